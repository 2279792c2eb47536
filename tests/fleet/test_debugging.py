"""Remote debugging and logging: breakpoint() in a remote function is a pdb session in the
client's terminal, one rank at a time (driven here over a pipe, as a user would type), under
local_mesh and torchrun; set_log_level changes what the workers log."""

import os
import subprocess
import sys
import time

import pytest
import torch
from _watchdog import CLIENT_ENV, stacks_of_a_hung_client

import tdmesh
from tdmesh import RemoteException, inspect, remote

from paths import REPO, SCRIPTS

SCRIPT = os.path.join(SCRIPTS, "debug_client.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "tdmesh.worker"]
SESSION = "p x\nn\np y\nc\n"  # per rank: x is rank*10+7, a step, y is 2x, continue


def env(**extra):
    return dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", TDMESH_PEER_EXIT_DELAY="2.5", **CLIENT_ENV, **extra)


def run_script(command, typed: str):
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env())
    out, err = proc.communicate(typed, timeout=180)
    return proc.returncode, out, err


def sessions(out: str) -> list[tuple[int, str]]:
    """The pdb sessions in the client's output: (rank, what it printed), in order."""
    parts = out.split("[tdmesh] pdb on worker rank ")[1:]
    return [(int(p.split(" ", 1)[0]), p) for p in parts]


def assert_both_ranks_stepped(rc, out, err):
    assert rc == 0, err[-3000:]
    found = sessions(out)
    assert sorted(rank for rank, _ in found) == [0, 1]  # each rank once, whichever stopped first
    for rank, text in found:
        prompt = f"(Pdb rank {rank}) "
        x, y = rank * 10 + 7, (rank * 10 + 7) * 2
        assert f"{prompt}{x}\n" in text and f"{prompt}{y}\n" in text, text
        assert text.index(f"{prompt}{x}\n") < text.index("-> return y") < text.index(f"{prompt}{y}\n")
        assert "Pdb rank 0" not in text or "Pdb rank 1" not in text  # one rank's session at a time
    assert "results [14, 34]" in out and out.rstrip().endswith("script done")


def test_breakpoint_on_every_rank_is_one_pdb_session_per_rank_under_local_mesh():
    assert_both_ranks_stepped(*run_script([sys.executable, SCRIPT, "local", "both"], SESSION * 2))


def test_breakpoint_on_every_rank_under_torchrun():
    assert_both_ranks_stepped(*run_script(TORCHRUN + [SCRIPT, "torchrun", "both"], SESSION * 2))


def test_quit_makes_the_remote_function_raise_and_the_worker_serves_on():
    rc, out, err = run_script([sys.executable, SCRIPT, "local", "quit"], "w\nq\n")
    assert rc == 0, err[-3000:]
    [(rank, text)] = sessions(out)
    assert rank == 1
    assert "stop_here()" in text and "tdmesh/worker" not in text  # `w` shows the user's frames only
    assert "quit raised RemoteException True" in out  # BdbQuit, at the user's line
    assert "after quit 101" in out and out.rstrip().endswith("script done")


def test_a_rank_in_pdb_is_not_a_stuck_op():
    """With a 1 s operation timeout that fails the fleet, sessions that outlast it still succeed."""
    stuck_fails = env(TDMESH_OPERATION_TIMEOUT="1", TDMESH_FAIL_ON_OPERATION_TIMEOUT="1",
                      TDMESH_PROGRESS_CHECK_INTERVAL="0.2")
    proc = subprocess.Popen([sys.executable, SCRIPT, "local", "both"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=stuck_fails)
    seen = b""
    try:
        for prompts in (1, 2):  # each rank's prompt: keep it waiting past the timeout, then continue
            while seen.count(b"(Pdb rank") < prompts:
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, proc.stderr.read().decode()[-3000:]
                seen += chunk
            time.sleep(3)
            proc.stdin.write(b"c\n")
            proc.stdin.flush()
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the client did not end within 120 s of the last `c`; it printed {seen.decode()[-2000:]!r}\n"
                        f"{stacks_of_a_hung_client(proc)}", pytrace=False)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert b"results [14, 34]" in seen + out


def test_a_rank_stepping_over_slow_code_in_pdb_is_not_a_stuck_op():
    """`n` over a 3 s sleep: the user's thread waits (the client's lock is free, the supervisor
    checks) while the rank's op is 3 times the operation timeout late; it is in pdb, not stuck."""
    stuck_fails = env(TDMESH_OPERATION_TIMEOUT="1", TDMESH_FAIL_ON_OPERATION_TIMEOUT="1",
                      TDMESH_PROGRESS_CHECK_INTERVAL="0.2")
    proc = subprocess.run([sys.executable, SCRIPT, "local", "slow"], input="n\nc\n", capture_output=True,
                          text=True, timeout=180, env=stuck_fails)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "slow 1" in proc.stdout and "-> return int(value)" in proc.stdout
    assert "'in pdb'" in proc.stdout.split("the dashboard saw rank 1")[1].splitlines()[0]  # and never 'stuck'
    assert "'stuck'" not in proc.stdout.split("the dashboard saw rank 1")[1].splitlines()[0]


def fail_here(x):
    raise ValueError("a failure for the log")


def test_set_log_level_shows_worker_debug_lines_until_the_session_ends(tmp_path, monkeypatch):
    monkeypatch.setenv("TDMESH_LOG_FILE", str(tmp_path / "worker{rank}.log"))
    fail = remote(fail_here, propagate=lambda x: x)
    logs = [tmp_path / f"worker{r}.log" for r in (0, 1)]

    def fail_once(mesh):
        with mesh.activate(), pytest.raises(RemoteException):
            inspect(fail(torch.ones(1)))
        return [log.read_text().count("failed on worker") for log in logs]

    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
        pids = [h.pid for h in mesh.client.hellos.values()]
        assert fail_once(mesh) == [0, 0]  # TDMESH_LOG_LEVEL's default, WARNING, hides the debug line
        with pytest.raises(ValueError, match="unknown log level"):
            tdmesh.set_log_level("LOUD", mesh)
        with mesh.activate():
            tdmesh.set_log_level("debug")
        assert fail_once(mesh) == [1, 1]
        tdmesh.set_log_level(30, mesh)
        assert fail_once(mesh) == [1, 1]
        tdmesh.set_log_level("DEBUG", mesh)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:  # the same warm workers, a new session
        assert [h.pid for h in mesh.client.hellos.values()] == pids
        assert fail_once(mesh) == [1, 1]  # the level went back when the last session ended


def test_a_hung_test_fails_at_its_time_limit_with_the_stacks_of_its_workers(tmp_path):
    """tests/_watchdog.py on a real fleet: a test waiting on a remote function that never
    returns fails at its limit, and the failure shows the worker's thread inside that
    function (each worker writes its stacks on SIGUSR1, faulthandler at the C level)."""
    import textwrap
    (tmp_path / "conftest.py").write_text("from _watchdog import pytest_runtest_protocol, pytest_unconfigure  # noqa\n")
    (tmp_path / "test_hung_fleet.py").write_text(textwrap.dedent("""
        import pytest, tdmesh

        def wait_forever():
            import threading
            threading.Event().wait()

        @pytest.fixture(scope="module")
        def mesh():
            fleet = tdmesh.local_mesh(hosts=1, gpus_per_host=1, pool=False)
            yield fleet.__enter__()
            stuck = RuntimeError("a test ran past its limit")  # leave as after an error: no drain
            fleet.__exit__(RuntimeError, stuck, None)

        def test_starts_the_fleet(mesh):  # under the default limit: starting may be slow on a busy host
            pass

        @pytest.mark.time_limit(5)
        def test_waits_on_a_worker(mesh):
            with mesh.activate():
                tdmesh.call_on_shard_and_fetch(tdmesh.remote(wait_forever)).result()
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "tests"), REPO, str(tmp_path)]),
           "TDMESH_DEVICE": "cpu"}
    env.pop("TDMESH_STACKS_DIR", None)  # the inner run makes its own
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-o", "addopts=", "-o", "markers=time_limit", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "ran past its 5 s time limit" in out and "1 failed, 1 passed" in out, out
    assert "--- worker process" in out and "in wait_forever" in out, out


def _blocked_on_the_main_stream(seconds):
    time.sleep(seconds)
    return "done"


def _main_stream(text: str) -> str:
    main = text[text.index("Thread 'tdmesh-stream-0'"):]
    return main[:main.index("\nThread ")] if "\nThread " in main else main


def test_stacks_answer_while_the_main_stream_is_blocked_and_nothing_is_lost(mesh2x2):
    with mesh2x2.activate():
        blocked = remote(_blocked_on_the_main_stream).call(8)
        deadline = time.monotonic() + 30
        while True:  # until each rank's main stream is inside the function (it may still be importing it)
            stacks = tdmesh.stacks(timeout=30)
            assert sorted(stacks) == [0, 1, 2, 3]
            if all("_blocked_on_the_main_stream" in _main_stream(t) for t in stacks.values()):
                break
            assert time.monotonic() < deadline, stacks
            time.sleep(0.2)
        assert not blocked.done()  # answered while the function still ran
        for text in stacks.values():
            assert "time.sleep(seconds)" in _main_stream(text) and "Thread 'MainThread'" in text
        assert [v for _, v in blocked.result(timeout=60)] == ["done"] * 4
        assert torch.equal(tdmesh.fetch_shard(torch.ones(2) * 3).result(), torch.full((2,), 3.0))
