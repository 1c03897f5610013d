#!/usr/bin/env bash
# GPU check of the rollout engines, under 8 minutes on one GPU. Needs a CUDA GPU and `pip install 'reinforge[gpu]'`.
# For each installed engine (vllm, sglang, trtllm): generation with the tiny default model and, if one is on disk
# ($GPU_CHECK_MODEL, default /models/Qwen2.5-0.5B-Instruct), a small real model: tokens/s against the hf engine on
# the same GPU, log-prob agreement with the policy's forward, and a weight update that changes the output.
# Then three GRPO iterations of the tiny pipeline with engine.type=vllm.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
REAL=${GPU_CHECK_MODEL:-/models/Qwen2.5-0.5B-Instruct}
export PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false PREFECT_LOGGING_LEVEL=WARNING
$PY -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')" || exit 2
status=0
for engine in vllm sglang trtllm; do
  module=$engine; [ "$engine" = trtllm ] && module=tensorrt_llm
  if ! $PY -c "import $module" 2>/dev/null; then echo "{\"engine\": \"$engine\", \"skipped\": \"$module not installed\"}"; continue; fi
  models=(tiny); [ -f "$REAL/config.json" ] && models+=("$REAL")
  for model in "${models[@]}"; do
    timeout 300 $PY -m bench.gpu_check --engine "$engine" --model "$model" || { echo "{\"engine\": \"$engine\", \"model\": \"$model\", \"failed\": $?}"; status=1; }
  done
done
if $PY -c "import vllm" 2>/dev/null; then
  run=$(mktemp -d -p "$PWD" .gpu_check_run.XXXX)
  ov=(trainer.run_dir=$run data.raw_dir=$run/raw data.train_path=$run/clean/train.parquet data.eval_path=$run/clean/test.parquet
      data.quarantine_dir=$run/quarantine sft.output_dir=$run/sft actor.model.path=$run/sft trainer.output_dir=$run/grpo
      sft.steps=100 trainer.iterations=3 trainer.test_interval=3 trainer.save_interval=3 trainer.progress=false
      engine.type=vllm trainer.rollout_placement=separate engine.num_gpus=0.4 engine.gpu_memory_utilization=0.3
      engine.health_check=true "trainer.worker_resources={\"CPU\": 1, \"GPU\": 0.5}")
  export MLFLOW_TRACKING_URI=sqlite:///$run/mlflow.db
  ( $PY -m flows.data "${ov[@]}" >/dev/null && $PY -m flows.sft "${ov[@]}" >/dev/null &&
    timeout 300 $PY -m flows.train "${ov[@]}" | tail -n 9 ) || { echo '{"grpo_with_vllm": "failed"}'; status=1; }
  rm -rf "$run"
fi
exit $status
