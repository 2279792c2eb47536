"""tdmesh: drive a fleet of PyTorch workers from one Python program.

    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh, mesh.activate():
        x = torch.ones(3) * mesh.rank("gpu")
        print(tdmesh.fetch_shard(x, host=0, gpu=1).result())
"""

from . import (
    checkpoint,  # tdmesh.checkpoint.save / async_save / load
    interop,  # noqa: F401 - torch's ecosystem around the loop, adapted at the first activation of a mesh
    pool,  # noqa: F401 - tdmesh.pool.clear()
    random,
)
from .borrow import Borrow
from .collectives import GradReduction, MeshSliceTensor, reduce, reduce_, reduce_grads_in_backward, slice_mesh, to_mesh
from .config import ControllerParams, SupervisionParams
from .engine.activation import no_mesh
from .engine.coalescing import coalescing
from .engine.context import get_active_mesh
from .engine.fetch import fetch_all, fetch_shard, inspect, show
from .engine.future import Future, ValueMesh, as_completed
from .engine.stream import Stream, get_active_stream
from .engine.tensor import Tensor
from .errors import DeviceException, PlacementError, RemoteException, TdmeshError, UsageError
from .fault_tolerance import FaultTolerance, HealRecord
from .geometry.shape import Shape, UnknownDimError
from .geometry.slice import Slice
from .gradients import grad_function, grad_generator, gradient_execution_order
from .launcher import LoggingLocation, attach, local_mesh, local_meshes, restart_count, world_mesh
from .logs import set_log_level
from .mesh import DeviceMesh, RemoteProcessGroup
from .monitor import dashboard, stop_dashboard
from .objects import ObjectHandle, ObjectMethod
from .opaque import OpaqueObject, opaque_method
from .opaque_module import OpaqueModule
from .opaque_ref import OpaqueRef
from .profiling import profile
from .programs.optim import register_foreach_support  # noqa: F401 - registers tdmesh.Tensor with torch.optim
from .programs.recording import compile
from .remote import Remote, call_on_shard_and_fetch, remote
from .remote_autograd import remote_autograd_function
from .stacks import stacks

__all__ = [
    "Slice", "Shape", "UnknownDimError", "DeviceMesh", "get_active_mesh", "no_mesh",
    "TdmeshError", "DeviceException", "RemoteException", "PlacementError", "ValueMesh", "ControllerParams",
    "SupervisionParams", "Future", "Tensor", "Remote", "remote", "OpaqueObject", "opaque_method",
    "OpaqueRef", "OpaqueModule", "remote_autograd_function",
    "call_on_shard_and_fetch", "fetch_shard", "inspect", "local_mesh", "local_meshes",
    "restart_count", "world_mesh", "RemoteProcessGroup", "Borrow", "Stream", "get_active_stream",
    "MeshSliceTensor", "reduce", "reduce_", "reduce_grads_in_backward", "GradReduction", "slice_mesh", "to_mesh",
    "coalescing", "compile", "profile", "fetch_all",
    "show", "attach", "random", "UsageError", "ObjectHandle", "ObjectMethod", "set_log_level", "as_completed",
    "LoggingLocation", "checkpoint", "grad_generator", "grad_function", "gradient_execution_order",
    "stacks", "dashboard", "stop_dashboard", "FaultTolerance", "HealRecord",
]
