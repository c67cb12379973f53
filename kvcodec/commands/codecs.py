"""``kvcodec codecs``: list the registered codecs."""

from __future__ import annotations

import argparse

from . import format_table, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "codecs", help="list codecs and their nominal bits per element",
        description="List the codec presets: the names `kvcodec encode --codec` and `kvcodec bench "
        "--codecs` take. 'nominal b' is the bits per element of the coded values before side "
        "information (scales, tables, headers); `kvcodec bench` measures the real size. --json adds "
        "each preset's full config, the quality it promises (target) and the settings it requires.")
    p.add_argument("--json", action="store_true",
                   help="print JSON to stdout (config, target and requires of every preset)")
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
        # wrapped to 100 columns; the column header says what the number is (not the file's size)
        print(format_table(rows, ["name", "nominal_bits", "lossless", "description"],
                           headers={"nominal_bits": "nominal b"}, width=100))
        print("\nnominal b: bits per element of the coded values, before scales, tables and headers "
              "(kvcodec bench\nmeasures files). Use a name with kvcodec encode --codec; --json shows "
              "each preset's full config.")
    return 0
