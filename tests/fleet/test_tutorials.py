"""Every tutorial runs as a user would run it (CPU workers here)."""

import glob
import os
import subprocess
import sys

import pytest

from paths import REPO as ROOT

TUTORIALS = sorted(glob.glob(os.path.join(ROOT, "tutorials", "[0-9][0-9]_*.py")))


@pytest.mark.parametrize("path", TUTORIALS, ids=os.path.basename)
def test_tutorial_runs(path):
    out = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TDMESH_DEVICE="cpu"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stdout


def test_quickstart_output():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tutorials", "01_quickstart.py")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TDMESH_DEVICE="cpu"))
    assert "[ 6.,  8., 10.]" in out.stdout
    assert "caught locally: a and b must have same reduction dim" in out.stdout
    assert "remote error, reported at the fetch: IndexError" in out.stdout
    assert "unrelated values stay fetchable: 15.0" in out.stdout


def test_pipeline_tutorial_matches_one_mesh():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tutorials", "06_pipeline.py"), "--steps", "3"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TDMESH_DEVICE="cpu"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    piped = [line.split()[4] for line in out.stdout.splitlines() if line.startswith("pipeline   step")]
    single = [line.split()[5] for line in out.stdout.splitlines() if line.startswith("one mesh   step")]
    assert len(piped) == 3 and piped == single
