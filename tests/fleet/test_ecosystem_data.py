"""A DataLoader under an active mesh gives the batches it gives without one (local tensors, for the user to put
on the mesh), with workers (fork and spawn), pinned memory, persistent workers, shuffling with and without a
generator; an error in a loader worker reaches the loop as torch raises it, never a hang."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

import tdmesh


class Numbers(Dataset):
    """Items made with torch calls (``torch.tensor`` of Python data, as most datasets' ``__getitem__``)."""

    def __init__(self, n: int = 23) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return {"x": torch.tensor([float(i)] * 3) * torch.rand(1), "y": i % 4}


class Broken(Numbers):
    def __getitem__(self, i: int):
        if i == 5:
            raise ValueError("item 5 is broken")
        return super().__getitem__(i)


def stack_collate(items):
    return torch.stack([item["x"] for item in items]), torch.tensor([item["y"] for item in items])


def batches(loader, epochs: int = 2) -> list:
    out = []
    for _ in range(epochs):
        out.extend(loader)
    return out


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def mesh():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as m:
        yield m


@settings(max_examples=30, deadline=None, database=None)
@given(workers=st.sampled_from([0, 2]), shuffle=st.booleans(), generator=st.one_of(st.none(), st.integers(0, 99)),
       batch=st.integers(1, 6), drop_last=st.booleans(), persistent=st.booleans(), pin=st.booleans(),
       collate=st.sampled_from([None, stack_collate]), seed=st.integers(0, 2**16))
def test_a_loader_gives_under_a_mesh_the_batches_it_gives_without_one(mesh, workers, shuffle, generator, batch,
                                                                      drop_last, persistent, pin, collate, seed):
    def loader():
        return DataLoader(Numbers(), batch_size=batch, shuffle=shuffle, num_workers=workers, collate_fn=collate,
                          drop_last=drop_last, persistent_workers=persistent and workers > 0, pin_memory=pin,
                          generator=None if generator is None else torch.Generator().manual_seed(generator))

    torch.manual_seed(seed)
    want = batches(loader())
    with mesh.activate():
        torch.manual_seed(seed)  # the client's generator too: an unseeded shuffle follows it, as without a mesh
        got = batches(loader())
        on_mesh = tdmesh.to_mesh(got[0], mesh)  # the pattern: one upload a step
        back = tdmesh.fetch_shard(on_mesh, host=0, gpu=1).result()
    assert same(got, want)
    assert same(back, want[0])


def test_a_loader_with_spawned_workers_gives_the_same_batches(mesh):
    def loader():
        return DataLoader(Numbers(9), batch_size=4, num_workers=2, multiprocessing_context="spawn",
                          collate_fn=stack_collate, generator=torch.Generator().manual_seed(3), shuffle=True)

    torch.manual_seed(0)
    want = batches(loader(), 1)
    with mesh.activate():
        torch.manual_seed(0)
        got = batches(loader(), 1)
    assert same(got, want)


@pytest.mark.time_limit(120)  # a hang is the defect: the watchdog fails the test with its stacks
@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_a_loader_reaches_the_loop_as_torch_raises_it(mesh, workers):
    with mesh.activate():
        with pytest.raises(ValueError, match="item 5 is broken"):
            for _ in DataLoader(Broken(), batch_size=2, num_workers=workers):
                pass
        bad_collate = DataLoader(list(range(8)), batch_size=4, num_workers=workers,
                                 collate_fn=lambda b: torch.tensor([torch.ones(2) for _ in b]))
        with pytest.raises((ValueError, RuntimeError, TypeError)):
            next(iter(bad_collate))
        assert tdmesh.fetch_shard(torch.ones(2) * 3).result().tolist() == [3.0, 3.0]  # the fleet goes on


def test_a_forked_child_cannot_touch_the_clients_mesh(mesh):
    """A process forked under a mesh (a loader's worker) finds every client closed: a mesh op there raises
    instead of writing into the parent's sockets; the parent's mesh goes on."""
    import multiprocessing

    def child(queue):
        try:
            torch.ones(2) + t  # noqa: B018 - an op on the parent's mesh tensor
            queue.put("ran")
        except Exception as e:  # noqa: BLE001 - what the child met is the result
            queue.put(f"{type(e).__name__}: {e}")

    with mesh.activate():
        t = torch.ones(2)
        queue = multiprocessing.get_context("fork").Queue()
        process = multiprocessing.get_context("fork").Process(target=child, args=(queue,))
        process.start()
        said = queue.get(timeout=60)
        process.join(60)
        assert "this mesh has exited" in said
        assert tdmesh.fetch_shard(t + 1).result().tolist() == [2.0, 2.0]
