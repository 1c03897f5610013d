"""The policy worker: model, frozen reference, critic, optimizers and the updates. Run as a Ray actor."""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from components.batch import Batch
from components.errors import CheckpointError, ConfigError
from components.models.loading import (
    load_image_encoder,
    load_model,
    load_tokenizer,
    save_pretrained,
    teacher_tokenizer_problem,
)
from components.models.lora import (
    ADAPTER_WEIGHTS,
    AdaptersOff,
    adapter_state,
    apply_lora,
    load_adapter_state,
    merged_state,
    save_adapter,
)
from components.outputs import MODEL
from components.seeding import seed_everything
from components.settings import LoraSettings, PolicySettings, ReferenceSettings, UpdateSettings
from components.tracking import sharded as S
from components.tracking.checkpoints import load_optimizer, save_optimizer
from components.training import distributed as D
from components.training.actor import PolicyTrainer
from components.training.critic import CriticTrainer, build_value_model
from components.training.logprobs import batch_logprobs
from components.training.optim import freeze_vision, make_optimizer, make_scheduler, param_groups

MP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ADAPTER_DIR = "adapter"  # a LoRA policy's peft adapter directory, inside its (merged) model directory
PART_DIRS = {"actor": "model", "critic": "critic"}  # where a sharded checkpoint keeps each part's weights
COMPRESSION_CODES = {
    "none": 0,
    "fp16": 1,
    "powersgd": 2,
}  # perf/grad_compression (MLflow metrics are numbers)


def sharded_precision(s: PolicySettings, world_size: int) -> bool:
    """Mixed precision done by FSDP's parameter dtype rather than by autocast (FSDP wraps the model when
    there are several data-parallel replicas: workers / tensor_parallel_size)."""
    data_parallel = world_size // s.parallel.tensor_parallel_size
    return s.mixed_precision.enabled and s.parallel.strategy == "fsdp" and data_parallel > 1


def parallel_settings(s: PolicySettings, world_size: int, ocfg=None, mesh=None) -> D.ParallelSettings:
    p, mem, o = s.parallel, s.memory, ocfg or s.optimizer
    dp = p.data_parallel_size or (1 if p.strategy == "fsdp" else world_size)
    return D.ParallelSettings(
        world_size=world_size,
        data_parallel_size=dp if world_size % dp == 0 else 1,
        param_offload=mem.param_offload,
        optimizer_offload=mem.optimizer_offload,
        mp_dtype=MP_DTYPES[s.mixed_precision.dtype] if sharded_precision(s, world_size) else None,
        zero_stage=p.zero_stage,
        grad_clip=o.grad_clip,
        optimizer=lambda params: make_optimizer(params, o)[0],
        mesh=mesh,
    )


def update_for(s: PolicySettings, world_size: int) -> UpdateSettings:
    """The update settings on `world_size` workers: with FSDP's parameter dtype there is no autocast."""
    return replace(s.update, autocast_dtype=None) if sharded_precision(s, world_size) else s.update


def vision_metrics(batch: Batch, image_token: int, frozen: bool) -> dict[str, float]:
    """A VLM's image share of the batch: image tokens per sample, their fraction of the tokens the forward
    sees (prompt + response), and whether the vision tower is frozen."""
    t = batch.tensors
    image = ((t["prompts"] == image_token) & t["prompt_mask"].bool()).sum(1).float()
    total = t["prompt_mask"].sum(1) + t["response_mask"].sum(1)
    return {
        "vision/image_tokens_per_sample": image.mean().item(),
        "vision/image_token_frac": (image.sum() / total.sum().clamp(min=1)).item(),
        "vision/frozen": float(frozen),
    }


def rng_state() -> dict:
    """Python's and numpy's global RNG states as JSON (torch's goes to safetensors)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    return {
        "python": [version, list(internal), py_gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
    }


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def make_scaler(s: PolicySettings, model: torch.nn.Module) -> torch.amp.GradScaler | None:
    """Dynamic loss scaling for fp16 (bf16 has fp32's range and needs none)."""
    mp = s.mixed_precision
    if not (mp.enabled and mp.dtype == "fp16" and mp.loss_scale == "dynamic"):
        return None
    return torch.amp.GradScaler(next(model.parameters()).device.type)


class PolicyWorker:
    """One policy worker: rank `spec.rank` of the group. The constructor keeps its settings (the plan's slice,
    components/plan.py); setup() joins the process group and builds the model (wrapped by the strategy when
    there are several workers), the reference, the critic and their optimizers."""

    def __init__(self, settings: PolicySettings):
        self.s = settings
        torch.set_num_threads(settings.num_threads)
        seed_everything(settings.seed)

    def address(self) -> tuple[str, int]:
        """This worker's node address and a free port on it (rank 0's are the group's rendezvous)."""
        import ray

        return ray.util.get_node_ip_address(), D.free_port()

    def setup(self, spec: D.GroupSpec) -> int:
        s = self.s
        D.join_group(spec)
        self.rank, self.world_size = spec.rank, spec.world_size
        device = "cuda" if spec.backend == "nccl" else "cpu"
        p = s.parallel
        self.mesh = D.parallel_mesh(spec.world_size, p.tensor_parallel_size, device, p.pipeline_parallel_size)
        # the update loop's collectives span the data-parallel replicas: a replica's TP and pipeline workers
        # hold the same rows
        self.comm = D.make_comm(self.mesh["dp"].get_group() if self.mesh is not None else None)
        m = s.model
        trust = m.trust_remote_code  # a model directory's own code runs only if the user said so
        self.tokenizer = load_tokenizer(m.path, trust_remote_code=trust)
        self.images = load_image_encoder(m.path, self.tokenizer, trust_remote_code=trust)  # None: text only
        policy = load_model(m.path, m.dtype, m.attention_implementation, trust_remote_code=trust)
        freeze_vision(policy, m)
        if s.lora.enabled:  # adapters over the frozen base: only they train (and get optimizer state)
            policy = apply_lora(policy, s.lora, m.path)
        self.pipeline = None
        if p.pipeline_parallel_size > 1:  # this worker holds one stage of the layers (or its TP share)
            from components.training.pipeline_parallel import Pipeline

            mem = s.memory
            if mem.gradient_checkpointing or mem.activation_checkpointing:
                policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.pipeline = Pipeline(policy, self.mesh, p.pipeline_microbatches, p.pipeline_schedule)
            self.model = self.pipeline.module
        else:
            self.model = self._wrap(policy)
        ref = None
        if s.reference and s.lora.enabled:  # the base itself: the policy with its adapters off, no copy
            ref = AdaptersOff(policy)
        elif s.reference:
            ref = load_model(m.path, m.dtype, m.attention_implementation, trust_remote_code=trust)
            ref = ref.eval().requires_grad_(False)
        settings = update_for(s, spec.world_size)
        opt, sched = self._optimizer(self.model, s.optimizer, s.model)
        self.trainer = PolicyTrainer(
            self.model,
            ref,
            opt,
            sched,
            settings,
            self.comm,
            make_scaler(s, self.model),
            self.pipeline,
            self._teacher(),
        )
        self.critic = self._make_critic(settings) if s.critic is not None else None
        self.compression = self._compression()
        self.need_old = s.need_old
        self.version = 0
        return os.getpid()

    def _teacher(self):
        """On-policy distillation's teacher, frozen beside the policy; refused in one line when its tokenizer
        is not the student's (the config check cannot tell when the student is yet to be trained)."""
        t = self.s.teacher
        if t is None:
            return None
        problem = teacher_tokenizer_problem(self.s.model.path, t.path, t.trust_remote_code)
        if problem:
            raise ConfigError(problem)
        model = load_model(
            t.path,
            t.dtype,
            t.attention_implementation,
            "distill.teacher_path",
            trust_remote_code=t.trust_remote_code,
        )
        return model.eval().requires_grad_(False)

    @staticmethod
    def _optimizer(model: torch.nn.Module, ocfg, mcfg=None):
        """The optimizer and schedule of `model` (a VLM's vision tower frozen or at its own learning rate, by
        `mcfg`, the model config); a DeepSpeed engine's is ours wrapped (scheduled here)."""
        if hasattr(model, "set_gradient_accumulation_boundary"):
            base = getattr(model.optimizer, "optimizer", model.optimizer)
            return model.optimizer, make_scheduler(base, ocfg)
        return make_optimizer(param_groups(model, ocfg.lr, mcfg), ocfg)

    def _wrap(self, model: torch.nn.Module, ocfg=None) -> torch.nn.Module:
        """Recompute activations if asked, then the strategy's wrapper when there are several workers
        (`ocfg`: the optimizer config a DeepSpeed engine builds its optimizer from; the actor's if None)."""
        mem = self.s.memory
        if mem.gradient_checkpointing or mem.activation_checkpointing:
            inner = getattr(model, "backbone", model)
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.world_size == 1:
            return model
        if self.mesh is not None:
            from components.training.tensor_parallel import parallelize

            parallelize(model, self.mesh["tp"], self.s.parallel.sequence_parallel)
            if self.mesh["dp"].size() == 1:
                return model
        return D.STRATEGIES.get(self.s.parallel.strategy)(
            model, parallel_settings(self.s, self.world_size, ocfg, self.mesh)
        )

    def _make_critic(self, settings: UpdateSettings) -> CriticTrainer:
        m, c = self.s.model, self.s.critic
        key = "critic.model_path" if c.model_path else "actor.model.path"
        value_model = build_value_model(
            c.model_path or m.path,
            m.dtype,
            m.attention_implementation,
            key,
            LoraSettings.from_config(c.lora),
            m.trust_remote_code,
        )
        model = self._wrap(value_model, c.optimizer)
        opt, sched = self._optimizer(model, c.optimizer)
        return CriticTrainer(model, opt, sched, settings.loop, c.cliprange_value, "token-mean", self.comm)

    def _compression(self) -> D.CompressionChoice | None:
        """DDP only: measure the all-reduce bandwidth once and install the gradient compression it calls for."""
        t = self.s.parallel
        if self.world_size == 1 or t.strategy != "ddp" or self.pipeline is not None:
            return None
        gbps = D.measure_allreduce_gbps(cap_gbps=t.simulated_bandwidth_gbps)
        choice = D.choose_compression(
            gbps, t.grad_compression, t.compression_fp16_below_gbps, t.compression_powersgd_below_gbps
        )
        for part in [self.model] + ([self.critic.model] if self.critic is not None else []):
            D.register_compression(part, choice)
        return choice

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
        start = time.perf_counter()
        metrics = self.trainer.update(batch)
        metrics["timing_s/update_actor_compute"] = (
            time.perf_counter() - start
        )  # in the worker (log-probs too)
        self.version += 1
        if self.images is not None:
            metrics |= vision_metrics(batch, self.images.token_id, self.s.model.freeze_vision_model)
        if self.compression is not None:
            metrics["perf/grad_compression"] = COMPRESSION_CODES[self.compression.name]
            metrics["perf/grad_compression_rank"] = self.compression.rank
            metrics["perf/allreduce_gbps"] = self.compression.allreduce_gbps
        return metrics

    def get_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """The current weights for the rollout engine (detached CPU tensors, gathered from the shards on rank
        0; {} on other ranks) and their version: with LoRA, the adapters alone, or the merged weights when the
        engine takes no adapters (engine.lora_merge_on_sync). Every rank must be called."""
        if self.s.lora.enabled and not self.s.lora_merge_on_sync:
            return (adapter_state(D.unwrap(self.model)) if self.rank == 0 else {}), self.version
        return self._full_state(self.model), self.version

    def _full_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """`model`'s whole state dict on rank 0, gathered from the stages or shards ({} on other ranks); a LoRA
        policy's merged into the base model's weights (every worker holds all of it: DDP)."""
        if self.pipeline is not None and model is self.model:
            return self.pipeline.full_state()
        if model is self.model and self.s.lora.enabled:
            return merged_state(D.unwrap(model)) if self.rank == 0 else {}
        return D.full_model_state(model)

    def _hf_model(self) -> torch.nn.Module:
        """The Hugging Face model object of the policy (its config, for saving): a LoRA policy's base."""
        if self.pipeline is not None:
            return self.pipeline.module.lm
        model = D.unwrap(self.model)
        return model.get_base_model() if self.s.lora.enabled else model

    def save_model(self, out: str, kind: str = MODEL) -> str:
        """The policy in Hugging Face format (rank 0 writes it; every rank must be called), marked as an output
        of `kind` (only a directory of that kind is ever replaced). A LoRA policy is written merged, with its
        peft adapter directory inside (`adapter/`, naming the base model directory)."""
        state = self._full_state(self.model)
        if self.rank == 0:
            processor = self.images.processor if self.images is not None else None
            save_pretrained(
                self._hf_model(), self.tokenizer, out, state_dict=state, kind=kind, processor=processor
            )
            if self.s.lora.enabled:
                save_adapter(D.unwrap(self.model), self.tokenizer, Path(out) / ADAPTER_DIR, self.s.model.path)
        return out

    def _trained_parts(self) -> list[tuple[str, PolicyTrainer | CriticTrainer, str]]:
        """(name, trainer, optimizer file) of each part with an optimizer: the actor, and the critic if any."""
        parts = [("actor", self.trainer, "optimizer")]
        return parts + ([("critic", self.critic, "critic_optimizer")] if self.critic is not None else [])

    def _optimizer_state(self, part) -> dict:
        if self.world_size == 1:
            return part.optimizer.state_dict()
        if self.pipeline is not None and part is self.trainer:
            return self.pipeline.full_optimizer_state(part.optimizer)
        return D.full_optimizer_state(part.model, part.optimizer)

    def write_checkpoint(self, out: str, with_optimizer: bool = True) -> None:
        """A checkpoint into the (temporary) directory `out`. Full format: rank 0 writes the model (HF format),
        the whole optimizer state (gathered from every worker, in one format whatever their number) and the
        critic. Sharded format (trainer.checkpoint_format=sharded): every rank writes its own shards of them
        at once (components/tracking/sharded.py), rank 0 the model's config and tokenizer beside them. Then
        rank 0 writes the scheduler, step counters, weights version and its RNG states, rank r > 0 its RNG
        states (rng_rank<r>.json: with workers on several nodes, trainer.output_dir must be shared storage).
        Every rank must be called."""
        out = Path(out)
        sharded = self.s.checkpoint_format == "sharded"
        if sharded:
            self._write_shards(out, with_optimizer)
            parts = [(name, part, opt_file, None) for name, part, opt_file in self._trained_parts()]
            critic = None
        else:
            self.save_model(str(out / "model"))
            parts = [
                (name, part, opt_file, self._optimizer_state(part) if with_optimizer else None)
                for name, part, opt_file in self._trained_parts()
            ]
            critic = D.full_model_state(self.critic.model) if self.critic is not None else None
        if self.rank > 0:
            # rank 0 may not have made the directory yet: nothing above synchronises the ranks for a LoRA policy
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rng_rank{self.rank}.json").write_text(
                json.dumps({"rng": rng_state(), "torch": torch.get_rng_state().tolist()})
            )
            return
        tensors, state = {"rng.torch": torch.get_rng_state()}, {"version": self.version, "rng": rng_state()}
        for name, part, opt_file, opt_state in parts:
            if opt_state is not None:
                save_optimizer(out, opt_file, opt_state)
            state[name] = {"steps": part.steps, "scheduler": part.scheduler.state_dict()}
        if critic is not None:
            # cloned: a VLM critic keeps its LM's tied embedding and head, which safetensors will not store as one
            critic_tensors = {k: v.detach().clone().contiguous() for k, v in critic.items()}
            save_file(critic_tensors, out / "critic.safetensors")
        save_file(tensors, out / "worker.safetensors")
        (out / "worker.json").write_text(json.dumps(state, sort_keys=True))

    def _write_shards(self, out: Path, with_optimizer: bool) -> None:
        """Every rank's shards of each trained part (model and optimizer); rank 0 also the model's config,
        tokenizer and processor, so the checkpoint's model directory describes the model (convert, resume
        checks) without a gathered copy of its weights."""
        for name, part, opt_file in self._trained_parts():
            S.save_shards(S.model_shards(part.model), out / PART_DIRS[name] / S.SHARDS)
            if with_optimizer:
                S.save_optimizer_shards(part.model, part.optimizer, out / opt_file, self.rank)
        if self.rank == 0:
            self._hf_model().config.save_pretrained(out / "model")
            self.tokenizer.save_pretrained(out / "model")
            if self.images is not None:
                self.images.processor.save_pretrained(out / "model")

    def load_checkpoint(self, path: str) -> int:
        """Restore everything write_checkpoint wrote, in either format and whatever layout wrote it (the
        caller verified the manifest); returns the version."""
        ckpt = Path(path)
        state = json.loads((ckpt / "worker.json").read_text())
        sharded = S.is_sharded(ckpt)
        if sharded:
            S.load_model_shards(self.model, ckpt / "model" / S.SHARDS)
        elif self.s.lora.enabled:  # the base is actor.model.path (in the resume fingerprint): the adapters
            adapters = load_file(ckpt / "model" / ADAPTER_DIR / ADAPTER_WEIGHTS)
            load_adapter_state(D.unwrap(self.model), adapters, f"checkpoint {ckpt}")
        else:
            loaded = load_model(
                ckpt / "model",
                self.s.model.dtype,
                self.s.model.attention_implementation,
                key=f"checkpoint {ckpt}",
                safetensors_only=True,
            )
            self._load_weights(self.model, loaded.state_dict())
        for name, part, opt_file in self._trained_parts():
            if sharded and (ckpt / opt_file / S.SHARDS).is_dir():
                S.load_optimizer_shards(part.model, part.optimizer, ckpt / opt_file)
            else:
                opt = None if sharded else load_optimizer(ckpt, opt_file)
                if opt is None:
                    raise CheckpointError(
                        f"{ckpt} has no {name} optimizer state (saved with trainer.save_optimizer="
                        "false), so a resume would not be exact. Start fresh with "
                        "trainer.resume_mode=disable."
                    )
                if self.world_size == 1:
                    part.optimizer.load_state_dict(opt)
                elif self.pipeline is not None and part is self.trainer:
                    self.pipeline.load_full_optimizer_state(part.optimizer, opt)
                else:
                    D.load_full_optimizer_state(part.model, part.optimizer, opt)
            part.scheduler.load_state_dict(state[name]["scheduler"])
            part.steps = state[name]["steps"]
        if self.critic is not None and sharded:
            S.load_model_shards(self.critic.model, ckpt / PART_DIRS["critic"] / S.SHARDS)
        elif self.critic is not None:
            self._load_weights(self.critic.model, load_file(ckpt / "critic.safetensors"))
        own = ckpt / f"rng_rank{self.rank}.json"
        if self.rank == 0:
            torch.set_rng_state(load_file(ckpt / "worker.safetensors")["rng.torch"])
            set_rng_state(state["rng"])
        elif own.is_file():  # saved with as many workers; a group of another size keeps its seeded state
            rng = json.loads(own.read_text())
            torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
            set_rng_state(rng["rng"])
        self.version = state["version"]
        return self.version

    def _load_weights(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        if self.world_size == 1:
            model.load_state_dict(state)
        elif self.pipeline is not None and model is self.model:
            self.pipeline.load_full_state(state)
        else:
            D.load_full_model_state(model, state)

    def pid(self) -> int:
        return os.getpid()

    def parameter_count(self) -> int:
        """Parameter elements this worker holds (its shards under TP or FSDP; a tied weight once)."""
        from torch.distributed.tensor import DTensor

        params = {id(p): p for p in self.model.parameters()}.values()
        return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)

    def state(self) -> dict:
        return {"version": self.version, "steps": self.trainer.steps}


class ColocatedWorker(PolicyWorker):
    """Policy worker 0 that also serves the rollout engine (trainer.rollout_placement=colocate), sampling with
    the policy's own parameters: a weight sync moves the version and copies nothing, and the run has one
    process (and one copy of the model) fewer."""

    def setup(self, spec: D.GroupSpec) -> int:
        from components.rollout.worker import RolloutWorker

        pid = super().setup(spec)
        self.rollout = RolloutWorker.from_settings(self.s.rollout, model=D.unwrap(self.model))
        return pid

    def generate(self, *args, **kwargs) -> Batch:
        return self.rollout.generate(*args, **kwargs)

    def weights_version(self) -> int:
        return self.rollout.weights_version()

    def share_weights(self) -> int:
        """The engine holds this worker's parameters: mark them current at this version."""
        self.rollout.engine.mark_current(self.version)
        return self.version


class ReferenceWorker:
    """The frozen reference policy in a Ray actor of its own (trainer.ref_placement=separate): log-probs of
    the responses, so the policy workers hold no second copy of the model."""

    def __init__(self, s: ReferenceSettings):
        torch.set_num_threads(s.num_threads)
        m = s.model
        model = load_model(m.path, m.dtype, m.attention_implementation, trust_remote_code=m.trust_remote_code)
        self.model = model.eval().requires_grad_(False)
        self.temperature, self.micro = s.temperature, s.micro_batch_size

    def logprobs(self, batch: Batch) -> torch.Tensor:
        return batch_logprobs(self.model, batch, self.temperature, self.micro)

    def pid(self) -> int:
        return os.getpid()
