"""``tdmesh.checkpoint``: save and restore a whole fleet's training state from the one client.

Shaped like ``torch.distributed.checkpoint`` (DCP), and built on it: ``save(state_dict,
checkpoint_id=...)``, ``load(state_dict, checkpoint_id=...)`` (in place), ``async_save(...)``
returning a :class:`tdmesh.Future`.  ``state_dict`` is any pytree of mesh tensors and plain
values (``{"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}``, or torch's
``get_state_dict(model, opt)``, which also makes a fresh optimizer's state to load into).

Every rank writes and reads its own data through DCP on the workers (see
``tdmesh.worker.checkpoint``): no tensor byte goes through the client.  A tensor equal on
every rank (DDP-style training) is written once and loads onto a mesh of any size, and into
plain torch (``dcp.load`` in a plain process, or ``format_utils.dcp_to_torch_save``); one
that differs along some dims is written per rank and loads onto a mesh with those dims.
``checkpoint_id`` is a directory every worker can reach (a shared filesystem across hosts);
a relative one is taken from the client's working directory.  DCP's ``.metadata`` is written
last: :func:`latest` finds the newest complete checkpoint, and a cut-off one never loads.
"""

from __future__ import annotations

import os
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_flatten_with_path

from .engine.future import Future
from .engine.placement import check_mutation
from .engine.tensor import Tensor
from .errors import UsageError, user_line
from .mesh import DeviceMesh, RemoteProcessGroup
from .remote import Remote

__all__ = ["save", "async_save", "load", "latest", "is_complete"]

COMMIT_FILE = ".metadata"  # DCP's metadata file, which its save writes last
_save = Remote("tdmesh.worker.checkpoint.save")
_load = Remote("tdmesh.worker.checkpoint.load")
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _CheckpointGroup(RemoteProcessGroup):
    """The process group over all of a mesh's dims that its checkpoints coordinate on: gloo
    whatever the device, so DCP's plans and a background write go beside the job's NCCL."""

    def _tdmesh_groups(self, client, stream: int):
        self._check_live()
        client.ensure_groups("checkpoint", stream, self.mesh.shape, self.dims, self.ref)
        return self._tdmesh_wire()


def _group(mesh: DeviceMesh) -> _CheckpointGroup:
    group = _groups.get(mesh)
    if group is None:
        group = _groups[mesh] = _CheckpointGroup(mesh, mesh.names)
    return group


def _prepare(state_dict, what: str, checkpoint_id) -> tuple[DeviceMesh, str]:
    """The mesh of ``state_dict``'s tensors and the checkpoint's absolute path; refuses what
    the workers could not save (local tensors, tensors of two meshes, no tensors at all)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"tdmesh.checkpoint.{what} takes a state dict (a dict of tensors and plain values), got "
                        f"{type(state_dict).__name__}\n  at {user_line()}")
    mesh = None
    for path, leaf in tree_flatten_with_path(state_dict)[0]:
        if isinstance(leaf, torch.Tensor):
            name = "".join(str(p) for p in path)
            if type(leaf) is not Tensor:
                raise TypeError(f"tdmesh.checkpoint.{what}: state_dict{name} is a local tensor; it holds mesh "
                                f"tensors and plain values (move it onto the mesh with torch.asarray under "
                                f"mesh.activate(), or torch.save it)\n  at {user_line()}")
            if mesh is None:
                mesh = leaf.mesh
            elif leaf.mesh is not mesh:
                raise ValueError(f"tdmesh.checkpoint.{what}: state_dict{name} is on mesh {leaf.mesh.shape}, "
                                 f"others on {mesh.shape}: one checkpoint is of one mesh\n  at {user_line()}")
    if mesh is None:
        raise ValueError(f"tdmesh.checkpoint.{what}: the state dict holds no mesh tensor (save plain values with "
                         f"torch.save)\n  at {user_line()}")
    if mesh.client is None or mesh.client.closed:
        raise UsageError(f"tdmesh.checkpoint.{what}: the mesh has exited\n  at {user_line()}")
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise TypeError(f"tdmesh.checkpoint.{what}: checkpoint_id is a directory path, got "
                        f"{type(checkpoint_id).__name__}\n  at {user_line()}")
    return mesh, os.path.abspath(os.fspath(checkpoint_id))


def save(state_dict: dict, *, checkpoint_id) -> None:
    """Write ``state_dict`` as checkpoint ``checkpoint_id`` (a directory) and return once it is
    complete; an error on any rank is raised here."""
    mesh, path = _prepare(state_dict, "save", checkpoint_id)
    _save.call(state_dict, path, _group(mesh), mesh, None).result()


def async_save(state_dict: dict, *, checkpoint_id) -> Future:
    """Start writing ``state_dict`` as checkpoint ``checkpoint_id`` and return at once: a
    future that resolves (to None, or the first rank's error) once the checkpoint is complete.

    The tensors are copied on each worker when the call reaches it, in order with the ops
    before and after it: later in-place updates do not reach the checkpoint, and the writing
    overlaps the training that follows.  Checkpoints of one fleet are written one after
    another; leaving the mesh waits for the one being written."""
    mesh, path = _prepare(state_dict, "async_save", checkpoint_id)
    client = mesh.client
    task, done = client.tasks.new(mesh.rank_list, f"tdmesh.checkpoint.async_save of {path}")
    started = _save.call(state_dict, path, _group(mesh), mesh, task)

    def copied(fut: Future) -> None:  # a rank that failed to copy never starts the write
        error = fut._exception
        if error is not None:
            client.tasks.abandon(task, error)
    started.add_callback(copied)
    return done


def load(state_dict: dict, *, checkpoint_id) -> None:
    """Load checkpoint ``checkpoint_id`` into ``state_dict`` in place, as DCP does: each rank
    reads its tensors' data into them on its own, and the plain values (``"step": 7``) are set
    in ``state_dict``.  Every tensor of ``state_dict`` must be in the checkpoint with its shape
    (what the checkpoint has besides is ignored).  ``checkpoint_id`` may also be a file of
    pretrained weights (``torch.save``'s, or ``.safetensors``) that every worker can read: each
    reads it itself (``load(model.state_dict(), checkpoint_id="weights.pt")``), by dotted name.
    To load into a fresh optimizer, take its state dict with
    ``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt)`` (which makes the
    state) and apply it with ``set_state_dict`` after loading."""
    mesh, path = _prepare(state_dict, "load", checkpoint_id)
    for leaf in tree_flatten(state_dict)[0]:
        if type(leaf) is Tensor:
            check_mutation(leaf, "tdmesh.checkpoint.load")
    values = _load.call(state_dict, path, _group(mesh), mesh).result()
    _assign_plain(state_dict, next(iter(values))[1])


def _assign_plain(target, loaded) -> None:
    """Set the plain values of ``loaded`` (the workers' tree, tensors as None) in ``target``."""
    for key, value in loaded.items() if isinstance(loaded, dict) else enumerate(loaded):
        current = target[key]
        if isinstance(current, torch.Tensor):
            continue
        if isinstance(current, dict) and isinstance(value, dict) or (
                isinstance(current, list) and isinstance(value, list) and len(value) == len(current)):
            _assign_plain(current, value)  # a container of the user's: its tensors stay, its values are set
        else:
            target[key] = value


def is_complete(checkpoint_id) -> bool:
    """Whether ``checkpoint_id`` holds a complete checkpoint (its ``.metadata`` was written)."""
    return os.path.exists(os.path.join(os.fspath(checkpoint_id), COMMIT_FILE))


def latest(root) -> str | None:
    """The newest complete checkpoint directly under ``root`` (by the time its save completed),
    or None: what a resumed job loads.  Directories a save left half-written are passed over."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    found = [os.path.join(root, name) for name in os.listdir(root)]
    complete = [p for p in found if is_complete(p)]
    if not complete:
        return None
    return max(complete, key=lambda p: (os.path.getmtime(os.path.join(p, COMMIT_FILE)), p))
