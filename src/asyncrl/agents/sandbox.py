"""Run untrusted code (written by a language model) in a fenced child process.

No root and no containers needed: the child is fenced with what this kernel offers, probed
once per process, and every result says which fences were in force (`isolation`):

- ``rlimits``:  CPU time, address space, process count, file size (always).
- ``cgroup``:   a pids cgroup caps the process count; needed as root, whom the kernel exempts
                from RLIMIT_NPROC (kuid 0 is exempt even inside a user namespace).
- ``uid``:      started as root, the child drops to nobody (65534) when that user can run
                the interpreter (it cannot when Python lives under a 0700 home, as here).
- ``userns``:   a private user namespace, so RLIMIT_NPROC counts only the sandbox's own
                processes and holds even for root (root ignores it in the initial namespace).
- ``pidns``:    the code runs in a private pid namespace under a tiny init (pid 1); when the
                code ends, or its launcher is killed, the kernel kills every process it left
                behind, even ones that called setsid() to escape the process group.
- ``netns``:    a private network namespace with no interfaces: no network at all.
- ``landlock``: writes only inside the working directory and its temp dir; reads only of the
                system, the interpreter and the working dir (no ~/.ssh, no /proc/<pid>/environ
                of the parent); with ABI >= 4 no TCP, with ABI >= 6 no signals or abstract unix
                sockets outside the sandbox.
- ``tcp_ports``: with the network allowed and `SandboxLimits.tcp_ports` set, TCP connect only
                to those ports and no TCP bind (Landlock ABI >= 4): an agent runtime reaches
                its model's proxy and nothing else over TCP.
- ``seccomp``:  socket() of any family but AF_UNIX, and io_uring, fail with EPERM.

The fences are set up by this very file run as a script (``python -I -S sandbox.py``), a
launcher that applies them and then execs the target: no ``preexec_fn`` runs in a fork of
the (threaded) parent.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import json
import math
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

NOBODY = 65534
_SETUP_FAILED = 125  # the launcher's exit code when a fence the probe promised cannot be set up

# Landlock (linux/landlock.h)
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_LL_WRITE_DIR = sum(1 << i for i in range(4, 13))  # remove dir/file, make char..sym
_LL_REFER, _LL_TRUNCATE = 1 << 13, 1 << 14
_LL_FILE_RIGHTS = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_TRUNCATE
_LL_NET_TCP = (1 << 0) | (1 << 1)  # bind, connect
_LL_NET_CONNECT, _LL_RULE_NET_PORT = 1 << 1, 2
_LL_SCOPE_UNIX, _LL_SCOPE_SIGNAL = 1 << 0, 1 << 1
_SYS_LANDLOCK = (444, 445, 446)  # create_ruleset, add_rule, restrict_self (all arches)

_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38

# Readable by sandboxed code besides the interpreter, its packages and the working dir.
_SYSTEM_READ = (
    "/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/opt",
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
    "/etc/ssl", "/etc/ca-certificates", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf",
    "/etc/hosts", "/etc/os-release", "/etc/alternatives", "/etc/mime.types",
    "/etc/locale.alias", "/proc", "/sys/devices/system/cpu",
    "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/full",
)
_DEV_WRITE = ("/dev/null", "/dev/zero", "/dev/full")


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Resource limits of one sandboxed run."""

    cpu_s: float = 10.0        # RLIMIT_CPU
    wall_s: float = 20.0       # the whole process group is killed after this
    memory_mb: int = 1024      # RLIMIT_AS
    max_procs: int = 32        # RLIMIT_NPROC (per user namespace when there is one)
    file_mb: int = 16          # RLIMIT_FSIZE
    output_chars: int = 4000   # stdout and stderr are each cut to this, with a marker
    network: bool = False      # False: no network at all
    # With network=True: TCP connect only to these ports, no TCP bind (None: any port)
    tcp_ports: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "max_procs", "file_mb", "output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)}")
        if self.tcp_ports is not None and not self.network:
            raise ValueError("SandboxLimits.tcp_ports needs network=True (without it no TCP "
                             "connection is possible at all)")
        if self.tcp_ports is not None and not all(
                isinstance(p, int) and 0 < p < 65536 for p in self.tcp_ports):
            raise ValueError(f"SandboxLimits.tcp_ports must be ports 1-65535, got {self.tcp_ports}")


@dataclass(kw_only=True)
class SandboxResult:
    """What a sandboxed run did: exit code (negative: killed by that signal), output, fences."""

    exit_code: int | None  # None when killed at the wall-clock limit
    stdout: str
    stderr: str
    timed_out: bool        # killed at the wall-clock limit or the CPU-time limit
    truncated: bool
    isolation: tuple[str, ...]
    duration_s: float

    @property
    def ok(self) -> bool:
        """True when the code ran to completion and exited 0."""
        return self.exit_code == 0 and not self.timed_out


class Sandbox:
    """Runs commands under `limits`, fenced by the strongest isolation this machine offers."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), *,
                 read_paths: tuple[str | Path, ...] = ()):
        self.limits = limits
        self.read_paths = tuple(str(p) for p in read_paths)  # extra read-only paths

    @property
    def isolation(self) -> tuple[str, ...]:
        """The fences this machine supports for these limits (probed once per process)."""
        return _plan(self.limits.network)

    async def run_python(self, code: str, *, cwd: str | Path | None = None,
                         stdin: str | None = None) -> SandboxResult:
        """Run `code` with this interpreter in isolated mode (python -I)."""
        if len(code.encode()) < 100_000:  # an argv string may not exceed 128 KiB
            return await self.run([sys.executable, "-I", "-c", code], cwd=cwd, stdin=stdin)
        return await self._run([sys.executable, "-I", "main.py"], cwd, stdin, None,
                               script=code)

    async def run(self, argv: list[str], *, cwd: str | Path | None = None,
                  stdin: str | None = None, env: dict[str, str] | None = None) -> SandboxResult:
        """Run `argv` in `cwd` (default: a fresh temp dir, removed afterwards)."""
        if not argv:
            raise ValueError("argv is empty")
        return await self._run(argv, cwd, stdin, env)

    async def _run(self, argv: list[str], cwd: str | Path | None, stdin: str | None,
                   env: dict[str, str] | None, script: str | None = None) -> SandboxResult:
        plan = await asyncio.to_thread(_plan, self.limits.network)
        with _Workspace(cwd, NOBODY if "uid" in plan else None,
                        self.limits.max_procs if "cgroup" in plan else None) as ws:
            if script is not None:
                (ws.tmp / "main.py").write_text(script)
                argv = [*argv[:-1], str(ws.tmp / "main.py")]
            result = await _execute(argv, ws, self.limits, plan, self.read_paths, stdin, env)
        seen = isolation_seen.get()
        if seen is not None:  # an agent session is recording what fenced its code
            seen.update(result.isolation)
        return result


# Set by whoever runs an agent session (the agent workflow) to a set that collects the
# isolation mechanisms of every sandboxed run made in that session's context.
isolation_seen: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "sandbox_isolation_seen", default=None)


class _Workspace:
    """The run's directories: the working dir (given or fresh) and a private temp dir."""

    def __init__(self, cwd: str | Path | None, uid: int | None, max_procs: int | None = None):
        self.max_procs = max_procs
        self.cgroup: Path | None = None
        self.base = Path(tempfile.mkdtemp(prefix="asyncrl-sandbox-"))
        self.tmp = self.base / "tmp"
        self.tmp.mkdir()
        self.given = cwd is not None
        self.work = Path(cwd).resolve() if cwd is not None else self.base / "work"
        if not self.given:
            self.work.mkdir()
        if not self.work.is_dir():
            shutil.rmtree(self.base)
            raise NotADirectoryError(f"sandbox cwd {self.work} is not a directory")
        self.uid = uid
        self._owner = (self.work.stat().st_uid, self.work.stat().st_gid)

    def __enter__(self) -> Self:
        if self.uid is not None:  # the dropped user must own what it may write
            os.chmod(self.base, 0o755)
            for path in (self.tmp, self.work):
                _chown_tree(path, self.uid, self.uid)
        if self.max_procs is not None:
            # + the launcher and the namespace's init
            self.cgroup = _make_pids_cgroup(self.base.name, self.max_procs + 2)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.given and self.uid is not None:  # give the tree back, new files included
            _chown_tree(self.work, *self._owner)
        if self.cgroup is not None:
            _remove_cgroup(self.cgroup)
        shutil.rmtree(self.base, ignore_errors=True)


def _pids_hierarchy() -> Path | None:
    """A writable cgroup hierarchy with the pids controller (v1, or the v2 root), if any."""
    v1 = Path("/sys/fs/cgroup/pids")
    if (v1 / "cgroup.procs").exists() and os.access(v1, os.W_OK):
        return v1
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        control = root / "cgroup.subtree_control"
        if control.exists() and "pids" in control.read_text().split() and os.access(root, os.W_OK):
            return root
    return None


def _make_pids_cgroup(name: str, max_tasks: int) -> Path:
    hierarchy = _pids_hierarchy()
    if hierarchy is None:
        raise RuntimeError("the sandbox plan needs a pids cgroup, but none is writable now")
    path = hierarchy / name
    path.mkdir()
    (path / "pids.max").write_text(str(max_tasks))
    return path


def _remove_cgroup(path: Path) -> None:
    for _ in range(50):  # tasks of a killed group may take a moment to be reaped
        for pid in (path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"cannot remove sandbox cgroup {path}: tasks remain")


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid, follow_symlinks=False)
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chown(os.path.join(parent, name), uid, gid, follow_symlinks=False)


def _child_env(ws: _Workspace, extra: dict[str, str] | None) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": str(ws.work),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "PYTHONDONTWRITEBYTECODE": "1",
        "TMPDIR": str(ws.tmp),
        # one thread per BLAS pool: threads count against max_procs
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }
    env.update(extra or {})
    return env


def _launcher_config(ws: _Workspace, limits: SandboxLimits, want: tuple[str, ...],
                     read_paths: tuple[str, ...], status_fd: int, strict: bool) -> str:
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                os.path.dirname(os.path.realpath(sys.executable))}
    packages = {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    write = [str(ws.work), str(ws.tmp)]
    return json.dumps({
        "workdir": str(ws.work), "cgroup": str(ws.cgroup) if ws.cgroup else None, "write": write, "dev_write": list(_DEV_WRITE),
        "read": sorted(set(_SYSTEM_READ) | prefixes | packages | set(read_paths)),
        "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "max_procs": limits.max_procs,
        "file_mb": limits.file_mb, "network": limits.network, "uid": ws.uid,
        "tcp_ports": None if limits.tcp_ports is None else list(limits.tcp_ports),
        "want": list(want), "strict": strict, "status_fd": status_fd,
    })


async def _execute(argv: list[str], ws: _Workspace, limits: SandboxLimits,
                   plan: tuple[str, ...], read_paths: tuple[str, ...], stdin: str | None,
                   env: dict[str, str] | None) -> SandboxResult:
    status_r, status_w = os.pipe()
    config = _launcher_config(ws, limits, plan, read_paths, status_w, strict=True)
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", __file__, config, *argv,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_child_env(ws, env),
            start_new_session=True, pass_fds=(status_w,))
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    out, err = _Capture(limits.output_chars), _Capture(limits.output_chars)
    pumps = [asyncio.ensure_future(_pump(proc.stdout, out)),
             asyncio.ensure_future(_pump(proc.stderr, err))]
    if stdin is not None:
        pumps.append(asyncio.ensure_future(_feed(proc.stdin, stdin)))
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), timeout=limits.wall_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:  # also on cancellation: nothing of the run may outlive it
        _kill_group(proc.pid)
    await proc.wait()
    # Without a pid namespace an escaped grandchild could hold the pipes open: drain briefly.
    _, pending = await asyncio.wait(pumps, timeout=1.0)
    for task in pending:
        task.cancel()
    applied, code = _read_status(status_r, proc.returncode)
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and not timed_out):
        timed_out = True  # the CPU-time limit: SIGXCPU at the soft limit, SIGKILL at the hard
    stdout, cut_out = out.text()
    stderr, cut_err = err.text()
    return SandboxResult(exit_code=None if timed_out and code == -signal.SIGKILL else code,
                         stdout=stdout, stderr=stderr, timed_out=timed_out,
                         truncated=cut_out or cut_err, isolation=applied or plan,
                         duration_s=time.monotonic() - start)


def _read_status(fd: int, returncode: int) -> tuple[tuple[str, ...], int]:
    """The fences the launcher applied and the code's exit (its init cannot die by signal)."""
    with os.fdopen(fd, "rb") as status:
        lines = status.read().decode().splitlines()
    applied = tuple(json.loads(lines[0])) if lines else ()
    if len(lines) > 1 and returncode >= 0:
        returncode = json.loads(lines[1])["exit"]
    return applied, returncode


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


async def _pump(stream: asyncio.StreamReader, capture: _Capture) -> None:
    while chunk := await stream.read(1 << 16):
        capture.feed(chunk)


async def _feed(stream: asyncio.StreamWriter, data: str) -> None:
    try:
        stream.write(data.encode())
        await stream.drain()
        stream.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited without reading all of its input


class _Capture:
    """A bounded copy of a stream: its head and its tail, however much flows through."""

    def __init__(self, chars: int):
        self.chars = chars
        self.tail_chars = chars // 4
        self.head_limit = 4 * chars  # bytes: a UTF-8 character is at most 4 of them
        self.tail_limit = 4 * self.tail_chars
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        self.head += chunk[:room]
        rest = chunk[room:] if room < len(chunk) else b""
        if rest:
            self.tail += rest
            del self.tail[:-self.tail_limit or len(self.tail)]

    def text(self) -> tuple[str, bool]:
        """The captured text and whether it was cut."""
        head = self.head.decode(errors="replace")
        if not self.tail and len(head) <= self.chars:
            return head, False
        keep_head = self.chars - self.tail_chars
        tail = self.tail.decode(errors="replace") if self.tail else head[keep_head:]
        tail = tail[-self.tail_chars:] if self.tail_chars else ""
        omitted = self.total - len(head[:keep_head].encode()) - len(tail.encode())
        marker = f"\n[... output truncated: {omitted} bytes omitted ...]\n"
        return head[:keep_head] + marker + tail, True


# ---------------------------------------------------------------------------------------------
# Probing: which fences does this machine allow?

_plans: dict[bool, tuple[str, ...]] = {}
_plans_lock = threading.Lock()


def _plan(network: bool) -> tuple[str, ...]:
    """The fences for runs with this network setting, probed with a tiny child once."""
    with _plans_lock:
        if network not in _plans:
            _plans[network] = _probe(network)
        return _plans[network]


def _probe(network: bool) -> tuple[str, ...]:
    best = ["rlimits", "userns", "pidns", "landlock"]
    if not network:
        best += ["netns", "seccomp"]
    if _pids_hierarchy() is not None:
        best.append("cgroup")
    candidates = [best + ["uid"], best] if os.geteuid() == 0 else [best]
    for want in candidates:  # the interpreter may be unreadable for nobody: then keep root
        applied = _probe_once(want, network)
        if applied is not None:
            return applied
    return ()


def _probe_once(want: list[str], network: bool) -> tuple[str, ...] | None:
    uid = NOBODY if "uid" in want else None
    with _Workspace(None, uid, 8 if "cgroup" in want else None) as ws:
        status_r, status_w = os.pipe()
        limits = SandboxLimits(network=network)
        config = _launcher_config(ws, limits, tuple(want), (), status_w, strict=False)
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-S", __file__, config, sys.executable, "-I", "-c", "pass"],
                stdin=subprocess.DEVNULL, capture_output=True, env=_child_env(ws, None), check=False,
                start_new_session=True, pass_fds=(status_w,), timeout=30)
        finally:
            os.close(status_w)
        applied, _ = _read_status(status_r, done.returncode)
    return applied if done.returncode == 0 else None


# ---------------------------------------------------------------------------------------------
# The launcher: runs as `python -I -S sandbox.py CONFIG ARGV...`, fences itself, execs ARGV.

class _SetupError(Exception):
    pass


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    return libc


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise _SetupError(f"{what}: {os.strerror(err)}")
    return ret


def _join_cgroup(path: str) -> None:
    Path(path, "cgroup.procs").write_text(str(os.getpid()))


def _drop_uid(libc: ctypes.CDLL, uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    # A uid change makes us undumpable, which gives /proc/self to root: uid_map unwritable.
    _check(libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")


def _unshare(libc: ctypes.CDLL, flags: int) -> None:
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(ctypes.c_int(flags)), "unshare")
    if flags & _CLONE_NEWUSER:  # map ourselves to ourselves: no new rights, only a new count
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def _set_rlimits(cfg: dict) -> None:
    cpu = max(1, math.ceil(cfg["cpu_s"]))
    memory = cfg["memory_mb"] << 20
    files = cfg["file_mb"] << 20
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    procs = cfg["max_procs"] + 2  # the launcher and the init count in the user namespace too
    resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))
    resource.setrlimit(resource.RLIMIT_FSIZE, (files, files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _landlock(libc: ctypes.CDLL, cfg: dict) -> None:
    create, add_rule, restrict = _SYS_LANDLOCK
    abi = libc.syscall(create, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        raise _SetupError("landlock: not supported by this kernel")
    write = _LL_WRITE_FILE | _LL_WRITE_DIR
    write |= (_LL_REFER if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0)
    read = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR
    ports = cfg.get("tcp_ports")
    net = _LL_NET_TCP if abi >= 4 and (not cfg["network"] or ports is not None) else 0
    scoped = _LL_SCOPE_SIGNAL | (0 if cfg["network"] else _LL_SCOPE_UNIX) if abi >= 6 else 0
    attr = struct.pack("QQQ", read | write, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _check(libc.syscall(create, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)),
                     "landlock_create_ruleset")
    rules = [(p, read) for p in cfg["read"]] + [(p, read | write) for p in cfg["write"]]
    rules += [(p, _LL_WRITE_FILE | (_LL_TRUNCATE if abi >= 3 else 0)) for p in cfg["dev_write"]]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # absent on this machine
        if not os.path.isdir(path):
            access &= _LL_FILE_RIGHTS
        rule = struct.pack("=Qi", access, fd)
        _check(libc.syscall(add_rule, ruleset, 1, rule, ctypes.c_uint32(0)), f"landlock {path}")
        os.close(fd)
    for port in ports if net and cfg["network"] else ():  # struct landlock_net_port_attr
        rule = struct.pack("=QQ", _LL_NET_CONNECT, port)
        _check(libc.syscall(add_rule, ruleset, _LL_RULE_NET_PORT, rule, ctypes.c_uint32(0)),
               f"landlock tcp port {port}")
    _check(libc.syscall(restrict, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)


# (audit arch, socket, io_uring_setup, x32 syscall bit or 0)
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 425, 0x40000000), "aarch64": (0xC00000B7, 198, 425, 0)}


def _seccomp_program() -> bytes:
    """BPF: kill foreign-arch syscalls; socket(!AF_UNIX), io_uring_setup -> EPERM; allow rest."""
    machine = os.uname().machine
    if machine not in _SECCOMP_ARCH:
        raise _SetupError(f"seccomp: no syscall table for {machine}")
    arch, nr_socket, nr_uring, x32 = _SECCOMP_ARCH[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny, kill = 0x7FFF0000, 0x00050000 | 1, 0x80000000  # RET_ERRNO | EPERM
    # (code, k, jump-if-true label, jump-if-false label); labels: None = next instruction
    prog = [(ld, 4, None, None), (jeq, arch, None, "kill"), (ld, 0, None, None)]
    if x32:
        prog.append((jge, x32, "deny", None))
    prog += [(jeq, nr_uring, "deny", None), (jeq, nr_socket, None, "allow"),
             (ld, 16, None, None), (jeq, 1, "allow", "deny")]  # args[0] == AF_UNIX
    labels = {"allow": len(prog), "deny": len(prog) + 1, "kill": len(prog) + 2}
    prog += [(ret, allow, None, None), (ret, deny, None, None), (ret, kill, None, None)]
    out = b""
    for i, (code, k, jt, jf) in enumerate(prog):
        t = labels[jt] - i - 1 if jt else 0
        f = labels[jf] - i - 1 if jf else 0
        out += struct.pack("=HBBI", code, t, f, k)
    return out


def _seccomp(libc: ctypes.CDLL) -> None:
    program = _seccomp_program()
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("=HxxxxxxQ", len(program) // 8, ctypes.addressof(buf))
    fprog_buf = ctypes.create_string_buffer(fprog, len(fprog))
    _check(libc.prctl(_PR_SET_SECCOMP, 2, ctypes.addressof(fprog_buf), 0, 0),
           "seccomp")  # SECCOMP_MODE_FILTER


def _relay_exit(pid: int) -> None:
    """Wait for the sandboxed child and exit the same way it did."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128)


def _launch(cfg: dict, argv: list[str]) -> None:
    libc = _libc()
    want, strict = set(cfg["want"]), cfg["strict"]
    applied: list[str] = []

    def attempt(names: tuple[str, ...], step, *args) -> bool:
        if not set(names) <= want:
            return False
        try:
            step(*args)
        except (OSError, _SetupError) as exc:
            if strict:
                sys.stderr.write(f"sandbox: cannot set up {'+'.join(names)}: {exc}\n")
                os._exit(_SETUP_FAILED)
            return False
        applied.extend(names)
        return True

    os.chdir(cfg["workdir"])  # before dropping root: the path may not be traversable after
    if cfg["cgroup"] is not None:
        attempt(("cgroup",), _join_cgroup, cfg["cgroup"])
    if cfg["uid"] is not None and os.geteuid() == 0:
        attempt(("uid",), _drop_uid, libc, cfg["uid"])
    net = () if cfg["network"] else ("netns",)
    flags = _CLONE_NEWUSER | _CLONE_NEWPID | (0 if cfg["network"] else _CLONE_NEWNET)
    if not attempt(("userns", "pidns", *net), _unshare, libc, flags) and not strict:
        attempt(("userns", *net), _unshare, libc, flags & ~_CLONE_NEWPID)
    if "pidns" in applied:
        pid = os.fork()  # the child is pid 1 of the new namespace
        if pid:
            _relay_exit(pid)
    attempt(("rlimits",), _set_rlimits, cfg)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    attempt(("landlock",), _landlock, libc, cfg)
    if "landlock" in applied and cfg["network"] and cfg["tcp_ports"] is not None and \
            libc.syscall(_SYS_LANDLOCK[0], None, ctypes.c_size_t(0), ctypes.c_uint32(1)) >= 4:
        applied.append("tcp_ports")
    if not cfg["network"]:
        attempt(("seccomp",), _seccomp, libc)
    if "pidns" in applied:  # the launcher killed (wall timeout) -> pid 1 dies -> all die
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.write(cfg["status_fd"], json.dumps(applied).encode() + b"\n")
    if "pidns" in applied:
        _run_as_init(cfg["status_fd"], argv)
    os.close(cfg["status_fd"])
    _exec(argv)


def _exec(argv: list[str]) -> None:
    try:
        os.execvpe(argv[0], argv, os.environ)
    except OSError as exc:
        sys.stderr.write(f"sandbox: cannot execute {argv[0]}: {exc}\n")
        os._exit(127)


def _run_as_init(status_fd: int, argv: list[str]) -> None:
    """Be pid 1: run `argv` as a child, reap orphans, report the child's exit, then exit.

    The code is not pid 1 itself because the kernel shields a namespace's init from
    signals it has no handler for, SIGXCPU of the CPU-time limit included.
    """
    child = os.fork()
    if child == 0:
        os.close(status_fd)
        _exec(argv)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            break
    code = os.waitstatus_to_exitcode(status)
    os.write(status_fd, json.dumps({"exit": code}).encode() + b"\n")
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    _launch(json.loads(sys.argv[1]), sys.argv[2:])
