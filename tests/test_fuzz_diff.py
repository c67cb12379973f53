"""A few seconds of the differential decoder fuzz (eval/fuzz_diff.py; the published 20-minute run is
eval/results/fuzz_diff.md): mutated, re-signed files get one verdict and the same bits from the
native, fallback, verify and GPU host-build paths, and never change value silently."""

from __future__ import annotations

from pathlib import Path

from kvcodec.testing import load_file_module

ROOT = Path(__file__).resolve().parents[1]


def _fuzz_diff():
    return load_file_module("fuzz_diff", ROOT / "eval" / "fuzz_diff.py")


def test_differential_fuzz_finds_nothing_in_a_few_seconds():
    out = _fuzz_diff().run(seconds=4, seed=19, log=lambda *a: None)
    assert out["cases"] >= 50
    assert not out["failures"], out["failures"][:5]


def test_fuzz_cases_replay_and_value_params_are_told_apart():
    fd = _fuzz_diff()
    files = fd.fuzz_format.base_files()
    names = sorted(files)
    base = {n: fd.paths.decode_paths(files[n], gpu_host=False)["fallback"][1] for n in names[:3]}
    a = fd.one_case(files, names[:3], base, 12345, gpu_host=False)
    assert a == fd.one_case(files, names[:3], base, 12345, gpu_host=False)
    assert fd._leaf_diffs({"a": [1, {"rc": 2}]}, {"a": [1, {"rc": 3}]}) == [("a", 1, "rc")]
