"""torch.compile on W1 with Inductor's on-disk cache: what a run pays the first time, what it pays once the
cache is warm, and what each call gains, for the two halves of our step: the lean decode forward
(components/rollout/fast_decode.py, one rollout of 16 prompts x 8 samples of 16 new tokens) and the update's
forward and backward (the W1 model's token log-probs over 128 rows in micro-batches of 32, one optimizer step).

    python -m bench.compile_cache            # eager, cold cache, then warm cache and eager alternated; per part
    python -m bench.compile_cache --calls 15

Each measurement is a fresh process (as each run is), all sharing one temporary cache directory
(TORCHINDUCTOR_CACHE_DIR), which starts empty. Prints, per part and mode, the first call's seconds (the
compile, when compiled), the median of the later calls, and how many calls a warm run needs before its
gain per call has paid for its compile ("never" when compiled calls are no faster). Needs the default
pipeline's SFT model and data.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PARTS = ("decode", "update")
# the order of the runs per part: the cold compile comes first among the compiled runs
ORDER = ("eager", "cold", "warm", "eager", "warm", "eager", "warm")


def decode_call(compiled: bool):
    """One W1 rollout per call, the lean loop's forward compiled (dynamic shapes: rows drop, the cache
    grows) or not."""
    import torch

    from bench.trl_compare import CONFIG, WORKLOADS, model_dir
    from components.data.io import read_rows, to_plain
    from components.data.prompts import encode_prompts
    from components.models.loading import load_model, load_tokenizer
    from components.rollout.hf import HFEngine
    from components.settings import PromptSettings, SamplingParams
    from components.validate import load_checked

    spec = WORKLOADS["w1"]
    rows = [to_plain(r) for r in read_rows(load_checked(CONFIG, []).data.train_path).to_dict("records")]
    tok, model = load_tokenizer(model_dir("w1")), load_model(model_dir("w1"))
    prompts = encode_prompts(tok, [r["prompt"] for r in rows[: spec["prompts"]]], PromptSettings())
    params = SamplingParams(n=spec["n"], temperature=1.0, max_new_tokens=spec["max_new"])
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    if compiled:
        engine.lean.forward = torch.compile(engine.lean.forward, dynamic=True)
    return lambda i: engine.generate(prompts, params, seed=i)


def update_call(compiled: bool):
    """One W1-sized update per call: 128 rows of 28-32 tokens, micro-batches of 32, the token log-probs'
    mean as the loss, then AdamW's step; the loss function compiled (dynamic shapes) or not."""
    import torch

    from bench.trl_compare import model_dir
    from components.models.loading import load_model

    model = load_model(model_dir("w1")).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids).logits[:, :-1]
        return -torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).mean()

    loss = torch.compile(loss_of, dynamic=True) if compiled else loss_of

    def call(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, model.config.vocab_size, (128, 28 + i % 5), generator=g)
        opt.zero_grad()
        for start in range(0, 128, 32):
            loss(ids[start : start + 32]).backward()
        opt.step()

    return call


def child(part: str, compiled: bool, calls: int) -> dict:
    import torch

    torch.set_num_threads(2)
    torch.manual_seed(0)
    call = {"decode": decode_call, "update": update_call}[part](compiled)
    times = []
    for i in range(calls + 1):
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    return {"first_s": times[0], "median_s": statistics.median(times[1:])}


def payback(first: float, later: float, eager: float) -> str:
    """Calls after which a compiled run catches up with an eager one: its first call's extra over an eager
    call, over what each later call saves; "never" when its calls save nothing."""
    gain = eager - later
    return f"{(first - eager) / gain:.0f}" if gain > 0 else "never"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=9, help="timed calls after the first, per run")
    p.add_argument("--child", nargs=2, metavar=("PART", "MODE"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1] != "eager", a.calls)))
        return
    from bench.trl_compare import ensure_models

    ensure_models(["w1"])
    print("| part | mode | first call s | later calls, median s | calls to pay back the first |")
    print("|---|---|---|---|---|")
    for part in PARTS:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONWARNINGS": "ignore"}
            runs: dict[str, list[dict]] = {}
            for mode in ORDER:
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.compile_cache",
                    "--calls",
                    str(a.calls),
                    "--child",
                    part,
                    mode,
                ]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                runs.setdefault(mode, []).append(json.loads(out.strip().splitlines()[-1]))
        eager = statistics.median(r["median_s"] for r in runs["eager"])
        for mode in ("eager", "cold", "warm"):
            first = statistics.median(r["first_s"] for r in runs[mode])
            later = statistics.median(r["median_s"] for r in runs[mode])
            pays = "-" if mode == "eager" else payback(first, later, eager)
            print(f"| {part} | {mode} | {first:.2f} | {later:.4f} | {pays} |", flush=True)


if __name__ == "__main__":
    main()
