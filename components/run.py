"""A training run's state from start to end, which the training flow (flows/train.py) moves forward: the plan,
the data, where it writes and logs, its workers (replaced when they are rebuilt) and the loop's position."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from components.algorithms.shaping import KLController
from components.config import Config
from components.data.sampler import PromptSampler
from components.locking import Held
from components.plan import RunPlan
from components.rollout.ahead import AheadQueue
from components.services import PrefectWatch
from components.shutdown import stop
from components.tracking import runs
from components.tracking.mlflow_tracker import Tracker
from components.training import backends
from components.training.ray_workers import Workers


@dataclass
class Run:
    """What a training run holds from start to end: the plan, the data, where it writes and logs, its workers
    (replaced when they are rebuilt) and the loop's position."""

    cfg: Config
    plan: RunPlan
    tokenizer: object
    train_rows: list[dict]
    eval_rows: list[dict]
    scorers: dict  # data_source -> scorer, resolved once here
    resume: runs.ResumePlan
    fingerprint: runs.Fingerprint
    tracker: Tracker
    sampler: PromptSampler
    kl_ctrl: KLController | None
    ahead: AheadQueue  # asynchronous modes: the rollouts sampled ahead
    start_workers: Callable[[RunPlan], Workers] = backends.start_workers  # a rebuild's new workers
    workers: Workers | None = None
    version: int = 0  # the weights version the rollout engines sample with
    iteration: int = 1  # the next iteration to run
    checkpoint: str | None = None  # the last good checkpoint and its state.json
    state: dict = field(default_factory=dict)
    scored: tuple | None = None  # (iteration, batch, reward metrics, sampler state) until it is done
    history: list[dict] = field(default_factory=list)
    # this process's start-up instants (time.time()), logged as timing_s/startup/* with its first iteration
    marks: dict[str, float] = field(default_factory=dict)
    watch: PrefectWatch | None = None  # whether the Prefect server still answers
    lock: Held | None = None  # the run directory's, held from its start to its end

    def stop_if_prefect_died(self) -> None:
        """A dead Prefect server stops the run (the checkpoint before it intact), rather than training on
        blind while its calls retry."""
        if self.watch is not None and (problem := self.watch.problem()):
            stop(problem, 2)

    def driver_state(self) -> dict:
        """What a checkpoint holds of the driver: the sampler's position, the engine's weights version, the
        run's fingerprint and the KL controller."""
        state = {
            "sampler": self.sampler.state_dict(),
            "weights_version": self.version,
            **self.fingerprint.state(),
        }
        if self.kl_ctrl is not None:
            state["kl_ctrl"] = self.kl_ctrl.state_dict()
        return state

    def stop_workers(self) -> None:
        if self.workers is not None:
            self.workers.stop()

    def next_rows(self) -> list[dict]:
        return [self.train_rows[i] for i in self.sampler.next_indices()]
