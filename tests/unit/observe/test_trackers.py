"""W&B and SwanLab trackers of the StatsLogger, offline: what they write is read back.

No test needs network. To prove that no process (wandb-core included) needs one, run this
file in a network namespace with only the loopback interface:

    unshare --net sh -c \
        'ip link set lo up; exec .venv/bin/pytest -q tests/unit/observe/test_trackers.py'
"""

from __future__ import annotations

import json
import socket
import sys
import types
from pathlib import Path

import pytest
import yaml

from asyncrl.config import ConfigError, load_config
from asyncrl.config.schema import StatsLoggerConfig, SwanlabConfig, WandBConfig
from asyncrl.observe import StatsLogger, read_stats

# What every test logs: 3 train steps (a NaN, which no sink but the JSONL row keeps) and
# one evaluation at the last step. Trackers name scalars "<kind>/<key>", as TensorBoard,
# unless the key starts with its kind already.
TRAIN = {1: {"loss": 1.5, "train/lr": 0.1}, 2: {"loss": 3.0, "train/lr": 0.2},
         3: {"loss": 4.5, "train/lr": 0.3, "grad_norm": float("nan")}}
EVAL = {"eval/reward": 0.25, "n": 4}
EXPECTED = {1: {"train/loss": 1.5, "train/lr": 0.1}, 2: {"train/loss": 3.0, "train/lr": 0.2},
            3: {"train/loss": 4.5, "train/lr": 0.3, "eval/reward": 0.25, "eval/n": 4}}
RUN_CONFIG = {"experiment_name": "exp-a", "trial_name": "trial-b", "seed": 7,
              "agent": {"admin_key": "s3cret"}}
ENV = ("WANDB_MODE", "WANDB_ERROR_REPORTING", "SWANLAB_MODE", "SWANLAB_LOG_DIR")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """The libraries' own folders in tmp_path; env vars they set are undone afterwards."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "home").mkdir()
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "SWANLAB_SAVE_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home" / name.lower()))
    return tmp_path


@pytest.fixture
def internet_attempts(monkeypatch):
    """Each address outside this machine that Python code tries to resolve or reach."""
    attempts: list[object] = []
    local = ("localhost", "127.0.0.1", "::1", "", None)
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in local:
            attempts.append(address)
            raise OSError(f"test: no network ({address})")
        return real_connect(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if host not in local and not str(host).startswith("127."):
            attempts.append(host)
            raise socket.gaierror(f"test: no network ({host})")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts


def _log_run(run_dir: Path, cfg: StatsLoggerConfig, *, resume: bool = False) -> None:
    stats = StatsLogger(run_dir, cfg, run_config=RUN_CONFIG, resume=resume)
    for step, row in TRAIN.items():
        stats.log(step, row)
    stats.log(3, EVAL, kind="eval")
    stats.close()


def _leveldb_records(path: Path, ident: bytes):
    """The records of a W&B (.wandb) or SwanLab (backup.swanlab) file: both use LevelDB's
    log format (32 KiB blocks; records of FULL=1, or FIRST=2, MIDDLE=3, LAST=4 pieces,
    each after a 7-byte header) behind a 7-byte file header."""
    data = path.read_bytes()
    assert data[:4] == ident
    pos, pieces = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # the rest of a block is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield pieces
            pieces = b""


def _wandb_run(path: Path) -> tuple[dict, dict[int, dict[str, float]]]:
    """The run record (id, project, name, config) and the history {step: {key: value}}."""
    from wandb.proto import wandb_internal_pb2 as pb

    run, history = {}, {}
    for payload in _leveldb_records(path, b":W&B"):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.HasField("run"):
            run = {"id": record.run.run_id, "project": record.run.project,
                   "name": record.run.display_name, "tags": list(record.run.tags),
                   "config": {i.key: json.loads(i.value_json)
                              for i in record.run.config.update}}
        elif record.HasField("history"):
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in record.history.item}
            history[record.history.step.num] = {k: v for k, v in row.items()
                                                if not k.startswith("_")}
    return run, history


def test_wandb_offline_writes_every_scalar_at_its_step_and_the_config(
        home, internet_attempts):
    pytest.importorskip("wandb")
    run_dir = home / "runs" / "exp-a" / "trial-b"
    _log_run(run_dir, StatsLoggerConfig(tensorboard=False, wandb=WandBConfig(
        mode="offline", tags=["cpu"])))

    [path] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    run, history = _wandb_run(path)
    assert history == EXPECTED  # the whole file is written when the StatsLogger closes
    assert run["id"] == (run_dir / "wandb" / "run_id").read_text().strip()
    assert run["id"].endswith("-train")  # id_suffix
    assert (run["project"], run["name"], run["tags"]) == ("exp-a", "trial-b", ["cpu"])
    assert run["config"]["seed"] == 7 and run["config"]["agent"] == {"admin_key": "***"}
    assert len(read_stats(run_dir / "stats.jsonl")) == 4  # the JSONL record is unchanged
    assert internet_attempts == []


def test_wandb_resumed_run_keeps_its_id_and_a_fresh_run_gets_a_new_one(home):
    pytest.importorskip("wandb")
    run_dir = home / "runs" / "exp-a" / "trial-b"
    cfg = StatsLoggerConfig(tensorboard=False, wandb=WandBConfig(mode="offline",
                                                                  id_suffix=None))
    _log_run(run_dir, cfg)
    first = (run_dir / "wandb" / "run_id").read_text().strip()
    _log_run(run_dir, cfg, resume=True)
    _log_run(run_dir, cfg)
    ids = [_wandb_run(p)[0]["id"]
           for p in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"),
                           key=lambda p: p.stat().st_mtime_ns)]
    assert ids[:2] == [first, first] and ids[2] != first
    assert len(ids) == 3


def test_swanlab_offline_writes_every_scalar_at_its_step_and_the_config(
        home, internet_attempts):
    pytest.importorskip("swanlab")
    run_dir = home / "runs" / "exp-a" / "trial-b"
    _log_run(run_dir, StatsLoggerConfig(tensorboard=False, swanlab=SwanlabConfig(
        mode="offline")))

    [folder] = run_dir.glob("swanlab/run-*")
    records = [json.loads(r) for r in _leveldb_records(folder / "backup.swanlab", b":SWL")]
    history: dict[int, dict[str, float]] = {}
    for r in records:
        if r["model_type"] == "Scalar":
            history.setdefault(r["data"]["step"], {})[r["data"]["key"]] = \
                r["data"]["metric"]["data"]
    assert history == EXPECTED
    assert records[-1] == {"model_type": "Footer", "data": records[-1]["data"]}  # finished
    assert records[-1]["data"]["success"] is True
    names = {r["model_type"]: r["data"]["name"] for r in records
             if r["model_type"] in ("Project", "Experiment")}
    assert names == {"Project": "exp-a", "Experiment": "trial-b"}
    config = yaml.safe_load((folder / "files" / "config.yaml").read_text())
    assert config["seed"]["value"] == 7
    assert config["agent"]["value"] == {"admin_key": "***"}
    assert internet_attempts == []


@pytest.mark.parametrize("key, cfg", [
    ("wandb", StatsLoggerConfig(wandb=WandBConfig(mode="offline"))),
    ("swanlab", StatsLoggerConfig(swanlab=SwanlabConfig(mode="offline"))),
])
def test_missing_library_fails_at_start_naming_the_key(home, monkeypatch, key, cfg):
    monkeypatch.setitem(sys.modules, key, None)  # `import <key>` raises ImportError
    with pytest.raises(ConfigError, match=rf"^stats_logger\.{key}\.mode=offline needs the "
                       rf"{key} package: pip install 'asyncrl\[track\]'$"):
        StatsLogger(home / "run", cfg)
    assert not (home / "run").exists()


def test_disabled_trackers_import_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "swanlab", None)
    stats = StatsLogger(tmp_path, StatsLoggerConfig(tensorboard=False))
    stats.log(1, {"loss": 1.0})
    stats.close()


def test_swanlab_cloud_logs_in_with_the_api_key_and_never_sends_it(tmp_path, monkeypatch):
    calls: list[tuple] = []
    fake = types.ModuleType("swanlab")
    fake.login = lambda **kw: calls.append(("login", kw))
    fake.init = lambda **kw: calls.append(("init", kw))
    fake.log = lambda data, step: calls.append(("log", data, step))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "swanlab", fake)
    cfg = StatsLoggerConfig(jsonl=False, tensorboard=False, swanlab=SwanlabConfig(
        mode="cloud", project="p", api_key="k-123"))
    stats = StatsLogger(tmp_path, cfg, run_config={"swanlab": {"api_key": "k-123"}})
    stats.log(5, {"loss": 2.0})
    stats.close()
    stats.close()  # a second close finishes nothing twice
    assert calls == [
        ("login", {"api_key": "k-123", "save": False}),
        ("init", {"project": "p", "experiment_name": tmp_path.name,
                  "config": {"swanlab": {"api_key": "***"}},
                  "logdir": str(tmp_path / "swanlab"), "mode": "cloud"}),
        ("log", {"train/loss": 2.0}, 5),
        ("finish",),
    ]


@pytest.mark.parametrize("override, allowed", [
    ("stats_logger.wandb.mode=ofline", "'disabled', 'online', 'offline', 'shared'"),
    ("stats_logger.swanlab.mode=online", "'disabled', 'cloud', 'local', 'offline'"),
])
def test_unknown_tracker_mode_is_a_config_error_naming_the_key(override, allowed):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"'{key}'.*expected one of \[{allowed}\]"):
        load_config(None, ["train_dataset.path=data.jsonl", override])
    with pytest.raises(ValueError, match=rf"^{key} must be one of"):
        (WandBConfig if ".wandb." in key else SwanlabConfig)(mode="ofline")


def test_tensorboard_gets_the_same_names_and_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_run(tmp_path, StatsLoggerConfig())
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    history: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            history.setdefault(event.step, {})[tag] = event.value
    assert history.keys() == EXPECTED.keys()
    for step, row in EXPECTED.items():  # TensorBoard stores float32
        assert history[step] == pytest.approx(row)
