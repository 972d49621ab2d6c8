"""Distillation from a teacher: the reverse-KL loss term, on-policy advantages, config, vocab."""

import asyncio
import math

import pytest
import torch
from batches import hand_batch as make_batch

from asyncrl.algorithms import (
    compute_advantages,
    distill_loss,
    kl_estimate,
    make_ppo_loss_fn,
    on_policy_advantages,
    with_distillation,
)
from asyncrl.api.types import TensorBatch
from asyncrl.config import ConfigError, load_config
from asyncrl.config.schema import ActorConfig, GenerationConfig, NormConfig
from asyncrl.controller.workflows import RLVRWorkflow
from asyncrl.models.tiny import make_tiny_tokenizer
from asyncrl.trainer.frozen import check_shared_vocab, make_teacher_engine

EPS = 1e-5
E = math.e


# ---- the reverse-KL loss term ----------------------------------------------------------------

# Student log-probs [-1, -2, -0.5] and teacher [-1, -1, -2.5]: d = logp - teacher = [0, -1, 2].
STUDENT, TEACHER = [[-1.0, -2.0, -0.5]], [[-1.0, -1.0, -2.5]]


@pytest.mark.parametrize("estimator, kl_sum, grad_per_token", [
    # k1 = d: sum 0 - 1 + 2 = 1; dk1/dd = 1 on every token.
    ("k1", 1.0, [1.0, 1.0, 1.0]),
    # k2 = d^2 / 2 = [0, 0.5, 2], sum 2.5; dk2/dd = d = [0, -1, 2].
    ("k2", 2.5, [0.0, -1.0, 2.0]),
    # k3 = exp(-d) - 1 + d = [0, e - 2, e^-2 + 1] = [0, 0.718282, 1.135335], sum 1.853617;
    # dk3/dd = 1 - exp(-d) = [0, 1 - e, 1 - e^-2] = [0, -1.718282, 0.864665].
    ("k3", E - 2 + E**-2 + 1, [0.0, 1 - E, 1 - E**-2]),
])
def test_distill_loss_is_coef_times_the_token_mean_estimate_with_its_gradient(
        estimator, kl_sum, grad_per_token):
    # coef 0.5, token-mean over 3 tokens: loss = 0.5 * sum / 3, gradient 0.5 / 3 * dk/dd.
    logp = torch.tensor(STUDENT, requires_grad=True)
    loss, stats = distill_loss(logp, torch.tensor(TEACHER), torch.ones(1, 3), coef=0.5,
                               estimator=estimator, loss_agg_mode="token-mean", n_tokens=3,
                               n_seqs=1)
    assert loss.item() == pytest.approx(0.5 * kl_sum / 3, abs=1e-6)
    assert stats["distill_kl"] == pytest.approx(1 / 3, abs=1e-6)  # always the k1 mean
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([grad_per_token]) * 0.5 / 3)


def test_distill_loss_is_aggregated_like_the_policy_loss():
    # Row 0: loss tokens d = [0, -1] (k2 [0, 0.5], mean 0.25); row 1: d = [2] (k2 2, mean 2).
    # seq-mean-token-mean: (0.25 + 2) / 2 sequences = 1.125. distill_kl: (0 - 1 + 2) / 3 tokens.
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    teacher = torch.tensor([[-1.0, -1.0, 9.0], [-2.5, 9.0, 9.0]])  # 9s sit off the mask
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, stats = distill_loss(logp, teacher, mask, coef=1.0, estimator="k2",
                               loss_agg_mode="seq-mean-token-mean", n_tokens=3, n_seqs=2)
    assert loss.item() == pytest.approx(1.125, abs=1e-6)
    assert stats["distill_kl"] == pytest.approx(1 / 3, abs=1e-6)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_a_teacher_equal_to_the_student_gives_zero_kl_loss_and_gradient(estimator):
    logp = torch.tensor(STUDENT, requires_grad=True)
    loss, stats = distill_loss(logp, torch.tensor(STUDENT), torch.ones(1, 3), coef=0.5,
                               estimator=estimator, loss_agg_mode="token-mean", n_tokens=3,
                               n_seqs=1)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == 0.0 and stats["distill_kl"] == 0.0
    assert torch.count_nonzero(grad) == 0


def _expected_estimator_gradient(estimator: str, student_logits: torch.Tensor,
                                 teacher_logp: torch.Tensor) -> torch.Tensor:
    """E over the student's tokens of the gradient of k(d); the sampling is not differentiated."""
    logits = student_logits.clone().requires_grad_(True)
    logp = logits.log_softmax(-1)
    expected = (logp.detach().exp() * kl_estimate(logp, teacher_logp, estimator)).sum()
    return torch.autograd.grad(expected, logits)[0]


def test_on_student_samples_k2_follows_the_reverse_kl_gradient_k3_the_forward_k1_none():
    # One position, a vocabulary of 3: student p = softmax(logits), teacher q. Exact
    # expectations over the student's token, no sampling noise.
    logits = torch.tensor([0.5, -0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    p_logits = logits.clone().requires_grad_(True)
    p = p_logits.softmax(-1)
    reverse = (p * (p.log() - q.log())).sum()  # KL(p || q)
    (grad_reverse,) = torch.autograd.grad(reverse, p_logits)
    p_logits = logits.clone().requires_grad_(True)
    forward = (q * (q.log() - p_logits.log_softmax(-1))).sum()  # KL(q || p)
    (grad_forward,) = torch.autograd.grad(forward, p_logits)

    torch.testing.assert_close(_expected_estimator_gradient("k2", logits, q.log()), grad_reverse)
    torch.testing.assert_close(_expected_estimator_gradient("k3", logits, q.log()), grad_forward)
    torch.testing.assert_close(_expected_estimator_gradient("k1", logits, q.log()),
                               torch.zeros(3), atol=1e-6, rtol=0)


# ---- pure on-policy distillation: advantages -------------------------------------------------

def _on_policy_batch() -> TensorBatch:
    # Position 0 is the prompt. d = behaviour - teacher: row 0 [4 (prompt), 1, -1],
    # row 1 [4 (prompt), 0, -2]. Rewards [1, 0] must play no part.
    return make_batch([1, 0], [[0, 1, 1], [0, 1, 1]],
                      behavior_logprobs=[[0, -1, -2], [0, -0.5, -3]],
                      teacher_logprobs=[[-4, -2, -1], [-4, -0.5, -1]])


def _on_policy_cfg(**kw) -> ActorConfig:
    return ActorConfig(path="x", distill_coef=0.5, distill_mode="on_policy",
                       reward_norm=NormConfig(group_size=2), **kw)


def test_on_policy_advantage_is_minus_coef_times_the_per_token_reverse_kl():
    # -0.5 * d on loss tokens: row 0 [0, -0.5, 0.5], row 1 [0, 0, 1].
    expected = torch.tensor([[0.0, -0.5, 0.5], [0.0, 0.0, 1.0]])
    torch.testing.assert_close(on_policy_advantages(_on_policy_batch(), 0.5), expected)
    # compute_advantages ignores the rewards (and reward_norm) in this mode.
    torch.testing.assert_close(compute_advantages(_on_policy_batch(), _on_policy_cfg()), expected)


def test_on_policy_advantages_take_adv_norm_over_the_loss_tokens():
    # Loss-token advantages [-0.5, 0.5, 0, 1]: mean 0.25, centred [-0.75, 0.25, -0.25, 0.75],
    # variance (0.5625 + 0.0625 + 0.0625 + 0.5625) / 4 = 0.3125, std 0.559017.
    cfg = _on_policy_cfg(adv_norm=NormConfig(mean_level="batch", std_level="batch"))
    std = math.sqrt(0.3125)
    expected = torch.tensor([[0.0, -0.75, 0.25], [0.0, -0.25, 0.75]]) / (std + EPS)
    expected[:, 0] = 0.0
    torch.testing.assert_close(compute_advantages(_on_policy_batch(), cfg), expected)


def test_a_teacher_equal_to_the_behaviour_policy_gives_zero_on_policy_advantages():
    batch = _on_policy_batch()
    batch.teacher_logprobs = batch.behavior_logprobs.clone()
    assert torch.count_nonzero(compute_advantages(batch, _on_policy_cfg())) == 0


def test_on_policy_advantages_without_teacher_logprobs_say_what_to_set():
    batch = _on_policy_batch()
    batch.teacher_logprobs = None
    with pytest.raises(ValueError, match="teacher_logprobs is None"):
        compute_advantages(batch, _on_policy_cfg())


# ---- the loss function the trainer uses ------------------------------------------------------

def _loss_batch(behaviour) -> TensorBatch:
    return make_batch([0], [[1, 1, 1]], behavior_logprobs=behaviour,
                      advantages=[[1.0, -1.0, 0.5]], teacher_logprobs=TEACHER)


def test_without_distillation_the_loss_fn_is_unchanged():
    base = make_ppo_loss_fn(ActorConfig(path="x"), prox_is_current=True)
    assert with_distillation(base, ActorConfig(path="x")) is base


def test_kl_loss_mode_adds_the_term_to_the_ppo_loss():
    cfg = ActorConfig(path="x", distill_coef=0.5, distill_kl_estimator="k2")
    base = make_ppo_loss_fn(cfg, prox_is_current=True)
    # The current policy's log-probs are STUDENT (k1 mean 1/3, k2 sum 2.5, as above); the
    # behaviour's equal the teacher's and must play no part in the term or the stat.
    logp, batch = torch.tensor(STUDENT), _loss_batch(TEACHER)
    plain, _ = base(logp, batch, n_tokens=3, n_seqs=1)
    total, stats = with_distillation(base, cfg)(logp, batch, n_tokens=3, n_seqs=1)
    assert (total - plain).item() == pytest.approx(0.5 * 2.5 / 3, abs=1e-6)
    assert stats["distill_kl"] == pytest.approx(1 / 3, abs=1e-6)
    assert "clip_frac" in stats  # the PPO stats are kept


def test_kl_loss_term_follows_the_drgrpo_aggregation_of_the_policy_loss():
    # seq-mean-token-sum-norm with a budget of 4: the k2 sum 2.5 of the one sequence / (1 * 4),
    # times coef 0.5 = 0.3125 (the term reads actor.max_new_tokens, as the policy loss does).
    cfg = ActorConfig(path="x", distill_coef=0.5, distill_kl_estimator="k2",
                      loss_agg_mode="seq-mean-token-sum-norm", max_new_tokens=4)
    base = make_ppo_loss_fn(cfg, prox_is_current=True)
    logp, batch = torch.tensor(STUDENT), _loss_batch(TEACHER)
    plain, _ = base(logp, batch, n_tokens=3, n_seqs=1)
    total, _ = with_distillation(base, cfg)(logp, batch, n_tokens=3, n_seqs=1)
    assert (total - plain).item() == pytest.approx(0.5 * 2.5 / 4, abs=1e-6)


def test_on_policy_mode_reports_the_kl_but_adds_no_term():
    cfg = ActorConfig(path="x", distill_coef=0.5, distill_mode="on_policy")
    base = make_ppo_loss_fn(cfg, prox_is_current=True)
    # The stat is the behaviour's KL (STUDENT vs TEACHER: 1/3), the one the advantages used,
    # not the current policy's (here equal to the teacher: 0).
    logp, batch = torch.tensor(TEACHER), _loss_batch(STUDENT)
    plain, _ = base(logp, batch, n_tokens=3, n_seqs=1)
    total, stats = with_distillation(base, cfg)(logp, batch, n_tokens=3, n_seqs=1)
    assert total.item() == plain.item()
    assert stats["distill_kl"] == pytest.approx(1 / 3, abs=1e-6)


def test_distillation_without_teacher_logprobs_says_what_to_set():
    batch = _loss_batch(STUDENT)
    batch.teacher_logprobs = None
    cfg = ActorConfig(path="x", distill_coef=0.5)
    loss_fn = with_distillation(make_ppo_loss_fn(cfg, prox_is_current=True), cfg)
    with pytest.raises(ValueError, match="teacher_logprobs is None"):
        loss_fn(torch.tensor(STUDENT), batch, n_tokens=3, n_seqs=1)


# ---- vocabulary --------------------------------------------------------------------------

def test_tokenizers_of_one_family_pass_the_vocab_check():
    a, b = make_tiny_tokenizer(), make_tiny_tokenizer()
    check_shared_vocab(a.get_vocab(), b.get_vocab(), 320, teacher_path="/t")


def test_a_teacher_with_a_larger_tokenizer_is_refused():
    student, teacher = make_tiny_tokenizer(), make_tiny_tokenizer()
    teacher.add_tokens(["<extra>"])
    n = len(student)
    with pytest.raises(ValueError, match=rf"teacher.path='/t' has a tokenizer of {n + 1} tokens "
                                         rf"but the actor's \(tokenizer_path\) has {n}"):
        check_shared_vocab(student.get_vocab(), teacher.get_vocab(), 320, teacher_path="/t")


def test_a_teacher_with_other_token_ids_is_refused():
    with pytest.raises(ValueError, match=r"2 of 3 tokens have other ids .*'b': 1 for the actor, "
                                         r"2 for the teacher"):
        check_shared_vocab({"a": 0, "b": 1, "c": 2}, {"a": 0, "b": 2, "c": 1}, 3,
                           teacher_path="/t")


def test_a_teacher_whose_output_layer_is_short_of_the_tokenizer_is_refused():
    vocab = {"a": 0, "b": 1, "c": 2}
    check_shared_vocab(vocab, dict(vocab), 64, teacher_path="/t")  # padded rows are fine
    with pytest.raises(ValueError, match="output layer has 2 rows .* tokenizer has 3 tokens"):
        check_shared_vocab(vocab, dict(vocab), 2, teacher_path="/t")


def test_the_trainer_refuses_a_teacher_with_another_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from asyncrl.models.tiny import make_tiny_model
    from asyncrl.trainer.frozen import check_teacher_vocab, frozen_engine

    torch.set_num_threads(1)
    student = make_tiny_model(tmp_path / "student", seed=0)
    foreign = make_tiny_model(tmp_path / "foreign", seed=1)
    tok = AutoTokenizer.from_pretrained(foreign)
    tok.add_tokens(["<extra>"])  # one token more than the student's tokenizer
    tok.save_pretrained(foreign)
    student_tok = AutoTokenizer.from_pretrained(student)
    cfg = _load("actor.distill_coef=1", f"teacher.path={foreign}")
    for path, ok in ((student, True), (foreign, False)):
        teacher = frozen_engine(path=path, dtype="float32", mb_spec=cfg.teacher.mb_spec,
                                seed=cfg.seed, device="cpu")
        teacher.initialize()
        try:
            if ok:
                check_teacher_vocab(student_tok, teacher)
            else:
                with pytest.raises(ValueError, match=f"has a tokenizer of {len(student_tok) + 1}"):
                    check_teacher_vocab(student_tok, teacher)
        finally:
            teacher.destroy()


# ---- config ------------------------------------------------------------------------------

def _load(*overrides):
    return load_config(None, ["train_dataset.path=x.jsonl", "actor.path=/m/actor", *overrides])


def test_distillation_keys_load():
    cfg = _load("actor.distill_coef=0.3", "actor.distill_mode=on_policy", "teacher.path=/m/t",
                "teacher.dtype=float32", "workflow.reward_fn=null")
    assert (cfg.actor.distill_coef, cfg.actor.distill_mode) == (0.3, "on_policy")
    assert (cfg.teacher.path, cfg.teacher.dtype) == ("/m/t", "float32")
    assert cfg.workflow.reward_fn is None


def test_distillation_is_off_by_default():
    cfg = _load()
    assert cfg.actor.distill_coef == 0 and cfg.teacher.path == ""
    assert cfg.actor.distill_mode == "kl_loss" and cfg.actor.distill_kl_estimator == "k2"


@pytest.mark.parametrize("overrides, message", [
    (["actor.distill_coef=0.1"], "actor.distill_coef=0.1 but teacher.path is empty"),
    (["teacher.path=/m/t"], "teacher.path='/m/t' is set but actor.distill_coef=0"),
    (["actor.distill_coef=-1", "teacher.path=/m/t"], "actor.distill_coef must be >= 0"),
    (["actor.distill_mode=on_policy"], "actor.distill_mode=on_policy needs actor.distill_coef > 0"),
    (["actor.distill_coef=1", "teacher.path=/m/t", "actor.distill_mode=on_policy",
      "actor.reward_scaling=2"], "rewards.*ignored: actor.reward_scaling=2"),
    (["actor.distill_coef=1", "teacher.path=/m/t", "actor.distill_mode=on_policy",
      "actor.kl_ctl=0.1"], r"ignored: actor.kl_ctl \(in-reward KL\)=0.1"),
    (["workflow.reward_fn=null"], "workflow.reward_fn is null, but only pure on-policy"),
    (["workflow.reward_fn=null", "actor.distill_coef=1", "teacher.path=/m/t"],
     "workflow.reward_fn is null, but only pure on-policy"),
    (["workflow.reward_fn=null", "actor.distill_coef=1", "teacher.path=/m/t",
      "actor.distill_mode=on_policy", "valid_dataset.path=v.jsonl"],
     "workflow.reward_fn is null but valid_dataset is set"),
])
def test_bad_distillation_options_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _load(*overrides)


@pytest.mark.parametrize("override", ["actor.distill_mode=forward",
                                      "actor.distill_kl_estimator=k4"])
def test_unknown_distillation_choices_are_refused(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        _load(override)


def test_on_policy_distillation_keeps_a_kl_loss_to_the_reference():
    cfg = _load("actor.distill_coef=1", "teacher.path=/m/t", "actor.distill_mode=on_policy",
                "actor.kl_ctl=0.1", "actor.use_kl_loss=true")
    assert cfg.actor.kl_ctl == 0.1


# ---- the teacher engine and a workflow without reward ----------------------------------------

def test_no_teacher_engine_without_distillation():
    cfg = _load()
    assert make_teacher_engine(cfg.actor, cfg.teacher, seed=1, device="cpu") is None


def test_teacher_engine_follows_the_teacher_section_and_loads_real_weights():
    cfg = _load("actor.distill_coef=0.1", "teacher.path=/m/t", "teacher.dtype=float32",
                "teacher.mb_spec.max_tokens_per_mb=512", "actor.temperature=0.7",
                "actor.init_from_scratch=true")
    teacher = make_teacher_engine(cfg.actor, cfg.teacher, seed=cfg.seed, device="cpu")
    assert teacher is not None and teacher.model is None  # built, not loaded
    assert (teacher.spec.path, teacher.spec.dtype) == ("/m/t", "float32")
    assert teacher.spec.mb_spec.max_tokens_per_mb == 512 and teacher.spec.temperature == 0.7
    assert not teacher.spec.init_from_scratch  # a scratch teacher would teach noise


class _OneAnswerEngine:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def agenerate(self, req):
        from asyncrl.api.types import GenerationResponse

        out = self.tokenizer.encode("42", add_special_tokens=False)
        return GenerationResponse(rid=req.rid, input_ids=list(req.input_ids), output_ids=out,
                                  output_logprobs=[-0.5] * len(out), output_versions=[0] * len(out),
                                  stop_reason="stop")


def test_a_workflow_without_reward_fn_samples_unscored_answers():
    from asyncrl.config.schema import WorkflowConfig

    tok = make_tiny_tokenizer()
    workflow = RLVRWorkflow.from_config(tok, GenerationConfig(n_samples=2, max_new_tokens=4),
                                        WorkflowConfig(reward_fn=None))
    trajs = asyncio.run(workflow.run(_OneAnswerEngine(tok), {"id": 7, "question": "q?"}))
    assert [t.reward for t in trajs] == [0.0, 0.0]
    assert [t.meta["reward_fn"] for t in trajs] == [None, None]
    assert [t.meta["completion"] for t in trajs] == ["42", "42"]
    workflow.close()  # nothing to stop
