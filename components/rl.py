"""The RL iteration's pure stages over Batch: build the rollout batch, score it, compute advantages.

Workers and orchestration call these; none of them touches Ray, Prefect or MLflow.
"""

from __future__ import annotations

import torch

from components.algorithms.advantages import ADVANTAGES, AdvantageParams
from components.batch import Batch
from components.rewards.registry import score_batch
from components.rollout.base import RolloutOutput
from components.rollout.hf import left_pad


def encode_prompts(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Token ids of each row's prompt, through the tokenizer's chat template."""
    texts = [tokenizer.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=False)
             for r in rows]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def rollout_batch(rows: list[dict], prompt_ids: list[list[int]], out: RolloutOutput, n: int, pad_id: int,
                  iteration: int) -> Batch:
    """Rows x n completions as one Batch. group_ids (N,) tie completions of one prompt together."""
    prompts, prompt_mask = left_pad(prompt_ids, pad_id)
    reps = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
    return Batch(
        tensors={
            "prompts": prompts.repeat_interleave(n, 0), "prompt_mask": prompt_mask.repeat_interleave(n, 0),
            "responses": out.responses, "response_mask": out.response_mask, "rollout_logprobs": out.logprobs,
            "group_ids": torch.arange(len(rows)).repeat_interleave(n),
        },
        non_tensors={
            "ground_truth": reps([r["reward_model"]["ground_truth"] for r in rows]),
            "data_source": reps([r["data_source"] for r in rows]),
            "extra_info": reps([dict(r["extra_info"]) for r in rows]),
            "sample_index": [j for _ in rows for j in range(n)],
        },
        meta={"iteration": iteration, "weights_version": out.weights_version, "n": n},
    )


def decode_responses(tokenizer, batch: Batch) -> list[str]:
    t = batch.tensors
    ids = [row[m.bool()].tolist() for row, m in zip(t["responses"], t["response_mask"])]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def add_rewards(batch: Batch, texts: list[str], reward_cfg) -> tuple[Batch, dict[str, float]]:
    """Score each response; the sequence score sits on its last response token (token_rewards (N, R))."""
    nt = batch.non_tensors
    scores, invalid = score_batch(texts, nt["ground_truth"], nt["data_source"], nt["extra_info"], reward_cfg)
    mask = batch.tensors["response_mask"]
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32)
    last = (mask.sum(-1) - 1).clamp(min=0)
    token_rewards[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    s = torch.tensor(scores)
    lengths = mask.sum(-1).float()
    max_len = mask.shape[1]
    metrics = {"critic/score/mean": float(s.mean()), "critic/score/max": float(s.max()),
               "critic/score/min": float(s.min()), "reward/invalid_count": float(invalid),
               "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
               "response_length/min": float(lengths.min()),
               "prompt_length/mean": float(batch.tensors["prompt_mask"].sum(-1).float().mean())}
    return batch.union(token_rewards=token_rewards, scores=s.float()), metrics


def add_advantages(batch: Batch, estimator: str, params: AdvantageParams) -> tuple[Batch, dict[str, float]]:
    t = batch.tensors
    mask = t["response_mask"].float()
    adv, returns = ADVANTAGES.get(estimator)(t["token_rewards"], mask, t["group_ids"], t.get("values"), params)
    valid = adv[mask.bool()]
    ret = returns[mask.bool()]
    metrics = {"critic/advantages/mean": float(valid.mean()), "critic/advantages/max": float(valid.max()),
               "critic/advantages/min": float(valid.min()), "critic/returns/mean": float(ret.mean()),
               "critic/returns/max": float(ret.max()), "critic/returns/min": float(ret.min())}
    return batch.union(advantages=adv, returns=returns), metrics
