#!/usr/bin/env bash
# The screenshots in docs/img/, from real runs, taken with headless Chromium (Debian's `chromium`) from the links
# a user opens. Needs the default pipeline's results (`make run`). About 6 minutes.
#   scripts/screenshots.sh            # writes docs/img/*.png
# MLflow: the checkout's own store, with the README's DVC experiment beside the workspace's run, opened from the
# link `reinforge ui` prints. Prefect and the registry: two nightlies on a Prefect server of their own, with an
# MLflow store of their own (.demo/).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v chromium >/dev/null || { echo "install chromium: apt-get install -y chromium" >&2; exit 2; }
export PATH=$PWD/.venv/bin:$PATH PYTHONWARNINGS=ignore
demo=$PWD/.demo
rm -rf "$demo" && mkdir -p "$demo" docs/img
servers=()
trap 'kill ${servers[*]} 2>/dev/null || true' EXIT

# the README's experiment: DVC trains it in a temporary copy, its MLflow run lands in this checkout's store
dvc exp run --temp -S 'configs/arith_grpo.yaml:algorithm.kl_loss_coef=0.04' dvc.yaml >"$demo/exp.log" 2>&1
reinforge ui --port 5010 >"$demo/ui.log" 2>&1 &
servers+=($!)
until grep -q '^MLflow UI: ' "$demo/ui.log"; do sleep 1; done
link=$(sed -n 's/^MLflow UI: //p' "$demo/ui.log")

read -r exp workspace experiment model <<<"$(python - <<'EOF'
from mlflow import MlflowClient
from components.tracking.mlflow_tracker import default_tracking_uri
c = MlflowClient(default_tracking_uri())
exp = c.get_experiment_by_name("reinforge")
runs = c.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
dvc_run = next(r for r in runs if "dvc.exp_name" in r.data.tags)
same = lambda r: r.data.params.get("actor.model.type") == dvc_run.data.params.get("actor.model.type")
workspace = next(r for r in runs if "dvc.exp_name" not in r.data.tags and same(r))  # its baseline, not the VLM
print(exp.experiment_id, workspace.info.run_id, dvc_run.info.run_id, dvc_run.outputs.model_outputs[0].model_id)
EOF
)"

shot() {  # shot NAME URL
  chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync --window-size=1600,1000 \
    --virtual-time-budget=20000 --screenshot="docs/img/$1.png" "$2" >/dev/null 2>&1
  echo "docs/img/$1.png <- $2"
}
m=http://127.0.0.1:5010
ml="workflowType=machine_learning"  # what `reinforge ui`'s link carries: the UI's "Model training" toggle
shot mlflow_experiment "$link"
shot mlflow_compare "$m/#/compare-runs?runs=[%22$workspace%22,%22$experiment%22]&experiments=[%22$exp%22]&$ml"
shot mlflow_run "$m/#/experiments/$exp/runs/$experiment?$ml"
shot mlflow_model "$m/#/experiments/$exp/models/$model?$ml"

# Prefect and the registry: two nightlies (the second with a KL loss) on a Prefect server of their own
export MLFLOW_TRACKING_URI=sqlite:///$demo/mlflow.db PREFECT_HOME=$demo/prefect
export PREFECT_API_URL=http://127.0.0.1:4310/api
prefect server start --port 4310 >"$demo/prefect.log" 2>&1 &
servers+=($!)
mlflow server --backend-store-uri "$MLFLOW_TRACKING_URI" --port 5011 --workers 1 >"$demo/mlflow.log" 2>&1 &
servers+=($!)
until curl -sf "$PREFECT_API_URL/health" >/dev/null; do sleep 1; done
until curl -sf http://127.0.0.1:5011/health >/dev/null; do sleep 1; done
run=(trainer.output_dir=.demo/grpo trainer.iterations=10 trainer.test_interval=5 trainer.save_interval=10
  trainer.experiment_name=reinforge-demo trainer.system_metrics_interval_s=2)
reinforge nightly --model-name reinforge-demo "${run[@]}"
reinforge nightly --model-name reinforge-demo "${run[@]}" algorithm.kl_loss_coef=0.04 algorithm.use_kl_loss=true
flow_run=$(python - <<'EOF'
from prefect import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.client.schemas.sorting import FlowRunSort
with get_client(sync_client=True) as c:
    runs = c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rl-train"])), sort=FlowRunSort.START_TIME_DESC, limit=1)
    print(runs[0].id)
EOF
)
shot mlflow_registry "http://127.0.0.1:5011/#/models/reinforge-demo?$ml"
p=http://127.0.0.1:4310
shot prefect_flow_run "$p/runs/flow-run/$flow_run?tab=Logs"
shot prefect_evaluation "$p/artifacts/key/evaluation"
shot prefect_promotion "$p/artifacts/key/promotion"
