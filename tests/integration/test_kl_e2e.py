"""KL to a reference model end to end: 2 async steps on a tiny model, in-reward and as a loss."""

from pathlib import Path

import pytest
from tiny_run import tiny_run_config

from asyncrl.controller.rl import train
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration


def _config(tmp_path, model, use_kl_loss):
    return tiny_run_config(
        tmp_path, model, f"trial_name=loss{use_kl_loss}", "ref.dtype=float32",
        "actor.kl_ctl=0.1", "actor.kl_estimator=k3",
        f"actor.use_kl_loss={str(use_kl_loss).lower()}", name="kl")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


@pytest.mark.parametrize("use_kl_loss", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["in_reward", "kl_loss"])
def test_kl_to_the_reference_is_zero_before_the_first_update(tmp_path, tiny_model, use_kl_loss):
    summary = train(_config(tmp_path, tiny_model, use_kl_loss))
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    # Step 1 trains on samples of the initial policy, which is the reference. In-reward, the
    # KL reads the inference engine's behaviour log-probs: equal up to float noise.
    assert rows[0]["train/kl_ref"] == pytest.approx(0.0, abs=1e-4)
    assert rows[1]["train/kl_ref"] >= -1e-6  # k3 is non-negative, up to float32 rounding
    if use_kl_loss:  # the loss reads the updated policy: one lr-1e-3 step moved it (~0.09)
        assert rows[1]["train/kl_ref"] > 1e-3
    assert all(r["train/grad_norm"] > 0 for r in rows)
