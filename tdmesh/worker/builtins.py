"""Small functions the client calls remotely by import path (``mesh.rank``, ``process_idx``)."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import sys
import tempfile

import torch

from ..protocol.codec import describe_tensor
from ..protocol.messages import OPAQUE
from ..protocol.resident import Resident

_levels_before: dict[str, int] = {}  # logger name -> its level before this session's set_log_level


def shipped(data, device, order: tuple = ()) -> torch.Tensor:
    """A local tensor of the client's (``dispatch.ship_local``) on this worker's device: it
    arrives packed (``codec.pack_tensor``: pickled twice as fast as a tensor, unpickled into
    memory the tensor then owns), or as itself where bytes cannot carry it (sparse, quantized).
    ``order``: the bytes of a dense, non-contiguous tensor (channels-last) came as they lay in
    memory; seen in this order they have its layout again (``.to`` keeps a dense layout)."""
    from ..protocol.codec import unpack_tensor
    t = data if isinstance(data, torch.Tensor) else unpack_tensor(data)
    return (t.permute(order) if order else t).to(device)


def set_generator_state(key: int, device: str, state: torch.Tensor) -> None:
    """The client's generator ``key`` has this state now (first used, or reseeded by the user since):
    this worker's copy of it takes it (``engine/generators.py``)."""
    from ..protocol.arguments import worker_generator
    worker_generator(key, device).set_state(state)


def mesh_rank(mesh, dims) -> torch.Tensor:
    """This worker's coordinate along ``dims`` as an int64 scalar on its device."""
    return torch.tensor(mesh.rank(dims), dtype=torch.int64, device=mesh.device)


def process_idx(mesh) -> torch.Tensor:
    """This worker's global rank as an int64 scalar on its device."""
    return torch.tensor(mesh.global_rank, dtype=torch.int64, device=mesh.device)


def live_refs() -> int:
    """How many refs this worker holds: what a leak check or a soak test watches."""
    from .interpreter import Interpreter
    return len(Interpreter.current.env) if Interpreter.current is not None else 0


def live_process_groups() -> int:
    """How many process groups this worker's session holds (the world's aside): what a check
    that ``RemoteProcessGroup.drop`` freed them watches."""
    from .interpreter import Interpreter
    return Interpreter.current.groups.live() if Interpreter.current is not None else 0



def probe(target, args, kwargs):
    """Run ``target`` once for real and describe its outputs: the client's cached propagation.

    Returns ``(output tree spec, leaves, mutated)``: each leaf is ``None``, ``(size, stride, offset, dtype,
    aliased input index)`` for a tensor, ``("opaque",)`` for an OpaqueRef (a handle on the client), or
    ``("value", v)`` for any other picklable value (Monarch's semantics: the client's result holds this rank's
    value, cached with the call's key); ``mutated`` lists the inputs it wrote in place.
    """
    import torch.distributed as dist
    from torch.utils._pytree import tree_flatten, treespec_dumps

    from .functions import resolve
    fn = resolve(target)
    inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    if any(isinstance(x, dist.ProcessGroup) for x in tree_flatten((args, kwargs))[0]):
        raise TypeError("cached propagation runs the function on one rank, where a collective would wait "
                        "forever; give this remote function an explicit propagate=")
    versions = [t._version for t in inputs]
    storages = [t.untyped_storage().data_ptr() for t in inputs]
    out = fn(*args, **kwargs)
    leaves, spec = tree_flatten(out)
    described = []
    for leaf in leaves:
        if leaf is None:
            described.append(None)
        elif type(leaf) is Resident:  # an OpaqueRef: the client allocates a ref for it
            described.append((OPAQUE,))
        elif isinstance(leaf, torch.Tensor):
            ptr = leaf.untyped_storage().data_ptr()
            alias = next((i for i, p in enumerate(storages) if p == ptr and p != 0), None)
            described.append((tuple(leaf.shape), tuple(leaf.stride()), leaf.storage_offset(),
                              str(leaf.dtype).split(".")[1], alias))
        else:
            try:
                pickle.dumps(leaf)
            except Exception as e:
                raise TypeError(f"a remote function's result holds a {type(leaf).__name__}, which does not pickle "
                                f"({e}): return tensors and picklable values, or keep the object on the workers "
                                f"(mesh.spawn)") from e
            described.append(("value", leaf))
    mutated = [i for i, (t, v) in enumerate(zip(inputs, versions)) if t._version != v]
    return treespec_dumps(spec), described, mutated


_profiler = None


def profile_start(record_shapes: bool = False) -> None:
    """Start torch.profiler on this worker (CPU, and CUDA when present) for every stream."""
    global _profiler
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        activities.append(ProfilerActivity.CUDA)
    _profiler = profile(activities=activities, record_shapes=record_shapes)
    with _kineto_notices_dropped():
        _profiler.__enter__()


# What kineto writes to stderr when a profile starts and stops on a thread other than the
# one that loaded it (the worker's stream threads): "ERROR: External init callback must run in
# same thread as registerClient", and a "USDT: ... profiler_start/stop" line; a CUDA build of torch on a
# host without a GPU driver (torch 2.14.1+cu130 here) adds "DeviceProperties.cpp:56] gpuGetDeviceCount
# failed with code 35" (kineto looking for GPUs).  None is an error of the profile (its trace is whole),
# and a user reads "ERROR".
_KINETO_NOTICES = (b"External init callback must run in same thread as registerClient",
                   b"SyncActivityProfilerHandler.cpp", b"gpuGetDeviceCount failed")


@contextlib.contextmanager
def _kineto_notices_dropped():
    """Run the block with this process's stderr (fd 2) captured, then write back every line
    but kineto's notices: what other threads wrote meanwhile arrives, a moment later."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [ln for ln in captured.read().splitlines(keepends=True)
                    if not any(n in ln for n in _KINETO_NOTICES)]
            if kept:
                os.write(2, b"".join(kept))


def profile_stop(directory: str, rank: int) -> torch.Tensor:
    """Stop the profiler and write this rank's Chrome/Perfetto trace (``rank<r>.trace.json``
    in ``directory``); returns a remote 1, which the client sums to know every rank is done."""
    global _profiler
    if _profiler is None:
        raise RuntimeError("profile_stop without profile_start on this worker")
    prof, _profiler = _profiler, None
    with _kineto_notices_dropped():
        prof.__exit__(None, None, None)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank{rank}.trace.json")
    prof.export_chrome_trace(path)
    return torch.tensor(1)


def describe(values) -> list:
    """The metadata of each tensor (``codec.describe_tensor``): the client learns the
    shapes of outputs that only the data decides (``nonzero``, ``unique``, boolean masks,
    sparse results) or that torch cannot derive without running the op."""
    return [describe_tensor(t) for t in values]


def values_of(t: torch.Tensor):
    """A tensor's values as Python numbers: arguments that torch reads on the host."""
    return t.tolist()


def recording_modes() -> dict:
    """How each recording this worker has called runs: "program", or why it replays message by
    message (see tdmesh.worker.programs); recordings not called yet are left out."""
    from .interpreter import Interpreter
    interp = Interpreter.current
    if interp is None:
        return {}
    return interp.recordings.modes()


def recording_graphs() -> dict:
    """Per recording this worker runs with ``backend="inductor"``: how many graphs inductor compiled
    of it (``graphs``), and the aten ops that run between them, by name and count (``outside``): an op
    inductor cannot take (a fused optimizer kernel, an op that returns a Python value) splits the step."""
    from .interpreter import Interpreter
    interp = Interpreter.current
    return {} if interp is None else interp.recordings.graphs()


def set_log_level(logger: str, level: int) -> None:
    """``tdmesh.set_log_level``: ``logger`` ("tdmesh": tdmesh's own; "": the root) logs at ``level``."""
    target = logging.getLogger(logger or None)
    _levels_before.setdefault(logger, target.level)
    target.setLevel(level)


def log_message(logger: str, level: int, *args, **kwargs) -> None:
    """``tdmesh.builtins.log_remote``: ``args`` logged at ``level`` on this worker's ``logger``."""
    logging.getLogger(logger).log(level, *args, **kwargs)


def restore_log_levels() -> None:
    """Put back the levels that ``set_log_level`` changed, when the client's session ends."""
    for logger, level in _levels_before.items():
        logging.getLogger(logger or None).setLevel(level)
    _levels_before.clear()


def same(*values) -> tuple:
    """Its arguments: binds new refs to values the worker holds (a compiled call that goes on
    after a host read missed names the replay's tensors as its Python holds them)."""
    return values


def digests(tensors) -> list:
    """A CRC-32 of each tensor's bytes: whether the ranks hold one replica (``tdmesh.interop.hf``'s saves of a
    mesh model write one, after checking that every rank's agrees)."""
    import zlib
    out = []
    for t in tensors:
        t = t.detach().cpu().contiguous()
        out.append(zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else 0)
    return out
