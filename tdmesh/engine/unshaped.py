"""Ops whose output metadata the client cannot derive, so the workers tell it.

Either only the data decides the shapes (``nonzero``, ``x[x > 0]``, ``unique``), or torch
has no meta kernel for the op (most sparse ops, cuDNN-only kernels).  The op runs on the
workers, and one blocking round trip (the cost of an ``.item()``) brings back the metadata
of its outputs.  Ops that read a tensor argument on the host (``tensor_split`` by a tensor of
indices) get that argument's values the same way (:func:`host_values`).
"""

from __future__ import annotations

from ..errors import user_line
from ..protocol import messages as m
from .coalescing import check_not_coalescing
from .host_reads import read_on_host
from .issue import adopt, issue_unshaped
from .placement import note_written
from .propagation import SparseMeta, from_description, op_aliasing, schema_arg
from .saved import workers_record
from .stream import get_active_stream
from .tensor import Tensor, describe
from .wire import op_path, to_wire

__all__ = ["dispatch_unshaped", "data_dependent", "no_kernel", "meta_stricter", "host_values", "SHAPES_READ"]

# the read of an op's output shapes (a guard inside a compiled function: ``Guard.reads_shapes``)
SHAPES_READ = "tdmesh.worker.builtins.describe"


def dispatch_unshaped(func, args, kwargs, remote, mesh, device, why: str):
    """An op whose output metadata the client cannot derive: only the data decides it
    (``nonzero``, ``x[x > 0]``, ``unique``), or torch has no meta kernel for it (most sparse
    ops, cuDNN-only kernels).  It runs on the workers, and one blocking round trip learns the
    metadata of its outputs and of what it writes, which every rank of the mesh must agree on
    (the client holds one proxy for all ranks)."""
    check_not_coalescing(f"{func} ({why}: the client must ask the workers)")
    aliasing = op_aliasing(func)
    if any(is_list for _, _, is_list in aliasing.return_aliases) or not aliasing.return_aliases:
        raise NotImplementedError(f"{func}: {why}, and tdmesh learns output metadata from the workers only for "
                                  f"ops that return tensors, not lists; run it in a remote function"
                                  f"\n  at {user_line()}")
    mutated = [t for position in aliasing.mutated_args
               for t in _tensors_in(schema_arg(func, args, kwargs, position))]
    written = [schema_arg(func, args, kwargs, source) if is_write else None
               for source, is_write, _ in aliasing.return_aliases]  # in place: the result is the argument
    for t in mutated:
        note_written(t)
    stream = get_active_stream()
    path = op_path(func)
    grad = workers_record(mesh.client)

    def build(seq, results, mutated_refs):
        return m.CallFunction(seq, results, mutated_refs, path, to_wire(args), to_wire(kwargs) if kwargs else {},
                              stream.id, grad=grad)

    sink = mesh.client.sink  # a compiled function's trace learns of the proxies below (a guard's)
    refs = issue_unshaped(mesh, build, [w is None for w in written], inputs=remote, mutated=mutated, stream=stream)
    new_refs = [r for r in refs if r is not None]
    asked = new_refs + [t._r.id for t in mutated]

    def agree(per_rank):
        shapes = list(per_rank)  # (point, descriptions) per rank
        first = shapes[0][1]
        if any(v != first for _, v in shapes):
            listed = "\n".join(f"  {point}: {[list(d[0]) for d in v]}" for point, v in shapes)
            raise ValueError(f"{func}: {why}, and the ranks of {mesh.shape} disagree on its output shapes:\n"
                             f"{listed}\none proxy cannot stand for different shapes; run it inside a remote "
                             f"function, or use a fixed-size form (nonzero_static(size=...), "
                             f"repeat_interleave(output_size=...), masked_fill instead of boolean indexing)"
                             f"\n  at {user_line()}")
        return first

    # inside a compiled function the read is a guard (its value: the output shapes); not where the op
    # writes an argument's shape, which a replay's proxies could not follow
    try:
        first = read_on_host(mesh, SHAPES_READ, ([m.Ref(r) for r in asked],), {},
                             f"the output shapes of {func} ({why})", uses=tuple(asked), agree=agree,
                             guard=not mutated)
    except BaseException:
        mesh.client.delete_refs(new_refs, mesh)
        raise
    metas = [from_description(d) for d in first]
    for t, meta in zip(mutated, metas[len(new_refs):]):
        if t._meta != meta:
            if type(meta) is not SparseMeta:
                raise NotImplementedError(f"{func} changed the shape of a remote tensor in place, and only "
                                          f"sparse proxies follow such a change; use its out-of-place form"
                                          f"\n  at {user_line()}")
            t._meta = meta
    made = adopt(mesh, new_refs, metas[:len(new_refs)], device, stream)
    adopted = getattr(sink, "adopted", None)
    if adopted is not None:
        adopted(made)
    new = iter(made)
    proxies = [w if w is not None else next(new) for w in written]
    return proxies[0] if len(proxies) == 1 else tuple(proxies)


def _tensors_in(value) -> list:
    return [t for t in (value if isinstance(value, (list, tuple)) else (value,)) if type(t) is Tensor]


def no_kernel(e: Exception) -> bool:
    """Whether propagation failed because torch has no meta (or fake) kernel for the op."""
    from torch._subclasses.fake_tensor import UnsupportedOperatorException
    # a library op (torch.library.custom_op) that registers no fake impl says so in text
    return isinstance(e, (NotImplementedError, UnsupportedOperatorException)) or "no fake impl" in str(e)


# (op, device type) -> the text of a refusal by torch's meta kernel that the device's kernel does not
# make: there the workers' kernel decides (and raises its own error where it refuses too).  torch's
# meta kernel for _grouped_mm checks CUDA's fast path (bfloat16 only); the CPU kernel runs float32,
# and transformers' MoE layers call it so on CPU.  Its meta ``view_copy`` views, where the device's
# kernels reshape: a transposed input is refused (CPU meshes propagate on fake CPU tensors, which run
# the CPU kernel's rule; CUDA meshes on the meta device).
# Each refusal's texts, one a torch version that words it otherwise (torch 2.14: "Expected mat_a to be BFloat16 ...").
_META_STRICTER = {("aten::_grouped_mm", "cpu"): ("Expected inputs of BF16 type", "to be BFloat16 or supported Float16"),
                  ("aten::view_copy", "cuda"): ("view size is not compatible with input tensor's size and stride",)}


def meta_stricter(func, device_type: str, e: Exception) -> bool:
    """Whether propagation failed where torch's meta kernel is stricter than the device's kernel."""
    texts = _META_STRICTER.get((func._schema.name, device_type), ())
    return any(text in str(e) for text in texts)


def data_dependent(e: Exception) -> bool:
    """Whether propagation failed because the output shape depends on the data."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    if isinstance(e, (DynamicOutputShapeException, DataDependentOutputException)):
        return True
    text = str(e)
    return ("data is not allocated" in text or "meta tensor without output_size" in text
            or "cannot be called on meta tensors" in text)




def host_values(t: Tensor, op: str):
    """The values of a remote tensor as Python numbers, for an argument torch reads on the
    host (``tensor_split`` by a tensor of indices): fetched from every rank of its mesh,
    which must agree (the number of outputs depends on them).  One blocking round trip; a
    guard inside a compiled function, as ``.tolist()`` is (``agree`` outlives the call with the
    guard, so it holds the tensor's description, not the tensor)."""
    named, mesh = describe(t), t._mesh

    def agree(per_rank):
        values = list(per_rank)
        if any(v != values[0][1] for _, v in values):
            listed = "\n".join(f"  {point}: {v}" for point, v in values)
            raise ValueError(f"{op} reads the values of {named} on the host, and the ranks of {mesh.shape} "
                             f"disagree on them:\n{listed}\nrun it inside a remote function\n  at {user_line()}")
        return values[0][1]

    return read_on_host(mesh, "tdmesh.worker.builtins.values_of", (t,), {},
                        f"{op} (it reads the values of {named} on the host)", agree=agree)
