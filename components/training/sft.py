"""Supervised warm start: next-token loss on the answer tokens only (prompt tokens are masked out)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from components.data.prompts import encode_prompt
from components.rollout.multi_turn import conversation_ids
from components.settings import PromptSettings

if TYPE_CHECKING:  # transformers' modeling code: imported where a model is built, not here
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# a tool's output inside an answer (multi-turn trajectories): seen by the model, never a training target
_TOOL_OUTPUT = re.compile(r"(<tool_response>.*?</tool_response>)", re.S)


@dataclass
class SFTExample:
    prompt_ids: list[int]
    answer_ids: list[int]  # ends with EOS
    answer_mask: list[int] | None = None  # 1 = a target token; None = all of them
    pixel_values: torch.Tensor | None = None  # (C, H, W): the prompt's image, for a VLM


def encode_examples(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list,
    answers: list[str],
    settings: PromptSettings = PromptSettings(),
    images=None,
    rows: list[dict] | None = None,
    max_obs_chars: int | None = None,
) -> list[SFTExample]:
    """Prompt as the rollout engine sees it (components.data.prompts), answer + EOS;
    `<tool_response>...</tool_response>` spans of an answer (a tool-calling trajectory) are tokenized on their
    own and masked out of the loss. A prompt with assistant turns (a game's conversation so far) is encoded as
    the rollout holds it (conversation_ids; observations cut to max_obs_chars). With `images` (a VLM's
    ImageEncoder) and the `rows`, each prompt's image tokens are expanded and its pixels kept, as the rollout
    worker does."""
    out = []
    pixels = images.pixels(rows) if images is not None else None
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        ids, mask = [], []
        for k, part in enumerate(_TOOL_OUTPUT.split(answer)):
            part_ids = tokenizer(part, add_special_tokens=False)["input_ids"] if part else []
            ids += part_ids
            mask += [k % 2 == 0] * len(part_ids)  # odd parts are the tool outputs
        if not isinstance(prompt, str) and any(m["role"] == "assistant" for m in prompt):
            # a conversation (a game's turns so far): the context the rollout holds at that turn
            prompt_ids = conversation_ids(tokenizer, list(prompt), settings, max_obs_chars)
        else:
            prompt_ids = encode_prompt(tokenizer, prompt, settings)
        out.append(
            SFTExample(
                images.expand(prompt_ids) if images is not None else prompt_ids,
                ids + [tokenizer.eos_token_id],
                [int(m) for m in mask] + [1] if not all(mask) else None,
                pixels[row] if pixels is not None else None,
            )
        )
    return out


def collate(examples: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (-100 on prompt and padding). All (B, L)."""
    width = max(len(e.prompt_ids) + len(e.answer_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        seq = e.prompt_ids + e.answer_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        targets = torch.tensor(e.answer_ids)
        if e.answer_mask is not None:
            targets = torch.where(torch.tensor(e.answer_mask, dtype=torch.bool), targets, -100)
        labels[i, len(e.prompt_ids) : len(seq)] = targets
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if examples[0].pixel_values is not None:
        batch["pixel_values"] = torch.stack([e.pixel_values for e in examples])
    return batch


def train_sft(
    model: PreTrainedModel,
    examples: list[SFTExample],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    pad_id: int,
    seed: int,
    final_lr_frac: float = 1.0,
    params: list[dict] | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """AdamW over shuffled examples, lr decaying linearly to lr * final_lr_frac; returns the loss per step.

    The default keeps lr constant: a run that ends at lr ~ 0 settles where the loss is very sharp, and the
    first RL steps from there overshoot (measured: one SGD step of norm 0.05 along the SFT gradient takes
    greedy accuracy from 0.67 to 0.06 after a decayed schedule). `params`: optimizer groups (a VLM's vision
    tower at its own learning rate, or frozen); None = every parameter at `lr`.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params or model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - (1.0 - final_lr_frac) * s / max(steps, 1))
    model.train()
    losses: list[float] = []
    order = torch.randperm(len(examples), generator=gen).tolist()
    cursor = 0
    for step in range(steps):
        if cursor + batch_size > len(order):
            order, cursor = torch.randperm(len(examples), generator=gen).tolist(), 0
        batch = collate([examples[i] for i in order[cursor : cursor + batch_size]], pad_id)
        cursor += batch_size
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1, losses[-1])
    model.eval()
    return losses
