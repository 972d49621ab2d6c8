"""The sandbox against hostile code: loops, fork bombs, huge allocations, network, escapes."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from asyncrl.agents.sandbox import Sandbox, SandboxLimits

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")


def run_python(code: str, limits: SandboxLimits | None = None, **kwargs):
    return asyncio.run(Sandbox(limits or SandboxLimits()).run_python(code, **kwargs))


def require(*fences: str) -> None:
    missing = set(fences) - set(Sandbox().isolation)
    if missing:
        pytest.skip(f"this machine lacks {sorted(missing)}")


def processes_with_env(marker: str) -> list[int]:
    """Pids whose environment holds `marker` (processes that outlived a run)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue  # gone, or not ours
    return found


def test_isolation_is_probed_once_and_reported_on_each_result():
    sandbox = Sandbox()
    result = asyncio.run(sandbox.run_python("print('hi')"))
    assert result.ok and result.stdout == "hi\n"
    assert "rlimits" in sandbox.isolation
    assert set(result.isolation) == set(sandbox.isolation)
    assert Sandbox().isolation is sandbox.isolation  # cached per process


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    result = run_python("while True: pass", SandboxLimits(cpu_s=1, wall_s=15))
    assert result.timed_out and not result.ok
    assert result.exit_code == -signal.SIGXCPU
    assert result.duration_s < 6  # 1 s of CPU, however busy the 2 cores are


def test_sleeping_program_is_killed_at_the_wall_limit():
    start = time.monotonic()
    result = run_python("import time; print('start', flush=True); time.sleep(60)",
                        SandboxLimits(wall_s=1))
    assert result.timed_out and result.exit_code is None
    assert result.stdout == "start\n"  # output before the kill is kept
    assert time.monotonic() - start < 5


FORK_COUNTER = """
import os, time
n = 0
for _ in range(100):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.setsid()  # tries to escape the process group the sandbox kills
        time.sleep(20)
        os._exit(0)
    n += 1
print(n)
"""


def test_forks_are_capped_at_max_procs_and_leftovers_die_with_the_run():
    marker = uuid.uuid4().hex
    result = asyncio.run(Sandbox(SandboxLimits(max_procs=8, wall_s=10)).run(
        [sys.executable, "-I", "-c", FORK_COUNTER], env={"MARKER": marker}))
    assert result.exit_code == 0, result.stderr
    forked = int(result.stdout)
    assert 1 <= forked <= 7  # the program itself + 7 children = max_procs
    if "pidns" in result.isolation:  # the setsid() children died with the namespace
        assert processes_with_env(marker) == []


def test_fork_bomb_ends_at_the_wall_limit_and_leaves_the_machine_usable():
    marker = uuid.uuid4().hex
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.monotonic()
    result = asyncio.run(Sandbox(SandboxLimits(max_procs=8, wall_s=2)).run(
        [sys.executable, "-I", "-c", bomb], env={"MARKER": marker}))
    assert result.timed_out
    assert time.monotonic() - start < 6
    assert subprocess.run(["true"], check=False).returncode == 0  # we can still fork
    if "pidns" in result.isolation:
        assert processes_with_env(marker) == []


def test_ten_gigabyte_allocation_fails_inside_only():
    result = run_python("x = bytearray(10 * 1024**3)", SandboxLimits(memory_mb=512))
    assert result.exit_code == 1
    assert "MemoryError" in result.stderr
    assert len(bytearray(64 << 20)) == 64 << 20  # the parent's memory is untouched


CONNECT = """
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2).close()
    print("connected")
except OSError as exc:
    print("blocked", type(exc).__name__)
"""


def connect_from_sandbox(port: int, network: bool):
    return asyncio.run(Sandbox(SandboxLimits(network=network)).run(
        [sys.executable, "-I", "-c", CONNECT, str(port)]))


def test_connect_to_a_listening_local_port_is_blocked():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # it does listen
        server.accept()[0].close()
        result = connect_from_sandbox(port, network=False)
        assert result.stdout.startswith("blocked"), result
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing arrived


def test_same_connect_works_when_network_is_allowed():
    with socket.create_server(("127.0.0.1", 0)) as server:
        result = connect_from_sandbox(server.getsockname()[1], network=True)
        assert result.stdout == "connected\n", result


def test_tcp_ports_let_the_sandbox_reach_only_the_ports_named():
    require("landlock")
    with socket.create_server(("127.0.0.1", 0)) as allowed, \
            socket.create_server(("127.0.0.1", 0)) as other:
        ports = allowed.getsockname()[1], other.getsockname()[1]
        sandbox = Sandbox(SandboxLimits(network=True, tcp_ports=(ports[0],)))

        def connect(port):
            return asyncio.run(sandbox.run([sys.executable, "-I", "-c", CONNECT, str(port)]))

        reached, refused = connect(ports[0]), connect(ports[1])
    if "tcp_ports" not in reached.isolation:
        pytest.skip("Landlock here has no TCP port rules (ABI < 4)")
    assert reached.stdout == "connected\n", reached
    assert refused.stdout.startswith("blocked PermissionError"), refused


def test_tcp_ports_without_network_is_refused_when_configured():
    with pytest.raises(ValueError, match="tcp_ports needs network=True"):
        SandboxLimits(tcp_ports=(8000,))


def test_write_outside_the_workdir_is_blocked():
    require("landlock")
    outside = Path(tempfile.mkdtemp(prefix="sandbox-test-"))
    outside.chmod(0o777)  # world-writable: only the sandbox can stop the write
    target = outside / "escape.txt"
    try:
        result = run_python(f"open({str(target)!r}, 'w').write('x')")
        assert result.exit_code == 1 and "PermissionError" in result.stderr
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)
        outside.rmdir()


def test_fresh_workdir_is_writable_and_removed_afterwards():
    code = ("import os\nopen('note.txt', 'w').write('12345')\n"
            "print(os.getcwd(), os.path.getsize('note.txt'))")
    result = run_python(code)
    workdir, size = result.stdout.split()
    assert size == "5"
    assert not Path(workdir).exists()


def test_given_cwd_is_where_the_code_runs_and_keeps_its_owner(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "data.txt").write_text("3 4")
    owner = repo.stat().st_uid
    code = ("a, b = map(int, open('data.txt').read().split())\n"
            "open('sum.txt', 'w').write(str(a + b))")
    result = run_python(code, cwd=repo)
    assert result.ok, result.stderr
    assert (repo / "sum.txt").read_text() == "7"
    assert (repo / "sum.txt").stat().st_uid == owner


def test_output_is_truncated_to_head_and_tail_with_a_marker():
    limits = SandboxLimits(output_chars=100)
    result = run_python("print('a' * 50 + 'b' * 10_000 + 'END')", limits)
    assert result.truncated
    assert result.stdout.startswith("a" * 50 + "b" * 25)  # head: 100 - 100 // 4 = 75 chars
    assert result.stdout.endswith("b" * 21 + "END\n")  # tail: 25 chars
    assert "output truncated: 9954 bytes omitted" in result.stdout  # 10054 - 75 - 25


def test_huge_output_is_drained_without_hanging():
    code = "import sys\nfor _ in range(1600):\n    sys.stdout.write('y' * 65536)\nprint('END')"
    result = run_python(code, SandboxLimits(output_chars=1000, wall_s=20))
    assert result.ok and result.truncated  # 100 MiB went through a bounded buffer
    assert result.stdout.endswith("END\n")
    assert len(result.stdout) < 1100


def test_parent_secrets_do_not_reach_the_child(monkeypatch):
    monkeypatch.setenv("ASYNCRL_FAKE_SECRET", "hunter2")
    result = asyncio.run(Sandbox().run(
        [sys.executable, "-I", "-c", "import os; print(sorted(os.environ.items()))"],
        env={"TASK": "demo"}))
    assert "hunter2" not in result.stdout and "ASYNCRL_FAKE_SECRET" not in result.stdout
    assert "('TASK', 'demo')" in result.stdout


def test_child_cannot_read_the_parents_environment_through_proc(monkeypatch):
    require("landlock")
    monkeypatch.setenv("ASYNCRL_FAKE_SECRET", "hunter2")
    code = f"print(open('/proc/{os.getpid()}/environ', 'rb').read())"
    result = run_python(code)
    assert result.exit_code == 1 and "hunter2" not in result.stdout


def test_stdin_is_passed_when_given_and_empty_otherwise():
    code = "import sys; print(sum(int(x) for x in sys.stdin.read().split()))"
    assert run_python(code, stdin="3\n4\n").stdout == "7\n"
    assert run_python(code).stdout == "0\n"


def test_exit_code_and_stderr_of_a_failing_program():
    result = run_python("import sys; print('bad', file=sys.stderr); sys.exit(3)")
    assert result.exit_code == 3 and not result.ok and not result.timed_out
    assert result.stderr == "bad\n"


def test_code_longer_than_an_argument_runs_from_a_file():
    code = "# " + "x" * 200_000 + "\nprint(2 + 2)"
    assert run_python(code).stdout == "4\n"


def test_concurrent_runs_are_independent():
    async def group():
        sandbox = Sandbox(SandboxLimits(max_procs=4))
        return await asyncio.gather(*(sandbox.run_python(f"print({i} * {i})") for i in range(6)))

    assert [r.stdout for r in asyncio.run(group())] == ["0\n", "1\n", "4\n", "9\n", "16\n", "25\n"]
