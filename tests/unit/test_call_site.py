"""``errors.call_site``: the user's frames of the op being issued, with tdmesh's and torch's passed over.
Whose a frame is, is cached by the id of its code object (hashing a code object hashes its constants,
the code of nested functions among them: ~1.6 us a lookup for a function with closures, once per op):
the cache must classify code objects made and freed by the thousand as their files say."""

from __future__ import annotations

import functools
import os

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
