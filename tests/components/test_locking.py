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
