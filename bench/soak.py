"""The nightly, soaked: N nights of `reinforge nightly` back to back on the tiny model, each with one fault from
a fixed list, with nobody watching. A Prefect server of its own carries the pipeline's notifications (Prefect
automations POSTing to a local webhook receiver), MLflow's registry is a SQLite store, and the training output
lives on a size-limited tmpfs (so a full disk is a real ENOSPC; as root only, else that fault is skipped).

    python -m bench.soak --nights 10

It prints one row a night: the fault, how the night ended (exit code; the last line it printed), what it
registered and why, the messages the webhook got about that night, whether the champion is then the best version
with a finite metric, and whether the night left its checkpoints whole. Then the summary the issue's target reads:
nothing wrong promoted, every failure one line and one message, nothing lost, every failed night followed by a
good one with no hand on the machine (the soak only restarts the Prefect server it killed, as a service manager
would, and frees the disk it filled).

The faults, in order: none, a killed policy worker (SIGKILL after checkpoint 1), the champion's recorded metric
NaN (a registry record written before the gate refused NaN), the Prefect server killed mid-training, a diverging
run (actor.optimizer.lr=1e20), the champion's version deleted by hand, a full disk at a checkpoint, and a
loaded machine (4 busy processes per core through the night); then again from the top.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.paths import paths_under

PROJECT = Path(__file__).resolve().parents[1]
PIPELINE, FLOW, MODEL = "nightly", "rl-nightly", "reinforge-arith"
FAULTS = (
    "none",
    "killed worker",
    "NaN metric",
    "killed Prefect server",
    "diverging run",
    "deleted champion",
    "full disk",
    "loaded machine",
)
# how a night with each fault should end: 0, or 2 with one line (a failure reported by notification)
FAILS = {"killed Prefect server", "diverging run", "full disk"}
DISK_MIB = 1024


class Receiver:
    """A webhook on a loopback port: every JSON body POSTed to it is kept, in order."""

    def __init__(self):
        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def wait(self, count: int = 1, timeout_s: float = 120.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while len(self.received) < count and time.monotonic() < deadline:
            time.sleep(0.5)
        return self.received

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefectServer:
    """`prefect server start` on a loopback port, its database in `home` (kept across a kill and restart)."""

    def __init__(self, home: Path):
        self.home, self.port, self.proc = home, free_port(), None
        self.url = f"http://127.0.0.1:{self.port}/api"

    def start(self, timeout_s: float = 240.0) -> None:
        env = {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        prefect = str(Path(sys.executable).with_name("prefect"))
        self.proc = subprocess.Popen(
            [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(self.port), "--no-ui"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(self.url + "/health", timeout=2).read() == b"true":
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("prefect server did not start")
            time.sleep(0.5)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def overrides(root: Path) -> list[str]:
    """The default pipeline's model and SFT (held-out accuracy ~0.3) on less data, under `root`: a night is
    about a minute on 2 cores, the first (data and SFT) a few."""
    return [
        *paths_under(root, "out/nightly"),
        "data.num_train=2000",
        "data.num_eval=60",
        "data.batch_size=16",
        "trainer.iterations=4",
        "trainer.test_interval=4",
        "trainer.save_interval=1",
        "trainer.max_checkpoints_to_keep=2",
        "trainer.eval_k=2",
        "trainer.progress=false",
        "trainer.experiment_name=soak",
        "trainer.log_system_metrics=false",
    ]


# each night's learning rate (as nightly data would, they make the candidates differ; the evaluation set stays)
LEARNING_RATES = ("1e-4", "4e-4", "5e-5", "2e-4", "8e-4")
# a state change comes with a link to the run's previous one when that is under 5 minutes old, and Prefect's
# triggers hold an event whose link they never saw (a restarted server) for 15 minutes: a real next night comes
# a day later, so after the night whose server was killed the soak waits past those 5 minutes
NEXT_NIGHT_AFTER_S = 330


@dataclass
class Night:
    number: int
    fault: str
    code: int | None = None
    last_line: str = ""
    error_lines: int = 0
    traceback: bool = False
    registered: str = "nothing"
    flow_run: str = ""
    messages: list[str] = field(default_factory=list)
    champion_ok: bool = True
    whole: bool = True
    note: str = ""
    ended: float = 0.0

    @property
    def failed(self) -> bool:
        return self.code != 0

    @property
    def as_expected(self) -> bool:
        return (self.fault in FAILS) == self.failed or self.note.startswith("skipped")


class Soak:
    def __init__(self, root: Path):
        self.root = root
        self.receiver = Receiver()
        self.server = PrefectServer(root / "prefect")
        self.tracking = f"sqlite:///{root}/mlflow.db"
        self.out = root / "out"
        self.ov = overrides(root)
        self.tmpfs = False

    # -- setup and the services --------------------------------------------------------------------------

    def setup(self) -> None:
        self.out.mkdir(parents=True)
        if os.geteuid() == 0:
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={DISK_MIB}m,mode=0700", "tmpfs", str(self.out)],
                capture_output=True,
            )
            self.tmpfs = mounted.returncode == 0
        self.server.start()
        os.environ["PREFECT_API_URL"] = self.server.url
        from flows.notifications import Notify, configure

        configure(PIPELINE, FLOW, Notify(webhook=self.receiver.url))

    def teardown(self) -> None:
        if self.server.alive():
            self.server.kill()
        self.receiver.close()
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.out)], capture_output=True)

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.tracking, registry_uri=self.tracking)

    # -- one night ------------------------------------------------------------------------------------------

    def run_dir(self) -> Path | None:
        runs = sorted((self.out / "nightly" / "runs").glob("*"), key=lambda p: p.stat().st_mtime)
        return runs[-1] if runs else None

    def latest(self) -> str | None:
        run = self.run_dir()
        pointer = run / "checkpoints" / "latest" if run else None
        return pointer.read_text().strip() if pointer and pointer.is_file() else None

    def wait_for_checkpoint(self, proc: subprocess.Popen, name: str, started: float) -> bool:
        while proc.poll() is None:
            run = self.run_dir()
            if run and run.stat().st_mtime >= started and self.latest() == name:
                return True
            time.sleep(0.2)
        return False

    def night(self, number: int, fault: str) -> Night:
        record = Night(number, fault)
        extra, before = self.before_night(record)
        if not any(o.startswith("actor.optimizer.lr=") for o in extra):  # the fault's own rate wins
            extra = [f"actor.optimizer.lr={LEARNING_RATES[(number - 1) % len(LEARNING_RATES)]}", *extra]
        env = {
            **os.environ,
            "MLFLOW_TRACKING_URI": self.tracking,
            "PREFECT_API_URL": self.server.url,
            "PYTHONUNBUFFERED": "1",
            "PREFECT_LOGGING_LEVEL": "WARNING",
        }
        cmd = [sys.executable, "-m", "flows.cli", "nightly", "--config", "configs/arith_grpo.yaml", "--json"]
        started = time.time()
        proc = subprocess.Popen(
            [*cmd, *self.ov, *extra],
            cwd=PROJECT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        during = threading.Thread(target=self.during_night, args=(record, proc, started), daemon=True)
        during.start()
        out, err = proc.communicate(timeout=1800)
        during.join(60)
        self.after_night(record, before)
        record.code = proc.returncode
        lines = [line for line in err.strip().splitlines() if line.strip()]
        record.error_lines = sum(line.startswith("error:") for line in lines)
        record.traceback = "Traceback" in err
        record.last_line = lines[-1] if lines and record.failed else ""
        if record.code == 0:
            reg = json.loads(out[out.index("{") :])["registry"]
            record.registered = f"v{reg['version']} -> {reg['alias']}: {reg['reason']}"
        record.flow_run = self.newest_flow_run()
        record.champion_ok = self.champion_is_best()
        record.whole = self.checkpoints_whole()
        return record

    def before_night(self, record: Night) -> tuple[list[str], object]:
        """The fault's part before the night starts; returns the night's extra overrides and what to undo."""
        client = self.client()
        fault = record.fault
        if fault == "diverging run":
            return ["actor.optimizer.lr=1e20"], None
        if fault in ("NaN metric", "deleted champion"):
            try:
                champ = client.get_model_version_by_alias(MODEL, "champion")
            except Exception:  # noqa: BLE001 - no champion yet: nothing to break
                record.note = "skipped: no champion yet"
                return [], None
            if fault == "NaN metric":
                client.set_model_version_tag(MODEL, champ.version, "eval_acc", "nan")
                record.note = f"v{champ.version}'s recorded eval_acc set to nan"
            else:
                client.delete_model_version(MODEL, champ.version)
                record.note = f"v{champ.version} (the champion) deleted"
        if fault == "full disk":
            if not self.tmpfs:
                record.note = "skipped: needs root for a size-limited tmpfs"
                return [], None
            ballast = self.out / "ballast"
            free = shutil.disk_usage(self.out).free
            ckpt = self.checkpoint_bytes()
            # room for the run's first checkpoint, not for its second (the older is kept until a newer exists)
            ballast.write_bytes(b"\0" * max(0, free - int(1.5 * ckpt)))
            record.note = f"{shutil.disk_usage(self.out).free / 2**20:.1f} MiB left on the output's disk"
            return [], ballast
        if fault == "loaded machine":
            hogs = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(4 * (os.cpu_count() or 2))
            ]
            record.note = f"{len(hogs)} busy processes"
            return [], hogs
        return [], None

    def during_night(self, record: Night, proc: subprocess.Popen, started: float) -> None:
        if record.fault == "killed worker" and self.wait_for_checkpoint(proc, "iter_000001", started):
            workers = [
                p
                for p in psutil.Process(proc.pid).children(recursive=True)
                if "ColocatedWorker" in " ".join(p.cmdline())
            ]
            for p in workers:
                p.kill()
            record.note = f"SIGKILL to {len(workers)} policy worker(s) after checkpoint 1"
        if record.fault == "killed Prefect server" and self.wait_for_checkpoint(proc, "iter_000001", started):
            self.server.kill()
            record.note = "SIGKILL to the Prefect server after checkpoint 1"

    def after_night(self, record: Night, undo) -> None:
        if record.fault == "full disk" and undo is not None:
            undo.unlink(missing_ok=True)  # the disk freed
        if record.fault == "loaded machine" and undo:
            for hog in undo:
                hog.kill()
                hog.wait()
        if not self.server.alive():
            self.server.start()  # as a service manager would

    # -- what the night left ----------------------------------------------------------------------------------

    def checkpoint_bytes(self) -> int:
        from components.tracking.checkpoints import tree_bytes

        run = self.run_dir()
        found = sorted(run.glob("checkpoints/iter_*")) if run else []
        return tree_bytes(found[-1]) if found else 4 * 2**20

    def checkpoints_whole(self) -> bool:
        """Every checkpoint of every run verifies, and `latest` names one of them (or there is none yet)."""
        from components.errors import CheckpointError
        from components.tracking import checkpoints

        for run in (self.out / "nightly" / "runs").glob("*"):
            root = run / "checkpoints"
            try:
                for ckpt in root.glob("iter_*"):
                    checkpoints.verify(ckpt)
            except CheckpointError:
                return False
            if (root / "latest").is_file() and not (root / (root / "latest").read_text().strip()).is_dir():
                return False
        return True

    def champion_is_best(self) -> bool:
        """The champion is the best version with a finite recorded metric on the evaluation set (versions
        whose record was corrupted by the soak excluded), or there is no version with one."""
        from components.tracking.registry import Recorded

        client = self.client()
        try:
            versions = [Recorded.of(v) for v in client.search_model_versions(f"name='{MODEL}'")]
        except Exception:  # noqa: BLE001 - no model registered yet
            return True
        valid = [v for v in versions if v.valid]
        if not valid:
            return True
        try:
            champ = str(client.get_model_version_by_alias(MODEL, "champion").version)
        except Exception:  # noqa: BLE001 - no alias
            return False
        best = max(v.acc for v in valid)
        mine = next((v for v in valid if v.version == champ), None)
        return mine is not None and math.isclose(mine.acc, best)

    def newest_flow_run(self) -> str:
        from prefect import get_client
        from prefect.client.schemas.filters import FlowFilter, FlowFilterName
        from prefect.client.schemas.sorting import FlowRunSort

        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW])),
                sort=FlowRunSort.START_TIME_DESC,
                limit=1,
            )
        return runs[0].name if runs else ""


def attribute(nights: list[Night], received: list[dict]) -> None:
    """Each message to the night whose flow run it names."""
    for message in received:
        body = message.get("body", "")
        for night in nights:
            if night.flow_run and f"flow run {night.flow_run} " in body:
                night.messages.append(body.splitlines()[0])


def table(nights: list[Night]) -> str:
    rows = [
        "| night | fault | outcome | registered | messages | champion best | checkpoints whole |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in nights:
        if n.failed:
            outcome = f"exit {n.code}: `{n.last_line[:160]}`" + (" (traceback!)" if n.traceback else "")
        else:
            outcome = "exit 0"
        if n.note:
            outcome += f" [{n.note}]"
        messages = "<br>".join(m[:160] for m in n.messages) or "none"
        rows.append(
            f"| {n.number} | {n.fault} | {outcome} | {n.registered[:120]} | {messages} | "
            f"{'yes' if n.champion_ok else 'NO'} | {'yes' if n.whole else 'NO'} |"
        )
    return "\n".join(rows)


def is_failure(message: str) -> bool:
    return any(f"ended {state}:" in message for state in ("Failed", "Crashed", "TimedOut"))


def summary(nights: list[Night]) -> dict:
    failed = [n for n in nights if n.failed]
    good = [n for n in nights if not n.failed]
    after_failure = [nights[i + 1] for i, n in enumerate(nights[:-1]) if n.failed]
    challengers = [n for n in good if "-> challenger" in n.registered]
    return {
        "nights": len(nights),
        "nights that ended as their fault should": sum(n.as_expected for n in nights),
        "failed nights": len(failed),
        "failed nights in one line, no traceback": sum(
            n.error_lines == 1 and not n.traceback for n in failed
        ),
        "failed nights with exactly one failure message": sum(
            sum(map(is_failure, n.messages)) == 1 for n in failed
        ),
        "good nights with a failure message": sum(any(map(is_failure, n.messages)) for n in good),
        "challengers announced / registered": f"{sum(bool(n.messages) for n in challengers)} / {len(challengers)}",
        "nights after which the champion was not the best valid version": sum(
            not n.champion_ok for n in nights
        ),
        "nights that left a checkpoint broken": sum(not n.whole for n in nights),
        "failed nights followed by a good one (or by the next planned fault)": (
            f"{sum(not n.failed or n.fault in FAILS for n in after_failure)} / {len(after_failure)}"
        ),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nights", type=int, default=10, help="nights to run (the faults cycle)")
    p.add_argument("--root", help="working directory (default: a new temporary one, removed after)")
    a = p.parse_args(argv)
    root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="soak-"))
    soak = Soak(root)
    nights: list[Night] = []
    began = time.time()
    try:
        soak.setup()
        for number in range(1, a.nights + 1):
            if nights and nights[-1].fault == "killed Prefect server":
                wait = NEXT_NIGHT_AFTER_S - (time.time() - nights[-1].ended)
                print(
                    f"  (the next night comes {max(wait, 0):.0f} s later: see NEXT_NIGHT_AFTER_S)", flush=True
                )
                time.sleep(max(wait, 0))
            night = soak.night(number, FAULTS[(number - 1) % len(FAULTS)])
            night.ended = time.time()
            nights.append(night)
            print(f"night {number}: {night.fault}: exit {night.code} {night.last_line[:120]}", flush=True)
        soak.receiver.wait(sum(n.failed for n in nights), timeout_s=60)
        time.sleep(5)  # a not-promoted message of the last night
        attribute(nights, soak.receiver.received)
    finally:
        soak.teardown()
        if not a.root:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(table(nights))
    print()
    for key, value in summary(nights).items():
        print(f"{key}: {value}")
    print(
        f"wall: {(time.time() - began) / 60:.1f} min, disk for checkpoints: {'tmpfs' if soak.tmpfs else 'plain'}"
    )


if __name__ == "__main__":
    main()
