"""Agents as programs: the policy behind a token endpoint, for programs that own their loop (docs/agents.md).

endpoint.py serves the run's engine over HTTP on loopback (vLLM's token route, OpenAI's chat route) and records
every request; sampler.py is what it asks of an engine; chat.py keeps chat conversations token-faithful; records.py
is what it records. producer.py is the seam agent programs plug into (`Player`, `Played`); engine.py runs players as
the run's rollout engine (`AgentEngine`), one training row per episode; solve.py is `environment.agent`'s player,
verifiers_env.py `environment.verifiers`'s (a verifiers 0.4 environment), vf_harness.py the in-process chat harness
its environments use offline.
"""
