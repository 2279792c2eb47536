"""tdmesh.dashboard on live CPU fleets: the page in a real headless Chromium (rank grid, a state
that follows a slow remote function, the stacks button, log lines, a screenshot), the JSON view
of every state a rank can be in, and who may read it."""

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

import tdmesh
from tdmesh import ControllerParams, remote
from tdmesh.monitor import stop_dashboard

from browser import Chromium


def _slow_on_rank_0(seconds: float) -> str:
    print("slow function starts", flush=True)
    if int(os.environ["RANK"]) == 0:
        time.sleep(seconds)
    return "done"


def _fails() -> None:
    raise ValueError("a bad value on purpose")


def fleet_json(url: str, **headers) -> dict:
    request = urllib.request.Request(url.split("?")[0] + "api/fleet", headers=headers)
    return json.loads(urllib.request.urlopen(request, timeout=30).read())


def wait_for_view(url: str, test, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        view = fleet_json(url)
        if test(view):
            return view
        shown = {key: view[key] for key in ("ranks", "job", "failure", "warnings")}  # not the long chart
        assert time.monotonic() < deadline, json.dumps(shown, indent=1)[:6000]
        time.sleep(0.2)


def states(view) -> list[str]:
    return [r["state"] for r in view["ranks"]]


@pytest.fixture
def fleet():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, pool=False,
                           controller=ControllerParams(operation_timeout=4.0)) as mesh:
        yield mesh
    stop_dashboard()


def test_the_page_in_chromium_follows_a_slow_remote_function_and_shows_its_stacks(fleet, tmp_path):
    with fleet.activate():
        url = tdmesh.dashboard()
        assert url.startswith("http://127.0.0.1:")
        assert torch.equal(tdmesh.fetch_shard(torch.ones(4) * 2).result(), torch.full((4,), 2.0))
        with Chromium(str(tmp_path / "profile")) as browser:
            page = browser.open(url)
            page.wait_for("document.querySelectorAll('.rank').length === 2 && "
                          "[0, 1].every(r => document.getElementById('rank-' + r).dataset.state === 'idle')")
            assert page.evaluate("document.getElementById('memory-0').textContent").startswith("rank 0RSS ")
            slow = remote(_slow_on_rank_0).call(60)
            # the cell names what the rank runs (a sample taken while the call was still queued says
            # "stream 0: 1 queued" first, which a loaded CI host showed once)
            running = page.wait_for("(e => e && e.dataset.state === 'running' && e.title.includes('_slow_on_rank_0')"
                                    " && e.title)(document.getElementById('rank-0'))")
            assert running.startswith("stream 0: ")
            page.wait_for("document.getElementById('rank-1').dataset.state === 'idle'")
            page.evaluate("document.getElementById('stacks-button').click()")
            stack = page.wait_for("(e => e && e.textContent)(document.getElementById('stacks-rank-0'))")
            assert "Thread 'tdmesh-stream-0'" in stack and "time.sleep(seconds)" in stack
            page.wait_for("document.getElementById('logs-0').textContent.includes('slow function starts')")
            page.wait_for("document.getElementById('rank-0').dataset.state === 'stuck'", timeout=30)
            page.screenshot(str(tmp_path / "dashboard.png"))
            assert not slow.done()
        with open(tmp_path / "dashboard.png", "rb") as f:
            png = f.read()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
        os.kill(fleet._live().hellos[0].pid, signal.SIGKILL)  # rank 0 dies inside the function
        with pytest.raises(tdmesh.DeviceException):
            slow.result(timeout=60)
        view = wait_for_view(url, lambda v: v["ranks"][0]["state"] == "dead")
        assert view["job"]["state"] == "failed" and "worker rank 0" in view["failure"]["text"]


def test_the_json_view_names_every_rank_its_progress_memory_and_the_last_error(fleet):
    with fleet.activate():
        url = tdmesh.dashboard()
        x = torch.zeros(8)
        for _ in range(150):
            x = x + 1
        assert tdmesh.fetch_shard(x).result()[0] == 150
        view = wait_for_view(url, lambda v: all(r["rss"] for r in v["ranks"]))
        assert [r["rank"] for r in view["ranks"]] == [0, 1]
        for entry, hello in zip(view["ranks"], (fleet._live().hellos[0], fleet._live().hellos[1])):
            assert (entry["pid"], entry["device"], entry["host"]) == (hello.pid, "cpu", 0)
            assert entry["completed"] >= 150 and entry["rss"] > 50 << 20 and entry["cuda_allocated"] is None
            assert [s["id"] for s in entry["streams"]] == [0]
        assert view["job"]["issued"] >= 150 and view["job"]["dims"] == {"host": 1, "gpu": 2}
        assert view["last_error"] is None and view["failure"] is None
        failed = remote(_fails).call()
        with pytest.raises(tdmesh.RemoteException):
            failed.result(timeout=60)
        error = fleet_json(url)["last_error"]
        assert error["type"] == "RemoteException" and error["message"] == "ValueError: a bad value on purpose"
        assert "test_dashboard.py" in error["client_traceback"] and "failed = remote(_fails).call()" in \
            error["client_traceback"]
        assert 'raise ValueError("a bad value on purpose")' in error["worker_traceback"]
        assert wait_for_view(url, lambda v: v["chart"])["chart"][-1][0] <= 0  # a point a second: [seconds ago, ...]


def test_nothing_runs_before_dashboard_is_called_and_the_workers_sample_after(fleet):
    def sampler_threads(mesh) -> list[bool]:
        return ["Thread 'tdmesh-sampler'" in text for text in tdmesh.stacks(mesh).values()]

    assert not [t for t in threading.enumerate() if t.name.startswith("tdmesh-dashboard")]
    assert sampler_threads(fleet) == [False, False]
    url = tdmesh.dashboard(mesh=fleet)
    assert {t.name for t in threading.enumerate()} >= {"tdmesh-dashboard", "tdmesh-dashboard-timeline"}
    assert sampler_threads(fleet) == [True, True]
    assert tdmesh.dashboard(mesh=fleet) == url  # one page per process: asked again, the same URL
    tdmesh.stop_dashboard()  # and closed, nothing of it is left: the workers stop sampling too
    deadline = time.monotonic() + 10
    while any(sampler_threads(fleet)) or [t for t in threading.enumerate() if t.name.startswith("tdmesh-dashboard")]:
        assert time.monotonic() < deadline, threading.enumerate()
        time.sleep(0.2)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)
    assert tdmesh.dashboard(mesh=fleet) != url or fleet_json(url)["ranks"]  # opens again (a new free port)
    assert all(sampler_threads(fleet))


def test_a_parked_fleet_shows_parked_after_its_mesh_exits():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
        url = tdmesh.dashboard(mesh=mesh)
        wait_for_view(url, lambda v: states(v) == ["idle", "idle"])
    try:
        view = fleet_json(url)
        assert states(view) == ["parked", "parked"] and view["job"]["state"] == "parked"
    finally:
        stop_dashboard()
        tdmesh.pool.clear()


def test_a_spare_worker_shows_as_spare():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, spares=1, pool=False) as mesh:
        url = tdmesh.dashboard(mesh=mesh)
        try:
            view = wait_for_view(url, lambda v: states(v) == ["idle", "idle", "spare"])
            assert [r["rank"] for r in view["ranks"]] == [0, 1, 2] and "spare" in view["states"]
        finally:
            stop_dashboard()


def test_another_address_requires_the_job_token_and_loopback_refuses_foreign_hosts(fleet):
    url = tdmesh.dashboard(mesh=fleet)
    request = urllib.request.Request(url + "api/fleet", headers={"Host": "attacker.example:80"})
    with pytest.raises(urllib.error.HTTPError, match="403"):
        urllib.request.urlopen(request, timeout=10)
    open_url = tdmesh.dashboard(mesh=fleet, host="0.0.0.0")
    assert "?token=" in open_url
    port, token = open_url.split(":")[2].split("/")[0], open_url.split("token=")[1]
    local = f"http://127.0.0.1:{port}/"
    assert token == fleet.fleet.gate.token  # the job's token
    for wrong in ({}, {"Authorization": "Bearer not-the-token"}):
        with pytest.raises(urllib.error.HTTPError, match="403"):
            fleet_json(local, **wrong)
    assert fleet_json(local, Authorization=f"Bearer {token}")["ranks"]
    page = urllib.request.urlopen(f"{local}?token={token}", timeout=10)
    cookie = page.headers["Set-Cookie"].split(";")[0]
    assert b"tdmesh fleet" in page.read()
    assert fleet_json(local, Cookie=cookie)["ranks"]
