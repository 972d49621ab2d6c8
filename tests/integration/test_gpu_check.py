"""benchmarks/gpu/check.py on the CPU (`--device cpu`): every step runs at tiny shapes, and each
derived figure is recomputed here from the raw numbers results.json holds beside it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "benchmarks" / "gpu" / "check.py"
SHAPES = ("smollm2-135m", "qwen3-0.6b", "qwen3-1.7b")
# Non-embedding parameters of the tiny shapes (hidden 64, 2 heads of 32, 1 KV head,
# intermediate 128): per layer q 64x64, k and v 64x32, o 64x64, gate, up and down 64x128, two
# norms of 64; Qwen3 adds q and k norms of 32. Layers 2, 3, 4; the final norm, 64.
LLAMA_LAYER = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
TINY_PARAMS = {"smollm2-135m": 2 * LLAMA_LAYER + 64,
               "qwen3-0.6b": 3 * (LLAMA_LAYER + 2 * 32) + 64,
               "qwen3-1.7b": 4 * (LLAMA_LAYER + 2 * 32) + 64}


def run_check(out: Path, *steps: str) -> tuple[subprocess.CompletedProcess, dict]:
    # No assets: the tiny byte-level tokenizer (259 tokens, embeddings of 320 rows).
    argv = [sys.executable, str(CHECK), "--device", "cpu", "--out", str(out),
            "--assets", str(out / "no-assets"), "--steps", *steps]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    return done, json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def shapes_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    done, results = run_check(out, "shapes")
    return done, results, out


def rows(results: dict) -> dict:
    return {(s["name"], s["shape"]): s for s in results["steps"]}


def test_every_step_has_a_row_that_passed_in_the_table_and_the_json(shapes_run):
    done, results, out = shapes_run
    expected = [("build", ""), ("calibrate", "")] + [
        (part, shape) for shape in SHAPES for part in ("train", "decode", "publish")]
    assert [(s["name"], s["shape"]) for s in results["steps"]] == expected, done.stdout[-3000:]
    failed = {k: s["error"] for k, s in rows(results).items() if s["status"] != "passed"}
    assert not failed
    assert done.returncode == 0
    table = (out / "table.md").read_text()
    for name, shape in expected:
        assert f"| {name} | {shape} | passed |" in table
    for log in {s["log"] for s in results["steps"]}:
        assert (out / log).is_file()


def test_mfu_is_six_params_tokens_over_step_time_over_the_measured_peak(shapes_run):
    _, results, _ = shapes_run
    peak = results["calibration"]["peak_flops"]
    assert peak == max(results["calibration"]["matmul_flops_by_size"].values())
    for shape in SHAPES:
        m = rows(results)[("train", shape)]["metrics"]
        assert m["params"] == TINY_PARAMS[shape]
        # 2 groups x 4 answers of 8-24 tokens after a 16-token prompt
        assert 8 * (16 + 8) <= m["tokens"] <= 8 * (16 + 24)
        assert m["flops"] == 6 * TINY_PARAMS[shape] * m["tokens"]
        assert m["mfu"] == pytest.approx(m["flops"] / m["step_s"] / peak, rel=1e-12)
        assert m["step_s"] == pytest.approx(sum(m["step_times"]) / len(m["step_times"]))
        assert m["peak_memory_bytes"] > 0


def test_decode_counts_tokens_and_bytes_and_its_limit_is_bandwidth_over_bytes_read(shapes_run):
    _, results, _ = shapes_run
    bandwidth = results["calibration"]["copy_bytes_per_s"]
    for shape in SHAPES:
        params = rows(results)[("train", shape)]["metrics"]["params"]
        vocab = rows(results)[("build", "")]["metrics"][shape]["shape"]["vocab_size"]
        assert vocab == 320
        decode = rows(results)[("decode", shape)]["metrics"]
        for batch in (1, 64):
            r = decode[f"batch_{batch}"]
            # 16 new tokens each; the first (or two) come with admission, not counted
            assert r["tokens"] in (14 * batch, 15 * batch)
            assert r["tokens"] == r["steps"] * batch
            assert r["weight_bytes"] == 2 * (vocab * 64 + params)  # tied head, bf16
            assert r["bytes"] == r["steps"] * r["weight_bytes"] + r["kv_bytes"]
            assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
            assert r["limit_tokens_per_s"] == pytest.approx(r["tokens"] * bandwidth / r["bytes"])
            assert r["tokens_per_s"] > 0
        # speeds are the check's figures to print, not asserted: a shared CPU reorders them


def test_published_weights_are_served_bit_for_bit_with_the_trainers_logprobs(shapes_run):
    _, results, _ = shapes_run
    for shape in SHAPES:
        m = rows(results)[("publish", shape)]["metrics"]
        assert m["published_version"] == m["served_version"] == 3  # one warm-up, two timed
        assert m["digest_equal"] is True
        assert m["save_s"] > 0 and m["load_s"] > 0 and m["bytes"] > 0
        assert m["logprob_tokens"] == 4 * 8
        # bf16 on both sides, in another op order: a few bf16 roundings of the logits
        assert m["logprob_gap_max"] < 0.05


@pytest.mark.slow
def test_all_steps_with_device_tests_and_grpo(tmp_path):
    done, results = run_check(tmp_path, "tests", "shapes", "grpo")
    steps = rows(results)
    assert steps[("device tests", "")]["status"] == "passed", steps[("device tests", "")]
    ipc, disk = (steps[(f"grpo {sync}", "smollm2-135m")] for sync in ("ipc", "disk"))
    assert ipc["status"] == "skipped" and "needs a GPU" in ipc["error"]  # CPU: disk only
    assert disk["status"] == "passed", disk["error"]
    assert disk["metrics"]["steps"] == 2 and disk["metrics"]["logprob_gap_max"] < 0.1
    assert done.returncode == 0, done.stdout[-3000:]


# The `moe` step's tiny Qwen3-MoE (make_tiny_model's defaults): per layer q and o 64x64, k and
# v 64x32, q and k norms of 32, the router 8x64, 8 experts' gate_up 64x64 and down 64x32, two
# norms of 64; two layers, the final norm and the tied 320 x 64 embedding.
MOE_LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 32 + 8 * 64 + 8 * (64 * 64 + 64 * 32) + 2 * 64
# The `lora` step's adapters on the tiny SmolLM2 shape, rank 16, all-linear: per layer
# A [16, in] and B [out, 16] of q (64 -> 64), k and v (64 -> 32), o (64 -> 64), gate and up
# (64 -> 128) and down (128 -> 64).
LORA_LAYER = 16 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64))


@pytest.mark.slow  # ~30 s; tests/unit/trainer/test_lora_moe.py serves LoRA-on-MoE log-probs
def test_lora_and_moe_steps_serve_the_trainers_logprobs(tmp_path):
    done, results = run_check(tmp_path, "lora", "moe")
    steps = rows(results)
    assert [(s["name"], s["shape"]) for s in results["steps"]][2:] == [
        ("lora", "smollm2-135m"), ("moe", "qwen3-moe")], done.stdout[-3000:]
    assert all(s["status"] == "passed" for s in results["steps"]), done.stdout[-3000:]
    lora = steps[("lora", "smollm2-135m")]["metrics"]
    assert lora["adapter_tensors"] == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
    assert lora["adapter_tensor_bytes"] == 2 * 2 * LORA_LAYER  # bf16, 2 layers
    assert lora["full_bytes"] == 2 * (320 * 64 + TINY_PARAMS["smollm2-135m"])
    assert lora["served_version"] == 1 and lora["logprob_tokens"] == 4 * 8
    assert lora["logprob_gap_max"] < 0.05  # bf16 on both sides, as the full publish
    moe = steps[("moe", "qwen3-moe")]["metrics"]
    assert moe["params"] == 2 * MOE_LAYER + 64 + 320 * 64
    assert moe["logprob_tokens"] == 4 * 8
    assert moe["replay_gap_max"] < 0.05  # bf16 trainer on the engine's own routes
    assert moe["router_aux_loss"] > 0 and moe["grad_norm"] > 0
    assert moe["logprob_change_max"] > 1e-3  # the step did train
    table = (tmp_path / "table.md").read_text()
    assert "## LoRA (all-linear" in table and "## Qwen3-MoE step" in table
    assert done.returncode == 0
