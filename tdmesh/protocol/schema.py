"""What a well-formed message looks like: one entry per record of ``tdmesh.protocol.messages``.

Authentication says a peer is ours, not that its frames are sound: a bug, a version
mismatch or a corrupt frame can still deliver a record whose fields have the wrong types,
the wrong count or absurd sizes.  Unchecked, such a value fails far from its cause (a
``KeyError`` deep in a stream thread, a ``TypeError`` in the client's history); checked
here, on arrival, it ends that peer's session with an error naming the record and field.

``CLIENT_SCHEMA`` (checked by workers) and ``WORKER_SCHEMA`` (by the client, and by relays
on the frames they open) map each record to ``{field: kind}`` in field order; a new record
or field needs its entry here (``tests/unit/test_fuzz.py`` fails until it has one).  The
eager hot path's bare-tuple ``CallOp`` has a hand-written check that costs a few hundred
nanoseconds.  Size limits come from ``tdmesh.config`` (``TDMESH_MAX_TEXT``, ``TDMESH_MAX_ITEMS``);
whole frames are bounded by ``TDMESH_MAX_FRAME`` in the transport.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Container
from typing import Any, NamedTuple

from ..config import env_int
from ..errors import ProtocolViolation
from ..geometry.slice import Slice
from . import messages as m
from .transport import decode

__all__ = ["Kind", "CLIENT_SCHEMA", "WORKER_SCHEMA", "RELAY_SCHEMA", "MAX_TEXT", "MAX_ITEMS", "check_client_message",
           "check_worker_message", "check_relay_control", "worker_messages", "received_messages",
           "record_name"]

MAX_TEXT = env_int("TDMESH_MAX_TEXT")    # characters of one string field (an import path, a traceback)
MAX_ITEMS = env_int("TDMESH_MAX_ITEMS")  # entries of one tuple or dict field (refs, arguments, commands)


class Kind(NamedTuple):
    """A field's expected form: ``test(value)`` holds for a well-formed value; ``name`` says what it must be."""
    name: str
    test: Callable[[Any], bool]


def _sized(value) -> bool:
    return len(value) <= MAX_ITEMS


def _is_int(value) -> bool:
    return type(value) is int


def _is_opt_int(value) -> bool:
    return value is None or type(value) is int


def _is_text(value) -> bool:
    return type(value) is str and len(value) <= MAX_TEXT


def _only_ints(values: tuple) -> bool:
    for value in values:
        if type(value) is not int:
            return False
    return True


def _only_ints_or_none(values: tuple) -> bool:
    for value in values:
        if type(value) is not int and value is not None:
            return False
    return True


def _is_ints(value) -> bool:
    return type(value) is tuple and _sized(value) and _only_ints(value)


def _is_factory(value) -> bool:  # (shape, dtype name)
    return type(value) is tuple and len(value) == 2 and _is_ints(value[0]) and _is_text(value[1])


def _is_expected(value) -> bool:  # (shape, dtype name, layout name)
    return type(value) is tuple and len(value) == 3 and _is_ints(value[0]) and _is_text(value[1]) and \
        _is_text(value[2])


INT = Kind("an int", _is_int)
OPT_INT = Kind("an int or None", _is_opt_int)
POSITIVE = Kind("a positive number", lambda v: type(v) in (int, float) and v > 0)
NON_NEGATIVE = Kind("a number >= 0", lambda v: type(v) in (int, float) and v >= 0)
BOOL = Kind("a bool", lambda v: type(v) is bool)
TEXT = Kind(f"a str of at most {MAX_TEXT} characters", _is_text)
OPT_TEXT = Kind(f"None or a str of at most {MAX_TEXT} characters", lambda v: v is None or _is_text(v))
FUNCTION = Kind(f"an import path (a str of at most {MAX_TEXT} characters) or a pickled callable (bytes)",
                lambda v: _is_text(v) or type(v) is bytes)
OPT_FUNCTION = Kind(f"None or {FUNCTION.name}", lambda v: v is None or FUNCTION.test(v))
INTS = Kind(f"a tuple of at most {MAX_ITEMS} ints", _is_ints)
RANKS = Kind(f"a non-empty tuple of at most {MAX_ITEMS} ints", lambda v: _is_ints(v) and len(v) > 0)
OPT_INTS = Kind(f"a tuple of at most {MAX_ITEMS} ints or Nones",
                lambda v: type(v) is tuple and _sized(v) and _only_ints_or_none(v))
TUPLE = Kind(f"a tuple of at most {MAX_ITEMS} entries", lambda v: type(v) is tuple and _sized(v))
ARGS = Kind(f"a tuple of at most {MAX_ITEMS} arguments, or sealed arguments (bytes)",
            lambda v: (type(v) is tuple and _sized(v)) or type(v) is bytes)
KWARGS = Kind(f"a dict of at most {MAX_ITEMS} str keys",
              lambda v: type(v) is dict and _sized(v) and all(type(k) is str for k in v))
SLICE = Kind("a Slice", lambda v: type(v) is Slice)
OPT_SLICE = Kind("a Slice or None", lambda v: v is None or type(v) is Slice)
FACTORY = Kind("a (shape: tuple of ints, dtype: str) pair", _is_factory)
FACTORIES = Kind(f"a tuple of at most {MAX_ITEMS} (shape, dtype) pairs",
                 lambda v: type(v) is tuple and _sized(v) and all(_is_factory(x) for x in v))
PROCESS_GROUPS = Kind(f"a tuple of at most {MAX_ITEMS} ProcessGroupArgs",
                      lambda v: type(v) is tuple and _sized(v) and all(type(x) is m.ProcessGroupArg for x in v))
ANY = Kind("anything", lambda v: True)
EXPECTED = Kind(f"a tuple of at most {MAX_ITEMS} (shape, dtype, layout) triples, {m.OPAQUE!r}s or Nones",
                lambda v: type(v) is tuple and _sized(v) and all(x is None or x == m.OPAQUE or _is_expected(x)
                                                                  for x in v))
NONCE = Kind("bytes of at most 64", lambda v: type(v) is bytes and len(v) <= 64)
OPT_BYTES = Kind("bytes or None", lambda v: v is None or type(v) is bytes)
FETCHED = Kind("bytes, (bytes, buffer, ...) or None",  # codec.pickle_value: big buffers come in a bulk frame
               lambda v: v is None or type(v) is bytes or (type(v) is tuple and len(v) > 1 and type(v[0]) is bytes
                                                          and all(type(b) is memoryview for b in v[1:])))
OPT_DEPENDENT_ERROR = Kind("None or a DependentError",
                           lambda v: v is None or (type(v) is m.DependentError and type(v.seq) is int))
COMMANDS = Kind(f"a tuple of at most {m.MAX_COMMANDS_PER_CHUNK} well-formed client->worker messages",
                lambda v: type(v) is tuple and len(v) <= m.MAX_COMMANDS_PER_CHUNK and all(_well_formed(x) for x in v))
OPTIONS = Kind(f"a tuple of at most {MAX_ITEMS} (name: str, value) pairs",
               lambda v: type(v) is tuple and _sized(v) and all(type(x) is tuple and len(x) == 2 and type(x[0]) is str
                                                                 for x in v))
HELLOS = Kind(f"a tuple of at most {MAX_ITEMS} well-formed Hellos",
              lambda v: type(v) is tuple and _sized(v) and all(type(h) is m.Hello and _problem(h) is None for h in v))

CLIENT_SCHEMA: dict[type, dict[str, Kind]] = {
    m.CallFunction: dict(seq=INT, results=OPT_INTS, mutates=INTS, function=FUNCTION, args=ARGS, kwargs=KWARGS,
                         stream=INT, process_groups=PROCESS_GROUPS, grad=BOOL, expect=EXPECTED),
    m.DefineOp: dict(op=INT, function=TEXT, args=TUPLE, kwargs=KWARGS, grad=BOOL),
    m.CallOp: dict(seq=INT, op=INT, results=OPT_INTS, mutates=INTS, refs=INTS, stream=INT),
    m.SendValue: dict(seq=INT, mutates=INTS, function=OPT_FUNCTION, args=ARGS, kwargs=KWARGS, stream=INT,
                      process_groups=PROCESS_GROUPS),
    m.Reduce: dict(seq=INT, result=OPT_INT, tensor=INT, factory=FACTORY, group=INT, reduction=TEXT, scatter=BOOL,
                   inplace=BOOL, out=OPT_INT, stream=INT),
    m.ReduceMany: dict(seq=INT, tensors=INTS, factories=FACTORIES, group=INT, reduction=TEXT, stream=INT),
    m.SendTensor: dict(seq=INT, result=INT, from_ranks=SLICE, to_ranks=SLICE, tensor=INT, factory=FACTORY,
                       from_stream=INT, to_stream=INT, zeros_on=OPT_SLICE),
    m.CreateGroups: dict(kind=TEXT, stream=INT, mesh=ANY, dims=TUPLE, ref=OPT_INT, to_stream=OPT_INT, id=INT),
    m.DropGroups: dict(ref=INT),
    m.DefineRecording: dict(recording=INT, commands=COMMANDS, formals=INTS, results=INTS, chunk=INT, total=INT,
                            mode=TEXT, options=OPTIONS),
    m.CallRecording: dict(seq=INT, recording=INT, actuals=INTS, results=INTS),
    m.BorrowCreate: dict(result=INT, borrow=INT, tensor=INT, from_stream=INT, to_stream=INT),
    m.BorrowFirstUse: dict(borrow=INT),
    m.BorrowLastUse: dict(borrow=INT),
    m.BorrowDrop: dict(borrow=INT),
    m.DeleteRefs: dict(refs=INTS),
    m.RequestStatus: dict(seq=INT),
    m.DebuggerInput: dict(line=TEXT),
    m.Supervise: dict(heartbeat_interval=POSITIVE),
    m.Observe: dict(interval=NON_NEGATIVE),
    m.RequestStacks: dict(request=INT),
    m.Detach: dict(),
    m.Exit: dict(error=OPT_TEXT),
    m.Heal: dict(scope=TEXT, ranks=TUPLE, world_size=INT),
}

WORKER_SCHEMA: dict[type, dict[str, Kind]] = {
    m.Hello: dict(rank=INT, nonce=NONCE, proof=TEXT, hostname=TEXT, pid=INT, device=TEXT, log=OPT_TEXT),
    m.Heartbeat: dict(rank=INT),
    m.FetchResult: dict(seq=INT, value=FETCHED, error=OPT_DEPENDENT_ERROR, rank=INT),
    m.RemoteFunctionFailed: dict(seq=INT, rank=INT, exc_type=TEXT, message=TEXT, traceback=TEXT),
    m.WorkerFailed: dict(seq=INT, rank=INT, function=TEXT, exc_type=TEXT, message=TEXT, traceback=TEXT),
    m.Status: dict(rank=INT, first_uncompleted=INT),
    m.TaskDone: dict(task=INT, rank=INT, error=OPT_TEXT),
    m.DebuggerRead: dict(rank=INT, output=TEXT),
    m.DebuggerDone: dict(rank=INT, output=TEXT),
    m.RelayHello: dict(host=INT, first=INT, end=INT, nonce=NONCE, proof=TEXT, hellos=HELLOS),
    m.RanksLost: dict(ranks=RANKS, why=TEXT),
    m.Sample: dict(rank=INT, rss=INT, cuda_allocated=INT, cuda_reserved=INT, streams=TUPLE, logs=TUPLE),
    m.Stacks: dict(rank=INT, request=INT, text=TEXT),
}

RELAY_SCHEMA: dict[type, dict[str, Kind]] = {
    m.RelayConfig: dict(heartbeat_interval=POSITIVE, heartbeat_timeout=POSITIVE),
}

_SCHEMAS = {**CLIENT_SCHEMA, **WORKER_SCHEMA, **RELAY_SCHEMA}
_BARE_CALL_OP = len(m.CallOp._fields)
_BARE_CALL_RECORDING = len(m.CallRecording._fields)
_short = reprlib.Repr()
_short.maxstring = _short.maxother = 80


def _problem(msg) -> str | None:
    """What is wrong with ``msg`` (a record of any direction), or None when it is well formed."""
    fields = _SCHEMAS.get(type(msg))
    if fields is None:
        return f"an unknown message type {type(msg).__module__}.{type(msg).__qualname__}: {_short.repr(msg)}"
    name = type(msg).__name__
    if len(msg) != len(fields):
        return f"a {name} with {len(msg)} fields where it has {len(fields)} ({', '.join(fields)})"
    for (field, kind), value in zip(fields.items(), msg):
        if not kind.test(value):
            return f"a {name} whose {field} is {type(value).__name__} {_short.repr(value)}; it must be {kind.name}"
    return None


def _well_formed(msg) -> bool:
    if type(msg) is tuple:  # recordings may hold the hot messages' bare form too
        return _bare_problem(msg) is None
    return type(msg) in CLIENT_SCHEMA and _problem(msg) is None


def _bare_problem(msg: tuple) -> str | None:
    # The hot paths (one message per eager op, per compiled call): spelled out, no loop over kinds.
    if len(msg) == _BARE_CALL_OP:
        seq, op, results, mutates, refs, stream = msg
        if (type(seq) is int and type(op) is int and type(stream) is int and type(results) is tuple
                and type(mutates) is tuple and type(refs) is tuple
                and len(results) + len(mutates) + len(refs) <= MAX_ITEMS
                and _only_ints(refs) and _only_ints(mutates) and _only_ints_or_none(results)):
            return None
        return _problem(m.CallOp._make(msg))
    if len(msg) == _BARE_CALL_RECORDING:
        seq, recording, actuals, results = msg
        if (type(seq) is int and type(recording) is int and type(actuals) is tuple and type(results) is tuple
                and len(actuals) + len(results) <= MAX_ITEMS and _only_ints(actuals) and _only_ints(results)):
            return None
        return _problem(m.CallRecording._make(msg))
    return (f"a bare tuple of {len(msg)} fields (only a CallOp ({_BARE_CALL_OP}) or a CallRecording "
            f"({_BARE_CALL_RECORDING}) travels bare): {_short.repr(msg)}")


def record_name(msg) -> str:
    """The name of the record ``msg`` is, its bare forms included (for errors)."""
    if type(msg) is tuple:
        return {_BARE_CALL_OP: "CallOp", _BARE_CALL_RECORDING: "CallRecording"}.get(len(msg), "bare tuple")
    return type(msg).__name__


def check_client_message(msg) -> None:
    """Raise ProtocolViolation unless ``msg`` is a well-formed client->worker message."""
    if type(msg) is tuple:
        problem = _bare_problem(msg)
    elif type(msg) in CLIENT_SCHEMA:
        problem = _problem(msg)
    else:
        problem = f"a message that is not client->worker: {_short.repr(msg)}"
    if problem is not None:
        raise ProtocolViolation(f"the client sent {problem}")


def check_worker_message(msg, ranks: Container[int] | None = None) -> None:
    """Raise ProtocolViolation unless ``msg`` is a well-formed worker->client message whose
    rank fields name ``ranks`` (when given; a FetchResult's rank may also be -1: "the sender")."""
    if type(msg) in WORKER_SCHEMA:
        problem = _problem(msg)
    else:
        problem = f"a message that is not worker->client: {_short.repr(msg)}"
    if problem is None and ranks is not None:
        named = msg.ranks if type(msg) is m.RanksLost else (getattr(msg, "rank", None),)
        stray = [r for r in named if r is not None and r not in ranks and not (type(msg) is m.FetchResult and r == -1)]
        if stray:
            problem = f"a {type(msg).__name__} for rank {stray[0]}, which is not in this fleet"
    if problem is not None:
        raise ProtocolViolation(f"it sent {problem}")


def check_relay_control(msg) -> None:
    """Raise ProtocolViolation unless ``msg`` is a well-formed control frame for a relay."""
    problem = _problem(msg) if type(msg) in RELAY_SCHEMA else f"a control frame that is not one: {_short.repr(msg)}"
    if problem is not None:
        raise ProtocolViolation(f"the client sent {problem}")


def worker_messages(payload, ranks: Container[int]) -> list | None:
    """The checked messages of one upstream frame payload (None for a closed connection)."""
    if payload is None:
        return None
    msgs = list(decode(payload))
    for msg in msgs:
        check_worker_message(msg, ranks)
    return msgs


def received_messages(conn, ranks: Container[int]) -> list | None:
    """The checked messages of ``conn``'s next frame and of every later frame TLS has already
    read in, which no selector reports (None for a closed connection)."""
    payloads = conn.recv_payloads()
    if payloads is None:
        return None
    return [msg for payload in payloads for msg in worker_messages(payload, ranks) or ()]
