"""LoRA end to end: 2 async steps on a tiny model with the servers in their own processes,
the adapters published by disk and the KL reference the base with adapters off."""

from pathlib import Path

import pytest
from tiny_run import tiny_run_config

from asyncrl.controller.rl import train
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytest.importorskip("peft")
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


def test_a_lora_run_publishes_adapters_and_its_reference_is_the_base(tmp_path, tiny_model):
    cfg = tiny_run_config(tmp_path, tiny_model, "actor.use_lora=true", "actor.lora_rank=4",
                          "actor.lora_alpha=8", "actor.kl_ctl=0.1", "actor.kl_estimator=k3",
                          "actor.use_kl_loss=true", "saver.freq_steps=2", name="lora")
    summary = train(cfg)
    run = Path(summary["run_dir"])
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    # B starts at 0: step 1's policy is the base, its reference, to float noise; one step
    # of lr 1e-3 on the adapters moves it.
    assert rows[0]["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert rows[1]["train/kl_ref"] > 1e-6
    # Each version is 2 layers x 7 projections of A [4, in] + B [out, 4] in fp32 (the
    # servers' dtype) and a safetensors header: 32 KB, not the model's weights.
    params = 2 * 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 2 + (128 + 64))
    assert all(4 * params < r["perf/weights_mb"] * 2**20 < 4 * params + 8192 for r in rows)
    saved = run / "checkpoints" / "step2"
    assert (saved / "adapter_config.json").is_file() and not (saved / "model.safetensors").exists()
