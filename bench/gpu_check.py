"""GPU check of one rollout engine on one model (scripts/gpu_check.sh runs it for each installed engine).

Prints one JSON line: rollout tokens/s of the engine and of the hf engine on the same GPU (same prompts and
sampling settings), the mean absolute difference between the engine's log-probs and the policy's own
log-probs of the same tokens (fp32 forward), before and after a weight update, and whether the update changed
its seeded samples.

    python -m bench.gpu_check --engine vllm --model tiny
    python -m bench.gpu_check --engine sglang --model /models/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch


def tiny_model_dir() -> str:
    from components.models import build_char_tokenizer, build_tiny_model, save_pretrained

    tok = build_char_tokenizer()
    model = build_tiny_model(
        tok, hidden_size=128, num_layers=2, num_heads=4, intermediate_size=512, max_positions=512, seed=0
    )
    return str(save_pretrained(model, tok, tempfile.mkdtemp(prefix="gpu-check-tiny-")))


def prompts(tokenizer, count: int) -> list[list[int]]:
    from components.data.prompts import encode_prompts
    from components.settings import PromptSettings

    texts = [
        [{"role": "user", "content": f"What is {a} + {3 * a + 7}? Answer after ####."}] for a in range(count)
    ]
    return encode_prompts(tokenizer, texts, PromptSettings())


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rollout_rate(engine, ids, params, seed=0) -> tuple[float, object]:
    engine.generate(ids[:4], params, seed)  # warm-up (graphs, caches)
    sync()
    start = time.perf_counter()
    out = engine.generate(ids, params, seed)
    sync()
    return float(out.response_mask.sum()) / (time.perf_counter() - start), out


def main(argv: list[str] | None = None) -> int:
    from components.models.loading import load_tokenizer
    from components.rollout.base import make_engine
    from components.settings import EngineOptions, SamplingParams
    from components.training.logprobs import engine_logprob_gaps

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, choices=["vllm", "sglang", "trtllm"])
    p.add_argument("--model", default="tiny", help="'tiny' (built here) or a local model directory")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    a = p.parse_args(argv)
    path = tiny_model_dir() if a.model == "tiny" else a.model
    dtype = "float32" if a.model == "tiny" else "bfloat16"
    tok = load_tokenizer(path)
    ids = prompts(tok, a.prompts)
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=a.max_new_tokens)
    options = EngineOptions(dtype=dtype, gpu_memory_utilization=0.35, max_model_len=1024, enforce_eager=True)
    result: dict = {"engine": a.engine, "model": a.model, "dtype": dtype}

    hf = make_engine("hf", path, tok.eos_token_id, tok.pad_token_id, EngineOptions(dtype=dtype))
    result["hf_tokens_per_s"], _ = rollout_rate(hf, ids, params)
    policy = hf.model.float()  # the fp32 forward the update uses, for the log-prob comparison
    del hf

    engine = make_engine(a.engine, path, tok.eos_token_id, tok.pad_token_id, options)
    result["engine_tokens_per_s"], out = rollout_rate(engine, ids, params)
    result["speedup_vs_hf"] = result["engine_tokens_per_s"] / result["hf_tokens_per_s"]

    def logprob_gap(out) -> float:
        """Mean |engine log-prob - the policy's fp32 forward log-prob| over the sampled tokens."""
        return float(engine_logprob_gaps(policy, ids, out, tok.pad_token_id).mean())

    result["logprob_mean_abs_diff"] = logprob_gap(out)

    # a weight update: the engine's seeded samples change, and its log-probs follow the new weights
    seeded = SamplingParams(n=1, temperature=1.0, max_new_tokens=32)
    before = engine.generate(ids[:16], seeded, 0).responses
    result["same_seed_same_output"] = torch.equal(before, engine.generate(ids[:16], seeded, 0).responses)
    gen = torch.Generator().manual_seed(0)
    noisy = {
        k: (v + 0.3 * v.float().std() * torch.randn(v.shape, generator=gen).to(v.device)).to(v.dtype)
        for k, v in policy.state_dict().items()
    }
    engine.update_weights(noisy, 1)
    after = engine.generate(ids[:16], seeded, 0).responses
    result["weight_update_changed_output"] = not torch.equal(before, after)
    policy.load_state_dict(noisy)
    result["logprob_mean_abs_diff_after_update"] = logprob_gap(engine.generate(ids, params, 1))
    result["weights_version"] = engine.weights_version
    print(json.dumps(result))
    ok = result["weight_update_changed_output"] and result["logprob_mean_abs_diff_after_update"] < 0.1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
