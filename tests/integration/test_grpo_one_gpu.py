"""benchmarks/gpu/grpo_one_gpu.py on the CPU: trainer and server side by side, a real run."""

import sys
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.models.tiny import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
import grpo_one_gpu  # noqa: E402

pytestmark = pytest.mark.integration

# bf16 compute on both sides: about 3 significant digits on log-probs of magnitude ~5
# (test_train_engine's bf16 tolerance).
BF16_LOGPROB_TOL = 0.1


def test_two_steps_on_the_cpu_give_a_sane_row_and_equal_logprobs(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", seed=5)
    row = grpo_one_gpu.run("cpu", model, str(tmp_path / "out"), steps=2, sync="disk")
    assert (row["device"], row["sync"], row["steps"]) == ("cpu", "disk", 2)
    # publishing is a part of each step (medians keep the order of the rows)
    assert 0 < row["publish_s"] <= row["step_s"] < 60
    assert row["step_s"] < row["wall_s"]
    # The check sampled the last batch's 2 prompts x 2 samples (1..12 tokens each) with the
    # weights of the second publish, which the servers held: every token is of version 2.
    assert row["logprob_gap_version"] == 2
    assert 4 <= row["logprob_gap_tokens"] <= 4 * 12
    assert 0 <= row["logprob_gap_max"] < BF16_LOGPROB_TOL


def test_ipc_on_the_cpu_is_a_config_error_naming_disk(tmp_path):
    with pytest.raises(ConfigError, match="use actor.weight_update_mode=disk"):
        grpo_one_gpu.run("cpu", str(tmp_path / "absent"), str(tmp_path), steps=2, sync="ipc")
