"""The contract's static half (issue 11): exports, the one table of TDMESH_* variables,
declared dependencies, numpy mesh arrays, and no_mesh's device inside a CUDA mesh.  The
fleet half is tests/fleet/test_contract.py."""

import importlib.metadata
import os
import re

import numpy as np
import pytest
import torch

import tdmesh
from tdmesh.config import VARIABLES

from paths import REPO as ROOT


# ----------------------------------------------------------------------------- exports and config
def test_params_are_exported_at_top_level():
    from tdmesh import config
    assert tdmesh.ControllerParams is config.ControllerParams
    assert tdmesh.SupervisionParams is config.SupervisionParams
    assert {"ControllerParams", "SupervisionParams"} <= set(tdmesh.__all__)
    assert tdmesh.ControllerParams().operation_timeout == 120.0


def _python_files():
    for top in ("tdmesh", "bench", "launch", "tutorials", "tests"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    yield os.path.join(folder, name)


READ = re.compile(r"""(?:environ\.get|getenv)\(\s*["'](TDMESH_\w+)["']"""
                  r"""|environ\[\s*["'](TDMESH_\w+)["']\s*\](?!\s*=[^=])""")


def test_every_tdmesh_variable_is_in_the_table_and_read_through_it():
    unknown, direct = set(), []
    for path in _python_files():
        if path == os.path.abspath(__file__):
            continue  # this file names unlisted variables on purpose
        text = open(path).read()
        unknown |= {v for v in re.findall(r"\bTDMESH_[A-Z][A-Z0-9_]*\b", text) if v not in VARIABLES}
        if os.path.basename(path) != "config.py":  # setting one (os.environ["TDMESH_X"] = ...) is fine
            direct += [f"{os.path.relpath(path, ROOT)}: {m.group(0)}" for m in READ.finditer(text)]
    assert not unknown, f"TDMESH_* names missing from tdmesh/config.py's table: {sorted(unknown)}"
    assert not direct, "read these through tdmesh.config (env_str/env_int/env_float):\n" + "\n".join(direct)


def test_an_unlisted_variable_is_refused():
    from tdmesh.config import env_str
    with pytest.raises(KeyError):
        env_str("TDMESH_NO_SUCH_THING")


# ----------------------------------------------------------------------------- dependencies
def test_numpy_and_cloudpickle_are_runtime_dependencies():
    requires = importlib.metadata.requires("tdmesh") or []
    plain = {re.split(r"[ ;<>=!\[]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r}
    assert {"torch", "numpy", "cloudpickle"} <= plain, requires


def test_rank_array_is_shaped_like_the_mesh():
    mesh = tdmesh.DeviceMesh.from_sizes(host=2, gpu=3)
    ranks = mesh.rank_array()
    assert isinstance(ranks, np.ndarray) and ranks.shape == (2, 3) and ranks.dtype == np.int64
    assert ranks.tolist() == [[0, 1, 2], [3, 4, 5]]
    sub = mesh.slice(gpu=slice(1, 3)).rename(gpu="tp")
    assert sub.rank_array().tolist() == [[1, 2], [4, 5]]
    assert mesh.split(host=("dp", "pp"), pp=1).rank_array().shape == (2, 1, 3)


# ----------------------------------------------------------------------------- no_mesh
class CudaMeshGeometry:
    """Only what Activation reads of a mesh: its device type.  The real CUDA case is
    tests/gpu/test_gpu.py::test_no_mesh_inside_a_gpu_mesh_stays_on_the_clients_device."""
    device_type = "cuda"


def test_no_mesh_inside_a_cuda_mesh_restores_the_clients_default_device():
    from tdmesh.engine.activation import Activation, default_device
    outer = Activation(CudaMeshGeometry())
    try:
        assert default_device().type == "cuda"  # factories under the mesh describe CUDA tensors
        with tdmesh.no_mesh.activate():
            assert torch.ones(2).device.type == "cpu"
            with Activation(CudaMeshGeometry()):
                assert default_device().type == "cuda"
            assert torch.zeros(1).device.type == "cpu"
    finally:
        outer.deactivate()
    assert default_device().type == "cpu"


def test_no_mesh_keeps_a_default_device_the_user_set():
    from tdmesh.engine.activation import Activation
    torch.set_default_device("meta")
    try:
        outer = Activation(CudaMeshGeometry())
        with tdmesh.no_mesh.activate():
            assert torch.ones(2).device.type == "meta"
        outer.deactivate()
    finally:
        torch.set_default_device(None)


# ----------------------------------------------------------------------------- the error tree
def test_every_tdmesh_error_has_one_root():
    from tdmesh import errors
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type):
            assert issubclass(obj, tdmesh.TdmeshError), name
    assert issubclass(tdmesh.PlacementError, TypeError) and issubclass(tdmesh.UnknownDimError, KeyError)


def test_placement_errors_carry_their_code_and_refuse_unknown_codes():
    e = tdmesh.PlacementError("WRONG_MESH", "two meshes")
    assert e.code == "WRONG_MESH" and str(e).startswith("WRONG_MESH: two meshes\n  at ")
    with pytest.raises(ValueError, match="unknown placement error code 'NOPE'"):
        tdmesh.PlacementError("NOPE", "x")
