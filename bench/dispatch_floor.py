"""The floor of an eager op: what torch itself charges a ``__torch_dispatch__`` wrapper
subclass, against tdmesh's whole client path, same process, microseconds per op.

    python -m bench.dispatch_floor                 # CPU worker
    python -m bench.dispatch_floor --device cuda   # a GPU worker (the client's work is the same)

Every row times the loop ``x = ones + x`` (100x100 float32) as the client issues it (best of
``--repeats``; the workers' execution is not waited for, except by tdmesh's own flow control):

  empty handler    a wrapper subclass whose ``__torch_dispatch__`` returns one preallocated
                   wrapper: torch's argument parsing, its dispatcher and the call into Python
  new wrapper      the handler makes a new wrapper per op (``_make_wrapper_subclass``), as
                   every proxy is made: torch's part of any design that returns a new tensor
  tdmesh's own     the same two with tdmesh's classes and modes (``tdmesh.Tensor``, the mesh's
    empty / new    torch-function mode and dispatch mode): the mode's handler returns one
                   preallocated proxy, or a new one (``tensor.new_proxy``), and sends nothing
  tdmesh           the loop under ``mesh.activate()``, one worker
  tdmesh, no site  the same with the user's call site not captured (``errors.call_site``
                   answering at once): what capturing it costs

The last two rows' difference from ``new wrapper`` is tdmesh's own work per op.
"""

from __future__ import annotations

import argparse
import os
import sys

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
    p = argparse.ArgumentParser(prog="python -m bench.dispatch_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ["TDMESH_DEVICE"] = "cpu"
    h.ensure_importable_by_workers()
    import torch

    import tdmesh
    import tdmesh.errors as errors
    n = args.iters
    empty_cls, fresh_cls, meta = _wrappers()
    rows = []
    for name, cls in (("empty handler", empty_cls), ("new wrapper", fresh_cls)):
        ones, x0 = cls(meta), cls(meta)

        def loop(ones=ones, x0=x0):
            x = x0
            for _ in range(n):
                x = ones + x
        rows.append((name, h.best_after_warmup(loop, args.repeats)))
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, pool=False) as mesh, mesh.activate():
        ones = torch.ones(100, 100)

        def adds():
            x = torch.zeros(100, 100)
            for _ in range(n):
                x = ones + x
            return x
        import tdmesh.engine.dispatch as dispatch_module
        from tdmesh.engine.tensor import new_proxy
        mode, handler = dispatch_module._MeshMode, dispatch_module._MeshMode.__torch_dispatch__
        x = adds()
        try:
            mode.__torch_dispatch__ = lambda self, func, types, args=(), kwargs=None: x  # type: ignore[method-assign]
            rows.append(("tdmesh's own, empty", h.best_after_warmup(adds, args.repeats)))
            mode.__torch_dispatch__ = lambda self, func, types, args=(), kwargs=None: new_proxy(  # type: ignore
                x._meta, x.device, x._mesh, x._r.id, x._r.aliases, x._stream)
            rows.append(("tdmesh's own, new", h.best_after_warmup(adds, args.repeats)))
        finally:
            mode.__torch_dispatch__ = handler  # type: ignore[method-assign]
        rows.append(("tdmesh", h.best_after_warmup(adds, args.repeats)))
        tdmesh.fetch_shard(adds()).result()
        captured = errors.call_site
        import tdmesh.engine.client as client_module
        import tdmesh.engine.issue as issue_module
        try:
            issue_module.call_site = client_module.call_site = lambda skip=0: []  # type: ignore[assignment]
            rows.append(("tdmesh, no site", h.best_after_warmup(adds, args.repeats)))
        finally:
            issue_module.call_site = client_module.call_site = captured  # type: ignore[assignment]
        tdmesh.fetch_shard(adds()).result()
    print(f"dispatch floor: x = ones + x, {n} ops a run, best of {args.repeats}; torch {torch.__version__}; "
          f"{h.machine_line()}")
    floor = rows[1][1]
    h.print_table(["loop", "us per op", "over new wrapper"],
                  [[name, f"{s / n * 1e6:.2f}", f"{(s - floor) / n * 1e6:+.2f} us"] for name, s in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
