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


def test_dynamic_batches_fit_the_budget_cover_every_row_once_and_shuffle_by_seed():
    from components.data.sampler import DynamicBatchSampler

    lengths = [3, 17, 5, 9, 2, 11, 8, 8, 1, 16]
    s = DynamicBatchSampler(lengths, max_tokens=20, shuffle=True, seed=3)
    batches = list(s)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 20 for b in batches)
    assert list(DynamicBatchSampler(lengths, 20, True, 3)) == batches  # same seed, same order
    s.set_epoch(1)
    assert sorted(map(sorted, s)) == sorted(map(sorted, batches)) and len(s) == len(batches)


def test_dynamic_batches_halve_the_padding_of_fixed_count_batches_on_mixed_lengths():
    import random

    from components.data.sampler import DynamicBatchSampler

    rng = random.Random(0)
    lengths = [rng.choice([4, 6, 40, 64]) for _ in range(256)]
    fixed = [lengths[i : i + 8] for i in range(0, 256, 8)]
    padded_fixed = sum(len(b) * max(b) for b in fixed)
    dynamic = [[lengths[i] for i in b] for b in DynamicBatchSampler(lengths, max_tokens=8 * 64, seed=0)]
    padded_dynamic = sum(len(b) * max(b) for b in dynamic)
    waste = lambda padded: padded - sum(lengths)  # noqa: E731
    assert waste(padded_dynamic) <= 0.5 * waste(padded_fixed), (waste(padded_dynamic), waste(padded_fixed))
