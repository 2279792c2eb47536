"""Rank 0's client process under torchrun: connect the fleet, run the user's script, exit with its code."""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from torch.distributed.elastic.multiprocessing.errors import record

from .launcher import connect_world


@record
def main() -> int:
    """Run the script; an exception it raises is re-raised after the fleet is down, so that
    ``@record`` writes torchrun's error file and torchrun's summary names it as the root cause."""
    script, args = sys.argv[1], sys.argv[2:]
    fleet = connect_world()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code, error, failure = 0, None, None
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        error = None if code == 0 else f"the script exited with code {code}"
    except BaseException as e:  # noqa: BLE001 - shut the fleet down, then report once
        code, error, failure = 1, f"the script raised {type(e).__name__}: {e}", e
    try:
        fleet.exit(error)
    except BaseException:  # noqa: BLE001 - an unobserved remote error: printed, then the exit code says it
        traceback.print_exc()
        code = code or 1
    if failure is not None:
        raise failure
    return code


if __name__ == "__main__":
    sys.exit(main())
