"""The critic: value positions, zero start, the update fits returns, accumulation invariance."""

import torch

from components.batch import Batch
from components.settings import LoopSettings
from components.training.critic import CriticTrainer, ValueModel
from tests.components.training.test_actor import synthetic_batch
from tests.conftest import make_model


def critic(tokenizer, micro=None, lr=0.05, epochs=1):
    torch.manual_seed(0)
    model = ValueModel(make_model(tokenizer))
    torch.nn.init.normal_(model.head.weight, std=0.1)  # a non-zero head, so the backbone gets gradients too
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return CriticTrainer(
        model,
        opt,
        sched,
        LoopSettings(ppo_epochs=epochs, micro_batch_size=micro, grad_clip=1e9),
        cliprange=0.5,
    )


def with_targets(tokenizer, trainer) -> Batch:
    b = synthetic_batch(tokenizer)
    mask = b.tensors["response_mask"].float()
    return b.union(
        values=trainer.values(b), returns=torch.linspace(-1, 1, mask.numel()).reshape(mask.shape) * mask
    )


def test_values_are_zero_at_start_and_on_padding(tokenizer):
    model = ValueModel(make_model(tokenizer))
    b = synthetic_batch(tokenizer)
    t = b.tensors
    v = model(t["prompts"], t["prompt_mask"], t["responses"], t["response_mask"])
    assert v.shape == t["responses"].shape and (v == 0).all()


def test_value_of_a_position_does_not_see_its_own_token(tokenizer):
    # the value before response token t must not change when token t (or any later one) changes
    c = critic(tokenizer)
    b = synthetic_batch(tokenizer)
    t = b.tensors
    v1 = c.model(t["prompts"], t["prompt_mask"], t["responses"], t["response_mask"])
    changed = t["responses"].clone()
    changed[:, 2:] = (changed[:, 2:] + 1) % len(tokenizer)
    v2 = c.model(t["prompts"], t["prompt_mask"], changed, t["response_mask"])
    torch.testing.assert_close(v1[:, :3], v2[:, :3])
    assert not torch.allclose(v1[:, 3:], v2[:, 3:])


def test_update_fits_the_returns(tokenizer):
    c = critic(tokenizer, epochs=4)
    b = with_targets(tokenizer, c)
    first = c.update(b)
    for _ in range(10):
        last = c.update(b.union(values=c.values(b)))
    assert last["critic/vf_loss"] < 0.5 * first["critic/vf_loss"]
    assert {"critic/vf_clipfrac", "critic/grad_norm", "critic/lr"} <= last.keys()


def test_micro_batch_1x8_equals_8x1(tokenizer):
    params = []
    for micro in (1, 8):
        c = critic(tokenizer, micro=micro)
        c.update(with_targets(tokenizer, c))
        params.append({k: v.detach().clone() for k, v in c.model.named_parameters()})
    for k in params[0]:
        torch.testing.assert_close(params[0][k], params[1][k], atol=1e-6, rtol=0)
