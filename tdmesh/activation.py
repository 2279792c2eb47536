"""``mesh.activate()`` and ``tdmesh.no_mesh``: making a mesh the one ops run on.

Activation takes effect on call (before any ``with``) and restores the previous mesh when
its context exits, so activations nest.  While any mesh is active the client runs the
dispatch mode that turns torch ops into remote ops; a CUDA mesh also makes factories
describe CUDA tensors, and ``no_mesh`` inside it gives local factories back the client's
own default device (the client never creates a CUDA context by itself).
"""

from __future__ import annotations

import contextvars
import threading

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _pop_mode, _push_mode

from ._context import active_mesh
from .dispatch import MESH_MODE

__all__ = ["Activation", "no_mesh"]

# The client's own default device, as it was before a CUDA mesh made factories default to
# "cuda": under no_mesh, local tensors go back there.
_client_device: contextvars.ContextVar = contextvars.ContextVar("tdmesh_client_device", default=None)
_mode_lock = threading.Lock()
_mode_depth = 0


class Activation:
    """Returned by ``activate()``: already in effect; exiting restores the previous mesh."""

    def __init__(self, mesh) -> None:
        self._mesh = mesh
        self._token = active_mesh.set(mesh)
        self._device_token = None
        self._device_ctx = None
        if mesh is not None and mesh.device_type == "cuda":
            if _client_device.get() is None:
                self._device_token = _client_device.set(default_device())
            self._device_ctx = torch.device("cuda")
        elif mesh is None and _client_device.get() is not None:  # no_mesh inside a CUDA mesh
            self._device_ctx = _client_device.get()
        if self._device_ctx is not None:
            self._device_ctx.__enter__()
        _enter_mode()
        self._active = True

    def __enter__(self):
        return self._mesh

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def deactivate(self) -> None:
        if not self._active:
            return
        self._active = False
        _exit_mode()
        if self._device_ctx is not None:
            self._device_ctx.__exit__(None, None, None)
        if self._device_token is not None:
            _client_device.reset(self._device_token)
        active_mesh.reset(self._token)


def default_device() -> torch.device:
    """The device factories use now, as ``torch.get_default_device()`` finds it, but never
    resolving an index-less "cuda" (that would initialise CUDA in the client)."""
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode.device
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return context.device if context is not None else torch.device("cpu")


def _enter_mode() -> None:
    global _mode_depth
    with _mode_lock:
        if _mode_depth == 0:
            _push_mode(MESH_MODE)
        _mode_depth += 1


def _exit_mode() -> None:
    global _mode_depth
    with _mode_lock:
        _mode_depth -= 1
        if _mode_depth == 0:
            _pop_mode()


class _NoMesh:
    """``no_mesh.activate()``: torch ops on local tensors run locally again."""

    device_type = "cpu"

    def activate(self) -> Activation:
        return Activation(None)

    def __repr__(self) -> str:
        return "tdmesh.no_mesh"


no_mesh = _NoMesh()
