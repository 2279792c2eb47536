"""Compiled functions as programs: a recording turned into one generated function per rank.

Replaying a recording message by message renames every ref of every message, queues each
message on its stream and looks each ref up in the stream's table.  A program does that work
once, at its first call: each ref of the recording becomes a local variable of one generated
Python function, defined ops and aten calls become calls with their constants bound,
collectives become calls on the local tensors, temporaries never enter the ref table, and
only the inputs (formals, captures) are read from it and the results written to it.  A call
runs the whole function as one item of its stream.

Failures keep the message-by-message semantics exactly: a call with a poisoned (or missing)
input runs message by message from the start; an op that raises fails its own results
(reported against the call's seq) and the rest of the call continues message by message
from the locals of that moment, so independent work still runs and every rank runs the same
collectives in the same order.  A recording a program cannot express (borrows, moves between
meshes, several streams, sealed user-function arguments, process-group arguments) is always
replayed message by message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..errors import ProtocolViolation
from ..protocol import messages as m
from ..protocol.arguments import SHIPPED_FUNCTION
from . import collectives
from .functions import resolve
from .inductor import CompiledGraph, GraphBuilder, graphable
from .ops import call_source, found, holds, on_device
from .values import Poison

_PLAIN = (m.CallOp, m.CallFunction, m.Reduce, m.ReduceMany)


class Unsupported(Exception):
    """The recording is replayed message by message; the text says why (for tests and logs)."""


def _one(value):
    if isinstance(value, torch.Tensor):
        return value
    return _many(value, 1)[0]


def _many(value, n: int) -> list:
    if type(value) in (tuple, list) and len(value) == n and all(isinstance(v, torch.Tensor) for v in value):
        return value  # an op's tuple of tensors: what tree_leaves would return, without its walk
    leaves = tree_leaves(value)
    if len(leaves) != n:
        raise TypeError(f"function returned {len(leaves)} values where the client expected {n}")
    return leaves


def _stream_of(c) -> int | None:
    t = type(c)
    if t is m.DeleteRefs:
        return None
    if t not in _PLAIN:
        raise Unsupported(f"{t.__name__} in the recording")
    return c[5] if t is m.CallOp else c.stream


class Program:
    """One recording of this rank as a generated function ``run(env, actuals, results) -> bool``
    (False: an input is poisoned, nothing ran)."""

    def __init__(self, rec, interp, inductor: bool = False) -> None:
        self.recording = rec.id
        self.interp = interp
        self.inductor = inductor
        self.mode = "inductor" if inductor else "program"
        self.options: dict = rec.options  # inductor's config options (tdmesh.compile(options=))
        self.graphs = 0  # (inductor) its graphs, and the aten ops left between them: what inductor did not fuse
        self.outside: dict[str, int] = {}
        streams = {s for s in (_stream_of(c) for c in rec.commands) if s is not None}
        if len(streams) != 1:
            raise Unsupported(f"the recording uses {len(streams)} streams")
        self.stream: int = streams.pop()
        self._formals = {r: i for i, r in enumerate(rec.formals)}
        self._names: dict[int, str] = {}
        self._loads: list[str] = []       # first lines: read the inputs from the ref table
        self._inputs: list[str] = []
        self._input_refs: set[int] = set()
        self._deleted: set[int] = set()
        self._internal: set[int] = set()  # (inductor) refs that live and die inside one graph
        self.consts: dict[str, Any] = {"P": Poison, "one": _one, "many": _many, "interp": interp,
                                       "reduce": collectives.reduce, "reduce_many": collectives.reduce_many}
        body: list[str] = []
        self.step_of_line: dict[int, int] = {}
        self.defined_before: list[list[tuple[int, str]]] = []  # per step: (ref, local) defined by earlier steps
        self.mutated: list[int] = []  # every ref the recording writes in place
        self._commands = rec.commands  # to name the step where a run failed
        defined: list[tuple[int, str]] = []
        graph: GraphBuilder | None = None  # (inductor) the graph of the aten steps since the last other step
        held: list[str] = []  # frees of refs a pending graph may still read: after its call
        last_read = _last_reads(rec.commands, interp) if inductor else {}
        needed = set(rec.results) | set(self._formals)

        def emit(lines: list[str], index: int) -> None:
            for line in lines:
                body.append(line)
                self.step_of_line[len(body) + 1] = index  # source line: "def body" is line 1

        for index, c in enumerate(rec.commands):
            self.defined_before.append(list(defined))
            if inductor:
                op = interp.ops.get(c[1]) if type(c) is m.CallOp else None
                if op is not None and op.fn is not None and op.slots == len(c[4]) and graphable(op, len(c[2])):
                    if graph is None:
                        graph = GraphBuilder(self._use)
                    graph.add(index, op, c[4], c[2])
                    self.mutated.extend(c[3])
                    continue
                if op is not None and op.fn is not None:
                    name = str(op.fn)
                    self.outside[name] = self.outside.get(name, 0) + 1
                if type(c) is m.DeleteRefs and graph is not None:
                    held.extend(self._delete(c.refs, pending=graph.nodes))
                    continue
                if graph is not None:
                    emit(self._graph_call(graph, last_read, needed, defined), graph.steps[0])
                    emit(held, index)
                    graph, held = None, []
            emit(self._step(c, index, interp), index)
            if type(c) is not m.DeleteRefs:
                results, mutates, _ = _failure_targets(c, interp)
                defined.extend((ref, self._names[ref]) for ref in results if ref is not None)
                self.mutated.extend(mutates)
        if graph is not None:
            emit(self._graph_call(graph, last_read, needed, defined), graph.steps[0])
            emit(held, len(rec.commands) - 1)
        outs: list[str] = []
        ends: list[str] = []
        for i, ref in enumerate(rec.results):
            if ref not in self._names or all(r != ref for r, _ in defined):
                raise Unsupported(f"result ref {ref} is not defined by the recording")
            ends.append(f"env[R[{i}]] = o[{len(outs)}]")
            outs.append(self._names[ref])
        for ref in dict.fromkeys(r for r, _ in defined):
            if ref in self._formals:  # an input rebound inside: the call's actual ref sees it
                ends.append(f"env[A[{self._formals[ref]}]] = o[{len(outs)}]")
                outs.append(self._names[ref])
        inputs = ", ".join(self._inputs)
        # body(inputs) -> outputs is the straight-line code (what inductor compiles); program reads
        # the inputs from the ref table, checks them, and writes the outputs back
        lines = [f"def body({inputs}):", *body, "return (" + "".join(f"{o}, " for o in outs) + ")", "",
                 "def program(env, A, R):", *self._loads]
        if self._inputs:
            lines.append("if " + " or ".join(f"type({v}) is P" for v in self._inputs) + ": return False")
        self.body_line = len(lines) + 1
        lines += [f"o = body({inputs})", *ends, "return True"]
        source = "".join((ln if ln.startswith("def ") or not ln else "    " + ln) + "\n" for ln in lines)
        self.source = source
        exec(compile(source, f"<tdmesh program {rec.id}>", "exec"), self.consts)  # noqa: S102
        self.run: Callable[[dict, tuple, tuple], bool] = self.consts["program"]
        self.code = self.consts["body"].__code__
        self.capture_refs = [r for r in self._input_refs if r not in self._formals]
        self.result_count = len(rec.results)

    # -- building --------------------------------------------------------------------------
    def _use(self, ref: int) -> str:
        if ref in self._deleted:
            raise Unsupported(f"ref {ref} is used after the recording deletes it")
        name = self._names.get(ref)
        if name is None:
            name = self._names[ref] = f"v{len(self._names)}"
            source = f"A[{self._formals[ref]}]" if ref in self._formals else str(ref)
            self._loads.append(f"{name} = env[{source}]")
            self._inputs.append(name)
            self._input_refs.add(ref)
        return name

    def _define(self, ref: int | None) -> str:
        if ref is None:
            return "_"
        if ref in self._input_refs and ref not in self._formals:
            raise Unsupported(f"the recording reads captured ref {ref} and then defines it")
        self._deleted.discard(ref)
        name = self._names.get(ref)
        if name is None:
            name = self._names[ref] = f"v{len(self._names)}"
        return name

    def _bind(self, results: tuple, call: str) -> list[str]:
        if not results:
            return [call]
        if len(results) == 1:
            return [f"{self._define(results[0])} = one({call})"]
        targets = ", ".join(self._define(r) for r in results)
        return [f"{targets}, = many({call}, {len(results)})"]

    @staticmethod
    def _callable(fn):
        """An aten OpOverload's C++ callable (its ``__call__`` is one Python frame around it: 0.15 us an op)."""
        return fn._op if isinstance(fn, torch._ops.OpOverload) else fn

    def _graph_call(self, graph: GraphBuilder, last_read: dict[int, int], needed: set[int],
                    defined: list[tuple[int, str]]) -> list[str]:
        """(inductor) The line that calls ``graph``: it returns what a later step, the results or the
        call's inputs read of what it defines; the rest lives and dies inside it."""
        end = graph.steps[-1]
        outputs = [r for r in dict.fromkeys(graph.defined) if last_read.get(r, -1) > end or r in needed]
        self._internal.update(r for r in graph.defined if r not in outputs)
        compiled = self._const(CompiledGraph(graph.finish(outputs), self.options))
        self.graphs += 1
        call = f"{compiled}({''.join(n + ', ' for n in graph.input_names)})"
        if not outputs:
            return [call]
        names = [self._define(r) for r in outputs]
        defined.extend(zip(outputs, names))
        return ["".join(n + ", " for n in names) + "= " + call]

    def _delete(self, refs, pending: dict | None = None) -> list[str]:
        """The lines that free ``refs`` (none for a ref that lives inside a graph, or a pending one's)."""
        lines = []
        for r in refs:
            inside = r in self._internal or (pending is not None and r in pending and r not in self._input_refs)
            if not inside and (r not in self._names or r in self._input_refs):
                raise Unsupported(f"the recording deletes ref {r}, which it did not define")
            if not inside:
                lines.append(f"{self._names[r]} = None")
            self._deleted.add(r)
        return lines

    def _const(self, value) -> str:
        name = f"k{len(self.consts)}"
        self.consts[name] = value
        return name

    def _step(self, c, index: int, interp) -> list[str]:
        t = type(c)
        if t is m.CallOp:
            _, op_id, results, mutates, refs, _ = c
            op = interp.ops.get(op_id)
            if op is None or op.fn is None or op.slots != len(refs):
                raise Unsupported(f"op {op_id} is not defined (or does not resolve) on this worker")
            for r in mutates:
                self._use(r)
            names = [self._use(r) for r in refs]
            call = call_source(self._const(self._callable(op.fn)), op.args, op.kwargs, names.__getitem__, self.consts)
            return self._bind(results, call)
        if t is m.CallFunction:
            if type(c.args) is bytes or c.process_groups:
                raise Unsupported("a user function's sealed arguments (or process groups) in the recording")
            try:
                fn = resolve(c.function)
            except Exception as e:  # noqa: BLE001 - replayed message by message, which reports it
                raise Unsupported(f"function {c.function!r} does not resolve: {e}") from None
            slotted: list[int] = []
            args = on_device(_slotted(c.args, slotted), interp.device)
            kwargs = on_device(_slotted(c.kwargs, slotted), interp.device)
            if c.function == SHIPPED_FUNCTION and not slotted:  # a client's local tensor, the same bytes every
                # call: made on the device once, copied there each call (fresh, as eager's; a CUDA graph
                # cannot capture a host-to-device copy from pageable memory)
                try:
                    made = fn(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - replayed message by message, which reports it
                    raise Unsupported(f"a local tensor could not be made on this worker: {e}") from None
                return self._bind(c.results, f"{self._const(made)}.clone()")
            for r in c.mutates:
                self._use(r)
            names = [self._use(r) for r in slotted]
            return self._bind(c.results, call_source(self._const(self._callable(fn)), args, kwargs, names.__getitem__,
                                                     self.consts))
        if t is m.Reduce:
            scratch = ", ".join(f"{r}: {self._use(r)}" for r in (c.tensor, c.out) if r is not None)
            lines = [f"s = {{{scratch}}}", f"reduce(interp, {self._const(c)}, s)"]
            if c.result is not None:
                lines.append(f"{self._define(c.result)} = s[{c.result}]")
            return ["; ".join(lines)]
        if t is m.ReduceMany:
            scratch = ", ".join(f"{r}: {self._use(r)}" for r in c.tensors)
            return [f"reduce_many(interp, {self._const(c)}, {{{scratch}}})"]
        if t is m.DeleteRefs:
            return ["; ".join(self._delete(c.refs)) or "pass"]
        raise Unsupported(f"{t.__name__} in the recording")

    # -- running -----------------------------------------------------------------------------
    def call(self, call: m.CallRecording, stream) -> None:
        """Run one call on its stream (the stream thread's work item), with no autograd graph recorded."""
        interp = self.interp
        interp.last_op.note(call.seq)
        torch._C._set_grad_enabled(False)
        env = stream.env
        try:
            if self.run(env, call.actuals, call.results):
                return
            failed: int | None = None
            error: BaseException | None = None
            state: dict = {}
        except ProtocolViolation:
            raise  # a broken message (an unknown group, ...): the worker stops, as message by message
        except Exception as e:  # noqa: BLE001 - the op's own failure: reported as its message would be
            if self.inductor and self._in_body(e):
                return self._fail_whole(call, env, e)
            failed, error, state = self._where(e)
        commands, temporaries, names = interp.recordings.expand(call)
        start = 0
        if failed is not None:
            for ref, local in self.defined_before[failed]:
                value = state.get(local)
                if value is not None:
                    env[names.get(ref, ref)] = value
            c = commands[failed]
            results, mutates, function = _failure_targets(c, interp)
            interp.fail(env, call.seq, results, mutates, error, function)
            start = failed + 1
        for c in commands[start:]:
            interp.stream_work(c, stream)
        for ref in temporaries:
            env.pop(ref, None)

    def _in_body(self, error: BaseException) -> bool:
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code is not self.run.__code__:
            tb = tb.tb_next
        return tb is not None and tb.tb_lineno == self.body_line

    def _fail_whole(self, call: m.CallRecording, env: dict, error: BaseException) -> None:
        """A compiled (fused) body fails as one op: every result and everything it writes."""
        _, _, names = self.interp.recordings.expand(call)
        mutated = tuple(dict.fromkeys(names.get(r, r) for r in self.mutated))
        self.interp.fail(env, call.seq, call.results, mutated, error, "a compiled function (inductor)")

    def failed_step(self, error: BaseException) -> str:
        """Which step of the recording raised ``error`` (its op or function), for a log line."""
        step = self._where(error)[0]
        name = None if step is None else _failure_targets(self._commands[step], self.interp)[2]
        return "" if step is None else f" (step {step} of the recording: {name})"

    def _where(self, error: BaseException) -> tuple[int | None, BaseException | None, dict]:
        """The step that raised ``error`` and the program's locals then (None: reading an input)."""
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code is not self.code:
            tb = tb.tb_next
        if tb is None:
            return None, None, {}
        step = self.step_of_line.get(tb.tb_lineno)
        if step is None:
            return None, None, {}
        return step, error, dict(tb.tb_frame.f_locals)


def _last_reads(commands, interp) -> dict[int, int]:
    """Each ref's last reading step (an op's tensors and what it writes, a collective's tensors)."""
    last: dict[int, int] = {}
    for index, c in enumerate(commands):
        t = type(c)
        if t is m.CallOp:
            read = (*c[4], *c[3])
        elif t is m.CallFunction:
            read = (*(ref.id for ref in found((c.args, c.kwargs), m.Ref, [])), *c.mutates)
        elif t is m.Reduce:
            read = tuple(r for r in (c.tensor, c.out) if r is not None)
        elif t is m.ReduceMany:
            read = tuple(c.tensors)
        else:
            continue
        for r in read:
            last[r] = index
    return last


def _failure_targets(c, interp) -> tuple[tuple, tuple, Any]:
    """(results, mutates, function) that fail when renamed message ``c`` raises."""
    t = type(c)
    if t is m.CallOp:
        op = interp.ops.get(c[1])
        return c[2], c[3], op.function if op is not None else "op"
    if t is m.CallFunction:
        return c.results, c.mutates, c.function
    if t is m.Reduce:
        return (c.result,) if c.result is not None else (), (c.out,) if c.out is not None else (), "reduce"
    return (), c.tensors, "reduce"


def _slotted(obj, refs: list[int]):
    """A CallFunction's arguments as a template: each Ref a Slot (its ref appended to ``refs``);
    anything a template cannot hold raises Unsupported."""
    t = type(obj)
    if t is m.Ref:
        refs.append(obj.id)
        return m.Slot(len(refs) - 1)
    if t is tuple or t is list:
        return t(_slotted(x, refs) for x in obj)
    if t is dict:
        return {k: _slotted(v, refs) for k, v in obj.items()}
    if t in (m.MeshArg, m.ProcessGroupArg, m.TorchMeshArg) or (isinstance(obj, tuple) and holds(obj, m.Ref)):
        raise Unsupported(f"a {t.__name__} argument in the recording")
    return obj
