"""torch's own OpInfo samples, run locally and through a mesh, compared (issue 13).

``python -m tests.fleet.opinfo_conformance [--device cpu|cuda] [--dtype float32|bfloat16]``
prints the rate and every failing sample; ``tests/fleet/test_opinfo.py`` runs it in the suite.
Each op of ``op_db`` that supports the dtype gives up to ``SAMPLES_PER_OP`` sample inputs; a
sample counts when local torch runs it (an input local torch refuses tests nothing here).
The same inputs (storage and view) are shipped to a one-worker mesh, the op runs there,
the result is fetched and compared with ``torch.testing.assert_close``, and the strides of the
proxies the client made (its own metadata of the worker's results) with those of local torch's
result (dims of size 1 aside: their stride means nothing).  ``layout`` runs each sample as given,
with its tensors ``permuted`` (4-d channels-last, 5-d channels-last-3d, others column-major), or
``noncontiguous`` (OpInfo's own non-contiguous copies).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import Counter
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

import tdmesh

SAMPLES_PER_OP = 8

# Ops whose results do not depend on their inputs alone: random draws, or memory left
# uninitialised.  Local torch and a worker cannot agree on them by construction.
_RANDOM = ("bernoulli normal normal.number_mean rand rand_like randint randint_like randn randn_like multinomial "
           "uniform cauchy exponential geometric log_normal nn.functional.dropout nn.functional.dropout2d "
           "nn.functional.dropout3d nn.functional.alpha_dropout nn.functional.feature_alpha_dropout.with_train "
           "nn.functional.feature_alpha_dropout.without_train nn.functional.fractional_max_pool2d "
           "nn.functional.fractional_max_pool3d nn.functional.rrelu nn.functional.gumbel_softmax "
           "nn.functional.multi_head_attention_forward nn.functional.scaled_dot_product_attention "
           "svd_lowrank pca_lowrank").split()
_UNINITIALISED = "empty empty_like new_empty new_empty_strided empty_strided empty_permuted".split()
_ATTENTION = ("torch.ops.aten._efficient_attention_forward", "torch.ops.aten._flash_attention_forward")
NOT_DETERMINISTIC = {**{op: "draws random numbers (the worker's generator is not the client's)" for op in _RANDOM},
                     **{op: "returns uninitialised memory" for op in _UNINITIALISED},
                     **{op: "CUDA only: half its samples draw dropout masks, and without dropout its philox "
                            "seed and offset (rng state) outputs are uninitialised" for op in _ATTENTION}}


class Outcome(NamedTuple):
    op: str
    sample: int
    error: str | None  # None: identical
    strides: str | None = None  # None: the client's proxies have local torch's strides


def _ship(mesh, value):
    """Local tensors of a sample as exact copies on the mesh; everything else as it is."""
    return tree_map(lambda x: _ship_tensor(mesh, x) if isinstance(x, torch.Tensor) else x, value)


def _ship_tensor(mesh, t: torch.Tensor):
    """``t`` on the mesh with its whole storage, viewed with its own sizes, strides and offset:
    ops that read the storage around a view (``as_strided``) see the same memory there."""
    if t.layout is not torch.strided or t.is_conj() or t.is_neg():
        return tdmesh.to_mesh(t, mesh)
    storage = t.untyped_storage()
    base = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (storage.nbytes() // t.element_size(),))
    remote = tdmesh.to_mesh(base, mesh)
    with mesh.activate():
        return remote.as_strided(t.size(), t.stride(), t.storage_offset())


def conformance(mesh, device: str = "cpu", dtype: torch.dtype = torch.float32,
                only: set[str] | None = None, layout: str = "as_given") -> list[Outcome]:
    """Every sample's outcome, op by op, with its inputs laid out as ``layout`` says."""
    return conformance_layouts(mesh, device, dtype, only, (layout,))[layout]


def conformance_layouts(mesh, device: str = "cpu", dtype: torch.dtype = torch.float32,
                        only: set[str] | None = None,
                        layouts: tuple[str, ...] = ("as_given",)) -> dict[str, list[Outcome]]:
    """Every sample's outcome in each layout, from one pass over the database (each sample made once).  A
    ``permuted`` sample whose tensors permuting leaves as they were (none of 2 dims or more) is the ``as_given``
    one again: run once, counted under ``as_given`` when both run.  The samples of ``OPS_PER_ROUND`` ops are
    issued before any of their results is fetched (a fetch resolves in stream order, so each sees its own op's
    result; a failed op fails only what depends on it): one round trip per round, not per sample."""
    from torch.testing._internal.common_methods_invocations import op_db
    outcomes: dict[str, list[Outcome]] = {layout: [] for layout in layouts}
    pending: list[tuple[str, str, int, object, object]] = []  # (layout, op, sample, future or error, expected)
    with _without_absent_device_seeding(device):
        for op in op_db:
            name = op.name if not op.variant_test_name else f"{op.name}.{op.variant_test_name}"
            if (only is not None and name not in only) or name in NOT_DETERMINISTIC or op.name in NOT_DETERMINISTIC:
                continue
            if device == "cuda" and op.name.startswith("jiterator_"):
                continue  # the local reference run faults (illegal address) and poisons this process's CUDA context
            if dtype not in op.supported_dtypes(device):
                continue
            try:
                samples = list(op.sample_inputs(device, dtype, requires_grad=False))[:SAMPLES_PER_OP]
            except Exception:  # noqa: BLE001 - the database cannot make inputs for this op here
                continue
            for i, given in enumerate(samples):
                for layout in layouts:
                    try:
                        sample = _laid_out(given, layout)
                    except Exception:  # noqa: BLE001 - OpInfo cannot lay this sample out so (sparse tensors)
                        continue
                    if layout == "permuted" and "as_given" in layouts and _same_layout(sample, given):
                        continue
                    try:
                        expected = op(sample.input, *sample.args, **sample.kwargs)
                    except Exception:  # noqa: BLE001 - local torch refuses this input: nothing to compare
                        continue
                    pending.append((layout, name, i, _issue(mesh, op, sample), expected,
                                    lambda op=op, sample=sample: op(sample.input, *sample.args, **sample.kwargs)))
            if len({p[1] for p in pending}) >= OPS_PER_ROUND:
                _settle(pending, outcomes)
        _settle(pending, outcomes)
    return outcomes


OPS_PER_ROUND = 16


def _laid_out(sample, layout: str):
    if layout == "noncontiguous":
        return sample.noncontiguous()
    if layout == "permuted":
        return sample.transform(_permuted)
    return sample


def _permuted(t):
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided or t.dim() < 2:
        return t
    if t.dim() in (4, 5):
        return t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _same_layout(a, b) -> bool:
    """Whether two samples' tensors have the same strides and offsets (the same tensors, laid out alike)."""
    def layout(sample):
        return [(t.stride(), t.storage_offset()) if t.layout is torch.strided else None
                for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0] if isinstance(t, torch.Tensor)]
    return layout(a) == layout(b)


def _strides(value) -> list:
    """(size, stride) of each dim longer than 1, per tensor leaf of ``value`` (None: not strided)."""
    leaves = tree_flatten(value)[0]
    return [tuple((n, s) for n, s in zip(t.shape, t.stride()) if n > 1)
            if isinstance(t, torch.Tensor) and t.layout is torch.strided else None for t in leaves]


def _issue(mesh, op, sample):
    """The sample run on the mesh: (a future of its fetched result, its proxies' strides), or the
    text of the error it raised."""
    try:
        remote_input, remote_args, remote_kwargs = _ship(mesh, (sample.input, sample.args, sample.kwargs))
        with mesh.activate():
            out = op(remote_input, *remote_args, **remote_kwargs)
            return tdmesh.fetch_shard(out), _strides(out)
    except Exception as e:  # noqa: BLE001 - any failure is this sample's result
        return _error_text(e)


def _settle(pending: list, outcomes: dict) -> None:
    """The outcomes of the issued samples, each under its layout (and ``pending`` emptied).  A sample whose mesh
    result differs is run locally once more: where local torch does not give its own result again (torch
    2.14.1's CPU flash attention on channels-last inputs), there is nothing to compare with, and the sample is
    left out as one local torch refuses is, and noted in ``UNREPRODUCIBLE``."""
    for layout, name, i, issued, expected, again in pending:
        error = _compare(issued, expected)
        if error is not None and error.startswith("different result") and not _reproducible(expected, again):
            UNREPRODUCIBLE.append(f"{layout} {name}[{i}]")
            continue
        outcomes[layout].append(Outcome(name, i, error, _compare_strides(issued, expected)))
    pending.clear()


UNREPRODUCIBLE: list[str] = []  # samples whose local result changes from run to run (see _settle)


def _reproducible(expected, again) -> bool:
    try:
        torch.testing.assert_close(again(), expected, equal_nan=True, rtol=0, atol=0)
    except Exception:  # noqa: BLE001 - another value, or the second run raised
        return False
    return True


def _compare_strides(issued, expected) -> str | None:
    if isinstance(issued, str):
        return None
    proxies, local = issued[1], _strides(expected)
    for got, want in zip(proxies, local):
        if got is not None and want is not None and got != want:
            return f"proxy (size, stride) {got}, local torch {want}"
    return None


def _error_text(e: Exception) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:300]


def _compare(issued, expected) -> str | None:
    if isinstance(issued, str):
        return issued
    try:
        got = issued[0].result()
    except Exception as e:  # noqa: BLE001 - any failure is this sample's result
        return _error_text(e)
    try:
        torch.testing.assert_close(got, tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, expected),
                                   equal_nan=True, check_stride=False, check_device=False)
    except Exception as e:  # noqa: BLE001 - a different value (or type, or shape)
        return f"different result: {str(e).splitlines()[0]}"[:300]
    return None


@contextlib.contextmanager
def _without_absent_device_seeding(device: str):
    """OpInfo seeds torch for every sample it makes (``torch.manual_seed``), which also queues a seed
    for each accelerator type torch knows (CUDA, XPU, MTIA), each with the caller's formatted stack
    while that device is uninitialised: 30% of this run's time on a CPU-only host.  Where this
    run uses no such device, those per-device seeds are skipped; the CPU generator is seeded as before."""
    names = [mod for mod in ("cuda", "xpu", "mtia") if not (mod == device or getattr(torch, mod).is_available())]
    saved = [(getattr(torch, mod), getattr(torch, mod).manual_seed_all) for mod in names]
    for module, _ in saved:
        module.manual_seed_all = lambda seed: None
    try:
        yield
    finally:
        for module, original in saved:
            module.manual_seed_all = original


def summary(outcomes: list[Outcome]) -> str:
    ok = sum(o.error is None for o in outcomes)
    ops = {o.op for o in outcomes}
    failing = Counter(o.op for o in outcomes if o.error is not None)
    strided = Counter(o.op for o in outcomes if o.strides is not None)
    return (f"{ok}/{len(outcomes)} samples identical ({100.0 * ok / max(len(outcomes), 1):.2f}%) over {len(ops)} ops; "
            f"{len(failing)} ops with a failing sample; proxies with other strides than local torch's: "
            f"{sum(strided.values())} samples of {len(strided)} ops")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--op", action="append", help="only these ops (repeatable)")
    p.add_argument("--layout", default="as_given", choices=["as_given", "permuted", "noncontiguous"])
    args = p.parse_args()
    start = time.monotonic()
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:
        outcomes = conformance(mesh, args.device, getattr(torch, args.dtype), set(args.op) if args.op else None,
                               args.layout)
    for o in outcomes:
        if o.error is not None:
            print(f"FAIL {o.op}[{o.sample}]: {o.error}")
        if o.strides is not None:
            print(f"STRIDES {o.op}[{o.sample}]: {o.strides}")
    print(f"{args.device} {args.dtype} {args.layout}: {summary(outcomes)} in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
