"""The one path by which an op leaves the client.

Every producer of work (aten dispatch, remote functions, collectives, moves between
meshes, borrows, fetches, compiled-function replays) calls :func:`issue`.  It allocates
the result refs and the op's seq, makes the result proxies, builds the message, and hands
``(ranks, message, seq, uses, defs)`` to the client's *sink*: the client itself, which
records the op in the dataflow history and sends it, or a compiled function's recorder,
which keeps it.  ``uses`` are the refs the op reads; ``defs`` the refs it defines or
writes, every alias of a mutated tensor included, which is the history's invariant: a
failure poisons exactly the values computed from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ..errors import call_site
from ..protocol.messages import CallOp, CallRecording
from .propagation import SparseMeta, TensorMeta
from .saved import thread_hooks, workers_record
from .settle import pending, settle
from .stream import Stream, get_active_stream
from .tensor import AliasSet, Tensor, new_proxy, view_proxy

_grad_enabled = torch._C.is_grad_enabled
_tuple_new = tuple.__new__  # a NamedTuple from its values without its Python-level __new__

__all__ = ["New", "issue", "issue_op", "issue_lean", "issue_call", "issue_message", "issue_unshaped", "adopt"]


class New(NamedTuple):
    """An output the op creates: ``aliases`` names the storage it shares (a view), None a
    fresh one; ``stream``, ``device`` and ``mesh`` default to the op's own."""
    meta: TensorMeta | SparseMeta
    aliases: AliasSet | None = None
    stream: Stream | None = None
    device: object = None
    mesh: object = None


def issue(mesh, build: Callable, *, inputs: Sequence[Tensor] = (), outputs: Sequence = (),
          mutated: Sequence[Tensor] = (), device=None, stream: Stream | None = None, ranks=None, future=None,
          uses: Sequence[int] = (), defs: Sequence[int] = (), deletes_first: bool = False) -> list:
    """Issue one op on ``mesh`` (to ``ranks`` if given); returns its output proxies.

    ``outputs`` holds, per output: a :class:`New`, an input ``Tensor`` (the op returns that
    argument, e.g. in place), or ``None`` (no value).  ``build(seq, results, mutated_refs)``
    makes the message, where ``results`` has one ref per output (None where no new tensor is
    made).  It may return ``[(ranks, message), ...]``: the first is the op, the others carry
    no seq (parts of one op sent to other ranks).  ``uses`` and ``defs`` add refs that are
    not inputs or outputs (a recording's captures).
    """
    if pending:  # a fault-tolerant step not yet confirmed: settled before anything else (settle.py)
        settle(inputs)
    client = mesh.client
    stream = stream if stream is not None else get_active_stream()
    with client.lock:
        results: list = []
        proxies: list = []
        made: list = []  # the new proxies
        for out in outputs:
            if type(out) is New:
                ref = client.new_ref()
                proxy = Tensor(out.meta, out.device if out.device is not None else device,
                               out.mesh if out.mesh is not None else mesh, ref,
                               out.aliases if out.aliases is not None else AliasSet(),
                               out.stream if out.stream is not None else stream)
                proxies.append(proxy)
                made.append(proxy)
                results.append(ref)
            else:
                proxies.append(out)
                results.append(None)
        mutated_refs = [r for t in mutated for r in t._r.aliases.refs] if mutated else []
        seq = client.new_seq()
        msg = build(seq, tuple(results), tuple(mutated_refs))
        all_uses = [t._r.id for t in inputs]
        if uses:
            all_uses.extend(uses)
        all_defs = [t._r.id for t in made]  # the new refs, then every alias of what the op writes
        if mutated_refs:
            all_defs.extend(mutated_refs)
        if defs:
            all_defs.extend(defs)
        sink = client.sink
        if type(msg) is list:
            (first_ranks, first), rest = msg[0], msg[1:]
            sink.submit(first_ranks, first, seq, all_uses, all_defs, future, inputs, deletes_first, made)
            for part_ranks, part in rest:
                sink.submit(part_ranks, part)
        else:
            sink.submit(mesh.rank_list if ranks is None else ranks, msg, seq, all_uses, all_defs, future, inputs,
                        deletes_first, made)
    return proxies


def issue_op(mesh, plan, remote: Sequence[Tensor], device, stream: Stream) -> list:
    """Issue an aten op by its plan (:mod:`tdmesh.engine.plan`): ``remote`` fill its slots.  The
    same work as :func:`issue` without building a message from a template each time: this
    is the eager hot path (one call per dispatched op)."""
    if pending:  # a fault-tolerant step not yet confirmed: settled before anything else (settle.py)
        settle(remote)
    client = mesh.client
    with client.lock:
        grad = workers_record(client)
        op = (client.op_numbers if grad else client.op_numbers_no_grad).get(plan)
        if op is None:
            op = client.define_op(plan, grad)
        proxies: list = []
        results: list = []
        made: list = []
        defs: list = []
        for kind, value, slot in plan.outputs:
            if kind == 0:  # plan.NEW: a new proxy, viewing the storage of slot's tensor if slot >= 0
                ref = client.new_ref()
                proxy = view_proxy(value, device, mesh, ref, remote[slot], stream) if slot >= 0 else \
                    new_proxy(value, device, mesh, ref, AliasSet(), stream)
                proxies.append(proxy)
                made.append(proxy)
                results.append(ref)
                defs.append(ref)
            else:  # the written argument itself (ARG), or a Python value (VALUE)
                proxies.append(remote[value] if kind == 1 else value)
                results.append(None)
        refs = [t._r.id for t in remote]
        mutated_refs: tuple = ()
        if plan.mutated:
            mutated_refs = tuple([r for slot in plan.mutated for r in remote[slot]._r.aliases.refs])
            defs.extend(mutated_refs)
        seq = client.new_seq()
        msg = _tuple_new(CallOp, (seq, op, tuple(results), mutated_refs, tuple(refs), stream.id))
        # the site from here: issue_op <- _issue_plan <- dispatch (or _dispatch_remote, then dispatch) are
        # tdmesh's frames on every path (dispatch is the mode's or Tensor's __torch_dispatch__)
        client.sink.submit(mesh.rank_list, msg, seq, refs, defs, None, remote, False, made, call_site(3, True))
    return proxies


def issue_lean(mesh, plan, remote: Sequence[Tensor], device, stream: Stream) -> Tensor:
    """:func:`issue_op` for the commonest op (``plan.lean``: one new tensor, nothing written) issued to
    the client itself, its inputs plainly placed (``placement.plainly_placed``): the eager hot path."""
    if pending:  # a fault-tolerant step not yet confirmed: settled before anything else (settle.py)
        settle(remote)
    client = mesh.client
    if client.sink is not client:  # a compiled function's recorder keeps what it is given
        return issue_op(mesh, plan, remote, device, stream)[0]
    meta, slot = plan.lean
    with client.lock:
        grad = _grad_enabled() and thread_hooks.ours_on_top  # saved.workers_record, its sink known
        op = (client.op_numbers if grad else client.op_numbers_no_grad).get(plan)
        if op is None:
            op = client.define_op(plan, grad)
        ref = client.next_ref
        client.next_ref = ref + 1
        proxy = view_proxy(meta, device, mesh, ref, remote[slot], stream) if slot >= 0 else \
            new_proxy(meta, device, mesh, ref, AliasSet(), stream)
        # the site from here: issue_lean <- dispatch (the mode's or Tensor's __torch_dispatch__) or the operator
        # itself (operators.py); the walk starts above them
        n = len(remote)  # one or two inputs, most often: no list comprehension's frame (0.15 us)
        refs = (remote[0]._r.id, remote[1]._r.id) if n == 2 else (remote[0]._r.id,) if n == 1 else \
            tuple([t._r.id for t in remote])
        client.queue_op(mesh.rank_list, op, ref, refs, stream.id, call_site(2, True))
    return proxy


def issue_call(mesh, recording: int, inputs: Sequence[Tensor], outputs: Sequence[tuple], captures: Sequence[int],
               defs: list[int], ranks, stream: Stream, kept: tuple = ()) -> list[Tensor]:
    """Issue one call of a compiled function (a CallRecording): ``outputs`` are its new
    results as (dense meta, index of the input whose storage it views or None, stream,
    device, mesh); ``captures`` the refs it reads besides its inputs, ``defs`` those it writes,
    ``kept`` the refs of its state, which every call defines again (after its new results).
    :func:`issue`'s work for this one shape of op, the hot path of replays."""
    if pending:  # a fault-tolerant step not yet confirmed: settled before anything else (settle.py)
        settle(inputs)
    client = mesh.client
    with client.lock:
        made = []
        refs = []
        for meta, source, out_stream, device, out_mesh in outputs:
            ref = client.new_ref()
            made.append(new_proxy(meta, device, out_mesh, ref,
                                  inputs[source]._r.aliases if source is not None else AliasSet(), out_stream))
            refs.append(ref)
        actuals = [t._r.id for t in inputs]
        seq = client.new_seq()
        msg = _tuple_new(CallRecording, (seq, recording, tuple(actuals), tuple(refs) + kept if kept else tuple(refs)))
        actuals.extend(captures)
        client.sink.submit(ranks, msg, seq, actuals, refs + defs + list(kept) if kept else refs + defs, None, inputs,
                           False, made, call_site(2, True))
    return made


def issue_unshaped(mesh, build: Callable, slots: Sequence[bool], *, inputs: Sequence[Tensor] = (),
                   mutated: Sequence[Tensor] = (), stream: Stream | None = None) -> list[int | None]:
    """Issue an op whose output metadata only the workers know: a result ref is defined now
    for each output whose slot is True (None for outputs that are a written argument);
    :func:`adopt` makes their proxies once the metadata is known."""
    if pending:  # a fault-tolerant step not yet confirmed: settled before anything else (settle.py)
        settle(inputs)
    client = mesh.client
    stream = stream if stream is not None else get_active_stream()
    with client.lock:
        results = [client.new_ref() if slot else None for slot in slots]
        mutated_refs = [r for t in mutated for r in t._r.aliases.refs]
        seq = client.new_seq()
        msg = build(seq, tuple(results), tuple(mutated_refs))
        client.sink.submit(mesh.rank_list, msg, seq, [t._r.id for t in inputs],
                           [r for r in results if r is not None] + mutated_refs, None, inputs)
    return results


def adopt(mesh, refs: Sequence[int], metas: Sequence[TensorMeta | SparseMeta], device, stream: Stream) -> list[Tensor]:
    """The proxies of refs that :func:`issue_unshaped` defined, now that their shapes are known."""
    with mesh.client.lock:
        return [Tensor(meta, device, mesh, ref, AliasSet(), stream) for ref, meta in zip(refs, metas)]


def issue_message(mesh, msg, ranks=None) -> None:
    """A message that is part of work already issued (a borrow's hand-back, freeing views):
    no seq, no results; recorded like any op while a compiled function is traced."""
    client = mesh.client
    with client.lock:
        client.sink.submit(mesh.rank_list if ranks is None else ranks, msg)
