"""For client scripts of the fleet tests: the dashboard's JSON once every rank has sent a sample."""
import json
import time
import urllib.request


def sampled_view(url: str, timeout: float = 60.0) -> dict:
    """``/api/fleet`` of the page at ``url``, polled until every rank has a memory figure (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        view = json.loads(urllib.request.urlopen(url + "api/fleet", timeout=30).read())
        if all(r["rss"] for r in view["ranks"]) or time.monotonic() > deadline:
            return view
        time.sleep(0.2)
