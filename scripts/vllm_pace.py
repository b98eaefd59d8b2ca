"""Our vLLM engines' rollout against vLLM alone, on the same prompts and sampling: what our engines add to a step.

    .venv/bin/python scripts/vllm_pace.py                                   # tiny32, both engines, 5 reps
    .venv/bin/python scripts/vllm_pace.py --model builtin:smollm2-135m-instruct --prompts 4 --g 8 --max-tokens 64
    .venv/bin/python scripts/vllm_pace.py --engines server --server-url URL  # against a server already running

Colocated: one `VLLMColocateEngine` (vLLM in this process). Each rep calls our `engine.generate(prompts, G,
seeds)` and, on the very same `vllm.LLM`, `LLM.generate` alone with the `SamplingParams` built from
vllm_sampling.py's `sampling_fields` / `request_seed` (the ones our engine builds: checked equal, by their repr,
to what our engine passed) and the same token-id prompts, built before its timing starts, under `torch.no_grad()` as
our engine calls it. One engine for both sides: the same weights, KV cache and kernels, so that the difference is
our engine's Python. vLLM's token budget a step (`max_num_batched_tokens`, both engines) is raised to a whole step's
prefill: vLLM 0.32's CPU build fails seeded requests whose prefill is chunked (see `batched_tokens`).

Server: one server started as a user would (`python -m grpo_trainer serve`, weight_sync none), our
`VLLMServerEngine.generate` against a minimal direct client that POSTs the same `/v1/completions` bodies (our
engine's `_requests`, JSON-encoded before its timing starts) concurrently, one kept-alive connection per thread of a
pool started once, and stops its clock when the last answer's bytes are in (it parses nothing). A third side, the
same client with a new pool per call and a new connection per request (the shape of our engine's transport, without
urllib and JSON), tells how much of the gap connections make.

Both sides get the same per-prompt seeds in a rep (a new set each rep), so they sample the same completions (the
table says how many came out identical); the order alternates (ours first in even reps, vLLM's first in odd ones),
after one untimed call of each, `gc.collect()` before each side. Overhead = (ours - vLLM's) / vLLM's, on the medians;
paired = the median of each rep's own ratio; outside vLLM = our code around vLLM's call (all phases but `wait`) over
vLLM's median, the figure that holds on a busy machine (end-to-end ratios there move with the load). Our time is split, by wrapping
the engine's own functions in this script (the engine files are not touched):

    build     request building (colocated: SamplingParams + TokensPrompt; server: the JSON bodies' dicts)
    wait      inside vLLM (colocated: LLM.generate; server: sending, the server's work, reading and JSON-decoding)
    extract   log-prob extraction (the sampled token's log-prob out of vLLM's output)
    cut       vllm_sampling.cut_completion (EOS / truncation), per sample
    assemble  the rest: the Rollout, per-prompt bookkeeping, the engine's checks

Prints a table, a breakdown, a one-line verdict against the 10% target (issue 47) and a RESULT line
(scripts/gpu_check.sh). `--json PATH` writes the numbers with the machine (scripts/machine.py) and load average.
On a GPU vLLM picks it; nothing is downloaded with the default model (tiny32 is built from the embedded tiny model).
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as the colocated engine runs it
TARGET = 0.10
PHASES = ("build", "wait", "extract", "cut", "assemble")
TINY32 = "tiny32"
QUESTIONS = [
    "What is {a} + {b}?",
    "Tom has {a} apples and buys {b} more. How many now?",
    "Compute {a} times {b}.",
    "Is {a} larger than {b}? Explain.",
    "Write a short poem about the number {a}.",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default=TINY32,
        help=f"{TINY32} (the tiny model's tokenizer, head_dim 32, random weights: vLLM's CPU attention takes no head_dim "
        "24), builtin:smollm2-135m-instruct or a model folder",
    )
    p.add_argument("--engines", default="colocate,server", help="colocate, server or both (comma-separated)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--g", type=int, default=8, help="completions per prompt (n)")
    p.add_argument("--max-tokens", type=int, default=16, help="max new tokens per completion")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=5, help="timed calls of each side, alternating (>= 3 for the doc)")
    p.add_argument("--dtype", default="float32", help="vLLM's dtype")
    p.add_argument("--kv-cache-mib", type=int, default=512, help="vLLM's KV cache (kv_cache_memory_bytes)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="on a GPU: size the KV cache by this share of the GPU instead of --kv-cache-mib",
    )
    p.add_argument(
        "--server-url", help="use this running server (started by `grpo_trainer serve`) instead of one of ours"
    )
    p.add_argument("--port", type=int, default=0, help="the port of the server we start (0: a free one)")
    p.add_argument("--json", help="also write the numbers here")
    return p


def batched_tokens(prompts: list[list[int]], args) -> int:
    """vLLM's token budget per step, large enough that no prompt's prefill is split: vLLM 0.32's CPU build fails a
    seeded request whose prefill is chunked ("CPU Generator does not use offset", gpu_model_runner's discarded
    sample), and our engines seed every request."""
    return max(2048, args.g * sum(len(p) for p in prompts))


def build_tiny32(folder: Path) -> str:
    """A 2-layer Llama, head_dim 32, random weights, the tiny model's tokenizer and chat template (as the vLLM tests'
    model, tests/vllm_helpers.py: the builtin tiny model's head_dim 24 is one vLLM's CPU attention refuses)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_trainer.builtin.tiny import ensure_model

    tiny = Path(ensure_model())
    cfg = json.loads((tiny / "config.json").read_text())
    for key in ("architectures", "transformers_version"):
        cfg.pop(key, None)
    cfg.update(hidden_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(folder)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, folder / f.name)
    return str(folder)


def sampling_and_prompts(model: str, args):
    """SamplingSettings as the trainer builds them (the tokenizer's EOS) and chat-templated prompts as token ids."""
    from transformers import AutoTokenizer

    from grpo_trainer.rollout import SamplingSettings

    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for i in range(args.prompts):
        text = QUESTIONS[i % len(QUESTIONS)].format(a=17 + 3 * i, b=5 + i)
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    sampling = SamplingSettings(
        eos_token_ids=[tok.eos_token_id], max_completion_length=args.max_tokens, temperature=args.temperature
    )
    return sampling, prompts


class Phases:
    """Seconds spent in wrapped functions during one call of ours (non-reentrant wrappers only)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


def seeds_for(rep: int, n_prompts: int) -> list[int]:
    return [1_000_003 * (rep + 1) + i for i in range(n_prompts)]


class Reps:
    """One engine's timed reps, side by side with vLLM's (rep -1, the warm-up, is measured and not kept)."""

    def __init__(self, times: dict[str, list[float]]):
        self.times = times  # per side ("ours", "vllm", ...): seconds per rep
        self.splits: list[dict] = []  # per rep: our call's phases
        self.same: list[float] = []  # per rep: share of completions the same as vLLM's
        self.tokens: list[int] = []  # per rep: completion tokens

    def keep(
        self, rep: int, seconds: dict[str, float], split: dict, ours: list[list[int]], theirs: list[list[int]]
    ) -> float:
        """Complete `split` (extraction less the cut it includes; `assemble`: the rest of our call), keep the rep
        unless it is the warm-up, and return the share of our completions that vLLM's begin with."""
        alike = sum(a == b[: len(a)] for a, b in zip(ours, theirs)) / len(theirs)
        split["extract"] = split.get("extract", 0.0) - split.get("cut", 0.0)
        split["assemble"] = seconds["ours"] - sum(split.get(k, 0.0) for k in ("build", "wait", "extract", "cut"))
        if rep >= 0:
            for side, t in seconds.items():
                self.times[side].append(t)
            self.splits.append(split)
            self.same.append(alike)
            self.tokens.append(sum(len(c) for c in ours))
        return alike

    def row(self, name: str) -> dict:
        return median_row(name, self.times["ours"], self.times["vllm"], self.splits, self.same, self.tokens)


def median_row(
    name: str, ours: list[float], theirs: list[float], phases: list[dict], same: list[float], tokens: list[int]
) -> dict:
    o, v = statistics.median(ours), statistics.median(theirs)
    split = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in PHASES}
    return {
        "engine": name,
        "ours_s": o,
        "vllm_s": v,
        "overhead": (o - v) / v,
        "ours_reps_s": ours,
        "vllm_reps_s": theirs,
        "phases_s": split,
        "same_completions": min(same),
        "completion_tokens": statistics.median(tokens),
        # Our code around vLLM's call: all but `wait` (for the server, `wait` holds our transport too: see the
        # direct client with fresh connections).
        "outside_s": statistics.median(sum(p.get(k, 0.0) for k in PHASES if k != "wait") for p in phases),
        "paired_overhead": statistics.median((a - b) / b for a, b in zip(ours, theirs)),
    }


# ---------------------------------------------------------------------------- colocated
def measure_colocate(model: str, sampling, prompts: list[list[int]], args) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from grpo_trainer.config import VLLMConfig
    from grpo_trainer.rollout import vllm_colocate
    from grpo_trainer.rollout.vllm_sampling import request_seed, sampling_fields

    settings = dict(dtype=args.dtype, max_model_len=max(len(p) for p in prompts) + args.max_tokens + 16)
    if args.gpu_memory_utilization:
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        settings["kv_cache_memory_bytes"] = args.kv_cache_mib * 2**20
    engine = vllm_colocate.VLLMColocateEngine(
        sampling,
        VLLMConfig(**settings),
        model_path=model,
        seed=0,
        extra_llm_kwargs={"max_num_batched_tokens": batched_tokens(prompts, args)},
    )
    raw_generate = engine.llm.generate
    phases = Phases()
    captured: list = []

    def spying_generate(prompts_, params, **kw):
        captured.append(params)
        return raw_generate(prompts_, params, **kw)

    engine._sampling_params = phases.wrap("build", engine._sampling_params)
    engine.llm.generate = phases.wrap("wait", spying_generate)
    originals = vllm_colocate.completions_from_outputs, vllm_colocate.cut_completion
    vllm_colocate.completions_from_outputs = phases.wrap("extract", originals[0])
    vllm_colocate.cut_completion = phases.wrap("cut", originals[1])

    def alone(seeds):
        """vLLM alone: what `LLM.generate` needs, built before the clock starts."""
        params = [
            SamplingParams(
                **sampling_fields(sampling, args.g, seed=request_seed(None, 0, i, args.g, s)),
                detokenize=bool(sampling.stop),
            )
            for i, s in enumerate(seeds)
        ]
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        start = time.perf_counter()
        with torch.no_grad():  # the context our engine's generate runs vLLM in
            out = raw_generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - start, out, params

    def ours(seeds):
        phases.seconds.clear()
        captured.clear()
        start = time.perf_counter()
        rollout = engine.generate(prompts, args.g, seeds=seeds)
        return time.perf_counter() - start, rollout

    try:
        reps = Reps({"ours": [], "vllm": []})
        for rep in range(-1, args.reps):  # rep -1: untimed
            seeds = seeds_for(rep, len(prompts))
            order = ("ours", "vllm") if rep % 2 == 0 else ("vllm", "ours")
            for side in order:
                gc.collect()  # neither side pays for the other's garbage
                if side == "ours":
                    t_ours, rollout = ours(seeds)
                    split = dict(phases.seconds)
                else:
                    t_vllm, outputs, params = alone(seeds)
            if [repr(p) for p in captured[0]] != [repr(p) for p in params]:
                raise SystemExit(
                    f"our engine's SamplingParams differ from vLLM alone's:\n{captured[0][0]}\n{params[0]}"
                )
            theirs = [list(o.token_ids) for r in outputs for o in r.outputs]
            # completions_from_outputs = extraction + cut_completion: Reps.keep takes the cut out
            alike = reps.keep(rep, {"ours": t_ours, "vllm": t_vllm}, split, rollout.completion_ids, theirs)
            print(
                f"colocate rep {rep}: ours {t_ours:.4f}s, vLLM alone {t_vllm:.4f}s, same completions {alike:.0%}",
                file=sys.stderr,
            )
    finally:
        vllm_colocate.completions_from_outputs, vllm_colocate.cut_completion = originals
        engine.close()
    return reps.row("colocate")


# ---------------------------------------------------------------------------- server
class DirectClient:
    """POSTs ready-made JSON bodies to /v1/completions, all at once, from a pool started once, one kept-alive
    connection per thread: about the least a Python client can add to the server's own time."""

    def __init__(self, url: str, workers: int):
        parts = urllib.parse.urlparse(url)
        self.host, self.port = parts.hostname, parts.port
        self.local = threading.local()
        self.workers = workers
        self.pool = ThreadPoolExecutor(max_workers=workers)

    def post(self, body: bytes, fresh: bool = False) -> bytes:
        conn, used = (None, 0.0) if fresh else getattr(self.local, "conn", (None, 0.0))
        if conn is not None and time.monotonic() - used > 2.0:  # the server drops idle ones (uvicorn: after 5 s)
            conn.close()
            conn = None
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):  # dropped anyway: once more
            conn.close()
            conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
        data = resp.read()
        if not fresh:
            self.local.conn = (conn, time.monotonic())
        if fresh:
            conn.close()
        if resp.status != 200:
            raise SystemExit(f"the server answered HTTP {resp.status}: {data[:300]!r}")
        return data

    def send(self, bodies: list[bytes]) -> list[bytes]:
        return list(self.pool.map(self.post, bodies))

    def send_fresh(self, bodies: list[bytes]) -> list[bytes]:
        """As our engine's transport does it: a new pool for the call, a new connection per request."""
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            return list(pool.map(lambda b: self.post(b, fresh=True), bodies))

    def close(self) -> None:
        self.pool.shutdown()


def start_server(model: str, prompts: list[list[int]], args, tmp: Path):
    from grpo_trainer.rollout.vllm_server import _free_port

    port = args.port or _free_port()
    max_len = 256 if args.max_tokens < 200 else args.max_tokens + 256
    cmd = [
        sys.executable,
        "-m",
        "grpo_trainer",
        "serve",
        "configs/demo_cpu.yaml",
        f"model.name_or_path={model}",
        "rollout.engine=vllm_server",
        "rollout.vllm_server.weight_sync=none",
        f"rollout.vllm.dtype={args.dtype}",
        f"rollout.vllm.max_model_len={max_len}",
        "--port",
        str(port),
    ]
    vllm_args = ["--", "--max-num-batched-tokens", str(batched_tokens(prompts, args))]
    if args.gpu_memory_utilization:
        cmd += [f"rollout.vllm.gpu_memory_utilization={args.gpu_memory_utilization}"]
    else:
        cmd.insert(cmd.index("--port"), f"rollout.vllm.kv_cache_memory_bytes={args.kv_cache_mib * 2**20}")
    log = tmp / "server.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd + vllm_args,
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
    return proc, f"http://127.0.0.1:{port}", log


def measure_server(sampling, prompts: list[list[int]], url: str, args) -> dict:
    from grpo_trainer.config import VLLMServerConfig
    from grpo_trainer.rollout import vllm_server

    engine = vllm_server.VLLMServerEngine(
        sampling, VLLMServerConfig(base_url=url, weight_sync="none", timeout=600, startup_timeout=1800), seed=0
    )
    phases = Phases()
    captured: list = []
    raw_requests = engine._requests

    def spying_requests(*a, **k):
        out = raw_requests(*a, **k)
        captured.append([body for _, body in out])
        return out

    engine._requests = phases.wrap("build", spying_requests)
    engine._send_all = phases.wrap("wait", engine._send_all)
    engine._read = phases.wrap("extract", engine._read)
    original_cut = vllm_server.cut_completion
    vllm_server.cut_completion = phases.wrap("cut", original_cut)
    client = DirectClient(url, workers=min(64, len(prompts)))
    n = len(prompts)

    def alone(seeds, fresh: bool = False):
        bodies = [body for _, body in raw_requests(prompts, args.g, seeds, None, 0, 0)]
        encoded = [json.dumps(b).encode() for b in bodies]
        start = time.perf_counter()
        answers = client.send_fresh(encoded) if fresh else client.send(encoded)
        return time.perf_counter() - start, answers, bodies

    try:
        reps = Reps({"ours": [], "vllm": [], "fresh": []})
        for rep in range(-1, args.reps):
            seeds = seeds_for(rep, n)
            order = ("ours", "vllm", "fresh") if rep % 2 == 0 else ("fresh", "vllm", "ours")
            for side in order:
                gc.collect()  # neither side pays for the other's garbage
                if side == "fresh":
                    t_fresh = alone(seeds, fresh=True)[0]
                elif side == "ours":
                    phases.seconds.clear()
                    captured.clear()
                    start = time.perf_counter()
                    rollout = engine.generate(prompts, args.g, seeds=seeds)
                    t_ours = time.perf_counter() - start
                    split = dict(phases.seconds)
                else:
                    t_vllm, answers, bodies = alone(seeds)
            if captured[0] != bodies:
                raise SystemExit("our engine's request bodies differ from the direct client's")
            theirs = [
                c.get("token_ids") or []
                for a in answers
                for c in sorted(json.loads(a)["choices"], key=lambda c: c["index"])
            ]
            seconds = {"ours": t_ours, "vllm": t_vllm, "fresh": t_fresh}  # _read = extraction + cut: keep takes it out
            alike = reps.keep(rep, seconds, split, rollout.completion_ids, theirs)
            print(
                f"server rep {rep}: ours {t_ours:.4f}s, direct client {t_vllm:.4f}s (fresh connections {t_fresh:.4f}s), "
                f"same completions {alike:.0%}",
                file=sys.stderr,
            )
        row = reps.row("server")
        row["fresh_connections_s"] = statistics.median(reps.times["fresh"])
        row["fresh_reps_s"] = reps.times["fresh"]
        # What of `wait` is JSON: encoding our bodies and decoding the answers, once more, single-threaded.
        start = time.perf_counter()
        for body in captured[0]:
            json.dumps(body).encode()
        row["json_encode_s"] = time.perf_counter() - start
        start = time.perf_counter()
        for a in answers:
            json.loads(a)
        row["json_decode_s"] = time.perf_counter() - start
        return row
    finally:
        vllm_server.cut_completion = original_cut
        client.close()
        engine.close()


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not set(engines) <= {"colocate", "server"} or not engines:
        raise SystemExit(f"--engines: colocate, server or both, not {args.engines!r}")
    import machine

    from grpo_trainer.builtin import resolve_model_path

    info = machine.describe(measure=False)
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-pace-") as tmp:
        model = build_tiny32(Path(tmp) / TINY32) if args.model == TINY32 else resolve_model_path(args.model)
        sampling, prompts = sampling_and_prompts(model, args)
        if "colocate" in engines:
            rows.append(measure_colocate(model, sampling, prompts, args))
        if "server" in engines:
            proc, url, log = (
                (None, args.server_url, None) if args.server_url else start_server(model, prompts, args, Path(tmp))
            )
            try:
                if proc is not None:
                    from bench_push import wait_healthy

                    wait_healthy(url, proc, log, 1800)
                rows.append(measure_server(sampling, prompts, url, args))
            finally:
                if proc is not None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
    info["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    print(f"machine: {machine.one_line(info)}")
    print(
        f"model {args.model}, {args.prompts} prompts x {args.g} completions of up to {args.max_tokens} tokens, "
        f"temperature {args.temperature}, {args.reps} reps, alternating; medians"
    )
    print(
        f"| engine | ours (s) | vLLM alone (s) | overhead | paired | outside vLLM | same completions | tokens/step | "
        f"{' | '.join(PHASES)} (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(PHASES))
    for r in rows:
        split = " | ".join(f"{1e3 * r['phases_s'][k]:.2f}" for k in PHASES)
        print(
            f"| {r['engine']} | {r['ours_s']:.4f} | {r['vllm_s']:.4f} | {100 * r['overhead']:+.1f}% | "
            f"{100 * r['paired_overhead']:+.1f}% | {100 * r['outside_s'] / r['vllm_s']:.2f}% | "
            f"{r['same_completions']:.0%} | {r['completion_tokens']:.0f} | {split} |"
        )
        if "json_encode_s" in r:
            print(
                f"  server: the direct client with a new pool per call and a new connection per request (as our "
                f"engine's transport, without urllib and JSON): {r['fresh_connections_s']:.4f} s, "
                f"{100 * (r['fresh_connections_s'] / r['vllm_s'] - 1):+.1f}% on the kept-alive client"
            )
            print(
                f"  server: of `wait`, JSON encoding our bodies {1e3 * r['json_encode_s']:.2f} ms and decoding the "
                f"answers {1e3 * r['json_decode_s']:.2f} ms (single-threaded, measured apart)"
            )
    print(
        "overhead: (median ours - median vLLM's) / median vLLM's; paired: the median of each rep's own ratio; outside "
        "vLLM: our code around vLLM's call (build + extract + cut + assemble) / vLLM's median"
    )
    worst = max(r["overhead"] for r in rows)
    verdict = "within" if worst <= TARGET else "OVER"
    print(
        f"VERDICT: {verdict} the {TARGET:.0%} target: "
        + ", ".join(
            f"{r['engine']} {100 * r['overhead']:+.1f}% ({1e3 * (r['ours_s'] - r['vllm_s']):+.1f} ms a step; our code "
            f"outside vLLM {100 * r['outside_s'] / r['vllm_s']:.2f}%)"
            for r in rows
        )
    )
    print(
        "RESULT "
        + ", ".join(
            f"{r['engine']}_overhead={r['overhead']:.3g}, {r['engine']}_outside={r['outside_s'] / r['vllm_s']:.3g}, "
            f"{r['engine']}_vllm_s={r['vllm_s']:.3g}"
            for r in rows
        )
    )
    report = {"rows": rows, "machine": info, "config": vars(args), "target": TARGET, "within_target": worst <= TARGET}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


if __name__ == "__main__":
    main()
