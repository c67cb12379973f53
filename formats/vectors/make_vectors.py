"""Write the missing golden vectors of formats/vectors/v1/ (never overwrites an existing one).

Usage (from the repository root):

    KVCODEC_WRITE_VECTORS=1 python formats/vectors/make_vectors.py          # write missing vectors
    python formats/vectors/make_vectors.py --check                          # decode and compare all

Equivalent: ``KVCODEC_WRITE_VECTORS=1 python -m pytest tests/test_vectors.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcodec import vectors

HERE = Path(__file__).resolve().parent / "v1"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only decode every vector and compare hashes")
    args = p.parse_args(argv)
    if not args.check:
        written = vectors.write_missing(HERE)
        print(f"wrote {len(written)} vector(s): {', '.join(written) or '-'}")
    failed = 0
    for name in vectors.vector_names():
        try:
            rec = vectors.check(HERE, name)
            print(f"ok    {name:28s} {rec['kvc_bytes']:7d} bytes  {rec['bits_per_element']:8.4f} bits/element")
        except AssertionError as e:
            failed += 1
            print(f"FAIL  {name:28s} {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
