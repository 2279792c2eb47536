"""Collectives over mesh dims, moves between meshes, and remote process groups.

Runs on the ``cmesh`` fixture (tests/conftest.py): by default the 2x2 mesh shared with the
engine tests (CPU workers over gloo on a machine without CUDA).  ``TDMESH_TEST_MESH=HOSTSxGPUS``
asks for another shape, and local_mesh puts the workers on CUDA (one GPU each, NCCL) wherever
CUDA is present, so on a 2-GPU host

    TDMESH_TEST_MESH=1x2 python -m pytest -q tests/fleet/test_collectives.py tests/fleet/test_streams.py
    TDMESH_TEST_MESH=2x1 python -m pytest -q tests/fleet/test_collectives.py tests/fleet/test_streams.py

run this suite on CUDA tensors (``TDMESH_DEVICE=cpu`` keeps any shape on CPU/gloo).

Every coordinate, group and expected value is derived from the mesh's sizes (tests/_meshcase.py),
computed locally from the same formula the workers use, and compared exactly.  Values built
under ``mesh.activate()`` are remote; comparisons happen outside the activation, on fetched
(local, CPU) tensors.  A test that needs a dim of size >= 2 uses whichever dim has one, and
skips, naming the shape, where none has; the to_mesh shift needs 3 ranks and skips on 1x2/2x1.
"""

import math

import pytest
import torch
import torch.distributed as dist

import tdmesh
from tdmesh import fetch_shard, inspect, remote

try:
    from ._meshcase import (
        at,
        coords,
        fetch_every,
        group_dim,
        members,
        other,
        rank_of,
        rows,
        shape_text,
        shard,
        wide_dim,
    )
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from _meshcase import at, coords, fetch_every, group_dim, members, other, rank_of, rows, shape_text, shard, wide_dim


# ----------------------------------------------------------------------------- remote functions
# Device-agnostic: whatever they create lives on the device of their input (cuda:<rank> on
# NCCL workers, the CPU on gloo workers).
def fail_where_coordinate_is_1(x, mesh, dim):
    if mesh.rank(dim) == 1:
        raise RuntimeError(f"fail_where_coordinate_is_1 ({dim}): this rank refuses")
    return x + 1


def pg_all_reduce(x, pg, op="sum"):
    y = x.clone()
    dist.all_reduce(y, getattr(dist.ReduceOp, op.upper()), group=pg)
    return y


def pg_info(pg):
    return (dist.get_world_size(pg), dist.get_rank(pg), [dist.get_global_rank(pg, i) for i in range(pg.size())],
            isinstance(pg, dist.ProcessGroup))


def pg_backend(pg):
    return dist.get_backend(pg)


def pg_barrier_and_gathers(x, pg):
    """barrier, all_gather (list), all_gather_into_tensor.  (gloo takes only the concatenated
    output form of all_gather_into_tensor, not the stacked ``[n, *shape]`` one that NCCL takes,
    so the concatenated form is what both backends run here.)"""
    dist.barrier(group=pg)
    n = dist.get_world_size(pg)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=pg)
    flat = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(flat, x.reshape(-1), group=pg)
    return torch.stack(parts), flat


def pg_reduce_scatter(x, pg):
    """``x`` is ``[n, k]``: this rank gets the sum over the group of row ``group rank``.
    (gloo needs the flat concatenated form ``[n*k] -> [k]``; a ``[n, k] -> [k]`` call aborts
    the process in a gloo CHECK.  NCCL takes the flat form too.)"""
    out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.reshape(-1), dist.ReduceOp.SUM, group=pg)
    return out


def pg_broadcast(x, pg):
    y = x.clone()
    dist.broadcast(y, src=dist.get_global_rank(pg, 0), group=pg)
    return y


def pg_all_to_all(x, pg):
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=pg)
    return out


def pg_send_recv(x, pg):
    """Group rank 0 sends ``x`` to group rank 1 (isend/irecv); rank 1 returns what it got,
    every other rank a copy of its own ``x``."""
    me = dist.get_rank(pg)
    if me == 0:
        dist.isend(x.contiguous(), dst=dist.get_global_rank(pg, 1), group=pg).wait()
        return x.clone()
    if me != 1:
        return x.clone()
    got = torch.empty_like(x)
    dist.irecv(got, src=dist.get_global_rank(pg, 0), group=pg).wait()
    return got


def pg_list_collectives(x, pg):
    """all_to_all (lists), gather and scatter to/from group rank 0, reduce to group rank 0,
    reduce_scatter (lists) and reduce_scatter_tensor with AVG.  ``x`` is ``[n, k]``.
    (Every one of these runs on gloo in torch >= 2.13 and on NCCL.)"""
    n, me = dist.get_world_size(pg), dist.get_rank(pg)
    root = dist.get_global_rank(pg, 0)
    a2a = [torch.empty_like(x[0]) for _ in range(n)]
    dist.all_to_all(a2a, [row.contiguous() for row in x], group=pg)
    gathered = [torch.zeros_like(x[0]) for _ in range(n)]
    dist.gather(x[0].contiguous(), gathered if me == 0 else None, dst=root, group=pg)
    scattered = torch.empty_like(x[0])
    dist.scatter(scattered, [row.contiguous() for row in x] if me == 0 else None, src=root, group=pg)
    reduced = x[0].clone()
    dist.reduce(reduced, dst=root, group=pg)
    if me != 0:
        reduced.zero_()  # only the destination's buffer is defined
    rs = torch.empty_like(x[0])
    dist.reduce_scatter(rs, [row.contiguous() for row in x], group=pg)
    rs_avg = torch.empty_like(x[0])
    dist.reduce_scatter_tensor(rs_avg, x.reshape(-1), dist.ReduceOp.AVG, group=pg)
    return torch.stack(a2a), torch.stack(gathered), scattered, reduced, rs, rs_avg


def _list_collectives_meta(x, pg):
    n = pg.size()
    row = torch.empty_like(x[0])
    return (torch.empty((n, *row.shape)), torch.empty((n, *row.shape)), torch.empty_like(row), torch.empty_like(row),
            torch.empty_like(row), torch.empty_like(row))


def _like(x, pg, *rest):
    return torch.empty_like(x)


def _gathers_meta(x, pg):
    n = pg.size()
    return torch.empty((n, *x.shape), dtype=x.dtype), torch.empty(n * x.numel(), dtype=x.dtype)


# ----------------------------------------------------------------------------- helpers
def local_x(mesh, h, g, dtype=torch.int64):
    return (12 * rank_of(mesh, h, g) + torch.arange(12).view(3, 4)).to(dtype)


def make_x(mesh, dtype=torch.int64):
    """``local_x`` on every rank: ``12 * global rank + arange(12)``, from the rank's coordinates."""
    with mesh.activate():
        x = 12 * mesh.size("gpu") * mesh.rank("host") + 12 * mesh.rank("gpu") + torch.arange(12).view(3, 4)
        return x.to(dtype)


@pytest.fixture(scope="module")
def xs(cmesh):
    """The shards of x, fetched once, checked against the formula."""
    got = fetch_every(make_x(cmesh), cmesh)
    for h, g in coords(cmesh):
        assert torch.equal(got[h, g], local_x(cmesh, h, g))
    return got


# ----------------------------------------------------------------------------- reduce
def test_reduce_sum_over_each_dim_and_all_dims(cmesh, xs):
    x = make_x(cmesh)
    results = {
        "gpu": x.reduce("gpu"),
        "host": x.reduce("host", "sum"),
        "both": x.reduce(("gpu", "host"), "sum"),
        "all": x.reduce((), "sum"),
        "default": x.reduce(),
    }
    got = fetch_every(results, cmesh)
    total = sum(xs.values())
    for h, g in coords(cmesh):
        r = got[h, g]
        assert torch.equal(r["gpu"], sum(xs[c] for c in members(cmesh, "gpu", h, g)))
        assert torch.equal(r["host"], sum(xs[c] for c in members(cmesh, "host", h, g)))
        assert torch.equal(r["both"], total)
        assert torch.equal(r["all"], total)
        assert torch.equal(r["default"], total)
        assert r["gpu"].dtype == torch.int64


def test_every_float_reduction(cmesh, xs):
    x = make_x(cmesh, torch.float32)
    ops = {"sum": lambda ts: sum(ts), "avg": lambda ts: sum(ts) / len(ts),
           "product": lambda ts: torch.stack(ts).prod(0), "min": lambda ts: torch.stack(ts).amin(0),
           "max": lambda ts: torch.stack(ts).amax(0)}
    results = {(d, op): x.reduce(d, op) for d in ("gpu", "host", ("gpu", "host")) for op in ops}
    got = fetch_every(results, cmesh)
    for h, g in coords(cmesh):
        for (d, op), value in got[h, g].items():
            shards = [xs[c].float() for c in members(cmesh, d, h, g)]
            expected = ops[op](shards)
            assert value.dtype == torch.float32 and value.shape == (3, 4)
            assert torch.equal(value, expected), (d, op, h, g)


def test_bitwise_reductions_on_int64(cmesh, xs):
    """band/bor/bxor: native on gloo, emulated by tdmesh on NCCL (which has no bitwise ops)."""
    x = make_x(cmesh)
    ops = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
    results = {(d, op): x.reduce(d, op) for d in ("gpu", "host", ()) for op in ops}
    got = fetch_every(results, cmesh)
    for h, g in coords(cmesh):
        for (d, op), value in got[h, g].items():
            shards = [xs[c] for c in members(cmesh, d, h, g)]
            expected = shards[0]
            for s in shards[1:]:
                expected = ops[op](expected, s)
            assert value.dtype == torch.int64
            assert torch.equal(value, expected), (d, op, h, g)


def test_stack_is_in_coordinate_order(cmesh, xs):
    x = make_x(cmesh)
    got = fetch_every({"gpu": x.reduce("gpu", "stack"), "host": x.reduce("host", "stack")}, cmesh)
    for h, g in coords(cmesh):
        assert got[h, g]["gpu"].shape == (cmesh.size("gpu"), 3, 4)
        assert got[h, g]["host"].shape == (cmesh.size("host"), 3, 4)
        assert torch.equal(got[h, g]["gpu"], torch.stack([xs[c] for c in members(cmesh, "gpu", h, g)]))
        assert torch.equal(got[h, g]["host"], torch.stack([xs[c] for c in members(cmesh, "host", h, g)]))


def test_scatter_needs_dim0_of_the_group_size_then_reduce_scatter_and_all_to_all(cmesh, xs):
    n_host, n_gpu = cmesh.size("host"), cmesh.size("gpu")
    x = make_x(cmesh)
    with cmesh.activate():
        wrong = x if x.shape[0] != n_gpu else x.reshape(4, 3)  # dim 0 is not the gpu group size
    with pytest.raises(TypeError, match="When scattering"):
        wrong.reduce("gpu", "sum", scatter=True)
    with pytest.raises(TypeError, match="When scattering"):
        wrong.reduce("gpu", "stack", scatter=True)
    with cmesh.activate():
        y_gpu = rows(x, n_gpu)                                     # [n_gpu, 12 / n_gpu]
        y_host = y_gpu if n_host == n_gpu else rows(x, n_host)
    rs = y_gpu.reduce("gpu", "sum", scatter=True)
    a2a = y_gpu.reduce("gpu", "stack", scatter=True)
    rs_host = y_host.reduce("host", "max", scatter=True)
    ys_gpu = {c: rows(v, n_gpu) for c, v in xs.items()}
    ys_host = {c: rows(v, n_host) for c, v in xs.items()}
    assert rs.shape == ys_gpu[0, 0].shape[1:] and a2a.shape == ys_gpu[0, 0].shape
    got = fetch_every((rs, a2a, rs_host), cmesh)
    for h, g in coords(cmesh):
        r, a, m = got[h, g]
        gpu_peers = [ys_gpu[c] for c in members(cmesh, "gpu", h, g)]
        host_peers = [ys_host[c] for c in members(cmesh, "host", h, g)]
        assert torch.equal(r, sum(gpu_peers)[g])
        assert torch.equal(a, torch.stack([p[g] for p in gpu_peers]))
        assert torch.equal(m, torch.stack(host_peers).amax(0)[h])


def test_reduce_argument_errors(cmesh):
    x = make_x(cmesh)
    with cmesh.activate():
        y = x.reshape(2, 6)
    with pytest.raises(ValueError, match="not valid for multiple dimensions"):
        x.reduce(("host", "gpu"), "stack")
    with pytest.raises(ValueError, match="not valid for multiple dimensions"):
        y.reduce(("host", "gpu"), "sum", scatter=True)
    with pytest.raises(ValueError, match="not valid for multiple dimensions"):
        x.reduce((), "stack")
    with pytest.raises(KeyError, match="zone"):
        x.reduce("zone")
    with pytest.raises(ValueError, match="unknown reduction"):
        x.reduce("gpu", "mean")
    with pytest.raises(ValueError, match="twice"):
        x.reduce(("gpu", "gpu"))
    with pytest.raises(NotImplementedError):
        x.reduce("gpu", mesh=cmesh)
    with pytest.raises(TypeError, match="tdmesh tensor"):
        tdmesh.reduce(torch.ones(2), "gpu")
    # nothing was sent for any of these: the tensor is still usable
    got = inspect(x.reduce("gpu"), host=0, gpu=0)
    assert torch.equal(got, sum(local_x(cmesh, *c) for c in members(cmesh, "gpu", 0, 0)))


def test_reduce_out(cmesh, xs):
    n_host, n_gpu = cmesh.size("host"), cmesh.size("gpu")
    x = make_x(cmesh)
    with cmesh.activate():
        out = torch.zeros(3, 4, dtype=torch.int64)
        wrong = torch.zeros(4, 3, dtype=torch.int64)
        stack_out = torch.zeros(n_host, 3, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"Reduce expects the shape to be torch\.Size"):
        x.reduce("gpu", out=wrong)
    with pytest.raises(ValueError, match=rf"Reduce expects the shape to be torch\.Size\(\[{n_gpu}, 3, 4\]\)"):
        x.reduce("gpu", "stack", out=out)
    plain = x.reduce("gpu")  # no out: out's earlier contents stay as they were
    before = fetch_every(out, cmesh)
    result = x.reduce("gpu", out=out)
    assert result is out
    stacked = x.reduce("host", "stack", out=stack_out)
    assert stacked is stack_out
    got = fetch_every((out, plain, stack_out), cmesh)
    for h, g in coords(cmesh):
        assert torch.equal(before[h, g], torch.zeros(3, 4, dtype=torch.int64))
        o, p, s = got[h, g]
        assert torch.equal(o, sum(xs[c] for c in members(cmesh, "gpu", h, g)))
        assert torch.equal(p, o)
        assert torch.equal(s, torch.stack([xs[c] for c in members(cmesh, "host", h, g)]))
    with pytest.raises(ValueError, match="only supported when reducing a single tensor"):
        tdmesh.reduce({"a": x}, "gpu", out=out)


def test_reduce_in_place(cmesh, xs):
    x = make_x(cmesh)
    with cmesh.activate():
        y = x.clone()
    assert y.reduce_("host") is y
    with pytest.raises(ValueError, match="reduce_ cannot stack"):
        y.reduce_("gpu", "stack")
    with cmesh.activate():
        y_rows = rows(y, cmesh.size("gpu"), view=True)  # dim 0 the group size: the scatter check passes
    with pytest.raises(ValueError, match="reduce_ cannot scatter"):
        y_rows.reduce_("gpu", "sum", scatter=True)
    got = fetch_every((x, y), cmesh)
    for h, g in coords(cmesh):
        assert torch.equal(got[h, g][0], xs[h, g])  # the input of the copy is untouched
        assert torch.equal(got[h, g][1], sum(xs[c] for c in members(cmesh, "host", h, g)))


def test_reduce_pytree_in_place_then_out_of_place(cmesh):
    n = cmesh.size()
    with cmesh.activate():
        r = cmesh.rank(("gpu", "host")).float()  # a permutation of 0..n-1
        tree = {"a": r + 0, "b": r + 1}
    same = tdmesh.reduce_(tree, ("gpu", "host"))
    assert same["a"] is tree["a"] and same["b"] is tree["b"]
    again = tdmesh.reduce(tree, ("gpu", "host"))
    assert again["a"] is not tree["a"]
    got = fetch_every((tree, again), cmesh)
    total = n * (n - 1) // 2
    for h, g in coords(cmesh):
        t, a = got[h, g]
        assert t["a"].item() == total and t["b"].item() == total + n
        assert a["a"].item() == n * total and a["b"].item() == n * (total + n)


def test_reduce_many_in_place_equals_one_by_one(cmesh):
    """A list of tensors (mixed dtypes, a strided view, a 0-dim value) reduced in place by one
    ``tdmesh.reduce_`` call: one message, bucketed by dtype on the workers, the same values
    as one reduce per tensor."""
    d = group_dim(cmesh, "gpu")
    with cmesh.activate():
        r = cmesh.rank(("host", "gpu"))
        base = (torch.arange(12, dtype=torch.float32).view(3, 4) + r).t().contiguous()
        leaves = [
            torch.arange(6, dtype=torch.float32).view(2, 3) + r,
            (torch.arange(5) + 10 * r).to(torch.int64),
            base.t(),                                    # a strided view (its base is not in the list)
            r.to(torch.float64) + 0.5,                  # 0-dim
            torch.ones(4, dtype=torch.float32) * (r + 1),
        ]
        by_one = [t.clone() for t in leaves]
        avg_leaves = [leaves[0].clone(), leaves[4].clone()]
        client = cmesh.client
        before = client.last_seq
        same = tdmesh.reduce_(leaves, d, "sum")
        assert client.last_seq == before + 1, "a list of tensors should travel as one op"
        for t in by_one:
            t.reduce_(d, "sum")
        tdmesh.reduce_(avg_leaves, (), "avg")
        got = fetch_every((leaves, by_one, avg_leaves, base), cmesh)
    assert all(a is b for a, b in zip(same, leaves))
    n_all = cmesh.size()
    for h, g in coords(cmesh):
        mine, one_by_one, avgs, b = got[h, g]
        for a, e in zip(mine, one_by_one):
            assert a.dtype == e.dtype and torch.equal(a, e)
        group = [rank_of(cmesh, *c) for c in members(cmesh, d, h, g)]
        assert torch.equal(mine[0], sum(torch.arange(6, dtype=torch.float32).view(2, 3) + q for q in group))
        assert torch.equal(mine[1], sum((torch.arange(5) + 10 * q) for q in group))
        assert torch.equal(b.t(), mine[2])              # the view wrote through to its base
        every = range(n_all)
        assert torch.equal(avgs[0], sum(torch.arange(6, dtype=torch.float32).view(2, 3) + q for q in every) / n_all)
        assert torch.equal(avgs[1], sum(torch.ones(4) * (q + 1) for q in every) / n_all)


def test_reduce_many_falls_back_for_shared_memory_and_checks_each_tensor(cmesh):
    d = group_dim(cmesh, "gpu")
    n = cmesh.size(d)
    with cmesh.activate():
        x = torch.ones(4)
        head = x[:2]
        client = cmesh.client
        before = client.last_seq
        tdmesh.reduce_([x, head], d)                   # one storage, twice: reduced one by one
        assert client.last_seq == before + 2
        with pytest.raises(ValueError, match="unknown reduction"):
            tdmesh.reduce_([torch.ones(2), torch.ones(3)], d, "median")
        w = torch.ones(2).requires_grad_()
        with pytest.raises(TypeError, match="REQUIRES_GRAD"):
            tdmesh.reduce_([torch.ones(2), w * 2], d)
        got = inspect(x)
    assert torch.equal(got, torch.tensor([n * n, n * n, n, n], dtype=torch.float32))


def test_reduce_many_with_a_poisoned_tensor(cmesh):
    """One tensor of the list is poisoned on some ranks: nobody hangs, the call's tensors are
    marked failed with the root cause, and the group keeps working."""
    d = wide_dim(cmesh, "gpu", needs="a group of >= 2 ranks, one of them poisoned")
    n = cmesh.size(d)
    fn = remote(fail_where_coordinate_is_1, propagate=lambda x, mesh, dim: x + 1)
    with cmesh.activate():
        good = torch.ones(3)
        bad = fn(torch.zeros(3), cmesh, d)
        tdmesh.reduce_([good, bad], d)
        with pytest.raises(tdmesh.RemoteException, match="this rank refuses"):
            fetch_shard(good, host=0, gpu=0).result(timeout=60)
        after = inspect(torch.ones(2).reduce(d))
    assert torch.equal(after, torch.full((2,), float(n)))


def test_reduce_many_inside_a_compiled_function(cmesh):
    d = group_dim(cmesh, "gpu")
    n = cmesh.size(d)

    @tdmesh.compile
    def grads_step(a, b):
        tdmesh.reduce_([a, b], d)
        return a + b

    with cmesh.activate():
        outs = []
        for k in range(3):
            a, b = torch.ones(2) * (k + 1), torch.ones(3, dtype=torch.int64) * k
            outs.append((a, b, grads_step(a, b[:2].float())))
        got = fetch_every(outs, cmesh)
    for h, g in coords(cmesh):
        for k, (a, b, s) in enumerate(got[h, g]):
            assert torch.equal(a, torch.full((2,), float(n * (k + 1))))
            assert torch.equal(b, torch.full((3,), k, dtype=torch.int64))   # b itself was not in the list
            assert torch.equal(s, torch.full((2,), float(n * (k + 1) + n * k)))


def test_sub_mesh_reduce(cmesh):
    """Reduce over ``d`` on the sub-mesh at the last coordinate of the other dim."""
    d = group_dim(cmesh, "gpu")
    e, last = other(d), cmesh.size(other(d)) - 1
    sub = cmesh.slice(**{e: last})
    with sub.activate():
        v = torch.ones(()) * (sub.process_idx() + 3)  # global rank + 3
        total = v.reduce(d)
        got = [inspect(total, **{d: i}) for i in range(cmesh.size(d))]
    expected = sum(rank_of(cmesh, *c) + 3 for c in members(cmesh, d, *at(**{d: 0, e: last})))
    assert [t.item() for t in got] == [float(expected)] * cmesh.size(d)


def test_split_mesh_reduce(cmesh):
    n_host, n_gpu = cmesh.size("host"), cmesh.size("gpu")
    split = cmesh.split(host=("oh", "ih"), ih=1)
    assert split.sizes == {"oh": n_host, "ih": 1, "gpu": n_gpu}
    with split.activate():
        v = torch.ones(()) * (split.process_idx() + 3)
        per_host = v.reduce(("ih", "gpu"))
        everything = v.reduce(("oh", "gpu"))
        got = {(h, g): fetch_shard((per_host, everything), oh=h, ih=0, gpu=g) for h, g in coords(cmesh)}
    for (h, g), fut in got.items():
        p, e = fut.result()
        assert p.item() == sum(rank_of(cmesh, *c) + 3 for c in members(cmesh, "gpu", h, g))
        assert e.item() == sum(r + 3 for r in range(cmesh.size()))


def test_requires_grad_input_is_refused(cmesh):
    with cmesh.activate():
        w = torch.ones(2).requires_grad_()
        with pytest.raises(TypeError, match="REQUIRES_GRAD"):
            w.reduce("gpu")
        with torch.no_grad():
            fine = w.reduce("gpu")
        d = w.detach().reduce("gpu")
        got = inspect((fine, d), host=cmesh.size("host") - 1, gpu=0)
    n_gpu = float(cmesh.size("gpu"))
    assert torch.equal(got[0], torch.full((2,), n_gpu)) and torch.equal(got[1], torch.full((2,), n_gpu))


def test_poisoned_rank_still_takes_part(cmesh):
    """The ranks at coordinate 1 of ``d`` fail; their groups over ``d`` still reduce."""
    d = wide_dim(cmesh, "gpu", needs="a group of >= 2 ranks, one of them poisoned")
    n = cmesh.size(d)
    poisoned = shard(at(**{d: 1, other(d): 0}))
    fn = remote(fail_where_coordinate_is_1, propagate=lambda x, mesh, dim: x + 1)
    with cmesh.activate():
        x = torch.ones(2)
        y = torch.full((2,), 2.0)
        z = fn(x, cmesh, d)
        fine = (x + y).reduce(d)
        bad = z.reduce(d)
        got_fine = inspect(fine, host=cmesh.size("host") - 1, gpu=cmesh.size("gpu") - 1)
        with pytest.raises(tdmesh.RemoteException, match="this rank refuses"):
            fetch_shard(bad, host=0, gpu=0).result(timeout=60)
        with pytest.raises(tdmesh.RemoteException, match="this rank refuses"):
            fetch_shard(z, host=0, gpu=0).result(timeout=60)
        got = fetch_shard(2 * x, **poisoned).result(timeout=60)
        # the group still works afterwards: nobody is stuck inside the failed collective
        after = inspect((x + 1).reduce(d), **poisoned)
    assert torch.equal(got_fine, torch.full((2,), 3.0 * n))
    assert torch.equal(got, torch.full((2,), 2.0))
    assert torch.equal(after, torch.full((2,), 2.0 * n))


# ----------------------------------------------------------------------------- to_mesh
def _halves(mesh):
    """``(d, e)``: the dim ``d`` whose coordinates 0 and 1 are the two halves that data moves
    between (host where it has size >= 2, as the tests were written for hosts), and the other."""
    d = wide_dim(mesh, "host", needs="two halves of the mesh (a dim of size >= 2)")
    return d, other(d)


def test_to_mesh_between_hosts(cmesh, xs):
    """Between the halves at ``d=0`` and ``d=1`` (the hosts where there are two)."""
    d, e = _halves(cmesh)
    half0, half1 = cmesh.slice(**{d: 0}), cmesh.slice(**{d: 1})
    e_stride = 12 * (cmesh.size("gpu") if e == "host" else 1)
    with half0.activate():
        x = e_stride * half0.rank(e) + torch.arange(12).view(3, 4)  # local_x at d=0
    moved = x.to_mesh(half1)
    assert moved.mesh is half1 and moved.shape == (3, 4)
    a = make_x(cmesh)
    a0 = a.slice_mesh(**{d: 0})
    to0, to1 = a0.to_mesh(half0), a0.to_mesh(half1)
    futures = [(i, fetch_shard((moved, to1), **{e: i}), fetch_shard(to0, **{e: i})) for i in range(cmesh.size(e))]
    for i, f1, f0 in futures:
        m, t1 = f1.result()
        t0 = f0.result()
        expected = xs[at(**{d: 0, e: i})]
        assert torch.equal(m, expected)
        assert torch.equal(t1, expected) and torch.equal(t0, expected)


def test_to_mesh_broadcasts_over_missing_dims(cmesh, xs):
    n_host, n_gpu = cmesh.size("host"), cmesh.size("gpu")
    a = make_x(cmesh)
    last_gpu = a.slice_mesh(gpu=n_gpu - 1)
    with pytest.warns(UserWarning, match="broadcasts over destination dims \\['gpu'\\]"):
        full = last_gpu.to_mesh(cmesh)
    one = a.slice_mesh(host=n_host - 1, gpu=n_gpu - 1)
    with pytest.warns(UserWarning, match="broadcasts"):
        full2 = one.to_mesh(cmesh)
    stacked = full.reduce("gpu", "stack")
    stacked2 = full2.reduce("host", "stack").reduce("gpu", "stack")
    got = fetch_every((stacked, stacked2), cmesh)
    for h, g in coords(cmesh):
        s, s2 = got[h, g]
        assert torch.equal(s, torch.stack([xs[h, n_gpu - 1]] * n_gpu))
        assert s2.shape == (n_gpu, n_host, 3, 4)
        assert torch.equal(s2, xs[n_host - 1, n_gpu - 1].expand(n_gpu, n_host, 3, 4))


def test_to_mesh_same_mesh_is_a_copy(cmesh):
    with cmesh.activate():
        t = torch.zeros(3)
    copy = t.to_mesh(t.mesh)
    assert copy.mesh is t.mesh and copy.ref != t.ref
    with cmesh.activate():
        t.add_(1)
    got = fetch_every((t, copy), cmesh)
    for c in coords(cmesh):
        assert torch.equal(got[c][0], torch.ones(3)) and torch.equal(got[c][1], torch.zeros(3))


def test_to_mesh_onto_another_stream(cmesh):
    d, e = _halves(cmesh)
    other_stream = tdmesh.Stream("to_mesh_other")
    m0, m1 = cmesh.slice(**{d: 0}), cmesh.slice(**{d: 1})
    with m0.activate():
        # dtype= spelled out: the client caches propagation by argument value, and arange(12)
        # (int64, used above) and arange(12.0) share a cache key (12 == 12.0)
        t = torch.arange(12, dtype=torch.float32).view(3, 4) + m0.rank(e)
    t2 = t.to_mesh(m1, stream=other_stream)
    assert t2.stream is other_stream and t2.mesh is m1
    with m1.activate(), other_stream.activate():
        got = [inspect(t2 + t2, **{e: i}) for i in range(cmesh.size(e))]
    for i in range(cmesh.size(e)):
        assert torch.equal(got[i], 2 * (torch.arange(12.0).view(3, 4) + i))
    with m1.activate():
        with pytest.raises(TypeError, match="WRONG_STREAM"):
            t2 + 1


def test_to_mesh_pytree(cmesh):
    d, e = _halves(cmesh)
    half0, half1 = cmesh.slice(**{d: 0}), cmesh.slice(**{d: 1})
    with half0.activate():
        tree = {"a": torch.zeros(2), "b": torch.ones(2)}
    moved = tdmesh.to_mesh(tree, half1)
    with half1.activate():
        moved["a"].add_(1)
        moved["b"].add_(1)
        got = inspect(moved, **{e: cmesh.size(e) - 1})
    assert torch.equal(got["a"], torch.ones(2)) and torch.equal(got["b"], torch.full((2,), 2.0))


def test_slice_mesh_pytree_to_mesh_then_reduce(cmesh):
    """Each slice along ``e`` moved onto its sub-mesh, then reduced there over ``d``."""
    d = group_dim(cmesh, "gpu")
    e, n = other(d), cmesh.size(d)
    with cmesh.activate():
        coordinate = cmesh.rank(e)
        tree = {"a": torch.zeros(3) + coordinate, "b": torch.zeros(3) + coordinate + 1}
    results = []
    for i in range(cmesh.size(e)):
        sub = cmesh.slice(**{e: i})
        moved = tdmesh.to_mesh(tdmesh.slice_mesh(tree, **{e: i}), sub)
        assert moved["a"].mesh is sub
        tdmesh.reduce_(moved, d)
        results.append(fetch_shard(moved, **{d: n - 1}))
    for i, fut in enumerate(results):
        got = fut.result()
        assert torch.equal(got["a"], torch.full((3,), float(n * i)))
        assert torch.equal(got["b"], torch.full((3,), float(n * (i + 1))))


def test_to_mesh_argument_errors(cmesh):
    # a sub-mesh of a different length along a dim needs that dim to have size >= 2
    shorter = wide_dim(cmesh, "host", needs="a dim of size >= 2 to slice a sub-mesh of another length")
    shorter_dest = wide_dim(cmesh, "gpu", needs="a dim of size >= 2 to slice a sub-mesh of another length")
    with cmesh.activate():
        t = torch.ones(2)
    with pytest.raises(ValueError, match="destination mesh does not have dimensions"):
        t.to_mesh(cmesh.slice(host=0))
    with pytest.raises(ValueError, match="different length"):
        t.to_mesh(cmesh.slice(**{shorter: slice(0, 1)}))
    with pytest.raises(ValueError, match="different length"):
        t.slice_mesh(**{other(shorter_dest): 0}).to_mesh(cmesh.slice(**{shorter_dest: slice(1, 2)}))
    with pytest.raises(TypeError, match="tdmesh tensor"):
        tdmesh.to_mesh("not a tensor", cmesh)
    assert torch.equal(inspect(tdmesh.to_mesh(torch.ones(2), cmesh)), torch.ones(2))  # local data is shipped
    assert torch.equal(inspect(t), torch.ones(2))


# ----------------------------------------------------------------------------- remote process groups
@pytest.fixture(scope="module")
def values(cmesh):
    """``ones(4) * (global rank + 3)`` on the full mesh."""
    with cmesh.activate():
        return torch.ones(4) * (cmesh.process_idx() + 3)


def _plus3(mesh, cs):
    """The sum of ``global rank + 3`` over the coordinates ``cs``: what ``values`` sums to."""
    return float(sum(rank_of(mesh, *c) + 3 for c in cs))


def test_process_group_all_reduce_by_dims(cmesh, values):
    all_reduce = remote(pg_all_reduce, propagate=_like)
    full = cmesh.process_group(("host", "gpu"))
    by_gpu = cmesh.process_group("gpu")
    by_host = cmesh.process_group(("host",))
    assert full.size() == cmesh.size() and by_gpu.size() == cmesh.size("gpu") and by_host.size() == cmesh.size("host")
    with cmesh.activate():
        results = (all_reduce(values, full), all_reduce(values, by_gpu), all_reduce(values, by_host))
        got = fetch_every(results, cmesh)
    for h, g in coords(cmesh):
        f, gp, hp = got[h, g]
        assert torch.equal(f, torch.full((4,), _plus3(cmesh, coords(cmesh))))
        assert torch.equal(gp, torch.full((4,), _plus3(cmesh, members(cmesh, "gpu", h, g))))
        assert torch.equal(hp, torch.full((4,), _plus3(cmesh, members(cmesh, "host", h, g))))


def test_process_group_is_a_real_process_group(cmesh):
    d = group_dim(cmesh, "gpu")
    pg = cmesh.process_group(d)
    info = remote(pg_info)
    with cmesh.activate():
        got = {c: tdmesh.call_on_shard_and_fetch(info, pg, shard=shard(c)) for c in coords(cmesh)}
    for (h, g), fut in got.items():
        size, rank, group, real = fut.result()
        expected_group = [rank_of(cmesh, *c) for c in members(cmesh, d, h, g)]
        assert (size, rank, group, real) == (cmesh.size(d), shard((h, g))[d], expected_group, True)


def test_full_mesh_process_group_under_a_sub_mesh(cmesh):
    """A process group of the full mesh (over ``d``), used on the sub-mesh at the last
    coordinate of the other dim."""
    d = group_dim(cmesh, "gpu")
    e, last = other(d), cmesh.size(other(d)) - 1
    all_reduce = remote(pg_all_reduce, propagate=_like)
    pg = cmesh.process_group(d)
    sub = cmesh.slice(**{e: last})
    with sub.activate():
        v = torch.ones(4) * (sub.process_idx() + 3)
        got = [inspect(all_reduce(v, pg), **{d: i}) for i in range(cmesh.size(d))]
    expected = torch.full((4,), _plus3(cmesh, members(cmesh, d, *at(**{d: 0, e: last}))))
    assert all(torch.equal(t, expected) for t in got)


def test_sub_mesh_process_groups_are_distinct(cmesh):
    d = group_dim(cmesh, "gpu")
    e, n = other(d), cmesh.size(d)
    sub = cmesh.slice(**{e: 0})
    pg1 = sub.process_group((d,))
    pg2 = sub.process_group((d,))
    assert pg1 is not pg2 and pg1.ref != pg2.ref
    assert pg1.size() == n and pg2.size() == n
    all_reduce = remote(pg_all_reduce, propagate=_like)
    with sub.activate():
        v = torch.ones(2) * (sub.process_idx() + 1)
        a, b = all_reduce(v, pg1), all_reduce(v, pg2, "max")
        got = inspect((a, b), **{d: n - 1})
    ranks = [rank_of(cmesh, *c) for c in members(cmesh, d, *at(**{d: 0, e: 0}))]
    assert torch.equal(got[0], torch.full((2,), float(sum(r + 1 for r in ranks))))
    assert torch.equal(got[1], torch.full((2,), float(max(ranks) + 1)))



def test_a_dropped_process_group_is_freed_on_every_rank_and_refused_after(cmesh):
    d = group_dim(cmesh, "gpu")
    live = remote("tdmesh.worker.builtins.live_process_groups")
    all_reduce = remote(pg_all_reduce, propagate=_like)
    side = tdmesh.Stream("drop_side")
    pg = cmesh.process_group(d)

    def live_per_rank() -> dict:
        return {(point["host"], point["gpu"]): n for point, n in live.call().result()}

    with cmesh.activate():
        before = live_per_rank()
        v = torch.ones(3) * (cmesh.process_idx() + 3)
        summed = all_reduce(v, pg)
        with side.activate():
            w = torch.ones(3) * (cmesh.process_idx() + 3)
            summed_on_side = all_reduce(w, pg, "max")
        used = live_per_rank()
        pg.drop()  # right after the calls: they still run on the groups, which go after them
        got = fetch_every(summed, cmesh)
        with side.activate():
            got_on_side = fetch_every(summed_on_side, cmesh)
        after = live_per_rank()
        with pytest.raises(tdmesh.TdmeshError, match=r"\(dropped\)> was dropped, at .*test_collectives.py.*\n.*"
                                                     r"at .*test_collectives.py"):
            all_reduce(v, pg)
        pg.drop()  # a second drop does nothing
        assert "(dropped)" in repr(pg)
    assert {p: n - before[p] for p, n in used.items()} == {p: 2 for p in used}  # one group per stream it ran on
    assert after == before
    for h, g in coords(cmesh):
        group = members(cmesh, d, h, g)
        assert torch.equal(got[h, g], torch.full((3,), _plus3(cmesh, group)))
        assert torch.equal(got_on_side[h, g], torch.full((3,), max(rank_of(cmesh, *c) + 3 for c in group)))

def test_collectives_inside_remote_functions(cmesh):
    """barrier, all_gather, all_gather_into_tensor, reduce_scatter_tensor, all_reduce
    (sum/avg/product/max/min), broadcast, all_to_all_single over a mesh process group."""
    n = cmesh.size()
    pg = cmesh.process_group(("host", "gpu"))
    gathers = remote(pg_barrier_and_gathers, propagate=_gathers_meta)
    all_reduce = remote(pg_all_reduce, propagate=_like)
    reduce_scatter = remote(pg_reduce_scatter, propagate=lambda x, pg: torch.empty(x.shape[1:], dtype=x.dtype))
    broadcast = remote(pg_broadcast, propagate=_like)
    all_to_all = remote(pg_all_to_all, propagate=_like)
    with cmesh.activate():
        idx = cmesh.process_idx()
        v = torch.ones(2) * (idx + 3)               # 3, 4, ... on ranks 0, 1, ...
        mat = torch.arange(3 * n, dtype=torch.float32).view(n, 3) * (idx + 1)
        a2a_in = torch.arange(n, dtype=torch.float32) + 10 * idx      # element j goes to rank j
        results = {
            "gathers": gathers(v, pg),
            "sum": all_reduce(v, pg, "sum"), "max": all_reduce(v, pg, "max"), "min": all_reduce(v, pg, "min"),
            "product": all_reduce(v, pg, "product"), "avg": all_reduce(v, pg, "avg"),
            "reduce_scatter": reduce_scatter(mat, pg),
            "broadcast": broadcast(v, pg),
            "all_to_all": all_to_all(a2a_in, pg),
        }
        got = fetch_every(results, cmesh)
    shards = [torch.ones(2) * (r + 3) for r in range(n)]
    mats = [torch.arange(3.0 * n).view(n, 3) * (r + 1) for r in range(n)]
    for h, g in coords(cmesh):
        rank = rank_of(cmesh, h, g)
        r = got[h, g]
        parts, flat = r["gathers"]
        assert torch.equal(parts, torch.stack(shards))
        assert torch.equal(flat, torch.tensor([float(s + 3) for s in range(n) for _ in range(2)]))
        assert torch.equal(r["sum"], torch.full((2,), float(sum(s + 3 for s in range(n)))))
        assert torch.equal(r["max"], torch.full((2,), float(n + 2)))
        assert torch.equal(r["min"], torch.full((2,), 3.0))
        assert torch.equal(r["product"], torch.full((2,), float(math.prod(s + 3 for s in range(n)))))
        assert torch.equal(r["avg"], torch.full((2,), sum(s + 3 for s in range(n)) / n))  # gloo has AVG in this torch
        assert torch.equal(r["reduce_scatter"], sum(mats)[rank])
        assert torch.equal(r["broadcast"], torch.full((2,), 3.0))
        assert torch.equal(r["all_to_all"], torch.tensor([10.0 * s + rank for s in range(n)]))


def test_isend_irecv_between_hosts(cmesh):
    """Over the groups along ``d`` (the hosts where there are two): the rank at ``d=1``
    receives from the one at ``d=0``; every other rank keeps its own value."""
    d, e = _halves(cmesh)
    pg = cmesh.process_group(d)
    send_recv = remote(pg_send_recv, propagate=_like)
    with cmesh.activate():
        v = torch.arange(5, dtype=torch.float32) + 100 * cmesh.process_idx()
        got = fetch_every(send_recv(v, pg), cmesh)
    for h, g in coords(cmesh):
        c = shard((h, g))
        source = at(**{d: 0, e: c[e]}) if c[d] == 1 else (h, g)
        assert torch.equal(got[h, g], torch.arange(5.0) + 100 * rank_of(cmesh, *source))


_TORCH_BEFORE_2_13 = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)


def test_list_collectives_inside_remote_functions(cmesh):
    """all_to_all, gather, scatter, reduce, reduce_scatter and reduce_scatter_tensor(AVG)
    over the groups along ``d`` ("gpu" where it has size >= 2): group rank 0 is coordinate 0."""
    d = group_dim(cmesh, "gpu")
    n = cmesh.size(d)
    pg = cmesh.process_group(d)
    if _TORCH_BEFORE_2_13:  # NCCL has the list all_to_all in older torch too: skip on gloo only
        with cmesh.activate():
            backend = tdmesh.call_on_shard_and_fetch(remote(pg_backend), pg, shard=shard((0, 0))).result()
        if backend == "gloo":
            pytest.skip("gloo before torch 2.13 has no list all_to_all (seen on torch 2.11: 'Backend gloo "
                        "does not support alltoall'); the other ops are covered by the other tests")
    fn = remote(pg_list_collectives, propagate=_list_collectives_meta)
    with cmesh.activate():
        idx = cmesh.process_idx()
        x = torch.arange(3 * n, dtype=torch.float32).view(n, 3) + 10 * idx
        got = fetch_every(fn(x, pg), cmesh)
    xs = {c: torch.arange(3 * n, dtype=torch.float32).view(n, 3) + 10 * rank_of(cmesh, *c) for c in coords(cmesh)}
    for h, g in coords(cmesh):
        a2a, gathered, scattered, reduced, rs, rs_avg = got[h, g]
        me = shard((h, g))[d]
        peers = [xs[c] for c in members(cmesh, d, h, g)]
        assert torch.equal(a2a, torch.stack([p[me] for p in peers]))
        expected_gather = torch.stack([p[0] for p in peers]) if me == 0 else torch.zeros(n, 3)
        assert torch.equal(gathered, expected_gather)
        assert torch.equal(scattered, peers[0][me])
        assert torch.equal(reduced, sum(p[0] for p in peers) if me == 0 else torch.zeros(3))
        assert torch.equal(rs, sum(p[me] for p in peers))
        assert torch.equal(rs_avg, sum(p[me] for p in peers) / n)


def test_process_group_on_another_stream(cmesh, values):
    """The same mesh process group used from two streams: each stream gets its own
    communicator, so the calls neither mix nor wait for each other."""
    d = group_dim(cmesh, "gpu")
    all_reduce = remote(pg_all_reduce, propagate=_like)
    pg = cmesh.process_group(d)
    other_stream = tdmesh.Stream("pg_other")
    with cmesh.activate():
        on_main = all_reduce(values, pg)
        b, borrow = other_stream.borrow(values)
        with other_stream.activate():
            on_other = all_reduce(b, pg, "max")
        borrow.drop()
        got_main = fetch_every(on_main, cmesh)
        got_other = fetch_every(on_other, cmesh)
    for h, g in coords(cmesh):
        group = members(cmesh, d, h, g)
        assert torch.equal(got_main[h, g], torch.full((4,), _plus3(cmesh, group)))
        assert torch.equal(got_other[h, g], torch.full((4,), float(max(rank_of(cmesh, *c) for c in group) + 3)))


# ----------------------------------------------------------------------------- worker layouts
def test_reduce_layouts(cmesh):
    """Non-contiguous inputs, views reduced in place (the base changes), a non-contiguous
    out=, 0-dim stacks, an in-place all-to-all, and integer avg (the floor of the mean on every backend)."""
    n_host, n_gpu = cmesh.size("host"), cmesh.size("gpu")
    with cmesh.activate():
        idx = cmesh.process_idx()
        base = torch.zeros(3, 4) + idx
        base[:, 1].reduce_("gpu")                      # a column view, in place
        transposed = (torch.arange(12, dtype=torch.float32).view(3, 4) + idx).t()
        t_sum = transposed.reduce("host")
        t_stack = transposed.reduce("host", "stack")
        out = torch.zeros(3, 8)
        ret = base.reduce("host", out=out[:, ::2])     # a strided out
        scalar_stack = idx.float().reduce("gpu", "stack")
        y = rows(torch.arange(12, dtype=torch.float32) + 100 * idx, n_gpu, view=True)
        y.reduce_("gpu", "stack", scatter=True)       # all-to-all in place
        ints = torch.ones(2, 3, dtype=torch.int64) * (idx + 1)
        int_avg = ints.reduce("gpu", "avg")
        neg_avg = (-ints).reduce("gpu", "avg")          # floor, not toward zero, on every backend
        assert ret.shape == (3, 4) and scalar_stack.shape == (n_gpu,) and t_stack.shape == (n_host, 4, 3)
        got = fetch_every((base, t_sum, t_stack, out, scalar_stack, y, int_avg, neg_avg), cmesh)
    bases = {}
    for h, g in coords(cmesh):
        b = torch.zeros(3, 4) + rank_of(cmesh, h, g)
        b[:, 1] = sum(rank_of(cmesh, *c) for c in members(cmesh, "gpu", h, g))
        bases[h, g] = b
    for h, g in coords(cmesh):
        b, ts, tst, o, ss, yy, ia, na = got[h, g]
        gpu_group = members(cmesh, "gpu", h, g)
        assert torch.equal(b, bases[h, g])
        tloc = [(torch.arange(12, dtype=torch.float32).view(3, 4) + rank_of(cmesh, *c)).t()
                for c in members(cmesh, "host", h, g)]
        assert torch.equal(ts, sum(tloc))
        assert torch.equal(tst, torch.stack(tloc))
        expected_out = torch.zeros(3, 8)
        expected_out[:, ::2] = sum(bases[c] for c in members(cmesh, "host", h, g))
        assert torch.equal(o, expected_out)
        assert torch.equal(ss, torch.tensor([float(rank_of(cmesh, *c)) for c in gpu_group]))
        ys = [rows(torch.arange(12, dtype=torch.float32) + 100 * rank_of(cmesh, *c), n_gpu) for c in gpu_group]
        assert torch.equal(yy, torch.stack([p[g] for p in ys]))
        int_sum = sum(rank_of(cmesh, *c) + 1 for c in gpu_group)
        assert torch.equal(ia, torch.full((2, 3), int_sum // n_gpu, dtype=torch.int64))
        assert torch.equal(na, torch.full((2, 3), -int_sum // n_gpu, dtype=torch.int64))


def test_to_mesh_shift_where_a_rank_sends_and_receives(cmesh):
    """ranks 0,1 -> 1,2: rank 1 sends to 2 and receives from 0 in one batch."""
    if cmesh.size() < 3:
        pytest.skip(f"needs >= 3 ranks (a shift 0,1 -> 1,2, where rank 1 both sends and receives); the mesh is "
                    f"{shape_text(cmesh)} (host x gpu), {cmesh.size()} ranks")
    flat = cmesh.flatten("all")
    src, dst = flat.slice(all=slice(0, 2)), flat.slice(all=slice(1, 3))
    with src.activate():
        v = torch.ones(2) * (src.process_idx() + 10)
    moved = v.to_mesh(dst)
    got = [fetch_shard(moved, all=i) for i in range(2)]
    assert [f.result().tolist() for f in got] == [[10.0, 10.0], [11.0, 11.0]]


def test_to_mesh_of_a_borrow_on_a_p2p_stream(cmesh):
    """Borrow onto a p2p stream, move to the next stage, drop; borrow back onto the main
    stream there and read it.  The stages are the halves along ``d`` (the hosts where there are two)."""
    d, e = _halves(cmesh)
    p2p = tdmesh.Stream("p2p")
    main = tdmesh.get_active_stream()
    m0, m1 = cmesh.slice(**{d: 0}), cmesh.slice(**{d: 1})
    with m0.activate():
        x = torch.ones(3, 5) * (m0.process_idx() + 1)
        xb, x_borrow = p2p.borrow(x)
        with p2p.activate():
            y = xb.to_mesh(m1)
        x_borrow.drop()
        x.add_(100)  # the origin is writable again, and the moved copy is its own
    assert y.stream is p2p and y.mesh is m1
    with m1.activate():
        yb, y_borrow = main.borrow(y)
        doubled = yb * 2
        y_borrow.drop()
        got = [fetch_shard(doubled, **{e: i}) for i in range(cmesh.size(e))]
    for i, fut in enumerate(got):
        origin = rank_of(cmesh, *at(**{d: 0, e: i}))
        assert torch.equal(fut.result(), torch.full((3, 5), 2.0 * (origin + 1)))


def test_to_mesh_onto_fresh_streams(cmesh):
    """Regression: a sending rank looked the destination stream up from its own stream
    thread, racing the message thread that created the same stream for the next op, so
    one stream existed twice and the next op's refs vanished (ProtocolViolation)."""
    d, e = _halves(cmesh)
    h0, h1 = cmesh.slice(**{d: 0}), cmesh.slice(**{d: 1})
    with h0.activate():
        t = torch.ones(2)
    futures = []
    for i in range(64):
        s = tdmesh.Stream(f"fresh{i}")
        moved = t.to_mesh(h1, stream=s)
        with h0.activate(), s.activate():
            u = torch.ones(2) * i
        futures.append((i, fetch_shard(u, **{e: cmesh.size(e) - 1}), fetch_shard(moved, **{e: 0})))
    for i, fu, fm in futures:
        assert torch.equal(fu.result(timeout=60), torch.full((2,), float(i)))
        assert torch.equal(fm.result(timeout=60), torch.ones(2))
