"""A seeded prompt sampler with a resumable position: every row once per epoch, in a per-epoch order."""

from __future__ import annotations

import torch

from components.seeding import derive_seed


class PromptSampler:
    def __init__(self, n_rows: int, batch_size: int, shuffle: bool, seed: int):
        self.n_rows, self.batch_size, self.shuffle, self.seed = n_rows, batch_size, shuffle, seed
        self.epoch, self.cursor = 0, 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n_rows))
        gen = torch.Generator().manual_seed(derive_seed(self.seed, epoch, "sampler"))
        return torch.randperm(self.n_rows, generator=gen).tolist()

    def next_indices(self) -> list[int]:
        """The next batch_size row indices; an epoch's tail is followed by the next epoch's head."""
        out: list[int] = []
        while len(out) < self.batch_size:
            order = self._order(self.epoch)
            take = order[self.cursor : self.cursor + self.batch_size - len(out)]
            out += take
            self.cursor += len(take)
            if self.cursor >= self.n_rows:
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "n_rows": self.n_rows, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["n_rows"] != self.n_rows:
            raise ValueError(f"sampler state is for {state['n_rows']} rows, the dataset has {self.n_rows}")
        self.epoch, self.cursor = state["epoch"], state["cursor"]


def pack_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices grouped so each group's padded size (rows x its longest row) stays within max_tokens:
    rows sorted longest first, each group filled while the next row fits. A row longer than max_tokens
    gets a group of its own. Groups come out longest first."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class DynamicBatchSampler:
    """Batches of dataset indices packed to a token budget instead of a fixed count (padding-aware: a
    batch's cost is rows x its longest row). `dataset` is a sequence of token-id sequences, or of lengths.
    Batch order is shuffled per epoch from (seed, epoch); call set_epoch(e) between epochs."""

    def __init__(self, dataset, max_tokens: int, shuffle: bool = True, seed: int = 0):
        self.lengths = [x if isinstance(x, int) else len(x) for x in dataset]
        self.max_tokens, self.shuffle, self.seed, self.epoch = max_tokens, shuffle, seed, 0
        self.batches = pack_by_tokens(self.lengths, max_tokens)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        order = range(len(self.batches))
        if self.shuffle:
            gen = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, "dynamic_batches"))
            order = torch.randperm(len(self.batches), generator=gen).tolist()
        for i in order:
            yield list(self.batches[i])
