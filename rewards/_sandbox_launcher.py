"""Trusted first process of every sandbox run (see ``rewards/sandbox.py``).

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
    "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME,
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
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={tmpfs_bytes},nr_inodes=4096,mode=0700,uid={uid},gid={gid}")
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
    pids = []
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


if __name__ == "__main__":
    main()
