"""The policy update: gradient-accumulation invariance and that an update really changes every weight."""

import pytest
import torch

from components.batch import Batch
from components.errors import TrainingDiverged
from components.settings import LoopSettings, PolicyLossParams, UpdateSettings
from components.training.actor import PolicyTrainer
from tests.conftest import make_model


def synthetic_batch(tokenizer, n=8, seed=0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    prompts = torch.randint(3, vocab, (n, 4), generator=g)
    prompt_mask = torch.ones(n, 4, dtype=torch.long)
    prompt_mask[::2, 0] = 0  # some left padding
    responses = torch.randint(3, vocab, (n, 5), generator=g)
    response_mask = torch.ones(n, 5, dtype=torch.long)
    response_mask[1::3, 3:] = 0
    adv = torch.randn(n, generator=g)[:, None] * response_mask
    return Batch(
        {
            "prompts": prompts,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "advantages": adv,
        }
    )


def trained_params(tokenizer, micro, mini=None, epochs=1, beta=0.0, max_tokens=None):
    torch.manual_seed(0)
    model = make_model(tokenizer)
    ref = make_model(tokenizer) if beta else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    s = UpdateSettings(
        LoopSettings(
            ppo_epochs=epochs,
            mini_batch_size=mini,
            micro_batch_size=micro,
            grad_clip=1e9,
            max_tokens=max_tokens,
        ),
        beta=beta,
        loss=PolicyLossParams(agg_mode="token-mean"),
    )
    trainer = PolicyTrainer(model, ref, opt, sched, s)
    metrics = trainer.update(synthetic_batch(tokenizer))
    return {k: v.detach().clone() for k, v in model.named_parameters()}, metrics


def test_micro_batch_1x8_equals_8x1(tokenizer):
    a, _ = trained_params(tokenizer, micro=1)
    b, _ = trained_params(tokenizer, micro=8)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


def test_accumulation_invariance_with_kl_and_mini_batches(tokenizer):
    a, _ = trained_params(tokenizer, micro=1, mini=4, epochs=2, beta=0.1)
    b, _ = trained_params(tokenizer, micro=4, mini=4, epochs=2, beta=0.1)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


def test_update_changes_every_parameter_and_reports_metrics(tokenizer):
    before = {k: v.detach().clone() for k, v in make_model(tokenizer).named_parameters()}
    after, metrics = trained_params(tokenizer, micro=4)
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key]))


def test_multiple_epochs_move_the_ratio_off_one(tokenizer):
    _, metrics = trained_params(tokenizer, micro=8, mini=4, epochs=2)
    assert metrics["actor/ppo_kl"] != 0.0


def test_token_budget_micro_batches_give_the_same_step(tokenizer):
    a, _ = trained_params(tokenizer, micro=8)
    b, _ = trained_params(
        tokenizer, micro=None, max_tokens=20
    )  # several packed micro-batches of <= 20 tokens
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


def test_micro_batches_are_cut_to_their_padding_and_packed_to_the_budget(tokenizer):
    from components.training.loop import micro_batches, padded_tokens

    b = synthetic_batch(tokenizer, n=8)
    b.tensors["response_mask"][1::2, 2:] = 0  # every other row has a 2-token response and a 2-token prompt
    b.tensors["prompt_mask"][1::2, :2] = 0
    packed = micro_batches(b, None, max_tokens=36)  # as many tokens as 4 rows of the longest length
    assert sum(len(p) for p in packed) == 8
    assert all(padded_tokens(p) <= 36 for p in packed)
    fixed = micro_batches(b, 4)
    assert sum(padded_tokens(p) for p in packed) < sum(padded_tokens(p) for p in fixed) <= padded_tokens(b)
    for p in packed:  # no column left that every row pads
        assert p.tensors["response_mask"][:, -1].any() and p.tensors["prompt_mask"][:, 0].any()


def test_rollout_probability_gap_is_the_token_mean_of_abs_prob_differences(tokenizer):
    """training/rollout_probs_diff_mean = token mean of |exp(rollout logp) - exp(trainer logp)| over the mask,
    whatever the micro-batching: 0 for an engine that samples with the trainer's own weights."""
    from components.training.logprobs import batch_logprobs

    torch.manual_seed(0)
    model = make_model(tokenizer)
    batch = synthetic_batch(tokenizer)
    with torch.no_grad():
        logp = batch_logprobs(model.eval(), batch, 1.0, None)
    mask = batch.tensors["response_mask"].float()
    shifted = torch.where(
        torch.arange(8)[:, None] % 2 == 0, logp + 0.1, logp
    )  # every other row: e^0.1 x the prob
    expected = float(((shifted.exp() - logp.exp()).abs() * mask).sum() / mask.sum())
    for micro, rollout, want in ((8, logp, 0.0), (8, shifted, expected), (1, shifted, expected)):
        torch.manual_seed(0)
        model = make_model(tokenizer)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        s = UpdateSettings(LoopSettings(micro_batch_size=micro), loss=PolicyLossParams(agg_mode="token-mean"))
        metrics = PolicyTrainer(model, None, opt, sched, s).update(batch.union(rollout_logprobs=rollout))
        assert abs(metrics["training/rollout_probs_diff_mean"] - want) < 1e-6, (micro, metrics)


def diverging_trainer(tokenizer, lr: float) -> PolicyTrainer:
    torch.manual_seed(0)
    model = make_model(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    s = UpdateSettings(LoopSettings(micro_batch_size=4, grad_clip=1.0), loss=PolicyLossParams())
    return PolicyTrainer(model, None, opt, sched, s)


@pytest.mark.parametrize("lr", [1e6, 1e20, 1e30])
def test_an_absurd_learning_rate_stops_the_update_in_one_line_naming_the_iteration_and_key(tokenizer, lr):
    """A finite step so large that the weights it leaves give a NaN forward (or are NaN themselves): an update
    raises before its weights can reach the engine or a checkpoint, naming the iteration and the key."""
    trainer = diverging_trainer(tokenizer, lr)
    with pytest.raises(TrainingDiverged) as err:
        for iteration in range(1, 6):
            batch = synthetic_batch(tokenizer, seed=iteration)
            batch.meta["iteration"] = iteration
            trainer.update(batch)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"iteration {iteration}: the actor update diverged")
    assert f"actor.optimizer.lr (now {lr:g})" in message and "last good checkpoint stays `latest`" in message


def test_a_non_finite_loss_stops_the_update_naming_the_metric(tokenizer):
    batch = synthetic_batch(tokenizer)
    batch = batch.union(advantages=batch.tensors["advantages"] * float("nan"))
    with pytest.raises(TrainingDiverged, match=r"actor/pg_loss=nan"):
        diverging_trainer(tokenizer, 1e-3).update(batch)
