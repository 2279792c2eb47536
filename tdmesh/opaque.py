"""Monarch's ``OpaqueObject`` and ``@opaque_method``: a Python object per rank, reached through its methods.

Monarch users hold worker-resident objects this way (``monarch.opaque_object``); tdmesh's own spelling is
``mesh.spawn`` (:mod:`tdmesh.objects`), which this module wraps without adding semantics:

- ``OpaqueObject(constructor, *args, **kwargs)`` builds ``constructor(*args, **kwargs)`` on every rank of the
  active mesh, in order with its tensor ops; ``constructor`` is a class, a callable or an import path.  The
  objects are freed on the workers when the client's ``OpaqueObject`` dies (its ref's ``DeleteRefs``);
  ``OpaqueObject(ref)`` of an ``OpaqueRef`` a remote function returned gives that object methods.
- ``obj.call_method(name, propagation, *args, **kwargs)`` runs ``name`` on each rank's object; its tensors
  come back as mesh tensors shaped by ``propagation(obj, *args, **kwargs)`` (run on the client on meta
  tensors, as a remote function's propagator).  Not differentiable, as in Monarch.
- ``obj.call_method_on_shard_and_fetch(name, *args, shard=None, **kwargs)``: one rank's result, fetched.
- ``@opaque_method``: a method of an ``OpaqueObject`` subclass whose body is its own propagator; calling it
  runs the worker object's method of that name.
- Passed to a remote function, an ``OpaqueObject`` arrives as its rank's box: ``arg.value`` is the object.

Attributes set on the client's ``OpaqueObject`` stay on the client.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from .engine.context import get_active_mesh
from .objects import ObjectHandle
from .opaque_ref import OpaqueRef

__all__ = ["OpaqueObject", "opaque_method"]


class OpaqueObject(OpaqueRef):
    """``constructor(*args, **kwargs)`` on every rank of the active mesh (Monarch's name for ``mesh.spawn``)."""

    def __init__(self, constructor, *args, **kwargs) -> None:
        if isinstance(constructor, OpaqueObject):  # Monarch wraps an existing one: the same objects
            self._handle: ObjectHandle = constructor._handle
        elif isinstance(constructor, OpaqueRef):  # the objects a remote function returned
            self._handle = ObjectHandle(constructor._r, constructor.mesh, constructor.stream, "OpaqueRef")
        else:
            self._handle = get_active_mesh().spawn(constructor, *args, **kwargs)
        self._r, self.mesh, self.stream = self._handle.owner, self._handle.mesh, self._handle.stream

    @property
    def handle(self) -> ObjectHandle:
        """The ``mesh.spawn`` handle: ``call`` / ``call_one`` / ``remote`` as tdmesh spells them."""
        return self._handle

    def call_method(self, method_name: str, propagation: Callable, *args, **kwargs):
        """``method_name(*args, **kwargs)`` on each rank's object; its tensors as mesh tensors shaped by
        ``propagation(self, *args, **kwargs)``."""
        return self._handle.remote(method_name, propagate=functools.partial(propagation, self))(*args, **kwargs)

    def call_method_on_shard_and_fetch(self, method_name: str, *args, shard: dict | None = None, **kwargs):
        """One rank's result of ``method_name(*args, **kwargs)`` (``shard``: every dim named; None: the first)."""
        return self._handle.call_one(method_name, *args, shard=shard, **kwargs)

    def __repr__(self) -> str:
        return f"<OpaqueObject {self._handle!r}>"


def opaque_method(fn: Callable) -> Callable:
    """A method of an ``OpaqueObject`` subclass whose body shapes its results (run on meta tensors on the client);
    calling it runs the worker object's method of the same name."""
    @functools.wraps(fn)
    def method(self: OpaqueObject, *args, **kwargs):
        return self.call_method(fn.__name__, fn, *args, **kwargs)

    return method
