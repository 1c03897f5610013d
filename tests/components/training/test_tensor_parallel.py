"""Tensor parallelism's plan and its config checks (the equivalence with one worker, on Ray with gloo:
tests/components/training/test_distributed.py; through the flow: tests/flows/test_multi_worker.py)."""

from __future__ import annotations

import pytest
import torch

from components.errors import ConfigError
from components.training.tensor_parallel import clip_grad_norm, module_plan
from components.validate import load_checked


def test_the_plan_is_the_architectures_own_with_the_vocabulary_split_when_it_divides(tokenizer):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from tests.conftest import make_model

    model = make_model(tokenizer)
    plan = module_plan(model, 2)  # a 99-token vocabulary: no even split, the embedding and head stay whole
    assert {k: type(v).__name__ for k, v in plan.items()} == {
        "model.layers.*.self_attn.q_proj": "ColwiseParallel",
        "model.layers.*.self_attn.k_proj": "ColwiseParallel",
        "model.layers.*.self_attn.v_proj": "ColwiseParallel",
        "model.layers.*.self_attn.o_proj": "RowwiseParallel",
        "model.layers.*.mlp.gate_proj": "ColwiseParallel",
        "model.layers.*.mlp.up_proj": "ColwiseParallel",
        "model.layers.*.mlp.down_proj": "RowwiseParallel",
    }
    plan = module_plan(model, 3)  # 99 = 3 x 33: split over the vocabulary
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)
    assert isinstance(plan["lm_head"], ColwiseParallel)


def test_clip_over_one_layout_is_torchs():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn(4, 3)
        q.grad = p.grad.clone()
    ours = clip_grad_norm(a, 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(b, 0.5)
    assert abs(ours - float(theirs)) < 1e-6
    assert all(torch.allclose(p.grad, q.grad, atol=1e-7) for p, q in zip(a, b))


def gpt2_dir(tmp_path, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    out = tmp_path / "gpt2"
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["trainer.num_workers=3", "actor.tensor_model_parallel_size=2"],
            r"actor\.tensor_model_parallel_size=2 must divide trainer\.num_workers=3",
        ),
        (
            ["trainer.num_workers=4", "actor.tensor_model_parallel_size=4"],
            r"actor\.tensor_model_parallel_size=4 must divide the model's 2 attention heads",
        ),
        (
            ["trainer.num_workers=4", "actor.tensor_model_parallel_size=2", "trainer.strategy=ddp"],
            r"trainer\.strategy=ddp with actor\.tensor_model_parallel_size=2 and 2 data-parallel replicas.*"
            r"trainer\.strategy=fsdp",
        ),
        (
            ["trainer.num_workers=2", "actor.tensor_model_parallel_size=2", "trainer.data_parallel_size=1"],
            r"trainer\.data_parallel_size=1 with actor\.tensor_model_parallel_size=2: .*unset it",
        ),
        (
            ["actor.sequence_parallel=true"],
            r"actor\.sequence_parallel=true .* actor\.tensor_model_parallel_size=1; set it above 1",
        ),
        (
            [
                "trainer.num_workers=4",
                "actor.tensor_model_parallel_size=2",
                "actor.pipeline_model_parallel_size=2",
                "actor.sequence_parallel=true",
            ],
            r"actor\.pipeline_model_parallel_size=2 with actor\.sequence_parallel=true is not supported",
        ),
    ],
)
def test_impossible_meshes_fail_before_any_work_naming_the_key(tiny_model_dir, overrides, match):
    base = [f"actor.model.path={tiny_model_dir}", "data.batch_size=2", "engine.n=4"]
    with pytest.raises(ConfigError, match=match):
        load_checked(None, base + overrides)


def test_an_architecture_without_a_plan_is_named(tmp_path, tokenizer):
    path = gpt2_dir(tmp_path, tokenizer)
    with pytest.raises(
        ConfigError, match=rf"actor\.model\.path={path} is a gpt2 model, which has no tensor-parallel"
    ):
        load_checked(
            None,
            [f"actor.model.path={path}", "trainer.num_workers=2", "actor.tensor_model_parallel_size=2"],
        )


def test_sequence_parallelism_names_an_architecture_it_has_no_layout_for(tmp_path, tokenizer):
    from transformers import GemmaConfig, GemmaForCausalLM

    path = tmp_path / "gemma"
    config = GemmaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    GemmaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    overrides = [
        "trainer.num_workers=2",
        "actor.tensor_model_parallel_size=2",
        "actor.sequence_parallel=true",
    ]
    with pytest.raises(ConfigError, match=r"actor\.sequence_parallel=true: .* is a gemma model"):
        load_checked(None, [f"actor.model.path={path}", *overrides])


def test_a_valid_mesh_loads(tiny_model_dir):
    cfg = load_checked(
        None,
        [
            f"actor.model.path={tiny_model_dir}",
            "data.batch_size=2",
            "engine.n=4",
            "trainer.num_workers=4",
            "actor.tensor_model_parallel_size=2",
            "trainer.strategy=fsdp",
        ],
    )
    assert cfg.actor.tensor_model_parallel_size == 2
