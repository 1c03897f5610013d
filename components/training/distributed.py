"""Several policy workers as one torch.distributed process group: joining it, the collectives the update
loop needs, what each `trainer.strategy` does to the model, full (rank-0) state dicts, and DDP's adaptive
gradient compression.

One worker needs none of this: `Comm()` is the single-process no-op and the model stays unwrapped.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from components.algorithms.registry import Registry


@dataclass(frozen=True)
class GroupSpec:
    """What worker `rank` needs to join the group: rank 0's address and a free port on it."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    backend: str = "gloo"  # nccl on CUDA
    timeout_s: float = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def join_group(spec: GroupSpec) -> None:
    """init_process_group over TCP (rank 0's address); a no-op for a group of one. Also sets the variables
    torch's launcher would (DeepSpeed reads them); with GPUs Ray gives each actor its own device, index 0."""
    import os

    os.environ.update(
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
        LOCAL_RANK="0" if spec.backend == "nccl" else str(spec.rank),
    )
    if spec.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            spec.backend,
            init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.timeout_s),
        )


class Comm:
    """The collectives of the update loop, for one process: every reduction is the identity."""

    rank, world_size = 0, 1

    def sum(self, values: list[float]) -> list[float]:
        return values

    def max(self, value: int) -> int:
        return value

    def min(self, value: float) -> float:
        return value


class DistComm(Comm):
    """The same collectives over a process group (float64 all-reduce): the default one, or with tensor
    parallelism the data-parallel group of this worker (its TP peers hold the same rows)."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def _reduce(self, values: list[float], op) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def sum(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM) if values else values

    def max(self, value: int) -> int:
        return int(self._reduce([float(value)], dist.ReduceOp.MAX)[0])

    def min(self, value: float) -> float:
        return self._reduce([value], dist.ReduceOp.MIN)[0]


def make_comm(group=None) -> Comm:
    """The update loop's collectives over `group` (None: every worker); the no-op for a group of one."""
    return DistComm(group) if dist.is_initialized() and dist.get_world_size(group) > 1 else Comm()


def parallel_mesh(world_size: int, tensor_parallel_size: int, device: str, pipeline_parallel_size: int = 1):
    """The device mesh of a model-parallel group, None without model parallelism: (dp, tp) with tensor
    parallelism alone, (dp, pp, tp) with pipeline stages. A data-parallel replica is consecutive ranks, its
    TP peers adjacent (as on one node's GPUs). Every rank must call it."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp == 1 and pp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    dp = world_size // (tp * pp)
    if pp == 1:
        return init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))


@dataclass(frozen=True)
class ParallelSettings:
    """What the strategies read from the config (components/training/worker.py builds it)."""

    world_size: int = 1
    data_parallel_size: int = 1  # fsdp: replicas (hybrid sharding when 1 < dp < world_size)
    param_offload: bool = False
    optimizer_offload: bool = False
    mp_dtype: torch.dtype | None = None  # fsdp's MixedPrecisionPolicy param dtype
    zero_stage: int = 2
    grad_clip: float = 1.0  # deepspeed clips inside its step
    optimizer: Callable | None = (
        None  # params -> torch optimizer, for deepspeed to wrap (ours: actor.optimizer)
    )
    mesh: object = None  # tensor parallelism's (dp, tp) DeviceMesh (parallel_mesh); None without it


# strategy name -> (model, settings) -> wrapped model (built before its optimizer)
STRATEGIES: Registry = Registry("strategy", "trainer.strategy")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a Hugging Face causal LM (what FSDP shards one by one)."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    return [m for m in model.modules() if type(m).__name__ in names]


@STRATEGIES.register("ddp")
def wrap_ddp(model: torch.nn.Module, s: ParallelSettings) -> torch.nn.Module:
    """Every worker holds the whole model; gradients are averaged by all-reduce in buckets."""
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


@STRATEGIES.register("fsdp")
def wrap_fsdp(model: torch.nn.Module, s: ParallelSettings) -> torch.nn.Module:
    """FSDP2 (`fully_shard`): each decoder layer, then the root, sharded over the workers (full sharding), or
    over groups of world_size / data_parallel_size workers replicated data_parallel_size times (hybrid)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device.type
    if s.mesh is not None:  # tensor parallel inside each replica: shard over the data-parallel dimension
        mesh = s.mesh["dp"]
    elif s.data_parallel_size > 1:
        mesh = init_device_mesh(
            device,
            (s.data_parallel_size, s.world_size // s.data_parallel_size),
            mesh_dim_names=("replicate", "shard"),
        )
    else:
        mesh = init_device_mesh(device, (s.world_size,))
    kwargs: dict = {"mesh": mesh}
    if s.mp_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=s.mp_dtype, reduce_dtype=torch.float32)
    if s.param_offload or s.optimizer_offload:
        # parameters, gradients and optimizer state in host memory (pinned for fast copies when there is a GPU)
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


@STRATEGIES.register("deepspeed")
def wrap_deepspeed(model: torch.nn.Module, s: ParallelSettings) -> torch.nn.Module:
    """DeepSpeed ZeRO (stage s.zero_stage) around the model and our optimizer (s.optimizer), whose state
    it partitions; the engine steps at the accumulation boundaries we mark."""
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(
            "trainer.strategy=deepspeed needs the deepspeed package: pip install 'reinforge[gpu]' "
            f"(or set trainer.strategy=fsdp, which ships with torch): {exc}"
        ) from None
    zero: dict = {"stage": s.zero_stage}
    if s.optimizer_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if s.param_offload and s.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "gradient_clipping": s.grad_clip,
        "zero_allow_untested_optimizer": True,
        "wall_clock_breakdown": False,
    }
    if s.mp_dtype is not None:
        config["bf16" if s.mp_dtype == torch.bfloat16 else "fp16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=s.optimizer,
        config=config,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
    )
    return engine


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP / DeepSpeed wrapper (FSDP2 shards in place: the model itself)."""
    return getattr(model, "module", model)


def state_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose state dicts torch.distributed.checkpoint reads and writes: DDP's inner module, else the
    model itself (FSDP2 and tensor parallelism shard it in place)."""
    return unwrap(model) if hasattr(model, "no_sync") else model


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Skip the gradient reduction of a micro-batch that is not the last of its mini-batch (wraps its
    forward and backward)."""
    if enabled:
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float):
    """torch's clip_grad_norm_, or with tensor parallelism (parameters on several meshes, or DTensors beside
    plain tensors) the same over every layout."""
    from torch.distributed.tensor import DTensor

    layouts = {p.device_mesh if isinstance(p, DTensor) else None for p in params}
    if len(layouts) > 1:
        from components.training.tensor_parallel import clip_grad_norm as mixed

        return torch.tensor(mixed(params, max_norm))
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


class TorchStep:
    """backward / clip / step with a torch optimizer (one process, DDP or FSDP), with optional fp16 loss
    scaling. One instance per mini-batch step."""

    def __init__(self, model: torch.nn.Module, optimizer, grad_clip: float, scaler=None):
        self.model, self.optimizer, self.grad_clip, self.scaler = model, optimizer, grad_clip, scaler

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def accumulate(self, last: bool):
        return gradient_sync(self.model, last)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def forward_backward(self, micro_loss, part, agg, scale: float, last: bool) -> dict:
        """One micro-batch's loss (micro_loss(part, agg)) times `scale`, backpropagated; its metrics."""
        with self.accumulate(last):
            loss, metrics = micro_loss(part, agg)
            self.backward(loss * scale, last)
        return metrics

    def step(self) -> float:
        """Clip to grad_clip and step; returns the global gradient norm before clipping."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = clip_grad_norm(params, self.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


class DeepSpeedStep(TorchStep):
    """The same through a DeepSpeed engine: it reduces (ZeRO-partitioned) gradients at the accumulation
    boundary we mark, clips (gradient_clipping in its config) and steps its wrapped optimizer."""

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def accumulate(self, last: bool):
        self.model.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.model.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.model.step()
        norm = self.model.get_global_grad_norm()
        return float(norm if norm is not None else 0.0)


class PipelineStep(TorchStep):
    """The same for a pipeline stage (components/training/pipeline_parallel.Pipeline): the schedule runs each
    micro-batch's forward and backward across the stages, the last stage computing `logits_loss(tensors,
    logits, agg)`; the step sums a tied embedding's gradients and clips by the whole model's norm."""

    def __init__(self, pipeline, optimizer, grad_clip: float, logits_loss):
        super().__init__(pipeline.module, optimizer, grad_clip)
        self.pipeline, self.logits_loss = pipeline, logits_loss

    def forward_backward(self, micro_loss, part, agg, scale: float, last: bool) -> dict:
        def loss(logits, tensors):
            value, metrics = self.logits_loss(tensors, logits, agg)
            return value * scale, metrics

        return self.pipeline.forward_backward(part.tensors, loss)

    def step(self) -> float:
        self.pipeline.sync_grads()
        norm = self.pipeline.clip_grad_norm(self.grad_clip)
        self.optimizer.step()
        return norm


def make_step(
    model: torch.nn.Module, optimizer, grad_clip: float, scaler=None, pipeline=None, logits_loss=None
) -> TorchStep:
    if pipeline is not None:
        return PipelineStep(pipeline, optimizer, grad_clip, logits_loss)
    is_deepspeed = hasattr(model, "set_gradient_accumulation_boundary")
    return (DeepSpeedStep if is_deepspeed else TorchStep)(model, optimizer, grad_clip, scaler)


def _zero3(model: torch.nn.Module) -> bool:
    return hasattr(model, "zero_optimization_stage") and model.zero_optimization_stage() == 3


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0 (CPU tensors), {} elsewhere; every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if _zero3(model):  # ZeRO-3 partitions the parameters themselves: gather them for the copy
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.module.parameters()), modifier_rank=None):
            state = {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
        return state if dist.get_rank() == 0 else {}
    return get_model_state_dict(
        state_module(model),
        options=StateDictOptions(full_state_dict=True, cpu_offload=True),
    )


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every rank passes the whole state dict; each keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if _zero3(model):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.module.parameters()), modifier_rank=0):
            if dist.get_rank() == 0:
                model.module.load_state_dict(state)
        return
    set_model_state_dict(
        state_module(model),
        state,
        options=StateDictOptions(full_state_dict=True),
    )


def full_optimizer_state(model: torch.nn.Module, optimizer) -> dict:
    """The optimizer's whole state on rank 0 in torch's plain format (parameters numbered in order), so a
    checkpoint is the same whatever the number of workers; {} on other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(
        state_module(model),
        optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True),
    )
    if not sd:
        return {}
    order = [name for group in sd["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]]
    return {"state": {index[n]: v for n, v in sd["state"].items()}, "param_groups": groups}


def load_full_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """The inverse of full_optimizer_state: every rank passes the whole plain state; each keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    inner = state_module(model)
    names = [n for n, p in inner.named_parameters() if p.requires_grad]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    sd = {"state": {names[int(i)]: v for i, v in state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(inner, optimizer, sd, options=StateDictOptions(full_state_dict=True))


# ---- adaptive gradient compression (DDP communication hooks) ----


@dataclass(frozen=True)
class CompressionChoice:
    name: str  # none | fp16 | powersgd
    allreduce_gbps: float
    rank: int = 0  # PowerSGD matrix rank


def measure_allreduce_gbps(nbytes: int = 1 << 22, repeats: int = 3, cap_gbps: float | None = None) -> float:
    """Bandwidth of an all-reduce of `nbytes` (GB/s), the slowest rank's, agreed by every rank. cap_gbps
    simulates a slower link: each all-reduce is held until it would have finished at that rate."""
    buf = torch.ones(nbytes // 4)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if cap_gbps:
            time.sleep(max(0.0, nbytes / (cap_gbps * 1e9) - (time.perf_counter() - t0)))
    gbps = nbytes * repeats / (time.perf_counter() - start) / 1e9
    return DistComm().min(gbps)


def choose_compression(
    gbps: float, mode: str, fp16_below_gbps: float, powersgd_below_gbps: float
) -> CompressionChoice:
    """auto: none on a fast link, fp16 below fp16_below_gbps, PowerSGD below powersgd_below_gbps, its rank
    (how much of the gradient survives) 4 just below that, 2 below half of it, 1 below a quarter; other modes
    are taken as given (PowerSGD's rank still from the bandwidth)."""
    if mode == "auto":
        mode = "powersgd" if gbps < powersgd_below_gbps else "fp16" if gbps < fp16_below_gbps else "none"
    rank = 1 if gbps < powersgd_below_gbps / 4 else 2 if gbps < powersgd_below_gbps / 2 else 4
    return CompressionChoice(mode, gbps, rank if mode == "powersgd" else 0)


def _fp16_hook():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    return None, fp16_compress_hook


def _powersgd_hook(rank: int):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,
        use_error_feedback=True,
        warm_start=True,
    )
    return state, powerSGD_hook.powerSGD_hook


def register_compression(model: torch.nn.Module, choice: CompressionChoice) -> None:
    """Install the chosen hook on a DDP model (`none` keeps DDP's own all-reduce)."""
    if choice.name == "none" or not hasattr(model, "register_comm_hook"):
        return
    state, hook = _fp16_hook() if choice.name == "fp16" else _powersgd_hook(choice.rank)
    model.register_comm_hook(state, hook)
