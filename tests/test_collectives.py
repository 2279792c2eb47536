"""Collectives over mesh dims, moves between meshes, and remote process groups (CPU, gloo).

Every expected value is computed locally from the same formula the workers use, and
compared exactly.  Values built under ``mesh.activate()`` are remote; comparisons happen
outside the activation, on fetched (local) tensors.
"""

import pytest
import torch
import torch.distributed as dist

import tdmesh
from tdmesh import fetch_shard, inspect, remote

COORDS = [(h, g) for h in range(2) for g in range(2)]


# ----------------------------------------------------------------------------- remote functions
def fail_on_gpu1(x, mesh):
    if mesh.rank("gpu") == 1:
        raise RuntimeError("fail_on_gpu1: this rank refuses")
    return x + 1


def pg_all_reduce(x, pg, op="sum"):
    y = x.clone()
    dist.all_reduce(y, getattr(dist.ReduceOp, op.upper()), group=pg)
    return y


def pg_info(pg):
    return (dist.get_world_size(pg), dist.get_rank(pg), [dist.get_global_rank(pg, i) for i in range(pg.size())],
            isinstance(pg, dist.ProcessGroup))


def pg_barrier_and_gathers(x, pg):
    """barrier, all_gather (list), all_gather_into_tensor.  (gloo takes only the concatenated
    output form of all_gather_into_tensor, not the stacked ``[n, *shape]`` one that NCCL takes.)"""
    dist.barrier(group=pg)
    n = dist.get_world_size(pg)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=pg)
    flat = torch.empty(n * x.numel(), dtype=x.dtype)
    dist.all_gather_into_tensor(flat, x.reshape(-1), group=pg)
    return torch.stack(parts), flat


def pg_reduce_scatter(x, pg):
    """``x`` is ``[n, k]``: this rank gets the sum over the group of row ``group rank``.
    (gloo needs the flat concatenated form ``[n*k] -> [k]``; a ``[n, k] -> [k]`` call aborts
    the process in a gloo CHECK.)"""
    out = torch.empty(x.shape[1:], dtype=x.dtype)
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
    """Group rank 0 sends ``x`` to group rank 1 (isend/irecv); rank 1 returns what it got."""
    me = dist.get_rank(pg)
    peer = dist.get_global_rank(pg, 1 - me)
    if me == 0:
        dist.isend(x.contiguous(), dst=peer, group=pg).wait()
        return x.clone()
    got = torch.empty_like(x)
    dist.irecv(got, src=peer, group=pg).wait()
    return got


def pg_list_collectives(x, pg):
    """all_to_all (lists), gather and scatter to/from group rank 0, reduce to group rank 0,
    reduce_scatter (lists) and reduce_scatter_tensor with AVG.  ``x`` is ``[n, k]``."""
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
def fetch_every(obj, mesh):
    """``{(host, gpu): value}``: one fetch per rank, all in flight at once."""
    futures = {(h, g): fetch_shard(obj, host=h, gpu=g) for h, g in COORDS}
    return {c: f.result() for c, f in futures.items()}


def local_x(h, g, dtype=torch.int64):
    return (24 * h + 12 * g + torch.arange(12).view(3, 4)).to(dtype)


def make_x(mesh, dtype=torch.int64):
    with mesh.activate():
        x = 24 * mesh.rank("host") + 12 * mesh.rank("gpu") + torch.arange(12).view(3, 4)
        return x.to(dtype)


@pytest.fixture(scope="module")
def xs(mesh2x2):
    """The shards of x, fetched once, checked against the formula."""
    got = fetch_every(make_x(mesh2x2), mesh2x2)
    for h, g in COORDS:
        assert torch.equal(got[h, g], local_x(h, g))
    return got


# ----------------------------------------------------------------------------- reduce
def test_reduce_sum_over_each_dim_and_all_dims(mesh2x2, xs):
    x = make_x(mesh2x2)
    results = {
        "gpu": x.reduce("gpu"),
        "host": x.reduce("host", "sum"),
        "both": x.reduce(("gpu", "host"), "sum"),
        "all": x.reduce((), "sum"),
        "default": x.reduce(),
    }
    got = fetch_every(results, mesh2x2)
    total = sum(xs.values())
    for h, g in COORDS:
        r = got[h, g]
        assert torch.equal(r["gpu"], xs[h, 0] + xs[h, 1])
        assert torch.equal(r["host"], xs[0, g] + xs[1, g])
        assert torch.equal(r["both"], total)
        assert torch.equal(r["all"], total)
        assert torch.equal(r["default"], total)
        assert r["gpu"].dtype == torch.int64


def test_every_float_reduction(mesh2x2, xs):
    x = make_x(mesh2x2, torch.float32)
    dims = {"gpu": lambda h, g: [(h, 0), (h, 1)], "host": lambda h, g: [(0, g), (1, g)],
            ("gpu", "host"): lambda h, g: COORDS}
    ops = {"sum": lambda ts: sum(ts), "avg": lambda ts: sum(ts) / len(ts),
           "product": lambda ts: torch.stack(ts).prod(0), "min": lambda ts: torch.stack(ts).amin(0),
           "max": lambda ts: torch.stack(ts).amax(0)}
    results = {(d, op): x.reduce(d, op) for d in dims for op in ops}
    got = fetch_every(results, mesh2x2)
    for h, g in COORDS:
        for (d, op), value in got[h, g].items():
            shards = [xs[c].float() for c in dims[d](h, g)]
            expected = ops[op](shards)
            assert value.dtype == torch.float32 and value.shape == (3, 4)
            assert torch.equal(value, expected), (d, op, h, g)


def test_bitwise_reductions_on_int64(mesh2x2, xs):
    x = make_x(mesh2x2)
    ops = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
    results = {(d, op): x.reduce(d, op) for d in ("gpu", "host", ()) for op in ops}
    got = fetch_every(results, mesh2x2)
    members = {"gpu": lambda h, g: [(h, 0), (h, 1)], "host": lambda h, g: [(0, g), (1, g)], (): lambda h, g: COORDS}
    for h, g in COORDS:
        for (d, op), value in got[h, g].items():
            shards = [xs[c] for c in members[d](h, g)]
            expected = shards[0]
            for s in shards[1:]:
                expected = ops[op](expected, s)
            assert value.dtype == torch.int64
            assert torch.equal(value, expected), (d, op, h, g)


def test_stack_is_in_coordinate_order(mesh2x2, xs):
    x = make_x(mesh2x2)
    got = fetch_every({"gpu": x.reduce("gpu", "stack"), "host": x.reduce("host", "stack")}, mesh2x2)
    for h, g in COORDS:
        assert got[h, g]["gpu"].shape == (2, 3, 4)
        assert torch.equal(got[h, g]["gpu"], torch.stack([xs[h, 0], xs[h, 1]]))
        assert torch.equal(got[h, g]["host"], torch.stack([xs[0, g], xs[1, g]]))


def test_scatter_needs_dim0_of_the_group_size_then_reduce_scatter_and_all_to_all(mesh2x2, xs):
    x = make_x(mesh2x2)
    with pytest.raises(TypeError, match="When scattering"):
        x.reduce("gpu", "sum", scatter=True)
    with pytest.raises(TypeError, match="When scattering"):
        x.reduce("gpu", "stack", scatter=True)
    with mesh2x2.activate():
        y = x.reshape(2, 6)
    rs = y.reduce("gpu", "sum", scatter=True)
    a2a = y.reduce("gpu", "stack", scatter=True)
    rs_host = y.reduce("host", "max", scatter=True)
    assert rs.shape == (6,) and a2a.shape == (2, 6)
    got = fetch_every((rs, a2a, rs_host), mesh2x2)
    ys = {c: v.reshape(2, 6) for c, v in xs.items()}
    for h, g in COORDS:
        r, a, m = got[h, g]
        assert torch.equal(r, (ys[h, 0] + ys[h, 1])[g])
        assert torch.equal(a, torch.stack([ys[h, 0][g], ys[h, 1][g]]))
        assert torch.equal(m, torch.maximum(ys[0, g], ys[1, g])[h])


def test_reduce_argument_errors(mesh2x2):
    x = make_x(mesh2x2)
    with mesh2x2.activate():
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
        x.reduce("gpu", mesh=mesh2x2)
    with pytest.raises(TypeError, match="tdmesh tensor"):
        tdmesh.reduce(torch.ones(2), "gpu")
    # nothing was sent for any of these: the tensor is still usable
    got = inspect(x.reduce("gpu"), host=0, gpu=0)
    assert torch.equal(got, local_x(0, 0) + local_x(0, 1))


def test_reduce_out(mesh2x2, xs):
    x = make_x(mesh2x2)
    with mesh2x2.activate():
        out = torch.zeros(3, 4, dtype=torch.int64)
        wrong = torch.zeros(4, 3, dtype=torch.int64)
        stack_out = torch.zeros(2, 3, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"Reduce expects the shape to be torch\.Size"):
        x.reduce("gpu", out=wrong)
    with pytest.raises(ValueError, match=r"Reduce expects the shape to be torch\.Size\(\[2, 3, 4\]\)"):
        x.reduce("gpu", "stack", out=out)
    plain = x.reduce("gpu")  # no out: out's earlier contents stay as they were
    before = fetch_every(out, mesh2x2)
    result = x.reduce("gpu", out=out)
    assert result is out
    stacked = x.reduce("host", "stack", out=stack_out)
    assert stacked is stack_out
    got = fetch_every((out, plain, stack_out), mesh2x2)
    for h, g in COORDS:
        assert torch.equal(before[h, g], torch.zeros(3, 4, dtype=torch.int64))
        o, p, s = got[h, g]
        assert torch.equal(o, xs[h, 0] + xs[h, 1])
        assert torch.equal(p, o)
        assert torch.equal(s, torch.stack([xs[0, g], xs[1, g]]))
    with pytest.raises(ValueError, match="only supported when reducing a single tensor"):
        tdmesh.reduce({"a": x}, "gpu", out=out)


def test_reduce_in_place(mesh2x2, xs):
    x = make_x(mesh2x2)
    with mesh2x2.activate():
        y = x.clone()
    assert y.reduce_("host") is y
    with pytest.raises(ValueError, match="reduce_ cannot stack"):
        y.reduce_("gpu", "stack")
    with pytest.raises(ValueError, match="reduce_ cannot scatter"):
        y.view(2, 6).reduce_("gpu", "sum", scatter=True)
    got = fetch_every((x, y), mesh2x2)
    for h, g in COORDS:
        assert torch.equal(got[h, g][0], xs[h, g])  # the input of the copy is untouched
        assert torch.equal(got[h, g][1], xs[0, g] + xs[1, g])


def test_reduce_pytree_in_place_then_out_of_place(mesh2x2):
    with mesh2x2.activate():
        r = mesh2x2.rank(("gpu", "host")).float()
        tree = {"a": r + 0, "b": r + 1}
    same = tdmesh.reduce_(tree, ("gpu", "host"))
    assert same["a"] is tree["a"] and same["b"] is tree["b"]
    again = tdmesh.reduce(tree, ("gpu", "host"))
    assert again["a"] is not tree["a"]
    got = fetch_every((tree, again), mesh2x2)
    for h, g in COORDS:
        t, a = got[h, g]
        assert t["a"].item() == 6 and t["b"].item() == 10
        assert a["a"].item() == 24 and a["b"].item() == 40


def test_sub_mesh_reduce(mesh2x2):
    host1 = mesh2x2.slice(host=1)
    with host1.activate():
        v = torch.ones(()) * (host1.process_idx() + 3)  # (host+1)*2 + gpu + 1
        total = v.reduce("gpu")
        got = [inspect(total, gpu=g) for g in range(2)]
    assert [t.item() for t in got] == [11.0, 11.0]


def test_split_mesh_reduce(mesh2x2):
    split = mesh2x2.split(host=("oh", "ih"), ih=1)
    assert split.sizes == {"oh": 2, "ih": 1, "gpu": 2}
    with split.activate():
        v = torch.ones(()) * (split.process_idx() + 3)
        per_host = v.reduce(("ih", "gpu"))
        everything = v.reduce(("oh", "gpu"))
        got = {(h, g): fetch_shard((per_host, everything), oh=h, ih=0, gpu=g) for h, g in COORDS}
    for (h, g), fut in got.items():
        p, e = fut.result()
        assert p.item() == (7.0 if h == 0 else 11.0)
        assert e.item() == 18.0


def test_requires_grad_input_is_refused(mesh2x2):
    with mesh2x2.activate():
        w = torch.ones(2).requires_grad_()
        with pytest.raises(TypeError, match="REQUIRES_GRAD"):
            w.reduce("gpu")
        with torch.no_grad():
            fine = w.reduce("gpu")
        d = w.detach().reduce("gpu")
        got = inspect((fine, d), host=1, gpu=0)
    assert torch.equal(got[0], torch.full((2,), 2.0)) and torch.equal(got[1], torch.full((2,), 2.0))


def test_poisoned_rank_still_takes_part(mesh2x2):
    fn = remote(fail_on_gpu1, propagate=lambda x, mesh: x + 1)
    with mesh2x2.activate():
        x = torch.ones(2)
        y = torch.full((2,), 2.0)
        z = fn(x, mesh2x2)
        fine = (x + y).reduce("gpu")
        bad = z.reduce("gpu")
        got_fine = inspect(fine, host=1, gpu=1)
        with pytest.raises(tdmesh.RemoteException, match="this rank refuses"):
            fetch_shard(bad, host=0, gpu=0).result(timeout=60)
        with pytest.raises(tdmesh.RemoteException, match="this rank refuses"):
            fetch_shard(z, host=0, gpu=0).result(timeout=60)
        got = fetch_shard(2 * x, host=0, gpu=1).result(timeout=60)
        # the group still works afterwards: nobody is stuck inside the failed collective
        after = inspect((x + 1).reduce("gpu"), host=0, gpu=1)
    assert torch.equal(got_fine, torch.full((2,), 6.0))
    assert torch.equal(got, torch.full((2,), 2.0))
    assert torch.equal(after, torch.full((2,), 4.0))


# ----------------------------------------------------------------------------- to_mesh
def test_to_mesh_between_hosts(mesh2x2, xs):
    host0, host1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with host0.activate():
        x = 12 * host0.rank("gpu") + torch.arange(12).view(3, 4)
    moved = x.to_mesh(host1)
    assert moved.mesh is host1 and moved.shape == (3, 4)
    a = make_x(mesh2x2)
    a0 = a.slice_mesh(host=0)
    to0, to1 = a0.to_mesh(host0), a0.to_mesh(host1)
    futures = [(g, fetch_shard((moved, to1), gpu=g), fetch_shard(to0, gpu=g)) for g in range(2)]
    for g, f1, f0 in futures:
        m, t1 = f1.result()
        t0 = f0.result()
        assert torch.equal(m, xs[0, g])
        assert torch.equal(t1, xs[0, g]) and torch.equal(t0, xs[0, g])


def test_to_mesh_broadcasts_over_missing_dims(mesh2x2, xs):
    a = make_x(mesh2x2)
    gpu1 = a.slice_mesh(gpu=1)
    with pytest.warns(UserWarning, match="broadcasts over destination dims \\['gpu'\\]"):
        full = gpu1.to_mesh(mesh2x2)
    one = a.slice_mesh(host=1, gpu=1)
    with pytest.warns(UserWarning, match="broadcasts"):
        full2 = one.to_mesh(mesh2x2)
    stacked = full.reduce("gpu", "stack")
    stacked2 = full2.reduce("host", "stack").reduce("gpu", "stack")
    got = fetch_every((stacked, stacked2), mesh2x2)
    for h, g in COORDS:
        s, s2 = got[h, g]
        assert torch.equal(s, torch.stack([xs[h, 1], xs[h, 1]]))
        assert s2.shape == (2, 2, 3, 4)
        assert torch.equal(s2, xs[1, 1].expand(2, 2, 3, 4))


def test_to_mesh_same_mesh_is_a_copy(mesh2x2):
    with mesh2x2.activate():
        t = torch.zeros(3)
    copy = t.to_mesh(t.mesh)
    assert copy.mesh is t.mesh and copy.ref != t.ref
    with mesh2x2.activate():
        t.add_(1)
    got = fetch_every((t, copy), mesh2x2)
    for c in COORDS:
        assert torch.equal(got[c][0], torch.ones(3)) and torch.equal(got[c][1], torch.zeros(3))


def test_to_mesh_onto_another_stream(mesh2x2):
    other = tdmesh.Stream("to_mesh_other")
    m0, m1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with m0.activate():
        # dtype= spelled out: the client caches propagation by argument value, and arange(12)
        # (int64, used above) and arange(12.0) share a cache key (12 == 12.0)
        t = torch.arange(12, dtype=torch.float32).view(3, 4) + m0.rank("gpu")
    t2 = t.to_mesh(m1, stream=other)
    assert t2.stream is other and t2.mesh is m1
    with m1.activate(), other.activate():
        got = [inspect(t2 + t2, gpu=g) for g in range(2)]
    for g in range(2):
        assert torch.equal(got[g], 2 * (torch.arange(12.0).view(3, 4) + g))
    with m1.activate():
        with pytest.raises(TypeError, match="WRONG_STREAM"):
            t2 + 1


def test_to_mesh_pytree(mesh2x2):
    host0, host1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with host0.activate():
        tree = {"a": torch.zeros(2), "b": torch.ones(2)}
    moved = tdmesh.to_mesh(tree, host1)
    with host1.activate():
        moved["a"].add_(1)
        moved["b"].add_(1)
        got = inspect(moved, gpu=1)
    assert torch.equal(got["a"], torch.ones(2)) and torch.equal(got["b"], torch.full((2,), 2.0))


def test_slice_mesh_pytree_to_mesh_then_reduce(mesh2x2):
    with mesh2x2.activate():
        host = mesh2x2.rank("host")
        tree = {"a": torch.zeros(3) + host, "b": torch.zeros(3) + host + 1}
    results = []
    for i in range(2):
        sub = mesh2x2.slice(host=i)
        moved = tdmesh.to_mesh(tdmesh.slice_mesh(tree, host=i), sub)
        assert moved["a"].mesh is sub
        tdmesh.reduce_(moved, "gpu")
        results.append(fetch_shard(moved, gpu=1))
    for i, fut in enumerate(results):
        got = fut.result()
        assert torch.equal(got["a"], torch.full((3,), 2.0 * i))
        assert torch.equal(got["b"], torch.full((3,), 2.0 * (i + 1)))


def test_to_mesh_argument_errors(mesh2x2):
    with mesh2x2.activate():
        t = torch.ones(2)
    with pytest.raises(ValueError, match="destination mesh does not have dimensions"):
        t.to_mesh(mesh2x2.slice(host=0))
    with pytest.raises(ValueError, match="different length"):
        t.to_mesh(mesh2x2.slice(host=slice(0, 1)))
    with pytest.raises(ValueError, match="different length"):
        t.slice_mesh(host=0).to_mesh(mesh2x2.slice(gpu=slice(1, 2)))
    with pytest.raises(TypeError, match="tdmesh tensor"):
        tdmesh.to_mesh(torch.ones(2), mesh2x2)
    assert torch.equal(inspect(t), torch.ones(2))


# ----------------------------------------------------------------------------- remote process groups
@pytest.fixture(scope="module")
def values(mesh2x2):
    """``ones(4) * ((host+1)*2 + gpu + 1)`` on the full mesh."""
    with mesh2x2.activate():
        return torch.ones(4) * (mesh2x2.process_idx() + 3)


def test_process_group_all_reduce_by_dims(mesh2x2, values):
    all_reduce = remote(pg_all_reduce, propagate=_like)
    full = mesh2x2.process_group(("host", "gpu"))
    by_gpu = mesh2x2.process_group("gpu")
    by_host = mesh2x2.process_group(("host",))
    assert full.size() == 4 and by_gpu.size() == 2 and by_host.size() == 2
    with mesh2x2.activate():
        results = (all_reduce(values, full), all_reduce(values, by_gpu), all_reduce(values, by_host))
        got = fetch_every(results, mesh2x2)
    for h, g in COORDS:
        f, gp, hp = got[h, g]
        assert torch.equal(f, torch.full((4,), 18.0))
        assert torch.equal(gp, torch.full((4,), 7.0 if h == 0 else 11.0))
        assert torch.equal(hp, torch.full((4,), 8.0 if g == 0 else 10.0))


def test_process_group_is_a_real_process_group(mesh2x2):
    pg = mesh2x2.process_group("gpu")
    info = remote(pg_info)
    with mesh2x2.activate():
        got = {c: tdmesh.call_on_shard_and_fetch(info, pg, shard={"host": c[0], "gpu": c[1]}) for c in COORDS}
    for (h, g), fut in got.items():
        size, rank, members, real = fut.result()
        assert (size, rank, members, real) == (2, g, [2 * h, 2 * h + 1], True)


def test_full_mesh_process_group_under_a_sub_mesh(mesh2x2):
    all_reduce = remote(pg_all_reduce, propagate=_like)
    pg = mesh2x2.process_group("gpu")
    host1 = mesh2x2.slice(host=1)
    with host1.activate():
        v = torch.ones(4) * (host1.process_idx() + 3)
        got = [inspect(all_reduce(v, pg), gpu=g) for g in range(2)]
    assert all(torch.equal(t, torch.full((4,), 11.0)) for t in got)


def test_sub_mesh_process_groups_are_distinct(mesh2x2):
    host0 = mesh2x2.slice(host=0)
    pg1 = host0.process_group(("gpu",))
    pg2 = host0.process_group(("gpu",))
    assert pg1 is not pg2 and pg1.ref != pg2.ref
    assert pg1.size() == 2 and pg2.size() == 2
    all_reduce = remote(pg_all_reduce, propagate=_like)
    with host0.activate():
        v = torch.ones(2) * (host0.process_idx() + 1)
        a, b = all_reduce(v, pg1), all_reduce(v, pg2, "max")
        got = inspect((a, b), gpu=1)
    assert torch.equal(got[0], torch.full((2,), 3.0)) and torch.equal(got[1], torch.full((2,), 2.0))


def test_collectives_inside_remote_functions(mesh2x2):
    """barrier, all_gather, all_gather_into_tensor, reduce_scatter_tensor, all_reduce
    (sum/avg/product/max/min), broadcast, all_to_all_single over a mesh process group."""
    pg = mesh2x2.process_group(("host", "gpu"))
    gathers = remote(pg_barrier_and_gathers, propagate=_gathers_meta)
    all_reduce = remote(pg_all_reduce, propagate=_like)
    reduce_scatter = remote(pg_reduce_scatter, propagate=lambda x, pg: torch.empty(x.shape[1:], dtype=x.dtype))
    broadcast = remote(pg_broadcast, propagate=_like)
    all_to_all = remote(pg_all_to_all, propagate=_like)
    with mesh2x2.activate():
        idx = mesh2x2.process_idx()
        v = torch.ones(2) * (idx + 3)               # 3 4 5 6 on ranks 0..3
        mat = torch.arange(12, dtype=torch.float32).view(4, 3) * (idx + 1)
        a2a_in = torch.arange(4, dtype=torch.float32) + 10 * idx      # element j goes to rank j
        results = {
            "gathers": gathers(v, pg),
            "sum": all_reduce(v, pg, "sum"), "max": all_reduce(v, pg, "max"), "min": all_reduce(v, pg, "min"),
            "product": all_reduce(v, pg, "product"), "avg": all_reduce(v, pg, "avg"),
            "reduce_scatter": reduce_scatter(mat, pg),
            "broadcast": broadcast(v, pg),
            "all_to_all": all_to_all(a2a_in, pg),
        }
        got = fetch_every(results, mesh2x2)
    shards = [torch.ones(2) * (r + 3) for r in range(4)]
    mats = [torch.arange(12.0).view(4, 3) * (r + 1) for r in range(4)]
    for h, g in COORDS:
        rank = 2 * h + g
        r = got[h, g]
        parts, flat = r["gathers"]
        assert torch.equal(parts, torch.stack(shards))
        assert torch.equal(flat, torch.tensor([3.0, 3, 4, 4, 5, 5, 6, 6]))
        assert torch.equal(r["sum"], torch.full((2,), 18.0))
        assert torch.equal(r["max"], torch.full((2,), 6.0))
        assert torch.equal(r["min"], torch.full((2,), 3.0))
        assert torch.equal(r["product"], torch.full((2,), 360.0))
        assert torch.equal(r["avg"], torch.full((2,), 4.5))  # gloo has AVG in this torch
        assert torch.equal(r["reduce_scatter"], sum(mats)[rank])
        assert torch.equal(r["broadcast"], torch.full((2,), 3.0))
        assert torch.equal(r["all_to_all"], torch.tensor([10.0 * s + rank for s in range(4)]))


def test_isend_irecv_between_hosts(mesh2x2):
    pg = mesh2x2.process_group("host")
    send_recv = remote(pg_send_recv, propagate=_like)
    with mesh2x2.activate():
        v = torch.arange(5, dtype=torch.float32) + 100 * mesh2x2.process_idx()
        got = fetch_every(send_recv(v, pg), mesh2x2)
    for h, g in COORDS:
        assert torch.equal(got[h, g], torch.arange(5.0) + 100 * g)  # host1 got host0's value


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
                    reason="gloo before torch 2.13 has no list all_to_all (seen on torch 2.11: 'Backend gloo "
                           "does not support alltoall'); the other ops are covered by the other tests")
def test_list_collectives_inside_remote_functions(mesh2x2):
    """all_to_all, gather, scatter, reduce, reduce_scatter and reduce_scatter_tensor(AVG)
    over the "gpu" groups: group rank 0 is gpu 0 of each host."""
    pg = mesh2x2.process_group("gpu")
    fn = remote(pg_list_collectives, propagate=_list_collectives_meta)
    with mesh2x2.activate():
        idx = mesh2x2.process_idx()
        x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * idx
        got = fetch_every(fn(x, pg), mesh2x2)
    xs = {(h, g): torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * (2 * h + g) for h, g in COORDS}
    for h, g in COORDS:
        a2a, gathered, scattered, reduced, rs, rs_avg = got[h, g]
        peers = [xs[h, 0], xs[h, 1]]
        assert torch.equal(a2a, torch.stack([p[g] for p in peers]))
        expected_gather = torch.stack([p[0] for p in peers]) if g == 0 else torch.zeros(2, 3)
        assert torch.equal(gathered, expected_gather)
        assert torch.equal(scattered, xs[h, 0][g])
        assert torch.equal(reduced, peers[0][0] + peers[1][0] if g == 0 else torch.zeros(3))
        assert torch.equal(rs, peers[0][g] + peers[1][g])
        assert torch.equal(rs_avg, (peers[0][g] + peers[1][g]) / 2)


def test_process_group_on_another_stream(mesh2x2, values):
    """The same mesh process group used from two streams: each stream gets its own
    communicator, so the calls neither mix nor wait for each other."""
    all_reduce = remote(pg_all_reduce, propagate=_like)
    pg = mesh2x2.process_group("gpu")
    other = tdmesh.Stream("pg_other")
    with mesh2x2.activate():
        on_main = all_reduce(values, pg)
        b, borrow = other.borrow(values)
        with other.activate():
            on_other = all_reduce(b, pg, "max")
        borrow.drop()
        got_main = fetch_every(on_main, mesh2x2)
        got_other = fetch_every(on_other, mesh2x2)
    for h, g in COORDS:
        assert torch.equal(got_main[h, g], torch.full((4,), 7.0 if h == 0 else 11.0))
        assert torch.equal(got_other[h, g], torch.full((4,), 4.0 if h == 0 else 6.0))


# ----------------------------------------------------------------------------- worker layouts
def test_reduce_layouts(mesh2x2):
    """Non-contiguous inputs, views reduced in place (the base changes), a non-contiguous
    out=, 0-dim stacks, an in-place all-to-all, and integer avg (floor, emulated on gloo)."""
    with mesh2x2.activate():
        idx = mesh2x2.process_idx()
        base = torch.zeros(3, 4) + idx
        base[:, 1].reduce_("gpu")                      # a column view, in place
        transposed = (torch.arange(12, dtype=torch.float32).view(3, 4) + idx).t()
        t_sum = transposed.reduce("host")
        t_stack = transposed.reduce("host", "stack")
        out = torch.zeros(3, 8)
        ret = base.reduce("host", out=out[:, ::2])     # a strided out
        scalar_stack = idx.float().reduce("gpu", "stack")
        y = (torch.arange(12, dtype=torch.float32) + 100 * idx).view(2, 6)
        y.reduce_("gpu", "stack", scatter=True)       # all-to-all in place
        ints = torch.ones(2, 3, dtype=torch.int64) * (idx + 1)
        int_avg = ints.reduce("gpu", "avg")
        assert ret.shape == (3, 4) and scalar_stack.shape == (2,) and t_stack.shape == (2, 4, 3)
        got = fetch_every((base, t_sum, t_stack, out, scalar_stack, y, int_avg), mesh2x2)
    bases = {}
    for h, g in COORDS:
        b = torch.zeros(3, 4) + (2 * h + g)
        b[:, 1] = (2 * h) + (2 * h + 1)
        bases[h, g] = b
    for h, g in COORDS:
        r = 2 * h + g
        b, ts, tst, o, ss, yy, ia = got[h, g]
        assert torch.equal(b, bases[h, g])
        tloc = [(torch.arange(12, dtype=torch.float32).view(3, 4) + (2 * hh + g)).t() for hh in range(2)]
        assert torch.equal(ts, tloc[0] + tloc[1])
        assert torch.equal(tst, torch.stack(tloc))
        expected_out = torch.zeros(3, 8)
        expected_out[:, ::2] = bases[0, g] + bases[1, g]
        assert torch.equal(o, expected_out)
        assert torch.equal(ss, torch.tensor([2.0 * h, 2.0 * h + 1]))
        ys = [(torch.arange(12, dtype=torch.float32) + 100 * (2 * h + gg)).view(2, 6) for gg in range(2)]
        assert torch.equal(yy, torch.stack([ys[0][g], ys[1][g]]))
        assert torch.equal(ia, torch.full((2, 3), (2 * h + 1 + 2 * h + 2) // 2, dtype=torch.int64))


def test_to_mesh_shift_where_a_rank_sends_and_receives(mesh2x2):
    """ranks 0,1 -> 1,2: rank 1 sends to 2 and receives from 0 in one batch."""
    flat = mesh2x2.flatten("all")
    src, dst = flat.slice(all=slice(0, 2)), flat.slice(all=slice(1, 3))
    with src.activate():
        v = torch.ones(2) * (src.process_idx() + 10)
    moved = v.to_mesh(dst)
    got = [fetch_shard(moved, all=i) for i in range(2)]
    assert [f.result().tolist() for f in got] == [[10.0, 10.0], [11.0, 11.0]]


def test_to_mesh_of_a_borrow_on_a_p2p_stream(mesh2x2):
    """Borrow onto a p2p stream, move to the next stage, drop; borrow back onto the main
    stream there and read it."""
    p2p = tdmesh.Stream("p2p")
    main = tdmesh.get_active_stream()
    m0, m1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
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
        got = [fetch_shard(doubled, gpu=g) for g in range(2)]
    for g, fut in enumerate(got):
        assert torch.equal(fut.result(), torch.full((3, 5), 2.0 * (g + 1)))


def test_to_mesh_onto_fresh_streams(mesh2x2):
    """Regression: a sending rank looked the destination stream up from its own stream
    thread, racing the message thread that created the same stream for the next op, so
    one stream existed twice and the next op's refs vanished (ProtocolViolation)."""
    h0, h1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with h0.activate():
        t = torch.ones(2)
    futures = []
    for i in range(64):
        s = tdmesh.Stream(f"fresh{i}")
        moved = t.to_mesh(h1, stream=s)
        with h0.activate(), s.activate():
            u = torch.ones(2) * i
        futures.append((i, fetch_shard(u, gpu=1), fetch_shard(moved, gpu=0)))
    for i, fu, fm in futures:
        assert torch.equal(fu.result(timeout=60), torch.full((2,), float(i)))
        assert torch.equal(fm.result(timeout=60), torch.ones(2))
