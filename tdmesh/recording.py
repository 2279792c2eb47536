"""``@tdmesh.compile``: record a function's messages on the workers once, replay them after.

The first call traces the function: its messages are captured instead of sent, and defined
on each rank as a recording (in chunks).  Every later call with the same kind of inputs
(tree structure, non-tensor values, tensor metadata, aliasing, mesh, stream) sends one
``CallRecording`` per rank, however many ops the function has.  Tensors the function only
captures from outside are read where they are; tensors it creates and does not return are
dropped.  ``verify=True`` traces the first reuse again and raises if the messages differ.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import messages as m
from ._context import active_mesh_or_none
from .capture import recording_mode
from .errors import UsageError, call_site, user_line
from .issue import New, issue, issue_call
from .placement import check_inputs, check_no_grad
from .propagation import SparseMeta
from .signature import first_difference, signature
from .stream import get_active_stream
from .tensor import Tensor, raise_in_op

__all__ = ["compile"]

_recording_ids = itertools.count(1)


class Recorder:
    """The client's sink while a compiled function is traced: keeps the messages that would
    have been sent (per rank), the proxies made, and every tensor an op read."""

    def __init__(self, client) -> None:
        self.client = client
        self.messages: list[tuple[tuple, object, list, list]] = []
        self.created: list = []  # weakrefs to the RefOwners made while tracing
        self.devices: set[str] = set()  # the device types of the tensors it made
        self.first_ref = client.next_ref  # refs from here on are made by the trace
        self.seen: dict[int, Tensor] = {}  # every tensor an op read while tracing, by ref

    def submit(self, ranks, msg, seq=None, uses=(), defs=(), future=None, inputs=(), deletes_first=False,
               outputs=(), site=None) -> None:
        if type(msg) in (m.SendValue, m.RequestStatus):
            raise NotImplementedError("NYI: fetching values inside a compiled function; return the tensor and "
                                      "fetch it after the call")
        for t in inputs:
            self.seen[t.ref] = t
        self.created.extend(weakref.ref(t._r) for t in outputs)
        self.devices.update(t.device.type for t in outputs)
        self.messages.append((tuple(ranks), msg, list(uses), list(defs)))


class _Compiled:
    def __init__(self, fn, verify: bool, backend: str, cuda_graph: bool | None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"tdmesh.compile: unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
        if backend == "messages" and cuda_graph:
            raise ValueError("tdmesh.compile: cuda_graph=True needs backend='program' (a graph captures a program)")
        self.fn = fn
        self.verify = verify
        self.backend = backend
        self.cuda_graph = cuda_graph
        self.warned = False  # the reason a recording is not a CUDA graph is said once
        self.last: _Recording | None = None
        self.recordings: dict = {}
        self.traces = 0
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        key = None if kwargs else _tensors_key(args)
        if key is not None:  # the common call, f(tensor, ...): no tree walk, no per-input checks
            rec = self.recordings.get(key)
            if rec is not None and rec.verified and type(rec.client.sink) is not Recorder and rec.fresh():
                return rec.replay(args[0].mesh, args)
        flat, spec = tree_flatten((args, kwargs))
        inputs = [x for x in flat if type(x) is Tensor]
        mesh = inputs[0].mesh if inputs else active_mesh_or_none()
        if mesh is None or mesh.client is None:
            raise ValueError("a compiled function runs on a mesh: call it under `with mesh.activate():`")
        client = mesh.client
        if type(client.sink) is Recorder:  # compile inside compile: just run it
            return self.fn(*args, **kwargs)
        for t in inputs:
            check_no_grad(t, "tdmesh.compile (it does not record autograd)")
        if key is None:
            key = _key(spec, flat)
        rec = self.recordings.get(key)
        if rec is not None and not rec.fresh():  # a captured tensor changed shape since the trace: trace again
            rec = None
        if rec is None:
            rec, outputs = self._trace(client, args, kwargs, inputs)
            mode = recording_mode(self.backend, self.cuda_graph, mesh, rec, inputs, self)
            rec.verified = not self.verify
            self.recordings[key] = rec
            rec.mode = mode
            self.last = rec
            rec.define(client, mode)
            rec.call(mesh, inputs)
            return outputs
        if self.verify and not rec.verified:
            again, outputs = self._trace(client, args, kwargs, inputs)
            at = rec.diverges_from(again)
            if at is not None:
                raise UsageError(f"tdmesh.compile failed to verify recording. Recording diverges at operation "
                                   f"{at}: the function does not send the same operations on every call "
                                   f"(a data- or Python-dependent branch?)\n  at {user_line()}")
            rec.verified = True
            rec.call(mesh, inputs, again)
            return outputs
        return rec.replay(mesh, inputs)

    @property
    def recording_id(self) -> int | None:
        """The workers' id of the latest trace's recording (``tdmesh.worker.builtins.recording_modes``
        says, per id, how a worker runs it)."""
        return self.last.id if self.last is not None else None

    @property
    def mode(self) -> str | None:
        """How the client asked the workers to run the latest trace: "cuda_graph" (or
        "cuda_graph_required"), "program" or "messages"."""
        return self.last.mode if self.last is not None else None

    def _trace(self, client, args, kwargs, inputs) -> tuple[_Recording, object]:
        recorder = client.sink = Recorder(client)
        try:
            try:
                outputs = self.fn(*args, **kwargs)
            except BaseException:
                try:
                    _drop_traced_borrows(recorder)
                except Exception:  # noqa: BLE001 - the function's own error is the one to report
                    pass
                # nothing of this trace reached the workers: a tensor it made (and leaked) names a
                # ref they never had, which would stop them; make it DROPPED on the client instead
                site = call_site()
                for ref in recorder.created:
                    r = ref()
                    if r is not None:
                        r.dropped_at = site
                raise
            if _drop_traced_borrows(recorder):
                raise UsageError(f"all borrows created within a compiled function must be dropped within it "
                                   f"(call borrow.drop() before it returns)\n  at {user_line()}")
        finally:
            client.sink = client
        self.traces += 1
        out_flat, out_spec = tree_flatten(outputs)
        for o in out_flat:
            if isinstance(o, torch.Tensor) and type(o) is not Tensor:
                raise TypeError(f"a compiled function returns tdmesh tensors, got a local {type(o).__name__}")
            if type(o) is Tensor and o.requires_grad:
                raise_in_op("REQUIRES_GRAD", f"a compiled function cannot return tensor {o.ref}, which requires "
                                             f"grad")
        rec = _Recording(recorder, inputs, out_flat, out_spec)
        site = call_site()
        keep = {o._r.id for o in out_flat if type(o) is Tensor}
        for ref in recorder.created:  # made inside, not returned: unusable from now on
            r = ref()
            if r is not None and r.id not in keep and r.id in rec.defined:
                r.dropped_at = site
        return rec, outputs


def _drop_traced_borrows(recorder: Recorder) -> bool:
    """Drop the borrows a trace created and left undropped; True if there were any.

    Their messages were only recorded, never sent, so the drop is recorded too (and thrown
    away with the trace): a definition that the workers would reject (a ProtocolViolation
    that ends every worker) is never sent, and a later drop cannot name an unknown borrow."""
    created = {msg.borrow for _, msg, _, _ in recorder.messages if type(msg) is m.BorrowCreate}
    undropped = {}
    for ref in recorder.created:
        r = ref()
        borrow = r.aliases.borrow if r is not None else None
        if borrow is not None and borrow.id in created and not borrow.dropped:
            undropped[id(borrow)] = borrow
    for borrow in undropped.values():
        borrow.drop()
    return bool(undropped)


class _Recording:
    def __init__(self, recorder: Recorder, inputs: list, out_flat: list, out_spec) -> None:
        self.id = next(_recording_ids)
        self.messages = recorder.messages
        self.verified = False
        self.mode = "program"
        self.formals = [t.ref for t in inputs]
        defined: list[int] = []
        used: list[int] = []
        mutated: list[int] = []
        for _, msg, uses, defs in self.messages:
            used.extend(uses)
            defined.extend(defs)
            if type(msg) is m.CallFunction or type(msg) is m.CallOp:
                mutated.extend(msg.mutates)
        # defined inside: refs the trace made (a def of an older ref is a write to a tensor
        # from outside: a captured parameter an optimizer updates is a capture, and mutated)
        self.defined = {r for r in defined if r >= recorder.first_ref} - set(self.formals)
        formal_set = set(self.formals)
        self.capture_refs = [r for r in dict.fromkeys(used) if r not in self.defined and r not in formal_set]
        # keep captured tensors alive (and checkable) for as long as the recording exists
        self.captures = [recorder.seen[r] for r in self.capture_refs if r in recorder.seen]
        self.mutated_outside = [r for r in dict.fromkeys(mutated) if r not in self.defined]
        self.formal_index = {r: i for i, r in enumerate(self.formals)}
        self.capture_of = {t.ref: t for t in self.captures}
        self.capture_metas = [t._meta for t in self.captures]
        self.out_spec = out_spec
        # per output leaf: ("value", v) | ("formal", i) | ("capture", t)
        #                  | ("result", meta, source, stream, device, mesh)
        self.outputs: list[tuple] = []
        self.results = []
        self.result_alias_ids: list[int] = []  # the storage of each result, for capture.graph_blocker
        self.devices = recorder.devices  # the device types of the tensors the trace made
        input_aliases = [t._r.aliases for t in inputs]
        for o in out_flat:
            if type(o) is not Tensor:
                self.outputs.append(("value", o))
            elif o.ref in formal_set:
                self.outputs.append(("formal", self.formals.index(o.ref)))
            elif o.ref not in self.defined:
                self.outputs.append(("capture", o))
            else:
                source = next((i for i, a in enumerate(input_aliases) if a is o._r.aliases), None)
                self.outputs.append(("result", o._meta, source, o.stream, o.device, o.mesh))
                self.results.append(o.ref)
                self.result_alias_ids.append(id(o._r.aliases))
        self.ranks = sorted({r for ranks, *_ in self.messages for r in ranks})
        results = [o[1:] for o in self.outputs if o[0] == "result"]
        self.dense_results = None if any(isinstance(r[0], SparseMeta) for r in results) else results
        self.single_result = len(self.outputs) == 1 and self.outputs[0][0] == "result" and out_spec.num_leaves == 1 \
            and out_spec.num_children == 0

    def fresh(self) -> bool:
        """Whether every captured tensor still has the metadata it was traced with (an in-place
        resize_, set_ or transpose_ outside changes it: the recorded work would be stale)."""
        return all(t._meta is meta or t._meta == meta for t, meta in zip(self.captures, self.capture_metas))

    def diverges_from(self, other: _Recording):
        return first_difference(signature(self.messages), signature(other.messages))

    def define(self, client, mode: str) -> None:
        self.client = client
        # ranks that run the same messages get one definition (most recordings: every rank)
        sets = {id(ranks): frozenset(ranks) for ranks, *_ in self.messages}
        groups: dict[tuple, list[int]] = {}
        for rank in self.ranks:
            groups.setdefault(tuple(rank in s for s in sets.values()), []).append(rank)
        for member, ranks in groups.items():
            inside = {key for key, yes in zip(sets, member) if yes}
            commands = tuple(msg for r, msg, _, _ in self.messages if id(r) in inside)
            step = m.MAX_COMMANDS_PER_CHUNK
            chunks = [commands[i:i + step] for i in range(0, len(commands), step)] or [()]
            for index, chunk in enumerate(chunks):
                client.send_setup(m.DefineRecording(self.id, chunk, tuple(self.formals), tuple(self.results),
                                                    index, len(chunks), mode), ranks=tuple(ranks))

    def call(self, mesh, inputs: list, traced: _Recording | None = None) -> None:
        """Run the recording for a call that was just traced: its results are the traced refs."""
        self._send(mesh, inputs, [], list((traced or self).results))

    def _send(self, mesh, inputs: Sequence[Tensor], outputs: list, traced: Sequence[int] = ()) -> list:
        """One CallRecording on this recording's ranks: ``outputs`` are the new proxies of a
        replay, ``traced`` the refs of a traced call's own outputs instead."""
        actual_refs = [t.ref for t in inputs]
        mutated = self._written(inputs)
        call = (self.id, tuple(actual_refs))

        def build(seq, new_refs, _mutated):
            return m.CallRecording(seq, *call, tuple(traced) + new_refs)

        return issue(mesh, build, outputs=outputs, ranks=self.ranks, uses=actual_refs + self.capture_refs,
                     defs=list(traced) + mutated)

    def _written(self, inputs: Sequence[Tensor]) -> list[int]:
        """Every alias of what a call with ``inputs`` writes outside, as the aliases are now."""
        written: list[int] = []
        for r in self.mutated_outside:
            owner = inputs[self.formal_index[r]] if r in self.formal_index else self.capture_of.get(r)
            written.extend(owner._r.aliases.refs if owner is not None else [r])
        return written

    def replay(self, mesh, inputs: Sequence[Tensor]):
        stream = get_active_stream()
        for t in inputs:  # dropped or borrowed since the trace? (inputs may come from several meshes)
            check_inputs((t,), t._mesh, "a compiled function", stream)
        if self.captures:
            check_inputs(self.captures, self.captures[0].mesh, "a compiled function (a captured tensor)", stream)
        if self.dense_results is None:  # a sparse result: the general path
            return self._replay_general(mesh, inputs)
        proxies = issue_call(mesh, self.id, inputs, self.dense_results, self.capture_refs, self._written(inputs),
                             self.ranks, stream)
        if self.single_result:
            return proxies[0]
        it = iter(proxies)
        leaves = [next(it) if kind == "result" else (inputs[rest[0]] if kind == "formal" else rest[0])
                  for kind, *rest in self.outputs]
        return tree_unflatten(leaves, self.out_spec)

    def _replay_general(self, mesh, inputs: Sequence[Tensor]):
        slots: list = []  # per output leaf: (is a new proxy, the value or its index among the new ones)
        new: list = []
        for kind, *rest in self.outputs:
            if kind == "value" or kind == "capture":
                slots.append((False, rest[0]))
            elif kind == "formal":
                slots.append((False, inputs[rest[0]]))
            else:
                meta, source, out_stream, device, out_mesh = rest
                slots.append((True, len(new)))
                new.append(New(meta, inputs[source].aliases if source is not None else None, out_stream, device,
                               out_mesh))
        proxies = self._send(mesh, inputs, new)
        return tree_unflatten([proxies[v] if is_new else v for is_new, v in slots], self.out_spec)


def _tensors_key(args: tuple) -> tuple | None:
    """The recording key of a call whose arguments are all tdmesh tensors (None otherwise):
    what ``_key`` would distinguish, and whether grad must be refused (then the slow path
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


def _key(spec, flat) -> tuple:
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


BACKENDS = ("program", "messages", "inductor")


def compile(fn=None, *, verify: bool = False, backend: str = "program", cuda_graph: bool | None = None):
    """Compile ``fn`` into a worker-side recording: ``@tdmesh.compile`` or ``@tdmesh.compile(verify=True)``.

    ``backend="program"`` (the default) runs each call on a worker as one generated function
    wherever the recording allows it (see ``tdmesh.worker.programs``); ``"messages"`` replays
    it message by message, as before programs existed (for comparison and debugging);
    ``"inductor"`` compiles each worker's program with ``torch.compile`` (fused kernels; its
    first call compiles, collectives run between the compiled graphs, and an error fails the
    whole call).
    ``cuda_graph``: on a CUDA mesh, None (the default) captures the program as a CUDA graph at
    its second call where the recording qualifies (``tdmesh.capture`` says when) and warns
    once where it does not; True raises instead; False never captures."""
    if fn is None:
        return lambda f: _Compiled(f, verify, backend, cuda_graph)
    return _Compiled(fn, verify, backend, cuda_graph)
