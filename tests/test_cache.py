import pytest
import torch

from kvcodec import KVCache
from kvcodec.errors import InputError

from conftest import make_cache


def test_properties():
    c = make_cache(layers=2, tokens=5, heads=3, dim=8)
    assert (c.num_layers, c.num_tokens, c.num_elements) == (2, 5, 2 * 2 * 5 * 3 * 8)
    assert c.fp16_bytes() == 2 * c.num_elements
    assert [(i, r) for i, r, _ in c.tensors()] == [(0, "k"), (0, "v"), (1, "k"), (1, "v")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kw", [dict(), dict(mla=True, dim=40), dict(tokens=0), dict(tokens=1)])
def test_safetensors_roundtrip(tmp_path, dtype, kw):
    c = make_cache(dtype=dtype, **kw)
    c.positions = torch.arange(c.num_tokens) + 7
    c.to_safetensors(tmp_path / "c.safetensors")
    d = KVCache.from_safetensors(tmp_path / "c.safetensors")
    assert d.equal(c)
    assert torch.equal(d.token_ids, c.token_ids) and torch.equal(d.positions, c.positions)


def test_equal_is_bitwise():
    c = make_cache(dtype=torch.float32)
    d = KVCache(layers=[{r: t.clone() for r, t in layer.items()} for layer in c.layers])
    assert c.equal(d)
    d.layers[0]["k"][0, 0, 0] = torch.nextafter(d.layers[0]["k"][0, 0, 0], torch.tensor(float("inf")))
    assert not c.equal(d)
    z = KVCache.from_tensors([(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))])
    nz = KVCache.from_tensors([(-torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))])
    assert not z.equal(nz)  # -0 and +0 differ in bits


@pytest.mark.parametrize(
    "layers, msg",
    [
        ([{"k": torch.zeros(2, 1, 4)}], "expected \\['k', 'v'\\]"),
        ([{"k": torch.zeros(2, 4), "v": torch.zeros(2, 4)}], "expected \\[tokens, heads, dim\\]"),
        ([{"k": torch.zeros(2, 1, 4, dtype=torch.int32), "v": torch.zeros(2, 1, 4)}], "dtype"),
        ([{"k": torch.zeros(2, 1, 4), "v": torch.zeros(3, 1, 4)}], "tokens"),
        ([{"k": torch.zeros(2, 1, 4), "v": torch.zeros(2, 2, 4)}], "heads"),
        ([{"k": torch.zeros(2, 1, 4), "v": torch.zeros(2, 1, 4).half()}], "dtype"),
    ],
)
def test_invalid_caches_rejected(layers, msg):
    with pytest.raises(InputError, match=msg):
        KVCache(layers=layers)


def test_token_ids_must_match():
    with pytest.raises(InputError, match="token_ids"):
        KVCache.from_tensors([(torch.zeros(3, 1, 2), torch.zeros(3, 1, 2))], token_ids=torch.arange(4))


def test_missing_layer_rejected(tmp_path):
    from safetensors.torch import save_file

    save_file({"layers.0.k": torch.zeros(1, 1, 2), "layers.0.v": torch.zeros(1, 1, 2),
               "layers.2.k": torch.zeros(1, 1, 2), "layers.2.v": torch.zeros(1, 1, 2)}, tmp_path / "x")
    with pytest.raises(InputError, match="layers \\[1\\] are missing"):
        KVCache.from_safetensors(tmp_path / "x")


def test_raw_dump_keeps_identity_rope_and_layer_kinds(tmp_path):
    from kvcodec import LayerInfo, ModelIdentity

    c = make_cache(layers=2)
    c.model = ModelIdentity(model_id="m", revision="r1", config_hash="abc", tokenizer="tok")
    c.layer_info = [LayerInfo("sliding", 8), LayerInfo("full", 0)]
    c.rope, c.rope_applied = {"theta": 10000.0}, False
    c.to_safetensors(tmp_path / "c.safetensors")
    d = KVCache.from_safetensors(tmp_path / "c.safetensors")
    assert d.model == c.model and d.layer_info == c.layer_info
    assert d.rope == c.rope and d.rope_applied is False


def test_raw_dump_with_bad_metadata_is_rejected(tmp_path):
    from safetensors.torch import save_file

    save_file({"layers.0.k": torch.zeros(1, 1, 2), "layers.0.v": torch.zeros(1, 1, 2)},
              tmp_path / "x", metadata={"kvcodec.cache": "{not json"})
    with pytest.raises(InputError, match="bad kvcodec.cache metadata"):
        KVCache.from_safetensors(tmp_path / "x")
