"""Trusted processes of the sandbox (see ``rewards/sandbox.py``): a launcher per run, or a fork server.

The fork server (``--serve``, ``namespaces`` mode) is described at ``serve`` below. The launcher
(every other mode) is the first process of one run.

Run as ``python -I -S <this file> <config json>``, inside fresh PID, network
and mount namespaces when the sandbox mode allows (then this process is PID 1
of its namespace: when it exits the kernel kills everything left in it, and
signals from inside cannot kill it). It:

1. (namespaces) remounts every mount read-only and mounts a size-limited tmpfs
   over the work directory, copying the run's files into it;
2. (no namespaces) becomes a child subreaper so escaped descendants are re-parented here;
3. forks the untrusted program: resource limits, an unprivileged uid/gid when
   configured, then ``execve`` of a fresh interpreter;
4. waits at most ``wall_seconds``, kills what is left, and exits with the
   program's status (128 + signal when killed by one, 124 on timeout).

The config holds no secrets: ``/proc/1/cmdline`` is readable from inside.
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
_KEPT_MOUNT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
PR_SET_CHILD_SUBREAPER = 36
TIMEOUT_EXIT = 124
SETUP_FAILED_EXIT = 125

_libc = ctypes.CDLL(None, use_errno=True)


class _Stop(Exception):
    """SIGTERM from the trainer: clean up and leave."""


def _mount(source, target, fstype, flags, data) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, per-mount flags to keep) for every mount, from /proc/self/mountinfo."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            target = fields[4].encode().decode("unicode_escape")  # "\040" is a space
            kept = 0
            for option in fields[5].split(","):
                kept |= _KEPT_MOUNT_FLAGS.get(option, 0)
            points.append((target, kept))
    return points


def _lock_down_filesystem(workdir: str, tmpfs_bytes: int, uid: int, gid: int) -> None:
    """Everything read-only; the work directory becomes a private, size-limited tmpfs."""
    files = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as f:
            files[name] = f.read()
    for target, kept in _mount_points():
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept, None)
    _mount(
        "tmpfs",
        workdir,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={tmpfs_bytes},nr_inodes=4096,mode=0700,uid={uid},gid={gid}",
    )
    for name, data in files.items():
        path = os.path.join(workdir, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chown(path, uid, gid)


def _start_program(cfg: dict) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        os.chdir(cfg["workdir"])
        for name, value in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value))
        if cfg["drop_uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["drop_gid"])
            os.setuid(cfg["drop_uid"])
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as exc:  # noqa: BLE001 - report and never return into the launcher
        os.write(2, f"sandbox launcher: cannot start program: {exc}\n".encode())
    os._exit(SETUP_FAILED_EXIT)


def _children(pid: int) -> list[int]:
    pids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return pids
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return pids


def _descendants() -> list[int]:
    found, frontier = [], [os.getpid()]
    while frontier:
        children = _children(frontier.pop())
        found += children
        frontier += children
    return found


def _kill_descendants() -> None:
    """Stop, then kill, every descendant; as a subreaper, orphans come back to us.

    Stopping the whole tree first keeps a fork bomb from replacing what we kill.
    """
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        pids = _descendants()
        if not pids:
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        time.sleep(0.01)


def _wait(pid: int, wall_seconds: float) -> int:
    """The program's exit status as a shell would report it, or TIMEOUT_EXIT."""
    pidfd = os.pidfd_open(pid)
    deadline = time.monotonic() + wall_seconds
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return TIMEOUT_EXIT
        if select.select([pidfd], [], [], remaining)[0]:
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main() -> None:
    cfg = json.loads(sys.argv[1])

    def stop(signum, frame):
        raise _Stop()

    signal.signal(signal.SIGTERM, stop)
    try:
        if cfg["namespaces"]:
            uid = cfg["drop_uid"] if cfg["drop_uid"] is not None else os.getuid()
            gid = cfg["drop_gid"] if cfg["drop_gid"] is not None else os.getgid()
            _lock_down_filesystem(cfg["workdir"], cfg["tmpfs_bytes"], uid, gid)
        else:
            _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except OSError as exc:
        os.write(2, f"sandbox launcher: setup failed: {exc}\n".encode())
        os._exit(SETUP_FAILED_EXIT)

    code = TIMEOUT_EXIT
    try:
        code = _wait(_start_program(cfg), cfg["wall_seconds"])
    except _Stop:
        pass
    finally:
        if not cfg["namespaces"]:  # in a PID namespace the kernel does this when we exit
            _kill_descendants()
    os._exit(code)


# ---------------------------------------------------------------- fork server
#
# ``python -I -B <this file> --serve <config json>``, started once per concurrent
# caller by ``sandbox.py`` in ``namespaces`` mode, as root, with a clean
# environment. Why: most of the per-run cost of the launched path above is two
# interpreter start-ups with their imports (this launcher's and the program's;
# the profile is in docs/rewards.md); forking a warm interpreter skips both (a
# run then pays for little more than its forks and namespaces). The server
# never runs untrusted code itself: every run is a fresh fork of it, so nothing
# a run does (modules, globals, environment, files) reaches the next one.
#
# Per run, three processes, like the launched path:
#   supervisor  (fork of the server, root, outside the run's PID namespace)
#               new PID, mount and IPC namespaces; a fresh tmpfs work directory
#               with the run's files; kills the run at the deadline or when the
#               trainer asks; exits with the run's status.
#   init        (PID 1 of the run's namespace, root) mounts a fresh /proc, reaps
#               orphans, exits with the program's status; when it exits the
#               kernel kills whatever is left in the namespace.
#   program     (PID 2, ``nobody``, rlimits) runs the harness in this already
#               warm interpreter: no execve.

import socket  # noqa: E402
import struct  # noqa: E402
import types  # noqa: E402

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x08000000, 0x20000000, 0x40000000
MS_REC, MS_PRIVATE = 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
RUN_FDS = ("request", "stdin", "stdout", "stderr", "nonce", "kill")  # passed with each request, in this order
# Imported once here so that programs find them warm (HumanEval-style code imports typing and friends).
PRELOAD = (
    "typing",
    "math",
    "re",
    "collections",
    "itertools",
    "functools",
    "heapq",
    "bisect",
    "string",
    "dataclasses",
    "fractions",
    "decimal",
    "statistics",
    "json",
    "copy",
    "operator",
    "random",
)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _exit_child(body, *args, err_fd: int) -> None:
    """Run ``body(*args)`` in a forked child and exit with its result: whatever happens (an error, an
    error while reporting one, a program's own exception), the child never returns into its parent's code."""
    code = SETUP_FAILED_EXIT
    try:
        code = body(*args)
    except BaseException as exc:  # noqa: BLE001 - report where the trainer reads it
        try:
            os.write(err_fd, f"sandbox {body.__name__.strip('_')}: {exc}\n".encode())
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(code)


def _die_with_parent() -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")


def _enter_server_namespaces() -> None:
    """One network and mount namespace for the server's life: no interface but a down loopback,
    mounts private (nothing propagates back to the host) and read-only."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    for target, kept in _mount_points():
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept, None)


def _recv_fds(sock: socket.socket) -> dict:
    """One request: a marker byte with the run's file descriptors attached."""
    marker, fds, _, _ = socket.recv_fds(sock, 1, len(RUN_FDS))
    if not marker:
        raise EOFError
    if len(fds) != len(RUN_FDS):
        raise ValueError(f"expected {len(RUN_FDS)} file descriptors, got {len(fds)}")
    return dict(zip(RUN_FDS, fds))


def _read_request(fd: int) -> dict:
    """The run's JSON (files, limits), read by the supervisor from its own pipe: the server never holds
    a run's code or tests, so no later fork of it inherits them."""
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks))


def _fresh_workdir(workdir: str, tmpfs_bytes: int, files: dict, uid: int, gid: int) -> None:
    _mount(
        "tmpfs",
        workdir,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={tmpfs_bytes},nr_inodes=4096,mode=0700,uid={uid},gid={gid}",
    )
    for name, text in files.items():
        path = os.path.join(workdir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chown(path, uid, gid)


def _wait_or_kill(pid: int, kill_fd: int, wall_seconds: float) -> int:
    """Like ``_wait``, but also kill when the trainer writes to (or closes) the kill pipe."""
    pidfd = os.pidfd_open(pid)
    deadline = time.monotonic() + wall_seconds
    while True:
        remaining = deadline - time.monotonic()
        ready = select.select([pidfd, kill_fd], [], [], max(remaining, 0))[0] if remaining > 0 else []
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
        if remaining <= 0 or kill_fd in ready:
            os.kill(pid, signal.SIGKILL)  # PID 1 of the run: the kernel kills the rest
            os.waitpid(pid, 0)
            return TIMEOUT_EXIT


def _supervise(fds: dict, workdir: str) -> int:
    """The supervisor: namespaces and files for one run, then wait for it."""
    _die_with_parent()
    request = _read_request(fds.pop("request"))
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC), "unshare")
    _fresh_workdir(workdir, request["tmpfs_bytes"], request["files"], request["uid"], request["gid"])
    pid = os.fork()
    if pid == 0:
        _exit_child(_init, request, fds, workdir, err_fd=fds["stderr"])
    for name in ("stdin", "stdout", "stderr", "nonce"):
        os.close(fds[name])
    return _wait_or_kill(pid, fds["kill"], request["wall_seconds"])


def _init(request: dict, fds: dict, workdir: str) -> int:
    """PID 1 of the run: a fresh /proc, the program as PID 2, reap until the program exits."""
    _die_with_parent()
    os.close(fds["kill"])
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    program = os.fork()
    if program == 0:
        _exit_child(_program, request, fds, workdir, err_fd=2)  # its first step puts the run's stderr there
    for name in ("stdin", "stdout", "stderr", "nonce"):
        os.close(fds[name])
    return _reap_until(program)


def _reap_until(program: int) -> int:
    while True:
        pid, status = os.wait()
        if pid == program:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _become_program(request: dict, fds: dict, workdir: str) -> None:
    """Limits, the unprivileged user, the run's stdio and nothing else open."""
    for target, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        os.dup2(fds[name], target)
    nonce_fd = fds["nonce"]
    os.closerange(3, nonce_fd)
    os.closerange(nonce_fd + 1, 1 << 16)
    os.chdir(workdir)
    for name, value in request["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    os.setgroups([])
    os.setgid(request["gid"])
    os.setuid(request["uid"])
    _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(DUMPABLE)")  # as after an execve: /proc/self is ours
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")  # no setuid binary gives root back
    _die_with_parent()  # cleared by setuid; init's death kills the namespace anyway


def _program(request: dict, fds: dict, workdir: str) -> int:
    """PID 2: become the program, read the nonce, run solution.py and tests.py, report."""
    _become_program(request, fds, workdir)
    token = os.read(fds["nonce"], 64)
    os.close(fds["nonce"])
    del request, fds
    return _harness(token)


def _harness(token: bytes) -> int:
    """The same contract as sandbox._HARNESS: the nonce only after the code and the tests ran."""
    if "random" in sys.modules:  # preloaded (statistics imports it): reseed, as a fresh interpreter would
        sys.modules["random"].seed()
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    sys.argv = ["solution.py"]
    try:
        for filename in ("solution.py", "tests.py"):
            with open(filename, encoding="utf-8") as f:
                source = f.read()
            exec(compile(source, filename, "exec"), main.__dict__)
        sys.stdout.flush()
        os.write(1, b"\n" + token + b"\n")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001 - the program's own error: traceback to its stderr
        sys.excepthook(*sys.exc_info())
        code = 1
    return _finish(code)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _finish(code: int) -> int:
    """What the interpreter does at exit: wait for threads, atexit handlers, flush; a handler's SystemExit wins."""
    import atexit

    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()
    try:
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = _exit_code(exc)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _serve_one(sock: socket.socket, workdir: str) -> None:
    fds = _recv_fds(sock)
    try:
        pid = os.fork()
        if pid == 0:
            sock.close()
            _exit_child(_supervise, fds, workdir, err_fd=fds["stderr"])
    finally:
        for fd in fds.values():
            os.close(fd)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    sock.sendall(struct.pack("!i", code))


def serve(cfg: dict) -> None:
    """Answer requests on fd ``cfg["socket"]`` one at a time, until the trainer closes it.

    No parent-death signal here: it would fire when the trainer *thread* that started us exits.
    A dead trainer closes the socket (we exit) and every kill pipe (its supervisors kill their runs).
    """
    _enter_server_namespaces()
    for name in PRELOAD:
        __import__(name)
    sock = socket.socket(fileno=cfg["socket"])
    sock.sendall(b"R")  # ready
    try:
        while True:
            _serve_one(sock, cfg["workdir"])
    except EOFError:
        pass


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(json.loads(sys.argv[2]))
    else:
        main()
