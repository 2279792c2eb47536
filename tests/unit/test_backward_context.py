"""The mesh and stream an op made on autograd's device thread gets (``tdmesh.engine.context``).

A CUDA backward the client's engine runs executes its nodes on autograd's device thread, whose
Python context is empty; a factory there (a double-backward formula's ``ones``, a hook's tensor)
runs on the mesh and stream of the backward call being run.  Here a CPU backward runs a hook in a
fresh ``contextvars.Context``, which is what that thread has; the GPU case is
``tests/gpu/test_gpu.py::test_a_factory_on_autograds_device_thread_runs_on_the_backward_calls_mesh_and_stream``.
"""

from __future__ import annotations

import contextvars

import torch

from tdmesh.engine import context
from tdmesh.engine.stream import DEFAULT_STREAM, Stream, get_active_stream

_LEAVE = object()


def _seen_in_backward(calls: list, set_here=_LEAVE) -> list:
    """What a node running in a fresh context sees, during a backward with ``calls`` registered."""
    seen: list = []

    def look():
        if set_here is not _LEAVE:
            context.active_mesh.set(set_here)
        seen.append((context.active_mesh_or_none(), get_active_stream()))

    w = torch.ones(2, requires_grad=True)
    w.register_hook(lambda g: contextvars.Context().run(look))
    context.backward_calls[:] = calls
    try:
        (w * 2).sum().backward()
        outside = contextvars.Context().run(lambda: (context.active_mesh_or_none(), get_active_stream()))
    finally:
        context.backward_calls.clear()
    return seen + [outside]


def test_a_node_with_no_context_runs_on_the_backward_calls_mesh_and_stream():
    mesh, stream = object(), Stream("side")
    inside, outside = _seen_in_backward([(mesh, stream)])
    assert inside[0] is mesh and inside[1] is stream
    assert outside == (None, DEFAULT_STREAM)  # no backward running: nothing is borrowed


def test_backward_calls_that_differ_lend_nothing():
    inside, _ = _seen_in_backward([(object(), DEFAULT_STREAM), (object(), DEFAULT_STREAM)])
    assert inside == (None, DEFAULT_STREAM)


def test_a_context_that_set_no_mesh_keeps_it():
    """``tdmesh.no_mesh`` sets None: a hook running local code under it stays local."""
    inside, _ = _seen_in_backward([(object(), Stream("side"))], set_here=None)
    assert inside[0] is None
