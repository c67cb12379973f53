"""Golden vectors (formats/vectors/v1): every registered preset has a stored KVC file whose decoded
tensors hash to the recorded SHA-256. A missing vector fails; it is written only when missing and
only under KVCODEC_WRITE_VECTORS=1 (see formats/vectors/make_vectors.py)."""

import os
from pathlib import Path

import pytest

from kvcodec.errors import FormatError
from kvcodec import vectors

V1 = Path(__file__).resolve().parents[1] / "formats" / "vectors" / "v1"


@pytest.mark.parametrize("name", vectors.vector_names())
def test_golden_vector_decodes_to_recorded_hash(name):
    if os.environ.get(vectors.ENV) == "1":
        vectors.write_missing(V1, [name])
    vectors.check(V1, name)


def test_vectors_are_small_and_the_input_is_stored():
    assert (V1 / vectors.INPUT_NAME).stat().st_size < 64 * 1024
    for p in V1.glob("*.kvc"):
        assert p.stat().st_size < 64 * 1024, p.name
    stored = vectors.load_input(V1)
    assert stored.equal(vectors.vector_input())  # the generator still makes the stored input


def test_writing_needs_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(vectors.ENV, raising=False)
    with pytest.raises(FormatError, match="KVCODEC_WRITE_VECTORS=1"):
        vectors.write_missing(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_missing_vector_fails_and_existing_one_is_never_overwritten(tmp_path, monkeypatch):
    with pytest.raises(AssertionError, match="no golden vector for 'raw'"):
        vectors.check(tmp_path, "raw")
    monkeypatch.setenv(vectors.ENV, "1")
    assert vectors.write_missing(tmp_path, ["raw"]) == ["raw"]
    before = (tmp_path / "raw.kvc").read_bytes()
    (tmp_path / "raw.kvc").write_bytes(before[:-1] + bytes([before[-1] ^ 1]))
    assert vectors.write_missing(tmp_path, ["raw"]) == []  # not rewritten
    with pytest.raises(AssertionError, match="changed on disk"):
        vectors.check(tmp_path, "raw")
