"""``errors.call_site``: the user's frames of the op being issued, with tdmesh's and torch's passed over.
Whose a frame is, is cached by the id of its code object (hashing a code object hashes its constants,
the code of nested functions among them: ~1.6 us a lookup for a function with closures, once per op):
the cache must classify code objects made and freed by the thousand as their files say."""

from __future__ import annotations

import functools
import os
import sys
import weakref

from hypothesis import given, settings
from hypothesis import strategies as st

import tdmesh.errors as errors
from tdmesh.errors import call_site, site_text

ENGINE_FILE = os.path.join(os.path.dirname(errors.__file__), "engine", "generated_for_a_test.py")


def _function(filename: str, name: str):
    """A function compiled as if it lived in ``filename``, calling ``inner`` (its argument)."""
    namespace: dict = {}
    exec(compile(f"def {name}(inner):\n    return inner()\n", filename, "exec"), namespace)
    return namespace[name]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=6))
def test_the_innermost_user_frame_is_found_through_tdmesh_frames_made_and_freed_again_and_again(layers):
    """``layers``: from the user's outermost function inward, whether each function down to the capture is
    tdmesh's (passed over) or the user's (the innermost user one is the site).  New code objects every
    round: a freed one's id may be reused by the next, which the cache must not confuse."""
    innermost_user = max((i for i, is_tdmesh in enumerate(layers) if not is_tdmesh), default=None)
    expected = "main" if innermost_user is None else f"layer_{innermost_user}"
    for _ in range(20):
        call = call_site
        for i in reversed(range(len(layers))):  # partial: no frame of its own between two layers
            call = functools.partial(_function(ENGINE_FILE if layers[i] else f"/user/code_{i}.py", f"layer_{i}"),
                                     call)
        site = _function("/user/main.py", "main")(call)
        assert site[0][0].co_name == expected, (site_text(site), layers)
        caller = "main" if innermost_user == 0 else f"layer_{innermost_user - 1}" if innermost_user else \
            "test_the_innermost_user_frame_is_found_through_tdmesh_frames_made_and_freed_again_and_again"
        assert site[1][0].co_name == caller, (site_text(site), layers)  # then every frame outward, tdmesh's too


def test_a_site_skips_tdmeshs_frames_until_the_users(tmp_path):
    """Called from tdmesh's code (a function compiled under tdmesh's directory), the site is the user's
    frame that called it, not tdmesh's."""
    inner = _function(ENGINE_FILE, "tdmesh_inner")
    for _ in range(100):  # the same code object again: the cached answer
        site = inner(call_site)
        assert site_text(site).startswith(f'File "{__file__}"'), site_text(site)
        assert site[0][0].co_name == "test_a_site_skips_tdmeshs_frames_until_the_users"


def test_a_thread_begun_in_c_with_fewer_frames_than_skipped_gets_an_empty_site():
    """autograd's engine runs a CUDA backward's ops on a thread it started in C: there the op's only Python
    frames are tdmesh's, fewer than ``issue_lean``'s ``call_site(2)`` skips (``sys._getframe`` raised
    ValueError and every such op failed: found by the H100 lease's ``bench.dispatch_floor``).  A thread
    started by ``_thread.start_new_thread`` has just its function's frame, as that one has."""
    import _thread
    import threading

    results: list = []
    done = threading.Event()

    def shallow() -> None:
        try:
            results.append(call_site(2))
        except Exception as e:  # noqa: BLE001 - the failure this test is about
            results.append(e)
        finally:
            done.set()

    _thread.start_new_thread(shallow, ())
    assert done.wait(10)
    assert results == [[]], results


# ----------------------------------------------------------------- the frames above, held between ops
def _walked(frame) -> list:
    """A site's entries from ``frame`` outward, walked afresh (what ``call_site`` did on every op)."""
    site = []
    while frame is not None and len(site) < 6:
        site.append((frame.f_code, frame.f_lasti))
        frame = frame.f_back
    return site


def _capture():
    """An op's capture: the site, and a fresh walk of the frames above this one."""
    return call_site(hold=True), _walked(sys._getframe(0))


def _direct():
    return _capture()


def _from_a_loop(n):
    return [_capture() for _ in range(n)]  # one caller (the comprehension's frame), the same instruction


def _two_calls():
    first = _capture()
    return [first, _capture()]  # one caller, another instruction


def _first_line():
    return _direct()


def _second_line():
    return _direct()


def _generator():
    while True:
        yield _capture()  # resumed from different callers: the frames above it change while it lives


def _resume_here(gen):
    return next(gen)


def _resume_there(gen):
    return next(gen)


_STEPS = {"direct": lambda gen: [_direct()], "loop": lambda gen: _from_a_loop(3), "first": lambda gen: [_first_line()],
          "second": lambda gen: [_second_line()], "here": lambda gen: [_resume_here(gen)],
          "there": lambda gen: [_resume_there(gen)], "two": lambda gen: _two_calls(),
          "forget": lambda gen: errors.forget_callers() or []}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(sorted(_STEPS)), min_size=1, max_size=25))
def test_a_site_whose_caller_is_held_is_the_site_a_fresh_walk_finds(steps):
    """``call_site`` holds the caller of the last site's innermost frame and reuses the entries above it
    while that caller is at the same instruction: every site must be what walking the frames finds, over
    calls from loops, from other lines of one caller and of other functions, and from a generator resumed by
    different callers
    (whose frames above change while it lives: it is never held)."""
    gen = _generator()
    for step in steps:
        for site, walked in _STEPS[step](gen):
            assert site[0][0] is walked[0][0] and site[1:] == walked[1:], (step, site_text(site))
            assert [entry[0].co_name for entry in site[:2]] in (
                ["_capture", "_direct"], ["_capture", "<listcomp>"], ["_capture", "_from_a_loop"],  # Python 3.12
                ["_capture", "_generator"], ["_capture", "_two_calls"])  # inlines a comprehension: no frame of its own


def test_a_held_caller_that_returned_lets_its_locals_go_when_the_client_sends():
    """A held caller that returned would keep its locals alive: ``forget_callers`` (the client calls it at
    every send, before it queues the frees of dead proxies) lets them go."""
    class Local:
        pass

    def inner(hold):
        return call_site(hold=hold)

    def outer(hold):
        local = Local()
        inner(hold)  # its site's caller is this frame: held where the site is a queued message's
        return weakref.ref(local)

    gone = outer(True)
    errors.forget_callers()
    assert gone() is None
    assert outer(False)() is None  # a site that queues nothing (an error's user_line) holds no caller
