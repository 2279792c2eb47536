"""The whole wire protocol: one typed record per message.

Client -> worker messages carry ``Ref`` placeholders where tensors go; worker -> client
messages report values, root failures and progress.  Records are NamedTuples because
they pickle small and fast, and the hot path pickles one per op.  ``REF_FIELDS`` says, in
one table, which fields of each message hold refs: renaming a recording on the worker, the
refs a recording defines and the client's recording signatures all read it.  The values
that travel inside messages (a mesh argument, a packed tensor) are in ``arguments``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from ..geometry.slice import Slice

# the argument values that messages carry, as m.MeshArg
from .arguments import (  # noqa: F401
    OPAQUE,
    DeviceName,
    GeneratorArg,
    MeshArg,
    PackedTensor,
    ProcessGroupArg,
    TorchGlobal,
    TorchMeshArg,
)


class Ref(NamedTuple):
    """A worker-side value named by the client's integer ref id."""
    id: int


# --------------------------------------------------------------------- client -> worker
class CallFunction(NamedTuple):
    """Run ``function(*args, **kwargs)``; bind flattened results to ``results`` (``None`` slots dropped); on
    failure poison ``results`` and ``mutates``."""
    seq: int
    results: tuple[int | None, ...]
    mutates: tuple[int, ...]
    function: str | bytes     # an import path, or a pickled callable
    args: tuple | bytes       # aten ops: Refs among plain values; user functions: sealed (pickled) with kwargs
    kwargs: dict
    stream: int = 0
    process_groups: tuple[ProcessGroupArg, ...] = ()  # created, in order, before it runs
    grad: bool = True         # the client's grad mode: the worker records autograd as the client does
    expect: tuple = ()        # a remote function's: (shape, dtype, layout names) per result (None: none; OPAQUE:
    # an OpaqueRef) as its propagation described them; a result that differs is the function's error, not a desync


class Slot(NamedTuple):
    """In a DefineOp template: where the ref at ``position`` of each CallOp's refs goes."""
    position: int


class DefineOp(NamedTuple):
    """Sent to every rank once per op plan (an aten op and its argument metadata): ``op`` is the client's number
    for ``function(*args, **kwargs)``, ``Slot``s mark the tensors; the worker makes it straight-line code once."""
    op: int
    function: str             # an import path (aten or library op)
    args: tuple
    kwargs: dict
    grad: bool = True         # the grad mode it runs in: the client's when it issued the op (an op used
    # under both modes is defined twice), so that workers record the autograd graph the client does


class CallOp(NamedTuple):
    """Run defined op ``op`` with ``refs`` in its slots; bind and poison as CallFunction.  The hot message of
    eager dispatch, so it travels as a bare tuple of ints (pickling a NamedTuple costs ~1.3 us more, a fifth of
    an op's budget): ``handle`` takes a plain tuple of this length as a CallOp; recordings hold this record."""
    seq: int
    op: int
    results: tuple[int | None, ...]
    mutates: tuple[int, ...]
    refs: tuple[int, ...]
    stream: int = 0


class SendValue(NamedTuple):
    """Send ``function(*args, **kwargs)`` (or ``args[0]`` with no function) back as a FetchResult."""
    seq: int
    mutates: tuple[int, ...]
    function: str | bytes | None
    args: tuple | bytes
    kwargs: dict
    stream: int = 0
    process_groups: tuple[ProcessGroupArg, ...] = ()


class Reduce(NamedTuple):
    """A collective over ``dims`` of ``mesh`` on ``stream``; a poisoned input joins with zeros."""
    seq: int
    result: Optional[int]     # the output ref, or None when the output is ``out``/the input itself
    tensor: int
    factory: tuple[tuple[int, ...], str]  # (shape, dtype name) of the input, for zeros when it is poisoned
    group: int                # the CreateGroups id of (stream, mesh, dims): ints pickle fast
    reduction: str            # sum avg product min max band bor bxor stack
    scatter: bool
    inplace: bool
    out: Optional[int]
    stream: int = 0


class ReduceMany(NamedTuple):
    """In-place reduce of several tensors over one group: one collective per dtype bucket
    (as DDP buckets gradients), each rank's tensors flattened in this order."""
    seq: int
    tensors: tuple[int, ...]  # refs, reduced in place
    factories: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype name) per tensor, for zeros where poisoned
    group: int
    reduction: str            # sum avg product min max band bor bxor
    stream: int = 0


class SendTensor(NamedTuple):
    """``to_mesh``: ``from_ranks[i]`` sends ``tensor`` to ``to_ranks[i]`` (as ``result``); ``zeros_on`` get zeros."""
    seq: int
    result: int
    from_ranks: Slice
    to_ranks: Slice
    tensor: int
    factory: tuple[tuple[int, ...], str]
    from_stream: int
    to_stream: int
    zeros_on: Optional[Slice] = None


class CreateGroups(NamedTuple):
    """Sent to every rank, once per key: create the process groups that ``key`` needs.  ``new_group`` is
    collective over the world, so every rank creates every group of the key (``grouping.all_groups``) in the
    client's one order, members or not.  Kind "dims": the groups over ``dims`` of ``mesh`` for ``stream``;
    "remote": the same, for the user-visible group ``ref``; "p2p": all ranks, ``to_mesh`` to ``to_stream``."""
    kind: str
    stream: int
    mesh: Any = None
    dims: tuple = ()
    ref: Optional[int] = None
    to_stream: Optional[int] = None
    id: int = 0               # the client's number for this key; hot messages name groups by it


class DropGroups(NamedTuple):
    """Destroy user-visible group ``ref``'s process groups (``RemoteProcessGroup.drop``), after the queued work."""
    ref: int


MAX_COMMANDS_PER_CHUNK = 1000  # messages of one DefineRecording: a recording of many ops travels in chunks


class DefineRecording(NamedTuple):
    """One chunk (``chunk`` of ``total``) of a compiled function's messages for these ranks.  ``formals`` and
    ``results`` are the refs they use for the inputs and outputs; every other ref is a temporary of one call."""
    recording: int
    commands: tuple
    formals: tuple[int, ...]
    results: tuple[int, ...]
    chunk: int
    total: int
    mode: str = "program"  # "messages" | "program" | "inductor", "[inductor+]cuda_graph[_required]": programs.capture
    options: tuple = ()  # backend="inductor": inductor config options for its graphs, (name, value) pairs


class CallRecording(NamedTuple):
    """Replay ``recording`` with ``actuals`` for its formals, binding ``results`` (a bare tuple, as CallOp)."""
    seq: int
    recording: int
    actuals: tuple[int, ...]
    results: tuple[int, ...]


class BorrowCreate(NamedTuple):
    """On ``from_stream``: lend ``tensor`` to ``to_stream`` as ``result`` (after the work so far)."""
    result: int
    borrow: int
    tensor: int
    from_stream: int
    to_stream: int


class BorrowFirstUse(NamedTuple):
    """On the borrowing stream: wait for the lender, then bind the borrowed value."""
    borrow: int


class BorrowLastUse(NamedTuple):
    """On the borrowing stream: unbind the value and hand it back."""
    borrow: int


class BorrowDrop(NamedTuple):
    """On the lending stream: wait until the borrower is done, then forget the borrow."""
    borrow: int


class DeleteRefs(NamedTuple):
    """Forget these refs (on every stream of the worker)."""
    refs: tuple[int, ...]


class RequestStatus(NamedTuple):
    """Answer ``Status(seq + 1)`` once everything sent before this has run."""
    seq: int


class DebuggerInput(NamedTuple):
    """A line the user typed for the rank whose pdb session has the client's terminal."""
    line: str                 # with its newline; "" is end of input (pdb quits)


class Supervise(NamedTuple):
    """Start sending Heartbeats every ``heartbeat_interval`` seconds."""
    heartbeat_interval: float


class Observe(NamedTuple):
    """Send a Sample every ``interval`` seconds from now on (``tdmesh.dashboard``); 0 stops them."""
    interval: float


class RequestStacks(NamedTuple):
    """Answer with Stacks, from the message thread: every stream may be blocked (``tdmesh.stacks``)."""
    request: int


class Detach(NamedTuple):
    """Attach mode: this client is done; forget its state and wait for the next client."""


class Exit(NamedTuple):
    """Leave the message loop; ``error`` is why the client is shutting the fleet down."""
    error: Optional[str] = None


class Heal(NamedTuple):
    """A worker died: leave the session now, keep its tensors, join generation ``scope`` (``worker/healing``)."""
    scope: str
    ranks: tuple[tuple[int, int], ...]  # (rank now, rank in the new generation) for every live worker
    world_size: int


# --------------------------------------------------------------------- worker -> client
class Hello(NamedTuple):
    """A worker's answer to the listener's Challenge: who it is, proven with the job token
    (``proof``: an HMAC of both nonces and its rank and pid, see tdmesh.protocol.handshake)."""
    rank: int
    nonce: bytes
    proof: str
    hostname: str
    pid: int
    device: str               # "cpu" or "cuda:N"
    log: Optional[str]


class Heartbeat(NamedTuple):
    """A worker is alive (sent from a thread of its own, whatever its streams are doing)."""
    rank: int


class Sample(NamedTuple):
    """A worker's state for the dashboard: memory (bytes), each stream's ``(id, queued, seq running or -1,
    what, innermost line, running for s -- time in pdb left out)``, and the lines it logged or printed
    since the last Sample."""
    rank: int
    rss: int
    cuda_allocated: int
    cuda_reserved: int
    streams: tuple
    logs: tuple


class Stacks(NamedTuple):
    """The answer to RequestStacks ``request``: every thread's Python stack, by thread name."""
    rank: int
    request: int
    text: str


class FetchResult(NamedTuple):
    seq: int
    value: Any                # pickled bytes of the value, or None when ``error`` is set
    error: Any = None         # a DependentError when the value depends on a failure
    rank: int = -1            # the rank that sent it (relays forward it unchanged)


class RemoteFunctionFailed(NamedTuple):
    """A root failure: reported once, by the rank where it happened."""
    seq: int
    rank: int
    exc_type: str
    message: str
    traceback: str


class WorkerFailed(NamedTuple):
    """This worker is broken and leaves after sending this: ``function`` (op ``seq``) hit an
    error that leaves the device unusable (a sticky CUDA error: device-side assert, illegal
    address), so every later op would fail the same way."""
    seq: int
    rank: int
    function: str
    exc_type: str
    message: str
    traceback: str


class Status(NamedTuple):
    """Every seq below ``first_uncompleted`` has run on ``rank`` (a relay's: on all its ranks, named by the first)."""
    rank: int
    first_uncompleted: int


class TaskDone(NamedTuple):
    """A background task a message started on ``rank`` (an async checkpoint's write) ended; ``error``: why it failed."""
    task: int
    rank: int
    error: Optional[str] = None


class DebuggerRead(NamedTuple):
    """``rank`` is stopped in pdb (``breakpoint()`` in a remote function): print ``output``
    (what pdb printed, ending in its prompt) and send it the user's next line."""
    rank: int
    output: str


class DebuggerDone(NamedTuple):
    """``rank``'s pdb session gave the terminal back (continue, quit, or its remote function
    returned): print ``output``; another rank's session may start."""
    rank: int
    output: str


# --------------------------------------------------------------------- relays
class RelayHello(NamedTuple):
    """A host's relay to its parent, once ranks ``range(first, end)`` (``hellos``) are connected to it."""
    host: int
    first: int
    end: int
    nonce: bytes
    proof: str
    hellos: tuple


# --------------------------------------------------------------------- handshake (tdmesh.protocol.handshake)
class Challenge(NamedTuple):
    """Listener -> connecting side, the first frame: a fresh nonce to prove the token against."""
    nonce: bytes


class Welcome(NamedTuple):
    """Listener -> an authenticated peer: its own proof of the token (both nonces)."""
    proof: str


class RelayConfig(NamedTuple):
    """Client -> relays (a control frame): heartbeat period, and silence that makes a rank lost."""
    heartbeat_interval: float
    heartbeat_timeout: float


class RanksLost(NamedTuple):  # relay -> client: these ranks' connections closed, or they went silent
    ranks: tuple
    why: str


class DependentError(NamedTuple):
    """Marks a worker value that could not be computed because ``seq`` failed."""
    seq: int


CLIENT_TO_WORKER = (CallFunction, DefineOp, CallOp, SendValue, Reduce, ReduceMany, SendTensor, CreateGroups,
                    DropGroups, DefineRecording, CallRecording, BorrowCreate, BorrowFirstUse, BorrowLastUse, BorrowDrop,
                    DeleteRefs, RequestStatus, DebuggerInput, Supervise, Observe, RequestStacks, Detach, Exit, Heal)
WORKER_TO_CLIENT = (Hello, Heartbeat, FetchResult, RemoteFunctionFailed, WorkerFailed, Status, TaskDone,
                    DebuggerRead, DebuggerDone, RelayHello, RanksLost, Sample, Stacks)
RELAY_CONTROL = (RelayConfig,)
HANDSHAKE = (Challenge, Welcome)

# Which fields of a client->worker message hold refs, and how:
#   "def"   one ref the message defines (None: it defines none)   "defs"  a tuple of them (None slots allowed)
#   "use"   one ref it reads or writes (None allowed)              "uses"  a tuple of them
#   "args"  Ref placeholders anywhere inside (sealed bytes: inside the pickle)
#   "borrow" a borrow id (named like a ref, renamed with the borrows of a recording)
# The seq (first field, where there is one) is the op's own.  Messages not listed hold no refs.
REF_FIELDS: dict[Any, dict[str, str]] = {  # NamedTuple message class -> {field: kind}
    CallFunction: {"results": "defs", "mutates": "uses", "args": "args", "kwargs": "args"},
    CallOp: {"results": "defs", "mutates": "uses", "refs": "uses"},
    SendValue: {"mutates": "uses", "args": "args", "kwargs": "args"},
    Reduce: {"result": "def", "tensor": "use", "out": "use"},
    ReduceMany: {"tensors": "uses"},
    SendTensor: {"result": "def", "tensor": "use"},
    CallRecording: {"actuals": "uses", "results": "defs"},
    DefineRecording: {"formals": "uses", "results": "defs"},  # the recording's own names for its inputs and outputs
    BorrowCreate: {"result": "def", "borrow": "borrow", "tensor": "use"},
    BorrowFirstUse: {"borrow": "borrow"},
    BorrowLastUse: {"borrow": "borrow"},
    BorrowDrop: {"borrow": "borrow"},
    DeleteRefs: {"refs": "uses"},
}
