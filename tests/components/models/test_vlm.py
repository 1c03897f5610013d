"""Vision-language policies: the tiny composed VLM (projector and cross-attention) and a LLaVA directory go
through the same load, forward, generation and optimizer code as text models."""

import pytest
import torch
from PIL import Image

from components.data.images import IMAGE_TOKEN, ImageEncoder, draw_count_image
from components.models.loading import load_image_encoder, load_model, load_tokenizer, save_pretrained
from components.models.multimodal import engine_problems
from components.models.tiny import build_char_tokenizer, build_tiny_model
from components.models.vlm import (
    compose,
    make_processor,
    tiny_vision_encoder,
    vision_parameter,
    with_image_token,
)
from components.rollout.hf import HFEngine, left_pad
from components.rollout.sglang_engine import request_inputs
from components.rollout.vllm_engine import token_prompts
from components.settings import SamplingParams
from components.training.logprobs import response_logprobs
from components.training.optim import freeze_vision, param_groups


def tiny_vlm(fusion: str, grid: int = 2):
    tok = with_image_token(build_char_tokenizer())
    text = build_tiny_model(
        tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=128, seed=0
    )
    vision = tiny_vision_encoder(32, 8, 32, 2, 2, seed=1)
    model = compose(
        text,
        vision,
        fusion_method=fusion,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        image_grid=grid,
        gate_init=0.5,
        seed=2,
    )
    return model.eval(), tok, make_processor(tok, 32, True, model.config.image_tokens)


def images(n: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    return [draw_count_image(1 + k % 4, 32, rng) for k in range(n)]


def encode(tok, processor, image_tokens, prompts, imgs):
    enc = ImageEncoder(processor, image_tokens)
    ids = [enc.expand(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    pixels = processor.image_processor(images=imgs, return_tensors="pt")["pixel_values"].float()
    return ids, pixels


@pytest.mark.parametrize("fusion", ["projector", "cross_attention"])
def test_batched_logprobs_equal_transformers_own_forward_of_each_row(fusion):
    """Left-padded prompts of different lengths with their images, as the trainer computes them, against
    transformers' forward of each row alone through the processor's own outputs."""
    model, tok, processor = tiny_vlm(fusion)
    prompts = [f"{IMAGE_TOKEN}How many?", f"{IMAGE_TOKEN}Count them, please:", f"{IMAGE_TOKEN}n="]
    imgs = images(3)
    ids, pixels = encode(tok, processor, model.config.image_tokens, prompts, imgs)
    responses = torch.tensor([[5, 6, 7, 1], [8, 9, 1, 0], [10, 1, 0, 0]])
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    p_ids, p_mask = left_pad(ids, tok.pad_token_id)
    ours, _ = response_logprobs(model, p_ids, p_mask, responses, response_mask, pixel_values=pixels)
    for i, (prompt, img) in enumerate(zip(prompts, imgs)):
        inputs = processor(text=[prompt], images=[img], return_tensors="pt", add_special_tokens=False)
        assert inputs["input_ids"][0].tolist() == ids[i]  # our expansion is the processor's
        n = int(response_mask[i].sum())
        full = torch.cat([inputs["input_ids"], responses[i : i + 1, :n]], dim=1)
        with torch.no_grad():
            logits = model(input_ids=full, pixel_values=inputs["pixel_values"]).logits[0].float()
        logits[:, model.config.image_token_id] = float("-inf")  # the policy never writes its image token
        P = len(ids[i])
        want = torch.log_softmax(logits[P - 1 : P + n - 1], -1).gather(-1, responses[i, :n, None]).squeeze(-1)
        assert torch.allclose(ours[i, :n], want, atol=1e-5), (ours[i, :n], want)


@torch.no_grad()
@pytest.mark.parametrize("fusion", ["projector", "cross_attention"])
def test_the_image_decides_the_output_and_the_kv_cache_covers_it(fusion, tmp_path):
    """Saved and loaded in HF format (the processor beside it), the hf engine samples with pixel inputs: its
    log-probs equal the trainer's forward with the images (the cache held the image tokens or states), and
    other images give other log-probs."""
    model, tok, processor = tiny_vlm(fusion)
    out = save_pretrained(model, tok, tmp_path / "vlm", processor=processor)
    loaded = load_model(out)
    tok2 = load_tokenizer(out)
    enc = load_image_encoder(out, tok2)
    assert type(loaded).__name__ == "VisionLanguageModel" and enc.image_tokens == model.config.image_tokens
    rows = [{"prompt": f"{IMAGE_TOKEN}How many?", "images": [str(tmp_path / f"{k}.png")]} for k in range(3)]
    for k, img in enumerate(images(3)):
        img.save(rows[k]["images"][0])
    ids = [enc.expand(tok2(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows]
    pixels = enc.pixels(rows)
    engine = HFEngine(loaded, tok2.eos_token_id, tok2.pad_token_id)
    sample = engine.generate(
        ids, SamplingParams(n=2, max_new_tokens=6), seed=3, images=enc.prompt_images(rows)
    )
    p_ids, p_mask = left_pad([p for p in ids for _ in range(2)], tok2.pad_token_id)
    pix = pixels.repeat_interleave(2, 0)
    ours, _ = response_logprobs(
        loaded, p_ids, p_mask, sample.responses, sample.response_mask, pixel_values=pix
    )
    mask = sample.response_mask.bool()
    assert torch.allclose(ours[mask], sample.logprobs[mask], atol=1e-5)
    other, _ = response_logprobs(
        loaded, p_ids, p_mask, sample.responses, sample.response_mask, pixel_values=pix.flip(0)
    )
    assert (other[mask] - ours[mask]).abs().max() > 1e-3


def test_freeze_keeps_the_vision_tower_bit_identical_and_the_ratio_sets_its_lr():
    from types import SimpleNamespace

    from components.training.sft import SFTExample, train_sft

    model, tok, processor = tiny_vlm("projector")
    ids, pixels = encode(tok, processor, 4, [f"{IMAGE_TOKEN}n="] * 4, images(4))
    examples = [SFTExample(p, [10 + k, tok.eos_token_id], None, pixels[k]) for k, p in enumerate(ids)]
    cfg = SimpleNamespace(type="multimodal", freeze_vision_model=False, vision_lr_ratio=0.25)
    groups = param_groups(model, 1e-3, cfg)
    assert [g.get("lr") for g in groups] == [None, 0.25e-3]
    assert all(
        vision_parameter(n) == (id(p) in {id(q) for q in groups[1]["params"]})
        for n, p in model.named_parameters()
    )

    frozen = SimpleNamespace(type="multimodal", freeze_vision_model=True, vision_lr_ratio=0.25)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert freeze_vision(model, frozen) > 0
    train_sft(
        model,
        examples,
        steps=3,
        batch_size=4,
        lr=1e-2,
        pad_id=tok.pad_token_id,
        seed=0,
        params=param_groups(model, 1e-2, frozen),
    )
    after = dict(model.named_parameters())
    vision = [n for n in before if vision_parameter(n)]
    assert vision and all(torch.equal(before[n], after[n]) for n in vision)
    assert any(not torch.equal(before[n], after[n]) for n in before if n.startswith("projector."))


@torch.no_grad()
def test_a_llava_directory_loads_and_samples_through_the_same_code(tmp_path):
    """A tiny randomly initialised LLaVA (transformers' own classes, saved to disk) as a user's VLM."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = with_image_token(build_char_tokenizer())
    text = build_tiny_model(
        tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=128, seed=0
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text.config,
        vision_feature_layer=-1,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    llava = LlavaForConditionalGeneration(config)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ),
        tokenizer=tok,
        patch_size=16,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )
    out = save_pretrained(llava, tok, tmp_path / "llava", processor=processor)
    model, tok2 = load_model(out), load_tokenizer(out)
    enc = load_image_encoder(out, tok2)
    assert type(model).__name__ == "LlavaForConditionalGeneration" and enc.image_tokens == 4  # 2x2 patches
    path = tmp_path / "a.png"
    images(1)[0].save(path)
    rows = [{"prompt": f"{IMAGE_TOKEN}How many?", "images": [str(path)]}]
    ids = [enc.expand(tok2(rows[0]["prompt"], add_special_tokens=False)["input_ids"])]
    prompt_images = enc.prompt_images(rows)
    pixels = prompt_images.pixels
    sample = HFEngine(model, tok2.eos_token_id, tok2.pad_token_id).generate(
        ids, SamplingParams(n=2, max_new_tokens=4), seed=0, images=prompt_images
    )
    p_ids, p_mask = left_pad(ids * 2, tok2.pad_token_id)
    ours, _ = response_logprobs(
        model,
        p_ids,
        p_mask,
        sample.responses,
        sample.response_mask,
        pixel_values=pixels.repeat_interleave(2, 0),
    )
    mask = sample.response_mask.bool()
    assert torch.allclose(ours[mask], sample.logprobs[mask], atol=1e-5)

    # vLLM and SGLang take this directory: the prompt as the user wrote it (one placeholder, their processor
    # expands it) with the decoded image; reinforge's own composed class they refuse, naming the key
    (request,) = token_prompts(ids, prompt_images)
    assert request["prompt_token_ids"] == tok2(rows[0]["prompt"], add_special_tokens=False)["input_ids"]
    assert request["multi_modal_data"]["image"].size == Image.open(path).size
    assert request_inputs(ids, 2, prompt_images)["image_data"] == [request["multi_modal_data"]["image"]] * 2
    assert engine_problems("vllm", str(out)) == [] and engine_problems("sglang", str(out)) == []
    composed, composed_tok, composed_processor = tiny_vlm("projector")
    ours_dir = save_pretrained(composed, composed_tok, tmp_path / "ours", processor=composed_processor)
    (problem,) = engine_problems("vllm", str(ours_dir))
    assert (
        problem.startswith(f"engine.type=vllm with actor.model.path={ours_dir}")
        and "engine.type=hf" in problem
    )
    assert "takes no images" in engine_problems("trtllm", str(out))[0]


def test_an_image_processor_needs_no_torchvision():
    model, tok, processor = tiny_vlm("projector")
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"
    out = processor.image_processor(images=[Image.new("RGB", (50, 20))], return_tensors="pt")
    assert tuple(out["pixel_values"].shape) == (1, 3, 32, 32)


def test_the_policy_directory_and_the_model_type_must_agree(tmp_path):
    from components.errors import ConfigError
    from components.validate import load_checked
    from tasks.rl import check_vision

    model, tok, processor = tiny_vlm("projector")  # 2x2 pooled: 4 image tokens
    vlm = save_pretrained(model, tok, tmp_path / "vlm", processor=processor)
    text = save_pretrained(model.language_model, tok, tmp_path / "text")

    def check(path, *extra):
        cfg = load_checked("configs/arith_grpo.yaml", [f"actor.model.path={path}", *extra])
        check_vision(cfg, load_tokenizer(path))

    with pytest.raises(ConfigError, match=r"actor\.model\.type=text, but .* is a vision-language model"):
        check(vlm)
    with pytest.raises(ConfigError, match=r"actor\.model\.type=multimodal, but .* is a text-only model"):
        check(text, "actor.model.type=multimodal")
    with pytest.raises(
        ConfigError, match=r"actor\.model\.vision_token_ratio=0\.05: an image .* takes 4 tokens"
    ):
        check(vlm, "actor.model.type=multimodal", "actor.model.vision_token_ratio=0.05")
    check(vlm, "actor.model.type=multimodal")  # 4 tokens <= 0.5 x 64


def test_a_qwen2_vl_directory_is_refused_naming_the_key(tmp_path):
    """A real (tiny, random) Qwen2-VL directory: its dynamic-resolution inputs are not handled in this
    version, so loading it as the policy is a config error naming the key and what to use instead."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from components.errors import ConfigError

    tok = build_char_tokenizer()
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]},
        },
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "in_chans": 3},
    )
    torch.manual_seed(0)
    out = tmp_path / "qwen2vl"
    Qwen2VLForConditionalGeneration(config).save_pretrained(out)
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil().save_pretrained(out)
    with pytest.raises(ConfigError, match=rf"actor\.model\.path={out}: a qwen2_vl model.*LLaVA-style"):
        load_image_encoder(out, tok)
