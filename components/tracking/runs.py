"""Runs inside a training output directory, and the decision of what a new training run continues.

`trainer.output_dir` holds one subdirectory per run, so a run never writes, resumes or prunes another's:

    checkpoints/grpo/            marked as a training output (components/outputs.py); `.lock` while one trains
      runs/<id>/                 one run: <id> is the start of its fingerprint (-2, -3 for a restart of the same)
        run.json                 fingerprint, what went into it, target iterations, status, MLflow run ids
        checkpoints/iter_*/      its checkpoints and their `latest` pointer
        final/                   its final model
      latest                     the id of the run that last finished here
      final/                     that run's final model (hard links), what DVC tracks: the runs themselves
                                 (MLflow ids, timestamps, checkpoints) are this machine's working state

What a run does with trainer.resume_mode=auto (plan_run): continue the newest run of its configuration when
it is unfinished; extend it when it finished and trainer.iterations asks for more; train a new run when it
asks for fewer iterations than that run has; refuse when it asks for as many as a finished run already did
(nothing to train), unless trainer.when_finished=retrain (a deployment's or the nightly's run), which trains a
new run then. A run another process is training now (its run directory's lock held: components/locking.py)
is never continued: the new run trains in a directory of its own. `disable` starts a new run directory; a
checkpoint path continues that checkpoint, checked like `auto`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from components.data.io import write_json
from components.errors import CheckpointError, ConfigError
from components.tracking import checkpoints

RUNS, RUN_INFO, FINAL = "runs", "run.json", "final"


@dataclass(frozen=True)
class Fingerprint:
    """What a checkpoint must match to be continued: the digest, and what it was made of (the training keys of
    the config, and the md5 of the data, starting models and reward function), to name what differs."""

    digest: str
    config: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)

    def differences(self, state: dict) -> list[str]:
        """The keys whose value in a checkpoint's state differs from this fingerprint's."""
        theirs = {**state.get("fingerprint_config", {}), **state.get("fingerprint_inputs", {})}
        ours = {**self.config, **self.inputs}
        return [
            f"{k}: {theirs.get(k)!r} -> {ours.get(k)!r}"
            for k in sorted(set(ours) | set(theirs))
            if theirs.get(k) != ours.get(k)
        ]

    def state(self) -> dict:
        return {
            "fingerprint": self.digest,
            "fingerprint_config": self.config,
            "fingerprint_inputs": self.inputs,
        }


@dataclass
class ResumePlan:
    """Where a training run writes and what it starts from: `checkpoint` None = iteration 1. `mlflow_run_id`
    the MLflow run to continue (None = a new one); `extends` the iteration a finished run is extended from,
    whose MLflow run (`parent_run_id`) stays as it was while the extension logs to a child run."""

    run_dir: Path
    checkpoint: Path | None = None
    state: dict = field(default_factory=dict)
    mlflow_run_id: str | None = None
    extends: int | None = None
    parent_run_id: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def info(self) -> dict:
        return read_info(self.run_dir)


def read_info(run_dir: Path) -> dict:
    path = Path(run_dir) / RUN_INFO
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}


def write_info(run_dir: Path, **fields) -> dict:
    info = {**read_info(run_dir), **fields}
    write_json(info, Path(run_dir) / RUN_INFO)
    return info


def run_dirs(output_dir: str | Path, digest: str | None = None) -> list[Path]:
    """The run directories of `output_dir` (of one fingerprint when `digest` is given), oldest first."""
    root = Path(output_dir) / RUNS
    found = [d for d in root.iterdir() if d.is_dir() and not d.is_symlink()] if root.is_dir() else []
    if digest is not None:
        found = [d for d in found if read_info(d).get("fingerprint") == digest]
    return sorted(found, key=lambda d: (read_info(d).get("created", 0), d.name))


def new_run_dir(output_dir: str | Path, digest: str) -> Path:
    """A run directory no run has used: runs/<digest[:10]>, then -2, -3, ... (created by start_info, once the
    run starts: a plan that is refused writes nothing)."""
    root = Path(output_dir) / RUNS
    base, n = digest[:10], 1
    while (root / (base if n == 1 else f"{base}-{n}")).exists():
        n += 1
    return root / (base if n == 1 else f"{base}-{n}")


def _finished(state: dict, info: dict) -> bool:
    return info.get("status") == "finished" and state.get("iteration") == info.get("iterations")


def _fewer(iterations: int, ckpt: Path, iteration: int) -> ConfigError:
    return ConfigError(
        f"trainer.iterations={iterations} is fewer than the {iteration} iterations checkpoint {ckpt} of this "
        "configuration already holds, so there is nothing to train and nothing was written. Raise "
        "trainer.iterations to extend that run, set trainer.resume_mode=disable to train a new run from the "
        "start (in a directory of its own), or use another trainer.output_dir."
    )


def plan_run(
    output_dir: str | Path,
    fingerprint: Fingerprint,
    resume_mode: str,
    iterations: int,
    accept_mismatch: bool = False,
    when_finished: str = "stop",
    busy: Callable[[Path], bool] = lambda run_dir: False,
) -> ResumePlan:
    """Decide, before anything is written, what this training run continues (see the module docstring).
    `when_finished` = retrain (the nightly): a finished run of this configuration is not an error but the
    start of a new run directory, as a run of more iterations than asked always is. A run directory `busy`
    says another process trains is passed over. Raises ConfigError or CheckpointError with the fix."""
    if resume_mode == "disable":
        return ResumePlan(new_run_dir(output_dir, fingerprint.digest))
    if resume_mode != "auto":
        return _plan_explicit(Path(resume_mode), fingerprint, iterations, accept_mismatch, Path(output_dir))
    notes: list[str] = []
    for run_dir in reversed(run_dirs(output_dir, fingerprint.digest)):
        if busy(run_dir):
            notes.append(f"{run_dir.name} is being trained by another process now; this run trains its own")
            continue
        ckpt, skipped = checkpoints.find_resumable(run_dir / "checkpoints", fingerprint.digest)
        notes += skipped
        if ckpt is None:
            continue
        state, info = checkpoints.read_state(ckpt), read_info(run_dir)
        done = _finished(state, info) and state["iteration"] == iterations
        if state["iteration"] > iterations or (done and when_finished == "retrain"):
            return ResumePlan(
                new_run_dir(output_dir, fingerprint.digest),
                notes=notes
                + [
                    f"{run_dir.name} already holds {state['iteration']} iterations; training a new run of {iterations}"
                ],
            )
        if done:
            raise ConfigError(
                f"{run_dir} already finished all {iterations} iterations of this configuration (MLflow run "
                f"{info.get('mlflow_run_id')}), so there is nothing to train and nothing was written. Raise "
                "trainer.iterations to extend it, or set trainer.resume_mode=disable to train a new run from the "
                "start in a directory of its own."
            )
        return _continue(run_dir, ckpt, state, notes)
    return ResumePlan(new_run_dir(output_dir, fingerprint.digest), notes=notes)


def _continue(run_dir: Path, ckpt: Path, state: dict, notes: list[str]) -> ResumePlan:
    """Continue `ckpt` in its own run directory: in its MLflow run, or (a finished run) in a child of it."""
    if _finished(state, read_info(run_dir)):
        return ResumePlan(run_dir, ckpt, state, None, state["iteration"], state.get("mlflow_run_id"), notes)
    return ResumePlan(run_dir, ckpt, state, state.get("mlflow_run_id"), notes=notes)


def _plan_explicit(
    ckpt: Path, fingerprint: Fingerprint, iterations: int, accept_mismatch: bool, output_dir: Path
) -> ResumePlan:
    """trainer.resume_mode=<checkpoint>: verified, and its fingerprint compared key by key like auto's. A
    checkpoint of this configuration in a run directory of this output continues there; any other (accepted
    knowingly, or copied from elsewhere) starts a new run directory and a new MLflow run from its state, so
    no other run's checkpoints or MLflow history are written."""
    checkpoints.verify(ckpt)
    state = checkpoints.read_state(ckpt)
    same = state.get("fingerprint") == fingerprint.digest
    differ = [] if same else fingerprint.differences(state)
    if not same and not accept_mismatch:
        shown = "; ".join(differ[:5]) or "its fingerprint (made before reinforge recorded what went into one)"
        raise CheckpointError(
            f"trainer.resume_mode={ckpt}: that checkpoint was made with another configuration or data ({shown}), "
            "so continuing it would not be this run. Resume a checkpoint of this configuration (resume_mode=auto), "
            "or set trainer.resume_accept_mismatch=true to continue it knowingly (in a new run directory)."
        )
    if state["iteration"] > iterations:
        raise _fewer(iterations, ckpt, state["iteration"])
    run_dir = ckpt.resolve().parent.parent
    if same and run_dir in [d.resolve() for d in run_dirs(output_dir, fingerprint.digest)]:
        return _continue(run_dir, ckpt, state, [])
    note = (
        f"continuing {ckpt} of another configuration ({'; '.join(differ[:5])})"
        if differ
        else f"continuing {ckpt}, a checkpoint from outside this output directory"
    )
    return ResumePlan(new_run_dir(output_dir, fingerprint.digest), ckpt, state, notes=[note])


def start_info(plan: ResumePlan, fingerprint: Fingerprint, iterations: int, mlflow_run_id: str) -> dict:
    """run.json at the start of a run (or of an extension): what it trains and where it logs."""
    info = read_info(plan.run_dir)
    runs = list(dict.fromkeys([*info.get("mlflow_runs", []), mlflow_run_id]))
    return write_info(
        plan.run_dir,
        fingerprint=fingerprint.digest,
        fingerprint_config=fingerprint.config,
        fingerprint_inputs=fingerprint.inputs,
        iterations=iterations,
        status="running",
        created=info.get("created", time.time()),
        mlflow_run_id=mlflow_run_id,
        mlflow_runs=runs,
    )


def finished_run(output_dir: str | Path, digest: str) -> Path:
    """The newest finished run of a fingerprint (for evaluation); DataError-like ConfigError when none is."""
    done = [d for d in run_dirs(output_dir, digest) if read_info(d).get("status") == "finished"]
    if not done:
        raise ConfigError(
            f"trainer.output_dir={output_dir} holds no finished run of this configuration; run "
            "`reinforge train` with it first (or evaluate a model directly with --model_path)."
        )
    return done[-1]


def publish_final(output_dir: str | Path, final: str | Path) -> Path:
    """The finished run's final model as `output_dir`/final, replaced atomically (hard links to its files:
    no copy of the weights). DVC tracks this directory, the same bytes for the same training."""
    import shutil

    from components.tracking.checkpoints import replace_dir

    target = Path(output_dir) / FINAL
    tmp = target.parent / f".tmp_{FINAL}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(final, tmp, copy_function=os.link)
        replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_dir(path: str | Path) -> Path:
    """A model directory given by the user: a training output directory (`checkpoints/grpo`) stands for the
    final model of the run that last finished there (its `latest`); anything else is itself."""
    from components.outputs import TRAIN_OUTPUT, marker_kind

    p = Path(path)
    latest = p / "latest"
    if marker_kind(p) == TRAIN_OUTPUT and latest.is_file():
        return p / RUNS / latest.read_text().strip() / "final"
    return p
