"""Run untrusted Python (model-generated code) in a separate, limited process.

What every run gets
  * A fresh process in its own session, in a fresh work directory, with a
    clean environment (no variable of the trainer's is passed: no tokens, no
    secrets), stdin from us, ``python -I`` (no user site, no PYTHON* variables).
  * setrlimit in the child: CPU seconds, address space, file size, open files,
    number of processes, no core dumps.
  * A wall-clock timeout after which a trusted process outside the program
    (and, as a backstop, the trainer) kills the whole process tree.
  * stdout and stderr read with a cap: a run that prints more than
    ``output_bytes`` is killed at once and fails; nothing is buffered beyond the cap.
  * A verdict the program cannot forge by printing or exiting: ``run_python``
    reports ``completed`` only if the exit status is 0 *and* the harness wrote
    a per-run random nonce after the code and its tests ran. The nonce reaches
    the harness through a pipe that is drained and closed before any untrusted
    code runs, so ``print("PASSED")``, ``sys.exit(0)``, ``os._exit(0)`` or an
    atexit hook before the tests do not pass.

Isolation modes, strongest available first (``sandbox_mode()`` says which one
is active, and it is logged once at INFO on first use):
  ``namespaces``       root: runs go through warm fork servers
                       (``_sandbox_launcher.py --serve``, one per concurrent
                       caller, root, in a network namespace with only a down
                       loopback and a mount namespace where every mount is
                       read-only). Per run the server forks: new PID, mount and
                       IPC namespaces; the work directory a fresh tmpfs of
                       ``disk_bytes``; a fresh /proc; the program as ``nobody``
                       (so RLIMIT_NPROC applies: root ignores it), PID 2 under
                       a trusted PID 1; when PID 1 exits the kernel kills
                       everything left. The program is a fork of the warm
                       interpreter, not a new one: far cheaper, and nothing a
                       run does reaches the server or the next run.
  ``user-namespaces``  not root (``unshare --user``), one launcher per run:
                       new PID, network and mount namespaces, but the program
                       keeps our uid (mapped to root inside) and the trainer's
                       files stay writable to it where the filesystem is not
                       read-only-remounted.
  ``setuid``           root without namespaces: runs as ``nobody``; sockets
                       blocked in-process; the launcher is a child subreaper
                       and kills all descendants at the end.
  ``rlimits``          neither: limits, process group, subreaper, in-process
                       socket blocking only.

What is NOT covered
  * Memory is limited per process (RLIMIT_AS), not per run: up to
    ``processes`` x ``memory_bytes`` in the worst case (no cgroups are used).
  * Without namespaces: network blocking is in-process only (``socket`` is
    replaced in Python; a subprocess such as ``curl`` or ctypes bypass it);
    world-writable places (/tmp, /dev/shm) can be written as ``nobody``; the
    disk is limited per file (RLIMIT_FSIZE), not in total; in ``rlimits`` mode
    the program runs with the trainer's uid and can touch its files.
  * Code that introspects the harness in its own process (frames, gc) could
    find the nonce, and Python-level tricks (an object whose ``__eq__`` is
    always True) can pass ``assert`` tests: these are reward-hacking issues
    of in-process test harnesses, not process-isolation ones.
  * Kernel exploits, CPU side channels, and timing attacks are out of scope.
  * ``namespaces`` runs of one fork server share its network namespace, one
    after another (never at the same time; nothing in it outlives a run, and
    ``nobody`` cannot configure it), and its string-hash seed (a fork inherits
    it; a fresh interpreter would draw one), so set and dict orders of strings
    repeat across runs. ``random`` is reseeded per run.
  * RLIMIT_NPROC counts all processes of ``nobody`` on the machine, so
    concurrent runs share it.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import pwd
import secrets
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MODES = ("namespaces", "user-namespaces", "setuid", "rlimits")
_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_launcher.py")
_TIMEOUT_EXIT = 124  # _sandbox_launcher.TIMEOUT_EXIT
_UNSHARE_USER = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]


@dataclass(frozen=True)
class Limits:
    """Per-run limits. ``cpu_seconds`` defaults to the wall time rounded up, plus one."""

    wall_seconds: float = 10.0
    cpu_seconds: int | None = None
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20  # the tmpfs work directory (namespaces modes only)
    open_files: int = 64
    processes: int = 32
    output_bytes: int = 1 << 20  # each of stdout and stderr


@dataclass
class RunResult:
    returncode: int | None
    stdout: bytes  # the program's output, without the harness's nonce line
    stderr: bytes
    completed: bool  # exit status 0 and the harness ran past the code and the tests
    timed_out: bool
    output_overflow: bool
    mode: str
    seconds: float


# ---------------------------------------------------------------- the harness

# Runs inside the sandbox. It reads the nonce before any untrusted code runs,
# executes solution.py then tests.py in one __main__ namespace, and writes the
# nonce only if both returned. The nonce never appears in any file or argument.
_HARNESS = r"""
import os, sys
def _reporter():
    token = os.read({nonce_fd}, 64)
    os.close({nonce_fd})
    write = os.write
    def report():
        sys.stdout.flush()
        write(1, b"\n" + token + b"\n")
    return report
_report = _reporter()
del _reporter
if {block_sockets}:
    import errno, socket, _socket
    def _no_network(*args, **kwargs):
        raise OSError(errno.EACCES, "network access is disabled in this sandbox")
    for _module in (socket, _socket):
        for _name in ("socket", "socketpair", "create_connection", "create_server", "fromfd", "getaddrinfo"):
            if hasattr(_module, _name):
                setattr(_module, _name, _no_network)
def _run():
    namespace = {{"__name__": "__main__", "__builtins__": __builtins__}}
    for filename in ("solution.py", "tests.py"):
        with open(filename, encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, filename, "exec"), namespace)
_run()
_report()
"""


# ---------------------------------------------------------------- mode


_mode: str | None = None
_mode_lock = threading.Lock()


def _nobody() -> tuple[int | None, int | None]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _probe(mode: str) -> bool:
    try:
        result = run_python("print(6 * 7)", mode=mode, limits=Limits(wall_seconds=20.0))
    except (OSError, subprocess.SubprocessError):
        return False
    return result.completed and result.stdout.strip() == b"42"


def sandbox_mode() -> str:
    """The strongest isolation mode that works here (probed once, then cached).

    ``GRPO_SANDBOX_MODE`` forces one of ``MODES``.
    """
    global _mode
    with _mode_lock:
        if _mode is None:
            forced = os.environ.get("GRPO_SANDBOX_MODE")
            if forced:
                if forced not in MODES:
                    raise ValueError(f"GRPO_SANDBOX_MODE={forced!r}; expected one of {MODES}")
                _mode = forced
            else:
                root = os.geteuid() == 0
                candidates = ["namespaces", "setuid"] if root else ["user-namespaces", "rlimits"]
                _mode = next((m for m in candidates[:-1] if shutil.which("unshare") and _probe(m)), candidates[-1])
            logger.info("code sandbox mode: %s", _mode)
        return _mode


# ---------------------------------------------------------------- running


def _world_usable(path: str) -> bool:
    """Whether an unprivileged user can execute ``path`` (every parent searchable by others)."""
    path = os.path.realpath(path)
    try:
        if os.stat(path).st_mode & 0o005 != 0o005:
            return False
        parent = os.path.dirname(path)
        while True:
            if not os.stat(parent).st_mode & 0o001:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


_interpreter: str | None = None


def sandbox_python() -> str:
    """The interpreter that runs sandboxed code.

    ``GRPO_SANDBOX_PYTHON`` if set; else this interpreter if ``nobody`` can run
    it; else the first ``python3`` on the system PATH that it can (a venv under
    /root, for example, is closed to ``nobody``). Sandboxed code can import
    only what that interpreter has installed.
    """
    global _interpreter
    if _interpreter is None:
        forced = os.environ.get("GRPO_SANDBOX_PYTHON")
        system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
        usable = [c for c in (sys.executable, system) if c and _world_usable(c)]
        _interpreter = forced or (usable[0] if usable else sys.executable)
        logger.info("code sandbox interpreter: %s", _interpreter)
    return _interpreter


def _clean_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _rlimits(limits: Limits) -> dict[str, int]:
    return {
        "RLIMIT_CPU": limits.cpu_seconds or math.ceil(limits.wall_seconds) + 1,
        "RLIMIT_AS": limits.memory_bytes,
        "RLIMIT_FSIZE": limits.file_size_bytes,
        "RLIMIT_NOFILE": limits.open_files,
        "RLIMIT_NPROC": limits.processes,
        "RLIMIT_CORE": 0,
    }


def _launcher_config(mode: str, workdir: str, limits: Limits) -> dict:
    drop_uid, drop_gid = _nobody() if mode == "setuid" else (None, None)
    return {
        "namespaces": mode in ("namespaces", "user-namespaces"),
        "workdir": workdir,
        "tmpfs_bytes": limits.disk_bytes,
        "drop_uid": drop_uid,
        "drop_gid": drop_gid,
        "wall_seconds": limits.wall_seconds,
        "rlimits": _rlimits(limits),
        "argv": [sandbox_python(), "-I", "-B", "harness.py"],
        "env": _clean_env(workdir),
    }


def _write_files(workdir: str, files: dict[str, str], owner: int | None, group: int | None) -> None:
    for name, text in files.items():
        path = os.path.join(workdir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        if owner is not None and group is not None:  # both, or neither (mode setuid)
            os.chown(path, owner, group)
    if owner is not None and group is not None:
        os.chown(workdir, owner, group)


def _kill_tree(process: subprocess.Popen, mode: str) -> None:
    """Backstop for a launcher that overran its own deadline, or for too much output."""
    if mode in ("setuid", "rlimits") and process.poll() is None:
        process.terminate()  # the launcher kills its re-parented descendants first
        try:
            process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # in namespaces: --kill-child ends PID 1, the kernel the rest
    except (ProcessLookupError, PermissionError):
        pass


def run_python(
    code: str,
    tests: str = "",
    *,
    stdin: bytes = b"",
    limits: Limits = Limits(),
    mode: str | None = None,
) -> RunResult:
    """Run ``code`` then ``tests`` as one ``__main__`` module in a fresh sandbox.

    ``completed`` is the verdict: exit status 0 and both ran to their end.
    """
    mode = mode or sandbox_mode()
    nonce = secrets.token_hex(16).encode()
    start = time.monotonic()
    run = _run_forked if mode == "namespaces" else _run_launched
    returncode, stdout, stderr, overflow, killed = run(code, tests, stdin, limits, mode, nonce)
    suffix = b"\n" + nonce + b"\n"
    reached_end = stdout.endswith(suffix) and not overflow
    if reached_end:
        stdout = stdout[: -len(suffix)]
    return RunResult(
        returncode=returncode,
        stdout=stdout,
        stderr=stderr,
        completed=reached_end and returncode == 0,
        timed_out=killed or returncode == _TIMEOUT_EXIT,
        output_overflow=overflow,
        mode=mode,
        seconds=time.monotonic() - start,
    )


def _run_launched(code: str, tests: str, stdin: bytes, limits: Limits, mode: str, nonce: bytes):
    """One launcher process per run (every mode but ``namespaces``): unshare, launcher, fresh interpreter."""
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
    nonce_read, nonce_write = os.pipe()  # ours until Popen; the harness drains it
    try:
        cfg = _launcher_config(mode, workdir, limits)
        # The pipe keeps its fd number through unshare, the launcher and execve.
        harness = _HARNESS.format(nonce_fd=nonce_read, block_sockets=mode in ("setuid", "rlimits"))
        _write_files(
            workdir, {"harness.py": harness, "solution.py": code, "tests.py": tests}, cfg["drop_uid"], cfg["drop_gid"]
        )
        os.write(nonce_write, nonce)
        os.close(nonce_write)
        nonce_write = -1
        prefix = _UNSHARE_USER if mode == "user-namespaces" else []
        argv = prefix + [sys.executable, "-I", "-S", _LAUNCHER, json.dumps(cfg)]
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=cfg["env"],
            start_new_session=True,
            pass_fds=(nonce_read,),
        )
        os.close(nonce_read)
        nonce_read = -1
        out = _communicate(
            process.stdin, process.stdout, process.stderr, stdin, limits, kill=lambda: _kill_tree(process, mode)
        )
        return (process.wait(), *out)
    finally:
        for fd in (nonce_read, nonce_write):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------- fork servers (namespaces mode)


class _ForkServer:
    """A warm, root interpreter (``_sandbox_launcher.py --serve``) that forks one sandboxed run per request.

    Why: two interpreter start-ups (the launcher's and the program's) were most of a run's cost; a run forked
    from a warm one pays only for its forks and namespaces (the profile: docs/rewards.md).
    It serves one run at a time and never runs untrusted code itself.
    """

    def __init__(self, workdir: str):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cfg = {"socket": theirs.fileno(), "workdir": workdir}
        try:
            self.process = subprocess.Popen(
                [sandbox_python(), "-I", "-B", _LAUNCHER, "--serve", json.dumps(cfg)],
                stdin=subprocess.DEVNULL,
                env=_clean_env(workdir),
                start_new_session=True,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        self.sock = ours
        self.sock.settimeout(60.0)  # interpreter start-up on a loaded machine
        try:
            ready = self.sock.recv(1)
        except OSError:
            ready = b""
        if ready != b"R":
            self.close()
            raise OSError("sandbox fork server did not start (see its stderr)")

    def start(self, fds: list[int]) -> None:
        """Hand over the run's pipe ends (``_sandbox_launcher.RUN_FDS``); the request follows on the first."""
        self.sock.settimeout(10.0)
        socket.send_fds(self.sock, [b"r"], fds)

    def result(self, timeout: float) -> int:
        """The run's exit status (as ``_sandbox_launcher`` reports it)."""
        self.sock.settimeout(timeout)
        data = b""
        while len(data) < 4:
            chunk = self.sock.recv(4 - len(data))
            if not chunk:
                raise OSError("sandbox fork server closed its socket")
            data += chunk
        return struct.unpack("!i", data)[0]

    def close(self) -> None:
        """Kill the server; its supervisors die with it (parent-death signal), and with them their runs."""
        self.sock.close()
        try:
            self.process.kill()
        except ProcessLookupError:
            pass
        self.process.wait()


class _ForkServerPool:
    """Idle fork servers, one started per concurrent caller; a server that misbehaved is discarded."""

    def __init__(self):
        self._idle: list[_ForkServer] = []
        self._lock = threading.Lock()
        self._workdir: str | None = None
        self.started = 0  # for tests: how many servers this process has started

    def acquire(self) -> _ForkServer:
        with self._lock:
            while self._idle:
                server = self._idle.pop()
                if server.process.poll() is None:
                    return server
                server.close()  # killed while idle (the OOM killer, an operator)
            if self._workdir is None:
                # Only a mount point: each run mounts its own tmpfs over it, in its own mount namespace.
                self._workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
            self.started += 1
            workdir = self._workdir
        return _ForkServer(workdir)

    def release(self, server: _ForkServer, healthy: bool) -> None:
        if healthy and server.process.poll() is None:
            with self._lock:
                self._idle.append(server)
        else:
            server.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            workdir, self._workdir = self._workdir, None
        for server in idle:
            server.close()
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


_POOL = _ForkServerPool()
atexit.register(_POOL.close)


def _run_forked(code: str, tests: str, stdin: bytes, limits: Limits, mode: str, nonce: bytes):
    """One run through a warm fork server. The trainer keeps the pipes: it feeds stdin, reads the capped
    output, and asks for a kill through the kill pipe (closing it, as a dying trainer does, kills too)."""
    uid, gid = _nobody()
    request = json.dumps(
        {
            "files": {"solution.py": code, "tests.py": tests},
            "wall_seconds": limits.wall_seconds,
            "tmpfs_bytes": limits.disk_bytes,
            "uid": uid,
            "gid": gid,
            "rlimits": _rlimits(limits),
        }
    ).encode()
    pipes = {name: os.pipe() for name in ("request", "stdin", "stdout", "stderr", "nonce", "kill")}
    theirs = [
        pipes["request"][0],
        pipes["stdin"][0],
        pipes["stdout"][1],
        pipes["stderr"][1],
        pipes["nonce"][0],
        pipes["kill"][0],
    ]
    ours = {name: pipes[name][0 if name in ("stdout", "stderr") else 1] for name in pipes}
    os.write(ours.pop("nonce"), nonce)  # 32 bytes: fits the pipe
    server, healthy = _POOL.acquire(), False
    try:
        server.start(theirs)
        _close(theirs)
        _write_all(ours.pop("request"), request)
        stdin_file, stdout_file, stderr_file = (
            open(ours.pop(name), mode, buffering=0)
            for name, mode in (("stdin", "wb"), ("stdout", "rb"), ("stderr", "rb"))
        )
        out = _communicate(stdin_file, stdout_file, stderr_file, stdin, limits, kill=lambda: _ask_to_kill(ours["kill"]))
        returncode = server.result(timeout=limits.wall_seconds + 10.0)
        healthy = True
        return (returncode, *out)
    finally:
        _close(theirs + list(ours.values()))
        _POOL.release(server, healthy)


def _ask_to_kill(kill_fd: int) -> None:
    try:
        os.write(kill_fd, b"k")
    except BrokenPipeError:
        pass  # the supervisor is gone: so is the run


def _write_all(fd: int, data: bytes) -> None:
    """Write and close; the supervisor reads concurrently. A supervisor that died closes the pipe: EPIPE."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:
        pass  # its status tells
    finally:
        os.close(fd)


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _communicate(
    stdin_file, stdout_file, stderr_file, stdin: bytes, limits: Limits, kill
) -> tuple[bytes, bytes, bool, bool]:
    """Feed stdin, read stdout/stderr up to the cap, call ``kill()`` at the backstop deadline or on overflow.

    Closes the three files. Returns (stdout, stderr, output_overflow, killed_by_us).
    """

    def feed() -> None:
        try:
            stdin_file.write(stdin)
        except (BrokenPipeError, OSError):
            pass  # the program exited or closed stdin without reading it all
        finally:
            try:
                stdin_file.close()
            except OSError:
                pass

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    chunks: dict[Any, list[bytes]] = {stdout_file: [], stderr_file: []}
    sizes = {stdout_file: 0, stderr_file: 0}
    # The launcher enforces wall_seconds itself; this is the backstop if it cannot.
    deadline = time.monotonic() + limits.wall_seconds + 10.0
    overflow = killed = False
    with selectors.DefaultSelector() as selector:
        for stream in chunks:
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed = True
                kill()
                break
            for key, _ in selector.select(timeout=remaining):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                stream = key.fileobj
                keep = limits.output_bytes - sizes[stream]
                chunks[stream].append(data[:keep])
                sizes[stream] += len(data)
                if sizes[stream] > limits.output_bytes:
                    overflow = True
            if overflow:
                kill()
                break
    for stream in chunks:
        stream.close()
    feeder.join(timeout=1.0)
    return b"".join(chunks[stdout_file]), b"".join(chunks[stderr_file]), overflow, killed
