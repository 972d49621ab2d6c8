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
        if state != "Z" and b"asyncrl.engine.server" in cmd and model_path.encode() in cmd:
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
