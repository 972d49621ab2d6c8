"""`asyncrl plan`: parameter counts against HF's models, the trainer's bytes worked out by
hand, the device totals, and advice that names the keys to change."""

import pytest
import torch
import transformers

from asyncrl.cli import main as cli_main
from asyncrl.config import load_config
from asyncrl.controller.plan import (
    RUNTIME_BYTES,
    GiB,
    ModelShape,
    TrainLayout,
    plan_run,
    plan_trainer,
    train_layout,
)

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
    # two CPU ranks: FSDP, and the trainer's fused CPU paths
    plan = plan_trainer(shape, layout=TrainLayout(2), device="cpu", tokens_per_mb=100)
    assert plan["weights (fp32 master)"] == 4 * p // 2
    assert plan["gradients (fp32)"] == 4 * p // 2 and plan["optimiser (AdamW fp32)"] == 8 * p // 2
    assert plan["weights (compute copy)"] == 2 * (2 * layer + 1000 * 64 + 64)
    # 2 bytes x (4 x 64 + 4 x 4 x 16 + 4 x 128) per token and layer; the head's chunk: 3 x 4 B
    per_token_layer = 2 * (4 * 64 + 4 * 4 * 16 + 4 * 128)
    assert plan["activations"] == 2 * 100 * per_token_layer + 3 * 100 * 1000 * 4
    checkpointed = plan_trainer(shape, layout=TrainLayout(2), device="cpu", tokens_per_mb=100,
                                gradient_checkpointing=True)
    assert checkpointed["activations"] == (2 * 100 * 64 * 2 + 100 * per_token_layer
                                           + 3 * 100 * 1000 * 4)
    lora = plan_trainer(shape, device="cpu", tokens_per_mb=100, adapters=5000)
    assert lora["gradients (fp32)"] == 4 * 5000 and lora["optimiser (AdamW fp32)"] == 8 * 5000
    # the frozen base stays in fp32 (the engine loads it so) beside the adapters' masters
    assert lora["weights (fp32 master)"] == 4 * (p + 5000)
    assert lora["weights (compute copy)"] == 2 * (p + 5000)  # one CPU rank: a bf16 copy of all


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
    assert any("allocation_mode vllm:d4+fsdp:d8 (8 ranks)" in a for a in plan.advice)
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


# A 2-layer Qwen3 worked out by hand: vocab 1000, hidden 64, 4 heads and 2 KV heads of 16,
# MLP 128, tied embeddings.
SMALL = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128)
# q 64x64 + k, v 64x32 + o 64x64 = 12288; gate, up, down 3 x 64 x 128 = 24576
SPLIT = 12288 + 24576
WHOLE = 2 * 64 + 2 * 16  # the two RMSNorms and q_norm, k_norm
EMBEDDING = 1000 * 64 + 64  # tied embedding and head, and the final norm
N = 2 * (SPLIT + WHOLE) + EMBEDDING  # 138112
# the same with 4 experts of 32 (top 2) instead of the MLP, untied
MOE = dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
EXPERTS = 4 * 3 * 64 * 32  # 24576 per layer
MOE_WHOLE = WHOLE + 4 * 64  # and the router
MOE_N = 2 * (12288 + EXPERTS + MOE_WHOLE) + 2 * 1000 * 64 + 64  # 202624


def _small(moe=False):
    if moe:
        config = transformers.Qwen3MoeConfig(**MOE, tie_word_embeddings=False)
        return config, transformers.Qwen3MoeForCausalLM(config)
    config = transformers.Qwen3Config(**SMALL, tie_word_embeddings=True)
    return config, transformers.Qwen3ForCausalLM(config)


def test_the_small_models_hand_counts_equal_hf_s_numel():
    for moe, by_hand in ((False, N), (True, MOE_N)):
        config, model = _small(moe)
        assert by_hand == sum(p.numel() for p in model.parameters())
        assert ModelShape.from_config(config.to_dict()).n_params == by_hand
    assert (N, MOE_N) == (138112, 202624)


def test_published_parameter_counts_of_known_hub_models():
    # the totals of the models' safetensors indexes (hub model cards: 8.2B, 30.5B)
    assert ModelShape.of("Qwen/Qwen3-8B").n_params == 8_190_735_360
    assert ModelShape.of("Qwen/Qwen3-30B-A3B").n_params == 30_532_122_624


def _states(plan):
    return (plan["weights (fp32 master)"], plan["gradients (fp32)"],
            plan["optimiser (AdamW fp32)"])


@pytest.mark.parametrize("layout, held", [
    (TrainLayout(2), N),  # d2: every parameter, halved by FSDP
    (TrainLayout(1, 2), 2 * (SPLIT // 2 + WHOLE) + EMBEDDING),  # t2: 101248 on each rank
    (TrainLayout(2, 2), 2 * (SPLIT // 2 + WHOLE) + EMBEDDING),  # d2t2: that, halved
])
def test_dense_rank_bytes_under_data_and_tensor_parallelism(layout, held):
    shape = ModelShape.from_config(_small()[0].to_dict())
    plan = plan_trainer(shape, layout=layout, device="cuda", tokens_per_mb=100)
    d = layout.data
    assert _states(plan) == (4 * held // d, 4 * held // d, 8 * held // d)
    # FSDP gathers two of the rank's layers and the root group in bf16
    assert plan["weights (compute copy)"] == 2 * (2 * (SPLIT // layout.tensor + WHOLE)
                                                  + EMBEDDING)
    # HF's modules on a GPU, per token and layer: 16 B per hidden unit, 10 per query and KV
    # head dimension (Qwen3's fp32 q/k norms), 8 per MLP unit, the last two split t ways;
    # the head's chunk: 3 x 4 B per token and vocabulary entry
    per_token_layer = 16 * 64 + (10 * (64 + 32) + 8 * 128) // layout.tensor
    assert per_token_layer == {1: 3008, 2: 2016}[layout.tensor]
    assert plan["activations"] == 2 * 100 * per_token_layer + 3 * 100 * 1000 * 4


# The rank's share under expert parallelism: half of each layer's experts (2 x 24576 / 2 =
# 24576), FSDP-sharded over the d ranks holding the same ones; everything else (attention,
# norms, routers, embeddings: 202624 - 49152 = 153472) FSDP-sharded over all d x e ranks.
@pytest.mark.parametrize("layout, sharded", [
    (TrainLayout(1, 1, 2), 24576 + 153472 // 2),  # e2: 101312, MOE_N / 2
    (TrainLayout(2, 1, 2), 24576 // 2 + 153472 // 4),  # d2e2: 50656, MOE_N / 4
    (TrainLayout(2), MOE_N // 2),  # d2: every expert on every rank, halved by FSDP
])
def test_moe_rank_bytes_under_expert_parallelism(layout, sharded):
    shape = ModelShape.from_config(_small(moe=True)[0].to_dict())
    assert 2 * EXPERTS + 153472 == MOE_N
    plan = plan_trainer(shape, layout=layout, device="cuda", tokens_per_mb=100)
    assert _states(plan) == (4 * sharded, 4 * sharded, 8 * sharded)
    # the compute copy: two layers gathered, each with the rank's experts, and the root group
    layer = 12288 + EXPERTS // layout.expert + MOE_WHOLE
    assert plan["weights (compute copy)"] == 2 * (2 * layer + 2 * 1000 * 64 + 64)
    # per token and layer: 2 B x (4 x 64 + 4 x 4 x 16 + top 2 x (2 x 64 + 4 x 32)) and the
    # router's bf16 logits and fp32 probabilities over 4 experts
    assert shape.activation_bytes_per_token_layer(2) == 2 * (256 + 256 + 512) + 4 * 6 == 2072


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hf_layer_activations_match_what_autograd_saves(kind):
    # an independent count: the bytes of every tensor autograd keeps for one HF decoder
    # layer's backward (saved-tensor hooks, each storage once, the layer's input included)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    config = config_cls(vocab_size=1000, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=64)
    config._attn_implementation = "sdpa"
    model = model_cls(config).to(torch.bfloat16)
    layer, tokens = model.model.layers[0], 256
    x = torch.randn(1, tokens, 512, dtype=torch.bfloat16, requires_grad=True)
    position = torch.arange(tokens)[None]
    saved = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        layer(x, position_embeddings=model.model.rotary_emb(x, position), attention_mask=None,
              position_ids=position)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    counted = sum(n for ptr, n in saved.items() if ptr not in weights) / tokens
    shape = ModelShape.from_config(config.to_dict())
    planned = shape.activation_bytes_per_token_layer(2, hf_modules=True)
    # what the plan leaves out: the rotary embedding's cos and sin, a few bytes per token
    assert 0 <= counted - planned < 0.02 * counted


def test_lora_adapters_equal_peft_s_and_train_alone_on_a_frozen_fp32_base():
    import peft

    config, model = _small()
    peft.inject_adapter_in_model(peft.LoraConfig(r=8, target_modules="all-linear"), model)
    by_peft = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    # per layer 8 x ((64+64) + 2 x (64+32) + (64+64) + 2 x (64+128) + (128+64)) = 8192
    assert by_peft == 2 * 8192
    shape = ModelShape.from_config(config.to_dict())
    assert shape.lora_params(8) == by_peft
    plan = plan_trainer(shape, device="cpu", tokens_per_mb=100, adapters=by_peft)
    assert _states(plan) == (4 * (N + 16384), 4 * 16384, 8 * 16384)
    d2 = plan_trainer(shape, layout=TrainLayout(2), device="cuda", tokens_per_mb=100,
                      adapters=by_peft)
    assert _states(d2) == (2 * (N + 16384), 2 * 16384, 4 * 16384)


def _trainer_lora(model, targets):
    """trainer/lora.py's adapters on `model` (rank 8): its trainable parameters' count."""
    from asyncrl.config.engine import TrainEngineSpec
    from asyncrl.trainer.lora import add_adapters

    add_adapters(model, TrainEngineSpec(path="unused", use_lora=True, lora_rank=8,
                                        target_modules=tuple(targets)))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"]])
def test_lora_on_moe_counts_what_the_trainer_trains(targets):
    pytest.importorskip("peft")
    config, model = _small(moe=True)
    shape = ModelShape.from_config(config.to_dict())
    # all-linear on an MoE model: the attention's q, k, v and o of both layers,
    # 8 x ((64+64) + (64+32) + (64+32) + (64+64)) each
    by_hand = {"all-linear": 2 * 8 * (128 + 96 + 96 + 128), "q_proj": 2 * 8 * (128 + 96)}
    assert shape.lora_params(8, targets) == _trainer_lora(model, targets) == by_hand[targets[0]]


@pytest.mark.parametrize("targets", [["q_proj", "gate"], ["experts"]])
def test_lora_on_the_router_or_experts_is_refused_as_the_trainer_refuses_it(targets):
    pytest.importorskip("peft")
    config, model = _small(moe=True)
    with pytest.raises(ValueError) as planned:
        ModelShape.from_config(config.to_dict()).lora_params(8, targets)
    with pytest.raises(ValueError) as trained:
        _trainer_lora(model, targets)
    assert str(planned.value) == str(trained.value)
    assert "adapts the MoE router or experts" in str(planned.value)


def test_train_layout_is_the_trainer_s_reading_of_actor_backend():
    from asyncrl.config.allocation import parse_train_backend

    for text, want in (("fsdp:d2e4", (2, 1, 4)), ("fsdp:d2t2", (2, 2, 1)), ("e4d2", (2, 1, 4))):
        assert train_layout(text) == parse_train_backend(text) == TrainLayout(*want)
    assert train_layout(None, 3) == TrainLayout(3)
    assert TrainLayout(2, 1, 4).world_size == 8 and TrainLayout(2, 1, 4).spelling == "fsdp:d2e4"
    for bad in ("fsdp:d2t2e2", "fsdp:d2d2", "fsdp:x4", "fsdp:d0"):
        with pytest.raises(ValueError, match="actor.backend") as planned:
            train_layout(bad)
        with pytest.raises(ValueError) as trained:
            parse_train_backend(bad)
        assert str(planned.value) == str(trained.value)
    with pytest.raises(ValueError, match="tensor .t2. and expert .e2. parallel training "
                                         "together are not supported"):
        load_config(None, [DATA, "actor.backend=fsdp:d2t2e2"])


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from asyncrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe")


@pytest.mark.parametrize("arch, extra, backend", [
    ("qwen3_moe", [], "fsdp:d1e3"),  # 8 experts: e3 does not divide them
    ("llama", [], "fsdp:d1e2"),  # no experts to split
    ("qwen3_moe", ["actor.use_lora=true"], "fsdp:d1e2"),  # LoRA trains data parallel only
    ("qwen3_moe", [], "fsdp:d1t2"),  # tensor parallel training splits dense layers only
    ("llama", [], "fsdp:d1t4"),  # 2 heads: t4 does not divide them
])
def test_the_plan_refuses_the_layouts_the_trainer_refuses(tiny_moe, tmp_path, arch,
                                                                 extra, backend):
    from transformers import AutoModelForCausalLM

    from asyncrl.config.allocation import check_lora_layout, parse_train_backend
    from asyncrl.models.tiny import make_tiny_model
    from asyncrl.trainer import experts, parallel

    path = tiny_moe if arch == "qwen3_moe" else make_tiny_model(tmp_path / "dense")
    cfg = load_config(None, [DATA, f"actor.path={path}", f"tokenizer_path={path}",
                             f"actor.backend={backend}", *extra])
    with pytest.raises(ValueError) as planned:
        plan_run(cfg, device_bytes=64 * GiB)
    layout = parse_train_backend(backend)
    model = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError) as trained:  # trainer/engine.py's checks, in its order
        if layout.expert > 1:
            experts.check_model(model, layout.expert)
        if "actor.use_lora=true" in extra:
            check_lora_layout(layout, backend)
        parallel.check_model(model.config, layout.tensor)
    assert str(planned.value) == str(trained.value)
    assert backend[-2:] in str(planned.value)  # names the size: e3, e2, t2, t4


def test_the_plan_command_names_a_refused_layout_as_a_config_error(tiny_moe, capsys):
    code = cli_main(["plan", DATA, f"actor.path={tiny_moe}", f"tokenizer_path={tiny_moe}",
                     "actor.backend=fsdp:d1e3"])
    assert code == 2
    assert "config error: expert parallel size e3 (actor.backend) must divide the model's " \
        "num_experts=8" in capsys.readouterr().err


def test_an_expert_layout_the_trainer_accepts_is_planned(tiny_moe):
    cfg = load_config(None, [DATA, f"actor.path={tiny_moe}", f"tokenizer_path={tiny_moe}",
                             "actor.backend=fsdp:d1e4"])
    shape = ModelShape.of(tiny_moe)
    plan = plan_run(cfg, device_bytes=64 * GiB)
    # 1/4 of the experts on each rank, everything else sharded over the 4 ranks
    experts = shape.num_layers * shape.layer_expert_params()
    assert plan.trainer["gradients (fp32)"] == 4 * (experts // 4 + (shape.n_params - experts) // 4)
    assert plan.ranks_per_device == 4  # every rank on this CPU machine


def test_a_tensor_parallel_server_holds_its_share_of_the_weights():
    cfg = load_config(None, [DATA, "actor.path=Qwen/Qwen3-8B", "tokenizer_path=Qwen/Qwen3-8B",
                             "cluster.n_gpus_per_node=8", "allocation_mode=vllm:d1t4+fsdp:d4"])
    plan = plan_run(cfg, device_bytes=80 * GiB)
    # 8,190,735,360 bf16 weights over 4 GPUs: 4,095,367,680 bytes each
    assert plan.server["weights (bf16, 1/4 per GPU)"] == 4_095_367_680
    assert plan.server["KV cache and activations"] == int(0.9 * 80 * GiB) - 4_095_367_680
    # AReaL's per-engine spelling of the same servers
    per_engine = load_config(None, [DATA, "actor.path=Qwen/Qwen3-8B",
                                    "tokenizer_path=Qwen/Qwen3-8B", "cluster.n_gpus_per_node=16",
                                    "rollout.backend=vllm:d2t4", "actor.backend=fsdp:d4"])
    assert plan_run(per_engine, device_bytes=80 * GiB).server == plan.server


def test_advice_names_each_lever_with_the_rank_s_figure():
    args = [DATA, "actor.path=Qwen/Qwen3-8B", "tokenizer_path=Qwen/Qwen3-8B",
            "cluster.n_gpus_per_node=8", "allocation_mode=vllm:d4+fsdp:d1",
            "actor.mb_spec.max_tokens_per_mb=8192"]
    plan = plan_run(load_config(None, args), device_bytes=80 * GiB)
    advice = "\n".join(plan.advice)
    shape = ModelShape.of("Qwen/Qwen3-8B")
    base = dict(device="cuda", tokens_per_mb=8192)
    for lever, kwargs in [
        ("allocation_mode vllm:d4+fsdp:d8 (8 ranks)", dict(layout=TrainLayout(8))),
        ("allocation_mode vllm:d4+fsdp:d1t4 (4 ranks)", dict(layout=TrainLayout(1, 4))),
        ("actor.use_lora=true", dict(adapters=shape.lora_params(32))),
        ("actor.gradient_checkpointing=true", dict(gradient_checkpointing=True)),
        ("actor.mb_spec.max_tokens_per_mb=2048", dict(tokens_per_mb=2048)),
    ]:
        gib = sum(plan_trainer(shape, **(base | kwargs)).values()) / GiB
        assert f"{lever}" in advice and f"{gib:.1f} GiB per trainer rank" in advice, lever
    # d8: 16 B x 8.19B / 8 = 15.3 GiB of states, fits; t2 still does not (t4 is the first)
    assert "fsdp:d1t2" not in advice
    # the first lever saves the most
    totals = [float(a.split(": ")[-1].split(" GiB")[0]) for a in plan.advice]
    assert totals == sorted(totals)


def test_an_moe_run_is_advised_expert_parallelism_not_tensor():
    args = [DATA, "actor.path=Qwen/Qwen3-30B-A3B", "tokenizer_path=Qwen/Qwen3-8B",
            "cluster.n_gpus_per_node=8", "allocation_mode=vllm:d2t2+fsdp:d4"]
    plan = plan_run(load_config(None, args), device_bytes=80 * GiB)
    advice = "\n".join(plan.advice)
    assert "split experts over expert ranks: allocation_mode vllm:d2t2+fsdp:d4e" in advice
    assert "tensor ranks" not in advice
    # all-linear LoRA on an MoE model adapts the attention, as the trainer does
    assert "train LoRA adapters (actor.use_lora=true, lora_rank=32): " in advice
