"""`make test` relies on `--dist loadgroup`: the tests of one `xdist_group` run on one worker, so a module fixture
that starts vLLM servers (tests/test_vllm_server.py, tests/test_async_vllm.py) or loads SmolLM2 starts once.

pytest 9.2 with pytest-xdist 3.8 dropped the groups without a word (pytest-dev/pytest-xdist#1386: xdist marks a
group by rewriting the test's node id, which pytest 9.2 no longer reads): each group was spread over both workers
and every such fixture set up twice, ~4 minutes of `make test`. This runs the installed pytest and xdist on a
generated module, as `make test` runs them, and checks that a group stays on one worker.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts a pytest with two xdist workers

GROUPED = '''
import os
import pytest

pytestmark = pytest.mark.xdist_group("one_worker")

@pytest.fixture(scope="module")
def started_once():
    with open("setups.log", "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_grouped(i, started_once):
    with open("ran.log", "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
'''

UNGROUPED = '''
import time
import pytest

@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    time.sleep(0.2)  # keeps the other worker busy while the group runs
'''


def test_a_group_runs_on_one_worker_and_its_module_fixture_starts_once(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_ungrouped.py").write_text(UNGROUPED)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                             "--rootdir", str(tmp_path), str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ran = (tmp_path / "ran.log").read_text().split()
    assert len(ran) == 6 and len(set(ran)) == 1, f"the group ran on workers {sorted(set(ran))}"
    assert (tmp_path / "setups.log").read_text().split() == ran[:1], "the module fixture was set up more than once"
