"""Compiled functions as CUDA graphs on GPU workers: a training step with fused AdamW and the
bucketed gradient reduce captured after one warm-up call, the same losses as eager, and every
fallback (decided on the client, or a capture that fails on the worker) tested.

Skipped without CUDA; run on a GPU host with ``python -m pytest -q tests/gpu``.  The reduce is
a collective only with two or more GPUs (a group of one reduces nothing): with one GPU the
captured step has no NCCL kernel in it; the multi-GPU test runs only where there are two.
"""

import warnings

import pytest
import torch
from _training import data_parallel_step

import tdmesh
from tdmesh import fetch_shard, remote
from tdmesh.errors import UsageError
from tdmesh.protocol import messages as m
from tdmesh.worker import graphs
from tdmesh.worker.interpreter import Interpreter
from tdmesh.worker.values import Poison

pytestmark = pytest.mark.gpu
recording_modes = remote("tdmesh.worker.builtins.recording_modes")
recording_graphs = remote("tdmesh.worker.builtins.recording_graphs")


@pytest.fixture(scope="module")
def gpu_mesh():
    """A worker that keeps every graph it captures, untimed (``TDMESH_GRAPH_TRIALS=0``): these tests are about a
    graph's semantics, and a graph of a few ops is slower than its program (the measured choice drops it)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("TDMESH_GRAPH_TRIALS", "0")  # read by the worker as it starts
    try:
        with tdmesh.local_mesh(hosts=1, gpus_per_host=1, pool=False) as mesh:
            patch.undo()
            yield mesh
    finally:
        patch.undo()


def _train(mesh, steps: int, cuda_graph, backend: str = "program", foreach: bool = False,
           eager_between: bool = False) -> tuple[list[float], dict]:
    """``foreach``: AdamW as torch's multi-tensor ops (capturable), which inductor compiles with the step;
    ``eager_between``: an eager op before each call (as a batch made on the workers), in grad mode."""
    with mesh.activate():
        tdmesh.random.set_manual_seed_remote(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **({"foreach": True, "capturable": True} if foreach
                                                                 else {"fused": True}))
        xs = [torch.randn(16, 32) for _ in range(steps)]
        batches = [(x, x[:, :10].argmax(1)) for x in xs]  # a rule it can learn

        step = data_parallel_step(model, opt, mesh)

        for x, y in batches[:2]:
            step(x, y)
        run = step if cuda_graph is None else tdmesh.compile(step, backend=backend, cuda_graph=cuda_graph)
        losses = [fetch_shard(run(x * 1.0 if eager_between else x, y)).result() for x, y in batches[2:]]
        modes = tdmesh.call_on_shard_and_fetch(recording_modes).result()
    return [float(v) for v in losses], modes


def test_a_training_step_as_a_cuda_graph_gives_the_eager_losses(gpu_mesh):
    eager, _ = _train(gpu_mesh, 22, None)
    graphed, modes = _train(gpu_mesh, 22, True)
    program, _ = _train(gpu_mesh, 22, False)
    assert list(modes.values())[-1] == "cuda_graph"
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=0)
    torch.testing.assert_close(program, eager, rtol=1e-5, atol=0)
    assert eager[-1] < eager[0]


def test_inductor_programs_alone_and_inside_a_cuda_graph_train_like_eager(gpu_mesh):
    eager, _ = _train(gpu_mesh, 22, None)
    fused, modes = _train(gpu_mesh, 22, False, backend="inductor")
    assert list(modes.values())[-1] == "inductor"
    graphed, modes = _train(gpu_mesh, 22, True, backend="inductor")
    assert list(modes.values())[-1] == "inductor+cuda_graph"
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-5)  # fused kernels round differently
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-5)


def test_an_optimizer_inside_an_inductor_graph_is_captured_after_eager_ops_in_grad_mode(gpu_mesh):
    """foreach AdamW's in-place writes to the parameters are ops of the inductor graph.  An eager op between
    two calls turns the worker's grad mode on; the capture runs in the program's (off), or those writes to
    leaves that require grad refuse to run (found by bench.train_step --optimizer foreach at GPT-2 width)."""
    eager, _ = _train(gpu_mesh, 22, None, foreach=True, eager_between=True)
    graphed, modes = _train(gpu_mesh, 22, True, backend="inductor", foreach=True, eager_between=True)
    assert list(modes.values())[-1] == "inductor+cuda_graph"
    with gpu_mesh.activate():
        graphs = list(tdmesh.call_on_shard_and_fetch(recording_graphs).result().values())[-1]
    assert not [op for op in graphs["outside"] if "_foreach_" in op], graphs  # AdamW's ops are inductor's
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-5)
    assert eager[-1] < eager[0]


def test_results_are_fresh_tensors_and_inputs_are_read_each_call(gpu_mesh):
    with gpu_mesh.activate():
        w = torch.full((4,), 2.0)

        @tdmesh.compile(cuda_graph=True)
        def fn(x):
            return x * w + 1

        outs = [fn(torch.full((4,), float(i))) for i in range(9)]  # a warm-up, 3 timed programs, then replays
        w.mul_(10)  # a captured tensor's value: read where it is by the graph
        last = fn(torch.ones(4))
        got = [fetch_shard(o).result() for o in outs + [last]]
        modes = tdmesh.call_on_shard_and_fetch(recording_modes).result()
    assert list(modes.values())[-1].startswith("cuda_graph")
    for i in range(9):
        assert torch.equal(got[i], torch.full((4,), 2.0 * i + 1))  # not overwritten by later replays
    assert torch.equal(got[9], torch.full((4,), 21.0))


def test_a_graph_slower_than_its_program_is_dropped_and_the_mode_says_why():
    """One big elementwise op: the program is one kernel; the graph adds the copies at its edges (the input
    into the static copy, the result out of the graph's pool), three times the memory traffic.  The first
    replays measure it (a worker with the default trials), the program stays, the values the same either way;
    a training step's graph, faster than its program, is kept and says so."""
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, pool=False) as mesh:
        with mesh.activate():
            @tdmesh.compile(cuda_graph=True)
            def doubled(x):
                y = x * 2
                s = y[:1, :1]
                for _ in range(10):  # a graph needs 10 ops or more (capture.py); these are tiny
                    s = s + 1
                return y, s

            xs = [torch.full((64, 2**20), float(i)) for i in range(10)]  # 256 MiB each, in fp32
            corners = [fetch_shard(doubled(x)[0][::16, ::2**16]).result() for x in xs]
            modes = tdmesh.call_on_shard_and_fetch(recording_modes).result()
        _, trained = _train(mesh, 22, True)
    mode = [v for v in modes.values() if "graph" in v][-1]
    assert mode.startswith("program (a CUDA graph was slower:"), mode
    assert all(torch.equal(c, torch.full((4, 16), 2.0 * i)) for i, c in enumerate(corners))
    assert list(trained.values())[-1].startswith("cuda_graph (measured"), trained


def test_what_cannot_be_a_graph_warns_once_by_default_and_raises_with_cuda_graph_true(gpu_mesh):
    with gpu_mesh.activate():
        x = torch.ones(4)

        def writes_its_input(t):
            t.add_(1)
            for _ in range(10):  # long enough for a graph by default (capture.MIN_GRAPH_OPS)
                t = t * 1
            return t

        auto = tdmesh.compile(writes_its_input)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                auto(x)
        said = [w for w in caught if "not a CUDA graph" in str(w.message)]
        assert len(said) == 1 and "writes an input in place" in str(said[0].message)
        written = fetch_shard(x).result()
        with pytest.raises(UsageError, match=r"cuda_graph=True\): writes_its_input cannot be captured.*in place"):
            tdmesh.compile(writes_its_input, cuda_graph=True)(x)
        with pytest.raises(UsageError, match="views an input"):
            tdmesh.compile(lambda t: t[1:], cuda_graph=True)(x)
        with pytest.raises(UsageError, match="tensors on cpu"):
            tdmesh.compile(lambda t: t * torch.ones(4, device="cpu").to("cuda"), cuda_graph=True)(x)
    assert torch.equal(written, torch.full((4,), 4.0))


def _worker(mode: str):
    sent: list = []
    interp = Interpreter(0, torch.device("cuda"), sent.append)
    interp.handle(m.DefineOp(1, "torch.ops.aten.mul.Tensor", (m.Slot(0), m.Slot(1)), {}))
    commands = (m.CallOp(0, 1, (10,), (), (1, 1), 0), m.CallFunction(0, (), (), "torch.cuda.synchronize", (), {}),
                m.CallOp(0, 1, (11,), (), (10, 1), 0))
    interp.handle(m.DefineRecording(1, commands, (1,), (11,), 0, 1, mode))
    return interp, sent


def test_a_capture_that_fails_on_the_worker_falls_back_to_the_program_or_fails_the_call(monkeypatch):
    monkeypatch.setattr(graphs, "TRIALS", 0)  # captured at the second call, untimed
    interp, sent = _worker("cuda_graph")  # a host sync inside: cannot be captured
    interp.env[5] = torch.full((3,), 2.0, device="cuda")
    for i in range(3):
        interp.handle(m.CallRecording(20 + i, 1, (5,), (100 + i,)))
    assert sent == [] and all(torch.equal(interp.env[100 + i].cpu(), torch.full((3,), 8.0)) for i in range(3))
    assert interp.recordings.modes()[1].startswith("program: capture failed")

    interp, sent = _worker("cuda_graph_required")
    interp.env[5] = torch.full((3,), 2.0, device="cuda")
    for i in range(3):
        interp.handle(m.CallRecording(20 + i, 1, (5,), (100 + i,)))
    assert torch.equal(interp.env[100].cpu(), torch.full((3,), 8.0))  # the warm-up call runs as a program
    failures = [x for x in sent if isinstance(x, m.RemoteFunctionFailed)]
    assert [f.seq for f in failures] == [21, 22] and "could not be captured as a CUDA graph" in failures[0].message
    assert type(interp.env[101]) is Poison and type(interp.env[102]) is Poison


def test_a_failed_capture_names_the_step_that_failed(monkeypatch):
    """A step that raises while captured (a copy from pageable host memory) is named in the mode
    and the worker's warning, so a user can find the op that keeps a step off CUDA graphs."""
    monkeypatch.setattr(graphs, "TRIALS", 0)
    sent: list = []
    interp = Interpreter(0, torch.device("cuda"), sent.append)
    interp.handle(m.DefineOp(1, "torch.ops.aten.mul.Tensor", (m.Slot(0), m.Slot(1)), {}))
    commands = (m.CallOp(0, 1, (10,), (), (1, 1), 0),
                m.CallFunction(0, (12,), (), "torch.Tensor.cuda", (torch.full((3,), 3.0),), {}),
                m.CallOp(0, 1, (11,), (), (10, 12), 0))
    interp.handle(m.DefineRecording(1, commands, (1,), (11,), 0, 1, "cuda_graph"))
    interp.env[5] = torch.full((3,), 2.0, device="cuda")
    for i in range(3):
        interp.handle(m.CallRecording(20 + i, 1, (5,), (100 + i,)))
    assert sent == [] and all(torch.equal(interp.env[100 + i].cpu(), torch.full((3,), 12.0)) for i in range(3))
    mode = interp.recordings.modes()[1]
    assert mode.startswith("program: capture failed") and "(step 1 of the recording: torch.Tensor.cuda)" in mode, mode


def test_a_poisoned_input_runs_the_program_instead_of_the_graph(monkeypatch):
    monkeypatch.setattr(graphs, "TRIALS", 0)
    interp, sent = _worker("cuda_graph")
    interp.handle(m.DefineRecording(2, (m.CallOp(0, 1, (10,), (), (1, 1), 0),), (1,), (10,), 0, 1, "cuda_graph"))
    interp.env[5] = torch.full((3,), 3.0, device="cuda")
    interp.env[6] = Poison(4, "earlier")
    for i, ref in enumerate((5, 5, 6, 5)):
        interp.handle(m.CallRecording(30 + i, 2, (ref,), (200 + i,)))
    assert interp.recordings.modes()[2] == "cuda_graph"
    assert type(interp.env[202]) is Poison and interp.env[202].seq == 4 and sent == []
    assert torch.equal(interp.env[203].cpu(), torch.full((3,), 9.0))


def test_a_short_function_is_a_program_by_default_and_a_graph_when_asked(gpu_mesh):
    with gpu_mesh.activate():
        one, x = torch.ones(4), torch.zeros(4)
        short = tdmesh.compile(lambda a: a + one)
        forced = tdmesh.compile(lambda a: a + one, cuda_graph=True)
        for _ in range(3):
            x = forced(short(x))
        modes = list(tdmesh.call_on_shard_and_fetch(recording_modes).result().values())
        got = fetch_shard(x).result()
    assert modes[-2:] == ["program", "cuda_graph"]
    assert torch.equal(got, torch.full((4,), 6.0))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL inside a graph needs two GPUs")
def test_nccl_reduce_inside_a_cuda_graph_on_two_gpus():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
        eager, _ = _train(mesh, 12, None)
        graphed, modes = _train(mesh, 12, True)
    assert list(modes.values())[-1] == "cuda_graph"
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=0)


def _clipped_losses(mesh, compiled: bool) -> tuple[list[float], dict, list[str]]:
    """A step that clips with ``error_if_nonfinite=True`` (a read of the norm's finiteness after
    backward), compiled from its first call or not: its losses, the workers' recording modes and
    the warnings said."""
    with mesh.activate(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tdmesh.random.set_manual_seed_remote(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        xs = [torch.randn(16, 32) for _ in range(12)]

        def step(x):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), x[:, :10].argmax(1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, error_if_nonfinite=True)
            opt.step()
            return loss.detach()

        run = tdmesh.compile(step) if compiled else step
        losses = [float(fetch_shard(run(x)).result()) for x in xs]
        modes = tdmesh.call_on_shard_and_fetch(recording_modes).result()
    return losses, modes, [str(w.message) for w in caught if "tdmesh.compile" in str(w.message)]


def test_a_step_with_a_read_captures_each_part_that_can_be_a_graph(gpu_mesh):
    """The part before the read (forward, backward, the norm) is a CUDA graph; the part after it
    steps the optimizer on the gradients the first part makes, new tensors every call, which a
    graph would read where they were at its capture: a program, and one warning says so."""
    eager, _, _ = _clipped_losses(gpu_mesh, False)
    compiled, modes, said = _clipped_losses(gpu_mesh, True)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    parts = list(modes.values())[-2:]
    assert parts[0].startswith("cuda_graph") and parts[1].startswith("program"), modes
    assert len(said) == 1 and "reads state an earlier part makes" in said[0], said


def test_local_tensors_made_inside_are_captured_and_fresh_every_call(gpu_mesh):
    """``torch.tensor(...)`` of local data inside the function (Hugging Face models make a few a
    step) is made on the GPU once and copied there each call: the capture has no host-to-device
    copy from pageable memory (which failed it, so the step ran as a program)."""
    with tdmesh.no_mesh.activate():
        local = torch.tensor([1.0, 2.0])
    with gpu_mesh.activate():
        @tdmesh.compile(cuda_graph=True)
        def fn(x):
            t = torch.tensor(local)
            t.add_(x)  # the next call's copy must not see this write
            return torch.cat([t * 2, torch.empty(0), torch.tensor([10.0])]), t

        outs = [fn(torch.full((2,), float(i))) for i in range(8)]  # a warm-up, 3 timed programs, then replays
        got = [(fetch_shard(a).result(), fetch_shard(b).result()) for a, b in outs]
        modes = tdmesh.call_on_shard_and_fetch(recording_modes).result()
    assert list(modes.values())[-1].startswith("cuda_graph"), modes
    for i, (a, b) in enumerate(got):
        assert torch.equal(b, torch.tensor([1.0 + i, 2.0 + i]))
        assert torch.equal(a, torch.tensor([2.0 + 2 * i, 4.0 + 2 * i, 10.0]))
