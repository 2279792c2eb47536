"""A guarded replay that missed goes on from the read (``tdmesh.programs.guards``).

The workers have run the ops before the read, and the client cannot resume Python half-way
through a function, so the function runs again with a ``Resumer`` as the client's sink: the
ops it issues before the read are not sent but matched against the recording (the same ops on
the same tensors, by signature; an op's ``mutates`` are left out, since they list whatever else
aliases what it writes, the replay's tensors too), its earlier reads get the values this call read, and at the
read that missed every tensor it holds is bound to the one the replay made for the trace's
tensor in its place (one ``same`` call per mesh and stream on the workers).  Then the read
returns the new value and the rest of the call runs eagerly, as the function would.

The re-run must issue what the trace issued before the read.  Where Python decides otherwise
(a global that changed since the trace), the ops that ran cannot be taken back: the call
raises a ``UsageError`` naming the read, and the tensors the re-run made are dropped.
"""

from __future__ import annotations

import weakref

from ..engine.autograd_context import set_sink
from ..errors import UsageError, call_site
from ..protocol import messages as m
from .signature import signature_names
from .tracing import live_after

__all__ = ["resume"]


def resume(fn, args, kwargs, rec, miss, inputs):
    """Run ``fn(*args, **kwargs)`` on from the read ``miss`` names; its outputs."""
    client = inputs[0].mesh.client if inputs else rec.guards[0].mesh.client
    resumer = Resumer(client, rec, miss, inputs)
    try:
        outputs = fn(*args, **kwargs)
        if not resumer.resumed:
            raise resumer.diverged("it returned before making the read")
        return outputs
    except BaseException:
        resumer.abandon()
        raise


class Resumer:
    """The client's sink while a missed call's Python runs again up to the read."""

    def __init__(self, client, rec, miss, inputs) -> None:
        self.client = client
        self.rec = rec
        self.miss = miss
        self.inputs = inputs
        self.first_ref = client.next_ref
        self.messages: list[tuple] = []
        self.created: list = []
        self.reads = 0
        self.resumed = False
        self.names: tuple = ({}, {})  # the numberings of the last check: the trace's, the re-run's
        self.held: list[tuple[int, object]] = []  # frees of older tensors, sent once the re-run's are bound
        set_sink(client, self)
        client.delete_holder = self

    def note_read(self, *_args) -> None:
        pass

    def read_done(self, value, ok: bool) -> None:
        pass

    def adopted(self, proxies: list) -> None:
        """Proxies of an op whose shapes a read learned: the re-run's own tensors (bound at the
        read that missed if the trace held them there)."""
        if not self.resumed:
            self.created.extend(weakref.ref(t._r) for t in proxies)

    def hold_delete(self, ref: int, mesh) -> bool:
        """Until the read, the re-run's own tensors name nothing on the workers: their frees are
        dropped; older ones wait (one may be the state a re-run tensor is bound to)."""
        if self.resumed:
            return False
        if ref < self.first_ref:
            self.held.append((ref, mesh))
        return True

    def submit(self, ranks, msg, seq=None, uses=(), defs=(), future=None, inputs=(), deletes_first=False,
               outputs=(), site=None) -> None:
        if self.resumed:  # a late part of an op split over ranks
            self.client.submit(ranks, msg, seq, uses, defs, future, inputs, deletes_first, outputs, site)
            return
        if type(msg) is m.RequestStatus:  # the read's own: its value is here already
            return
        self.created.extend(weakref.ref(t._r) for t in outputs)
        self.messages.append((tuple(ranks), msg, list(uses), list(defs)))
        if type(msg) is not m.SendValue:
            return
        j = self.reads
        self.reads += 1
        if j > self.miss.k:
            raise self.diverged(f"it made more reads than the {j} before that one")
        self._check(j)  # the same ops and reads so far: the read gets this call's value
        future._set_result(self.miss.values[j])
        if j == self.miss.k:
            self._resume()

    def diverged(self, detail: str) -> UsageError:
        g = self.rec.guards[self.miss.k]
        return UsageError(f"tdmesh.compile: {g.what} at {g.site} read a new value ({self.miss.value!r}; "
                          f"{g.value!r} when traced), so the call went on from that read by running the function "
                          f"again; but the function did not issue the operations it issued before that read when "
                          f"it was traced ({detail}), and those that ran cannot be taken back. Keep what decides "
                          f"the operations before a host read in tensors, or read the value after the compiled call")

    def _check(self, j: int) -> None:
        """The re-run issued what the trace issued up to its read ``j`` (the read included):
        the same ops and reads on corresponding tensors (see ``_resume``)."""
        guards = self.rec.guards
        traced: list = []
        start = 0
        for g in guards[:j + 1]:
            traced.extend(self.rec.messages[start:g.index])
            traced.append(g.message)
            start = g.index
        theirs, their_names = signature_names(traced, aliases=False)
        mine, my_names = signature_names(self.messages, aliases=False)
        if mine != theirs:
            at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            raise self.diverged(f"operation {at} of {len(theirs)} before the read differs")
        self.names = (their_names, my_names)

    def _resume(self) -> None:
        rec, miss = self.rec, self.miss
        guard = rec.guards[miss.k]
        their_names, my_names = self.names
        traced = {i: r for r, i in their_names.items()}
        actual = {f: t._r.id for f, t in zip(rec.formals, self.inputs)}
        carried = set(guard.carried)
        bind: list[tuple[int, int]] = []  # (ref of the re-run, trace ref it stands for)
        for r, i in my_names.items():
            t = traced[i]
            if t in actual:
                same = r == actual[t]
            elif t < rec.first_ref:
                same = r == t
            else:
                same = r >= self.first_ref
                if same and t in carried:
                    bind.append((r, t))
            if not same:
                raise self.diverged(f"tensor {r} stands where the trace had tensor {t}")
        bound = {r for r, _ in bind}
        held = [o.id for o in live_after(self.created) if o.id not in bound]
        if held:
            raise self.diverged(f"it holds tensor {held[0]} at the read, which the trace did not")
        self._bind(bind)

    def _bind(self, bind: list[tuple[int, int]]) -> None:
        """Name, on the workers, each tensor the re-run holds by the value the replay made."""
        client, env, kept = self.client, self.miss.env, self.rec.kept_places
        by_place: dict = {}
        for r, t in bind:
            owner = env.get(t)
            ref, mesh, stream = (owner._r.id, owner._mesh, owner._stream) if owner is not None else (t,) + kept[t]
            by_place.setdefault((id(mesh), stream.id), (mesh, stream, []))[2].append((r, ref))
        with client.lock:
            self.resumed = True
            set_sink(client, client)
            if client.delete_holder is self:
                client.delete_holder = None
            site = call_site()
            for mesh, stream, pairs in by_place.values():
                seq = client.new_seq()
                sources = [ref for _, ref in pairs]
                names = tuple(r for r, _ in pairs)
                msg = m.CallFunction(seq, names, (), "tdmesh.worker.builtins.same", tuple(m.Ref(s) for s in sources),
                                     {}, stream.id)
                client.submit(mesh.rank_list, msg, seq, sources, list(names), None, (), False, (), site)
            self._release()

    def _release(self) -> None:
        """Send the frees held back (after the bindings, which may read what they free)."""
        held, self.held = self.held, []
        for ref, mesh in held:
            self.client.delete_ref(ref, mesh)

    def abandon(self) -> None:
        """The call failed before it could go on: the re-run's tensors name nothing on the workers."""
        client = self.client
        with client.lock:
            if client.sink is self:
                set_sink(client, client)
            if client.delete_holder is self:
                client.delete_holder = None
            self._release()
        if not self.resumed:
            site = call_site()
            for w in self.created:
                r = w()
                if r is not None:
                    r.dropped_at = site
