"""A compiled function's recording as the client holds it: what one trace sent, defined on
the workers once, and the replay of one call (``tdmesh.programs.recording`` decides when).

A replay names the call's inputs, its new results and the refs of the state the recording
keeps (the same refs every call); captured tensors are read where they are and held weakly,
so a recording whose captures or state the program dropped is stale, never replayed.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

from torch.utils._pytree import tree_unflatten

from ..engine.issue import New, issue, issue_call
from ..engine.placement import check_inputs
from ..engine.propagation import SparseMeta
from ..engine.stream import get_active_stream
from ..engine.tensor import Tensor
from ..protocol import messages as m
from .guards import split
from .optim import hyperparameters
from .signature import first_difference, signature
from .tracing import Recorder, TraceState

__all__ = ["Recording"]

_recording_ids = itertools.count(1)


class Recording:
    def __init__(self, recorder: Recorder, inputs: list, out_flat: list, out_spec, state: TraceState) -> None:
        self.id = next(_recording_ids)
        self.recorder: Recorder | None = recorder  # until release(): its held frees
        self.messages = recorder.messages
        self.verified = False
        self.mode = "program"
        self.options: tuple = ()  # inductor's options (tdmesh.compile(options=)), sent with the definition
        self.replays = 0
        self.formals = [t.ref for t in inputs]
        self.first_ref = recorder.first_ref  # refs from here on were made by the trace
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
        # captured tensors are held weakly: one the program no longer holds makes the recording
        # stale (a replay would read a tensor the function would not read again)
        held = [(r, state.captures[r]) for r in self.capture_refs if state.captures.get(r) is not None]
        self.captures = [t for _, t in held]
        self.capture_names = [r for r, _ in held]
        self._weak_captures = [weakref.ref(t) for t in self.captures]
        self.mutated_outside = [r for r in dict.fromkeys(mutated) if r not in self.defined]
        self.formal_index = {r: i for i, r in enumerate(self.formals)}
        self.capture_metas = [t._meta for t in self.captures]
        # the stream the function was called on: a capture that lives on another reached the trace's ops only
        # through a borrow (or an activation of its stream) inside the function, which every replay repeats
        self.home_stream = get_active_stream()
        self.borrows_captures = any(t._stream is not self.home_stream for t in self.captures)  # streams never change
        # state the call made and the program keeps: rewritten in place (same refs) by every call
        self.kept_refs = tuple(state.kept_refs)
        self._kept = [weakref.ref(r) for r in state.kept]
        self.optimizers = [(weakref.ref(opt), settings) for opt, settings in recorder.optimizers.values()]
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
        self.results.extend(self.kept_refs)
        self.ranks = sorted({r for ranks, *_ in self.messages for r in ranks})
        results = [o[1:] for o in self.outputs if o[0] == "result"]
        self.dense_results = None if any(isinstance(r[0], SparseMeta) for r in results) else results
        self.single_result = len(self.outputs) == 1 and self.outputs[0][0] == "result" and out_spec.num_leaves == 1 \
            and out_spec.num_children == 0
        self.guards = recorder.guards
        self.segments: list | None = None
        self.segment_modes: list[str] | None = None  # per segment, on CUDA (tdmesh.programs.capture)
        self.unsplittable: str | None = None  # why a trace with reads is no recording
        if self.guards:
            self._split(recorder, inputs, out_flat, state)

    def _split(self, recorder: Recorder, inputs: list, out_flat: list, state: TraceState) -> None:
        """A trace with reads: its segments (``tdmesh.programs.guards``), the tensors its reads
        read besides those of its ops (held weakly, as captures), and where its state lives."""
        formal_set = set(self.formals)
        for g in self.guards:
            for r in g.capture_refs:
                t = state.captures.get(r)
                if r not in formal_set and r not in self.capture_names and t is not None:
                    self.capture_names.append(r)
                    self._weak_captures.append(weakref.ref(t))
                    self.capture_metas.append(t._meta)
        made = [o for o in out_flat if type(o) is Tensor and o.ref in self.defined]  # results the call made
        alias_of = {r: a for g in self.guards for r, a in zip(g.carried, g.carried_aliases)}
        alias_of.update((o.ref, o._r.aliases) for o in made)
        captured = {r: state.captures[r]._r.aliases for r in self.capture_names if state.captures.get(r) is not None}
        segments = split(self.messages, self.guards, self.formals, recorder.first_ref, [o.ref for o in made],
                         self.kept_refs, recorder.metas, alias_of, [t._r.aliases for t in inputs], captured)
        for g in self.guards:
            g.carried_aliases = []  # not held past the trace
        if isinstance(segments, str):
            self.unsplittable = segments
            return
        self.segments = segments
        self.kept_places = {r: recorder.metas[r][2:4] for r in self.kept_refs}

    def release(self, recorded: bool) -> None:
        """The recording's first call is queued: send the frees its trace held back."""
        if self.recorder is not None:
            self.recorder.release(recorded)
            self.recorder = None
            self.captures = []  # from now on held weakly only

    def live(self) -> list | None:
        """The captured tensors, if a replay would do what the function does now (else None)."""
        captures, stale = self.check()
        return captures if stale is None else None

    def check(self) -> tuple[list | None, str | None]:
        """``(captures, None)`` if a replay would do what the function does now, else
        ``(None, why)``: every captured tensor is still held by the program, with the metadata
        it was traced with (an in-place ``resize_``, ``set_`` or ``transpose_`` changes it),
        every tensor of its state is still held, and every optimizer it steps has the same
        settings (``lr`` ...)."""
        captures = [w() for w in self._weak_captures]
        for t, meta, ref in zip(captures, self.capture_metas, self.capture_names):
            if t is None:
                return None, f"tensor {ref}, which it reads, is no longer held by the program"
            if t._meta is not meta and t._meta != meta:
                return None, f"tensor {ref}, which it reads, changed shape or strides in place"
        for w, ref in zip(self._kept, self.kept_refs):
            if w() is None:
                return None, f"tensor {ref} of its state is no longer held by the program"
        for opt, settings in self.optimizers:
            o = opt()
            if o is None:
                return None, "an optimizer it steps is gone"
            if hyperparameters(o) != settings:
                return None, f"the settings of {type(o).__name__} changed (lr, ...)"
        return captures, None

    def diverges_from(self, other: Recording):
        return first_difference(signature(self.messages), signature(other.messages))

    def define(self, client, mode: str) -> None:
        self.client = client
        if self.segments is None:
            _define(client, self.id, self.messages, self.ranks, self.formals, self.results, mode, self.options)
            return
        modes = self.segment_modes or [mode] * len(self.segments)
        for seg, seg_mode in zip(self.segments, modes):  # a guarded recording: a recording per segment with ops
            if seg.messages:
                seg.id = next(_recording_ids)
                _define(client, seg.id, seg.messages, seg.ranks, seg.formals, seg.new + list(seg.kept), seg_mode,
                        self.options)

    def call(self, mesh, inputs: list, traced: Recording | None = None) -> None:
        """Run the recording for a call that was just traced: its results are the traced refs."""
        captures = self.captures if self.recorder is not None else (self.live() or [])
        self._send(mesh, inputs, captures, [], list((traced or self).results))

    def _send(self, mesh, inputs: Sequence[Tensor], captures: list, outputs: list, traced: Sequence[int] = ()) -> list:
        """One CallRecording on this recording's ranks: ``outputs`` are the new proxies of a
        replay (its state's refs follow them), ``traced`` the refs of a traced call's own
        outputs and state instead."""
        actual_refs = [t.ref for t in inputs]
        mutated = self._written(inputs, captures)
        call = (self.id, tuple(actual_refs))
        kept = () if traced else self.kept_refs

        def build(seq, new_refs, _mutated):
            return m.CallRecording(seq, *call, tuple(traced) + new_refs + kept)

        return issue(mesh, build, outputs=outputs, ranks=self.ranks, uses=actual_refs + self.capture_refs,
                     defs=list(traced) + list(kept) + mutated)

    def _written(self, inputs: Sequence[Tensor], captures: list) -> list[int]:
        """Every alias of what a call with ``inputs`` writes outside, as the aliases are now."""
        written: list[int] = []
        capture_of = {t._r.id: t for t in captures} if self.mutated_outside else {}
        for r in self.mutated_outside:
            owner = inputs[self.formal_index[r]] if r in self.formal_index else capture_of.get(r)
            written.extend(owner._r.aliases.refs if owner is not None else [r])
        return written

    def start_replay(self, inputs: Sequence[Tensor], captures: list):
        """A replay begins: its inputs and captures may be used on the active stream (dropped or
        borrowed since the trace?); returns that stream."""
        self.replays += 1
        stream = get_active_stream()
        for t in inputs:  # inputs may come from several meshes
            check_inputs((t,), t._mesh, "a compiled function", stream)
        if captures:
            mesh, what = captures[0].mesh, "a compiled function (a captured tensor)"
            if not self.borrows_captures:
                check_inputs(captures, mesh, what, stream)
            else:  # one borrowed inside the function: checked on its own stream (dropped? borrowed elsewhere?)
                home = self.home_stream
                for t in captures:
                    check_inputs((t,), mesh, what, stream if t._stream is home else t._stream)
        return stream

    def replay(self, mesh, inputs: Sequence[Tensor], captures: list):
        """One call: its outputs (a guarded recording's replay is ``guards.replay_guarded``)."""
        stream = self.start_replay(inputs, captures)
        if self.dense_results is None:  # a sparse result: the general path
            return self._replay_general(mesh, inputs, captures)
        proxies = issue_call(mesh, self.id, inputs, self.dense_results, self.capture_refs,
                             self._written(inputs, captures), self.ranks, stream, self.kept_refs)
        if self.single_result:
            return proxies[0]
        it = iter(proxies)
        leaves = [next(it) if kind == "result" else (inputs[rest[0]] if kind == "formal" else rest[0])
                  for kind, *rest in self.outputs]
        return tree_unflatten(leaves, self.out_spec)

    def _replay_general(self, mesh, inputs: Sequence[Tensor], captures: list):
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
        proxies = self._send(mesh, inputs, captures, new)
        return tree_unflatten([proxies[v] if is_new else v for is_new, v in slots], self.out_spec)


def _define(client, recording: int, messages: list, ranks: list, formals: list, results: list, mode: str,
            options: tuple = ()) -> None:
    """Define ``messages`` on the workers as recording ``recording``: ranks that run the same
    messages get one definition (most recordings: every rank), in chunks."""
    sets = {id(r): frozenset(r) for r, *_ in messages}
    groups: dict[tuple, list[int]] = {}
    for rank in ranks:
        groups.setdefault(tuple(rank in s for s in sets.values()), []).append(rank)
    for member, group in groups.items():
        inside = {key for key, yes in zip(sets, member) if yes}
        commands = tuple(msg for r, msg, _, _ in messages if id(r) in inside)
        step = m.MAX_COMMANDS_PER_CHUNK
        chunks = [commands[i:i + step] for i in range(0, len(commands), step)] or [()]
        for index, chunk in enumerate(chunks):
            client.send_setup(m.DefineRecording(recording, chunk, tuple(formals), tuple(results), index, len(chunks),
                                                mode, options), ranks=tuple(group))
