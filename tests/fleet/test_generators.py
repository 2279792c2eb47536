"""A client's ``torch.Generator`` on a mesh (``tdmesh/engine/generators.py``): ops drawing from it give local
torch's stream, draw after draw, whatever the ops; a reseed starts it again, as torch does.  Before the
twenty-eighth session each (op, shape) pair drew from its own copy of the generator's first state, so a second
op repeated the first one's numbers without an error.  Drawn by hypothesis: the ops, their sizes, reseeds and a
second generator interleaved, against the same calls on local torch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tdmesh
from tdmesh import fetch_shard, inspect

_CPU = {"device": "cpu"}  # a CPU generator draws CPU tensors (torch's rule): on a CUDA mesh, the workers' CPU
_DRAWS = {
    "randn": lambda g, n: torch.randn(n, 2, generator=g, dtype=torch.float64, **_CPU),
    "rand": lambda g, n: torch.rand(n, generator=g, **_CPU),
    "randint": lambda g, n: torch.randint(0, 1000, (n,), generator=g, **_CPU),
    "randperm": lambda g, n: torch.randperm(n + 3, generator=g, **_CPU),
    "normal_": lambda g, n: torch.zeros(n, dtype=torch.float64, **_CPU).normal_(1.0, 2.0, generator=g),
    "uniform_": lambda g, n: torch.zeros(n, 3, **_CPU).uniform_(-1.0, 1.0, generator=g),
    "exponential_": lambda g, n: torch.zeros(n, **_CPU).exponential_(generator=g),
    "bernoulli": lambda g, n: torch.bernoulli(torch.full((n, 4), 0.3, **_CPU), generator=g),
    "multinomial": lambda g, n: torch.multinomial(torch.ones(n, 6, **_CPU), 3, generator=g),
}

_STEP = st.one_of(st.tuples(st.sampled_from(sorted(_DRAWS)), st.integers(1, 40), st.sampled_from([0, 1])),
                  st.tuples(st.just("reseed"), st.sampled_from([0, 7]), st.sampled_from([0, 1])))


def _run(steps, fetch) -> list:
    generators = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    out = []
    for name, n, which in steps:
        if name == "reseed":
            generators[which].manual_seed(n)
        else:
            out.append(_DRAWS[name](generators[which], n))
    return [fetch(t) for t in out]


@settings(max_examples=25, deadline=None)
@given(steps=st.lists(_STEP, min_size=1, max_size=8))
def test_draws_from_a_clients_generator_follow_local_torchs_stream(mesh1, steps):
    want = _run(steps, lambda t: t)
    with mesh1.activate():
        got = _run(steps, inspect)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_every_rank_draws_the_same_numbers_and_no_op_repeats_another(mesh2x2):
    g_local = torch.Generator().manual_seed(3)
    want = [torch.randn(5, generator=g_local) for _ in range(3)]
    with mesh2x2.activate():
        g = torch.Generator().manual_seed(3)
        drawn = [torch.randn(5, generator=g, **_CPU) for _ in range(3)]
        per_rank = [[fetch_shard(t, host=h, gpu=p).result() for h in range(2) for p in range(2)] for t in drawn]
    for w, ranks in zip(want, per_rank):
        assert all(torch.equal(r, w) for r in ranks)
    assert not torch.equal(want[0], want[1])


def test_a_generator_inside_a_compiled_function_is_refused_at_the_users_line(mesh1):
    g = torch.Generator().manual_seed(0)

    @tdmesh.compile
    def noisy(x):
        return x + torch.randn(3, generator=g, **_CPU)

    with mesh1.activate():
        x = torch.zeros(3, **_CPU)
        with pytest.raises(NotImplementedError, match="torch.Generator") as raised:
            noisy(x)
        assert "test_generators.py" in str(raised.value)
