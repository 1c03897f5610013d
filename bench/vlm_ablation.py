"""Is the multimodal pipeline's gain visual? Held-out greedy accuracy of a VLM with the real images and with
every image blanked (all black: the same prompt, no picture to count), side by side in one run.

    python -m bench.vlm_ablation --config configs/vlm_grpo.yaml --model_path <final model> [--model_path ...]

Prints one JSON line per model: acc with images, acc blanked, and chance (1 / data.max_count).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from PIL import Image

from components.data.formats import row_schema
from components.data.io import read_rows, to_plain, write_parquet
from components.validate import load_checked


def blanked(eval_path: str, work: Path, size: int) -> str:
    """A copy of the held-out file whose every image is black, of the same size. One pixel of each is 1/255
    (its place differs by row): invisible, and it keeps the rows from being one duplicate picture."""
    work.mkdir(parents=True, exist_ok=True)
    rows = [to_plain(r) for r in read_rows(eval_path).to_dict("records")]
    for i, r in enumerate(rows):
        black = Image.new("RGB", (size, size))
        black.putpixel((i % size, (i // size) % size), (1, 1, 1))
        black.save(work / f"black_{i}.png")
        r["images"] = [{"bytes": None, "path": str(work / f"black_{i}.png")} for _ in r["images"]]
    return str(write_parquet(rows, work / "blank.parquet", row_schema("text", images=True)))


def main(argv: list[str] | None = None) -> None:
    from prefect import flow

    from tasks.evaluate import evaluate_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/vlm_grpo.yaml")
    p.add_argument("--model_path", action="append", required=True)
    args = p.parse_args(argv)
    # k = 1 sample: greedy accuracy is the figure; the rows are all checked and kept, as in evaluate
    cfg = load_checked(args.config, ["trainer.eval_k=1"])
    work = Path(".bench-vlm-ablation")
    try:
        blank = blanked(cfg.data.eval_path, work, cfg.data.image_processor.size)

        @flow(name="vlm-ablation")
        def run() -> list[dict]:
            out = []
            for path in args.model_path:
                real = evaluate_model.fn(path, cfg.data.eval_path, cfg)
                none = evaluate_model.fn(path, blank, cfg)
                out.append(
                    {
                        "model": path,
                        "acc": real["acc"],
                        "acc_blank_images": none["acc"],
                        "chance": 1 / cfg.data.max_count,
                        "n": real["n"],
                    }
                )
            return out

        for line in run():
            print(json.dumps(line))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
