"""A worker that dies (``os._exit``, SIGKILL) is reported as a diagnosis: the dead rank and its cause first, then
the op it was running and the user's line that issued it, then the consequences (the launcher stopping the
other ranks).  Before, the first line was rank 0's SIGTERM, a consequence, and no op or line was named."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

import tdmesh


def die(how: str) -> None:
    if os.environ.get("RANK") == "1":
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("how, cause", [("exit", "died: exit code 3"), ("kill", "died: killed by signal SIGKILL")])
def test_a_dead_workers_exception_names_the_cause_then_its_op_then_the_consequences(how, cause):
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, pool=False) as mesh, mesh.activate():
        y = torch.ones(3) + 1
        tdmesh.remote(die, propagate="inspect")(how)  # the op the diagnosis names
        line = sys._getframe().f_lineno - 1
        with pytest.raises(tdmesh.DeviceException) as caught:
            tdmesh.fetch_shard(y * 2).result()
        lines = str(caught.value).splitlines()
        caught.value.observed = True
    assert lines[0].startswith("worker rank 1 (") and lines[0].endswith(cause), lines
    assert lines[1].startswith("it was running op ") and f'"{__file__}", line {line}' in lines[1], lines
    assert lines[2].startswith("then: worker rank 0 (") and "stopped by the launcher (SIGTERM)" in lines[2], lines
    assert lines[-1].startswith("worker logs:"), lines
