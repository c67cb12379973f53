"""formats/manifest.schema.json agrees with what the writer writes and what the reader requires.

jsonschema is not a dependency, so a small validator for the keywords the schema uses lives here.
"""

import copy
import json
import re
from pathlib import Path

import pytest
import torch

import kvcodec
from kvcodec.testing import spelled_out
from kvcodec import format as kvf
from kvcodec.errors import FormatError

from conftest import make_cache
from kvc_tools import manifest_of, rewrite
from test_format import rich_cache

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "formats" / "manifest.schema.json").read_text())
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def errors(x, s, root=SCHEMA, path="$"):
    """Every violation of schema ``s`` by ``x`` (subset of JSON Schema 2020-12 used by our schema)."""
    if "$ref" in s:
        s = root["$defs"][s["$ref"].rsplit("/", 1)[1]]
    out = []
    t = s.get("type")
    if t == "integer":
        if type(x) is not int:
            return [f"{path}: not an integer"]
    elif t is not None and not (isinstance(x, TYPES[t]) and not (t != "boolean" and isinstance(x, bool))):
        return [f"{path}: not {t}"]
    if "enum" in s and x not in s["enum"]:
        out.append(f"{path}: {x!r} not in enum")
    if "const" in s and x != s["const"]:
        out.append(f"{path}: {x!r} != const")
    if "minimum" in s and isinstance(x, int) and x < s["minimum"]:
        out.append(f"{path}: below minimum")
    if "maximum" in s and isinstance(x, int) and x > s["maximum"]:
        out.append(f"{path}: above maximum")
    if "minLength" in s and isinstance(x, str) and len(x) < s["minLength"]:
        out.append(f"{path}: too short")
    if "pattern" in s and isinstance(x, str) and not re.search(s["pattern"], x):
        out.append(f"{path}: pattern")
    if isinstance(x, dict):
        for k in s.get("required", []):
            if k not in x:
                out.append(f"{path}: missing {k}")
        props = s.get("properties", {})
        for k, v in x.items():
            if "propertyNames" in s:
                out += errors(k, s["propertyNames"], root, f"{path}.<name {k}>")
            if k in props:
                out += errors(v, props[k], root, f"{path}.{k}")
            elif s.get("additionalProperties") is False:
                out.append(f"{path}: unexpected {k}")
            elif isinstance(s.get("additionalProperties"), dict):
                out += errors(v, s["additionalProperties"], root, f"{path}.{k}")
    if isinstance(x, list):
        if len(x) < s.get("minItems", 0) or len(x) > s.get("maxItems", 1 << 62):
            out.append(f"{path}: wrong length")
        if "items" in s:
            for i, v in enumerate(x):
                out += errors(v, s["items"], root, f"{path}[{i}]")
    if "oneOf" in s:
        n = sum(not errors(x, sub, root, path) for sub in s["oneOf"])
        if n != 1:
            out.append(f"{path}: matches {n} of oneOf")
    return out


CACHES = {
    "rich": lambda: rich_cache(),
    "mla": lambda: make_cache(mla=True, tokens=5),
    "empty": lambda: make_cache(tokens=0),
}


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("which", sorted(CACHES))
def test_written_manifests_follow_the_schema(which, chunk):
    for name in kvcodec.list_codecs():
        m = manifest_of(spelled_out(name).encode(CACHES[which](), tokens_per_chunk=chunk))
        assert errors(m, SCHEMA) == [], (name, which)


def test_schema_rejects_what_the_reader_rejects():
    blob = kvcodec.get_codec("fp16").encode(rich_cache())
    m = manifest_of(blob)
    for key in SCHEMA["required"]:
        bad = copy.deepcopy(m)
        del bad[key]
        assert errors(bad, SCHEMA), key
        with pytest.raises(FormatError, match=key):
            kvcodec.open(rewrite(blob, manifest=lambda mm: mm.pop(key)))
    for mutate in (
        lambda mm: mm["layers"][0].update(kind="global"),
        lambda mm: mm["layers"][2].pop("latent_dim"),
        lambda mm: mm["storage"]["tensors"].update({"layers.x.k.p": {"dtype": "U8", "shape": [1], "crc32": "00000000"}}),
        lambda mm: mm["storage"]["tensors"]["meta.token_ids"].update(crc32="XYZ"),
        lambda mm: mm.update(num_tokens=True),
        lambda mm: mm["layers"][0]["tensors"].update(kv=mm["layers"][0]["tensors"]["k"]),
    ):
        bad = copy.deepcopy(m)
        mutate(bad)
        assert errors(bad, SCHEMA)
        with pytest.raises(FormatError):
            kvcodec.open(rewrite(blob, manifest=mutate))
    assert torch.equal(kvcodec.open(blob).read_layer(0)["k"], rich_cache().layers[0]["k"])
