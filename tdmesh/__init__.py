"""tdmesh: drive a fleet of PyTorch workers from one Python program.

    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh, mesh.activate():
        x = torch.ones(3) * mesh.rank("gpu")
        print(tdmesh.fetch_shard(x, host=0, gpu=1).result())
"""

from .slice import Slice
from .shape import Shape, UnknownDimError
from .mesh import DeviceMesh
from ._context import get_active_mesh, no_mesh
from .errors import DeviceException, RemoteException
from .config import ControllerParams, SupervisionParams
from .future import Future
from .tensor import Tensor
from .remote import Remote, RemoteProcessGroup, remote
from .stream import Borrow, Stream, get_active_stream
from ._coalescing import coalescing
from .recording import compile
from .profiling import profile
from .collectives import MeshSliceTensor, reduce, reduce_, slice_mesh, to_mesh
from .fetch import call_on_shard_and_fetch, fetch_all, fetch_shard, inspect, show
from .launcher import attach, local_mesh, local_meshes, restart_count, world_mesh
from . import random

__all__ = [
    "Slice", "Shape", "UnknownDimError", "DeviceMesh", "get_active_mesh", "no_mesh",
    "DeviceException", "RemoteException", "ControllerParams", "SupervisionParams", "Future", "Tensor", "Remote", "remote",
    "call_on_shard_and_fetch", "fetch_shard", "inspect", "local_mesh", "local_meshes",
    "restart_count", "world_mesh", "RemoteProcessGroup", "Borrow", "Stream", "get_active_stream",
    "MeshSliceTensor", "reduce", "reduce_", "slice_mesh", "to_mesh", "coalescing", "compile", "profile", "fetch_all", "show", "attach", "random",
]
