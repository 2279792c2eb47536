"""``DeviceMesh``: named dims over a set of worker ranks, and the handle that sends work there.

The geometry (``slice``, ``split``, ``rename``, ``flatten``, sizes, the rank table) is a pure
value over :class:`~tdmesh.geometry.shape.Shape` and sends nothing.  A mesh made by a launcher also
holds the ``client`` that talks to its fleet, and the ``fleet`` itself (to shut it down);
sub-meshes share both.  Process groups and torch DeviceMesh handles for remote functions
live here too.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from .engine.activation import Activation, deactivate
from .errors import UsageError, user_line
from .geometry.fanout import RankList
from .geometry.grouping import normalize_dims
from .geometry.shape import Shape
from .geometry.slice import Slice
from .objects import spawn
from .protocol import messages as m
from .remote import Remote

__all__ = ["DeviceMesh", "RemoteProcessGroup", "TorchMeshHandle"]


class DeviceMesh:
    """A mesh of worker ranks with named dims, e.g. ``("host", "gpu")``.

    Meshes compare by identity (as Monarch's): two handles over the same ranks are still
    different meshes for placement checks.  Geometry methods return new meshes that share
    this mesh's fleet.
    """

    def __init__(self, shape: Shape, client=None, *, fleet=None) -> None:
        if not isinstance(shape, Shape):
            raise TypeError(f"DeviceMesh needs a Shape, got {type(shape).__name__}")
        self._shape = shape
        self.client = client
        self.fleet = fleet  # what exit() shuts down; None for geometry values and bare clients

    @classmethod
    def from_sizes(cls, client=None, **sizes: int) -> DeviceMesh:
        """A dense mesh over ranks ``0..N-1``: ``DeviceMesh.from_sizes(host=2, gpu=4)``."""
        return cls(Shape(tuple(sizes), Slice.new_row_major(list(sizes.values()))), client)

    def _derive(self, shape: Shape) -> DeviceMesh:
        return DeviceMesh(shape, self.client, fleet=self.fleet)

    # -- geometry ------------------------------------------------------------------------
    @property
    def shape(self) -> Shape:
        return self._shape

    @property
    def names(self) -> tuple[str, ...]:
        return self._shape.labels

    @property
    def sizes(self) -> dict[str, int]:
        return self._shape.sizes

    @property
    def processes(self) -> Slice:
        """The global ranks of this mesh as a :class:`Slice`."""
        return self._shape.slice

    @functools.cached_property
    def rank_list(self) -> tuple[int, ...]:
        """The global ranks in mesh order (cached, and read as a plain attribute after: the send path
        reads it for every op)."""
        return RankList(self._shape.slice)

    def size(self, dims: None | str | Sequence[str] = None) -> int:
        """Ranks along ``dims``: all dims for ``None``, a product for a sequence."""
        return self._shape.size(dims)

    def __len__(self) -> int:
        return len(self._shape)

    def spawn(self, cls, /, *args, **kwargs):
        """One ``cls(*args, **kwargs)`` on every rank, in order with the tensor ops (see tdmesh.objects)."""
        return spawn(self, cls, *args, **kwargs)

    def __call__(self, /, **kw: int | slice) -> DeviceMesh:
        """``mesh(host=0)``: Monarch's older spelling of :meth:`slice` (deprecated there, as here)."""
        warnings.warn("mesh(**dims) is Monarch's older spelling of mesh.slice(**dims): use mesh.slice",
                      DeprecationWarning, stacklevel=2)
        return self.slice(**kw)

    def slice(self, /, **kw: int | slice) -> DeviceMesh:
        """``int`` removes a dim, ``slice`` restricts it; applied in keyword order."""
        return self._derive(self._shape.index(**kw))

    def split(self, /, **kw: Sequence[str] | int) -> DeviceMesh:
        """``split(host=("dp", "pp"), gpu=("tp",), pp=4)``: rank order is preserved."""
        return self._derive(self._shape.split(**kw))

    def rename(self, /, **kw: str) -> DeviceMesh:
        """``rename(gpu="tp")``: new names, same ranks in the same order."""
        return self._derive(self._shape.rename(**kw))

    def flatten(self, name: str) -> DeviceMesh:
        """One dim called ``name`` over every rank; dense meshes only."""
        return self._derive(self._shape.flatten(name))

    def rank_array(self):
        """The global ranks as a numpy array shaped like the mesh (as torch's ``DeviceMesh.mesh``
        is a tensor of ranks): ``mesh.rank_array()[h, g]`` is the rank at ``host=h, gpu=g``."""
        return np.array(self._shape.ranks(), dtype=np.int64).reshape([self.sizes[d] for d in self.names])

    def to_table(self) -> str:
        """The rank grid as text: the last dim across, the others down."""
        return self._shape.to_table()

    # -- live: these talk to the fleet -------------------------------------------------------
    def _tdmesh_wire(self):
        """How a mesh argument travels to a remote function (the worker sees its own view)."""
        return m.MeshArg(self._shape)

    @property
    def device_type(self) -> str:
        return self._live().device_type

    def _live(self):
        if self.client is None:
            raise UsageError(f"{self!r} has no fleet: it is a pure geometry value. Get a live mesh from "
                               f"tdmesh.local_mesh() or tdmesh.world_mesh()")
        return self.client

    def activate(self) -> Activation:
        """Make this mesh the one ops run on, now; usable as a context manager that restores
        the previous mesh on exit."""
        self._live().check_usable()
        return Activation(self)

    def deactivate(self) -> None:
        """End the activation begun by ``activate()`` called without ``with``; the mesh that
        was active before is active again.  A UsageError if this mesh is not the active one."""
        deactivate(self)

    def rank(self, dims: str | Sequence[str]):
        """A remote int64 scalar: each worker's coordinate along ``dims`` (row-major in the given order)."""
        if isinstance(dims, str):
            dims = (dims,)
        for d in dims:
            self._shape.dim(d)
        return _mesh_rank(self, tuple(dims))

    @property
    def ranks(self) -> dict:
        return {d: self.rank(d) for d in self.names}

    def process_idx(self):
        """A remote int64 scalar: each worker's global rank."""
        return _process_idx(self)

    def process_group(self, dims: str | Sequence[str]):
        """A process group over ``dims`` that remote functions receive as a real
        ``torch.distributed.ProcessGroup`` (on the calling stream).  Each call is a new group."""
        self._live()
        return RemoteProcessGroup(self, dims)

    def torch_mesh(self) -> TorchMeshHandle:
        """A handle that a remote function receives as a ``torch.distributed`` DeviceMesh with
        this mesh's dims and groups, so DTensor / FSDP2 code runs unchanged on the workers."""
        self._live()
        return TorchMeshHandle(self)

    def exit(self, error: str | None = None) -> None:
        """Shut the fleet down (idempotent) and raise any remote error nobody observed."""
        if self.fleet is not None:
            self.fleet.exit(error)
        elif self.client is not None:
            self.client.shutdown(error)

    def __repr__(self) -> str:
        spares = self.fleet.spares if self.fleet is not None and self.fleet.mesh is self else ()
        beside = f", spares {_ranks_text(spares)}" if spares else ""
        return f"<DeviceMesh {self._shape} ranks {_ranks_text(self._shape.ranks())}{beside}>"

    def __str__(self) -> str:
        return f"DeviceMesh {self._shape}\n{self.to_table()}"


class RemoteProcessGroup:
    """``mesh.process_group(dims)``: a remote function receives it as a real
    ``torch.distributed.ProcessGroup`` over ``dims``, on the stream the call runs on.
    The workers keep its groups until :meth:`drop` (or the mesh's exit)."""

    def __init__(self, mesh: DeviceMesh, dims) -> None:
        if isinstance(dims, str):
            dims = (dims,)
        self.mesh = mesh
        self.dims = normalize_dims(mesh.shape, dims)
        self.ref = mesh.client.new_ref()
        self.dropped_at: str | None = None  # the user's line that dropped it

    def size(self) -> int:
        """Members of each group: ``mesh.size(dims)``."""
        return self.mesh.size(self.dims)

    def drop(self) -> None:
        """Free this group on every rank now: each worker destroys its torch ProcessGroups of
        it (one per stream it was used on) after the calls already issued there, which is what
        a long job making groups as it goes needs.  Using it afterwards is a UsageError;
        dropping again, or after the mesh's exit, does nothing."""
        if self.dropped_at is not None:
            return
        client = self.mesh.client
        if client.sink is not client:
            raise UsageError(f"drop {self!r} outside the compiled function: a drop is not part of a recording\n"
                             f"  at {user_line()}")
        self.dropped_at = user_line()
        if not client.closed and client.failure is None:  # an exited or failed fleet has no groups left
            client.send_setup(m.DropGroups(self.ref))

    def _check_live(self) -> None:
        if self.dropped_at is not None:
            raise UsageError(f"{self!r} was dropped, at {self.dropped_at}; make a new one with mesh.process_group()\n"
                             f"  at {user_line()}")

    def _tdmesh_wire(self):
        self._check_live()
        return m.ProcessGroupArg(self.ref, self.mesh.shape, self.dims)

    def _tdmesh_groups(self, client, stream: int):
        """Before a call that takes this group runs on ``stream``: its groups exist there."""
        self._check_live()
        if self.mesh.client is not client:
            raise TypeError(f"{self!r} belongs to another fleet than the mesh this call runs on")
        client.ensure_groups("remote", stream, self.mesh.shape, self.dims, self.ref)
        return self._tdmesh_wire()

    def __repr__(self) -> str:
        state = " (dropped)" if self.dropped_at is not None else ""
        return f"<tdmesh.RemoteProcessGroup {self.ref} over {list(self.dims)} of {self.mesh.shape}{state}>"


class TorchMeshHandle:
    """See :meth:`DeviceMesh.torch_mesh`."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def _tdmesh_wire(self):
        return m.TorchMeshArg(self.mesh.shape)

    def _tdmesh_groups(self, client, stream: int) -> None:
        """Before a call that takes this mesh runs on ``stream``: one group per dim there."""
        for d in self.mesh.names:
            client.ensure_groups("dims", stream, self.mesh.shape, (d,))

    def __repr__(self) -> str:
        return f"<torch DeviceMesh handle for {self.mesh.shape}>"


_mesh_rank = Remote("tdmesh.worker.builtins.mesh_rank", propagate=lambda *a: torch.empty((), dtype=torch.int64))
_process_idx = Remote("tdmesh.worker.builtins.process_idx", propagate=lambda *a: torch.empty((), dtype=torch.int64))


def _ranks_text(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}..{ranks[-1]}"
    if len(ranks) > 12:
        return ", ".join(map(str, ranks[:6])) + ", ..., " + ", ".join(map(str, ranks[-3:]))
    return ", ".join(map(str, ranks))
