"""``mesh.activate()`` and ``tdmesh.no_mesh``: making a mesh the one ops run on.

Activation takes effect on call (before any ``with``) and restores the previous mesh when
its context exits, so activations nest; ``mesh.deactivate()`` ends one begun without
``with`` (the innermost, which must be that mesh's).  While any mesh is active the client runs the
dispatch mode that turns torch ops into remote ops, and the mesh's :class:`MeshFunctions`
(factories describe tensors of the mesh's device type; local data given to
``torch.tensor`` ships); ``no_mesh`` inside a CUDA mesh gives local factories back the
client's own default device (the client never creates a CUDA context by itself).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext, _device_constructors
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from .. import errors
from ..errors import UsageError, backward_sites, call_site, note_engine_code, user_line, warn_at_user_line
from . import saved
from .autograd_context import note_context
from .backward import backward, mirror_requires_grad
from .composites import SPECIAL as COMPOSITES
from .composites import configure as configure_composites
from .context import active_mesh, active_mesh_or_none, backward_calls
from .dispatch import MESH_MODE, ship_local
from .operators import install as install_operators
from .optimizers import set_aside_for_torchs_optimizers
from .packed_sequences import SPECIAL as PACKED_SEQUENCE_CALLS
from .propagation import keep_dynamo_out
from .rank_index import SPECIAL as RANK_INDEXING
from .stream import get_active_stream
from .tensor import Tensor
from .unshaped import host_values

__all__ = ["Activation", "MeshFunctions", "no_mesh", "deactivate", "plain_torch", "AT_FIRST_ACTIVATION"]

# The client's own default device, as it was before a CUDA mesh made factories default to
# "cuda": under no_mesh, local tensors go back there.
_client_device: contextvars.ContextVar = contextvars.ContextVar("tdmesh_client_device", default=None)
# The innermost activation still in effect, for mesh.deactivate() (activate() used without ``with``).
_innermost: contextvars.ContextVar = contextvars.ContextVar("tdmesh_innermost_activation", default=None)
_mode_lock = threading.Lock()


class Activation:
    """Returned by ``activate()``: already in effect; exiting restores the previous mesh."""

    def __init__(self, mesh) -> None:
        self._mesh = mesh
        self._token = active_mesh.set(mesh)
        self._innermost_token = _innermost.set(self)
        self._device_token = None
        self._device_ctx: DeviceContext | None = None
        if mesh is not None:
            if mesh.device_type == "cuda" and _client_device.get() is None:
                self._device_token = _client_device.set(default_device())
            self._device_ctx = MeshFunctions(mesh.device_type)
        elif _client_device.get() is not None:  # no_mesh inside a CUDA mesh
            self._device_ctx = _ClientDevice(_client_device.get())
        if self._device_ctx is not None:
            self._device_ctx.__enter__()
        _patch_once()
        configure_composites()
        # the dispatch mode is on this thread's stack while a mesh activation of this thread is in effect: pushed
        # by the first (on this thread: the stack is per thread), or by a mesh activated inside no_mesh; no_mesh
        # sets it and tdmesh's saved-tensor hooks aside (local ops run as plain torch; a mesh tensor's ops still
        # reach it through the tensor)
        self._aside = _set_aside() if mesh is None else (False, False)
        self._own_mode = mesh is not None and MESH_MODE not in _get_current_dispatch_mode_stack()
        if self._own_mode:
            _push_mode(MESH_MODE)
        self._hooks = mesh is not None and saved.push_hooks()  # what the client's graphs save (engine/saved.py)
        self._active = True
        note_context()

    def __enter__(self):
        return self._mesh

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def deactivate(self) -> None:
        if not self._active:
            return
        self._active = False
        if self._hooks:
            saved.pop_hooks()
        if self._own_mode:
            _pop_mode()
        mode_aside, hooks_aside = self._aside
        if hooks_aside:
            saved.bring_back()
        if mode_aside:
            _push_mode(MESH_MODE)
        if self._device_ctx is not None:
            self._device_ctx.__exit__(None, None, None)
        if self._device_token is not None:
            _client_device.reset(self._device_token)
        active_mesh.reset(self._token)
        _innermost.reset(self._innermost_token)
        note_context()


def deactivate(mesh) -> None:
    """End the innermost activation, which must be ``mesh``'s: the mesh active before it is
    active again.  Activations nest, so ending an outer one first would leave the inner
    one's mesh active under the outer's name; that is refused."""
    current = _innermost.get()
    if current is None or current._mesh is not mesh:
        active = "no mesh is active" if current is None else f"the active mesh is {current._mesh!r}"
        raise UsageError(f"{mesh!r} is not the active mesh ({active}): deactivate() ends the innermost "
                         f"activation, begun by that mesh's activate()\n  at {user_line()}")
    current.deactivate()


class MeshFunctions(DeviceContext):
    """The torch-function half of an active mesh (its dispatch half is ``MESH_MODE``).

    As a DeviceContext it makes factories default to the mesh's device type.  It also sees
    the calls that never reach the dispatcher in a form tdmesh can act on:
    ``torch.tensor``/``as_tensor``/``asarray`` of a local tensor ship it to the mesh
    (``as_tensor`` of a tensor that needs no conversion dispatches nothing at all), and
    ``tensor_split`` by a remote tensor of indices reads them first (torch's kernel reads
    the indices' memory directly).  On CUDA meshes it replaces the DeviceContext the mesh
    needs anyway, so ops pay no extra Python call; on CPU meshes it costs one per torch call.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        special = _SPECIAL.get(func)
        if special is not None:
            out = special(func, args, kwargs)
            if out is not NotImplemented:
                return out
        if func in _device_constructors() and kwargs.get("device") is None:
            kwargs["device"] = self.device
        if kwargs.get("requires_grad"):  # a factory's leaf: made, then requires_grad_ (mirrored on the workers)
            kwargs = {k: v for k, v in kwargs.items() if k != "requires_grad"}
            out = func(*args, **kwargs)
            return out.requires_grad_() if isinstance(out, torch.Tensor) else out  # a local one under no_mesh too
        return func(*args, **kwargs)


def _ship(func, args, kwargs):
    """``torch.tensor(local)`` under a mesh: a copy of ``local`` on every rank of the mesh."""
    data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
    mesh = active_mesh_or_none()
    if type(data) is Tensor and func is torch.tensor:  # a copy on its own mesh, as torch copies a tensor
        warn_at_user_line(_COPY_CONSTRUCT)  # torch's own warning, at the user's line (it named this file)
        out = data.detach().clone() if kwargs.get("dtype") is None else data.detach().to(kwargs["dtype"], copy=True)
        return out.requires_grad_() if kwargs.get("requires_grad") else out
    if mesh is None or not isinstance(data, torch.Tensor) or type(data) is Tensor:
        return NotImplemented  # Python data lifts through the dispatcher; as_tensor of remote data is itself
    dtype = kwargs.get("dtype")
    local = data.detach()
    if dtype is not None:
        local = local.to(dtype)
    out = ship_local(local, mesh)
    if kwargs.get("requires_grad"):
        out.requires_grad_()
    return out


_COPY_CONSTRUCT = ("To copy construct from a tensor, it is recommended to use sourceTensor.detach().clone() or "
                   "sourceTensor.detach().clone().requires_grad_(True), rather than torch.tensor(sourceTensor).")


def _split_by_remote_indices(func, args, kwargs):
    for key in ("tensor_indices_or_sections", "indices_or_sections"):
        if type(kwargs.get(key)) is Tensor:
            values = host_values(kwargs[key], "tensor_split")
            rest = {k: v for k, v in kwargs.items() if k != key}
            return func(*args, **rest, **{"indices" if isinstance(values, list) else "sections": values})
    if len(args) > 1 and type(args[1]) is Tensor:
        return func(args[0], host_values(args[1], "tensor_split"), *args[2:], **kwargs)
    return NotImplemented


def _with_backward_site(func, args, kwargs):
    """A backward call: its ops (run by autograd's engine, on this thread or its device thread)
    have this call's site (see ``tdmesh.errors.backward_sites``), and its mesh and stream
    (``tdmesh.engine.context.backward_calls``)."""
    entry = (threading.get_ident(), call_site())
    backward_sites.append(entry)
    caller = (active_mesh_or_none(), get_active_stream())
    backward_calls.append(caller)
    try:
        return func(*args, **kwargs)
    finally:
        for entries, mine in ((backward_sites, entry), (backward_calls, caller)):
            for i in range(len(entries) - 1, -1, -1):
                if entries[i] is mine:
                    del entries[i]
                    break


def _set_data(func, args, kwargs):
    """``p.data = new`` (``module.to(dtype)``, ``.half()``: torch's default for parameters): the proxy
    takes ``new``'s worker value, not only its metadata (before, ``p`` went on naming its old value
    on the workers); a leaf that requires grad is made to require it there again."""
    proxy, new = args
    if type(proxy) is not Tensor or type(new) is not Tensor:
        return NotImplemented
    with torch._C.DisableTorchFunction():
        func(proxy, new)
        leaf_requires_grad = proxy.requires_grad and proxy.grad_fn is None
    proxy._r, proxy._meta, proxy._mesh, proxy._stream, proxy._device = new._r, new._meta, new._mesh, new._stream, \
        new._device
    proxy._wgrad = False
    if leaf_requires_grad:
        mirror_requires_grad(proxy, True)
    return None


def _backward(func, args, kwargs):
    """A backward call: one message where the workers can run it (``tdmesh.engine.backward``)."""
    return backward(_with_backward_site, func, args, kwargs)


install_operators(MeshFunctions)
_SPECIAL = {torch.tensor: _ship, torch.as_tensor: _ship, torch.asarray: _ship,
            torch.tensor_split: _split_by_remote_indices, torch.Tensor.tensor_split: _split_by_remote_indices,
            torch.Tensor.backward: _backward, torch.autograd.backward: _backward,
            torch.autograd.grad: _backward, vars(torch._C.TensorBase)["data"].__set__: _set_data}
_SPECIAL.update(PACKED_SEQUENCE_CALLS)
_SPECIAL.update(COMPOSITES)
_SPECIAL.update(RANK_INDEXING)
_engine = getattr(torch.autograd.graph, "_engine_run_backward", None)
if _engine is not None:  # torch's one Python function that runs the engine (2.11 and 2.13 have it)
    note_engine_code(_engine.__code__)
errors.in_backward = lambda: torch._C._current_graph_task_id() != -1


def default_device() -> torch.device:
    """The device factories use now, as ``torch.get_default_device()`` finds it, but never
    resolving an index-less "cuda" (that would initialise CUDA in the client)."""
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode.device
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return context.device if context is not None else torch.device("cpu")


def _patch_once() -> None:
    """At the first activation: ``torch.load`` returns local tensors, torch's optimizers skip the function mode."""
    global _torch_load
    if _torch_load is not None:  # done (every later activation passes here without the lock)
        return
    with _mode_lock:
        if _torch_load is None and torch.load is not _load_locally:
            _torch_load, torch.load = torch.load, _load_locally
            set_aside_for_torchs_optimizers(MeshFunctions)
            keep_dynamo_out()  # local_mesh did at its start; a mesh got another way (attach) does here
            for install in AT_FIRST_ACTIVATION:  # what the layers above adapt of torch's ecosystem (tdmesh.interop)
                install()


def _set_aside() -> tuple[bool, bool]:
    """``no_mesh``: tdmesh's dispatch mode and saved-tensor hooks off this thread's stacks where they are
    on top (a mode or hooks of the user's above them stay, and so do they): local code under no_mesh ran
    2.5x slower than plain torch, every op through the mode's Python and every saved tensor through a box."""
    mode_aside = _get_current_dispatch_mode() is MESH_MODE
    if mode_aside:
        _pop_mode()
    return mode_aside, saved.set_aside()


class plain_torch:
    """Torch as if no mesh had ever been activated on this thread, for code around the model that must run at
    plain torch's speed and never touch a mesh: a DataLoader's iteration (``tdmesh.interop.data``).  Unlike
    ``no_mesh``, which keeps the mesh's torch-function mode below its own on CPU meshes (a Python call per torch
    call), it takes every one of tdmesh's modes off this thread's stacks, its saved-tensor hooks and the active
    mesh, and puts them back in place after; modes of the user's stay as they were.  Processes forked meanwhile
    (a DataLoader's workers) start with none of them."""

    __slots__ = ("_functions", "_dispatch", "_hooks", "_token")

    def __enter__(self):
        self._functions = _strip(_FUNCTION_MODES, lambda mode: isinstance(mode, (MeshFunctions, _ClientDevice)))
        self._dispatch = _strip(_DISPATCH_MODES, lambda mode: mode is MESH_MODE)
        self._hooks = saved.set_aside()
        self._token = active_mesh.set(None)
        return self

    def __exit__(self, *exc) -> None:
        active_mesh.reset(self._token)
        if self._hooks:
            saved.bring_back()
        _put_back(_DISPATCH_MODES, self._dispatch)
        _put_back(_FUNCTION_MODES, self._functions)


# (the stack as a list, pop its top, push on it): torch's torch-function and dispatch mode stacks of this thread
_FUNCTION_MODES = (_get_current_function_mode_stack, torch._C._pop_torch_function_stack,
                   torch._C._push_on_torch_function_stack)
_DISPATCH_MODES = (_get_current_dispatch_mode_stack, _pop_mode, _push_mode)


def _strip(modes, ours) -> list | None:
    """Take the modes ``ours`` picks off a mode stack, the others back in order; the stack as it was (to put
    back), or None where none of them was ours."""
    stack, pop, push = modes[0](), modes[1], modes[2]
    if not any(ours(mode) for mode in stack):
        return None
    for _ in stack:
        pop()
    for mode in stack:
        if not ours(mode):
            push(mode)
    return stack


def _put_back(modes, stack: list | None) -> None:
    if stack is not None:
        for _ in modes[0]():
            modes[1]()
        for mode in stack:
            modes[2](mode)


class _ClientDevice(DeviceContext):
    """``no_mesh`` inside a CUDA mesh: local factories get the client's own device back."""


class _NoMesh:
    """``no_mesh.activate()``: torch ops on local tensors run locally again."""

    device_type = "cpu"

    def activate(self) -> Activation:
        return Activation(None)

    def __repr__(self) -> str:
        return "tdmesh.no_mesh"


no_mesh = _NoMesh()
_torch_load: Callable | None = None  # torch's own, once the first activation wrapped it
AT_FIRST_ACTIVATION: list[Callable[[], None]] = []  # run once, by the first activation of the process


def _load_locally(*args, **kwargs):
    """``torch.load`` under an active mesh returns what it returns without one: local tensors
    (pretrained weights, which ``load_state_dict`` then ships to the mesh), ``map_location``
    honoured.  Without this wrapper (installed by the first activation) the file's storages
    would meet the mesh's factories, which describe mesh tensors, and torch.load fails."""
    assert _torch_load is not None
    if active_mesh_or_none() is None:
        return _torch_load(*args, **kwargs)
    with no_mesh.activate():
        return _torch_load(*args, **kwargs)
