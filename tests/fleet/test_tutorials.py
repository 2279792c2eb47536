"""Every tutorial runs as a user would run it (CPU workers here)."""

import glob
import os
import subprocess
import sys

import pytest

from paths import REPO as ROOT

TUTORIALS = sorted(glob.glob(os.path.join(ROOT, "tutorials", "[0-9][0-9]_*.py")))


def check_quickstart(stdout: str) -> None:
    assert "[ 6.,  8., 10.]" in stdout
    assert "caught locally: a and b must have same reduction dim" in stdout
    assert "remote error, reported at the fetch: IndexError" in stdout
    assert "unrelated values stay fetchable: 15.0" in stdout


def check_pipeline_matches_one_mesh(stdout: str) -> None:
    """The GPipe schedule on two stages trains exactly as the same model on one mesh."""
    piped = [line.split()[4] for line in stdout.splitlines() if line.startswith("pipeline   step")]
    single = [line.split()[5] for line in stdout.splitlines() if line.startswith("one mesh   step")]
    assert len(piped) == 3 and piped == single


# What a tutorial's own output must show beyond a clean exit, and the arguments it runs with here
# (each tutorial runs once: a process per run is most of what these tests cost).
CHECKS = {"01_quickstart.py": ((), check_quickstart),
          "06_pipeline.py": (("--steps", "3"), check_pipeline_matches_one_mesh)}


@pytest.mark.parametrize("path", TUTORIALS, ids=os.path.basename)
def test_tutorial_runs(path):
    args, check = CHECKS.get(os.path.basename(path), ((), None))
    out = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TDMESH_DEVICE="cpu"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stdout
    if check is not None:
        check(out.stdout)
