"""A seeded prompt sampler with a resumable position: every row once per epoch, in a per-epoch order."""

from __future__ import annotations

import torch

from components.training.seeding import derive_seed


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
            take = order[self.cursor:self.cursor + self.batch_size - len(out)]
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
