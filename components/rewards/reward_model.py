"""A learned reward model: a local Hugging Face sequence-classification model scoring prompt + response.

`RewardModelScorer` loads it (`reward_model.path`, `reward_model.dtype`) and scores texts in batches; the
training flow runs it as a Ray actor. `train_reward_model` fits one on preference pairs with the
Bradley-Terry loss -log sigmoid(r_chosen - r_rejected), starting from a causal LM's weights (the SFT model),
and `arith_preference_pairs` builds such pairs from the arithmetic task, so the path runs with no downloads.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F

from components.data.prompts import render_prompt
from components.errors import ConfigError
from components.models.loading import DTYPES, check_model_dir, load_tokenizer
from components.settings import PromptSettings


def load_reward_model(
    path: str, dtype: str = "float32", key: str = "reward_model.path", trust_remote_code: bool = False
):
    from transformers import AutoModelForSequenceClassification

    tokenizer = load_tokenizer(path, key, trust_remote_code)
    tokenizer.padding_side = "right"  # positions start at 0 for every text; the score is read at its end
    check_model_dir(path, key, trust_remote_code=trust_remote_code)
    model = AutoModelForSequenceClassification.from_pretrained(
        path,
        dtype=DTYPES[dtype],
        local_files_only=True,
        use_safetensors=True,
        trust_remote_code=trust_remote_code,
    )
    if model.config.num_labels != 1:
        raise ConfigError(
            f"{key}={path}: a reward model has one output (num_labels=1), this one has "
            f"{model.config.num_labels}. Point it at a reward model."
        )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id  # the score is read at the last non-pad token
    return tokenizer, model.eval()


class RewardModelScorer:
    """Scores prompt + response texts with a reward model, `batch_size` texts per forward pass."""

    def __init__(
        self,
        path: str,
        dtype: str = "float32",
        batch_size: int = 32,
        num_threads: int = 1,
        max_length: int = 1024,
        trust_remote_code: bool = False,
    ):
        torch.set_num_threads(num_threads)
        self.tokenizer, self.model = load_reward_model(path, dtype, trust_remote_code=trust_remote_code)
        self.batch_size, self.max_length = batch_size, max_length

    def pid(self) -> int:
        import os

        return os.getpid()

    @torch.no_grad()
    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        texts = [p + r for p, r in zip(prompts, responses)]
        out: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
                add_special_tokens=False,
            )
            out += self.model(**enc).logits[:, 0].float().tolist()
        return out


def wrong_answers(truth: int, rng: random.Random) -> list[str]:
    """Kinds of wrong response a policy produces: a near miss, a far miss, swapped or dropped digits, an extra
    digit, a missing `####`."""
    near = truth + rng.choice([d for d in range(-10, 11) if d])
    far = rng.choice(
        [v for v in (rng.randint(0, 2 * truth + 20) for _ in range(4)) if v != truth] or [truth + 11]
    )
    digits = str(abs(truth))
    swapped = int(digits[::-1]) if len(digits) > 1 and digits != digits[::-1] else truth + 1
    dropped = int(digits[:-1]) if len(digits) > 1 else truth + 2
    return [
        f"#### {near}",
        f"#### {far}",
        f"#### {swapped}",
        f"#### {dropped}",
        f"#### {truth}{rng.randint(0, 9)}",
        f"{truth}",
    ]


def arith_preference_pairs(
    rows: list[dict], tokenizer, seed: int, per_row: int = 2, settings: PromptSettings = PromptSettings()
) -> list[tuple[str, str, str]]:
    """(prompt text as the policy sees it, chosen, rejected): the right answer against `per_row` wrong ones of
    different kinds."""
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        prompt = render_prompt(tokenizer, row["prompt"], settings)
        truth = int(row["reward_model"]["ground_truth"])
        for rejected in rng.sample(wrong_answers(truth, rng), per_row):
            pairs.append((prompt, f"#### {truth}", rejected))
    return pairs


def train_reward_model(
    init_path: str,
    pairs: list[tuple[str, str, str]],
    out: str | Path,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    on_step=None,
) -> dict[str, float]:
    """Fit a one-output sequence classifier (backbone from the causal LM at init_path) on the pairs; save it in
    Hugging Face format to `out`. Returns the final loss and the pair accuracy on the training pairs."""
    from transformers import AutoModelForSequenceClassification

    from components.models.loading import save_pretrained
    from components.outputs import REWARD_MODEL

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(init_path, "reward_model.init_path")
    tokenizer.padding_side = "right"
    check_model_dir(init_path, "sft.output_dir")
    model = AutoModelForSequenceClassification.from_pretrained(
        init_path, num_labels=1, local_files_only=True, use_safetensors=True, trust_remote_code=False
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)

    def rewards(texts: list[str]) -> torch.Tensor:
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return model(**enc).logits[:, 0]

    loss = torch.tensor(0.0)
    model.train()
    for step in range(steps):
        chunk = rng.sample(pairs, min(batch_size, len(pairs)))
        chosen = rewards([p + c for p, c, _ in chunk])
        rejected = rewards([p + r for p, _, r in chunk])
        loss = -F.logsigmoid(chosen - rejected).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if on_step:
            on_step(step, float(loss))
    model.eval()
    save_pretrained(model, tokenizer, out, kind=REWARD_MODEL)
    return {"loss": float(loss), "pair_accuracy": pair_accuracy(model, tokenizer, pairs)}


@torch.no_grad()
def pair_accuracy(model, tokenizer, pairs: list[tuple[str, str, str]], batch_size: int = 256) -> float:
    """The fraction of pairs whose chosen response the model scores above the rejected one."""
    right = 0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        enc = lambda texts: tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)  # noqa
        c = model(**enc([p + c for p, c, _ in chunk])).logits[:, 0]
        r = model(**enc([p + r for p, _, r in chunk])).logits[:, 0]
        right += int((c > r).sum())
    return right / max(len(pairs), 1)
