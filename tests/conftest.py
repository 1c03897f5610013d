"""Shared fixtures: a tiny model saved in HF format, small datasets, isolated MLflow/Prefect state."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from components.env import apply_defaults

# this session's stage results in a directory of its own: a second run of the suite in the same checkout is
# never served the first run's (a stage's cache key is what it reads, not where it writes)
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = tempfile.mkdtemp(prefix="reinforge-test-results-")
atexit.register(shutil.rmtree, os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"], True)

# the defaults every entry point sets (components/env.py), before any test module imports Prefect: Prefect
# reads its logging settings once, when imported, and the run loggers' INFO level is what sends each
# iteration's line to the server; a test module that imported Prefect first kept every later flow run's logs
# off it
apply_defaults()
os.environ.setdefault("PYTHONWARNINGS", "ignore")

# pytest rewrites (parses with `ast`) the modules of its plugins' distributions (hypothesis among them) and any
# module named conftest as they are imported. Those below were imported lazily, in the middle of a test whose
# threads (Ray's, Prefect's, the reward scorer's) may be parsing too: CPython 3.11's AST constructor shares its
# state across threads (components/pyparse.py), and pandera's first validate failed a CI run with
# "SystemError: AST constructor recursion depth mismatch". Imported here, before any test starts a thread.
import beartype  # noqa: E402, F401  (Prefect's key-value store's; it imports beartype._conf.conftest)
import hypothesis.internal.conjecture.optimiser  # noqa: E402, F401
import pandera.backends.pandas.builtin_checks  # noqa: E402, F401
import pandera.backends.pandas.builtin_hypotheses  # noqa: E402, F401
import pytest  # noqa: E402
import torch  # noqa: E402

from components.models import build_char_tokenizer, build_tiny_model, save_pretrained  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


def make_model(tokenizer, seed: int = 0, hidden: int = 32):
    return build_tiny_model(
        tokenizer,
        hidden_size=hidden,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        max_positions=64,
        seed=seed,
    )


# the files that take longest (end-to-end runs, most of them several processes each), in order
LONGEST_FIRST = (
    "tests/docs/test_doc_runs.py",  # the docs' pipeline blocks, one after another in one checkout (~8 min)
    "tests/flows/test_multi_worker.py",  # the two-node cluster: the longest single test (~4 min)
    "tests/flows/test_dvc.py",
    "tests/flows/test_faults.py",
    "tests/flows/test_nightly.py",
    "tests/flows/test_user_data.py",
    "tests/flows/",
    "tests/components/training/",
)


def pytest_collection_modifyitems(items):
    """The longest files first. The suite runs in two processes (pytest-xdist, --dist loadfile), each file
    whole in the first free one, in collection order: started first, the long files overlap each other,
    and the many short ones fill the end, instead of one long file running alone after the rest are done."""

    def rank(item) -> int:
        return next((i for i, p in enumerate(LONGEST_FIRST) if item.nodeid.startswith(p)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: within a rank, the collection's order


def arith_rows(count: int) -> list[dict]:
    """`count` prompts a+a= (a = 0, 1, ...) as rows of the cleaned dataset."""
    return [
        {
            "prompt": f"{a}+{a}=",
            "reward_model": {"ground_truth": str(2 * a)},
            "data_source": "arith",
            "extra_info": {},
        }
        for a in range(count)
    ]


def refused_in_one_line(args: list[str], **run) -> str:
    """`python -m flows.cli <args>` in a child process (subprocess.run's `run` keywords: cwd, env): it must
    stop with exit 2 and one line on stderr, no traceback. That line."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, timeout=300, **run
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    return res.stderr


def descendants(text: str, pid: int | None = None, recursive: bool = True) -> list:
    """The live descendants (or children) of `pid` (this process) whose command line holds `text`. A child
    that exits while we look, or is a zombie awaiting its parent, is not one (psutil raises for those)."""
    import psutil

    def matches(process: psutil.Process) -> bool:
        try:
            return text in " ".join(process.cmdline())
        except psutil.Error:
            return False

    return [p for p in psutil.Process(pid).children(recursive=recursive) if matches(p)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("tiny_model")
    save_pretrained(make_model(tokenizer), tokenizer, out)
    return out


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from components.training.ray_workers import ensure_ray

    ensure_ray()
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)
