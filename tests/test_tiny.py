"""The tiny models' recipes give the same weights on every CPU of a kind (build.build_canonically), and the
package ships what they gave on one (build.shipped_weights): the golden metrics and the README's demo numbers
depend on them.

The full builds take ~6-7 minutes of one core each, so `make test` repeats each recipe's first steps and
compares them with a recorded short build (weights/checks/) within rounding (build.check_distance): another kind
of CPU rounds the canonical arithmetic differently, and the next CI machine may be one nobody has recorded. The
check is tested both ways: a simulated other CPU passes it, a one-line recipe change fails it.
`python scripts/build_builtins.py` checks the full builds.
"""

from __future__ import annotations

import filecmp
import shutil

import pytest

from grpo_trainer.builtin import build, tiny, tiny_guess, tiny_tools
from grpo_trainer.builtin.build import (
    CHECK_TOLERANCE,
    build_canonically,
    check_distance,
    read_manifest,
    sha256_of,
    shipped_weights,
)
from grpo_trainer.builtin.charlm import build_tokenizer, char_llama_config
from helpers import load_script

RECIPES = [tiny, tiny_tools, tiny_guess]
IDS = ["tiny", "tiny-tools", "tiny-guess"]

# Python run in the build's child process before the recipe (build_canonically's prelude).
OTHER_CPU = "from grpo_trainer.builtin.build import nudge_after_every_step; nudge_after_every_step(seed=1)"
LEARNING_RATE_X1_01 = (
    "import torch.optim\n"
    "_adamw = torch.optim.AdamW.__init__\n"
    "def _scaled(self, params, lr=1e-3, **kwargs): _adamw(self, params, lr=lr * 1.01, **kwargs)\n"
    "torch.optim.AdamW.__init__ = _scaled"
)


def one_example_more(module) -> str:
    """Every recipe's warm start takes its batch size as its first default argument: one more per batch."""
    return (
        f"import {module.__name__} as _recipe\n"
        "_defaults = list(_recipe._supervised_warm_start.__defaults__)\n"
        "_defaults[0] += 1\n"
        "_recipe._supervised_warm_start.__defaults__ = tuple(_defaults)"
    )


def weights_hash(folder) -> str:
    return sha256_of(folder / "model.safetensors")


def short_build_distance(module, folder, prelude: str = "") -> float:
    entry = read_manifest()[module.FOLDER]
    build_canonically(f"{module.__name__}:build_model", folder, sft_steps=entry["check_steps"], prelude=prelude)
    return check_distance(module.FOLDER, folder / "model.safetensors")


def assert_same_folder_but_the_weights(assembled, built) -> None:
    """Config, generation config, tokenizer and template of the two folders are byte for byte the same."""
    names = sorted(p.name for p in built.iterdir())
    assert sorted(p.name for p in assembled.iterdir()) == names
    others = [n for n in names if n != "model.safetensors"]
    _, mismatch, errors = filecmp.cmpfiles(assembled, built, others, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


@pytest.mark.slow  # a model build in a child process
@pytest.mark.parametrize("module", RECIPES, ids=IDS)
def test_each_recipe_is_the_one_its_shipped_weights_came_from(module, tmp_path):
    """The recipe's first steps, built canonically here, lie within rounding of the recorded short build
    (whatever this CPU), and the folder assembled from the shipped weights is the recipe's own folder but for
    the weights."""
    distance = short_build_distance(module, tmp_path / "built")
    assert distance <= CHECK_TOLERANCE, (
        f"the short build of {module.FOLDER} lies {distance:.2e} from the recorded one (tolerance "
        f"{CHECK_TOLERANCE:.0e}): the recipe changed; bump its VERSION and run scripts/build_builtins.py --write"
    )
    module.build_model(tmp_path / "assembled", weights=shipped_weights(module.FOLDER))
    assert weights_hash(tmp_path / "assembled") == read_manifest()[module.FOLDER]["sha256"]
    assert_same_folder_but_the_weights(tmp_path / "assembled", tmp_path / "built")


@pytest.mark.slow  # three model builds in child processes
@pytest.mark.parametrize("module", RECIPES, ids=IDS)
def test_the_check_passes_another_cpus_rounding_and_fails_a_changed_recipe(module, tmp_path):
    """A CPU that rounds differently (simulated: every weight nudged by one ulp after every step, more than a
    reordered sum changes) passes the check; the learning rate x1.01 fails it, and so does one warm-start example
    more per batch (tried on one recipe). Each distance is compared with the tolerance from both sides, so the margin shows in a failure."""
    other_cpu = short_build_distance(module, tmp_path / "other_cpu", OTHER_CPU)
    assert 0 < other_cpu < CHECK_TOLERANCE / 10, other_cpu  # > 0: the nudge did change the bits
    learning_rate = short_build_distance(module, tmp_path / "lr", LEARNING_RATE_X1_01)
    assert learning_rate > 3 * CHECK_TOLERANCE, learning_rate
    if module is tiny_guess:  # the cheapest recipe: a change of the data, once (a build costs ~10 s of a core)
        one_more = short_build_distance(module, tmp_path / "one_more", one_example_more(module))
        assert one_more > 3 * CHECK_TOLERANCE, one_more


@pytest.mark.slow  # a model build in a child process
def test_the_canonical_build_does_not_depend_on_the_cpus_instructions_or_threads(tmp_path, monkeypatch):
    """On one machine, the short warm start built on two threads with MKL held to AVX2 gives the same bytes as
    on one thread with MKL free to use the best instructions it finds. Built plainly, ATen's AVX-512 and AVX2
    kernels gave different weights on a Xeon."""
    entry = read_manifest()[tiny.FOLDER]
    builder, steps = "grpo_trainer.builtin.tiny:build_model", entry["check_steps"]
    build_canonically(builder, tmp_path / "plain", sft_steps=steps)
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    build_canonically(builder, tmp_path / "avx2_two_threads", threads=2, sft_steps=steps)
    assert weights_hash(tmp_path / "avx2_two_threads") == weights_hash(tmp_path / "plain")


def test_every_shipped_file_is_in_the_manifest_and_matches_its_recipe():
    manifest = read_manifest()
    assert sorted(manifest) == sorted([tiny.FOLDER, tiny_tools.FOLDER, tiny_guess.FOLDER])
    assert sorted(p.name for p in build.WEIGHTS_DIR.glob("*.safetensors")) == sorted(f"{n}.safetensors" for n in manifest)
    assert sorted(p.name for p in build.CHECKS_DIR.iterdir()) == sorted(f"{n}.safetensors" for n in manifest)
    for module in (tiny, tiny_tools, tiny_guess):
        assert manifest[module.FOLDER]["sft_steps"] == module.SFT_STEPS


def test_missing_or_altered_shipped_weights_are_an_error_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / tiny.FOLDER}.safetensors: the shipped weights .* missing"):
        shipped_weights(tiny.FOLDER)
    (tmp_path / f"{tiny.FOLDER}.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ValueError, match="not the weights manifest.json records for 'tiny-v5'.*build_builtins.py"):
        shipped_weights(tiny.FOLDER)
    with pytest.raises(FileNotFoundError, match="no entry for 'tiny-v9'"):
        shipped_weights("tiny-v9")


def test_weights_that_do_not_fit_the_recipes_model_are_refused(tmp_path):
    shutil.copyfile(shipped_weights(tiny.FOLDER), tmp_path / "tiny.safetensors")
    with pytest.raises(ValueError, match="does not fit the model its recipe builds"):
        tiny_tools.build_model(tmp_path / "out", weights=tmp_path / "tiny.safetensors")


@pytest.mark.parametrize("module, count", [(tiny, "215,520"), (tiny_tools, "312,704"), (tiny_guess, "312,704")])
def test_the_parameter_count_in_the_docstring_is_the_models(module, count):
    """Counted on the meta device from the recipe's own shape, so no weights are built."""
    import torch
    from transformers import LlamaForCausalLM

    config = char_llama_config(build_tokenizer(), **module.SHAPE)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert f"{sum(p.numel() for p in model.parameters()):,}" == count and count in module.__doc__


def test_the_rebuild_script_reports_a_recipe_that_no_longer_gives_the_shipped_weights(tmp_path, monkeypatch, capsys):
    """scripts/build_builtins.py's verdicts and --write, with the canonical builds replaced by assembling the
    shipped weights (a full build takes minutes; the random start is built for real, it trains nothing) and the
    short build's distance injected: within the tolerance the recipe agrees, beyond it the script fails naming
    it; --write records weights, manifest and a check that the same build then passes."""
    import json
    import sys

    script = load_script("build_builtins")
    shipped = {module: shipped_weights(module.FOLDER) for module in (tiny, tiny_tools)}
    shipped_sha256 = read_manifest()[tiny.FOLDER]["sha256"]

    def assemble(builder, folder, threads=1, sft_steps=None, **kwargs):
        module = tiny if builder.startswith("grpo_trainer.builtin.tiny:") else tiny_tools
        if sft_steps == 0:
            module.build_model(folder, sft_steps=0)
        else:
            module.build_model(folder, weights=shipped[module])

    monkeypatch.setattr(script, "build_canonically", assemble)
    monkeypatch.setattr(sys, "argv", ["build_builtins.py", "--only", tiny.FOLDER])
    monkeypatch.setattr(script, "check_distance", lambda name, built: CHECK_TOLERANCE / 100)
    assert script.main() == 0
    assert "equal to the shipped weights; short build 1.0e-05 from the recorded one" in capsys.readouterr().out

    monkeypatch.setattr(script, "check_distance", lambda name, built: CHECK_TOLERANCE * 3)
    assert script.main() == 1
    out = capsys.readouterr()
    assert f"{tiny.FOLDER}: built in" in out.out and "DIFFERENT: short build 3.0e-03" in out.out
    assert "bump the recipe's VERSION and run this with --write" in out.err

    monkeypatch.setattr(script, "check_distance", check_distance)
    manifest = tmp_path / "manifest.json"
    for module in (build, script):
        monkeypatch.setattr(module, "MANIFEST", manifest)
        monkeypatch.setattr(module, "WEIGHTS_DIR", tmp_path)
    monkeypatch.setattr(build, "CHECKS_DIR", tmp_path / "checks")
    monkeypatch.setattr(sys, "argv", ["build_builtins.py", "--only", tiny.FOLDER, "--write"])
    assert script.main() == 0
    recorded = json.loads(manifest.read_text())[tiny.FOLDER]
    assert recorded["sha256"] == sha256_of(tmp_path / f"{tiny.FOLDER}.safetensors") == shipped_sha256
    assert check_distance(tiny.FOLDER, tmp_path / f"{tiny.FOLDER}.safetensors") == 0.0
