"""Evaluation tasks: score a model directory on held-out rows; write metrics/eval.json."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from components.config import Config
from components.data.clean import RowRules, validate_file
from components.data.io import write_json
from components.data.prompts import PromptSettings
from components.models.loading import load_tokenizer
from components.rollout.completions import EngineOptions
from components.rollout.multi_turn import MultiTurnSettings
from components.rollout.worker import RolloutWorker
from components.tracking.mlflow_tracker import Tracker
from components.training.seeding import derive_seed
from tasks.caching import StageCache, cached_stage
from tasks.common import STAGE

METRICS = ("math_acc",)  # --metric names: math_acc = rule-scored accuracy (greedy) plus mean@k / pass@k


EVAL_CACHE = StageCache(config_keys=("engine", "actor.model", "reward_model", "custom_reward_function", "sandbox",
                                     "multi_turn", "trainer.seed", "trainer.eval_k", "trainer.eval_size",
                                     "data.apply_chat_template", "data.allow_unk", "data.max_prompt_len"),
                        reads=lambda i: [i["model_path"], i["eval_path"]])


@task(name="evaluate-model", timeout_seconds=STAGE["timeout_seconds"], **cached_stage(EVAL_CACHE))
def evaluate_model(model_path: str, eval_path: str, cfg: Config, model_key: str = "--model_path",
                   data_key: str = "--eval_data") -> dict[str, float]:
    """Greedy accuracy (`acc`) and sampled mean@k / pass@k of the model at `model_path`. The held-out rows
    are checked first, as the clean stage checks them, with this model's tokenizer."""
    rows = validate_file(eval_path, data_key, load_tokenizer(model_path, model_key), RowRules.from_config(cfg))
    rows = rows[:cfg.trainer.eval_size] if cfg.trainer.eval_size else rows
    worker = RolloutWorker(model_path, cfg.engine.type, EngineOptions.from_config(cfg), cfg.trainer.num_threads,
                           key=model_key, multi_turn=MultiTurnSettings.from_config(cfg),
                           prompts=PromptSettings.from_config(cfg))
    m = worker.evaluate(rows, cfg, cfg.trainer.eval_k, cfg.engine.max_new_tokens,
                        derive_seed(cfg.trainer.seed, "eval"), cfg.engine.temperature or 1.0)
    k = cfg.trainer.eval_k
    out = {"acc": m["val/acc"], "n": len(rows)}
    for key, value in m.items():
        if key.endswith(f"acc_mean_at_{k}") or key.endswith(f"pass_at_{k}"):
            out[key.split("/")[-1]] = value
    return out


@task(name="write-eval", **STAGE)
def write_eval(results: dict, path: str, tracker_run: dict | None) -> str:
    """metrics/eval.json for `dvc metrics show`, and the same figures on the training run in MLflow."""
    write_json(results, path)
    if tracker_run and tracker_run.get("run_id"):
        tracker = Tracker(tracker_run["experiment"], "", run_id=tracker_run["run_id"])
        tracker.log_summary({f"eval/{name}/{k}": v for name in ("sft", "final") for k, v in results[name].items()
                             if isinstance(v, (int, float))})
        if tracker_run.get("model_id"):  # the held-out figures of that exact model, logged with it
            tracker.log_summary({f"eval/{k}": v for k, v in results["final"].items() if isinstance(v, (int, float))},
                                model_id=tracker_run["model_id"])
        tracker.log_artifact(path)
        tracker.end("FINISHED")
    return str(Path(path))
