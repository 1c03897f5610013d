"""DAPO's overlong penalty and dynamic-sampling filter, the KL penalty in the reward and its controller."""

import math

import torch

from components.algorithms.shaping import KLController, informative_groups, kl_in_reward, overlong_penalty


def test_overlong_penalty_hand_computed():
    # max 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at 10 (factor 1), capped at -factor
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    torch.testing.assert_close(
        overlong_penalty(lengths, 10, 4, 1.0), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    )
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 0.5)[3], torch.tensor(-0.25))
    assert (overlong_penalty(lengths, 10, 0, 1.0) == 0).all()  # buffer 0: off


def test_informative_groups_drops_all_equal_groups():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    ids = torch.tensor([3, 3, 5, 5, 9, 9, 11])  # group 11 has one member: nothing to compare
    assert informative_groups(scores, ids).tolist() == [False, False, True, True, False, False, False]


def test_informative_groups_loop_equals_vectorized():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 2, (40,), generator=g).float()
    ids = torch.randint(0, 10, (40,), generator=g)
    expected = [len({float(scores[j]) for j in range(40) if ids[j] == ids[i]}) > 1 for i in range(40)]
    assert informative_groups(scores, ids).tolist() == expected


def test_kl_in_reward_hand_computed():
    # k1: logp - ref = (0.5, 0.1), coef 0.2 -> rewards (0 - 0.1, 1 - 0.02); KL per sequence = mean 0.3
    r = torch.tensor([[0.0, 1.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0, -5.0]])
    ref = torch.tensor([[-1.5, -1.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out, kl = kl_in_reward(r, logp, ref, mask, 0.2, "k1")
    torch.testing.assert_close(out, torch.tensor([[-0.1, 0.98, 0.0]]))
    assert math.isclose(kl, 0.3, rel_tol=1e-6)


def test_adaptive_controller_hand_computed():
    # KL 0.2 against target 0.1: error clipped to +0.2; n 100 of horizon 1000 -> coef x (1 + 0.02)
    ctrl = KLController(0.1, "adaptive", target=0.1, horizon=1000)
    assert math.isclose(ctrl.update(0.2, 100), 0.102, rel_tol=1e-9)
    # KL 0.09: error -0.1 -> x (1 - 0.01)
    assert math.isclose(ctrl.update(0.09, 100), 0.102 * 0.99, rel_tol=1e-9)
    fixed = KLController(0.1, "fixed")
    assert fixed.update(5.0, 100) == 0.1
    state = ctrl.state_dict()
    other = KLController(0.0, "adaptive")
    other.load_state_dict(state)
    assert other.value == ctrl.value
