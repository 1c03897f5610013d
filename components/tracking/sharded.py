"""Sharded checkpoints (trainer.checkpoint_format=sharded): every policy worker writes its own shards of the
model and optimizer state at once, and any number of workers, in any layout (one worker, DDP, FSDP, tensor
parallel), reads them back: torch.distributed.checkpoint (DCP) plans the reads from what each file holds.

The files are safetensors, written and read through DCP's Hugging Face storage: each file records the offsets
of the shards it holds in its JSON metadata, so, as for full checkpoints, nothing is ever unpickled. A group
of N workers writes N files (fewer when shards are replicated: DCP writes a replicated tensor once).

Layout inside a checkpoint: `<part>/shards/*.safetensors` for the model ("model", "critic") and the optimizer
("optimizer", "critic_optimizer"), and `<optimizer part>/param_groups.json` (learning rates and the like).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from components.training.distributed import state_module

SHARDS = "shards"
PARAM_GROUPS = "param_groups.json"


def is_sharded(ckpt: Path) -> bool:
    """Whether a checkpoint was written sharded (whatever the current trainer.checkpoint_format)."""
    return (Path(ckpt) / "model" / SHARDS).is_dir()


def save_shards(state: dict[str, torch.Tensor], directory: Path) -> None:
    """Every rank calls this with its own (sharded) state dict; each writes its shards under `directory`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    directory.mkdir(parents=True, exist_ok=True)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))


def load_shards(template: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    """Fill `template` (this rank's layout: DTensor shards, or whole tensors) from the shards in `directory`,
    whatever layout wrote them; every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    dcp.load(template, storage_reader=HuggingFaceStorageReader(str(directory)))
    return template


def model_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of the model's state dict (DTensor shards under FSDP or TP)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(state_module(model))


def load_model_shards(model: torch.nn.Module, directory: Path) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(state_module(model), load_shards(model_shards(model), directory))


def optimizer_shards(model: torch.nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """This rank's optimizer state as flat tensors ({`state.<parameter>.<name>`: tensor}) and the parameter
    groups (parameters by name); an optimizer that has not stepped yet gets its state created first (DCP's
    get_optimizer_state_dict does), so a fresh group can be the template a checkpoint is read into."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd = get_optimizer_state_dict(state_module(model), optimizer)
    tensors = {f"state.{fqn}.{k}": v for fqn, state in sd["state"].items() for k, v in state.items()}
    return tensors, sd["param_groups"]


def save_optimizer_shards(model: torch.nn.Module, optimizer, directory: Path, rank: int) -> None:
    tensors, groups = optimizer_shards(model, optimizer)
    save_shards(tensors, directory / SHARDS)
    if rank == 0:
        (directory / PARAM_GROUPS).write_text(json.dumps(groups, sort_keys=True))


def load_optimizer_shards(model: torch.nn.Module, optimizer, directory: Path) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    tensors, _ = optimizer_shards(model, optimizer)
    load_shards(tensors, directory / SHARDS)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        fqn, name = key[len("state.") :].rsplit(".", 1)
        state.setdefault(fqn, {})[name] = value
    groups = json.loads((directory / PARAM_GROUPS).read_text())
    set_optimizer_state_dict(state_module(model), optimizer, {"state": state, "param_groups": groups})
