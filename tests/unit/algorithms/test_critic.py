"""PPO with a critic: GAE, the clipped value loss, value stats and config, numbers by hand."""

import pytest
import torch
from batches import hand_batch as make_batch

from asyncrl.algorithms import (
    compute_advantages_and_returns,
    gae,
    make_value_loss_fn,
    value_loss,
    value_stats,
)
from asyncrl.algorithms.advantages import last_token_rewards
from asyncrl.config import ConfigError, load_config
from asyncrl.config.schema import ActorConfig, CriticConfig, NormConfig

# ---- GAE ----------------------------------------------------------------------------------

# A 4-step trajectory: rewards [0, 0, 0, 1], values [0.5, 0.4, 0.6, 0.8], gamma 0.9,
# lambda 0.8 (gamma * lambda = 0.72). delta_t = r_t + 0.9 * V_{t+1} - V_t, V_4 = 0:
#   delta_3 = 1 + 0          - 0.8 =  0.2
#   delta_2 = 0 + 0.9 * 0.8  - 0.6 =  0.12
#   delta_1 = 0 + 0.9 * 0.6  - 0.4 =  0.14
#   delta_0 = 0 + 0.9 * 0.4  - 0.5 = -0.14
# A_t = delta_t + 0.72 * A_{t+1}:
#   A_3 = 0.2
#   A_2 = 0.12 + 0.72 * 0.2     = 0.264
#   A_1 = 0.14 + 0.72 * 0.264   = 0.33008
#   A_0 = -0.14 + 0.72 * 0.33008 = 0.0976576
# Returns R_t = A_t + V_t = [0.5976576, 0.73008, 0.864, 1.0].
VALUES_4 = [0.5, 0.4, 0.6, 0.8]
ADV_4 = [0.0976576, 0.33008, 0.264, 0.2]
RET_4 = [0.5976576, 0.73008, 0.864, 1.0]


def test_gae_on_a_four_step_trajectory_matches_the_hand_recursion():
    adv, ret = gae(torch.tensor([[0.0, 0, 0, 1]]), torch.tensor([VALUES_4]),
                   torch.ones(1, 4), discount=0.9, gae_lambda=0.8)
    torch.testing.assert_close(adv, torch.tensor([ADV_4]))
    torch.testing.assert_close(ret, torch.tensor([RET_4]))


def test_gae_skips_prompt_padding_and_gaps_and_ignores_their_values():
    # Row 0: prompt of 2, then the 4-step trajectory above. Row 1: prompt of 1, loss tokens
    # at 1, 2 and (after a tool-output token at 3) 4, then padding. Its steps are 3:
    # values [0.2, 0.4, 0.5], reward 1 on the last. delta = [0 + 0.9*0.4 - 0.2,
    # 0 + 0.9*0.5 - 0.4, 1 - 0.5] = [0.16, 0.05, 0.5]; A_2 = 0.5, A_1 = 0.05 + 0.72*0.5 =
    # 0.41, A_0 = 0.16 + 0.72*0.41 = 0.4552. Off-mask values are 9 (must not be read).
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 1, 0]], dtype=torch.float32)
    values = torch.tensor([[9, 9, *VALUES_4], [9, 0.2, 0.4, 9, 0.5, 9]])
    rewards = last_token_rewards(torch.tensor([1.0, 1.0]), mask)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 1, 0]]))
    adv, ret = gae(rewards, values, mask, discount=0.9, gae_lambda=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0, 0, *ADV_4], [0, 0.4552, 0.41, 0, 0.5, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[0, 0, *RET_4], [0, 0.6552, 0.81, 0, 1.0, 0]]))


def test_gae_with_zero_values_and_gamma_lambda_one_is_the_broadcast_reward_exactly():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    rewards = torch.tensor([0.7311, -1.25, 3.0])
    adv, _ = gae(last_token_rewards(rewards, mask), torch.zeros(3, 4), mask,
                 discount=1.0, gae_lambda=1.0)
    assert torch.equal(adv, rewards[:, None] * mask)  # bit for bit, not just close


def test_without_a_critic_a_discount_below_one_discounts_the_reward_to_each_token():
    # V = 0, lambda 1: A_t = gamma^(steps after t) * r -> 0.5^2, 0.5^1, 0.5^0 for r = 1.
    cfg = ActorConfig(path="x", reward_norm=None, discount=0.5)
    adv, returns = compute_advantages_and_returns(make_batch([1.0], [[0, 1, 1, 1]]), cfg)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.25, 0.5, 1.0]]))
    assert returns is None  # nothing to train a critic on


def test_critic_advantages_use_the_normalised_reward_and_returns_skip_adv_norm():
    # Group [2, 0]: reward_norm (mean 1, std 1) gives [1, -1] / (1 + eps) ~ [1, -1].
    # Each row: 2 loss tokens, values [0.5, 0.5], gamma = lambda = 1: A = [r - 0.5, r - 0.5]
    # -> row 0 [0.5, 0.5], row 1 [-1.5, -1.5]; returns A + V = [1, 1] and [-1, -1].
    r = 1 / (1 + 1e-5)
    batch = make_batch([2.0, 0.0], [[0, 1, 1], [0, 1, 1]], values=[[7, 0.5, 0.5]] * 2)
    cfg = ActorConfig(path="x", reward_norm=NormConfig(group_size=2))
    adv, ret = compute_advantages_and_returns(batch, cfg)
    torch.testing.assert_close(adv, torch.tensor([[0, r - 0.5, r - 0.5], [0, -r - 0.5, -r - 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[0, r, r], [0, -r, -r]]))
    # Batch adv_norm over the 4 loss tokens: mean -0.5, std 1 -> [1, 1, -1, -1] / (1 + eps);
    # the critic's targets stay the unnormalised returns.
    cfg.adv_norm = NormConfig(mean_level="batch", std_level="batch")
    adv_n, ret_n = compute_advantages_and_returns(batch, cfg)
    a = 1 / (1 + 1e-5)
    torch.testing.assert_close(adv_n, torch.tensor([[0, a, a], [0, -a, -a]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(ret_n, ret)


# ---- value loss ---------------------------------------------------------------------------

# V = [1, 0, 2], V_old = 0.5, R = [1.5, 1, 0], eps 0.2; a 4th token off the mask.
#   token 0: (V - R)^2 = 0.25; clipped 0.5 + 0.2 = 0.7, (0.7 - 1.5)^2 = 0.64 -> 0.64 (clipped)
#   token 1: (V - R)^2 = 1;    clipped 0.5 - 0.2 = 0.3, (0.3 - 1)^2 = 0.49   -> 1
#   token 2: (V - R)^2 = 4;    clipped 0.7, (0.7 - 0)^2 = 0.49                -> 4
# loss = 0.5 * (0.64 + 1 + 4) / 3 = 0.94; without clipping 0.5 * (0.25 + 1 + 4) / 3 = 0.875.
def _value_case(eps_clip):
    values = torch.tensor([1.0, 0.0, 2.0, 5.0], requires_grad=True)
    loss, stats = value_loss(values, old_values=torch.full((4,), 0.5),
                             returns=torch.tensor([1.5, 1.0, 0.0, -5.0]),
                             loss_mask=torch.tensor([1.0, 1, 1, 0]), eps_clip=eps_clip,
                             n_tokens=3)
    loss.backward()
    return loss, stats, values.grad


def test_value_loss_with_clipping_takes_the_worse_error_and_holds_back_the_clipped_token():
    loss, stats, grad = _value_case(0.2)
    assert float(loss.detach()) == pytest.approx(0.94)
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    # Token 0's loss is the clipped branch, constant in V: no gradient. The others:
    # d/dV 0.5 * (V - R)^2 / 3 = (V - R) / 3 = -1/3 and 2/3. Off the mask: 0.
    torch.testing.assert_close(grad, torch.tensor([0.0, -1 / 3, 2 / 3, 0.0]))


def test_value_loss_without_clipping_is_half_the_mean_squared_error():
    loss, stats, grad = _value_case(None)
    assert float(loss.detach()) == pytest.approx(0.875)
    assert stats["clip_frac"] == 0.0
    torch.testing.assert_close(grad, torch.tensor([-0.5 / 3, -1 / 3, 2 / 3, 0.0]))


def test_value_loss_fn_needs_values_and_returns():
    fn = make_value_loss_fn(CriticConfig(path="x"))
    with pytest.raises(ValueError, match="batch.values / batch.returns is None"):
        fn(torch.zeros(1, 2), make_batch([0.0], [[1, 1]]), n_tokens=2, n_seqs=1)


def test_value_stats_explained_variance_by_hand():
    # Loss tokens: V = [1, 2, 3], R = [1, 2, 4]. Var(R) = (16 + 1 + 25) / 9 / 3 = 14/9;
    # R - V = [0, 0, 1]: Var = (1/9 + 1/9 + 4/9) / 3 = 2/9 -> 1 - (2/9) / (14/9) = 6/7.
    batch = make_batch([0.0], [[0, 1, 1, 1]], values=[[9, 1, 2, 3]], returns=[[9, 1, 2, 4]])
    stats = value_stats(batch)
    assert stats == pytest.approx({"values_mean": 2.0, "returns_mean": 7 / 3,
                                   "explained_var": 6 / 7})


# ---- config -------------------------------------------------------------------------------

BASE = ["train_dataset.path=x.jsonl", "actor.path=/models/m"]


def test_no_critic_by_default_and_an_empty_section_takes_the_actors_model_and_minibatches():
    assert load_config(None, BASE).critic is None
    cfg = load_config(None, [*BASE, "critic={}", "actor.ppo_n_minibatches=2"])
    assert cfg.critic.path == "/models/m" and cfg.critic.ppo_n_minibatches == 2
    assert cfg.critic.eps_clip == 0.5  # AReaL's default value clip
    assert load_config(None, [*BASE, "critic.ppo_n_minibatches=3"]).critic.ppo_n_minibatches == 3


@pytest.mark.parametrize("override, message", [
    ("critic.eps_clip=0", "critic.eps_clip must be > 0 or null"),
    ("critic.ppo_n_minibatches=0", "critic.ppo_n_minibatches must be >= 1"),
    ("actor.discount=1.5", r"actor.discount must be in \[0, 1\]"),
    ("actor.gae_lambda=-0.1", r"actor.gae_lambda must be in \[0, 1\]"),
    ("critic.eps_clipp=0.2", "did you mean 'critic.eps_clip'"),
])
def test_bad_critic_and_gae_keys_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*BASE, override])


def test_value_clipping_can_be_turned_off():
    assert load_config(None, [*BASE, "critic.eps_clip=null"]).critic.eps_clip is None
