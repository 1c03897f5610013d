"""The policy update: PPO-style epochs over mini-batches, gradient accumulation over micro-batches.

Total actor loss = pg_loss - entropy_coeff * agg(H) + kl_loss_coef * agg(KL(pi, pi_ref)), every term
aggregated with the same mode and the counts of the whole mini-batch (see components/training/loop.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from components.algorithms.losses import (
    POLICY_LOSSES,
    AggParams,
    agg_loss,
    generalized_jsd,
    kl_penalty,
)
from components.batch import Batch
from components.models.moe import Routing, RoutingStats
from components.settings import UpdateSettings
from components.training.distributed import Comm
from components.training.logprobs import (
    batch_logprobs,
    logits_logprobs,
    moe_routes,
    response_attention,
    response_distributions,
    response_logprobs,
    sequence_logits,
    vision_inputs,
)
from components.training.loop import minibatch_update, row_chunks

if TYPE_CHECKING:  # transformers' modeling code: imported where a model is built, not here
    from transformers import PreTrainedModel


def autocast(model: torch.nn.Module, dtype_name: str | None):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype_name or "")
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=dtype, enabled=dtype is not None)


class PolicyTrainer:
    """Owns the policy, its optimizer and the frozen reference; `update(batch)` runs one RL update."""

    def __init__(
        self,
        model: PreTrainedModel,
        ref_model: PreTrainedModel | None,
        optimizer,
        scheduler,
        settings: UpdateSettings,
        comm: Comm | None = None,
        scaler: torch.amp.GradScaler | None = None,
        pipeline=None,
        teacher: PreTrainedModel | None = None,
    ):
        self.model, self.ref_model, self.teacher = model, ref_model, teacher
        self.optimizer, self.scheduler, self.s = optimizer, scheduler, settings
        self.comm, self.scaler = comm or Comm(), scaler
        self.pipeline = pipeline  # a pipeline stage (components/training/pipeline_parallel.py), or None
        self.steps = 0
        self.route_stats = RoutingStats()  # an MoE policy's agreement with the rollout's routes, this batch

    def routing(self, t: dict[str, torch.Tensor], stats: RoutingStats | None = None) -> Routing | None:
        """The policy's forwards over these rows replay the rollout's routes (R3), or leave them be; `stats`
        counts how often the policy's own routers chose as the rollout's."""
        routes = moe_routes(t)
        return None if routes is None else Routing(routes, self.s.router_replay, stats)

    def _logprobs(self, model, b: Batch, entropy: bool = False):
        t = b.tensors
        return response_logprobs(
            model,
            t["prompts"],
            t["prompt_mask"],
            t["responses"],
            response_attention(t),
            self.s.temperature,
            with_entropy=entropy,
            **vision_inputs(t),
            routing=self.routing(t) if model is self.model else None,
        )

    def off_policy(self, n_rows: int) -> bool:
        """More than one optimizer step per batch, so the ratio to the behaviour policy moves off 1."""
        return self.s.loop.ppo_epochs > 1 or (self.s.loop.mini_batch_size or n_rows) < n_rows

    def logprobs(self, batch: Batch, reference: bool = False) -> torch.Tensor:
        """Log-probs (N, R) of the responses under the current policy or the frozen reference."""
        if self.pipeline is not None and not reference:  # through the stages; the last one's, sent to all
            temperature = self.s.temperature
            return torch.cat(
                [
                    self.pipeline.forward_only(
                        part.tensors,
                        lambda logits, t: logits_logprobs(logits, t["responses"], temperature)[0],
                    )
                    for part in row_chunks(batch, self.s.loop.micro_batch_size)
                ]
            )
        if reference:  # the reference routes by itself: its weights are not the ones that sampled
            return batch_logprobs(self.ref_model, batch, self.s.temperature, self.s.loop.micro_batch_size)
        return batch_logprobs(
            self.model,
            batch,
            self.s.temperature,
            self.s.loop.micro_batch_size,
            lambda t: self.routing(t, self.route_stats),
        )

    def _logits_loss(self, t: dict[str, torch.Tensor], logits: torch.Tensor, agg: AggParams):
        """A pipeline's last stage: the micro-batch's loss from its logits."""
        logp, entropy = logits_logprobs(logits, t["responses"], self.s.temperature, with_entropy=True)
        return self.loss_from_logprobs(t, logp, entropy, agg)

    def prepare(self, batch: Batch, need_old: bool = False) -> Batch:
        """Add what the update needs and the batch lacks: old (behaviour) log-probs when off-policy or asked,
        reference log-probs when a reference is loaded, a distillation teacher's when one is. Computed once,
        before any update."""
        t, extra = batch.tensors, {}
        # an MoE rollout's routes: this pass, with the weights before any step, measures the routing agreement
        need_old = need_old or "prompt_routes" in t
        if "old_logprobs" not in t and (need_old or self.off_policy(len(batch))):
            extra["old_logprobs"] = self.logprobs(batch)
        if "ref_logprobs" not in t and self.ref_model is not None:
            extra["ref_logprobs"] = self.logprobs(batch, reference=True)
        if "teacher_logprobs" not in t and self.teacher is not None:  # on-policy distillation's scores
            extra["teacher_logprobs"] = batch_logprobs(
                self.teacher, batch, self.s.temperature, self.s.loop.micro_batch_size
            )
        return batch.union(**extra) if extra else batch

    def _micro_loss(self, mb: Batch, agg: AggParams) -> tuple[torch.Tensor, dict]:
        if self.s.jsd_coef:
            return self._distilled_loss(mb, agg)
        with autocast(self.model, self.s.autocast_dtype):
            logp, entropy = self._logprobs(self.model, mb, entropy=True)
        return self.loss_from_logprobs(mb.tensors, logp, entropy, agg)

    def _distilled_loss(self, mb: Batch, agg: AggParams) -> tuple[torch.Tensor, dict]:
        """distill.loss=jsd (GKD on the student's own samples): the loss plus jsd_coef x the generalised JSD
        between the teacher's and the student's whole distributions at each response position."""
        t = mb.tensors
        args = (t["prompts"], t["prompt_mask"], t["responses"], response_attention(t))
        with autocast(self.model, self.s.autocast_dtype):
            logits = sequence_logits(self.model, *args, **vision_inputs(t), routing=self.routing(t))
        student = response_distributions(logits, t["responses"], self.s.temperature)
        with torch.no_grad():
            teacher = response_distributions(
                sequence_logits(self.teacher, *args, **vision_inputs(t)), t["responses"], self.s.temperature
            )
        logp = student.gather(-1, t["responses"][..., None]).squeeze(-1)
        entropy = -(student.exp() * student).sum(-1)
        loss, metrics = self.loss_from_logprobs(t, logp, entropy, agg)
        jsd = agg_loss(
            generalized_jsd(student, teacher, self.s.jsd_beta),
            t["response_mask"].float(),
            self.s.loss.agg_mode,
            agg,
        )
        return loss + self.s.jsd_coef * jsd, {**metrics, "distill/jsd": jsd.detach()}

    def loss_from_logprobs(
        self, t: dict[str, torch.Tensor], logp: torch.Tensor, entropy: torch.Tensor, agg: AggParams
    ) -> tuple[torch.Tensor, dict]:
        """The micro-batch's loss and additive metrics from its log-probs and entropies (N, R): the policy
        loss, the entropy bonus and the KL term (a pipeline's last stage calls this on its logits)."""
        mode = self.s.loss.agg_mode
        mask = t["response_mask"].float()
        old = t["old_logprobs"] if "old_logprobs" in t else logp.detach()
        pg_loss, metrics = POLICY_LOSSES.get(self.s.policy_loss)(
            logp, old, t["advantages"], mask, self.s.loss, agg
        )
        ent = agg_loss(entropy, mask, mode, agg)
        loss = pg_loss - self.s.entropy_coeff * ent if self.s.entropy_coeff else pg_loss
        metrics = {**metrics, "actor/pg_loss": pg_loss.detach(), "actor/entropy": ent.detach()}
        if (
            "rollout_logprobs" in t
        ):  # how far the engine's sampling probabilities are from the trainer's forward
            diff = (t["rollout_logprobs"].exp() - old.exp()).abs()
            metrics["training/rollout_probs_diff_mean"] = agg_loss(diff, mask, "token-mean", agg).detach()
        if self.s.beta > 0 and "ref_logprobs" in t:
            kl = agg_loss(kl_penalty(logp, t["ref_logprobs"], self.s.kl_loss_type), mask, mode, agg)
            loss = loss + self.s.beta * kl
            metrics["actor/kl_loss"] = kl.detach()
        return loss, metrics

    def update(self, batch: Batch) -> dict[str, float]:
        """One RL update on `batch` (needs prompts, prompt_mask, responses, response_mask, advantages)."""
        batch = self.prepare(batch)
        self.model.train()
        metrics = minibatch_update(
            batch,
            self.model,
            self.optimizer,
            self.scheduler,
            self.s.loop,
            self.steps,
            self._micro_loss,
            "actor",
            self.comm,
            self.scaler,
            self.pipeline,
            self._logits_loss,
        )
        if self.pipeline is not None:  # the loss and its metrics were computed on the last stage
            metrics = self.pipeline.from_last_stage(metrics)
        if self.s.beta > 0:
            metrics["actor/kl_coef"] = self.s.beta
        if self.route_stats.total:  # (token, layer) pairs where the trainer's router chose as the rollout's
            metrics["moe/routing_agreement"] = self.route_stats.agreement()
        self.route_stats = RoutingStats()  # counted from this batch's prepare, whoever called it, to here
        self.steps += 1
        self.model.eval()
        return metrics
