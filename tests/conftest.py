import os
import re

import hypothesis
import pytest
import torch
from _watchdog import pytest_runtest_protocol, pytest_unconfigure  # noqa: F401  (hooks: time limits)
from hypothesis._settings import is_in_ci as hypothesis_in_ci

import tdmesh
from tdmesh.config import cpu_forced, env_str

# The files that take the longest, longest first (a fresh-clone run of 2026-12-03 on this 2-core VM:
# 190-380 s for the differential test, 200 s for supervision, down to ~40 s). pytest-xdist hands whole
# files out in collection order (pytest.ini: --dist loadfile --no-loadscope-reorder; xdist's own
# order is by test count, which put the one-test differential and OpInfo files
# last, where one process ran them alone for minutes), so these start first and the many short files
# fill in beside them: the longest-first rule keeps the two processes' ends within a short file.
LONG_FILES = ("test_compile_differential.py", "test_smoke.py", "test_healing.py", "test_supervision.py",
              "test_tutorials.py", "test_checkpoint.py", "test_debugging.py", "test_torchrun.py", "test_pool.py",
              "test_docs.py", "test_security_fleet.py", "test_attach.py", "test_opinfo.py", "test_fuzz_fleet.py",
              "test_launch.py", "test_dashboard.py", "test_relays.py", "test_engine.py", "test_programs.py")


def pytest_runtest_setup(item):
    """Each test runs under hypothesis's own profile ("ci" under CI, else "default": 100
    examples): importing torch's ``testing._internal.common_utils`` (the OpInfo tests do) loads
    torch's profile for the whole process -- 10 examples, or 50 under CI -- which would quietly
    change every ``@given`` test that does not name its own ``max_examples``."""
    hypothesis.settings.load_profile("ci" if hypothesis_in_ci() else "default")


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    """Each test's tier is its folder (``-m unit``, ``-m fleet``, ``-m gpu``, ``-m bench`` select one);
    GPU tests are skipped without CUDA; the long files come first (``LONG_FILES``)."""
    def order(item) -> int:
        name = os.path.basename(str(item.path))
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=order)  # stable: the other files in collection order
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        tier = os.path.basename(os.path.dirname(str(item.path)))
        if tier in ("unit", "fleet", "gpu", "bench"):
            item.add_marker(getattr(pytest.mark, tier))
        elif tier == "tdmesh":  # the doctests of tdmesh/geometry/slice.py and tdmesh/geometry/shape.py
            item.add_marker(pytest.mark.unit)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mesh2x2():
    """Four workers (CPU over gloo here), dims host=2 x gpu=2, shared by the engine tests."""
    with tdmesh.local_mesh(hosts=2, gpus_per_host=2) as mesh:
        yield mesh


@pytest.fixture(scope="session")
def mesh1():
    """One worker (CPU here; cuda:0 where local_mesh finds a GPU)."""
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:
        yield mesh


def requested_mesh_shape() -> tuple[int, int]:
    """``(hosts, gpus_per_host)`` from ``TDMESH_TEST_MESH=HOSTSxGPUS`` (default ``2x2``)."""
    spec = env_str("TDMESH_TEST_MESH")
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(f"TDMESH_TEST_MESH={spec!r}: expected HOSTSxGPUS with both >= 1, e.g. 1x2 or 2x1")
    return int(match[1]), int(match[2])


@pytest.fixture(scope="session")
def cmesh(request):
    """The mesh of tests/fleet/test_collectives.py and tests/fleet/test_streams.py: dims host x gpu, of the
    shape ``TDMESH_TEST_MESH=HOSTSxGPUS`` names (default 2x2), on the device local_mesh picks
    (CUDA/NCCL, one GPU per worker, where CUDA is present unless ``TDMESH_DEVICE=cpu``; else
    CPU/gloo).  2x2 is the very ``local_mesh`` call of ``mesh2x2``: that fleet is shared
    rather than a second one started."""
    hosts, gpus = requested_mesh_shape()
    cuda = torch.cuda.is_available() and not cpu_forced()
    if cuda and hosts * gpus > torch.cuda.device_count():
        n = torch.cuda.device_count()
        pytest.fail(f"TDMESH_TEST_MESH={hosts}x{gpus} needs {hosts * gpus} GPUs and this host has {n}: "
                    f"set TDMESH_TEST_MESH to a smaller shape (e.g. 1x{n}) or TDMESH_DEVICE=cpu", pytrace=False)
    if (hosts, gpus) == (2, 2):
        yield request.getfixturevalue("mesh2x2")
        return
    with tdmesh.local_mesh(hosts=hosts, gpus_per_host=gpus) as mesh:
        yield mesh
