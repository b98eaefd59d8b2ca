"""The tiny models' recipes give the same weights on every CPU of a kind (build.build_canonically), and the
package ships what they gave on one (build.shipped_weights): the golden metrics and the README's demo numbers
depend on them. Where a kind of CPU computes the canonical arithmetic differently (an AMD EPYC did), the
manifest records the short build's hash there too (build.check_hashes).

The full builds take ~6-7 minutes of one core each, so `make test` checks each recipe's first steps against
the hash recorded with the shipped weights (weights/manifest.json), and the folder assembled from those
weights against a recipe's own folder; `python scripts/build_builtins.py` checks the full builds.
"""

from __future__ import annotations

import filecmp
import shutil

import pytest

from grpo_trainer.builtin import build, tiny, tiny_guess, tiny_tools
from grpo_trainer.builtin.build import build_canonically, check_hashes, read_manifest, sha256_of, shipped_weights
from grpo_trainer.builtin.charlm import build_tokenizer, char_llama_config
from helpers import load_script


def weights_hash(folder) -> str:
    return sha256_of(folder / "model.safetensors")


def assert_same_folder_but_the_weights(assembled, built) -> None:
    """Config, generation config, tokenizer and template of the two folders are byte for byte the same."""
    names = sorted(p.name for p in built.iterdir())
    assert sorted(p.name for p in assembled.iterdir()) == names
    others = [n for n in names if n != "model.safetensors"]
    _, mismatch, errors = filecmp.cmpfiles(assembled, built, others, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


def assert_a_recorded_check_hash(built: str, entry: dict) -> None:
    recorded = check_hashes(entry)
    assert built in recorded.values(), (
        f"the short build gave sha256 {built}, recorded are {recorded}: the recipe changed (bump its VERSION and "
        "run scripts/build_builtins.py --write), or this CPU computes the canonical arithmetic unlike all of those "
        "(scripts/build_builtins.py says which; --record-check records it)")


@pytest.mark.slow  # a model build in a child process
@pytest.mark.parametrize("module", [tiny, tiny_tools, tiny_guess], ids=["tiny", "tiny-tools", "tiny-guess"])
def test_each_recipe_is_the_one_its_shipped_weights_came_from(module, tmp_path):
    """The recipe's first steps, built canonically, give the hash recorded beside its shipped weights, and the
    folder assembled from those weights is the recipe's own folder but for the weights."""
    entry = read_manifest()[module.FOLDER]
    build_canonically(f"{module.__name__}:build_model", tmp_path / "built", sft_steps=entry["check_steps"])
    assert_a_recorded_check_hash(weights_hash(tmp_path / "built"), entry)
    module.build_model(tmp_path / "assembled", weights=shipped_weights(module.FOLDER))
    assert weights_hash(tmp_path / "assembled") == entry["sha256"]
    assert_same_folder_but_the_weights(tmp_path / "assembled", tmp_path / "built")


@pytest.mark.slow  # a model build in a child process
def test_the_canonical_build_does_not_depend_on_the_cpus_instructions_or_threads(tmp_path, monkeypatch):
    """The short warm start built on two threads with MKL held to AVX2 equals the one recorded in the manifest,
    which builds run on one thread with MKL free to use the best instructions it finds (AVX-512 on the Xeon and
    the EPYC that recorded theirs, checked above). Built plainly, ATen's AVX-512 and AVX2 kernels gave
    different weights on the Xeon."""
    entry = read_manifest()[tiny.FOLDER]
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    build_canonically("grpo_trainer.builtin.tiny:build_model", tmp_path / "avx2_two_threads", threads=2,
                      sft_steps=entry["check_steps"])
    assert_a_recorded_check_hash(weights_hash(tmp_path / "avx2_two_threads"), entry)


def test_every_shipped_file_is_in_the_manifest_and_matches_its_recipe():
    manifest = read_manifest()
    assert sorted(manifest) == sorted([tiny.FOLDER, tiny_tools.FOLDER, tiny_guess.FOLDER])
    assert sorted(p.name for p in build.WEIGHTS_DIR.glob("*.safetensors")) == sorted(f"{n}.safetensors" for n in manifest)
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
    """scripts/build_builtins.py's comparison, --record-check and --write, with the canonical build replaced by
    assembling the shipped weights (a full build takes minutes): the full builds match, the short ones cannot,
    until --record-check records theirs as this CPU's kind."""
    import json
    import sys

    script = load_script("build_builtins")

    shipped = {module: shipped_weights(module.FOLDER) for module in (tiny, tiny_tools)}

    def assemble(builder, folder, threads=1, **kwargs):
        module = tiny if builder.startswith("grpo_trainer.builtin.tiny:") else tiny_tools
        module.build_model(folder, weights=shipped[module])

    monkeypatch.setattr(script, "build_canonically", assemble)
    monkeypatch.setattr(sys, "argv", ["build_builtins.py", "--only", tiny.FOLDER])
    assert script.main() == 1
    out = capsys.readouterr()
    assert f"{tiny.FOLDER}: built in" in out.out and "DIFFERENT from every hash recorded" in out.out
    assert "bump the recipe's VERSION and run this with --write" in out.err

    shipped_manifest = read_manifest()
    manifest = tmp_path / "manifest.json"
    manifest.write_text(build.MANIFEST.read_text())
    for module in (build, script):
        monkeypatch.setattr(module, "MANIFEST", manifest)
        monkeypatch.setattr(module, "WEIGHTS_DIR", tmp_path)
    monkeypatch.setattr(sys, "argv", ["build_builtins.py", "--only", tiny.FOLDER, "--record-check"])
    assert script.main() == 0
    recorded = json.loads(manifest.read_text())[tiny.FOLDER]
    assert recorded["check_sha256_other_cpus"][script.this_cpu()] == sha256_of(shipped[tiny])
    assert recorded["check_sha256"] == shipped_manifest[tiny.FOLDER]["check_sha256"]  # the building CPU's, kept
    monkeypatch.setattr(sys, "argv", ["build_builtins.py", "--only", tiny.FOLDER])
    assert script.main() == 0
    assert "cannot be compared with them here" in capsys.readouterr().out

    monkeypatch.setattr(sys, "argv", ["build_builtins.py", "--only", tiny.FOLDER, "--write"])
    assert script.main() == 0
    written = json.loads(manifest.read_text())
    assert written[tiny.FOLDER]["sha256"] == written[tiny.FOLDER]["check_sha256"] == sha256_of(shipped[tiny])
    assert written[tiny.FOLDER]["built_on"] == script.this_cpu() and "check_sha256_other_cpus" not in written[tiny.FOLDER]
    assert written[tiny_tools.FOLDER] == shipped_manifest[tiny_tools.FOLDER]  # not rebuilt, kept
    assert (tmp_path / f"{tiny.FOLDER}.safetensors").read_bytes() == shipped[tiny].read_bytes()
