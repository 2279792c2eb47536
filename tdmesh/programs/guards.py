"""Host reads inside a compiled function, as guards: Dynamo's model on a recording.

A trace that reads a value on the host (``.item()``, ``bool()``, ``.tolist()``,
``torch.equal``) fetches it as eager torch would (every rank, which must agree) and records it
as a **guard**; the recording is split there into **segments**, one recording each on the
workers.  A replay runs a segment, reads the guard's value again (one round trip, as the eager
call would) and goes on while it is the value the trace read.  A different value is a
**miss**: the ops before the read have run, so the call goes on from that point
(``tdmesh.programs.resume``): the Python function runs again with those ops matched against
the recording instead of sent, the read gets the new value, and the rest runs eagerly.  The
recording is dropped; the next call traces again (``tdmesh.programs.recording`` makes a
function that misses at every call eager for good, with a warning).

What a later segment (or the Python after a miss) may use of an earlier one crosses the read
as per-call tensors: every tensor the trace made and still held at the read (``carried``).  A
replay makes a proxy for each (freed when the call's last user lets go), so the workers hold
exactly what the eager call would have held at that point.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..engine.fetch import send_value
from ..engine.host_reads import same_value
from ..engine.tensor import AliasSet, Tensor, new_proxy
from ..engine.unshaped import SHAPES_READ
from ..errors import call_site, user_line
from ..protocol import messages as m

__all__ = ["Guard", "Segment", "split", "replay_guarded", "Miss"]

# messages a guarded recording may hold: ones whose refs are tensors (a borrow's id is not, and
# a miss could not match it against the trace's)
_SPLITTABLE = (m.CallOp, m.CallFunction, m.Reduce, m.ReduceMany, m.SendTensor, m.DeleteRefs)


class _Slot(NamedTuple):
    """A tensor argument of a guard's read, by the trace's ref."""
    ref: int


class _RefSlot(NamedTuple):
    """A ref argument of a guard's read (``m.Ref``): the outputs of an op whose shapes the read
    learns (``tdmesh.engine.unshaped``), which have no proxy until it returns."""
    ref: int


class Guard:
    """One read of a value inside a traced call: what it reads (a template of its arguments),
    the value every rank read, where the recording splits (``index``: the ops before it) and
    the tensors the trace held at that point (``carried``: (ref, AliasSet) while tracing)."""

    def __init__(self, mesh, function, args, kwargs, what: str, first_ref: int, agree) -> None:
        self.mesh = mesh
        self.function = function
        self.what = what
        self.agree = agree  # per-rank answers -> the value, or the eager read's error where ranks disagree
        self.site = user_line()
        self.first_ref = first_ref
        self._args: tuple | None = (args, kwargs)
        self.template: tuple = ((), None)
        self.index = -1  # not a guard (yet)
        self.value: object = None
        self.carried: list[int] = []  # the refs of the tensors the trace held at the read
        self.carried_aliases: list = []  # their AliasSets, while the trace runs
        self.capture_refs: list[int] = []  # tensors from before the call that the read reads
        self.message: tuple = ()  # the read as the trace sent it (ranks, SendValue, uses, defs)

    def bind_trace(self, seen: dict, metas: dict) -> bool:
        """Name the read's tensors by ref (those from before the call join ``seen``, as
        captures); False where an argument is a tensor the guard cannot name again."""
        flat, spec = tree_flatten(self._args, is_leaf=lambda x: type(x) is m.Ref)  # a Ref is a NamedTuple
        out: list = []
        for x in flat:
            if type(x) is Tensor:
                ref = x._r.id
                if ref < self.first_ref:
                    seen[ref] = x
                    self.capture_refs.append(ref)
                elif ref not in metas:
                    return False
                out.append(_Slot(ref))
            elif isinstance(x, torch.Tensor):
                return False  # a local tensor: its bytes would be part of the guard
            elif type(x) is m.Ref:
                if x.id < self.first_ref:
                    return False  # a tensor from before the call, written by the op: not followed per call
                out.append(_RefSlot(x.id))
            else:
                out.append(x)
        self.template = (out, spec)
        self._args = None
        return True

    def bind(self, env: dict) -> tuple[tuple, tuple[int, ...]]:
        """The read's arguments for one replay (its tensors from ``env``, by trace ref), and
        the refs it reads that no proxy argument names (``send_value``'s ``uses``)."""
        flat, spec = self.template
        uses = tuple(env[x.ref]._r.id for x in flat if type(x) is _RefSlot)
        values = [env[x.ref] if type(x) is _Slot else m.Ref(env[x.ref]._r.id) if type(x) is _RefSlot else x
                  for x in flat]
        return tree_unflatten(values, spec), uses

    @property
    def reads_shapes(self) -> bool:
        """Whether it reads an op's output shapes (a shape only the data decides), not a value."""
        return self.function == SHAPES_READ

    def refs(self) -> list[int]:
        return [x.ref for x in self.template[0] if type(x) in (_Slot, _RefSlot)]


class Segment:
    """The ops between two reads, defined on the workers as a recording of their own: its
    formals are the call's inputs and the tensors carried into it, its results the tensors it
    makes that later parts hold (``new``, a proxy per call) and the state it keeps (``kept``)."""
    __slots__ = ("id", "messages", "formals", "new", "infos", "kept", "captures", "written", "ranks")

    def __init__(self, messages: list, formals: list[int], new: list[int], infos: dict, kept: tuple,
                 captures: list[int], written: list[int]) -> None:
        self.id: int | None = None  # set by the recording; None for a segment without ops
        self.messages = messages
        self.formals = formals
        self.new = new
        self.infos = infos  # per new ref: (meta, device, mesh, stream, alias key)
        self.kept = kept
        self.captures = captures
        self.written = written
        self.ranks = sorted({r for ranks, *_ in messages for r in ranks})


def split(messages: list, guards: list[Guard], formals: list[int], first_ref: int, ends: list[int], kept: tuple,
          metas: dict, alias_of: dict, input_aliases: list, capture_aliases: dict) -> list[Segment] | str:
    """The segments of a guarded trace, or why it cannot be split (a reason for the warning).
    ``ends``: the refs the call returns that it made; ``alias_of``: the AliasSet of each ref
    that crosses a read or is returned, to tell which per-call proxies share storage."""
    for _, msg, _, _ in messages:
        if type(msg) not in _SPLITTABLE:
            return f"it reads a value on the host and holds a {type(msg).__name__}"
    kept_set = set(kept)
    for g in guards:
        if kept_set & set(g.refs()):
            return f"it reads a tensor of its own state on the host ({g.what} at {g.site})"
    keys = _alias_keys(alias_of, formals, input_aliases, capture_aliases)
    segments = []
    carried: list[int] = []  # into the next segment
    start = 0
    formal_set = set(formals)
    made: set[int] = set()  # the refs earlier segments defined
    for k, end in enumerate([g.index for g in guards] + [len(messages)]):
        msgs = messages[start:end]
        inside = formals + [r for r in carried if r not in kept_set]  # kept state is read by its own name
        inside_set = set(inside)
        # what this segment makes: not what an earlier one made and this one writes in place (state it then
        # reads and writes by name, as a recording does its captures)
        defined = {r for _, _, _, defs in msgs for r in defs if r >= first_ref} - inside_set - formal_set - made
        after = guards[k].carried if k < len(guards) else list(ends) + list(kept)
        out = [r for r in dict.fromkeys(after) if r in defined]
        uses = [r for _, _, used, _ in msgs for r in used]
        captures = [r for r in dict.fromkeys(uses) if r not in defined and r not in inside_set]
        lost = [r for r in captures if r >= first_ref and r not in kept_set]
        if lost:
            return f"tensor {lost[0]} crosses a read without being held (an internal error of tdmesh.compile)"
        written = [r for _, msg, _, _ in msgs if type(msg) in (m.CallOp, m.CallFunction) for r in msg.mutates
                   if r not in defined]
        new = [r for r in out if r not in kept_set]
        infos = {r: metas[r] + (keys[r],) for r in new}
        segments.append(Segment(msgs, inside, new, infos, tuple(r for r in out if r in kept_set), captures,
                                list(dict.fromkeys(written))))
        made |= defined
        if k < len(guards):
            carried = guards[k].carried
        start = end
    return segments


def _alias_keys(alias_of: dict, formals: list[int], input_aliases: list, capture_aliases: dict) -> dict:
    """Per ref of ``alias_of``: which storage its per-call proxy shares -- ("input", i), ("capture",
    ref) or ("group", first ref of those that share one storage made by the call)."""
    by_input = {id(a): i for i, a in enumerate(input_aliases)}
    by_capture = {id(a): r for r, a in capture_aliases.items()}
    groups: dict[int, int] = {}
    keys = {}
    for ref, aliases in alias_of.items():
        key = id(aliases)
        if key in by_input:
            keys[ref] = ("input", formals[by_input[key]])
        elif key in by_capture:
            keys[ref] = ("capture", by_capture[key])
        else:
            keys[ref] = ("group", groups.setdefault(key, ref))
    return keys


class Miss(NamedTuple):
    """A replay's read that returned another value: the ops of ``segments[:k + 1]`` have run;
    ``values`` are the reads' answers so far (per rank), ``env`` the call's tensors by trace ref."""
    k: int
    value: object
    values: list
    env: dict


def replay_guarded(rec, mesh, inputs, captures):
    """One call of a guarded recording: ``(True, outputs)``, or ``(False, Miss)``."""
    env: dict = dict(zip(rec.formals, inputs))
    env.update(zip(rec.capture_names, captures))
    groups: dict = {}
    values: list = []
    guards = rec.guards
    for k, seg in enumerate(rec.segments):
        if seg.id is not None:
            _call(mesh, seg, env, groups)
        if k < len(guards):
            g = guards[k]
            (args, kwargs), uses = g.bind(env)
            per_rank = send_value(g.mesh, g.function, args, kwargs, None, uses=uses).result()
            values.append(per_rank)
            try:
                value = g.agree(per_rank)
            except ValueError as e:  # ranks that disagree: the eager read's error, named at the trace's read
                raise ValueError(f"inside a compiled function, the read at {g.site}: {e}") from None
            if not same_value(value, g.value):
                return False, Miss(k, value, values, env)
    results = iter(rec.results)
    leaves = []
    for kind, *rest in rec.outputs:
        if kind == "result":
            leaves.append(env[next(results)])
        else:
            leaves.append(inputs[rest[0]] if kind == "formal" else rest[0])
    return True, tree_unflatten(leaves, rec.out_spec)


def _call(mesh, seg: Segment, env: dict, groups: dict) -> None:
    """One CallRecording of a segment: a new proxy per tensor it hands on (into ``env``)."""
    client = mesh.client
    recording = seg.id
    assert recording is not None
    with client.lock:
        inputs = [env[r] for r in seg.formals]
        made = []
        refs = []
        for r in seg.new:
            meta, device, out_mesh, stream, (kind, of) = seg.infos[r]
            if kind == "group":
                aliases = groups.get(of)
                if aliases is None:
                    aliases = groups[of] = AliasSet()
            else:
                aliases = env[of]._r.aliases
            ref = client.new_ref()
            proxy = new_proxy(meta, device, out_mesh, ref, aliases, stream)
            env[r] = proxy
            made.append(proxy)
            refs.append(ref)
        written: list[int] = []
        for r in seg.written:
            owner = env.get(r)
            written.extend(owner._r.aliases.refs if owner is not None else (r,))
        actuals = [t._r.id for t in inputs]
        seq = client.new_seq()
        msg = m.CallRecording(seq, recording, tuple(actuals), tuple(refs) + seg.kept)
        client.sink.submit(seg.ranks, msg, seq, actuals + seg.captures, refs + list(seg.kept) + written, None,
                           inputs, False, made, call_site(3, True))
