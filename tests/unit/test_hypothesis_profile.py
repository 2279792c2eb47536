"""The suite's hypothesis settings are hypothesis's own, not the profile torch loads when its
testing internals are imported (tests/conftest.py, ``pytest_runtest_setup``)."""

import os

import hypothesis
import torch.testing._internal.common_utils  # noqa: F401 - loads torch's profile, as the OpInfo tests do


def test_given_tests_run_hypothesis_own_profile_not_torchs():
    assert hypothesis.settings.default.max_examples == 100
    assert hypothesis.settings.default.derandomize == bool(os.environ.get("CI"))
