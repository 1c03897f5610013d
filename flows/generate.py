"""Sample completions from a model for prompts given on the command line (no Ray, no tracking)."""

from __future__ import annotations

import argparse
import json
import sys

from components.errors import ReinforgeError
from components.rollout.base import SamplingParams
from components.rollout.worker import RolloutWorker


def generate(model_path: str, prompts: list[str], n: int, temperature: float, max_new_tokens: int,
             seed: int) -> list[dict]:
    worker = RolloutWorker(model_path)
    rows = [{"prompt": [{"role": "user", "content": p}], "reward_model": {"ground_truth": ""},
             "data_source": "cli", "extra_info": {}} for p in prompts]
    batch = worker.generate(rows, SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens),
                            seed, iteration=0)
    texts = worker.decode(batch)
    return [{"prompt": prompts[i // n], "completion": texts[i]} for i in range(len(texts))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Sample completions from a local model.")
    p.add_argument("prompts", nargs="+", help="prompt texts, e.g. '12+34='")
    p.add_argument("--model_path", default="checkpoints/grpo/final", help="HF model directory")
    p.add_argument("-n", type=int, default=1, help="completions per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        out = generate(a.model_path, a.prompts, a.n, a.temperature, a.max_new_tokens, a.seed)
    except ReinforgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
