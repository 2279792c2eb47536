"""Hugging Face weights in and out of a mesh.

- ``from_pretrained`` under an active mesh returns the model on the mesh: transformers loads it as it does
  without a mesh (in ``plain_torch``: its own file reading, dtype and key handling, tied weights), then each
  parameter and buffer is put on the mesh once (a tied pair stays one tensor).  Before, the model came back
  with local parameters, and its first forward failed inside transformers with ``LOCAL_TENSOR``.
- ``save_pretrained`` of a model on a mesh writes the files of one replica, after checking that every rank
  holds the same values (a CRC of each tensor on every rank): a model whose ranks differ is refused before
  anything is written, naming ``tdmesh.checkpoint.save``.  Before, safetensors failed on the mesh tensors'
  storage after the config was written: a directory of a model without weights.  safetensors' own
  ``save_file`` of mesh tensors is refused before it writes (``Tensor.untyped_storage``), naming the ways.
- ``transformers.Trainer`` drives a model in its own process (its device placement, DataLoader, accelerate):
  given a model on a mesh it is refused at ``Trainer(...)``, naming the way: a training loop of one's own.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..engine.activation import plain_torch
from ..engine.context import active_mesh_or_none
from ..engine.fetch import fetch_shard
from ..engine.tensor import Tensor
from ..errors import UsageError, user_line
from ..remote import remote
from .imports import when_imported

__all__ = ["install", "replica_values", "onto_mesh"]

_digests = remote("tdmesh.worker.builtins.digests", propagate="inspect")


def replica_values(named: dict, what: str) -> dict:
    """``named``'s mesh tensors as the local tensors of one replica (the first rank's), once every rank is seen
    to hold the same bytes; a tensor that appears under two names (tied) is one local tensor under both."""
    unique: dict[tuple, Tensor] = {}  # one per worker value: a state_dict's tied entries are two detached proxies
    for value in named.values():
        if type(value) is Tensor:
            unique.setdefault(_same_memory(value), value)
    if not unique:
        return named
    keys, proxies = list(unique), list(unique.values())
    mesh = proxies[0].mesh
    if any(t.mesh is not mesh for t in proxies):
        raise UsageError(f"{what} of tensors on several meshes: put them on one (t.to_mesh(mesh))\n  at {user_line()}")
    ranks = [(point, values) for point, values in _digests.call([t.detach() for t in proxies]).result()]
    first_point, first = ranks[0]
    for point, values in ranks[1:]:
        if values != first:
            i = next(i for i, (a, b) in enumerate(zip(values, first)) if a != b)
            name = next(k for k, v in named.items() if type(v) is Tensor and _same_memory(v) == keys[i])
            raise UsageError(f"{what} writes one model, and the ranks of {mesh!r} hold different values of {name!r} "
                             f"({first_point} and {point}): nothing was written. Save per-rank state with "
                             f"tdmesh.checkpoint.save, or make the replicas agree (tdmesh.reduce_(..., 'avg'))"
                             f"\n  at {user_line()}")
    local = dict(zip(unique, fetch_shard([t.detach() for t in proxies]).result()))
    return {k: local[_same_memory(v)] if type(v) is Tensor else v for k, v in named.items()}


def _same_memory(t: Tensor) -> tuple:
    """Proxies of one worker tensor seen the same way (``p.detach()`` of a tied weight, under two names) agree."""
    return id(t.aliases), t.meta


def onto_mesh(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Put a local module's parameters and buffers on ``mesh`` in place, each tensor once (tied weights stay
    tied: one Parameter object under both names)."""
    from ..collectives import to_mesh
    moved: dict[int, Any] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, value in table.items():
                if value is None or type(value) is Tensor:
                    continue
                if id(value) not in moved:
                    on_mesh = to_mesh(value.detach(), mesh)
                    if isinstance(value, torch.nn.Parameter):
                        on_mesh = torch.nn.Parameter(on_mesh, requires_grad=value.requires_grad)
                    moved[id(value)] = on_mesh
                table[name] = moved[id(value)]
    return model


def _from_pretrained(original):
    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        mesh = active_mesh_or_none()
        if mesh is None or mesh.client is None:
            return original(cls, *args, **kwargs)
        with plain_torch():
            model = original(cls, *args, **kwargs)
        return onto_mesh(model, mesh)

    from_pretrained.__tdmesh__ = True
    return from_pretrained


def _save_pretrained(original):
    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, state_dict=None, **kwargs):
        named = self.state_dict() if state_dict is None else state_dict
        if not any(type(v) is Tensor for v in named.values()):
            return original(self, save_directory, *args, state_dict=state_dict, **kwargs)
        local = replica_values(named, "save_pretrained")
        with plain_torch():
            return original(self, save_directory, *args, state_dict=local, **kwargs)

    save_pretrained.__tdmesh__ = True
    return save_pretrained


def _trainer_init(original):
    @functools.wraps(original)
    def __init__(self, model=None, *args, **kwargs):
        if model is not None and any(type(p) is Tensor for p in model.parameters()):
            raise UsageError("transformers.Trainer drives a model in its own process (its device placement, its "
                             "DataLoader, accelerate), and this model's parameters live on a tdmesh mesh: write the "
                             "loop (for batch in loader: loss = model(**tdmesh.to_mesh(batch, mesh)).loss; "
                             "loss.backward(); optimizer.step(); optimizer.zero_grad()), or give Trainer a local "
                             f"model (docs/coverage.md, the ecosystem around the loop)\n  at {user_line()}")
        return original(self, model, *args, **kwargs)

    __init__.__tdmesh__ = True
    return __init__


def _patch_transformers(modeling_utils) -> None:
    model = modeling_utils.PreTrainedModel
    if hasattr(model.save_pretrained, "__tdmesh__"):
        return
    model.from_pretrained = classmethod(_from_pretrained(model.from_pretrained.__func__))
    model.save_pretrained = _save_pretrained(model.save_pretrained)


def _patch_trainer(trainer) -> None:
    if not hasattr(trainer.Trainer.__init__, "__tdmesh__"):
        trainer.Trainer.__init__ = _trainer_init(trainer.Trainer.__init__)


def install() -> None:
    when_imported("transformers.modeling_utils", _patch_transformers)
    when_imported("transformers.trainer", _patch_trainer)
