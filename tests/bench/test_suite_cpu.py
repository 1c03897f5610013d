"""bench/suite_cpu.py names each process of a test run by its kind, from its command line."""

from bench.suite_cpu import kind_of


def test_each_process_is_named_by_its_kind():
    assert kind_of("ray::PolicyWorker.setup") == "ray: PolicyWorker"
    assert kind_of("ray::RewardScorer") == "ray: RewardScorer"
    assert kind_of("ray::IDLE") == "ray: idle worker"
    assert (
        kind_of("/v/bin/python /v/lib/ray/_private/workers/default_worker.py --node-ip") == "ray: idle worker"
    )
    assert kind_of("/v/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x") == "ray: services"
    assert kind_of("ray::DashboardAgent") == "ray: services"
    assert kind_of(
        "/v/bin/python -m uvicorn --app-dir /v/prefect/server/api prefect.server.api.server:x"
    ) == ("prefect: server")
    assert kind_of("/v/bin/python /v/bin/mlflow server --host 127.0.0.1") == "mlflow: server"
    assert kind_of("/v/bin/python /v/bin/dvc repro dvc.yaml") == "dvc"
    assert kind_of("/v/bin/python -m flows.cli train --config c.yaml") == "reinforge: stages and runs"
    assert kind_of("/v/bin/python /v/bin/reinforge train") == "reinforge: stages and runs"
    assert kind_of("/v/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))") == "pytest"
    assert kind_of("git clone -q x y") == "other"
