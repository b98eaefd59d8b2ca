"""An agent written on the OpenAI SDK, trained as it is (environment.agent; docs/agents.md): it asks the policy the
row's question over the run's endpoint and scores the reply itself, 1.0 for the right boxed answer."""

from openai import AsyncOpenAI


async def solve(row, *, base_url, api_key, model, seed):
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": row["prompt"]}], max_tokens=16, seed=seed
        )
    text = reply.choices[0].message.content or ""
    return 1.0 if "\\boxed{" + row["answer"] + "}" in text else 0.0
