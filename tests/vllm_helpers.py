"""What the vLLM test files share: the small head_dim-32 model, the trainer's log-probs to compare vLLM's
with, and CPU vLLM servers started as a user would (`python -m grpo_trainer serve`), killed and restarted."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from grpo_trainer.models import TokenLogprobs, make_sequence_batch
from grpo_trainer.builtin.tiny import ensure_model as ensure_tiny_model

ROOT = Path(__file__).resolve().parents[1]
EOS = 2  # <|im_end|>, the tiny tokenizer's EOS
MAX_LEN = 40
TEMPERATURE = 0.8
ATOL = 2e-4  # fp32 on both sides; different kernels (vLLM CPU attention vs eager)
PROMPTS = [[1, 20, 30, 40], [1, 50, 60], [1, 70, 71, 72, 73, 74], [1, 90]]
SERVER_START_S = 900  # a CPU server starts in ~40 s alone; far longer while the machine is shared


def build_model(folder: Path) -> Path:
    """A 2-layer Llama, head_dim 32, random weights, the tiny model's tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = ensure_tiny_model()
    cfg = json.loads((Path(tiny) / "config.json").read_text())
    for key in ("architectures", "transformers_version"):
        cfg.pop(key, None)
    cfg.update(hidden_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():  # peakier than the default init, so that samples and EOS vary with the weights
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(folder)
    for f in Path(tiny).iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, folder / f.name)
    return folder


def load_lm(folder: Path):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    lm.config.use_cache = False
    return lm


def trainer_logprobs(lm, prompts, completions, temperature) -> list[list[float]]:
    batch = make_sequence_batch(prompts, completions, pad_id=0)
    with torch.no_grad():
        lp, _ = TokenLogprobs(lm, temperature=temperature)(**batch.tensors())
    return [lp[i, : len(c)].tolist() for i, c in enumerate(completions)]


def perturb(lm, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() + 1e-3))


def assert_close(a: list[list[float]], b: list[list[float]], atol=ATOL):
    for x, y in zip(a, b, strict=True):
        assert len(x) == len(y)
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=atol), (x[:5], y[:5])


def max_diff(a, b) -> float:
    return max(max(abs(u - v) for u, v in zip(x, y)) for x, y in zip(a, b) if x)


def check_rollout(rollout, n_prompts, g):
    assert len(rollout.completion_ids) == len(rollout.truncated) == len(rollout.sampling_logprobs) == n_prompts * g
    for ids, trunc, lps in zip(rollout.completion_ids, rollout.truncated, rollout.sampling_logprobs):
        assert len(lps) == len(ids) >= 1
        assert all(v <= 1e-6 for v in lps)
        assert EOS not in ids[:-1]  # nothing after the first EOS
        if trunc:
            assert len(ids) == MAX_LEN and ids[-1] != EOS
        else:
            assert ids[-1] == EOS and len(ids) <= MAX_LEN


@contextlib.contextmanager
def sampling_changed(engine, **changes):
    """Sample with some settings changed (rollout.min_p, rollout.stop, ...) for the duration."""
    before = engine.sampling
    engine.sampling = dataclasses.replace(before, **changes)
    try:
        yield
    finally:
        engine.sampling = before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A CPU vLLM server started with `python -m grpo_trainer serve CONFIG OVERRIDES -- VLLM_ARGS`, in its own
    process group (the API server, its engine core and workers), so that a kill takes all of it down, as a
    crashed machine would, and a restart comes back on the same port."""

    def __init__(self, log: Path, model_dir: Path, overrides: list[str] = (), vllm_args: list[str] = (),
                 without: tuple[str, ...] = ()):
        """`without`: flags `serve` sets that this server is started without, as by a user who typed vLLM's command
        by hand (`serve` refuses to override its own flags)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        config = ["configs/demo_cpu.yaml", f"model.name_or_path={model_dir}", "rollout.vllm.max_model_len=256",
                  "rollout.vllm.kv_cache_memory_bytes=268435456", "rollout.engine=vllm_server", *overrides]
        self.command = [sys.executable, "-m", "grpo_trainer", "serve", *config, "--port", str(self.port), "--", *vllm_args]
        self.env: dict[str, str] = {}
        if without:
            from grpo_trainer.config import load_config
            from grpo_trainer.serve import serve_command

            command, self.env = serve_command(load_config(ROOT / config[0], config[1:]), port=self.port,
                                              vllm_args=list(vllm_args))
            dropped = {i for i, arg in enumerate(command) if arg in without}
            dropped |= {i + 1 for i in dropped if i + 1 < len(command) and not command[i + 1].startswith("--")}
            self.command = [arg for i, arg in enumerate(command) if i not in dropped]
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        with open(self.log, "a") as fh:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONPATH=str(ROOT), **self.env), start_new_session=True)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5):
                return True
        except OSError:
            return False

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while not self.healthy():
            assert self.proc.poll() is None, f"vLLM server exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"vLLM server not healthy after {SERVER_START_S}s:\n{self.tail()}"
            time.sleep(0.5)

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def kill(self) -> None:
        """SIGKILL the whole server (API process, engine core, workers) and wait until it is gone."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        deadline = time.monotonic() + 60
        while self.healthy() and time.monotonic() < deadline:  # the port is free once it stops answering
            time.sleep(0.1)

    def requests_running(self) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("vllm:num_requests_running"):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc = None


class Again:
    """An environment answering every plain reply with a user message; done after its third answer."""

    def reset(self, seed: int, **row) -> None:
        self.answers = 0

    def step(self, reply: str) -> tuple[str, bool]:
        self.answers += 1
        return f"again {self.answers}", self.answers >= 3

    def get_reward(self) -> float:
        return float(self.answers)


def assert_episodes_line_up(engine, model_dir, lm, group: int) -> None:
    """environment.factory's episode loop (`Again`) around a vLLM engine: every episode continued from its whole
    context (environment messages between turns), the sampler's per-turn log-probs equal the trainer's one forward
    over the conversation on every model-written token; environment tokens masked with log-prob 0."""
    from transformers import AutoTokenizer

    from grpo_trainer.environments import EpisodeSpec
    from grpo_trainer.environments.class_env import ClassEnvironment
    from grpo_trainer.environments.episodes import EpisodeEngine, EpisodeSettings

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    env = ClassEnvironment(Again, "environment.factory test:Again", {}, extra_tools=[], tool_timeout=5)
    settings = EpisodeSettings(max_turns=3, step_timeout=5.0, episode_timeout=30.0, concurrency=8, observation_chars=100,
                               record=True)
    loop = EpisodeEngine(engine, env, tokenizer, eos_token_ids=[EOS], max_completion_length=200, settings=settings)
    specs = [EpisodeSpec({"prompt": "-"}, 7, f"p{i}", lambda text: None) for i in range(len(PROMPTS))]
    out = loop.generate(PROMPTS, group, seeds=[11, 12, 13, 14], episodes=specs)  # seeded: the same episodes each run
    rows = [j for j, turns in enumerate(out.turns) if turns > 1]
    assert len(rows) >= 3, out.turns
    assert {e.ended_by for e in out.episodes} <= {"environment", "length", "model", "turns"}
    trainer = trainer_logprobs(lm, [PROMPTS[j // group] for j in rows], [out.completion_ids[j] for j in rows], TEMPERATURE)
    for j, theirs in zip(rows, trainer):
        mask, sampled = out.completion_mask[j], out.sampling_logprobs[j]
        assert 0 in mask and len(sampled) == len(mask) == len(out.completion_ids[j])
        assert all(s == 0.0 for s, m in zip(sampled, mask) if not m)
        assert max(abs(s - t) for s, t, m in zip(sampled, theirs, mask) if m) < ATOL
        assert "again 1" in tokenizer.decode([t for t, m in zip(out.completion_ids[j], mask) if not m])
