"""Shared pieces of the benches, importable by tdmesh workers as ``bench.helpers``.

Keep this module light at import time: workers import it (by the import path
``"bench.helpers.run_loop_local"``) to run the remote-function variant of the dispatch bench.
"""

from __future__ import annotations

import os
import pickle
import socket
import statistics
import struct
import sys
import time
import zlib
from collections.abc import Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Same framing as tdmesh.protocol.transport: MAGIC | u64 length | u32 CRC-32 | payload (16-byte header).
# Re-declared here so the raw baseline does not go through tdmesh's code at all.
FRAME_MAGIC = b"TDM1"
FRAME_HEADER = struct.Struct("!4sQI")


# ---------------------------------------------------------------------------- the smoke tier
# Every bench takes --smoke: the same code path as a real run, with few iterations at small sizes, so
# that CI runs it in seconds (tests/bench/test_smoke.py lists bench/*.py: a new bench cannot be left
# out).  A bench that needs a GPU exits with NO_CUDA and says so where there is none.
SMOKE_HELP = "CI smoke: the same code path, a few iterations at small sizes (seconds on 2 cores)"
NO_CUDA = 3


def parse(parser, argv=None, **smoke):
    """``parser``'s arguments, with ``--smoke`` added: when given, each of ``smoke``'s arguments
    takes its small value (what a flag such as ``--quick`` already means is passed as ``quick=True``)."""
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in smoke.items():
            if not hasattr(args, name):
                raise AssertionError(f"--smoke sets {name!r}, which {parser.prog} does not take")
            setattr(args, name, value)
    return args


def require_cuda(name: str, device: str = "cuda") -> None:
    """Leave with NO_CUDA and a one-line reason when ``device`` is CUDA and this host has none."""
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        print(f"bench.{name} needs a CUDA device (torch.cuda.is_available() is False on this host): "
              f"run it where there is a GPU", file=sys.stderr)
        sys.exit(NO_CUDA)


# ---------------------------------------------------------------------------- the kernel
def run_loop_local(n: int, shape, device: str | None = None):
    """Monarch's ``dispatch_bench_helper.run_loop_local``: ``n`` dependent adds.

    Runs wherever it is called: in the client for the local baseline, on a worker when
    shipped with ``tdmesh.remote("bench.helpers.run_loop_local", ...)``.
    """
    import torch

    from tdmesh.config import cpu_forced
    if device is None:
        device = "cuda" if torch.cuda.is_available() and not cpu_forced() else "cpu"
    local = torch.zeros(shape, device=device)
    ones = torch.ones(shape, device=device)
    for _ in range(n):
        local = ones + local
    return local


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- timing
def repeat(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds per call of ``fn``, ``repeats`` times (``fn`` includes any synchronisation)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_after_warmup(fn: Callable[[], object], repeats: int) -> float:
    """The fewest seconds of ``repeats`` calls of ``fn``, after one untimed call (the warm-up)."""
    fn()
    return min(repeat(fn, repeats))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 100]."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def best_median(times: list[float]) -> tuple[float, float]:
    return min(times), statistics.median(times)


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us"


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [headers] + rows) for i in range(len(headers))]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


def process_cpu_seconds(pids) -> float:
    """User + system CPU seconds the processes ``pids`` have used so far (all their threads;
    Linux's /proc; their children not included)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        total += int(fields[11]) + int(fields[12])  # utime, stime: the 14th and 15th fields
    return total / ticks


def machine_line() -> str:
    try:
        load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        load = "load average n/a"
    return f"{os.cpu_count()} CPUs, {load}, python {sys.version.split()[0]}"


def ensure_importable_by_workers() -> None:
    """Workers run ``python -m tdmesh.worker`` in our cwd with our environment; make sure
    ``bench.helpers`` resolves there even when the bench is started from another directory."""
    path = os.environ.get("PYTHONPATH", "")
    if REPO_ROOT not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = REPO_ROOT + (os.pathsep + path if path else "")
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)


# ---------------------------------------------------------------------------- raw framed echo
def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


def raw_send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(FRAME_HEADER.pack(FRAME_MAGIC, len(payload), zlib.crc32(payload)) + payload)


def raw_recv(sock: socket.socket) -> bytes | None:
    header = _recv_exact(sock, FRAME_HEADER.size)
    if header is None:
        return None
    magic, length, crc = FRAME_HEADER.unpack(header)
    assert magic == FRAME_MAGIC, magic
    payload = _recv_exact(sock, length)
    assert payload is None or zlib.crc32(payload) == crc
    return payload


def echo_server(listener_fd: int | None = None, port: int | None = None) -> None:
    """Accept one client; for each frame, unpickle the object and send it back pickled.

    This is the floor a fetch round trip could reach: the same framing and pickling,
    one hop each way between two processes, no tdmesh bookkeeping.
    """
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port or 0))
    srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        payload = raw_recv(conn)
        if payload is None:
            break
        obj = pickle.loads(payload)
        raw_send(conn, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    conn.close()
    srv.close()


def start_echo_server():
    """The echo server in a subprocess (a second process, like a worker); returns (proc, socket)."""
    import subprocess
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([sys.executable, "-c", "import bench.helpers as h; h.echo_server()"],
                            stdout=subprocess.PIPE, cwd=REPO_ROOT, env=env, text=True)
    port = int(proc.stdout.readline())
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return proc, sock


def raw_round_trip(sock: socket.socket, obj) -> object:
    raw_send(sock, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return pickle.loads(raw_recv(sock))


# ---------------------------------------------------------------------------- reduce bench
def raw_all_reduce_seconds(x, group, iters: int):
    """On a worker: ``iters`` plain ``dist.all_reduce`` calls of ``x`` over ``group``, timed
    there (after a warm-up and a barrier, synchronising CUDA), as the raw baseline."""
    import torch
    import torch.distributed as dist
    dist.all_reduce(x, group=group)
    if x.is_cuda:
        torch.cuda.synchronize()
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x, group=group)
    if x.is_cuda:
        torch.cuda.synchronize()
    return torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=x.device)


# ---------------------------------------------------------------------------- CUDA graph exploration
def graph_vs_eager(n: int, shape):
    """On a CUDA worker: seconds for ``n`` dependent adds run eagerly vs captured once as a
    CUDA graph and replayed (what replaying a compiled recording as a graph could give)."""
    import torch
    ones = torch.ones(shape, device="cuda")
    static = torch.zeros(shape, device="cuda")

    def loop(local):
        for _ in range(n):
            local = ones + local
        return local

    loop(static)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loop(static)
    torch.cuda.synchronize()
    eager = time.perf_counter() - t0
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loop(static)  # warm-up on a side stream, as capture requires
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = loop(static)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    replay = time.perf_counter() - t0
    assert torch.equal(out, torch.full(shape, float(n), device="cuda"))
    return torch.tensor([eager, replay], dtype=torch.float64, device="cuda")


class OpCounter:
    """Counts the aten ops dispatched while it is active (a TorchDispatchMode): the same counter
    measures a plain local step and a step issued through a mesh (where it sits above the
    mesh's own mode and sees every op the client turns into a message)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.ops += 1
                return func(*args, **(kwargs or {}))

        self.ops = 0
        self._mode = _Mode()

    def __enter__(self) -> OpCounter:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def count_kernels(trace_path: str) -> int:
    """GPU kernels in a torch.profiler Chrome trace (events of category ``kernel``): the same
    count for a DDP step's trace and a tdmesh worker's (``tdmesh.profile``)."""
    import json
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    return sum(1 for e in events if e.get("cat") == "kernel")


OPTIMIZERS = ("fused", "foreach")  # bench.train_step's --optimizer (CUDA)


def train_optimizer(params, cuda: bool, kind: str = "fused"):
    """The benches' optimizer, the same for DDP and tdmesh: the fast flags of README's
    Optimizers section (one fused AdamW op per step on CUDA; foreach SGD with momentum on CPU,
    where torch's default for plain tensors is the per-parameter loop).  ``kind="foreach"`` (CUDA):
    AdamW as torch's multi-tensor ops, its step counts on the GPU (``capturable``), which a compiled
    step with ``backend="inductor"`` hands to inductor with the rest of the step (a fused AdamW is one
    opaque kernel between its graphs)."""
    import torch
    if cuda:
        if kind == "foreach":
            return torch.optim.AdamW(params, lr=3e-3, foreach=True, capturable=True)
        return torch.optim.AdamW(params, lr=3e-3, fused=True)
    return torch.optim.SGD(params, lr=0.3, momentum=0.9, foreach=True)


def data_parallel_step(model, opt, mesh, bf16: bool = False, set_to_none: bool = True, clip: bool = False):
    """The benches' training step, as a user writes it: forward (under bf16 autocast if asked),
    ``opt.zero_grad(set_to_none=...)``, backward, one bucketed ``reduce_`` of every gradient
    over the mesh (DDP's averaging), with ``clip`` ``clip_grad_norm_(..., error_if_nonfinite=True)``
    (a host read every step), the optimizer's step; returns the detached loss."""
    import torch

    import tdmesh

    def step(x, y):
        with torch.autocast(mesh.device_type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        tdmesh.reduce_([p.grad for p in model.parameters()], mesh.names, "avg")
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        return loss.detach()
    return step


DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * 1024 * 1024    # DistributedDataParallel(bucket_cap_mb=25), its default


def overlapped_step(model, opt, mesh, bf16: bool = False, set_to_none: bool = True, buckets: int | None = None,
                    how: str = "generator"):
    """``data_parallel_step`` with the gradients averaged bucket by bucket while backward runs,
    as DDP does: each bucket (in the order backward completes the gradients: DDP's sizes by
    default, the first closed at 1 MiB and the others at 25 MiB; ``buckets=N``: N of about equal
    bytes) is one flat buffer whose views are its parameters' ``.grad``; once its last
    gradient is in, the buffer is lent to a second stream and averaged there, so the workers
    reduce it while they compute the rest of backward (one borrow and one collective a bucket,
    not one a gradient).  ``how``: ``"generator"`` iterates ``tdmesh.grad_generator``;
    ``"hooks"`` runs torch's own backward with a post-accumulate-grad hook per parameter
    (registered at the first step, as DDP registers its hooks once); ``"workers"`` registers the
    parameters with ``tdmesh.reduce_grads_in_backward`` once and the workers' own backward reduces
    their buckets as it goes (``buckets`` does not apply: DDP's sizes).
    ``set_to_none``: ``opt.zero_grad``'s; a new gradient is copied into its view (with kept
    gradients backward accumulates into the views themselves)."""
    import torch

    import tdmesh
    params = [p for p in model.parameters() if p.requires_grad]
    if how == "workers":
        tdmesh.reduce_grads_in_backward(params, mesh.names, "avg")

        def reduced_in_backward(x, y):
            with torch.autocast(mesh.device_type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(x, y)
            opt.zero_grad(set_to_none=set_to_none)
            loss.backward()
            opt.step()
            return loss.detach()
        reduced_in_backward.buckets = lambda: 0  # type: ignore[attr-defined]  # the workers' own
        return reduced_in_backward
    comms = tdmesh.Stream("grad_reduce")
    plan: dict = {}

    def make_plan(loss) -> None:
        order = [params[i] for i in tdmesh.gradient_execution_order(loss, params)]
        total = sum(p.numel() * p.element_size() for p in order)
        groups: list[list] = [[]]
        size = 0
        for p in order:
            if buckets is None:  # DDP's: a bucket closes once it holds its cap
                full = size >= (DDP_FIRST_BUCKET_BYTES if len(groups) == 1 else DDP_BUCKET_BYTES)
            else:
                full = size >= total / buckets and len(groups) < buckets
            if full or (groups[-1] and p.dtype != groups[-1][0].dtype):  # a flat buffer holds one dtype
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        flats, views = [], {}
        for group in groups:
            flat = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype)
            offset = 0
            for p in group:
                views[id(p)] = flat[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()
            flats.append(flat)
        plan.update(order=order, groups=groups, flats=flats, views=views,
                    bucket_of={id(p): k for k, group in enumerate(groups) for p in group})

    def into_views(pending: list) -> None:
        """Each new gradient of a bucket into its view: one multi-tensor copy a bucket (one op
        for the client to issue, not one a gradient), then the views become the ``.grad``s."""
        if pending:
            with torch.no_grad():
                torch._foreach_copy_([view for _, view, _ in pending], [g for _, _, g in pending])
            for p, view, _ in pending:
                p.grad = view

    def reduce_on_comms(k: int, lent: list) -> None:
        borrowed, borrow = comms.borrow(plan["flats"][k], mutable=True)
        lent.append(borrow)
        with comms.activate():
            borrowed.reduce_(mesh.names, "avg")

    current: dict = {}  # the step under way: what the hooks add to (empty between steps)

    def arrive(p, g) -> None:
        arrived, pending = current["arrived"], current["pending"]
        k = plan["bucket_of"][id(p)]
        view = plan["views"][id(p)]
        if g is not None and g is not view:
            pending[k].append((p, view, g))
        arrived[k] += 1
        if arrived[k] == len(plan["groups"][k]):
            into_views(pending[k])
            reduce_on_comms(k, current["lent"])

    def hook(p) -> None:  # torch's engine may complete a bucket's gradients in another order
        if current:  # (a backward outside the step, e.g. the user's own, is not this step's)
            arrive(p, p.grad)

    def step(x, y):
        with torch.autocast(mesh.device_type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)
        opt.zero_grad(set_to_none=set_to_none)
        if not plan:  # the order backward completes the gradients: the same every step
            make_plan(loss)
            if how == "hooks":  # registered once, as DDP registers its hooks
                for p in params:
                    p.register_post_accumulate_grad_hook(hook)
        lent: list = []
        current.update(lent=lent, arrived=[0] * len(plan["groups"]),
                       pending=[[] for _ in plan["groups"]])  # per bucket: (param, view, new gradient)
        try:
            if how == "generator":
                for p, g in zip(plan["order"], tdmesh.grad_generator(loss, plan["order"])):
                    if g is not None and p.grad is not None:  # (None: not reached from the loss)
                        g = p.grad + g
                    arrive(p, g)
            else:
                loss.backward()
                arrived = current["arrived"]
                for k in range(len(plan["groups"])):  # a bucket with a parameter backward did not reach
                    if 0 < arrived[k] < len(plan["groups"][k]):
                        into_views(current["pending"][k])
                        reduce_on_comms(k, lent)
        finally:
            current.clear()
        for borrow in lent:
            borrow.drop()
        opt.step()
        return loss.detach()
    step.buckets = lambda: len(plan.get("groups", ()))  # type: ignore[attr-defined]  # once a step has run
    return step


# ---------------------------------------------------------------------------- checkpoint baseline
def plain_write(tensors, directory: str, rank) -> None:
    """Runs on a worker: ``tensors``' bytes into one file of this rank, written and fsynced as
    DCP's FileSystemWriter writes its file per rank (the bench's plain-file baseline)."""
    import torch
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"rank{int(rank)}.bin"), "wb") as f:
        for t in tensors:
            f.write(memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def plain_read(tensors, directory: str, rank) -> None:
    """Runs on a worker: read ``plain_write``'s file back into ``tensors`` (their CPU memory,
    or a CPU buffer copied to the device)."""
    import torch
    with open(os.path.join(directory, f"rank{int(rank)}.bin"), "rb") as f:
        for t in tensors:
            buffer = t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype)
            f.readinto(memoryview(buffer.reshape(-1).view(torch.uint8).numpy()))
            if buffer is not t:
                t.copy_(buffer)
