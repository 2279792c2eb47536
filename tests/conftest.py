import pytest
import torch

import tdmesh


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mesh2x2():
    """Four CPU workers over gloo, dims host=2 x gpu=2, shared by the engine tests."""
    with tdmesh.local_mesh(hosts=2, gpus_per_host=2) as mesh:
        yield mesh


@pytest.fixture(scope="session")
def mesh1():
    """One CPU worker."""
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:
        yield mesh
