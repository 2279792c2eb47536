"""Monarch's ``OpaqueRef`` and ``OpaqueModule`` on tdmesh (issue 57): Python objects that live on the workers.

An ``OpaqueRef`` a remote function returns is a handle on the client and each rank's object on the workers:
passed to a later remote function it is that rank's box again, its ``.value`` refused on the client, the objects
freed when the handle dies (the workers' table shrinks, Monarch's ``test_opaqueRef_key_deleted``).  An
``OpaqueModule``'s parameters alias the live weights, and a call with gradients is one node of the client's
autograd graph: the differential test checks its outputs and gradients against the same module run in local
torch with the rank's weights, for modules hypothesis draws, under both places a backward may run.
"""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tdmesh
from tdmesh import OpaqueModule, OpaqueObject, OpaqueRef, RemoteException

LIVE_REFS = tdmesh.remote("tdmesh.worker.builtins.live_refs")


@pytest.fixture(scope="module")
def mesh():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as m:
        yield m


def make_counter(start):
    return OpaqueRef({"n": start})


def bump(ref, by):
    ref.value["n"] += by
    return torch.tensor(float(ref.value["n"]))


def replace(ref, value):
    ref.value = {"n": value}


def not_a_ref(n):
    return torch.zeros(n)


make_declared = tdmesh.remote(make_counter, propagate=lambda start: OpaqueRef(None))
make_cached = tdmesh.remote(make_counter)  # cached propagation: the probe's run says it is an OpaqueRef
bump_it = tdmesh.remote(bump, propagate=lambda ref, by: torch.zeros(()))
replace_it = tdmesh.remote(replace, propagate=lambda ref, value: None)
liar = tdmesh.remote(not_a_ref, propagate=lambda n: OpaqueRef(None))


def _live() -> list[int]:
    gc.collect()
    return [n for _, n in LIVE_REFS.call().get()]


@pytest.mark.parametrize("make", [make_declared, make_cached], ids=["propagator", "cached"])
def test_an_opaque_ref_a_remote_function_returns_is_each_ranks_object(mesh, make):
    with mesh.activate():
        before = _live()
        ref = make(10)
        assert type(ref) is OpaqueRef and ref.mesh is mesh
        first = bump_it(ref, 1)
        second = bump_it(ref, 5)  # the same objects: state kept between calls
        replace_it(ref, 100)
        third = bump_it(ref, 1)
        for g in range(2):
            got = tdmesh.fetch_shard((first, second, third), host=0, gpu=g).result()
            assert [float(t) for t in got] == [11.0, 16.0, 101.0]
        assert _live() == [n + 4 for n in before]  # the ref and the three results
        del ref, first, second, third
        assert _live() == before  # the workers' objects went with the handle


def test_the_value_lives_only_on_the_workers(mesh):
    with mesh.activate():
        ref = make_declared(1)
        with pytest.raises(RuntimeError, match="Client is attempting to access an OpaqueRef"):
            _ = ref.value
        with pytest.raises(RuntimeError, match="Client is attempting to set an OpaqueRef"):
            ref.value = 3
        with pytest.raises(RuntimeError, match="Client is attempting to create an OpaqueRef"):
            OpaqueRef([1, 2])
        wrapped = OpaqueObject(ref)  # Monarch's OpaqueObject(ref): the same objects, with methods
        assert wrapped.call_method_on_shard_and_fetch("get", "n").result() == 1


def test_a_result_unlike_its_propagation_is_the_functions_error(mesh):
    with mesh.activate():
        bad = liar(3)  # described as an OpaqueRef, returns a tensor
        with pytest.raises(RemoteException, match="described an OpaqueRef"):
            tdmesh.inspect(bump_it(bad, 1))
        wrong = tdmesh.remote(make_counter, propagate=lambda start: torch.zeros(()))(1)
        with pytest.raises(RemoteException, match="is an OpaqueRef, where its propagation described a tensor"):
            tdmesh.inspect(wrong)
        assert float(tdmesh.inspect(bump_it(make_declared(2), 1))) == 3.0  # the fleet goes on


def test_an_opaque_ref_inside_a_compiled_function_is_refused(mesh):
    with mesh.activate():
        @tdmesh.compile
        def step():
            return make_declared(1)

        with pytest.raises(tdmesh.UsageError, match="make them before the compiled function"):
            step()


def test_an_opaque_modules_parameters_alias_its_live_weights(mesh):
    with mesh.activate():
        linear = OpaqueModule("torch.nn.Linear", 3, 3)
        with torch.no_grad():
            for p in linear.parameters():
                p.zero_()
        out = linear.call_method("forward", lambda self, x: x.clone(), torch.rand(3, 3))
        assert float(tdmesh.inspect(out.abs().sum())) == 0.0
        assert all(p.requires_grad for p in linear.parameters())


# Modules Monarch users keep on the workers: (constructor path, args, kwargs, input shape, output propagator)
MODULES = {
    "linear": ("torch.nn.Linear", (4, 3), {}, (5, 4), lambda self, x: x.new_empty(5, 3)),
    "linear_nobias": ("torch.nn.Linear", (4, 2), {"bias": False}, (2, 4), lambda self, x: x.new_empty(2, 2)),
    "conv1d": ("torch.nn.Conv1d", (2, 3, 3), {}, (1, 2, 7), lambda self, x: x.new_empty(1, 3, 5)),
    "layernorm": ("torch.nn.LayerNorm", (6,), {}, (3, 6), lambda self, x: x.clone()),
    "gru": ("torch.nn.GRU", (4, 5), {"batch_first": True}, (2, 3, 4),
            lambda self, x: (x.new_empty(2, 3, 5), x.new_empty(1, 2, 5))),
}


@settings(max_examples=10, deadline=None, database=None)
@given(name=st.sampled_from(sorted(MODULES)), input_grad=st.booleans(), frozen=st.integers(-1, 1),
       where=st.sampled_from(["auto", "client"]), weights=st.lists(st.floats(-2, 2), min_size=2, max_size=2))
def test_an_opaque_module_call_differentiates_as_local_torch(mesh, name, input_grad, frozen, where, weights):
    """Outputs and the gradients of the input and of each parameter (one frozen when ``frozen`` names it) equal
    the same module run in local torch with rank g's weights; the worker's graph is freed after backward."""
    path, args, kwargs, shape, propagator = MODULES[name]
    with pytest.MonkeyPatch.context() as env, mesh.activate():
        env.setenv("TDMESH_BACKWARD", where)
        module = OpaqueModule(path, *args, **kwargs)
        params = module.parameters()
        if 0 <= frozen < len(params):
            params[frozen].requires_grad_(False)
        assume(input_grad or any(p.requires_grad for p in params))  # else torch's backward refuses, as tdmesh's
        x = (torch.rand(shape) + mesh.rank("gpu")).requires_grad_(input_grad)
        before = _live()
        out = module(x, propagator=propagator)
        outs = list(out) if isinstance(out, tuple) else [out]
        loss = sum(o.sum() * w for o, w in zip(outs, weights))
        loss.backward()
        grads = [p.grad if p.requires_grad else torch.zeros(()) for p in params]
        fetched = [tdmesh.fetch_shard((x, outs, x.grad if input_grad else torch.zeros(()), grads, params),
                                      host=0, gpu=g).result() for g in range(2)]
        x.grad = None
        for p in params:
            p.grad = None
        del out, outs, loss, grads
        assert _live() == before  # the worker's graph (the forward's box) went with the client's graph
    for xv, got_outs, xg, got_grads, pv in fetched:
        local = getattr(torch.nn, path.rsplit(".", 1)[1])(*args, **kwargs)
        with torch.no_grad():
            for p, v in zip(local.parameters(), pv):
                p.copy_(v)
        lparams = list(local.parameters())
        if 0 <= frozen < len(lparams):
            lparams[frozen].requires_grad_(False)
        lx = xv.clone().requires_grad_(input_grad)
        lout = local(lx)
        louts = list(lout) if isinstance(lout, tuple) else [lout]
        sum(o.sum() * w for o, w in zip(louts, weights)).backward()
        for a, b in zip(got_outs, louts):
            torch.testing.assert_close(a, b.detach())
        if input_grad:
            torch.testing.assert_close(xg, lx.grad)
        for g, lp in zip(got_grads, lparams):
            torch.testing.assert_close(g, lp.grad if lp.requires_grad else torch.zeros(()))


def test_an_opaque_module_without_gradients_is_a_plain_call(mesh):
    with mesh.activate():
        module = OpaqueModule("torch.nn.Linear", 2, 2)
        x = torch.rand(4, 2)
        with torch.no_grad():
            out = module(x, propagator=lambda self, x: x.clone())
        assert not out.requires_grad and tuple(out.shape) == (4, 2)
        w, b = module.parameters()
        torch.testing.assert_close(tdmesh.inspect(out), tdmesh.inspect(x) @ tdmesh.inspect(w).T + tdmesh.inspect(b))
