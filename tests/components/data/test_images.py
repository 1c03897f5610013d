"""Rows with images: the counting task, the LLaVA importer, and cleaning that quarantines bad images."""

import json
import random
from pathlib import Path

import pandas as pd
import pytest
import torch
from PIL import Image

from components.data.clean import RowRules, clean_rows
from components.data.images import IMAGE_TOKEN, draw_count_image, llava_rows, visual_count_rows
from components.errors import ConfigError
from components.models.tiny import build_char_tokenizer
from components.models.vlm import with_image_token
from components.validate import load_checked

TOK = with_image_token(build_char_tokenizer())
RULES = RowRules(max_prompt_len=32, image_tokens=16)


def test_the_counting_task_is_seeded_and_its_answer_is_in_the_image(tmp_path):
    a, _ = visual_count_rows(6, 2, 4, tmp_path / "a", 32, seed=3)
    b, _ = visual_count_rows(6, 2, 4, tmp_path / "b", 32, seed=3)
    assert [r["reward_model"] for r in a] == [r["reward_model"] for r in b]
    for ra, rb in zip(a, b):
        assert Path(ra["images"][0]["path"]).read_bytes() == Path(rb["images"][0]["path"]).read_bytes()
    img = draw_count_image(3, 32, random.Random(0))
    lit = sum(1 for px in img.getdata() if px != (0, 0, 0))
    assert lit == 3 * 6 * 6  # three 6x6 squares (cell 8, side 3/4 of it), nowhere overlapping


def test_bad_images_are_quarantined_with_their_reason_and_nothing_is_lost(tmp_path):
    rows, _ = visual_count_rows(8, 1, 4, tmp_path, 32, seed=0)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(Path(rows[1]["images"][0]["path"]).read_bytes()[:60])
    cmyk = tmp_path / "cmyk.jpg"
    Image.new("CMYK", (32, 32)).save(cmyk)
    not_image = tmp_path / "notes.png"
    not_image.write_text("hello")
    bad = [
        {**rows[1], "images": [str(truncated)]},
        {**rows[2], "images": [str(cmyk)]},
        {**rows[3], "images": [str(tmp_path / "missing.png")]},
        {**rows[4], "images": [str(not_image)]},
        {**rows[5], "images": []},  # a placeholder without an image
        {**rows[6], "prompt": "How many?"},  # an image without a placeholder
        {**rows[7], "images": [rows[0]["images"][0]]},  # the same picture as row 0
    ]
    df = pd.DataFrame([rows[0], *bad])
    kept, quarantined = clean_rows(df, TOK, RULES, "x.parquet")
    reasons = {q["source_row"]: q["reason"] for q in quarantined}
    assert reasons == {
        1: "bad_image",
        2: "image_mode",
        3: "missing_image",
        4: "bad_image",
        5: "image_placeholders",
        6: "image_placeholders",
        7: "duplicate",
    }
    assert len(kept) + len(quarantined) == len(df) and kept[0]["images"] == rows[0]["images"]


def test_image_tokens_count_against_the_prompt_budget():
    rows, _ = visual_count_rows(1, 1, 4, "/tmp/reinforge-test-images", 32, seed=0)
    _, quarantined = clean_rows(pd.DataFrame(rows), TOK, RowRules(max_prompt_len=20, image_tokens=16), "x")
    assert quarantined[0]["reason"] == "too_long" and "16 tokens" in quarantined[0]["detail"]


def test_a_file_with_images_for_a_text_only_policy_is_refused():
    rows, _ = visual_count_rows(2, 1, 4, "/tmp/reinforge-test-images", 32, seed=0)
    with pytest.raises(ConfigError, match=r"actor\.model\.type=multimodal"):
        clean_rows(pd.DataFrame(rows), TOK, RowRules(max_prompt_len=32), "x.parquet")


def test_llava_jsonl_import(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "cat.png")
    lines = [
        {
            "id": "a",
            "image": "cat.png",
            "conversations": [
                {"from": "human", "value": "<image>\nHow many cats?"},
                {"from": "gpt", "value": "One. #### 1"},
            ],
        },
        {
            "id": "b",
            "image": "cat.png",
            "conversations": [{"from": "human", "value": "Colour?"}, {"from": "gpt", "value": "black"}],
            "ground_truth": "black",
        },
    ]
    path = tmp_path / "llava.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    rows = llava_rows(path, None)
    assert rows[0]["prompt"] == "<image>\nHow many cats?" and rows[0]["reward_model"]["ground_truth"] == "1"
    assert rows[1]["prompt"] == f"{IMAGE_TOKEN}Colour?" and rows[1]["reward_model"]["ground_truth"] == "black"
    assert (
        rows[0]["images"] == [{"bytes": None, "path": str(tmp_path / "cat.png")}]
        and rows[0]["extra_info"]["answer"] == "One. #### 1"
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["actor.model.type=multimodal", "actor.model.vision_model=/nowhere/clip"],
            r"actor\.model\.vision_model=/nowhere/clip: no Hugging Face model there",
        ),
        (["actor.model.type=multimodal", "actor.model.fusion_method=concat"], r"actor\.model\.fusion_method"),
        (
            ["actor.model.type=multimodal", "actor.model.vision_token_ratio=1.5"],
            r"actor\.model\.vision_token_ratio",
        ),
        (
            ["actor.model.type=multimodal", "actor.model.vision_token_ratio=0"],
            r"actor\.model\.vision_token_ratio",
        ),
        (["data.task=visual_count"], r"actor\.model\.type=text is a text-only model"),
        (["actor.model.type=multimodal", "engine.type=trtllm"], r"engine\.type=trtllm takes no images"),
    ],
)
def test_multimodal_config_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_checked("configs/arith_grpo.yaml", overrides)


def test_verl_parquet_with_image_bytes_cleans_and_round_trips(tmp_path):
    """verl's multimodal parquet: `images` holds {bytes, path} with the encoded picture; cleaning keeps the
    bytes exactly (not decoded as text), writes verl's form back, and the policy's encoder reads the same
    pixels as from the file."""
    from components.data.clean import clean_file
    from components.data.formats import row_schema
    from components.data.images import ImageEncoder
    from components.data.io import read_rows, to_plain, write_parquet
    from components.models.vlm import make_processor

    rows, _ = visual_count_rows(4, 1, 4, tmp_path / "img", 32, seed=1)
    as_bytes = [
        {**r, "images": [{"bytes": Path(r["images"][0]["path"]).read_bytes(), "path": None}]} for r in rows
    ]
    src = write_parquet(as_bytes, tmp_path / "verl.parquet", row_schema("text", images=True))
    report = clean_file(src, tmp_path / "clean.parquet", tmp_path / "q", TOK, RULES)
    assert report.kept == 4 and report.quarantined == 0
    kept = [to_plain(r) for r in read_rows(tmp_path / "clean.parquet").to_dict("records")]
    assert [k["images"][0]["bytes"] for k in kept] == [a["images"][0]["bytes"] for a in as_bytes]
    encoder = ImageEncoder(make_processor(TOK, 32, True, 16), 16)
    assert torch.equal(encoder.pixels(kept), encoder.pixels(rows))
