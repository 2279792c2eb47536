"""The client: owns the connections to one fleet, sends batches, and pumps replies.

In the user's process (torchrun's rank 0 spawns it), ops arrive from :func:`tdmesh.engine.issue.issue` at
``sink.submit`` (the client is the sink, except while a compiled function is traced), are recorded in the dataflow
history and appended once to the outbox (:mod:`tdmesh.engine.outbox`), which goes out whole to every child (a
worker, or a host's relay) when it grows, when a value is awaited, or shortly after the user stops issuing ops.
A reader thread turns frames into inbox messages, applied (a handler per message) under the lock by a waiting
thread (``pump``) or a probe's drain.
"""

from __future__ import annotations

import logging
import pickle
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..config import ControllerParams, SupervisionParams
from ..errors import DeviceException, UsageError, call_site, forget_callers, frames, site_text
from ..garbage import release_for_client
from ..protocol import messages as m
from ..protocol.transport import Connection, encode
from . import coalescing
from .debugging import Debugger
from .flusher import flush_loop
from .forks import client_started
from .future import Future
from .history import History
from .observation import Observations
from .outbox import Outbox, flush_interval
from .reader import Inbox, read_loop
from .supervisor import FleetFailure, FleetInfo, Supervisor, WorkerLost
from .tasks import Tasks

log = logging.getLogger("tdmesh")

_FLUSH_BYTES = 256 * 1024
_BARE = (m.CallOp, m.CallRecording)
# A coalescing block streams in batches of this size (~400 CallOps): the workers start on a long block
# within milliseconds (256 KiB held ~6,500 back: slower than plain dispatch), ~100x fewer frames than ops.
_COALESCED_BATCH_BYTES = 16 * 1024
_PROBE_RECHECK = 16  # ops between two looks at whether the last probe was answered, once one is due
_LOOK_AGAIN = 0.05  # s between a waiting pump's looks at until(): another thread may apply what it awaits
_dumps, _PROTOCOL = pickle.dumps, pickle.HIGHEST_PROTOCOL  # transport.encode, without the call: once per op
_monotonic = time.monotonic


class Client:
    """``conns`` are the client's children, keyed by the first rank behind each: a worker, or a
    host's relay (``relays`` maps those keys to the ranks behind them)."""

    def __init__(self, conns: dict[int, Connection], hellos: dict[int, m.Hello], log_dir: str | None = None,
                 on_shutdown: Callable[[], None] | None = None, supervision: SupervisionParams | None = None,
                 controller: ControllerParams | None = None,
                 process_failure: Callable[[], str | None] | None = None, relays: dict | None = None,
                 failed_ranks: Callable[[], tuple[int, ...]] | None = None) -> None:
        self.lock = threading.RLock()
        self.conns = conns
        self.hellos = hellos
        self.relays = relays or {}
        self.info = FleetInfo(hellos, log_dir, process_failure, self.relays, failed_ranks, self.site_of)
        self.ranks = sorted(hellos)
        self.children = sorted(conns)
        device = hellos[self.ranks[0]].device
        self.device = torch.device("cuda", 0) if device.startswith("cuda") else torch.device("cpu")
        self.device_type = sys.intern(self.device.type)  # interned: op plans are checked by identity (dispatch.py)
        self.next_ref = 1
        self._next_seq = 0
        self.outbox = Outbox(tuple(self.ranks))
        self._last_flush = time.monotonic()
        self.flush_interval = flush_interval(hellos)  # seconds between timed sends while a thread issues
        self._deletes: dict[object, tuple] = {}   # mesh -> (mesh, [refs]): DeviceMesh hashes by identity
        self._groups: dict = {}                   # CreateGroups key -> id, for keys already sent
        self.op_numbers: dict = {}                # OpPlan -> its number in grad mode (DefineOp sent)...
        self.op_numbers_no_grad: dict = {}        # ...and outside it
        self.sink = self                          # where issued ops go: a Recorder while tracing,
        self.delete_holder = None                 # which holds frees until its outcome is queued
        self.history = History(self.children)
        self.inbox = Inbox()
        self.failure: DeviceException | None = None
        self.closed = False
        self._on_shutdown = on_shutdown
        self.exiting = False
        self.reading: tuple[int, float] | None = None  # (child, since when) while the reader is inside its frame
        self.supervision = supervision or SupervisionParams.from_env()
        self.controller = controller or ControllerParams.from_env()
        self._ops_since_probe = 0
        self._last_probe_seq = -1
        self._last_queued = self._last_flush
        self._probe_every = self.controller.ops_per_progress_request
        self.debugger = Debugger(self)
        self.observations = Observations(self)  # samples and stacks for tdmesh.dashboard / tdmesh.stacks
        self.tasks = Tasks(self)  # workers' background work (async checkpoint writes)
        self.supervisor = Supervisor(self, self.supervision, self.controller, process_failure)
        self._reader = threading.Thread(target=read_loop, args=(self,), name="tdmesh-reader", daemon=True)
        self._reader.start()
        self._flusher_idle = False  # the flusher waits on _work_queued, not the clock (flusher.py)
        self._work_queued = threading.Event()
        self._flusher = threading.Thread(target=flush_loop, args=(self,), name="tdmesh-flusher", daemon=True)
        self._flusher.start()
        self._handlers: dict[type, Callable[[int, Any], None]] = {
            m.Status: self.Status, m.FetchResult: self.FetchResult, m.RemoteFunctionFailed: self.RemoteFunctionFailed,
            WorkerLost: self.WorkerLost, FleetFailure: self.FleetFailure, **self.debugger.handlers,
            **self.tasks.handlers}
        for key in self.relays:
            conns[key].send_control(m.RelayConfig(*self.supervision))
        self.send_setup(m.Supervise(self.supervision.heartbeat_interval))
        self.flush()
        client_started(self)  # fewer full collections while it is live; closed in a forked child (forks.py)

    def new_ref(self) -> int:
        """Refs only grow: a ref >= ``next_ref`` now is one made from now on (see recording.py)."""
        ref = self.next_ref
        self.next_ref = ref + 1
        return ref

    def new_seq(self) -> int:
        seq = self._next_seq
        self._next_seq = seq + 1
        return seq

    @property
    def last_seq(self) -> int:
        """The seq of the op issued last."""
        return self._next_seq - 1

    def check_usable(self) -> None:
        """Raise the fleet's failure (now observed) or refuse an exited mesh."""
        if self.failure is not None:
            self.failure.observed = True
            raise self.failure
        if self.closed:
            raise UsageError("this mesh has exited; its tensors can no longer be used")

    def submit(self, ranks, msg, seq: int | None = None, uses=(), defs=(), future: Future | None = None,
               inputs=(), deletes_first: bool = False, outputs=(), site=None) -> None:
        """The sink's one method: record op ``seq`` (if any) in the history and queue ``msg`` for ``ranks``.
        Frees of dead proxies go in one DeleteRefs per flush (refs are never reused), first with ``deletes_first``;
        ``inputs``/``outputs`` (proxies read, made) matter to a recorder only; ``site``: the caller's call site."""
        with self.lock:
            if self.failure is not None or self.closed:
                self.check_usable()
            if deletes_first and self._deletes:
                self._queue_deletes()
            if seq is not None:
                self.history.add(seq, uses, defs, site if site is not None else call_site(hold=True), future)
            outbox = self.outbox
            found = outbox.known.get(id(ranks))  # Outbox.set_id's first lookup, inlined: once per op
            set_id = found[1] if found is not None and found[0] is ranks else outbox.set_id(ranks)
            if type(msg) is m.CallFunction:  # may carry an upload's bytes (dispatch.ship_local): sent from its memory
                outbox.append_message(set_id, msg)
            else:  # CallOps and CallRecordings travel as bare tuples (see messages.CallOp)
                outbox.append(set_id, _dumps(tuple(msg) if type(msg) in _BARE else msg, _PROTOCOL))
            self._queued(seq)

    def queue_op(self, ranks, op: int, result: int, refs: tuple, stream: int, site) -> None:
        """``submit`` of the CallOp of plan number ``op`` reading ``refs`` and defining ``result``, the
        eager hot path's (``issue.issue_lean``, which holds the lock): its seq is taken here."""
        if self.failure is not None or self.closed:
            self.check_usable()
        seq = self._next_seq
        self._next_seq = seq + 1
        self.history.add(seq, refs, (result,), site)
        self.outbox.append_call_op(ranks, seq, op, result, refs, stream)
        self._queued(seq)

    def _queued(self, seq: int | None) -> None:
        """After a message is queued (the caller holds the lock): wake an idle flusher, probe progress every so many
        ops once the last probe is answered, send when enough is queued or the interval passed (flusher.py)."""
        if self._flusher_idle:
            self._wake_flusher()
        if seq is not None:
            self._ops_since_probe += 1
            if self._ops_since_probe >= self._probe_every:
                if self.supervisor.answered(self._last_probe_seq):
                    self._queue_probe(seq)  # after the op itself: the probe must not overtake it
                else:
                    self._ops_since_probe -= _PROBE_RECHECK
        if coalescing._depth:  # coalescing.depth(), without the call: once per op
            coalescing.clients().add(self)
            if self.outbox.bytes > _COALESCED_BATCH_BYTES:  # a long block streams: the workers start on it
                self.flush()
        else:
            now = self._last_queued = _monotonic()
            if self.outbox.bytes > _FLUSH_BYTES or now - self._last_flush > self.flush_interval:
                self.flush()

    def send_setup(self, msg, ranks=None) -> None:
        """A message that sets the fleet up (groups, recordings, supervision): never part of a
        compiled function, so it bypasses the sink."""
        with self.lock:
            self.check_usable()
            self.outbox.put(self.ranks if ranks is None else ranks, encode(msg))
            if self._flusher_idle:
                self._wake_flusher()

    def _queue_probe(self, seq: int) -> None:
        """A RequestStatus after ``seq``: progress for the supervisor and completion for the
        history, so long runs without fetches keep both current (and memory flat)."""
        self._ops_since_probe = 0
        self._last_probe_seq = seq
        self.outbox.put_all(encode(m.RequestStatus(seq)))
        self.supervisor.probed(seq)
        self._drain_inbox()

    def send_probe(self) -> None:
        """From the supervisor thread: probe progress if the user is not sending anything."""
        if self.lock.acquire(timeout=0.1):
            try:  # a coalescing block's messages stay held: the block's exit sends them
                if not self.closed and self.failure is None and self._next_seq and not self.coalescing_held():
                    self._queue_probe(self._next_seq - 1)
                    self.flush()
            finally:
                self.lock.release()

    def outstanding_work(self, frontier: int) -> bool:
        return self._next_seq > frontier

    def _drain_inbox(self) -> int:
        """Apply whatever replies already arrived, without waiting (caller holds the lock); how many."""
        return self.inbox.drain(self._apply)

    def ensure_groups(self, kind: str, stream: int, mesh=None, dims: tuple = (), ref=None,
                      to_stream=None) -> int:
        """Have every rank create the process groups of this key, once; returns the key's id."""
        key = (kind, stream, mesh, dims, ref, to_stream)
        found = self._groups.get(key)
        if found is None:
            with self.lock:
                found = self._groups.get(key)
                if found is None:
                    found = self._groups[key] = len(self._groups) + 1
                    self.send_setup(m.CreateGroups(kind, stream, mesh, dims, ref, to_stream, found))
        return found

    def define_op(self, plan, grad: bool = True) -> int:
        """Number an op plan and define it on every rank (before any CallOp names it), in grad mode ``grad``."""
        with self.lock:
            number = len(self.op_numbers) + len(self.op_numbers_no_grad) + 1
            (self.op_numbers if grad else self.op_numbers_no_grad)[plan] = number
            self.send_setup(m.DefineOp(number, plan.path, plan.args, plan.kwargs, grad))
        return number

    def delete_ref(self, ref: int, mesh) -> None:
        """Called when a proxy dies (any thread): batched into the next flush."""
        if self.closed:
            return
        holder = self.delete_holder
        if holder is not None and holder.hold_delete(ref, mesh):  # a trace is pending (programs.tracing)
            return
        (self._deletes.get(mesh) or self._deletes.setdefault(mesh, (mesh, [])))[1].append(ref)
        if self._flusher_idle:
            self._wake_flusher()

    def delete_refs(self, refs, mesh) -> None:
        for ref in refs:
            self.delete_ref(ref, mesh)

    def _queue_deletes(self) -> None:
        deletes, self._deletes = self._deletes, {}
        for mesh, refs in deletes.values():
            if refs:
                self.history.forget_refs(refs)
                self.outbox.put(mesh.rank_list, encode(m.DeleteRefs(tuple(refs))))

    def pending_messages(self) -> int:
        """Messages queued and not yet sent (each once, whatever the ranks it goes to)."""
        return self.outbox.pending()

    def flush(self) -> None:
        forget_callers()  # the frame call_site holds: a returned one's proxies die here, their frees sent now
        with self.lock:
            if self._deletes:
                self._queue_deletes()
            self._last_flush = time.monotonic()
            if not self.outbox.log:
                return
            parts, crc, bulk = self.outbox.take_frame()
            for key, conn in self.conns.items():
                try:
                    conn.send_parts(parts, crc, bulk)
                except OSError as e:
                    # A dead process shows first as a broken pipe; the launcher's exit code
                    # or signal, when it comes within a moment, says more.
                    self._fail_fleet(self.info.lost(key, self.info.exit_reason() or f"sending to it failed: {e}"))
            self.outbox.sent(sum(memoryview(p).nbytes for p in parts), len(self.conns))

    def _wake_flusher(self) -> None:
        """Something is queued for an idle flusher (a check of ``_flusher_idle`` first: one attribute
        read per op, the event only after an idle spell)."""
        self._flusher_idle = False
        self._work_queued.set()

    def coalescing_held(self) -> bool:
        """True while a coalescing block holds this client's messages back."""
        return self in coalescing.held_clients

    def pump(self, timeout: float | None = 0, until: Callable[[], bool] | None = None) -> None:
        """Apply worker replies to the history until ``until()`` holds or ``timeout`` passes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.flush()
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = remaining if until is None else _LOOK_AGAIN if remaining is None else min(_LOOK_AGAIN, remaining)
            inbox = self.inbox
            arrived = not inbox.empty() or inbox.arrived.wait(wait)  # waited outside the lock, taken under it
            if arrived:
                with self.lock:
                    inbox.arrived.clear()
                    arrived = self._drain_inbox() > 0
            if not arrived:  # with until: a probe's drain on another thread may have applied what this awaits,
                if until is None or until() or wait == remaining:  # and a relay sends no Status that is not new
                    return
                continue
            if until is not None and until():
                return

    def _apply(self, rank: int, msg) -> None:
        handler = self._handlers.get(type(msg))
        if handler is not None:
            return handler(rank, msg)
        self._fail_fleet(DeviceException(f"{self.info.name(rank)} sent an unexpected {type(msg).__name__}: {msg!r}"))

    # handlers of worker->client messages (and the reader's and supervisor's inbox items)
    def Status(self, rank: int, msg: m.Status) -> None:
        for node in self.history.status(msg):
            self.history.resolve(node)

    def FetchResult(self, rank: int, msg: m.FetchResult) -> None:
        self.history.set_value(msg, rank)

    def RemoteFunctionFailed(self, rank: int, msg: m.RemoteFunctionFailed) -> None:
        self.history.fail(msg, frames)
        self.observations.last_error = self.history.unobserved.get(msg.seq, self.observations.last_error)

    def WorkerLost(self, rank: int, msg: WorkerLost) -> None:
        self.observations.lost(msg.ranks or (rank,))
        if not self.closed:
            self._fail_fleet(self.info.lost(rank, msg.why, msg.ranks))

    def FleetFailure(self, rank: int, msg: FleetFailure) -> None:
        self._fail_fleet(msg.error)

    def site_of(self, seq: int) -> str:
        """The user's line that issued op ``seq``, while the op is not complete."""
        return site_text(self.history.site_of(seq))

    def fail_from_supervisor(self, exc: DeviceException) -> None:
        """From the supervisor (or reader) thread: the fleet is broken; wake whoever waits."""
        if self.exiting:
            return
        if self.failure is None:
            self.failure = exc
        self.inbox.put((-1, FleetFailure(exc)))

    def _fail_fleet(self, exc: DeviceException) -> None:
        if self.failure is None:
            self.failure = self.observations.last_error = exc
        self.tasks.fail(self.failure)
        for fut in self.history.pending_futures():
            if not fut._finished():
                fut._set_exception(self.failure)

    def request_status(self, seq: int) -> None:
        """Every rank answers once all it was sent before this has run."""
        self.sink.submit(self.ranks, m.RequestStatus(seq))

    def shutdown(self, error: str | None = None, timeout: float = 30.0, detach: bool = False) -> None:
        """Stop every worker (or, with ``detach``, release them for the next client); idempotent."""
        if self.closed:
            return
        if self.failure is None:
            self.tasks.wait_all(timeout)  # a checkpoint being written is finished first
        self.exiting, self.observations.parked = True, detach
        try:
            if self.failure is None:
                with self.lock:
                    self._queue_deletes()
                    self.outbox.put_all(encode(m.Detach() if detach else m.Exit(error)))
                    self.flush()
                self._reader.join(timeout)
        finally:
            self.closed = True
            release_for_client()
            self._work_queued.set()  # the flusher sees closed and ends
            for conn in self.conns.values():
                conn.close()
            if self._on_shutdown is not None:
                self._on_shutdown()

