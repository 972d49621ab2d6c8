"""KL to a reference model: estimators, the in-reward penalty, the loss term, numbers by hand."""

import math

import pytest
import torch
from batches import hand_batch as make_batch

from asyncrl.algorithms import (
    compute_advantages,
    kl_estimate,
    kl_loss,
    make_ppo_loss_fn,
)
from asyncrl.api.types import TensorBatch
from asyncrl.config import load_config
from asyncrl.config.schema import ActorConfig, NormConfig
from asyncrl.trainer.frozen import make_ref_engine

EPS = 1e-5
LN2 = math.log(2)


@pytest.mark.parametrize("estimator, expected", [
    ("k1", [0.0, LN2, -LN2]),  # d itself
    ("k2", [0.0, LN2**2 / 2, LN2**2 / 2]),  # 0.6931^2 / 2 = 0.2402 both ways
    # exp(-d) - 1 + d: exp(-ln 2) = 0.5 -> 0.5 - 1 + 0.6931 = 0.1931;
    # exp(ln 2) = 2 -> 2 - 1 - 0.6931 = 0.3069
    ("k3", [0.0, 0.5 - 1 + LN2, 2 - 1 - LN2]),
])
def test_kl_estimators_on_hand_worked_log_ratios(estimator, expected):
    logp = torch.tensor([0.0, LN2, -LN2])  # ref log-probs 0: d = logp
    out = kl_estimate(logp, torch.zeros(3), estimator)
    torch.testing.assert_close(out, torch.tensor(expected))


def test_unknown_estimator_names_the_key():
    with pytest.raises(ValueError, match="actor.kl_estimator"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


def _grpo_batch() -> TensorBatch:
    # Two groups of two rows, two loss tokens each. k1 per token (behaviour - ref):
    # row 0: [0.5, 0.5] (sum 1), row 1: 0, row 2: [1, 1] (sum 2), row 3: 0.
    return make_batch([1, 0, 1, 1], [[1, 1]] * 4,
                      behavior_logprobs=[[-0.5, -0.5], [-1, -1], [-1, -1], [-2, -2]],
                      ref_logprobs=[[-1, -1], [-1, -1], [-2, -2], [-2, -2]])


def test_in_reward_kl_is_a_per_token_reward_after_normalisation_counted_from_each_token_on():
    # Rewards [1, 0 | 1, 1] normalised per group: [a, -a | 0, 0], a = 0.5 / (0.5 + eps).
    # Token rewards (kl_ctl 0.5): -0.5 * kl_t on every loss token, the score on the last one.
    # Advantage = reward-to-go (V = 0, gamma = lambda = 1):
    # row 0: r = [-0.25, a - 0.25] -> [a - 0.5, a - 0.25]; row 1: r = [0, -a] -> [-a, -a];
    # row 2: r = [-0.5, -0.5] -> [-1, -0.5]; row 3: [0, 0].
    cfg = ActorConfig(path="x", kl_ctl=0.5, reward_norm=NormConfig(group_size=2))
    adv = compute_advantages(_grpo_batch(), cfg)
    a = 0.5 / (0.5 + EPS)
    torch.testing.assert_close(adv, torch.tensor([[a - 0.5, a - 0.25], [-a, -a], [-1.0, -0.5],
                                                  [0.0, 0.0]]))


def test_reinforce_plus_plus_returns_count_only_the_kl_still_to_come():
    # REINFORCE++ (no reward norm, gamma 1): A_t = r - kl_ctl * sum_{s >= t} kl_s.
    # One row, reward 2, k1 per token [0.5, 1, 2], kl_ctl 0.1:
    # A = [2 - 0.35, 2 - 0.3, 2 - 0.2] = [1.65, 1.7, 1.8].
    batch = make_batch([2.0], [[1, 1, 1]], behavior_logprobs=[[-0.5, -1.0, -1.0]],
                       ref_logprobs=[[-1.0, -2.0, -3.0]])
    cfg = ActorConfig(path="x", kl_ctl=0.1, reward_norm=None)
    torch.testing.assert_close(compute_advantages(batch, cfg), torch.tensor([[1.65, 1.7, 1.8]]))


def test_in_reward_kl_prefers_the_recomputed_proximal_logprobs():
    # prox = ref everywhere: no KL, rewards [1, 0 | 1, 1] -> [+1, -1 | 0, 0].
    batch = _grpo_batch()
    batch.prox_logprobs = batch.ref_logprobs.clone()
    cfg = ActorConfig(path="x", kl_ctl=0.5, reward_norm=NormConfig(group_size=2))
    a = 0.5 / (0.5 + EPS)
    torch.testing.assert_close(compute_advantages(batch, cfg)[:, 0], torch.tensor([a, -a, 0, 0]))


def test_kl_as_a_loss_leaves_the_advantages_alone():
    on = ActorConfig(path="x", kl_ctl=0.5, use_kl_loss=True, reward_norm=NormConfig(group_size=2))
    off = ActorConfig(path="x", reward_norm=NormConfig(group_size=2))
    torch.testing.assert_close(compute_advantages(_grpo_batch(), on),
                               compute_advantages(_grpo_batch(), off))


def test_kl_loss_is_kl_ctl_times_mean_k3_with_the_analytic_gradient():
    # k3 over d = [0, ln 2, -ln 2] sums to 0 + 0.1931 + 0.3069 = 0.5; token-mean over 3
    # tokens: 0.5 / 3; times kl_ctl 0.1 = 0.016667.
    # d k3 / d d = 1 - exp(-d) = [0, 0.5, -1]; times 0.1 / 3 -> [0, 0.016667, -0.033333].
    logp = torch.tensor([[0.0, LN2, -LN2]], requires_grad=True)
    loss, stats = kl_loss(logp, torch.zeros(1, 3), torch.ones(1, 3), kl_ctl=0.1, estimator="k3",
                          loss_agg_mode="token-mean", n_tokens=3, n_seqs=1)
    assert loss.item() == pytest.approx(0.1 * 0.5 / 3, abs=1e-7)
    assert stats["kl_ref"] == pytest.approx(0.5 / 3, abs=1e-7)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.5, -1.0]]) * 0.1 / 3)


def test_ppo_loss_fn_adds_the_kl_term_only_with_use_kl_loss():
    logp = torch.tensor([[0.0, LN2, -LN2]], requires_grad=True)
    batch = make_batch([0], [[1, 1, 1]], behavior_logprobs=[[0.0, LN2, -LN2]],
                       advantages=[[1.0, -1.0, 0.5]], ref_logprobs=[[0.0, 0.0, 0.0]])
    base = dict(path="x", kl_ctl=0.1, kl_estimator="k3")
    plain, _ = make_ppo_loss_fn(ActorConfig(**base), prox_is_current=True)(
        logp, batch, n_tokens=3, n_seqs=1)
    with_kl, stats = make_ppo_loss_fn(ActorConfig(**base, use_kl_loss=True), prox_is_current=True)(
        logp, batch, n_tokens=3, n_seqs=1)
    assert (with_kl - plain).item() == pytest.approx(0.1 * 0.5 / 3, abs=1e-6)
    assert stats["kl_ref"] == pytest.approx(0.5 / 3, abs=1e-6)


def test_kl_loss_without_reference_logprobs_says_what_to_set():
    batch = make_batch([0], [[1]], advantages=[[1.0]])
    loss_fn = make_ppo_loss_fn(ActorConfig(path="x", kl_ctl=0.1, use_kl_loss=True),
                               prox_is_current=True)
    with pytest.raises(ValueError, match="ref_logprobs is None"):
        loss_fn(torch.zeros(1, 1), batch, n_tokens=1, n_seqs=1)


# ---- config and the reference engine --------------------------------------------------------

def _load(*overrides):
    return load_config(None, ["train_dataset.path=x.jsonl", "actor.path=/m/actor", *overrides])


def test_kl_keys_load_and_the_reference_defaults_to_the_actor_path():
    cfg = _load("actor.kl_ctl=0.05", "actor.kl_estimator=k3", "actor.use_kl_loss=true",
                "ref.dtype=float32")
    assert (cfg.actor.kl_ctl, cfg.actor.kl_estimator, cfg.actor.use_kl_loss) == (0.05, "k3", True)
    assert cfg.ref.path == "/m/actor" and cfg.ref.dtype == "float32"


@pytest.mark.parametrize("override, message", [
    ("actor.kl_ctl=-0.1", "actor.kl_ctl must be >= 0"),
    ("actor.kl_estimator=k4", "actor.kl_estimator"),
])
def test_bad_kl_options_name_the_key(override, message):
    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _load(override)


def test_no_reference_engine_without_kl():
    cfg = _load()
    assert make_ref_engine(cfg.actor, cfg.ref, seed=1, device="cpu") is None


def test_reference_engine_follows_the_ref_section():
    cfg = _load("actor.kl_ctl=0.1", "ref.path=/m/ref", "ref.dtype=float32",
                "ref.mb_spec.max_tokens_per_mb=512", "actor.temperature=0.7")
    ref = make_ref_engine(cfg.actor, cfg.ref, seed=cfg.seed, device="cpu")
    assert ref is not None and ref.model is None  # built, not loaded
    assert (ref.spec.path, ref.spec.dtype) == ("/m/ref", "float32")
    assert ref.spec.mb_spec.max_tokens_per_mb == 512
    assert ref.spec.temperature == 0.7


def test_the_documented_reinforce_plus_plus_settings_load(tmp_path):
    path = tmp_path / "rpp.yaml"
    path.write_text("gconfig: {n_samples: 1}\ntrain_dataset: {path: x.jsonl}\n"
                    "actor: {kl_ctl: 0.01, kl_estimator: k1, use_kl_loss: false, reward_norm: null,"
                    " adv_norm: {mean_level: batch, std_level: batch}}\n")
    cfg = load_config(path)
    assert cfg.actor.reward_norm is None and cfg.actor.adv_norm.mean_level == "batch"
    assert cfg.actor.kl_ctl == 0.01 and not cfg.actor.use_kl_loss
