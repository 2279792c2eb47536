"""``tdmesh.FaultTolerance``: a training step that survives a worker's death, healed without a restart.

    ft = tdmesh.FaultTolerance(mesh, {"model": model, "opt": opt}, replicated="gpu")
    for batch in data:
        loss = ft.step(train_step, batch)

``ft.step(fn, ...)`` issues one step and returns: the workers run it while the client issues the next one
(a lagged commit).  Every few steps the step's first op copies the state's mesh tensors on each worker
(``worker/healing.stash``, two copies kept) and the client notes the rest (``step_state.StepState``); the
copy's answer, each worker's generator states, confirms every step before it.  Before the client does
anything else (an op outside ``ft.step``, a wait on a value) every step is confirmed (``engine/settle.py``).
If a worker dies (killed, ``os._exit``, a broken device, a missed heartbeat) the futures fail at once and the
controller heals: the survivors leave the broken session, a spare takes the dead rank's number and every
process group is formed again (``fleet/heal.py``), every rank's state goes back to the newest confirmed copy
— the new rank's from a replica along ``replicated`` — with the generators, and the steps since run again,
what they returned bound to the new values.  A healed job ends bit for bit as the job without the fault.
Other tensors of the broken session (activations, an old loss) are lost: using one raises at the user's
line.  The controller's own death stays fatal: resume from a checkpoint (``tdmesh.checkpoint``) there.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from torch.utils._pytree import tree_leaves

from . import checkpoint
from .engine import settle
from .engine.fetch import send_value
from .engine.future import Future
from .engine.tensor import Tensor, describe
from .errors import DeviceException, RemoteException, UsageError
from .fleet.heal import reform
from .geometry.shape import Shape
from .geometry.slice import Slice
from .heal_plan import check_replicas, kept_when_shrinking, lost_ranks, replica_of, repoint
from .mesh import DeviceMesh
from .step_state import UNSET, StepRecord, StepState, rebind

__all__ = ["FaultTolerance", "HealRecord"]

_STASH = "tdmesh.worker.healing.stash"
_RESTORE = "tdmesh.worker.healing.restore"
_RNG = "tdmesh.worker.healing.rng_bundle"
_FINGERPRINTS = "tdmesh.worker.healing.fingerprints"


def _answered(copy: Future) -> bool:
    """A copy's answer has come back without an error (read from replies already applied: no wait)."""
    return copy._finished() and copy._exception is None


class HealRecord(NamedTuple):
    """One heal: the mesh rank that died, why, what took its place (a spare or a new process, with its pid, or
    nothing where the mesh shrank), the seconds from the failure seen to the steps running again, the first
    step run again (the newest confirmed copy's: the failed step or one before it), and that time's parts."""
    rank: int
    cause: str
    replaced_by: str
    seconds: float
    step: int
    phases: dict
    seen_at: float  # time.monotonic() when the client saw the failure: a bench adds the time from the kill


class FaultTolerance:
    stash_every = 4  # steps at least between two copies of the state on the workers
    window_cap = 64  # steps a heal may have to run again at most: past it the client waits for the workers

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
        self._mesh = mesh
        self.state = state
        self.replicated = dims
        self.max_heals = max_heals
        self.shrink = shrink
        self._heals: list[HealRecord] = []
        self.steps = 0
        self._fleet = fleet
        self._window: list[StepRecord] = []  # the steps issued and not yet confirmed, oldest first (two at most)
        self._issued = 0  # the next step's number
        self._last: Any = None  # what the newest confirmed step returned
        if fleet.processes is not None and hasattr(fleet.processes, "tolerant"):
            fleet.processes.tolerant = True  # a dead worker must not make the launcher stop the others
        if fleet.store is not None and fleet.scope:  # under torchrun: a dead worker's keeper lets the job go on
            fleet.store.set(f"{fleet.scope}/healing", "1")
        self.checkpoint_dir = os.path.abspath(checkpoint_dir) if checkpoint_dir is not None else None
        saved = StepState(state, mesh)
        self._check_replicas(saved)  # a state it cannot keep is refused here, not at a heal
        self._rng = self._generators()
        self._checkpoint(saved)

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh to use: the same object after a heal (smaller after a shrink).  Read after the steps before
        are confirmed, so a fault still to be found is healed first."""
        settle.settle()
        return self._mesh

    @property
    def heals(self) -> list[HealRecord]:
        """Every heal so far (after the steps before are confirmed)."""
        settle.settle()
        return self._heals

    def step(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)``, run again after a heal until it completes; returns what it returns.

        It returns once the step is issued, so the workers run it while the client issues the next one.  As
        every ``stash_every``-th step begins the workers copy the state (two copies are kept); a copy's answer
        (each rank's generators then) confirms every step before it.  The client waits only before a third
        copy, for the second one's answer: unless it is that many steps ahead of the workers, it never waits.
        Before it issues anything else or waits on a value, every step is confirmed (``engine/settle.py``).
        A worker's death heals and runs again every step since the newest copy answered (what they returned
        is bound to the new run's values).  With ``checkpoint_dir`` each step is confirmed before it returns
        (the checkpoint of its end is written then)."""
        held = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        if held:
            raise UsageError(f"ft.step's arguments hold a mesh tensor ({describe(held[0])}): a heal cannot give a "
                             f"new rank its value; make it inside the step (from local data, or a remote function), "
                             f"or put it in FaultTolerance's state")
        settle.cancel()  # this step confirms what it must itself
        number = self._issued
        point = self._copies_now(number)
        saved = StepState(self.state, self._mesh, full=point)
        try:
            self._issue(number, fn, args, kwargs, saved)
            if self.checkpoint_dir is not None:
                self._confirm_all()
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                self._window = []  # nothing is waited for on the way out
                raise
            if not self._broken(e):
                self._abandon(e)
                raise
            if not self._window or self._window[-1].number != number:  # cut short: it runs again too
                self._window.append(StepRecord(number, fn, args, kwargs, saved, UNSET, None))
            self._heal_and_rerun(time.monotonic())
        self._issued += 1
        self.steps += 1
        if self._window:
            settle.defer(self._settle, self._fleet)
            return self._window[-1].result
        return self._last

    def _copies_now(self, number: int) -> bool:
        """Whether step ``number`` begins with a copy of the state: the first of a window (each step with a
        checkpoint_dir), and one ``stash_every`` steps or more after the window's newest copy, once a third
        copy would not wait (the second has answered) or the window has grown to ``window_cap`` steps."""
        if not self._window or self.checkpoint_dir is not None:
            return True
        copies = [s for s in self._window if s.start is not None]
        if number - copies[-1].number < self.stash_every:
            return False
        if len(copies) < 2:
            return True
        start = copies[1].start
        assert start is not None
        # answered already (applied with the replies the client reads as it issues: no wait, no flush here)
        return _answered(start) or number - self._window[0].number >= self.window_cap

    def _issue(self, number: int, fn: Callable[..., Any], args: tuple, kwargs: dict, saved: StepState,
               returned: Any = UNSET) -> None:
        """Step ``number``'s ops, added to the window: with a full ``saved``, the workers' copy first (before
        a third copy, the steps up to the second are confirmed: a worker keeps two).  ``returned``: what this
        step returned when it first ran (a heal runs it again): bound to the new values, and kept."""
        start = None
        if saved.full:
            self._drop_confirmed(wait=True)
            start = send_value(self._mesh, _STASH, (number, saved.packed_refs, 2), {}, None, flush=False)
        self._window.append(StepRecord(number, fn, args, kwargs, saved, returned, start))
        result = fn(*args, **kwargs)
        if returned is UNSET:
            self._window[-1] = self._window[-1]._replace(result=result)
        else:
            rebind(returned, result)

    def _drop_confirmed(self, wait: bool) -> None:
        """The window begins at its newest copy that has answered (waiting for the second copy's answer with
        ``wait``): the steps before it are confirmed; its answer, the generators, is where a heal starts it."""
        later = [i for i, s in enumerate(self._window) if i and s.start is not None]
        if not later:
            return
        i = later[-1] if not wait else later[0]
        start = self._window[i].start
        assert start is not None
        if not wait and not _answered(start):
            return
        self._rng = self._by_rank(start.result())
        self._last = self._window[i - 1].result
        del self._window[:i]

    def _confirm_all(self) -> None:
        """Every step of the window confirmed: a fetch of the generators after the newest answers once it ran on
        every rank (an answer's completion covers every stream).  A fault raises here."""
        if not self._window:
            return
        end = send_value(self._mesh, _RNG, (), {}, None)
        self._rng = self._by_rank(end.result())
        self._last = self._window[-1].result
        number = self._window[-1].number
        self._window = []
        if self.checkpoint_dir is not None:
            self._wait()
            self._checkpoint(StepState(self.state, self._mesh), number + 1)

    def _settle(self) -> None:
        """``engine/settle.py``'s call: the client is about to do something else; every step confirmed first."""
        try:
            self._confirm_all()
        except BaseException as e:
            if not self._broken(e):
                raise
            failed_at = time.monotonic()
            now = StepState(self.state, self._mesh, full=False)  # what the client changed since the last step
            self._heal_and_rerun(failed_at)
            now.restore_client()

    def _abandon(self, error: BaseException) -> None:
        """``fn`` raised (not a fault): the steps before it are confirmed, and a fault found then is not healed
        (the failed step's own effects could not be run again as they were)."""
        self._window = [s for s in self._window if s.number != self._issued]
        try:
            self._confirm_all()
        except BaseException as e:
            if self._broken(e):
                raise DeviceException(f"a worker died ({self._mesh.client.failure}) in a step before the one that "
                                      f"raised {type(error).__name__}: not healed") from error
            raise

    def _heal_and_rerun(self, failed_at: float) -> None:
        """Heal, then run every step of the window again from its first copy's start (each later step after
        the client's own changes before it are put back), and confirm them all; again if a fault comes."""
        while True:
            self._drop_confirmed(wait=False)  # a copy that answered: no need to go back further
            first = self._window[0]
            self._heal(first.saved, first.number, failed_at)  # raises what cannot be healed
            old, self._window = self._window, []
            try:
                for i, step in enumerate(old):
                    if i:
                        step.saved.restore_client()
                    self._issue(step.number, step.fn, step.args, step.kwargs,
                                StepState(self.state, self._mesh, full=step.saved.full), step.result)
                self._confirm_all()
                return
            except BaseException as e:
                failed_at = time.monotonic()
                if not self._broken(e):
                    raise
                done = {s.number for s in self._window}
                self._window += [s for s in old if s.number not in done and s.number > max(done, default=-1)]

    # -- one heal ------------------------------------------------------------------------------------------
    def _heal(self, saved: StepState, tag: int, failed_at: float) -> None:
        client = self._mesh.client
        lost = lost_ranks(self._fleet)
        cause = str(client.failure).splitlines()[0] if client.failure is not None else "a worker died"
        if not lost:
            raise DeviceException(f"the fleet broke with no worker lost ({cause}): not a fault a heal mends")
        if len(self._heals) + len(lost) > self.max_heals:
            raise DeviceException(f"rank {', '.join(map(str, lost))} died ({cause}) after {len(self._heals)} heals: "
                                  f"more than max_heals={self.max_heals}") from client.failure
        dead = [rank for rank in lost if rank in self._mesh.rank_list]
        began = time.monotonic()
        if self.shrink and len([s for s in self._fleet.spares if s not in lost]) < len(dead):
            keep, sizes = kept_when_shrinking(self._mesh, self.replicated, dead, cause)
            took, phases = reform(self._fleet, lost, shrink_to=keep)
            self._rng = {new: self._rng[old] for new, old in enumerate(keep)}
            self._mesh._shape = Shape(self._mesh.names, Slice.new_row_major(sizes))  # the same mesh, smaller
            self._mesh.__dict__.pop("rank_list", None)
            copies: list[tuple[int, int]] = []
            missing: list[int] = []
        else:
            found = {rank: replica_of(self._mesh, self.replicated, rank, lost) for rank in dead}
            sources = {rank: source for rank, source in found.items() if source is not None}
            missing = [rank for rank in dead if rank not in sources]
            if missing and self.checkpoint_dir is None:
                raise DeviceException(f"rank {missing[0]} died ({cause}) and no live replica along "
                                      f"{self.replicated} holds its state") from client.failure
            took, phases = reform(self._fleet, lost)
            copies = [(sources[rank], rank) for rank in took if rank in sources]
        new = self._fleet.client
        pointed = time.monotonic()
        repoint(self._fleet, new, set(saved.refs), tag)
        phases["lost values"] = time.monotonic() - pointed
        restoring = time.monotonic()
        empty = {rank: {t.ref: (t.shape, t.stride(), t.dtype, t.requires_grad) for t in saved.held}
                 for rank in missing}  # no replica: the checkpoint of the step's start fills these
        done = send_value(self._mesh, _RESTORE, (tag, saved.refs, copies, self._rng, empty), {}, None)
        phases["copy"] = max(v["copy_s"] for _, v in done.result())
        if empty:  # no replica had these ranks' state: the step's start, from the checkpoint
            self._load_checkpoint(saved, tag, cause)
        saved.restore()
        self._wait()
        phases["restore"] = time.monotonic() - restoring
        phases["detect to heal"] = began - failed_at
        for rank, what in took.items():
            self._heals.append(HealRecord(rank, cause, what, time.monotonic() - failed_at, tag, dict(phases),
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

    def _load_checkpoint(self, saved: StepState, tag: int, cause: str) -> None:
        assert self.checkpoint_dir is not None
        path = os.path.join(self.checkpoint_dir, f"step-{tag:08d}")
        if not checkpoint.is_complete(path):
            raise DeviceException(f"a rank with no live replica died ({cause}) and the checkpoint of step "
                                  f"{tag}'s start ({path}) is not complete")
        checkpoint.load({f"r{ref}": t for ref, t in zip(saved.refs, saved.held)}, checkpoint_id=path)

    # -- helpers -----------------------------------------------------------------------------------------
    def _broken(self, error: BaseException) -> bool:
        """Whether ``error`` came from a worker's death (then the client's failure is set, or about to be:
        a survivor's collective may report its dead peer before the client sees the connection close)."""
        client = self._mesh.client
        if client.failure is None and isinstance(error, RemoteException):
            try:
                self._wait()
            except DeviceException:
                pass
        return client.failure is not None and not isinstance(error, (KeyboardInterrupt, SystemExit))

    def _wait(self) -> None:
        """Until every op sent so far ran, or the fleet broke (then raise its failure)."""
        self._fleet.drain(timeout=None)
        failure = self._mesh.client.failure
        if failure is not None:
            raise failure

    def _check_replicas(self, saved: StepState) -> None:
        digests = self._by_rank(send_value(self._mesh, _FINGERPRINTS, (saved.refs,), {}, None).result())
        check_replicas(self._mesh, self.replicated, saved.paths, digests)

    def _generators(self) -> dict[int, bytes]:
        fut = send_value(self._mesh, _RNG, (), {}, None)
        return self._by_rank(fut.result())

    def _by_rank(self, values) -> dict[int, bytes]:
        return dict(zip(self._mesh.shape.ranks(), (v for _, v in values)))
