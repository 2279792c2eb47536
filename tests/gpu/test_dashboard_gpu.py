"""The dashboard on a GPU worker: its memory figures are the worker's own CUDA allocator's."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import torch

import tdmesh
from tdmesh import remote

pytestmark = pytest.mark.gpu


def _cuda_memory() -> tuple[int, int]:
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def test_a_gpu_workers_cuda_memory_shows_on_the_page():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, pool=False) as mesh, mesh.activate():
        url = tdmesh.dashboard()
        try:
            big = torch.ones(256, 1024, 1024)  # 1 GiB of fp32 on the worker's GPU
            assert tdmesh.fetch_shard(big.sum()).result().item() == 256 * 1024 * 1024
            allocated, reserved = [value for _, value in remote(_cuda_memory).call().result()][0]
            deadline = time.monotonic() + 30
            while True:
                rank = json.loads(urllib.request.urlopen(url + "api/fleet", timeout=30).read())["ranks"][0]
                if rank["cuda_allocated"] == allocated:
                    break
                assert time.monotonic() < deadline, rank
                time.sleep(0.3)
            assert rank["device"].startswith("cuda") and allocated >= 1 << 30
            assert rank["cuda_reserved"] == reserved >= allocated and rank["rss"] > 0
            del big
        finally:
            tdmesh.stop_dashboard()
