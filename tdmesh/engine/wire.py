"""How op arguments travel: remote tensors become ``Ref``s, functions become import paths.

Plain containers are rebuilt only where they hold something to convert; an object with a
``_tdmesh_wire()`` method (a mesh, a process group, an RNG state) says how it travels; a client's
``torch.Generator`` travels as the key of the workers' copy of it (``generators.py``).
"""

from __future__ import annotations

import pickle

import torch
from torch._library.custom_ops import OPDEFS

from ..errors import user_line
from ..protocol import messages as m
from .generators import wire as generator_wire
from .tensor import Tensor

__all__ = ["to_wire", "sealed_args", "op_path"]


def to_wire(obj):
    """Arguments as they travel: proxies become Refs; containers are rebuilt only if needed."""
    t = type(obj)
    if t is Tensor:
        return m.Ref(obj._r.id)
    if t is tuple or t is list:
        return t(to_wire(x) for x in obj)
    if t is dict:
        return {k: to_wire(v) for k, v in obj.items()}
    if t is torch.Tensor or isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, tuple):  # NamedTuples and torch.return_types (sort, topk, svd ...) keep their type
        items = [to_wire(x) for x in obj]
        return t(*items) if hasattr(obj, "_fields") else t(items)
    if t is torch.memory_format or t is torch.layout:
        return _TORCH_GLOBALS[obj]
    if t is torch.device:
        name = _device_names.get(obj)
        if name is None:
            name = _device_names[obj] = m.DeviceName(str(obj))
        return name
    if t is torch.Generator:  # the worker's own copy of it (generators.py)
        return generator_wire(obj)
    wire = getattr(obj, "_tdmesh_wire", None)
    if wire is not None:
        return wire()
    if isinstance(obj, dict):  # an OrderedDict (a module's state_dict()) keeps its type
        return type(obj)((k, to_wire(v)) for k, v in obj.items())
    return obj


# pickle finds a memory format's module by scanning all of sys.modules (~0.1 ms a value);
# layouts and devices pickle through a reduce: all travel as names (see messages.TorchGlobal)
_TORCH_GLOBALS = {getattr(torch, name): m.TorchGlobal(name) for name in (
    "preserve_format", "contiguous_format", "channels_last", "channels_last_3d", "strided", "sparse_coo",
    "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged")
    if hasattr(torch, name)}
_device_names: dict = {}


def sealed_args(args: tuple, kwargs: dict) -> bytes:
    """A user function's arguments, pickled on their own: a value the worker cannot unpickle
    (a class defined in ``__main__``, say) then fails that call, not the worker's whole frame."""
    try:
        return pickle.dumps((to_wire(args), to_wire(kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(f"the arguments of this remote call cannot be pickled ({type(e).__name__}: {e}); "
                        f"pass tensors, plain values or importable classes\n  at {user_line()}") from e


_op_paths: dict = {}


def op_path(func) -> str:
    """The import path of an aten (or library) op overload, as workers resolve it.  An op that
    a Python module registers (``torch.library.custom_op``) carries that module after an
    ``@``: the worker imports it first, so the op exists there too."""
    path = _op_paths.get(func)
    if path is None:
        qualname = func._schema.name
        path = f"torch.ops.{func.namespace}.{qualname.split('::')[1]}.{func._overloadname}"
        if func.namespace not in ("aten", "prims"):
            definition = OPDEFS.get(qualname)
            module = getattr(getattr(definition, "_init_fn", None), "__module__", None)
            if module:
                path = f"{path}@{module}"
        _op_paths[func] = path
    return path
