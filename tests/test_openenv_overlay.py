"""The OpenEnv overlay's list (.ci/openenv-overlay.txt) is complete on its own: `make test VLLM=` builds a venv
without vLLM, and the overlay must not borrow what only vLLM brings into the venv (pydantic-settings, jsonschema,
sse-starlette, ...). The OpenEnv test server is started with every module that only vLLM's requirements
installed made unimportable (tests/openenv_without_vllm.py), and must serve an episode."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from grpo_trainer.environments import EpisodeSpec
from grpo_trainer.environments.openenv_ws import OpenEnvRemote
from grpo_trainer.environments.tools import parse_tool_calls
from helpers import ROOT, free_port
from openenv_overlay import overlay_or_skip

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("openenv")]


def test_the_overlay_serves_without_what_only_vllm_installs(tmp_path):
    overlay = overlay_or_skip()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(overlay), str(ROOT / "tests"), str(ROOT)])}
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "openenv_without_vllm.py"),
                                 str(ROOT / "tests" / "openenv_envs.py"), str(port), str(free_port())],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
        env_ = OpenEnvRemote(f"openenv+ws://127.0.0.1:{port}", sessions=1, step_timeout=5.0, reconnect_timeout=5.0,
                             max_message_mb=1.0)
        episode = env_.episode()
        spec = EpisodeSpec({"prompt": "Play."}, seed=5, episode_id="s1-d0-p0", extend_prompt=lambda text: [])
        assert episode.reset(spec, 0) == "Guess my number from 1 to 8."
        secret = random.Random(5).randint(1, 8)
        text = f'<tool_call>{{"name": "guess", "arguments": {{"guess": {secret}}}}}</tool_call>'
        assert episode.respond(text, parse_tool_calls(text)).reward == 1.0
        episode.close()
        env_.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
