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
from collections.abc import Callable
from functools import partial

import torch

from .engine.tensor import Tensor
from .errors import UsageError

__all__ = ["StepState"]


class StepState:
    """Walks ``state`` once, at the step's start: ``refs`` are its mesh tensors' refs (each once), ``held``
    keeps their proxies alive (a ref freed in the step must still exist to be put back)."""

    def __init__(self, state, mesh) -> None:
        self.mesh = mesh
        self.refs: list[int] = []
        self.paths: list[str] = []  # where each of refs is in the state, for messages
        self.held: list[Tensor] = []
        self._seen: set[int] = set()
        self._storages: dict[int, int] = {}  # id(AliasSet) -> the first ref seen of it
        self._undo: list[Callable[[], object]] = []
        self._seen_params: set[int] = set()
        rng = torch.get_rng_state()
        self._undo.append(partial(torch.set_rng_state, rng))
        self._walk(state, "state")

    def restore(self) -> None:
        """Every structure back as it was (the workers' tensors are put back by ``worker/healing.restore``)."""
        with torch.no_grad():
            for undo in self._undo:
                undo()

    # -- the walk ----------------------------------------------------------------------------------------
    def _walk(self, obj, path: str) -> None:
        if isinstance(obj, Tensor):
            self._mesh_tensor(obj, path)
        elif isinstance(obj, torch.Tensor):
            kept = obj.detach().clone()
            self._undo.append(partial(_copy_back, obj, kept))
        elif isinstance(obj, torch.nn.Module):
            self._module(obj, path)
        elif isinstance(obj, torch.optim.Optimizer):
            self._optimizer(obj, path)
        elif isinstance(obj, dict):
            items = dict(obj)
            self._undo.append(partial(_refill, obj, items))
            for key, value in items.items():
                self._walk(value, f"{path}[{key!r}]")
        elif isinstance(obj, list):
            saved = list(obj)
            self._undo.append(partial(obj.__setitem__, slice(None), saved))
            for i, value in enumerate(saved):
                self._walk(value, f"{path}[{i}]")
        elif isinstance(obj, tuple):
            for i, value in enumerate(obj):
                self._walk(value, f"{path}[{i}]")
        elif obj is None or isinstance(obj, (int, float, bool, str, bytes, torch.dtype, torch.device)):
            pass
        elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            saved = obj.state_dict()
            if any(isinstance(t, Tensor) for t in torch.utils._pytree.tree_leaves(saved)):
                raise UsageError(f"FaultTolerance's {path} ({type(obj).__name__}) has mesh tensors in its state_dict: "
                                 f"pass the tensors, modules or optimizers themselves in the state")
            saved = copy.deepcopy(saved)
            self._undo.append(partial(_load, obj, saved))
        else:
            raise UsageError(f"FaultTolerance cannot keep {path}, a {type(obj).__name__}: the state holds mesh "
                             f"tensors, modules, optimizers, dicts, lists, tuples, plain values, and objects with "
                             f"state_dict() and load_state_dict() (an LR scheduler)")

    def _mesh_tensor(self, t: Tensor, path: str) -> None:
        if t.mesh.fleet is not self.mesh.fleet:
            raise UsageError(f"FaultTolerance's {path} lives on another fleet's mesh ({t.mesh!r}), not {self.mesh!r}")
        if t.stream.id != 0:
            raise UsageError(f"FaultTolerance's {path} lives on stream {t.stream.name!r}: a healed step's state "
                             f"lives on the default stream")
        ref = t.ref
        if ref in self._seen:
            return
        aliases = id(t.aliases)
        first = self._storages.setdefault(aliases, ref)
        if first != ref:
            raise UsageError(f"FaultTolerance's {path} (ref {ref}) shares its storage with ref {first} of the state "
                             f"(a view of it): a heal copies each tensor alone; keep only the base in the state")
        self._seen.add(ref)
        self.refs.append(ref)
        self.paths.append(path)
        self.held.append(t)

    def _module(self, module: torch.nn.Module, path: str) -> None:
        for name, sub in module.named_modules(remove_duplicate=True):
            params, buffers, training = dict(sub._parameters), dict(sub._buffers), sub.training

            def undo(sub=sub, params=params, buffers=buffers, training=training) -> None:
                sub._parameters.clear()
                sub._parameters.update(params)
                sub._buffers.clear()
                sub._buffers.update(buffers)
                sub.training = training
            self._undo.append(undo)
            where = f"{path}.{name}" if name else path
            for key, p in params.items():
                if p is not None:
                    self._parameter(p, f"{where}.{key}")
            for key, b in buffers.items():
                if b is not None:
                    self._walk(b, f"{where}.{key}")

    def _parameter(self, p: torch.Tensor, path: str) -> None:
        if id(p) in self._seen_params:
            return
        self._seen_params.add(id(p))
        self._walk(p, path)
        grad = p.grad
        self._undo.append(partial(setattr, p, "grad", grad))
        if grad is not None:
            self._walk(grad, f"{path}.grad")

    def _optimizer(self, opt: torch.optim.Optimizer, path: str) -> None:
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
                self._parameter(p, f"{path}.param_groups[{i}]")
        for i, s in enumerate(state.values()):
            for key, value in s.items():
                self._walk(value, f"{path}.state[{i}][{key!r}]")


def _copy_back(t: torch.Tensor, kept: torch.Tensor) -> None:
    t.copy_(kept)


def _refill(d: dict, items: dict) -> None:
    d.clear()
    d.update(items)


def _load(obj, saved) -> None:
    obj.load_state_dict(copy.deepcopy(saved))
