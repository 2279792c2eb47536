"""The worker's message interpreter: a ref table and one handler per message.

Values that could not be computed are stored as :class:`Poison`.  Only the op that raised
reports ``RemoteFunctionFailed``; ops that read a poisoned ref poison their own results
silently, because the client's dataflow history already knows they depend on the root.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..errors import ProtocolViolation, RecordingError
from ..protocol import messages as m
from ..protocol.codec import pickle_value
from ..protocol.lastop import Slot
from . import collectives, healing
from .backward import remote_results
from .borrows import Borrows
from .debugger import Console
from .functions import resolve, take_part_when_poisoned
from .groups import Groups
from .mesh import WorkerMesh
from .observing import Observer
from .ops import DefinedOp, slot_values
from .recordings import Recordings
from .streams import Stream
from .tasks import Tasks
from .values import DependentOnError, DeviceBroken, Poison, bind_results, device_is_broken, to_fetchable, unseal

log = logging.getLogger("tdmesh.worker")
_CALL_OP_FIELDS = len(m.CallOp._fields)
_CALL_RECORDING_FIELDS = len(m.CallRecording._fields)
_grad_enabled = torch._C.is_grad_enabled
_set_grad = torch._C._set_grad_enabled


class Interpreter:
    """Executes client messages for one worker rank.

    The message thread routes each message to the stream(s) it names; each stream runs its
    work in order on its own thread (``threaded=False`` runs everything inline, for unit
    tests).  ``send`` delivers a worker->client message and may be called from any stream.
    """

    current: Interpreter | None = None  # this process's interpreter, for builtins that report on it

    def __init__(self, rank: int, device: torch.device, send: Callable[[Any], None], *,
                 world_size: int = 1, threaded: bool = False,
                 on_fatal: Callable[[], None] | None = None) -> None:
        Interpreter.current = self
        self._wake = on_fatal  # wakes the message loop, which then leaves
        self.rank = rank
        self.device = device
        self.send = send
        self.threaded = threaded
        self.streams: dict[int, Stream] = {}
        self._streams_lock = threading.Lock()
        self.groups = Groups(rank, world_size)
        self.borrows = Borrows(rank)
        self.recordings = Recordings()
        self.tasks = Tasks(rank, send)
        self.ops: dict[int, DefinedOp] = {}
        self.console = Console(rank, send)  # breakpoint() in a remote function: see loop._session
        self.observer = Observer(self)  # the dashboard's samples and tdmesh.stacks, only when asked
        self.last_op = Slot(threaded)  # for the client's diagnosis if this process dies (protocol/lastop.py)
        self.caused_error = False
        self.fatal: BaseException | None = None
        self.exit_request: m.Exit | m.Detach | m.Heal | None = None
        self._handlers = {cls: getattr(self, cls.__name__) for cls in m.CLIENT_TO_WORKER}
        self._work: dict[type, Callable[[Any, Stream], None]] = {
            m.CallOp: self._call_op, m.CallFunction: self._call_function, m.Reduce: self._reduce,
            m.ReduceMany: self._reduce_many, m.DeleteRefs: self._delete_refs}
        self.stream(0)

    @property
    def env(self) -> dict:
        """The default stream's refs."""
        return self.streams[0].env

    def stream(self, stream_id: int) -> Stream:
        s = self.streams.get(stream_id)
        if s is None:
            # Stream threads look streams up too (to_mesh reads/writes another stream's refs):
            # two threads must never each create their own copy of one stream.
            with self._streams_lock:
                s = self.streams.get(stream_id)
                if s is None:
                    s = self.streams[stream_id] = Stream(stream_id, self.device, self._on_fatal, self.threaded)
        return s

    def _on_fatal(self, error: BaseException) -> None:
        if self.fatal is None:
            self.fatal = error
            if self._wake is not None:
                self._wake()

    # -- routing (message thread) -----------------------------------------------------------
    def handle(self, msg) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            if type(msg) is tuple and len(msg) == _CALL_OP_FIELDS:  # a CallOp travels as a bare tuple
                return self.CallOp(msg)
            if type(msg) is tuple and len(msg) == _CALL_RECORDING_FIELDS:  # and so does a CallRecording
                return self.CallRecording(m.CallRecording._make(msg))
            raise ProtocolViolation(f"worker {self.rank} got an unknown message {type(msg).__name__}: {msg!r}")
        handler(msg)

    # handlers: named after the messages they handle
    def CallFunction(self, msg: m.CallFunction) -> None:
        self.stream(msg.stream).submit(self._call_function, msg)

    def DefineOp(self, msg: m.DefineOp) -> None:
        self.ops[msg.op] = DefinedOp(msg, self.device)  # a new client's numbers replace an old one's

    def CallOp(self, msg: m.CallOp | tuple) -> None:
        self.stream(msg[5]).submit(self._call_op, msg)

    def SendValue(self, msg: m.SendValue) -> None:
        self.stream(msg.stream).submit(self._send_value, msg)

    def Reduce(self, msg: m.Reduce) -> None:
        self.stream(msg.stream).submit(self._reduce, msg)

    def ReduceMany(self, msg: m.ReduceMany) -> None:
        self.stream(msg.stream).submit(self._reduce_many, msg)

    def SendTensor(self, msg: m.SendTensor) -> None:
        sends = self.rank in msg.from_ranks
        receives = collectives.binds_result(msg, self.rank)
        if sends and receives and msg.from_stream != msg.to_stream:
            self.stream(msg.to_stream).submit(self._unsupported_p2p, msg)
            return
        self.stream(msg.from_stream if sends else msg.to_stream).submit(self._send_tensor, msg)

    def CreateGroups(self, msg: m.CreateGroups) -> None:
        self.groups.create(msg)  # collective over every rank: here, in message order

    def DropGroups(self, msg: m.DropGroups) -> None:
        for stream_id in self.groups.streams_of(msg.ref):  # each after the work queued there, which may use it
            self.stream(stream_id).submit(lambda ref, stream: self.groups.drop(ref, stream.id), msg.ref)

    def DefineRecording(self, msg: m.DefineRecording) -> None:
        try:
            self.recordings.define(msg)
        except RecordingError as e:
            raise ProtocolViolation(str(e)) from None

    def CallRecording(self, msg: m.CallRecording) -> None:
        try:
            program = self.recordings.program(msg, self)
            if program is not None:
                return self.stream(program.stream).submit(program.call, msg)
            commands, temporaries, _ = self.recordings.expand(msg)
        except RecordingError as e:
            raise ProtocolViolation(str(e)) from None
        for command in commands:
            self.handle(command)
        if temporaries:
            self.DeleteRefs(m.DeleteRefs(tuple(temporaries)))

    def BorrowCreate(self, msg: m.BorrowCreate) -> None:
        self.borrows.add(msg)
        self.stream(msg.from_stream).submit(self.borrows.create, msg)

    def BorrowFirstUse(self, msg: m.BorrowFirstUse) -> None:
        self.stream(self.borrows.slot(msg.borrow).msg.to_stream).submit(self.borrows.first_use, msg)

    def BorrowLastUse(self, msg: m.BorrowLastUse) -> None:
        self.stream(self.borrows.slot(msg.borrow).msg.to_stream).submit(self.borrows.last_use, msg)

    def BorrowDrop(self, msg: m.BorrowDrop) -> None:
        self.stream(self.borrows.slot(msg.borrow).msg.from_stream).submit(self.borrows.drop, msg)

    def DeleteRefs(self, msg: m.DeleteRefs) -> None:
        for s in list(self.streams.values()):
            s.submit(self._delete_refs, msg)

    def RequestStatus(self, msg: m.RequestStatus) -> None:
        streams = list(self.streams.values())
        pending = [len(streams), threading.Lock()]
        for s in streams:
            s.submit(self._status_marker, (msg, pending))

    def DebuggerInput(self, msg: m.DebuggerInput) -> None:
        self.console.lines.put(msg.line)  # for the stream stopped in pdb, which is waiting for it

    def Supervise(self, msg: m.Supervise) -> None:
        """Heartbeats come from a thread of their own: a busy stream is not a dead worker."""
        def beat() -> None:
            while self.exit_request is None and self.fatal is None:
                try:
                    self.send(m.Heartbeat(self.rank))
                except OSError:
                    return
                time.sleep(msg.heartbeat_interval)
        threading.Thread(target=beat, name="tdmesh-heartbeat", daemon=True).start()

    def Observe(self, msg: m.Observe) -> None:
        self.observer.observe(msg)

    def RequestStacks(self, msg: m.RequestStacks) -> None:
        self.observer.stacks(msg)

    def Detach(self, msg: m.Detach | m.Exit) -> None:
        """End the session once every stream drained and every async checkpoint is written; Detach forgets values."""
        for s in list(self.streams.values()):
            s.close()
            if type(msg) is m.Detach:
                s.env.clear()
        self.tasks.join()
        self.exit_request = msg

    Exit = Detach

    def Heal(self, msg: m.Heal) -> None:
        """A worker died (``tdmesh.FaultTolerance``): leave now, keeping the state (``worker/healing``)."""
        healing.leave(self)
        self.exit_request = msg

    # -- work (stream threads) -----------------------------------------------------------------
    def stream_work(self, msg, stream: Stream) -> None:
        """Run one message of a recording's call directly on ``stream`` (its thread is running it)."""
        self._work[type(msg)](msg, stream)

    def _call_function(self, msg: m.CallFunction, stream: Stream) -> None:
        self.last_op.note(msg.seq)
        env = stream.env
        fn = raw_args = raw_kwargs = None
        try:
            fn = resolve(msg.function)
            raw_args, raw_kwargs = unseal(msg.args, msg.kwargs)
            args = self._resolve(raw_args, stream)
            kwargs = self._resolve(raw_kwargs, stream) if raw_kwargs else {}
            _set_grad(msg.grad)
            value = fn(*args, **kwargs)
            if not isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):  # a remote function
                value = remote_results(value, msg.expect, msg.function)
            self._bind(env, msg.results, value, msg.function)
        except DependentOnError as e:
            self._poison(env, msg.results, msg.mutates, e.poison)
            take_part_when_poisoned(fn, raw_args, raw_kwargs, self.device, self.rank)
        except ProtocolViolation:
            raise  # a broken message, not a failing user function: the worker stops
        except Exception as e:  # noqa: BLE001 - whatever the user's function raises is its failure
            self.fail(env, msg.seq, msg.results, msg.mutates, e, msg.function)

    def _call_op(self, msg: m.CallOp | tuple, stream: Stream) -> None:
        seq, op_id, results, mutates, refs, _ = msg
        env = stream.env
        op = self.ops.get(op_id)
        if op is None or op.slots != len(refs):
            raise ProtocolViolation(f"op {op_id} is not defined on worker {self.rank}" if op is None else
                                    f"op {op_id} ({op.function}) takes {op.slots} refs, got {len(refs)}")
        if op.grad is not _grad_enabled():  # the client's grad mode when it issued the op
            _set_grad(op.grad)
        try:
            self._bind(env, results, op.run(slot_values(env, refs, stream.id, self.rank)))
        except DependentOnError as e:
            self._poison(env, results, mutates, e.poison)
        except ProtocolViolation:
            raise
        except Exception as e:  # noqa: BLE001 - the op's own failure
            self.fail(env, seq, results, mutates, e, op.function)

    def _send_value(self, msg: m.SendValue, stream: Stream) -> None:
        env = stream.env
        try:
            fn = resolve(msg.function) if msg.function is not None else None
            raw_args, raw_kwargs = unseal(msg.args, msg.kwargs)
            args = self._resolve(raw_args, stream)
            kwargs = self._resolve(raw_kwargs, stream) if raw_kwargs else {}
            if fn is None:
                if len(args) != 1 or kwargs:
                    raise ProtocolViolation("SendValue without a function takes exactly one argument")
                value = args[0]
            else:
                value = fn(*args, **kwargs)
            payload = pickle_value(tree_map(to_fetchable, value))  # big tensors beside the pickle, not in it
        except DependentOnError as e:
            self._poison(env, (), msg.mutates, e.poison)
            self.send(m.FetchResult(msg.seq, None, m.DependentError(e.poison.seq), self.rank))
            return
        except ProtocolViolation:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the user's function raises is its failure
            self.fail(env, msg.seq, (), msg.mutates, e, msg.function)
            self.send(m.FetchResult(msg.seq, None, m.DependentError(msg.seq), self.rank))
            return
        self.send(m.FetchResult(msg.seq, payload, None, self.rank))

    def _reduce(self, msg: m.Reduce, stream: Stream) -> None:
        error = self._collective(collectives.reduce, msg, stream.env)
        if error is not None:
            targets = (msg.result,) if msg.result is not None else ()
            self.fail(stream.env, msg.seq, targets, (msg.out,) if msg.out is not None else (), error, "reduce")

    def _reduce_many(self, msg: m.ReduceMany, stream: Stream) -> None:
        error = self._collective(collectives.reduce_many, msg, stream.env)
        if error is not None:
            self.fail(stream.env, msg.seq, (), msg.tensors, error, "reduce")

    def _send_tensor(self, msg: m.SendTensor, stream: Stream) -> None:
        error = self._collective(collectives.send_tensor, msg, stream)
        if error is not None:
            receives = collectives.binds_result(msg, self.rank)
            env = self.stream(msg.to_stream).env if receives else stream.env
            self.fail(env, msg.seq, (msg.result,) if receives else (), (), error, "to_mesh")

    def _collective(self, run, msg, where) -> Exception | None:
        """Run one collective (on a stream, or on the ref table ``where``); its error, if it raised
        one that the user's values caused (a broken message is a ProtocolViolation and ends the worker)."""
        self.last_op.note(msg.seq)
        try:
            with torch.no_grad():  # it may write a leaf that requires grad here (a parameter), as c10d may
                run(self, msg, where)
        except ProtocolViolation:
            raise
        except Exception as e:  # noqa: BLE001 - reported against the op's seq by the caller
            return e
        return None

    def _unsupported_p2p(self, msg: m.SendTensor, stream: Stream) -> None:
        error = NotImplementedError(f"to_mesh: rank {self.rank} would send on stream {msg.from_stream} and receive "
                                    f"on stream {msg.to_stream}; move within one stream")
        self.fail(stream.env, msg.seq, (msg.result,), (), error, "to_mesh")

    def _delete_refs(self, msg: m.DeleteRefs, stream: Stream) -> None:
        env = stream.env
        for ref in msg.refs:
            env.pop(ref, None)

    def _status_marker(self, item, stream: Stream) -> None:
        msg, pending = item
        with pending[1]:
            pending[0] -= 1
            last = pending[0] == 0
        if last:
            self.send(m.Status(self.rank, msg.seq + 1))

    # -- helpers ---------------------------------------------------------------------------
    def _resolve(self, obj, stream: Stream):
        t = type(obj)
        if t is m.Ref:
            try:
                value = stream.env[obj.id]
            except KeyError:
                raise ProtocolViolation(f"ref {obj.id} is not defined on stream {stream.id} of worker {self.rank}: "
                                        f"it was deleted or never created") from None
            if type(value) is Poison:
                raise DependentOnError(value)
            return value
        if t is tuple or t is list:
            return t(self._resolve(x, stream) for x in obj)
        if t is dict:
            return {k: self._resolve(v, stream) for k, v in obj.items()}
        if t is m.MeshArg:
            return WorkerMesh(obj.shape, self.rank, self.device)
        if t is m.ProcessGroupArg:
            return self.groups.remote(obj.ref, stream.id)
        if t is m.TorchMeshArg:
            return self.groups.torch_mesh(stream.id, obj.mesh, self.device)
        if t is torch.device and obj.type != "cpu":
            return self.device
        if isinstance(obj, tuple):  # a NamedTuple or a torch.return_types value holding refs
            items = [self._resolve(x, stream) for x in obj]
            return t(*items) if hasattr(obj, "_fields") else t(items)
        if isinstance(obj, dict):  # an OrderedDict (a module's state_dict())
            return t((k, self._resolve(v, stream)) for k, v in obj.items())
        return obj

    _bind = staticmethod(bind_results)

    @staticmethod
    def _poison(env: dict, results, mutates, poison: Poison) -> None:
        for ref in results:
            if ref is not None:
                env[ref] = poison
        for ref in mutates:
            env[ref] = poison

    def fail(self, env: dict, seq, results, mutates, error: BaseException, function) -> None:
        self.caused_error = True
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        name = function if isinstance(function, str) else getattr(function, "__qualname__", "a pickled function")
        self._poison(env, results, mutates, Poison(seq, f"{type(error).__name__}: {error}"))
        if device_is_broken(self.device, error):
            log.error("seq %s on worker %s running %s broke the device; leaving:\n%s", seq, self.rank, name, tb)
            self.send(m.WorkerFailed(seq, self.rank, name, type(error).__name__, str(error), tb))
            self._on_fatal(DeviceBroken(f"{type(error).__name__}: {error}"))
            return
        log.debug("seq %s failed on worker %s running %s:\n%s", seq, self.rank, name, tb)
        self.send(m.RemoteFunctionFailed(seq, self.rank, type(error).__name__, str(error), tb))
