"""The hf engine's two sampling loops side by side: transformers' forward vs the lean loop
(components/rollout/fast_decode.py), on the benchmark's W1 and W2 shapes, alternated, medians.

    python -m bench.engine                    # W1 (16 prompts x 8, 16 new tokens) and W2 (8 x 8, 64 new tokens)
    python -m bench.engine --reps 9 --workloads w1

Needs the models bench.trl_compare builds (it builds them when missing). Prints seconds per generate call,
generated tokens/s and the ratio lean / transformers per workload.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.trl_compare import CONFIG, WORKLOADS, ensure_models, model_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["w1", "w2"], choices=sorted(WORKLOADS))
    p.add_argument("--reps", type=int, default=5, help="timed calls per loop (after one warm-up call)")
    a = p.parse_args(argv)

    import torch

    from components.data.io import read_rows, to_plain
    from components.data.prompts import encode_prompts
    from components.models.loading import load_model, load_tokenizer
    from components.rollout.hf import HFEngine
    from components.settings import PromptSettings, SamplingParams
    from components.validate import load_checked

    torch.set_num_threads(2)
    ensure_models(a.workloads)
    rows = [to_plain(r) for r in read_rows(load_checked(CONFIG, []).data.train_path).to_dict("records")]
    print(
        "| workload | transformers s/call | lean s/call | lean / transformers | tokens/s transformers / lean |"
    )
    print("|---|---|---|---|---|")
    for w in a.workloads:
        spec = WORKLOADS[w]
        tok, model = load_tokenizer(model_dir(w)), load_model(model_dir(w))
        prompts = encode_prompts(tok, [r["prompt"] for r in rows[: spec["prompts"]]], PromptSettings())
        params = SamplingParams(n=spec["n"], temperature=1.0, max_new_tokens=spec["max_new"])
        engines = {
            "hf": HFEngine(model, tok.eos_token_id, tok.pad_token_id, fast_decode=False),
            "lean": HFEngine(model, tok.eos_token_id, tok.pad_token_id),
        }
        times: dict[str, list[float]] = {"hf": [], "lean": []}
        tokens: dict[str, list[float]] = {"hf": [], "lean": []}
        for i in range(a.reps + 1):
            for name in ("hf", "lean") if i % 2 == 0 else ("lean", "hf"):
                start = time.perf_counter()
                out = engines[name].generate(prompts, params, seed=i)
                if i:  # the first call of each warms up
                    times[name].append(time.perf_counter() - start)
                    tokens[name].append(float(out.response_mask.sum()))
        hf, lean = statistics.median(times["hf"]), statistics.median(times["lean"])
        print(
            f"| {w} | {hf:.4f} | {lean:.4f} | {lean / hf:.2f} | "
            f"{statistics.median(tokens['hf']) / hf:.0f} / {statistics.median(tokens['lean']) / lean:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
