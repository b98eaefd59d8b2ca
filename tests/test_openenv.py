"""Real OpenEnv 0.10 environments (tests/openenv_envs.py) through our adapters: over `/ws` against a real OpenEnv
server (uvicorn, 127.0.0.1, free ports) from this process, which never imports openenv (the remote kind needs
none); and in process, in a child pytest (tests/openenv_inprocess_cases.py), since only processes with the
OpenEnv overlay on their path may import openenv (tests/openenv_overlay.py says why).

The adapters are driven directly (reset / respond / reward / snapshot / close), as the episode loop does; the
loop itself, with its time limits and failure policy, is tested in tests/test_environments.py.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from grpo_trainer.environments import EpisodeSpec, ProtocolBreach
from grpo_trainer.environments.openenv_ws import (
    Disconnected, EnvironmentServerLost, OpenEnvRemote, ServerError, StepTimeout, fetch_schema,
)
from grpo_trainer.errors import ConfigError
from grpo_trainer.environments.tools import parse_tool_calls
from helpers import ROOT, free_port
from openenv_loop import END, WON, call, check_a_won_episode, check_episodes_resume_under_async, play
import openenv_overlay
from openenv_overlay import overlay_or_skip

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("openenv")]  # slow: OpenEnv servers, a child pytest

HANG_SECONDS = 4.0  # openenv_envs.HANG_SECONDS (that module imports openenv: not here)


@pytest.fixture(scope="module")
def overlay() -> Path:
    return overlay_or_skip()


def start_server(overlay: Path, ports: list[int], log: Path) -> subprocess.Popen:
    """tests/openenv_envs.py serving on `ports`, with the overlay on its path; returns once every port is healthy."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(overlay), str(ROOT / "tests"), str(ROOT)])}
    with open(log, "a") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "openenv_envs.py"), *map(str, ports)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    for port in ports:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    stop(proc)
                    pytest.fail(f"the OpenEnv test server did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.1)
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def servers(overlay, tmp_path_factory):
    """GuessEnv served twice: with 32 sessions, and with OpenEnv's default capacity of one."""
    ports = [free_port(), free_port()]
    proc = start_server(overlay, ports, tmp_path_factory.mktemp("openenv") / "server.log")
    yield [f"openenv+ws://127.0.0.1:{port}" for port in ports]
    stop(proc)


def test_an_overlay_that_cannot_be_built_skips_the_tests_or_fails_them_under_make_test(overlay, monkeypatch, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text(f"{tmp_path / 'missing-0.1-py3-none-any.whl'}\n")  # fails before any index is asked
    with pytest.raises(subprocess.CalledProcessError):
        openenv_overlay.build(bad)
    assert (overlay / ".installed").read_text() == openenv_overlay.REQUIREMENTS.read_text()  # the overlay is intact
    assert not list(overlay.parent.glob("openenv-overlay.*/"))  # and no half-built folder is left

    def broken():
        raise subprocess.CalledProcessError(2, ["uv"], stderr="error: Failed to fetch: `https://pypi.org/simple/openenv/`")

    monkeypatch.setattr(openenv_overlay, "build", broken)
    monkeypatch.delenv(openenv_overlay.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"could not be built from openenv-overlay.txt: error: Failed to fetch"):
        openenv_overlay.overlay_or_skip()
    monkeypatch.setenv(openenv_overlay.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=r"GRPO_TRAINER_REQUIRE_OPENENV=1: `make test` needs OpenEnv"):
        openenv_overlay.overlay_or_skip()


def remote(url: str, sessions: int = 2, step_timeout: float = 1.0, reconnect_timeout: float = 5.0, **kw) -> OpenEnvRemote:
    return OpenEnvRemote(url, sessions=sessions, step_timeout=step_timeout, reconnect_timeout=reconnect_timeout,
                         max_message_mb=1.0, **kw)


def spec(seed: int = 5, **row) -> EpisodeSpec:
    return EpisodeSpec({"prompt": "Play.", **row}, seed=seed, episode_id="s1-d0-p0", extend_prompt=lambda text: [])


def turn(episode, text: str):
    return episode.respond(text, parse_tool_calls(text))


def test_a_remote_episode_plays_by_tool_calls_and_plain_json_with_the_servers_schema(servers):
    env = remote(servers[0])
    assert env.tools == [{"type": "function", "function": {
        "name": "guess", "description": "Guess the number.",
        "parameters": {"type": "object", "properties": {"guess": {"title": "Guess", "type": "integer"}}, "required": ["guess"]}}}]
    episode = env.episode()
    # `hint` is in reset's signature, `level` is not: the server passes only what reset takes.
    assert episode.reset(spec(seed=5, hint="Be quick.", level=3), 0) == "Guess my number from 1 to 8. Be quick."
    secret = random.Random(5).randint(1, 8)  # the env's rule, from the group's seed
    low = 1 if secret > 1 else 2
    first = turn(episode, call(low))
    assert first.messages == [{"role": "tool", "name": "guess", "content": "higher" if low < secret else "lower"}]
    assert (first.done, first.reward, first.tool_calls, first.invalid_actions) == (False, 0.0, 1, 0)
    bad = turn(episode, call('"abc"'))  # the server's Action rejects it: told to the model, not a failure
    assert bad.invalid_actions == 1 and bad.tool_errors == 1 and bad.messages[0]["role"] == "tool"
    assert bad.messages[0]["content"].startswith("error: invalid action: guess: Input should be a valid integer")
    hit = turn(episode, f'I think {{"guess": {secret}}}')  # a plain reply holding a JSON object: answered as the user
    assert hit.messages == [{"role": "user", "content": "yes"}] and hit.done and hit.reward == 1.0
    assert episode.reward() == 1.0  # the steps' rewards summed: 0 + 1
    shot = episode.snapshot()
    assert shot.state == {"episode_id": "s1-d0-p0-g0", "step_count": 2, "seed": 5} and shot.done and shot.reward == 1.0
    assert shot.observation == {"feedback": "yes"}
    episode.close()
    env.close()


def test_a_reset_that_says_done_leaves_the_model_one_turn(servers):
    env = remote(servers[0])
    episode = env.episode()
    episode.reset(spec(over=True), 0)
    reply = turn(episode, call(3))
    assert reply.messages == [] and reply.done and episode.reward() is None  # the step was never sent
    assert episode.snapshot().state["step_count"] == 0
    episode.close()
    env.close()


@pytest.mark.parametrize("guess, error, says", [
    (13, ServerError, "step: unlucky 13 (EXECUTION_ERROR)"),  # the server's environment raised
    (16, ProtocolBreach, "whose done is 'yes'"),  # lies about done
    (15, ServerError, "larger than 1 MiB (environment.max_message_mb)"),  # a frame over our limit
    (14, StepTimeout, "no answer to step within 2 s"),  # hangs: step_timeout 1 s + REPLY_GRACE
])
def test_a_hostile_remote_step_fails_its_episode_alone_and_the_next_episode_plays(servers, guess, error, says):
    env = remote(servers[0], sessions=1)
    episode = env.episode()
    episode.reset(spec(), 0)
    # A hang is given up, not waited out: StepTimeout is raised only when no answer came within the reply timeout;
    # a client that waited HANG_SECONDS would get the step's answer and raise nothing (DID NOT RAISE).
    with pytest.raises(error, match=re.escape(says)):
        turn(episode, call(guess))
    episode.close()
    # The one session was dropped after a timeout or the server's error (never reused: a late reply would answer
    # the next request); a new one is opened. A hung step holds its server slot until it returns: waited for.
    after = env.episode()
    assert after.reset(spec(), 1) == "Guess my number from 1 to 8."
    assert turn(after, call(8)).messages[0]["content"] in ("yes", "lower")
    after.close()
    env.close()


def test_a_server_with_one_session_is_reported_and_episodes_take_turns_on_it(servers, caplog):
    env = remote(servers[1], sessions=3)
    assert env._pool is None  # opened when the first episode needs one: a build for the tools alone holds none
    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        assert env.capacity == 1 and env.pool.capacity_refusals == 1
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"{servers[1]} accepts 1 session (Server at capacity: 1/1 sessions active")
    assert "running 1 episode at a time on this rank (environment.concurrency 3)" in warning
    for j in range(3):  # one after the other on the one session
        episode = env.episode()
        assert episode.reset(spec(), j) is not None
        episode.close()
    busy = env.episode()
    busy.reset(spec(), 0)
    with pytest.raises(Disconnected, match=r"no session free within 1 s \(capacity 1\)"):
        env.episode().reset(spec(), 1)  # the loop sizes waves by env.capacity; beyond it, a call waits, then fails
    busy.close()
    env.close()


def test_no_server_is_one_line_naming_the_url():
    url = f"openenv+ws://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=rf"^environment.url {re.escape(url)}: no OpenEnv server answers \(GET http://127.0.0.1:\d+/health: .*refused"):
        fetch_schema(url, timeout=2)


def test_a_server_that_is_not_openenv_or_lacks_the_observation_field_is_one_line(servers):
    from http.server import BaseHTTPRequestHandler, HTTPServer

    other = HTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)  # answers every GET with 501
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        url = f"openenv+ws://127.0.0.1:{other.server_port}"
        with pytest.raises(ConfigError, match=rf"^environment.url {re.escape(url)}: GET http://127.0.0.1:\d+/health answered 501 .*; is it an OpenEnv server\?$"):
            fetch_schema(url, timeout=2)
    finally:
        other.shutdown()
    with pytest.raises(ConfigError, match=r"^environment.observation_field 'text': the observation of .* has no such field \(feedback\)$"):
        remote(servers[0], observation_field="text")


def test_a_server_that_drops_is_reconnected_and_one_that_stays_away_stops_the_run(overlay, tmp_path):
    port = free_port()
    url = f"openenv+ws://127.0.0.1:{port}"
    proc = start_server(overlay, [port], tmp_path / "server.log")
    try:
        env = remote(url, sessions=2, step_timeout=2.0, reconnect_timeout=60.0)
        episode = env.episode()
        episode.reset(spec(), 0)
        with pytest.raises(Disconnected, match=f"^{re.escape(url)} closed the connection"):
            turn(episode, call(99))  # the server's process dies mid-step
        proc.wait(timeout=30)
        episode.close()
        assert env.pool.disconnects == 1 and env.pool._open == 1  # the other session waits, dead, in the pool
        proc = start_server(overlay, [port], tmp_path / "server.log")  # back on the same port
        again = [env.episode() for _ in range(2)]
        assert [e.reset(spec(), j) for j, e in enumerate(again)] == ["Guess my number from 1 to 8."] * 2
        assert env.pool.reconnects == 1  # the dead free session was replaced before the episode began
        with pytest.raises(Disconnected, match="closed the connection"):
            turn(again[0], call(99))  # drops again; this time it stays away
        proc.wait(timeout=30)
        again[1].close()
    finally:
        stop(proc)
    # Through the loop: episodes that cannot get a session fail as `disconnect` meanwhile; then generate raises.
    env.pool.reconnect_timeout = 1.0
    start = time.monotonic()
    with pytest.raises(EnvironmentServerLost, match=rf"^{re.escape(url)} went away and did not come back within 1 s \(environment.reconnect_timeout\); stopping$"):
        while time.monotonic() - start < 60:  # a safety net: it raises once reconnect_timeout has passed
            out, _ = play(env, WON, step_timeout=3.0)  # above the pool's 2 s of backoff per session
            assert [r.ended_by for r in out.episodes] == ["disconnect"] * 2
            assert out.episodes[0].error.startswith(f"reset: Disconnected: {url}")
    env.close()


def test_openenv_in_process(overlay, servers):
    """tests/openenv_inprocess_cases.py in a child pytest with the overlay on its path (and the server's URL, to
    compare in-process episodes with remote ones)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(overlay), str(ROOT / "tests"), str(ROOT)]),
           "GRPO_TRAINER_OPENENV_URL": servers[0]}
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                             str(ROOT / "tests" / "openenv_inprocess_cases.py")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


def test_remote_episodes_through_the_loop(servers, tiny_model_path):
    """The episode loop over /ws: a won episode as the loop records it (openenv_loop.check_a_won_episode), the
    server's snapshot for the rewards; a step the server's environment raises in, and one that hangs past
    environment.step_timeout, end their episodes as failures saying why."""
    env = remote(servers[0], sessions=4, step_timeout=0.5)
    out, tokenizer = play(env, WON, step_timeout=0.5)
    check_a_won_episode(out, tokenizer)
    snapshot = out.environments[1]
    assert snapshot.state["step_count"] == 2 and snapshot.reward == 1.0 and snapshot.observation == {"feedback": "yes"}
    raised, _ = play(env, [call(13) + END, "never"], step_timeout=0.5)
    assert [(r.ended_by, r.error) for r in raised.episodes] == [("error", f"respond: ServerError: {servers[0]} step: unlucky 13 (EXECUTION_ERROR)")] * 2
    assert env.pool._open == 4 - 2  # sessions whose server environment raised are not reused
    hung, _ = play(env, [call(14) + END, "never"], step_timeout=0.5)
    # `timeout` is the loop abandoning the calls at step_timeout: had it waited, the server's answer (after
    # HANG_SECONDS) or the client's StepTimeout (REPLY_GRACE later, an `error`) would have ended them otherwise.
    assert [r.ended_by for r in hung.episodes] == ["timeout"] * 2 and all("step_timeout" in r.error for r in hung.episodes)
    deadline = time.monotonic() + 60  # a safety net only: the abandoned calls' waits end REPLY_GRACE after step_timeout
    while env.pool._open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert env.pool._open == 0 and env.capacity == 4  # their sessions were dropped, not leaked
    again, tokenizer = play(env, WON, step_timeout=0.5)  # two new sessions (the hung steps still hold two slots)
    check_a_won_episode(again, tokenizer)
    env.close()
    assert not [m for m in sys.modules if m.split(".")[0] in ("openenv", "fastmcp")]  # the remote kind needs no openenv


def test_remote_episodes_play_under_async_rollouts_and_resume_with_their_snapshots(servers, tmp_path):
    """environment.url under rollout.max_staleness 1: the episodes play over /ws from the queue's thread, and a
    checkpoint saves what the rewards get (the server's snapshot: plain data, no connection)."""
    env = remote(servers[0], sessions=4, step_timeout=5.0)
    check_episodes_resume_under_async(env, tmp_path)
    env.close()


def test_remote_episodes_play_in_waves_of_the_sessions_held_and_refusals_are_counted(servers):
    """Six episodes on two sessions play in three waves (before waves, four of them waited step_timeout for a
    session and failed); a server that accepts one session is counted in environment/capacity_refusals, and a
    group larger than what it accepts is refused in one line."""
    env = remote(servers[0], sessions=2)
    out, _ = play(env, WON, groups=3)
    assert [(r.ended_by, r.env_reward) for r in out.episodes] == [("environment", 1.0)] * 6
    assert out.env_counters == {"capacity_refusals": 0, "reconnects": 0}
    env.close()
    one = remote(servers[1], sessions=3)
    out, _ = play(one, WON, groups=2, g=1)
    assert [(r.ended_by, r.env_reward) for r in out.episodes] == [("environment", 1.0)] * 2
    assert out.env_counters == {"capacity_refusals": 1, "reconnects": 0}
    with pytest.raises(ConfigError, match=rf"^environment.url {re.escape(servers[1])}: a group's 2 episodes must play at once, and this rank can run 1 "):
        play(one, WON)
    one.close()


def test_a_run_trains_against_an_openenv_server_from_the_cli(servers, tmp_path):
    """`environment.url` on the tiny model (hf engine): a step and an evaluation play their episodes over /ws (the
    server has 32 sessions: the 16 of the run, and room for steps still hanging from earlier tests; the
    tiny model writes no valid guess: its turns are invalid actions, told to the model), the
    environment's metrics, the session pool's counters included, are logged and nothing fails. (A turn cut by the length limit gets no answer.)"""
    from grpo_trainer.metrics import read_metrics
    from helpers import run_cli, small_run_overrides

    out = tmp_path / "run"
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, 1), f"environment.url={servers[0]}",
                      "environment.concurrency=16", "environment.max_turns=2", "rewards=[]", "eval.every=1",
                      "eval.num_samples=4"])
    assert result.returncode == 0, result.stderr[-3000:]
    [record] = read_metrics(out)
    assert record["environment/errors"] == record["environment/disconnects"] == record["environment/frac_failed"] == 0
    assert record["environment/capacity_refusals"] == record["environment/reconnects"] == 0  # the pool's, logged
    assert record["environment/invalid_actions_per_episode"] > 0 and "eval/environment/mean@4" in record
