"""The prompt sampler: every row exactly once per epoch, and the same sequence across an interruption."""

from collections import Counter

import pytest

from components.data.sampler import PromptSampler


def draw(sampler, n):
    return [sampler.next_indices() for _ in range(n)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_row_once_per_epoch(shuffle):
    s = PromptSampler(10, 4, shuffle, seed=3)
    flat = [i for b in draw(s, 5) for i in b]  # 20 indices = exactly 2 epochs
    assert Counter(flat[:10]) == Counter(range(10)) and Counter(flat[10:]) == Counter(range(10))


def test_interrupted_and_restored_gives_the_same_sequence():
    whole = draw(PromptSampler(10, 4, True, seed=3), 7)
    first = PromptSampler(10, 4, True, seed=3)
    head = draw(first, 3)
    second = PromptSampler(10, 4, True, seed=3)  # a new process: fresh object, state from the checkpoint
    second.load_state_dict(first.state_dict())
    assert head + draw(second, 4) == whole


def test_state_for_another_dataset_is_refused():
    s = PromptSampler(10, 4, True, seed=3)
    with pytest.raises(ValueError, match="10 rows"):
        PromptSampler(12, 4, True, seed=3).load_state_dict(s.state_dict())
