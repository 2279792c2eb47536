"""Host reads: Python values the client needs now (``.item()``, ``bool()``, ``float()``,
``.tolist()``, ``torch.equal``, ``f"{loss:.4f}"``).

The client is one program for every rank, so a branch on a value takes one path for all of
them.  A host read therefore reads **every rank of the mesh** (one round trip, as eager
torch's sync; the relays carry the answers) and returns the value only when all ranks agree.
Where they differ it raises a ``ValueError`` that lists each rank's value and the ways out
(reduce first, or ``fetch_shard`` for one rank): returning one rank's value would take a
branch that the other ranks' data does not take, silently.  Data-dependent shapes follow the
same rule (``tdmesh.engine.unshaped``).
"""

from __future__ import annotations

import math

from ..errors import user_line
from .coalescing import check_not_coalescing
from .fetch import send_value
from .tensor import Tensor, describe

__all__ = ["read_on_host", "agreed", "read_name", "same_value"]

# How messages name a host read, by a part of its op or builtin's path
_READ_NAMES = {"_local_scalar_dense": ".item() (or float(), int(), bool())", "aten::item": ".item()",
               "is_nonzero": "bool()", "equal": "torch.equal", "values_of": ".tolist()",
               "describe": "an op whose output shape only the data decides"}


def read_name(path: str) -> str:
    """The name a user knows a host read by (``.item()``, ``bool()`` ...), from its path."""
    return next((name for part, name in _READ_NAMES.items() if part in path), path)


def same_value(a, b) -> bool:
    """Equal as the host sees values: NaN reads the same as NaN."""
    if a == b:
        return True
    if isinstance(a, float) and isinstance(b, float):
        return math.isnan(a) and math.isnan(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return False


def agreed(per_rank, what: str, mesh) -> object:
    """The one value every rank of ``per_rank`` (a ValueMesh) read, or a ValueError naming
    each rank's value and the ways out."""
    values = list(per_rank)
    first = values[0][1]
    if all(same_value(v, first) for _, v in values[1:]):
        return first
    listed = "\n".join(f"  {point}: {_short(v)}" for point, v in values)
    raise ValueError(f"{what} reads a value on the host, and the ranks of {mesh.shape} disagree on it:\n{listed}\n"
                     f"the client is one program for every rank, so it cannot take one branch for all of them: "
                     f"reduce the tensor over the mesh first (t.reduce(mesh.names, 'avg')), or read one rank's "
                     f"value with tdmesh.fetch_shard(t, **coords).result()\n  at {user_line()}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + " ..."


def read_on_host(mesh, function, args, kwargs, what: str, *, uses: tuple = (), agree=None, guard: bool = True):
    """``function(*args, **kwargs)`` on every rank of ``mesh``: its value where all agree
    (``agree(per_rank)`` decides where given, else :func:`agreed`).  Inside a compiled
    function's trace the sink is told of the read (``note_read``), and of its value
    (``read_done``: None with ``ok=False`` when it failed), so that it can be a guard (not with
    ``guard=False``: then the trace runs eagerly from the read)."""
    check_not_coalescing(f"{what} (it needs a value from the workers)")
    if agree is None:
        def agree(per_rank):
            return agreed(per_rank, what, mesh)
    sink = mesh.client.sink
    note = getattr(sink, "note_read", None) if guard else None
    if note is None:
        return agree(send_value(mesh, function, args, kwargs, None, uses=uses).result())
    note(mesh, function, args, kwargs, what, agree)
    ok = False
    value = None
    try:
        value = agree(send_value(mesh, function, args, kwargs, None, uses=uses).result())
        ok = True
    finally:
        sink.read_done(value, ok)
    return value


def _tolist(self):
    """``t.tolist()``: the values of every rank, which must agree (see the module docstring)."""
    return read_on_host(self._mesh, "tdmesh.worker.builtins.values_of", (self,), {}, f"{describe(self)}.tolist()")


def _numpy(self, *, force: bool = False):
    raise TypeError(f"{describe(self)}.numpy(): a tdmesh tensor's data lives on the workers, one value per rank; "
                    f"fetch one rank's value with tdmesh.fetch_shard(t, **coords).result().numpy(), or every "
                    f"rank's with tdmesh.fetch_all(t) (a ValueMesh: .to_numpy())\n  at {user_line()}")


def _format(self, spec: str) -> str:
    """``f"{loss:.4f}"`` formats the value, as for a local 0-d tensor; other tensors format as
    their repr (a non-empty spec is a TypeError, as for a local tensor of several values)."""
    if self.dim() == 0:
        return format(self.item(), spec)
    return object.__format__(self, spec)


Tensor.tolist = _tolist  # type: ignore[method-assign]
Tensor.numpy = _numpy  # type: ignore[method-assign]
Tensor.__format__ = _format  # type: ignore[method-assign]
