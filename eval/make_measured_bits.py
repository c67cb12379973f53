#!/usr/bin/env python
"""Measure every preset's all-in bits per element on the reference cache and write
``kvcodec/data/measured_bits.json``, which ``kvcodec codecs`` shows beside the nominal bits.

The reference cache: SmolLM2-135M-Instruct on the built-in text, 1536 tokens, fp16
(:func:`kvcodec.harness.capture.default_cache`). Presets that require a setting (the kvc ``-cal``
presets need a calibration file) are not measured. tests/test_codecs_measured.py checks the file
against fresh encodes (bit for bit where the fresh reference cache has the digest recorded here,
``cache_sha256``: another CPU's kernels may round the model's forward pass differently), so a
change to a codec's bytes must rerun this:

    python eval/make_measured_bits.py
"""

from __future__ import annotations

import json
from pathlib import Path

CONTEXT = 1536
OUT = Path(__file__).resolve().parents[1] / "kvcodec" / "data" / "measured_bits.json"


def main() -> int:
    from kvcodec.format.atomic import atomic_write_bytes
    from kvcodec.harness.results import provenance
    from kvcodec.harness.capture import default_cache
    from kvcodec.harness.studies import cache_sha256, preset_bits

    prov = provenance()
    doc = {"what": f"all-in bits per element of each preset on SmolLM2-135M-Instruct's KV cache of the built-in "
                   f"text, {CONTEXT} tokens, fp16 (kvcodec.harness.capture.default_cache); kvc's level presets "
                   "without a profile (their fixed steps)",
           "command": prov["command"], "commit": prov["commit"], "date": prov["date"], "machine": prov["machine"],
           "context": CONTEXT, "cache_sha256": cache_sha256(default_cache(CONTEXT)),
           "bits": preset_bits(context=CONTEXT)}
    atomic_write_bytes(OUT, (json.dumps(doc, indent=1) + "\n").encode())
    print(f"wrote {OUT}: {len(doc['bits'])} presets")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
