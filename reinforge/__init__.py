"""reinforge: RL post-training for LLMs (GRPO, PPO and their kin) as a versioned Prefect/DVC workflow,
tracked in MLflow.

    >>> import reinforge
    >>> cfg = reinforge.load_config("configs/arith_grpo.yaml", ["trainer.iterations=5"])
    >>> reinforge.train_flow("configs/arith_grpo.yaml", ["trainer.iterations=5"])  # doctest: +SKIP

The version is the installed distribution's, which pyproject.toml sets (one source of truth). The entry
points below are imported on first use, so `import reinforge` stays cheap (no torch, Ray or Prefect).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("reinforge")
except PackageNotFoundError:  # a source tree that was never installed: `make install` installs it
    __version__ = "0+unknown"

# public name -> the module that defines it (and its name there, when another)
_ENTRY_POINTS = {
    "Config": "components.config",
    "load_config": "components.validate:load_checked",  # every rule, the model directories' too
    "make_plan": "components.plan",
    "data_flow": "flows.data",
    "sft_flow": "flows.sft",
    "train_flow": "flows.train",
    "evaluate_flow": "flows.evaluate",
    "nightly_flow": "flows.nightly",
    "reference_config": "components.reference",
}

__all__ = ["__version__", *_ENTRY_POINTS]


def __getattr__(name: str):
    if name not in _ENTRY_POINTS:
        raise AttributeError(f"module 'reinforge' has no attribute {name!r}; it offers {', '.join(__all__)}")
    module, _, attr = _ENTRY_POINTS[name].partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value
    return value
