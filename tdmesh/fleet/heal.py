"""A fleet re-formed around a dead worker (``tdmesh.FaultTolerance``): the same processes, a new generation.

The broken session cannot be mended in place: the client's history, its sticky failure and every process
group of the workers span the dead rank.  So a heal starts a new session on the processes that live, as
the warm pool starts a new job on parked workers (``fleet/pool.py``): the old client sends ``Heal`` to
every live worker (each leaves at once, keeping its tensors: ``worker/healing.py``), a spare takes the
dead rank's number, and the workers form a fresh world process group under a new scope of the same c10d
store (torchft's way: a new generation, only live members; no collective ever runs over a dead world)
and connect to a new client.  The caller (``tdmesh/fault_tolerance.py``) then restores the state and
points the user's meshes at the new client.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import time
from collections.abc import Sequence

from ..engine.client import Client
from ..errors import DeviceException
from ..protocol import messages as m
from ..protocol.transport import encode
from .job import Fleet, accept_workers

log = logging.getLogger("tdmesh")

__all__ = ["reform", "NoReplacement"]


class NoReplacement(DeviceException):
    """No spare is left to take a dead worker's place."""


def reform(fleet: Fleet, lost: Sequence[int], timeout: float = 120.0,
           shrink_to: Sequence[int] | None = None) -> tuple[dict[int, str], dict[str, float]]:
    """Replace the ``lost`` ranks of ``fleet`` by spares (by new processes when none is left and the launcher
    can start one) and connect a new client; returns ({mesh rank: what replaced it}, seconds spent releasing
    the survivors and re-forming).  ``shrink_to``: no replacement; the new mesh is these live ranks, in this
    order (numbered from 0), every other live worker a spare after them."""
    old = fleet.client
    lost = sorted(set(lost))
    if shrink_to is not None:
        return _shrink(fleet, lost, list(shrink_to), timeout)
    spares = [s for s in fleet.spares if s not in lost]
    mesh_size = len(old.ranks) - len(fleet.spares)
    dead = [r for r in lost if r < mesh_size]
    spawn = fleet.reconnect.get("spawn")
    if len(spares) < len(dead) and spawn is None:
        raise NoReplacement(f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} died and "
                            f"{len(spares) or 'no'} spare{'s are' if len(spares) != 1 else ' is'} left: start the "
                            f"mesh with more (local_mesh(spares=k), TDMESH_SPARES=k under torchrun)")
    take = dict(zip(dead, spares))
    fresh = [r for r in dead if r not in take]  # no spare left for these: a new process each
    ranks = {r: r for r in old.ranks if r < mesh_size and r not in lost}
    ranks.update((spare, rank) for rank, spare in take.items())
    rest = [s for s in spares if s not in take.values()]
    ranks.update((s, mesh_size + i) for i, s in enumerate(rest))
    replaced, phases = _next_generation(fleet, lost, ranks, mesh_size + len(rest), fresh, timeout)
    replaced.update((rank, f"a spare (pid {fleet.client.hellos[rank].pid})") for rank in take)
    return replaced, phases


def _shrink(fleet: Fleet, lost: list[int], keep: list[int], timeout: float):
    old = fleet.client
    live = [r for r in old.ranks if r not in lost]
    order = keep + [r for r in live if r not in keep]
    ranks = {r: i for i, r in enumerate(order)}
    replaced, phases = _next_generation(fleet, lost, ranks, len(order), [], timeout)
    fleet.spares = tuple(range(len(keep), len(order)))
    replaced.update((r, f"nothing: the mesh shrank to {len(keep)} ranks") for r in lost)
    return replaced, phases


def _next_generation(fleet: Fleet, lost: list[int], ranks: dict[int, int], world: int, fresh: list[int],
                     timeout: float) -> tuple[dict[int, str], dict[str, float]]:
    """Every live worker leaves the broken session and takes its rank in ``ranks`` of the next generation
    (``fresh``: ranks a new process takes); a new client accepts them all."""
    old = fleet.client
    spawn = fleet.reconnect.get("spawn")
    began = time.monotonic()
    _make_sure_dead(fleet, lost)
    if fleet.processes is not None and hasattr(fleet.processes, "forgiven"):
        fleet.processes.forgiven.update(fleet.process_of[r] for r in lost)
    current = fleet.scope if fleet.generation == 0 else f"{fleet.scope}/heal{fleet.generation}"
    fleet.generation += 1
    scope = f"{fleet.scope}/heal{fleet.generation}"
    heal = m.Heal(scope, tuple(sorted(ranks.items())), world)
    # Every live worker leaves the broken session now (ops still queued there are dropped): told on its
    # connection, and in the store, which a watch thread of each reads where the message thread is blocked
    # (creating a process group with the dead rank: waiting in the store for its address).
    fleet.store.set(f"{current}/heal", pickle.dumps(heal))
    with old.lock:  # to the live only: a send to a dead one waits for the launcher to say how it died
        old.conns = {key: conn for key, conn in old.conns.items() if key not in lost}
        old.outbox.put_all(encode(heal))
        old.flush()
    started = {rank: spawn(rank, world, scope) for rank in fresh} if fresh and spawn is not None else {}
    released = time.monotonic()
    if fleet.gate is not None:
        fleet.gate.close()
    args = fleet.reconnect
    conns, hellos, gate, relays = accept_workers(fleet.store, world, host=args["host"], bind=args["bind"],
                                                 scope=scope, alive=args.get("alive", lambda: None),
                                                 timeout=timeout)
    client = Client(conns, hellos, log_dir=args.get("log_dir"), supervision=old.supervision,
                    controller=old.controller, process_failure=args.get("process_failure"), relays=relays,
                    failed_ranks=args.get("failed_ranks"))
    client.next_ref = old.next_ref  # the state's refs keep their numbers; new ones never collide with them
    with contextlib.suppress(Exception):
        old.shutdown()
    fleet.process_of = {new: fleet.process_of[rank] for rank, new in ranks.items()} | started
    if "dead" in args:
        args["dead"].clear()  # healed: the dashboard shows the new rank, not the dead one
    process_ranks = args.get("process_ranks")
    if process_ranks is not None:  # how the launcher names a process that dies from now on
        process_ranks.clear()
        process_ranks.update((index, rank) for rank, index in fleet.process_of.items())
    fleet.log_files = {new: fleet.log_files[rank] for rank, new in ranks.items() if rank in fleet.log_files}
    fleet.client, fleet.gate, fleet.pool_key = client, gate, None  # a healed fleet is never parked
    fleet.store.set(f"{scope}/healing", "1")  # the workers of this generation: an error may be a dead peer's
    mesh_size = len(old.ranks) - len(fleet.spares)
    fleet.spares = tuple(range(mesh_size, world))
    log.info("tdmesh: healed %s in %s", ranks, scope)
    replaced = {rank: f"a new process (pid {client.hellos[rank].pid})" for rank in started}
    return replaced, {"release": released - began, "re-form": time.monotonic() - released}


def _make_sure_dead(fleet: Fleet, lost: Sequence[int]) -> None:
    """A rank the client lost (a missed heartbeat, a broken connection) may still run: stop its process,
    so that it never writes anything again (local fleets; under torchrun its agent's is not ours to kill)."""
    processes = fleet.processes
    for rank in lost:
        pid = processes.pid(fleet.process_of[rank]) if processes is not None and hasattr(processes, "pid") else None
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
