"""A worker's life: pick a device, join the process group, find the client, serve."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..config import cpu_forced, env_float, env_int, env_str, usable_cores
from ..errors import ProtocolViolation
from ..garbage import tune_worker
from ..geometry.fanout import relay_parents, subtree_hosts
from ..protocol import messages as m
from ..protocol.handshake import join
from ..protocol.relay import Relay
from ..protocol.rendezvous import (
    NEXT_JOB,
    SHUTDOWN,
    connect_store,
    job_scope,
    reachable_host,
    read_controller,
    store_address,
)
from ..protocol.schema import check_client_message, record_name
from ..protocol.transport import ProtocolError, RankFilter, connect
from . import builtins, healing
from .interpreter import Interpreter
from .values import DeviceBroken

log = logging.getLogger("tdmesh.worker")


def configure_logging() -> None:
    """tdmesh's worker log goes to stderr, and also to ``TDMESH_LOG_FILE`` when it is set."""
    level = env_str("TDMESH_LOG_LEVEL")
    fmt = "[tdmesh worker %(process)d] %(levelname)s %(message)s"
    logging.basicConfig(level=level, format=fmt)
    path = log_file()
    if path:
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s " + fmt))
        logging.getLogger("tdmesh").addHandler(handler)


def log_file() -> str | None:
    """This worker's ``TDMESH_LOG_FILE`` (``{rank}`` filled in), or None."""
    path = env_str("TDMESH_LOG_FILE")
    return path.replace("{rank}", os.environ.get("RANK", "0")) if path else None


def pick_device() -> torch.device:
    """``cuda:i`` for this rank when CUDA is present (one GPU per worker), else the CPU."""
    if cpu_forced() or not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(env_str("TDMESH_DEVICE_INDEX") or os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def run_worker(attachable: bool = False) -> tuple[int, bool]:
    """Serve one client until it says Exit; returns (exit code, clean).

    Not clean means the client vanished or this worker broke: a stream may be stuck in
    a collective whose peers are dead, so the caller leaves with ``os._exit`` rather than
    waiting in teardown."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    _leave_with_the_client()
    device = pick_device()
    backend = env_str("TDMESH_BACKEND") or ("nccl" if device.type == "cuda" else "gloo")
    store = connect_store()
    # NCCL's world communicator made up front, except where spares share the mesh's GPUs (local_mesh): NCCL
    # refuses two ranks on one device, and no collective of the mesh spans a spare (it is made at a first use)
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" and not env_int("TDMESH_SPARES") else {}
    seed = torch.initial_seed()
    while True:
        began = time.monotonic()
        dist.init_process_group(backend, store=dist.PrefixStore(job_scope() + "/pg", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=env_float("TDMESH_PG_TIMEOUT")),
                                **kwargs)
        log.info("rank %d: process group (%s) ready in %.3f s", rank, backend, time.monotonic() - began)
        if attachable:
            return _serve_attached(rank, world_size, device, store)
        found = read_controller(store)
        if found is None:
            log.info("rank %d: the job ended before a client started", rank)
            dist.destroy_process_group()
            return 0, True
        host, port, token = found
        healing.protect(port)  # the client's connection: a heal must not cut it
        if world_size > 1 and env_str("TDMESH_RELAYS") in ("auto", "1"):
            host, port = _through_relay(store, rank, world_size, (host, port), token)
            healing.protect(port)
        tune_worker()  # what this process holds now lives as long as it does: no full collection scans it
        code, clean, end = _session(rank, device, (host, port), token)
        if type(end) is m.Heal:  # a worker died: the next generation, on the same store (a new connection to it)
            rank, world_size = _rejoin(end, rank)
            store, kwargs = connect_store(), {}
            continue
        if clean:
            dist.destroy_process_group()
        if not (clean and type(end) is m.Detach and env_str("TDMESH_SCOPE")):
            return code, clean
        scope = _park(store, device, seed)  # a local_mesh's warm worker: wait for the next job
        if scope is None:
            return 0, True
        os.environ["TDMESH_SCOPE"] = scope
        kwargs = {}  # a warm worker's NCCL communicator is made at its first collective, not up front


def _forget_session() -> None:
    """The last session's caches go: its groups' info, functions, mirrored graphs and interpreter."""
    from . import backward, collectives, functions
    collectives.clear_group_info()
    functions.clear()
    backward.forget_mirroring()
    Interpreter.current = None  # the last session's interpreter: its recordings, CUDA graphs and their pools
    gc.collect()  # the last session's ref table sits in cycles (streams, threads): free its tensors now


def _rejoin(msg: m.Heal, rank: int) -> tuple[int, int]:
    """After ``Heal`` (``worker/healing.leave`` kept the state): leave the broken generation's process groups
    (their connections are cut: destroying them does not wait) and take this process's rank in the next."""
    dist.destroy_process_group()
    _forget_session()
    ranks = dict(msg.ranks)
    if rank not in ranks:
        raise ProtocolViolation(f"a Heal that gives rank {rank} no place: {msg.ranks}")
    os.environ.update(RANK=str(ranks[rank]), WORLD_SIZE=str(msg.world_size), TDMESH_SCOPE=msg.scope)
    log.info("rank %d: healing: rank %d of %d in %s", rank, ranks[rank], msg.world_size, msg.scope)
    return ranks[rank], msg.world_size


def _park(store, device: torch.device, seed: int) -> str | None:
    """Between two local meshes (tdmesh.fleet.pool): forget the last job's caches, put torch's
    global state back as a fresh process has it, and wait for the next job's scope."""
    _forget_session()
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    scope = store.get(job_scope() + NEXT_JOB).decode()
    return None if scope == SHUTDOWN else scope


DIRECT = "direct"  # a host's relay key when its ranks connect to the client themselves


def _relay_pays(hosts: int, per_host: int) -> bool:
    """Whether a host's relay is worth its hop.  Across hosts it is (each frame crosses the network once
    per host).  On a job of one host it saves the client a send per rank and frame, on a thread of the
    first worker: where the host's ranks and the client outnumber its cores that thread has no core of
    its own and its sends and wake-ups cost the workers more than the client saves (tiny GPT eager,
    2 CPU workers on 2 cores, 7 alternating runs each way: without it the workers' CPU per unit of the
    client's 6% lower in every pair, the step 3% shorter; bench/README twenty-first session);
    so there, under 'auto', every rank connects to the client (a 1x15 layout on 16 cores keeps its relay:
    1.17x the ops/s of direct connections, bench/README fourth session)."""
    if env_str("TDMESH_RELAYS") == "1" or hosts > 1:
        return True
    return per_host + 1 <= usable_cores()


def _through_relay(store, rank: int, world_size: int, client: tuple[str, int], token: str) -> tuple[str, int]:
    """Where this rank connects when hosts relay: its host's relay, which its host's first
    worker (this process, for local rank 0) starts on a thread, or the client itself where that
    worker found the relay not worth its hop (``_relay_pays``: one process decides for its host)."""
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    host, hosts = rank // per_host, world_size // per_host
    key = f"{job_scope()}/relay/{host}"
    if rank % per_host == 0 and not _relay_pays(hosts, per_host):
        store.set(key, DIRECT)
    elif rank % per_host == 0:
        fanout = env_int("TDMESH_FANOUT")
        subtree = subtree_hosts(host, hosts, fanout)
        loopback = client[0] == "127.0.0.1"  # local_mesh: every "host" is this machine
        relay = Relay(host, host * per_host, subtree.stop * per_host, token,
                      bind="127.0.0.1" if loopback else "0.0.0.0",
                      heartbeat_interval=env_float("TDMESH_HEARTBEAT_INTERVAL"),
                      heartbeat_timeout=env_float("TDMESH_HEARTBEAT_TIMEOUT"))
        store.set(key, f"{'127.0.0.1' if loopback else reachable_host()}:{relay.port}")
        healing.protect(relay.port)
        parent = relay_parents(hosts, fanout)[host]
        parent_key = None if parent < 0 else f"{job_scope()}/relay/{parent}"

        def run() -> None:
            try:
                relay.gather(env_float("TDMESH_CONNECT_TIMEOUT"))
                up = client if parent_key is None else _address(store.get(parent_key).decode())
                relay.connect_up(*up)
            except Exception as e:  # noqa: BLE001 - this host's ranks see their connections close
                log.error("host %d's relay could not start: %s", host, e)
                for child in relay.children:
                    child.conn.close()
                relay.listener.close()
                return
            relay.serve()

        threading.Thread(target=run, name="tdmesh-relay", daemon=True).start()
    found = store.get(key).decode()
    return client if found == DIRECT else _address(found)


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def _leave_with_the_client() -> None:
    """Under ``local_mesh`` the client process is this worker's parent.  Once connected, a
    closed connection ends the worker; before that (connecting to the client's store, joining
    the process group) nothing would, and the store connect retries for half an hour: a
    client killed during startup would leave orphans.  So watch the parent from the start."""
    if not env_str("TDMESH_SCOPE"):
        return  # under torchrun the elastic agent owns the worker's life
    parent = os.getppid()

    def leave() -> None:
        log.error("rank %s: the client process is gone; leaving", os.environ.get("RANK"))
        sys.stderr.flush()
        os._exit(env_int("TDMESH_PEER_ERROR_EXIT_CODE"))

    if _store_refuses():  # the client (which hosts the store) died while this process was starting
        leave()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                leave()

    threading.Thread(target=watch, name="tdmesh-client-watch", daemon=True).start()


def _store_refuses() -> bool:
    try:
        socket.create_connection(store_address(), timeout=5).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        pass  # unreachable for now: connect_store decides
    return False


def _serve_attached(rank: int, world_size: int, device: torch.device, store) -> tuple[int, bool]:
    """Serve one attached client after another until one ends the job with Exit."""
    from .attach import publish_job, wait_for_client
    job_token = publish_job(store, rank, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    session = 0
    while True:
        found = wait_for_client(store, job_token, session)
        if found is None:
            dist.destroy_process_group()
            return 0, True
        if found == "bad":
            session += 1
            continue
        host, port, token = found
        tune_worker()  # what this process holds now lives as long as it does: no full collection scans it
        code, clean, end = _session(rank, device, (host, port), token)
        if type(end) is not m.Detach:
            if clean:
                dist.destroy_process_group()
            return code, clean
        gc.collect()  # the detached session's cycles, before the next session's tune_worker freezes what is left
        session += 1


def _session(rank: int, device: torch.device, address: tuple[str, int], token: str) -> tuple[int, bool, Any]:
    """Serve the client at ``address`` (or this host's relay) until it says Exit, Detach or Heal:
    returns (exit code, whether the client ended the session cleanly, the Detach (attach mode, the
    warm pool) or Heal that ended it, else None).  Nothing is read from it before it proves it
    knows the job token."""
    where = f"the tdmesh client (or relay) at {address[0]}:{address[1]}"
    try:
        conn = connect(*address)
        join(conn, token, m.Hello(rank, b"", "", socket.gethostname(), os.getpid(), str(device), log_file()), where)
    except (OSError, ProtocolError) as e:
        log.error("rank %d: %s", rank, e)
        return env_int("TDMESH_SELF_ERROR_EXIT_CODE"), False, None
    send_lock = threading.Lock()

    def send(msg) -> None:  # called from any stream thread
        with send_lock:
            conn.send_messages([msg])

    def stop_reading() -> None:  # a stream thread found this worker broken: end the message loop
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RD)

    interp = Interpreter(rank, device, send, world_size=int(os.environ["WORLD_SIZE"]), threaded=True,
                         on_fatal=stop_reading)
    mine = RankFilter(rank)
    sys.breakpointhook = interp.console.breakpoint
    end_watch = healing.watch(conn, f"{job_scope()}/heal")
    try:
        while interp.exit_request is None:
            payload = conn.recv_payload()
            msgs = None if payload is None else mine.messages(payload)
            if isinstance(interp.fatal, DeviceBroken):
                break
            if interp.fatal is not None:  # a stream stopped on a broken message and woke this loop
                raise interp.fatal
            if msgs is None and healing.pending is not None:  # healing: the old client closed as it should
                healing.leave(interp)
                return 0, True, healing.take_pending()
            if msgs is None:
                log.error("rank %d: the client closed the connection without Exit; leaving", rank)
                return env_int("TDMESH_PEER_ERROR_EXIT_CODE"), False, None
            for msg in msgs:
                check_client_message(msg)
                try:
                    interp.handle(msg)
                except ProtocolViolation:
                    raise
                except Exception as e:  # a well-formed message that its handler still cannot carry out
                    raise ProtocolViolation(f"the client sent a {record_name(msg)} that could not be handled: "
                                            f"{type(e).__name__}: {e}") from e
            if interp.fatal is not None and not isinstance(interp.fatal, DeviceBroken):
                raise interp.fatal
    except Exception as e:  # noqa: BLE001 - each kind of end is told apart in _broken_session
        if healing.wait_for_heal(f"{job_scope()}/healing", 10.0):  # the heal watch cut what this thread waited
            # on, or a dead peer broke it and the client heals the fleet
            healing.leave(interp)
            return 0, True, healing.take_pending()
        return _broken_session(rank, e)
    finally:
        end_watch()
        conn.close()
        interp.last_op.close()
        sys.breakpointhook = sys.__breakpointhook__  # this session's settings end with it (a pooled
        builtins.restore_log_levels()                # or attached worker serves another client next)
    if isinstance(interp.fatal, DeviceBroken):  # reported to the client as WorkerFailed
        log.error("rank %d: %s; the device is unusable, leaving", rank, interp.fatal)
        return env_int("TDMESH_SELF_ERROR_EXIT_CODE"), False, None
    if type(interp.exit_request) in (m.Detach, m.Heal):
        return 0, True, interp.exit_request
    assert type(interp.exit_request) is m.Exit  # the loop ends only on Exit, Detach or Heal here
    if interp.exit_request.error is None:
        return 0, True, None
    if interp.caused_error:
        return env_int("TDMESH_SELF_ERROR_EXIT_CODE"), True, None
    if rank != 0 and not env_str("TDMESH_SCOPE"):
        wait_for_rank_0_to_leave()
    return env_int("TDMESH_PEER_ERROR_EXIT_CODE"), True, None


def _broken_session(rank: int, error: Exception) -> tuple[int, bool, Any]:
    """A session that ended on an error: why, logged, and the worker's exit."""
    if isinstance(error, (ProtocolError, ProtocolViolation)):  # ProtocolError first: it is a ConnectionError too
        log.error("rank %d: leaving: the session broke the protocol: %s", rank, error)
    elif isinstance(error, ConnectionError):
        log.error("rank %d: leaving: the connection to the client failed: %s", rank, error)
    else:  # a stream stopped on an error of its own: the same end
        log.error("rank %d: leaving: a stream stopped on %s: %s", rank, type(error).__name__, error)
    return env_int("TDMESH_SELF_ERROR_EXIT_CODE"), False, None


# Under torchrun rank 0's worker says on the job's store that it is about to exit (with the
# script's own code), just before it does: the other ranks, which leave because the script
# failed, wait for that, then TDMESH_PEER_EXIT_DELAY more, so that rank 0 is the first failure
# torchrun observes and its summary names the script as the root cause.  A fixed delay alone
# lost that race on a loaded machine: the client's own teardown can take longer than it.
RANK_0_LEAVING = "rank_0_leaving"
RANK_0_WAIT_LIMIT = 60.0  # seconds; rank 0 killed before it could say so: the others leave anyway


def say_rank_0_leaves(code: int) -> None:
    """On rank 0 under torchrun, just before it exits: tell the other ranks (best effort)."""
    if env_str("TDMESH_SCOPE") or int(os.environ.get("RANK", "0")) != 0:
        return
    with contextlib.suppress(Exception):  # a store already gone: the other ranks' wait is bounded
        connect_store(timeout=10.0).set(f"{job_scope()}/{RANK_0_LEAVING}", str(code))


def wait_for_rank_0_to_leave() -> None:
    with contextlib.suppress(Exception):  # the limit passed or the store is gone: leave now
        connect_store(timeout=10.0).wait([f"{job_scope()}/{RANK_0_LEAVING}"], timedelta(seconds=RANK_0_WAIT_LIMIT))
    time.sleep(env_float("TDMESH_PEER_EXIT_DELAY"))
