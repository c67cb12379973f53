"""``kvcodec verify FILE [--json]``: check everything; exit 0 when the file is good, 1 otherwise.

Checks the header and manifest (structure, version, required features, manifest CRC-32, canonical
layout, size limits), the CRC-32 of every stored tensor, the zero padding, and decodes every layer
with the file's codec (values must be finite). On failure it prints one line naming the problem
to stderr (with --json, the JSON verdict to stdout).
"""

from __future__ import annotations

import argparse
import os
import sys

from . import print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="check a KVC file's checksums and decode it; exit 0 if good, 1 if not",
        description="Check every header field, checksum and padding byte of a KVC file and decode it. "
                    "Exit 0 when the file is good, 1 (with a one-line reason) when it is not.")
    p.add_argument("file", help="KVC file")
    p.add_argument("--no-decode", action="store_true", help="check structure and checksums only")
    p.add_argument("--json", action="store_true", help="print JSON to stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import KVCodecError
    from ..api import open as open_kvc

    path = os.fspath(args.file)
    try:
        with open_kvc(path) as r:
            summary = r.verify(decode=not args.no_decode)
    except KVCodecError as e:
        if args.json:
            print_json({"file": path, "ok": False, "error": type(e).__name__, "message": str(e)})
        else:
            print(f"FAIL {path}: {type(e).__name__}: {e}", file=sys.stderr)  # stdout stays for results
        return 1
    if args.json:
        print_json({"file": path, **summary})
    else:
        what = "decoded" if summary["decoded"] else "not decoded"
        print(f"OK {path}: {summary['layers']} layers, {summary['tensors']} tensors, {summary['bytes']} bytes, "
              f"all checksums match, {what}")
    return 0
