"""``@tdmesh.compile``: record a function's messages on the workers once, replay them after.

A call traces the function: its messages are kept instead of sent (``tdmesh.programs.tracing``).
What the trace becomes follows one rule: **every call gives what the function run eagerly
would give, from the first call on** (no warm-up steps).  So:

1. A trace that made nothing the program keeps (only its results) becomes a recording at
   once: defined on each rank (in chunks) and called; every later call with the same kind
   of inputs (tree structure, non-tensor values, tensor metadata, aliasing, mesh, stream) is
   one ``CallRecording`` per rank, however many ops the function has.
2. A trace that made **state** -- tensors that outlive the call without being returned:
   ``.grad``, an optimizer's ``state``, a lazily built module, a tensor the function stored --
   runs as the eager ops it traced, so the state exists as the program sees it; the next
   call traces again and reads it as captures.  State made anew by every call (gradients
   under ``zero_grad(set_to_none=True)``) settles when two traces in a row send the same
   messages and the first one's state is gone: the recording then rewrites that state in
   place (the same refs) at every call.
3. A **host read** of a value (``.item()``, ``bool()``, ``.tolist()``, ``torch.equal``, the
   output shapes of an op that only the data decides: ``x[mask]``, ``nonzero``) is a
   guard (``tdmesh.programs.guards``): the traced call runs as the eager ops it traced (the
   read sees the workers' value), and its recording is split at the read; a replay reads the
   value between the parts and goes on while it is the traced one.  A different value goes
   on from the read by running the function again (``tdmesh.programs.resume``) and the next
   call traces again.  Any other host read (a fetch, an op that changes an argument's shape
   in place) sends what was traced and runs the rest of the call eagerly.
4. A replay runs only while it would do what the function does now: every tensor it reads
   (captures) and keeps is still held by the program, with the metadata it was traced with,
   and every ``torch.optim`` optimizer it steps has the same settings (``lr``...).
   Otherwise the call traces again.

A function whose calls run eagerly ``EAGER_AFTER`` times in a row for one reason (a read
value that changes from call to call, other host reads every call, state that never settles,
a recording stale at every call) runs eagerly for good, with one warning naming why and the
way out.  What a replay cannot see: other Python values the function reads (a global float, a
branch on Python state); ``verify=True`` traces the first reuse of a recording without reads
again and raises if the messages differ.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._pytree import tree_flatten

from ..engine.autograd_context import set_sink
from ..engine.context import active_mesh_or_none
from ..engine.placement import check_no_grad
from ..engine.tensor import Tensor, raise_in_op
from ..errors import UsageError, call_site, user_line, warn_at_user_line
from .capture import recording_mode
from .guards import replay_guarded
from .optim import watch_optimizers
from .replay import Recording
from .resume import resume
from .signature import call_key, signature, tensors_key
from .tracing import Recorder, drop_traced_borrows, forget_trace, trace_state

__all__ = ["compile"]

# A function whose calls run eagerly this many times for one reason (host reads, state that
# never settles, a recording that goes stale every call) runs eagerly from then on, warning once.
EAGER_AFTER = 4
READ_WAY_OUT = ("fetch after the call, or for torch.optim pass fused=True (or capturable=True on CUDA), which read "
                "nothing on the host")
SHAPE_WAY_OUT = ("use a fixed-size form (masked_fill or torch.where instead of x[mask], nonzero_static(size=...)), "
                 "or run the op in a remote function, whose shapes the client does not need")
STALE_WAY_OUT = ("keep what it reads the same tensors with the same settings (for a learning-rate scheduler, a "
                 "tensor lr=torch.tensor(...), which the scheduler updates in place)")


def way_out(guard) -> str:
    """How to compile a function whose read ``guard`` changes value from call to call."""
    return SHAPE_WAY_OUT if guard.reads_shapes else READ_WAY_OUT


class _Compiled:
    def __init__(self, fn, verify: bool, backend: str, cuda_graph: bool | None, options: dict | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"tdmesh.compile: unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
        if backend == "messages" and cuda_graph:
            raise ValueError("tdmesh.compile: cuda_graph=True needs backend='program' (a graph captures a program)")
        self.options = inductor_options(backend, options)
        self.fn = fn
        self.verify = verify
        self.backend = backend
        self.cuda_graph = cuda_graph
        self.warned = False  # the reason a recording is not a CUDA graph is said once
        self.last: Recording | None = None
        self.recordings: dict = {}
        self.traces = 0
        self.settling: dict = {}  # key -> (signature, weakrefs to its state, optimizer settings) of its last
        #                           trace that made state
        self.misses: dict[str, int] = {}  # calls that ran eagerly, by why, since the last recording
        #                                  ("guard_misses": since the last replay that passed its reads)
        self.missed: dict = {}  # key -> (why its last guarded replay missed, the way out); the trace after clears it
        self.eager_because: str | None = None  # set once the function runs eagerly for good
        self.stale_run = 0  # recordings in a row that went stale before their first replay
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        key = None if kwargs else tensors_key(args)
        if key is not None:  # the common call, f(tensor, ...): no tree walk, no per-input checks
            rec = self.recordings.get(key)
            if rec is not None and rec.verified and rec.segments is None and type(rec.client.sink) is not Recorder:
                captures = rec.live()
                if captures is not None:
                    return rec.replay(args[0].mesh, args, captures)
        flat, spec = tree_flatten((args, kwargs))
        inputs = [x for x in flat if type(x) is Tensor]
        mesh = inputs[0].mesh if inputs else active_mesh_or_none()
        if mesh is None or mesh.client is None:
            raise ValueError("a compiled function runs on a mesh: call it under `with mesh.activate():`")
        client = mesh.client
        if type(client.sink) is Recorder or self.eager_because is not None:  # inside compile, or eager for good
            return self.fn(*args, **kwargs)
        check_no_grad(inputs, "tdmesh.compile (it does not record autograd)")
        if key is None:
            key = call_key(spec, flat)
        rec = self.recordings.get(key)
        captures, stale = rec.check() if rec is not None else (None, None)
        if stale is not None:  # a tensor it reads or keeps is gone or reshaped, or settings changed
            self.stale_run = self.stale_run + 1 if rec.replays == 0 else 1
            if self.stale_run >= EAGER_AFTER:
                self._eager_for_good(f"its recording went stale ({stale})", STALE_WAY_OUT)
                return self.fn(*args, **kwargs)
        if captures is None:
            return self._trace_call(client, mesh, key, args, kwargs, inputs)
        if rec.segments is not None:
            return self._replay_guarded(rec, mesh, key, args, kwargs, inputs, captures)
        if self.verify and not rec.verified:
            recorder, outputs, out_flat, out_spec = self._trace(client, args, kwargs)
            again = self._settle(recorder, key, inputs, out_flat, out_spec)
            if again is None:
                return outputs
            at = rec.diverges_from(again)
            if at is not None:  # nothing of this call was sent
                forget_trace(recorder)
                again.release(recorded=True)
                raise UsageError(f"tdmesh.compile failed to verify recording. Recording diverges at operation "
                                 f"{at}: the function does not send the same operations on every call "
                                 f"(a data- or Python-dependent branch?)\n  at {user_line()}")
            rec.verified = True
            rec.call(mesh, inputs, again)
            again.release(recorded=True)
            return outputs
        return rec.replay(mesh, inputs, captures)

    def _trace_call(self, client, mesh, key, args, kwargs, inputs):
        """A call that traces: it becomes a recording, or runs as the eager ops it traced."""
        recorder, outputs, out_flat, out_spec = self._trace(client, args, kwargs)
        rec = self._settle(recorder, key, inputs, out_flat, out_spec)
        if rec is None:
            return outputs
        try:
            mode = recording_mode(self.backend, self.cuda_graph, mesh, rec, inputs, self)
        except BaseException:  # refused (cuda_graph=True): nothing of the call was sent
            forget_trace(recorder)
            rec.release(recorded=True)
            raise
        # state settles only after two equal traces; a call with reads ran eagerly, and is not traced again
        rec.verified = not self.verify or bool(rec.kept_refs) or bool(rec.guards)
        self.recordings[key] = rec
        rec.mode = mode
        rec.options = self.options
        self.last = rec
        rec.define(client, mode)
        if rec.guards:  # its ops have run (eagerly): the recording serves the next calls
            rec.release(recorded=False)
            return outputs
        rec.call(mesh, inputs)
        rec.release(recorded=True)
        return outputs

    def _replay_guarded(self, rec: Recording, mesh, key, args, kwargs, inputs, captures):
        """A call of a recording with reads: replayed while every read gives the traced value;
        from a read that does not, the call goes on eagerly (``tdmesh.programs.resume``)."""
        rec.start_replay(inputs, captures)
        done, result = replay_guarded(rec, mesh, inputs, captures)
        if done:
            self.misses.pop("guard_misses", None)
            return result
        guard = rec.guards[result.k]
        del self.recordings[key]  # the next call traces again
        outputs = resume(self.fn, args, kwargs, rec, result, inputs)
        self.missed[key] = (f"a value it reads on the host changes ({guard.what} at {guard.site}: {guard.value!r} "
                            f"when traced, {result.value!r} at a later call)", way_out(guard))
        why, out = self.missed[key]
        self._eager_call(why, "guard_misses", out)
        return outputs

    def _settle(self, recorder: Recorder, key, inputs, out_flat, out_spec) -> Recording | None:
        """What a finished trace becomes: a recording (returned, not yet released), or None when
        the call has run as eager ops (sent here) -- see the module docstring for the rules."""
        if recorder.host_read is None and recorder.guards:
            recorder.send_eagerly()  # the ops after the last read: the call runs as the eager ops it traced
        if self.cuda_graph and (recorder.host_read is not None or recorder.guards):
            read = recorder.host_read or f"{recorder.guards[0].what} at {recorder.guards[0].site}"
            raise UsageError(f"tdmesh.compile(cuda_graph=True): {getattr(self.fn, '__name__', 'the function')} reads "
                             f"a value on the host ({read}), which a CUDA graph cannot capture (this call ran "
                             f"eagerly); read it after the call, or use cuda_graph=None (a read of a value then "
                             f"splits the recording into programs, any other runs the rest of the call eagerly)"
                             f"\n  at {user_line()}")
        if recorder.host_read is not None:  # sent already, from the read on
            self._eager_call(f"it reads a value on the host ({recorder.host_read})", "host_reads",
                             recorder.way_out or READ_WAY_OUT)
            return None
        state = trace_state(recorder, out_flat)
        if state.why_eager is None:
            previous = self.settling.get(key)
            values = [repr(g.value) for g in recorder.guards]
            sig = (signature(recorder.messages, state.kept_refs), values) if state.kept else None
            settings = [(type(opt).__name__, s) for opt, s in recorder.optimizers.values()]
            if state.kept and (previous is None or previous[0] != sig or any(w() is not None for w in previous[1])):
                state.why_eager = "it made new state that later calls read"
                changed = [(g, v) for g, v, now in zip(recorder.guards, previous[0][1], values) if v != now] \
                    if previous is not None else []
                if previous is not None and previous[2] != settings:
                    state.why_eager = f"the settings of {settings[0][0] if settings else 'an optimizer'} changed"
                    state.way_out = STALE_WAY_OUT
                elif changed:  # a read's value changed (and, maybe, the ops after it)
                    g, before = changed[0]
                    state.why_eager = (f"a value it reads on the host changes ({g.what} at {g.site}: {before} at one "
                                       f"call, {g.value!r} at the next)")
                    state.way_out = way_out(g)
                self.settling[key] = (sig, [weakref.ref(r) for r in state.kept], settings)
        if state.why_eager is not None:
            recorder.send_eagerly()
            self._eager_call(state.why_eager, "settle_misses", state.way_out)
            return None
        self.settling.pop(key, None)
        rec = Recording(recorder, inputs, out_flat, out_spec, state)
        if rec.unsplittable is not None:  # ran eagerly already
            self._eager_call(rec.unsplittable, "host_reads", READ_WAY_OUT)
            return None
        self.misses = {kind: n for kind, n in self.misses.items() if kind == "guard_misses"}
        if rec.guards:
            missed = self.missed.pop(key, None)
            if missed is not None:  # traced again after a miss: a value that changes every call gets here too
                self._eager_call(missed[0], "guard_misses", missed[1])
                if self.eager_because is not None:
                    return None
            return rec
        site = call_site()
        keep = {o._r.id for o in out_flat if type(o) is Tensor} | set(state.kept_refs)
        for ref in recorder.created:  # made inside, not returned, not kept: gone (a temporary)
            r = ref()
            if r is not None and r.id not in keep and r.id in rec.defined:
                r.dropped_at = site
        return rec

    def _eager_call(self, why: str, kind: str, way_out: str) -> None:
        """This call ran eagerly; after ``EAGER_AFTER`` such calls the function runs eagerly
        for good."""
        self.misses[kind] = self.misses.get(kind, 0) + 1
        if self.misses[kind] >= EAGER_AFTER:
            self._eager_for_good(why, way_out)

    def _eager_for_good(self, why: str, way_out: str) -> None:
        """Run eagerly from now on, with one warning (at the user's line)
        naming why and the way out."""
        self.eager_because = why
        name = getattr(self.fn, "__name__", "the function")
        warn_at_user_line(f"tdmesh.compile: {name} runs eagerly from now on: {why}, on each of {EAGER_AFTER} "
                          f"calls in a row; {way_out}")

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

    def _trace(self, client, args, kwargs) -> tuple[Recorder, object, list, object]:
        recorder = Recorder(client)
        set_sink(client, recorder)
        hooks = watch_optimizers(recorder)
        try:
            try:
                outputs = self.fn(*args, **kwargs)
            finally:
                hooks.remove()
            if recorder.host_read is None and drop_traced_borrows(recorder):
                raise UsageError(f"all borrows created within a compiled function must be dropped within it "
                                 f"(call borrow.drop() before it returns)\n  at {user_line()}")
            self.traces += 1
            out_flat, out_spec = tree_flatten(outputs)
            for o in out_flat:
                if isinstance(o, torch.Tensor) and type(o) is not Tensor:
                    raise TypeError(f"a compiled function returns tdmesh tensors, got a local {type(o).__name__}")
                if type(o) is Tensor and o.requires_grad:
                    raise_in_op("REQUIRES_GRAD", f"a compiled function cannot return tensor {o.ref}, which "
                                                 f"requires grad")
        except BaseException:
            if recorder.sent:  # the ops before a read ran: so do those after it, as eager torch's would have
                recorder.send_eagerly()
                recorder.release(recorded=False)
                raise
            if recorder.host_read is None:  # nothing was sent
                forget_trace(recorder)
            recorder.release(recorded=True)
            raise
        recorder.finished = True  # from here every free waits until the outcome is queued
        if client.sink is recorder:
            set_sink(client, client)
        return recorder, outputs, out_flat, out_spec


BACKENDS = ("program", "messages", "inductor")


def compile(fn=None, *, verify: bool = False, backend: str = "program", cuda_graph: bool | None = None,
            options: dict | None = None):
    """Compile ``fn`` into a worker-side recording: ``@tdmesh.compile`` or ``@tdmesh.compile(verify=True)``.

    ``backend="program"`` (the default) runs each call on a worker as one generated function
    wherever the recording allows it (see ``tdmesh.worker.programs``); ``"messages"`` replays
    it message by message, as before programs existed (for comparison and debugging);
    ``"inductor"`` compiles the program's aten ops with inductor, as the FX graphs the recording
    already is (no dynamo trace; ``tdmesh.worker.inductor``): fused kernels; its first call
    compiles, collectives and fused optimizer kernels run between the graphs, and an error
    fails the whole call.
    ``cuda_graph``: on a CUDA mesh, None (the default) captures the program as a CUDA graph at
    its second call where the recording qualifies (``tdmesh.programs.capture`` says when) and warns
    once where it does not; True raises instead; False never captures.  A function that reads
    values on the host (``.item()``, ``bool()``) runs as parts between its reads, each read checked
    at every call (the module docstring says how); ``verify=True`` checks recordings without reads.
    ``options`` (``backend="inductor"``): inductor's config options for the workers' compiles, as
    ``torch.compile(options=)`` takes them (``torch._inductor.list_options()`` names them;
    ``torch._inductor.list_mode_options("max-autotune-no-cudagraphs")`` is that mode's)."""
    if fn is None:
        return lambda f: _Compiled(f, verify, backend, cuda_graph, options)
    return _Compiled(fn, verify, backend, cuda_graph, options)


def inductor_options(backend: str, options: dict | None) -> tuple:
    """``options`` checked on the client, as ``torch.compile`` checks them (names, value types), so that a
    misspelt one raises here, not on every worker at its first compile: sorted (name, value) pairs."""
    if not options:
        return ()
    if backend != "inductor":
        raise ValueError(f"tdmesh.compile: options= are inductor's config options; backend={backend!r} has none "
                         f"(use backend='inductor')")
    from torch._inductor import config
    known = config.get_config_copy()
    for name, value in options.items():
        if name not in known:
            raise ValueError(f"tdmesh.compile: unknown inductor option {name!r}; torch._inductor.list_options() "
                             f"names them")
        if name == "triton.cudagraphs" and value:
            raise ValueError("tdmesh.compile: inductor's own CUDA graphs ('triton.cudagraphs') would capture each "
                             "graph apart; tdmesh captures the whole step: use cuda_graph= (on by default on CUDA)")
        expected = type(known[name])
        if known[name] is not None and not isinstance(value, expected):
            raise ValueError(f"tdmesh.compile: inductor option {name!r} takes a {expected.__name__}, "
                             f"not {type(value).__name__}")
    return tuple(sorted(options.items()))
