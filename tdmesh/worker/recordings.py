"""Compiled functions on the worker: recordings of messages, replayed with new refs.

A recording is the list of messages one call of a compiled function sent to this rank.
Replaying it renames every ref: formals become the call's actual refs, results the call's
result refs, refs defined inside become fresh temporaries (deleted after the call), and
refs defined outside (captures) stay as they are.  Every replayed message reports errors
against the CallRecording's seq, so a failure inside fails the call's outputs together.
"""

from __future__ import annotations

import itertools
import pickle

from .. import messages as m

MAX_COMMANDS_PER_CHUNK = 1000
_temporaries = itertools.count(-1, -1)  # worker-local refs: negative, never clash with the client's


class RecordingError(RuntimeError):
    pass


class Recording:
    def __init__(self, first: m.DefineRecording) -> None:
        self.id = first.recording
        self.total = first.total
        self.formals = first.formals
        self.results = first.results
        self.commands: list = []
        self.next_index = 0
        self.defined: list[int] = []  # refs the commands define, once complete

    @property
    def complete(self) -> bool:
        return self.next_index == self.total


class Recordings:
    """This rank's recordings and the rules for defining them."""

    def __init__(self) -> None:
        self._recordings: dict[int, Recording] = {}
        self._defining: Recording | None = None

    def define(self, msg: m.DefineRecording) -> None:
        current = self._defining
        if current is not None and current.id != msg.recording:
            raise RecordingError(f"cannot define recording {msg.recording}: a different recording "
                                 f"({current.id}) is already active")
        if current is None:
            if msg.recording in self._recordings:
                raise RecordingError(f"recording {msg.recording} is already defined")
            if msg.index != 0:
                raise RecordingError(f"recording {msg.recording} must start at chunk 0, got chunk {msg.index}")
            current = self._defining = Recording(msg)
        if msg.index != current.next_index or msg.total != current.total:
            raise RecordingError(f"recording {msg.recording}: expected chunk {current.next_index} of "
                                 f"{current.total}, got {msg.index} of {msg.total}")
        for command in msg.commands:
            if type(command) in (m.SendValue, m.RequestStatus, m.CreateGroups, m.DefineRecording, m.CallRecording):
                raise RecordingError(f"{type(command).__name__} is not allowed inside a recording")
        current.commands.extend(msg.commands)
        current.next_index += 1
        if current.complete:
            _check_borrows(current)
            current.defined = _defined_refs(current.commands)
            self._recordings[current.id] = current
            self._defining = None

    def get(self, recording: int) -> Recording:
        if self._defining is not None and self._defining.id == recording:
            raise RecordingError(f"recording {recording} is called while it is still being defined")
        try:
            return self._recordings[recording]
        except KeyError:
            raise RecordingError(f"recording {recording} not found") from None

    def expand(self, call: m.CallRecording) -> tuple[list, list[int]]:
        """The messages of one call with their refs renamed, and the temporaries to delete."""
        rec = self.get(call.recording)
        if len(call.actuals) != len(rec.formals) or len(call.results) != len(rec.results):
            raise RecordingError(f"recording {rec.id} takes {len(rec.formals)} inputs and {len(rec.results)} "
                                 f"outputs, called with {len(call.actuals)} and {len(call.results)}")
        names = dict(zip(rec.formals, call.actuals))
        names.update(zip(rec.results, call.results))
        temporaries = []
        for ref in rec.defined:
            if ref not in names:
                names[ref] = fresh = next(_temporaries)
                temporaries.append(fresh)
        borrow_names: dict[int, int] = {}
        commands = [_rename(c, names, borrow_names, call.seq) for c in rec.commands]
        return commands, temporaries


def _defined_refs(commands) -> list[int]:
    refs: list[int] = []
    for c in commands:
        t = type(c)
        if t is m.CallFunction:
            refs.extend(r for r in c.results if r is not None)
        elif t is m.Reduce or t is m.SendTensor:
            if c.result is not None:
                refs.append(c.result)
        elif t is m.BorrowCreate:
            refs.append(c.result)
    return list(dict.fromkeys(refs))


def _check_borrows(rec: Recording) -> None:
    created = {c.borrow for c in rec.commands if type(c) is m.BorrowCreate}
    dropped = {c.borrow for c in rec.commands if type(c) is m.BorrowDrop}
    if created - dropped:
        raise RecordingError("all borrows created within recording must be dropped within recording "
                             f"(borrows {sorted(created - dropped)} are not)")


def _ref(names: dict, ref):
    return names.get(ref, ref) if ref is not None else None


def _rename_value(obj, names: dict):
    t = type(obj)
    if t is m.Ref:
        new = names.get(obj.id)
        return obj if new is None else m.Ref(new)
    if t is tuple or t is list:
        return t([_rename_value(x, names) for x in obj])
    if t is dict:
        return {k: _rename_value(v, names) for k, v in obj.items()}
    return obj


def _rename(c, names: dict, borrows: dict, seq: int):
    # Replays rename every command of a recording: records are built directly, not with
    # NamedTuple._replace (several times slower), on the worker's message thread.
    t = type(c)
    if t is m.CallFunction:
        get = names.get
        results = tuple([None if r is None else get(r, r) for r in c.results])
        mutates = tuple([get(r, r) for r in c.mutates]) if c.mutates else ()
        if type(c.args) is bytes:  # sealed user-function arguments: rename inside, seal again
            args, kwargs = pickle.loads(c.args)
            sealed = pickle.dumps((_rename_value(args, names), _rename_value(kwargs, names)),
                                  protocol=pickle.HIGHEST_PROTOCOL)
            return m.CallFunction(seq, results, mutates, c.function, sealed, c.kwargs, c.stream, c.process_groups)
        return m.CallFunction(seq, results, mutates, c.function, _rename_value(c.args, names),
                              _rename_value(c.kwargs, names) if c.kwargs else c.kwargs, c.stream, c.process_groups)
    if t is m.Reduce:
        return c._replace(seq=seq, result=_ref(names, c.result), tensor=names.get(c.tensor, c.tensor),
                          out=_ref(names, c.out))
    if t is m.ReduceMany:
        return c._replace(seq=seq, tensors=tuple(names.get(r, r) for r in c.tensors))
    if t is m.SendTensor:
        return c._replace(seq=seq, result=names.get(c.result, c.result), tensor=names.get(c.tensor, c.tensor))
    if t is m.DeleteRefs:
        return c._replace(refs=tuple(names.get(r, r) for r in c.refs))
    if t is m.BorrowCreate:
        borrows[c.borrow] = fresh = next(_temporaries)
        return c._replace(result=names.get(c.result, c.result), borrow=fresh, tensor=names.get(c.tensor, c.tensor))
    if t in (m.BorrowFirstUse, m.BorrowLastUse, m.BorrowDrop):
        return c._replace(borrow=borrows.get(c.borrow, c.borrow))
    if t is m.CommandGroup:
        return c._replace(commands=tuple(_rename(x, names, borrows, seq) for x in c.commands))
    return c
