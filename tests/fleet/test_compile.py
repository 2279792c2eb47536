"""``@tdmesh.compile``: the first call records the function's messages on the workers, later
calls replay the recording with one CallRecording.  MONARCH_NOTES §1.5 and §5 items 95-103."""

import pytest
import torch

import tdmesh
from tdmesh import fetch_shard, inspect, remote
from tdmesh.protocol.messages import MAX_COMMANDS_PER_CHUNK

live_refs = remote("tdmesh.worker.builtins.live_refs")


def test_captured_tensor_mutated_three_times(mesh1):
    with mesh1.activate():
        a = torch.zeros(())
        ones = torch.ones(())

        @tdmesh.compile
        def fn():
            nonlocal a
            a += ones
            return torch.ones(())

        zs = [fn() for _ in range(3)]
        assert fn.traces == 1 and len(fn.recordings) == 1
        got_a, got_zs = fetch_shard((a, zs)).result()
    assert float(got_a) == 3.0
    assert [float(z) for z in got_zs] == [1.0, 1.0, 1.0]


def test_formals_match_local_math(mesh1):
    @tdmesh.compile
    def fn(a, b):
        return 2 * a + b

    with mesh1.activate():
        a = torch.arange(4.0)
        outs = [fn(a, torch.full((4,), 10.0 * i)) for i in range(3)]
        got = inspect(outs)
    assert fn.traces == 1
    for i, g in enumerate(got):
        assert torch.equal(g, 2 * torch.arange(4.0) + 10.0 * i)


def test_formals_with_a_captured_tensor(mesh1):
    with mesh1.activate():
        a = torch.arange(4.0)

        @tdmesh.compile
        def fn(b):
            return 2 * a + b

        outs = [fn(torch.full((4,), float(i))) for i in range(3)]
        a.add_(100)  # a capture is read where it lives, at each call
        outs.append(fn(torch.ones(4)))
        got = inspect(outs)
    assert fn.traces == 1
    for i in range(3):
        assert torch.equal(got[i], 2 * torch.arange(4.0) + i)
    assert torch.equal(got[3], 2 * (torch.arange(4.0) + 100) + 1)


def test_new_traces_for_new_kinds_of_inputs(mesh1):
    @tdmesh.compile
    def fn(x, y, k):
        return x * k + y

    with mesh1.activate():
        x, y = torch.ones(3), torch.ones(3)
        fn(x, y, 2)
        fn(torch.zeros(3), torch.zeros(3), 2)   # same kind: a replay
        assert fn.traces == 1
        fn(x, x, 2)                             # the inputs alias each other: a new trace
        fn(x, y, 3)                             # another non-tensor value: a new trace
        fn(torch.ones(2, 3), torch.ones(2, 3), 2)  # other metadata: a new trace
        out = fn(x, x, 2)
        assert fn.traces == 4
        got = inspect(out)
    assert torch.equal(got, torch.full((3,), 3.0))


def test_outputs_alias_inputs_like_the_traced_function(mesh1):
    @tdmesh.compile
    def fn(x, y):
        return x[1:], y * 2, y

    with mesh1.activate():
        fn(torch.arange(4.0), torch.ones(4))          # the trace
        x2, y2 = torch.arange(4.0) + 10, torch.ones(4)
        view, doubled, same = fn(x2, y2)               # a replay
        assert fn.traces == 1
        assert view._r.aliases is x2._r.aliases          # a view of the *new* input
        assert view.shape == (3,) and view.storage_offset() == 1
        assert doubled._r.aliases is not y2._r.aliases and len(doubled._r.aliases.refs) == 1
        assert same is y2                                 # a returned input is the input itself
        view.mul_(-1)                                     # writes through to x2
        got_x2, got_doubled = fetch_shard((x2, doubled)).result()
    assert torch.equal(got_x2, torch.tensor([10.0, -11.0, -12.0, -13.0]))
    assert torch.equal(got_doubled, torch.full((4,), 2.0))


def test_verify_retraces_once_then_replays(mesh1):
    @tdmesh.compile(verify=True)
    def fn(x):
        return x * 3 + 1

    with mesh1.activate():
        x = torch.arange(3.0)
        outs = [fn(x) for _ in range(4)]
        assert fn.traces == 2  # the first call and the first reuse; later calls replay
        got = inspect(outs)
    assert all(torch.equal(g, torch.arange(3.0) * 3 + 1) for g in got)


BRANCH = {"positive": True}


def test_verify_catches_a_data_dependent_branch(mesh1):
    @tdmesh.compile(verify=True)
    def fn(x):
        if BRANCH["positive"]:
            return x + 1
        return x - 1

    with mesh1.activate():
        x = torch.zeros(2)
        first = fn(x)
        BRANCH["positive"] = False
        try:
            with pytest.raises(RuntimeError, match="Recording diverges at operation 0"):
                fn(x)
        finally:
            BRANCH["positive"] = True
        got = inspect(first)
    assert torch.equal(got, torch.ones(2))


def test_a_tensor_stored_by_the_function_is_state_every_call_rewrites(mesh1):
    """Made inside and kept (a nonlocal): state.  The first call runs as eager ops, the second
    (same messages, the first's tensor gone) becomes a recording that rewrites it in place."""
    with mesh1.activate():
        stored = None

        @tdmesh.compile
        def fn(x):
            nonlocal stored
            stored = x + 1
            return x * 2

        for i in range(5):
            x = torch.full((2,), float(i))
            out = fn(x)
            assert not stored.dropped
            assert torch.equal(inspect(stored), torch.full((2,), i + 1.0))
            assert torch.equal(inspect(out), torch.full((2,), 2.0 * i))
        assert fn.traces == 2 and len(fn.recordings) == 1
        (rec,) = fn.recordings.values()
        assert len(rec.kept_refs) == 1 and rec.replays == 3
        stored = None  # the program drops its state: the recording is stale, the next call traces
        fn(torch.ones(2))
        assert fn.traces == 3 and torch.equal(inspect(stored), torch.full((2,), 2.0))


def test_a_trace_that_raises_leaves_nothing_behind(mesh1):
    side = tdmesh.Stream("compile_raises")
    with mesh1.activate():
        x = torch.ones(2)
        leaked = {}

        @tdmesh.compile
        def fn(x):
            x.add_(1)
            leaked["t"] = x + 1
            _, leaked["borrow"] = side.borrow(x)
            raise ValueError("a bug in the traced function")

        with pytest.raises(ValueError, match="a bug in the traced function"):
            fn(x)
        assert fn.traces == 0 and not fn.recordings and mesh1.client.sink is mesh1.client
        # none of the trace was sent: its tensors are DROPPED, not names the workers never had
        with pytest.raises(TypeError, match="DROPPED"):
            leaked["t"] * 2
        assert leaked["borrow"].dropped and x._r.aliases.read_borrows == 0
        x.mul_(3)  # x is writable again, and the in-place add of the trace never ran
        got = inspect(x)
    assert torch.equal(got, torch.full((2,), 3.0))


def test_requires_grad_is_refused(mesh1):
    @tdmesh.compile
    def double(x):
        return x * 2

    with mesh1.activate():
        w = torch.ones(2).requires_grad_()
        with pytest.raises(TypeError, match="REQUIRES_GRAD"):
            double(w)

        @tdmesh.compile
        def returns_capture():
            return w

        with pytest.raises(TypeError, match="REQUIRES_GRAD"):
            returns_capture()
        assert double.traces == 0
        got = inspect(double(torch.ones(2)))
    assert torch.equal(got, torch.full((2,), 2.0))


def test_an_error_inside_fails_the_outputs_on_fetch(mesh1):
    @tdmesh.compile
    def fn(x, index):
        picked = x[index]   # an index out of bounds: only the worker can tell
        return picked * 2, picked + 1, x + 1

    with mesh1.activate():
        x = torch.ones(3)
        for _ in range(3):  # the traced call and two replays
            outputs = fn(x, torch.tensor([5]))
            # one CallRecording is one op: its outputs fail together, even x + 1
            for out in outputs:
                with pytest.raises(tdmesh.RemoteException, match="index 5 is out of bounds"):
                    inspect(out)
            assert torch.equal(inspect(x), torch.ones(3))  # the input is not poisoned
        good, plus_one, _ = fn(x, torch.tensor([1]))
        assert torch.equal(inspect((good, plus_one))[0], torch.full((1,), 2.0))
    assert fn.traces == 1


def test_one_compiled_function_on_two_meshes(mesh2x2):
    host0, host1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with host0.activate():
        a = torch.ones(3) * (host0.process_idx() + 1)
    with host1.activate():
        b = torch.ones(3) * (host1.process_idx() + 1)

    @tdmesh.compile
    def fn(a, b):
        return a * 2, b + 100

    for _ in range(3):
        ra, rb = fn(a, b)
    assert fn.traces == 1
    assert ra.mesh is host0 and rb.mesh is host1
    for g in range(2):
        assert torch.equal(inspect(ra, gpu=g), torch.full((3,), 2.0 * (g + 1)))
        assert torch.equal(inspect(rb, gpu=g), torch.full((3,), 100.0 + 2 + g + 1))


def test_borrow_created_and_dropped_inside(mesh1):
    side = tdmesh.Stream("compile_side")
    with mesh1.activate():
        a = torch.zeros(2)

        @tdmesh.compile
        def fn():
            b, borrow = side.borrow(a, mutable=True)
            with side.activate():
                b.add_(1)
            borrow.drop()

        for _ in range(3):
            assert fn() is None
        assert fn.traces == 1
        assert a._r.aliases.mutable_borrow is None
        got = inspect(a)
    assert torch.equal(got, torch.full((2,), 3.0))


def test_borrow_left_undropped_inside_is_refused_on_the_client(mesh1):
    side = tdmesh.Stream("compile_undropped")
    with mesh1.activate():
        a = torch.zeros(2)

        @tdmesh.compile
        def fn():
            b, borrow = side.borrow(a)
            with side.activate():
                b + 1
            return None

        with pytest.raises(RuntimeError, match="all borrows created within a compiled function must be dropped"):
            fn()
        assert a._r.aliases.read_borrows == 0  # the trace's borrow was given back on the client
        a.add_(5)                               # so a is writable again, and the workers are fine
        got = inspect(a)
    assert torch.equal(got, torch.full((2,), 5.0))


def test_borrow_made_outside_and_used_inside(mesh1):
    side = tdmesh.Stream("compile_outer_borrow")
    with mesh1.activate():
        a = torch.zeros(2)
        b, borrow = side.borrow(a, mutable=True)

        @tdmesh.compile
        def fn():
            b.add_(1)

        with side.activate():
            for _ in range(3):
                fn()
        borrow.drop()
        got = inspect(a)
    assert torch.equal(got, torch.full((2,), 3.0))


def test_a_fetch_inside_runs_the_call_eagerly_from_there(mesh1):
    """A host read inside: the call runs eagerly from the read on (the read sees the workers'
    value); after EAGER_AFTER such calls the function runs eagerly for good, warning once."""
    from tdmesh.programs.recording import EAGER_AFTER

    @tdmesh.compile
    def fn(x):
        y = x + 1
        return y * 2 if inspect(y).sum() > 0 else y * 3

    with mesh1.activate():
        for i in range(EAGER_AFTER - 1):
            assert torch.equal(inspect(fn(torch.full((2,), float(i)))), torch.full((2,), 2.0 * (i + 1)))
        assert mesh1.client.sink is mesh1.client and not fn.recordings
        with pytest.warns(UserWarning, match=r"runs eagerly from now on: it reads a value on the host "
                                             r"\(.* at .*test_compile.py.*fused=True"):
            got = fn(-torch.full((2,), 5.0))
        assert torch.equal(inspect(got), torch.full((2,), -12.0))
        assert fn.eager_because is not None
        assert torch.equal(inspect(fn(torch.ones(2))), torch.full((2,), 4.0))  # eager: no trace
        traces = fn.traces
        fn(torch.ones(2))
        assert fn.traces == traces


def test_cuda_graph_required_refuses_a_host_read_at_the_users_line(mesh1):
    @tdmesh.compile(cuda_graph=True)
    def fn(x):
        return x * 2 if bool((x > 0).all()) else x

    with mesh1.activate():
        with pytest.raises(tdmesh.UsageError, match=r"(?s)cuda_graph=True.*reads a value on the host \(\.item\(\).*"
                                                    r"cannot capture.*test_compile.py"):
            fn(torch.ones(2))
        assert mesh1.client.sink is mesh1.client and mesh1.client.delete_holder is None
        assert torch.equal(inspect(torch.ones(2) + 1), torch.full((2,), 2.0))


def test_more_than_one_chunk_of_operations(mesh1):
    n = MAX_COMMANDS_PER_CHUNK + 150

    @tdmesh.compile
    def fn(x):
        for _ in range(n):
            x = x + 1
        return x

    with mesh1.activate():
        x = fn(torch.zeros(2))
        x = fn(x)
        (rec,) = fn.recordings.values()
        assert len(rec.messages) > MAX_COMMANDS_PER_CHUNK
        got = inspect(x)
    assert fn.traces == 1
    assert torch.equal(got, torch.full((2,), 2.0 * n))


def test_replays_leave_no_temporaries_behind(mesh1):
    @tdmesh.compile
    def fn(x):
        t = x * 2
        u = t + 1
        return u.sum()

    with mesh1.activate():
        x = torch.ones(8)
        fn(x)
        before = tdmesh.call_on_shard_and_fetch(live_refs).result()
        for _ in range(10):
            fn(x)
        after = tdmesh.call_on_shard_and_fetch(live_refs).result()
        got = inspect(fn(x))
    assert after == before
    assert float(got) == 24.0
