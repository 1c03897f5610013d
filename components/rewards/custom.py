"""`custom_reward_function.{path, name}`: a user's scorer loaded from a Python file inside the project.

The module is pickled by value, so Ray workers that score in other processes get the same function without
the file being importable there. Errors name the file and line.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import traceback
from functools import lru_cache
from pathlib import Path

from components.errors import ConfigError


def _line_in(exc: BaseException, path: Path) -> str:
    """`file:line` of the deepest frame of exc's traceback inside `path` (or just the file)."""
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"{path}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path]
    return f"{path}:{frames[-1].lineno}" if frames else str(path)


def check_custom_reward(cfg) -> None:
    """At config validation: custom_reward_function.path is a Python file inside the project that imports and
    defines `name` with the reward signature (ConfigError naming the key, the file and line otherwise)."""
    if cfg.custom_reward_function.path:
        load_custom_reward(cfg.custom_reward_function.path, cfg.custom_reward_function.name)


def load_custom_reward(path: str, name: str):
    """The function `name` of the file at `path` (relative to the working directory, which must contain it),
    loaded once per file content."""
    root, file = Path.cwd().resolve(), Path(path).resolve()
    if root not in file.parents:
        raise ConfigError(
            f"custom_reward_function.path={path}: resolves to {file}, outside the project "
            f"{root}. Put the file inside the project and give its relative path."
        )
    if not file.is_file() or file.suffix != ".py":
        raise ConfigError(
            f"custom_reward_function.path={path}: no Python file there. Give the path of a .py "
            "file that defines the reward function."
        )
    stat = file.stat()
    return _load(path, file, name, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=8)
def _load(path: str, file: Path, name: str, _mtime_ns: int, _size: int):
    module_name = f"reinforge_custom_reward_{abs(hash(str(file)))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ConfigError(
            f"custom_reward_function.path={path}: loading it failed at {_line_in(exc, file)}: "
            f"{type(exc).__name__}: {exc}. Fix the file."
        ) from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(
            f"custom_reward_function.name={name}: {path} defines no function {name!r} (it has: "
            f"{', '.join(found) or 'none'}). Set custom_reward_function.name to one of them."
        )
    try:
        inspect.signature(fn).bind("response", "ground truth", {})
    except TypeError as exc:
        raise ConfigError(
            f"custom_reward_function.name={name}: {path} defines {name}{inspect.signature(fn)}, but a "
            f"reward function is called as {name}(response_text, ground_truth, extra_info) ({exc}). "
            "Give it those three parameters."
        ) from None
    except ValueError:  # no signature to read (a builtin): it is called and checked at the first batch
        pass
    sys.modules[module_name] = module
    import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    try:  # Ray pickles with its own copy of cloudpickle
        from ray import cloudpickle as ray_cloudpickle

        ray_cloudpickle.register_pickle_by_value(module)
    except ImportError:
        pass
    return _Located(fn, file)


class _Located:
    """The user's function, with where it came from for error messages (`origin`)."""

    def __init__(self, fn, file: Path):
        self.fn, self.file = fn, file
        self.origin = f"{getattr(fn, '__name__', 'the function')} in {file} (custom_reward_function)"

    def __call__(self, response_text, ground_truth, extra_info):
        try:
            return self.fn(response_text, ground_truth, extra_info)
        except Exception as exc:
            raise RuntimeError(f"{_line_in(exc, self.file)}: {type(exc).__name__}: {exc}") from exc
