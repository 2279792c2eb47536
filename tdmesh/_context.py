"""The active mesh and stream: the only mutable global state of the client.

``mesh.activate()`` takes effect on call (before any ``with``) and restores the previous
mesh when its context exits, so activations nest.  While any mesh is active the client
runs a dispatch mode that turns torch ops into remote ops.
"""

from __future__ import annotations

import contextvars
import threading

_active_mesh: contextvars.ContextVar = contextvars.ContextVar("tdmesh_active_mesh", default=None)
# The client's own default device, as it was before a CUDA mesh made factories default to
# "cuda": under no_mesh, local tensors go back there (the client never makes a CUDA context).
_client_device: contextvars.ContextVar = contextvars.ContextVar("tdmesh_client_device", default=None)
_mode_lock = threading.Lock()
_mode_depth = 0


def get_active_mesh():
    """The mesh that ops without remote tensor arguments run on."""
    mesh = _active_mesh.get()
    if mesh is None:
        raise ValueError("no device mesh is active; use `with mesh.activate():`")
    return mesh


def active_mesh_or_none():
    return _active_mesh.get()


class Activation:
    """Returned by ``activate()``: already in effect; exiting restores the previous mesh."""

    def __init__(self, mesh) -> None:
        import torch
        self._mesh = mesh
        self._token = _active_mesh.set(mesh)
        self._device_token = None
        self._device_ctx = None
        if mesh is not None and mesh.device_type == "cuda":
            if _client_device.get() is None:
                self._device_token = _client_device.set(_default_device())
            self._device_ctx = torch.device("cuda")
        elif mesh is None and _client_device.get() is not None:  # no_mesh inside a CUDA mesh
            self._device_ctx = _client_device.get()
        if self._device_ctx is not None:
            self._device_ctx.__enter__()
        _push_mode()
        self._active = True

    def __enter__(self):
        return self._mesh

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def deactivate(self) -> None:
        if not self._active:
            return
        self._active = False
        _pop_mode()
        if self._device_ctx is not None:
            self._device_ctx.__exit__(None, None, None)
        if self._device_token is not None:
            _client_device.reset(self._device_token)
        _active_mesh.reset(self._token)


def _default_device():
    """The device factories use now, as ``torch.get_default_device()`` finds it, but never
    resolving an index-less "cuda" (that would create a CUDA context in the client)."""
    import torch
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode.device
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return context.device if context is not None else torch.device("cpu")


def _push_mode() -> None:
    global _mode_depth
    from .tensor import MESH_MODE
    from torch.utils._python_dispatch import _push_mode as push
    with _mode_lock:
        if _mode_depth == 0:
            push(MESH_MODE)
        _mode_depth += 1


def _pop_mode() -> None:
    global _mode_depth
    from torch.utils._python_dispatch import _pop_mode as pop
    with _mode_lock:
        _mode_depth -= 1
        if _mode_depth == 0:
            pop()


class _NoMesh:
    """``no_mesh.activate()``: torch ops on local tensors run locally again."""

    device_type = "cpu"

    def activate(self) -> Activation:
        return Activation(None)

    def __repr__(self) -> str:
        return "tdmesh.no_mesh"


no_mesh = _NoMesh()
