"""A ``DataLoader`` iterated under an active mesh gives the batches it gives without one: local tensors, made
at plain torch's speed, for the user to put on the mesh (``tdmesh.to_mesh(batch, mesh)``, one upload a step).

Its ``__iter__`` and each ``__next__`` run in ``engine.activation.plain_torch``: none of tdmesh's modes on the
thread, no active mesh.  Before, a loader under a mesh made every ``torch.tensor`` of ``__getitem__`` a mesh op
(0.09x the local loop), drew its base seed on the mesh and read it back (an ``.item()`` the ranks disagreed
on), and forked workers that inherited the mesh's modes: a collate error died in a feeder thread and the
loop waited forever.  Workers forked in ``__iter__`` now start with no mesh in them, and the client copied
into them is closed (``engine.forks``): a loader's error reaches the loop as torch raises it.
"""

from __future__ import annotations

import functools

from ..engine.activation import plain_torch

__all__ = ["install"]


def _plain(method):
    @functools.wraps(method)
    def run(self):
        with plain_torch():
            return method(self)

    run.__tdmesh_original__ = method
    return run


def install() -> None:
    from torch.utils.data import dataloader
    if hasattr(dataloader.DataLoader.__iter__, "__tdmesh_original__"):
        return
    dataloader.DataLoader.__iter__ = _plain(dataloader.DataLoader.__iter__)  # type: ignore[method-assign]
    base = dataloader._BaseDataLoaderIter
    base.__next__ = _plain(base.__next__)  # type: ignore[method-assign]
