"""Advantages and the PPO loss on small tensors, with values worked out by hand."""

import math

import pytest
import torch
from batches import hand_batch as make_batch

from asyncrl.algorithms import (
    compute_advantages,
    make_ppo_loss_fn,
    normalize,
    overlong_penalty,
    ppo_loss,
)
from asyncrl.config.schema import ActorConfig, NormConfig

EPS = 1e-5


# ---- advantages ---------------------------------------------------------------------------

def test_grpo_advantages_are_group_zscores_on_loss_tokens():
    # Group 1 rewards [1, 0, 0, 1]: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + eps).
    # Group 2 rewards all 1: every advantage is 0.
    mask = [[0, 1, 1]] * 8
    batch = make_batch([1, 0, 0, 1, 1, 1, 1, 1], mask)
    cfg = ActorConfig(path="x", reward_norm=NormConfig(group_size=4))
    adv = compute_advantages(batch, cfg)
    a = 0.5 / (0.5 + EPS)
    expected_rows = torch.tensor([a, -a, -a, a, 0, 0, 0, 0])
    torch.testing.assert_close(adv, expected_rows[:, None] * batch.loss_mask)


def test_group_of_equal_rewards_has_zero_advantage():
    batch = make_batch([0.3, 0.3, 0.3], [[1, 1]] * 3)
    adv = compute_advantages(batch, ActorConfig(path="x", reward_norm=NormConfig(group_size=3)))
    assert torch.equal(adv, torch.zeros(3, 2))


def test_reward_scaling_and_bias_without_normalisation():
    # (r + bias) * scaling = (1 - 0.5) * 2 = 1 and (0 - 0.5) * 2 = -1.
    batch = make_batch([1, 0], [[0, 1], [1, 1]])
    cfg = ActorConfig(path="x", reward_scaling=2.0, reward_bias=-0.5, reward_norm=None)
    expected = torch.tensor([[0.0, 1.0], [-1.0, -1.0]])
    torch.testing.assert_close(compute_advantages(batch, cfg), expected)


def test_batch_level_adv_norm_counts_loss_tokens_only():
    # Loss tokens carry [3] and [1, 1, 1]: mean 1.5, population variance (2.25 + 3 * 0.25) / 4
    # = 0.75, so 3 -> 1.5 / sqrt(0.75) = sqrt(3) and 1 -> -0.5 / sqrt(0.75) = -1 / sqrt(3).
    batch = make_batch([3, 1], [[0, 0, 1], [1, 1, 1]])
    cfg = ActorConfig(path="x", reward_norm=None,
                      adv_norm=NormConfig(mean_level="batch", std_level="batch"))
    s = math.sqrt(0.75) + EPS
    expected = torch.tensor([[0, 0, 1.5 / s], [-0.5 / s] * 3])
    torch.testing.assert_close(compute_advantages(batch, cfg), expected)


def test_std_only_normalisation_does_not_subtract_the_mean():
    out = normalize(torch.tensor([1.0, 0.0, 0.0, 1.0]), mean_level="none", std_level="group",
                    group_size=4, eps=EPS)
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0, 0.0, 1.0]) / (0.5 + EPS))


def test_group_norm_rejects_a_batch_that_is_not_whole_groups():
    with pytest.raises(ValueError, match="whole number of groups of 4"):
        normalize(torch.zeros(6), group_size=4)


def test_group_norm_without_group_size_names_the_field():
    cfg = ActorConfig(path="x", reward_norm=NormConfig())
    with pytest.raises(ValueError, match="reward_norm.group_size"):
        compute_advantages(make_batch([1, 0], [[1], [1]]), cfg)


# ---- PPO loss -----------------------------------------------------------------------------

def loss_of(logp, *, prox, behav, adv, mask=None, eps_clip=0.2, eps_clip_higher=None, cap=None,
            c_clip=None):
    logp = torch.tensor(logp, requires_grad=True)
    mask = torch.ones_like(logp) if mask is None else torch.tensor(mask)
    loss, stats = ppo_loss(logp, prox_logprobs=torch.tensor(prox),
                           behavior_logprobs=torch.tensor(behav),
                           advantages=torch.tensor(adv), loss_mask=mask, eps_clip=eps_clip,
                           eps_clip_higher=eps_clip_higher, imp_weight_cap=cap, c_clip=c_clip,
                           n_tokens=int(mask.sum()))
    loss.backward()
    return loss.item(), stats, logp.grad


def test_policy_loss_clipped_when_ratio_above_one_plus_eps_with_positive_advantage():
    # ratio 1.5, A = 1: max(-1.5, -1.2) = -1.2 and the clipped branch has no gradient.
    loss, stats, grad = loss_of([math.log(1.5)], prox=[0.0], behav=[0.0], adv=[1.0])
    assert loss == pytest.approx(-1.2)
    assert stats["clip_frac"] == 1.0
    assert grad.tolist() == [0.0]


def test_policy_loss_unclipped_inside_the_trust_region():
    # ratio 1.1, A = 1: loss -1.1, d(-A * ratio)/dlogp = -ratio = -1.1.
    loss, stats, grad = loss_of([math.log(1.1)], prox=[0.0], behav=[0.0], adv=[1.0])
    assert loss == pytest.approx(-1.1)
    assert stats["clip_frac"] == 0.0
    torch.testing.assert_close(grad, torch.tensor([-1.1]))


def test_negative_advantage_is_not_clipped_above_the_trust_region():
    # ratio 1.5, A = -1: max(1.5, 1.2) = 1.5, the unclipped branch keeps its gradient.
    loss, _, grad = loss_of([math.log(1.5)], prox=[0.0], behav=[0.0], adv=[-1.0])
    assert loss == pytest.approx(1.5)
    torch.testing.assert_close(grad, torch.tensor([1.5]))


def test_eps_clip_higher_widens_only_the_upper_bound():
    # ratio 1.25 lies inside [0.8, 1.28]: unclipped.
    loss, _, _ = loss_of([math.log(1.25)], prox=[0.0], behav=[0.0], adv=[1.0], eps_clip_higher=0.28)
    assert loss == pytest.approx(-1.25)


def test_behaviour_importance_weight_scales_the_token_loss():
    # prox/behav = 1 / 0.5 = 2; ratio 1, A = 1: loss -1 * 2.
    loss, stats, _ = loss_of([0.0], prox=[0.0], behav=[math.log(0.5)], adv=[1.0])
    assert loss == pytest.approx(-2.0)
    assert stats["imp_weight_mean"] == pytest.approx(2.0)


def test_tokens_above_the_weight_cap_are_masked_out_and_counted():
    # Weights 2 and 10 with cap 5: only the first counts, divided by both loss tokens.
    loss, stats, grad = loss_of([0.0, 0.0], prox=[0.0, 0.0], behav=[math.log(0.5), math.log(0.1)],
                                adv=[1.0, 1.0], cap=5.0)
    assert loss == pytest.approx(-2.0 / 2)
    assert stats["rejected_tokens"] == 1.0
    assert stats["rejected_frac"] == pytest.approx(0.5)
    assert stats["imp_weight_max"] == pytest.approx(10.0)
    assert grad[1].item() == 0.0


def test_loss_ignores_tokens_off_the_mask_but_divides_by_the_batch_token_count():
    logp = torch.tensor([0.0, 5.0], requires_grad=True)
    loss, _ = ppo_loss(logp, prox_logprobs=torch.zeros(2), behavior_logprobs=torch.zeros(2),
                       advantages=torch.ones(2), loss_mask=torch.tensor([1.0, 0.0]), eps_clip=0.2,
                       n_tokens=4)
    assert loss.item() == pytest.approx(-1.0 / 4)


def test_clipped_tokens_get_zero_gradient_and_the_rest_do_not():
    ratios = [0.5, 0.9, 1.1, 1.5]  # A > 0: only 1.5 is clipped (0.5 is below, unclipped min)
    adv = [1.0, 1.0, 1.0, 1.0]
    logp = [math.log(r) for r in ratios]
    _, stats, grad = loss_of(logp, prox=[0.0] * 4, behav=[0.0] * 4, adv=adv)
    torch.testing.assert_close(grad, torch.tensor([-0.5, -0.9, -1.1, 0.0]) / 4)
    assert stats["clip_frac"] == pytest.approx(0.25)
    assert stats["ratio_mean"] == pytest.approx(sum(ratios) / 4)


def test_plain_ppo_uses_behaviour_logprobs_and_ignores_prox():
    logp = [math.log(1.5), math.log(0.9), 0.3]
    behav = [0.0, 0.0, 0.1]
    adv = [1.0, -2.0, 1.0]
    mb = make_batch([0, 0, 0], [[1, 1, 1]], behavior_logprobs=[behav], advantages=[adv],
                    prox_logprobs=[[9.0, 9.0, 9.0]])  # nonsense: must not be used
    cfg = ActorConfig(path="x", use_decoupled_loss=False)
    loss, stats = make_ppo_loss_fn(cfg)(torch.tensor([logp]), mb, n_tokens=3, n_seqs=1)
    expected = 0.0
    for lp, b, a in zip(logp, behav, adv):
        r = math.exp(lp - b)
        expected += max(-a * r, -a * min(max(r, 0.8), 1.2))
    assert expected / 3 == pytest.approx(-0.2)  # -1.2 (clipped) + 1.8 - 1.2 (clipped)
    assert loss.item() == pytest.approx(expected / 3)
    assert stats["imp_weight_mean"] == pytest.approx(1.0)


def test_decoupled_loss_needs_prox_logprobs():
    mb = make_batch([0], [[1]], advantages=[[1.0]])
    with pytest.raises(ValueError, match="prox_logprobs"):
        make_ppo_loss_fn(ActorConfig(path="x"))(torch.zeros(1, 1), mb, n_tokens=1, n_seqs=1)


def test_prox_from_the_current_forward_equals_a_separate_recomputation():
    # One optimiser step per batch: prox is the pre-update policy, i.e. this forward.
    logp = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    behav = [[-0.7, -0.9, -3.0]]  # weights prox/behav: e^0.2, e^-0.1, e^1.0
    adv = [[1.0, -1.0, 2.0]]
    cfg = ActorConfig(path="x", behav_imp_weight_cap=2.0)  # caps the third token (e^1 > 2)
    fused = make_batch([0], [[1, 1, 1]], behavior_logprobs=behav, advantages=adv)
    loss_fused, stats_fused = make_ppo_loss_fn(cfg, prox_is_current=True)(
        logp, fused, n_tokens=3, n_seqs=1)
    (grad_fused,) = torch.autograd.grad(loss_fused, logp)
    separate = make_batch([0], [[1, 1, 1]], behavior_logprobs=behav, advantages=adv,
                          prox_logprobs=logp.detach().tolist())
    loss_sep, stats_sep = make_ppo_loss_fn(cfg)(logp, separate, n_tokens=3, n_seqs=1)
    (grad_sep,) = torch.autograd.grad(loss_sep, logp)
    # ratio 1 everywhere: loss = -(1 * e^0.2 + (-1) * e^-0.1) / 3, third token capped
    expected = -(math.exp(0.2) - math.exp(-0.1)) / 3
    assert loss_fused.item() == pytest.approx(expected, abs=1e-6)
    assert loss_sep.item() == pytest.approx(expected, abs=1e-6)
    torch.testing.assert_close(grad_fused, grad_sep)
    assert stats_fused == stats_sep and stats_fused["rejected_tokens"] == 1.0


# ---- reward shaping: clip and DAPO's overlong penalty ----------------------------------------

def test_reward_clip_bounds_the_shaped_reward():
    # (r + 0) * 2 = [6, -6, 1]; clipped to [-5, 5] -> [5, -5, 1].
    batch = make_batch([3, -3, 0.5], [[1], [1], [1]])
    cfg = ActorConfig(path="x", reward_scaling=2.0, reward_clip=5.0, reward_norm=None)
    torch.testing.assert_close(compute_advantages(batch, cfg), torch.tensor([[5.0], [-5.0], [1.0]]))


def test_overlong_penalty_below_at_and_inside_the_window():
    # max_len 10, window 4: free up to 10 - 4 = 6 tokens.
    # L = 5, 6 -> 0; L = 7 -> -(7 - 6) / 4 * 0.5 = -0.125; L = 10 -> -(10 - 6) / 4 * 0.5 = -0.5.
    out = overlong_penalty(torch.tensor([5, 6, 7, 10]), max_len=10, overlong_tokens=4, factor=0.5)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.125, -0.5]))


def test_overlong_penalty_is_added_to_the_raw_reward_by_loss_token_count():
    # max_new_tokens 4, window 2: free up to 2 tokens. Row 0 has 2 loss tokens -> 1 + 0;
    # row 1 has 4 -> 1 - (4 - 2) / 2 * 1 = 0; row 2 has 3 -> 0 - (3 - 2) / 2 = -0.5.
    batch = make_batch([1, 1, 0], [[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    cfg = ActorConfig(path="x", reward_norm=None, overlong_reward_penalty=True,
                      overlong_tokens=2, max_new_tokens=4)
    expected = torch.tensor([[0, 0, 1.0, 1.0], [0.0] * 4, [0, -0.5, -0.5, -0.5]])
    torch.testing.assert_close(compute_advantages(batch, cfg), expected)


def test_overlong_penalty_without_a_budget_names_the_key():
    cfg = ActorConfig(path="x", reward_norm=None, overlong_reward_penalty=True, overlong_tokens=2)
    with pytest.raises(ValueError, match="actor.max_new_tokens is unset"):
        compute_advantages(make_batch([1], [[1]]), cfg)


# ---- normalisation: leave-one-out mean (RLOO), unbiased std -----------------------------------

def test_leave_one_out_mean_excludes_each_sample():
    # [1, 0, 0, 1], sum 2: baselines (2 - 1) / 3 = 1/3 and (2 - 0) / 3 = 2/3,
    # so x - baseline = [2/3, -2/3, -2/3, 2/3].
    out = normalize(torch.tensor([1.0, 0.0, 0.0, 1.0]), mean_level="group", std_level="none",
                    group_size=4, mean_leave1out=True)
    torch.testing.assert_close(out, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_rloo_advantage_is_n_over_n_minus_1_times_the_centred_reward():
    # Groups of 2: [3, 1] and [4, 0]. The leave-one-out baseline is the other sample:
    # 3 - 1 = 2, 1 - 3 = -2, 4 - 0 = 4, 0 - 4 = -4.
    batch = make_batch([3, 1, 4, 0], [[1, 1]] * 4)
    cfg = ActorConfig(path="x", reward_norm=NormConfig(group_size=2, std_level="none",
                                                       mean_leave1out=True))
    expected = torch.tensor([2.0, -2.0, 4.0, -4.0])[:, None].expand(4, 2)
    torch.testing.assert_close(compute_advantages(batch, cfg), expected)


def test_unbiased_std_divides_by_n_minus_1():
    # [1, 0, 0, 1]: mean 0.5, squared deviations sum 4 * 0.25 = 1; unbiased variance 1 / 3,
    # std sqrt(1/3), so +-0.5 / sqrt(1/3) = +-sqrt(3) / 2 (population std would give +-1).
    out = normalize(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4, eps=0.0, std_unbiased=True)
    h = math.sqrt(3) / 2
    torch.testing.assert_close(out, torch.tensor([h, -h, -h, h]))


def test_leave_one_out_on_a_group_of_one_is_an_error():
    with pytest.raises(ValueError, match="mean_leave1out needs at least 2 samples per group"):
        normalize(torch.tensor([1.0, 0.0]), mean_level="group", std_level="none",
                  group_size=1, mean_leave1out=True)


def test_norm_config_rejects_leave_one_out_with_group_size_1():
    with pytest.raises(ValueError, match=r"actor.reward_norm.mean_leave1out=true needs groups"):
        ActorConfig(path="x", reward_norm=NormConfig(group_size=1, mean_leave1out=True))


# ---- dual clip, aggregation modes, GSPO, stats ------------------------------------------------

def test_dual_clip_caps_only_negative_advantages_beyond_c_clip():
    # c_clip 3, eps 0.2. Token 1: A = -1, ratio 5 -> max(5, 1.2) = 5, capped at -A * 3 = 3.
    # Token 2: A = -1, ratio 2 -> max(2, 1.2) = 2 < 3, untouched.
    # Token 3: A = +1, ratio 5 -> max(-5, -1.2) = -1.2; -A * 3 = -3 is lower but A > 0: untouched.
    # Loss (3 + 2 - 1.2) / 3 = 3.8 / 3 (without the dual clip: (5 + 2 - 1.2) / 3 = 5.8 / 3).
    # Only token 2 has a gradient: d(-A r)/dlogp = r = 2, / 3 tokens.
    logp = [math.log(5.0), math.log(2.0), math.log(5.0)]
    kwargs = dict(prox=[0.0] * 3, behav=[0.0] * 3, adv=[-1.0, -1.0, 1.0])
    loss, stats, grad = loss_of(logp, c_clip=3.0, **kwargs)
    assert loss == pytest.approx(3.8 / 3)
    torch.testing.assert_close(grad, torch.tensor([0.0, 2.0 / 3, 0.0]))
    assert stats["dual_clip_frac"] == pytest.approx(1 / 3)
    assert stats["clip_frac"] == pytest.approx(1 / 3)  # token 3 only
    assert loss_of(logp, **kwargs)[0] == pytest.approx(5.8 / 3)


def agg_loss(mode, rows=(0, 1), norm_len=None):
    # Ratio 1 and weight 1, so each token's loss is -A. Loss tokens: sequence 0 has A = 1, 2, 3
    # (one padding token), sequence 1 has A = 6 (three padding tokens).
    adv = torch.tensor([[1.0, 2.0, 3.0, 9.0], [6.0, 9.0, 9.0, 9.0]])[list(rows)]
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])[list(rows)]
    loss, _ = ppo_loss(torch.zeros_like(adv), prox_logprobs=torch.zeros_like(adv),
                       behavior_logprobs=torch.zeros_like(adv), advantages=adv, loss_mask=mask,
                       eps_clip=0.2, loss_agg_mode=mode, n_tokens=4, n_seqs=2,
                       norm_len=norm_len)
    return loss.item()


def test_loss_aggregation_modes_on_sequences_of_different_lengths():
    # token-mean: -(1 + 2 + 3 + 6) / 4 = -3 (the long sequence weighs 3/4).
    # seq-mean-token-mean: mean(-(1 + 2 + 3) / 3, -6 / 1) = mean(-2, -6) = -4.
    # seq-mean-token-sum: mean(-(1 + 2 + 3), -6) = mean(-6, -6) = -6.
    assert agg_loss("token-mean") == pytest.approx(-3.0)
    assert agg_loss("seq-mean-token-mean") == pytest.approx(-4.0)
    assert agg_loss("seq-mean-token-sum") == pytest.approx(-6.0)
    # seq-mean-token-sum-norm (Dr.GRPO), budget 8: mean(-6 / 8, -6 / 8) = -0.75.
    assert agg_loss("seq-mean-token-sum-norm", norm_len=8) == pytest.approx(-0.75)


def test_drgrpo_aggregation_needs_the_generation_budget():
    with pytest.raises(ValueError, match="needs norm_len"):
        agg_loss("seq-mean-token-sum-norm")


def test_sequence_aggregation_adds_up_over_micro_batches():
    # Each row alone, divided by the batch's 2 sequences: -2 / 2 + -6 / 2 = -4.
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        parts = agg_loss(mode, rows=[0], norm_len=8) + agg_loss(mode, rows=[1], norm_len=8)
        assert parts == pytest.approx(agg_loss(mode, norm_len=8))


def test_unknown_aggregation_mode_names_the_key():
    with pytest.raises(ValueError, match="actor.loss_agg_mode must be one of"):
        agg_loss("seq-sum")


def gspo_loss(log_ratios, level):
    logp = torch.tensor([log_ratios + [7.0]], requires_grad=True)  # the last token is padding
    loss, stats = ppo_loss(logp, prox_logprobs=torch.zeros(1, 3), behavior_logprobs=torch.zeros(1, 3),
                           advantages=torch.ones(1, 3), loss_mask=torch.tensor([[1.0, 1.0, 0.0]]),
                           eps_clip=0.2, importance_sampling_level=level, n_tokens=2, n_seqs=1)
    loss.backward()
    return loss.item(), stats, logp.grad


def test_gspo_ratio_is_one_value_per_sequence():
    # Log-ratios 0.1 and 0.15 -> mean 0.125, ratio r = e^0.125 ~ 1.133 < 1.2 on both tokens:
    # loss (-r - r) / 2 = -r. Each token's term depends on both log-probs through the mean
    # (d mean / d logp_j = 1/2), so d loss / d logp_j = -r / 2 for both: equal.
    loss, stats, grad = gspo_loss([0.1, 0.15], "sequence")
    r = math.exp(0.125)
    assert loss == pytest.approx(-r)
    assert stats["ratio_mean"] == pytest.approx(r)
    torch.testing.assert_close(grad, torch.tensor([[-r / 2, -r / 2, 0.0]]))
    # Per token the gradients differ: -e^0.1 / 2 and -e^0.15 / 2.
    _, _, grad = gspo_loss([0.1, 0.15], "token")
    torch.testing.assert_close(grad, torch.tensor([[-math.exp(0.1) / 2, -math.exp(0.15) / 2, 0.0]]))


def test_gspo_clips_the_whole_sequence_on_its_ratio():
    # Log-ratios 0.5 and 0.1: mean 0.3, ratio e^0.3 ~ 1.35 > 1.2, so both tokens are clipped
    # (loss -1.2, no gradient) although e^0.1 ~ 1.105 alone is inside the trust region.
    loss, stats, grad = gspo_loss([0.5, 0.1], "sequence")
    assert loss == pytest.approx(-1.2)
    assert stats["clip_frac"] == 1.0
    assert torch.equal(grad, torch.zeros(1, 3))
    # Per token only e^0.5 ~ 1.65 is clipped: loss (-1.2 - e^0.1) / 2.
    loss, stats, _ = gspo_loss([0.5, 0.1], "token")
    assert loss == pytest.approx((-1.2 - math.exp(0.1)) / 2)
    assert stats["clip_frac"] == 0.5


def test_clip_fraction_counts_loss_tokens_only_over_the_batch_token_count():
    # Ratios 1.5 with A = 1 are all clipped, but the third token is off the mask and the
    # batch has 4 loss tokens (the others in another micro-batch): 2 / 4.
    logp = torch.full((3,), math.log(1.5))
    _, stats = ppo_loss(logp, prox_logprobs=torch.zeros(3), behavior_logprobs=torch.zeros(3),
                        advantages=torch.ones(3), loss_mask=torch.tensor([1.0, 1.0, 0.0]),
                        eps_clip=0.2, n_tokens=4)
    assert stats["clip_frac"] == pytest.approx(0.5)


def test_approx_kl_is_the_k3_estimator_between_policy_and_proximal():
    # d = prox - logp = ln 2 on token 1, 0 on token 2: k3 = e^d - 1 - d = 1 - ln 2, and 0.
    # Mean over 2 loss tokens: (1 - ln 2) / 2. behav = prox: weight 1, behav_kl 0.
    prox = [math.log(2.0), 0.0]
    _, stats, _ = loss_of([0.0, 0.0], prox=prox, behav=prox, adv=[1.0, 1.0])
    assert stats["approx_kl"] == pytest.approx((1 - math.log(2)) / 2)
    assert stats["behav_kl"] == 0.0
    assert stats["imp_weight_mean"] == 1.0


def test_loss_fn_reads_the_algorithm_keys_from_the_config():
    # Plain PPO, ratio 1: token losses -A = -1, -2, -3 (sequence 0), -6 (sequence 1);
    # seq-mean-token-sum: (-6 - 6) / 2 = -6.
    adv = [[1.0, 2.0, 3.0], [6.0, 0.0, 0.0]]
    mb = make_batch([0, 0], [[1, 1, 1], [1, 0, 0]], advantages=adv)
    cfg = ActorConfig(path="x", use_decoupled_loss=False, loss_agg_mode="seq-mean-token-sum",
                      c_clip=3.0, importance_sampling_level="sequence")
    loss, stats = make_ppo_loss_fn(cfg)(torch.zeros(2, 3), mb, n_tokens=4, n_seqs=2)
    assert loss.item() == pytest.approx(-6.0)
    assert stats["dual_clip_frac"] == 0.0
