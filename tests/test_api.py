"""The Python API: in-memory objects give the run their YAML equivalent gives, bit for bit; resuming needs the same
objects; datasets and reward entries are read as the YAML path reads files and names."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

import grpo_trainer
from grpo_trainer import api, in_memory
from grpo_trainer.config import DataConfig
from grpo_trainer.errors import ConfigError, DataError
from grpo_trainer.metrics import read_metrics
from grpo_trainer.builtin.tiny import arithmetic_records
from helpers import ROOT, assert_same_run, run_cli, run_in_fork, small_run_overrides

STEPS = 3
# What both runs share; the YAML run adds the files, the object run the objects.
SHARED = [*small_run_overrides(Path("OUT"), steps=STEPS)[1:], "eval.every=3", "eval.num_samples=4", "eval.num_generations=2",
          "loss.type=dr_grpo", "loss.beta=0.04"]  # with a KL term: the model object's frozen reference copy is used
YAML_REWARDS = ("rewards=[{name: tests/api_rewards.py:accuracy, kwargs: {bonus: 0.5}}, "
                "{name: tests/api_rewards.py:brevity, weight: 0.5, kwargs: {scale: 100}}]")


def train_with_objects(out: str, result_file: str, overrides: list[str], changed_answer: bool = False) -> None:
    """In a forked child: the objects a notebook would hold, and grpo_trainer.train on them."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from api_rewards import accuracy, brevity
    from grpo_trainer.builtin.tiny import ensure_model as ensure_tiny_model

    rows = arithmetic_records("train")
    if changed_answer:
        rows[0] = {**rows[0], "answer": "0"}
    folder = ensure_tiny_model()
    result = grpo_trainer.train(
        "configs/demo_cpu.yaml", [f"output_dir={out}", *overrides],
        train_dataset=rows,  # a list of dicts
        eval_dataset=datasets.Dataset.from_list(arithmetic_records("test")),  # a datasets.Dataset
        rewards=[{"fn": accuracy, "kwargs": {"bonus": 0.5}}, {"fn": brevity, "weight": 0.5, "kwargs": {"scale": 100}}],
        model=AutoModelForCausalLM.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder),
    )
    Path(result_file).write_text(json.dumps({"output_dir": str(result.output_dir), "steps_done": result.steps_done,
                                             "last_metrics": result.last_metrics}))


@pytest.fixture(scope="module")
def paired_runs(tmp_path_factory, tiny_model_path):
    """The same run twice: from YAML and files, and from Python objects."""
    root = tmp_path_factory.mktemp("api")
    data = root / "data"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in arithmetic_records(split)))
    from_yaml = run_cli(["train", "configs/demo_cpu.yaml", f"output_dir={root / 'yaml'}", *SHARED, YAML_REWARDS,
                         f"data.source={data / 'train.jsonl'}", f"data.eval_source={data / 'test.jsonl'}"])
    assert from_yaml.returncode == 0, from_yaml.stderr[-3000:]
    from_objects = run_in_fork(train_with_objects, (str(root / "objects"), str(root / "result.json"), SHARED))
    assert from_objects.returncode == 0, from_objects.stderr[-3000:]
    return root / "yaml", root / "objects", json.loads((root / "result.json").read_text())


@pytest.mark.slow
def test_objects_and_their_yaml_equivalent_give_the_same_run(paired_runs):
    from_yaml, from_objects, result = paired_runs
    assert_same_run(from_yaml, from_objects)  # final weights bit for bit, every metric but timings
    rows = read_metrics(from_objects)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("rewards/accuracy/mean", "rewards/brevity/mean", "eval/accuracy/mean@2", "eval/brevity/pass@2", "kl"):
        assert key in rows[-1], key  # callables are named by their function names
    assert result["output_dir"] == str(from_objects) and result["steps_done"] == STEPS
    assert result["last_metrics"]["reward"] == rows[-1]["reward"]


@pytest.mark.slow
def test_the_resolved_config_names_the_objects(paired_runs):
    _, from_objects, _ = paired_runs
    cfg = grpo_trainer.load_config(from_objects / "config.yaml")
    train_rows = api.dataset_records(arithmetic_records("train"), "train_dataset")
    assert cfg.data.source == f"object:train_dataset@{in_memory.fingerprint(train_rows)}"
    assert cfg.data.eval_source.startswith("object:eval_dataset@")
    assert [r.name for r in cfg.rewards] == ["object:reward/accuracy", "object:reward/brevity"]
    assert (cfg.model.name_or_path, cfg.model.tokenizer, cfg.model.dtype) == ("object:model", "object:tokenizer", "float32")


@pytest.mark.slow
def test_resuming_without_an_object_is_refused_naming_it(paired_runs, tiny_model_path):
    _, from_objects, _ = paired_runs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from api_rewards import accuracy, brevity

    with pytest.raises(ConfigError) as refused:
        grpo_trainer.train(from_objects / "config.yaml", ["train.max_steps=4", "checkpoint.resume=auto"],
                           rewards=[accuracy, brevity],
                           model=AutoModelForCausalLM.from_pretrained(tiny_model_path),
                           tokenizer=AutoTokenizer.from_pretrained(tiny_model_path))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"cannot resume from {from_objects / 'checkpoints' / 'step-000003'}: its run was given train_dataset")
    assert "pass train_dataset= again" in message

    # The command line, given the run's config.yaml, stops with one line too (the first object it needs)
    cli = run_cli(["train", str(from_objects / "config.yaml"), "train.max_steps=4", "checkpoint.resume=auto"])
    assert cli.returncode == 2
    assert cli.stderr.strip().splitlines()[-1].startswith("error: model.tokenizer: 'object:tokenizer' names an object given")
    assert "pass tokenizer=" in cli.stderr and "Traceback" not in cli.stderr


def resume_with_objects(out: str, result_file: str) -> None:
    """In a forked child: resume first with a changed dataset (refused), then with the same objects."""
    from grpo_trainer.errors import TrainingError

    resumed = ["train.max_steps=4", "checkpoint.resume=auto"]
    try:
        train_with_objects(out, result_file, [*SHARED, *resumed], changed_answer=True)
        refusal = None
    except TrainingError as exc:
        refusal = str(exc)
    train_with_objects(out, result_file, [*SHARED, *resumed])
    result = json.loads(Path(result_file).read_text())
    Path(result_file).write_text(json.dumps({**result, "refusal": refusal}))


@pytest.mark.slow
def test_a_changed_dataset_is_refused_on_resume_and_the_same_objects_resume(paired_runs, tmp_path):
    _, from_objects, _ = paired_runs
    shutil.copytree(from_objects, tmp_path / "run")
    child = run_in_fork(resume_with_objects, (str(tmp_path / "run"), str(tmp_path / "result.json")))
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    changed = api.dataset_records([{**arithmetic_records("train")[0], "answer": "0"}, *arithmetic_records("train")[1:]], "x")
    assert result["refusal"].startswith("cannot resume: these settings differ from the checkpoint's")
    assert f"'object:train_dataset@{in_memory.fingerprint(changed)}'" in result["refusal"]
    assert result["steps_done"] == 1 and [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- the model card of these runs


@pytest.mark.slow
def test_the_final_model_has_a_card_the_hub_loader_reads(paired_runs):
    import transformers
    import yaml
    from huggingface_hub import ModelCard

    from_yaml, from_objects, _ = paired_runs
    card = ModelCard.load(from_yaml / "model" / "README.md")
    assert (card.data.library_name, card.data.license, card.data.pipeline_tag) == ("transformers", "apache-2.0", "text-generation")
    assert card.data.tags == ["grpo-trainer", "reinforcement-learning", "grpo", "dr_grpo"]  # the loss type
    assert card.data.base_model is None and card.data.datasets is None  # the tiny model and local files: no Hub ids
    rows = read_metrics(from_yaml)
    tokens = sum(r["completions/mean_length"] for r in rows) * 16
    for line in ("| rewards | `accuracy` (weight 1), `brevity` (weight 0.5) |", "| group size G | 4 completions per prompt |",
                 "| steps | 3 (of train.max_steps 3) |", "| completions trained on | 48 |",
                 f"| completion tokens trained on | {tokens:,.0f} |", "| processes | 1 (NO) |"):
        assert line in card.text, line
    assert "| hardware | CPU: " in card.text and f"transformers {transformers.__version__}" in card.text
    assert "![Training reward](reward_curve.png)" in card.text
    assert (from_yaml / "model" / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    evaluated = rows[-1]
    assert "| step | accuracy/mean@2 | accuracy/pass@2 | brevity/mean@2 |" in card.text
    assert f"| 3 | {evaluated['eval/accuracy/mean@2']:.3f} | {evaluated['eval/accuracy/pass@2']:.3f} |" in card.text
    config_block = card.text.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(config_block) == yaml.safe_load((from_yaml / "config.yaml").read_text())

    objects_card = ModelCard.load(from_objects / "model" / "README.md").text
    fingerprint = grpo_trainer.load_config(from_objects / "config.yaml").data.source.rpartition("@")[2]
    assert f"| training data | a dataset given in Python (train_dataset, fingerprint `{fingerprint}`) |" in objects_card
    assert "`object:...` names what was given in Python (eval_dataset, model, reward/accuracy" in objects_card


@pytest.mark.slow
def test_export_writes_a_card_from_the_checkpoint(paired_runs, tmp_path):
    from huggingface_hub import ModelCard

    from_yaml, _, _ = paired_runs
    exported = run_cli(["export", str(from_yaml / "checkpoints" / "step-000003"), str(tmp_path / "exported")])
    assert exported.returncode == 0, exported.stderr[-2000:]
    card = ModelCard.load(tmp_path / "exported" / "README.md")
    assert card.data.library_name == "transformers" and "dr_grpo" in card.data.tags
    assert "| steps | 3 (of train.max_steps 3) |" in card.text and "| processes | 1 |" in card.text
    assert "| hardware | not recorded |" in card.text and (tmp_path / "exported" / "reward_curve.png").is_file()


# ----------------------------------------------------------------------------- datasets


def test_a_dataset_and_its_list_of_dicts_are_the_same_records():
    import datasets

    rows = [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "What is 2+2?"}]
    as_list = api.dataset_records(rows, "train_dataset")
    assert as_list[1] == {"prompt": "What is 2+2?", "answer": None}  # every record gets every column, as from a file
    as_dataset = api.dataset_records(datasets.Dataset.from_list(rows), "train_dataset")
    assert as_dataset == as_list and in_memory.fingerprint(as_dataset) == in_memory.fingerprint(as_list)
    assert in_memory.fingerprint(as_list) != in_memory.fingerprint(as_list[::-1])  # order is part of the data


@pytest.mark.parametrize("dataset, message", [
    ([{"prompt": "a"}, "b"], "train_dataset: record 1 is a str, not a dict of columns"),
    ([], "train_dataset: the dataset has no records"),
    ("data.jsonl", "train_dataset: expected a datasets.Dataset or a list of dicts, got str"),
])
def test_datasets_that_cannot_be_read_are_refused(dataset, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        api.dataset_records(dataset, "train_dataset")


def test_a_dataset_dict_is_refused_naming_the_split_to_pass():
    import datasets

    both = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a"}])})
    with pytest.raises(ConfigError, match=r"several splits; pass one, e.g. train_dataset=dataset\['train'\]"):
        api.dataset_records(both, "train_dataset")


def test_a_reference_without_its_object_is_one_line_naming_it():
    with pytest.raises(DataError) as missing:
        from grpo_trainer.data import load_records

        load_records(DataConfig(source="object:train_dataset@0123456789abcdef"))
    assert str(missing.value) == (
        "data.source: 'object:train_dataset@0123456789abcdef' names an object given to grpo_trainer.train() in Python, "
        "and none was given here: pass train_dataset= (a run given objects runs and resumes from Python, with the same objects)")
    records = in_memory.Records([{"prompt": "a"}], "feedfacefeedface")
    with in_memory.given({"train_dataset": records}), pytest.raises(DataError, match="has fingerprint feedfacefeedface"):
        load_records(DataConfig(source="object:train_dataset@0123456789abcdef"))


def test_a_model_object_is_the_policy_once_then_its_frozen_reference():
    import torch

    policy = torch.nn.Linear(2, 2)
    reference = torch.nn.Linear(2, 2)
    with in_memory.given({"model": in_memory.ModelObject(policy, reference)}):
        assert in_memory.model("object:model", "model.name_or_path") is policy  # trained in place
        assert in_memory.model("object:model", "model.name_or_path") is reference  # copied before training
    with in_memory.given({"model": in_memory.ModelObject(policy)}):
        in_memory.model("object:model", "model.name_or_path")
        copied = in_memory.model("object:model", "model.name_or_path")
        assert copied is not policy and torch.equal(copied.weight, policy.weight)
    with pytest.raises(ConfigError, match="pass model="):
        in_memory.model("object:model", "model.name_or_path")  # outside a train() call: nothing is given


# ----------------------------------------------------------------------------- rewards and config


def named_reward(completions, **kwargs):
    return [0.0] * len(completions)


class CallableReward:
    def __call__(self, completions, **kwargs):
        return [0.0] * len(completions)


def test_reward_entries_name_functions_as_metrics_will():
    objects: dict = {}
    assert api._reward_entry(named_reward, 0, objects) == {"name": "object:reward/named_reward"}
    entry = api._reward_entry({"fn": named_reward, "weight": 0.5, "kwargs": {"x": 1}, "alias": "mine"}, 1, objects)
    assert entry == {"name": "object:reward/mine", "weight": 0.5, "kwargs": {"x": 1}, "alias": "mine"}
    partial = api._reward_entry(functools.partial(named_reward, x=1), 2, {})
    assert partial == {"name": "object:reward/named_reward", "alias": "named_reward"}
    assert api._reward_entry(CallableReward(), 3, objects) == {"name": "object:reward/CallableReward", "alias": "CallableReward"}
    assert api._reward_entry("math_accuracy", 4, objects) == {"name": "math_accuracy"}
    assert objects["reward/named_reward"] is named_reward and objects["reward/mine"] is named_reward


@pytest.mark.parametrize("item, message", [
    (lambda completions, **kw: [0.0], "rewards[0]: this function has no name to log its metrics under"),
    ({"fn": named_reward, "name": "math_accuracy"}, "rewards[0]: give `fn` (a function) or `name`"),
    ({"fn": 3}, "rewards[0].fn: expected a function, got int"),
])
def test_reward_entries_that_cannot_work_are_refused(item, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        api._reward_entry(item, 0, {})


def test_two_functions_of_one_name_are_refused():
    objects: dict = {}
    api._reward_entry(named_reward, 0, objects)
    with pytest.raises(ConfigError, match="two reward functions are named 'named_reward'; give one an alias"):
        api._reward_entry(named_reward, 1, objects)


def test_overrides_as_strings_and_as_a_dict_give_one_config(tmp_path):
    from grpo_trainer.config import Config, config_from_dict

    as_strings = api.config_data("configs/demo_cpu.yaml")
    api._apply_overrides(as_strings, ["train.max_steps=7", "loss.type=dr_grpo", "rewards.0.weight=2"])
    as_dict = api.config_data(grpo_trainer.load_config("configs/demo_cpu.yaml"))  # from a Config object
    api._apply_overrides(as_dict, {"train.max_steps": 7, "loss.type": "dr_grpo", "rewards.0.weight": 2})
    assert config_from_dict(as_strings) == config_from_dict(as_dict)
    assert config_from_dict(as_dict).train.max_steps == 7 and isinstance(config_from_dict(as_dict), Config)
    with pytest.raises(ConfigError, match="overrides: expected a list of KEY=VALUE strings or a dict"):
        grpo_trainer.train("configs/demo_cpu.yaml", "train.max_steps=7")


def test_what_cannot_work_with_objects_stops_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError, match="eval.every: the training data was given as an object"):
        grpo_trainer.train("configs/demo_cpu.yaml", {"eval.every": 2, "output_dir": str(tmp_path)},
                           train_dataset=arithmetic_records("train"))

    class Model(torch.nn.Module):  # what a causal LM has that the API checks: a module, a config, generate
        dtype = "torch.float32"
        name_or_path = str(tmp_path)
        config = None

        def generate(self):
            raise AssertionError("not reached")

    with pytest.raises(ConfigError, match="rollout.engine: vllm_colocate loads the model from model.name_or_path"):
        grpo_trainer.train("configs/demo_cpu.yaml", {"rollout.engine": "vllm_colocate", "output_dir": str(tmp_path)},
                           model=Model())


# ----------------------------------------------------------------------------- a script under accelerate launch


LAUNCHED_SCRIPT = '''
import sys
import grpo_trainer
from grpo_trainer.builtin.tiny import arithmetic_records


def boxed(completions, answer, **kwargs):
    return [1.0 if "\\\\boxed{" + a + "}" in c else 0.0 for c, a in zip(completions, answer)]


if __name__ == "__main__":
    result = grpo_trainer.train("configs/demo_cpu.yaml", sys.argv[1:], train_dataset=arithmetic_records("train"),
                                rewards=[boxed])
    print(f"rank done: {result.steps_done} steps, reward {result.last_metrics['reward']:.4f}")
'''


@pytest.mark.slow
def test_a_script_under_accelerate_launch_trains_on_two_ranks(tmp_path, tiny_model_path):
    import os
    import subprocess
    import sys

    from helpers import cpu_launch_file

    script = tmp_path / "notebook_script.py"
    script.write_text(LAUNCHED_SCRIPT)
    launch = cpu_launch_file("ddp", tmp_path)
    out = tmp_path / "run"
    result = subprocess.run(
        [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(launch), str(script),
         *small_run_overrides(out, steps=2)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world_size=2 distributed_type=MULTI_CPU" in result.stderr
    assert result.stdout.count("rank done: 2 steps") == 2  # every rank returns the (same) result
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and "rewards/boxed/mean" in rows[-1]
    assert "| processes | 2 (MULTI_CPU) |" in (out / "model" / "README.md").read_text()
