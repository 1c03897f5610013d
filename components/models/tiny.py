"""The embedded default model: a small Qwen2 causal LM (transformers' own class) and a character tokenizer.

Nothing is downloaded: the tokenizer's vocabulary is printable ASCII plus three special tokens, and the
model is initialised from a seed.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

if TYPE_CHECKING:
    from transformers import Qwen2ForCausalLM

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# hermes-style tool-call markers, one token each (as in Qwen2.5's vocabulary), for multi-turn rollouts
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# A chat template that joins message contents (a tool's output inside <tool_response> tags): the tiny model has
# no roles, real models bring their own.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}"
    "</tool_response>{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)


def build_char_tokenizer(tool_tokens: bool = False) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (newline included); decode joins them back. tool_tokens adds
    the tool-call markers as one token each (multi-turn runs; without them the vocabulary, and so the seeded
    model, is the default pipeline's)."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    if tool_tokens:
        fast.add_tokens(TOOL_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def tiny_model_for(
    sft, max_positions: int, tokenizer: PreTrainedTokenizerFast, seed: int
) -> Qwen2ForCausalLM:
    """build_tiny_model sized by the `sft` config section (hidden_size, num_layers, num_heads,
    intermediate_size)."""
    return build_tiny_model(
        tokenizer,
        hidden_size=sft.hidden_size,
        num_layers=sft.num_layers,
        num_heads=sft.num_heads,
        intermediate_size=sft.intermediate_size,
        max_positions=max_positions,
        seed=seed,
        num_experts=sft.num_experts,
        experts_per_token=sft.experts_per_token,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_positions: int,
    seed: int,
    num_experts: int = 0,
    experts_per_token: int = 2,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2ForCausalLM sized for a 2-core CPU. Seeded: same args, same weights.

    num_experts > 0 builds its mixture-of-experts sibling instead, a Qwen2MoeForCausalLM (transformers' own
    class) whose every layer's MLP is `num_experts` experts of intermediate_size / experts_per_token, each
    token routed to `experts_per_token` of them, beside a shared expert of the same size: as many active
    MLP parameters per token as the dense model's MLP."""
    from transformers import (  # modeling code: only where a model is built
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_cache=True,
    )
    if num_experts:
        # a multiple of 8: transformers' grouped matmul over the experts wants 16-byte strides
        expert_size = max(intermediate_size // (experts_per_token + 1) // 8 * 8, 8)
        config = Qwen2MoeConfig(
            **common,
            intermediate_size=intermediate_size,
            moe_intermediate_size=expert_size,
            shared_expert_intermediate_size=expert_size,
            num_experts=num_experts,
            num_experts_per_tok=experts_per_token,
            norm_topk_prob=True,
            output_router_logits=False,
        )
        model_cls = Qwen2MoeForCausalLM
    else:
        config, model_cls = Qwen2Config(**common, intermediate_size=intermediate_size), Qwen2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model
