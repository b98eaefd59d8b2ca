"""rewards.sandbox against hostile programs: one property per test.

Every hostile run must end within its limit, leave this test process running,
not count as completed, and change nothing outside its own temporary directory.
Properties that the weaker ``setuid`` mode also claims run in both modes when
we are root.
"""

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from rewards.sandbox import MODES, Limits, run_python, sandbox_mode

# The process census below counts every process of `nobody` on the machine: all tests that run sandboxed
# code as `nobody` share one pytest-xdist worker, so they never run at the same time.
pytestmark = [pytest.mark.xdist_group("sandbox"), pytest.mark.slow]  # slow: every test runs sandboxed processes

WALL = 2.0
FAST = Limits(wall_seconds=WALL)

ROOT = os.geteuid() == 0
BOTH_MODES = ["namespaces", "setuid"] if ROOT and sandbox_mode() == "namespaces" else [sandbox_mode()]


request_cleanup = []


@pytest.fixture(autouse=True, scope="module")
def _remove_canary_dirs():
    yield
    for path in request_cleanup:
        shutil.rmtree(path, ignore_errors=True)


def run_hostile(code, tests="", mode=None, limits=FAST, **kwargs):
    """Each test names why its program was stopped (the result's flags: timed_out, output_overflow, ...)."""
    result = run_python(code, tests, mode=mode, limits=limits, **kwargs)
    assert not result.completed
    return result


def _uid_processes(uid):
    """Live processes of `uid` (zombies excluded: they are already dead, only not yet reaped by init)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid and _state(entry) != "Z":
                    pids.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return pids


def _state(pid) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


# ------------------------------------------------------------- positives


def test_mode_is_reported_and_strongest_here():
    assert sandbox_mode() in MODES
    if ROOT and subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount-proc", "true"]).returncode == 0:
        assert sandbox_mode() == "namespaces"


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_code_and_tests_that_pass_complete(mode):
    result = run_python("def f(x):\n    return 2 * x\n", "assert f(3) == 6\nprint('ok')", mode=mode)
    assert result.completed, result.stderr
    assert result.stdout == b"ok\n"  # the nonce line is not part of the program's output


def test_failing_assert_does_not_complete():
    result = run_python("def f(x):\n    return x\n", "assert f(3) == 6")
    assert not result.completed
    assert b"AssertionError" in result.stderr


def test_stdin_reaches_the_program():
    result = run_python("print(sum(map(int, input().split())))", stdin=b"2 3\n")
    assert result.completed and result.stdout == b"5\n"


# ------------------------------------------------------------- hostile


def test_infinite_loop_is_killed():
    result = run_hostile("while True:\n    pass\n")
    assert result.timed_out


def test_sleeping_forever_is_killed_by_wall_clock():
    result = run_hostile("import time\ntime.sleep(3600)\n")
    assert result.timed_out


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_fork_bomb_is_contained_and_cleaned_up(mode):
    nobody_before = set(_uid_processes(65534))
    run_hostile(
        "import os, time\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"  # try to escape the process group as well
        "    except OSError:\n"
        "        time.sleep(0.001)\n",
        mode=mode,
    )
    # Cleanup is synchronous (the launcher kills the tree before it exits); the wait only covers a loaded
    # machine's scheduling, and ends as soon as the processes are gone (a guard, not a speed claim).
    deadline = time.monotonic() + 60.0
    while (left := set(_uid_processes(65534)) - nobody_before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == set(), {pid: _state(pid) for pid in list(left)[:5] if os.path.exists(f"/proc/{pid}")}


def test_memory_bomb_fails_fast():
    result = run_hostile("x = bytearray(64 * 2**30)\n", "assert True")
    assert b"MemoryError" in result.stderr
    assert not result.timed_out


def test_slow_memory_growth_hits_the_limit():
    limits = Limits(wall_seconds=10.0, memory_bytes=256 * 2**20)  # filling 1 GiB takes seconds here
    result = run_hostile("chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))\n", limits=limits)
    assert b"MemoryError" in result.stderr
    assert not result.timed_out


def test_disk_filling_write_is_stopped(tmp_path):
    usage_before = os.statvfs("/tmp")
    run_hostile(
        "with open('big', 'wb') as f:\n"
        "    while True:\n"
        "        f.write(b'0' * 2**20)\n"
    )
    run_hostile(  # many files each under the per-file limit
        "i = 0\n"
        "while True:\n"
        "    with open(f'f{i}', 'wb') as f:\n"
        "        f.write(b'0' * (8 * 2**20))\n"
        "    i += 1\n"
    )
    usage_after = os.statvfs("/tmp")
    lost = (usage_before.f_bavail - usage_after.f_bavail) * usage_after.f_frsize
    assert lost < 256 * 2**20


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_files_outside_the_sandbox_cannot_be_changed(mode):
    outside = pathlib.Path(tempfile.mkdtemp(prefix="sandbox-canary-"))
    request_cleanup.append(outside)
    canary = outside / "canary.txt"
    canary.write_text("original")
    # Readable by the sandbox; in namespaces mode even world-writable (every mount is read-only inside).
    outside.chmod(0o777 if mode == "namespaces" else 0o755)
    canary.chmod(0o666 if mode == "namespaces" else 0o644)
    created = [str(outside / "created.txt"), "/work/escape.txt", "/etc/escape.txt"]
    if mode == "namespaces":  # without it, nobody can write world-writable places (documented)
        created += [f"/tmp/escape-{uuid.uuid4().hex}", f"/var/tmp/escape-{uuid.uuid4().hex}",
                    f"/dev/shm/escape-{uuid.uuid4().hex}"]
    code = (
        "import os, shutil\n"
        f"canary, created = {str(canary)!r}, {created!r}\n"
        "attempts = [lambda: open(canary, 'w').write('owned'), lambda: os.remove(canary),\n"
        "            lambda: os.rename(canary, canary + '.moved'), lambda: os.chmod(canary, 0),\n"
        "            lambda: shutil.rmtree(os.path.dirname(canary))]\n"
        "attempts += [lambda p=p: open(p, 'w').write('x') for p in created]\n"
        "for attempt in attempts:\n"
        "    try:\n"
        "        attempt()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    run_hostile(code, "assert False", mode=mode)
    assert canary.read_text() == "original"
    assert canary.stat().st_mode & 0o777 in (0o644, 0o666)
    assert [p for p in created if os.path.exists(p)] == []


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_network_connection_never_arrives(mode):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    port = listener.getsockname()[1]
    code = (
        "import socket, subprocess\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hello')\n"
        "except OSError as e:\n"
        "    print('blocked', e)\n"
    )
    try:
        run_hostile(code, "assert False", mode=mode)
        listener.settimeout(0.5)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


PRINTS_FOREVER = """
import sys
while True:
    try:
        sys.stdout.write('x' * 2**20)
        sys.stdout.flush()
    except OSError:  # the reader closed its end: printing on, only a kill ends this
        pass
"""


def test_printing_gigabytes_is_cut_off():
    """Killed on overflow, not at its wall-clock limit: the program prints on past a closed pipe, and with a limit
    of ten minutes its run ends in time for the safety net below only if the overflow killed it (the kill is
    reported like a timeout's, so the flags alone cannot tell). Were it not killed, the run would still be going
    when the net gives up: the test fails saying so."""
    limits = Limits(wall_seconds=600.0, output_bytes=2**20)
    ended = []

    def run():
        try:
            ended.append(run_python(PRINTS_FOREVER, limits=limits))
        except BaseException as exc:  # raised again below
            ended.append(exc)

    runner = threading.Thread(target=run, daemon=True)  # a run that is never killed must not hold pytest's exit
    runner.start()
    runner.join(timeout=300)  # the safety net: far above the fraction of a second the kill takes, half the limit
    assert ended, "the program printing without end was not killed on overflow"
    if isinstance(ended[0], BaseException):
        raise ended[0]
    assert ended[0].output_overflow and not ended[0].completed
    assert len(ended[0].stdout) <= 2**20


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_killing_the_parent_and_everyone_fails(mode):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = (
            "import os, signal\n"
            "for attempt in (lambda: os.kill(os.getppid(), 9), lambda: os.killpg(os.getpgid(0), 9),\n"
            f"                lambda: os.kill({os.getpid()}, 9), lambda: os.kill({bystander.pid}, 9),\n"
            "                lambda: os.kill(-1, 9), lambda: os.kill(1, 9)):\n"
            "    try:\n"
            "        attempt()\n"
            "    except OSError:\n"
            "        pass\n"
        )
        run_hostile(code, "assert False", mode=mode)
        assert bystander.poll() is None  # a process of ours, outside the sandbox, survived
    finally:
        bystander.kill()
        bystander.wait()
    # and this test process is still here to assert it


@pytest.mark.parametrize(
    "exit_early",
    ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "raise SystemExit(0)\n",
     "import atexit, os\natexit.register(lambda: os._exit(0))\nraise SystemExit(0)\n"],
    ids=["sys.exit", "os._exit", "SystemExit", "atexit"],
)
def test_exiting_before_the_tests_does_not_pass(exit_early):
    result = run_python(exit_early, "assert False, 'the tests must run'")
    assert result.returncode == 0  # the exit status alone would have said "pass"
    assert not result.completed


def test_fake_pass_markers_do_not_pass():
    code = (
        "import builtins, os, sys\n"
        "print('PASSED'); print('All tests passed'); print('OK')\n"
        "os.write(1, b'\\n' + b'0' * 32 + b'\\n')\n"  # shaped like the nonce line
        "builtins.AssertionError = type('Never', (Exception,), {})\n"  # tamper with the harness's world
        "sys.stdout.flush()\n"
        "os._exit(0)\n"
    )
    result = run_python(code, "assert False")
    assert not result.completed


def test_nonce_differs_per_run_and_is_not_in_files():
    code = "import os\nfor name in sorted(os.listdir('.')):\n    print(name, open(name).read())\n"
    first, second = run_python(code), run_python(code)
    assert first.completed and second.completed
    assert first.stdout == second.stdout  # nothing run-specific is visible to the program


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_environment_secrets_are_not_visible(monkeypatch, mode):
    secret = "hunter2-" + uuid.uuid4().hex
    monkeypatch.setenv("GRPO_TEST_SECRET", secret)
    code = (
        "import os\n"
        "print(dict(os.environ))\n"
        "for path in ('/proc/self/environ', f'/proc/{os.getppid()}/environ', '/proc/1/environ'):\n"
        "    try:\n"
        "        print(open(path, 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(path, e)\n"
    )
    result = run_python(code, mode=mode)
    assert result.completed
    assert b"GRPO_TEST_SECRET" not in result.stdout and secret.encode() not in result.stdout
    assert os.environ["GRPO_TEST_SECRET"] == secret


def test_runs_as_unprivileged_user_when_root():
    if not ROOT:
        pytest.skip("only root drops privileges")
    result = run_python("import os\nprint(os.getuid(), os.getgid(), os.getgroups())")
    assert result.stdout.split()[:2] == [b"65534", b"65534"]
