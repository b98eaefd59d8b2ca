"""64 concurrent single-turn episodes through the token endpoint against one batched generate of the same prompts.

    python scripts/bench_endpoint.py [--requests 64] [--max-tokens 32] [--model builtin:tiny] [--repeats 3]

Same engine (hf), same prompts, same length limit. Three timings, best of `--repeats`:
* `generate`: `HFEngine.generate(prompts, 1)` unseeded, one batched decode (what an ordinary hf run does);
* `sample_rows`: `HFEngine.sample_rows` with the seeds the endpoint derives, one batched decode with a stream per
  row: the very tokens the endpoint returns (checked), so the difference to it is the endpoint's own cost;
* `endpoint`: one episode per prompt, all requests sent at once over HTTP (aiohttp client, the token route), from
  the first request sent to the last answer read.
Prints the ratio endpoint / generate (the issue's target: within 1.5x) and endpoint / sample_rows. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402
import torch  # noqa: E402

from grpo_trainer.agents.endpoint import EndpointLimits, TokenEndpoint  # noqa: E402
from grpo_trainer.agents.sampler import HFTokenSampler  # noqa: E402
from grpo_trainer.config import ModelConfig  # noqa: E402
from grpo_trainer.models import eos_token_ids, load_causal_lm, load_tokenizer  # noqa: E402
from grpo_trainer.rollout import SamplingSettings  # noqa: E402
from grpo_trainer.rollout.hf import HFEngine  # noqa: E402
from grpo_trainer.seeds import mix_seed  # noqa: E402


async def through_endpoint(endpoint: TokenEndpoint, prompts: list[list[int]], max_tokens: int, step: int):
    handles = [endpoint.open_episode(step=step, index=i, budget=max_tokens) for i in range(len(prompts))]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(handle, ids):
            body = {"model": endpoint.model_name, "token_ids": ids, "sampling_params": {"max_tokens": max_tokens}}
            headers = {"Authorization": f"Bearer {handle.api_key}"}
            async with session.post(f"{endpoint.url}/inference/v1/generate", json=body, headers=headers) as r:
                r.raise_for_status()
                return (await r.json())["choices"][0]["token_ids"]

        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(h, p) for h, p in zip(handles, prompts)))
        seconds = time.perf_counter() - started
    for h in handles:
        endpoint.close_episode(h.session_id)
    return seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    cfg = ModelConfig(name_or_path=args.model)
    tokenizer, lm = load_tokenizer(cfg), load_causal_lm(cfg)
    eos = eos_token_ids(tokenizer, lm)
    engine = HFEngine(
        SamplingSettings(eos_token_ids=eos, max_completion_length=args.max_tokens),
        get_model=lambda: lm,
        pad_token_id=tokenizer.pad_token_id,
        tokenizer=tokenizer,
    )
    prompts = []
    for i in range(args.requests):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {i}+{2 * i + 1}?"}], add_generation_prompt=True
        )
        prompts.append(list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered))
    sampler = HFTokenSampler(engine, max_batch=args.requests)
    seed = 1234
    limits = EndpointLimits(batch_window_s=0.05)
    with TokenEndpoint(sampler, tokenizer, seed=seed, eos_token_ids=eos, limits=limits) as endpoint:
        asyncio.run(through_endpoint(endpoint, prompts[:2], 2, step=10**6))  # warm: plan kernels, connect
        times: dict[str, float] = {"generate": float("inf"), "sample_rows": float("inf"), "endpoint": float("inf")}
        for repeat in range(args.repeats):
            torch.manual_seed(repeat)
            started = time.perf_counter()
            engine.generate(prompts, 1)
            times["generate"] = min(times["generate"], time.perf_counter() - started)
            seeds = [mix_seed(seed, repeat, i, 0) for i in range(len(prompts))]
            started = time.perf_counter()
            direct = engine.sample_rows(prompts, seeds, [args.max_tokens] * len(prompts))
            times["sample_rows"] = min(times["sample_rows"], time.perf_counter() - started)
            seconds, tokens = asyncio.run(through_endpoint(endpoint, prompts, args.max_tokens, step=repeat))
            times["endpoint"] = min(times["endpoint"], seconds)
            assert tokens == direct.completion_ids, "the endpoint's tokens differ from sample_rows' for the same seeds"
        batches = endpoint.counters().get("agent/batches", 0)
    print(f"model {args.model}, {args.requests} requests, max_tokens {args.max_tokens}, torch threads {torch.get_num_threads()}")
    for name, value in times.items():
        print(f"  {name:12s} {value:8.3f} s (best of {args.repeats})")
    print(f"  batches formed by the endpoint: {batches} over {args.repeats + 1} rounds")
    print(f"ratio endpoint / generate:    {times['endpoint'] / times['generate']:.2f}")
    print(f"ratio endpoint / sample_rows: {times['endpoint'] / times['sample_rows']:.2f}")


if __name__ == "__main__":
    main()
