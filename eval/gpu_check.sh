#!/usr/bin/env bash
# The one prepared GPU check: GPU kernel tests, then the decode benchmark. Installs nothing from
# the network: constriction and zstandard come from wheels carried in .whl/ (git-ignored); the
# machine's own python3 brings torch, numpy, safetensors, pytest, cuda-bindings and NVRTC.
#   bash eval/gpu_check.sh            (writes under $OUT if set, else eval/results/gpu_run/)
# Budget: under 5 minutes on an H200 (tests ~2 min, benchmark capped by --budget-s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/eval/results/gpu_run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: installing the carried wheels failed" >&2; exit 3; }
fi
export PYTHONPATH=/tmp/site:$PWD
export KVCODEC_CUBIN_CACHE=/tmp/kvcodec-cubin
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  python3 -c "import sys, torch, numpy, cuda.bindings, kvcodec.gpu as g; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__, 'cuda-bindings', cuda.bindings.__version__, 'nvrtc', g.nvrtc_version(), 'gpu', torch.cuda.get_device_name(0))" 2>&1
} | tee "$OUT/device.txt"

t0=$(date +%s)
# -W default: show warnings instead of failing on the machine's newer library versions (the CPU
# CI keeps filterwarnings=error); -p no:cacheprovider: leave the tree alone.
timeout 170 python3 -m pytest -q -p no:cacheprovider -W default -rfE --tb=short tests/test_cuda_kernels.py 2>&1 \
  | tee "$OUT/tests.log" | tail -40
tests_rc=${PIPESTATUS[0]}
echo "gpu_check: GPU tests exit code $tests_rc after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/device.txt"

left=$(( 270 - ($(date +%s) - t0) ))
[ "$left" -lt 60 ] && left=60
timeout $(( left + 40 )) python3 eval/bench_gpu.py --out "$OUT" --budget-s "$left" > "$OUT/bench.log" 2>&1
bench_rc=$?
[ "$bench_rc" -ne 0 ] && tail -25 "$OUT/bench.log"
echo "gpu_check: tests rc=$tests_rc bench rc=$bench_rc total $(( $(date +%s) - t0 )) s"
# the short table last
[ -f "$OUT/gpu_bench.md" ] && cat "$OUT/gpu_bench.md"
exit $(( tests_rc != 0 || bench_rc != 0 ))
