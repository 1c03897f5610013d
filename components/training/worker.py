"""The policy worker: model, frozen reference, optimizer and the update. Run as a Ray actor."""

from __future__ import annotations

import torch

from components.algorithms.losses import PolicyLossParams
from components.algorithms.presets import resolve
from components.batch import Batch
from components.config.schema import Config
from components.models.loading import load_model, load_tokenizer, save_pretrained
from components.training.actor import PolicyTrainer, UpdateSettings
from components.training.optim import make_optimizer
from components.training.seeding import seed_everything


def update_settings(cfg: Config) -> UpdateSettings:
    algo = resolve(cfg.algorithm)
    a = cfg.algorithm
    return UpdateSettings(
        ppo_epochs=cfg.actor.ppo_epochs, mini_batch_size=cfg.actor.ppo_mini_batch_size,
        micro_batch_size=cfg.actor.ppo_micro_batch_size, temperature=cfg.engine.temperature or 1.0,
        beta=a.beta, kl_loss_type=algo.kl_loss_type, entropy_coeff=a.entropy_coeff, policy_loss=algo.policy_loss,
        loss=PolicyLossParams(clip_low=a.clip_epsilon, clip_high=a.clip_ratio_high or a.clip_epsilon,
                              clip_ratio_c=a.clip_ratio_c, agg_mode=algo.loss_agg_mode),
        grad_clip=cfg.actor.optimizer.grad_clip, norm_const=float(cfg.engine.max_new_tokens), seed=cfg.trainer.seed,
        autocast_dtype=cfg.mixed_precision.dtype if cfg.mixed_precision.enabled else None)


class PolicyWorker:
    def __init__(self, cfg_dict: dict):
        cfg = Config.model_validate(cfg_dict)
        torch.set_num_threads(cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed)
        m = cfg.actor.model
        self.cfg = cfg
        self.tokenizer = load_tokenizer(m.path)
        self.model = load_model(m.path, m.dtype, m.attention_implementation)
        if cfg.memory_optim.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        ref = None
        if cfg.algorithm.beta > 0:
            ref = load_model(m.path, m.dtype, m.attention_implementation).eval().requires_grad_(False)
        opt, sched = make_optimizer(self.model.parameters(), cfg.actor.optimizer)
        self.trainer = PolicyTrainer(self.model, ref, opt, sched, update_settings(cfg))
        self.version = 0

    def update(self, batch: Batch) -> dict[str, float]:
        metrics = self.trainer.update(batch)
        self.version += 1
        return metrics

    def get_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """The current weights (detached CPU tensors) and their version."""
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}, self.version

    def save_model(self, out: str) -> str:
        return str(save_pretrained(self.model, self.tokenizer, out))

    def optimizer_state(self) -> dict:
        return self.trainer.optimizer.state_dict()

    def state(self) -> dict:
        return {"version": self.version, "steps": self.trainer.steps}
