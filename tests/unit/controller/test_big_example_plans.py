"""examples/big: each GPU recipe loads, fits its node by `asyncrl plan`, carries the plan's
current output in its opening comment, and has a CPU twin whose tiny model keeps the big
model's proportions."""

from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.controller.plan import ModelShape, plan_run

BIG = Path(__file__).resolve().parents[3] / "examples" / "big"
GPU_CONFIGS = sorted(p for p in BIG.glob("*.yaml") if not p.stem.endswith("_cpu"))


def pasted_plan(path: Path) -> list[str]:
    """The table under the '# asyncrl plan --config examples/big/<name>' comment line."""
    lines = path.read_text().splitlines()
    marker = f"# asyncrl plan --config examples/big/{path.name}"
    assert marker in lines, f"{path.name} has no '{marker}' comment"
    out = []
    for line in lines[lines.index(marker) + 1:]:
        if line == "#":
            break
        assert line.startswith("#   "), f"{path.name}: {line!r} is inside the pasted plan"
        out.append(line[4:])
    return out


def test_there_are_three_gpu_recipes_each_with_a_cpu_twin():
    assert [p.name for p in GPU_CONFIGS] == [
        "qwen3_30b_a3b_grpo.yaml", "qwen3_8b_grpo.yaml", "qwen3_lora_one_gpu.yaml"]
    for path in GPU_CONFIGS:
        assert path.with_name(path.stem + "_cpu.yaml").is_file()


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_the_pasted_plan_is_the_planner_s_current_output(path):
    plan = plan_run(load_config(path))
    want = plan.table().splitlines()
    assert pasted_plan(path) == want, (
        f"the plan pasted at the top of {path.name} is stale; paste this under its "
        f"'# asyncrl plan' line, each line prefixed by '#   ':\n" + "\n".join(want))
    assert plan.fits and plan.device_bytes == 80 * 2**30  # 80 GB GPUs


# What each twin's tiny model keeps of its big model's shape.
PROPORTIONS = {
    "qwen3_8b_grpo.yaml": ["kind", "heads_per_kv", "mlp_over_hidden", "tied",
                           "heads_times_dim_over_hidden"],
    "qwen3_30b_a3b_grpo.yaml": ["kind", "heads_per_kv", "mlp_over_hidden", "tied",
                                "experts_used"],
    "qwen3_lora_one_gpu.yaml": ["kind", "heads_per_kv"],
}


def _proportions(shape: ModelShape) -> dict:
    mlp = shape.moe_intermediate_size if shape.num_experts else shape.intermediate_size
    return {"kind": "moe" if shape.num_experts else "dense",
            "heads_per_kv": shape.num_heads / shape.num_kv_heads,
            "mlp_over_hidden": mlp / shape.hidden_size, "tied": shape.tie_word_embeddings,
            "heads_times_dim_over_hidden": shape.num_heads * shape.head_dim / shape.hidden_size,
            "experts_used": (shape.experts_per_token / shape.num_experts
                             if shape.num_experts else 0)}


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_each_cpu_twin_runs_the_same_recipe_on_a_model_of_the_same_proportions(
        path, tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))  # the named tiny models are built here
    big, twin = load_config(path), load_config(path.with_name(path.stem + "_cpu.yaml"))
    big_shape, tiny_shape = ModelShape.of(big.actor.path), ModelShape.of(twin.actor.path)
    assert tiny_shape.n_params < 1_000_000
    mine, theirs = _proportions(tiny_shape), _proportions(big_shape)
    for key in PROPORTIONS[path.name]:
        assert mine[key] == theirs[key], f"{path.name}'s twin: {key} {mine[key]} != {theirs[key]}"
    for key in ("use_lora", "routing_replay", "gradient_checkpointing", "use_decoupled_loss",
                "recompute_logprob"):
        assert getattr(twin.actor, key) == getattr(big.actor, key), key
    assert twin.cluster.device == "cpu" and big.cluster.device == "cuda"
    # an expert-parallel recipe's twin splits its experts too (over fewer ranks)
    expert = [c.allocation.trainer_expert_size if c.allocation else 1 for c in (big, twin)]
    assert (expert[0] > 1) == (expert[1] > 1), expert
