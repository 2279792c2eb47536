"""A client's ``torch.Generator`` passed to an op on a mesh (``torch.randn(..., generator=g)``, ``normal_``,
``multinomial``, ``randperm``): it draws on the workers, and must go on from where its last draw there ended.

It used to travel pickled inside each op's definition: every (op, argument metadata) pair got its own copy
of the client's state, which never advanced on the client, so a second op drawing from ``g`` repeated the
first one's numbers (``randn(3, generator=g)`` then ``randn(2, 2, generator=g)`` began alike): silently not
torch's stream.  Now each worker keeps one copy per client generator (``protocol.arguments.GeneratorArg``,
made on first use) that every op drawing from it advances, as torch advances one generator.  Before such
an op the client sends its generator's state to the workers where the state changed since it last did
(first use, or the user reseeded it): right after sending, the client's own copy is reseeded at random, so
that any reseed of the user's (``g.manual_seed(0)`` again, to repeat a draw) is seen as a change, never
taken for the state already sent.  So on the client ``g`` does not describe the draws made on the mesh:
read or restore a generator's state only where it draws locally, and a generator that draws both on a mesh
and locally (a local tensor's ``normal_``, ``no_mesh``) draws locally from its client state, not where the
mesh's draws left off: not torch's one stream, though never a repeat.  A generator used on two meshes draws
on each independently.  Each rank draws the same numbers (one generator).  Inside a compiled function a
generator is refused: sending its state is the client's business at each call, not a recorded op.
"""

from __future__ import annotations

import itertools
import random
import weakref
from collections import OrderedDict

import torch

from ..errors import user_line
from ..protocol import messages as m
from ..protocol.arguments import SET_GENERATOR_FUNCTION
from .issue import issue

__all__ = ["key_part", "send_state", "wire"]

_keys = itertools.count(1)
# torch hands each op a new Python object for the same generator: entries are by its C++ object (``_cdata``),
# each holding one of its Python objects (so that address is not reused while the entry lives):
# _cdata -> [key, state after the last send or None, meshes sent to, a Python object of it]
_known: OrderedDict[int, list] = OrderedDict()
KEPT = 1024  # the generators remembered, most recently used first kept: one forgotten and used again
# starts its draws on the workers from the client's (random) state, never again from one already drawn
_nonces = random.Random()


def _entry(generator: torch.Generator) -> list:
    address = generator._cdata  # type: ignore[attr-defined]
    entry = _known.get(address)
    if entry is None:
        entry = _known[address] = [next(_keys), None, weakref.WeakSet(), generator]
        if len(_known) > KEPT:
            _known.popitem(last=False)
    else:
        _known.move_to_end(address)
    return entry


def key_part(generator: torch.Generator) -> tuple:
    """The generator's part of an op's plan key (its client key, not the object: plans outlive it)."""
    return (torch.Generator, _entry(generator)[0])


def wire(generator: torch.Generator) -> m.GeneratorArg:
    """How the generator travels in an op: the worker's copy of it, by key."""
    return m.GeneratorArg(_entry(generator)[0], generator.device.type)


def send_state(generator: torch.Generator, mesh, stream) -> None:
    """Before an op on ``mesh`` that draws from ``generator``: the workers' copy takes the client's state
    where it changed since it was last sent there (or was never sent)."""
    client = mesh.client
    if client.sink is not client:
        raise NotImplementedError(f"a torch.Generator passed to an op inside a tdmesh.compile'd function: a "
                                  f"generator's state is the client's to send, not part of a recording; seed the "
                                  f"workers' generators with torch.manual_seed under the mesh instead\n  at "
                                  f"{user_line()}")
    entry = _entry(generator)
    state = generator.get_state()
    if entry[1] is not None and mesh in entry[2] and torch.equal(state, entry[1]):
        return
    key, device = entry[0], generator.device.type

    def build(seq, results, _mutated):
        return m.CallFunction(seq, results, (), SET_GENERATOR_FUNCTION, (key, device, state), {}, stream.id)

    issue(mesh, build, stream=stream)
    if entry[1] is None or not torch.equal(state, entry[1]):
        generator.manual_seed(_nonces.getrandbits(63))  # a reseed of the user's is then always a change
        entry[1] = generator.get_state()
        entry[2] = weakref.WeakSet()
    entry[2].add(mesh)
