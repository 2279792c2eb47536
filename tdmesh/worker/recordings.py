"""Compiled functions on the worker: recordings of messages, replayed with new refs.

A recording is the list of messages one call of a compiled function sent to this rank.
Replaying it renames every ref: formals become the call's actual refs, results the call's
result refs, refs defined inside become fresh temporaries (deleted after the call), and
refs defined outside (captures) stay as they are.  Every replayed message reports errors
against the CallRecording's seq, so a failure inside fails the call's outputs together.
"""

from __future__ import annotations

import itertools
import logging
import pickle
from typing import Any

from ..errors import RecordingError
from ..protocol import messages as m
from .graphs import GraphedProgram
from .programs import Program, Unsupported

log = logging.getLogger("tdmesh.worker")

_temporaries = itertools.count(-1, -1)  # worker-local refs: negative, never clash with the client's


class Recording:
    def __init__(self, first: m.DefineRecording) -> None:
        self.id = first.recording
        self.total = first.total
        self.formals = first.formals
        self.results = first.results
        self.commands: list = []
        self.next_index = 0
        self.defined: list[int] = []  # refs the commands define, once complete
        self.mode = first.mode
        self.options = dict(first.options)  # inductor's config options for its graphs (backend="inductor")
        self.program: Program | GraphedProgram | None = None  # made at the first call (its ops are defined by then)
        self.unsupported: str | None = None  # why it replays message by message instead

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
            if msg.chunk != 0:
                raise RecordingError(f"recording {msg.recording} must start at chunk 0, got chunk {msg.chunk}")
            current = self._defining = Recording(msg)
        if msg.chunk != current.next_index or msg.total != current.total:
            raise RecordingError(f"recording {msg.recording}: expected chunk {current.next_index} of "
                                 f"{current.total}, got {msg.chunk} of {msg.total}")
        for command in msg.commands:
            if type(command) in (m.SendValue, m.RequestStatus, m.CreateGroups, m.DropGroups, m.DefineOp,
                                 m.DefineRecording, m.CallRecording):
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

    def checked(self, call: m.CallRecording) -> Recording:
        rec = self.get(call.recording)
        if len(call.actuals) != len(rec.formals) or len(call.results) != len(rec.results):
            raise RecordingError(f"recording {rec.id} takes {len(rec.formals)} inputs and {len(rec.results)} "
                                 f"outputs, called with {len(call.actuals)} and {len(call.results)}")
        return rec

    def program(self, call: m.CallRecording, interp) -> Program | GraphedProgram | None:
        """The call's recording as a program (or a CUDA graph of one), or None where it replays
        message by message."""
        rec = self.checked(call)
        if rec.program is None and rec.unsupported is None:
            if rec.mode == "messages":
                rec.unsupported = "compiled with backend='messages'"
            else:
                graph = rec.mode.split("+")[-1]  # "cuda_graph[_required]" where a graph is asked for
                try:
                    rec.program = Program(rec, interp, inductor=rec.mode.startswith("inductor"))
                    if graph.startswith("cuda_graph") and interp.device.type == "cuda":
                        rec.program = GraphedProgram(rec.program, required=graph == "cuda_graph_required")
                except Unsupported as e:
                    rec.unsupported = str(e)
                    log.debug("recording %s replays message by message: %s", rec.id, e)
                except Exception as e:  # noqa: BLE001 - a program that cannot be built is a slower replay, not a dead worker
                    rec.unsupported = f"making its program failed: {type(e).__name__}: {e}"
                    log.warning("recording %s replays message by message: %s", rec.id, rec.unsupported)
        return rec.program

    def modes(self) -> dict[int, str]:
        """Per called recording: "program", or why it replays message by message."""
        return {rid: getattr(rec.program, "mode", "program") if rec.program is not None
                else f"messages: {rec.unsupported}"
                for rid, rec in self._recordings.items() if rec.program is not None or rec.unsupported}

    def graphs(self) -> dict[int, dict]:
        """Per called recording run with inductor: its graphs, and the aten ops it runs between them."""
        found = {}
        for rid, rec in self._recordings.items():
            program = rec.program.program if isinstance(rec.program, GraphedProgram) else rec.program
            if isinstance(program, Program) and program.inductor:
                found[rid] = {"graphs": program.graphs, "outside": dict(program.outside)}
        return found

    def expand(self, call: m.CallRecording) -> tuple[list, list[int], dict[int, int]]:
        """The messages of one call with their refs renamed, the temporaries to delete, and the
        renaming (recorded ref -> the call's ref)."""
        rec = self.checked(call)
        names = dict(zip(rec.formals, call.actuals))
        names.update(zip(rec.results, call.results))
        temporaries = []
        for ref in rec.defined:
            if ref not in names:
                names[ref] = fresh = next(_temporaries)
                temporaries.append(fresh)
        borrow_names: dict[int, int] = {}
        commands = [_rename(c, names, borrow_names, call.seq) for c in rec.commands]
        return commands, temporaries, names


def _defined_refs(commands) -> list[int]:
    refs: list[int] = []
    for c in commands:
        for index, kind in _LAYOUT.get(type(c), ()):
            if kind == "def" and c[index] is not None:
                refs.append(c[index])
            elif kind == "defs":
                refs.extend(r for r in c[index] if r is not None)
    return list(dict.fromkeys(refs))


def _check_borrows(rec: Recording) -> None:
    created = {c.borrow for c in rec.commands if type(c) is m.BorrowCreate}
    dropped = {c.borrow for c in rec.commands if type(c) is m.BorrowDrop}
    if created - dropped:
        raise RecordingError("all borrows created within recording must be dropped within recording "
                             f"(borrows {sorted(created - dropped)} are not)")


# per message type: (field index, kind) of its ref fields, from messages.REF_FIELDS
_LAYOUT: dict[Any, tuple[tuple[int, str], ...]] = {
    t: tuple((t._fields.index(f), kind) for f, kind in fields.items())
    for t, fields in m.REF_FIELDS.items()}


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
    """``c`` with its refs renamed (by ``names``), its borrow ids too, and the call's seq."""
    layout = _LAYOUT.get(type(c))
    if layout is None:
        return c
    values = list(c)
    get = names.get
    for index, kind in layout:
        v = values[index]
        if kind == "def" or kind == "use":
            values[index] = v if v is None else get(v, v)
        elif kind == "defs" or kind == "uses":
            values[index] = tuple([r if r is None else get(r, r) for r in v])
        elif kind == "args":
            if type(v) is bytes:  # sealed user-function arguments: rename inside, seal again
                args, kwargs = pickle.loads(v)
                values[index] = pickle.dumps((_rename_value(args, names), _rename_value(kwargs, names)),
                                             protocol=pickle.HIGHEST_PROTOCOL)
            elif v:
                values[index] = _rename_value(v, names)
        elif type(c) is m.BorrowCreate:  # "borrow": a fresh id for each call of the recording
            borrows[v] = values[index] = next(_temporaries)
        else:
            values[index] = borrows.get(v, v)
    if c._fields[0] == "seq":
        values[0] = seq
    return type(c)(*values)
