"""The per-test time limit (tests/_watchdog.py) fails a hung test with its threads' stacks and
runs on to the next test, instead of holding the whole run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from paths import REPO


def test_a_test_past_its_limit_fails_with_the_stacks_and_the_run_goes_on(tmp_path):
    (tmp_path / "conftest.py").write_text("from _watchdog import pytest_runtest_protocol, pytest_unconfigure  # noqa\n")
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import threading
        import pytest

        @pytest.mark.time_limit(1)
        def test_waits_forever():
            threading.Event().wait()

        def test_after_it():
            pass
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "tests"), REPO])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-o", "addopts=", "-o", "markers=time_limit", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed, 1 passed" in run.stdout, run.stdout
    assert "test_waits_forever ran past its 1 s time limit" in run.stdout, run.stdout
    assert "threading.Event().wait()" in run.stdout  # the hung line, in the failure's stacks

