"""The SPMD idioms of a training script on a mesh, against what torch gives: a torchrun job's ranks (seeds,
torch.distributed calls), or local torch on the whole batch (SyncBatchNorm), or each rank's local torch
(indexing by a rank).  Equal, or refused at the user's line with the way out."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from ecosystem_models import Net, rank_values
from hypothesis import given, settings
from hypothesis import strategies as st

import tdmesh

from paths import REPO, SCRIPTS

SEED = 1234


@pytest.fixture(scope="module")
def mesh():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as m:
        yield m


@pytest.fixture(scope="module")
def spmd(tmp_path_factory):
    """Each rank's results of tests/scripts/spmd_reference.py under a real torchrun (2 ranks, gloo)."""
    out = tmp_path_factory.mktemp("spmd")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          os.path.join(SCRIPTS, "spmd_reference.py"), str(out), str(SEED)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def per_rank(mesh) -> tdmesh.Tensor:
    """``rank_values(SEED, rank)`` on each rank: both shipped, each rank picks its own by its rank."""
    with tdmesh.no_mesh.activate():
        both = torch.stack([rank_values(SEED, r) for r in range(2)])
    return torch.tensor(both)[mesh.rank("gpu")]


def test_manual_seed_gives_every_rank_a_torchrun_ranks_initial_weights_and_draws(mesh, spmd):
    with mesh.activate():
        torch.manual_seed(SEED)
        model = Net()
        draws = torch.randn(5)
        for g in range(2):
            params = tdmesh.fetch_shard(model.state_dict(), host=0, gpu=g).result()
            assert params.keys() == spmd[g]["params"].keys()
            for name, value in params.items():
                assert torch.equal(value, spmd[g]["params"][name]), (g, name)
            assert torch.equal(tdmesh.fetch_shard(draws, host=0, gpu=g).result(), spmd[g]["draws"])


def test_torch_distributed_calls_on_mesh_tensors_give_each_rank_what_torchrun_gives(mesh, spmd):
    with mesh.activate():
        t = per_rank(mesh)
        assert dist.get_world_size() == 2
        reduced = {}
        for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
            reduced[op] = t.clone()
            assert dist.all_reduce(reduced[op], getattr(dist.ReduceOp, op)) is None
        b = t.clone()
        assert dist.broadcast(b, src=1) is None  # async_op=False: None, as torch
        gathered = [torch.empty_like(t) for _ in range(2)]
        work = dist.all_gather(gathered, t, async_op=True)
        assert work.wait() and work.is_completed()
        dist.barrier()
        for g in range(2):
            got = tdmesh.fetch_shard((reduced, b, gathered), host=0, gpu=g).result()
            for op in reduced:
                assert torch.allclose(got[0][op], spmd[g]["reduced"][op], rtol=1e-6), (op, g)
            assert torch.equal(got[1], spmd[g]["broadcast"])
            assert all(torch.equal(a, e) for a, e in zip(got[2], spmd[g]["gathered"]))
        with pytest.raises(tdmesh.UsageError, match=r"mesh\.rank\(\['host', 'gpu'\]\)"):
            dist.get_rank()
        with pytest.raises(tdmesh.UsageError, match="the mesh is the job's group"):
            dist.init_process_group("gloo")
        with pytest.raises(tdmesh.UsageError, match="reduce_grads_in_backward"):
            torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    assert not dist.is_initialized()  # the client has no process group of its own: torch's answer, unchanged


@settings(max_examples=40, deadline=None, database=None)
@given(first=st.integers(0, 2**20),
       steps=st.lists(st.tuples(st.sampled_from(["seed", "cuda_seed", "randn", "rand", "randint", "normal_", "dropout",
                                                 "local"]), st.integers(0, 2**20)), max_size=8))
def test_seeded_draws_on_every_rank_are_local_torchs_after_the_same_seeds(mesh, first, steps):
    """The workers' draws follow ``torch.manual_seed`` as one rank's torch does; the client's own local draws
    (under no_mesh) follow it on the client's generator (docs/coverage.md: two streams where a rank has one)."""
    steps = [("seed", first), *steps]
    mesh_out, local_mesh_stream, local_client = [], [], []
    with tdmesh.no_mesh.activate():  # the reference: what each rank's (and the client's) torch draws
        workers, client = torch.Generator(), torch.Generator()
        workers.set_state(torch.random.default_generator.get_state())
        client.set_state(torch.random.default_generator.get_state())
    with mesh.activate():
        for what, value in steps:
            if what == "seed":
                torch.manual_seed(value)
                workers.manual_seed(value)
                client.manual_seed(value)
            elif what == "cuda_seed":  # a CPU mesh: nothing to seed, nothing changes
                torch.cuda.manual_seed_all(value)
            elif what == "local":
                with tdmesh.no_mesh.activate():
                    local_client.append((torch.rand(3), torch.rand(3, generator=client)))
            else:
                made, expected = _draw(what), None
                with tdmesh.no_mesh.activate():
                    expected = _draw(what, workers)
                mesh_out.append(made)
                local_mesh_stream.append(expected)
        for g in range(2):
            got = tdmesh.fetch_shard(mesh_out, host=0, gpu=g).result()
            assert all(torch.equal(a, b) for a, b in zip(got, local_mesh_stream)), g
    assert all(torch.equal(a, b) for a, b in local_client)


def _draw(what: str, generator=None):
    if what == "randn":
        return torch.randn(4, generator=generator)
    if what == "rand":
        return torch.rand(2, 3, generator=generator)
    if what == "randint":
        return torch.randint(0, 100, (5,), generator=generator)
    if what == "normal_":
        return torch.empty(3).normal_(generator=generator)
    # dropout draws from the default generator (no generator argument): the reference swaps it in
    if generator is None:
        return torch.nn.functional.dropout(torch.ones(8), 0.5)
    state = torch.random.default_generator.get_state()
    torch.random.default_generator.set_state(generator.get_state())
    try:
        return torch.nn.functional.dropout(torch.ones(8), 0.5)
    finally:
        generator.set_state(torch.random.default_generator.get_state())
        torch.random.default_generator.set_state(state)


@settings(max_examples=12, deadline=None, database=None)
@given(dims=st.sampled_from([1, 2, 3]), batch=st.integers(1, 3), channels=st.integers(1, 4),
       affine=st.booleans(), track=st.booleans(), momentum=st.sampled_from([0.1, None]), steps=st.integers(1, 2),
       seed=st.integers(0, 2**16))
def test_sync_batch_norm_normalises_with_the_whole_batch_like_batch_norm_over_it(mesh, dims, batch, channels, affine,
                                                                                 track, momentum, steps, seed):
    spatial = {1: (), 2: (5,), 3: (3, 4)}[dims]
    g = torch.Generator().manual_seed(seed)
    shares = [torch.randn(batch, channels, *spatial, generator=g) * (r + 1) + r for r in range(2)]
    weights = [torch.randn(batch, channels, *spatial, generator=g) for _ in range(2)]
    if batch * 2 * max(1, int(torch.tensor(spatial).prod())) < 2:
        return
    local = torch.nn.BatchNorm1d(channels, affine=affine, track_running_stats=track, momentum=momentum) \
        if dims < 3 else torch.nn.BatchNorm2d(channels, affine=affine, track_running_stats=track, momentum=momentum)
    want = []
    for _ in range(steps):
        x = torch.cat(shares).requires_grad_()
        y = local(x)
        per_rank_params = []
        for r in range(2):  # each rank's weight gradient is its own share's (DDP reduces it later)
            local.zero_grad()
            part = slice(r * batch, (r + 1) * batch)
            (y[part] * weights[r]).sum().backward(retain_graph=True)
            per_rank_params.append([p.grad.clone() for p in local.parameters()])
        x.grad = None
        (y * torch.cat(weights)).sum().backward()
        want.append((y.detach(), x.grad.clone(), per_rank_params,
                     [b.clone() for b in local.buffers() if b.is_floating_point()]))
    with mesh.activate():
        sync = torch.nn.SyncBatchNorm(channels, affine=affine, track_running_stats=track, momentum=momentum)
        with tdmesh.no_mesh.activate():
            both, wboth = torch.stack(shares), torch.stack(weights)
        got = []
        for _ in range(steps):
            x = torch.tensor(both)[mesh.rank("gpu")].requires_grad_()
            y = sync(x)
            sync.zero_grad()
            (y * torch.tensor(wboth)[mesh.rank("gpu")]).sum().backward()
            got.append([tdmesh.fetch_shard((y, x.grad, [p.grad for p in sync.parameters()],
                                            [b for b in sync.buffers() if b.is_floating_point()]),
                                           host=0, gpu=r).result() for r in range(2)])
    for (y, xg, params, buffers), ranks in zip(want, got):
        for r, (gy, gxg, gparams, gbuffers) in enumerate(ranks):
            part = slice(r * batch, (r + 1) * batch)
            assert torch.allclose(gy, y[part], rtol=1e-4, atol=1e-5)
            assert torch.allclose(gxg, xg[part], rtol=1e-4, atol=1e-4)
            assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(gparams, params[r]))
            assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(gbuffers, buffers))


@settings(max_examples=40, deadline=None, database=None)
@given(rows=st.integers(2, 4), cols=st.integers(2, 5), form=st.sampled_from(
    ["x[i]", "x[:, i]", "x[i, 1]", "x[..., i, None]", "x[i][1:]", "x[i] = v", "x[1:, i] = v", "x[i, i] = 7"]))
def test_indexing_by_a_rank_gives_each_rank_its_local_torchs_row(mesh, rows, cols, form):
    with tdmesh.no_mesh.activate():
        base = torch.arange(float(rows * cols)).reshape(rows, cols)
    with mesh.activate():
        x = torch.tensor(base)
        i = mesh.rank("gpu")
        out, want = _index(form, x, i), []
        for g in range(2):
            with tdmesh.no_mesh.activate():
                want.append(_index(form, base.clone(), g))
            assert torch.equal(tdmesh.fetch_shard(out, host=0, gpu=g).result(), want[g]), (form, g)
        if "=" not in form:
            with pytest.raises(tdmesh.PlacementError, match="INDEXED_COPY.*x\\[i\\] = value"):
                out.add_(1)


def _index(form: str, x, i):
    if form == "x[i]":
        return x[i]
    if form == "x[:, i]":
        return x[:, i]
    if form == "x[i, 1]":
        return x[i, 1]
    if form == "x[..., i, None]":
        return x[..., i, None]
    if form == "x[i][1:]":
        return x[i][1:]
    if form == "x[i] = v":
        x[i] = -1.0
    elif form == "x[1:, i] = v":
        x[1:, i] = torch.arange(float(x.shape[0] - 1))
    else:
        x[i, i] = 7
    return x


def test_torch_tensor_of_a_mesh_tensor_warns_at_the_users_line_as_torch_does(mesh):
    with mesh.activate(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        t = torch.ones(2)
        copy = torch.tensor(t)  # the line torch's warning must name
        line = sys._getframe().f_lineno - 1
        shipped = torch.tensor([1.0, 2.0])
    copies = [w for w in said if "To copy construct from a tensor" in str(w.message)]
    assert len(copies) == 1 and copies[0].filename == __file__ and copies[0].lineno == line
    assert type(copy) is tdmesh.Tensor and copy.ref != t.ref and type(shipped) is tdmesh.Tensor
