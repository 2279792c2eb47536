"""Op plans (tdmesh/engine/plan.py): an aten op seen once with some argument metadata is defined on
the workers once and issued as a CallOp after; these tests check that the reuse keeps
every semantic of the first dispatch (slots, aliasing, writes, failures)."""

import pytest
import torch

import tdmesh
from tdmesh import inspect
from tdmesh.engine.plan import PLANS
from tdmesh.protocol import messages as m


class Sent:
    """Every message the client queues while the block runs (the client's own submit, send_setup
    and queue_op, the hot path's submit of one CallOp, wrapped)."""

    def __init__(self, client) -> None:
        self.client = client
        self.messages: list = []

    def __enter__(self):
        submit, setup, queue_op = self.client.submit, self.client.send_setup, self.client.queue_op
        self.client.submit = lambda ranks, msg, *a, **k: (self.messages.append(msg), submit(ranks, msg, *a, **k))[1]
        self.client.send_setup = lambda msg, *a, **k: (self.messages.append(msg), setup(msg, *a, **k))[1]

        def queued(ranks, op, result, refs, stream, site):
            queue_op(ranks, op, result, refs, stream, site)
            self.messages.append(m.CallOp(self.client.last_seq, op, (result,), (), refs, stream))
        self.client.queue_op = queued
        return self

    def __exit__(self, *exc) -> None:
        del self.client.submit, self.client.send_setup, self.client.queue_op

    def of(self, kind) -> list:
        return [msg for msg in self.messages if type(msg) is kind]


def test_an_op_is_defined_once_then_sent_as_call_ops(mesh1):
    with mesh1.activate():
        x, y = torch.ones(3, 5), torch.full((3, 5), 2.0)
        with Sent(mesh1.client) as sent:
            for _ in range(20):
                x = x + y * 0.5
        assert inspect(x).eq(21.0).all()
    defined = sent.of(m.DefineOp)
    assert len(defined) <= 2  # mul and add, unless an earlier test already defined them on this client
    assert len(sent.of(m.CallOp)) == 40 and not sent.of(m.CallFunction)
    assert all(type(arg) is m.Slot or type(arg) is float for d in defined for arg in d.args)


def test_a_reused_plan_puts_each_tensor_in_its_own_slot(mesh1):
    """The same op and metadata with the tensors in other places: out=, duplicates, lists."""
    with mesh1.activate():
        a, b, c = torch.ones(4), torch.full((4,), 2.0), torch.zeros(4)
        torch.add(a, a, out=c)            # the first use: its plan; a appears twice
        d, e, f = torch.full((4,), 5.0), torch.full((4,), 7.0), torch.zeros(4)
        torch.add(d, e, out=f)            # the same key: slots 0, 1 and the out= slot 2
        assert inspect(f).eq(12.0).all() and inspect(d).eq(5.0).all() and inspect(c).eq(2.0).all()
        s1 = torch.stack([a, b, a])
        s2 = torch.stack([d, e, f])
        assert inspect(s2)[:, 0].tolist() == [5.0, 7.0, 12.0] and inspect(s1)[:, 0].tolist() == [1.0, 2.0, 1.0]
        z = torch.zeros(4)
        z.add_(b)                         # plan of add_: the written slot is self
        e.add_(d)
        assert inspect(e).eq(12.0).all() and inspect(z).eq(2.0).all() and inspect(b).eq(2.0).all()


def test_writes_through_views_reach_every_alias_after_reuse(mesh1):
    with mesh1.activate():
        for _ in range(3):
            base = torch.zeros(2, 3)
            row = base[1]                 # a view: its plan's output aliases slot 0
            row.mul_(0).add_(4.0)
            col = base.t()[0]
            assert inspect(base).tolist() == [[0.0] * 3, [4.0] * 3]
            assert inspect(col).tolist() == [0.0, 4.0]


def test_a_failure_of_a_planned_op_poisons_only_its_dependents(mesh1):
    with mesh1.activate():
        ok = torch.ones(2, 2)
        for _ in range(2):
            idx = torch.tensor([0, 5])    # out of range for dim 0 of size 2: fails on the worker only
            picked = torch.index_select(ok, 0, idx)
            later = picked + 1
            with pytest.raises(tdmesh.RemoteException, match="index"):
                inspect(later)
            assert inspect(ok + 1).eq(2.0).all()


def test_a_change_of_metadata_makes_a_new_plan(mesh1):
    with mesh1.activate():
        before = len(PLANS)
        x = torch.ones(3)
        x = x + 1
        y = torch.ones(3, 2) + 1          # another shape: another plan
        assert len(PLANS) >= before + 1
        assert inspect(x).eq(2.0).all() and inspect(y).eq(2.0).all()


def test_with_the_plan_cache_full_ops_are_sent_whole(mesh1, monkeypatch):
    monkeypatch.setattr("tdmesh.engine.dispatch.MAX_PLANS", 0)
    with mesh1.activate():
        x = torch.ones(6)
        with Sent(mesh1.client) as sent:
            y = (x.view(2, 3) * 3).sum(0, dtype=torch.float64)
        assert inspect(y).tolist() == [6.0, 6.0, 6.0]
    new_ops = [msg for msg in sent.messages if type(msg) in (m.CallOp, m.CallFunction)]
    assert new_ops and all(type(msg) is m.CallFunction or msg.op in mesh1.client.op_numbers.values()
                           for msg in new_ops)


def test_a_second_client_defines_the_ops_it_uses_again():
    """Plans outlive a fleet; op numbers are each client's own."""
    for _ in range(2):
        with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
            x = torch.arange(4.0)
            got = inspect(x * 2 + 1)
            assert got.tolist() == [1.0, 3.0, 5.0, 7.0]
            assert len(mesh.client.op_numbers) >= 3
