"""Op plans: what it takes to issue an aten op again, cached by (op, argument metadata).

A training loop dispatches the same few hundred (op, argument metadata) pairs every step.
The first dispatch of a pair works out, in :mod:`tdmesh.engine.dispatch`, its output metadata
(propagation), which arguments it writes and which outputs alias which inputs; an
:class:`OpPlan` keeps all of it in terms of *slots* (the remote tensors of the call, in
argument order).  The workers get the op once, as a ``DefineOp`` template with ``Slot``s
where the tensors go.  Every later dispatch of the pair is one dict lookup, the placement
checks, the new proxies, and a ``CallOp`` of ints: the op's number, seq and refs.

Plans are the client's; op numbers are per client (:meth:`tdmesh.engine.client.Client.op_number`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..protocol import messages as m
from .issue import New
from .propagation import schema_arg
from .tensor import Tensor
from .wire import op_path, to_wire

__all__ = ["OpPlan", "NEW", "ARG", "VALUE", "PLANS", "make_plan", "outputs_of", "slot_spans"]

# kinds of output leaf
NEW, ARG, VALUE = 0, 1, 2

PLANS: dict = {}      # (func, argument key) -> OpPlan
MAX_PLANS = 100_000   # past this, ops are sent whole (CallFunction): a loop of ever-new values stays bounded


class OpPlan:
    """One (op, argument metadata) pair, ready to issue; hashed by identity (clients number it)."""
    __slots__ = ("func", "path", "args", "kwargs", "outputs", "mutated", "single", "spec", "restrides", "reusable",
                 "device_type", "lean")

    def __init__(self, func, path: str, args: tuple, kwargs: dict, outputs: tuple, mutated: tuple, single: bool,
                 spec: Any, restrides: tuple, reusable: bool) -> None:
        self.func = func
        self.path = path
        self.args = args            # the DefineOp template: wire-form arguments with Slots for the tensors
        self.kwargs = kwargs
        self.outputs = outputs      # per output leaf: (NEW, meta, aliased slot or -1) | (ARG, slot, 0) | (VALUE, v, 0)
        self.mutated = mutated      # the slots of the tensors the op writes
        self.single = single        # the op returns one tensor; else ``spec`` is its outputs' tree spec
        self.spec = spec
        self.restrides = restrides  # in-place view ops: (slot, new metadata) of each tensor whose shape changes
        self.reusable = reusable    # it can be kept and sent as a CallOp (every tensor a slot, no restride)
        self.device_type = ""       # the device its outputs' metadata is for (strides may differ by device)
        # the commonest op, one new tensor and nothing written: (its metadata, the slot it views or -1),
        # issued by issue.issue_lean; else None
        self.lean = (outputs[0][1], outputs[0][2]) if single and len(outputs) == 1 and outputs[0][0] == NEW and \
            not mutated and reusable else None


def slot_spans(func, args: tuple, kwargs: dict) -> dict[int, range]:
    """Schema argument position -> the slots of the remote tensors it holds (the order of
    ``dispatch._scan``: positional arguments, then keyword arguments as given)."""
    spans: dict[int, range] = {}
    n = 0
    for position, value in enumerate(args):
        count = _count(value)
        spans[position] = range(n, n + count)
        n += count
    if kwargs:
        names = [a.name for a in func._schema.arguments]
        for name, value in kwargs.items():
            count = _count(value)
            if name in names:
                spans[names.index(name)] = range(n, n + count)
            n += count
    return spans


def _count(obj) -> int:
    t = type(obj)
    if t is Tensor:
        return 1
    if t is tuple or t is list:
        return sum(_count(x) for x in obj)
    if t is dict:
        return sum(_count(x) for x in obj.values())
    return 0


def make_plan(func, args: tuple, kwargs: dict, out, aliasing, leaf_positions: list, n_remote: int) -> OpPlan:
    """The plan of one call: ``out`` is its propagation, ``leaf_positions`` the schema
    position each output leaf aliases (or None) and whether the op writes it."""
    spans = slot_spans(func, args, kwargs)

    def tensor_slot(position):
        """The slot of the argument at ``position`` when it is one remote tensor, else -1."""
        span = spans.get(position) if position is not None else None
        if span is None or len(span) != 1:
            return -1
        return span[0] if type(schema_arg(func, args, kwargs, position)) is Tensor else -1

    mutated = tuple(s for position in aliasing.mutated_args for s in spans.get(position, ()))
    outputs: list[tuple] = []
    restrides: list[tuple] = []
    for leaf, (position, is_write) in zip(out.leaves, leaf_positions):
        if type(leaf) is tuple and leaf and leaf[0] == "value":
            # None: an optional output the op did not produce (e.g. a grad).  A number beside
            # tensors (the max sequence lengths of _efficient_attention_forward) comes from
            # the shapes and arguments alone (a meta kernel has no data): the client has it.
            outputs.append((VALUE, leaf[1], 0))
            continue
        slot = tensor_slot(position)
        if is_write and slot >= 0:
            if _slot_meta(args, kwargs, slot) != leaf:
                if torch.Tag.inplace_view not in func.tags:
                    raise NotImplementedError(f"{func} changes the shape or strides of a remote tensor in place; "
                                              f"use its out-of-place form")
                restrides.append((slot, leaf))
            outputs.append((ARG, slot, 0))  # in-place / out=: the result is the argument itself
            continue
        outputs.append((NEW, leaf, slot))
    counter = [0]
    template = _template((to_wire(args), to_wire(kwargs) if kwargs else {}), counter)
    return OpPlan(func, op_path(func), template[0], template[1], tuple(outputs), mutated, out.single, out.spec,
                  tuple(restrides), counter[0] == n_remote and not restrides)


def _slot_meta(args, kwargs, slot: int):
    found: list = []

    def walk(obj):
        t = type(obj)
        if t is Tensor:
            found.append(obj)
        elif t is tuple or t is list:
            for x in obj:
                walk(x)
        elif t is dict:
            for x in obj.values():
                walk(x)
    walk(args)
    walk(kwargs)
    return found[slot]._meta


def _template(obj, counter: list):
    """Wire-form arguments with each ``Ref`` replaced by the next ``Slot``."""
    t = type(obj)
    if t is m.Ref:
        counter[0] += 1
        return m.Slot(counter[0] - 1)
    if t is tuple or t is list:
        return t(_template(x, counter) for x in obj)
    if t is dict:
        return {k: _template(v, counter) for k, v in obj.items()}
    return obj


def outputs_of(plan: OpPlan, remote: list) -> tuple[list, list]:
    """The plan's outputs as ``issue`` takes them (New, an input Tensor, or None), and the
    (position, value) of the Python values among them, for sending it whole."""
    outputs: list = []
    values: list = []
    for kind, value, slot in plan.outputs:
        if kind == NEW:
            outputs.append(New(value, remote[slot]._r.aliases if slot >= 0 else None))
        elif kind == ARG:
            outputs.append(remote[value])
        else:
            outputs.append(None)
            if value is not None:
                values.append((len(outputs) - 1, value))
    return outputs, values
