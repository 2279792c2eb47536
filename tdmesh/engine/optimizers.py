"""torch's own optimizers, and ``zero_grad``, run with the mesh's torch-function mode set aside.

An optimizer's Python reads each parameter's properties about ten times a step (``p.grad``,
``grad.is_sparse``, ``torch.is_complex(p)``...).  While a mesh is active every such read is a round
trip through :class:`tdmesh.engine.activation.MeshFunctions` (torch pops the mode, calls it, pushes
it back: ~2.5 us on a 2-core VM), where a proxy's own reads cost nothing (``Tensor`` disables
``__torch_function__``).  Measured on this VM: ``zero_grad`` and a fused AdamW step of a 29-parameter
GPT took 1.38 ms under the mode and 0.55 ms without it; 3.5 and 1.2 ms for a 77-parameter one.

Nothing those functions do needs the mode: their ops still reach the mesh through the dispatch mode
(which stays), the factories they call without a device (``torch.tensor(0.0)``, a step counter) are
placed on the mesh's device there as under the mode, and they never set ``.data`` or call backward.
So the mode is set aside while they run: only torch's own classes (a user's optimizer or override
keeps it), only when the mode is the innermost (a user's mode above it is left alone), and not for a
step given a ``closure`` (the user's forward and backward run inside it).  The optimizer's step hooks
(``register_step_pre_hook``...) run outside, under the mode, as the user's code they are.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["set_aside_for_torchs_optimizers"]

_MARK = "__tdmesh_functions_mode_aside__"
# torch.optim's classes whose step may take the user's code in: LBFGS always runs its closure
_KEEP_MODE = {"LBFGS", "Optimizer"}


def _aside(fn, functions_mode_type: type, closure_position: int | None):
    """``fn`` run with the innermost torch-function mode popped while it is a ``functions_mode_type``."""
    length, top_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
    pop, push = torch._C._pop_torch_function_stack, torch._C._push_on_torch_function_stack

    @functools.wraps(fn)
    def run(*args, **kwargs):
        depth = length()
        if depth == 0:
            return fn(*args, **kwargs)
        mode = top_at(depth - 1)
        if type(mode) is not functions_mode_type:
            return fn(*args, **kwargs)
        if closure_position is not None and (kwargs.get("closure") is not None or (
                len(args) > closure_position and args[closure_position] is not None)):
            return fn(*args, **kwargs)  # the user's forward and backward run inside: they keep the mode
        pop()
        try:
            return fn(*args, **kwargs)
        finally:
            push(mode)
    setattr(run, _MARK, True)
    return run


def set_aside_for_torchs_optimizers(functions_mode_type: type) -> None:
    """Wrap ``step`` of torch.optim's optimizers, ``Optimizer.zero_grad`` and ``Module.zero_grad``
    (once; at the first activation)."""
    optimizer = torch.optim.Optimizer
    if getattr(optimizer.zero_grad, _MARK, False):
        return
    optimizer.zero_grad = _aside(optimizer.zero_grad, functions_mode_type, None)  # type: ignore[method-assign]
    torch.nn.Module.zero_grad = _aside(torch.nn.Module.zero_grad, functions_mode_type,  # type: ignore[method-assign]
                                       None)
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, optimizer)) or name in _KEEP_MODE:
            continue
        step = cls.__dict__.get("step")
        if step is None or getattr(step, _MARK, False):
            continue
        if getattr(step, "hooked", False):  # torch wrapped it in its profiling hooks: ours goes inside them
            inner = _aside(step.__wrapped__, functions_mode_type, 1)
            cls.step = optimizer.profile_hook_step(inner)  # type: ignore[method-assign,assignment]
            cls.step.hooked = True  # type: ignore[attr-defined]
        else:  # torch wraps it at the class's first optimizer, around ours
            cls.step = _aside(step, functions_mode_type, 1)  # type: ignore[method-assign]
