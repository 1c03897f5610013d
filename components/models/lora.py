"""LoRA (actor.lora.rank > 0): the policy trains low-rank adapters over frozen base weights, with peft.

- Training: `apply_lora` wraps the loaded model in a peft model; only the adapters need gradients, so only
  they get optimizer state. The frozen reference is the same module with its adapters disabled
  (`AdaptersOff`): no second copy of the weights.
- Weight sync: the adapters alone (`adapter_state`, peft's own naming) into an engine that holds the same
  adapters over the same base (the hf engine in its own actor), or the merged weights (`merged_state`, the
  base model's names) for an engine without adapter support (engine.lora_merge_on_sync).
- Export: a peft adapter directory (`save_adapter`) and the merged Hugging Face model; `load_merged` reads
  an adapter directory back as a merged model, so `reinforge generate` and `evaluate` take either.

The merged weights are computed beside the module (W + delta for each adapted layer), never by merging in
place and back, which would round the base weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from components.settings import LoraSettings

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
INITS = {"default": True, "gaussian": "gaussian"}  # actor.lora.init -> peft's init_lora_weights


def peft_config(s: LoraSettings, base_path: str | None = None):
    """peft's LoraConfig of these settings."""
    from peft import LoraConfig

    targets = s.target_modules
    return LoraConfig(
        r=s.rank,
        lora_alpha=s.alpha,
        lora_dropout=s.dropout,
        target_modules=list(targets) if isinstance(targets, tuple) else targets,
        init_lora_weights=INITS[s.init],
        base_model_name_or_path=base_path,
        task_type="CAUSAL_LM",
    )


def apply_lora(model: torch.nn.Module, s: LoraSettings, base_path: str | None = None) -> torch.nn.Module:
    """`model` with adapters (its base weights frozen); the adapters' random parts drawn from torch's
    (seeded) RNG."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config(s, base_path))


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors (detached CPU copies), in peft's naming (what an adapter directory holds)."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Set the adapters of `model` from `state` (adapter_state's naming); every adapter tensor must be
    there, and nothing else, or the load fails naming `what`."""
    from peft.utils import set_peft_model_state_dict

    expected = set(adapter_state(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"{what}: the adapter tensors do not match the model's adapters (missing {missing[:3]}, "
            f"unexpected {extra[:3]}); was it written with the same actor.lora settings?"
        )
    result = set_peft_model_state_dict(model, state)
    if result.unexpected_keys:
        raise ValueError(f"{what}: adapter tensors the model has no place for: {result.unexpected_keys[:3]}")


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The merged weights (base + each adapter's delta) under the base model's names, computed beside the
    module: its own base weights are left untouched. Detached CPU tensors."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    state = {k: v.detach().cpu().clone() for k, v in base.state_dict().items() if "lora_" not in k}
    state = {k.replace(".base_layer.", "."): v for k, v in state.items()}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and not module.merged:
                key = f"{name}.weight"
                for adapter in module.active_adapters:
                    state[key] = state[key] + module.get_delta_weight(adapter).detach().cpu().to(
                        state[key].dtype
                    )
    return state


class AdaptersOff(torch.nn.Module):
    """The frozen reference of a LoRA policy: its forward is the policy's with the adapters disabled, i.e. the
    base model, sharing its weights."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.__dict__["peft"] = model  # not a submodule: its parameters are the policy's, not the reference's

    @property
    def config(self):
        return self.peft.get_base_model().config

    def forward(self, *args, **kwargs):
        with self.peft.disable_adapter():
            return self.peft(*args, **kwargs)


def save_adapter(model: torch.nn.Module, tokenizer, out: str | Path, base_path: str) -> Path:
    """A peft adapter directory (adapter_config.json naming the base model directory, adapter weights) with
    the tokenizer beside them, written atomically."""
    import os
    import shutil

    from components.tracking.checkpoints import replace_dir

    out = Path(out)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.peft_config["default"].base_model_name_or_path = str(base_path)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_adapter_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def adapter_base(path: str | Path) -> str:
    """The base model directory an adapter directory names."""
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""


def load_merged(path: str | Path, load_base) -> torch.nn.Module:
    """An adapter directory as one merged model: its base (load_base(dir)) with the adapters folded in."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base(adapter_base(path)), str(path), is_trainable=False)
    return model.merge_and_unload()


def lora_problems(model_dir: str, s: LoraSettings, key: str = "actor.lora") -> list[str]:
    """Adapters this model cannot take, each naming the key and the fix: target_modules naming no module,
    a rank above a targeted layer's smaller side. The model is built on the meta device from its
    config.json (no weights read); [] when the directory does not exist yet."""
    if not s.enabled or not (Path(model_dir) / "config.json").is_file():
        return []
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if s.target_modules == "all-linear":
        head = model.get_output_embeddings()
        targets = {n: m for n, m in linear.items() if m is not head}
    else:
        names = s.target_modules
        targets = {n: m for n, m in linear.items() if any(n == t or n.endswith(f".{t}") for t in names)}
        unknown = [t for t in names if not any(n == t or n.endswith(f".{t}") for n in linear)]
        if unknown:
            known = sorted({n.rsplit(".", 1)[-1] for n in linear})
            return [
                f"{key}.target_modules: {unknown} name no linear layer of {model_dir} ({config.model_type}); "
                f"its linear layers are {known}, or use all-linear."
            ]
    if not targets:
        return [f"{key}.target_modules selects no linear layer of {model_dir}; use all-linear."]
    smallest = min(min(m.in_features, m.out_features) for m in targets.values())
    if s.rank > smallest:
        return [
            f"{key}.rank={s.rank} is larger than the smallest side ({smallest}) of a targeted layer of "
            f"{model_dir}: a low-rank update needs rank <= {smallest}; lower it."
        ]
    return []
