"""What a worker tells the client beyond op results, for ``tdmesh.dashboard`` and ``tdmesh.stacks``.

Nothing here runs until the client asks: ``Observe`` starts one thread that sends a ``Sample``
(memory, each stream's queue and the op it is running, new log lines) every ``interval``
seconds for the rest of the session; ``RequestStacks`` is answered with every thread's stack.
Both are read by the message thread, never queued on a stream, so they are answered while
every stream is blocked inside an op.  What a stream is running is read from its thread's
frame (``sys._current_frames``): the streams do no bookkeeping per op for this.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time

import torch

from ..errors import thread_stacks
from ..protocol import messages as m

_LOG_LINES = 200   # a rank's lines kept between two samples (older ones are dropped)
_LINE_CHARS = 500  # a longer line is cut: the page shows recent output, the log files keep all of it
_TDMESH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tdmesh's own frames are not the user's


def resident_bytes() -> int:
    """This process's resident memory now (Linux ``/proc``; elsewhere the peak, from ``getrusage``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class LogTail(logging.Handler):
    """The lines this worker logs or prints, kept until the next sample takes them: a handler on
    the root logger (tdmesh's loggers and the user's propagate to it) and a tee of ``sys.stdout`` and
    ``sys.stderr`` (``print`` in a remote function).  The output still goes where it went."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: collections.deque[str] = collections.deque(maxlen=_LOG_LINES)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self._streams: list[tuple[str, object, _Tee]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record)[:_LINE_CHARS])
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not worth a crash
            pass

    def install(self) -> None:
        logging.getLogger().addHandler(self)
        for name in ("stdout", "stderr"):
            original = getattr(sys, name)
            tee = _Tee(original, self.lines, name == "stderr")
            self._streams.append((name, original, tee))
            setattr(sys, name, tee)

    def uninstall(self) -> None:
        logging.getLogger().removeHandler(self)
        for name, original, tee in self._streams:
            if getattr(sys, name) is tee:  # not if someone wrapped it since: theirs stays
                setattr(sys, name, original)
        self._streams.clear()

    def take(self) -> tuple[str, ...]:
        lines = []
        while self.lines:
            lines.append(self.lines.popleft())
        return tuple(lines)


class _Tee:
    """A text stream that writes through to ``original`` and keeps each complete line."""

    def __init__(self, original, lines: collections.deque, is_stderr: bool) -> None:
        self._original = original
        self._lines = lines
        self._partial = ""
        self._prefix = "stderr: " if is_stderr else ""

    def write(self, text: str) -> int:
        written = self._original.write(text)
        if "\n" in text:
            *done, self._partial = (self._partial + text).split("\n")
            self._lines.extend((self._prefix + line)[:_LINE_CHARS] for line in done)
        else:
            self._partial = (self._partial + text)[-_LINE_CHARS:]
        return written

    def __getattr__(self, name: str):
        return getattr(self._original, name)


class Observer:
    """One worker's sampler and stack answerer (``Interpreter.observer``)."""

    def __init__(self, interp) -> None:
        self.interp = interp
        self.interval = 0.0
        self._generation = 0  # a sampler thread runs while its generation is the current one
        self._thread: threading.Thread | None = None
        self.tail: LogTail | None = None
        self._running: dict[int, tuple[int, float, float]] = {}  # stream id -> (seq seen running, since, pdb s then)

    def observe(self, msg: m.Observe) -> None:
        """Start sampling, change its interval, or (0) stop it: the thread and the log tee go."""
        running = self.interval > 0
        self.interval = msg.interval
        if msg.interval > 0 and not running:
            self._generation += 1
            previous = self._thread
            self._thread = threading.Thread(target=self._loop, args=(self._generation, previous),
                                            name="tdmesh-sampler", daemon=True)
            self._thread.start()

    def stacks(self, msg: m.RequestStacks) -> None:
        self.interp.send(m.Stacks(self.interp.rank, msg.request, f"pid {os.getpid()}\n" + thread_stacks()))

    def _loop(self, generation: int, previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()  # a stopped sampler takes its log tee away first (within one interval)
        interp = self.interp
        tail = self.tail = LogTail()
        tail.install()
        try:
            while interp.exit_request is None and interp.fatal is None and generation == self._generation \
                    and self.interval > 0:
                try:
                    interp.send(self.sample())
                except OSError:
                    return
                time.sleep(self.interval)
        finally:
            tail.uninstall()  # a pooled worker's next session starts without it

    def sample(self) -> m.Sample:
        device = self.interp.device
        allocated = reserved = 0
        if device.type == "cuda":
            allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        logs = self.tail.take() if self.tail is not None else ()
        return m.Sample(self.interp.rank, resident_bytes(), allocated, reserved, self.stream_states(), logs)

    def stream_states(self) -> tuple:
        """Per stream: (id, messages queued, seq running or -1, what it runs, the innermost line, for how long)."""
        frames = sys._current_frames()
        now = time.monotonic()
        console = self.interp.console
        states = []
        for sid, stream in sorted(self.interp.streams.items()):
            queue, thread = stream._queue, stream._thread
            queued = queue.qsize() if queue is not None else 0
            frame = frames.get(thread.ident) if thread is not None else None
            seq, what, where = _running(frame, self.interp.ops)
            if seq is None:
                self._running.pop(sid, None)
                states.append((sid, queued, -1, "", "", 0.0))
                continue
            in_pdb = console.pdb_seconds(thread.ident if thread is not None else None, now)
            seen = self._running.get(sid)
            if seen is None or seen[0] != seq:
                seen = self._running[sid] = (seq, now, in_pdb)
            # the op's age leaves out the time its thread sat in pdb: a rank the user steps through is
            # never shown stuck, not even by a sample taken just before the pdb session ended
            states.append((sid, queued, seq, what, where, round(max(0.0, now - seen[1] - (in_pdb - seen[2])), 3)))
        return tuple(states)


def _running(frame, ops: dict) -> tuple[int | None, str, str]:
    """(seq, what, where) of the work a stream thread is inside, or (None, "", "") when it waits for work."""
    innermost = frame
    run = None
    while frame is not None:
        if frame.f_code.co_name == "_run" and frame.f_code.co_filename.endswith("streams.py"):
            run = frame
            break
        frame = frame.f_back
    if run is None or innermost is None:
        return None, "", ""
    fn, msg = run.f_locals.get("fn"), run.f_locals.get("msg")
    what = getattr(fn, "__name__", type(fn).__name__).lstrip("_")
    if hasattr(type(msg), "_fields"):  # a message record; its seq, where it has one
        seq = getattr(msg, "seq", 0)
        function = getattr(msg, "function", None)
        if isinstance(function, str):
            what += f" {function}"
    elif type(msg) is tuple and len(msg) == len(m.CallOp._fields):  # a CallOp travels as a bare tuple
        seq = msg[0]
        op = ops.get(msg[1])
        if op is not None:
            what += f" {op.function}"
    else:
        seq = 0
    inside, frame = [], innermost
    while frame is not None and frame is not run:
        inside.append(frame)
        frame = frame.f_back
    called = next((f for f in reversed(inside) if not f.f_code.co_filename.startswith(_TDMESH)), None)
    if called is not None and not isinstance(getattr(msg, "function", None), str):
        what += f" {called.f_code.co_qualname}"  # a function shipped by value: named by the frame it runs in
    code = innermost.f_code
    where = f"{code.co_filename}:{innermost.f_lineno} in {code.co_name}"
    return seq, what, where
