"""An in-process chat harness for verifiers 0.4 environments trained here (environment.verifiers, docs/agents.md).

verifiers' built-in harnesses run a program in a runtime: `null` and `bash` `uv sync` a PEP-723 script at run
time, the others install an agent program, so each needs the package index or a container; none runs offline.
This one runs its loop in the trainer's process, as verifiers allows (`Harness.launch`: "a harness may run its
loop in-process ... as long as every model call goes through `endpoint` + `secret`"): one chat request per
segment, no tools, to verifiers' interception server, which renders it with the train client and samples it from
the trainer's token endpoint. A multi-turn environment drives it turn by turn (`agents.<role>.interaction(task)`,
then `turn(message)`): each turn resumes on the conversation so far (`SUPPORTS_RESUME`).

An environment module uses it by exporting it beside its `Taskset` (verifiers takes a taskset's own harness as
its agents' default), e.g. `from grpo_trainer.agents.vf_harness import InProcessChatHarness` and
`__all__ = ["GuessTaskset", "GuessEnv", "InProcessChatHarness"]` (configs/verifiers_guess.py).
"""

from __future__ import annotations

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire, parse_message

__all__ = ["InProcessChatHarness", "InProcessChatHarnessConfig"]


class InProcessChatHarnessConfig(vf.HarnessConfig):
    pass


class InProcessChatHarness(vf.Harness[InProcessChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(parse_message(m) if isinstance(m, dict) else m) for m in prompt]
        body = {"model": ctx.model, "messages": messages}
        headers = {"Authorization": f"Bearer {secret}"}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{endpoint.rstrip('/')}/chat/completions", json=body, headers=headers) as reply:
                text = await reply.text()
                if reply.status != 200:
                    return vf.ProgramResult(exit_code=1, stdout="", stderr=f"HTTP {reply.status}: {text[-2000:]}")
        return vf.ProgramResult(exit_code=0, stdout=text, stderr="")
