"""pipelines.yaml -> Prefect deployments (served in-process, on a work pool, or Prefect's own prefect.yaml).

A triggered training deployment trains a new run each time, as the nightly does
(`trainer.when_finished=retrain`, shown in its parameters): `prefect deployment run 'rl-train/arith-grpo'` after
`make run` trains again instead of failing on the finished run. The CLI keeps its refuse-or-extend default.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from components.errors import ConfigError
from flows.notifications import Notify
from flows.notifications import configure as configure_notifications

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# pipelines.yaml `flow:` -> entrypoint
FLOWS = {
    "train": "flows.train:train_flow",
    "nightly": "flows.nightly:nightly_flow",
    "data": "flows.data:data_flow",
    "sft": "flows.sft:sft_flow",
    "evaluate": "flows.evaluate:evaluate_flow",
}


class Schedule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cron: str = Field(description="cron expression, e.g. '0 2 * * *'")
    timezone: str = Field("UTC", description="timezone of the cron")

    @model_validator(mode="after")
    def is_valid(self) -> Schedule:
        # Prefect's own schedule type checks the cron fields and the timezone, as the server would
        from prefect.client.schemas.schedules import CronSchedule

        try:
            CronSchedule(cron=self.cron, timezone=self.timezone)
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise ValueError(f"cron {self.cron!r} in timezone {self.timezone!r}: {reason}") from None
        return self


class Pipeline(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="deployment name")
    version: str = Field(description="pipeline version, recorded on the deployment and the MLflow run")
    flow: str = Field(description=f"one of {', '.join(FLOWS)}")
    config: str = Field(description="config file the flow runs with")
    description: str = Field("", description="shown in the Prefect UI")
    schedule: Schedule | None = Field(None, description="optional cron schedule")
    concurrency_limit: int | None = Field(
        None,
        ge=1,
        description="at most this many runs at once; the others wait for a slot (Prefect's own limit)",
    )
    parameters: dict[str, Any] = Field(default_factory=dict, description="extra flow parameters")
    inputs: str | None = Field(
        None,
        description="the DVC stage whose outputs the flow reads (dvc.yaml:sft: the data and SFT model); a "
        "work pool's worker that clones the code (reinforge deploy --source) takes them with `dvc repro --pull` "
        "before each run",
    )
    notify: Notify | None = Field(
        None,
        description="a webhook told when a run fails or the nightly does not promote its model (Prefect "
        "automations, set up by `reinforge deploy`: flows/notifications.py)",
    )

    @field_validator("config")
    @classmethod
    def config_in_the_project(cls, config: str) -> str:
        # a deployment's runs read it on the worker's machine, from the project's checkout
        resolved = (PROJECT_ROOT / config).resolve()
        if PROJECT_ROOT.resolve() not in resolved.parents:
            raise ValueError(
                f"{config!r} resolves to {resolved}, outside the project; give a config file in it"
            )
        if not resolved.is_file():
            raise ValueError(f"{config!r} is not a file in the project")
        return config

    @field_validator("inputs")
    @classmethod
    def inputs_in_the_project(cls, inputs: str | None) -> str | None:
        if inputs is None:
            return None
        file = inputs.rpartition(":")[0] or inputs  # dvc.yaml:sft, or a whole file
        if not (PROJECT_ROOT / file).is_file():
            raise ValueError(
                f"{inputs!r} names no DVC file of the project "
                "(dvc.yaml:sft, vlm/dvc.yaml:sft, environments/dvc.yaml:sft)"
            )
        return inputs

    @model_validator(mode="after")
    def overrides_are_a_list(self) -> Pipeline:
        from components.config.loader import check_given

        if "overrides" in self.parameters:  # a string would be spread into one override per character
            check_given(self.parameters["overrides"] or [], f"in pipeline {self.name}'s parameters")
        return self


class PipelinesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pipelines: list[Pipeline]

    @field_validator("pipelines")
    @classmethod
    def names_are_unique(cls, pipelines: list[Pipeline]) -> list[Pipeline]:
        # two deployments of one name: the second would silently replace the first
        names = [p.name for p in pipelines]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"pipeline names must be unique; {', '.join(twice)} appears more than once")
        return pipelines


def load_pipelines(path: str | Path = PROJECT_ROOT / "pipelines.yaml") -> list[Pipeline]:
    from components.config.loader import read_yaml

    try:
        pf = PipelinesFile.model_validate(read_yaml(path, "pipelines file"))
    except ValidationError as exc:
        raise ConfigError(
            f"{path}: "
            + "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors()
            )
        ) from None
    for p in pf.pipelines:
        if p.flow not in FLOWS:
            raise ConfigError(
                f"{path}: pipeline {p.name}: flow={p.flow} is unknown; valid: {', '.join(FLOWS)}"
            )
    return pf.pipelines


def flow_of(p: Pipeline):
    module, attr = FLOWS[p.flow].split(":")
    return getattr(importlib.import_module(module), attr)


RETRAIN = (
    "trainer.when_finished=retrain"  # a triggered training run trains anew (components/tracking/runs.py)
)


def parameters_of(p: Pipeline) -> dict[str, Any]:
    """The flow run's parameters: the pipeline's, its config, its name and version; a training deployment's
    overrides start with RETRAIN (the pipeline's own overrides come after it, and win)."""
    params = {"config": p.config, **p.parameters}
    if p.flow in ("train", "nightly"):
        params.update(pipeline=p.name, pipeline_version=p.version)
    if p.flow == "train":
        params["overrides"] = [RETRAIN, *(params.get("overrides") or [])]
    return params


def schedule_of(p: Pipeline):
    """The pipeline's cron in its own timezone (Prefect's `cron=` shorthand would leave the timezone unset)."""
    from prefect.schedules import Cron

    return Cron(p.schedule.cron, timezone=p.schedule.timezone)


def entrypoint(p: Pipeline) -> str:
    """The flow as Prefect names it in a deployment: flows/train.py:train_flow."""
    return FLOWS[p.flow].replace(".", "/", 1).replace(":", ".py:", 1)


PREFECT_YAML = PROJECT_ROOT / "prefect.yaml"
WORK_POOL = "reinforge"  # prefect.yaml's work pool: `prefect work-pool create reinforge --type process`


def prefect_yaml(pipelines: list[Pipeline]) -> dict[str, Any]:
    """Prefect's own deployment file for the same pipelines (`prefect deploy --all`, then a worker of the
    `reinforge` process pool runs them). No pull step: `prefect deploy` records the directory it is run
    from, so a worker on this machine runs the checkout; docs/deployments.md shows a git_clone pull step for
    workers elsewhere."""
    deployments = []
    for p in pipelines:
        d: dict[str, Any] = {
            "name": p.name,
            "version": p.version,
            "description": p.description,
            "entrypoint": entrypoint(p),
            "tags": [f"pipeline:{p.name}"],
            "parameters": parameters_of(p),
            "work_pool": {"name": WORK_POOL},
        }
        if p.schedule:
            d["schedules"] = [{"cron": p.schedule.cron, "timezone": p.schedule.timezone}]
        if p.concurrency_limit:
            d["concurrency_limit"] = p.concurrency_limit
        deployments.append(d)
    import prefect

    return {"name": "reinforge", "prefect-version": prefect.__version__, "deployments": deployments}


def prefect_yaml_text(pipelines: list[Pipeline]) -> str:
    header = (
        "# Generated from pipelines.yaml by `reinforge deploy --write-prefect-yaml`: edit pipelines.yaml, then\n"
        "# run that again (a test fails when this file is out of date). With a Prefect server:\n"
        "#   prefect work-pool create reinforge --type process && prefect --no-prompt deploy --all\n"
        "#   prefect worker start --pool reinforge\n"
    )
    return header + yaml.safe_dump(prefect_yaml(pipelines), sort_keys=False, width=100)


def deployment_options(p: Pipeline) -> dict[str, Any]:
    """What every way of deploying `p` gives Prefect: name, version, description, parameters, tags, and the
    schedule and concurrency limit it has."""
    out = {
        "name": p.name,
        "version": p.version,
        "description": p.description,
        "parameters": parameters_of(p),
        "tags": [f"pipeline:{p.name}"],
    }
    if p.schedule:
        out["schedule"] = schedule_of(p)
    if p.concurrency_limit:
        out["concurrency_limit"] = p.concurrency_limit
    return out


def to_deployments(pipelines: list[Pipeline]) -> list:
    """RunnerDeployments for `prefect.serve` (in-process, no work pool needed)."""
    return [flow_of(p).to_deployment(**deployment_options(p)) for p in pipelines]


def source_of(source: str | None, branch: str | None = None, inputs: str | None = None):
    """Where a work pool's worker gets the code: a git repository it clones (a URL; `branch`, else the
    repository's default), then the DVC outputs the flow reads (`inputs`, taken from the DVC remote or made);
    or, with no source, this checkout's directory (a worker on this machine, its outputs in place)."""
    if not source:
        return str(PROJECT_ROOT)
    from prefect.runner.storage import GitRepository

    class CodeAndData(GitRepository):
        """A git clone, then `dvc repro --pull <inputs>` in it: a clone holds the code and dvc.lock, not the
        data and SFT model DVC tracks."""

        def to_pull_step(self) -> list[dict[str, Any]]:
            clone = super().to_pull_step()
            clone["prefect.deployments.steps.git_clone"]["id"] = "clone"
            if not inputs:
                return [clone]
            data = {
                "script": f"dvc repro --pull {inputs}",
                "directory": "{{ clone.directory }}",
                "stream_output": True,
            }
            return [clone, {"prefect.deployments.steps.run_shell_script": data}]

    return CodeAndData(url=source, branch=branch, pull_interval=None)


def deploy(
    pipelines: list[Pipeline],
    mode: str = "serve",
    work_pool: str | None = None,
    source: str | None = None,
    branch: str | None = None,
) -> list[str]:
    """serve: register and run them in this process; apply: register only; work_pool: deploy to that pool,
    its workers taking the code from `source` (a git URL) or from this checkout."""
    names = [f"{flow_of(p).name}/{p.name}" for p in pipelines]
    for p in pipelines:  # the server's automations: they hold however the deployment is run
        if p.notify is not None:
            configure_notifications(p.name, flow_of(p).name, p.notify)
    if work_pool:
        for p in pipelines:
            code = source_of(source, branch, p.inputs)
            src = flow_of(p).from_source(source=code, entrypoint=entrypoint(p))
            src.deploy(work_pool_name=work_pool, build=False, push=False, **deployment_options(p))
        return names
    deployments = to_deployments(pipelines)
    if mode == "apply":
        for d in deployments:
            d.apply()
        return names
    from prefect import serve

    serve(*deployments)
    return names
