"""Objects that live on the workers: ``mesh.spawn(cls, ...)`` and the handle it returns.

A data loader, a tokenizer or a model kept per rank is a value in each worker's ref table,
like a tensor but never sent anywhere: one ``CallFunction`` constructs it on every rank of
the mesh, in order with the tensor ops of the stream it was spawned on, and its handle's
ref is freed (``DeleteRefs``) when the handle dies.  Methods run as remote functions whose
first argument is the object: ``handle.call`` fetches what they return from every rank,
``handle.remote(name, propagate=...)`` makes their tensors mesh tensors.  A method that
raises fails its own call (a RemoteException with both tracebacks), never the object: only a
failed construction poisons it, and then every later call reports that failure.
"""

from __future__ import annotations

from torch.utils._pytree import tree_flatten

from .engine.fetch import prepare_call, send_value, shard_rank
from .engine.future import Future
from .engine.issue import issue
from .engine.settle import pending, settle
from .engine.stream import get_active_stream
from .engine.tensor import AliasSet, RefOwner, Tensor
from .engine.wire import sealed_args
from .errors import UsageError, user_line
from .protocol import messages as m
from .remote import Remote, call_remote, function_path

__all__ = ["ObjectHandle", "ObjectMethod", "spawn"]

_CONSTRUCT = "tdmesh.worker.objects.construct"
_CALL_METHOD = "tdmesh.worker.objects.call_method"


class ObjectHandle:
    """One instance of ``cls`` on every rank of ``mesh``, reached through its methods."""

    def __init__(self, ref: RefOwner, mesh, stream, cls_name: str) -> None:
        self._r = ref
        self.mesh = mesh
        self.stream = stream
        self.cls_name = cls_name

    @property
    def ref(self) -> int:
        return self._r.id

    @property
    def owner(self) -> RefOwner:
        """What deletes the objects on the workers when the last handle holding it dies."""
        return self._r

    @property
    def _tdmesh_object_ref(self) -> int:  # read by fetch.prepare_call: a call passing this object uses it
        return self._r.id

    def _tdmesh_wire(self):  # an argument: each worker substitutes its own instance
        return m.Ref(self._r.id)

    def call(self, name: str, *args, **kwargs) -> Future:
        """Run method ``name`` on every rank: a Future of the ValueMesh of its (picklable) results."""
        with self._placed(args, kwargs):
            return send_value(self.mesh, _CALL_METHOD, (self, name, *args), kwargs, None)

    def call_one(self, name: str, *args, shard: dict | None = None, **kwargs) -> Future:
        """Run method ``name`` on one rank (``shard``: every dim named; None: the first rank)."""
        with self._placed(args, kwargs):
            return send_value(self.mesh, _CALL_METHOD, (self, name, *args), kwargs,
                              shard_rank(self.mesh, shard, {}))

    def remote(self, name: str, propagate=None) -> ObjectMethod:
        """Method ``name`` as a remote function: calling it returns mesh tensors, described by
        ``propagate`` as for ``tdmesh.remote`` (a callable taking the method's arguments,
        "inspect", or None/"cached", which runs the method once more on the first rank)."""
        return ObjectMethod(self, name, propagate)

    def _placed(self, args, kwargs):
        """Checks that the call's tensors live where the object does; runs it on the object's stream."""
        for x in tree_flatten((args, kwargs))[0]:
            if type(x) is Tensor and (x.mesh is not self.mesh or x.stream is not self.stream):
                raise UsageError(f"a method of {self!r} got tensor {x.ref} of {x.mesh.shape} on {x.stream!r}; "
                                 f"an object's methods take tensors of its mesh and stream\n  at {user_line()}")
        return self.stream.activate()  # activates now; the with block restores the previous stream

    def __repr__(self) -> str:
        return f"<tdmesh object {self.cls_name} (ref {self._r.id}) on {self.mesh.shape}>"


class ObjectMethod:
    """``handle.remote(name)``: calling it runs the method on every rank of the object's mesh."""

    def __init__(self, handle: ObjectHandle, name: str, propagate) -> None:
        if callable(propagate):
            user = propagate
            propagate = lambda _obj, _name, *args, **kwargs: user(*args, **kwargs)  # noqa: E731
        self.handle = handle
        self.name = name
        self._remote = Remote(_CALL_METHOD, propagate)
        self._remote.__name__ = f"{handle.cls_name}.{name}"

    @property
    def cache_hits(self) -> int:
        return self._remote.cache_hits

    def __call__(self, *args, **kwargs):
        with self.handle._placed(args, kwargs):
            return call_remote(self._remote, (self.handle, self.name, *args), kwargs, mesh=self.handle.mesh)

    def __repr__(self) -> str:
        return f"<tdmesh method {self._remote.__name__} of {self.handle!r}>"


def spawn(mesh, cls, *args, **kwargs) -> ObjectHandle:
    """``mesh.spawn(cls, *args, **kwargs)``: construct ``cls(*args, **kwargs)`` on every rank."""
    if pending:  # a fault-tolerant step not yet confirmed: settled first (engine/settle.py)
        settle()
    client = mesh.client
    if client.sink is not client:
        raise UsageError(f"mesh.spawn inside tdmesh.compile: objects are made once, spawn them before the "
                         f"compiled function\n  at {user_line()}")
    if not callable(cls) and not (isinstance(cls, str) and "." in cls):
        raise TypeError(f"mesh.spawn needs a class (or a callable that builds the object, or its import path), got "
                        f"{cls!r}\n  at {user_line()}")
    target = function_path(cls)  # an import path, or the class pickled by value (one of __main__)
    stream = get_active_stream()
    flat = tree_flatten((args, kwargs))[0]
    inputs, groups, objects = prepare_call(flat, mesh, stream)
    sealed = sealed_args((target, args, kwargs), {})
    with client.lock:
        ref = client.new_ref()
        owner = RefOwner(ref, mesh, AliasSet())
        issue(mesh, lambda seq, results, mutated: m.CallFunction(seq, (ref,), (), _CONSTRUCT, sealed, {}, stream.id,
                                                                  groups),
              inputs=inputs, stream=stream, uses=objects, defs=(ref,))
    return ObjectHandle(owner, mesh, stream, getattr(cls, "__qualname__", repr(cls)))

