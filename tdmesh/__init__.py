"""tdmesh: drive a fleet of PyTorch workers from one Python program.

    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh, mesh.activate():
        x = torch.ones(3) * mesh.rank("gpu")
        print(tdmesh.fetch_shard(x, host=0, gpu=1).result())
"""

from . import random
from ._coalescing import coalescing
from ._context import get_active_mesh
from .activation import no_mesh
from .borrow import Borrow
from .collectives import MeshSliceTensor, reduce, reduce_, slice_mesh, to_mesh
from .config import ControllerParams, SupervisionParams
from .errors import DeviceException, PlacementError, RemoteException, TdmeshError, UsageError
from .fetch import fetch_all, fetch_shard, inspect, show
from .future import Future, ValueMesh, as_completed
from .launcher import LoggingLocation, attach, local_mesh, local_meshes, restart_count, world_mesh
from .logs import set_log_level
from .mesh import DeviceMesh, RemoteProcessGroup
from .objects import ObjectHandle, ObjectMethod
from .optim import register_foreach_support  # noqa: F401 - registers tdmesh.Tensor with torch.optim
from .profiling import profile
from .recording import compile
from .remote import Remote, call_on_shard_and_fetch, remote
from .shape import Shape, UnknownDimError
from .slice import Slice
from .stream import Stream, get_active_stream
from .tensor import Tensor

__all__ = [
    "Slice", "Shape", "UnknownDimError", "DeviceMesh", "get_active_mesh", "no_mesh",
    "TdmeshError", "DeviceException", "RemoteException", "PlacementError", "ValueMesh", "ControllerParams",
    "SupervisionParams", "Future", "Tensor", "Remote", "remote",
    "call_on_shard_and_fetch", "fetch_shard", "inspect", "local_mesh", "local_meshes",
    "restart_count", "world_mesh", "RemoteProcessGroup", "Borrow", "Stream", "get_active_stream",
    "MeshSliceTensor", "reduce", "reduce_", "slice_mesh", "to_mesh", "coalescing", "compile", "profile", "fetch_all",
    "show", "attach", "random", "UsageError", "ObjectHandle", "ObjectMethod", "set_log_level", "as_completed",
    "LoggingLocation",
]
