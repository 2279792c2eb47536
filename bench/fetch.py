"""Fetching big tensors: ``fetch_shard(t).result()`` vs the socket floor, same run.

    python -m bench.fetch                      # CPU workers, 1, 16, 64 MiB; 1 worker and 2 (a relay)
    python -m bench.fetch --device cuda        # a GPU worker: the fetch includes the device-to-host copy
    python -m bench.fetch --quick              # CI smoke

For each size:
  fetch   ``fetch_shard(t).result()`` of a float32 tensor of that size on the mesh (best of
          ``--repeats`` after a warm-up): the worker's pickle, frame and checksum, the socket, the
          client's read, checksum and unpickle into a tensor.
  floor   a second process sends the same number of bytes, already in memory, over TCP when
          asked; this process reads them into a fresh buffer (no pickling, no checksum, no
          tdmesh): what a fetch could reach on this machine.
  upload  the other way: ``torch.asarray(local)`` of a local tensor of that size under the
          mesh, then a fetch of one element of it (the wait for it to arrive), 1-worker fleet.
  d2h     (``--device cuda``) ``t.cpu()`` of the same tensor in this process: the part of a GPU
          fetch that is the copy off the device.
Ratios are fetch / floor (1.0 = the floor; above 1 = slower).
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402

MIB = 1 << 20


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.fetch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--sizes", default=None, help="MiB, comma-separated (default 1,16,64; 1,4 with --quick)")
    p.add_argument("--workers", default="1,2", help="fleet sizes, comma-separated (2 and more: through a relay)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    return h.parse(p, argv, quick=True, repeats=1, workers="1")


_SIZE = struct.Struct("!Q")


def _recv_into(sock: socket.socket, buf) -> bool:
    view, got = memoryview(buf), 0
    while got < len(buf):
        k = sock.recv_into(view[got:])
        if k == 0:
            return False
        got += k
    return True


def blob_server() -> None:
    """On request (a size), send that many bytes straight from a tensor's memory, as a worker
    sends a fetched tensor (from a ``bytes`` object the same send took twice as long here)."""
    import ctypes

    import torch
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    tensors: dict[int, torch.Tensor] = {}
    request = bytearray(_SIZE.size)
    while _recv_into(conn, request):
        (size,) = _SIZE.unpack(request)
        t = tensors.setdefault(size, torch.ones(size // 4))
        conn.sendall(request)
        conn.sendall((ctypes.c_char * size).from_address(t.data_ptr()))


def floor_seconds(sizes: list[int], repeats: int) -> dict[int, float]:
    env = dict(os.environ, PYTHONPATH=h.REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", "import bench.fetch as f; f.blob_server()"],
                            stdout=subprocess.PIPE, cwd=h.REPO_ROOT, env=env, text=True)
    assert proc.stdout is not None
    sock = socket.create_connection(("127.0.0.1", int(proc.stdout.readline())))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        def fetch(size: int) -> None:
            sock.sendall(_SIZE.pack(size))
            header, data = bytearray(_SIZE.size), bytearray(size)  # a fresh buffer, as a fetch reads into
            assert _recv_into(sock, header) and _recv_into(sock, data) and _SIZE.unpack(header)[0] == size
        return {size: h.best_after_warmup(lambda size=size: fetch(size), repeats) for size in sizes}
    finally:
        sock.close()
        proc.wait(timeout=30)


def fetch_seconds(workers: int, sizes: list[int], repeats: int, device: str) -> tuple[dict, dict]:
    """Per size: seconds of a fetch, and (for one worker) of an upload."""
    import torch

    import tdmesh
    out, up = {}, {}
    with tdmesh.local_mesh(hosts=1, gpus_per_host=workers, pool=False) as mesh, mesh.activate():
        for size in sizes:
            t = torch.arange(size // 4, dtype=torch.float32)
            check = tdmesh.fetch_shard(t).result()
            assert check.device.type == "cpu" and check.numel() == size // 4 and float(check[-1]) == size // 4 - 1
            out[size] = h.best_after_warmup(lambda t=t: tdmesh.fetch_shard(t).result(), repeats)
            if workers == 1:
                with tdmesh.no_mesh.activate():
                    local = torch.arange(size // 4, dtype=torch.float32)
                arrived = tdmesh.fetch_shard(torch.asarray(local)[-1:]).result()
                assert float(arrived[0]) == size // 4 - 1
                up[size] = h.best_after_warmup(
                    lambda local=local: tdmesh.fetch_shard(torch.asarray(local)[-1:]).result(), repeats)
    return out, up


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    h.ensure_importable_by_workers()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ["TDMESH_DEVICE"] = "cpu"
    else:
        os.environ.pop("TDMESH_DEVICE", None)
    sizes = [int(s) * MIB for s in (args.sizes or ("1,4" if args.quick else "1,16,64")).split(",")]
    fleets = [int(w) for w in args.workers.split(",")]
    if args.device == "cuda":
        fleets = [w for w in fleets if w <= torch.cuda.device_count()]
    repeats = 2 if args.quick else args.repeats
    print(f"tdmesh big-fetch bench: float32 tensors on {args.device} workers, best of {repeats} after a warm-up; "
          f"torch {torch.__version__}; {h.machine_line()}", flush=True)
    floor = floor_seconds(sizes, repeats)
    fetched, uploads = {}, {}
    for w in fleets:
        fetched[w], up = fetch_seconds(w, sizes, repeats, args.device)
        uploads.update(up)
    d2h = {}
    if args.device == "cuda":
        for size in sizes:
            t = torch.ones(size // 4, device="cuda")
            d2h[size] = h.best_after_warmup(lambda t=t: (t.cpu(), torch.cuda.synchronize()), repeats)
    rows = []
    for size in sizes:
        row = [f"{size // MIB} MiB", f"{floor[size] * 1e3:.1f} ms ({size / floor[size] / 2**30:.2f} GiB/s)"]
        for w in fleets:
            s = fetched[w][size]
            row.append(f"{s * 1e3:.1f} ms ({size / s / 2**30:.2f} GiB/s) {s / floor[size]:.2f}x")
        if uploads:
            row.append(f"{uploads[size] * 1e3:.1f} ms ({size / uploads[size] / 2**30:.2f} GiB/s) "
                       f"{uploads[size] / floor[size]:.2f}x")
        if d2h:
            row.append(f"{d2h[size] * 1e3:.1f} ms")
        rows.append(row)
    headers = ["size", "floor: raw TCP"] + [f"fetch, {w} worker{'s' * (w > 1)} (vs floor)" for w in fleets]
    headers += ["upload, 1 worker (vs floor)"] if uploads else []
    h.print_table(headers + (["d2h in this process"] if d2h else []), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
