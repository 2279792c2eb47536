"""What the client's autograd graphs save, held so that a backward run by the workers can free it.

While a mesh is active (``TDMESH_BACKWARD=auto``) the client's saved-tensor hooks are
``pack``/``unpack``: each tensor a node saves is held by a ``Saved`` box, filed under the
node's sequence number.  When the workers run a graph's backward themselves
(``tdmesh/engine/backward.py``), the client's engine never runs it, so nothing would release
what the client's copy saved; emptying those boxes frees the proxies (and so the workers'
activations) as torch's engine frees a graph's saved tensors.  The boxes also tell which nodes
were recorded under these hooks: a node saved by the user's own hooks (``checkpoint``,
``save_on_cpu``) has none, and its graph's backward stays on the client.

With hooks, torch hands ``pack`` the tensor itself: a saved output is no longer detached
first, one message fewer per saved output.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch._C._autograd import _get_sequence_nr

from ..config import env_str

__all__ = ["Saved", "pack", "unpack", "saved_by_node", "RELEASED", "workers_record", "push_hooks", "pop_hooks",
           "set_aside", "bring_back", "workers_run_backward"]

RELEASED: tuple = ()  # a node's entry once its saved tensors were freed by a backward on the workers
_PRUNE_FROM = 1 << 14
_grad_enabled = torch._C.is_grad_enabled


def workers_run_backward() -> bool:
    """``TDMESH_BACKWARD``: 'auto' lets workers run a backward whose graph allows it."""
    return env_str("TDMESH_BACKWARD") != "client"


class Saved:
    """One saved tensor of a client graph; ``tensor`` is None once the workers' backward freed it."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor


class _Nodes(threading.local):  # sequence numbers are per thread
    def __init__(self) -> None:
        self.saved: dict[int, list | tuple] = {}  # sequence_nr -> weakrefs to its Saved boxes, or RELEASED
        self.prune_at = _PRUNE_FROM


_nodes = _Nodes()


def saved_by_node() -> dict:
    """This thread's boxes by node sequence number."""
    return _nodes.saved


def pack(tensor: torch.Tensor) -> Saved:
    box = Saved(tensor)
    nodes = _nodes
    seq = _get_sequence_nr() - 1  # the node being made took the last number
    entry = nodes.saved.get(seq)
    if entry is None or entry is RELEASED:
        nodes.saved[seq] = [weakref.ref(box)]
        if len(nodes.saved) > nodes.prune_at:
            _prune(nodes)
    else:
        entry.append(weakref.ref(box))  # type: ignore[union-attr]
    return box


def unpack(box: Saved) -> torch.Tensor:
    tensor = box.tensor
    if tensor is None:
        raise freed_error()
    return tensor


def freed_error() -> RuntimeError:
    """torch's error for a graph whose saved tensors were freed (here: by a backward on the workers)."""
    return RuntimeError("Trying to backward through the graph a second time (or directly access saved tensors "
                           "after they have already been freed). Saved intermediate values of the graph are freed "
                           "when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to "
                           "backward through the graph a second time or if you need to access saved tensors after "
                        "calling backward.  (tdmesh: that backward ran on the workers)")


def _prune(nodes: _Nodes) -> None:
    """Forget the entries of graphs that died without a backward on the workers."""
    nodes.saved = {seq: refs for seq, refs in nodes.saved.items()
                   if refs is not RELEASED and any(r() is not None for r in refs)}
    nodes.prune_at = max(_PRUNE_FROM, 2 * len(nodes.saved))


def release(sequence_numbers: list[int]) -> None:
    """Free what these nodes saved (their backward ran on the workers)."""
    saved = _nodes.saved
    for seq in sequence_numbers:
        entry = saved.get(seq)
        if entry:
            for ref in entry:
                box = ref()
                if box is not None:
                    box.tensor = None
            saved[seq] = RELEASED


def workers_record(client) -> bool:
    """Whether workers record autograd for an op ``client`` issues now: in grad mode, under tdmesh's
    own saved-tensor hooks (under the user's, ``checkpoint`` say, the client keeps the backward),
    and not while a compiled function traces (its recording replays with no autograd there).
    Once per op: the hooks' order is kept here as torch's push and pop change it (asking torch,
    ``_top_saved_tensors_default_hooks``, cost 6% of an add's client time)."""
    return _grad_enabled() and thread_hooks.ours_on_top and client.sink is client


class _Hooks(threading.local):
    def __init__(self) -> None:
        self.foreign: list[bool] = []  # this thread's saved-tensor hooks, bottom first: True where not tdmesh's
        self.ours_on_top = False


thread_hooks = _Hooks()
on_hooks_change: list = []  # called after each push or pop (autograd_context notes the sequence number)
_push = torch._C._autograd._push_saved_tensors_default_hooks
_pop = torch._C._autograd._pop_saved_tensors_default_hooks


def ours_on_top() -> bool:
    """Whether tdmesh's saved-tensor hooks take what nodes save now (not the user's, ``checkpoint`` say,
    nor none: outside an activation, or with ``TDMESH_BACKWARD=client`` when it began)."""
    return thread_hooks.ours_on_top


def _pushed(pack_hook, unpack_hook) -> None:
    """torch's push of saved-tensor hooks (``saved_tensors_hooks``, ``checkpoint``), followed here."""
    _push(pack_hook, unpack_hook)
    thread_hooks.foreign.append(pack_hook is not pack)
    thread_hooks.ours_on_top = pack_hook is pack
    for hook in on_hooks_change:
        hook()


def _popped() -> None:
    _pop()
    foreign = thread_hooks.foreign
    if foreign:
        foreign.pop()
    thread_hooks.ours_on_top = bool(foreign) and not foreign[-1]
    for hook in on_hooks_change:
        hook()


torch._C._autograd._push_saved_tensors_default_hooks = _pushed
torch._C._autograd._pop_saved_tensors_default_hooks = _popped


def push_hooks() -> bool:
    """Make ``pack``/``unpack`` this thread's saved-tensor hooks (an activation); False where
    torch refuses hooks now (``disable_saved_tensors_hooks``)."""
    if not workers_run_backward():
        return False
    try:
        _pushed(pack, unpack)
    except RuntimeError:
        return False
    return True


def pop_hooks() -> None:
    _popped()


def set_aside() -> bool:
    """Take tdmesh's hooks off the top for a while (``no_mesh``); False where they are not on top."""
    if not thread_hooks.ours_on_top:
        return False
    _popped()
    return True


def bring_back() -> None:
    """Put back hooks that :func:`set_aside` took off."""
    _pushed(pack, unpack)
