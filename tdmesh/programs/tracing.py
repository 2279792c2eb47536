"""One traced call of a compiled function: the client's sink while it runs, and what it left.

While a compiled function is traced, every op it issues is kept here instead of being sent.
What the call then becomes is decided from what it left behind (``Trace``):

- **a host read** of a value (``.item()``, ``bool()``, ``.tolist()``, ``torch.equal``, the
  output shapes of an op that only the data decides: ``nonzero``, ``x[mask]``, ``unique``) sends
  the ops kept so far and reads the value as eager torch would; the trace goes on, and the
  read becomes a **guard** of the recording (``tdmesh.programs.guards``): the value it read,
  and the tensors the call held at that point (the live ones a later part may use).  The ops
  traced after the last read are sent when the call returns: a call with reads runs as the
  eager ops it traced, and the recording serves the calls after it;
- **another host read** (a fetch, a wait, an op that writes an argument's shape in place)
  sends everything kept so far, in order, and the rest of the call runs eagerly;
- **state**: tensors the call made that outlive it without being returned (``.grad``, an
  optimizer's ``state``, a lazily built module, anything the function stored) are sent as
  the eager ops they were, so they exist on the workers as the program sees them; later
  calls read them as captures;
- otherwise the messages become a recording (``tdmesh.programs.recording``).

The ops of an eager outcome are submitted to the client exactly as they would have been
without the trace (same seqs, uses and defs, the user's line of each), and the frees of the
trace's own tensors that died meanwhile are held back until those ops are queued, so the
workers never free a ref before the op that defines it.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

from ..engine.autograd_context import set_sink
from ..engine.host_reads import read_name
from ..engine.propagation import TensorMeta
from ..errors import call_site, user_line
from ..protocol import messages as m
from .guards import Guard

__all__ = ["Recorder", "host_read_name", "live_after"]

_HOST_READS = (m.SendValue, m.RequestStatus)


class Recorder:
    """The client's sink while a compiled function is traced: keeps the messages that would
    have been sent (per rank), the proxies made, and every tensor an op read."""

    def __init__(self, client) -> None:
        self.client = client
        self.entries: list[tuple] = []  # client.submit's arguments: (ranks, msg, seq, uses, defs, future, site)
        self.created: list = []  # weakrefs to the RefOwners made while tracing
        self.devices: set[str] = set()  # the device types of the tensors it made
        self.first_ref = client.next_ref  # refs from here on are made by the trace
        client.delete_holder = self
        self.seen: dict[int, Any] = {}  # the tensors from before the call that an op read (captures), by ref
        self.held_deletes: list[tuple[int, object]] | None = []  # frees of trace-made refs, in order
        self.host_read: str | None = None  # what made the call eager: "<op> at <user line>"
        self.finished = False  # the function returned: every free waits until the outcome is sent
        self.optimizers: dict[int, tuple] = {}  # torch optimizers stepped by the call (tdmesh.programs.optim's hook)
        self.sent = 0  # entries sent already: the ops before the last guard read
        self.guards: list[Guard] = []  # the reads of values the call made, in order
        self.reading: Guard | None = None  # the read in flight (noted by read_on_host)
        self.metas: dict[int, tuple] = {}  # per ref the trace made: (meta, device, mesh, stream)
        self.way_out: str | None = None  # for the warning, where the host read's own way out is not the usual

    def note_read(self, mesh, function, args, kwargs, what: str, agree) -> None:
        """``read_on_host`` is about to read a value: it may become a guard (``submit`` decides)."""
        if self.host_read is None and self.client.sink is self and self.reading is None:
            self.reading = Guard(mesh, function, args, kwargs, what, self.first_ref, agree)

    def read_done(self, value, ok: bool) -> None:
        """The read's value, which every rank agreed on: the guard's expected value.  A read that
        failed (the ranks disagreed) is no guard: if the function goes on, it runs eagerly."""
        guard, self.reading = self.reading, None
        if guard is None or guard.index < 0:
            return
        if ok:
            guard.value = value
            self.guards.append(guard)
        elif self.host_read is None:
            self.host_read = f"{guard.what}, which failed, at {guard.site}"
            self.send_eagerly()

    def adopted(self, proxies: list) -> None:
        """The proxies of an op's outputs whose shapes the last read learned (a shape only the
        data decides: ``tdmesh.engine.unshaped``): made by the trace, and held across that read
        (the guard's value is their metadata).  A sparse one has no fixed shape per call: the
        call runs eagerly from here on."""
        if self.host_read is not None or not self.guards:
            return
        guard = self.guards[-1]
        if any(not isinstance(t._meta, TensorMeta) for t in proxies):
            self.host_read = f"{guard.what} at {guard.site}: a sparse result, whose shape a replay cannot fix"
            self.way_out = "run the sparse ops in a remote function (tdmesh.remote)"
            self.send_eagerly()
            return
        for t in proxies:
            self.created.append(weakref.ref(t._r))
            self.devices.add(t.device.type)
            self.metas[t._r.id] = (t._meta, t.device, t._mesh, t._stream)
            guard.carried.append(t._r.id)
            guard.carried_aliases.append(t._r.aliases)

    def submit(self, ranks, msg, seq=None, uses=(), defs=(), future=None, inputs=(), deletes_first=False,
               outputs=(), site=None) -> None:
        if self.host_read is None and type(msg) in _HOST_READS:
            reading = self.reading
            if reading is not None and (reading.index >= 0 or self._guard(reading, (ranks, msg, uses, defs))):
                self.client.submit(ranks, msg, seq, uses, defs, future, inputs, deletes_first, outputs, site)
                return
            self.reading = None
            self.host_read = f"{host_read_name(msg)} at {user_line()}"
            self.send_eagerly()
        if self.client.sink is not self:  # eager from the host read on
            self.client.submit(ranks, msg, seq, uses, defs, future, inputs, deletes_first, outputs, site)
            return
        first = self.first_ref
        for t in inputs:
            ref = t._r.id
            if ref < first:  # a tensor from before the call: a capture (trace-made ones are not held here)
                self.seen[ref] = t
        metas = self.metas
        for t in outputs:
            self.created.append(weakref.ref(t._r))
            device = t.device
            self.devices.add(device.type)
            metas[t._r.id] = (t._meta, device, t._mesh, t._stream)
        if seq is not None and site is None:
            site = call_site()
        self.entries.append((ranks, msg, seq, uses, defs, future, site))

    @property
    def messages(self) -> list[tuple[tuple, object, list, list]]:
        """The kept ops as a recording holds them: ``(ranks, message, uses, defs)``."""
        return [(tuple(ranks), msg, list(uses), list(defs)) for ranks, msg, _, uses, defs, _, _ in self.entries]

    def _guard(self, guard: Guard, read: tuple) -> bool:
        """Whether the read (``submit``'s ranks, message, uses, defs; a SendValue) becomes
        ``guard``: then the ops kept so far are sent (kept too, for the recording) and the read
        goes out; the trace goes on."""
        ranks, msg, uses, defs = read
        if type(msg) is not m.SendValue:
            return False
        live = live_after(self.created)
        if any(not isinstance(self.metas[r.id][0], TensorMeta) for r in live):
            return False  # a sparse tensor crosses the read: its per-call proxy has no fixed shape
        if not guard.bind_trace(self.seen, self.metas):
            return False
        guard.message = (tuple(ranks), msg, list(uses), list(defs))
        guard.index = len(self.entries)
        guard.carried = [r.id for r in live]
        guard.carried_aliases = [r.aliases for r in live]
        self.send_sofar()
        return True

    def send_sofar(self) -> None:
        """Send the entries not sent yet, keeping them: they are part of the recording too."""
        client = self.client
        with client.lock:
            for ranks, msg, seq, uses, defs, future, site in self.entries[self.sent:]:
                client.submit(ranks, msg, seq, uses, defs, future, (), False, (), site)
            self.sent = len(self.entries)

    def hold_delete(self, ref: int, mesh) -> bool:
        """Whether the free of ``ref`` (a proxy died) waits for the trace's outcome: refs the
        trace made are unknown to the workers until its ops are sent, if they ever are."""
        held = self.held_deletes
        if held is None or (ref < self.first_ref and not self.finished):
            return False
        held.append((ref, mesh))
        return True

    def send_eagerly(self) -> None:
        """Send every op kept and not sent yet as the client would have, and stop keeping: the
        call runs eagerly from here on (the entries stay, for a recording of a guarded call)."""
        client = self.client
        with client.lock:
            set_sink(client, client)
            self.send_sofar()
            held, self.held_deletes = self.held_deletes, None
            if client.delete_holder is self:
                client.delete_holder = None
            for ref, mesh in held or ():
                client.delete_ref(ref, mesh)

    def release(self, recorded: bool) -> None:
        """The outcome is queued: stop being the sink and send the frees held back.  Where the
        trace became a recording (``recorded``), the refs it made and freed are the recording's
        own temporaries, which the workers never held by these names."""
        client = self.client
        with client.lock:
            if client.sink is self:
                set_sink(client, client)
            held, self.held_deletes = self.held_deletes, None
            if client.delete_holder is self:
                client.delete_holder = None
            for ref, mesh in held or ():
                if not recorded or ref < self.first_ref:
                    client.delete_ref(ref, mesh)


def host_read_name(msg) -> str:
    """What a host read inside a trace was, for the warning that names it."""
    if type(msg) is not m.SendValue:
        return "a wait for the workers"
    fn = msg.function
    if fn is None:
        return "a fetch (fetch_shard, inspect)"
    if not isinstance(fn, str):
        return "a remote function's value"
    return read_name(fn)


def live_after(refs: list) -> list:
    """The RefOwners among weakrefs ``refs`` that are still alive once the young generations'
    cycles are collected (only if some look alive, so the usual trace pays nothing).  Not a
    full collection: with torch's OpInfo database loaded that takes ~240 ms, against ~1 ms.
    A tensor held only by an older cycle counts as state: its call runs eagerly, still right."""
    alive = [r for r in (w() for w in refs) if r is not None]
    if alive:
        del alive
        gc.collect(1)
        alive = [r for r in (w() for w in refs) if r is not None]
    return alive


def drop_traced_borrows(recorder: Recorder) -> bool:
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


class TraceState:
    """What a finished trace left behind: the tensors it made that outlive the call without
    being returned (``kept``: state), the tensors it read from before the call
    (``captures``, by ref), and why it cannot be a recording (``why_eager``), if it cannot."""

    def __init__(self) -> None:
        self.kept: list = []
        self.kept_refs: list[int] = []
        self.captures: dict[int, Any] = {}
        self.why_eager: str | None = None
        self.way_out = ""


def trace_state(recorder: Recorder, out_flat: list) -> TraceState:
    """Look at what the trace left (``recorder.finished`` holds every free meanwhile): the
    recorder's own strong references go first, so what is alive is what the program holds."""
    state = TraceState()
    returned = {o._r.id for o in out_flat if hasattr(o, "_r")}
    before = {r: weakref.ref(t) for r, t in recorder.seen.items() if r < recorder.first_ref}
    recorder.seen = {}
    state.kept = [r for r in live_after(recorder.created) if r.id not in returned]
    state.kept_refs = [r.id for r in state.kept]
    state.captures = {r: w() for r, w in before.items()}
    gone = sorted(r for r, t in state.captures.items() if t is None)
    if gone:
        state.why_eager = (f"it read tensor {gone[0]} and left it unreachable (a new tensor took its place, as in "
                           f"`self.x = self.x * 0.9 + y`)")
        state.way_out = "update such state in place (`self.x.mul_(0.9).add_(y)`) to compile it"
    elif state.kept:
        state.way_out = ("keep the state it makes the same tensors from call to call (`opt.zero_grad(set_to_none="
                         "False)`, in-place updates), or make it before the first call")
    return state


def forget_trace(recorder: Recorder) -> None:
    """A trace that raised: nothing of it reached the workers, so a tensor it made (and leaked)
    names a ref they never had, which would stop them; make it DROPPED on the client instead."""
    try:
        drop_traced_borrows(recorder)
    except Exception:  # noqa: BLE001 - the function's own error is the one to report
        pass
    site = call_site()
    for ref in recorder.created:
        r = ref()
        if r is not None:
            r.dropped_at = site
