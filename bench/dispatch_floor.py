"""The floor of an eager op: what torch itself charges a ``__torch_dispatch__`` wrapper
subclass, against tdmesh's whole client path, same process, microseconds per op.

    python -m bench.dispatch_floor                 # CPU worker
    python -m bench.dispatch_floor --device cuda   # a GPU worker (the client's work is the same)

Every row times the loop ``x = ones + x`` (100x100 float32) as the client issues it (the
workers' execution is waited for outside the timer):

  empty handler    a wrapper subclass whose ``__torch_dispatch__`` returns one preallocated
                   wrapper: torch's argument parsing, its dispatcher and the call into Python
  new wrapper      the handler makes a new wrapper per op (``_make_wrapper_subclass``), as
                   every proxy is made: torch's part of any design that returns a new tensor
  tdmesh's own     the same two with tdmesh's classes and modes (``tdmesh.Tensor``, the mesh's
    empty / new    torch-function mode and dispatch mode): the mode's handler returns one
                   preallocated proxy, or a new one (``tensor.new_proxy``), and sends nothing
  least sent       the mode's handler does the least an op that is sent must do in Python: a
                   new ref and proxy, a message of ints pickled and queued (no placement
                   checks, no dataflow history, no framing or socket), and ``+ site`` with
                   the user's call site captured as tdmesh captures it
  tdmesh           the loop under ``mesh.activate()``, one worker
  tdmesh, no site  the same with the user's call site not captured (``errors.call_site``
                   answering at once): what capturing it costs

The last two rows' difference from ``new wrapper`` is tdmesh's own work per op.  The handler rows
reach their handler through torch's dispatcher; tdmesh's own rows issue a learnt operator without it
(``tdmesh/engine/operators.py``), so part of torch's cost in the floor rows is not in them.

A second table does the same for bench.train_step's eager step (``--size``, tiny by default;
``--dtype``, ``--batch-size``): forward, ``zero_grad``, backward, one bucketed ``reduce_``, the
optimizer (fused AdamW on CUDA, foreach SGD on CPU); every op of it has an op plan after the
first step.  Per step, and per message the real step sends:

  tdmesh           the step under ``mesh.activate()``, one worker: the client's time to issue
                   the steps (their end is waited for outside the timer)
  tdmesh, no site  the same without the call-site capture
  plan proxies     the mode's handler finds the op's plan as tdmesh's hot path does (its
                   arguments scanned, the (op, metadata) key looked up) and makes the plan's
                   result proxies; nothing is issued, recorded or sent, and ``reduce_`` does
                   nothing: torch's autograd, argument parsing and wrappers, plus the least
                   Python a design with cached output metadata needs per op
  given proxies    the handler is handed each op's plan in the step's order (no key, no
                   lookup) and makes its proxies: torch's part of the step, with the proxies
                   any design must return

The step's target (issue 29) is a client cost per op; ``given proxies`` is the part of it no
change to tdmesh's own work can remove.  A last line times the step without its backward (the
forward and the optimizer): what the client issues when the workers run backward, in one message.

The step table runs with ``TDMESH_BACKWARD=client`` (every backward op a message: the per-op path;
``bench.train_step`` times the default, one message for backward).  Both tables time their rows in
rounds (``--repeats`` after one that warms up), each row its best: the H200 host drifts up to 2x.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pickle import dumps

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402


def _wrappers():
    import torch

    class Empty(torch.Tensor):
        """Returns one preallocated wrapper from every op."""
        out = None

        @staticmethod
        def __new__(cls, meta):
            return torch.Tensor._make_wrapper_subclass(cls, meta.shape, dtype=meta.dtype, device="meta")

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return cls.out

    class Fresh(Empty):
        """Makes a new wrapper per op, of the first argument's metadata."""

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            a = args[0]
            return torch.Tensor._make_wrapper_subclass(cls, a.shape, dtype=a.dtype, device="meta")

    meta = torch.empty(100, 100, device="meta")
    Empty.out = Empty(meta)
    return Empty, Fresh, meta


def main(argv=None) -> int:
    os.environ["TDMESH_BACKWARD"] = "client"  # the per-op path (see above); read at each backward call
    p = argparse.ArgumentParser(prog="python -m bench.dispatch_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="training steps a run of the step table (0: no step table)")
    p.add_argument("--size", default="tiny", help="the GPT of the step table (tutorials/nanogpt.py's sizes)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: the step under autocast")
    args = h.parse(p, argv, iters=300, repeats=1, steps=1)
    h.require_cuda("dispatch_floor", args.device)
    if args.device == "cpu":
        os.environ["TDMESH_DEVICE"] = "cpu"
    h.ensure_importable_by_workers()
    import torch

    import tdmesh
    n = args.iters
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, pool=False) as mesh:
        rows = list(_add_rows(mesh, n, args.repeats).items())
        with mesh.activate():
            steps = _step_rows(mesh, args.size, args.batch_size, args.dtype == "bf16", args.steps,
                               args.repeats) if args.steps else None
    print(f"dispatch floor: x = ones + x, {n} ops a run, best of {args.repeats}; torch {torch.__version__}; "
          f"{h.machine_line()}")
    floor = rows[1][1][0]
    h.print_table(["loop", "us per op", "over new wrapper", "its thread's CPU"],
                  [[name, f"{s / n * 1e6:.2f}", f"{(s - floor) / n * 1e6:+.2f} us", f"{cpu / n * 1e6:.2f}"]
                   for name, (s, cpu) in rows])
    print("(the CPU time of the thread that issues, best round: on a host with cores to spare the two agree; "
          "the rest of the wall time is other threads' and processes' claims on its core and the GIL)")
    if steps is not None:
        rows, messages, _ = steps
        without_s, without_messages = dict(rows).pop(NO_BACKWARD)
        auto = {name: s for name, s in rows if name in (ON_WORKERS, PLAN_NO_BACKWARD, GIVEN_NO_BACKWARD)}
        rows = [(name, s) for name, s in rows if name != NO_BACKWARD and name not in auto]
        print(f"\n{args.size} GPT training step ({args.dtype}, batch {args.batch_size}), {args.steps} steps a run, "
              f"best of {args.repeats}; {messages} messages a step")
        floor = rows[-1][1]
        h.print_table(["step", "ms per step", "us per message", "over given proxies"],
                      [[name, f"{s / args.steps * 1e3:.2f}", f"{s / args.steps / messages * 1e6:.2f}",
                        f"{(s - floor) / args.steps / messages * 1e6:+.2f} us"] for name, s in rows])
        full = dict(rows)["tdmesh"]
        print(f"without its backward (the forward, recorded by autograd, and the optimizer): "
              f"{without_s / args.steps * 1e3:.2f} ms a step, {without_messages} messages, {without_s / full:.2f}x "
              f"the whole step's client time: what the client would keep if the workers ran backward")
        print(f"\nthe step as bench.train_step runs it (TDMESH_BACKWARD=auto: backward one message, run by the "
              f"workers' autograd), {steps[2]} messages a step; the floors of its forward and optimizer. 'us per "
              f"op': the client's time for the step's {messages} ops (the per-op path's messages, issue 29's unit)")
        floor = auto[GIVEN_NO_BACKWARD]
        h.print_table(["step", "ms per step", "us per op", "over given proxies, no backward"],
                      [[name, f"{s / args.steps * 1e3:.2f}", f"{s / args.steps / messages * 1e6:.2f}",
                        f"{(s - floor) / args.steps * 1e3:+.2f} ms"]
                       for name, s in [(ON_WORKERS, auto[ON_WORKERS]), (NO_BACKWARD, without_s),
                                       (PLAN_NO_BACKWARD, auto[PLAN_NO_BACKWARD]), (GIVEN_NO_BACKWARD, floor)]])
    return 0


def interleaved(variants: dict, repeats: int, after=None) -> dict:
    """``variants``: name -> (enter, leave, fn).  Rounds of every variant in turn, each row its best
    round (the first round warms up): a host whose speed drifts during the run (the H200 host's
    does, by up to 2x) moves every row alike.  ``after(name, round, fn's result)`` runs untimed."""
    best = dict.fromkeys(variants, float("inf"))
    for round_ in range(repeats + 1):
        for name, (enter, leave, fn) in variants.items():
            enter()
            try:
                start = time.perf_counter()
                out = fn()
                seconds = time.perf_counter() - start
            finally:
                leave()
            if round_:
                best[name] = min(best[name], seconds)
            if after is not None:
                after(name, round_, out)
    return best


def _capture_call_sites(on: bool) -> None:
    """tdmesh's per-op capture of the user's call site, or a stand-in that captures nothing."""
    import tdmesh.engine.client as client_module
    import tdmesh.engine.issue as issue_module
    import tdmesh.errors as errors
    site = errors.call_site if on else (lambda skip=0, hold=False: [])
    issue_module.call_site = client_module.call_site = site  # type: ignore[assignment]


def _add_rows(mesh, n: int, repeats: int) -> dict:
    """The add loop's rows: {name: (seconds for ``n`` ops, the issuing thread's CPU seconds)}."""
    import torch

    import tdmesh
    import tdmesh.engine.dispatch as dispatch_module
    import tdmesh.errors as errors
    from tdmesh.engine.activation import MeshFunctions
    from tdmesh.engine.operators import install
    from tdmesh.engine.tensor import AliasSet, Tensor, new_proxy

    empty_cls, fresh_cls, meta = _wrappers()

    def loop_of(cls):
        def loop(ones=cls(meta), x0=cls(meta)):
            x = x0
            for _ in range(n):
                x = ones + x
        return loop

    def adds():
        x = torch.zeros(100, 100)
        for _ in range(n):
            x = ones + x
        return x

    thread_cpu: dict = {}

    def thread_timed(name: str, loop):
        def timed():
            start = time.thread_time()
            out = loop()
            thread_cpu[name] = min(thread_cpu.get(name, float("inf")), time.thread_time() - start)
            return out
        return timed

    client, sent, seqs = mesh.client, [], iter(range(1 << 62))

    def least(self, func, types, args=(), kwargs=None, site=False):
        """The least an op that is sent can cost in Python: a new ref and proxy, a message
        of ints pickled and queued (no checks, no history, no framing, no socket)."""
        ref = client.new_ref()
        out = new_proxy(x._meta, x.device, x._mesh, ref, AliasSet(), x._stream)
        uses = tuple([a._r.id for a in args if type(a) is Tensor])
        sent.append(dumps((next(seqs), 1, (ref,), (), uses, 0), 5))
        if site:
            errors.call_site(1, True)  # as the hot path captures it (issue.issue_lean)
        return out

    handlers = {
        "tdmesh's own, empty": lambda self, func, types, args=(), kwargs=None: x,
        "tdmesh's own, new": lambda self, func, types, args=(), kwargs=None: new_proxy(
            x._meta, x.device, x._mesh, x._r.id, x._r.aliases, x._stream),
        "least sent": least,
        "least sent + site": lambda self, func, types, args=(), kwargs=None: least(self, func, types, args, kwargs,
                                                                                 site=True)}
    mode, handler = dispatch_module._MeshMode, dispatch_module._MeshMode.__torch_dispatch__
    activation: list = []

    def on_mesh(name: str):
        def enter():
            activation.append(mesh.activate())
            if name in handlers:
                mode.__torch_dispatch__ = handlers[name]  # type: ignore[method-assign]
                # the floor handlers are the mode's: operators reach them through torch's dispatcher
                install(MeshFunctions, learnt=False)
            elif name == "tdmesh, no site":
                _capture_call_sites(False)

        def leave():
            install(MeshFunctions)
            mode.__torch_dispatch__ = handler  # type: ignore[method-assign]
            _capture_call_sites(True)
            sent.clear()
            activation.pop().deactivate()
        return enter, leave, thread_timed(name, adds)

    def after(name: str, round_: int, out) -> None:
        if name in handlers:  # the frees of the row's proxies sent and done before the next row
            tdmesh.fetch_shard(ones).result()
        elif out is not None:  # tdmesh's own rows: the workers' end, outside the timer
            tdmesh.fetch_shard(out).result()

    with mesh.activate():
        ones = torch.ones(100, 100)
        x = adds()
        tdmesh.fetch_shard(x).result()
    off_mesh = (lambda: None, lambda: None)
    variants = {"empty handler": (*off_mesh, thread_timed("empty handler", loop_of(empty_cls))),
                "new wrapper": (*off_mesh, thread_timed("new wrapper", loop_of(fresh_cls)))}
    for name in [*handlers, "tdmesh", "tdmesh, no site"]:
        variants[name] = on_mesh(name)
    return {name: (seconds, thread_cpu[name]) for name, seconds in interleaved(variants, repeats, after).items()}


NO_BACKWARD = "tdmesh, no backward"
ON_WORKERS = "tdmesh, backward on the workers"
PLAN_NO_BACKWARD = "plan proxies, no backward"
GIVEN_NO_BACKWARD = "given proxies, no backward"


def _step_rows(mesh, size: str, batch: int, bf16: bool, n: int, repeats: int):
    """The training-step table's rows: [(name, seconds for ``n`` steps)] and messages a step; the
    ``NO_BACKWARD`` row's value is (seconds, messages a step)."""
    import torch
    from torch.utils._pytree import tree_unflatten

    import tdmesh
    import tdmesh.engine.dispatch as dispatch_module
    from tdmesh.engine.plan import PLANS
    from tdmesh.engine.stream import get_active_stream
    from tdmesh.engine.tensor import AliasSet, Tensor, new_proxy

    sys.path.insert(0, os.path.join(h.REPO_ROOT, "tutorials"))
    from nanogpt import GPT, sized
    tdmesh.random.set_manual_seed_remote(0)
    with tdmesh.no_mesh.activate():  # gpt2's token stream is local data, drawn from a local generator
        cfg, _ = sized(size)
    model = GPT(cfg)
    # bench.train_step's eager step: the same model, optimizer, batch and step function
    step_of = h.data_parallel_step(model, h.train_optimizer(model.parameters(), mesh.device_type == "cuda"), mesh,
                                   bf16)
    x = torch.randint(cfg.vocab_size, (batch, cfg.block_size))
    y = torch.randint(cfg.vocab_size, (batch, cfg.block_size))

    def step():
        return step_of(x, y)

    def run():
        for _ in range(n):
            loss = step()
        return loss

    # a second model for the step without its backward (the forward, which autograd records, and the
    # optimizer on the gradients of its one full step): the floor rows leave their own proxies as gradients
    other = GPT(cfg)
    other_optimizer = h.train_optimizer(other.parameters(), mesh.device_type == "cuda")
    h.data_parallel_step(other, other_optimizer, mesh, bf16)(x, y)

    def without_backward():
        for _ in range(n):
            with torch.autocast(mesh.device_type, dtype=torch.bfloat16, enabled=bf16):
                loss = other(x, y)
            other_optimizer.step()
        return loss

    client = mesh.client
    tdmesh.fetch_shard(run().detach()).result()
    first = client.last_seq
    tdmesh.fetch_shard(run().detach()).result()
    messages = round((client.last_seq - first - 1) / n)  # less the fetch's own message

    def inputs_and_key(func, args, kwargs):
        remote: list = []
        local: list = []
        parts = [dispatch_module._scan(a, remote, local) for a in args]
        return remote, (func, (tuple, tuple(parts)), dispatch_module._scan(kwargs, remote, local) if kwargs else None)

    def proxies(plan, remote):
        device = remote[0].device if remote else client.device
        stream = get_active_stream()
        out = [new_proxy(value, device, mesh, client.new_ref(), remote[slot]._r.aliases if slot >= 0 else AliasSet(),
                         stream) if kind == 0 else (remote[value] if kind == 1 else value)
               for kind, value, slot in plan.outputs]
        return out[0] if plan.single else tree_unflatten(out, plan.spec)

    unplanned: list = []

    def by_key_into(order: list):
        def by_key(func, args, kwargs):
            if dispatch_module._makes_no_tensor(func):  # the profiler's ranges: the client's own, as in tdmesh
                return func(*args, **kwargs)
            remote, key = inputs_and_key(func, args, kwargs)
            plan = PLANS.get(key)
            if plan is None:
                unplanned.append(func)
                return func(*args, **kwargs) if not remote else dispatch_module.dispatch(None, func, (), args, kwargs)
            order.append(plan)
            return proxies(plan, remote)
        return by_key

    order: list = []
    order_without: list = []
    by_key = by_key_into(order)

    given = iter(())

    def by_order(func, args, kwargs):
        if dispatch_module._makes_no_tensor(func):
            return func(*args, **kwargs)
        plan = next(given, None)
        if plan is None or plan.func is not func:
            unplanned.append(func)
            return func(*args, **kwargs)
        remote: list = []
        for a in args:
            dispatch_module._scan(a, remote, [])
        return proxies(plan, remote)

    def handled_by(fn):
        def torch_dispatch(_caller, func, types, args=(), kwargs=None):
            return fn(func, args, kwargs or {})
        dispatch_module._MeshMode.__torch_dispatch__ = torch_dispatch  # type: ignore[method-assign]
        Tensor.__torch_dispatch__ = classmethod(torch_dispatch)  # type: ignore[assignment,method-assign]

    def ordered():
        nonlocal given
        for _ in range(n):
            given = iter(per_step)
            loss = step()
        return loss

    def ordered_without_backward():
        nonlocal given
        for _ in range(n):
            given = iter(per_step_without)
            with torch.autocast(mesh.device_type, dtype=torch.bfloat16, enabled=bf16):
                loss = other(x, y)
            other_optimizer.step()
        return loss

    def as_tdmesh(site: bool):
        return (lambda: _capture_call_sites(site)), (lambda: _capture_call_sites(True)), run

    def as_floor(fn, timed):
        def enter():
            tdmesh.reduce_ = lambda *a, **k: None  # type: ignore[assignment]
            handled_by(fn)

        def leave():
            dispatch_module._MeshMode.__torch_dispatch__ = handler  # type: ignore[method-assign]
            Tensor.__torch_dispatch__ = tensor_handler  # type: ignore[method-assign]
            tdmesh.reduce_ = reduce_
        return enter, leave, timed

    activations: list = []

    def backward_on_workers():
        """TDMESH_BACKWARD=auto, for the forward too: read when an activation begins."""
        def enter():
            os.environ["TDMESH_BACKWARD"] = "auto"
            activations.append(mesh.activate())

        def leave():
            activations.pop().deactivate()
            os.environ["TDMESH_BACKWARD"] = "client"
        return enter, leave

    reduce_ = tdmesh.reduce_
    handler, tensor_handler = dispatch_module._MeshMode.__torch_dispatch__, Tensor.__dict__["__torch_dispatch__"]
    variants = {"tdmesh": as_tdmesh(True), "tdmesh, no site": as_tdmesh(False),
                "plan proxies": as_floor(by_key, run), "given proxies": as_floor(by_order, ordered),
                NO_BACKWARD: (lambda: None, lambda: None, without_backward),
                ON_WORKERS: (*backward_on_workers(), run),
                PLAN_NO_BACKWARD: as_floor(by_key_into(order_without), without_backward),
                GIVEN_NO_BACKWARD: as_floor(by_order, ordered_without_backward)}
    per_step: list = []
    per_step_without: list = []

    def after(name: str, round_: int, loss) -> None:
        nonlocal per_step, per_step_without
        if round_ == 0 and name == "plan proxies":  # the step's plans, in order, for "given proxies"
            per_step = order[:len(order) // n]
        if round_ == 0 and name == PLAN_NO_BACKWARD:
            per_step_without = order_without[:len(order_without) // n]
        # the workers' end (or the frees of the floor's proxies) sent and done outside the timer
        tdmesh.fetch_shard(loss if name.startswith("tdmesh") else a_parameter).result()

    a_parameter = next(model.parameters())
    first = client.last_seq
    tdmesh.fetch_shard(without_backward().detach()).result()
    messages_without = round((client.last_seq - first - 1) / n)
    best = interleaved(variants, repeats, after)
    best[NO_BACKWARD] = (best[NO_BACKWARD], messages_without)
    if unplanned:
        print(f"note: {len(unplanned)} ops without a plan in the floor rows (run as tdmesh runs them): "
              f"{sorted(set(map(str, unplanned)))[:5]}")
    tdmesh.fetch_shard(run().detach()).result()
    enter, leave = backward_on_workers()
    enter()
    try:
        first = client.last_seq
        tdmesh.fetch_shard(run().detach()).result()
        messages_auto = round((client.last_seq - first - 1) / n)
    finally:
        leave()
    return list(best.items()), messages, messages_auto


if __name__ == "__main__":
    sys.exit(main())
