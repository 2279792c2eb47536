"""``tdmesh.no_mesh`` inside an active mesh: local code runs as plain torch runs it, off tdmesh's dispatch
mode and saved-tensor hooks (it went through both: a local training step ran 2.5x slower than plain torch),
while mesh tensors used there still reach their mesh and a mesh activated inside it is a mesh again."""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import tdmesh
from tdmesh import fetch_shard
from tdmesh.engine import backward as worker_backward
from tdmesh.engine import saved
from tdmesh.engine.dispatch import MESH_MODE


def _state():
    return MESH_MODE in _get_current_dispatch_mode_stack(), saved.ours_on_top()


def test_local_code_under_no_mesh_meets_neither_the_dispatch_mode_nor_the_saved_tensor_hooks(mesh2x2):
    boxed_before = len(saved.saved_by_node())
    with mesh2x2.activate():
        assert _state() == (True, True)
        with tdmesh.no_mesh.activate():
            assert _state() == (False, False)
            w = torch.ones(3, requires_grad=True)
            loss = (w.exp() * w).sum()  # local autograd: nothing filed in tdmesh's boxes
            loss.backward()
            assert type(w.grad) is torch.Tensor
            assert len(saved.saved_by_node()) == boxed_before
        assert _state() == (True, True)
        assert type(torch.ones(2)) is tdmesh.Tensor
    assert _state() == (False, False)
    torch.testing.assert_close(w.grad, (torch.ones(3) + 1) * torch.e)


def test_a_mesh_inside_no_mesh_is_a_mesh_and_each_exit_restores_what_was_there(mesh2x2):
    host1 = mesh2x2.slice(host=1)
    with mesh2x2.activate():
        with tdmesh.no_mesh.activate():
            with host1.activate():
                assert _state() == (True, True)
                x = torch.ones(2)  # a factory: the dispatch mode is back for it
                assert type(x) is tdmesh.Tensor and x.mesh is host1
                with tdmesh.no_mesh.activate():
                    assert _state() == (False, False)
                    assert type(torch.ones(2)) is torch.Tensor
                assert _state() == (True, True)
            assert _state() == (False, False)
            assert type(torch.ones(2)) is torch.Tensor
        assert _state() == (True, True)
        assert fetch_shard(x * 2).result().tolist() == [2.0, 2.0]
    with tdmesh.no_mesh.activate():  # no mesh around it at all
        assert type(torch.ones(2)) is torch.Tensor
    assert _state() == (False, False)


def test_mesh_tensors_used_under_no_mesh_still_reach_their_mesh_and_backward_on_the_workers(mesh2x2):
    with mesh2x2.activate():
        w = torch.ones(3).requires_grad_()
        loss = (w * 3).sum()
        counts = dict(worker_backward.COUNTS)
        with tdmesh.no_mesh.activate():
            y = w.detach() + 1  # an op on a mesh tensor: on its mesh, through the tensor
            loss.backward()
        assert type(y) is tdmesh.Tensor
        assert worker_backward.COUNTS["workers"] == counts["workers"] + 1
        assert fetch_shard(w.grad).result().tolist() == [3.0, 3.0, 3.0]
        assert fetch_shard(y).result().tolist() == [2.0, 2.0, 2.0]


def test_a_mesh_activated_in_another_thread_makes_mesh_tensors_there(mesh2x2):
    """torch's mode stacks are per thread: a second thread's activation pushes the dispatch mode on its own
    stack (it was pushed once per process: factories in that thread made local tensors, silently)."""
    out: dict = {}

    def other_thread():
        with mesh2x2.activate():
            out["inside"] = torch.ones(2) * 3
            out["modes"] = _state()
        out["after"] = (type(torch.ones(2)), _state())

    with mesh2x2.activate():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert _state() == (True, True)  # this thread's stacks are untouched by the other's exit
        assert type(torch.ones(2)) is tdmesh.Tensor
        assert type(out["inside"]) is tdmesh.Tensor and out["modes"] == (True, True)
        assert fetch_shard(out["inside"]).result().tolist() == [3.0, 3.0]
    assert out["after"] == (torch.Tensor, (False, False))
    assert _state() == (False, False)
