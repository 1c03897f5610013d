"""Images in rows: the synthetic counting task, the LLaVA importer, and the checks cleaning applies to images.

A multimodal row is a row of the usual format plus `images`: a list with one entry per `<image>` placeholder
of its prompt, in order. An entry is a path (relative to the project, or absolute) or verl's parquet form, a
dict with `bytes` (an encoded image) and/or `path`.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from pathlib import Path

from components.data.formats import make_row
from components.data.io import regular_file
from components.data.prompts import prompt_text
from components.errors import DataError

IMAGE_TOKEN = "<image>"
VISUAL_SOURCE = "visual_count"
COUNT_PROMPT = f"{IMAGE_TOKEN}How many?"
# what a policy's image processor accepts as it is (a palette, CMYK or 16-bit image must be converted by
# whoever made it: converting silently could change what the question is about, say its colours)
IMAGE_MODES = ("RGB", "RGBA", "L")
# light colours on black: every shape stands out from the background the same way
COLOURS = [(240, 240, 240), (250, 230, 120), (150, 240, 250)]


def image_ref(entry) -> dict:
    """One `images` entry in verl's form, {bytes, path}: a path string becomes {bytes: None, path}."""
    if isinstance(entry, dict):
        return {"bytes": entry.get("bytes") or None, "path": entry.get("path") or None}
    return {"bytes": None, "path": str(entry)}


def draw_count_image(count: int, size: int, rng: random.Random):
    """`count` filled squares of random light colours in distinct cells of a 4x4 grid on black, with a
    jittered position inside the cell: the answer is in the image, and only there."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (0, 0, 0))
    draw = ImageDraw.Draw(img)
    cell = size // 4
    side = max(2, cell * 3 // 4)
    for k in rng.sample(range(16), count):
        x0 = (k % 4) * cell + rng.randint(0, cell - side)
        y0 = (k // 4) * cell + rng.randint(0, cell - side)
        draw.rectangle([x0, y0, x0 + side - 1, y0 + side - 1], fill=rng.choice(COLOURS))
    return img


def visual_count_rows(
    num_train: int, num_eval: int, max_count: int, image_dir: str | Path, size: int, seed: int
) -> tuple[list[dict], list[dict]]:
    """Rows asking how many shapes an image holds (1..max_count, uniform), answer `#### N`; the images are
    written as PNG files under image_dir and named by the rows. Seeded: same arguments, same bytes."""
    rng = random.Random(seed)
    out_dir = Path(image_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def rows(n: int, split: str) -> list[dict]:
        made = []
        for i in range(n):
            count = rng.randint(1, max_count)
            path = out_dir / f"{split}_{i:05d}.png"
            draw_count_image(count, size, rng).save(path, format="PNG")
            row = make_row(
                VISUAL_SOURCE, COUNT_PROMPT, f"#### {count}", str(count), split, i, ability="vision"
            )
            row["prompt"] = COUNT_PROMPT  # a plain string: the tiny model has no chat roles
            row["images"] = [image_ref(path)]
            made.append(row)
        return made

    return rows(num_train, "train"), rows(num_eval, "test")


def llava_rows(path: str | Path, image_folder: str | Path | None, key: str = "data.llava_path") -> list[dict]:
    """A LLaVA-style jsonl ({image, conversations: [{from: human, value}, {from: gpt, value}]}) as rows: the
    human turn is the prompt (its `<image>` kept; one is put first when it has none), the gpt turn the SFT
    answer, and the ground truth the text after its last `#### ` (or the row's `ground_truth` field). Image
    paths are taken relative to image_folder (default: the jsonl's folder)."""
    src = regular_file(path, key, "a local LLaVA jsonl (image, conversations)")
    folder = Path(image_folder) if image_folder else src.parent
    out = []
    for i, line in enumerate(src.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            turns = rec["conversations"]
            question = next(t["value"] for t in turns if t.get("from") == "human")
            answer = next(t["value"] for t in turns if t.get("from") == "gpt")
        except (ValueError, KeyError, StopIteration, TypeError) as exc:
            raise DataError(
                f"{key}={path}: line {i + 1} is not a LLaVA record ({type(exc).__name__}); each line needs "
                "`conversations` with a human and a gpt turn."
            ) from None
        truth = str(rec.get("ground_truth", answer.rsplit("####", 1)[-1].strip() if "####" in answer else ""))
        images = rec.get("image") or []
        images = [images] if isinstance(images, str) else list(images)
        if images and IMAGE_TOKEN not in question:
            question = IMAGE_TOKEN * len(images) + question
        row = make_row(rec.get("data_source", VISUAL_SOURCE), question, answer, truth, "train", i, "vision")
        row["prompt"] = question
        row["images"] = [image_ref(folder / p) for p in images]
        out.append(row)
    return out


def image_entry_bytes(entry, base: Path | None = None) -> bytes:
    """The encoded bytes of one `images` entry (a path, or verl's {bytes, path}); OSError if unreadable."""
    if isinstance(entry, dict):
        if entry.get("bytes"):
            return bytes(entry["bytes"])
        entry = entry.get("path")
    if not isinstance(entry, str) or not entry:
        raise OSError(f"not an image path: {str(entry)[:60]!r}")
    p = Path(entry)
    if not p.is_absolute() and base is not None and not p.exists():
        p = base / p
    return p.read_bytes()


def open_image(entry, base: Path | None = None):
    """A PIL image, fully decoded (a truncated file raises here, not later in a worker)."""
    from PIL import Image

    img = Image.open(io.BytesIO(image_entry_bytes(entry, base)))
    img.load()
    return img


def image_problem(prompt, images, base: Path | None = None) -> tuple[str, str, str | None]:
    """(reason, detail, digest) for a row's images: reason is "" when they are fine, else one of
    image_placeholders, missing_image, bad_image, image_mode. The digest (md5 of the image bytes) makes rows
    with the same picture duplicates whatever their file names."""
    from PIL import Image, UnidentifiedImageError

    images = list(images) if isinstance(images, (list, tuple)) else ([] if images is None else [images])
    placeholders = prompt_text(prompt).count(IMAGE_TOKEN)
    if placeholders != len(images):
        return (
            "image_placeholders",
            f"the prompt has {placeholders} {IMAGE_TOKEN} placeholder(s) and the row {len(images)} image(s)",
            None,
        )
    if len(images) > 1:
        return ("image_placeholders", f"{len(images)} images in one prompt; reinforge takes one", None)
    digest = hashlib.md5()
    for entry in images:
        try:
            data = image_entry_bytes(entry, base)
        except OSError as exc:
            return (
                "missing_image",
                f"image {str(entry)[:80]!r} cannot be read ({exc.__class__.__name__})",
                None,
            )
        try:
            img = Image.open(io.BytesIO(data))
            img.load()
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            return ("bad_image", f"image {str(entry)[:80]!r} does not decode ({str(exc)[:80]})", None)
        if img.mode not in IMAGE_MODES:
            return (
                "image_mode",
                f"image {str(entry)[:80]!r} is {img.mode}; convert it to one of {', '.join(IMAGE_MODES)}",
                None,
            )
        digest.update(data)
    return "", "", digest.hexdigest() if images else None


def absolute_images(rows: list[dict], base: Path) -> list[dict]:
    """Rows whose images are {bytes, path} with absolute paths (Ray workers may run elsewhere in the tree)."""

    def fix(entry):
        ref = image_ref(entry)
        path = ref["path"]
        if not ref["bytes"] and path and not Path(path).is_absolute():
            ref["path"] = str((Path(path) if Path(path).exists() else base / path).resolve())
        return ref

    return [{**r, "images": [fix(e) for e in r["images"]]} if r.get("images") else r for r in rows]


class ImageEncoder:
    """A VLM's processor applied to rows: the `<image>` token of a prompt's ids becomes the processor's
    `image_tokens` copies (what transformers' processors do to the text), and each row's image its pixels.
    Rows without an image get zeros (their prompt has no image token to carry them)."""

    def __init__(self, processor, image_tokens: int):
        self.processor, self.image_tokens = processor, image_tokens
        token = getattr(processor, "image_token", IMAGE_TOKEN)
        self.token_id = processor.tokenizer.convert_tokens_to_ids(token)

    def expand(self, ids: list[int]) -> list[int]:
        out: list[int] = []
        for t in ids:
            out.extend([t] * self.image_tokens if t == self.token_id else [t])
        return out

    def pixels(self, rows: list[dict], base: Path | None = None):
        """(B, C, H, W) float32: each row's image through the image processor (zeros for a row without)."""
        return self.processed(self.opened(rows, base))

    def prompt_images(self, rows: list[dict], base: Path | None = None):
        """The rows' images as a rollout engine takes them (components.rollout.base.PromptImages): pixels for
        the hf engine, the decoded images for engines with their own processor; None without any image."""
        from components.rollout.base import PromptImages

        raw = self.opened(rows, base)
        pixels = self.processed(raw)
        return None if pixels is None else PromptImages(pixels, raw, self.token_id)

    @staticmethod
    def opened(rows: list[dict], base: Path | None = None) -> list:
        """Each row's first image as RGB (None for a row without)."""
        return [open_image(r["images"][0], base).convert("RGB") if r.get("images") else None for r in rows]

    def processed(self, images: list):
        import torch

        present = [img for img in images if img is not None]
        if not present:
            return None
        done = self.processor.image_processor(images=present, return_tensors="pt")["pixel_values"]
        out = torch.zeros((len(images), *done.shape[1:]), dtype=torch.float32)
        at = [i for i, img in enumerate(images) if img is not None]
        out[at] = done.float()
        return out
