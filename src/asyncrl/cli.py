"""`asyncrl train | sft | dpo | rm | serve | eval | quickstart | plan | export-merged | ps |
logs | stop`."""

# Each command imports what it runs inside its function: torch and the trainer load only
# for the commands that need them, so `asyncrl ps | logs | stop` and `--help` answer at once.

from __future__ import annotations

import argparse
import shutil
import signal
import sys
from importlib import resources
from pathlib import Path


def _train(args: argparse.Namespace) -> int:
    from asyncrl.config import load_config
    from asyncrl.controller.rl import train

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg)
    print_summary(summary)
    return 0


def _offline(args: argparse.Namespace) -> int:
    """`asyncrl sft` / `dpo` / `rm`: the offline trainer named by the subcommand.

    With allocation_mode fsdp:d<N>, N > 1, outside torchrun: starts and waits for N ranks.
    """
    from asyncrl.offline import launch as offline_launch

    return offline_launch.run_command(args.command, args.config, args.overrides)


def _quickstart(args: argparse.Namespace) -> int:
    from asyncrl.config import load_config
    from asyncrl.controller.rl import train

    recipe = resources.files("asyncrl.recipes") / "quickstart.yaml"
    with resources.as_file(recipe) as path:
        cfg = load_config(path, args.overrides)
    summary = train(cfg)
    print_summary(summary)
    return 0


def _plan(args: argparse.Namespace) -> int:
    """`asyncrl plan`: the run's memory per device, and whether it fits."""
    from asyncrl.config import ConfigError, load_config
    from asyncrl.controller.plan import GiB, plan_run

    cfg = load_config(args.config, args.overrides)
    device_bytes = int(args.device_gb * GiB) if args.device_gb else None
    try:
        plan = plan_run(cfg, device_bytes=device_bytes)
    except ValueError as e:  # what the trainer would refuse for this model (a layout, LoRA)
        raise ConfigError(str(e)) from None
    print(plan.table())
    return 0 if plan.fits else 1


def print_summary(summary: dict) -> None:
    before, after = summary.get("eval_before"), summary.get("eval_after")
    print("\n== asyncrl run finished ==")
    print(f"run directory : {summary['run_dir']}")
    if before is not None:
        print(f"held-out reward before training: {before:.4f}")
    if after is not None:
        print(f"held-out reward after training : {after:.4f}"
              + (f"  ({after - before:+.4f})" if before is not None else ""))
    tasks_before = summary.get("eval_before_by_task", {})
    for task, reward in summary.get("eval_after_by_task", {}).items():
        was = tasks_before.get(task)
        print(f"  {task}: " + (f"{was:.4f} -> " if was is not None else "") + f"{reward:.4f}")
    for finding in summary.get("health", []):
        print(f"WARNING, the run cannot learn: {finding}")
    for key in ("stats", "reward_curve", "timeline"):
        if key in summary:
            print(f"{key:14s}: {summary[key]}")


def _serve(args: argparse.Namespace) -> int:
    """One inference server with OpenAI /v1 routes, until Ctrl-C or SIGTERM."""
    if args.admin_key or args.export_dir:
        return _serve_backend(args)  # the agent proxy in front of a private server
    if args.backend == "local":
        from asyncrl.inference.server.app import main as server_main

        argv = ["--model", args.model, "--host", args.host, "--port", str(args.port),
                "--dtype", args.dtype, "--device", args.device,
                "--max-seq-len", str(args.max_seq_len)]
        if args.threads:
            argv += ["--threads", str(args.threads)]
        return server_main(argv) or 0
    return _serve_backend(args)


def _serve_backend(args: argparse.Namespace) -> int:
    """A server on a private loopback port, behind our OpenAI gateway or the agent proxy.

    The gateway gives every backend the same /v1 routes and extension fields (token ids,
    log-probs, weight versions); the backend's own port stays on 127.0.0.1. With
    --admin-key the agent proxy takes the gateway's place: sessions, recording, and each
    finished session written to --export-dir.
    """
    import asyncio
    import importlib.util
    import os
    import tempfile

    from asyncrl.config.schema import LocalEngineConfig, SchedulerConfig
    from asyncrl.inference import gateway
    from asyncrl.launch.local import LocalScheduler
    from asyncrl.models.hub import resolve_model_path

    if args.export_dir and not args.admin_key:
        raise SystemExit("asyncrl serve: --export-dir records agent sessions, which need "
                         "--admin-key (the key that starts them)")
    module = {"vllm": "vllm", "sglang": "sglang"}.get(args.backend)
    if module and importlib.util.find_spec(module) is None:
        hint = "pip install 'asyncrl[vllm]'" if module == "vllm" else "pip install sglang"
        raise SystemExit(f"asyncrl serve: --backend {args.backend} needs the {module} package "
                         f"({hint})")
    path = resolve_model_path(args.model)
    cores = len(os.sched_getaffinity(0))
    sched_cfg = SchedulerConfig(inference_threads=args.threads or cores, trainer_threads=0,
                                startup_timeout=args.startup_timeout)
    engine_cfg = LocalEngineConfig(dtype=args.dtype, max_seq_len=args.max_seq_len)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    logs = tempfile.mkdtemp(prefix="asyncrl-serve-")  # kept if the server dies: its log
    with LocalScheduler(sched_cfg, logs) as scheduler:
        [url] = scheduler.launch_inference_servers(path, engine_cfg, n_servers=1, seed=0,
                                                   backend=args.backend, device=device)
        print(f"asyncrl: {args.backend} server ready at {url} (private)", flush=True)
        if args.admin_key:
            from asyncrl.agents import proxy as agent_proxy

            serving = agent_proxy.serve(
                args.backend, url, tokenizer=path, model_name=args.model, host=args.host,
                port=args.port, admin_key=args.admin_key, export_dir=args.export_dir,
                session_timeout=args.session_timeout, max_model_len=args.max_seq_len,
                tool_parser=args.tool_parser)
        else:
            serving = gateway.serve(args.backend, url, tokenizer=path, model_name=args.model,
                                    host=args.host, port=args.port,
                                    max_model_len=args.max_seq_len)
        asyncio.run(_while_alive(scheduler, serving))
    shutil.rmtree(logs, ignore_errors=True)
    return 0


async def _while_alive(scheduler, serving, interval: float = 1.0) -> None:
    """Run `serving` until it returns or the backend server dies; then stop serving and raise
    SchedulerError with the server's cause line and log (a gateway in front of a dead server
    would answer every request with an error)."""
    import asyncio

    task = asyncio.ensure_future(serving)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=interval)
            if not task.done():
                scheduler.check_alive()
        task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _eval(args: argparse.Namespace) -> int:
    """`asyncrl eval`: a checkpoint on a dataset, greedy or pass@k/maj@k/mean@k."""
    from asyncrl.config.schema import DatasetConfig
    from asyncrl.controller.evaluation import EvalSpec, EvalSpecError, run
    from asyncrl.models.lora import AdapterError

    defaults: dict = {}
    datasets: list[DatasetConfig] = []
    if args.config is not None:  # a run's config: its held-out sets, prompt and reward
        from asyncrl.config import load_config

        cfg = load_config(args.config, [])
        defaults = {"reward": cfg.workflow.reward_fn, "system_prompt": cfg.workflow.system_prompt,
                    "few_shot": cfg.workflow.few_shot, "stop": cfg.gconfig.stop or None,
                    "max_tokens": cfg.evaluator.max_new_tokens or cfg.gconfig.max_new_tokens}
        if not args.data:  # the config's held-out sets; `--data` replaces all of them
            datasets = [DatasetConfig(path=d.path, split=args.split or d.split, size=d.size,
                                      seed=d.seed, task_kwargs=d.task_kwargs, shuffle=False)
                        for d in cfg.valid_datasets or [cfg.train_dataset]]

    def pick(name: str, fallback):
        value = getattr(args, name)
        return value if value is not None else defaults.get(name, fallback)

    if args.data:
        datasets = [DatasetConfig(path=path, split=args.split or "test", shuffle=False)
                    for path in args.data]
    if not datasets:
        print("asyncrl eval: give --data (a JSONL file or folder, an HF dataset path, or "
              "reasoning_gym:<task>) or --config (a run's config, for its valid_dataset)",
              file=sys.stderr)
        return 2
    try:
        ks = [int(k) for k in args.k.split(",")]
    except ValueError:
        print(f"asyncrl eval: --k {args.k!r} must be integers separated by commas, e.g. 1,4,8",
              file=sys.stderr)
        return 2
    few_shot = defaults.get("few_shot", [])
    if args.few_shot is not None:
        import json

        few_shot = json.loads(Path(args.few_shot).read_text())
    try:
        spec = EvalSpec(
            model=args.model, base=args.base, base_urls=args.base_url or [],
            backend=args.backend, dataset=datasets[0], extra_datasets=datasets[1:], out=args.out,
            reward_fn=pick("reward", "gsm8k"), answer_fn=args.answer_fn,
            system_prompt=pick("system_prompt", None), few_shot=few_shot,
            chat_template=args.chat_template, n=args.n or max(ks), ks=ks,
            temperature=args.temperature, top_p=args.top_p, stop=pick("stop", []),
            max_tokens=pick("max_tokens", 256), concurrency=args.concurrency,
            limit=args.limit, pass_threshold=args.pass_threshold, seed=args.seed,
            device=args.device, dtype=args.dtype, max_seq_len=args.max_seq_len,
            threads=args.threads, progress=not args.no_progress)
        run(spec)
    except (EvalSpecError, AdapterError) as err:
        print(f"asyncrl eval: {err}", file=sys.stderr)
        return 2
    return 0


def _ps(args: argparse.Namespace) -> int:
    """The run's services: role, address, pid, node, state, log."""
    from asyncrl.launch.control import ps

    print("\n".join(ps(args.run)))
    return 0


def _logs(args: argparse.Namespace) -> int:
    """The end of a role's logs (one worker's with INDEX)."""
    from asyncrl.launch.control import logs

    lines = logs(args.run, args.role, args.index, args.n)
    if not lines:
        print(f"asyncrl logs: no logs of {args.role!r} in {args.run}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


def _stop(args: argparse.Namespace) -> int:
    """Stop the run's services (local pids, Ray workers on this machine, Slurm jobs)."""
    from asyncrl.launch.control import stop

    print("\n".join(stop(args.run)))
    return 0


def _export_merged(args: argparse.Namespace) -> int:
    """A LoRA run's saved adapter merged into its base, written as a full HF folder."""
    from asyncrl.models.lora import AdapterError, export_merged

    try:
        counts = export_merged(args.adapter, args.out, base=args.base)
    except AdapterError as err:
        print(f"asyncrl export-merged: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {counts['weights']} weights, {counts['merged']} of them merged "
          "with the adapter")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run asynchronous RL from a YAML config")
    p.add_argument("--config", default=None, help="YAML config file (else defaults + overrides)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor.optimizer.lr=1e-6")
    p.set_defaults(func=_train)
    for name, what in (("sft", "supervised fine-tuning on prompt/answer or chat JSONL"),
                       ("dpo", "DPO / IPO on prompt/chosen/rejected JSONL"),
                       ("rm", "train a reward model on prompt/chosen/rejected JSONL")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--config", default=None, help="YAML config file (else defaults)")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.path=x")
        p.set_defaults(func=_offline)
    p = sub.add_parser("quickstart", help="async GRPO on SmolLM2-135M-Instruct, on the CPU")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the quickstart recipe")
    p.set_defaults(func=_quickstart)
    p = sub.add_parser("plan", help="the memory of a run per device, before it starts")
    p.add_argument("--config", default=None, help="YAML config file (else defaults + overrides)")
    p.add_argument("--device-gb", type=float, default=None,
                   help="memory of one device in GiB (default: 80 on a GPU run, this "
                        "machine's memory on a CPU run)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.set_defaults(func=_plan)
    p = sub.add_parser("serve", help="start an inference server alone (with OpenAI /v1 routes)")
    p.add_argument("--backend", default="local", choices=["local", "vllm", "sglang"])
    p.add_argument("--model", required=True, help="HF folder, hub id or named model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when a GPU is visible")
    p.add_argument("--max-seq-len", type=int, default=2048, help="prompt + completion tokens")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait for a vllm/sglang server to become healthy")
    p.add_argument("--admin-key", default=None,
                   help="serve the agent proxy (sessions, token-exact recording); this key "
                   "starts sessions (POST /rl/start_session)")
    p.add_argument("--export-dir", default=None,
                   help="with --admin-key: write each finished session here as JSONL")
    p.add_argument("--session-timeout", type=float, default=600.0,
                   help="with --admin-key: seconds before an idle session ends as timed_out")
    p.add_argument("--tool-parser", default=None, choices=("hermes", "llama3_json", "mistral"),
                   help="with --admin-key: the model's tool-call format (default: read from "
                        "its chat template)")
    p.set_defaults(func=_serve)
    _add_eval_parser(sub)
    p = sub.add_parser("export-merged",
                       help="merge a LoRA run's saved adapter into its base model (HF folder)")
    p.add_argument("--adapter", required=True, type=Path,
                   help="an adapter folder a LoRA run saved (e.g. <run>/checkpoints/step25)")
    p.add_argument("--out", required=True, type=Path, help="the merged model's folder")
    p.add_argument("--base", default=None,
                   help="the base model (default: the adapter's base_model_name_or_path)")
    p.set_defaults(func=_export_merged)
    p = sub.add_parser("ps", help="list a run's services (from <run>/services.json)")
    p.add_argument("--run", required=True, type=Path, help="the run directory")
    p.set_defaults(func=_ps)
    p = sub.add_parser("logs", help="show the end of a run's service logs")
    p.add_argument("--run", required=True, type=Path, help="the run directory")
    p.add_argument("role", help="e.g. inference, trainer, agent")
    p.add_argument("index", nargs="?", type=int, default=None, help="one worker (default: all)")
    p.add_argument("-n", type=int, default=50, help="lines per log (default: 50)")
    p.set_defaults(func=_logs)
    p = sub.add_parser("stop", help="stop a run's services")
    p.add_argument("--run", required=True, type=Path, help="the run directory")
    p.set_defaults(func=_stop)
    return parser


def _add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint on a dataset: greedy, or pass@k, "
                       "maj@k and mean@k over sampled answers")
    p.add_argument("--model", required=True,
                   help="HF folder, a run's published version folder, a LoRA adapter folder "
                        "or a named model; with --base-url, the tokenizer of what they serve")
    p.add_argument("--base", default=None,
                   help="an adapter's base model (default: the adapter's own record)")
    p.add_argument("--data", action="append", default=None,
                   help="JSONL file or folder, HF dataset path, reasoning_gym:<task> or "
                        "python:<module>:<function>; repeat it for several sets, scored "
                        "together and task by task")
    p.add_argument("--split", default=None, help="the split of a folder or HF dataset "
                   "(default: test)")
    p.add_argument("--config", default=None, type=Path,
                   help="a run's config: its valid_dataset (and extra_valid_datasets), reward, "
                        "system prompt, few-shot examples and evaluation length, unless "
                        "given here")
    p.add_argument("--reward", default=None,
                   help="reward_fn: gsm8k (default), reasoning_gym, code, short_answer, "
                        "marked_short_answer, or package.module:function")
    p.add_argument("--answer-fn", default=None,
                   help="what maj@k votes over: package.module:function(completion) -> answer "
                        "(default: the built-in reward's own extractor)")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--few-shot", default=None,
                   help="JSON file: a list of {question, answer} examples")
    p.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                   help="plain-text prompts (base models): examples and question joined")
    p.add_argument("--k", default="1", help="the k of pass@k, maj@k, mean@k, e.g. 1,4,8")
    p.add_argument("--n", type=int, default=None,
                   help="samples per item (default: the largest k)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=None, help="per answer (default: 256)")
    p.add_argument("--stop", action="append", default=None,
                   help="a stop string (repeat for several): an answer ends once its text "
                        "holds one, the string kept (our engine)")
    p.add_argument("--concurrency", type=int, default=32, help="items in flight")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N items of each set")
    p.add_argument("--pass-threshold", type=float, default=1.0,
                   help="a sample is correct when its reward is at least this")
    p.add_argument("--out", type=Path, default=Path("eval"), help="output folder")
    p.add_argument("--base-url", action="append", default=None,
                   help="a running server (repeat for several); else one is started here")
    p.add_argument("--backend", default="local", choices=["local", "vllm", "sglang"],
                   help="the servers' kind (started here, or at --base-url)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--max-seq-len", type=int, default=2048, help="prompt + answer tokens")
    p.add_argument("--threads", type=int, default=0, help="the server's CPU threads (0: all)")
    p.add_argument("--seed", type=int, default=0, help="the server's sampling seed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_eval)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from asyncrl.config import ConfigError
    from asyncrl.launch.local import SchedulerError

    # SIGTERM unwinds like Ctrl-C, so the scheduler stops every server on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"asyncrl: config error: {err}", file=sys.stderr)
        return 2
    except SchedulerError as err:  # a server that would not start: its log tail says why
        print(f"asyncrl: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("asyncrl: interrupted; servers stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
