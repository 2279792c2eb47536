"""``tdmesh.compile(options=)``: inductor's config options, checked on the client as torch.compile checks
them (its own names and value types), before anything is traced or sent."""

import pytest
import torch

import tdmesh
from tdmesh.programs.recording import inductor_options


def test_options_are_kept_as_sorted_pairs():
    fn = tdmesh.compile(lambda x: x, backend="inductor", options={"max_autotune": True,
                                                                  "coordinate_descent_tuning": True})
    assert fn.options == (("coordinate_descent_tuning", True), ("max_autotune", True))
    assert tdmesh.compile(lambda x: x).options == ()


def test_every_option_torch_lists_for_a_mode_is_accepted():
    for mode in ("max-autotune-no-cudagraphs", "default"):
        options = torch._inductor.list_mode_options(mode)
        assert inductor_options("inductor", options) == tuple(sorted(options.items()))


@pytest.mark.parametrize("backend, options, error", [
    ("inductor", {"max_autotun": True}, r"unknown inductor option 'max_autotun'; torch._inductor.list_options\(\)"),
    ("inductor", {"max_autotune": "yes"}, r"option 'max_autotune' takes a bool, not str"),
    ("inductor", {"triton.cudagraphs": True}, r"captures the whole step: use cuda_graph="),
    ("program", {"max_autotune": True}, r"backend='program' has none \(use backend='inductor'\)"),
])
def test_a_bad_option_raises_at_compile(backend, options, error):
    with pytest.raises(ValueError, match=error):
        tdmesh.compile(lambda x: x, backend=backend, options=options)
