"""``tdmesh.FaultTolerance``: a training step that survives a worker's death, healed without a restart.

    ft = tdmesh.FaultTolerance(mesh, {"model": model, "opt": opt}, replicated="gpu")
    for batch in data:
        loss = ft.step(train_step, batch)

``ft.step(fn, ...)`` runs one step.  Its first op copies the state's mesh tensors on each worker
(``worker/healing.stash``) and the client notes the rest (``step_state.StepState``); as the step ends it
waits for every op of it and fetches each worker's generator states.  If a worker dies in the step (killed,
``os._exit``, a broken device, a missed heartbeat) the step's futures fail at once and the controller heals:
the survivors leave the broken session, a spare takes the dead rank's number and every process group is
formed again (``fleet/heal.py``), every rank's state goes back to the step's start — the new rank's copied
from a replica along ``replicated`` — with the generators, and ``fn`` runs again.  A healed job ends bit
for bit as the job without the fault.  Tensors that were not in the state (the failed step's activations,
an old loss) are lost: using one raises at the user's line.  The controller's own death stays fatal: resume
from a checkpoint (``tdmesh.checkpoint``) there.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from torch.utils._pytree import tree_leaves

from . import checkpoint
from .engine.fetch import send_value
from .engine.tensor import RefOwner, Tensor, describe
from .errors import DeviceException, RemoteException, UsageError
from .fleet.heal import reform
from .geometry.shape import Shape
from .geometry.slice import Slice
from .mesh import DeviceMesh
from .remote import Remote, call_remote
from .step_state import StepState

__all__ = ["FaultTolerance", "HealRecord"]

_stash = Remote("tdmesh.worker.healing.stash", propagate=lambda *a: None)
_RESTORE = "tdmesh.worker.healing.restore"
_RNG = "tdmesh.worker.healing.rng_bundle"
_FINGERPRINTS = "tdmesh.worker.healing.fingerprints"


class HealRecord(NamedTuple):
    """One heal: the mesh rank that died, why, what took its place (a spare or a new process, with its pid, or
    nothing where the mesh shrank), the seconds from the failure seen to the step running again, the step
    (``ft.steps`` then), and that time's parts."""
    rank: int
    cause: str
    replaced_by: str
    seconds: float
    step: int
    phases: dict
    seen_at: float  # time.monotonic() when the client saw the failure: a bench adds the time from the kill


class FaultTolerance:
    """Heals ``mesh``'s fleet when a worker dies in :meth:`step` (see the module's docstring).

    ``state``: what a step changes and a heal must put back — mesh tensors, modules, optimizers, dicts and
    lists of them, objects with ``state_dict``/``load_state_dict``.  ``replicated``: the dims along which the
    state is the same on every rank (DDP's data-parallel dim), where a new rank copies it from; ``None``: no
    replica: a new rank loads the state of the step's start from ``checkpoint_dir``, where it is written as each
    step ends (a save per step, on the step's path).  ``max_heals``: more faults than
    this raise.  ``shrink``: with no spare left, the mesh loses the dead rank's place along the replicated dim
    (``ft.mesh`` is the same object, smaller; its state is each survivor's own) instead of a new process
    taking it; the step runs again there (read the mesh's size in the step)."""

    def __init__(self, mesh: DeviceMesh, state, *, replicated: str | tuple[str, ...] | None = None,
                 checkpoint_dir: str | None = None, max_heals: int = 3, shrink: bool = False) -> None:
        fleet = getattr(mesh, "fleet", None)
        if fleet is None or fleet.mesh is not mesh:
            raise UsageError(f"FaultTolerance needs the mesh a launcher made (local_mesh, world_mesh), got {mesh!r}")
        if replicated is None and checkpoint_dir is None:
            raise UsageError("FaultTolerance needs replicated=<dims along which the state is the same on every "
                             "rank> (a new rank copies its state from a replica there), or checkpoint_dir=<a "
                             "folder> (a new rank loads the state of the step's start from there)")
        dims = () if replicated is None else (replicated,) if isinstance(replicated, str) else tuple(replicated)
        unknown = [d for d in dims if d not in mesh.names]
        if unknown:
            raise UsageError(f"FaultTolerance(replicated={replicated!r}): {mesh!r} has no dim {unknown[0]!r}; "
                             f"its dims are {mesh.names}")
        if fleet.client.relays:
            raise UsageError("FaultTolerance needs each worker connected to the client itself (a host's relay dies "
                             "with its first worker): set TDMESH_RELAYS=0 for the fleet (local_mesh with spares does)")
        if max_heals < 0:
            raise UsageError(f"FaultTolerance(max_heals={max_heals}): a count, >= 0")
        self.mesh = mesh
        self.state = state
        self.replicated = dims
        self.max_heals = max_heals
        self.shrink = shrink
        self.heals: list[HealRecord] = []
        self.steps = 0
        self._fleet = fleet
        if fleet.processes is not None and hasattr(fleet.processes, "tolerant"):
            fleet.processes.tolerant = True  # a dead worker must not make the launcher stop the others
        if fleet.store is not None and fleet.scope:  # under torchrun: a dead worker's keeper lets the job go on
            fleet.store.set(f"{fleet.scope}/healing", "1")
        self.checkpoint_dir = os.path.abspath(checkpoint_dir) if checkpoint_dir is not None else None
        saved = StepState(state, mesh)
        self._check_replicas(saved)  # a state it cannot keep is refused here, not at a heal
        self._rng = self._generators()
        self._checkpoint(saved)

    def step(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)``, run again after a heal until it completes; returns what it returns."""
        held = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        if held:
            raise UsageError(f"ft.step's arguments hold a mesh tensor ({describe(held[0])}): a heal cannot give a "
                             f"new rank its value; make it inside the step (from local data, or a remote function), "
                             f"or put it in FaultTolerance's state")
        while True:
            saved = StepState(self.state, self.mesh)
            failed_at = None
            try:
                call_remote(_stash, (self.steps, saved.refs), {}, mesh=self.mesh)
                result = fn(*args, **kwargs)
                rng = send_value(self.mesh, _RNG, (), {}, None)  # the step's last op: its answer is the commit
                rng_next = self._by_rank(rng.result())
                self._wait()  # work on other streams (the answer covers the default one)
                self._checkpoint(StepState(self.state, self.mesh), self.steps + 1)
                self._rng = rng_next
                self.steps += 1
                return result
            except BaseException as e:
                failed_at = time.monotonic()
                if not self._broken(e):
                    raise
            self._heal(saved, failed_at)

    # -- one heal ------------------------------------------------------------------------------------------
    def _heal(self, saved: StepState, failed_at: float) -> None:
        client = self.mesh.client
        lost = self._lost()
        cause = str(client.failure).splitlines()[0] if client.failure is not None else "a worker died"
        if not lost:
            raise DeviceException(f"the fleet broke with no worker lost ({cause}): not a fault a heal mends")
        if len(self.heals) + len(lost) > self.max_heals:
            raise DeviceException(f"rank {', '.join(map(str, lost))} died ({cause}) after {len(self.heals)} heals: "
                                  f"more than max_heals={self.max_heals}") from client.failure
        dead = [rank for rank in lost if rank in self.mesh.rank_list]
        began = time.monotonic()
        if self.shrink and len([s for s in self._fleet.spares if s not in lost]) < len(dead):
            keep, sizes = self._kept_when_shrinking(dead, cause)
            took, phases = reform(self._fleet, lost, shrink_to=keep)
            self._rng = {new: self._rng[old] for new, old in enumerate(keep)}
            self.mesh._shape = Shape(self.mesh.names, Slice.new_row_major(sizes))  # the same mesh, smaller
            self.mesh.__dict__.pop("rank_list", None)
            copies: list[tuple[int, int]] = []
            missing: list[int] = []
        else:
            found = {rank: self._replica(rank, lost) for rank in dead}
            sources = {rank: source for rank, source in found.items() if source is not None}
            missing = [rank for rank in dead if rank not in sources]
            if missing and self.checkpoint_dir is None:
                raise DeviceException(f"rank {missing[0]} died ({cause}) and no live replica along "
                                      f"{self.replicated} holds its state") from client.failure
            took, phases = reform(self._fleet, lost)
            copies = [(sources[rank], rank) for rank in took if rank in sources]
        new = self._fleet.client
        pointed = time.monotonic()
        self._repoint(new, set(saved.refs))
        phases["lost values"] = time.monotonic() - pointed
        restoring = time.monotonic()
        empty = {rank: {t.ref: (t.shape, t.stride(), t.dtype, t.requires_grad) for t in saved.held}
                 for rank in missing}  # no replica: the checkpoint of the step's start fills these
        done = send_value(self.mesh, _RESTORE, (self.steps, saved.refs, copies, self._rng, empty), {}, None)
        phases["copy"] = max(v["copy_s"] for _, v in done.result())
        if empty:  # no replica had these ranks' state: the step's start, from the checkpoint
            self._load_checkpoint(saved, cause)
        saved.restore()
        self._wait()
        phases["restore"] = time.monotonic() - restoring
        phases["detect to heal"] = began - failed_at
        for rank, what in took.items():
            self.heals.append(HealRecord(rank, cause, what, time.monotonic() - failed_at, self.steps, dict(phases),
                                         failed_at))

    def _checkpoint(self, saved: StepState, step: int = 0) -> None:
        """With ``checkpoint_dir``: the state as the next step starts, written before that step begins (a
        rank with no replica is restored from it); the one before is kept, older ones removed."""
        if self.checkpoint_dir is None:
            return
        path = os.path.join(self.checkpoint_dir, f"step-{step:08d}")
        checkpoint.save({f"r{ref}": t for ref, t in zip(saved.refs, saved.held)}, checkpoint_id=path)
        for old in sorted(os.listdir(self.checkpoint_dir))[:-2]:
            if old.startswith("step-"):
                shutil.rmtree(os.path.join(self.checkpoint_dir, old), ignore_errors=True)

    def _load_checkpoint(self, saved: StepState, cause: str) -> None:
        assert self.checkpoint_dir is not None
        path = os.path.join(self.checkpoint_dir, f"step-{self.steps:08d}")
        if not checkpoint.is_complete(path):
            raise DeviceException(f"a rank with no live replica died ({cause}) and the checkpoint of step "
                                  f"{self.steps}'s start ({path}) is not complete")
        checkpoint.load({f"r{ref}": t for ref, t in zip(saved.refs, saved.held)}, checkpoint_id=path)

    def _kept_when_shrinking(self, dead: list[int], cause: str) -> tuple[list[int], list[int]]:
        """The ranks of the smaller mesh and its sizes: every rank but those at the dead ranks' places along the
        replicated dim (on a mesh of more dims, the dead rank's whole replica drops out; its live ranks become
        spares)."""
        if len(self.replicated) != 1:
            raise DeviceException(f"rank {dead[0]} died ({cause}) and no spare is left: shrinking needs one "
                                  f"replicated dim, not {self.replicated}")
        dim = self.replicated[0]
        gone = {self.mesh.shape.coordinates(r)[dim] for r in dead}
        keep = [r for r in self.mesh.rank_list if self.mesh.shape.coordinates(r)[dim] not in gone]
        if not keep:
            raise DeviceException(f"rank {dead[0]} died ({cause}): no rank of the mesh is left to shrink to")
        sizes = [self.mesh.sizes[d] - (len(gone) if d == dim else 0) for d in self.mesh.names]
        return keep, sizes

    def _lost(self) -> list[int]:
        """The ranks that died: those the client lost, and those whose process the launcher saw die."""
        client = self.mesh.client
        lost = set(client.observations.lost_ranks) & set(client.ranks)
        processes = self._fleet.processes
        if processes is not None and getattr(processes, "tolerant", False):
            result = processes.wait(timeout=0)
            if result is not None:
                of = {p: r for r, p in self._fleet.process_of.items()}
                lost.update(of[p] for p in result.failures if p in of)
        return sorted(lost)

    def _replica(self, rank: int, lost: list[int]) -> int | None:
        """A live rank holding ``rank``'s state: along the replicated dims, the first not lost."""
        shape = self.mesh.shape
        coords = shape.coordinates(rank)
        fixed = {d: c for d, c in coords.items() if d not in self.replicated}
        for candidate in shape.index(**fixed).ranks():
            if candidate not in lost:
                return candidate
        return None

    def _repoint(self, client, kept: set[int]) -> None:
        """The fleet's meshes now talk to the new client; tensors of the old session outside the state are lost."""
        fleet = self._fleet
        text = (f"was lost when tdmesh healed the fleet (step {self.steps}): only FaultTolerance's state "
                f"survives a heal; compute it again")
        for obj in gc.get_objects():
            if type(obj) is DeviceMesh and obj.fleet is fleet:
                obj.client = client
            elif type(obj) is RefOwner and obj.id not in kept and getattr(obj.mesh, "fleet", None) is fleet:
                obj.dropped_at = text  # type: ignore[assignment]

    # -- helpers -----------------------------------------------------------------------------------------
    def _broken(self, error: BaseException) -> bool:
        """Whether ``error`` came from a worker's death (then the client's failure is set, or about to be:
        a survivor's collective may report its dead peer before the client sees the connection close)."""
        client = self.mesh.client
        if client.failure is None and isinstance(error, RemoteException):
            try:
                self._wait()
            except DeviceException:
                pass
        return client.failure is not None and not isinstance(error, (KeyboardInterrupt, SystemExit))

    def _wait(self) -> None:
        """Until every op sent so far ran, or the fleet broke (then raise its failure)."""
        self._fleet.drain(timeout=None)
        failure = self.mesh.client.failure
        if failure is not None:
            raise failure

    def _check_replicas(self, saved: StepState) -> None:
        """The state must be the same along the replicated dims (a heal copies a replica's to the new rank):
        each tensor's digest on every rank, compared; one that differs is refused, named."""
        digests = self._by_rank(send_value(self.mesh, _FINGERPRINTS, (saved.refs,), {}, None).result())
        for rank in self.mesh.rank_list:
            replica = self._replica(rank, [rank])
            if replica is None:
                continue
            for i, (mine, theirs) in enumerate(zip(digests[rank], digests[replica], strict=True)):
                if mine != theirs:
                    dims = ", ".join(self.replicated)
                    raise UsageError(f"FaultTolerance(replicated={dims!r}): {saved.paths[i]} differs between ranks "
                                     f"{min(rank, replica)} and {max(rank, replica)}; a heal would give a new rank "
                                     f"another rank's value.  Keep per-rank values out of the state (make them in "
                                     f"the step), or name only the dims the state is the same along")

    def _generators(self) -> dict[int, bytes]:
        fut = send_value(self.mesh, _RNG, (), {}, None)
        return self._by_rank(fut.result())

    def _by_rank(self, values) -> dict[int, bytes]:
        return dict(zip(self.mesh.shape.ranks(), (v for _, v in values)))
