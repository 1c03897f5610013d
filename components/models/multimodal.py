"""The policy VLM that multimodal SFT starts from, as the config describes it (actor.model.type=multimodal):
actor.model.text_model + actor.model.vision_model (local directories, or the tiny ones built from the seed)
composed with actor.model.fusion_method, and the processor for data.image_processor."""

from __future__ import annotations

import json
from pathlib import Path

from components.errors import ConfigError


def _vision_config(path: str) -> dict:
    """The vision part of a vision encoder directory's config.json (a CLIPVisionModel's, or a CLIPModel's
    vision_config)."""
    config = json.loads((Path(path) / "config.json").read_text())
    return config.get("vision_config") or config


def native_grid(cfg) -> int:
    """Patches a side of the vision encoder's output for data.image_processor.size images."""
    from components.models.vlm import TINY_PATCH  # transformers' modeling code

    m, size = cfg.actor.model, cfg.data.image_processor.size
    if not m.vision_model:
        return max(1, size // TINY_PATCH)
    v = _vision_config(m.vision_model)
    return max(1, v.get("image_size", size) // v.get("patch_size", TINY_PATCH))


def composed_image_tokens(cfg) -> int:
    """Tokens one image takes in the prompt of the composed model: the pooled grid (projector), whose side
    keeps it within actor.model.vision_token_ratio of max_seq_len, or one marker token (cross_attention)."""
    from components.models.vlm import image_grid  # transformers' modeling code

    m = cfg.actor.model
    if m.fusion_method != "projector":
        return 1
    return image_grid(native_grid(cfg), m.vision_token_ratio, m.max_seq_len) ** 2


# engines that take images with their own processor for the model (components.rollout.base.PromptImages)
IMAGE_ENGINES = ("vllm", "sglang")


def engine_problems(engine_type: str, policy_path: str) -> list[str]:
    """Whether the rollout engine can sample this VLM: the hf engine runs any; vLLM and SGLang run the
    architectures they implement (LLaVA, Qwen2-VL, ...), never reinforge's own composed class, which is what
    multimodal SFT writes, so they need actor.model.path on a directory of such a model."""
    from components.models.vlm import VLMConfig  # transformers' modeling code

    if engine_type == "hf":
        return []
    if engine_type not in IMAGE_ENGINES:
        return [f"engine.type={engine_type} takes no images; set engine.type=hf (or vllm, sglang)."]
    config = Path(policy_path) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type in (None, VLMConfig.model_type):
        return [
            f"engine.type={engine_type} with actor.model.path={policy_path}: {engine_type} has no "
            f"implementation of reinforge's composed VLM ({VLMConfig.model_type}, what multimodal SFT writes); "
            "set engine.type=hf, or point actor.model.path at a LLaVA or Qwen2-VL directory."
        ]
    return []


def vision_problems(cfg) -> list[str]:
    """What a multimodal config gets wrong before anything runs, each with its fix."""
    m, problems = cfg.actor.model, []
    if m.type != "multimodal":
        if cfg.data.task == "visual_count" or cfg.data.llava_path:
            problems.append(
                "data.task=visual_count / data.llava_path give prompts with images, but actor.model.type=text "
                "is a text-only model; set actor.model.type=multimodal."
            )
        return problems
    from components.models.loading import check_model_dir  # torch and transformers: multimodal configs only

    for key in ("text_model", "vision_model"):
        path = getattr(m, key)
        if path:
            try:
                check_model_dir(path, f"actor.model.{key}", trust_remote_code=m.trust_remote_code)
            except ConfigError as exc:
                problems.append(str(exc))
    if m.vision_model and not problems:
        v = _vision_config(m.vision_model)
        if v.get("image_size") and v["image_size"] != cfg.data.image_processor.size:
            problems.append(
                f"data.image_processor.size={cfg.data.image_processor.size}: the vision encoder "
                f"actor.model.vision_model={m.vision_model} takes {v['image_size']}-pixel images; set "
                f"data.image_processor.size={v['image_size']}."
            )
    if int(m.vision_token_ratio * m.max_seq_len) < 1:
        problems.append(
            f"actor.model.vision_token_ratio={m.vision_token_ratio}: with actor.model.max_seq_len="
            f"{m.max_seq_len} no image token fits; raise either."
        )
    problems += engine_problems(cfg.engine.type, m.path)
    if cfg.multi_turn.enable:
        problems.append(
            "multi_turn.enable=true with actor.model.type=multimodal is not supported; disable one."
        )
    return problems


def compose_policy(cfg, tokenizer, seed: int):
    """(model, processor): the VLM multimodal SFT starts from. The text model is actor.model.text_model or
    the tiny Qwen2 (sft.* sizes); the vision encoder actor.model.vision_model or a tiny CLIP ViT; the tokenizer
    must already hold `<image>` (tasks.data.sft_tokenizer adds it)."""
    from transformers import AutoModel

    from components.models.loading import load_model
    from components.models.tiny import tiny_model_for
    from components.models.vlm import (  # transformers' modeling code
        IMAGE_TOKEN,
        TINY_PATCH,
        compose,
        image_grid,
        make_processor,
        tiny_vision_encoder,
    )

    m, s, ip = cfg.actor.model, cfg.sft, cfg.data.image_processor
    if m.text_model:
        text = load_model(m.text_model, key="actor.model.text_model", trust_remote_code=m.trust_remote_code)
        if text.get_input_embeddings().num_embeddings < len(tokenizer):
            text.resize_token_embeddings(len(tokenizer))
    else:
        text = tiny_model_for(s, m.max_seq_len, tokenizer, seed)
    if m.vision_model:
        vision = AutoModel.from_pretrained(
            m.vision_model, local_files_only=True, use_safetensors=True, trust_remote_code=m.trust_remote_code
        )
    else:
        vision = tiny_vision_encoder(ip.size, TINY_PATCH, s.hidden_size, 2, s.num_heads, seed + 1)
    grid = image_grid(native_grid(cfg), m.vision_token_ratio, m.max_seq_len)
    model = compose(
        text,
        vision,
        fusion_method=m.fusion_method,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_grid=grid,
        gate_init=0.5,
        seed=seed + 2,
    )
    processor = make_processor(tokenizer, ip.size, ip.crop, model.config.image_tokens)
    if m.vision_model and (Path(m.vision_model) / "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        # the encoder's own normalisation (its mean and std), at our size
        own = AutoImageProcessor.from_pretrained(
            m.vision_model, local_files_only=True, trust_remote_code=m.trust_remote_code
        )
        processor.image_processor.image_mean, processor.image_processor.image_std = (
            own.image_mean,
            own.image_std,
        )
    return model, processor
