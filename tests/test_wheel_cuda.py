"""An installed wheel finds the CUDA kernel sources (and carries the native CPU coder's C source).

The kernels live in the top-level cuda/ folder; pyproject force-includes it as kvcodec/_cuda and
kvcodec.gpu looks there first. This test builds the wheel, checks every kernel source is inside
and identical to the checkout's, installs it into a scratch folder (by unpacking: a wheel is a
zip) and asks a fresh interpreter, started outside the checkout, where kvcodec.gpu finds them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _build_wheel(out: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)]
    if importlib.util.find_spec("hatchling") is not None:
        cmd.insert(4, "--no-build-isolation")  # offline: use the installed build backend
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        if importlib.util.find_spec("hatchling") is None:
            pytest.skip(f"no build backend here (hatchling missing, isolated build failed): {res.stderr[-300:]}")
        raise AssertionError(f"wheel build failed:\n{res.stdout}\n{res.stderr}")
    wheels = sorted(out.glob("kvcodec-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_carries_and_finds_kernel_sources(tmp_path):
    wheel = _build_wheel(tmp_path / "dist")
    sources = sorted(p for p in (ROOT / "cuda").iterdir() if p.suffix in (".cu", ".cuh", ".cpp", ".md"))
    assert any(p.suffix == ".cu" for p in sources)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for p in sources:
            name = f"kvcodec/_cuda/{p.name}"
            assert name in names, f"{name} missing from {wheel.name}"
            assert z.read(name) == p.read_bytes(), f"{name} differs from cuda/{p.name}"
        # the native CPU coder's C sources, compiled on first use (kvcodec/native/csrc)
        csrc = sorted((ROOT / "kvcodec" / "native" / "csrc").iterdir())
        assert any(p.suffix == ".c" for p in csrc) and any(p.suffix == ".h" for p in csrc)
        for p in csrc:
            assert z.read(f"kvcodec/native/csrc/{p.name}") == p.read_bytes(), f"csrc/{p.name} differs"
        # the built-in texts and their provenance (kvcodec.harness.texts reads them as package data)
        data_dir = ROOT / "kvcodec" / "data"
        data = sorted(data_dir.glob("*.txt")) + [data_dir / "PROVENANCE.md"]
        assert len(data) >= 9
        for p in data:
            assert z.read(f"kvcodec/data/{p.name}") == p.read_bytes(), f"data/{p.name} differs"
        site = tmp_path / "site"
        z.extractall(site)
    # a fresh interpreter, outside the checkout, with only the unpacked wheel on its path
    code = ("import kvcodec.gpu as g; d = g.cuda_source_dir(); "
            "import json; print(d); print(json.dumps(sorted(p.name for p in d.glob('*.cu'))))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    found, programs = res.stdout.splitlines()[:2]
    assert Path(found) == site / "kvcodec" / "_cuda"
    from kvcodec import gpu

    assert json.loads(programs) == sorted(gpu.PROGRAMS)
