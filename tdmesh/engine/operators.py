"""Operators on proxies issued from their plans without torch's dispatcher, where nothing but tdmesh
would see the call.

``x * y`` on proxies reaches :func:`operator_call` from ``tensor._binary`` with the mesh's
torch-function mode already set aside.  Where its (operator, operand metadata) pair has a learnt lean
plan, no input requires grad (autograd records nothing), the mesh's dispatch mode is the only dispatch
mode (no user or infra mode), no torch-function mode is left, and autocast, functorch transforms,
forward AD, inference mode and the profiler are all off, torch would do nothing with the call but
parse it and hand it to that mode: the op is issued from its plan at once (``issue.issue_lean``),
3.5-4 us an op less on this VM.  Otherwise torch dispatches it as always.  The table is learnt from
the dispatcher, under the same conditions (a user's mode could rewrite the op): an operator call that
dispatched exactly one op, issued by its lean plan on ``[self, other]`` or ``[self]``, is that op from
then on (``2.0 / x`` is two ops in torch, ``x.reciprocal() * 2.0``: never learnt).
"""

from __future__ import annotations

import threading

import torch
import torch.autograd.forward_ad as forward_ad

from .issue import issue_lean
from .placement import plainly_placed
from .plan import MAX_PLANS
from .stream import get_active_stream
from .tensor import Tensor

__all__ = ["operator_call", "note_dispatched", "note_lean", "learners", "use_mode"]

_OPERATOR_PLANS: dict = {}
_learning = threading.local()
learners = [0]  # operator calls learning now (any thread): dispatch notes its lean ops only then
_mesh_mode: list = [None]
_any_autocast, _functorch_active = torch._C._is_any_autocast_enabled, torch._C._are_functorch_transforms_active
_profiling, _inference = torch._C._autograd._profiler_enabled, torch.is_inference_mode_enabled
_dispatch_modes, _dispatch_mode_at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at
_function_modes = torch._C._len_torch_function_stack
_NO_KEY = object()


def use_mode(mode) -> None:
    """The mesh's dispatch mode (``dispatch.MESH_MODE``, registered there: it sits above this module)."""
    _mesh_mode[0] = mode


def note_dispatched() -> None:
    """From dispatch, for every op it is handed while an operator call learns."""
    seen = getattr(_learning, "seen", None)
    if seen is not None:
        seen.append(None)


def note_lean(plan, remote: list) -> None:
    """From dispatch's lean path while an operator call learns: the plan the op just counted went by."""
    seen = getattr(_learning, "seen", None)
    if seen:
        seen[-1] = (plan, remote)


def _operand_key(other):
    """``other`` as dispatch's plan keys hold it (``dispatch._scan``), or ``_NO_KEY``."""
    t = type(other)
    if t is Tensor:
        return other._meta
    if t is float or t is bool or t is complex:  # as _scan keys them
        return (t, other)
    return other if t is int else _NO_KEY


def _nothing_else_would_see_it(self, other) -> bool:
    """Whether torch would only parse this operator call and hand it to the mesh's dispatch mode."""
    return not self.requires_grad and (type(other) is not Tensor or not other.requires_grad) and \
        _dispatch_modes() == 1 and _dispatch_mode_at(0) is _mesh_mode[0] and not _function_modes() and \
        not _any_autocast() and not _functorch_active() and forward_ad._current_level < 0 and not _inference() and \
        not _profiling()


def operator_call(name: str, base, self, other):
    """``self <name> other`` with the mesh's torch-function mode set aside (tensor._binary)."""
    part = _operand_key(other)
    if part is _NO_KEY or not _nothing_else_would_see_it(self, other):  # torch's dispatcher, nothing learnt
        return base(self, other)
    key = (name, self._meta, part)
    plan = _OPERATOR_PLANS.get(key)
    if plan is not None:
        mesh = self._mesh
        client = mesh.client
        if client is not None:
            remote = [self, other] if type(other) is Tensor else [self]
            device = self.device
            stream = get_active_stream()
            if (plan.device_type is client.device_type or plan.device_type == device.type) and \
                    plainly_placed(remote, mesh, stream):
                return issue_lean(mesh, plan, remote, device, stream)
    learners[0] += 1
    seen: list = []
    _learning.seen = seen
    try:
        out = base(self, other)
    finally:
        learners[0] -= 1
        _learning.seen = None
    if len(seen) == 1 and seen[0] is not None:  # one op, issued by its lean plan (a dunder may make several)
        plan, remote = seen[0]
        if len(remote) == (2 if type(other) is Tensor else 1) and remote[0] is self and remote[-1] is (
                other if type(other) is Tensor else self) and len(_OPERATOR_PLANS) < MAX_PLANS:
            _OPERATOR_PLANS[key] = plan
    return out
