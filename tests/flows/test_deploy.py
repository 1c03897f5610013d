"""pipelines.yaml -> Prefect deployments: names, versions, parameters and the nightly cron."""

from __future__ import annotations

import asyncio

import pytest

from components.errors import ConfigError
from flows.deploy import deploy, load_pipelines


def test_pipelines_file_is_valid_and_bad_flow_is_named(tmp_path):
    names = {p.name for p in load_pipelines()}
    assert {"arith-grpo", "nightly"} <= names
    bad = tmp_path / "p.yaml"
    bad.write_text("pipelines:\n  - {name: x, version: '1', flow: trian, config: configs/arith_grpo.yaml}\n")
    with pytest.raises(ConfigError, match="flow=trian is unknown"):
        load_pipelines(bad)


def test_deployments_registered_with_schedule(prefect_harness):
    from prefect.client.orchestration import get_client

    names = deploy(load_pipelines(), mode="apply")
    assert "rl-train/arith-grpo" in names and "rl-nightly/nightly" in names

    async def read():
        async with get_client() as client:
            train = await client.read_deployment_by_name("rl-train/arith-grpo")
            nightly = await client.read_deployment_by_name("rl-nightly/nightly")
            return train, nightly

    train, nightly = asyncio.run(read())
    assert train.version == "1.0.0"
    assert (
        train.parameters["config"] == "configs/arith_grpo.yaml"
        and train.parameters["pipeline"] == "arith-grpo"
    )
    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
    assert [s.schedule.timezone for s in nightly.schedules] == ["UTC"]  # as pipelines.yaml says
    assert not train.schedules


def test_prefect_yaml_is_current():
    """prefect.yaml is pipelines.yaml for Prefect's own `prefect deploy --all`: regenerated, not hand-edited."""
    from flows.deploy import PREFECT_YAML, prefect_yaml_text

    assert PREFECT_YAML.read_text() == prefect_yaml_text(load_pipelines()), (
        "prefect.yaml is out of date: run `reinforge deploy --write-prefect-yaml`"
    )


def test_pipelines_file_refuses_duplicate_names_and_bad_crons(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text(
        "pipelines:\n  - {name: x, version: '1', flow: train, config: configs/arith_grpo.yaml}\n"
        "  - {name: x, version: '2', flow: nightly, config: configs/arith_grpo.yaml}\n"
    )
    with pytest.raises(ConfigError, match="x appears more than once"):
        load_pipelines(bad)
    for schedule, said in (
        ("{cron: '0 25 * * *'}", "Invalid cron string"),
        ("{cron: 'nightly'}", "Invalid cron string"),
        ("{cron: '0 2 * * *', timezone: Mars/Base}", "Invalid timezone"),
    ):
        bad.write_text(
            "pipelines:\n  - {name: n, version: '1', flow: nightly, config: configs/arith_grpo.yaml, "
            f"schedule: {schedule}}}\n"
        )
        with pytest.raises(ConfigError, match=f"pipelines.0.schedule: .*{said}"):
            load_pipelines(bad)
