"""A full disk is recognised however a library words it, and becomes one line."""

from __future__ import annotations

import errno

import pytest
import torch
from safetensors.torch import save_file

from components.errors import OutputError, no_space


def safetensors_full_disk() -> Exception:
    """What safetensors' writer raised when the soak's tmpfs filled (its own type, its words)."""
    from safetensors import SafetensorError

    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


class RayLike(Exception):
    """An error that carries the worker's exception as `cause`, as Ray's RayTaskError does."""

    def __init__(self, cause):
        super().__init__("ray::PolicyWorker.write_checkpoint() failed")
        self.cause = cause


def chained() -> Exception:
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("saving failed") from inner
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        safetensors_full_disk(),
        RayLike(safetensors_full_disk()),
        RayLike(OSError(errno.ENOSPC, "No space left on device")),
        chained(),
    ],
    ids=["oserror", "safetensors", "ray-safetensors", "ray-oserror", "quota-chained"],
)
def test_a_full_disk_is_recognised_however_it_is_worded(exc):
    assert no_space(exc) is not None


@pytest.mark.parametrize(
    "exc", [OSError(errno.EACCES, "Permission denied"), ValueError("bad"), RayLike(KeyError())]
)
def test_other_errors_are_not_a_full_disk(exc):
    assert no_space(exc) is None


def test_a_flow_that_meets_a_full_disk_fails_in_one_line():
    from prefect import flow

    from flows._logs import one_line_errors

    @flow(name="writes")
    @one_line_errors
    def writes():
        raise RayLike(safetensors_full_disk())  # the final model's save, in a worker

    with pytest.raises(OutputError) as err:
        writes()
    message = str(err.value)
    assert "\n" not in message and message.startswith("no space left on a disk this run writes to")
    assert "No space left on device" in message and "the same command then resumes" in message


def test_a_checkpoint_a_worker_cannot_write_names_its_directory_and_keeps_latest(tmp_path):
    from components.tracking import checkpoints

    def model(d):
        (d / "model").mkdir()
        (d / "model" / "config.json").write_text("{}")
        save_file({"w": torch.ones(64)}, d / "model" / "model.safetensors")

    first = checkpoints.save_checkpoint(tmp_path, 1, model, {})

    def full(d):
        raise RayLike(safetensors_full_disk())

    with pytest.raises(OutputError) as err:
        checkpoints.save_checkpoint(tmp_path, 2, full, {})
    message = str(err.value)
    assert f"no space left on the device of {tmp_path} writing checkpoint iter_000002" in message
    assert "`latest` still names iter_000001" in message
    assert (tmp_path / "latest").read_text().strip() == first.name and not (tmp_path / "iter_000002").exists()
