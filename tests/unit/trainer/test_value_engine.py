"""The critic's FSDP2 engine on a tiny random model: value alignment, a step, save and resume."""

import pytest
import torch
from batches import random_batch

from asyncrl.algorithms import make_value_loss_fn
from asyncrl.api.types import TensorBatch
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import CriticConfig, OptimizerConfig
from asyncrl.trainer import FSDPValueEngine

pytestmark = pytest.mark.usefixtures("process_group")


def make_batch(seed: int = 0, lengths=(9, 5, 7)) -> TensorBatch:
    return random_batch(seed, lengths)


def make_critic(path, seed=1, **overrides) -> FSDPValueEngine:
    engine = FSDPValueEngine(TrainEngineSpec.of(critic_config(path, **overrides)),
                             total_steps=10, seed=seed)
    engine.initialize()
    return engine


def critic_config(path, **overrides) -> CriticConfig:
    optimizer = overrides.pop("optimizer", OptimizerConfig(lr=1e-3))
    return CriticConfig(path=path, dtype="float32", optimizer=optimizer, **overrides)


def test_value_at_t_reads_only_the_tokens_before_t(tiny_path):
    critic = make_critic(tiny_path)
    batch = make_batch()
    values = critic.compute_values(batch)
    assert values.shape == batch.input_ids.shape and values.dtype == torch.float32
    assert (values[:, 0] == 0).all() and (values[~batch.attention_mask] == 0).all()
    changed = TensorBatch(**{**vars(batch), "input_ids": batch.input_ids.clone()})
    changed.input_ids[0, 5] = (batch.input_ids[0, 5] + 1) % 250 + 3
    after = critic.compute_values(changed)
    # V before token t is a function of tokens < t: changing token 5 moves V at 6 onwards.
    torch.testing.assert_close(after[0, :6], values[0, :6])
    assert (after[0, 6:] - values[0, 6:]).abs().min() > 0
    torch.testing.assert_close(after[1:], values[1:])
    critic.destroy()


def test_the_fresh_head_is_seeded_and_dropout_free(tiny_path):
    a, b, c = (make_critic(tiny_path, seed=s) for s in (1, 1, 2))
    batch = make_batch()
    assert torch.equal(a.compute_values(batch), b.compute_values(batch))
    assert not torch.equal(a.compute_values(batch), c.compute_values(batch))
    assert a.model.hf.dropout.p == 0.0  # training values are compute_values' values
    for engine in (a, b, c):
        engine.destroy()


def test_train_steps_lower_the_value_loss_on_a_fixed_batch(tiny_path):
    critic = make_critic(tiny_path, eps_clip=None)
    batch = make_batch()
    batch.values = critic.compute_values(batch)
    batch.returns = 1.0 * batch.loss_mask  # a constant target on every loss token
    loss_fn = make_value_loss_fn(critic_config(tiny_path, eps_clip=None))
    losses = [critic.train_batch(batch, loss_fn)["loss"] for _ in range(5)]
    after = critic.compute_values(batch)
    mse = float(((after - batch.returns).square() * batch.loss_mask).sum() / batch.loss_mask.sum())
    assert losses[0] > 0.05 and losses == sorted(losses, reverse=True)
    assert 0.5 * mse < losses[-1]  # the step after the last logged loss also helped
    critic.destroy()


def test_saved_critic_is_an_hf_token_classifier_with_the_same_values(tiny_path, tmp_path):
    from transformers import AutoModelForTokenClassification

    critic = make_critic(tiny_path)
    batch = make_batch(seed=3)
    batch.values = critic.compute_values(batch)
    batch.returns = batch.loss_mask.clone()
    critic.train_batch(batch, make_value_loss_fn(critic_config(tiny_path)))  # the head is no longer the init
    ours = critic.compute_values(batch)
    critic.save_hf(str(tmp_path / "critic"))
    critic.save_state(str(tmp_path / "state"))
    critic.destroy()

    loaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic",
                                                             dtype=torch.float32)
    assert loaded.config.architectures == ["LlamaForTokenClassification"]
    assert loaded.config.num_labels == 1
    with torch.no_grad():
        scores = loaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    # The head at hidden state t - 1 is V at t; 0 at t = 0 and on padding.
    expected = torch.nn.functional.pad(scores[:, :-1, 0], (1, 0)) * batch.attention_mask
    expected[:, 0] = 0
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)

    resumed = make_critic(tiny_path, seed=7)  # another head: load_state must replace it
    resumed.load_state(str(tmp_path / "state"))
    assert resumed.steps_done == 1
    torch.testing.assert_close(resumed.compute_values(batch), ours)
    resumed.destroy()


def test_a_critic_has_no_logprobs(tiny_path):
    critic = make_critic(tiny_path)
    with pytest.raises(TypeError, match="compute_values"):
        critic.compute_logprobs(make_batch())
    critic.destroy()
