"""Rank 0's client process under torchrun: connect the fleet, run the user's script, exit with its code."""

from __future__ import annotations

import runpy
import sys
import traceback


def main() -> int:
    script, args = sys.argv[1], sys.argv[2:]
    from .launcher import _connect_world
    fleet = _connect_world()
    sys.argv = [script, *args]
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(script)))
    code, error = 0, None
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        error = None if code == 0 else f"the script exited with code {code}"
    except BaseException as e:  # noqa: BLE001 - report once, then fail the job
        traceback.print_exc()
        code, error = 1, f"the script raised {type(e).__name__}: {e}"
    try:
        fleet.exit(error)
    except BaseException:  # an unobserved remote error
        traceback.print_exc()
        code = code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
