"""How `make test` runs the suite. It relies on `--dist loadgroup`: the tests of one `xdist_group` run on one worker, so a module fixture
that starts vLLM servers (tests/test_vllm_server.py, tests/test_async_vllm.py) or trains a run starts once.

pytest 9.2 with pytest-xdist 3.8 dropped the groups without a word (pytest-dev/pytest-xdist#1386: xdist marks a
group by rewriting the test's node id, which pytest 9.2 no longer reads): each group was spread over both workers
and every such fixture set up twice, ~4 minutes of `make test`. This runs the installed pytest and xdist, with
this suite's conftest.py, on generated modules, as `make test` runs them: a group stays on one worker, whether
marked by hand or by conftest.py (a module fixture's tests).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts a pytest with two xdist workers

MODULE = '''
import os
import pytest
{mark}

@pytest.fixture(scope="module")
def started_once():
    with open("{name}.setups", "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_grouped(i, started_once):
    with open("{name}.ran", "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
'''

UNGROUPED = '''
import time
import pytest

@pytest.mark.parametrize("i", range(8))
def test_alone(i):
    time.sleep(0.2)  # keeps the other worker busy while the groups run
'''


def test_a_group_runs_on_one_worker_and_its_module_fixture_starts_once(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_marked.py").write_text(MODULE.format(name="marked", mark='pytestmark = pytest.mark.xdist_group("g")'))
    (tmp_path / "test_by_fixture.py").write_text(MODULE.format(name="by_fixture", mark=""))
    (tmp_path / "test_ungrouped.py").write_text(UNGROUPED)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                             "--rootdir", str(tmp_path), str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name in ("marked", "by_fixture"):
        ran = (tmp_path / f"{name}.ran").read_text().split()
        assert len(ran) == 6 and len(set(ran)) == 1, f"{name}: the group ran on workers {sorted(set(ran))}"
        assert (tmp_path / f"{name}.setups").read_text().split() == ran[:1], f"{name}: the fixture was set up twice"


def test_the_venvs_programs_come_first_on_the_path():
    """conftest.py puts this venv first on the PATH for everything the tests start: launchers (`accelerate`,
    `torchrun`) and the `ninja` DeepSpeed builds its CPU ops with are the venv's, whichever test starts them."""
    venv_bin = Path(sys.executable).parent
    assert shutil.which("accelerate") == str(venv_bin / "accelerate")
    if (venv_bin / "ninja").exists():
        assert shutil.which("ninja") == str(venv_bin / "ninja")
