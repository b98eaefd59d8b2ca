"""Agents as programs: the policy behind a token endpoint, for programs that own their loop (docs/agents.md).

endpoint.py serves the run's engine over HTTP on loopback (vLLM's token route, OpenAI's chat route) and records
every request; sampler.py is what it asks of an engine; chat.py keeps chat conversations token-faithful; records.py
is what the producers read back. verifiers_env.py is `environment.verifiers` (a verifiers 0.4 environment as a
player of the agent engine), vf_harness.py the in-process chat harness its environments use offline.
"""
