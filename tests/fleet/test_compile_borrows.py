"""A compiled function that borrows a captured tensor from another stream, against its eager runs.

Monarch's ``test_repeat_inner_borrow``: ``a`` on the default stream, ``b`` on another, and a compiled function
that borrows ``b`` into the default stream and adds it to ``a``.  Its second call failed with ``WRONG_STREAM``:
the replay checked every capture against the calling stream, though the function reaches ``b`` only through
the borrow it makes (and drops) itself, which every replay repeats.  A capture that lives on another stream
than the call's is now checked on its own stream (dropped? borrowed elsewhere?).  Hypothesis draws which
stream the borrowed tensor lives on, the borrow's mutability, what the function does through it and how many
times it is called; each compiled run equals the same function run eagerly on fresh tensors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tdmesh
from tdmesh.engine.stream import DEFAULT_STREAM

OTHER = tdmesh.Stream("borrows-other")


@pytest.fixture(scope="module")
def mesh():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as m:
        yield m


def streams(lives_on: str):
    """(the stream the borrowed tensor lives on, the stream that borrows it)."""
    return (DEFAULT_STREAM, OTHER) if lives_on == "main" else (OTHER, DEFAULT_STREAM)


def make(lives_on: str, mutable: bool, scale: float, use_with: bool):
    """Fresh tensors and a function over them, as a user writes it: ``src`` on one stream, borrowed into the
    other, where ``acc`` lives; a mutable borrow also writes ``src`` through the borrow."""
    home, into = streams(lives_on)
    with home.activate():
        src = torch.arange(4.0) + 1
    with into.activate():
        acc = torch.zeros(4)

    def fn():
        c, borrow = into.borrow(src, mutable=mutable)
        with into.activate():
            acc.add_(c * scale)
            if mutable:
                c.mul_(0.5)
        if use_with:
            with borrow:
                pass
        else:
            borrow.drop()

    return fn, src, acc, home, into


def values(src, acc, home, into):
    with home.activate():
        s = tdmesh.fetch_shard(src).result()
    with into.activate():
        a = tdmesh.fetch_shard(acc).result()
    return s, a


@settings(max_examples=20, deadline=None, database=None)
@given(lives_on=st.sampled_from(["main", "other"]), mutable=st.booleans(), calls=st.integers(1, 4),
       scale=st.sampled_from([0.5, 1.0, 3.0]), use_with=st.booleans())
def test_a_compiled_function_that_borrows_a_capture_equals_its_eager_runs(mesh, lives_on, mutable, calls, scale,
                                                                            use_with):
    with mesh.activate():
        eager, *eager_state = make(lives_on, mutable, scale, use_with)
        compiled_fn, *compiled_state = make(lives_on, mutable, scale, use_with)
        compiled = tdmesh.compile(compiled_fn)
        for _ in range(calls):
            eager()
            compiled()
        want = values(*eager_state)
        got = values(*compiled_state)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), (got, want)


def monarchs_case():
    """Monarch's ``test_repeat_inner_borrow``: ``a`` here, ``b`` on the other stream, a compiled function that
    borrows ``b`` into this stream and adds it to ``a``."""
    a = torch.zeros(())
    with OTHER.activate():
        b = torch.ones(())

    @tdmesh.compile
    def fn():
        c, borrow = DEFAULT_STREAM.borrow(b)
        with borrow:
            a.add_(c)

    return a, b, fn


def test_monarchs_repeat_inner_borrow(mesh):
    """Monarch's own case, as its test writes it: three calls, then ``a == 3``."""
    with mesh.activate():
        a, _, fn = monarchs_case()
        for _ in range(3):
            fn()
        assert tdmesh.fetch_shard(a).result().item() == 3


def test_a_capture_dropped_after_the_trace_is_still_refused(mesh):
    """The check on a borrowed capture's own stream still refuses what eager code would: a dropped tensor."""
    with mesh.activate():
        _, b, fn = monarchs_case()
        fn()
        fn()
        with OTHER.activate():
            b.drop()
        with pytest.raises(tdmesh.PlacementError, match="DROPPED"):
            fn()
