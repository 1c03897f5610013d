"""`reinforge convert`: a Hugging Face directory into a sharded model for a worker mesh, and a sharded model (or
the model of a sharded checkpoint) back into a Hugging Face directory: the model merger. Both directions go
through the same code the policy workers run (the tensor-parallel plan, FSDP2, torch.distributed.checkpoint's
safetensors storage), so a round trip gives bit-identical tensors.

A sharded model directory holds the model's config and tokenizer (and a VLM's processor) beside `shards/`, the
safetensors files each worker wrote; a sharded checkpoint keeps one as its `model/`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from components.errors import ConfigError
from components.models.loading import check_model_code
from components.tracking.sharded import SHARDS, load_shards


def sharded_model_dir(path: str | Path) -> Path:
    """The sharded model directory in `path`: `path` itself, or a sharded checkpoint's `model/`; ConfigError
    naming --source and what it expected otherwise."""
    path = Path(path)
    for candidate in (path, path / "model"):
        if (candidate / SHARDS).is_dir() and (candidate / "config.json").is_file():
            return candidate
    raise ConfigError(
        f"--source={path}: no sharded model there (a directory with config.json and {SHARDS}/, or a checkpoint "
        "written with trainer.checkpoint_format=sharded). A Hugging Face directory converts the other way: "
        "--to sharded."
    )


def _auto_class(path: Path):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from components.models.loading import is_vlm_dir

    return AutoModelForImageTextToText if is_vlm_dir(path) else AutoModelForCausalLM


# convert splits and merges architectures transformers has (their tensor-parallel plans): never a directory's code
NO_CODE = "`reinforge convert` never runs it"


def to_hf(source: str | Path, out: str | Path) -> Path:
    """Merge the shards in `source` into a Hugging Face directory `out` (safetensors), whatever mesh wrote
    them: the model is built from its config in the dtype it was saved in, then every tensor is read whole from
    the shards (DCP assembles each from the files that hold its pieces)."""
    import torch
    from transformers import AutoConfig

    from components.models.loading import DTYPES, load_tokenizer, save_pretrained

    src = sharded_model_dir(source)
    check_model_code(src, source, "--source", False, NO_CODE)
    config = AutoConfig.from_pretrained(src, local_files_only=True, trust_remote_code=False)
    saved = json.loads((src / "config.json").read_text())
    dtype = DTYPES.get(saved.get("dtype") or saved.get("torch_dtype") or "float32", torch.float32)
    model = _auto_class(src).from_config(config, dtype=dtype)
    state = model.state_dict()
    load_shards(state, src / SHARDS)
    model.load_state_dict(state)
    tokenizer, processor = load_tokenizer(src, "--source"), None
    if "vision_config" in saved:
        from components.models.vlm import load_processor

        processor = load_processor(src, tokenizer, "--source")
    return save_pretrained(model, tokenizer, out, processor=processor)


def _shard_worker(rank: int, world: int, port: int, source: str, out: str, tp: int) -> None:
    """One worker of the conversion group: the HF model split as a policy worker splits it, then its shards
    written."""
    import torch
    import torch.distributed as dist

    from components.models.loading import load_model
    from components.tracking.sharded import model_shards, save_shards
    from components.training import distributed as D
    from components.training.tensor_parallel import parallelize

    torch.set_num_threads(1)
    D.join_group(D.GroupSpec(rank, world, "127.0.0.1", port))
    try:
        model = load_model(source, key="--source")
        mesh = D.parallel_mesh(world, tp, "cpu")
        if mesh is not None:
            parallelize(model, mesh["tp"])
        if (
            world // tp > 1
        ):  # the data-parallel replicas shard what TP left whole, as trainer.strategy=fsdp does
            D.wrap_fsdp(model, D.ParallelSettings(world_size=world, mesh=mesh))
        save_shards(model_shards(model), Path(out) / SHARDS)
    finally:
        if world > 1:
            dist.destroy_process_group()


def to_sharded(source: str | Path, out: str | Path, tensor_parallel: int = 1, data_parallel: int = 1) -> Path:
    """Split the Hugging Face model in `source` for a mesh of data_parallel x tensor_parallel workers (local CPU
    processes, gloo) and write each worker's shards into the sharded model directory `out`."""
    import torch.multiprocessing as mp

    from components.models.loading import check_model_dir, load_tokenizer
    from components.training.distributed import free_port
    from components.training.tensor_parallel import plan_problems

    src = check_model_dir(source, "--source")
    check_model_code(src, source, "--source", False, NO_CODE)
    problems = plan_problems(str(src), tensor_parallel, "--source")
    if problems:
        raise ConfigError(problems[0].replace("actor.tensor_model_parallel_size", "--tensor-parallel"))
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out={out} exists and is not empty; give a new directory.")
    out.mkdir(parents=True, exist_ok=True)
    world = tensor_parallel * data_parallel
    args = (world, free_port(), str(src), str(out), tensor_parallel)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if world == 1:
        _shard_worker(0, *args)
    else:
        mp.spawn(_shard_worker, args=args, nprocs=world, join=True)
    from transformers import AutoConfig

    AutoConfig.from_pretrained(src, local_files_only=True, trust_remote_code=False).save_pretrained(out)
    saved = load_tokenizer(src, "--source")
    if "vision_config" in json.loads((src / "config.json").read_text()):
        from components.models.vlm import load_processor

        saved = load_processor(src, saved, "--source")  # the processor saves its tokenizer too
    saved.save_pretrained(out)
    return out
