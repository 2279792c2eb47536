"""Getting a mesh: ``local_mesh`` (workers via torch.distributed.elastic) and ``world_mesh`` (torchrun).

``local_mesh(hosts=2, gpus_per_host=4)`` starts ``hosts x gpus_per_host`` worker processes
with ``torch.distributed.elastic.multiprocessing.start_processes`` -- the same machinery
torchrun uses -- each running ``python -m tdmesh.worker --serve`` with torchrun's
environment variables.  Hosts are simulated on this machine.  The calling process is the
client; its c10d ``TCPStore`` is the rendezvous.  ``logging=`` (Monarch's
:class:`LoggingLocation`) says where the workers' output goes: this terminal, or files.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import signal
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from enum import Enum

import torch
from torch.distributed import TCPStore

from .config import cpu_forced, env_int
from .engine.client import Client
from .engine.propagation import warm_up
from .errors import UsageError
from .fleet import pool as warm_pool
from .fleet.job import Fleet, accept_workers, controller_host
from .fleet.processes import SerialProcesses
from .geometry.shape import Shape
from .geometry.slice import Slice
from .mesh import DeviceMesh
from .protocol.rendezvous import ATTACH, connect_store, job_scope, new_token, proof, restart_count, session_token
from .protocol.security import derive, secret_token, warn_if_exposed

__all__ = ["local_mesh", "local_meshes", "world_mesh", "restart_count", "attach", "connect_world", "LoggingLocation"]

_world: DeviceMesh | None = None


class LoggingLocation(Enum):
    """Where a local mesh's workers write their stdout and stderr (Monarch's names):
    ``DEFAULT``, the terminal of the client; ``FILE``, one ``stdout.log`` and one ``stderr.log``
    per worker under ``log_dir`` (a new temporary directory when none is given)."""

    DEFAULT = "default"
    FILE = "file"


def _logging_location(logging: LoggingLocation | None, log_dir: str | None) -> LoggingLocation:
    """``logging=None`` means files when a ``log_dir`` is given (as before ``logging=``), else the terminal."""
    if logging is None:
        return LoggingLocation.FILE if log_dir else LoggingLocation.DEFAULT
    if not isinstance(logging, LoggingLocation):
        raise TypeError(f"logging must be a tdmesh.LoggingLocation (FILE or DEFAULT), got {logging!r}")
    if logging is LoggingLocation.DEFAULT and log_dir:
        raise ValueError(f"logging=LoggingLocation.DEFAULT sends worker logs to this terminal, so log_dir={log_dir!r} "
                         f"would not be used: pass logging=LoggingLocation.FILE to write files there")
    return logging


def _default_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def describe_failures(processes, log_files: dict, dead: list[int] | None = None,
                      rank_of: dict[int, int] | None = None) -> str | None:
    """What the launcher knows of dead workers: rank, pid, exit code or signal, log file; the cause
    first, then the workers the launcher stopped because of it.  Their ranks are added to ``dead``, the
    cause first (what the dashboard shows dead, read without a poll: each poll of torch elastic's
    processes logs their failure again)."""
    result = processes.wait(timeout=0)
    if result is None:
        return None
    if not result.is_failed():
        return "every worker exited"
    # The cause first: torch elastic stamps failures in whole seconds, so the SIGTERMs it sends the survivors
    # once one worker died tie with that death, and rank 0's came first in rank order.
    stopped = -signal.SIGTERM
    order = sorted(result.failures.items(), key=lambda item: (item[1].exitcode == stopped, item[1].timestamp, item[0]))
    causes = [(r, f) for r, f in order if f.exitcode != stopped] or order[:1]
    parts, then = [], []
    for index, f in order:
        rank = rank_of.get(index, index) if rank_of else index  # a healed fleet's ranks changed (fleet/heal.py)
        how = f"killed by signal {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}"
        log = f", log {log_files[index]}" if log_files.get(index) else ""
        who = f"worker rank {rank} (host {socket.gethostname()}, pid {f.pid}{log})"
        if (index, f) in causes:
            parts.append(f"{who} died: {how}")
        else:
            then.append(f"{who} was stopped by the launcher (SIGTERM)")
    if dead is not None:
        dead.extend(r for r in (rank_of.get(i, i) if rank_of else i for i, _ in order) if r not in dead)  # causes first
    return "; ".join(parts) + (f"\nthen: {'; '.join(then)}" if then else "")


def _start_local_fleet(hosts: int, gpus_per_host: int, backend: str | None, logging: LoggingLocation,
                       log_dir: str | None, device_offset: int = 0, supervision=None, controller=None,
                       pool: bool = True, spares: int = 0) -> Fleet:
    """``log_dir=None`` with ``FILE``: a new temporary directory, or warm workers' own.  ``spares``: that many
    more workers, ranks after the mesh's (on a GPU host each shares a mesh rank's device, in turn)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    if hosts < 1 or gpus_per_host < 1:
        raise ValueError(f"local_mesh needs hosts >= 1 and gpus_per_host >= 1, got hosts={hosts}, "
                         f"gpus_per_host={gpus_per_host}")
    if spares < 0:
        raise ValueError(f"local_mesh needs spares >= 0, got {spares}")
    mesh_size = hosts * gpus_per_host
    world = mesh_size + spares
    cuda = torch.cuda.is_available() and not cpu_forced()
    if cuda and device_offset + mesh_size > torch.cuda.device_count():
        raise ValueError(f"local_mesh asks for {mesh_size} GPU workers but only "
                         f"{torch.cuda.device_count() - device_offset} CUDA devices are free")
    backend = backend or ("nccl" if cuda else "gloo")
    run_id = f"tdmesh-{uuid.uuid4().hex[:12]}"
    scope = f"tdmesh/{run_id}"
    # workers inherit this process's environment: only an identical one may reuse parked workers
    # (but torch's first compile-related import sets an inductor cache directory in it)
    inherited = frozenset(kv for kv in os.environ.items() if not kv[0].startswith("TORCHINDUCTOR_"))
    # a warm worker's output stays where it was redirected when it started: only the same logging setup reuses it
    logs = (logging.value, log_dir)
    key = (hosts, gpus_per_host, spares, backend, cuda, device_offset, logs, tuple(sys.path), inherited) if pool \
        else None
    parked = warm_pool.take(key) if key is not None and warm_pool.idle_timeout() > 0 else None
    if parked is not None:
        parked.store.set(parked.scope + warm_pool.NEXT_JOB, scope)  # the parked workers join this job
        return _accept(hosts, gpus_per_host, parked.processes, parked.store, scope, parked.log_files,
                       supervision, controller, key, f"from the warm pool ({hosts} host x {gpus_per_host}, {backend})",
                       cuda, spares)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=1800))
    base_env = {
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(gpus_per_host),
        "TDMESH_STORE": f"127.0.0.1:{store.port}", "TDMESH_SCOPE": scope, "TDMESH_BACKEND": backend,
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    if not cuda:
        base_env["TDMESH_DEVICE"] = "cpu"
    if spares:  # a heal re-connects the workers: each its own connection (a relay would die with its host's first)
        base_env.update(TDMESH_RELAYS="0", TDMESH_SPARES=str(spares))
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does: N workers must not each spin N threads
        base_env["OMP_NUM_THREADS"] = "1"
    # Workers import what the client can: functions travel by import path when they have one.
    paths = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    base_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    envs = {}
    for rank in range(world):
        env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank % gpus_per_host),
                   GROUP_RANK=str(rank // gpus_per_host), TDMESH_DEVICE_INDEX=str(device_offset + rank % mesh_size))
        envs[rank] = env
    to_files = logging is LoggingLocation.FILE
    owned_dir = None
    if to_files and not log_dir:
        log_dir = tempfile.mkdtemp(prefix="tdmesh_logs_")  # kept: the user reads the logs after the run
    elif not to_files:  # torch elastic makes a run directory even when nothing is redirected: one a run, left in /tmp
        log_dir = owned_dir = tempfile.mkdtemp(prefix="tdmesh_elastic_")
    specs = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL if to_files else Std.NONE)
    # torch elastic installs SIGINT/SIGTERM handlers in the calling process and never puts
    # the user's back: keep Ctrl-C a KeyboardInterrupt for the client.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    processes = SerialProcesses(start_processes(name="tdmesh-worker", entrypoint=sys.executable,
                                                args={r: ("-m", "tdmesh.worker", "--serve") for r in range(world)},
                                                envs=envs, logs_specs=specs), owned_dir)
    if threading.current_thread() is threading.main_thread():
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    log_files = {}
    if to_files:
        for rank in range(world):
            log_files[rank] = processes.stderrs.get(rank) if hasattr(processes, "stderrs") else None
    fleet = _accept(hosts, gpus_per_host, processes, store, scope, log_files, supervision, controller, key,
                    f"({hosts} host x {gpus_per_host}, {backend})", cuda, spares)
    fleet.reconnect["spawn"] = _spawner(processes, base_env, log_dir, to_files, device_offset, mesh_size)
    return fleet


def _spawner(processes: SerialProcesses, base_env: dict, log_dir: str | None, to_files: bool, device_offset: int,
             mesh_size: int) -> Callable[[int, int, str], int]:
    """How a heal starts a new worker where no spare is left: one process as the others were started, joining
    generation ``scope`` as ``rank`` of ``world`` directly; returns its index among the fleet's processes."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    def spawn(rank: int, world: int, scope: str) -> int:
        env = dict(base_env, RANK=str(rank), WORLD_SIZE=str(world), TDMESH_SCOPE=scope,
                   LOCAL_RANK=str(rank % int(base_env["LOCAL_WORLD_SIZE"])),
                   TDMESH_DEVICE_INDEX=str(device_offset + rank % mesh_size))
        specs = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL if to_files else Std.NONE)
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        pcontext = start_processes(name="tdmesh-worker", entrypoint=sys.executable,
                                   args={0: ("-m", "tdmesh.worker", "--serve")}, envs={0: env}, logs_specs=specs)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return processes.add(pcontext)
    return spawn


def _accept(hosts, gpus_per_host, processes, store, scope, log_files, supervision, controller, pool_key,
            how: str, cuda: bool, spares: int = 0) -> Fleet:
    """The common end of a local fleet's start: fresh or warm workers connect to a new client."""
    mesh_size = hosts * gpus_per_host
    world = mesh_size + spares
    # torch elastic writes LOG_DIR/RUN_ID/attempt_0/RANK/std{out,err}.log: the folder of every rank's
    log_dir = os.path.dirname(os.path.dirname(log_files[0])) if log_files.get(0) else None
    extra = f" + {spares} spare{'s' if spares > 1 else ''}" if spares else ""
    print(f"tdmesh: {mesh_size} {'GPU' if cuda else 'CPU'} workers{extra} {how}; worker logs: "
          f"{log_dir or 'this terminal'}", file=sys.stderr, flush=True)

    dead: list[int] = []
    ranks: dict[int, int] = {}  # process index -> rank, once a heal changed them

    def failed() -> str | None:
        return describe_failures(processes, log_files, dead, ranks or None)

    try:
        conns, hellos, gate, relays = accept_workers(store, world, host="127.0.0.1", bind="127.0.0.1",
                                                     scope=scope, alive=failed, meanwhile=warm_up)
    except BaseException:
        processes.close()
        raise
    hellos = {r: h._replace(log=log_files.get(r) or h.log) for r, h in hellos.items()}
    client = Client(conns, hellos, log_dir=log_dir, supervision=supervision, controller=controller,
                    process_failure=failed, relays=relays, failed_ranks=lambda: tuple(dead))
    fleet = Fleet(client, processes, store, log_files, gate, pool_key=pool_key, scope=scope,
                  spares=tuple(range(mesh_size, world)))
    fleet.reconnect = dict(host="127.0.0.1", bind="127.0.0.1", alive=failed, log_dir=log_dir, process_failure=failed,
                           failed_ranks=lambda: tuple(dead), process_ranks=ranks, dead=dead)
    return fleet


def _mesh_for(fleet: Fleet, hosts: int, gpus_per_host: int) -> DeviceMesh:
    """The fleet's mesh: ranks ``0..hosts*gpus_per_host-1``; the fleet's spares (the ranks after) stay outside."""
    mesh = DeviceMesh(Shape(("host", "gpu"), Slice.new_row_major([hosts, gpus_per_host])), fleet.client, fleet=fleet)
    fleet.mesh = mesh
    return mesh


@contextlib.contextmanager
def local_mesh(hosts: int = 1, gpus_per_host: int | None = None, *, backend: str | None = None,
               logging: LoggingLocation | None = None, log_dir: str | None = None, supervision=None,
               controller=None, pool: bool = True, spares: int = 0) -> Iterator[DeviceMesh]:
    """A mesh of ``hosts x gpus_per_host`` worker processes on this machine.

    ``gpus_per_host=None`` means the visible CUDA devices, or 2 CPU workers without CUDA.
    ``pool``: take warm workers a finished mesh of the same shape left (:mod:`tdmesh.fleet.pool`),
    and leave this one's warm when it exits cleanly; ``False`` starts and stops fresh ones.
    ``logging``: ``LoggingLocation.DEFAULT`` leaves the workers' output on this terminal;
    ``LoggingLocation.FILE`` writes each worker's stdout and stderr to files under ``log_dir``
    (a new temporary directory if it is None); left out, it is FILE when ``log_dir`` is given.
    The startup line says where the logs are.  Leaving the block shuts the fleet down and
    raises any remote error nobody observed.  ``spares``: that many more worker processes, started,
    connected and authenticated like the others but outside the mesh (ranks after its own), ready to
    take a dead worker's place (``tdmesh.FaultTolerance``).
    """
    with local_meshes(1, hosts, gpus_per_host, backend=backend, logging=logging, log_dir=log_dir,
                      supervision=supervision, controller=controller, pool=pool, spares=spares) as meshes:
        yield meshes[0]


@contextlib.contextmanager
def local_meshes(meshes: int = 2, hosts_per_mesh: int = 1, gpus_per_host: int | None = None, *,
                 backend: str | None = None, logging: LoggingLocation | None = None, log_dir: str | None = None,
                 supervision=None, controller=None, pool: bool = True,
                 spares: int = 0) -> Iterator[list[DeviceMesh]]:
    """Several independent fleets at once; a failure in one leaves the others usable.  With
    ``log_dir`` and more than one mesh, mesh ``i`` logs under ``log_dir/mesh<i>``."""
    location = _logging_location(logging, log_dir)
    gpus = _default_gpus() if gpus_per_host is None else gpus_per_host
    if gpus < 1:
        gpus = 2
    fleets: list[Fleet] = []
    try:
        for i in range(meshes):
            sub_dir = os.path.join(log_dir, f"mesh{i}") if log_dir and meshes > 1 else log_dir
            offset = i * hosts_per_mesh * gpus if torch.cuda.is_available() else 0
            fleets.append(_start_local_fleet(hosts_per_mesh, gpus, backend, location, sub_dir, offset, supervision,
                                             controller, pool, spares))
        result = [_mesh_for(f, hosts_per_mesh, gpus) for f in fleets]
    except BaseException:
        for f in fleets:
            f.exit("startup failed")
        raise
    try:
        yield result
    except BaseException as e:
        for f in fleets:
            with contextlib.suppress(Exception):
                f.exit(f"the client raised {type(e).__name__}: {e}", client_raised=True)
        raise
    errors = []
    for f in fleets:
        try:
            f.exit()
        except Exception as e:  # noqa: BLE001 - raise the first unobserved error after every fleet is down
            errors.append(e)
    if errors:
        raise errors[0]


def world_mesh() -> DeviceMesh:
    """Inside a script run by ``torchrun -m tdmesh.worker``: the mesh of every rank."""
    if _world is None:
        raise UsageError("tdmesh.world_mesh() only works in a script launched as\n"
                           "  torchrun --nproc_per_node N -m tdmesh.worker script.py\n"
                           "elsewhere, start workers with `with tdmesh.local_mesh(hosts=1, gpus_per_host=N) as mesh:`")
    return _world


def connect_world() -> Fleet:
    """In rank 0's client process: accept every torchrun rank's worker."""
    global _world
    world = int(os.environ["WORLD_SIZE"])
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    store = connect_store()
    warn_if_exposed(world, per_host)
    hosts, gpus, spares = _world_shape(world, per_host, env_int("TDMESH_SPARES"))
    conns, hellos, gate, relays = accept_workers(store, world, host=controller_host(), bind="0.0.0.0",
                                                 meanwhile=warm_up)
    fleet = Fleet(Client(conns, hellos, relays=relays), store=store, gate=gate,
                  spares=tuple(range(world - spares, world)), scope=job_scope())
    fleet.reconnect = dict(host=controller_host(), bind="0.0.0.0")  # a heal's new client (fleet/heal.py)
    _world = _mesh_for(fleet, hosts, gpus)
    return fleet


def _world_shape(world: int, per_host: int, spares: int) -> tuple[int, int, int]:
    """(hosts, ranks per host, spares) of a torchrun job's mesh: the last ``spares`` ranks stay outside it."""
    kept = world - spares
    if spares < 0 or kept < 1:
        raise UsageError(f"TDMESH_SPARES={spares} must leave at least one of the job's {world} ranks in the mesh")
    if kept % per_host == 0:
        return kept // per_host, per_host, spares
    if world == per_host:  # one host: its first ranks
        return 1, kept, spares
    raise UsageError(f"TDMESH_SPARES={spares} leaves {kept} ranks, not whole hosts of {per_host}: on several hosts "
                     f"keep whole hosts' ranks as spares (a multiple of --nproc_per_node)")


@contextlib.contextmanager
def attach(endpoint: str, token: str | None = None, *, supervision=None, controller=None,
           timeout: float = 120.0) -> Iterator[DeviceMesh]:
    """Drive a fleet that ``torchrun ... -m tdmesh.worker`` (no script) keeps serving.

    ``endpoint`` is the job's c10d store (``MASTER_ADDR:MASTER_PORT``) and ``token`` the job
    token, both printed by rank 0 when the fleet starts; with ``TDMESH_SECRET`` (or
    ``TDMESH_SECRET_FILE``) set here as on the fleet's ranks, leave ``token`` out: it is
    derived from the secret.  A wrong token is a PermissionError; the fleet keeps serving.
    Leaving the block detaches: the workers wait for the next client.  ``mesh.exit()``
    inside the block ends the job instead.
    """
    host, port = endpoint.rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
    scope = store.get(ATTACH + "/current").decode()
    source = "the token passed"
    if token is None:
        token = secret_token(f"{scope}|{store.get(scope + '/run').decode()}")
        if token is None:
            raise UsageError(f"tdmesh.attach({endpoint!r}) needs the job token: pass token=... (rank 0 printed "
                             f"it), or set TDMESH_SECRET / TDMESH_SECRET_FILE as on the fleet's ranks")
        source = "the token derived from this process's TDMESH_SECRET"
    salt, check = store.get(scope + "/check").decode().split("|")
    if not hmac.compare_digest(check, derive(token, "tdmesh-check", salt)):
        raise PermissionError(f"wrong token for the tdmesh fleet at {endpoint}: {source} is not the fleet's")
    world, per_host = (int(v) for v in store.get(scope + "/world").decode().split(","))
    session = store.add(scope + "/sessions", 1) - 1

    def announce(my_host: str, my_port: int) -> tuple[str, Callable[[], None]]:
        salt = new_token()
        signature = proof(token, session, my_host, my_port, salt)
        return session_token(token, session, salt), lambda: store.set(
            f"{scope}/{session}/controller", f"{my_host}|{my_port}|{salt}|{signature}")

    conns, hellos, gate, relays = accept_workers(store, world, host=controller_host(), bind="0.0.0.0",
                                                 announce=announce, timeout=timeout)
    fleet = Fleet(Client(conns, hellos, supervision=supervision, controller=controller, relays=relays), store=store,
                  gate=gate)
    mesh = _mesh_for(fleet, world // per_host, per_host)
    try:
        yield mesh
    except BaseException:
        fleet.exit(detach=True)
        raise
    fleet.exit(detach=True)
