"""Every error tdmesh raises, under one root, and the user's call site that they point at.

``TdmeshError`` is the root.  What the user catches: ``RemoteException`` (a remote op
failed), ``DeviceException`` (the fleet failed) and ``PlacementError`` (a tensor used where
it cannot be: its ``.code`` says which rule, and it is a ``TypeError`` as torch's own
placement errors are).  Protocol, resolve and recording errors belong to the workers and
the transport; the user meets them only inside a DeviceException or RemoteException.

No tdmesh imports here: the client and the workers both use this module.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Sequence
from types import FrameType

__all__ = ["TdmeshError", "RemoteException", "DeviceException", "PlacementError", "UnknownDimError", "UsageError",
           "ProtocolError", "ProtocolViolation", "ResolveError", "RecordingError", "call_site", "forget_callers",
           "site_text", "user_line", "frames"]


class TdmeshError(Exception):
    """The root of every error tdmesh raises."""


class RemoteException(TdmeshError):
    """A remote op failed (a deterministic problem in the user's program).

    Raised where a value that depends on the failure is observed: a fetch, or the mesh's
    exit when nobody observed it.  ``str()`` holds the rank, the user's call site, the
    worker traceback and the original exception.
    """

    def __init__(self, seq: int, rank: int, exc_type: str, message: str, worker_traceback: str,
                 call_site: Sequence[traceback.FrameSummary] | None) -> None:
        self.seq = seq
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.worker_traceback = worker_traceback
        self.call_site = list(call_site or [])
        super().__init__(self._render())

    def _render(self) -> str:
        where = "".join(traceback.format_list(self.call_site)) if self.call_site else "  <not tied to a user call>\n"
        return (f"A remote function failed on rank {self.rank}: {self.exc_type}: {self.message}\n"
                f"Issued by the client at (most recent call last):\n{where}"
                f"Traceback on worker rank {self.rank}:\n{self.worker_traceback.rstrip()}")

    @property
    def worker_error_string(self) -> str:
        """Monarch's name for the worker's traceback (it ends with the exception's type and message)."""
        return self.worker_traceback

    @property
    def controller_frames(self) -> list[traceback.FrameSummary]:
        """Monarch's name for ``call_site``: the client's frames that issued the failed call."""
        return self.call_site

    def __reduce__(self):
        return (RemoteException, (self.seq, self.rank, self.exc_type, self.message, self.worker_traceback,
                                  self.call_site))


class DeviceException(TdmeshError):
    """The fleet failed: a worker died, stopped answering, broke its device or the protocol.

    Reported once: ``observed`` turns true when the user is handed it (a fetch, an op on the
    failed mesh), and the mesh's exit raises it only if nobody was.
    """

    observed = False


class PlacementError(TdmeshError, TypeError):
    """A tensor used where it cannot be; raised at the user's line before anything is sent.

    ``code`` names the rule: ``LOCAL_TENSOR`` (a local tensor mixed with the mesh),
    ``WRONG_MESH``, ``WRONG_STREAM``, ``DROPPED``, ``BORROWED`` (mutably borrowed elsewhere),
    ``MUTATING_BORROW`` (a write to a read-only borrow), ``REQUIRES_GRAD`` (an op autograd
    cannot follow) or ``INDEXED_COPY`` (a write into ``x[per-rank scalar]``, a copy where torch's
    is a view).  The message starts with the code and ends with the user's line.
    """

    CODES = ("LOCAL_TENSOR", "WRONG_MESH", "WRONG_STREAM", "DROPPED", "BORROWED", "MUTATING_BORROW", "REQUIRES_GRAD",
             "INDEXED_COPY")

    def __init__(self, code: str, message: str) -> None:
        if code not in self.CODES:
            raise ValueError(f"unknown placement error code {code!r}; the codes are {list(self.CODES)}")
        self.code = code
        super().__init__(f"{code}: {message}\n  at {user_line()}")


class UnknownDimError(TdmeshError, KeyError, ValueError):
    """A dim name that the mesh does not have.  A ``KeyError`` (lookup by name) and a
    ``ValueError`` (bad argument) so that code written for either convention catches it."""

    def __str__(self) -> str:  # KeyError would repr-quote the message
        return str(self.args[0]) if self.args else ""


class UsageError(TdmeshError, RuntimeError):
    """A call that the state of the mesh or the process does not allow (an exited mesh, a
    geometry-only mesh, world_mesh outside torchrun, a compiled function that misbehaves)."""


class ProtocolError(TdmeshError, ConnectionError):
    """A peer sent bytes that are not a tdmesh frame (wrong magic, oversized, truncated)."""


class ProtocolViolation(TdmeshError, RuntimeError):
    """A message a worker cannot interpret: a bug or a foreign peer, never ignored."""


class ResolveError(TdmeshError, ValueError):
    """A worker could not find or unpickle the function a message names."""


class RecordingError(TdmeshError, RuntimeError):
    """A compiled function's recording is malformed (chunks out of order, unknown id)."""


# ----------------------------------------------------------------------------- the user's call site
def _dir_of(module: str) -> str:
    spec = importlib.util.find_spec(module)
    origin = spec.origin if spec is not None and spec.origin else ""
    return os.path.dirname(os.path.abspath(origin)) + os.sep


_SKIP = (os.path.dirname(os.path.abspath(__file__)) + os.sep, _dir_of("torch"), "<frozen",
         os.path.dirname(os.__file__) + os.sep + "contextlib")


# id(code object) -> (the code, whether its frames are tdmesh's or torch's (not the user's), or _ENGINE).
# Keyed by id: hashing a code object hashes its constants, nested functions' code among them (1.6 us for a
# function with closures, once per op).  The code is held, so no other code object has its id while cached.
_skipped: dict[int, tuple] = {}
_ENGINE = 2  # a frame of torch's function that runs the autograd engine: see backward_sites

# The backward calls in flight, as (thread ident, site of the call): pushed and popped by the
# active mesh around ``Tensor.backward``, ``torch.autograd.backward`` and ``grad`` (see
# tdmesh.engine.activation).  The ops autograd's engine runs for such a call have that call's site:
# on the calling thread (CPU tensors) their first frame outside tdmesh is the engine's, and
# the rest of the walk would find the same user frames for each of a backward's ~100s of ops;
# on the engine's device thread (CUDA tensors) there is no user frame to find at all.
backward_sites: list = []
in_backward: Callable[[], bool] = lambda: False  # whether autograd's engine is running on this thread


def note_engine_code(code) -> None:
    """``code`` is torch's function that runs the autograd engine (registered by the engine layer)."""
    _skipped[id(code)] = (code, _ENGINE)


def _skip(code) -> bool | int:
    found = _skipped.get(id(code))
    if found is not None:
        return found[1]
    if len(_skipped) > 50_000:  # generated code (exec in a loop) must not grow it for ever
        engine = {key: entry for key, entry in _skipped.items() if entry[1] == _ENGINE}
        _skipped.clear()
        _skipped.update(engine)
    skip = code.co_filename.startswith(_SKIP)
    _skipped[id(code)] = (code, skip)
    return skip


def _backward_site(thread: int | None) -> list | None:
    """The site of the innermost backward call in flight on ``thread``; with ``thread`` None (autograd's
    device thread, which runs the ops of a call made on another thread), of the one thread's that has
    backward calls in flight, or None when several threads have (which call an op belongs to is unknown).
    A backward begun with no mesh active registers nothing: beside one that did, on another thread, its
    device-thread ops would be given that one's site (two threads in backward at once, one of them outside
    every mesh on mesh tensors)."""
    sites = backward_sites
    if thread is None:
        if len(sites) == 1:
            return sites[0][1]
        return sites[-1][1] if len({t for t, _ in sites}) == 1 else None
    for t, site in reversed(sites):
        if t == thread:
            return site
    return None


def call_site(skip: int = 0, hold: bool = False) -> list:
    """The user's innermost frames, as (code object, last instruction) pairs: cheap enough
    for every op (the line numbers are worked out only when an error names the site).
    ``skip``: how many frames above the caller are tdmesh's for sure (``sys._getframe``
    passes over them without making frame objects, which walking ``f_back`` does).  ``hold``:
    keep the innermost frame's caller for the next site (``_above``): only where a message
    is queued with the site, so that a send follows and lets the caller go."""
    try:
        frame: FrameType | None = sys._getframe(1 + skip)
    except ValueError:  # fewer frames than ``skip`` says: a thread begun in C (autograd's device thread)
        frame = None
    skipped = _skipped
    while frame is not None:
        entry = skipped.get(id(frame.f_code))
        tdmesh_or_torch = entry[1] if entry is not None else _skip(frame.f_code)
        if not tdmesh_or_torch:
            break
        if tdmesh_or_torch == _ENGINE and backward_sites:  # an op autograd's engine runs on this thread
            found = _backward_site(threading.get_ident())
            if found is not None:
                return found
        frame = frame.f_back
    if frame is None and backward_sites and in_backward():  # autograd's device thread
        return _backward_site(None) or []
    if frame is None:
        return []
    caller = frame.f_back
    above = _above[0]
    if above is not None and above[0] is caller and above[1] == caller.f_lasti:
        return [(frame.f_code, frame.f_lasti), *above[2]]
    site: list = [(frame.f_code, frame.f_lasti)]
    frame = caller
    while frame is not None and len(site) < 6:
        site.append((frame.f_code, frame.f_lasti))
        frame = frame.f_back
    if hold and caller is not None and not caller.f_code.co_flags & _SUSPENDS:
        _above[0] = (caller, caller.f_lasti, tuple(site[1:]))
    return site


# The frames above the last site's innermost one: (that frame's caller, the caller's last instruction,
# the site's entries from the caller outward).  While a frame runs, the frames above it are suspended
# in their calls, so a site whose innermost frame has the same caller, at the same instruction, has
# the same entries above it: a loop's ops, or one function's, walk one frame, not six (0.13 us each on
# this VM).  The caller is held, so no other frame is taken for it; not a generator's or a coroutine's,
# which can be resumed from another caller.  A caller that returned would keep its locals alive while
# held: the client forgets it at every send (:func:`forget_callers`), before it queues the frees of
# dead proxies, so those go out in the same send as before; only the sites of queued messages hold
# one (``hold``), so a send always follows (an error message's ``user_line`` holds none).
_above: list = [None]
_SUSPENDS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def forget_callers() -> None:
    """Drop the frame :func:`call_site` holds (see ``_above``)."""
    _above[0] = None


def _entries(site) -> list[tuple[str, int, str]]:
    """(filename, lineno, name) per frame of a site (captured, or given in that form)."""
    out = []
    for entry in site or ():
        if len(entry) == 2:
            code, lasti = entry
            lineno = next((line for start, end, line in code.co_lines() if start <= lasti < end), None)
            entry = (code.co_filename, lineno if lineno is not None else code.co_firstlineno, code.co_name)
        out.append(entry)
    return out


def site_text(site) -> str:
    """The innermost user frame of a captured call site, as a traceback line."""
    if not site:
        return "<unknown>"
    filename, lineno, name = _entries(site[:1])[0]
    return f'File "{filename}", line {lineno}, in {name}'


def warn_at_user_line(message: str) -> None:
    """``warnings.warn(message)`` attributed to the user's innermost frame (the first that is
    neither tdmesh's nor torch's), however deep in tdmesh it is raised."""
    frame = sys._getframe(1)
    level = 2  # stacklevel 1 is this function; 2 its caller
    while frame.f_back is not None and _skip(frame.f_code):
        frame = frame.f_back
        level += 1
    warnings.warn(message, stacklevel=level)


def user_line() -> str:
    """The user's line that is running now, as a traceback line."""
    return site_text(call_site())


def frames(site) -> list[traceback.FrameSummary]:
    """A captured call site as traceback frames, outermost first."""
    return [traceback.FrameSummary(f, n, name) for f, n, name in reversed(_entries(site))]


def thread_stacks(limit: int | None = None, skip_current: bool = False) -> str:
    """Every thread's Python stack, innermost call last, headed ``Thread 'name':`` and sorted by
    name (``tdmesh.stacks`` on a worker; the tests' time limit in their own process)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    parts = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda kv: str(names.get(kv[0], kv[0]))):
        if not (skip_current and ident == me):
            parts.append(f"Thread {names.get(ident, ident)!r}:\n" + "".join(traceback.format_stack(frame, limit)))
    return "\n".join(parts)
