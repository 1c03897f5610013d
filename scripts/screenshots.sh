#!/usr/bin/env bash
# The screenshots in docs/img/, from a real run: two nightlies (the second with a KL loss) on a Prefect server
# with its UI and their own MLflow store, then the MLflow and Prefect UIs photographed by headless Chromium
# (Debian's `chromium`). Needs the default pipeline's data and SFT model (`make run`). About 4 minutes.
#   scripts/screenshots.sh            # writes docs/img/*.png
set -euo pipefail
cd "$(dirname "$0")/.."
command -v chromium >/dev/null || { echo "install chromium: apt-get install -y chromium" >&2; exit 2; }
demo=$PWD/.demo
rm -rf "$demo" && mkdir -p "$demo" docs/img
export PATH=$PWD/.venv/bin:$PATH PYTHONWARNINGS=ignore
export MLFLOW_TRACKING_URI=sqlite:///$demo/mlruns.db PREFECT_HOME=$demo/prefect
export PREFECT_API_URL=http://127.0.0.1:4310/api
prefect server start --port 4310 >"$demo/prefect.log" 2>&1 &
servers=($!)
mlflow server --backend-store-uri "$MLFLOW_TRACKING_URI" --port 5010 --workers 1 >"$demo/mlflow.log" 2>&1 &
servers+=($!)
trap 'kill ${servers[*]} 2>/dev/null || true' EXIT
until curl -sf "$PREFECT_API_URL/health" >/dev/null; do sleep 1; done
until curl -sf http://127.0.0.1:5010/health >/dev/null; do sleep 1; done

run=(trainer.output_dir=.demo/grpo trainer.iterations=10 trainer.test_interval=5 trainer.save_interval=10
  trainer.experiment_name=reinforge-demo trainer.log_system_metrics=true trainer.system_metrics_interval_s=2)
reinforge nightly --model-name reinforge-demo "${run[@]}"
reinforge nightly --model-name reinforge-demo "${run[@]}" algorithm.kl_loss_coef=0.04 algorithm.use_kl_loss=true

# the ids the pages need, from each tool's API
read -r exp run_a run_b model <<<"$(python - <<'EOF'
from mlflow import MlflowClient
c = MlflowClient()
exp = c.get_experiment_by_name("reinforge-demo")
runs = c.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
models = c.search_logged_models([exp.experiment_id], filter_string=f"source_run_id = '{runs[-1].info.run_id}'")
print(exp.experiment_id, runs[0].info.run_id, runs[-1].info.run_id, models[0].model_id)
EOF
)"
flow_run=$(python - <<'EOF'
import asyncio
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.client.schemas.sorting import FlowRunSort
async def main():
    async with get_client() as c:
        runs = await c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rl-train"])), sort=FlowRunSort.START_TIME_DESC, limit=1)
        print(runs[0].id)
asyncio.run(main())
EOF
)

shot() {  # shot NAME URL
  chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1600,1000 \
    --virtual-time-budget=20000 --screenshot="docs/img/$1.png" "$2" >/dev/null 2>&1
  echo "docs/img/$1.png <- $2"
}
m=http://127.0.0.1:5010
ml="workflowType=machine_learning"  # the UI's model-training view (its default is the GenAI one)
shot mlflow_run "$m/#/experiments/$exp/runs/$run_b?$ml"
shot mlflow_model "$m/#/experiments/$exp/models/$model?$ml"
shot mlflow_completions "$m/#/experiments/$exp/runs/$run_b/artifacts/samples/iter_000010/answers.json?$ml"
shot mlflow_compare "$m/#/compare-runs?runs=[%22$run_a%22,%22$run_b%22]&experiments=[%22$exp%22]&$ml"
shot mlflow_registry "$m/#/models/reinforge-demo?$ml"
p=http://127.0.0.1:4310
shot prefect_flow_run "$p/runs/flow-run/$flow_run"
shot prefect_evaluation "$p/artifacts/key/evaluation"
shot prefect_promotion "$p/artifacts/key/promotion"
