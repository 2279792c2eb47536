"""Spare workers (issue 54, part 1): processes started, connected and authenticated like the mesh's own, outside it.

``local_mesh(spares=k)`` and, under torchrun, ``TDMESH_SPARES=k`` keep the last k ranks out of the mesh: ops,
collectives and remote functions run on the mesh's ranks only (the values equal those of a mesh without spares),
the spares answer the client's all-rank messages, and no spare process outlives the fleet.  Under torchrun
the world mesh's spare is tested with healing (``test_healing.py``: its torchrun job prints the mesh and where a
remote function ran).
"""

from __future__ import annotations

import os

import pytest
import torch
from _processes import gone

import tdmesh


def rank_of():
    return int(os.environ["RANK"])


@pytest.mark.parametrize("spares", [1, 2])
def test_spares_stay_outside_the_mesh_and_leave_with_it(spares):
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, spares=spares, pool=False) as mesh:
        client = mesh.client
        assert client.ranks == list(range(2 + spares)) and mesh.fleet.spares == tuple(range(2, 2 + spares))
        assert repr(mesh).endswith({1: "ranks 0..1, spares 2>", 2: "ranks 0..1, spares 2..3>"}[spares])
        assert "spares" not in repr(mesh.slice(gpu=1))  # a sub-mesh is not the fleet's mesh
        pids = {r: h.pid for r, h in client.hellos.items()}
        with mesh.activate():
            x = torch.arange(3.0) * (mesh.rank("gpu") + 1)
            total = tdmesh.reduce(x, "gpu")
            ran = sorted(v for _, v in tdmesh.remote(rank_of).call().get())
            got = tdmesh.fetch_shard((x, total), host=0, gpu=1).result()
        assert ran == [0, 1]
        assert torch.equal(got[0], torch.arange(3.0) * 2) and torch.equal(got[1], torch.arange(3.0) * 3)
        for r in range(2, 2 + spares):
            os.kill(pids[r], 0)  # alive while the fleet is
    assert all(gone(pid) for pid in pids.values())


def test_spares_that_leave_no_mesh_are_refused():
    from tdmesh.launcher import _world_shape
    assert _world_shape(8, 4, 4) == (1, 4, 4) and _world_shape(3, 3, 1) == (1, 2, 1)
    with pytest.raises(tdmesh.UsageError, match="at least one"):
        _world_shape(2, 2, 2)
    with pytest.raises(tdmesh.UsageError, match="whole hosts"):
        _world_shape(8, 4, 1)
    with pytest.raises(ValueError, match="spares >= 0"):
        with tdmesh.local_mesh(hosts=1, gpus_per_host=1, spares=-1):
            pass
