"""Rejection sampling of the behaviour importance weight, on weights chosen by hand.

Every case below has policy = proximal (ratio 1) and advantage 1, so a kept token's loss
is -w (its behaviour weight w = prox / behav) and its gradient d loss / d logp is -w, both
divided by the batch's loss-token count.
"""

import math

import pytest
import torch

from asyncrl.algorithms import make_ppo_loss_fn, ppo_loss
from asyncrl.api.types import TensorBatch
from asyncrl.config import ConfigError, load_config
from asyncrl.config.schema import ActorConfig, RejectionSamplingConfig


def run(weights, mask, rs):
    """ppo_loss with prox = 0, behav = -log w, logp = 0: (loss, stats, d loss / d logp)."""
    mask = torch.tensor(mask, dtype=torch.float32)
    logp = torch.zeros(mask.shape, requires_grad=True)
    behav = -torch.log(torch.tensor(weights, dtype=torch.float32))
    loss, stats = ppo_loss(logp, prox_logprobs=torch.zeros(mask.shape), behavior_logprobs=behav,
                           advantages=torch.ones(mask.shape), loss_mask=mask, eps_clip=0.2,
                           rejection_sampling=rs, n_tokens=int(mask.sum()))
    loss.backward()
    return loss.item(), stats, logp.grad


# ---- token level: w = [0.5, 2, 8], bounds [0.6, 4] --------------------------------------------

def test_token_mask_drops_tokens_outside_both_bounds():
    # 0.5 < 0.6 and 8 > 4 are dropped; only w = 2 counts: loss -2 / 3, gradient [0, -2/3, 0].
    rs = RejectionSamplingConfig(level="token", action="mask", upper=4.0, lower=0.6)
    loss, stats, grad = run([0.5, 2.0, 8.0], [1, 1, 1], rs)
    assert loss == pytest.approx(-2 / 3)
    torch.testing.assert_close(grad, torch.tensor([0.0, -2 / 3, 0.0]))
    assert stats["rejected_tokens"] == 2.0
    assert stats["rejected_frac"] == pytest.approx(2 / 3)
    assert stats["clamped_frac"] == 0.0
    # the weight statistics are of w before the filter: mean (0.5 + 2 + 8) / 3 = 3.5
    assert stats["imp_weight_mean"] == pytest.approx(3.5)
    assert stats["imp_weight_max"] == pytest.approx(8.0)
    assert stats["imp_weight_min"] == pytest.approx(0.5)


def test_token_clamp_keeps_every_token_with_its_weight_clipped():
    # [0.5, 2, 8] -> [0.6, 2, 4]: loss -(0.6 + 2 + 4) / 3 = -2.2, gradient -[0.6, 2, 4] / 3.
    rs = RejectionSamplingConfig(level="token", action="clamp", upper=4.0, lower=0.6)
    loss, stats, grad = run([0.5, 2.0, 8.0], [1, 1, 1], rs)
    assert loss == pytest.approx(-2.2)
    torch.testing.assert_close(grad, -torch.tensor([0.6, 2.0, 4.0]) / 3)
    assert stats["clamped_frac"] == pytest.approx(2 / 3)
    assert stats["rejected_tokens"] == 0.0
    assert stats["imp_weight_max"] == pytest.approx(8.0)  # before the clamp


def test_token_clamp_without_a_lower_bound_clips_only_above():
    # [0.5, 2, 8] -> [0.5, 2, 4]: loss -6.5 / 3.
    rs = RejectionSamplingConfig(action="clamp", upper=4.0)
    loss, stats, _ = run([0.5, 2.0, 8.0], [1, 1, 1], rs)
    assert loss == pytest.approx(-6.5 / 3)
    assert stats["clamped_frac"] == pytest.approx(1 / 3)


# ---- sequence level --------------------------------------------------------------------------
# Row 1: a prompt token (w = 100, off the loss mask: ignored), then w = 1 and 4: geometric mean
# sqrt(1 * 4) = 2. Row 2: w = 4 and 16: geometric mean sqrt(64) = 8. Four loss tokens.

SEQ_WEIGHTS = [[100.0, 1.0, 4.0], [1.0, 4.0, 16.0]]
SEQ_MASK = [[0, 1, 1], [0, 1, 1]]


def test_sequence_mask_drops_whole_sequences_on_their_geometric_mean():
    # upper 5: row 2 (8) goes, row 1 stays with weight 2 on both tokens: loss -(2 + 2) / 4.
    rs = RejectionSamplingConfig(level="sequence", action="mask", upper=5.0)
    loss, stats, grad = run(SEQ_WEIGHTS, SEQ_MASK, rs)
    assert loss == pytest.approx(-1.0)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, -0.5], [0.0, 0.0, 0.0]]))
    assert stats["rejected_tokens"] == 2.0 and stats["rejected_frac"] == pytest.approx(0.5)
    # per-token sequence weights 2, 2, 8, 8: mean 5
    assert stats["imp_weight_mean"] == pytest.approx(5.0)
    assert stats["imp_weight_max"] == pytest.approx(8.0)
    assert stats["imp_weight_min"] == pytest.approx(2.0)


def test_sequence_mask_differs_from_token_mask_on_the_same_weights():
    # Token level, upper 5: only the w = 16 token goes: loss -(1 + 4 + 4) / 4 = -2.25.
    loss, stats, _ = run(SEQ_WEIGHTS, SEQ_MASK, RejectionSamplingConfig(level="token", upper=5.0))
    assert loss == pytest.approx(-2.25)
    assert stats["rejected_tokens"] == 1.0


def test_sequence_mask_lower_bound_drops_the_sequence_below_it():
    # Row 1 now w = 0.25 and 1: geometric mean 0.5 < 0.6, dropped. Row 2 (8) stays inside
    # [0.6, 10] with weight 8 on both tokens: loss -(8 + 8) / 4 = -4.
    rs = RejectionSamplingConfig(level="sequence", action="mask", upper=10.0, lower=0.6)
    loss, stats, _ = run([[100.0, 0.25, 1.0], SEQ_WEIGHTS[1]], SEQ_MASK, rs)
    assert loss == pytest.approx(-4.0)
    assert stats["rejected_tokens"] == 2.0
    assert stats["imp_weight_min"] == pytest.approx(0.5)


def test_sequence_clamp_clips_each_sequence_weight():
    # upper 5: sequence weights 2, 2, 5, 5: loss -14 / 4 = -3.5, gradient -w / 4.
    rs = RejectionSamplingConfig(level="sequence", action="clamp", upper=5.0)
    loss, stats, grad = run(SEQ_WEIGHTS, SEQ_MASK, rs)
    assert loss == pytest.approx(-3.5)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, -0.5], [0.0, -1.25, -1.25]]))
    assert stats["clamped_frac"] == pytest.approx(0.5)
    assert stats["imp_weight_max"] == pytest.approx(8.0)


# ---- behav_imp_weight_cap is the token/mask shorthand -----------------------------------------

def _batch(behav, adv, prox):
    shape = (1, len(behav))
    return TensorBatch(input_ids=torch.zeros(shape, dtype=torch.long),
                       attention_mask=torch.ones(shape, dtype=torch.bool),
                       loss_mask=torch.ones(shape), behavior_logprobs=torch.tensor([behav]),
                       versions=torch.zeros(shape, dtype=torch.long), rewards=torch.zeros(1),
                       advantages=torch.tensor([adv]), prox_logprobs=torch.tensor([prox]))


def test_behav_imp_weight_cap_equals_rejection_sampling_token_mask_bit_for_bit():
    logp = [-0.4, -1.3, -0.2, -2.0]
    prox = [-0.5, -1.0, -0.1, -2.5]
    behav = [-0.7, -0.9, -3.0, -2.4]  # weights e^0.2, e^-0.1, e^2.9 (> 3), e^-0.1
    mb = _batch(behav, [1.0, -1.0, 2.0, 0.5], prox)
    shorthand = ActorConfig(path="x", behav_imp_weight_cap=3.0)
    general = ActorConfig(path="x", behav_imp_weight_cap=None,
                          rejection_sampling=RejectionSamplingConfig(upper=3.0))
    results = []
    for cfg in (shorthand, general):
        x = torch.tensor([logp], requires_grad=True)
        loss, stats = make_ppo_loss_fn(cfg)(x, mb, n_tokens=4, n_seqs=1)
        (grad,) = torch.autograd.grad(loss, x)
        results.append((loss, stats, grad))
    (loss_a, stats_a, grad_a), (loss_b, stats_b, grad_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b) and stats_a == stats_b
    assert stats_a["rejected_tokens"] == 1.0
    # by hand: ratios e^0.1, e^-0.3, e^-0.1, e^0.5; the third token is rejected.
    expected = 0.0
    for lp, p, b, a in ((-0.4, -0.5, -0.7, 1.0), (-1.3, -1.0, -0.9, -1.0),
                        (-2.0, -2.5, -2.4, 0.5)):
        r, w = math.exp(lp - p), math.exp(p - b)
        expected += max(-a * r, -a * min(max(r, 0.8), 1.2)) * w
    assert loss_a.item() == pytest.approx(expected / 4, rel=1e-6)


def test_the_default_config_filters_like_a_cap_of_5():
    default = ActorConfig(path="x")
    assert default.rejection_sampling is None
    assert default.behav_rejection == RejectionSamplingConfig(level="token", action="mask",
                                                              upper=5.0)
    assert ActorConfig(path="x", behav_imp_weight_cap=None).behav_rejection is None


# ---- config -----------------------------------------------------------------------------------

def _load(*overrides):
    return load_config(None, ["train_dataset.path=reasoning_gym:basic_arithmetic", *overrides])


def test_rejection_sampling_keys_load_from_overrides():
    cfg = _load("actor.behav_imp_weight_cap=null", "actor.rejection_sampling.level=sequence",
                "actor.rejection_sampling.action=clamp", "actor.rejection_sampling.upper=2.0",
                "actor.rejection_sampling.lower=0.5")
    assert cfg.actor.behav_rejection == RejectionSamplingConfig(level="sequence", action="clamp",
                                                                upper=2.0, lower=0.5)


@pytest.mark.parametrize("overrides, message", [
    (["actor.rejection_sampling.level=sequence"],
     r"actor.behav_imp_weight_cap=5.0 and actor.rejection_sampling both set.*"
     r"set actor.behav_imp_weight_cap=null"),
    (["actor.behav_imp_weight_cap=null", "actor.rejection_sampling.upper=1.0"],
     r"actor.rejection_sampling.upper must be > 1"),
    (["actor.behav_imp_weight_cap=null", "actor.rejection_sampling.lower=1.5"],
     r"actor.rejection_sampling.lower must be in \[0, 1\)"),
    (["actor.behav_imp_weight_cap=null", "actor.rejection_sampling.upper=2",
      "actor.use_decoupled_loss=false", "actor.recompute_logprob=false"],
     r"actor.use_decoupled_loss=false; set use_decoupled_loss=true or drop rejection_sampling"),
    (["actor.behav_imp_weight_cap=1.0"], r"actor.behav_imp_weight_cap must be > 1 or null"),
    (["actor.behav_imp_weight_cap=null", "actor.rejection_sampling.action=truncate"],
     r"actor.rejection_sampling.action"),
])
def test_contradictory_or_bad_rejection_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _load(*overrides)
