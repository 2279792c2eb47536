"""Defined ops: a DefineOp template compiled once into a function of its slot values.

The client sends each (aten op, argument metadata) pair once as a template, with ``Slot``s
where the tensors go; every later CallOp names it by number and carries only refs.  The
template becomes one line of generated Python (``fn(v[0], 2, [v[1], v[2]], **{...})``),
so a call does no walk over its arguments: the constants are bound at definition.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import ProtocolViolation
from ..protocol import messages as m
from .functions import resolve
from .values import DependentOnError, Poison


class DefinedOp:
    """One DefineOp on this worker: ``run(values)`` calls the op with ``values`` in its slots."""
    __slots__ = ("function", "fn", "args", "kwargs", "run", "slots", "grad")

    def __init__(self, msg: m.DefineOp, device: torch.device) -> None:
        self.function = msg.function
        self.grad = msg.grad
        self.args = on_device(msg.args, device)
        self.kwargs = on_device(msg.kwargs, device)
        self.fn: Callable | None = None
        consts: dict[str, Any] = {}
        slots: set[int] = set()

        def slot(position: int) -> str:
            slots.add(position)
            return f"v[{position}]"

        call = call_source("fn", self.args, self.kwargs, slot, consts)
        try:
            self.fn = resolve(msg.function)
            # an aten overload is called through its C++ operation: OpOverload.__call__ only forwards
            # to it, one Python frame (~0.5 us) per op on the worker's hot path
            consts["fn"] = self.fn._op if isinstance(self.fn, torch._ops.OpOverload) else self.fn
            schema = getattr(self.fn, "_schema", None)
            if device.type == "cuda" and getattr(schema, "name", None) in _ON_THE_DEFAULT_STREAM:
                # programs call ``fn`` too (and keep a plain function out of inductor graphs)
                self.fn = consts["fn"] = _on_the_default_stream(consts["fn"])
        except Exception as e:  # noqa: BLE001 - every call of the op fails with it, as CallFunction's would
            self.run: Callable[[list], Any] = _raiser(e)
        else:
            source = f"def run(v):\n    return {call}\n"
            exec(compile(source, f"<tdmesh op {msg.op}: {msg.function}>", "exec"), consts)  # noqa: S102
            self.run = consts["run"]
        self.slots = len(slots)


# ops whose CUDA kernels go wrong on a stream other than the default one: torch 2.11's linalg_eig, on
# one H200, gave other eigenvalues (no error) for a column-major input made on a side stream, and
# from then on for column-major inputs on any stream; on the default stream its results are local
# torch's.  A worker runs every op on its own streams.
_ON_THE_DEFAULT_STREAM = frozenset({"aten::linalg_eig", "aten::_linalg_eigvals"})


def _on_the_default_stream(fn: Callable) -> Callable:
    """``fn`` run on the device's default stream, ordered after the current stream's work and before
    its later work; its tensors are marked used by the current stream (they were allocated on the other)."""
    def run(*args, **kwargs):
        current, default = torch.cuda.current_stream(), torch.cuda.default_stream()
        if current == default:
            return fn(*args, **kwargs)
        default.wait_stream(current)
        with torch.cuda.stream(default):
            out = fn(*args, **kwargs)
        current.wait_stream(default)
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                t.record_stream(current)
        return out
    return run


def call_source(fn: str, args, kwargs: dict, slot: Callable[[int], str], consts: dict[str, Any]) -> str:
    """The Python expression ``fn(*args, **kwargs)`` of a template: ``slot(position)`` names the
    value of each Slot, every other leaf becomes a constant added to ``consts`` (its name is
    unique within ``consts``, so one namespace can hold the calls of many templates)."""
    def expr(obj) -> str:
        t = type(obj)
        if t is m.Slot:
            return slot(obj.position)
        if (t is tuple or t is list) and holds(obj, m.Slot):
            items = "".join(expr(x) + ", " for x in obj)
            return f"({items})" if t is tuple else f"[{items}]"
        if t is dict and holds(obj, m.Slot):
            return "{" + "".join(f"{k!r}: {expr(x)}, " for k, x in obj.items()) + "}"
        name = f"c{len(consts)}"
        consts[name] = obj
        return name

    positional = "".join(expr(a) + ", " for a in args)
    keywords = f"**{expr(kwargs)}" if kwargs else ""
    return f"{fn}({positional}{keywords})"


def on_device(obj, device: torch.device):
    """The template with its accelerator devices made this worker's ("cuda" means its own GPU;
    on a CPU worker, the CPU), as ``Interpreter._resolve`` does for CallFunction."""
    t = type(obj)
    if t is torch.device:
        return device if obj.type != "cpu" else obj
    if t is tuple or t is list:
        return t(on_device(x, device) for x in obj)
    if t is dict:
        return {k: on_device(x, device) for k, x in obj.items()}
    return obj


def holds(obj, kind: type) -> bool:
    """Whether ``obj`` is a ``kind`` or holds one in its tuples, lists and dicts."""
    if type(obj) is kind:
        return True
    if isinstance(obj, (tuple, list)):
        return any(holds(x, kind) for x in obj)
    if isinstance(obj, dict):
        return any(holds(x, kind) for x in obj.values())
    return False


def found(obj, kind: type, into: list) -> list:
    """Every ``kind`` in ``obj`` and its tuples, lists and dicts, in order, appended to ``into``."""
    if type(obj) is kind:
        into.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            found(x, kind, into)
    elif isinstance(obj, dict):
        for x in obj.values():
            found(x, kind, into)
    return into


def _raiser(error: Exception) -> Callable[[list], Any]:
    def run(values: list) -> Any:
        raise error
    return run


def slot_values(env: dict, refs: tuple, stream: int, rank: int) -> list:
    """The values of a CallOp's refs: a poisoned one raises DependentOnError (the op poisons
    its results without running), a missing one is a broken message."""
    try:
        values = [env[r] for r in refs]
    except KeyError:
        missing = next(r for r in refs if r not in env)
        raise ProtocolViolation(f"ref {missing} is not defined on stream {stream} of worker {rank}: "
                                f"it was deleted or never created") from None
    for value in values:
        if type(value) is Poison:
            raise DependentOnError(value)
    return values
