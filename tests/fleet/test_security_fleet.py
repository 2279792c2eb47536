"""Secrets, mutual authentication and TLS with real fleets: local_mesh, a lone worker facing
a fake client announced through the store, and torchrun jobs in attach and script mode (issue 18)."""

import os
import pickle
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

import tdmesh
from tdmesh.certs import make_certificates
from tdmesh.protocol import messages as m
from tdmesh.protocol.handshake import challenge
from tdmesh.protocol.transport import Connection, decode_hello

from paths import REPO

SECURITY_VARS = ("TDMESH_SECRET", "TDMESH_SECRET_FILE", "TDMESH_TLS_CERT", "TDMESH_TLS_KEY", "TDMESH_TLS_CA")


@pytest.fixture
def clean_env(monkeypatch):
    for name in SECURITY_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _job_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SECURITY_VARS}
    env.update(OMP_NUM_THREADS="1", TDMESH_DEVICE="cpu", PYTHONPATH=REPO, **extra)
    return env


@pytest.mark.parametrize("secret", [False, True], ids=["random token", "shared secret"])
def test_with_a_secret_no_token_is_written_to_the_store(clean_env, secret):
    if secret:
        clean_env.setenv("TDMESH_SECRET", "a long random secret for this test")
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, pool=False) as mesh:
        fleet = mesh.fleet
        assert fleet.store.check([fleet.scope + "/controller"])
        assert fleet.store.check([fleet.scope + "/token"]) is not secret
        with mesh.activate():
            assert tdmesh.fetch_shard(torch.arange(3) * 2, host=0, gpu=1).result().tolist() == [0, 2, 4]


def test_a_tls_fleet_encrypts_every_connection(clean_env, tmp_path):
    for name, value in make_certificates(str(tmp_path / "tls")).items():
        clean_env.setenv(name, value)
    with tdmesh.local_mesh(hosts=2, gpus_per_host=2, pool=False) as mesh:  # two relays, four workers
        assert mesh.client.relays and all(type(c.sock) is ssl.SSLSocket for c in mesh.client.conns.values())
        with mesh.activate():
            x = torch.ones(4) * (mesh.rank(("host", "gpu")) + 1)
            assert tdmesh.fetch_shard(x.reduce(("host", "gpu")), host=1, gpu=1).result().tolist() == [10.0] * 4
            for _ in range(200):  # many small frames: TLS must not hold any in its buffer unread
                x = x + 1
            assert tdmesh.fetch_shard(x, host=1, gpu=0).result().tolist() == [203.0] * 4
            big = torch.arange(3 << 18, dtype=torch.float32) + mesh.rank(("host", "gpu"))  # 3 MiB: a bulk frame
            assert torch.equal(tdmesh.fetch_shard(big, host=1, gpu=1).result(), torch.arange(3 << 18) + 3.0)


class Trojan:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_fake_client_announced_through_the_store_directs_no_worker(tmp_path):
    """Anything that reaches the store can write the controller's key.  With a secret, the
    worker that connects there sees no proof of the token, leaves, and runs nothing it sent."""
    marker = tmp_path / "trojan-ran"
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    scope = "tdmesh/fake-test"
    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen(1)
    seen: dict = {}

    def pose_as_the_client() -> None:
        sock, _ = fake.accept()
        conn = Connection(sock)
        challenge(conn)
        payload = conn.recv_payload()
        seen["frame"], seen["hello"] = bytes(payload), decode_hello(payload)
        conn.send_messages([m.Welcome("0" * 64)])  # it cannot make the real proof
        try:
            conn.send_payload(pickle.dumps(Trojan(str(marker))))
            conn.recv_payload()
        except OSError:
            pass  # the worker has hung up

    threading.Thread(target=pose_as_the_client, daemon=True).start()
    store.set(scope + "/controller", f"127.0.0.1:{fake.getsockname()[1]}")
    secret = "the job's secret"
    worker = subprocess.run([sys.executable, "-m", "tdmesh.worker", "--serve"], capture_output=True, text=True,
                            timeout=120, env=_job_env(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0",
                                                      TDMESH_STORE=f"127.0.0.1:{store.port}", TDMESH_SCOPE=scope,
                                                      TDMESH_SECRET=secret, TDMESH_RELAYS="0"))
    assert worker.returncode != 0
    assert "did not prove that it knows this job's token" in worker.stderr, worker.stderr[-2000:]
    assert not marker.exists(), "the worker ran what the fake client sent"
    assert seen["hello"].rank == 0 and secret.encode() not in seen["frame"]
    fake.close()


def _serving_fleet(tmp_path, secret: str, extra: dict | None = None):
    log = open(tmp_path / "fleet.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "tdmesh.worker"], stdout=log, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            env=_job_env(TDMESH_SECRET=secret, **(extra or {})))
    deadline = time.time() + 90
    while time.time() < deadline:
        text = open(tmp_path / "fleet.log").read()
        match = re.search(r"tdmesh\.attach\('([^']+)'\) with the same TDMESH_SECRET", text)
        if match:
            return proc, match.group(1), text
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the fleet never printed how to attach:\n" + open(tmp_path / "fleet.log").read())


ATTACH = """
import sys, torch, tdmesh
endpoint, mode = sys.argv[1:3]
with tdmesh.attach(endpoint) as mesh:
    with mesh.activate():
        x = torch.ones(2) * mesh.process_idx()
        print("attached", tdmesh.fetch_shard(x, host=0, gpu=1).result().tolist(), flush=True)
    if mode == "end":
        mesh.exit()
"""


def test_attach_takes_the_token_from_the_secret_and_refuses_another_secret(tmp_path):
    proc, endpoint, printed = _serving_fleet(tmp_path, "fleet secret")
    script = tmp_path / "attach.py"
    script.write_text(ATTACH)

    def client(secret: str, mode: str):
        return subprocess.run([sys.executable, str(script), endpoint, mode], capture_output=True, text=True,
                              timeout=120, env=_job_env(TDMESH_SECRET=secret))
    try:
        assert "token=" not in printed
        host, port = endpoint.rsplit(":", 1)
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
        scope = store.get("tdmesh/attach/current").decode()
        assert not store.check([scope + "/token"])
        wrong = client("another secret", "stay")
        assert wrong.returncode != 0
        assert f"PermissionError: wrong token for the tdmesh fleet at {endpoint}" in wrong.stderr
        assert "TDMESH_SECRET" in wrong.stderr
        first = client("fleet secret", "stay")  # the fleet kept serving
        assert first.returncode == 0 and "attached [1.0, 1.0]" in first.stdout, first.stderr[-2000:]
        last = client("fleet secret", "end")
        assert last.returncode == 0 and "attached [1.0, 1.0]" in last.stdout, last.stderr[-2000:]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


SCRIPT = """
import ssl, torch, tdmesh
mesh = tdmesh.world_mesh()
kinds = sorted({type(c.sock).__name__ for c in mesh.client.conns.values()})
with mesh.activate():
    total = tdmesh.fetch_shard((torch.ones(2) * mesh.process_idx()).reduce(("host", "gpu"))).result()
print("connections", kinds, "total", total.tolist(), flush=True)
"""


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_torchrun_job_with_a_secret_and_tls_on_or_off(tmp_path, tls):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    extra = make_certificates(str(tmp_path / "tls")) if tls else {}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
                          "-m", "tdmesh.worker", str(script)], capture_output=True, text=True, timeout=180,
                         cwd=tmp_path, env=_job_env(TDMESH_SECRET="job secret", **extra))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    kind = "SSLSocket" if tls else "socket"
    assert f"connections ['{kind}'] total [3.0, 3.0]" in out.stdout
