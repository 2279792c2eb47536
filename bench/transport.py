"""Transport bench: tdmesh's framed TCP sockets against pyzmq, two processes on loopback.

Run from the repository root:

    python -m bench.transport            # full run (about a minute)
    python -m bench.transport --quick    # CI smoke

What it measures (this process is the "client"; a second process, started fresh per
transport, is the "worker"):
  (a) round-trip latency: the client sends an opaque payload of 64 B or 4 KiB, the peer
      sends the same bytes back; median and p99 over many round trips.
  (b) one-way throughput, timed from the first send to the peer's 2-byte acknowledgement:
      - 10,000 pickled CallFunction messages (~180 B each), one message per send; the
        peer unpickles each;
      - the same 10,000 messages concatenated into ~256 KiB batches, as tdmesh's client
        does (tdmesh.engine.client._FLUSH_BYTES); the peer unpickles every message of a batch;
      - 1 MiB opaque payloads (no unpickling).

tdmesh side: ``tdmesh.protocol.transport.Connection`` exactly as the client and workers use it.
zmq side: a PAIR socket pair over tcp://127.0.0.1; payloads of 64 KiB or more are sent and
received with ``copy=False`` (pyzmq's zero-copy path), smaller ones with plain send/recv.
Measurements alternate between the two transports (round by round) so that load from other
work on the machine falls on both columns alike.  pyzmq is optional: without it the zmq
column is skipped.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as ``python bench/transport.py``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402

ZERO_COPY = 65536
ACK = b"ok"


# ------------------------------------------------------------------------- the two transports
class TcpSide:
    name = "tdmesh TCP"

    def __init__(self, conn) -> None:
        self.conn = conn

    @classmethod
    def listen(cls):
        import socket
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        return srv, srv.getsockname()[1]

    @classmethod
    def accept(cls, srv) -> TcpSide:
        from tdmesh.protocol.transport import Connection
        sock, _ = srv.accept()
        return cls(Connection(sock))

    @classmethod
    def connect(cls, port: int) -> TcpSide:
        from tdmesh.protocol.transport import connect
        return cls(connect("127.0.0.1", port))

    def send(self, payload) -> None:
        self.conn.send_payload(payload)

    def recv(self):
        return self.conn.recv_payload()

    def close(self) -> None:
        self.conn.close()


class ZmqSide:
    name = "pyzmq PAIR"

    def __init__(self, ctx, sock) -> None:
        self.ctx = ctx
        self.sock = sock

    @classmethod
    def bind(cls) -> tuple[ZmqSide, int]:
        import zmq
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        return cls(ctx, sock), port

    @classmethod
    def connect(cls, port: int) -> ZmqSide:
        import zmq
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        return cls(ctx, sock)

    def send(self, payload) -> None:
        if len(payload) >= ZERO_COPY:
            self.sock.send(payload, copy=False)
        else:
            self.sock.send(payload)

    def recv(self):
        frame = self.sock.recv(copy=False)
        if len(frame) >= ZERO_COPY:
            return frame.buffer  # a memoryview onto zmq's buffer: no copy
        return frame.bytes

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


# ------------------------------------------------------------------------- the peer process
def serve(kind: str) -> None:
    """The worker side: announce a port on stdout, then obey control messages."""
    import tdmesh.protocol.messages  # noqa: F401  (the CallFunction pickles need it; import before timing)
    from tdmesh.protocol.transport import decode
    if kind == "tcp":
        srv, port = TcpSide.listen()
        print(port, flush=True)
        side = TcpSide.accept(srv)
        srv.close()
    else:
        side, port = ZmqSide.bind()
        print(port, flush=True)
    loads = pickle.loads
    while True:
        cmd = pickle.loads(side.recv())
        op = cmd[0]
        if op == "exit":
            break
        if op == "echo":
            for _ in range(cmd[1]):
                side.send(side.recv())
        elif op == "sink":
            count, mode = cmd[1], cmd[2]
            got = 0
            while got < count:
                payload = side.recv()
                if mode == "single":
                    loads(payload)
                    got += 1
                elif mode == "batched":
                    for _ in decode(payload):
                        got += 1
                else:  # raw
                    got += 1
            side.send(ACK)
        side.send(ACK)  # command done
    side.close()


def start_peer(kind: str):
    env = dict(os.environ)
    env["PYTHONPATH"] = h.REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([sys.executable, "-c", f"import bench.transport as t; t.serve({kind!r})"],
                            stdout=subprocess.PIPE, cwd=h.REPO_ROOT, env=env, text=True)
    port = int(proc.stdout.readline())
    side = TcpSide.connect(port) if kind == "tcp" else ZmqSide.connect(port)
    return proc, side


def command(side, *cmd) -> None:
    side.send(pickle.dumps(cmd))


def finish(side) -> None:
    assert bytes(side.recv()) == ACK


# ------------------------------------------------------------------------- the measurements
def call_function_messages(n: int) -> list[bytes]:
    """``n`` encoded CallFunction messages the size of a small op (~180 B each)."""
    from tdmesh.protocol import messages as m
    from tdmesh.protocol.transport import encode
    return [encode(m.CallFunction(100_000 + i, (200_000 + i,), (), "torch.ops.aten.addmm.default",
                                  (m.Ref(200_000 + i - 3), m.Ref(200_000 + i - 2), m.Ref(200_000 + i - 1)),
                                  {"beta": 0.5, "alpha": 2.0})) for i in range(n)]


def batches(msgs: list[bytes], limit: int = 256 * 1024) -> list[bytes]:
    out, cur, size = [], [], 0
    for b in msgs:
        cur.append(b)
        size += len(b)
        if size > limit:
            out.append(b"".join(cur))
            cur, size = [], 0
    if cur:
        out.append(b"".join(cur))
    return out


def latency(side, size: int, count: int, warm: int) -> list[float]:
    payload = b"x" * size
    command(side, "echo", count + warm)
    for _ in range(warm):
        side.send(payload)
        side.recv()
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        side.send(payload)
        back = side.recv()
        times.append(time.perf_counter() - t0)
    assert len(back) == size
    finish(side)
    return times


def one_way(side, payloads: list, count: int, mode: str) -> float:
    """Seconds to push ``payloads`` (``count`` messages in all) and get the peer's ack."""
    command(side, "sink", count, mode)
    t0 = time.perf_counter()
    for p in payloads:
        side.send(p)
    assert bytes(side.recv()) == ACK
    elapsed = time.perf_counter() - t0
    finish(side)
    return elapsed


def run_all(kinds: list[str], args) -> dict:
    """Every measurement, interleaved across transports (tcp, zmq, tcp, zmq, ...) so that
    load from other work on the machine falls on both columns alike."""
    peers = {}
    try:
        for k in kinds:
            peers[k] = start_peer(k)
        res = {k: {"rtt64": [], "rtt4096": [], "single": [], "batched": [], "big": []} for k in kinds}
        rounds = 10
        per_round = max(1, args.round_trips // rounds)
        for size in (64, 4096):
            for k in kinds:  # warm-up
                latency(peers[k][1], size, 10, max(100, per_round // 10))
            for _ in range(rounds):
                for k in kinds:
                    res[k][f"rtt{size}"] += latency(peers[k][1], size, per_round, 20)
        msgs = call_function_messages(args.messages)
        batched = batches(msgs)
        big = [os.urandom(1 << 20)] * args.mib
        for i in range(args.repeats + 1):  # round 0 warms up
            for name, payloads, count, mode in (("single", msgs, len(msgs), "single"),
                                                ("batched", batched, len(msgs), "batched"),
                                                ("big", big, len(big), "raw")):
                for k in kinds:
                    t = one_way(peers[k][1], payloads, count, mode)
                    if i:
                        res[k][name].append(t)
        for k in kinds:
            res[k].update(msg_size=statistics.mean(len(b) for b in msgs), small_bytes=sum(len(b) for b in msgs),
                          n_batches=len(batched))
            command(peers[k][1], "exit")
    finally:
        for proc, side in peers.values():
            side.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer round trips and messages (CI smoke)")
    p.add_argument("--round-trips", type=int, default=None, help="timed round trips per size (default 5000; 300 quick)")
    p.add_argument("--messages", type=int, default=10_000, help="small messages per throughput run (default 10000)")
    p.add_argument("--mib", type=int, default=None, help="1 MiB payloads per throughput run (default 200; 20 quick)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per throughput test, after a warm-up (default 5)")
    args = h.parse(p, argv, quick=True, round_trips=50, messages=500, mib=2, repeats=1)
    if args.round_trips is None:
        args.round_trips = 300 if args.quick else 5000
    if args.mib is None:
        args.mib = 20 if args.quick else 200
    if args.quick:
        args.messages = min(args.messages, 2000)

    try:
        import zmq
        zmq_version = f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()})"
    except ImportError:
        zmq = None
        zmq_version = None
    print(f"transport bench, two processes on loopback; {h.machine_line()}")
    print(f"  {zmq_version or 'pyzmq is not installed (pip install pyzmq): the zmq column is skipped'}", flush=True)

    kinds = ["tcp"] + (["zmq"] if zmq is not None else [])
    results = run_all(kinds, args)
    tcp = results["tcp"]
    print(f"\n  small messages: {args.messages:,} CallFunction pickles of {tcp['msg_size']:.0f} B on average "
          f"({tcp['small_bytes'] / 1e6:.2f} MB); batched = {tcp['n_batches']} frames of ~256 KiB")
    print(f"  large: {args.mib} x 1 MiB; throughput runs: best and median of {args.repeats} after a warm-up; "
          f"latency: {args.round_trips:,} round trips per size after a warm-up;\n"
          f"  every measurement alternates between the transports\n")

    headers = ["measurement", "tdmesh TCP"] + (["pyzmq PAIR", "zmq / TCP"] if "zmq" in results else [])
    rows = []
    summary = []

    def lat_row(label, key, stat, name):
        vals = {k: stat(r[key]) for k, r in results.items()}
        row = [label, h.fmt_us(vals["tcp"])]
        if "zmq" in vals:
            row += [h.fmt_us(vals["zmq"]), f"{vals['zmq'] / vals['tcp']:.2f}x"]
            summary.append(f"zmq/tcp {name} = {vals['zmq'] / vals['tcp']:.2f}x  "
                           f"({h.fmt_us(vals['zmq'])} vs {h.fmt_us(vals['tcp'])}; lower is better)")
        rows.append(row)

    def tput_row(label, key, nbytes_key, count, pick, name):
        vals = {}
        for k, r in results.items():
            t = pick(r[key])
            nbytes = r[nbytes_key] if isinstance(nbytes_key, str) else nbytes_key
            vals[k] = (nbytes / t / 1e6, count / t)
        def cell(v):
            return f"{v[0]:,.1f} MB/s, {v[1]:,.0f} msg/s"
        row = [label, cell(vals["tcp"])]
        if "zmq" in vals:
            ratio = vals["zmq"][0] / vals["tcp"][0]
            row += [cell(vals["zmq"]), f"{ratio:.2f}x"]
            summary.append(f"zmq/tcp {name} = {ratio:.2f}x  ({vals['zmq'][0]:,.1f} vs {vals['tcp'][0]:,.1f} MB/s; "
                           f"higher is better)")
        rows.append(row)

    for size in (64, 4096):
        lat_row(f"(a) RTT {size} B, median", f"rtt{size}", statistics.median, f"rtt_{size}B_median")
        lat_row(f"(a) RTT {size} B, p99", f"rtt{size}", lambda v: h.percentile(v, 99), f"rtt_{size}B_p99")
    big_bytes = args.mib << 20
    for pick, which in ((min, "best"), (statistics.median, "median")):
        tput_row(f"(b) {args.messages:,} msgs, 1 per send, {which}", "single", "small_bytes", args.messages, pick,
                 f"small_unbatched_{which}")
        tput_row(f"(b) {args.messages:,} msgs, 256 KiB batches, {which}", "batched", "small_bytes", args.messages,
                 pick, f"small_batched_{which}")
        tput_row(f"(b) {args.mib} x 1 MiB, {which}", "big", big_bytes, args.mib, pick, f"1MiB_{which}")
    h.print_table(headers, rows)
    print("\n  ratios are zmq / tdmesh TCP: for RTT lower is better, for MB/s higher is better")
    if summary:
        print("\nsummary:")
        for line in summary:
            print(f"  {line}")
    else:
        t = results["tcp"]
        print(f"\nsummary (tdmesh TCP only):\n  rtt_64B_median = {h.fmt_us(statistics.median(t['rtt64']))}\n"
              f"  1MiB_best = {big_bytes / min(t['big']) / 1e6:,.1f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
