"""`custom_reward_function.{path, name}`: a user's scorer loaded from a Python file inside the project.

The file is user code, and importing it runs whatever it does at import. So it is first imported in a short-lived
process of its own, at config validation (`check_custom_reward`): a file that exits there (sys.exit, os._exit),
starts a thread that would keep the run alive, hangs, raises, or lacks the function is refused with one line
naming the file (and line), before anything starts. The run itself never imports it in the driver: the scorer
is a `CustomReward` holding the file's source, imported on its first call in the process that scores (the
RewardScorer actor; the evaluation's own process), where an exit or a thread at import is a RewardError naming
the file. Shipped by value, so Ray workers on other nodes score with the same code.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import traceback
import types
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from components.errors import ConfigError, RewardError

CHECK_TIMEOUT_S = 60.0  # importing the file in the check process: a hang there is refused


@dataclass(frozen=True)
class UserCode:
    """A kind of user function loaded from a file of the project: the keys that name its file and function
    (the errors name them), the arguments it is called with (its signature must take them: checked with
    sample values) and how the errors write that call."""

    path_key: str
    name_key: str
    sample_args: str  # JSON: hashable, and what the check process reads
    called_as: str
    what: str


REWARD = UserCode(
    "custom_reward_function.path",
    "custom_reward_function.name",
    '["response", "ground truth", {}]',
    "(response_text, ground_truth, extra_info)",
    "reward",
)


def _line_in(exc: BaseException, path: Path) -> str:
    """`file:line` of the deepest frame of exc's traceback inside `path` (or just the file)."""
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"{path}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path]
    return f"{path}:{frames[-1].lineno}" if frames else str(path)


def _file_of(path: str, kind: UserCode = REWARD) -> Path:
    """The file at `path` (relative to the working directory, which must contain it)."""
    root, file = Path.cwd().resolve(), Path(path).resolve()
    if root not in file.parents:
        raise ConfigError(
            f"{kind.path_key}={path}: resolves to {file}, outside the project "
            f"{root}. Put the file inside the project and give its relative path."
        )
    if not file.is_file() or file.suffix != ".py":
        raise ConfigError(
            f"{kind.path_key}={path}: no Python file there. Give the path of a .py "
            f"file that defines the {kind.what} function."
        )
    return file


def check_custom_reward(cfg) -> None:
    """At config validation: custom_reward_function.path is a Python file inside the project that imports,
    in a process of its own, without exiting, hanging or leaving a thread running, and defines `name` with the
    reward signature (ConfigError or RewardError naming the key, the file and line otherwise)."""
    c = cfg.custom_reward_function
    if c.path:
        file = _file_of(c.path)
        _checked(c.path, str(file), c.name, hashlib.md5(file.read_bytes()).hexdigest())


def load_custom_reward(path: str, name: str, kind: UserCode = REWARD) -> CustomReward:
    """The function `name` of the file at `path` (a scorer by default), checked (check_custom_reward) but not
    imported here."""
    file = _file_of(path, kind)
    source = file.read_bytes()
    _checked(path, str(file), name, hashlib.md5(source).hexdigest(), kind)
    return CustomReward(path, str(file), name, source.decode("utf-8", "replace"), kind)


# run by `python -c` in the check process: import the file, then report on stdout as JSON and leave with
# os._exit, so a thread the file started cannot keep this process alive either
CHECK = r"""
import importlib.util, inspect, json, os, sys, threading, traceback
file, name, sample_args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

def report(**fields):
    sys.stdout.write(json.dumps(fields))
    sys.stdout.flush()
    os._exit(0)

def line_of(exc):
    if isinstance(exc, SyntaxError) and exc.lineno:
        return exc.lineno
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename) == file]
    return frames[-1].lineno if frames else None

before = set(threading.enumerate())
try:
    spec = importlib.util.spec_from_file_location("reinforge_custom_reward_check", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
except SystemExit as exc:
    report(problem="exit", code=repr(exc.code), line=line_of(exc))
except BaseException as exc:
    report(problem="raised", type=type(exc).__name__, message=str(exc)[:300], line=line_of(exc))
threads = [t.name for t in threading.enumerate() if t not in before and not t.daemon]
fn = getattr(module, name, None)
found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
signature, binds = None, True
if callable(fn):
    try:
        signature = str(inspect.signature(fn))
        inspect.signature(fn).bind(*sample_args)
    except TypeError as exc:
        binds = str(exc)
    except ValueError:
        pass
report(threads=threads, callable=callable(fn), found=found, signature=signature, binds=binds)
"""


@lru_cache(maxsize=8)
def _checked(path: str, file: str, name: str, _digest: str, kind: UserCode = REWARD) -> None:
    """Import the file in a process of its own and check what it defines, once per file content."""
    where = f"{kind.path_key}={path}"
    try:
        res = subprocess.run(
            [sys.executable, "-c", CHECK, file, name, kind.sample_args],
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise RewardError(
            f"{where}: importing it did not finish within {CHECK_TIMEOUT_S:g} s; a {kind.what} module must not "
            "block at import (do the work inside the function)."
        ) from None
    try:
        report = json.loads(res.stdout or "null")
    except ValueError:
        report = None
    if not isinstance(report, dict):
        raise RewardError(
            f"{where}: importing it ended the process (exit code {res.returncode}) before it could be "
            f"checked; a {kind.what} module must not exit, kill or replace its process at import."
        )
    at = f"{file}:{report['line']}" if report.get("line") else file
    if report.get("problem") == "exit":
        raise RewardError(
            f"{where}: it calls sys.exit({report['code']}) at import ({at}); a {kind.what} module must not end "
            "the process. Remove the exit, or move it under `if __name__ == '__main__':`."
        )
    if report.get("problem") == "raised":
        raise ConfigError(
            f"{where}: loading it failed at {at}: {report['type']}: {report['message']}. Fix the file."
        )
    if report["threads"]:
        raise RewardError(
            f"{where}: it starts a thread at import ({', '.join(report['threads'])[:80]}) that would keep "
            "the run's process alive after training; start threads inside the function, as daemon threads."
        )
    if not report["callable"]:
        raise ConfigError(
            f"{kind.name_key}={name}: {path} defines no function {name!r} (it has: "
            f"{', '.join(report['found']) or 'none'}). Set {kind.name_key} to one of them."
        )
    if report["binds"] is not True:
        raise ConfigError(
            f"{kind.name_key}={name}: {path} defines {name}{report['signature']}, but a "
            f"{kind.what} function is called as {name}{kind.called_as} "
            f"({report['binds']}). Give it those three parameters."
        )


# the process's imported custom reward modules, by file and content: each is imported once per scoring process
_IMPORTED: dict[tuple[str, str], types.ModuleType] = {}


_import_lock = threading.Lock()


@contextmanager
def _threads_started():
    """The threads the calling thread starts inside the block (others' threads are not counted)."""
    started: list[threading.Thread] = []
    importer, start = threading.current_thread(), threading.Thread.start

    def recording_start(thread, *args, **kwargs):
        if threading.current_thread() is importer:
            started.append(thread)
        return start(thread, *args, **kwargs)

    with _import_lock:
        threading.Thread.start = recording_start
        try:
            yield started
        finally:
            threading.Thread.start = start


class CustomReward:
    """The user's function as data: the file's path and source, imported on the first call in the process
    that scores (the RewardScorer actor, or the evaluation's process), never in the training driver."""

    def __init__(self, path: str, file: str, name: str, source: str, kind: UserCode = REWARD):
        self.path, self.file, self.name, self.source, self.kind = path, file, name, source, kind
        self.origin = f"{name} in {file} ({kind.path_key.split('.')[0]})"

    def function(self):
        key = (self.file, hashlib.md5(self.source.encode()).hexdigest())
        if key not in _IMPORTED:
            _IMPORTED[key] = self._import()
        fn = getattr(_IMPORTED[key], self.name, None)
        if not callable(fn):
            raise RewardError(f"{self.kind.name_key}={self.name}: {self.path} defines no {self.name!r}")
        return fn

    def _import(self) -> types.ModuleType:
        file = Path(self.file)
        module = types.ModuleType(f"reinforge_custom_reward_{abs(hash(self.file))}")
        module.__file__ = self.file
        try:
            with _threads_started() as started:
                exec(compile(self.source, self.file, "exec"), module.__dict__)
        except SystemExit as exc:
            raise RewardError(
                f"{self.kind.path_key}={self.path}: it calls sys.exit({exc.code!r}) at import "
                f"({_line_in(exc, file)}); a {self.kind.what} module must not end the process."
            ) from None
        except Exception as exc:
            raise RewardError(
                f"{self.kind.path_key}={self.path}: importing it failed at {_line_in(exc, file)}: "
                f"{type(exc).__name__}: {exc}."
            ) from None
        held = [t.name for t in started if not t.daemon]
        if held:
            raise RewardError(
                f"{self.kind.path_key}={self.path}: it starts a thread at import ({held[0]}) that "
                "would keep the process alive; start threads inside the function, as daemon threads."
            )
        return module

    def __call__(self, response_text, ground_truth, extra_info):
        fn = self.function()
        try:
            return fn(response_text, ground_truth, extra_info)
        except Exception as exc:
            raise RuntimeError(f"{_line_in(exc, Path(self.file))}: {type(exc).__name__}: {exc}") from exc
