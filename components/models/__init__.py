"""Models: the tiny local Qwen2 policy and its character tokenizer; loading any local HF causal LM."""

from components.models.loading import load_model, load_tokenizer, save_pretrained
from components.models.tiny import build_char_tokenizer, build_tiny_model

__all__ = ["build_char_tokenizer", "build_tiny_model", "load_model", "load_tokenizer", "save_pretrained"]
