"""Monarch's ``OpaqueRef``: a Python object per rank, held by the client as a handle.

A remote function makes one on the workers by returning ``tdmesh.OpaqueRef(obj)``; its propagator (or
the cached propagation's probe) says so with ``OpaqueRef(None)``.  The client gets an ``OpaqueRef``
handle: passed to a later remote function, each rank's function gets its own box back, whose ``.value``
is the object (and may be set).  The objects are freed on the workers when the handle dies (its ref's
``DeleteRefs``, as a tensor's), so a worker's table of them shrinks as the client lets go.

The value lives only on the workers: reading or setting ``.value`` on the client, or making an
``OpaqueRef`` of a value with a mesh active, raises, as Monarch's does.  ``OpaqueObject`` (tdmesh.opaque)
is the handle of an object built by a constructor, with methods; ``mesh.spawn`` is tdmesh's own spelling.
"""

from __future__ import annotations

from typing import Any

from .engine.context import active_mesh_or_none
from .engine.tensor import RefOwner
from .errors import user_line
from .protocol import messages as m
from .protocol.resident import Resident

__all__ = ["OpaqueRef", "handle_of"]

_ONLY_REMOTE = "This can only be done in a remote function."


class OpaqueRef:
    """``OpaqueRef(obj)`` in a remote function: ``obj`` kept on the worker, a handle on the client."""

    _r: RefOwner
    mesh: Any
    stream: Any

    def __new__(cls, value=None, *args, **kwargs):  # a subclass's __init__ takes its own arguments
        if cls is OpaqueRef:  # in a remote function (or, with None, a propagator): the worker's box
            if value is not None and active_mesh_or_none() is not None:
                raise RuntimeError(f"Client is attempting to create an OpaqueRef. {_ONLY_REMOTE} (return "
                                   f"tdmesh.OpaqueRef(obj) from a remote function, or use mesh.spawn)\n"
                                   f"  at {user_line()}")
            return Resident(value)
        return super().__new__(cls)

    @property
    def value(self):
        raise RuntimeError(f"Client is attempting to access an OpaqueRef. {_ONLY_REMOTE} (pass the OpaqueRef to "
                           f"one: its .value there is the rank's object)\n  at {user_line()}")

    @value.setter
    def value(self, _obj) -> None:
        raise RuntimeError(f"Client is attempting to set an OpaqueRef. {_ONLY_REMOTE}\n  at {user_line()}")

    def _tdmesh_wire(self):  # an argument of a remote function: each rank's own box
        return m.Ref(self._r.id)

    @property
    def _tdmesh_object_ref(self) -> int:  # read by fetch.prepare_call: a call passing this object uses it
        return self._r.id

    def __repr__(self) -> str:
        return f"<OpaqueRef (ref {self._r.id}) on {self.mesh.shape}>"


def handle_of(owner: RefOwner, mesh, stream) -> OpaqueRef:
    """The client's handle of the boxes a remote function returned, bound on the workers to ``owner``'s ref."""
    ref = object.__new__(OpaqueRef)  # not OpaqueRef(...): that makes a worker's box
    ref._r = owner
    ref.mesh = mesh
    ref.stream = stream
    return ref
