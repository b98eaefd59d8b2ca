"""docs/python_api.md's notebook example runs as written: its ```python blocks, in order, in one interpreter, as the
cells of a notebook would (from an empty folder, so its relative output_dir lands there)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from grpo_trainer.metrics import read_metrics
from helpers import ROOT, run_in_fork

DOC = ROOT / "docs" / "python_api.md"


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)


def run_cells(cells: list[str], folder: str) -> None:
    """In a forked child: the cells one after the other, sharing their names, as a notebook runs them."""
    os.chdir(folder)
    namespace: dict = {"__name__": "__main__"}
    for number, cell in enumerate(cells, start=1):
        exec(compile(cell, f"{DOC.name} block {number}", "exec"), namespace)


@pytest.mark.slow
def test_the_notebook_example_runs_as_written(tmp_path, tiny_model_path):
    cells = python_blocks(DOC.read_text())
    assert len(cells) >= 3 and "grpo_trainer.train(" in cells[0]
    # The first cell twice, as a notebook user reruns it: the finished run is said to be complete and its final
    # metrics are returned (it was resumed for 0 steps with last_metrics={}: a KeyError on 'reward').
    child = run_in_fork(run_cells, ([cells[0], cells[0], *cells[1:]], str(tmp_path)))
    assert child.returncode == 0, child.stderr[-3000:]
    printed = child.stdout.splitlines()  # (libraries print their own lines too, e.g. DeepSpeed's accelerator note)
    run = tmp_path / "outputs" / "notebook"
    # The run's folder comes back absolute: the config's local paths are made absolute once, at the start.
    first, again = [line.split() for line in printed if line.startswith(f"{run} ")]
    assert first[:2] == [str(run), "10"] and again == [str(run), "0", first[2]]  # dir, steps, reward
    assert f"the run in {run} is complete (checkpoint step-000010, step 10; train.max_steps=10)" in child.stderr
    assert any(line.startswith("4 ") for line in printed)  # the second run's steps_done
    assert "['grpo-trainer', 'reinforcement-learning', 'grpo']" in printed
    assert "| rewards | `correct` (weight 1), `concise` (weight 0.1) |" in printed
    rows = read_metrics(run)
    assert len(rows) == 10 and "rewards/concise/mean" in rows[-1] and "eval/correct/pass@4" in rows[4]
    assert len(read_metrics(tmp_path / "outputs" / "notebook-more")) == 4
    assert (tmp_path / "outputs" / "notebook-more" / "model" / "README.md").is_file()
