"""Evaluation tasks: score a model directory on held-out rows; write metrics/eval.json."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prefect import task

from components.config import Config
from components.config.stages import STAGES
from components.data.clean import RowRules, validate_file
from components.data.io import write_json
from components.evaluation import evaluate
from components.lineage import file_md5
from components.models.loading import load_image_encoder, load_tokenizer
from components.plan import make_plan
from components.rewards.registry import score_batch, scorers_for
from components.rollout.worker import RolloutWorker
from components.seeding import derive_seed
from components.tracking.mlflow_tracker import EVALUATION_TAG, Tracker, dataset_ref
from tasks.caching import StageCache, cached_stage
from tasks.common import STAGE

EVAL_CACHE = StageCache(
    config_keys=STAGES["evaluate"].reads, reads=lambda i: [i["model_path"], i["eval_path"]]
)


@task(name="evaluate-model", timeout_seconds=STAGE["timeout_seconds"], **cached_stage(EVAL_CACHE))
def evaluate_model(
    model_path: str,
    eval_path: str,
    cfg: Config,
    model_key: str = "--model_path",
    data_key: str = "--eval_data",
) -> dict[str, float]:
    """Greedy accuracy (`acc`) and sampled mean@k / pass@k of the model at `model_path`. The held-out rows
    are checked first, as the clean stage checks them, with this model's tokenizer."""
    trust = cfg.actor.model.trust_remote_code
    tokenizer = load_tokenizer(model_path, model_key, trust)
    images = load_image_encoder(model_path, tokenizer, model_key, trust)
    rows = validate_file(
        eval_path, data_key, tokenizer, RowRules.from_config(cfg, images.image_tokens if images else None)
    )
    rows = rows[: cfg.trainer.eval_size] if cfg.trainer.eval_size else rows
    plan = make_plan(cfg)
    worker = RolloutWorker.from_settings(replace(plan.rollout, model_path=model_path), key=model_key)
    scorers = scorers_for([r["data_source"] for r in rows], cfg)
    e = plan.evaluation
    m = evaluate(
        lambda chunk, params, seed: worker.generate(chunk, params, seed, iteration=-1),
        worker.decode,
        lambda *batch: score_batch(*batch, scorers, plan.rewards.concurrency),
        rows,
        e.k,
        e.max_new_tokens,
        derive_seed(e.seed, "eval"),
        e.temperature,
    )
    return eval_figures(m, cfg.trainer.eval_k, len(rows))


def eval_figures(m: dict[str, float], k: int, n: int) -> dict:
    """The figures of eval.json from evaluate()'s val/ metrics: acc, n, and acc_mean_at_k / pass_at_k of the
    whole set; with more than one source (data_sources, environments), each one's figures under its name."""
    per: dict[str, dict[str, float]] = {}
    for key, value in m.items():
        _, source, figure = key.split("/") if key.count("/") == 2 else (None, None, None)
        if figure in ("acc", f"acc_mean_at_{k}", f"pass_at_{k}"):
            per.setdefault(source, {})[figure] = value
    out: dict = {"acc": m["val/acc"], "n": n}
    if len(per) == 1:  # one source: its sampled figures are the set's
        out.update({f: v for f, v in next(iter(per.values())).items() if f != "acc"})
    else:
        out["by_source"] = dict(sorted(per.items()))
    return out


def gains(sft: dict, final: dict) -> dict[str, float]:
    """The final model's greedy accuracy minus the SFT model's: on the whole set (acc), and per source."""
    out = {"acc": final["acc"] - sft["acc"]}
    before, after = sft.get("by_source", {}), final.get("by_source", {})
    out.update({f"{s}/acc": after[s]["acc"] - before[s]["acc"] for s in sorted(before.keys() & after.keys())})
    return out


def flat(figures: dict) -> dict[str, float]:
    """eval.json's figures of one model as MLflow metric names: acc, by_source's <source>/acc, ..."""
    out = {k: v for k, v in figures.items() if isinstance(v, int | float)}
    for source, each in figures.get("by_source", {}).items():
        out.update({f"{source}/{k}": v for k, v in each.items()})
    return out


@task(name="write-eval", **STAGE)
def write_eval(results: dict, path: str, tracker_run: dict | None, eval_path: str) -> str:
    """metrics/eval.json for `dvc metrics show`, and the same figures on the training run in MLflow, those of
    the final model linked to its logged model and to the evaluation data (`eval_path`)."""
    write_json(results, path)
    if tracker_run and tracker_run.get("run_id"):
        tracker = Tracker(tracker_run["experiment"], "", run_id=tracker_run["run_id"])
        tracker.log_summary(
            {f"eval/{name}/{k}": v for name in ("sft", "final") for k, v in flat(results[name]).items()}
        )
        if tracker_run.get("model_id"):  # the held-out figures of that exact model, logged with it
            tracker.log_summary(
                {f"eval/{k}": v for k, v in flat(results["final"]).items()},
                model_id=tracker_run["model_id"],
                dataset=dataset_ref(eval_path, file_md5(eval_path)),
            )
            tracker.tag_model(tracker_run["model_id"], {EVALUATION_TAG: f"linked: eval/* on {eval_path}"})
        tracker.log_artifact(path)
        tracker.end("FINISHED")
    return str(Path(path))
