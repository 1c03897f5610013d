"""pipelines.yaml -> Prefect deployments (served in-process, or on a work pool)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from components.errors import ConfigError

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


class Pipeline(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="deployment name")
    version: str = Field(description="pipeline version, recorded on the deployment and the MLflow run")
    flow: str = Field(description=f"one of {', '.join(FLOWS)}")
    config: str = Field(description="config file the flow runs with")
    description: str = Field("", description="shown in the Prefect UI")
    schedule: Schedule | None = Field(None, description="optional cron schedule")
    parameters: dict[str, Any] = Field(default_factory=dict, description="extra flow parameters")


class PipelinesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pipelines: list[Pipeline]


def load_pipelines(path: str | Path = PROJECT_ROOT / "pipelines.yaml") -> list[Pipeline]:
    try:
        pf = PipelinesFile.model_validate(yaml.safe_load(Path(path).read_text()))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read pipelines: {exc}") from None
    except ValidationError as exc:
        raise ConfigError(
            f"{path}: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
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


def parameters_of(p: Pipeline) -> dict[str, Any]:
    params = {"config": p.config, **p.parameters}
    if p.flow in ("train", "nightly"):
        params.update(pipeline=p.name, pipeline_version=p.version)
    return params


def schedule_of(p: Pipeline):
    """The pipeline's cron in its own timezone (Prefect's `cron=` shorthand would leave the timezone unset)."""
    from prefect.schedules import Cron

    return Cron(p.schedule.cron, timezone=p.schedule.timezone)


def to_deployments(pipelines: list[Pipeline]) -> list:
    """RunnerDeployments for `prefect.serve` (in-process, no work pool needed)."""
    out = []
    for p in pipelines:
        kwargs = {"schedule": schedule_of(p)} if p.schedule else {}
        out.append(
            flow_of(p).to_deployment(
                name=p.name,
                version=p.version,
                description=p.description,
                parameters=parameters_of(p),
                tags=[f"pipeline:{p.name}"],
                **kwargs,
            )
        )
    return out


def deploy(pipelines: list[Pipeline], mode: str = "serve", work_pool: str | None = None) -> list[str]:
    """serve: register and run them in this process; apply: register only; work_pool: deploy to that pool."""
    names = [f"{flow_of(p).name}/{p.name}" for p in pipelines]
    if work_pool:
        for p in pipelines:
            entry = FLOWS[p.flow].replace(".", "/", 1).replace(":", ".py:", 1)
            src = flow_of(p).from_source(source=str(PROJECT_ROOT), entrypoint=entry)
            src.deploy(
                name=p.name,
                work_pool_name=work_pool,
                version=p.version,
                parameters=parameters_of(p),
                schedule=schedule_of(p) if p.schedule else None,
                build=False,
                push=False,
            )
        return names
    deployments = to_deployments(pipelines)
    if mode == "apply":
        for d in deployments:
            d.apply()
        return names
    from prefect import serve

    serve(*deployments)
    return names
