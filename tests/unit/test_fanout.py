"""The relay tree, rank sets, the client's outbox and a worker's reading of it (hypothesis),
and one relay over real sockets: forwarding, Status aggregation, lost ranks, shutdown."""
import math
import os
import pickle
import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tdmesh.engine.outbox import Outbox
from tdmesh.geometry.fanout import RankList, rank_set, relay_children, relay_parents, subtree_hosts
from tdmesh.geometry.slice import Slice
from tdmesh.protocol import messages as m
from tdmesh.protocol.bulk import BulkFrame, big_buffers_into
from tdmesh.protocol.handshake import AuthenticationError, challenge, check_hello, join, welcome
from tdmesh.protocol.relay import Relay
from tdmesh.protocol.transport import Connection, RankFilter, connect, decode_hello

TOKEN = "t" * 32


@given(st.integers(1, 3000), st.integers(1, 40))
@settings(max_examples=200, deadline=None)
def test_the_relay_tree_bounds_every_fanout_and_its_subtrees_are_contiguous(hosts, fanout):
    parents = relay_parents(hosts, fanout)
    children = relay_children(hosts, fanout)
    assert all(len(c) <= fanout for c in children.values())
    assert all(parents[h] < h for h in range(hosts))  # a block's first host relays for the rest of it
    depth = [0] * hosts
    for h in range(hosts):
        depth[h] = 1 if parents[h] < 0 else depth[parents[h]] + 1
    if fanout > 1:
        assert max(depth) <= math.ceil(math.log(hosts, fanout)) + 1 if hosts > 1 else max(depth) == 1
    for h in range(0, hosts, max(1, hosts // 7)):
        below = {h}
        for g in range(h + 1, hosts):
            if parents[g] in below:
                below.add(g)
        assert set(subtree_hosts(h, hosts, fanout)) == below


@given(st.lists(st.integers(0, 200), max_size=60))
def test_a_rank_set_covers_exactly_its_ranks(ranks):
    slices = rank_set(ranks)
    assert sorted(r for s in slices for r in s) == sorted(set(ranks))


@given(st.data())
@settings(max_examples=100, deadline=None)
def test_every_rank_reads_exactly_the_messages_of_its_rank_sets_in_order(data):
    world = data.draw(st.integers(1, 40))
    ranks = st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True)
    mesh = Slice.new_row_major([world])
    sets = [RankList(mesh)] + [data.draw(ranks) for _ in range(data.draw(st.integers(0, 5)))]
    sent = [(data.draw(st.sampled_from(range(len(sets)))), i) for i in range(data.draw(st.integers(0, 30)))]
    outbox = Outbox(tuple(range(world)))
    for which, i in sent:
        outbox.put(sets[which], pickle.dumps(m.RequestStatus(i)))
    payload = outbox.take()
    for rank in range(world):
        got = RankFilter(rank).messages(payload)
        assert got == [m.RequestStatus(i) for which, i in sent if rank in sets[which]]


_INT = st.one_of(st.integers(0, 2**31 - 1), st.integers(2**31 - 3, 2**31 + 3), st.integers(0, 2**62))


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_a_call_ops_hand_written_entry_reads_as_the_tuple_pickle_makes(data):
    """The eager hot path's CallOp entry (one struct pack, ``transport.call_op_entry``) is read by every
    rank of its set as the bare tuple ``pickle.dumps`` would have carried, among other messages, for
    values past int32 (pickle's own encoding then) and any number of refs; ``pending()`` counts it once."""
    world = data.draw(st.integers(1, 12))
    sets = [RankList(Slice.new_row_major([world])),
            data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))]
    outbox, sent = Outbox(tuple(range(world))), []
    for _ in range(data.draw(st.integers(0, 20))):
        which = data.draw(st.sampled_from([0, 1]))
        if data.draw(st.booleans()):
            seq, op, result, stream = (data.draw(_INT) for _ in range(4))
            refs = tuple(data.draw(st.lists(_INT, max_size=5)))
            outbox.append_call_op(sets[which], seq, op, result, refs, stream)
            sent.append((which, (seq, op, (result,), (), refs, stream)))
        else:
            outbox.put(sets[which], pickle.dumps(m.RequestStatus(len(sent))))
            sent.append((which, m.RequestStatus(len(sent))))
    assert outbox.pending() == len(sent) + (1 if any(which == 1 for which, _ in sent) and
                                            len(sets[1]) < world else 0)  # the definition of the second set
    payload = outbox.take()
    for rank in range(world):
        got = RankFilter(rank).messages(payload)
        want = [msg for which, msg in sent if rank in sets[which]]
        assert got == want and [type(g) for g in got] == [type(w) for w in want]


@given(st.data())
@settings(max_examples=100, deadline=None)
def test_every_rank_reads_its_uploads_bytes_and_skips_the_others(data):
    """Messages with out-of-band buffers (an upload's tensor memory) among plain ones: each rank
    gets the bytes of its own messages' buffers, whatever the others before them held."""
    world = data.draw(st.integers(1, 12))
    sets = [RankList(Slice.new_row_major([world]))] + [
        data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True)) for _ in range(3)]
    outbox = Outbox(tuple(range(world)))
    sent = []
    for i in range(data.draw(st.integers(0, 12))):
        which = data.draw(st.sampled_from(range(len(sets))))
        blobs = [bytes([i % 256]) * data.draw(st.integers(1, 64)) for _ in range(data.draw(st.integers(0, 3)))]
        msg = m.CallFunction(i, (), (), "f", tuple(pickle.PickleBuffer(bytearray(b)) for b in blobs), {})
        buffers: list = []
        pickled = pickle.dumps(msg, protocol=5, buffer_callback=big_buffers_into(buffers, 1))
        if buffers:
            outbox.append_with_buffers(outbox.set_id(sets[which]), pickled, buffers)
        else:
            outbox.put(sets[which], pickled)
        sent.append((which, i, blobs))
    payload = outbox.take()
    assert (type(payload) is BulkFrame) == any(blobs for _, _, blobs in sent)
    for rank in range(world):
        got = [(msg.seq, [bytes(a) for a in msg.args]) for msg in RankFilter(rank).messages(payload)]
        assert got == [(i, blobs) for which, i, blobs in sent if rank in sets[which]]


def test_an_uploads_bytes_are_sent_from_where_they_lie():
    outbox = Outbox((0,))
    memory = bytearray(b"x" * 4096)
    buffers: list = []
    pickled = pickle.dumps(m.CallFunction(1, (), (), "f", (pickle.PickleBuffer(memory),), {}), protocol=5,
                           buffer_callback=big_buffers_into(buffers, 1024))
    outbox.append_with_buffers(0, pickled, buffers)
    assert outbox.bytes == len(pickled) + len(memory)
    parts, _, bulk = outbox.take_frame()
    assert bulk and parts[-1].obj is memory and not outbox.bulk  # the caller's memory itself, not a copy


def test_a_mesh_rank_set_is_defined_by_its_slice_so_frames_do_not_grow_with_ranks():
    sizes = []
    for n in (4, 4096):
        outbox = Outbox(tuple(range(2 * n)))
        outbox.put(RankList(Slice.new_row_major([2, n]).at(0, 1)), pickle.dumps(m.RequestStatus(1)))
        sizes.append(len(outbox.take()))
    assert sizes[1] - sizes[0] <= 8  # a few bytes more for bigger ints: not 4,096 ranks listed


def _listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    return sock


def _worker(relay: Relay, rank: int, token: str = TOKEN, pid: int = 1):
    """A connection to ``relay`` that has passed (or tried) the handshake as ``rank``."""
    conn = connect("127.0.0.1", relay.port)
    join(conn, token, m.Hello(rank, b"", "", "h", pid, "cpu", None), "the relay")
    return conn


def _parent_of(listener) -> tuple[Connection, m.RelayHello]:
    """Accept a relay going up, as the client's gate does: challenge, check, welcome."""
    sock, _ = listener.accept()
    up = Connection(sock)
    nonce = challenge(up)
    hello = decode_hello(up.recv_payload())
    assert check_hello(TOKEN, nonce, hello)
    welcome(up, TOKEN, nonce, hello)
    return up, hello


def test_a_relay_forwards_frames_aggregates_status_and_reports_a_lost_rank():
    parent = _listener()
    relay = Relay(0, 0, 2, TOKEN, bind="127.0.0.1", heartbeat_interval=0.05, heartbeat_timeout=30)
    thread = threading.Thread(target=lambda: (relay.gather(10), relay.connect_up(*parent.getsockname()),
                                              relay.serve()), daemon=True)
    thread.start()
    workers = [_worker(relay, rank) for rank in range(2)]
    up, hello = _parent_of(parent)
    assert type(hello) is m.RelayHello and (hello.first, hello.end) == (0, 2)
    assert [h.rank for h in hello.hellos] == [0, 1]
    up.send_control(m.RelayConfig(0.05, 30))
    up.send_payload(b"entries, forwarded unopened")
    assert [w.recv_payload() for w in workers] == [b"entries, forwarded unopened"] * 2

    def next_message(kinds):
        while True:
            msg = up.recv_messages()[0]
            if type(msg) in kinds:
                return msg
    workers[0].send_messages([m.Status(0, 5)])
    workers[1].send_messages([m.Heartbeat(1)])
    workers[1].send_messages([m.Status(1, 3)])
    assert next_message((m.Status,)) == m.Status(0, 3)  # the minimum, once every rank reported
    workers[1].send_messages([m.FetchResult(2, b"v", None, 1)])
    assert next_message((m.FetchResult, m.Status)) == m.FetchResult(2, b"v", None, 1)
    assert type(next_message((m.Heartbeat,))) is m.Heartbeat  # the relay's own
    workers[1].close()
    lost = next_message((m.RanksLost,))
    assert lost.ranks == (1,) and "relay closed" in lost.why
    workers[0].close()  # the last rank leaves: so does the relay
    thread.join(5)
    assert not thread.is_alive()
    parent.close()


def test_a_relay_whose_parent_goes_away_closes_its_ranks():
    parent = _listener()
    relay = Relay(0, 0, 1, TOKEN, bind="127.0.0.1")
    thread = threading.Thread(target=lambda: (relay.gather(10), relay.connect_up(*parent.getsockname()),
                                              relay.serve()), daemon=True)
    thread.start()
    worker = _worker(relay, 0)
    up, _ = _parent_of(parent)
    up.close()
    assert worker.recv_payload() is None
    thread.join(5)
    parent.close()


def test_a_relay_refuses_a_hello_without_the_token_and_waits_for_the_real_rank():
    relay = Relay(0, 0, 1, TOKEN, bind="127.0.0.1")
    thread = threading.Thread(target=relay.gather, args=(10,), daemon=True)
    thread.start()
    with pytest.raises(AuthenticationError, match="closed the connection during tdmesh's handshake"):
        _worker(relay, 0, token="wrong")
    worker = _worker(relay, 0, pid=2)
    thread.join(10)
    assert [c.key for c in relay.children] == [0] and relay.hellos[0].pid == 2
    worker.close()


def _hellos(hosts: list[str]) -> dict:
    return {rank: m.Hello(rank, b"", "", host, 1000 + rank, "cpu", None) for rank, host in enumerate(hosts)}


def test_the_flush_interval_grows_only_where_workers_and_client_share_too_few_cores(monkeypatch):
    """'auto': the client sends every 2 ms, or every 5 ms where this host's worker processes and the
    client outnumber the cores it may run on; workers of other hosts do not count; a number is taken as given."""
    from tdmesh.engine.outbox import FLUSH_INTERVAL, SHARED_CORES_FLUSH_INTERVAL, flush_interval
    monkeypatch.delenv("TDMESH_FLUSH_INTERVAL", raising=False)
    cores = len(os.sched_getaffinity(0))
    here, there = socket.gethostname(), socket.gethostname() + "-elsewhere"
    assert flush_interval(_hellos([here] * (cores - 1))) == FLUSH_INTERVAL == 0.002  # one core each, client included
    assert flush_interval(_hellos([here] * cores)) == SHARED_CORES_FLUSH_INTERVAL == 0.005
    assert flush_interval(_hellos([here] * (cores - 1) + [there] * 8)) == FLUSH_INTERVAL
    monkeypatch.setenv("TDMESH_FLUSH_INTERVAL", "0.0125")
    assert flush_interval(_hellos([here] * (cores + 4))) == 0.0125
