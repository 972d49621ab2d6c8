"""SFT, DPO and RM end to end on a tiny random model: the signal moves, stats and model written."""

import json
from pathlib import Path

import pytest

from asyncrl import cli
from asyncrl.config import load_config
from asyncrl.config.offline import DPOConfig, SFTConfig
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats
from asyncrl.offline import dpo, sft

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def common(tmp_path, model, data, name):
    return [f"experiment_name={name}", f"cluster.fileroot={tmp_path / 'runs'}",
            f"model.path={model}", "model.dtype=float32", f"train_dataset.path={data}",
            f"valid_dataset.path={data}", "valid_dataset.shuffle=false",
            "stats_logger.progress_bar=false", "stats_logger.tensorboard=false",
            "scheduler.trainer_threads=1"]


def check_run(summary, n_steps):
    """stats.jsonl: eval, the train steps, eval; the final model loads as an HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = read_stats(Path(summary["stats"]))
    assert [r["kind"] for r in rows] == ["eval"] + ["train"] * n_steps + ["eval"]
    assert [r["step"] for r in rows] == [0, *range(1, n_steps + 1), n_steps]
    assert all(r["train/grad_norm"] > 0 for r in rows if r["kind"] == "train")
    model_dir = Path(summary["model_dir"])
    assert model_dir.name == f"step{n_steps}"
    AutoModelForCausalLM.from_pretrained(model_dir)
    AutoTokenizer.from_pretrained(model_dir)
    return rows


def test_sft_memorises_a_toy_set(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "toy.jsonl", [
        {"prompt": f"Count to {n}", "answer": " ".join(str(i) for i in range(1, n + 1))}
        for n in (3, 4, 5, 6)])
    cfg = load_config(None, common(tmp_path, tiny_model, data, "sft") + [
        "train_dataset.batch_size=4", "total_train_epochs=6", "model.optimizer.lr=3e-3"],
        schema=SFTConfig)
    summary = sft.train(cfg)
    rows = check_run(summary, n_steps=6)
    before, after = summary["eval_before"]["loss"], summary["eval_after"]["loss"]
    assert after < 0.7 * before, (before, after)
    # One batch is the whole set, so step 1's loss is the held-out loss before training.
    assert rows[1]["train/loss"] == pytest.approx(before, rel=1e-4)
    assert summary["train_loss_last"] < summary["train_loss_first"]


def test_dpo_raises_the_margin_and_computes_reference_logprobs_once(tmp_path, tiny_model,
                                                                    monkeypatch):
    data = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": f"Greet {name}", "chosen": f"Hello {name}!", "rejected": f"Go away {name}."}
        for name in ("Ann", "Bob", "Cy", "Di")])
    calls = []
    original = dpo.compute_reference_logprobs

    def counting(engine, examples, **kwargs):
        calls.append(len(examples))
        return original(engine, examples, **kwargs)

    monkeypatch.setattr(dpo, "compute_reference_logprobs", counting)
    cfg = load_config(None, common(tmp_path, tiny_model, data, "dpo") + [
        "train_dataset.batch_size=2", "total_train_epochs=2", "model.optimizer.lr=1e-3",
        "model.mb_spec.max_tokens_per_mb=64", "beta=0.5"], schema=DPOConfig)
    summary = dpo.train(cfg)
    assert calls == [8]  # once, over the 4 training and 4 held-out pairs, for 2 epochs
    rows = check_run(summary, n_steps=4)
    assert all(r["train/n_mbs"] == 2 for r in rows if r["kind"] == "train")  # a pair per mb
    before, after = summary["eval_before"], summary["eval_after"]
    # The reference is the starting policy: no margin before training.
    assert before["reward_margin"] == pytest.approx(0.0, abs=1e-4)
    assert after["reward_margin"] > 0.5 and after["reward_accuracy"] == 1.0
    assert after["loss"] < before["loss"] == pytest.approx(0.6931, abs=1e-4)  # ln 2 at h = 0


def test_sft_cli_runs_the_gsm8k_example_config(tmp_path, tiny_model, gsm8k_dir, capsys):
    code = cli.main(["sft", "--config", str(REPO / "examples/sft/gsm8k_sft_cpu.yaml"),
                     f"model.path={tiny_model}", "model.dtype=float32",
                     f"train_dataset.path={gsm8k_dir}", f"valid_dataset.path={gsm8k_dir}",
                     "train_dataset.size=4", "train_dataset.batch_size=4",
                     "valid_dataset.size=2", "total_train_steps=1",
                     f"cluster.fileroot={tmp_path / 'runs'}", "stats_logger.progress_bar=false",
                     "stats_logger.tensorboard=false", "scheduler.trainer_threads=1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "held-out loss" in out and "model_dir" in out
    run = tmp_path / "runs" / "gsm8k-sft-cpu" / "trial0"
    assert [r["kind"] for r in read_stats(run / "stats.jsonl")] == ["eval", "train", "eval"]
    assert (run / "checkpoints" / "step1" / "model.safetensors").is_file()


def test_rm_entry_point_runs_the_example_config_on_a_folder_with_saves_and_system_prompt(
        tmp_path, tiny_model, capsys):
    from transformers import AutoConfig

    from asyncrl.offline import rm

    data = tmp_path / "prefs"  # a folder: the keys RM gained from the shared config work
    data.mkdir()
    write_jsonl(data / "train.jsonl", [
        {"prompt": f"Greet {name}", "chosen": f"Hello {name}!", "rejected": f"Go away {name}."}
        for name in ("Ann", "Bob", "Cy", "Di")])
    # `python -m asyncrl.offline.rm` is `asyncrl rm`.
    code = rm.main(["--config", str(REPO / "examples/rm/preference_rm_cpu.yaml"),
                    f"model.path={tiny_model}", "model.dtype=float32",
                    f"train_dataset.path={data}", f"valid_dataset.path={data}",
                    "valid_dataset.split=train", "train_dataset.batch_size=2",
                    "total_train_steps=2", "saver.freq_steps=1", "system_prompt=Be fair.",
                    f"cluster.fileroot={tmp_path / 'runs'}", "stats_logger.progress_bar=false",
                    "stats_logger.tensorboard=false", "scheduler.trainer_threads=1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "held-out accuracy" in out and "model_dir" in out
    run = tmp_path / "runs" / "preference-rm-cpu" / "trial0"
    rows = read_stats(run / "stats.jsonl")
    assert [r["kind"] for r in rows] == ["eval", "train", "train", "eval"]
    assert all(r["train/n_seqs"] == 4 for r in rows if r["kind"] == "train")  # 2 pairs
    for step in (1, 2):  # saver.freq_steps=1 saves step 1; the final model is step 2
        config = AutoConfig.from_pretrained(run / "checkpoints" / f"step{step}")
        assert config.num_labels == 1 and config.system_prompt == "Be fair."


@pytest.fixture
def trained_weights(monkeypatch):
    """The weights of each LoRA engine an offline run trained, taken as it is destroyed:
    {name: (tensor, requires_grad)} per engine."""
    from torch.distributed.tensor import DTensor

    from asyncrl.trainer import FSDPTrainEngine

    taken, destroy = [], FSDPTrainEngine.destroy

    def take_then_destroy(engine):
        if engine.lora_config is not None:
            taken.append({n.removeprefix("hf."): (
                (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone(),
                p.requires_grad) for n, p in engine.model.named_parameters()})
        destroy(engine)

    monkeypatch.setattr(FSDPTrainEngine, "destroy", take_then_destroy)
    return taken


def check_only_adapters_trained(weights, base_dir, model_dir, targets):
    """Every base weight is the base file's, bit for bit; the trainable parameters are the
    adapters of `targets` alone, every B moved from its zero start; the saved model is the
    adapter folder of exactly those."""
    import torch
    from safetensors.torch import load_file

    base = load_file(str(Path(base_dir) / "model.safetensors"))
    trainable = sorted(n for n, (_, grad) in weights.items() if grad)
    modules = sorted({n.split(".lora_")[0] for n in trainable})
    assert modules and all(m.rsplit(".", 1)[1] in targets for m in modules)
    assert trainable == sorted(f"{m}.lora_{ab}.default.weight" for m in modules for ab in "AB")
    assert all(weights[f"{m}.lora_B.default.weight"][0].abs().max() > 0 for m in modules)
    frozen = {n.replace(".base_layer.", "."): t for n, (t, grad) in weights.items() if not grad}
    assert set(base) <= set(frozen)
    assert all(torch.equal(frozen[n], base[n].float()) for n in base)
    saved = load_file(str(Path(model_dir) / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(f"base_model.model.{m}.lora_{ab}.weight"
                                   for m in modules for ab in "AB")
    config = json.loads((Path(model_dir) / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert not (Path(model_dir) / "model.safetensors").exists()


LORA = ["model.use_lora=true", "model.lora_rank=4", "model.lora_alpha=8"]


def test_sft_with_lora_trains_the_adapters_alone_and_saves_their_folder(
        tmp_path, tiny_model, trained_weights):
    pytest.importorskip("peft")
    data = write_jsonl(tmp_path / "toy.jsonl", [
        {"prompt": f"Count to {n}", "answer": " ".join(str(i) for i in range(1, n + 1))}
        for n in (3, 4, 5, 6)])
    cfg = load_config(None, common(tmp_path, tiny_model, data, "sft-lora") + LORA + [
        "train_dataset.batch_size=4", "total_train_epochs=6", "model.optimizer.lr=3e-2"],
        schema=SFTConfig)
    summary = sft.train(cfg)
    assert summary["eval_after"]["loss"] < 0.9 * summary["eval_before"]["loss"]
    [weights] = trained_weights
    all_linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    check_only_adapters_trained(weights, tiny_model, summary["model_dir"], all_linear)


def test_dpo_with_lora_trains_the_adapters_alone_and_saves_their_folder(
        tmp_path, tiny_model, trained_weights):
    pytest.importorskip("peft")
    data = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": f"Greet {name}", "chosen": f"Hello {name}!", "rejected": f"Go away {name}."}
        for name in ("Ann", "Bob", "Cy", "Di")])
    cfg = load_config(None, common(tmp_path, tiny_model, data, "dpo-lora") + LORA + [
        "model.target_modules=[q_proj,v_proj]", "train_dataset.batch_size=2",
        "total_train_epochs=2", "model.optimizer.lr=1e-2", "beta=0.5"], schema=DPOConfig)
    summary = dpo.train(cfg)
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["reward_margin"] == pytest.approx(0.0, abs=1e-4)  # B = 0: the reference
    assert after["reward_margin"] > 0 and after["loss"] < before["loss"]
    [weights] = trained_weights  # the reference engine has no adapters
    check_only_adapters_trained(weights, tiny_model, summary["model_dir"], ("q_proj", "v_proj"))
