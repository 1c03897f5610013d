"""Vision-language models: a vision encoder and a causal LM (both transformers' own classes) fused by a
projector or by gated cross-attention, saved and loaded in Hugging Face format.

- `projector` (LLaVA-style): the encoder's patch features, average-pooled to `image_grid` x `image_grid`
  (so images never take more of the sequence than `actor.model.vision_token_ratio` allows), go through an MLP
  into the token stream, one feature per `<image>` token of the prompt (the processor expands the
  placeholder to that many tokens).
- `cross_attention` (Flamingo/Mllama-style): the prompt keeps one `<image>` token; after chosen decoder layers
  the text attends to the image features through a tanh-gated cross-attention block (gates start at
  `gate_init`, so the model starts as its text model when 0). During generation the image features are
  kept on the KV cache object, so decode steps need no pixels.

`VLMConfig` is registered with transformers' Auto classes (model_type `reinforge_vlm`), so a directory we
save loads through `AutoModelForImageTextToText` like a LLaVA or Qwen2-VL one. The processor saved beside it
is transformers' own `LlavaProcessor` over a PIL image processor (no torchvision needed).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    CLIPVisionConfig,
    CLIPVisionModel,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

IMAGE_TOKEN = "<image>"
FUSIONS = ("projector", "cross_attention")
# where a VLM keeps its vision tower, over the model families we load (ours, LLaVA, Qwen2-VL): the parameters
# `freeze_vision_model` freezes and `vision_lr_ratio` scales
VISION_PREFIXES = ("vision_model.", "model.vision_tower.", "vision_tower.", "model.visual.", "visual.")
# the cross-attention image states ride on the generation cache under this attribute
_CACHE_STATES = "reinforge_image_states"


class VLMConfig(PretrainedConfig):
    model_type = "reinforge_vlm"
    sub_configs = {"text_config": AutoConfig, "vision_config": AutoConfig}

    def __init__(
        self,
        text_config=None,
        vision_config=None,
        fusion_method: str = "projector",
        image_token_id: int | None = None,
        image_grid: int = 2,
        cross_attention_layers: list[int] | None = None,
        gate_init: float = 0.0,
        **kwargs,
    ):
        from transformers import CONFIG_MAPPING

        if isinstance(text_config, dict):
            text_config = CONFIG_MAPPING[text_config["model_type"]](**text_config)
        if isinstance(vision_config, dict):
            vision_config = CONFIG_MAPPING[vision_config["model_type"]](**vision_config)
        self.text_config = text_config
        self.vision_config = vision_config
        self.fusion_method = fusion_method
        self.image_token_id = image_token_id
        self.image_grid = image_grid
        self.cross_attention_layers = list(cross_attention_layers or [])
        self.gate_init = gate_init
        super().__init__(**kwargs)

    @property
    def image_tokens(self) -> int:
        """Tokens one image takes in the prompt: the pooled grid (projector) or its one marker token."""
        return self.image_grid**2 if self.fusion_method == "projector" else 1


class GatedCrossAttention(nn.Module):
    """h + tanh(gate) * attn(norm(h), image): text queries, image keys and values. (N, T, D) -> (N, T, D)."""

    def __init__(self, dim: int, heads: int, gate_init: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.gate = nn.Parameter(torch.tensor(float(gate_init)))

    def forward(self, hidden: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(self.norm(hidden), image, image, need_weights=False)
        return hidden + torch.tanh(self.gate) * out


class VisionLanguageModel(PreTrainedModel):
    config_class = VLMConfig
    base_model_prefix = "vlm"
    _supports_sdpa = True
    _no_split_modules = ["CLIPEncoderLayer"]

    def __init__(self, config: VLMConfig):
        super().__init__(config)
        vision, text = config.vision_config, config.text_config
        self.vision_model = AutoModel.from_config(vision)
        self.language_model = AutoModelForCausalLM.from_config(text)
        width = text.hidden_size
        if config.fusion_method == "projector":
            self.projector = nn.Sequential(
                nn.LayerNorm(vision.hidden_size),
                nn.Linear(vision.hidden_size, width),
                nn.GELU(),
                nn.Linear(width, width),
            )
        else:
            self.image_proj = nn.Sequential(
                nn.LayerNorm(vision.hidden_size), nn.Linear(vision.hidden_size, width)
            )
            heads = math.gcd(width, text.num_attention_heads)
            self.cross = nn.ModuleList(
                GatedCrossAttention(width, heads, config.gate_init) for _ in config.cross_attention_layers
            )
        self._image_states: torch.Tensor | None = None
        from components.rollout.hf import cache_kwarg

        # the text model's name for its KV cache, read off its forward's signature once (not per decode step)
        self._cache_name = cache_kwarg(self.language_model)
        self._hooks_added = False
        self.post_init()

    @property
    def _tied_weights_keys(self):  # the text model's ties, under its prefix (save and load keep them)
        ties = getattr(self.language_model, "_tied_weights_keys", None) or {}
        if not self.config.text_config.tie_word_embeddings:
            return {}
        return {f"language_model.{k}": f"language_model.{v}" for k, v in dict(ties).items()}

    @_tied_weights_keys.setter
    def _tied_weights_keys(self, value) -> None:
        pass  # transformers' init assigns the class default; ours follows the text model's

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, GatedCrossAttention):
            module.gate.data.fill_(self.config.gate_init)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def _add_hooks(self) -> None:
        """Each cross-attention block runs after its decoder layer, on that layer's output."""
        layers = self.language_model.base_model.layers
        for block, index in zip(self.cross, self.config.cross_attention_layers):

            def hook(_module, _args, output, block=block):
                if self._image_states is None:
                    return output
                if isinstance(output, tuple):
                    return (block(output[0], self._image_states), *output[1:])
                return block(output, self._image_states)

            layers[index].register_forward_hook(hook)
        self._hooks_added = True

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, image_tokens, D_text) for the projector, (N, patches, D_text) for cross-attention."""
        dtype = next(self.vision_model.parameters()).dtype
        patches = self.vision_model(pixel_values=pixel_values.to(dtype)).last_hidden_state
        if math.isqrt(patches.shape[1]) ** 2 != patches.shape[1]:
            patches = patches[:, 1:]  # a class token (CLIP) before the patch grid
        if self.config.fusion_method != "projector":
            return self.image_proj(patches)
        n, count, dim = patches.shape
        side = math.isqrt(count)
        grid = patches.transpose(1, 2).reshape(n, dim, side, side)
        pooled = nn.functional.adaptive_avg_pool2d(grid, self.config.image_grid)  # merge, never truncate
        return self.projector(pooled.flatten(2).transpose(1, 2))

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        past_key_values=None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        if self.config.fusion_method == "projector":
            if pixel_values is not None:
                inputs_embeds = self._merge(input_ids, inputs_embeds, self.image_features(pixel_values))
            states = None
        else:
            states = self.image_features(pixel_values) if pixel_values is not None else None
            if cache is not None:
                if states is not None:
                    setattr(cache, _CACHE_STATES, states)
                states = getattr(cache, _CACHE_STATES, None)
            if not self._hooks_added:
                self._add_hooks()
        self._image_states = states
        try:
            return self.language_model(
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **({self._cache_name: cache} if cache is not None else {}),
                **kwargs,
            )
        finally:
            self._image_states = None

    def _merge(self, ids: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Each row's first image_tokens `<image>` tokens (its prompt's) take its image's features, in order;
        one the model wrote in its response stays a token (decode steps never see pixels either)."""
        slots = ids == self.config.image_token_id
        slots = slots & (slots.cumsum(-1) <= features.shape[1])
        per_row = slots.sum(-1)
        if bool((per_row != features.shape[1]).any()):
            raise ValueError(
                f"each prompt needs {features.shape[1]} image tokens (the processor's expansion of "
                f"{IMAGE_TOKEN}); rows have {per_row.tolist()}"
            )
        return embeds.masked_scatter(slots[..., None], features.to(embeds.dtype))


AutoConfig.register(VLMConfig.model_type, VLMConfig)
AutoModelForImageTextToText.register(VLMConfig, VisionLanguageModel)


def vision_parameter(name: str) -> bool:
    """Whether a parameter (by its name in the model) belongs to the vision tower."""
    return name.startswith(VISION_PREFIXES) or ".vision_tower." in name or ".visual." in name


def is_vlm_config(config: PretrainedConfig) -> bool:
    return getattr(config, "vision_config", None) is not None


def tiny_vision_encoder(image_size: int, patch_size: int, hidden: int, layers: int, heads: int, seed: int):
    """A randomly initialised CLIP vision transformer (transformers' own class), seeded."""
    config = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=hidden,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CLIPVisionModel(config)


def compose(
    text_model: PreTrainedModel,
    vision_model: PreTrainedModel,
    *,
    fusion_method: str,
    image_token_id: int,
    image_grid: int,
    gate_init: float,
    seed: int,
) -> VisionLanguageModel:
    """A VLM over these two models' weights; the fusion layers are new, initialised from `seed`."""
    vision_config = vision_model.config
    if hasattr(vision_config, "vision_config"):  # a whole CLIPModel directory: its vision half
        vision_config = vision_config.vision_config
    layers = text_model.config.num_hidden_layers
    config = VLMConfig(
        text_config=text_model.config,
        vision_config=vision_config,
        fusion_method=fusion_method,
        image_token_id=image_token_id,
        image_grid=image_grid,
        cross_attention_layers=list(range(layers)),
        gate_init=gate_init,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = VisionLanguageModel(config)
    model.language_model.load_state_dict(text_model.state_dict())
    if hasattr(vision_model.config, "vision_config"):
        model.vision_model.vision_model.load_state_dict(vision_model.vision_model.state_dict())
    else:
        model.vision_model.load_state_dict(vision_model.state_dict())
    return model


def make_processor(tokenizer, image_size: int, crop: bool, image_tokens: int):
    """transformers' LlavaProcessor over a PIL CLIP image processor: resizes (and center-crops, with `crop`)
    to image_size, normalises, and expands each `<image>` of a prompt to `image_tokens` tokens."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    side = math.isqrt(image_tokens)
    if side * side != image_tokens:
        raise ValueError(f"image_tokens={image_tokens} is not a square grid")
    size = {"shortest_edge": image_size} if crop else {"height": image_size, "width": image_size}
    images = CLIPImageProcessorPil(
        size=size, crop_size={"height": image_size, "width": image_size}, do_center_crop=crop
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=image_size // side,
        vision_feature_select_strategy="full",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=0,
        chat_template=getattr(tokenizer, "chat_template", None),
    )


TINY_PATCH = 8  # the tiny vision encoder's patch side (pixels)


def image_grid(native_side: int, ratio: float, max_seq_len: int, key: str = "actor.model.vision_token_ratio"):
    """The pooled grid side for the projector: the encoder's own patch grid, merged down until its tokens are at
    most `ratio` of max_seq_len. ConfigError naming `key` when not even one token fits."""
    from components.errors import ConfigError

    budget = int(ratio * max_seq_len)
    if budget < 1:
        raise ConfigError(
            f"{key}={ratio}: with actor.model.max_seq_len={max_seq_len} no image token fits "
            f"({ratio} x {max_seq_len} < 1); raise it or actor.model.max_seq_len."
        )
    return max(1, min(native_side, math.isqrt(budget)))


def with_image_token(tokenizer):
    """The tokenizer with `<image>` as one special token (added when missing)."""
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tokenizer


# VLMs whose processors cut each image into a variable patch grid with 3-D rotary positions
DYNAMIC_RESOLUTION_VLMS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v")


def load_processor(path, tokenizer, key: str = "actor.model.path", trust_remote_code: bool = False):
    """The processor saved beside a VLM (ours, LLaVA), over `tokenizer` (loaded as saved and checked by
    components.models.loading); ConfigError naming `key` when the directory has none."""
    from pathlib import Path

    from transformers import AutoProcessor

    from components.errors import ConfigError
    from components.models.loading import check_model_code

    p = Path(path)
    model_type = check_model_code(p, path, key, trust_remote_code).get("model_type")
    if model_type in DYNAMIC_RESOLUTION_VLMS:
        raise ConfigError(
            f"{key}={path}: a {model_type} model, whose dynamic-resolution image inputs (image_grid_thw, M-RoPE "
            "positions) this version does not handle; use a LLaVA-style directory, or compose one with "
            "actor.model.type=multimodal (actor.model.text_model + vision_model)."
        )
    if not any((p / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
        raise ConfigError(
            f"{key}={path}: a vision-language model without its processor (processor_config.json or "
            "preprocessor_config.json); save the processor beside the model."
        )
    try:
        return AutoProcessor.from_pretrained(
            p, tokenizer=tokenizer, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, TypeError, ImportError) as exc:
        raise ConfigError(f"{key}={path}: its processor could not be loaded ({str(exc)[:200]}).") from None


def processor_image_tokens(processor) -> int:
    """How many tokens one `<image>` of a prompt becomes for this processor: measured on a blank image, so it
    holds for any processor that expands the placeholder (ours, LLaVA's)."""
    from PIL import Image

    token = getattr(processor, "image_token", IMAGE_TOKEN)
    size = processor.image_processor.crop_size or processor.image_processor.size
    side = size.get("height") or size.get("shortest_edge") or 32
    out = processor(text=[token], images=[Image.new("RGB", (side, side))], return_tensors="pt")
    token_id = processor.tokenizer.convert_tokens_to_ids(token)
    return int((out["input_ids"][0] == token_id).sum())
