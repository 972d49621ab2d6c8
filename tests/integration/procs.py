"""Finding the processes a test started, from /proc."""

from pathlib import Path


def server_pids(model_path: str) -> list[int]:
    """Live (not zombie) processes running an inference server on `model_path`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and b"asyncrl.inference.server.app" in cmd and model_path.encode() in cmd:
            pids.append(int(proc.name))
    return pids


def read_address(proc, timeout: float) -> str:
    """Wait for a server's 'listening on http://...' line; raise with its output if it dies."""
    import queue
    import threading
    import time

    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=0.5))
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if "listening on " in seen[-1]:
            return seen[-1].rsplit("listening on ", 1)[1].strip()
    tail = "".join(seen[-20:])
    raise RuntimeError(f"server did not start (exit code {proc.poll()}):\n{tail}")


def kill_after_step(run: Path, stop, role: str, index: int = 0, step: int = 1) -> None:
    """SIGKILL the process group of worker `index` of `role` (its pid from the run's
    services.json) once `step` is logged in stats.jsonl, unless `stop` is set first."""
    import json
    import os
    import signal
    import time

    while not stop.is_set():
        try:
            logged = (run / "stats.jsonl").read_text()
            workers = json.loads((run / "services.json").read_text())["workers"]
        except (OSError, ValueError):
            time.sleep(0.05)
            continue
        if f'"step": {step},' in logged or f'"step": {step}}}' in logged:
            pid = next(w["pid"] for w in workers if w["role"] == role and w["index"] == index)
            os.killpg(pid, signal.SIGKILL)
            return
        time.sleep(0.05)


def train_killing(cfg, run: Path, role: str, index: int = 0) -> dict:
    """`train(cfg)` while worker `index` of `role` is SIGKILLed once step 1 is logged."""
    import threading

    from asyncrl.controller.rl import train

    stop = threading.Event()
    killer = threading.Thread(target=kill_after_step, args=(run, stop, role, index))
    killer.start()
    try:
        return train(cfg)
    finally:
        stop.set()
        killer.join()
