"""LoRA (actor.lora): an update changes the adapters alone (the base bit-identical, optimizer state for the
adapters only); the reference with adapters off is the base model; the merged export gives the adapter model's
logits; the engine fed the adapters alone samples with the trainer's log-probs; an adapter directory loads as
the merged model; what LoRA cannot take fails at config validation naming the key."""

from __future__ import annotations

import copy

import pytest
import torch

from components.errors import ConfigError
from components.models.loading import load_model
from components.models.lora import (
    AdaptersOff,
    adapter_state,
    apply_lora,
    is_adapter_dir,
    merged_state,
    save_adapter,
)
from components.rollout.worker import RolloutWorker
from components.settings import LoopSettings, LoraSettings, PolicyLossParams, SamplingParams, UpdateSettings
from components.training.actor import PolicyTrainer
from components.training.logprobs import batch_logprobs
from components.training.optim import make_optimizer, param_groups
from components.validate import load_checked
from tests.components.training.test_actor import synthetic_batch

LORA = LoraSettings(rank=4, alpha=8.0)


def trained(tiny_model_dir, tokenizer, steps: int = 2):
    """A LoRA policy over the tiny model after `steps` AdamW updates, its trainer, and the base's weights."""
    torch.manual_seed(0)
    base = load_model(tiny_model_dir)
    start = {k: v.clone() for k, v in base.state_dict().items()}
    policy = apply_lora(base, LORA, str(tiny_model_dir))
    cfg = load_checked(None, ["actor.optimizer.lr=0.05", "actor.optimizer.type=adamw"]).actor.optimizer
    opt, sched = make_optimizer(param_groups(policy, cfg.lr), cfg)
    s = UpdateSettings(LoopSettings(grad_clip=1e9), loss=PolicyLossParams(agg_mode="token-mean"))
    trainer = PolicyTrainer(policy, AdaptersOff(policy), opt, sched, s)
    for step in range(steps):
        trainer.update(synthetic_batch(tokenizer, seed=step))
    return policy, trainer, start


def test_an_update_changes_the_adapters_alone(tiny_model_dir, tokenizer):
    policy, trainer, start = trained(tiny_model_dir, tokenizer)
    base = {k.replace(".base_layer", ""): v for k, v in policy.get_base_model().state_dict().items()}
    assert all(torch.equal(base[k], start[k]) for k in start)  # bit-identical base
    adapters = adapter_state(policy)
    assert any(float(v.abs().max()) > 0 for k, v in adapters.items() if "lora_B" in k)  # B moved off zero
    with_state = [p for p in policy.parameters() if p in trainer.optimizer.state]
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert len(with_state) == len(trainable) == len(adapters)  # optimizer state for the adapters only


def test_the_reference_with_adapters_off_is_the_base_model(tiny_model_dir, tokenizer):
    policy, trainer, _ = trained(tiny_model_dir, tokenizer)
    batch = synthetic_batch(tokenizer, seed=5)
    ref = trainer.logprobs(batch, reference=True)
    assert torch.equal(ref, batch_logprobs(load_model(tiny_model_dir), batch, 1.0, None))
    assert not torch.allclose(ref, trainer.logprobs(batch), atol=1e-4)  # the policy itself has moved


def test_the_merged_weights_give_the_adapter_models_logits(tiny_model_dir, tokenizer, tmp_path):
    policy, _, _ = trained(tiny_model_dir, tokenizer)
    ids = synthetic_batch(tokenizer).tensors["prompts"]
    merged = load_model(tiny_model_dir)
    merged.load_state_dict(merged_state(policy))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, policy(input_ids=ids).logits, atol=1e-5, rtol=0)
        # and an exported adapter directory loads as that merged model (generate / evaluate take either)
        save_adapter(policy, tokenizer, tmp_path / "adapter", str(tiny_model_dir))
        assert is_adapter_dir(tmp_path / "adapter")
        loaded = load_model(tmp_path / "adapter")
        torch.testing.assert_close(loaded(ids).logits, policy(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_an_engine_fed_the_adapters_alone_samples_with_the_trainers_logprobs(tiny_model_dir, tokenizer):
    policy, _, _ = trained(tiny_model_dir, tokenizer)
    worker = RolloutWorker(str(tiny_model_dir))
    worker.engine.use_adapters(LORA)
    worker.engine.update_weights(adapter_state(policy), 1)
    rows = [
        {"prompt": "12+30=", "reward_model": {"ground_truth": "42"}, "data_source": "arith", "extra_info": {}}
    ] * 2
    batch = worker.generate(rows, SamplingParams(n=4, temperature=1.0, max_new_tokens=6), seed=3, iteration=1)
    t = batch.tensors
    trainer_lp = batch_logprobs(policy, batch, 1.0, None) * t["response_mask"]
    torch.testing.assert_close(t["rollout_logprobs"], trainer_lp, atol=1e-5, rtol=0)
    # the base alone samples differently: the adapters did reach the engine
    base_lp = batch_logprobs(load_model(tiny_model_dir), batch, 1.0, None) * t["response_mask"]
    assert not torch.allclose(t["rollout_logprobs"], base_lp, atol=1e-4)


def test_the_engine_refuses_adapters_of_other_settings(tiny_model_dir, tokenizer):
    policy, _, _ = trained(tiny_model_dir, tokenizer, steps=0)
    worker = RolloutWorker(str(tiny_model_dir))
    worker.engine.use_adapters(LoraSettings(rank=4, target_modules=("q_proj",)))
    with pytest.raises(ValueError, match="do not match the model's adapters"):
        worker.engine.update_weights(adapter_state(policy), 1)


def test_merging_never_touches_the_base(tiny_model_dir, tokenizer):
    policy, _, start = trained(tiny_model_dir, tokenizer)
    before = copy.deepcopy(policy.state_dict())
    merged_state(policy)
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["actor.lora.rank=4", "actor.lora.target_modules=[nope_proj]"],
            r"actor\.lora\.target_modules: \['nope_proj'\] name no linear layer .* its linear layers are",
        ),
        (["actor.lora.rank=64"], r"actor\.lora\.rank=64 is larger than the smallest side \(32\)"),
        (
            ["actor.lora.rank=4", "engine.type=trtllm"],
            r"actor\.lora\.rank=4 with engine\.type=trtllm: .*set engine\.lora_merge_on_sync=true",
        ),
        (
            ["actor.lora.rank=4", "actor.lora.quantization=4bit"],
            r"actor\.lora\.quantization=4bit: a quantized base \(QLoRA\) needs bitsandbytes on a CUDA GPU",
        ),
        (["actor.lora.quantization=8bit"], r"actor\.lora\.quantization=8bit .* actor\.lora\.rank=0"),
        (
            ["actor.lora.rank=4", "trainer.num_workers=2", "trainer.strategy=fsdp"],
            r"actor\.lora\.rank=4 with trainer\.strategy=fsdp over several workers is not supported",
        ),
        (
            ["critic.lora.rank=4", "critic.lora.target_modules=[nope_proj]"],
            r"critic\.lora\.target_modules: \['nope_proj'\] name no linear layer",
        ),
        (["critic.lora.rank=64"], r"critic\.lora\.rank=64 is larger than the smallest side \(32\)"),
    ],
)
def test_what_lora_cannot_take_fails_before_any_work_naming_the_key(tiny_model_dir, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_checked(
            None, [f"actor.model.path={tiny_model_dir}", "data.batch_size=2", "engine.n=4", *overrides]
        )


def test_a_critic_with_adapters_trains_the_adapters_and_its_head_alone(tiny_model_dir, tokenizer):
    """critic.lora: the backbone's weights stay bit-identical, the adapters and the value head move, and the
    optimizer holds state for them alone."""
    from components.training.critic import CriticTrainer, build_value_model

    torch.manual_seed(0)
    start = {k: v.clone() for k, v in load_model(tiny_model_dir).base_model.state_dict().items()}
    model = build_value_model(str(tiny_model_dir), "float32", "sdpa", "critic.model_path", LORA)
    cfg = load_checked(None, ["critic.optimizer.lr=0.05", "critic.optimizer.type=adamw"]).critic.optimizer
    opt, sched = make_optimizer(param_groups(model, cfg.lr), cfg)
    trainer = CriticTrainer(model, opt, sched, LoopSettings(grad_clip=1e9), cliprange=0.5)
    for step in range(2):
        b = synthetic_batch(tokenizer, seed=step)
        mask = b.tensors["response_mask"].float()
        trainer.update(b.union(values=trainer.values(b), returns=torch.ones_like(mask) * mask))
    backbone = {
        k.replace(".base_layer", ""): v for k, v in model.backbone.state_dict().items() if "lora_" not in k
    }
    assert backbone.keys() == start.keys() and all(torch.equal(backbone[k], start[k]) for k in start)
    assert float(model.head.weight.abs().max()) > 0  # the head moved off its zero start
    adapters = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert adapters and any(float(p.abs().max()) > 0 for p in adapters.values())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in opt.state} == {id(p) for p in trainable}
    assert (
        len(trainable) == 2 * len(adapters) + 2
    )  # A and B of each adapted layer, the head's weight and bias
