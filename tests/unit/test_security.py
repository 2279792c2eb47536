"""Secrets, the mutual handshake and TLS on real sockets, in process (issue 18)."""

import logging
import os
import socket
import ssl
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tdmesh.certs import make_certificates
from tdmesh.errors import UsageError
from tdmesh.protocol import messages as m
from tdmesh.protocol.handshake import AuthenticationError, challenge, check_hello, identity, join, welcome
from tdmesh.protocol.security import derive, job_token, load_secret, secret_token, server_tls, warn_if_exposed
from tdmesh.protocol.transport import Connection, connect, decode_hello, encode

TOKEN = "k" * 64
HELLO = m.Hello(3, b"", "", "host", 1234, "cpu", None)


@pytest.fixture
def no_secret(monkeypatch):
    for name in ("TDMESH_SECRET", "TDMESH_SECRET_FILE", "TDMESH_TLS_CERT", "TDMESH_TLS_KEY", "TDMESH_TLS_CA"):
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------- secrets
def test_the_token_is_derived_from_the_secret_and_the_scope(no_secret, monkeypatch):
    assert secret_token("tdmesh/run/0") is None
    token, publish = job_token("tdmesh/run/0")
    assert publish and len(token) == 32
    monkeypatch.setenv("TDMESH_SECRET", "correct horse battery staple")
    assert job_token("tdmesh/run/0") == (secret_token("tdmesh/run/0"), False)
    assert secret_token("tdmesh/run/0") == derive(b"correct horse battery staple", "tdmesh-job", "tdmesh/run/0")
    assert secret_token("tdmesh/run/1") != secret_token("tdmesh/run/0")  # a restart gets a new token
    monkeypatch.setenv("TDMESH_SECRET", "another")
    assert secret_token("tdmesh/run/0") != derive(b"correct horse battery staple", "tdmesh-job", "tdmesh/run/0")


def test_a_secret_file_must_be_private(no_secret, monkeypatch, tmp_path):
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    monkeypatch.setenv("TDMESH_SECRET_FILE", str(path))
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match=r"readable by group or others \(mode -rw-r--r--\); chmod 600"):
        load_secret()
    os.chmod(path, 0o600)
    assert load_secret() == b"s3cret"
    monkeypatch.setenv("TDMESH_SECRET", "too")
    with pytest.raises(UsageError, match="not both"):
        load_secret()
    monkeypatch.delenv("TDMESH_SECRET")
    path.write_text("")
    with pytest.raises(UsageError, match="is empty"):
        load_secret()


def test_a_multi_node_job_without_a_secret_warns_once(no_secret, monkeypatch, caplog):
    import tdmesh.protocol.security as security
    caplog.set_level(logging.WARNING, logger="tdmesh")
    monkeypatch.setattr(security, "_warned", False)
    warn_if_exposed(8, 8)  # one node: nothing to say
    monkeypatch.setenv("TDMESH_SECRET", "s")
    warn_if_exposed(16, 8)  # a secret: nothing to say
    monkeypatch.delenv("TDMESH_SECRET")
    warn_if_exposed(16, 8)
    warn_if_exposed(16, 8)
    warnings = [r.getMessage() for r in caplog.records if "without TDMESH_SECRET" in r.getMessage()]
    assert len(warnings) == 1
    assert "run any code on every worker" in warnings[0] and "read all of its traffic" in warnings[0]


# ----------------------------------------------------------------------------- the handshake
class Listener:
    """A listening socket that runs the listener's half of the handshake for each connection
    (``token``), as the client's gate and the relays do; ``hellos`` records what arrived."""

    def __init__(self, token: str, tls=None, answer=None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.token, self.tls, self.answer = token, tls, answer
        self.hellos: list = []
        self.frames: list[bytes] = []
        self.errors: list[BaseException] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                return
            try:
                sock.settimeout(2)  # as the gate cuts a handshake that stalls (a plain peer of a TLS one)
                if self.tls is not None:
                    sock = self.tls.wrap_socket(sock, server_side=True)
                conn = Connection(sock)
                nonce = challenge(conn)
                payload = conn.recv_payload()
                self.frames.append(bytes(payload))
                hello = decode_hello(payload)
                ok = check_hello(self.token, nonce, hello)
                self.hellos.append((hello, ok))
                if self.answer is not None:
                    conn.send_messages([self.answer])
                elif ok:
                    welcome(conn, self.token, nonce, hello)
                conn.close()
            except Exception as e:  # noqa: BLE001 - recorded for the test
                self.errors.append(e)
                sock.close()

    def close(self) -> None:
        self.sock.close()


def test_both_sides_prove_the_token_and_never_send_it():
    listener = Listener(TOKEN)
    join(connect("127.0.0.1", listener.port), TOKEN, HELLO, "the test listener")
    (hello, ok), = listener.hellos
    assert ok and hello.rank == 3 and len(hello.nonce) == 16
    assert TOKEN.encode() not in listener.frames[0]
    listener.close()


def test_a_wrong_token_is_refused_by_the_listener():
    listener = Listener(TOKEN)
    with pytest.raises(AuthenticationError, match="closed the connection during tdmesh's handshake"):
        join(connect("127.0.0.1", listener.port), "w" * 64, HELLO, "the test listener")
    assert listener.hellos[0][1] is False
    listener.close()


def test_a_listener_that_cannot_prove_the_token_gets_no_obedience():
    fake = Listener("someone else's token", answer=m.Welcome("f" * 64))
    with pytest.raises(AuthenticationError, match="did not prove that it knows this job's token"):
        join(connect("127.0.0.1", fake.port), TOKEN, HELLO, "the fake client")
    fake.close()


def test_a_recorded_handshake_replays_into_nothing():
    genuine = Listener(TOKEN)
    join(connect("127.0.0.1", genuine.port), TOKEN, HELLO, "the listener")
    recorded_hello = genuine.frames[0]
    # the hello, replayed to a new connection: its proof covers the old challenge
    sock = socket.create_connection(("127.0.0.1", genuine.port))
    replay = Connection(sock)
    replay.recv_payload()  # this connection's own challenge, which the replay ignores
    replay.send_payload(recorded_hello)
    assert replay.recv_payload() is None  # refused: no Welcome
    assert [ok for _, ok in genuine.hellos] == [True, False]
    genuine.close()
    # the listener's Welcome, replayed to a new joiner: it covers the old nonces
    recorder = Listener(TOKEN)
    recorded: list = []
    original = Connection.recv_payload

    def keep(self):
        payload = original(self)
        recorded.append(bytes(payload) if payload is not None else None)
        return payload

    Connection.recv_payload = keep  # record what the joiner receives
    try:
        join(connect("127.0.0.1", recorder.port), TOKEN, HELLO, "the listener")
    finally:
        Connection.recv_payload = original
    old_welcome, = [msg for msg in map(pickle_loads, filter(None, recorded)) if type(msg) is m.Welcome]
    fake = Listener("unknown", answer=old_welcome)
    with pytest.raises(AuthenticationError, match="did not prove"):
        join(connect("127.0.0.1", fake.port), TOKEN, HELLO, "a replaying listener")
    recorder.close()
    fake.close()


def pickle_loads(payload: bytes):
    import pickle
    return pickle.loads(payload)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=16, max_size=16), st.binary(min_size=16, max_size=16), st.integers(0, 1 << 20),
       st.integers(0, 1 << 20))
def test_a_proof_holds_only_for_its_challenge_and_identity(asked, other, rank, pid):
    from tdmesh.protocol.handshake import _hello_proof
    hello = m.Hello(rank, b"n" * 16, "", "h", pid, "cpu", None)
    hello = hello._replace(proof=_hello_proof(TOKEN, asked, hello.nonce, identity(hello)))
    assert check_hello(TOKEN, asked, hello)
    assert check_hello(TOKEN, other, hello) == (other == asked)
    assert not check_hello(TOKEN, asked, hello._replace(rank=rank + 1))
    assert not check_hello(TOKEN, asked, hello._replace(pid=pid + 1))
    assert not check_hello("x" + TOKEN[1:], asked, hello)
    assert not check_hello(TOKEN, asked, hello._replace(nonce=b"short"))


def test_a_challenge_that_is_not_one_is_refused_before_anything_is_unpickled(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)

    def serve():
        s, _ = sock.accept()
        Connection(s).send_payload(encode(Evil()))

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(AuthenticationError, match="bad handshake frame"):
        join(connect("127.0.0.1", sock.getsockname()[1]), TOKEN, HELLO, "an evil listener")
    assert not marker.exists()
    sock.close()


# ----------------------------------------------------------------------------- TLS
def test_tls_needs_all_three_files(no_secret, monkeypatch):
    assert server_tls() is None
    monkeypatch.setenv("TDMESH_TLS_CERT", "/x.pem")
    with pytest.raises(UsageError, match="needs all of TDMESH_TLS_CERT, TDMESH_TLS_KEY and TDMESH_TLS_CA"):
        server_tls()


def test_tls_checks_certificates_on_both_sides(no_secret, monkeypatch, tmp_path):
    job = make_certificates(str(tmp_path / "job"))
    stranger = make_certificates(str(tmp_path / "stranger"))  # another CA
    for name, value in job.items():
        monkeypatch.setenv(name, value)
    listener = Listener(TOKEN, tls=server_tls())
    conn = connect("127.0.0.1", listener.port)  # TDMESH_TLS_CERT etc. are set: a TLS connection
    assert isinstance(conn.sock, ssl.SSLSocket) and conn.sock.version() in ("TLSv1.2", "TLSv1.3")
    join(conn, TOKEN, HELLO, "the TLS listener")
    assert listener.hellos[-1][1]
    monkeypatch.setenv("TDMESH_TLS_CERT", stranger["TDMESH_TLS_CERT"])  # a certificate the job's CA did not sign
    monkeypatch.setenv("TDMESH_TLS_KEY", stranger["TDMESH_TLS_KEY"])
    with pytest.raises((ssl.SSLError, OSError, AuthenticationError)):
        join(connect("127.0.0.1", listener.port), TOKEN, HELLO, "the TLS listener")
    for name in job:
        monkeypatch.delenv(name)
    with pytest.raises((ssl.SSLError, OSError, AuthenticationError)):  # no TLS at all
        join(connect("127.0.0.1", listener.port), TOKEN, HELLO, "the TLS listener")
    assert len(listener.hellos) == 1  # neither got as far as a hello
    listener.close()


def test_frames_that_tls_has_already_read_in_are_not_left_behind(no_secret, monkeypatch, tmp_path):
    """Two frames in one TLS record: reading the first decrypts the second into TLS's buffer,
    where no selector sees it; the readers take it in the same call."""
    import selectors

    from tdmesh.protocol.schema import received_messages
    from tdmesh.protocol.transport import FRAME_HEADER, MAGIC, checksum
    for name, value in make_certificates(str(tmp_path / "tls")).items():
        monkeypatch.setenv(name, value)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    frames = b"".join(FRAME_HEADER.pack(MAGIC, len(p), checksum(p)) + p
                      for p in (encode(m.Heartbeat(1)), encode(m.Status(1, 5))))

    def serve() -> None:
        sock = server_tls().wrap_socket(listener.accept()[0], server_side=True)
        sock.sendall(frames)  # one write: one TLS record holding both frames
        sock.recv(1)  # until the reader is done

    threading.Thread(target=serve, daemon=True).start()
    conn = connect("127.0.0.1", listener.getsockname()[1])
    sel = selectors.DefaultSelector()
    sel.register(conn.sock, selectors.EVENT_READ)
    assert sel.select(timeout=10)
    assert received_messages(conn, range(4)) == [m.Heartbeat(1), m.Status(1, 5)]
    assert conn.pending() == 0
    conn.close()
    listener.close()
