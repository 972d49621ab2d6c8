"""SFT and DPO/IPO losses against numbers worked out by hand on tiny tensors."""

import math

import pytest
import torch

from asyncrl.algorithms import dpo_loss, make_dpo_loss_fn, make_sft_loss_fn, sequence_logps
from asyncrl.api.types import TensorBatch

LN2 = math.log(2)


def make_batch(loss_mask, logprob_rows=None, labels=None, ref=None) -> TensorBatch:
    loss_mask = torch.tensor(loss_mask, dtype=torch.float32)
    n = loss_mask.shape[0]
    return TensorBatch(
        input_ids=torch.zeros(loss_mask.shape, dtype=torch.long),
        attention_mask=torch.ones(loss_mask.shape, dtype=torch.bool), loss_mask=loss_mask,
        behavior_logprobs=torch.zeros(loss_mask.shape),
        versions=torch.full(loss_mask.shape, -1, dtype=torch.long),
        rewards=torch.tensor(labels if labels is not None else [0.0] * n),
        ref_logprobs=None if ref is None else torch.tensor(ref, dtype=torch.float32))


# -- SFT --------------------------------------------------------------------------------


def _token_logprobs_from_a_tiny_vocabulary() -> torch.Tensor:
    """Log-probs of the tokens of two rows over a 2-token vocabulary, by hand.

    Row 0: prompt [t0, t1], answer [t2, t3]; row 1: prompt [t0], answer [t1], one pad.
    Logits [0, 0] give p = 1/2; [ln 3, 0] give p(token 1) = 1 / (3 + 1) = 1/4;
    [ln 7, 0] give p(token 1) = 1/8; [ln 999, 0] give 1/1000 (prompt tokens: must not count).
    """
    l = math.log
    logits = torch.tensor([
        [[0.0, 0.0], [l(999), 0.0], [0.0, 0.0], [l(3), 0.0]],  # picked: -, 1/1000, 1/2, 1/4
        [[0.0, 0.0], [l(999), 0.0], [l(7), 0.0], [0.0, 0.0]],  # picked: -, 1/1000, 1/8, pad
    ])
    tokens = torch.ones(2, 4, dtype=torch.long)  # every picked token is token 1
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    logprobs[:, 0] = 0.0  # position 0 has no context (the engine's alignment)
    return logprobs


def test_sft_loss_is_the_mean_nll_of_answer_tokens_only():
    logprobs = _token_logprobs_from_a_tiny_vocabulary()
    mask = [[0, 0, 1, 1], [0, 0, 1, 0]]
    # Answer tokens: 1/2, 1/4 (row 0) and 1/8 (row 1): NLL ln2, 2 ln2, 3 ln2; mean over the
    # 3 answer tokens = 6 ln2 / 3 = 2 ln2 = 1.3863. The prompt's 1/1000 (6.9 nats) is ignored.
    loss, stats = make_sft_loss_fn()(logprobs, make_batch(mask), n_tokens=3, n_seqs=2)
    assert loss.item() == pytest.approx(2 * LN2, abs=1e-6)
    assert stats == {"answer_tokens": 3.0}


def test_sft_micro_batch_shares_add_up_to_the_batch_loss():
    logprobs = _token_logprobs_from_a_tiny_vocabulary()
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0]], dtype=torch.float32)
    loss_fn = make_sft_loss_fn()
    # Row 0 alone: (ln2 + 2 ln2) / 3 = ln2; row 1 alone: 3 ln2 / 3 = ln2; sum 2 ln2.
    first, _ = loss_fn(logprobs[:1], make_batch(mask[:1].tolist()), n_tokens=3, n_seqs=2)
    second, _ = loss_fn(logprobs[1:], make_batch(mask[1:].tolist()), n_tokens=3, n_seqs=2)
    assert first.item() == pytest.approx(LN2, abs=1e-6)
    assert (first + second).item() == pytest.approx(2 * LN2, abs=1e-6)


# -- DPO / IPO ---------------------------------------------------------------------------

# Policy sequence log-probs chosen -1, rejected -3; reference -2 and -2; beta 0.1.
# h = (-1 - -2) - (-3 - -2) = 1 + 1 = 2; beta * h = 0.2.
POLICY, REF, BETA = (-1.0, -3.0), (-2.0, -2.0), 0.1
SIG_02 = 1 / (1 + math.exp(-0.2))  # sigmoid(0.2) = 0.549834


def _dpo(loss_type="sigmoid", label_smoothing=0.0):
    chosen = torch.tensor([POLICY[0]], requires_grad=True)
    rejected = torch.tensor([POLICY[1]], requires_grad=True)
    losses, stats = dpo_loss(chosen, rejected, torch.tensor([REF[0]]), torch.tensor([REF[1]]),
                             beta=BETA, loss_type=loss_type, label_smoothing=label_smoothing)
    losses.sum().backward()
    return losses, stats, chosen.grad, rejected.grad


def test_dpo_sigmoid_loss_by_hand():
    losses, stats, d_chosen, d_rejected = _dpo()
    # -log sigmoid(0.2) = log(1 + e^-0.2) = log(1 + 0.818731) = log(1.818731) = 0.598139
    assert losses.item() == pytest.approx(0.598139, abs=1e-6)
    # d/d logp_c = -beta * sigmoid(-0.2) = -0.1 * 0.450166 = -0.0450166; rejected: the opposite.
    assert d_chosen.item() == pytest.approx(-0.0450166, abs=1e-7)
    assert d_rejected.item() == pytest.approx(0.0450166, abs=1e-7)
    # Implicit rewards: 0.1 * (-1 - -2) = 0.1 and 0.1 * (-3 - -2) = -0.1; margin 0.2.
    assert stats["chosen_reward"].item() == pytest.approx(0.1)
    assert stats["rejected_reward"].item() == pytest.approx(-0.1)
    assert stats["reward_margin"].item() == pytest.approx(0.2)
    assert stats["reward_accuracy"].item() == 1.0


def test_dpo_label_smoothing_mixes_in_the_flipped_label():
    losses, *_ = _dpo(label_smoothing=0.1)
    # -log sigmoid(-0.2) = 0.2 + 0.598139 = 0.798139 (log(1 + e^0.2) = log 2.221403);
    # 0.9 * 0.598139 + 0.1 * 0.798139 = 0.538325 + 0.079814 = 0.618139.
    assert losses.item() == pytest.approx(0.618139, abs=1e-6)


def test_ipo_loss_by_hand():
    losses, _, d_chosen, d_rejected = _dpo(loss_type="ipo")
    # (h - 1 / (2 beta))^2 = (2 - 5)^2 = 9; d/d logp_c = 2 (h - 5) = -6, rejected +6.
    assert losses.item() == pytest.approx(9.0)
    assert d_chosen.item() == pytest.approx(-6.0)
    assert d_rejected.item() == pytest.approx(6.0)


def test_unknown_dpo_loss_type_names_the_key():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=0.1,
                 loss_type="hinge")


def _pair_batch():
    """Two pairs, rows (c0, r0, c1, r1), 3 tokens each; token 0 is the prompt."""
    # Sequence sums over the loss tokens: policy c0 = -0.25 - 0.75 = -1, r0 = -1 - 2 = -3
    # (the example above), c1 = -2 - 2 = -4, r1 = -1 - 1 = -2; the prompt's -9 never counts.
    logprobs = torch.tensor([[-9, -0.25, -0.75], [-9, -1, -2], [-9, -2, -2], [-9, -1, -1.0]])
    # Reference sums: c0 = -2, r0 = -2, c1 = -3, r1 = -3.
    ref = [[-9, -1, -1], [-9, -1.5, -0.5], [-9, -1, -2], [-9, -2, -1]]
    mask = [[0, 1, 1]] * 4
    return logprobs, make_batch(mask, labels=[1, 0, 1, 0], ref=ref)


def test_dpo_loss_fn_sums_tokens_into_sequences_and_averages_over_pairs():
    logprobs, batch = _pair_batch()
    torch.testing.assert_close(sequence_logps(logprobs, batch.loss_mask),
                               torch.tensor([-1.0, -3.0, -4.0, -2.0]))
    loss, stats = make_dpo_loss_fn(beta=BETA)(logprobs, batch, n_tokens=8, n_seqs=4)
    # Pair 0: h = 2 -> 0.598139 (above). Pair 1: h = (-4 - -3) - (-2 - -3) = -1 - 1 = -2,
    # beta h = -0.2 -> -log sigmoid(-0.2) = 0.798139. Mean over 2 pairs: 0.698139.
    assert loss.item() == pytest.approx(0.698139, abs=1e-6)
    # Margins 0.2 and -0.2: mean 0; accuracy 1 of 2.
    assert stats["reward_margin"] == pytest.approx(0.0, abs=1e-7)
    assert stats["reward_accuracy"] == pytest.approx(0.5)
    assert stats["chosen_logp"] == pytest.approx((-1 - 4) / 2)


def test_dpo_micro_batch_shares_add_up_to_the_batch_loss():
    logprobs, batch = _pair_batch()
    loss_fn = make_dpo_loss_fn(beta=BETA)
    whole, _ = loss_fn(logprobs, batch, n_tokens=8, n_seqs=4)
    # Each pair alone, normalised by the whole batch's 2 pairs: 0.598139 / 2 + 0.798139 / 2.
    parts = [loss_fn(logprobs[i:i + 2], batch.select([i, i + 1]), n_tokens=8, n_seqs=4)[0]
             for i in (0, 2)]
    assert parts[0].item() == pytest.approx(0.598139 / 2, abs=1e-6)
    assert sum(parts).item() == pytest.approx(whole.item(), abs=1e-7)


@pytest.mark.parametrize("rows, labels", [([0, 2], [1, 1]), ([1, 2], [0, 1]), ([0], [1])],
                         ids=["two_chosen", "rejected_first", "odd_rows"])
def test_dpo_loss_refuses_rows_that_are_not_pairs(rows, labels):
    logprobs, batch = _pair_batch()
    mb = batch.select(rows)
    assert mb.rewards.tolist() == labels
    with pytest.raises(ValueError, match="granularity"):
        make_dpo_loss_fn(beta=BETA)(logprobs[rows], mb, n_tokens=8, n_seqs=4)


def test_dpo_loss_without_reference_logprobs_is_explained():
    logprobs, batch = _pair_batch()
    batch.ref_logprobs = None
    with pytest.raises(ValueError, match="ref_logprobs is None"):
        make_dpo_loss_fn(beta=BETA)(logprobs, batch, n_tokens=8, n_seqs=4)
