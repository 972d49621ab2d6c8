"""One GPU check: asyncrl's device paths, measured and tested, in one command of <= 8 minutes.

    python3 benchmarks/gpu/check.py --out DIR --assets .gpu            # on the GPU machine
    python3 benchmarks/gpu/check.py --out DIR --device cpu             # the same, tiny, on CPU

Needs no network and no model weights: `benchmarks/gpu/prepare.py` writes the assets folder
(the pure-Python wheels asyncrl imports that the machine may lack, SmolLM2's tokenizer).
Missing imports are installed from it into a temporary folder (`pip install --no-index
--no-deps --target`), which children get on their PYTHONPATH. Random bf16 models of
SmolLM2-135M's, Qwen3-0.6B's and Qwen3-1.7B's published shapes are built on the device into
a temporary folder (tiny ones, hidden size 64, on `--device cpu`). Then, each step in a child
process of its own with a bounded time (the whole run within `--budget` seconds):

- calibrate: the device's bf16 matmul peak and device-copy bandwidth, measured;
- device tests: `ASYNCRL_TEST_DEVICE=<device> pytest -m device`;
- per shape: training steps in bf16 through FSDPTrainEngine (MFU against the measured peak,
  peak memory), LocalEngine decode at batch 1 and 64 (against the bandwidth limit), and
  publishing the trainer's bf16 weights to a folder and loading them into the engine (with
  the trainer's log-probs against the engine's on the engine's samples, at equal weights);
- lora: LoRA (all-linear) steps in bf16 on the SmolLM2 shape, the adapters alone published
  and merged by the local engine, whose sampled log-probs are checked against the trainer's;
- moe: a Qwen3-MoE (built by the step) sampled by the local engine with its routes recorded,
  the trainer's log-probs on them with routing replay, and a bf16 training step with replay
  and the router load-balancing loss;
- async GRPO with trainer and server on the one device (`grpo_one_gpu.run`), IPC and disk.
Tensor (and expert) parallel training needs two ranks, hence two GPUs (NCCL refuses two
ranks on one): not checked here; the CPU tests run them over gloo.

DIR gets table.md (the tables printed at the end), results.json (every measurement and
derived figure, each step's status, error and traceback), check.log (versions, the device,
what ran) and logs/ (each child's output). A failing step does not stop the others; the exit
status is 1 if any step failed or timed out. benchmarks/gpu/README.md says what each column
means.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SHAPES = ("smollm2-135m", "qwen3-0.6b", "qwen3-1.7b")
# --steps: what runs besides build and calibrate
STEP_NAMES = ("tests", "shapes", "lora", "moe", "grpo")
GRPO_SYNCS = ("ipc", "disk")
FEATURES = {"lora": SHAPES[0], "moe": "qwen3-moe"}  # step: the model it runs on
VERSIONS = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "aiohttp",
            "accelerate", "pytest", "omegaconf", "math-verify")
# What asyncrl imports beyond torch, transformers and the like, by the wheel that brings it.
NEEDED_MODULES = ("omegaconf", "math_verify", "latex2sympy2_extended", "antlr4",
                  "pytest_timeout")
log = logging.getLogger("check")


@dataclass
class Step:
    """One row of the summary: a child process's part, or a step that did not run."""

    name: str
    shape: str = ""
    status: str = "not run"  # passed | failed | timeout | skipped | not available
    seconds: float = 0.0
    error: str = ""
    log: str = ""
    metrics: dict = field(default_factory=dict)


@dataclass
class Plan:
    """Per-step time caps (s), the least each later step is left, and the run's sizes."""

    budget: float
    caps: dict
    floors: dict
    grpo_steps: int


PLANS = {
    # GPU: the run's ~8 minutes less start-up and the tables; the 1.7B shape's load and
    # steps take the longest.
    "cuda": Plan(budget=450, grpo_steps=3,
                 caps={"build": 150, "calibrate": 60, "tests": 120, "smollm2-135m": 80,
                       "qwen3-0.6b": 90, "qwen3-1.7b": 150, "lora": 60, "moe": 90, "grpo": 90},
                 floors={"build": 40, "calibrate": 15, "tests": 30, "smollm2-135m": 30,
                         "qwen3-0.6b": 35, "qwen3-1.7b": 60, "lora": 25, "moe": 35,
                         "grpo": 40}),
    "cpu": Plan(budget=400, grpo_steps=2,
                caps={"build": 60, "calibrate": 30, "tests": 120, "smollm2-135m": 60,
                      "qwen3-0.6b": 60, "qwen3-1.7b": 60, "lora": 60, "moe": 60, "grpo": 90},
                floors={"build": 20, "calibrate": 10, "tests": 20, "smollm2-135m": 20,
                        "qwen3-0.6b": 20, "qwen3-1.7b": 20, "lora": 20, "moe": 20,
                        "grpo": 20}),
}


class Runner:
    """Runs the steps in order within the budget; each child in its own process group."""

    def __init__(self, args: argparse.Namespace, plan: Plan, env: dict, work: Path) -> None:
        self.args, self.plan, self.env, self.work = args, plan, env, work
        self.deadline = time.monotonic() + args.budget
        self.logs = args.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def timeout(self, key: str, later: list[str]) -> float:
        """This step's time: its cap, less what the later steps must be left; 0 when that is
        below its own floor (it is then not started), except for build and calibrate."""
        left = self.deadline - time.monotonic() - sum(self.plan.floors[k] for k in later)
        floor = self.plan.floors[key]
        if key in ("build", "calibrate"):  # nothing runs without them
            return max(floor, min(self.plan.caps[key], left))
        return min(self.plan.caps[key], left) if left >= floor else 0.0

    def child(self, name: str, argv: list[str], timeout: float,
              extra_env: dict | None = None) -> tuple[str, float, Path]:
        """Run `argv` with output to logs/<name>.log; (passed|failed|timeout, seconds, log)."""
        path = self.logs / f"{name}.log"
        log.info("%s: %s (at most %.0fs)", name, " ".join(argv[:4]), timeout)
        t0 = time.monotonic()
        with open(path, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    env=self.env | (extra_env or {}), start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop_group(proc)
                rc = None
            except BaseException:  # this process is being stopped: so are its children
                stop_group(proc)
                raise
        seconds = time.monotonic() - t0
        status = "timeout" if rc is None else "passed" if rc == 0 else "failed"
        log.info("%s: exit %s after %.1fs", name, "(killed)" if rc is None else rc, seconds)
        return status, seconds, path

    def worker(self, name: str, worker: str, spec: dict, timeout: float) -> tuple[Step, dict]:
        """A check_steps.py worker; its step row and the JSON it wrote (what it got to)."""
        result_file = self.work / f"{name}.json"
        argv = [sys.executable, str(HERE / "check_steps.py"), worker, "--spec",
                json.dumps(spec), "--result", str(result_file)]
        status, seconds, path = self.child(name, argv, timeout)
        result = json.loads(result_file.read_text()) if result_file.is_file() else {}
        step = Step(name=name, seconds=seconds, log=str(path.relative_to(self.args.out)))
        own = result.get("worker", {})
        step.status = "timeout" if status == "timeout" else own.get("status", "failed")
        step.error = own.get("error", "") or (tail(path) if step.status != "passed" else "")
        if step.status == "timeout":
            step.error = f"killed after {seconds:.0f}s; last lines: {tail(path, 5)}"
        return step, result


def stop_group(proc: subprocess.Popen) -> None:
    """End a child and everything it started (its own process group)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, lines: int = 20) -> str:
    """The last lines of a log, for the error column and check.log."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


# ---- environment and assets -------------------------------------------------------------

def environment(device: str) -> dict:
    """Versions and the machine, for check.log and results.json."""
    env = {"python": sys.version.split()[0], "platform": platform.platform(),
           "cpus": os.cpu_count(), "device_arg": device,
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
    for name in VERSIONS:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    for key, argv in {"nvidia_smi": ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,"
                                     "clocks.max.sm,power.limit", "--format=csv,noheader"],
                      "git": ["git", "-C", str(REPO), "log", "-1", "--format=%H %s"]}.items():
        try:
            env[key] = subprocess.run(argv, capture_output=True, text=True,
                                      timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            env[key] = f"unavailable ({e})"
    return env


def wheel_modules(wheel: Path) -> set[str]:
    """The top-level modules a wheel installs."""
    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/")[0] for n in z.namelist()}
    return {t.removesuffix(".py") for t in tops
            if not t.endswith((".dist-info", ".data")) and not t.endswith(".pth")}


def install_missing(assets: Path | None, target: Path) -> dict:
    """Install the assets' wheels whose modules are missing here into `target`."""
    missing = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    report: dict = {"missing": missing, "installed": []}
    if not missing:
        return report
    wheels = sorted((assets / "wheels").glob("*.whl")) if assets else []
    chosen = [w for w in wheels if wheel_modules(w) & set(missing)]
    report["not_in_assets"] = sorted(set(missing) - set().union(*map(wheel_modules, chosen)))
    if not chosen:
        log.warning("missing modules %s and no wheels for them in %s", missing, assets)
        return report
    target.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
            "--disable-pip-version-check", "--target", str(target), *map(str, chosen)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        # No pip here: a pure-Python wheel is a zip of what site-packages gets.
        log.warning("pip install failed (%s); unpacking the wheels instead", done.stderr[-500:])
        for wheel in chosen:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(target)
    report["installed"] = [w.name for w in chosen]
    return report


def child_env(device: str, site: Path) -> dict:
    """The children's environment: this checkout's src first, the installed wheels, offline."""
    paths = [str(REPO / "src"), str(site), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", ASYNCRL_TEST_DEVICE=device)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the same paths as a CPU-only machine's
    return env


# ---- the steps --------------------------------------------------------------------------

def device_tests(runner: Runner, timeout: float) -> Step:
    """`pytest -m device` with ASYNCRL_TEST_DEVICE set; counts from its JUnit XML."""
    xml = runner.args.out / "device-tests.xml"
    argv = [sys.executable, "-m", "pytest", "-m", "device", "-q", "-rfE", "-p",
            "no:cacheprovider", "--continue-on-collection-errors", f"--junitxml={xml}"]
    status, seconds, path = runner.child("device-tests", argv, timeout)
    step = Step(name="device tests", seconds=seconds, log=str(path.relative_to(runner.args.out)))
    if not xml.is_file():
        step.status = "timeout" if status == "timeout" else "failed"
        step.error = tail(path)
        return step
    counts = junit_counts(xml)
    step.metrics = counts
    bad = counts["failed"] + counts["errors"]
    step.status = "timeout" if status == "timeout" else "failed" if bad else "passed"
    if bad:
        step.error = tail(path, 30)
    return step


def junit_counts(xml: Path) -> dict:
    """passed / failed / errors / skipped tests, and the modules that failed to import."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "import_errors": []}
    for case in ET.parse(xml).getroot().iter("testcase"):
        error = case.find("error")
        if error is not None and error.get("message") == "collection failure":
            module = ".".join(p for p in (case.get("classname"), case.get("name")) if p)
            why = [line[1:].strip() for line in (error.text or "").splitlines()
                   if line.startswith("E ")]
            counts["import_errors"].append(f"{module} ({why[-1] if why else 'see the log'})")
        elif error is not None:
            counts["errors"] += 1
        elif case.find("failure") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    counts["tests"] = counts["passed"] + counts["failed"] + counts["errors"] + counts["skipped"]
    return counts


def shape_steps(name: str, result: dict, worker: Step) -> list[Step]:
    """The worker's train, decode and publish parts as rows."""
    return [part_step(part, name, result, worker) for part in ("train", "decode", "publish")]


def part_step(part: str, shape: str, result: dict, worker: Step) -> Step:
    """One part of a worker's result as a row."""
    out = dict(result.get(part, {}))
    step = Step(name=part, shape=shape, log=worker.log, metrics=out)
    step.seconds = out.pop("seconds", 0.0)
    step.status = out.pop("status", "not run")
    if step.status in ("started", "not run") and worker.status != "passed":
        # killed, or the process died (a segfault, the OOM killer) during this part
        step.status = "timeout" if worker.status == "timeout" else "failed"
    step.error = out.pop("error", "")
    if step.status != "passed" and not step.error:
        step.error = worker.error
    if "traceback" in out:
        log.error("%s %s:\n%s", part, shape, out.pop("traceback"))
    return step


def derive(steps: list[Step], calibration: dict) -> None:
    """MFU and the bandwidth limit, from each row's raw numbers and the calibration."""
    peak, bandwidth = calibration.get("peak_flops"), calibration.get("copy_bytes_per_s")
    for step in steps:
        m = step.metrics
        if step.name == "train" and "step_s" in m:
            m["flops"] = 6 * m["params"] * m["tokens"]
            m["flops_per_s"] = m["flops"] / m["step_s"]
            m["mfu"] = m["flops_per_s"] / peak if peak else None
        if step.name == "decode":
            for run in (v for k, v in m.items() if k.startswith("batch_")):
                run["tokens_per_s"] = run["tokens"] / run["seconds"]
                run["limit_tokens_per_s"] = (run["tokens"] * bandwidth / run["bytes"]
                                             if bandwidth else None)
                run["of_limit"] = (run["tokens_per_s"] / run["limit_tokens_per_s"]
                                   if bandwidth else None)


def run_all(args: argparse.Namespace, plan: Plan, runner: Runner, results: dict,
            steps: list[Step]) -> None:
    """build, calibrate, then the chosen steps, each appended to `steps`; results.json and
    table.md rewritten after each."""
    later = (["calibrate"] + (["tests"] if "tests" in args.steps else [])
             + (list(SHAPES) if "shapes" in args.steps else [])
             + [name for name in FEATURES if name in args.steps]
             + (["grpo"] * len(GRPO_SYNCS) if "grpo" in args.steps else []))
    tiny = args.device == "cpu"
    models = runner.work / "models"

    def save() -> None:  # after each step: a run stopped from outside leaves its tables
        results["steps"] = [vars(s) for s in steps]
        write_json(args.out / "results.json", results)
        (args.out / "table.md").write_text(tables(results, steps))

    def next_timeout(key: str) -> float:
        if key in later:
            later.remove(key)
        return runner.timeout(key, later)

    build, built = runner.worker("build", "build", {
        "device": args.device, "tiny": tiny, "assets": str(args.assets or ""),
        "models": str(models)}, next_timeout("build"))
    build.metrics = {k: v for k, v in built.items() if k != "worker"}
    for name in SHAPES:
        if built.get(name, {}).get("status") not in (None, "passed"):
            build.status, build.error = "failed", f"{name}: {built[name].get('error')}"
            log.error("building %s:\n%s", name, built[name].get("traceback"))
    steps.append(build)
    save()
    calibrate, calibration = runner.worker("calibrate", "calibrate", {"device": args.device},
                                           next_timeout("calibrate"))
    calibration.pop("worker", None)
    calibrate.metrics = calibration
    results["calibration"] = calibration
    steps.append(calibrate)
    save()
    if "tests" in args.steps:
        timeout = next_timeout("tests")
        steps.append(device_tests(runner, timeout) if timeout else out_of_time("device tests"))
        save()
    if "shapes" in args.steps:
        for name in SHAPES:
            timeout = next_timeout(name)
            path = built.get(name, {}).get("path")
            if path is None or not timeout:
                why = "no model: see the build step" if path is None else "out of time"
                steps += [Step(name=p, shape=name, status="skipped", error=why)
                          for p in ("train", "decode", "publish")]
                continue
            spec = {"device": args.device, "tiny": tiny, "model": path,
                    "work": str(runner.work / name), "digest": tiny or name == SHAPES[0]}
            worker, result = runner.worker(name, "shape", spec, timeout)
            shutil.rmtree(spec["work"], ignore_errors=True)  # the published folders
            steps += shape_steps(name, result, worker)
            derive(steps[-3:], calibration)
            save()
    for name in FEATURES:
        if name in args.steps:
            steps.append(feature_step(args, runner, built, name, next_timeout(name)))
            save()
    if "grpo" in args.steps:
        for sync in GRPO_SYNCS:
            steps.append(grpo_step(args, runner, plan, built, sync, next_timeout("grpo")))
            save()


def feature_step(args: argparse.Namespace, runner: Runner, built: dict, name: str,
                 timeout: float) -> Step:
    """The `lora` worker (on the SmolLM2 shape) or the `moe` one (a model it builds)."""
    shape = FEATURES[name]
    path = built.get(SHAPES[0], {}).get("path")
    if (name == "lora" and path is None) or not timeout:
        return Step(name=name, shape=shape, status="skipped",
                    error="out of time" if timeout else "no model: see the build step")
    spec = {"device": args.device, "tiny": args.device == "cpu", "model": path,
            "work": str(runner.work / name)}
    worker, result = runner.worker(name, name, spec, timeout)
    shutil.rmtree(spec["work"], ignore_errors=True)
    return part_step(name, shape, result, worker)


def grpo_step(args: argparse.Namespace, runner: Runner, plan: Plan, built: dict, sync: str,
              timeout: float) -> Step:
    """One async GRPO run, if `grpo_one_gpu.py` is there."""
    name = f"grpo {sync}"
    if not (HERE / "grpo_one_gpu.py").is_file():
        return Step(name=name, shape=SHAPES[0], status="not available",
                    error="benchmarks/gpu/grpo_one_gpu.py is absent")
    if sync == "ipc" and args.device == "cpu":
        return Step(name=name, shape=SHAPES[0], status="skipped",
                    error="CUDA IPC needs a GPU (actor.weight_update_mode=ipc)")
    path = built.get(SHAPES[0], {}).get("path")
    if path is None or not timeout:
        return Step(name=name, shape=SHAPES[0], status="skipped",
                    error="no model: see the build step" if path is None else "out of time")
    spec = {"device": args.device, "model": path, "sync": sync,
            "steps": args.grpo_steps or plan.grpo_steps, "work": str(runner.work / f"grpo-{sync}")}
    step, result = runner.worker(f"grpo-{sync}", "grpo", spec, timeout)
    keep_small_files(Path(spec["work"]), args.out / f"grpo-{sync}")
    step.name, step.shape = name, SHAPES[0]
    step.metrics = result.get("row", {})
    if "traceback" in result.get("worker", {}):
        log.error("%s:\n%s", name, result["worker"]["traceback"])
    return step


def keep_small_files(src: Path, dst: Path, limit: int = 1 << 20) -> None:
    """Copy a run's logs and stats (text files under `limit` bytes, not weights) to --out."""
    for path in src.rglob("*"):
        if (path.is_file() and path.suffix in (".log", ".json", ".jsonl", ".txt", ".csv")
                and path.stat().st_size < limit):
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def out_of_time(name: str) -> Step:
    return Step(name=name, status="skipped", error="out of time")


# ---- tables -----------------------------------------------------------------------------

def fmt(value, spec: str = ".3g", scale: float = 1.0) -> str:
    """A number for the tables, '-' when absent."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, (int, float)):
        return format(value / scale, spec)
    return str(value)


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in row) + " |"
                    for row in rows]


def tables(results: dict, steps: list[Step]) -> str:
    """table.md: the run's facts, the summary, then a table per kind of step."""
    env, cal = results["env"], results.get("calibration", {})
    lines = [f"# GPU check ({env['device_arg']}): {cal.get('device_name', '?')}", "",
             f"torch {env['torch']}, transformers {env['transformers']}, python "
             f"{env['python']}; bf16 matmul peak {fmt(cal.get('peak_flops'), '.1f', 1e12)} "
             f"TFLOP/s, device copy {fmt(cal.get('copy_bytes_per_s'), '.0f', 1e9)} GB/s "
             f"(both measured); {env.get('git', '')}", ""]
    lines += markdown(["step", "shape", "status", "s", "error"],
                      [[s.name, s.shape, s.status, fmt(s.seconds, ".1f"), s.error[:200]]
                       for s in steps])
    by = {(s.name, s.shape): s for s in steps}
    tests = by.get(("device tests", ""))
    if tests is not None and tests.metrics:
        m = tests.metrics
        lines += ["", "## Device tests", ""] + markdown(
            ["tests", "passed", "failed", "errors", "skipped", "modules not imported"],
            [[fmt(m["tests"]), fmt(m["passed"]), fmt(m["failed"]), fmt(m["errors"]),
              fmt(m["skipped"]), ", ".join(m["import_errors"]) or "-"]])
    rows = [[n, fmt(m.get("params"), ".1f", 1e6), fmt(m.get("tokens"), ".0f"),
             fmt(m.get("micro_batches"), ".0f"), fmt(m.get("step_s"), ".3f"),
             fmt(m.get("flops_per_s"), ".1f", 1e12), fmt(m.get("mfu"), ".1%"),
             fmt(m.get("peak_memory_bytes"), ".2f", 2**30)]
            for n in SHAPES if (m := getattr(by.get(("train", n)), "metrics", None))]
    if rows:
        lines += ["", "## Training step (bf16, FSDPTrainEngine.train_batch)", ""] + markdown(
            ["shape", "params M", "tokens/step", "micro-batches", "step s", "TFLOP/s", "MFU",
             "peak GiB"], rows)
    rows = []
    for n in SHAPES:
        m = getattr(by.get(("decode", n)), "metrics", None) or {}
        for key in sorted((k for k in m if k.startswith("batch_")), key=lambda k: int(k[6:])):
            r = m[key]
            rows.append([n, fmt(r["batch"]), fmt(r.get("tokens_per_s"), ".1f"),
                         fmt(r.get("limit_tokens_per_s"), ".0f"), fmt(r.get("of_limit"), ".1%"),
                         fmt(r["weight_bytes"], ".1f", 2**20),
                         fmt(r["kv_bytes"] / max(r["steps"], 1), ".2f", 2**20)])
    if rows:
        lines += ["", "## Decode (LocalEngine, bf16)", ""] + markdown(
            ["shape", "batch", "tok/s", "limit tok/s", "of limit", "weights MiB",
             "KV MiB/step"], rows)
    rows = [[n, fmt(m.get("bytes"), ".1f", 2**20), fmt(m.get("save_s"), ".3f"),
             fmt(m.get("load_s"), ".3f"), fmt(m.get("digest_equal")),
             fmt(m.get("logprob_gap_max"), ".2e"), fmt(m.get("logprob_gap_mean"), ".2e")]
            for n in SHAPES if (m := getattr(by.get(("publish", n)), "metrics", None))]
    if rows:
        lines += ["", "## Publish (bf16 folder, loaded by the local engine)", ""] + markdown(
            ["shape", "MiB", "save s", "load s", "digest equal", "max |dlogp|",
             "mean |dlogp|"], rows)
    m = getattr(by.get(("lora", SHAPES[0])), "metrics", None)
    if m:
        lines += ["", "## LoRA (all-linear, bf16; the adapters alone published)", ""] + markdown(
            ["shape", "adapter MiB", "of full", "step s", "save s", "load s", "max |dlogp|",
             "mean |dlogp|"],
            [[SHAPES[0], fmt(m.get("adapter_tensor_bytes"), ".2f", 2**20),
              fmt(m["adapter_tensor_bytes"] / m["full_bytes"] if m.get("full_bytes") else None,
                  ".2%"),
              fmt(m.get("step_s"), ".3f"), fmt(m.get("save_s"), ".3f"),
              fmt(m.get("load_s"), ".3f"), fmt(m.get("logprob_gap_max"), ".2e"),
              fmt(m.get("logprob_gap_mean"), ".2e")]])
    m = getattr(by.get(("moe", "qwen3-moe")), "metrics", None)
    if m:
        lines += ["", "## Qwen3-MoE step (bf16, routing replay, load-balancing loss)", ""]
        lines += markdown(
            ["params M", "step s", "peak GiB", "replay max |dlogp|", "replay mean |dlogp|",
             "aux loss", "max logp change"],
            [[fmt(m.get("params"), ".1f", 1e6), fmt(m.get("step_s"), ".3f"),
              fmt(m.get("peak_memory_bytes"), ".2f", 2**30), fmt(m.get("replay_gap_max"), ".2e"),
              fmt(m.get("replay_gap_mean"), ".2e"), fmt(m.get("router_aux_loss"), ".4f"),
              fmt(m.get("logprob_change_max"), ".2e")]])
    grpo = [s for s in steps if s.name.startswith("grpo")]
    keys = list(dict.fromkeys(k for s in grpo for k, v in s.metrics.items()
                              if isinstance(v, (int, float, str))))[:10]  # the run's own row
    if grpo:
        lines += ["", "## Async GRPO on one device (grpo_one_gpu.run's row)", ""] + markdown(
            ["run", "status", *keys],
            [[s.name, s.status, *(fmt(s.metrics.get(k)) for k in keys)] for s in grpo])
    return "\n".join(lines) + "\n"


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the tables and logs")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--assets", type=Path, default=REPO / ".gpu",
                   help="prepare.py's folder (wheels/, tokenizer/)")
    p.add_argument("--budget", type=float, help="seconds for every step together "
                   f"(default: cuda {PLANS['cuda'].budget:.0f}, cpu {PLANS['cpu'].budget:.0f})")
    p.add_argument("--steps", nargs="+", choices=STEP_NAMES, default=list(STEP_NAMES),
                   help="what runs after building the models and calibrating")
    p.add_argument("--grpo-steps", type=int, help="GRPO steps per run")
    args = p.parse_args()
    plan = PLANS[args.device]
    args.budget = args.budget or plan.budget
    args.out = args.out.resolve()  # the children run in the repository root
    args.assets = args.assets.resolve() if args.assets is not None else None
    args.out.mkdir(parents=True, exist_ok=True)
    # stopped from outside (SIGTERM): end the running child and its group, write the tables
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout),
                                  logging.FileHandler(args.out / "check.log", mode="w")])
    if args.assets is not None and not args.assets.is_dir():
        log.warning("assets folder %s is absent: no wheels, the tiny byte tokenizer "
                    "(run benchmarks/gpu/prepare.py on a machine with network)", args.assets)
        args.assets = None
    work = Path(tempfile.mkdtemp(prefix="asyncrl-gpu-check-"))  # models: never under --out
    t0 = time.monotonic()
    results: dict = {"env": environment(args.device), "args": {k: str(v) for k, v in
                                                                 vars(args).items()}}
    log.info("environment: %s", json.dumps(results["env"], indent=1))
    steps: list[Step] = []
    try:
        results["install"] = install_missing(args.assets, work / "site")
        log.info("wheels: %s", results["install"])
        runner = Runner(args, plan, child_env(args.device, work / "site"), work)
        run_all(args, plan, runner, results, steps)
    except (Exception, SystemExit):  # the tables of what ran are still written below
        log.error("the check itself failed or was stopped:\n%s", traceback.format_exc())
        results["error"] = traceback.format_exc()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["steps"] = [vars(s) for s in steps]
    results["seconds"] = time.monotonic() - t0
    write_json(args.out / "results.json", results)
    table = tables(results, steps)
    (args.out / "table.md").write_text(table)
    print("\n" + table)
    log.info("done in %.0fs; %s", results["seconds"], args.out)
    # README: 1 if any step failed or ran out of time; a step skipped for what the device
    # lacks (CUDA IPC on the CPU) is neither.
    ok = "error" not in results and all(
        s.status in ("passed", "not available")
        or (s.status == "skipped" and s.error != "out of time") for s in steps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
