"""``kvcodec codecs``: list the registered codecs."""

from __future__ import annotations

import argparse

from . import format_table, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("codecs", help="list codecs and their nominal bits per element")
    p.add_argument("--json", action="store_true", help="print JSON to stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..codec import get_codec, list_codecs, preset_description, preset_target

    rows = []
    for name in list_codecs():
        c = get_codec(name)
        rows.append({
            "name": name,
            "id": c.codec_id,
            "nominal_bits": round(c.nominal_bits, 3),
            "lossless": c.lossless,
            "config": c.get_config(),
            "description": preset_description(name),
            "target": preset_target(name),  # the quality the preset promises, or null
            "requires": list(c.requires),  # settings it refuses to encode without
        })
    if args.json:
        print_json(rows)
    else:
        print(format_table(rows, ["name", "nominal_bits", "lossless", "description"]))
    return 0
