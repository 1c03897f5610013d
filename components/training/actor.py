"""The policy update: PPO-style epochs over mini-batches, gradient accumulation over micro-batches.

Losses are aggregated with counts of the whole mini-batch, so accumulating micro-batch gradients gives
the same update as one pass over the mini-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from components.algorithms.losses import POLICY_LOSSES, AggParams, PolicyLossParams, agg_loss, kl_penalty
from components.batch import Batch
from components.training.logprobs import response_logprobs


@dataclass(frozen=True)
class UpdateSettings:
    ppo_epochs: int = 1
    mini_batch_size: int | None = None  # None = the whole batch
    micro_batch_size: int | None = None  # None = the whole mini-batch
    temperature: float = 1.0
    beta: float = 0.0  # KL-to-reference loss coefficient
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    policy_loss: str = "vanilla"
    loss: PolicyLossParams = PolicyLossParams()
    grad_clip: float = 1.0
    norm_const: float = 1.0  # seq-mean-token-sum-norm constant (max response length)
    seed: int = 0
    autocast_dtype: str | None = None  # "bf16" / "fp16": autocast the update's forward passes


class PolicyTrainer:
    """Owns the policy, its optimizer and the frozen reference; `update(batch)` runs one RL update."""

    def __init__(self, model: PreTrainedModel, ref_model: PreTrainedModel | None, optimizer, scheduler,
                 settings: UpdateSettings):
        self.model, self.ref_model = model, ref_model
        self.optimizer, self.scheduler, self.s = optimizer, scheduler, settings
        self.steps = 0

    def _autocast(self):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.s.autocast_dtype or "")
        device = next(self.model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=dtype, enabled=dtype is not None)

    def _logprobs(self, model, b: Batch, entropy: bool = False):
        t = b.tensors
        return response_logprobs(model, t["prompts"], t["prompt_mask"], t["responses"], t["response_mask"],
                                 self.s.temperature, with_entropy=entropy)

    @torch.no_grad()
    def _fixed_logprobs(self, batch: Batch) -> Batch:
        """Add old (behaviour) and reference log-probs, computed once before any update."""
        extra = {}
        needs_old = self.s.ppo_epochs > 1 or (self.s.mini_batch_size or len(batch)) < len(batch)
        if needs_old:
            extra["old_logprobs"] = torch.cat([self._logprobs(self.model, p)[0] for p in self._micro(batch)])
        if self.s.beta > 0 and self.ref_model is not None:
            extra["ref_logprobs"] = torch.cat([self._logprobs(self.ref_model, p)[0] for p in self._micro(batch)])
        return batch.union(**extra)

    def _micro(self, b: Batch) -> list[Batch]:
        size = self.s.micro_batch_size or len(b)
        return b.chunk(max(1, len(b) // size))

    def _micro_loss(self, mb: Batch, agg: AggParams, mode: str) -> tuple[torch.Tensor, dict]:
        t = mb.tensors
        mask = t["response_mask"].float()
        with self._autocast():
            logp, entropy = self._logprobs(self.model, mb, entropy=True)
        old = t["old_logprobs"] if "old_logprobs" in t else logp.detach()
        pg_loss, metrics = POLICY_LOSSES.get(self.s.policy_loss)(logp, old, t["advantages"], mask, self.s.loss, agg)
        loss = pg_loss
        ent = agg_loss(entropy, mask, mode, agg)
        if self.s.entropy_coeff:
            loss = loss - self.s.entropy_coeff * ent
        metrics = {**metrics, "actor/pg_loss": pg_loss.detach(), "actor/entropy": ent.detach()}
        if "ref_logprobs" in t:
            kl = agg_loss(kl_penalty(logp, t["ref_logprobs"], self.s.kl_loss_type), mask, mode, agg)
            loss = loss + self.s.beta * kl
            metrics["actor/kl_loss"] = kl.detach()
        return loss, metrics

    def update(self, batch: Batch) -> dict[str, float]:
        """One RL update on `batch` (needs prompts, prompt_mask, responses, response_mask, advantages)."""
        self.model.train()
        batch = self._fixed_logprobs(batch)
        mode = self.s.loss.agg_mode
        mini_size = self.s.mini_batch_size or len(batch)
        gen = torch.Generator().manual_seed(self.s.seed + self.steps)
        sums: dict[str, float] = {}
        n_steps = 0
        for _ in range(self.s.ppo_epochs):
            order = torch.randperm(len(batch), generator=gen) if mini_size < len(batch) else torch.arange(len(batch))
            for start in range(0, len(batch), mini_size):
                mini = batch.select(order[start:start + mini_size])
                mask = mini.tensors["response_mask"]
                agg = AggParams(float(mask.sum()), float(len(mini)), self.s.norm_const)
                self.optimizer.zero_grad(set_to_none=True)
                for mb in self._micro(mini):
                    loss, metrics = self._micro_loss(mb, agg, mode)
                    loss.backward()
                    for k, v in metrics.items():  # every metric is additive across micro-batches
                        sums[k] = sums.get(k, 0.0) + float(v)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.grad_clip)
                sums["actor/grad_norm"] = sums.get("actor/grad_norm", 0.0) + float(grad_norm)
                sums["actor/lr"] = sums.get("actor/lr", 0.0) + self.scheduler.get_last_lr()[0]
                self.optimizer.step()
                self.scheduler.step()
                n_steps += 1
        self.steps += 1
        self.model.eval()
        return {k: v / n_steps for k, v in sums.items()}
