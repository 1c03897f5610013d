"""The docs' blocks that run the pipeline, exactly as written, in a checkout of their own.

Each test takes its block from the doc (tests/docs/blocks.py: the marker names the test) and runs it with
bash from a scratch checkout (tests/docs/checkout.py: this checkout's files, a venv of its own, the default
config shrunk to the tests' small pipeline), with a user's environment: no variable the doc does not set.
A block that keeps a terminal (a server) runs in the background; `# in a second terminal` starts the next.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs.blocks import Terminal, all_marked, as_script, marked, run_block, terminals, user_env
from tests.docs.checkout import scratch_checkout

pytestmark = pytest.mark.slow
PREFECT = "http://127.0.0.1:4200/api"


@dataclass(frozen=True)
class User:
    """A new user (an empty home: Prefect's database, Ray's token and DVC's cache start empty) and the
    checkout they run the blocks in."""

    home: Path
    checkout: Path

    def run(self, script: str, timeout_s: int = 900) -> subprocess.CompletedProcess:
        return run_block(script, timeout_s, self.checkout, self.home)

    def terminal(self, script: str, log: Path) -> Terminal:
        return Terminal(script, self.checkout, log, self.home)


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> User:
    home = tmp_path_factory.mktemp("home")
    return User(home, scratch_checkout(tmp_path_factory.mktemp("user") / "reinforge", home))


def ok(res, what: str) -> str:
    assert res.returncode == 0, f"{what}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    return res.stdout


def api(path: str, body: dict | None = None):
    """Prefect's REST API at the doc's address: GET, or POST `body`; the JSON it answers, None on a 404."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(PREFECT + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as answer:
            return json.load(answer)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def wait_for(read, what: str, timeout_s: float, server: Terminal):
    deadline = time.monotonic() + timeout_s
    while (value := read()) is None:
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s:\n{server.said()[-3000:]}"
        time.sleep(1)
    return value


def finished(run_id: str) -> dict | None:
    """The flow run's state once it is final, else None."""
    state = (api(f"/flow_runs/{run_id}") or {}).get("state") or {}
    return state if state.get("type") in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None


def answers(url: str) -> bool | None:
    """True once `url` answers 200, else None (wait_for's "not yet")."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return True if answer.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def why_not_completed(run_id: str, state: dict, worker: Terminal) -> str:
    """What a failed or crashed run said: its state's message, the run's own log lines from the server (the
    pull steps' and the flow's), and the worker's last lines."""
    logs = api("/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC"}) or []
    said = "\n".join(f"{line['level']:>2} {line['name']}: {line['message']}" for line in logs)
    return (
        f"{state['type']}: {state.get('message')}\nthe run's logs:\n{said[-6000:]}\n"
        f"the worker's last lines:\n{worker.said()[-8000:]}"
    )


def mlflow_runs(user: User, where: str = "") -> list:
    """The runs of the checkout's MLflow store (mlflow.db) that match `where` (MLflow's filter syntax)."""
    from mlflow.tracking import MlflowClient

    store = MlflowClient(f"sqlite:///{user.checkout / 'mlflow.db'}")
    return store.search_runs([e.experiment_id for e in store.search_experiments()], where)


def prefect_server(user: User, tmp_path: Path) -> Terminal:
    """A Prefect server at the docs' address, with a database of its own (not the user's ~/.prefect: each
    test's blocks create their work pool anew), once it answers."""
    server = user.terminal(
        f"PREFECT_HOME={tmp_path / 'prefect'} .venv/bin/prefect server start\n", tmp_path / "server.log"
    )
    try:
        wait_for(lambda: api("/health"), "Prefect server", 240, server)
    except BaseException:
        server.stop()
        raise
    return server


def flow_run_id(said: str) -> str:
    """The id of the flow run `prefect deployment run` said it created (the last command of its block)."""
    return re.findall(r"Created flow run '.*?'\.\s*└── UUID: ([0-9a-f-]{36})", said)[-1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_deployments_served_and_run_as_written(user, tmp_path):
    """README's (and docs/workflows.md's) deployment block: a Prefect server and `reinforge deploy` in one
    terminal, then in a second `prefect deployment run` typed twice at once: both runs complete, each in a run
    directory of its own, each a FINISHED MLflow run in the checkout's store (a new one: the two runs made
    it together)."""
    assert port_free(4200), "port 4200 is taken: the doc's Prefect server cannot start"
    serve, trigger = terminals(marked("test_deployments_served_and_run_as_written"))
    server = user.terminal(as_script(serve), tmp_path / "serve.log")
    try:
        wait_for(lambda: api("/deployments/name/rl-train/arith-grpo"), "deployment", 240, server)
        script = as_script(trigger)
        ids = [flow_run_id(ok(user.run(script, 120), "run")) for _ in "12"]
        states = [wait_for(lambda i=i: finished(i), "final state", 600, server) for i in ids]
        assert [s["type"] for s in states] == ["COMPLETED"] * 2, (states, server.said()[-4000:])
    finally:
        server.stop()
    made = list((user.checkout / "checkpoints" / "grpo" / "runs").iterdir())
    assert len(made) == 2, made  # the first trainings of this checkout
    runs = mlflow_runs(user, "tags.`reinforge.run_dir` LIKE '%checkpoints/grpo/runs/%'")
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 2


def test_the_champion_loaded_and_served_as_written(user, tmp_path):
    """After a nightly (`reinforge nightly`, which registers the champion), README's and docs/workflows.md's
    Python that loads `models:/reinforge-arith@champion`, run with .venv/bin/python from the checkout, each
    print the model's completions; then docs/workflows.md's `mlflow models serve` in one terminal and its
    curl in a second answer with a completion."""
    ok(user.run(".venv/bin/reinforge nightly\n", 900), "the nightly")
    for block in all_marked("test_the_champion_loaded_and_served_as_written"):
        if block.lang == "python":
            res = subprocess.run(
                [str(user.checkout / ".venv" / "bin" / "python"), "-"],
                input=block.body,
                cwd=user.checkout,
                env=user_env(user.home),
                capture_output=True,
                text=True,
                timeout=300,
            )
            prompts = block.body.count('="')
            assert (
                "completion" in ok(res, block.where()) and len(res.stdout.strip().splitlines()) == 1 + prompts
            )
    (shell,) = [b for b in all_marked("test_the_champion_loaded_and_served_as_written") if b.lang == "bash"]
    serve, ask = terminals(shell)
    assert port_free(5001), "port 5001 is taken: the doc's model server cannot start"
    server = user.terminal(as_script(serve), tmp_path / "serve.log")
    try:

        def ping():
            try:
                with urllib.request.urlopen("http://127.0.0.1:5001/ping", timeout=5) as answer:
                    return answer.status == 200 or None
            except OSError:
                return None

        wait_for(ping, "answer from the model server", 300, server)
        answer = json.loads(ok(user.run(as_script(ask), 120), "curl"))
    finally:
        server.stop()
    (row,) = answer["predictions"]
    assert isinstance(row["completion"], str), answer


def test_the_configuration_commands_as_written(user):
    """README's configuration block: a DAPO run of 20 iterations trains (its MLflow run has the preset's
    params and 20 steps), `config show` names each value's source, `config generate` lists every key."""
    out = ok(user.run(as_script(marked("test_the_configuration_commands_as_written")), 900), "block")
    assert "algorithm.name" in out and "actor.optimizer.lr" in out
    from mlflow.tracking import MlflowClient

    (run,) = mlflow_runs(user, "params.`algorithm.name` = 'dapo'")
    store = MlflowClient(f"sqlite:///{user.checkout / 'mlflow.db'}")
    steps = store.get_metric_history(run.info.run_id, "actor/pg_loss")
    assert run.info.status == "FINISHED" and max(m.step for m in steps) == 20, [m.step for m in steps][-3:]


def test_a_run_without_ray_as_written(user):
    """docs/workflows.md's in-process run: a FINISHED MLflow run of 5 iterations, its workers in-process."""
    ok(user.run(as_script(marked("test_a_run_without_ray_as_written")), 600), "block")
    runs = mlflow_runs(user, "params.`trainer.backend` = 'local'")
    assert [r.info.status for r in runs] == ["FINISHED"] and runs[0].data.params["trainer.iterations"] == "5"


def test_an_agent_program_trained_as_written(user):
    """docs/environments.md's agent run: agents/guess_number.py plays every episode through the openai client
    in the rollout; a FINISHED run whose episodes have more than one turn and whose reward is the agent's."""
    ok(user.run(as_script(marked("test_an_agent_program_trained_as_written")), 900), "block")
    from mlflow.tracking import MlflowClient

    (run,) = mlflow_runs(user, "params.`multi_turn.env` = 'agent'")
    store = MlflowClient(f"sqlite:///{user.checkout / 'mlflow.db'}")
    turns = [m.value for m in store.get_metric_history(run.info.run_id, "env/agent/turns")]
    rewards = [m.value for m in store.get_metric_history(run.info.run_id, "reward/env/mean")]
    assert run.info.status == "FINISHED" and len(turns) == len(rewards) > 0 and max(turns) > 1.0, turns


def test_the_calculator_pipeline_as_written(user):
    """docs/rewards.md's multi-turn pipeline on configs/arith_tool_grpo.yaml: its data, the SFT that shows the
    calculator, GRPO with calls, and the evaluation written where the block says, with both models' figures."""
    ok(user.run(as_script(marked("test_the_calculator_pipeline_as_written")), 900), "block")
    figures = json.loads((user.checkout / "metrics" / "tool_eval.json").read_text())
    assert {"sft", "final"} <= figures.keys(), figures
    assert all(0.0 <= figures[m]["acc"] <= 1.0 for m in ("sft", "final")), figures
    assert (user.checkout / "checkpoints" / "tool_grpo" / "final" / "config.json").is_file()


def test_a_work_pools_worker_as_written(user, tmp_path):
    """docs/workflows.md's work pool: with a Prefect server up, the first terminal deploys from a git URL (a
    bare repository of the checkout's commit) and asks for a run; the worker started in the second runs it
    in a clone of its own, whose data and SFT model `dvc repro --pull` made, and logs it to the MLflow server
    the block names: a FINISHED run with its logged model."""
    assert port_free(4200), "port 4200 is taken: the doc's Prefect server cannot start"
    bare = tmp_path / "reinforge.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(user.checkout), str(bare)], check=True)
    given = {"server": "127.0.0.1", "your_repo_url": f"file://{bare}"}
    deploy, work = terminals(marked("test_a_work_pools_worker_as_written"))
    assert port_free(5000), "port 5000 is taken: the doc's MLflow server cannot start"
    server = prefect_server(user, tmp_path)
    store = f"sqlite:///{tmp_path / 'tracking.db'}"
    tracking = user.terminal(
        f".venv/bin/mlflow server --port 5000 --backend-store-uri {store} "
        f"--artifacts-destination {tmp_path / 'artifacts'}\n",
        tmp_path / "mlflow.log",
    )
    worker = None
    try:
        # the doc's MLflow server is up before the runs that log to it, as a user's is: on a loaded machine it
        # takes longer to answer than the first stage of a worker's run takes to ask (a run that then failed)
        wait_for(lambda: answers("http://127.0.0.1:5000/health"), "MLflow server", 240, tracking)
        said = ok(user.run(as_script(deploy, **given), 600), "the first terminal")
        run_id = flow_run_id(said)
        worker = user.terminal(as_script(work, **given), tmp_path / "worker.log")
        state = wait_for(lambda: finished(run_id), "final state of the run", 900, worker)
        assert state["type"] == "COMPLETED", why_not_completed(run_id, state, worker)
    finally:
        for terminal in (worker, server, tracking):
            if terminal is not None:
                terminal.stop()
    said = worker.said()
    assert "Running stage 'sft'" in said  # the clone's data and SFT model, made by its dvc repro --pull
    from mlflow.tracking import MlflowClient

    server_store = MlflowClient(store)
    (run,) = server_store.search_runs([e.experiment_id for e in server_store.search_experiments()])
    assert run.info.status == "FINISHED" and run.outputs.model_outputs  # its logged model, on the server


def test_prefect_yaml_deployed_as_written(user, tmp_path):
    """docs/workflows.md's Prefect convention: `prefect deploy --all` reads prefect.yaml from the checkout, the
    run it asks for waits for the worker of the second terminal, which runs it in the checkout: a new run
    directory there, and a FINISHED MLflow run in the checkout's store."""
    assert port_free(4200), "port 4200 is taken: the doc's Prefect server cannot start"
    before = set((user.checkout / "checkpoints" / "grpo" / "runs").glob("*"))
    deploy, work = terminals(marked("test_prefect_yaml_deployed_as_written"))
    server = prefect_server(user, tmp_path)
    worker = None
    try:
        said = ok(user.run(as_script(deploy, server="127.0.0.1"), 600), "the first terminal")
        run_id = flow_run_id(said)
        worker = user.terminal(as_script(work, server="127.0.0.1"), tmp_path / "worker.log")
        state = wait_for(lambda: finished(run_id), "final state of the run", 900, worker)
        assert state["type"] == "COMPLETED", why_not_completed(run_id, state, worker)
    finally:
        for terminal in (worker, server):
            if terminal is not None:
                terminal.stop()
    (made,) = set((user.checkout / "checkpoints" / "grpo" / "runs").glob("*")) - before
    (run,) = mlflow_runs(user, f"tags.`reinforge.run_dir` LIKE '%{made.name}'")
    assert run.info.status == "FINISHED"


def test_a_cluster_of_two_nodes_as_written(user, tmp_path):
    """docs/cluster.md's cluster, its three places on this one machine: the head makes the token and starts
    (token auth on), a second node joins with the token, the driver's `reinforge diagnose` sees both and
    `reinforge train trainer.num_workers=4` trains on them; the block's own last line stops every process of
    it. Then the placement block, in the first block's context (the venv, the driver's two variables): the
    engine on the node with `rollout`, the policy workers on the node with `trainer`."""
    assert port_free(6379), "port 6379 is taken: the doc's Ray head cannot start"
    first, placed = all_marked("test_a_cluster_of_two_nodes_as_written")
    head, node, driver, stop = re.split(r"^# (?:on every|where you|on each).*$", first.body, flags=re.M)
    context = "\n".join(line for line in driver.splitlines() if line.startswith(("source", "export")))
    try:
        said = ok(user.run(as_script(head), 300), "the head node")
        token = re.match(r"[0-9a-f]{64}", said)[0]  # printed with no newline after it
        host = re.search(r"ray start --address='([0-9.]+):6379'", said)[1]
        given = {"token": token, "head": host}
        ok(user.run(as_script(node, **given), 300), "the second node")
        out = ok(user.run(as_script(driver, **given), 900), "the driver")
        assert f"RAY_ADDRESS={host}:6379 reachable" in out and "CPU 16" in out, out[-3000:]  # both nodes
    finally:
        stopped(user, stop)
    assert last_run(user).data.params["trainer.num_workers"] == "4"
    try:
        ok(user.run(as_script(context + "\n" + placed.body, **given), 900), "the placement block")
    finally:
        stopped(user, stop)
    params = last_run(user).data.params
    assert (params["trainer.num_workers"], params["trainer.rollout_placement"]) == ("2", "separate")


def stopped(user: User, stop: str) -> None:
    """Run the doc's stop line; every process of the cluster (its path in their command lines) is gone."""
    import psutil

    user.run(as_script(stop), 60)
    mine = [
        p for p in psutil.process_iter(["cmdline"]) if "/tmp/ray-mine" in " ".join(p.info["cmdline"] or [])
    ]
    _, left = psutil.wait_procs(mine, timeout=30)  # SIGKILLed: gone once the kernel has reaped them
    assert not left, left


def last_run(user: User):
    """The FINISHED MLflow run of the default pipeline's latest training."""
    latest = (user.checkout / "checkpoints" / "grpo" / "latest").read_text().strip()
    (run,) = mlflow_runs(user, f"tags.`reinforge.run_dir` LIKE '%{latest}'")
    assert run.info.status == "FINISHED"
    return run


def test_your_own_data_as_docs_data_md_writes_it(user, tmp_path):
    """docs/data.md's own-data block: a user's jsonl of plain-string prompts (one row bad) with a data_source
    of their own, outside the checkout, and a base model of their own without a chat template. `clean`
    quarantines the bad row with its reason, `train` trains on the rest and logs to the checkout's MLflow
    store (mlflow.db, MLflow's own default: mlflow.search_runs finds the run with no URI given)."""
    import pandas as pd

    from tests.flows.test_user_data import base_model, jsonl

    def rows(start: int, count: int) -> list[dict]:
        return [
            {
                "data_source": "mytask",
                "prompt": f"{a} + {a % 7} =",
                "reward_model": {"ground_truth": a + a % 7},
            }
            for a in range(start, start + count)
        ]

    mine = tmp_path / "mine"
    mine.mkdir()
    jsonl(mine / "train.jsonl", rows(0, 24) + [{"data_source": "mytask", "prompt": "", "reward_model": {}}])
    jsonl(mine / "test.jsonl", rows(40, 8))
    base_model(tmp_path / "model")
    block = marked("test_your_own_data_as_docs_data_md_writes_it")
    ok(user.run(as_script(block, your_dir=str(mine), your_model=str(tmp_path / "model"))), "block")
    data = user.checkout / "data" / "mine"
    kept = pd.read_parquet(data / "train.parquet")
    bad = pd.concat(pd.read_parquet(p) for p in (data / "quarantine").glob("*.parquet"))
    assert len(kept) == 24 and set(bad["reason"]) == {"empty"}, bad[["reason", "detail"]]
    latest = (user.checkout / "checkpoints" / "mine" / "latest").read_text().strip()
    assert (
        user.checkout / "checkpoints" / "mine" / "runs" / latest / "final" / "model.safetensors"
    ).is_file()
    found = subprocess.run(  # MLflow's own tools find the run from the checkout, no URI set
        [
            str(user.checkout / ".venv" / "bin" / "python"),
            "-c",
            "import json, mlflow; r = mlflow.search_runs(search_all_experiments=True, "
            "filter_string=\"tags.`reinforge.run_dir` LIKE '%checkpoints/mine%'\"); "
            "print(json.dumps(r['status'].tolist()))",
        ],
        cwd=user.checkout,
        env=user_env(user.home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert json.loads(found.stdout.strip().splitlines()[-1]) == ["FINISHED"], found.stderr[-2000:]
