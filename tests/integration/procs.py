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
        if state != "Z" and b"asyncrl.inference.server" in cmd and model_path.encode() in cmd:
            pids.append(int(proc.name))
    return pids
