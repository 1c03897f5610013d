"""The policy worker: model, frozen reference, critic, optimizers and the updates. Run as a Ray actor."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from components.algorithms.losses import PolicyLossParams
from components.algorithms.presets import resolve
from components.batch import Batch
from components.config.schema import Config
from components.errors import CheckpointError
from components.models.loading import load_model, load_tokenizer, save_pretrained
from components.tracking.checkpoints import load_optimizer, save_optimizer
from components.training.actor import PolicyTrainer, UpdateSettings
from components.training.critic import CriticTrainer, ValueModel
from components.training.loop import LoopSettings
from components.training.optim import make_optimizer
from components.training.seeding import seed_everything


def update_settings(cfg: Config) -> UpdateSettings:
    algo = resolve(cfg.algorithm)
    a = cfg.algorithm
    loop = LoopSettings(ppo_epochs=cfg.actor.ppo_epochs, mini_batch_size=cfg.actor.ppo_mini_batch_size,
                        micro_batch_size=cfg.actor.ppo_micro_batch_size, grad_clip=cfg.actor.optimizer.grad_clip,
                        norm_const=float(cfg.engine.max_new_tokens), seed=cfg.trainer.seed)
    return UpdateSettings(
        loop=loop, temperature=cfg.engine.temperature or 1.0,
        beta=a.kl_loss_coef if algo.use_kl_loss else 0.0, kl_loss_type=algo.kl_loss_type,
        entropy_coeff=a.entropy_coeff, policy_loss=algo.policy_loss,
        loss=PolicyLossParams(clip_low=a.clip_epsilon, clip_high=algo.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
                              agg_mode=algo.loss_agg_mode),
        autocast_dtype=cfg.mixed_precision.dtype if cfg.mixed_precision.enabled else None)


def rng_state() -> dict:
    """Python's and numpy's global RNG states as JSON (torch's goes to safetensors)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    return {"python": [version, list(internal), py_gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, gauss]}


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def make_critic(cfg: Config, settings: UpdateSettings) -> CriticTrainer:
    m, c = cfg.actor.model, cfg.critic
    key = "critic.model_path" if c.model_path else "actor.model.path"
    model = ValueModel(load_model(c.model_path or m.path, m.dtype, m.attention_implementation, key))
    opt, sched = make_optimizer(model.parameters(), c.optimizer)
    return CriticTrainer(model, opt, sched, settings.loop, c.cliprange_value, "token-mean")


class PolicyWorker:
    def __init__(self, cfg_dict: dict):
        cfg = Config.model_validate(cfg_dict)
        torch.set_num_threads(cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed)
        m = cfg.actor.model
        algo = resolve(cfg.algorithm)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(m.path)
        self.model = load_model(m.path, m.dtype, m.attention_implementation)
        if cfg.memory_optim.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        ref = None
        if algo.needs_reference:
            ref = load_model(m.path, m.dtype, m.attention_implementation).eval().requires_grad_(False)
        settings = update_settings(cfg)
        opt, sched = make_optimizer(self.model.parameters(), cfg.actor.optimizer)
        self.trainer = PolicyTrainer(self.model, ref, opt, sched, settings)
        self.critic = make_critic(cfg, settings) if algo.needs_critic else None
        self.need_old = cfg.algorithm.use_kl_in_reward
        self.version = 0

    def prepare(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """verl's old_log_prob / ref / values stages: what the advantages and updates need, computed once
        with the weights that sampled the batch. Returns the batch and per-stage seconds."""
        timings: dict[str, float] = {}
        start = time.perf_counter()
        batch = self.trainer.prepare(batch, need_old=self.need_old)
        timings["timing_s/old_log_prob"] = time.perf_counter() - start
        if self.critic is not None:
            start = time.perf_counter()
            batch = batch.union(values=self.critic.values(batch))
            timings["timing_s/values"] = time.perf_counter() - start
        return batch, timings

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self.critic.update(batch) if self.critic is not None else {}

    def update(self, batch: Batch) -> dict[str, float]:
        metrics = self.trainer.update(batch)
        self.version += 1
        return metrics

    def get_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """The current weights (detached CPU tensors) and their version."""
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}, self.version

    def save_model(self, out: str) -> str:
        return str(save_pretrained(self.model, self.tokenizer, out))

    def _trained_parts(self) -> list[tuple[str, "PolicyTrainer | CriticTrainer", str]]:
        """(name, trainer, optimizer file) of each part with an optimizer: the actor, and the critic if any."""
        parts = [("actor", self.trainer, "optimizer")]
        return parts + ([("critic", self.critic, "critic_optimizer")] if self.critic is not None else [])

    def write_checkpoint(self, out: str, with_optimizer: bool = True) -> None:
        """This worker's part of a checkpoint, into the (temporary) directory `out`: the model (HF format),
        optimizer and scheduler state, RNG states, step counters and weights version, and the critic."""
        out = Path(out)
        self.save_model(str(out / "model"))
        tensors, state = {"rng.torch": torch.get_rng_state()}, {"version": self.version, "rng": rng_state()}
        for name, part, opt_file in self._trained_parts():
            if with_optimizer:
                save_optimizer(out, opt_file, part.optimizer.state_dict())
            state[name] = {"steps": part.steps, "scheduler": part.scheduler.state_dict()}
        if self.critic is not None:
            save_file({k: v.detach().contiguous() for k, v in self.critic.model.state_dict().items()},
                      out / "critic.safetensors")
        save_file(tensors, out / "worker.safetensors")
        (out / "worker.json").write_text(json.dumps(state, sort_keys=True))

    def load_checkpoint(self, path: str) -> int:
        """Restore everything write_checkpoint wrote (the caller verified the manifest); returns the version."""
        ckpt = Path(path)
        state = json.loads((ckpt / "worker.json").read_text())
        loaded = load_model(ckpt / "model", self.cfg.actor.model.dtype, self.cfg.actor.model.attention_implementation,
                            key=f"checkpoint {ckpt}", safetensors_only=True)
        self.model.load_state_dict(loaded.state_dict())
        for name, part, opt_file in self._trained_parts():
            opt = load_optimizer(ckpt, opt_file)
            if opt is None:
                raise CheckpointError(f"{ckpt} has no {name} optimizer state (saved with trainer.save_optimizer="
                                      "false), so a resume would not be exact. Start fresh with "
                                      "trainer.resume_mode=disable.")
            part.optimizer.load_state_dict(opt)
            part.scheduler.load_state_dict(state[name]["scheduler"])
            part.steps = state[name]["steps"]
        if self.critic is not None:
            self.critic.model.load_state_dict(load_file(ckpt / "critic.safetensors"))
        torch.set_rng_state(load_file(ckpt / "worker.safetensors")["rng.torch"])
        set_rng_state(state["rng"])
        self.version = state["version"]
        return self.version

    def pid(self) -> int:
        return os.getpid()

    def state(self) -> dict:
        return {"version": self.version, "steps": self.trainer.steps}
