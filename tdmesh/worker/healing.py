"""A worker's part in healing (``tdmesh.FaultTolerance``): what outlives a broken session.

When a worker of the fleet dies the client sends ``Heal`` to the others.  Each leaves its session at
once (``leave``): the process groups' connections are cut (a gloo collective waiting on a dead peer, or
on a live one that already gave up, would otherwise wait out the group's timeout: neither ``abort`` nor
``shutdown`` releases it), the streams' queued work is dropped, and the tensors the session held are kept
here, outside its ref table, with the stash of the step's state.  The worker then joins the next
generation (a new process-group scope, maybe a new rank number) and serves the new client, whose first
call, ``restore``, puts the state back as it was when the failed step began: from this process's stash,
from the tensors it kept (when the step's first op, the stash, never ran here), or over the new world
group from a replica, for the rank that took the dead one's place.  The client keeps every rank's
generator states (``rng_bundle``, fetched as each step ends): those go back too, so a re-run draws what
the first run drew.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..protocol import messages as m
from ..protocol.arguments import worker_generators
from ..protocol.rendezvous import connect_store
from .streams import current_stream

log = logging.getLogger("tdmesh.worker")

_protected: set[int] = set()  # ports of the connections a heal must not cut (the client's, a relay's)
_protected_sockets: set[int] = set()  # and sockets (inodes): the client connection, the heal watch's store
pending: m.Heal | None = None  # a Heal the watch found in the store (the message thread may be blocked)
# step -> {ref -> (the live tensor, its copy at that step's start)}: the two newest steps, since the client
# confirms a step while the next one runs (a heal may go back to either)
_stashes: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
_kept: dict[int, torch.Tensor] = {}  # the broken session's tensors, by ref, until restore


def protect(*ports: int) -> None:
    """Connections to or from these ports survive a heal (called as the worker connects)."""
    _protected.update(p for p in ports if p)


def watch(conn, key: str) -> Callable[[], None]:
    """For this session: a thread that looks for ``key`` in the job's store, where the client also puts its
    ``Heal``.  The message thread may be blocked where the connection's copy never reaches it (creating a
    process group, a collective over the world: waiting in the store for the dead rank's address): the
    watch cuts the connections then (the main store's too), which fails that wait.  Returns the call that
    ends the watch as the session ends.  It polls (``check``, every 50 ms) rather than blocking in the
    store's ``wait``: a thread inside that C++ call as the process exits aborts it.  The store connection
    is made here, on the message thread, so that no other socket is taken for it."""
    global pending
    pending = None
    _protected_sockets.clear()
    _protected_sockets.add(os.fstat(conn.sock.fileno()).st_ino)
    before = set(_sockets())
    store = connect_store(timeout=30.0)
    _protected_sockets.update(set(_sockets()) - before)
    stop = threading.Event()

    def run() -> None:
        global pending
        while not stop.wait(0.05):
            try:
                if not store.check([key]):
                    continue
                found = pickle.loads(store.get(key))
            except Exception:  # noqa: BLE001 - the store gone (the job's end): the session ends too
                continue
            pending = found
            log.info("the heal watch found %s: cutting this worker's connections", key)
            cut_connections()
            return

    thread = threading.Thread(target=run, name="tdmesh-heal-watch", daemon=True)
    thread.start()

    def end() -> None:
        stop.set()
        thread.join()
    return end


def interruptible(make: Callable[[], Any]) -> Any:
    """``make()`` (creating process groups: collective over the world) on a thread of its own, while this
    thread waits for it or for a heal.  A rank that died in the middle of creating a gloo group leaves its
    peers retrying their connection to it until the group's timeout, in C++, where nothing cuts them free;
    so the message thread leaves that call behind (it ends on its own, failing) and the session heals."""
    done = threading.Event()
    out: list = []

    def run() -> None:
        try:
            out.append((True, make()))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            out.append((False, e))
        done.set()

    threading.Thread(target=run, name="tdmesh-new-groups", daemon=True).start()
    while not done.wait(0.05):
        if pending is not None:
            raise RuntimeError("creating process groups: a heal left the call behind (a worker died)")
    ok, value = out[0]
    if not ok:
        raise value
    return value


def wait_for_heal(key: str, seconds: float) -> bool:
    """After an error in the session: where the client heals this fleet (``key`` is in the store), wait for
    its Heal a moment; an error caused by a dead peer (creating a group with it) then heals, not ends, this
    worker.  True once a Heal is pending."""
    try:
        if pending is None and not connect_store(timeout=10.0).check([key]):
            return False
    except Exception:  # noqa: BLE001 - no store: no heal to wait for
        return False
    deadline = time.monotonic() + seconds
    while pending is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return pending is not None


def take_pending() -> m.Heal | None:
    global pending
    found, pending = pending, None
    return found


def stash(tag: int, packed: bytes, generations: int) -> bytes:
    """The first op of a fault-tolerant step: copy the state's tensors (into the copies of the step before
    last where their layout is unchanged), so that a heal puts back exactly what the step began with.  The
    copies of the step before stay: the client may not have confirmed it yet.  ``packed``: the refs, as int64s.
    Returns the generators' states as the step begins (``rng_bundle``): the answer confirms the step before."""
    refs = array("q", packed)
    env = _env()
    reuse: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for number in [n for n in _stashes if n >= tag]:  # this step again (restore empties them: a guard)
        reuse = _stashes.pop(number)
    if len(_stashes) >= generations:  # the oldest step kept: confirmed, its copies are reused
        reuse = _stashes.pop(min(_stashes))
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    lives: list[torch.Tensor] = []
    copies: list[torch.Tensor] = []
    with torch.no_grad():
        for ref in refs:
            live = env.get(ref)
            if not isinstance(live, torch.Tensor):
                continue  # a Poison: the state is broken already, and its error is the user's
            old = reuse.get(ref)
            if old is not None and _same_layout(old[1], live):
                kept[ref] = (live, old[1])
                lives.append(live)
                copies.append(old[1])
            else:
                kept[ref] = (live, live.detach().clone())
        if copies:
            torch._foreach_copy_(copies, lives)  # one call for every tensor (their count costs more than bytes)
    _stashes[tag] = kept
    return rng_bundle()


def fingerprints(refs: list[int]) -> list[str]:
    """A digest of each of the state's tensors on this rank: the client checks that replicas agree."""
    import hashlib
    env = _env()
    out = []
    for ref in refs:
        t = env.get(ref)
        if not isinstance(t, torch.Tensor):
            out.append("not a tensor")
            continue
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        out.append(hashlib.blake2b(data + repr((tuple(t.shape), t.dtype)).encode(), digest_size=16).hexdigest())
    return out


def _env() -> dict:
    stream = current_stream()
    if stream is None:
        raise RuntimeError("tdmesh's healing functions run on a worker stream")
    return stream.env


def _device() -> torch.device:
    stream = current_stream()
    return stream.device if stream is not None else torch.device("cpu")


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device


def rng_bundle() -> bytes:
    """This worker's generators' states (torch's default CPU and CUDA ones, and its copies of the client's
    generators), fetched by the client as each step begins (or ends): where a heal starts that step again."""
    state: dict = {"cpu": torch.get_rng_state()}
    device = _device()
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    state["generators"] = {key: g.get_state() for key, g in worker_generators().items()}
    return pickle.dumps({k: v.numpy().tobytes() if isinstance(v, torch.Tensor) else
                         {key: g.numpy().tobytes() for key, g in v.items()} for k, v in state.items()})


def _state(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _set_rng(bundle: bytes) -> None:
    state = pickle.loads(bundle)
    torch.set_rng_state(_state(state["cpu"]))
    if "cuda" in state:
        torch.cuda.set_rng_state(_state(state["cuda"]), _device())
    generators = worker_generators()
    for key, value in state["generators"].items():
        if key not in generators:
            generators[key] = torch.Generator(device=key[1])
        generators[key].set_state(_state(value))


def leave(interp) -> None:
    """``Heal`` arrived: release whatever this session waits on and keep its tensors for ``restore``."""
    global _kept
    cut = cut_connections()
    for s in list(interp.streams.values()):
        s.abandon()
    interp.tasks.join(30.0)  # an async checkpoint being written: finished (its collective was cut)
    env = interp.streams[0].env if 0 in interp.streams else {}
    _kept = {ref: v for ref, v in env.items() if isinstance(v, torch.Tensor)}
    for s in interp.streams.values():
        s.env.clear()
    log.info("rank %d: leaving the broken session (%d connections cut, %d tensors kept)", interp.rank, cut,
             len(_kept))


def cut_connections() -> int:
    """Shut down this process's established TCP connections but the protected ones: the process groups'
    (gloo pairs, NCCL's bootstrap), so that a collective blocked on a dead or departed peer fails now.
    Sockets are found through /proc (torch gives no handle on them); listeners are left alone (gloo aborts
    the process when its accept fails), and each socket is shut down through a duplicate descriptor, so
    the owner's descriptor stays valid until the group is destroyed."""
    sockets = _sockets()
    cut = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            inode = int(fields[9])
            if inode not in sockets or fields[3] != "01" or inode in _protected_sockets:  # 01: established
                continue
            local, remote = (int(fields[i].rsplit(":", 1)[1], 16) for i in (1, 2))
            if local in _protected or remote in _protected:
                continue
            try:  # a socket closed since the listing (its descriptor gone, or reused) is no business of ours
                dup = socket.socket(fileno=os.dup(sockets[inode]))
            except OSError:
                continue
            try:
                dup.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                pass
            finally:
                dup.close()
    return cut


def _sockets() -> dict[int, int]:
    """This process's sockets: inode -> descriptor."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(fd)
    return found


def restore(tag: int, refs: list[int], copies: list[tuple[int, int]], bundles: dict, empty: dict) -> dict:
    """The new session's first call: bind the state's refs as they were when step ``tag`` began.

    ``copies``: (source rank, new rank) pairs, over the new world group: the source sends its state, the
    new rank (a spare in a dead rank's place) receives it.  ``bundles``: every rank's generator states.
    ``empty``: {new rank with no replica: {ref: its layout}}: tensors made for the checkpoint's load."""
    global _kept
    env = _env()
    me = dist.get_rank()
    state: dict[int, torch.Tensor] = {}
    start: dict[int, torch.Tensor] = {}  # the values of the step's start: the stash's copies, sent as they are
    with torch.no_grad():
        for ref in refs:
            if ref in _stashes.get(tag, ()):
                state[ref], start[ref] = _stashes[tag][ref]
            elif ref in _kept:
                state[ref] = start[ref] = _kept[ref]  # the stash never ran here: nothing of the step did either
        began = time.perf_counter()
        for source, target in copies:  # first: the new rank waits for nothing but the bytes
            if source == me:
                _send(start, refs, target, {ref: state[ref].requires_grad for ref in refs})
        sources = [source for source, target in copies if target == me]
        if sources:
            state = _receive(sources[0])
        copied = time.perf_counter() - began
        for ref, live in state.items():
            if start.get(ref) is not None and start[ref] is not live:
                live.copy_(start[ref])
    if me in empty:  # a new rank with no replica to copy from: the client loads a checkpoint into these
        device = _device()
        for ref, (shape, stride, dtype, requires_grad) in empty[me].items():
            state[ref] = torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(requires_grad)
    missing = [ref for ref in refs if ref not in state]
    if missing:
        raise RuntimeError(f"rank {me} has no copy of the state's refs {missing[:8]} to restore")
    env.update(state)
    _set_rng(bundles[me])
    _stashes.clear()
    _kept = {}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return {"copy_s": copied if copies else 0.0, "bytes": nbytes}


_ALONE = 1 << 20  # bytes: a dense tensor at least this big travels by itself, straight into its new home


def _alone(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.numel() * t.element_size() >= _ALONE


def _send(state: dict[int, torch.Tensor], refs: list[int], target: int, grads: dict[int, bool]) -> None:
    """The state to ``target``: a description (pickled; ``grads``: whether each requires grad, as the live
    tensor does: the copies sent do not), each big dense tensor as itself (no copy on either side), then the
    rest packed in one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list] = {}
    layout = []
    for ref in refs:
        t = state[ref]
        layout.append((ref, tuple(t.shape), t.stride(), t.dtype, grads[ref], _alone(t)))
        if not _alone(t):
            by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
    header = torch.frombuffer(bytearray(pickle.dumps(layout)), dtype=torch.uint8)
    device = next(iter(state.values())).device if state else torch.device("cpu")
    dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=device), target)
    dist.send(header.to(device), target)
    for ref in refs:
        if _alone(state[ref]):
            dist.send(state[ref].detach(), target)
    for dtype in sorted(by_dtype, key=str):
        dist.send(torch.cat(by_dtype[dtype]), target)


def _receive(source: int) -> dict[int, torch.Tensor]:
    device = _device()
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, source)
    header = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(header, source)
    layout = pickle.loads(header.cpu().numpy().tobytes())
    state = {}
    for ref, shape, stride, dtype, requires_grad, alone in layout:
        if alone:
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            dist.recv(t, source)
            state[ref] = t.requires_grad_(requires_grad)
    for dtype in sorted({entry[3] for entry in layout if not entry[5]}, key=str):
        entries = [e for e in layout if e[3] is dtype and not e[5]]
        flat = torch.empty(sum(_numel(e[1]) for e in entries), dtype=dtype, device=device)
        dist.recv(flat, source)
        at = 0
        for ref, shape, stride, _, requires_grad, _ in entries:
            n = _numel(shape)
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            t.copy_(flat[at:at + n].view(shape))
            state[ref] = t.requires_grad_(requires_grad)
            at += n
    return state


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
