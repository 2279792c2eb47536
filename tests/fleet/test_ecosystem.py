"""DTensor interop and profiling on real CPU workers."""

import json
import os

import torch

import tdmesh


def dtensor_views(x, tmesh):
    from torch.distributed.tensor import DTensor, Partial, Shard
    summed = DTensor.from_local(x, tmesh["gpu"], [Partial()]).full_tensor()
    gathered = DTensor.from_local(x, tmesh["host"], [Shard(0)]).full_tensor()
    return summed, gathered, torch.tensor([tmesh.size(), tmesh.ndim])


def test_dtensor_in_a_remote_function_matches_reduce(mesh2x2):
    f = tdmesh.remote(dtensor_views, propagate=lambda x, m: (torch.empty(2), torch.empty(4),
                                                             torch.empty(2, dtype=torch.int64)))
    with mesh2x2.activate():
        x = torch.ones(2) * (mesh2x2.rank("gpu") + 1 + 10 * mesh2x2.rank("host"))
        summed, gathered, sizes = f(x, mesh2x2.torch_mesh())
        got = {(h, g): tdmesh.fetch_shard((summed, x.reduce("gpu"), gathered, sizes), host=h, gpu=g).result()
               for h in range(2) for g in range(2)}
    for (h, g), (s, reduced, gath, sz) in got.items():
        assert torch.equal(s, reduced) and torch.equal(s, torch.full((2,), 3.0 + 20 * h))
        assert torch.equal(gath, torch.tensor([g + 1.0, g + 1.0, g + 11.0, g + 11.0]))
        assert sz.tolist() == [4, 2]


def test_profile_writes_one_trace_per_rank(mesh2x2, tmp_path):
    with mesh2x2.activate():
        with tdmesh.profile(str(tmp_path)) as where:
            x = torch.randn(32, 32)
            for _ in range(3):
                x = x @ x
        assert where == str(tmp_path)
    files = sorted(os.listdir(tmp_path))
    assert files == [f"rank{r}.trace.json" for r in range(4)]
    for name in files:
        events = json.load(open(tmp_path / name))["traceEvents"]
        assert any(e.get("name") == "aten::mm" for e in events)


def test_show_draws_a_value_on_every_rank(mesh2x2):
    with mesh2x2.activate():
        text = tdmesh.show(torch.ones(2) * mesh2x2.process_idx())
        big = tdmesh.show(torch.arange(100.0) + mesh2x2.rank("gpu"))
    lines = text.splitlines()
    assert lines[0].split() == ["host", "gpu", "|", "value"]
    assert lines[2:] == ["   0    0  | [0.0, 0.0]", "   0    1  | [1.0, 1.0]",
                         "   1    0  | [2.0, 2.0]", "   1    1  | [3.0, 3.0]"]
    assert "[100] float32  min 1  mean 50.5  max 100" in big


def test_mesh_repr_and_table_show_the_rank_grid(mesh2x2):
    assert repr(mesh2x2) == "<DeviceMesh {host=2, gpu=2} ranks 0..3>"
    assert str(mesh2x2).splitlines()[1:] == ["       | gpu: 0 1", "host=0 |      0 1", "host=1 |      2 3"]


def worker_writes_to_stderr(text):
    os.write(2, text.encode())


def test_a_profile_prints_no_kineto_error_and_keeps_what_others_write(tmp_path):
    """kineto writes "ERROR: External init callback ..." when a profile starts on a thread that
    did not load it (a worker's stream thread): not an error of the profile, and dropped.
    Whatever else the worker writes to stderr meanwhile still reaches its log."""
    logs = tmp_path / "logs"
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, logging=tdmesh.LoggingLocation.FILE, log_dir=str(logs),
                           pool=False) as mesh, mesh.activate():
        with tdmesh.profile(str(tmp_path / "traces")):
            x = torch.randn(8, 8) @ torch.randn(8, 8)
            tdmesh.remote(worker_writes_to_stderr, propagate="inspect")("a line of the worker's own\n")
            tdmesh.fetch_shard(x).result()
    err = "".join(open(os.path.join(d, f)).read() for d, _, fs in os.walk(logs) for f in fs if f == "stderr.log")
    assert "a line of the worker's own" in err
    assert "External init callback" not in err and "ERROR" not in err
    assert os.listdir(tmp_path / "traces") == ["rank0.trace.json"]


class Sharder:
    """A worker object that answers with a DTensor and with a functional collective's pending result."""

    def __init__(self, tmesh):
        self.tmesh = tmesh

    def shard(self, x):
        from torch.distributed.tensor import DTensor, Shard
        return DTensor.from_local(x, self.tmesh["gpu"], [Shard(0)])

    def summed(self, x):
        import torch.distributed._functional_collectives as fc
        return fc.all_reduce(x, "sum", self.tmesh["gpu"])


def test_worker_objects_answer_with_dtensors_and_collectives_by_value_and_as_mesh_tensors(mesh2x2):
    """A worker object's DTensor comes back as each rank's local shard, a collective's result waited for: by
    value (``call``) and as a mesh tensor (``remote``); before, either fetch killed the worker (SIGSEGV)."""
    with mesh2x2.activate():
        x = torch.ones(2, 3) * (mesh2x2.rank("gpu") + 1 + 10 * mesh2x2.rank("host"))
        h = mesh2x2.spawn(Sharder, mesh2x2.torch_mesh())
        shards = h.call("shard", x).result()
        sums = h.call("summed", x).result()
        held_shard = h.remote("shard", propagate=lambda x: torch.empty(2, 3))(x)
        held_sum = h.remote("summed", propagate=lambda x: torch.empty(2, 3))(x)
        for hst in range(2):
            for g in range(2):
                point = {"host": hst, "gpu": g}
                mine = torch.full((2, 3), 1.0 + g + 10 * hst)
                total = torch.full((2, 3), 3.0 + 20 * hst)
                assert torch.equal(shards[point], mine) and torch.equal(sums[point], total)
                assert torch.equal(tdmesh.fetch_shard(held_shard, **point).result(), mine)
                assert torch.equal(tdmesh.fetch_shard(held_sum + 0, **point).result(), total)
