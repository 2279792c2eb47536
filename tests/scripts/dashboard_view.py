"""For client scripts of the fleet tests: the dashboard's JSON once every rank has sent a sample
and none is busy."""
import json
import time
import urllib.request


def sampled_view(url: str, timeout: float = 60.0) -> dict:
    """``/api/fleet`` of the page at ``url``, polled until every rank has a memory figure and none
    is ``running`` (or ``timeout``).  A quiet client's workers can still be running its last
    messages (a free, a status probe) when their first sample is taken: a later one shows them idle."""
    deadline = time.monotonic() + timeout
    while True:
        view = json.loads(urllib.request.urlopen(url + "api/fleet", timeout=30).read())
        settled = all(r["rss"] and r["state"] != "running" for r in view["ranks"])
        if settled or time.monotonic() > deadline:
            return view
        time.sleep(0.2)
