"""The only place a worker creates torch.distributed process groups.

``new_group`` is collective over the whole world unless every rank's group history is
identical (torch's hashed names for ``use_local_synchronization`` depend on how many groups
a rank already has, so sub-mesh traffic would make ranks disagree).  So the client sends
``CreateGroups`` to *every* rank, once per key, and every rank creates every group of the
key in the same order (``grouping.all_groups``), keeping the one it belongs to.  Creation
runs on the worker's message thread, in the client's one global message order.

Why not ``split_group``: in torch 2.11-2.13 it is experimental and NCCL-only (gloo raises),
and on GPUs it would bring nothing ``new_group`` lacks: the worker binds its device in
``init_process_group(device_id=...)``, so every NCCL ``new_group`` is already created by
``ncclCommSplit`` from the world communicator.  On CPU (gloo, 4 workers on 2 cores) a new
key makes its first ``reduce`` + fetch 4-12 ms slower than the second.

Keys: one group set per (stream, mesh, dims), so collectives on different streams never
queue behind each other on one communicator; one per (ref, stream) for the groups users
get from ``mesh.process_group``; one all-ranks group per (from stream, to stream) for P2P.
``tdmesh.checkpoint`` gets groups like a user's, on gloo whatever the device: DCP's plans and
an async save's writing thread go over them, beside the job's NCCL traffic.

Lifetime: every group lives for the worker's session (``Detach``/``Exit`` destroy the world,
and with it every group), except a user's group, which ``RemoteProcessGroup.drop`` ends
early: each stream destroys its own group of that ref once the work queued before the drop
has run there (``destroy_process_group`` is local to this rank; every rank drops, so every
rank's group history stays the same).
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from ..geometry.grouping import all_groups
from ..protocol import messages as m
from . import healing

log = logging.getLogger("tdmesh.worker")


class Groups:
    current: Groups | None = None  # this process's (the latest session's): for work that names a group by id

    def __init__(self, rank: int, world_size: int) -> None:
        Groups.current = self
        self.rank = rank
        self.world_size = world_size
        self._groups: dict = {}
        self._by_id: dict = {}     # CreateGroups.id -> this rank's group, for hot messages
        self._ids: dict = {}       # key -> its CreateGroups.id
        self._dropped: set = set()  # keys of user groups that RemoteProcessGroup.drop destroyed
        self.created = 0

    @staticmethod
    def key(msg: m.CreateGroups) -> tuple:
        if msg.kind == "dims":
            return ("dims", msg.stream, msg.mesh, msg.dims)
        if msg.kind in ("remote", "checkpoint"):  # a checkpoint's: a user group of its own, on gloo
            return ("remote", msg.ref, msg.stream)
        if msg.kind == "p2p":
            return ("p2p", msg.stream, msg.to_stream)
        raise ValueError(f"unknown group kind {msg.kind!r}")

    def create(self, msg: m.CreateGroups) -> None:
        key = self.key(msg)
        if key in self._groups:
            raise RuntimeError(f"process groups {key} were already created on rank {self.rank}")
        if msg.kind == "p2p":
            member_lists = [list(range(self.world_size))]
        else:
            member_lists = all_groups(msg.mesh, msg.dims)
        backend = "gloo" if msg.kind == "checkpoint" else None
        made = healing.interruptible(lambda: [dist.new_group(members, backend=backend,
                                                             group_desc=f"tdmesh:{msg.kind}:s{msg.stream}:{i}")
                                              for i, members in enumerate(member_lists)])
        mine = None
        for members, group in zip(member_lists, made):
            if self.rank in members:
                mine = group
        self._groups[key] = mine  # None where this rank is outside the mesh
        self._by_id[msg.id] = mine
        self._ids[key] = msg.id
        self.created += len(member_lists)
        log.debug("rank %d created %d groups for %s", self.rank, len(member_lists), key)

    def by_id(self, group_id: int):
        group = self._by_id.get(group_id)
        if group is None:
            if group_id in self._by_id:
                raise RuntimeError(f"rank {self.rank} is not a member of process groups {group_id}")
            raise RuntimeError(f"rank {self.rank} has no process groups {group_id}: the client did not create them")
        return group

    def dims(self, stream: int, mesh, dims: tuple):
        return self._lookup(("dims", stream, mesh, dims))

    def remote(self, ref: int, stream: int):
        return self._lookup(("remote", ref, stream))

    def p2p(self, from_stream: int, to_stream: int):
        return self._lookup(("p2p", from_stream, to_stream))

    def torch_mesh(self, stream: int, mesh, device):
        """A torch DeviceMesh over ``mesh``'s dims, built from this stream's per-dim groups."""
        key = ("torch_mesh", stream, mesh)
        found = self._groups.get(key)
        if found is None:
            import torch
            from torch.distributed.device_mesh import DeviceMesh
            groups = [self.dims(stream, mesh, (d,)) for d in mesh.labels]
            ranks = torch.tensor(mesh.ranks(), dtype=torch.int).view(*mesh.slice.sizes)
            found = DeviceMesh.from_group(groups, device.type, mesh=ranks, mesh_dim_names=mesh.labels)
            self._groups[key] = found
        return found

    def streams_of(self, ref: int) -> list[int]:
        """The streams that have the groups of user group ``ref`` (those a drop must reach)."""
        return [key[2] for key in list(self._groups) if key[0] == "remote" and key[1] == ref]

    def drop(self, ref: int, stream: int) -> None:
        """Destroy this rank's group of user group ``ref`` on ``stream`` (run on that stream,
        after the work that used it) and forget the key; later lookups say it was dropped."""
        key = ("remote", ref, stream)
        group = self._groups.pop(key, None)
        self._by_id.pop(self._ids.pop(key, None), None)
        self._dropped.add(key)
        if group is not None:
            dist.destroy_process_group(group)
        log.debug("rank %d dropped the process group of %s", self.rank, key)

    def live(self) -> int:
        """This rank's process groups (besides the world's) that are not destroyed."""
        return sum(1 for group in self._groups.values() if isinstance(group, dist.ProcessGroup))

    def _lookup(self, key):
        try:
            group = self._groups[key]
        except KeyError:
            if key in self._dropped:
                raise RuntimeError(f"rank {self.rank}: process group {key} was dropped") from None
            raise RuntimeError(f"rank {self.rank} has no process group {key}: the client did not create it") from None
        if group is None:
            raise RuntimeError(f"rank {self.rank} is not a member of process group {key}")
        return group
