"""``kvcodec codecs``: list the registered codecs."""

from __future__ import annotations

import argparse

from . import format_table, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "codecs", help="list codecs and their nominal bits per element",
        description="List the codec presets: the names `kvcodec encode --codec` and `kvcodec bench "
        "--codecs` take. 'nominal b' is the bits per element of the coded values before side "
        "information (scales, tables, headers) and before entropy coding; 'SmolLM2 b' is what a file "
        "measures, all-in, on SmolLM2-135M's 1536-token cache (kvcodec/data/measured_bits.json; "
        "shorter caches cost more per element). `kvcodec bench` measures your cache. --json adds "
        "each preset's full config, the quality it promises (target) and the settings it requires.")
    p.add_argument("--json", action="store_true",
                   help="print JSON to stdout (config, target and requires of every preset)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..codec import get_codec, list_codecs, preset_description, preset_target

    measured = measured_bits()
    rows = []
    for name in list_codecs():
        c = get_codec(name)
        rows.append({
            "name": name,
            "id": c.codec_id,
            "nominal_bits": round(c.nominal_bits, 3),
            "measured_bits": measured.get(name),  # all-in, SmolLM2-135M, 1536 tokens (None: not measured)
            "lossless": c.lossless,
            "config": c.get_config(),
            "description": preset_description(name),
            "target": preset_target(name),  # the quality the preset promises, or null
            "requires": list(c.requires),  # settings it refuses to encode without
        })
    if args.json:
        print_json(rows)
    else:
        # wrapped to 100 columns; the column header says what the number is (not the file's size)
        for r in rows:
            r["shown"] = "-" if r["measured_bits"] is None else f"{r['measured_bits']:.2f}"
        print(format_table(rows, ["name", "nominal_bits", "shown", "lossless", "description"],
                           headers={"nominal_bits": "nominal b", "shown": "SmolLM2 b"}, width=100))
        print("\nnominal b: bits per element of the coded values, before scales, tables, headers and "
              "entropy coding.\nSmolLM2 b: a file's real bits per element, all-in, on SmolLM2-135M's "
              "1536-token cache\n(kvc levels without a profile; '-': needs a calibration file). Short "
              "caches cost more per\nelement (headers, tables). kvcodec bench measures your cache; "
              "--json shows each preset's config.")
    return 0


def measured_bits() -> dict[str, float]:
    """``{preset: all-in bits per element}`` measured on SmolLM2-135M's 1536-token cache
    (``kvcodec/data/measured_bits.json``, written by eval/make_measured_bits.py)."""
    import json
    from importlib import resources

    return json.loads(resources.files("kvcodec.data").joinpath("measured_bits.json").read_text())["bits"]
