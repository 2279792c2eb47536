"""What a heal needs to know about the mesh, apart from running it (``fault_tolerance.FaultTolerance``): which
ranks died, where a dead rank's state has a live replica, which ranks a shrunk mesh keeps, whether the state
is the same along the replicated dims, and, once a new session stands, which client the user's meshes talk to
and which of their tensors were lost.
"""

from __future__ import annotations

import gc

from .engine.tensor import RefOwner
from .errors import DeviceException, UsageError
from .mesh import DeviceMesh

__all__ = ["lost_ranks", "replica_of", "kept_when_shrinking", "check_replicas", "repoint"]


def lost_ranks(fleet) -> list[int]:
    """The ranks that died: those the client lost, and those whose process the launcher saw die."""
    client = fleet.client
    lost = set(client.observations.lost_ranks) & set(client.ranks)
    processes = fleet.processes
    if processes is not None and getattr(processes, "tolerant", False):
        result = processes.wait(timeout=0)
        if result is not None:
            of = {p: r for r, p in fleet.process_of.items()}
            lost.update(of[p] for p in result.failures if p in of)
    return sorted(lost)


def replica_of(mesh: DeviceMesh, dims: tuple[str, ...], rank: int, lost: list[int]) -> int | None:
    """A live rank holding ``rank``'s state: along the replicated ``dims``, the first not lost."""
    shape = mesh.shape
    fixed = {d: c for d, c in shape.coordinates(rank).items() if d not in dims}
    for candidate in shape.index(**fixed).ranks():
        if candidate not in lost:
            return candidate
    return None


def kept_when_shrinking(mesh: DeviceMesh, dims: tuple[str, ...], dead: list[int],
                        cause: str) -> tuple[list[int], list[int]]:
    """The ranks of the smaller mesh and its sizes: every rank but those at the dead ranks' places along the
    replicated dim (on a mesh of more dims, the dead rank's whole replica drops out; its live ranks become
    spares)."""
    if len(dims) != 1:
        raise DeviceException(f"rank {dead[0]} died ({cause}) and no spare is left: shrinking needs one "
                              f"replicated dim, not {dims}")
    dim = dims[0]
    gone = {mesh.shape.coordinates(r)[dim] for r in dead}
    keep = [r for r in mesh.rank_list if mesh.shape.coordinates(r)[dim] not in gone]
    if not keep:
        raise DeviceException(f"rank {dead[0]} died ({cause}): no rank of the mesh is left to shrink to")
    return keep, [mesh.sizes[d] - (len(gone) if d == dim else 0) for d in mesh.names]


def check_replicas(mesh: DeviceMesh, dims: tuple[str, ...], paths: list[str], digests: dict) -> None:
    """The state must be the same along the replicated dims (a heal copies a replica's to the new rank): each
    tensor's digest on every rank (``digests``), compared; one that differs is refused, named."""
    for rank in mesh.rank_list:
        replica = replica_of(mesh, dims, rank, [rank])
        if replica is None:
            continue
        for i, (mine, theirs) in enumerate(zip(digests[rank], digests[replica], strict=True)):
            if mine != theirs:
                raise UsageError(f"FaultTolerance(replicated={', '.join(dims)!r}): {paths[i]} differs between ranks "
                                 f"{min(rank, replica)} and {max(rank, replica)}; a heal would give a new rank "
                                 f"another rank's value.  Keep per-rank values out of the state (make them in "
                                 f"the step), or name only the dims the state is the same along")


def repoint(fleet, client, kept: set[int], step: int) -> None:
    """The fleet's meshes now talk to the new ``client``; tensors of the old session outside the state
    (``kept``, by ref) are lost, and using one says so at the user's line."""
    text = (f"was lost when tdmesh healed the fleet (step {step}): only FaultTolerance's state survives a heal "
            f"(and what the steps it ran again returned); compute it again")
    for obj in gc.get_objects():
        if type(obj) is DeviceMesh and obj.fleet is fleet:
            obj.client = client
        elif type(obj) is RefOwner and obj.id not in kept and getattr(obj.mesh, "fleet", None) is fleet:
            obj.dropped_at = text  # type: ignore[assignment]
