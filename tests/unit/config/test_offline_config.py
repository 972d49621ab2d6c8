"""SFT, DPO and RM configs: defaults, validation that names the key, typos, the CLI's errors."""

import pytest

from asyncrl import cli
from asyncrl.config import ConfigError, load_config
from asyncrl.config.offline import DPOConfig, RMConfig, SFTConfig

DATA = "train_dataset.path=d.jsonl"


def test_sft_defaults_load_and_keep_areal_names():
    cfg = load_config(None, [DATA, "model.path=m", "valid_dataset.path=v.jsonl"],
                      schema=SFTConfig)
    assert cfg.tokenizer_path == "m"  # ${model.path}
    assert cfg.model.mb_spec.granularity == 1 and cfg.model.optimizer.lr == 1e-5
    assert cfg.valid_dataset.path == "v.jsonl" and cfg.valid_dataset.format == "auto"
    assert cfg.total_train_epochs == 1 and cfg.train_dataset.batch_size == 8


def test_dpo_keeps_pairs_together_and_its_reference_follows_the_model():
    cfg = load_config(None, [DATA, "model.path=m", "model.dtype=float32"], schema=DPOConfig)
    assert cfg.model.mb_spec.granularity == 2  # (chosen, rejected) share a micro-batch
    assert (cfg.ref.path, cfg.ref.dtype) == ("m", "float32")
    assert (cfg.beta, cfg.loss_type, cfg.label_smoothing) == (0.1, "sigmoid", 0.0)


@pytest.mark.parametrize("schema", [SFTConfig, DPOConfig])
def test_lora_keys_of_the_model_section_reach_its_engine_spec(schema):
    cfg = load_config(None, [DATA, "model.path=m", "model.use_lora=true", "model.lora_rank=8",
                             "model.target_modules=[q_proj,v_proj]"], schema=schema)
    spec = cfg.model.engine_spec(device="cpu")
    assert (spec.use_lora, spec.lora_rank, spec.lora_alpha) == (True, 8, 16)
    assert spec.target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize("schema, override, message", [
    (SFTConfig, "train_dataset.batch_size=0", "train_dataset.batch_size must be >= 1"),
    (SFTConfig, "train_dataset.max_length=1", "train_dataset.max_length must be >= 2"),
    (SFTConfig, "train_dataset.format=preference", "train_dataset.format=preference is not an "
                                                    "SFT format.*asyncrl dpo"),
    (SFTConfig, "total_train_epochs=0", "total_train_epochs must be >= 1"),
    (SFTConfig, "scheduler.trainer_threads=0", "scheduler.trainer_threads must be >= 1"),
    (SFTConfig, "model.mb_spec.granularity=0", "mb_spec.granularity must be >= 1"),
    (DPOConfig, "beta=0", "beta must be > 0"),
    (DPOConfig, "label_smoothing=0.5", "label_smoothing must be in \\[0, 0.5\\)"),
    (DPOConfig, "train_dataset.format=chat", "train_dataset.format=chat is not a DPO format"),
    (DPOConfig, "model.mb_spec.granularity=3", "granularity=3 would split \\(chosen, rejected\\)"),
    (DPOConfig, "loss_type=hinge", "loss_type"),
    (RMConfig, "train_dataset.format=gsm8k",
     "train_dataset.format=gsm8k is not a reward-model format"),
    (RMConfig, "model.mb_spec.granularity=5", "granularity=5 would split .*reward-model "
                                              "training sets 2"),
    (SFTConfig, "allocation_mode=vllm:d4+fsdp:d4",
     "allocation_mode='vllm:d4\\+fsdp:d4' has an inference part .*no inference servers"),
    (DPOConfig, "allocation_mode=fsdp:x2", "allocation_mode='fsdp:x2' is not 'fsdp:d<N>'"),
    (SFTConfig, "allocation_mode=fsdp:d0", "allocation_mode='fsdp:d0' is not 'fsdp:d<N>'"),
    (RMConfig, "scheduler.type=slurm", "scheduler.type=slurm: offline training starts its"),
    (SFTConfig, "cluster.n_nodes=2", "cluster.n_nodes=2: .*set cluster.n_nodes=1"),
    (DPOConfig, "allocation_mode=fsdp:d16",
     "train_dataset.batch_size=8 is smaller than the 16 ranks of allocation_mode='fsdp:d16'"),
    (SFTConfig, "model.lora_rank=0", "model.lora_rank must be >= 1"),
    (DPOConfig, "model.peft_type=ia3", "model.peft_type must be 'lora'"),
    (RMConfig, "model.use_lora=true", "reward-model training does not take LoRA adapters"),
])
def test_bad_values_name_the_key(schema, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [DATA, override], schema=schema)


@pytest.mark.parametrize("schema", [SFTConfig, DPOConfig, RMConfig])
@pytest.mark.parametrize("mode, world", [(None, 1), ("fsdp:d8", 8), ("d2", 2), ("fsdp:d1", 1)])
def test_allocation_mode_is_the_training_part_alone(schema, mode, world):
    overrides = [DATA, "cluster.n_gpus_per_node=8"] + ([f"allocation_mode={mode}"] if mode else [])
    assert load_config(None, overrides, schema=schema).trainer_world_size == world


def test_an_inference_part_is_refused_with_the_training_part_to_keep():
    with pytest.raises(ConfigError, match="allocation_mode='vllm:d4\\+fsdp:d4' .*offline "
                                          "training \\(sft, dpo, rm\\) starts no inference "
                                          "servers; give the training part alone, e.g. "
                                          "allocation_mode=fsdp:d4"):
        load_config(None, [DATA, "allocation_mode=vllm:d4+fsdp:d4"], schema=SFTConfig)


def test_allocation_mode_needs_a_gpu_per_rank_on_a_gpu_machine():
    with pytest.raises(ConfigError, match="allocation_mode='fsdp:d8' needs 8 GPUs \\(one per "
                                          "rank\\) but cluster.n_gpus_per_node=4"):
        load_config(None, [DATA, "allocation_mode=fsdp:d8", "cluster.n_gpus_per_node=4"],
                    schema=SFTConfig)
    cpu = load_config(None, [DATA, "allocation_mode=fsdp:d8"], schema=SFTConfig)
    assert cpu.trainer_world_size == 8  # CPU ranks share the machine's cores


@pytest.mark.parametrize("schema", [SFTConfig, DPOConfig, RMConfig])
def test_missing_dataset_path_is_explained(schema):
    with pytest.raises(ConfigError, match="train_dataset.path is empty"):
        load_config(None, [], schema=schema)


def test_label_smoothing_with_ipo_is_explained():
    with pytest.raises(ConfigError, match="label_smoothing=0.1 applies to loss_type=sigmoid only"):
        load_config(None, [DATA, "loss_type=ipo", "label_smoothing=0.1"], schema=DPOConfig)


def test_valid_dataset_is_checked_like_the_train_dataset():
    with pytest.raises(ConfigError, match="valid_dataset.format=preference is not an SFT"):
        load_config(None, [DATA, "valid_dataset.path=v", "valid_dataset.format=preference"],
                    schema=SFTConfig)


@pytest.mark.parametrize("schema, typo, suggestion", [
    (DPOConfig, "bta=0.2", "'beta'"),
    (SFTConfig, "model.optimzer.lr=1e-5", "'model.optimizer'"),
    (SFTConfig, "train_dataset.max_lenght=9", "'train_dataset.max_length'"),
])
def test_typos_suggest_the_nearest_key(schema, typo, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean {suggestion}"):
        load_config(None, [DATA, typo], schema=schema)


def test_dpo_keys_are_unknown_to_sft():
    with pytest.raises(ConfigError, match="unknown config key 'beta'"):
        load_config(None, [DATA, "beta=0.1"], schema=SFTConfig)


@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_cli_reports_a_typo_with_exit_code_2(command, capsys):
    assert cli.main([command, DATA, "model.optimzer.lr=1e-5"]) == 2
    assert "did you mean 'model.optimizer'?" in capsys.readouterr().err
