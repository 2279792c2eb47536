"""``tdmesh.checkpoint`` on the workers: every rank writes and reads its own data through
``torch.distributed.checkpoint`` (DCP); no tensor byte goes through the client.

Saving, each rank hashes its tensors (SHA-256 of the bytes) and the ranks exchange the digests
over the checkpoint's gloo group.  A tensor equal along a mesh dim is written once for that dim;
one that differs is written per rank.  In DCP's terms: a tensor equal on every rank is a plain
tensor (DCP's planner writes it once and loads it onto any mesh, or into plain torch); one that
differs along dims ``D`` is a DTensor of shape ``[size of each dim in D, *shape]``, sharded along
``D`` and replicated along the rest, which plain torch loads as that stacked tensor.
``tdmesh.json`` beside DCP's files records the mesh's dims and each tensor's ``D``; DCP's
``.metadata``, written last (and removed first when a checkpoint is overwritten), is the commit:
a checkpoint without it was cut off and never loads.

An async save copies each rank's tensors at the call, in stream order (so later in-place
updates do not reach the checkpoint), then writes on a background task
(``tdmesh.worker.tasks``); writes of one worker run one after another, in the order called.
DCP is imported by the write and the read, not with this module: importing it took 2.6 s on
the H200 host, which a first async save paid on the stream thread (the training step after the
call took 2.8 s) and now pays on the writing thread (the next ~10 steps share it).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from ..geometry.grouping import dims_rank
from .mesh import WorkerMesh

__all__ = ["save", "load", "LAYOUT_FILE", "COMMIT_FILE"]

LAYOUT_FILE = "tdmesh.json"
COMMIT_FILE = ".metadata"  # DCP's metadata: written last
_previous = threading.Event()  # the last write of this worker has ended (one after another)
_previous.set()
_order = threading.Lock()
_meshes: dict = {}
# dcp.load(no_dist=True) warns that it assumes one process on every call: meant (see _read)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
_planned_groups: dict = {}  # id -> group: a cached plan's key stays this group's (ids are not reused)


def _after_previous_write() -> tuple[threading.Event, threading.Event]:
    """(the event of the write before this one, this one's): a write waits for the one before."""
    global _previous
    with _order:
        before, _previous = _previous, threading.Event()
        return before, _previous


def save(tree, checkpoint_id: str, group, mesh: WorkerMesh, task: int | None) -> None:
    """Write ``tree`` (this rank's tensors and the plain values) as DCP checkpoint ``checkpoint_id``;
    with ``task``, copy the tensors now and write on that background task."""
    paths = [keystr(p) for p, _ in tree_flatten_with_path(tree)[0]]
    leaves, spec = tree_flatten(tree)
    before, mine = _after_previous_write()
    if task is None:
        _in_turn(before, mine, lambda: _write(leaves, paths, spec, checkpoint_id, group, mesh))
        return
    try:
        snapshot, copied = _snapshot(leaves)
    except BaseException:
        _in_turn(before, mine, lambda: None)
        raise
    from .interpreter import Interpreter  # the running worker's: its tasks report to the client

    def write() -> None:
        if copied is not None:
            copied.synchronize()  # the device-to-host copies, queued on the stream, have landed
        _write(snapshot, paths, spec, checkpoint_id, group, mesh, on_host=True)
    assert Interpreter.current is not None
    Interpreter.current.tasks.start(task, lambda: _in_turn(before, mine, write))


def _snapshot(leaves) -> tuple[list, Any]:
    """Copies of the tensor leaves as they are at this point of the stream: on CPU a clone; from
    a GPU into pinned host memory, queued on the stream (the stream goes on at once: the copies
    are ordered before its later work) with the event the write waits for."""
    out, cuda = [], False
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.device.type == "cuda":
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)  # torch's pinned cache reuses them
            host.copy_(x.detach(), non_blocking=True)
            out.append(host)
            cuda = True
        else:
            out.append(x.detach().clone() if isinstance(x, torch.Tensor) else x)
    if not cuda:
        return out, None
    event = torch.cuda.Event()
    event.record()
    return out, event


def _in_turn(before: threading.Event, mine: threading.Event, fn: Callable[[], None]) -> None:
    before.wait()
    try:
        fn()
    finally:
        mine.set()


_SAMPLE_WINDOWS = 64  # a tensor's sample: this many evenly spaced windows of its bytes...
_SAMPLE_BYTES = 4096   # ...of this size (a smaller tensor is its whole self)


def _bytes(t: torch.Tensor):
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def _digest(t: torch.Tensor, sample: bool) -> str:
    """SHA-256 of the tensor's bytes (``sample``: of evenly spaced windows of them), its dtype and shape."""
    data = _bytes(t)
    h = hashlib.sha256()
    if sample and data.size > _SAMPLE_WINDOWS * _SAMPLE_BYTES:
        step = (data.size - _SAMPLE_BYTES) // (_SAMPLE_WINDOWS - 1)
        for k in range(_SAMPLE_WINDOWS):
            h.update(data[k * step:k * step + _SAMPLE_BYTES].data)
    else:
        h.update(data.data)  # the bytes themselves, not a copy
    return f"{h.hexdigest()}|{t.dtype}|{tuple(t.shape)}"


def _differing_dims(everyone, j: int, labels, coords) -> list[str]:
    """The dims along which the ranks' digests of tensor ``j`` differ."""
    differs = []
    for k, dim in enumerate(labels):
        seen: dict[tuple, set] = {}
        for rank, digests in everyone:
            seen.setdefault(coords[rank][:k] + coords[rank][k + 1:], set()).add(digests[j])
        if any(len(s) > 1 for s in seen.values()):
            differs.append(dim)
    return differs


def _per_rank_dims(paths, leaves, group, mesh: WorkerMesh) -> dict[int, list[str]]:
    """For each tensor leaf (by index), the mesh dims along which its ranks hold different values.

    Samples first: a tensor whose samples already differ along a dim differs there (no more
    to read); only along the dims where every sample agrees are the whole tensors hashed, and
    only there does equality (of SHA-256 digests) make a tensor replicated."""
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    for i in tensors:
        if leaves[i].layout != torch.strided or leaves[i].is_quantized:
            raise TypeError(f"tdmesh.checkpoint saves dense tensors; {paths[i]} is {leaves[i].layout}")
    if group.size() == 1:
        return {i: [] for i in tensors}
    labels = mesh.names
    everyone: list = [None] * group.size()
    dist.all_gather_object(everyone, (mesh.global_rank, [_digest(leaves[i], True) for i in tensors]), group=group)
    coords = {rank: tuple(dims_rank(mesh.shape, rank, (d,)) for d in labels) for rank, _ in everyone}
    out = {}
    for j, i in enumerate(tensors):
        kinds = {digests[j].partition("|")[2] for _, digests in everyone}
        if len(kinds) > 1:
            raise ValueError(f"tdmesh.checkpoint: {paths[i]} has different dtypes or shapes on different ranks "
                             f"({sorted(kinds)}): a checkpointed tensor has one dtype and shape on every rank")
        out[i] = _differing_dims(everyone, j, labels, coords)
    spread = [d for d in labels if mesh.sizes[d] > 1]  # a dim of one rank never differs
    unsure = [j for j, i in enumerate(tensors) if len(out[i]) < len(spread)]  # equal samples along some dim
    if unsure:
        full: list = [None] * group.size()
        dist.all_gather_object(full, (mesh.global_rank, [_digest(leaves[tensors[j]], False) for j in unsure]),
                               group=group)
        for n, j in enumerate(unsure):
            out[tensors[j]] = _differing_dims(full, n, labels, coords)
    return out


def _cpu_mesh(mesh: WorkerMesh):
    """A torch DeviceMesh of the mesh's dims on CPU, without process groups of its own: DCP and
    DTensor need only the ranks' coordinates for the chunks of a per-rank tensor."""
    from torch.distributed.device_mesh import DeviceMesh
    found = _meshes.get(mesh.shape)
    if found is None:
        ranks = torch.tensor(mesh.shape.ranks(), dtype=torch.int).view(*[mesh.sizes[d] for d in mesh.names])
        found = _meshes[mesh.shape] = DeviceMesh("cpu", ranks, mesh_dim_names=mesh.names, _init_backend=False)
    return found


def _stacked(local: torch.Tensor, dims: list[str], mesh: WorkerMesh):
    """``local`` as the DTensor ``[size of each of dims, *local.shape]`` whose chunk is this rank's."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    shape = torch.Size([mesh.sizes[d] for d in dims] + list(local.shape))
    placements = [Shard(dims.index(d)) if d in dims else Replicate() for d in mesh.names]
    chunk = local.reshape([1] * len(dims) + list(local.shape))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(chunk, _cpu_mesh(mesh), placements, run_check=False, shape=shape, stride=stride)


def _write(leaves, paths, spec, checkpoint_id: str, group, mesh: WorkerMesh, on_host: bool = False) -> None:
    """``on_host``: every tensor is in host memory already (an async save's snapshot), so DCP's
    writer is told not to stage it through the GPU's current stream: its overlapping loader
    synchronizes that stream (the training's, on a GPU worker) again and again."""
    leader = dist.get_rank(group) == 0
    if leader:  # an overwritten checkpoint stops being a complete one before any byte changes
        os.makedirs(checkpoint_id, exist_ok=True)
        for name in (COMMIT_FILE, LAYOUT_FILE):
            if os.path.exists(os.path.join(checkpoint_id, name)):
                os.remove(os.path.join(checkpoint_id, name))
    per_rank = _per_rank_dims(paths, leaves, group, mesh)  # also a barrier: after the leader's removals
    values = list(leaves)
    for i, dims in per_rank.items():
        if dims:
            values[i] = _stacked(leaves[i].detach().to("cpu"), dims, mesh)
    if leader:
        layout = {"dims": dict(mesh.sizes), "per_rank": {paths[i]: d for i, d in per_rank.items() if d}}
        with open(os.path.join(checkpoint_id, LAYOUT_FILE), "w") as f:
            json.dump(layout, f, indent=1)
    import torch.distributed.checkpoint as dcp  # imported here, on the writing thread (see the module's docstring)
    writer = dcp.FileSystemWriter(checkpoint_id, per_thread_copy_ahead=0 if on_host else 10_000_000)
    _dcp(dcp.save, tree_unflatten(values, spec), storage_writer=writer, planner=_planner(dcp, group),
         process_group=group, checksums=False)


def _planner(dcp, group):
    """DCP's planner with its plan cache, scoped to this checkpoint group.

    A save's plan is exchanged over the group every time (each rank's plan gathered, the global
    plan scattered), pickled and unpickled on the writing thread while the training's thread
    waits for the GIL.  With ``enable_plan_caching`` a rank whose plan has not changed since
    the group's last save sends an empty one and the coordinator reuses the plans it made then:
    on one H200 worker async-saving the small GPT's 230 tensors, the training loop beside the
    saves went from 1.23x to 1.06-1.10x its step time (bench/README.md); a CPU worker's save
    of 58 tensors costs the same either way (``bench/save_cost.py``).  DCP keys its cache by
    planner class, for the whole process: the key here names the group (its ranks and the
    object, kept alive below), so saves on other meshes, or on a group of the same name in a
    later job of a warm worker, never share one.  A torch without the cache (or its key) gets
    the plain planner."""
    planner = dcp.DefaultSavePlanner(enable_plan_caching=True)
    if not hasattr(planner, "_cached_plans_key"):
        return dcp.DefaultSavePlanner()
    _planned_groups[id(group)] = group
    planner._cached_plans_key = f"tdmesh/{id(group)}/{dist.get_process_group_ranks(group)}"
    return planner


def load(tree, checkpoint_id: str, group, mesh: WorkerMesh):
    """Load checkpoint ``checkpoint_id`` into this rank's tensors of ``tree``, in place; returns
    the loaded tree with its tensors as None (the client takes the plain values from it)."""
    before, mine = _after_previous_write()  # a checkpoint still being written here is finished first
    result: list = []
    _in_turn(before, mine, lambda: result.append(_read(tree, checkpoint_id, group, mesh)))
    return result[0]


def _read(tree, checkpoint_id: str, group, mesh: WorkerMesh):
    if os.path.isfile(checkpoint_id):
        return _read_file(tree, checkpoint_id)
    if not os.path.exists(os.path.join(checkpoint_id, COMMIT_FILE)):
        what = "does not exist" if not os.path.isdir(checkpoint_id) else (
            f"has no {COMMIT_FILE}: it is not a complete checkpoint (the save writes it last, so a save that was "
            f"cut off leaves none)")
        raise FileNotFoundError(f"checkpoint {checkpoint_id} {what}")
    layout_path = os.path.join(checkpoint_id, LAYOUT_FILE)
    layout: dict = {"dims": {}, "per_rank": {}}  # a checkpoint that plain DCP wrote: every tensor as one
    if os.path.exists(layout_path):
        with open(layout_path) as f:
            layout = json.load(f)
    paths = [keystr(p) for p, _ in tree_flatten_with_path(tree)[0]]
    leaves, spec = tree_flatten(tree)
    targets = list(leaves)
    copies = []
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            continue
        dims = layout["per_rank"].get(paths[i], [])
        wrong = [d for d in dims if mesh.sizes.get(d) != layout["dims"].get(d)]
        if wrong:
            raise ValueError(f"tdmesh.checkpoint: {paths[i]} was saved per rank along {dims} of a mesh "
                             f"{layout['dims']}; this mesh is {dict(mesh.sizes)}: a per-rank tensor loads onto a mesh "
                             f"with those dims at those sizes (a tensor equal on every rank loads onto any mesh)")
        # read into the tensor itself where DCP can (its own memory: no fresh pages; a GPU tensor
        # through pinned staging buffers, checkpoint_reader); a GPU tensor saved per rank is stacked
        # into a DTensor on a CPU mesh, so it is read on the host first
        in_place = not dims or (x.device.type == "cpu" and x.is_contiguous())
        buffer = x if in_place else torch.empty(x.shape, dtype=x.dtype)
        if buffer is not x:
            copies.append((x, buffer))
        targets[i] = _stacked(buffer, dims, mesh) if dims else buffer
    loaded = tree_unflatten(targets, spec)
    import torch.distributed.checkpoint as dcp

    from .checkpoint_reader import DirectReader
    # Each rank plans its own reads from the checkpoint's metadata: DCP's load plan needs no other
    # rank (its global step returns the local plans unchanged), so the plan's gather and scatter and
    # the closing all-gather over the group (~10 ms a load of 2 CPU ranks) are left out.
    _dcp(dcp.load, loaded, storage_reader=DirectReader(checkpoint_id), process_group=group, no_dist=True)
    for x, buffer in copies:
        with torch.no_grad():
            x.copy_(buffer)
    return _without_tensors(loaded)


def _dotted(path) -> str:
    """A pytree key path as a state dict names it: ``model.0.weight``."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _flat_file(value, prefix: str = "") -> dict:
    """A loaded file's nested dicts as {dotted key: value}."""
    if isinstance(value, dict):
        out: dict = {}
        for k, v in value.items():
            out.update(_flat_file(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def _view(t: torch.Tensor) -> tuple:
    """What makes two tensors the same memory seen the same way (a tied weight: one tensor, two names)."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def _read_file(tree, path: str):
    """A pretrained file (``torch.save``'s, or ``.safetensors``) that this worker reads itself:
    each tensor of ``tree`` gets the file's value of the same (dotted) name, in place."""
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ImportError(f"loading {path} needs the safetensors package on the workers") from None
        loaded = load_file(path, device="cpu")
    else:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    found = _flat_file(loaded)
    pairs = [(_dotted(p), leaf) for p, leaf in tree_flatten_with_path(tree)[0]]
    # a tied weight (GPT-2's lm_head.weight is transformer.wte.weight) is saved once, under one of its names:
    # a name the file lacks is loaded through another that it has, if both are the same tensor here
    loaded_views = {_view(leaf) for name, leaf in pairs if isinstance(leaf, torch.Tensor) and name in found}
    missing = [name for name, leaf in pairs if isinstance(leaf, torch.Tensor) and name not in found and
               _view(leaf) not in loaded_views]
    if missing:
        raise KeyError(f"{path} has no {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                       f"({len(missing)} missing); it has {', '.join(list(found)[:5])} ...: the state dict's "
                       f"names must be the file's (load model.state_dict() from a file of model.state_dict())")
    for name, leaf in pairs:
        if isinstance(leaf, torch.Tensor) and name in found:
            value = found[name]
            if not isinstance(value, torch.Tensor) or value.shape != leaf.shape:
                raise ValueError(f"{path}: {name} is {getattr(value, 'shape', type(value).__name__)} in the file "
                                 f"and {tuple(leaf.shape)} in the state dict")
            with torch.no_grad():
                leaf.copy_(value)

    def plain(p, leaf):
        return None if isinstance(leaf, torch.Tensor) else found.get(_dotted(p), leaf)
    from torch.utils._pytree import tree_map_with_path
    return tree_map_with_path(plain, tree)


def _dcp(fn, *args, checksums: bool = True, **kwargs):
    """Call DCP, whose failures are a ``CheckpointException`` -- a BaseException, which a worker
    takes for a fatal one: raise the first failing rank's own error instead (a user error).

    ``checksums=False``: torch.save (which DCP writes each record with) skips the zip CRC-32s
    meanwhile.  Computing them holds the GIL for the whole record (~60 ms per 128 MiB), which
    stalls the training threads of the worker that an async save is meant to overlap; torch.load
    reads such records as well.  The setting is the process's: restored after the call."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.serialization import get_crc32_options, set_crc32_options
    was = get_crc32_options()
    if not checksums:
        set_crc32_options(False)
    try:
        return fn(*args, **kwargs)
    except CheckpointException as e:
        failures = sorted(e.failures.items())
        if not failures:
            raise RuntimeError(str(e)) from None
        rank, (error, _) = failures[0]
        if not isinstance(error, Exception):
            raise RuntimeError(str(e)) from None
        raise type(error)(f"{error} (torch.distributed.checkpoint, on checkpoint rank {rank})") from error
    finally:
        set_crc32_options(was)


def _without_tensors(tree):
    if isinstance(tree, torch.Tensor):
        return None
    if isinstance(tree, dict):
        return {k: _without_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_without_tensors(v) for v in tree)
    return tree
