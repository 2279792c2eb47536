"""Binary operators on proxies (``x * y``, ``2.0 / x``): two shortcuts past torch, installed on ``Tensor``
by :func:`install` (``activation`` does, for the mesh's torch-function mode).

**The mesh's torch-function mode is skipped.**  It passes every operator through unchanged: an operator
is no special function, no factory and has no keywords.  So where it is the innermost torch-function
mode, an operator on a proxy runs with it popped: the call torch would make from inside the mode,
without torch's round trip through it (pop the mode, call its Python, push it back: 2.7 us of the add
loop's ~18 on this VM).  As a ``DeviceContext`` it is at the bottom of the stack: with a mode of the
user's on, that one is the innermost and sees the operator as before; so does any tensor subclass's
own ``__torch_function__``.

**Learnt operators skip torch's dispatcher.**  Where an (operator, operand metadata) pair has a learnt
lean plan, no input requires grad (autograd records nothing), the mesh's dispatch mode is the only
dispatch mode (no user or infra mode), no torch-function mode is left, and autocast, functorch
transforms, forward AD, inference mode and the profiler are all off, torch would do nothing with the
call but parse it and hand it to that mode: the op is issued from its plan at once
(``issue.issue_lean``), 3.5-4 us an op less on this VM.  Otherwise torch dispatches it as always.  The
table is learnt from the dispatcher, under the same conditions (a user's mode could rewrite the op):
an operator call that dispatched exactly one op, issued by its lean plan on ``[self, other]`` or
``[self]``, is that op from then on (``2.0 / x`` is two ops in torch, ``x.reciprocal() * 2.0``: never
learnt).  Both shortcuts are one function, the operator itself: every frame counts on this path.
"""

from __future__ import annotations

import threading

import torch
import torch.autograd.forward_ad as forward_ad

from .issue import issue_lean
from .placement import plainly_placed
from .plan import MAX_PLANS
from .stream import get_active_stream
from .tensor import BINARY_OPERATORS, Tensor, binary_call

__all__ = ["install", "note_dispatched", "note_lean", "learners", "use_mode"]

_OPERATOR_PLANS: dict = {}
_learning = threading.local()
learners = [0]  # operator calls learning now (any thread): dispatch notes its lean ops only then
_mesh_mode: list = [None]
_any_autocast, _functorch_active = torch._C._is_any_autocast_enabled, torch._C._are_functorch_transforms_active
_profiling, _inference = torch._C._autograd._profiler_enabled, torch.is_inference_mode_enabled
_dispatch_modes, _dispatch_mode_at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at
_function_modes, _function_mode_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
_pop_function_mode, _push_function_mode = torch._C._pop_torch_function_stack, torch._C._push_on_torch_function_stack
_NO_KEY = object()


def use_mode(mode) -> None:
    """The mesh's dispatch mode (``dispatch.MESH_MODE``, registered there: it sits above this module)."""
    _mesh_mode[0] = mode


def install(mode_type: type, learnt: bool = True) -> None:
    """``Tensor``'s binary operators skip ``mode_type`` (the mesh's torch-function mode) where it is the
    innermost mode and, with ``learnt``, issue learnt operators from their plans.  ``learnt=False`` is
    for ``bench.dispatch_floor``, whose floor rows must reach torch's dispatcher."""
    for name in BINARY_OPERATORS:
        setattr(Tensor, name, _operator(name, mode_type, learnt))


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


def _operator(name: str, mode_type: type, learnt: bool):
    base = getattr(torch.Tensor, name)

    def operator(self, other):
        depth = _function_modes()
        if not depth or type(mode := _function_mode_at(depth - 1)) is not mode_type:
            return binary_call(base, self, other)
        _pop_function_mode()
        try:
            if depth > 1 or not learnt:  # a mode left below (torch keeps the DeviceContext lowest): torch's way
                return binary_call(base, self, other)
            t = type(other)  # the operand as dispatch's plan keys hold it (dispatch._scan)
            part = other._meta if t is Tensor else (t, other) if t is float or t is bool or t is complex else \
                other if t is int else _NO_KEY
            # torch would only parse the call and hand it to the mesh's dispatch mode (the mesh's
            # torch-function mode popped, none left): inline, as every frame counts here
            if part is _NO_KEY or self.requires_grad or (t is Tensor and other.requires_grad) or \
                    _dispatch_modes() != 1 or _dispatch_mode_at(0) is not _mesh_mode[0] or _any_autocast() or \
                    _functorch_active() or forward_ad._current_level >= 0 or _inference() or _profiling():
                return binary_call(base, self, other)  # torch, nothing learnt
            key = (name, self._meta, part)
            plan = _OPERATOR_PLANS.get(key)
            if plan is not None:
                mesh = self._mesh
                client = mesh.client
                if client is not None:
                    remote = [self, other] if t is Tensor else [self]
                    device = self._device
                    stream = get_active_stream()
                    if (plan.device_type is client.device_type or plan.device_type == device.type) and \
                            plainly_placed(remote, mesh, stream):
                        return issue_lean(mesh, plan, remote, device, stream)
            return _learn(key, base, self, other, t)
        finally:
            _push_function_mode(mode)

    operator.__name__ = name
    return operator


def _learn(key: tuple, base, self, other, other_type):
    """``base(self, other)`` through torch's dispatcher, learnt where it dispatched one op by its lean plan."""
    learners[0] += 1
    seen: list = []
    _learning.seen = seen
    try:
        out = binary_call(base, self, other)
    finally:
        learners[0] -= 1
        _learning.seen = None
    if len(seen) == 1 and seen[0] is not None:  # one op, issued by its lean plan (a dunder may make several)
        plan, remote = seen[0]
        tensor_other = other_type is Tensor
        if len(remote) == (2 if tensor_other else 1) and remote[0] is self and \
                remote[-1] is (other if tensor_other else self) and len(_OPERATOR_PLANS) < MAX_PLANS:
            _OPERATOR_PLANS[key] = plan
    return out
