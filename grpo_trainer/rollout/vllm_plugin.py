"""vLLM plugin entry point: registers the "gloo" weight-transfer backend (gloo_transfer.py) by name.

vLLM calls `register()` in each of its processes (API server, engine core, workers) through the
`vllm.general_plugins` entry point in this package's pyproject.toml. It only adds the name "gloo" to
vLLM's two backend registries (the workers' `WeightTransferEngineFactory`, the trainer's
`WeightTransferTrainerFactory`), lazily: nothing of gloo_transfer.py is imported until a server is
started with `--weight-transfer-config '{"backend": "gloo"}'` or a trainer asks for it. A vLLM process
that never asks behaves exactly as without this package (tests/test_vllm_transfer.py checks it).
`VLLM_PLUGINS` (vLLM's allow-list of plugin names) can leave it out; its name is "grpo_trainer".
"""

from __future__ import annotations

MODULE = "grpo_trainer.rollout.gloo_transfer"


def register() -> None:
    """Idempotent: vLLM may load plugins more than once in a process, and the trainer calls it too."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in (
        (WeightTransferEngineFactory, "GlooWeightTransferEngine"),
        (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine"),
    ):
        if "gloo" not in factory._registry:  # register_engine refuses a name twice
            factory.register_engine("gloo", MODULE, cls)
