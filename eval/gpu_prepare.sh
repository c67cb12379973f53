#!/usr/bin/env bash
# Prepares .whl/ (git-ignored) for eval/gpu_check.sh on a GPU machine that has no network:
#   * the wheels of the two core dependencies the device image lacks (constriction, zstandard),
#     for its CPython 3.12 on x86_64 Linux;
#   * a real SmolLM2-135M KV cache (1024 tokens of the built-in text, fp16, ~24 MB), which
#     tests/test_cuda_kernels.py::test_real_cache_decode_on_cuda decodes with every GPU codec;
#   * a kvc calibration profile of the built-in model on the built-in calibration text (query
#     statistics, sensitivities and the closed-loop steps of the three levels, as `kvcodec
#     calibrate` writes by default; ~4 minutes here), with which that test also codes the
#     calibrated kvc presets.
# Run it here (package registries reachable, [eval] extra installed), then carry .whl to the
# device:  bash eval/gpu_prepare.sh && <device run> "bash eval/gpu_check.sh" with carry [".whl"]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PY=${PYTHON:-python3}
"$PY" -m pip download -q --only-binary=:all: --no-deps --python-version "${DEVICE_PYTHON:-3.12}" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  "constriction==$("$PY" -c 'import importlib.metadata as m; print(m.version("constriction"))')" \
  "zstandard==$("$PY" -c 'import importlib.metadata as m; print(m.version("zstandard"))')" -d .whl
[ -f .whl/real_cache_smollm2_1024.safetensors ] || \
  "$PY" -m kvcodec.cli capture --context 1024 --out .whl/real_cache_smollm2_1024.safetensors
[ -f .whl/calib_smollm2.qstats.safetensors ] || \
  "$PY" -m kvcodec.cli calibrate --out .whl/calib_smollm2.qstats.safetensors
ls -la .whl
du -sh .whl
