"""``kvcodec info FILE [--json]``: the manifest, sizes, bits per element and a per-layer table.

Only the header is read and validated (format, version, manifest checksum, layout); tensor data
is not read. Use ``kvcodec verify`` to check every checksum and decode.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from . import format_table, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info", help="show a KVC file's manifest, sizes and per-layer bits/element",
        description="Show a KVC file's model identity, codec (its preset name and full config), "
        "cache geometry, where the bytes go and each layer's bits per element. Only the header "
        "is read and validated; `kvcodec verify` checks every checksum and decodes.")
    p.add_argument("file", help="KVC file")
    p.add_argument("--json", action="store_true", help="print JSON to stdout")
    p.set_defaults(func=run)


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The summary ``kvcodec info`` prints, as a JSON-able dict.

    Example:
        >>> import os, tempfile, torch, kvcodec
        >>> c = kvcodec.KVCache.from_tensors([(torch.ones(4, 2, 8), torch.ones(4, 2, 8))])
        >>> p = os.path.join(tempfile.mkdtemp(), "c.kvc")
        >>> _ = kvcodec.get_codec("fp16").encode(c, path=p)
        >>> d = describe(p)
        >>> d["codec"], d["preset"], d["layers"][0]["bits_per_element"], d["layers"][0]["k"]
        ({'id': 'fp16'}, 'fp16', 16.0, [4, 2, 8])
    """
    from ..api import open as open_kvc
    from ..codec import preset_for_config

    with open_kvc(path, require_codec=False) as r:  # inspect files of codecs not installed here
        m = r.manifest
        n = r.num_elements
        layers = []
        for i, lm in enumerate(m["layers"]):
            numel = sum(t["shape"][0] * t["shape"][1] * t["shape"][2] for t in lm["tensors"].values())
            nb = r.layer_nbytes(i)
            row: dict[str, Any] = {"layer": i, "kind": lm["kind"], "window": lm["window"], "kv_heads": lm["kv_heads"]}
            for role, t in lm["tensors"].items():
                row[role] = t["shape"]
            row.update(bytes=nb, bits_per_element=round(8 * nb / numel, 4) if numel else 0.0)
            layers.append(row)
        other = sum(r.read_plane_nbytes(x) for x in r.tensor_names() if not x.startswith("layers."))
        # where the bytes go, by plane kind (codes, scales, tables ...): side information made visible
        by_plane: dict[str, int] = {}
        for x in r.tensor_names():
            key = x.rsplit(".", 1)[1] if x.startswith("layers.") else x
            by_plane[key] = by_plane.get(key, 0) + r.read_plane_nbytes(x)
        padding = r.file_size - 8 - r.header_len - sum(by_plane.values())
        # the preset the writer recorded (producer.preset, formats/SPEC.md §4.2); for files without
        # one (older writers, a config given by codec id), the preset whose config is the file's
        recorded = m["producer"].get("preset")
        recorded = recorded if isinstance(recorded, str) and recorded else None
        return {
            "file": os.fspath(path),
            "format": f"{r.metadata['format']} {r.version[0]}.{r.version[1]}",
            "producer": m["producer"],
            "model": m["model"],
            "preset": recorded or preset_for_config(m["codec"]),
            "preset_recorded": recorded is not None,
            "codec": m["codec"],
            "source_dtype": m["source_dtype"],
            "rope": m["rope"],
            "num_layers": r.num_layers,
            "num_tokens": r.num_tokens,
            "tokens_per_chunk": r.tokens_per_chunk,
            "has_token_ids": m["has_token_ids"],
            "num_elements": n,
            "file_bytes": r.file_size,
            "header_bytes": 8 + r.header_len,
            "global_and_meta_bytes": other,
            "padding_bytes": padding,
            "bytes_by_plane": dict(sorted(by_plane.items(), key=lambda kv: -kv[1])),
            "bits_per_element": round(8 * r.file_size / n, 4) if n else 0.0,
            "ratio_vs_fp16": round(2 * n / r.file_size, 4),
            "required_features": m["required_features"],
            "layers": layers,
        }


def compact_json_lines(obj: dict[str, Any], start: int = 0, prefix: str = "", width: int = 100,
                       indent: int = 13) -> str:
    """``prefix`` then ``obj`` as compact JSON, broken between members so that lines stay within
    ``width`` where they can (the first line begins at column ``start``, the others are indented);
    the text still parses as JSON.

    Example:
        >>> print(compact_json_lines({"id": "kivi", "bits": 4, "group": 32}, width=24, indent=2))
        {"id":"kivi","bits":4,
          "group":32}
    """
    if not obj:
        return prefix + "{}"
    members = [json.dumps(k) + ":" + json.dumps(v, separators=(",", ":")) for k, v in obj.items()]
    lines: list[str] = []
    line, filled = prefix + "{", False
    for i, m in enumerate(members):
        piece = m + ("," if i < len(members) - 1 else "}")
        if filled and (0 if lines else start) + len(line) + len(piece) > width:
            lines.append(line)
            line = " " * indent
        line += piece
        filled = True
    return "\n".join(lines + [line])


def run(args: argparse.Namespace) -> int:
    d = describe(args.file)
    if args.json:
        print_json(d)
        return 0
    model = d["model"]["model_id"] or "(unknown model: its writer recorded none; kvcodec.save(..., model=model) does)"
    print(f"{d['file']}: KVC {d['format'].split()[-1]}, written by {d['producer'].get('name')} {d['producer'].get('version')}")
    print(f"  model      {model} rev={d['model']['revision'] or '-'} tokenizer={d['model']['tokenizer'] or '-'}")
    preset = d["preset"] or "-"
    if d["preset"] and not d["preset_recorded"]:
        preset += " (not recorded in the file: its codec config is this preset's)"
    print(f"  preset     {preset}")
    print("  codec      " + compact_json_lines({"id": d["codec"].get("id"), **d["codec"]}, 13))  # the id first
    print(f"  cache      {d['num_layers']} layers x {d['num_tokens']} tokens, {d['source_dtype']}, "
          f"RoPE {'applied' if d['rope']['applied'] else 'not applied'}"
          + (f", {d['tokens_per_chunk']} tokens/chunk" if d["tokens_per_chunk"] else ""))
    print(f"  size       {d['file_bytes']} bytes (header {d['header_bytes']}), {d['bits_per_element']} bits/element, "
          f"fp16 size / file size = {d['ratio_vs_fp16']}")
    total = d["file_bytes"]
    parts = [("header", d["header_bytes"]), ("padding", d["padding_bytes"]), *d["bytes_by_plane"].items()]
    print("  bytes      " + ", ".join(f"{k} {v} ({100 * v / total:.1f}%)" for k, v in parts if v))
    rows = []
    for L in d["layers"]:
        shapes = " ".join(f"{r}={'x'.join(map(str, L[r]))}" for r in ("k", "v", "kv") if r in L)
        rows.append({"layer": L["layer"], "kind": L["kind"] + (f"({L['window']})" if L["window"] else ""),
                     "tensors": shapes, "bytes": L["bytes"], "bits/elem": L["bits_per_element"]})
    print(format_table(rows, ["layer", "kind", "tensors", "bytes", "bits/elem"]))
    return 0
