"""The code around the model on a mesh, against the same code without one, same run (issue 53's targets).

    python -m bench.ecosystem                  # DataLoader loops and GPT-2 124M's from_pretrained, 1x2 CPU mesh
    python -m bench.ecosystem --rounds 9 --model-size tiny

(1) DataLoader loops: one epoch of a loader whose items are made with torch calls (``torch.tensor`` of Python
    data, a normalisation), batches of 32, ``num_workers`` 0 and 2; without a mesh and under an active one
    (``tdmesh.interop.data``: iteration as plain torch), rounds interleaved, the median of each round's ratio.
    Then the pattern that trains on a mesh from a loader: each batch shipped with ``tdmesh.to_mesh`` (and a
    fetch at the end), against the loop alone plus the socket floor of the same bytes (``bench.fetch``'s raw
    TCP between two processes, once per rank: without relays every rank's connection carries them); and one
    batch shipped alone, by its size, against the floor of its bytes.
(2) ``from_pretrained`` of a GPT-2 (124M parameters by default: ``GPT2Config()``, random weights saved to a
    temporary folder) onto a 1x2 CPU mesh, against a local ``from_pretrained`` plus the upload floor of its
    bytes (the same raw TCP floor) for each copy sent: one per rank where every rank connects to the client
    (``TDMESH_RELAYS=0``, this VM's default: it has no core for each rank), one per host through the host's
    relay (``TDMESH_RELAYS=1``, the default where a host has a core for each rank).  Target: at most 1.5x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402


class Items:
    """A dataset as most are: Python data turned into tensors in ``__getitem__``, then normalised."""

    def __init__(self, n: int, width: int) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import torch
        x = torch.tensor([float((i * 7 + j) % 13) for j in range(self.width)])
        return (x - x.mean()) / (x.std() + 1e-6), i % 10


def _epoch(loader, ship=None) -> float:
    start = time.perf_counter()
    last = None
    for x, y in loader:
        last = ship((x, y)) if ship is not None else x
    if ship is not None:
        import tdmesh
        tdmesh.fetch_shard(last[0][:1, :1]).result()  # every shipped batch has arrived
    return time.perf_counter() - start


def loaders(mesh, items: int, width: int, rounds: int) -> None:
    import torch
    from torch.utils.data import DataLoader

    import tdmesh
    dataset = Items(items, width)
    rows = []
    for workers in (0, 2):
        loader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=workers,
                            persistent_workers=workers > 0, generator=torch.Generator().manual_seed(0))
        _epoch(loader)
        with mesh.activate():
            _epoch(loader)
        plain, meshed, ratios = [], [], []
        for _ in range(rounds):
            a = _epoch(loader)
            with mesh.activate():
                b = _epoch(loader)
            plain.append(a)
            meshed.append(b)
            ratios.append(a / b)
        rows.append([str(workers), f"{statistics.median(plain) * 1e3:.1f}", f"{statistics.median(meshed) * 1e3:.1f}",
                     f"{statistics.median(ratios):.3f}x", f"{min(ratios):.3f}-{max(ratios):.3f}"])
    print(f"\n(1) DataLoader: one epoch of {items} items of {width} floats, batches of 32, {rounds} rounds interleaved")
    h.print_table(["num_workers", "no mesh ms", "under a mesh ms", "speed vs no mesh (median)", "range"], rows)

    from bench.fetch import floor_seconds
    loader = DataLoader(dataset, batch_size=32, num_workers=0)
    batch_bytes = sum(x.numel() * x.element_size() + y.numel() * y.element_size() for x, y in loader)
    ranks = len(mesh.rank_list)
    floor = floor_seconds([batch_bytes], 3)[batch_bytes] * ranks
    with mesh.activate():
        alone = min(_epoch(loader) for _ in range(3))
        shipped = min(_epoch(loader, lambda batch: tdmesh.to_mesh(batch, mesh)) for _ in range(3))
    print(f"    shipped to the mesh each step (tdmesh.to_mesh): {shipped * 1e3:.1f} ms an epoch; the loop alone "
          f"{alone * 1e3:.1f} ms + the socket floor of its {batch_bytes / 2**20:.2f} MiB to {ranks} ranks "
          f"{floor * 1e3:.1f} ms = {(alone + floor) * 1e3:.1f} ms: {shipped / (alone + floor):.2f}x "
          f"({len(loader)} batches: {(shipped - alone) / len(loader) * 1e6:.0f} us a batch over the loop)")


def ship_sizes(mesh, shapes: list[tuple], repeats: int) -> None:
    """One batch a step shipped with ``tdmesh.to_mesh``, alone, by its size, against the socket floor of its
    bytes to every rank: a small batch pays the op's fixed cost, a batch of images goes at the floor."""
    import torch

    import tdmesh
    from bench.fetch import floor_seconds
    ranks = len(mesh.rank_list)
    rows = []
    for shape in shapes:
        batch = torch.randn(*shape)
        nbytes = batch.numel() * batch.element_size()
        floor = floor_seconds([nbytes], repeats)[nbytes] * ranks

        def ship(batch: torch.Tensor = batch, n: int = 10) -> None:
            for _ in range(n):
                last = tdmesh.to_mesh(batch, mesh)
            tdmesh.fetch_shard(last.view(-1)[:1]).result()

        with mesh.activate():
            seconds = h.best_after_warmup(ship, repeats) / 10
        rows.append([str(tuple(shape)), f"{nbytes / 2**20:.2f}", f"{seconds * 1e3:.2f}", f"{floor * 1e3:.2f}",
                     f"{seconds / floor:.2f}x"])
    print(f"    one batch shipped (tdmesh.to_mesh, 10 in a row, best of {repeats}) against the raw TCP floor of its "
          f"bytes to {ranks} ranks:")
    h.print_table(["batch", "MiB", "ship ms", "floor ms", "ship / floor"], rows)


def pretrained(size: str, repeats: int, relay_settings: list[str]) -> None:
    import torch
    import transformers

    import tdmesh
    from bench.fetch import floor_seconds
    config = transformers.GPT2Config() if size == "gpt2" else transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0)
    folder = tempfile.mkdtemp(prefix="tdmesh-bench-hf-")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    del model

    def local() -> None:
        transformers.GPT2LMHeadModel.from_pretrained(folder)

    local_s = h.best_after_warmup(local, repeats)
    floor_one = floor_seconds([nbytes], repeats)[nbytes]
    print(f"\n(2) GPT2LMHeadModel.from_pretrained, {params / 1e6:.1f}M parameters ({nbytes / 2**20:.0f} MiB), best of "
          f"{repeats} after a warm-up; local {local_s:.2f} s (safetensors maps the file: bytes are read when used); "
          f"the upload floor of its bytes once (raw TCP) {floor_one:.2f} s")
    rows = []
    for relays in relay_settings:  # "0": each rank its own copy (this VM's default: no core a rank); "1": a host
        os.environ["TDMESH_RELAYS"] = relays
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2, pool=False) as mesh:
            ranks = len(mesh.rank_list)

            def on_mesh() -> None:
                with mesh.activate():
                    m = transformers.GPT2LMHeadModel.from_pretrained(folder)
                    tdmesh.fetch_shard(m.lm_head.weight[:1, :1]).result()  # on every rank

            mesh_s = h.best_after_warmup(on_mesh, repeats)
        copies = ranks if relays == "0" else 1
        floor = floor_one * copies
        rows.append([f"TDMESH_RELAYS={relays}", f"{copies}", f"{mesh_s:.2f}", f"{local_s + floor:.2f}",
                     f"{mesh_s / (local_s + floor):.2f}x"])
    os.environ.pop("TDMESH_RELAYS", None)
    h.print_table(["1x2 CPU mesh", "copies sent", "onto the mesh s", "local + floor s",
                   "mesh / (local + floor) (target <= 1.5x)"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ecosystem", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=4096, help="items in the loader's dataset")
    p.add_argument("--width", type=int, default=256, help="floats an item")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ship-shapes", default="32x256,32x3x64x64,32x3x224x224",
                   help="batches shipped alone against the floor, comma-separated")
    p.add_argument("--relays", default="0,1", help="TDMESH_RELAYS settings to load under, comma-separated")
    p.add_argument("--model-size", choices=("gpt2", "tiny"), default="gpt2")
    p.add_argument("--repeats", type=int, default=3)
    args = h.parse(p, argv, items=128, width=16, rounds=1, model_size="tiny", repeats=1,
                   ship_shapes="32x256", relays="0")
    os.environ.setdefault("TDMESH_DEVICE", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    h.ensure_importable_by_workers()
    import torch

    import tdmesh
    torch.set_num_threads(1)
    print(f"{h.machine_line()}; torch {torch.__version__}")
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
        loaders(mesh, args.items, args.width, args.rounds)
        ship_sizes(mesh, [tuple(int(d) for d in s.split("x")) for s in args.ship_shapes.split(",")], args.repeats)
    pretrained(args.model_size, args.repeats, args.relays.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
