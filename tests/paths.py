"""Where things are, for tests in any tier (tests/unit, tests/fleet, tests/gpu)."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
SCRIPTS = os.path.join(TESTS, "scripts")
