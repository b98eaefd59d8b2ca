"""Checking `environment:` before any model loads, without building it (validate, train, kernels).

Apart from the package's __init__ because it imports the OpenEnv adapters, which import the package's types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Config


def check_environment(cfg: Config, *, contact_server: bool) -> None:
    """What can be told of `environment:` without building it (no environment object made, no session opened),
    before any model loads: ConfigError naming the key for a factory or OpenEnv file that is missing or does not
    import, a name it lacks, a factory class without `reset`, an OpenEnv class without `reset`/`step` or whose
    Action class cannot be told; with `contact_server` (train, not validate: a server may not be up while a config
    is written), an `environment.url` that answers no OpenEnv schemas."""
    from ..errors import ConfigError

    env = cfg.environment
    if env.kind == "factory":
        from ..user_functions import resolve_function

        factory = resolve_function(env.factory or "", "environment.factory", "environment", ConfigError)
        if isinstance(factory, type) and not callable(getattr(factory, "reset", None)):
            raise ConfigError(
                f"environment.factory {env.factory}: {factory.__name__} has no reset method; an environment class "
                "needs reset(**row)"
            )
    elif env.kind == "openenv":
        from .openenv import build

        build(cfg)  # resolves the class and its Action; makes no environment object
    elif env.kind == "agent":
        from ..agents.solve import resolve_solve

        resolve_solve(env.agent or "")
    elif env.kind == "verifiers":
        from ..agents.verifiers_env import load_environment

        load_environment(
            env.verifiers or "", limit=env.step_timeout
        )  # imports it, refuses a downloading harness or a remote runtime
    elif env.kind == "url" and contact_server:
        from .openenv_ws import fetch_schema

        fetch_schema(env.url or "", env.step_timeout)
