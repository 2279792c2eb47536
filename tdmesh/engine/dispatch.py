"""aten calls to remote ops: the front of the client's data path.

``Tensor.__torch_dispatch__`` and the mode that is active while a mesh is (``MESH_MODE``,
pushed by :mod:`tdmesh.engine.activation`) send every aten call here.  An op on remote tensors,
or a factory under an active mesh, gets its output metadata from :mod:`tdmesh.engine.propagation`
(errors the metadata reveals are raised at the user's line) and is issued as one
``CallFunction`` through :func:`tdmesh.engine.issue.issue`.  Ops that need a Python value now
(``.item()``, ``bool()``) fetch; ops on local tensors only stay local.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map, tree_unflatten

from ..errors import UsageError, user_line
from ..protocol import messages as m
from ..protocol.arguments import SHIPPED_FUNCTION
from ..protocol.codec import pack_tensor
from .context import active_mesh_or_none
from .generators import key_part as generator_key_part
from .generators import send_state as send_generator_state
from .host_reads import read_name, read_on_host
from .issue import New, issue, issue_lean, issue_op
from .operators import learners, note_dispatched, note_lean, use_mode
from .placement import check_inputs, check_mutation, plainly_placed
from .plan import MAX_PLANS, PLANS, OpPlan, make_plan, outputs_of
from .propagation import TensorMeta, meta_tensor, op_aliasing, propagate, tensor_meta
from .saved import workers_record
from .stream import get_active_stream
from .tensor import Tensor, describe, raise_in_op
from .unshaped import data_dependent, dispatch_unshaped, meta_stricter, no_kernel
from .wire import op_path, to_wire

__all__ = ["dispatch", "ship_local", "MESH_MODE"]

# Ops whose answer is a Python value on the client: they need a fetch, not a dispatch.
_NEEDS_VALUE = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::item"}
_LIFT = ("aten::lift_fresh", "aten::lift")
# Questions a proxy's metadata answers without asking the workers.
_STRUCTURE_QUERIES = {"prim::device", "aten::_nnz", "aten::sparse_dim", "aten::dense_dim", "aten::is_coalesced",
                      "aten::_dimI", "aten::_dimV", "aten::is_same_size"}

_no_tensor_out: dict = {}
_value_out: dict = {}


def _makes_no_tensor(func) -> bool:
    answer = _no_tensor_out.get(func)
    if answer is None:
        answer = not any("Tensor" in str(r.type) for r in func._schema.returns) and not any(
            "Tensor" in str(a.type) for a in func._schema.arguments)
        _no_tensor_out[func] = answer
    return answer


def _returns_python_value(func) -> bool:
    """Ops such as ``allclose`` or ``equal`` answer with a Python value, not a tensor."""
    answer = _value_out.get(func)
    if answer is None:
        returns = func._schema.returns
        answer = _value_out[func] = bool(returns) and not any("Tensor" in str(r.type) for r in returns)
    return answer


def _scan(obj, remote: list, local: list):
    """One pass over an op's arguments: collect tensors, and build the propagation cache key."""
    t = type(obj)
    if t is Tensor:
        remote.append(obj)
        return obj._meta
    if t is tuple or t is list:  # foreach ops take lists of hundreds of tensors: those inline
        parts = []
        for x in obj:
            if type(x) is Tensor:
                remote.append(x)
                parts.append(x._meta)
            else:
                parts.append(_scan(x, remote, local))
        return (t, tuple(parts))
    if t is dict:
        return (dict, tuple([(k, _scan(v, remote, local)) for k, v in obj.items()]))
    if isinstance(obj, torch.Tensor):
        local.append(obj)
        return ("local", id(obj))
    if t is float or t is bool or t is complex:  # 12 == 12.0 == True, but they make other dtypes
        return (t, obj)
    if t is torch.Generator:
        return generator_key_part(obj)
    return obj


def dispatch(_caller, func, _types, args: tuple = (), kwargs: dict | None = None):
    """Turn one aten call into a remote op and return its result proxies.  This is ``__torch_dispatch__``
    itself, of the mesh's mode and of ``Tensor`` (``_caller`` is the mode or the class): one frame on
    either path, which the call-site captures of :mod:`tdmesh.engine.issue` count on."""
    if kwargs is None:
        kwargs = {}
    if learners[0]:  # an operator call learns what it dispatches: every op counts (operators.py)
        note_dispatched()
    remote: list = []
    local: list = []
    parts: list = []
    for x in args:  # _scan(args), with its commonest leaf inline: this runs for every op
        if type(x) is Tensor:
            remote.append(x)
            parts.append(x._meta)
        else:
            parts.append(_scan(x, remote, local))
    key = (func, (tuple, tuple(parts)), _scan(kwargs, remote, local) if kwargs else None)
    if kwargs and not local and type(kwargs.get("generator")) is torch.Generator:  # local ones draw here
        _send_generator_state(kwargs["generator"], remote)
    if not local:
        try:
            plan = PLANS.get(key)
        except TypeError:  # an unhashable argument: never planned
            plan = None
        if plan is not None:  # the hot path: this op with this argument metadata was seen before
            mesh = remote[0]._mesh if remote else active_mesh_or_none()
            client = mesh.client if mesh is not None else None
            if client is not None:
                device = remote[0].device if remote else _op_device(remote, kwargs, client)
                # a plan's strides are its device type's (propagation.py): the mesh's, or the op's own
                if plan.device_type is client.device_type or plan.device_type == device.type:
                    stream = get_active_stream()
                    if plan.lean is not None and plainly_placed(remote, mesh, stream):
                        if learners[0]:  # an operator call learns which plan it dispatches
                            note_lean(plan, remote)
                        return issue_lean(mesh, plan, remote, device, stream)
                    check_inputs(remote, mesh, func, stream)
                    return _issue_plan(plan, remote, mesh, device, stream)
    name = func._schema.name
    if remote:
        mesh = remote[0]._mesh
        if name in _NEEDS_VALUE or _returns_python_value(func):
            return _value_on_client(func, args, kwargs, remote)
    elif local and name not in _LIFT:
        # only local tensors (a fetched value, say): the op is the client's own business.
        # Mixing local and remote tensors is the error (below); torch.tensor(data) ships data.
        return func(*args, **kwargs)
    else:
        mesh = active_mesh_or_none()
        if mesh is None or _makes_no_tensor(func):
            # no_mesh, or an op with no remote input and no tensor output (profiler ranges and
            # the like): it is the client's own business
            return func(*args, **kwargs)
    client = mesh.client
    if client is None:
        raise UsageError(f"{mesh!r} is a pure geometry value with no fleet; get a live mesh from "
                         f"tdmesh.local_mesh() or tdmesh.world_mesh()\n  at {user_line()}")
    if local:
        if name in _LIFT and not remote:
            return ship_local(local[0], mesh)
        if func is _COPY and remote and args[0] is remote[0] and len(local) == 1 and args[1] is local[0]:
            # mesh_tensor.copy_(local): load_state_dict of local (pretrained) weights ships them
            return func(args[0], ship_local(local[0], mesh, remote[0].stream), *args[2:], **kwargs)
        raise_in_op("LOCAL_TENSOR", f"{func} mixes a local tensor with the mesh {mesh.shape}:\n"
                                    f"  {describe(local[0])}\ncopy it to the mesh with torch.tensor(tensor) under "
                                    f"mesh.activate() or tdmesh.to_mesh(tensor, mesh), "
                                    f"or run local code under tdmesh.no_mesh.activate()")
    check_inputs(remote, mesh, func)
    return _dispatch_remote(func, args, kwargs, key, remote, mesh, client)


_compile_noted = [False]


def _dynamo_callback():
    """Dynamo's frame hook, set while a ``torch.compile``'d function runs (None elsewhere)."""
    hook = getattr(torch._C, "_dynamo", None)
    return None if hook is None else hook.eval_frame.get_eval_frame_callback()


def _note_torch_compile() -> None:
    """Said once, at the first op planned inside a ``torch.compile``'d function: it runs eagerly."""
    _compile_noted[0] = True
    warnings.warn(f"torch.compile runs code on a mesh eagerly, op by op: dynamo cannot trace tdmesh's mesh tensors "
                  f"(tdmesh keeps it out of its own frames). tdmesh.compile(fn) compiles it, for the workers to run "
                  f"as one program\n  at {user_line()}", stacklevel=2)


def _send_generator_state(generator: torch.Generator, remote: list) -> None:
    """An op that draws from a client's generator: the workers' copy of it first takes its state where the
    client's changed (``generators.py``)."""
    mesh = remote[0]._mesh if remote else active_mesh_or_none()
    if mesh is not None and mesh.client is not None:
        send_generator_state(generator, mesh, remote[0]._stream if remote else get_active_stream())


def _op_device(remote: list, kwargs: dict, client) -> torch.device:
    if remote:
        return remote[0].device
    device = kwargs.get("device")
    if device is None:
        return client.device
    device = torch.device(device)
    return client.device if device.type == client.device.type else device  # "cuda": the worker's own GPU


def _issue_plan(plan: OpPlan, remote: list, mesh, device, stream):
    for slot in plan.mutated:
        check_mutation(remote[slot], plan.func)
    proxies = issue_op(mesh, plan, remote, device, stream)
    return proxies[0] if plan.single else tree_unflatten(proxies, plan.spec)


def _dispatch_remote(func, args, kwargs, key, remote, mesh, client):
    if not _compile_noted[0] and _dynamo_callback() is not None:
        _note_torch_compile()
    device = _op_device(remote, kwargs, client)
    try:
        # a generator changes no metadata, and some of torch's meta refs refuse one (exponential_)
        out = propagate(func, args, kwargs | {"generator": None} if kwargs.get("generator") is not None else kwargs,
                        remote, key, device.type)
    except Exception as e:  # noqa: BLE001 - re-raised, with the user's line
        if data_dependent(e):
            return dispatch_unshaped(func, args, kwargs, remote, mesh, device, "its output shape depends on the data")
        if no_kernel(e):
            return dispatch_unshaped(func, args, kwargs, remote, mesh, device,
                                      "torch cannot derive its output metadata without running it")
        if meta_stricter(func, device.type, e):
            return dispatch_unshaped(func, args, kwargs, remote, mesh, device,
                                      f"torch's meta kernel refuses what the {device.type} kernel runs")
        # Errors that metadata reveals are the user's, raised at their line as local torch would.
        if not _retypable(e):
            raise
        raise type(e)(f"{e}\n  (tdmesh: raised while checking {func} on the client, before anything was sent)"
                      f"\n  at {user_line()}") from None
    if out.sparse:  # meta kernels cannot know how many elements a sparse result holds
        return dispatch_unshaped(func, args, kwargs, remote, mesh, device, "it makes a sparse tensor")
    aliasing = op_aliasing(func)
    try:
        plan = make_plan(func, args, kwargs, out, aliasing, _leaf_positions(aliasing, out), len(remote))
    except NotImplementedError as e:
        raise NotImplementedError(f"{e}\n  at {user_line()}") from None
    plan.device_type = sys.intern(device.type)  # the client's own (interned) where it is the mesh's type
    if plan.reusable and len(PLANS) < MAX_PLANS:
        try:
            PLANS[key] = plan
        except TypeError:  # an unhashable argument: sent whole
            pass
        else:
            return _issue_plan(plan, remote, mesh, device, get_active_stream())
    # sent whole: an op whose tensors are not all slots, an in-place view op, a full plan cache
    for slot in plan.mutated:
        check_mutation(remote[slot], func)
    outputs, values = outputs_of(plan, remote)
    stream = get_active_stream()
    path = plan.path
    grad = workers_record(client)

    def build(seq, results, mutated_refs):
        return m.CallFunction(seq, results, mutated_refs, path, to_wire(args), to_wire(kwargs) if kwargs else {},
                              stream.id, grad=grad)

    for slot, meta in plan.restrides:  # before anything is sent: a refusal leaves both sides as they were
        _restride(func, args, kwargs, remote[slot], meta)
    proxies = issue(mesh, build, inputs=remote, outputs=outputs, mutated=[remote[s] for s in plan.mutated],
                    device=device, stream=stream)
    for position, value in values:
        proxies[position] = value
    return proxies[0] if out.single else tree_unflatten(proxies, out.spec)


def _restride(func, args, kwargs, proxy: Tensor, meta: TensorMeta) -> None:
    """An in-place view op changes the proxy's own sizes, strides and offset, as it changes
    the worker's tensor: run the op's meta kernel on the wrapper itself, with no dispatch
    (torch's subclass helpers update wrapper metadata the same way)."""
    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        except RuntimeError as e:  # resize_ growing a CUDA wrapper: torch's kernel asserts a meta tensor
            # the kernel may have changed the (dense) proxy's sizes before it failed: put them back
            old: TensorMeta = proxy._meta  # type: ignore[assignment]
            torch.ops.aten.as_strided_.default(proxy, old.size, old.stride, old.offset)
            raise NotImplementedError(
                f"{func} changes a remote {proxy.device.type} tensor's shape in a way the client's proxy cannot "
                f"follow ({str(e).splitlines()[0]}); nothing was sent.  Make a new tensor instead "
                f"(torch.empty(new_shape), or x.new_empty(new_shape))\n  at {user_line()}") from None
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
    proxy._meta = meta


def _leaf_positions(aliasing, out) -> list[tuple[int | None, bool]]:
    """For each output leaf: (the schema position of the argument it aliases or None,
    whether the op writes it)."""
    returns = aliasing.return_aliases
    n = len(out.leaves)
    if len(returns) == 1 and (returns[0][2] or n == 1):
        source, is_write, _ = returns[0]
        return [(source, is_write)] * n
    if len(returns) == n:
        return [(s, w) for s, w, _ in returns]
    return [(None, False)] * n


def _retypable(e: Exception) -> bool:
    try:
        type(e)("probe")
        return True
    except Exception:  # noqa: BLE001 - any constructor that refuses a message
        return False


def _value_on_client(func, args, kwargs, remote):
    """``t.item()``, ``bool(t)``, ``torch.allclose``: a Python value the client needs now.

    These block: the op runs on every rank of the tensors' mesh and its value comes back, one
    round trip; it is returned where all ranks agree, else a ValueError lists them
    (:mod:`tdmesh.engine.host_reads`).  Prefer ``fetch_shard`` where the wait can be deferred.
    """
    name = func._schema.name
    if name in _STRUCTURE_QUERIES:
        if name == "prim::device":  # asked of sparse proxies only: a wrapper knows its device
            return remote[0]._device
        return func(*_on_meta(args), **_on_meta(kwargs))
    what = f"{read_name(name)} of {describe(remote[0])}"
    return read_on_host(remote[0]._mesh, op_path(func), args, kwargs, what)


def _on_meta(value):
    return tree_map(lambda x: meta_tensor(x._meta) if type(x) is Tensor else x, value)


def ship_local(data: torch.Tensor, mesh, stream=None) -> Tensor:
    """A copy of the local tensor ``data`` on every rank of ``mesh`` (``torch.tensor(python
    data)`` under a mesh, ``tdmesh.to_mesh(local, mesh)``): its bytes travel with the op.

    As torch's copy from pageable memory, the bytes are taken before this returns: a small
    tensor's into the op's pickle, a big one's straight from its memory into the sockets (a
    bulk frame, flushed here), so later writes to ``data`` never reach the mesh and no copy is
    made of it here (a copy of fresh memory cost more than the transfer).  A recorder (a
    compiled function being captured) keeps its messages for later: it gets a copy."""
    with torch._C.DisableTorchFunction():  # local tensors only: not through the mesh's mode (17 calls, ~70 us)
        return _ship_local(data, mesh, stream)


def _ship_local(data: torch.Tensor, mesh, stream) -> Tensor:
    client = mesh.client
    device = client.device
    direct = client.sink is client
    data = data.detach()
    if data.device.type != "cpu" or not direct:
        data = data.to("cpu", copy=True)  # its bytes travel; each worker copies to its device
    order: tuple = ()
    if data.layout is torch.strided:
        order = _dense_order(data)
        data = data.permute(order) if order else data.contiguous()
    meta = tensor_meta(data)
    if order:  # what the worker makes: the bytes as a contiguous tensor, seen in the original order again
        order = tuple(sorted(range(len(order)), key=order.__getitem__))  # the inverse permutation
        meta = tensor_meta(torch.empty(meta.size, dtype=meta.dtype, device="meta").permute(order))
    stream = stream if stream is not None else get_active_stream()
    shipped = (device, order) if order else (device,)

    def build(seq, results, _mutated):
        return m.CallFunction(seq, results, (), SHIPPED_FUNCTION, (pack_tensor(data), *shipped), {},
                              stream.id)

    out = issue(mesh, build, outputs=[New(meta)], device=device, stream=stream)[0]
    if direct and client.outbox.bulk:
        client.flush()
    return out


def _dense_order(t: torch.Tensor) -> tuple:
    """The permutation of ``t``'s dims in which its memory is contiguous, where ``t`` is dense but not
    contiguous (channels-last, a transpose); else ``()``.  Its bytes then travel as they lie and the
    worker's tensor has ``t``'s layout, as ``t.to(device)`` keeps it: a channels-last batch stays
    channels-last, so the worker's kernels take local torch's paths (shipped contiguous, a
    channels-last CNN's gradients came out a rounding apart from local torch's)."""
    if t.is_contiguous() or t.dim() < 2:
        return ()
    strides = t.stride()
    order = tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))
    return order if t.permute(order).is_contiguous() else ()


_COPY = torch.ops.aten.copy_.default


class _MeshMode(TorchDispatchMode):
    """Active while any mesh is: factory calls and ops on remote tensors go to the mesh."""


# torch wraps a mode's __torch_dispatch__ in a dynamo-disable shim (several microseconds per
# op); tdmesh is never traced by dynamo, so the hot path is the plain function.
_MeshMode.__torch_dispatch__ = dispatch  # type: ignore[method-assign]
MESH_MODE = _MeshMode()
use_mode(MESH_MODE)
Tensor.__torch_dispatch__ = classmethod(dispatch)  # type: ignore[assignment,method-assign]
