from pathlib import Path

import pytest

from components.locking import AlreadyRunning, exclusive


def test_second_holder_is_refused_with_pid(tmp_path: Path):
    lock = tmp_path / "nightly.lock"
    with (
        exclusive(lock, "pipeline nightly"),
        pytest.raises(AlreadyRunning, match=r"already running \(pid \d+"),
        exclusive(lock, "pipeline nightly"),
    ):
        pass
    with exclusive(lock, "pipeline nightly"):  # released after the block
        pass


@pytest.mark.parametrize("name", ["nightly", "grpo", "x.lock", "a.lock.pipeline"])
def test_a_pipelines_lock_is_never_a_trainings(tmp_path, name):
    """The nightly holds its lock while the training it runs takes the training lock of the same output
    directory: were they one file, the nightly would refuse itself (an output directory named `nightly`)."""
    from components.locking import pipeline_lock, training_lock

    trainings = {training_lock(tmp_path / other) for other in ("nightly", "grpo", name, f"{name}.lock")}
    assert pipeline_lock(tmp_path / name) not in trainings
    with (
        exclusive(pipeline_lock(tmp_path / name), "pipeline"),
        exclusive(training_lock(tmp_path / name), "train"),
    ):
        pass


def test_the_probe_answers_whether_a_lock_is_held_and_creates_nothing(tmp_path):
    from components.locking import check_free

    lock = tmp_path / "deep" / ".grpo.lock"
    check_free(lock, "a training run")  # no file: free, and none made
    assert not lock.parent.exists()
    with (
        exclusive(lock, "a training run"),
        pytest.raises(AlreadyRunning, match=r"a training run is already running \(pid \d+"),
    ):
        check_free(lock, "a training run")
    check_free(lock, "a training run")  # released: free again
    with exclusive(lock, "a training run"):  # and the probe left it takeable
        pass


def test_a_waiting_taker_gets_the_lock_once_it_is_released_and_names_the_holder_if_never(tmp_path):
    import threading
    import time

    from components.locking import Held, is_held

    lock = tmp_path / ".grpo.lock"
    first = Held(lock, "a run picking its directory")
    assert is_held(lock)
    threading.Timer(0.3, first.release).start()
    started = time.monotonic()
    with exclusive(lock, "a run picking its directory", wait_s=10):
        assert 0.2 < time.monotonic() - started < 5  # it waited for the release, not the whole 10 s
    assert not is_held(lock)
    with (
        exclusive(lock, "a run picking its directory"),
        pytest.raises(AlreadyRunning, match=r"already running \(pid \d+, lock .* for 0.2 s\)"),
    ):
        Held(lock, "a run picking its directory", wait_s=0.2)


def test_a_kept_lock_refuses_others_and_the_keepers_own_block_takes_it_as_held(tmp_path):
    """The nightly command keeps its pipeline's lock from before any service starts; the flow it then runs
    takes the same lock with exclusive(), which must not refuse its own process."""
    from components import locking

    lock = tmp_path / ".nightly.lock.pipeline"
    locking.keep(lock, "pipeline nightly")
    try:
        assert locking.is_held(lock)  # another open of the file (another process's) is refused
        with pytest.raises(AlreadyRunning, match=r"pipeline nightly is already running \(pid \d+"):
            locking.Held(lock, "pipeline nightly")
        with locking.exclusive(lock, "pipeline nightly"):  # the flow inside the command
            assert locking.is_held(lock)
        assert locking.is_held(lock)  # still kept after the flow's block
    finally:
        locking._KEPT.pop(str(lock.resolve())).release()
    assert not locking.is_held(lock)
