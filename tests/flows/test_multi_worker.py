"""The training flow with several policy workers: 2 fsdp workers (the reference policy in an actor of its own)
learn as 1 worker with a colocated reference does (from the same start, the same rewards at every iteration
and final weights equal within 1e-4), and a cluster of two Ray nodes started on this machine
(`ray start --head` + `ray start --address`, token auth on) runs `reinforge train` with workers on both nodes
(docs/cluster.md)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from components.env import RAY_LOOPBACK
from tests.flows.conftest import scores, sft_ready

pytestmark = pytest.mark.slow
ITERATIONS = 6
ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "arith_grpo.yaml")
# the runs compared across placements all-reduce full-precision gradients: `auto` picks fp16 below a measured
# bandwidth, which a loaded machine may measure on one run and not on the other
EXACT = "trainer.grad_compression=none"
# the cluster's runs: user_data's overrides put a run's workers in its own process unless told otherwise
ON_RAY = "trainer.backend=ray"


def test_tensor_parallel_workers_then_one_resuming_them_learn_as_one(tmp_path, prefect_harness, ray_local):
    """Two tensor-parallel workers (the reference in its own actor, KL loss on, sharded checkpoints) train part
    of the run, one worker resumes it from their checkpoint: the rewards at every iteration and the final
    weights are one uninterrupted worker's. (FSDP and DDP against one worker:
    tests/components/training/test_distributed.py.)"""
    from flows.train import train_flow

    # SGD: Adam's first steps are lr x sign(grad), so rounding noise in a near-zero gradient would move a weight
    # by lr and let the two runs sample different tokens; with SGD they stay within rounding
    extra = (
        "algorithm.kl_loss_coef=0.04",
        "actor.ppo_mini_batch_size=16",
        "actor.optimizer.type=sgd",
        "actor.optimizer.lr=0.5",
    )
    with sft_ready(tmp_path, ITERATIONS, extra, backend="ray") as ov:
        # the one-worker runs with their workers in this process (trainer.backend=local: the same model as on
        # Ray, bit for bit), the resumed one from the Ray workers' checkpoint (where workers run is resume-neutral)
        here = "trainer.backend=local"
        one = train_flow("configs/arith_grpo.yaml", ov + [f"trainer.output_dir={tmp_path}/one", here])
        out = f"trainer.output_dir={tmp_path}/tp"
        ref = "trainer.ref_placement=separate"
        sharded = "trainer.checkpoint_format=sharded"  # each TP worker writes its shards, the one reads all
        tp = ["trainer.num_workers=2", "actor.tensor_model_parallel_size=2", ref, sharded]
        half = train_flow("configs/arith_grpo.yaml", ov + [out, *tp, f"trainer.iterations={ITERATIONS - 2}"])
        resumed = train_flow(
            "configs/arith_grpo.yaml", ov + [out, ref, here]
        )  # one worker, from TP2's checkpoint
    s1 = scores(tmp_path, one["run_id"])
    # the finished TP2 run's iterations, then the resumed one's (a run extended past its end logs a new MLflow run)
    s_tp = scores(tmp_path, half["run_id"]) + scores(tmp_path, resumed["run_id"])
    assert resumed["run_id"] != half["run_id"] and len(s1) == len(s_tp) == ITERATIONS
    assert max(abs(a - b) for a, b in zip(s1, s_tp)) <= 1e-6, (
        s1,
        s_tp,
    )  # the same rollouts, iteration by iteration
    from components.models import load_model

    w1 = dict(load_model(one["final_model"]).named_parameters())
    w_tp = dict(load_model(resumed["final_model"]).named_parameters())
    moved = max(float((w1[k] - w0).abs().max()) for k, w0 in load_model(tmp_path / "sft").named_parameters())
    assert moved > 1e-3 and max(float((w1[k] - w_tp[k]).abs().max()) for k in w1) < 1e-4
    kl = scores(tmp_path, half["run_id"], "actor/kl_loss")
    assert len(kl) == ITERATIONS - 2 and kl[-1] > 0
    assert len(scores(tmp_path, half["run_id"], "timing_s/ref")) == ITERATIONS - 2  # the reference's actor
    (run,) = (tmp_path / "tp" / "runs").iterdir()
    shards = run / "checkpoints" / f"iter_{ITERATIONS - 2:06d}" / "model" / "shards"
    assert len(list(shards.glob("*.safetensors"))) == 2  # by both TP workers, verified by the manifest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port: int, env: dict, nodes: int = 1, timeout: float = 120) -> None:
    """Until the cluster at `port` has `nodes` live nodes: its GCS port open, then one driver that asks until
    then (each driver is a process importing Ray, ~1.5 CPU-seconds: not one a second)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    probe = (
        "import ray, sys, time; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "deadline = time.time() + float(sys.argv[3])\n"
        "while sum(n['Alive'] for n in ray.nodes()) != int(sys.argv[2]) and time.time() < deadline:\n"
        "    time.sleep(0.5)\n"
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    err = ""
    while time.time() < deadline:  # again only if the driver could not join yet (the head still starting)
        res = subprocess.run(
            [
                sys.executable,
                "-c",
                probe,
                f"127.0.0.1:{port}",
                str(nodes),
                str(max(deadline - time.time(), 1)),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout + 60,
            check=False,
        )
        if res.returncode == 0 and res.stdout.strip().splitlines()[-1:] == [str(nodes)]:
            return
        err = res.stderr[-2000:]
        time.sleep(1)
    raise TimeoutError(f"the Ray cluster on port {port} did not reach {nodes} nodes: {err}")


def test_a_token_auth_cluster_of_two_nodes_runs_updates_and_training_and_refuses_what_it_cannot(
    tmp_path, prefect_api, monkeypatch
):
    """Two nodes started as a user starts them (`ray start --head`, `ray start --address`, token auth on, as
    `ray start` turns it on wherever a token exists): a driver given only RAY_AUTH_TOKEN joins; a wrong or
    missing token, and more workers than the cluster holds, stop `reinforge train` with one line and exit 2
    before any training; trainer.min_workers lets the run start with fewer, and it logs how many
    (workers/policy); custom resources place the policy workers on one node and the engine on the other; a
    run with a policy worker on each node loses one node and goes on with one worker; both runs end with the
    model a single machine trains."""
    import json
    import secrets

    from safetensors.torch import load_file

    from tests.flows.test_user_data import base_model, jsonl, overrides, string_rows

    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    # the cluster's GCS marks a node dead after 3 missed health checks a second apart (Ray's default: 5, 3 s
    # apart), so the run that loses one rebuilds on what is left sooner
    env |= {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    env.pop("RAY_ADDRESS", None)
    # a user's own cluster, started from a shell: not the loopback-only switch of our local instances
    env.pop(RAY_LOOPBACK, None)
    ray_bin = str(Path(sys.executable).parent / "ray")
    common = ["--num-cpus=2", "--block", "--disable-usage-stats"]
    head = subprocess.Popen(
        [ray_bin, "start", "--head", f"--port={port}", "--include-dashboard=false", *common]
        + ['--resources={"rollout": 1}'],  # the head samples, the second node trains
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    nodes = [head]
    address = f"127.0.0.1:{port}"
    # a driver as a user runs one: the token alone, no RAY_AUTH_MODE
    driver = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"} | {"RAY_ADDRESS": address}

    def second_node() -> None:
        """The node that trains: `ray start --address` with a `trainer` resource, until the cluster has two."""
        nodes.append(
            subprocess.Popen(
                [ray_bin, "start", f"--address={address}", *common, '--resources={"trainer": 2}'],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        _wait_for(port, env, nodes=2)

    try:
        _wait_for(port, env)
        second_node()
        # the line a driver that finds no node under its address gets names the addresses they did register
        # under, asked of this GCS (in a child: its client keeps the token of the environment it starts in)
        said = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from components.training.cluster import no_local_node as f; print(f({address!r}))",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert f"RAY_ADDRESS={address}: the cluster answers there" in said and "none found" not in said, said

        # `reinforge train` against it: a project of a newcomer's (a base model, a JSONL file)
        base_model(tmp_path / "base")
        jsonl(tmp_path / "train.jsonl", string_rows(24))
        jsonl(tmp_path / "test.jsonl", string_rows(6, start=40))
        cli = driver | {
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
            "PREFECT_API_URL": prefect_api,
        }

        def train(*extra: str, **env_changes: str | None) -> tuple[int, str, float]:
            run_env = {k: v for k, v in (cli | env_changes).items() if v is not None}
            started = time.monotonic()
            res = subprocess.run(
                [str(Path(sys.executable).with_name("reinforge")), "train", "--config", CONFIG]
                + overrides(tmp_path, ON_RAY, EXACT, *extra),
                cwd=ROOT,
                env=run_env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            return res.returncode, res.stderr, time.monotonic() - started

        def one_line(err: str, pattern: str) -> None:
            assert "Traceback" not in err and err.count("error:") == 1, err[-3000:]
            assert re.search(pattern, err), err[-3000:]
            assert "InvalidAuthToken" not in err  # Ray's own retry warnings stay off the terminal

        rc, err, took = train(RAY_AUTH_TOKEN="wrong" + token[5:])
        assert rc == 2 and took < 30, (rc, took)
        one_line(err, rf"RAY_ADDRESS={address}: the cluster refused this process's Ray auth token")
        rc, err, _ = train(RAY_AUTH_TOKEN=None, RAY_AUTH_TOKEN_PATH=str(tmp_path / "no_token"))
        assert rc == 2
        one_line(
            err, r"requires a Ray auth token and this process sends none \(it has none\); set RAY_AUTH_TOKEN"
        )
        # 4 CPUs, one of them the rollout engine's: no room for 4 policy workers, and no fewer allowed
        rc, err, _ = train("trainer.num_workers=4")
        assert rc == 2
        one_line(err, r"room for 3 policy worker\(s\) .* fewer than trainer\.num_workers=4\. .*min_workers")
        assert not list(tmp_path.glob("out/runs/*/checkpoints/iter_*"))  # refused before any training
        # placed by custom resources: the policy workers where `trainer` is (2 of them fit), the engine where
        # `rollout` is; min_workers lets the run start with the 2. SGD: the runs compared below, on 2 workers
        # and then 1, make the same steps within rounding; Adam's first steps (lr x sign of the gradient) would
        # turn that rounding into a whole lr on near-zero gradients (as in the test above)
        separate = ("trainer.rollout_placement=separate", "trainer.rollout_resources={rollout: 1}")
        sgd = ("trainer.iterations=4", "trainer.save_interval=1", "actor.optimizer.type=sgd")
        sgd += ("actor.optimizer.lr=0.5",)
        placed = ("trainer.worker_resources={CPU: 1, trainer: 1}", *separate, *sgd)
        rc, err, _ = train("trainer.num_workers=4", "trainer.min_workers=2", *placed)
        assert rc == 0, err[-3000:]
        client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
        experiments = [e.experiment_id for e in client.search_experiments()]
        (run,) = client.search_runs(experiments, "attributes.status = 'FINISHED'")  # the refused one is not
        used = [m.value for m in client.get_metric_history(run.info.run_id, "workers/policy")]
        assert used == [2.0] * 4, used
        assert "starting 2 policy workers instead of trainer.num_workers=4" in err
        where = placements(driver | {"RAY_AUTH_MODE": "token"})  # a plain Ray driver needs the mode too
        assert where["PolicyWorker"] == ["trainer", "trainer"] and where["RolloutWorker"] == ["rollout"], (
            where
        )

        # `reinforge diagnose` reads the cluster's resources (both nodes' CPUs), and says why it cannot
        from components.diagnose import describe_resources, ray_cluster_resources, ray_resources_check

        for key, value in driver.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        resources = ray_cluster_resources(address)
        assert describe_resources(resources).startswith("CPU 4, GPU 0, memory "), resources
        monkeypatch.setenv("RAY_AUTH_TOKEN", "wrong" + token[5:])
        check = ray_resources_check(address)
        assert check.status == "fail" and "refused this process's Ray auth token" in check.found, check

        # the second node lost (its raylet and workers SIGKILLed) in the middle of a run whose policy workers
        # span both nodes (Ray spreads them): the run goes on with one worker from its last checkpoint; then the
        # node comes back and the next run uses it
        lost = ("trainer.num_workers=2", *separate, *sgd)
        run = subprocess.Popen(
            [str(Path(sys.executable).with_name("reinforge")), "train", "--config", CONFIG]
            + overrides(
                tmp_path, ON_RAY, EXACT, *lost, "trainer.min_workers=1", f"trainer.output_dir={tmp_path}/lost"
            ),
            cwd=ROOT,
            env=cli,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + 300
        while time.time() < deadline and not list(tmp_path.glob("lost/runs/*/checkpoints/iter_000002")):
            time.sleep(0.05)
        os.killpg(nodes[1].pid, signal.SIGKILL)
        err = run.communicate(timeout=600)[1]
        assert run.returncode == 0, err[-3000:]
        assert re.search(
            r"iteration [34]: a worker died \(\w+\); rebuilding from the last checkpoint", err
        ), err
        where = placements(driver | {"RAY_AUTH_MODE": "token"})
        assert len(set(where["PolicyWorker"])) == 2, where  # the first two workers, one on each node
        (state,) = tmp_path.glob("lost/runs/*/checkpoints/iter_000004/state.json")
        lost_run = json.loads(state.read_text())["mlflow_run_id"]
        history = client.get_metric_history(lost_run, "critic/score/mean")
        assert sorted(m.step for m in history) == [1, 2, 3, 4]  # nothing logged twice
        used = sorted(client.get_metric_history(lost_run, "workers/policy"), key=lambda m: m.step)
        used = [m.value for m in used]
        assert used[:2] == [2.0] * 2 and used[-1] == 1.0, used  # the event, as a metric
        # both cluster runs end with the model the same run trains on one machine, its one worker in the
        # driver's process (trainer.backend=local: no cluster, no Ray, no custom resources): within rounding, as
        # one worker sums the gradient in another order than two (1.1e-8 measured), against weights that moved
        # by more than 1e-3
        local = {"RAY_ADDRESS": None, "RAY_AUTH_TOKEN": None}
        alone = ("trainer.backend=local", separate[0], *sgd, f"trainer.output_dir={tmp_path}/whole")
        rc, err, _ = train(*alone, **local)
        assert rc == 0, err[-3000:]
        assert_same_final(tmp_path / "out", tmp_path / "whole", 1e-5)
        assert_same_final(tmp_path / "lost", tmp_path / "whole", 1e-5)
        (final,) = tmp_path.glob("lost/runs/*/final/model.safetensors")
        moved, base = load_file(final), load_file(tmp_path / "base" / "model.safetensors")
        assert max(float((moved[k] - base[k]).abs().max()) for k in moved) > 1e-3
        second_node()
        rc, err, _ = train("trainer.num_workers=2", f"trainer.output_dir={tmp_path}/back")
        assert rc == 0, err[-3000:]  # 2 workers and the engine need both nodes' CPUs: without min_workers
    finally:
        _stop_cluster(nodes, port)


PLACEMENTS = textwrap.dedent("""
    import json, ray
    ray.init(logging_level="ERROR")  # RAY_ADDRESS
    # a node by its custom resources (a lost node's may be gone from what the GCS keeps: then by its id)
    nodes = {
        n["NodeID"]: sorted(k for k in n["Resources"] if k in ("trainer", "rollout")) or [n["NodeID"]]
        for n in ray.nodes()
    }
    actors = list(ray._private.state.actors().values())
    last = max(a["JobID"] for a in actors)  # the last run's actors
    out = {}
    for a in sorted(actors, key=lambda a: a["ActorClassName"]):
        if a["JobID"] == last:
            out.setdefault(a["ActorClassName"], []).extend(nodes[a["Address"]["NodeID"]])
    print(json.dumps(out))
""")


def placements(env: dict) -> dict[str, list[str]]:
    """{actor class: the custom resources of the node each of its actors ran on} of the cluster's last job,
    read from Ray's GCS as a driver of the cluster."""
    import json

    res = subprocess.run(
        [sys.executable, "-c", PLACEMENTS], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def assert_same_final(out_a: Path, out_b: Path, tol: float) -> None:
    """The final models of the runs in output directories `out_a` and `out_b` are equal within `tol`."""
    from safetensors.torch import load_file

    (a,) = out_a.glob("runs/*/final/model.safetensors")
    (b,) = out_b.glob("runs/*/final/model.safetensors")
    wa, wb = load_file(a), load_file(b)
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= tol


def _stop_cluster(nodes: list[subprocess.Popen], port: int) -> None:
    """Stop only this cluster (`ray stop` would stop the test session's own Ray too): the `ray start`
    process groups, then any of its daemons that name its port."""
    import psutil

    for p in reversed(nodes):  # killed: `ray start --block` takes ~30 s over SIGTERM, and nothing is kept
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    # the port itself, not a longer number that starts with it (another run's port, a memory size)
    names_port = re.compile(rf"[:=]{port}(?!\d)")
    daemons = [
        q
        for q in psutil.process_iter(["cmdline"])
        if any(names_port.search(a) for a in (q.info["cmdline"] or []))
    ]
    for q in daemons:
        with contextlib.suppress(psutil.NoSuchProcess):
            q.kill()
    psutil.wait_procs(daemons, timeout=10)
    current = Path("/tmp/ray/ray_current_cluster")  # `ray start` leaves its address for a later ray.init()
    if current.is_file() and current.read_text().strip().endswith(f":{port}"):
        current.unlink()
