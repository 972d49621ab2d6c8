"""`asyncrl plan`: parameter counts against HF's models, the trainer's bytes worked out by
hand, the device totals, and advice that names the keys to change."""

import pytest
import torch
import transformers

from asyncrl.cli import main as cli_main
from asyncrl.config import load_config
from asyncrl.controller.plan import RUNTIME_BYTES, GiB, ModelShape, plan_run, plan_trainer

DATA = "train_dataset.path=python:toy:items"  # never loaded by the plan
COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=96)


def _hf(kind, tied, **extra):
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[kind]
    config = config_cls(**COMMON, tie_word_embeddings=tied, **extra)
    return config, model_cls(config)


@pytest.mark.parametrize("kind, tied, extra", [
    ("llama", True, {}), ("llama", False, {}), ("qwen2", True, {}), ("qwen3", False, {}),
    ("qwen3_moe", False, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
])
def test_parameter_count_equals_the_hf_model_s(kind, tied, extra):
    config, model = _hf(kind, tied, **extra)
    shape = ModelShape.from_config(config.to_dict())
    assert shape.n_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"], ["down_proj"]])
def test_lora_parameters_equal_rank_times_in_plus_out_of_each_targeted_linear(targets):
    config, model = _hf("qwen3", False)
    wanted = None if targets == ["all-linear"] else set(targets)
    by_hand = sum(8 * (m.in_features + m.out_features) for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and name != "lm_head"
                  and (wanted is None or name.rsplit(".", 1)[-1] in wanted))
    assert ModelShape.from_config(config.to_dict()).lora_params(8, targets) == by_hand


def test_unknown_lora_targets_are_named():
    shape = ModelShape.from_config(_hf("llama", True)[0].to_dict())
    with pytest.raises(ValueError, match=r"actor.target_modules \['qkv'\]"):
        shape.lora_params(8, ["qkv"])


def test_trainer_bytes_worked_out_by_hand():
    shape = ModelShape(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    # per layer: q 64*64, k and v 64*32 each, o 64*64, gate/up/down 3*64*128, two norms
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    p = 2 * layer + 1000 * 64 + 64
    assert shape.n_params == p
    plan = plan_trainer(shape, world_size=2, device="cuda", tokens_per_mb=100)
    assert plan["weights (fp32 master)"] == 4 * p // 2
    assert plan["gradients (fp32)"] == 4 * p // 2 and plan["optimiser (AdamW fp32)"] == 8 * p // 2
    assert plan["weights (compute copy)"] == 2 * (2 * layer + 1000 * 64 + 64)
    # 2 bytes x (4 x 64 + 4 x 4 x 16 + 4 x 128) per token and layer; the head's chunk: 3 x 4 B
    per_token_layer = 2 * (4 * 64 + 4 * 4 * 16 + 4 * 128)
    assert plan["activations"] == 2 * 100 * per_token_layer + 3 * 100 * 1000 * 4
    checkpointed = plan_trainer(shape, world_size=2, device="cuda", tokens_per_mb=100,
                                gradient_checkpointing=True)
    assert checkpointed["activations"] == (2 * 100 * 64 * 2 + 100 * per_token_layer
                                           + 3 * 100 * 1000 * 4)
    lora = plan_trainer(shape, world_size=1, device="cpu", tokens_per_mb=100, trainable=5000)
    assert lora["gradients (fp32)"] == 4 * 5000 and lora["optimiser (AdamW fp32)"] == 8 * 5000
    assert lora["weights (compute copy)"] == 2 * p  # one CPU rank keeps a bf16 copy of all


def test_a_cpu_run_adds_every_rank_and_server_on_the_machine(tmp_path):
    from asyncrl.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m")
    cfg = load_config(None, [f"actor.path={path}", f"tokenizer_path={path}", DATA,
                             "allocation_mode=local:d2+fsdp:d2"])
    plan = plan_run(cfg, device_bytes=64 * GiB)
    assert (plan.ranks_per_device, plan.servers_per_device) == (2, 2)
    assert plan.device_total == 2 * plan.trainer_total + 2 * plan.server_total
    assert plan.trainer["runtime"] == RUNTIME_BYTES["cpu"] and plan.fits


def test_a_run_that_does_not_fit_says_which_keys_to_change(capsys):
    cfg = load_config(None, [DATA, "actor.path=Qwen/Qwen3-8B", "tokenizer_path=Qwen/Qwen3-8B",
                             "cluster.n_gpus_per_node=8", "allocation_mode=vllm:d4+fsdp:d1"])
    plan = plan_run(cfg, device_bytes=80 * GiB)
    # 8.19B parameters on one rank: 16 bytes each of masters, gradients and AdamW
    assert plan.trainer["weights (fp32 master)"] == 4 * ModelShape.of("Qwen/Qwen3-8B").n_params
    assert not plan.fits
    # the fewest ranks (doubling) whose sharding of masters, gradients and AdamW saves the
    # overshoot: 122 GiB of them, 92 GiB over; d4 saves 91.6, d8 107
    states = 16 * ModelShape.of("Qwen/Qwen3-8B").n_params
    over = plan.device_total - 80 * GiB
    assert states - states / 4 < over < states - states / 8
    assert any("allocation_mode fsdp:d8" in a for a in plan.advice)
    assert any("actor.use_lora=true" in a for a in plan.advice)
    code = cli_main(["plan", DATA, "actor.path=Qwen/Qwen3-8B", "tokenizer_path=Qwen/Qwen3-8B",
                     "cluster.n_gpus_per_node=8", "allocation_mode=vllm:d4+fsdp:d1",
                     "--device-gb", "80"])
    out = capsys.readouterr().out
    assert code == 1 and "does NOT fit in 80.0 GiB" in out and "fsdp:d8" in out


def test_an_unknown_hub_model_asks_for_a_local_folder():
    with pytest.raises(FileNotFoundError, match="give its local HF folder"):
        ModelShape.of("nobody/none-7B")


def test_a_lora_run_trains_only_the_adapters_and_keeps_no_reference_copy(tmp_path):
    from asyncrl.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m")
    shape = ModelShape.of(path)
    args = [DATA, f"actor.path={path}", f"tokenizer_path={path}", "actor.kl_ctl=0.1"]
    full = plan_run(load_config(None, args), device_bytes=64 * GiB)
    lora = plan_run(load_config(None, args + ["actor.use_lora=true", "actor.lora_rank=4",
                                              "actor.target_modules=[q_proj,v_proj]"]),
                    device_bytes=64 * GiB)
    adapters = shape.lora_params(4, ["q_proj", "v_proj"])
    assert lora.trainer["gradients (fp32)"] == 4 * adapters
    assert lora.trainer["optimiser (AdamW fp32)"] == 8 * adapters
    assert full.trainer["gradients (fp32)"] == 4 * shape.n_params
    # the KL reference: a second model without LoRA, the base itself with it
    assert "reference/teacher weights" in full.trainer
    assert "reference/teacher weights" not in lora.trainer
