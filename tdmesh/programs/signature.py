"""Recording signatures: what ``tdmesh.compile(verify=True)`` compares between two traces."""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import torch

from ..engine.tensor import Tensor
from ..protocol import messages as m


def signature(messages, kept=()) -> list:
    """A recording's ``(ranks, message, uses, defs)`` list as :func:`signature_names` numbers it."""
    return signature_names(messages, kept)[0]


def signature_names(messages, kept=(), aliases: bool = True) -> tuple[list, dict[int, int]]:
    """A recording's ``(ranks, message, uses, defs)`` list with its refs, borrow ids and seqs
    numbered by first appearance (the ref fields are those of ``messages.REF_FIELDS``): two
    traces that send the same operations have equal signatures.  ``kept``: the refs a trace
    leaves as state, whose places among its refs are part of the signature.  Also returns the
    numbering (ref -> number): equal signatures number corresponding refs alike.  Without
    ``aliases`` an op's ``mutates`` are left out: they name every live alias of what it writes
    (the client's bookkeeping, which depends on what else is alive), not what the op does."""
    names: dict[int, int] = {}
    counter = itertools.count()

    def ref(r):
        return None if r is None else names.setdefault(r, next(counter))

    def norm(x):
        t = type(x)
        if t is m.Ref:
            return ("ref", ref(x.id))
        if t is tuple or t is list:
            return tuple(norm(y) for y in x)
        if t is dict:
            return tuple((k, norm(v)) for k, v in x.items())
        if t is bytes:  # sealed arguments of a user function
            return norm(pickle.loads(x))
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), str(x.dtype))
        if t is m.PackedTensor:  # a local tensor shipped by the function: its bytes are part of the op
            data = x.data.raw() if isinstance(x.data, pickle.PickleBuffer) else memoryview(x.data)
            return ("packed", x.dtype, tuple(x.shape), bytes(data))
        return x

    rows = []
    for ranks, msg, _, _ in messages:
        msg_: Any = msg
        kinds = m.REF_FIELDS.get(type(msg), {})
        row: list = [ranks, type(msg).__name__]
        for field, value in zip(msg_._fields, msg_):
            kind = kinds.get(field)
            if field == "seq" or (field == "mutates" and not aliases):
                continue
            if kind in ("def", "use", "borrow"):
                row.append(ref(value))
            elif kind in ("defs", "uses"):
                row.append(tuple(ref(r) for r in value))
            elif field == "function":  # an import path, or a pickled callable: compared as it is
                row.append(value)
            else:
                row.append(norm(value))
        rows.append(tuple(row))
    if kept:
        rows.append(("kept", tuple(ref(r) for r in kept)))
    return rows, names



def first_difference(mine: list, theirs: list) -> int | None:
    """The index of the first operation where two signatures differ (None: they are equal)."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return i
    return None if len(mine) == len(theirs) else min(len(mine), len(theirs))


def tensors_key(args: tuple) -> tuple | None:
    """The recording key of a call whose arguments are all tdmesh tensors (None otherwise):
    what ``call_key`` would distinguish, and whether grad must be refused (then the slow path
    raises).  Read with torch functions off: under a mesh, ``requires_grad`` would go
    through the mesh's TorchFunctionMode (1 us a tensor)."""
    if not args:
        return None
    aliases: dict[int, int] = {}
    parts: list = ["tensors"]
    with torch._C.DisableTorchFunction():
        for x in args:
            if type(x) is not Tensor:
                return None
            grad = x.requires_grad and torch.is_grad_enabled()
            parts.append((x._meta, id(x._mesh), x._stream.id, grad,
                          aliases.setdefault(id(x._r.aliases), len(aliases))))
    return tuple(parts)


def call_key(spec, flat) -> tuple:
    aliases: dict[int, int] = {}
    parts: list = []
    for x in flat:
        if type(x) is Tensor:
            parts.append(("T", x._meta, id(x.mesh), x.stream.id, x.requires_grad,
                          aliases.setdefault(id(x._r.aliases), len(aliases))))
        else:
            try:
                hash(x)
                parts.append(x)
            except TypeError:
                parts.append(("unhashable", id(x)))
    return (spec, tuple(parts))
