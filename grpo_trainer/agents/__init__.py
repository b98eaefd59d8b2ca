"""Agents as programs: the policy behind a token endpoint, for programs that own their loop (docs/agents.md).

endpoint.py serves the run's engine over HTTP on loopback (vLLM's token route, OpenAI's chat route) and records
every request; sampler.py is what it asks of an engine; chat.py keeps chat conversations token-faithful; records.py
is what the producers (verifiers environments, `environment.agent`: not yet written) read back.
"""
