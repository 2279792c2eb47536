"""The values that travel inside messages beside plain Python ones: a mesh, a torch mesh or a
process group to substitute on the worker, a packed tensor, torch globals by name, and a client's
random generator (the worker's own copy of it).
``tdmesh.protocol.messages`` re-exports them (``m.MeshArg``), as the messages that carry them."""

from __future__ import annotations

from typing import Any, NamedTuple

# an entry of CallFunction.expect: the result is an OpaqueRef (a worker-resident box, protocol.resident), not a
# tensor of (shape, dtype, layout)
OPAQUE = "opaque"


class MeshArg(NamedTuple):
    """A ``DeviceMesh`` argument; the worker substitutes its own view of that mesh."""
    shape: Any


class TorchMeshArg(NamedTuple):
    """``mesh.torch_mesh()``: the worker's torch DeviceMesh of its dims, over the calling stream's groups."""
    mesh: Any


class ProcessGroupArg(NamedTuple):
    """A ``RemoteProcessGroup``: the worker's ProcessGroup over ``dims`` of ``mesh`` (per ref and stream)."""
    ref: int
    mesh: Any
    dims: tuple


# the worker function that makes a client's local tensor (its PackedTensor) a tensor on the worker's device:
# dispatch.ship_local sends it, and a worker's program makes its result once (worker/programs.py)
SHIPPED_FUNCTION = "tdmesh.worker.builtins.shipped"


class PackedTensor(NamedTuple):  # a dense CPU tensor as raw bytes: pickles ~10x faster than a tensor
    dtype: str
    shape: tuple
    data: Any  # a PickleBuffer where packed (codec.pack_tensor; protocol 5); a bytearray or a bulk frame's view


class TorchGlobal(NamedTuple):
    """A torch module attribute by name (``torch.preserve_format``): pickle finds a
    ``torch.memory_format``'s module by scanning every loaded module (~0.1 ms a value, and
    many ops carry one); this travels as a name and is looked up on arrival."""
    name: str

    def __reduce__(self):
        return torch_global, (self.name,)


def torch_global(name: str):
    import torch
    return getattr(torch, name)


class DeviceName(NamedTuple):
    """A ``torch.device`` as its name: its own pickle (a reduce through ``torch.device``)
    costs several microseconds an op."""
    name: str

    def __reduce__(self):
        return torch_device, (self.name,)


def torch_device(name: str):
    import torch
    return torch.device(name)


# the worker function that gives a worker's copy of a client's generator the client's state (engine/generators.py)
SET_GENERATOR_FUNCTION = "tdmesh.worker.builtins.set_generator_state"


class GeneratorArg(NamedTuple):
    """A client's ``torch.Generator`` (``generator=g``): the worker's own copy of it, one per client key and
    process, made at its first use; its draws advance it there, as the client's would have advanced."""
    key: int
    device: str

    def __reduce__(self):
        return worker_generator, (self.key, self.device)


_worker_generators: dict = {}  # (key, device) -> the worker's torch.Generator


def worker_generator(key: int, device: str):
    """The worker's copy of the client's generator ``key`` (made on first use; the client sends its state
    before the first op that draws from it)."""
    found = _worker_generators.get((key, device))
    if found is None:
        import torch
        found = _worker_generators[(key, device)] = torch.Generator(device=device)
    return found


def worker_generators() -> dict:
    """Every copy of a client generator this worker holds, by (key, device): what a heal saves and restores."""
    return _worker_generators
