"""The client's side of a fault-tolerant step's state: what ``fn`` may change, as it was when the step began.

``tdmesh.FaultTolerance(mesh, state)`` takes a pytree of mesh tensors, modules, optimizers, dicts and lists,
and objects with ``state_dict``/``load_state_dict`` (an LR scheduler).  The workers keep a copy of every mesh
tensor of it (``worker/healing.stash``); this keeps the rest, on the client: which tensors a module and an
optimizer hold (an optimizer's state made in the step is dropped again, a parameter's ``.grad`` set back),
the optimizers' hyperparameters (a scheduler changes them), local tensors' values, dicts' and lists' items,
modules' train/eval flags, and the client's own generator.  A heal puts all of it back before ``fn`` runs
again, so the re-run starts where the first run did.
"""

from __future__ import annotations

import copy
from array import array
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten

from .engine.future import Future
from .engine.tensor import Tensor
from .errors import DeviceException, UsageError

__all__ = ["StepState", "StepRecord", "rebind", "UNSET"]


UNSET = object()  # the result of a step a fault cut short


class StepRecord(NamedTuple):
    """A step issued and not yet confirmed: enough to run it again (the client's state at its start, the
    function and arguments) and what it returned; where it began with a copy of the state, that copy's answer
    (each rank's generators then), which confirms every step before it."""
    number: int
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    saved: StepState
    result: Any
    start: Future | None


def rebind(old, new) -> None:
    """What a step returned, now the values of its run after a heal: each mesh tensor takes the new run's
    ref, each pending or failed future follows the new one."""
    old_leaves, old_spec = tree_flatten(old)
    new_leaves, new_spec = tree_flatten(new)
    if old_spec != new_spec:
        raise DeviceException(f"ft.step's function returned {new_spec} when it ran again after a heal, where it "
                              f"returned {old_spec}: a step must issue the same work each time it runs")
    for a, b in zip(old_leaves, new_leaves):
        if type(a) is Tensor and type(b) is Tensor and a is not b:
            a._r = b._r
        elif isinstance(a, Future) and isinstance(b, Future) and (not a._finished() or a._exception is not None):
            a._follow(b)


class StepState:
    """Walks ``state`` once, at the step's start: ``refs`` are its mesh tensors' refs (each once), ``held``
    keeps their proxies alive (a ref freed in the step must still exist to be put back)."""

    def __init__(self, state, mesh, full: bool = True) -> None:
        self.mesh = mesh
        self.full = full  # False: only what the client alone holds (``restore_client``), a cheaper walk
        self._fleet = mesh.fleet
        self.refs: list[int] = []
        self._paths: list = []  # where each of refs is in the state: a chain formatted only for a message
        self.held: list[Tensor] = []
        self._seen: set[int] = set()
        self._storages: dict[int, int] = {}  # id(AliasSet) -> the first ref seen of it
        self._undo: list[Callable[[], object]] = []
        # what the client alone holds (no mesh tensor): hyperparameters, flags, local tensors, plain values
        self._client_undo: list[Callable[[], object]] = []
        self._seen_params: set[int] = set()
        self._modules: list[tuple] = []  # (module, its parameters, its buffers, its training flag)
        self._grads: list[tuple] = []  # (parameter, its .grad)
        self._both(partial(torch.set_rng_state, torch.get_rng_state()))
        self._walk(state, "state")
        if full:
            self._undo.append(partial(_put_back_modules, self._modules, self._grads))
        self._client_undo.append(partial(_put_back_flags, self._modules))

    @property
    def paths(self) -> list[str]:
        """Where each of ``refs`` is in the state, as the user wrote it (``state['model'].fc.weight``)."""
        return [_text(p) for p in self._paths]

    @property
    def packed_refs(self) -> bytes:
        """``refs`` as one value (int64s): a list of ints is a pytree of as many leaves, and a remote call's
        argument is flattened more than once on the client (0.3 ms for a small GPT's 88 tensors)."""
        return array("q", self.refs).tobytes()

    def restore(self) -> None:
        """Every structure back as it was (the workers' tensors are put back by ``worker/healing.restore``)."""
        with torch.no_grad():
            for undo in self._undo:
                undo()

    def restore_client(self) -> None:
        """Only what the client alone holds, as it was: a heal runs a step again from the one before, whose run
        made this step's mesh tensors anew; what the user changed between the two (an LR scheduler's step, a
        flag, the client's generator) is put back here before this step runs again."""
        with torch.no_grad():
            for undo in self._client_undo:
                undo()

    def _both(self, undo: Callable[[], object]) -> None:
        self._undo.append(undo)
        self._client_undo.append(undo)

    # -- the walk: it runs as every step begins, so a path is a tuple chain until a message needs its text ----
    def _walk(self, obj, path) -> None:
        if type(obj) is Tensor:
            if self.full:
                self._mesh_tensor(obj, path)
        elif isinstance(obj, torch.Tensor):
            self._both(partial(_copy_back, obj, obj.detach().clone()))
        elif isinstance(obj, torch.nn.Module):
            self._module(obj, path)
        elif isinstance(obj, torch.optim.Optimizer):
            self._optimizer(obj, path)
        elif isinstance(obj, dict):
            items = dict(obj)
            self._undo.append(partial(_refill, obj, items))
            self._client_undo.append(partial(obj.update, {k: v for k, v in items.items() if _plain(v)}))
            for key, value in items.items():
                self._walk(value, (path, "[{!r}]", key))
        elif isinstance(obj, list):
            saved = list(obj)
            self._undo.append(partial(obj.__setitem__, slice(None), saved))
            self._client_undo.append(partial(_set_plain, obj, saved))
            for i, value in enumerate(saved):
                self._walk(value, (path, "[{}]", i))
        elif isinstance(obj, tuple):
            for i, value in enumerate(obj):
                self._walk(value, (path, "[{}]", i))
        elif _plain(obj):
            pass
        elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            saved = obj.state_dict()
            if any(isinstance(t, Tensor) for t in torch.utils._pytree.tree_leaves(saved)):
                raise UsageError(f"FaultTolerance's {_text(path)} ({type(obj).__name__}) has mesh tensors in its "
                                 f"state_dict: pass the tensors, modules or optimizers themselves in the state")
            self._both(partial(_load, obj, copy.deepcopy(saved)))
        else:
            raise UsageError(f"FaultTolerance cannot keep {_text(path)}, a {type(obj).__name__}: the state holds "
                             f"mesh tensors, modules, optimizers, dicts, lists, tuples, plain values, and objects "
                             f"with state_dict() and load_state_dict() (an LR scheduler)")

    def _mesh_tensor(self, t: Tensor, path) -> None:
        r = t._r
        ref = r.id
        if ref in self._seen:
            return
        if t._mesh.fleet is not self._fleet:
            raise UsageError(f"FaultTolerance's {_text(path)} lives on another fleet's mesh ({t.mesh!r}), not "
                             f"{self.mesh!r}")
        if t._stream.id != 0:
            raise UsageError(f"FaultTolerance's {_text(path)} lives on stream {t.stream.name!r}: a healed step's "
                             f"state lives on the default stream")
        first = self._storages.setdefault(id(r.aliases), ref)
        if first != ref:
            raise UsageError(f"FaultTolerance's {_text(path)} (ref {ref}) shares its storage with ref {first} of the "
                             f"state (a view of it): a heal copies each tensor alone; keep only the base in the state")
        self._seen.add(ref)
        self.refs.append(ref)
        self._paths.append(path)
        self.held.append(t)

    def _module(self, module: torch.nn.Module, path) -> None:
        if not self.full:
            self._modules.extend((sub, None, None, sub.training) for sub in module.modules())
            return
        for name, sub in module.named_modules(remove_duplicate=True):
            params, buffers = sub._parameters, sub._buffers
            self._modules.append((sub, dict(params), dict(buffers), sub.training))
            where = (path, ".{}", name) if name else path
            for key, p in params.items():
                if p is not None:
                    self._parameter(p, (where, ".{}", key))
            for key, b in buffers.items():
                if b is not None:
                    self._walk(b, (where, ".{}", key))

    def _parameter(self, p: torch.Tensor, path) -> None:
        key = id(p)
        if key in self._seen_params:
            return
        self._seen_params.add(key)
        self._walk(p, path)
        grad = p.grad
        self._grads.append((p, grad))
        if grad is not None:
            self._walk(grad, (path, ".grad", None))

    def _optimizer(self, opt: torch.optim.Optimizer, path) -> None:
        hyper = [{k: v for k, v in g.items() if k != "params" and not isinstance(v, torch.Tensor)}
                 for g in opt.param_groups]
        self._client_undo.append(partial(_set_hyper, opt, hyper))
        if not self.full:
            return
        state = {p: dict(s) for p, s in opt.state.items()}
        groups = [dict(g) for g in opt.param_groups]

        def undo(opt=opt, state=state, groups=groups) -> None:
            opt.state.clear()
            opt.state.update({p: dict(s) for p, s in state.items()})
            for group, saved in zip(opt.param_groups, groups):
                group.clear()
                group.update(saved)
        self._undo.append(undo)
        for i, group in enumerate(groups):
            for p in group["params"]:
                self._parameter(p, (path, ".param_groups[{}]", i))
        for i, s in enumerate(state.values()):
            for key, value in s.items():
                self._walk(value, ((path, ".state[{}]", i), "[{!r}]", key))


def _text(path) -> str:
    """A path chain's text: ``(parent, format, key)`` nested down to the root's name."""
    parts = []
    while isinstance(path, tuple):
        path, fmt, key = path
        parts.append(fmt.format(key))
    return path + "".join(reversed(parts))


def _put_back_modules(modules: list[tuple], grads: list[tuple]) -> None:
    for sub, params, buffers, training in modules:
        sub._parameters.clear()
        sub._parameters.update(params)
        sub._buffers.clear()
        sub._buffers.update(buffers)
        sub.training = training
    for p, grad in grads:
        p.grad = grad


def _put_back_flags(modules: list[tuple]) -> None:
    for sub, _, _, training in modules:
        sub.training = training


_PLAIN = (int, float, bool, str, bytes, torch.dtype, torch.device, type(None))


def _plain(value) -> bool:
    return isinstance(value, _PLAIN)


def _set_plain(items: list, saved: list) -> None:
    for i, value in enumerate(saved):
        if _plain(value) and i < len(items):
            items[i] = value


def _set_hyper(opt: torch.optim.Optimizer, hyper: list[dict]) -> None:
    for group, saved in zip(opt.param_groups, hyper):
        group.update(saved)


def _copy_back(t: torch.Tensor, kept: torch.Tensor) -> None:
    t.copy_(kept)


def _refill(d: dict, items: dict) -> None:
    d.clear()
    d.update(items)


def _load(obj, saved) -> None:
    obj.load_state_dict(copy.deepcopy(saved))
