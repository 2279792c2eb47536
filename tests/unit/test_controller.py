"""The controller's History as a unit: dataflow failure propagation, "report once",
completion by every rank's Status, and what a future finally receives
(MONARCH_NOTES §3.3, §3.4, §5.H items 85-86).  No processes: worker replies are built by hand."""

from __future__ import annotations

import pickle
import traceback

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tdmesh.engine.future import Future
from tdmesh.engine.history import History
from tdmesh.errors import RemoteException, frames
from tdmesh.protocol import codec
from tdmesh.protocol import messages as m


class NoPump:
    """A client for futures that History resolves directly: pumping would be a test bug."""

    def pump(self, timeout=0, until=None):
        raise AssertionError("a resolved future must not pump")


CLIENT = NoPump()


def fut() -> Future:
    return Future(CLIENT)


def failed(seq, rank=0, exc_type="ValueError", message="boom", tb=None) -> m.RemoteFunctionFailed:
    if tb is None:
        tb = f"Traceback (most recent call last):\n  File \"w.py\", line 1, in op{seq}\n{exc_type}: {message}"
    return m.RemoteFunctionFailed(seq, rank, exc_type, message, tb)


def value(seq, obj) -> m.FetchResult:
    return m.FetchResult(seq, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))  # as a worker pickles it


def complete(h: History, first_uncompleted: int, ranks) -> list:
    """Every rank reports progress; resolve what completes, as the client does."""
    done = []
    for r in ranks:
        for node in h.status(m.Status(r, first_uncompleted)):
            h.resolve(node)
            done.append(node.seq)
    return done


def failed_seqs(h: History, seqs) -> set:
    return {s for s in seqs if h.failure_of(s) is not None}


def site(seq):
    """What ``tensor.call_site()`` records: (file, line, function), innermost first."""
    return [("/user/train.py", 100 + seq, f"step{seq}"), ("/user/train.py", 7, "main")]


# ----------------------------------------------------------------- propagation (§5.H 86)
def diamond(h: History) -> list[int]:
    """0 defines r10; 1 reads r10 (defines r11); 2 reads r11; 3 reads r10; 4 reads r12 and r13."""
    h.add(0, (), (10,), site(0))
    h.add(1, (10,), (11,), site(1))
    h.add(2, (11,), (12,), site(2))
    h.add(3, (10,), (13,), site(3))
    h.add(4, (12, 13), (14,), site(4))
    return [0, 1, 2, 3, 4]


def test_failure_marks_transitive_users_and_leaves_independent_seqs_clean():
    h = History([0])
    seqs = diamond(h)
    h.fail(failed(1), frames)
    assert failed_seqs(h, seqs) == {1, 2, 4}
    assert {s for s in seqs if h.failure_of(s) is None} == {0, 3}
    root = h.failure_of(1)
    assert isinstance(root, RemoteException) and root.seq == 1
    assert h.failure_of(2) is root and h.failure_of(4) is root
    assert h.unobserved == {1: root}


def test_failure_propagates_to_users_issued_after_it_was_reported():
    h = History([0])
    diamond(h)
    h.fail(failed(1), frames)
    h.add(5, (12,), (15,), site(5))       # reads what failed seq 2 defined
    h.add(6, (15,), (16,), site(6))       # and, transitively, what 5 defined
    h.add(7, (13,), (17,), site(7))
    assert h.failure_of(5) is h.failure_of(1)
    assert h.failure_of(6) is h.failure_of(1)
    assert h.failure_of(7) is None


def test_failure_of_a_mutation_poisons_later_readers_of_the_mutated_ref():
    h = History([0])
    h.add(0, (), (10,), site(0))
    h.add(1, (10,), (10,), site(1))          # x.add_(1): mutates are defs
    h.add(2, (10,), (11,), site(2))
    h.fail(failed(1), frames)
    assert h.failure_of(0) is None
    assert h.failure_of(1).seq == 1 and h.failure_of(2).seq == 1


# ----------------------------------------------------------------- report once (§5.H 85)
@pytest.mark.parametrize("second_rank", [0, 1])
def test_chain_with_two_failures_completes_as_four_errors_and_one_success(second_rank):
    ranks = [0, 1]
    h = History(ranks)
    futures = [fut() for _ in range(5)]
    for s, (uses, defs) in enumerate([((), (10,)), ((10,), (11,)), ((11,), (12,)), ((12,), (13,)), ((), (14,))]):
        h.add(s, uses, defs, site(s), futures[s])
    h.fail(failed(0, rank=0), frames)
    root = h.failure_of(0)
    assert failed_seqs(h, range(5)) == {0, 1, 2, 3}
    h.fail(failed(3, rank=second_rank, message="second"), frames)   # already poisoned by 0
    assert h.failure_of(3) is root and root.seq == 0                 # the root is not replaced
    assert set(h.unobserved) == {0}                                  # reported once
    h.set_value(value(4, 42))
    for s in range(4):
        h.set_value(m.FetchResult(s, None, m.DependentError(0)))

    assert complete(h, 5, ranks) == [0, 1, 2, 3, 4]
    errors = [f.exception() for f in futures if f.exception() is not None]
    values = [f.result() for f in futures if f.exception() is None]
    assert len(errors) == 4 and values == [42]
    assert all(e is root for e in errors)
    assert h.unobserved == {}
    assert len(h) == 0


def test_chain_failures_reported_latest_first_still_reach_every_future():
    h = History([0])
    futures = [fut() for _ in range(5)]
    for s, (uses, defs) in enumerate([((), (10,)), ((10,), (11,)), ((11,), (12,)), ((12,), (13,)), ((), (14,))]):
        h.add(s, uses, defs, site(s), futures[s])
    h.fail(failed(3), frames)
    h.fail(failed(0), frames)
    h.set_value(value(4, "ok"))
    complete(h, 5, [0])
    assert [type(f.exception()) for f in futures] == [RemoteException] * 4 + [type(None)]
    assert {f.exception().seq for f in futures[:4]} <= {0, 3}
    assert futures[0].exception().seq == 0
    assert futures[4].result() == "ok"
    assert h.unobserved == {}


def test_same_seq_failing_on_two_ranks_is_reported_once():
    h = History([0, 1])
    h.add(0, (), (10,), site(0))
    h.fail(failed(0, rank=1, message="first"), frames)
    first = h.failure_of(0)
    h.fail(failed(0, rank=0, message="second"), frames)
    assert h.failure_of(0) is first and first.rank == 1 and first.message == "first"
    assert h.unobserved == {0: first}


def test_failure_on_one_rank_fails_the_fetch_from_another():
    """§5.H 73: a failure on rank 1 poisons the seq globally; rank 0's value is not used."""
    h = History([0, 1])
    f = fut()
    h.add(0, (), (10,), site(0))
    h.add(1, (10,), (), site(1), f)
    h.fail(failed(0, rank=1), frames)
    h.set_value(value(1, "rank 0 computed something"))
    complete(h, 2, [0, 1])
    assert isinstance(f.exception(), RemoteException) and f.exception().rank == 1


# ----------------------------------------------------------------- failed refs outlive completion
def test_refs_defined_by_failed_seqs_stay_failed_until_forgotten():
    h = History([0])
    diamond(h)
    h.fail(failed(1), frames)
    root_exc = h.failure_of(1)
    complete(h, 5, [0])
    assert len(h) == 0

    f = fut()
    h.add(5, (11,), (15,), site(5), f)   # r11 was defined by failed seq 1
    assert h.failure_of(5) is root_exc    # fails at once, before any worker answers
    h.add(6, (15,), (), site(6))
    assert h.failure_of(6) is root_exc
    h.add(7, (13,), (), site(7))
    assert h.failure_of(7) is None        # r13 came from clean seq 3

    complete(h, 8, [0])
    assert f.exception() is root_exc
    assert h.unobserved == {}   # a future received the root error

    h.forget_refs([11])
    h.add(8, (11,), (), site(8))
    assert h.failure_of(8) is None
    h.add(9, (15,), (), site(9))
    assert h.failure_of(9) is root_exc   # r15 was not forgotten
    h.forget_refs([15, 12, 14, 999])
    h.add(10, (15, 12, 14), (), site(10))
    assert h.failure_of(10) is None


# ----------------------------------------------------------------- completion
def test_completion_needs_every_rank_and_is_in_seq_order():
    h = History([0, 1])
    futures = [fut() for _ in range(3)]
    order = []
    for s in range(3):
        h.add(s, (), (10 + s,), site(s), futures[s])
        h.set_value(value(s, s * 10))
        futures[s].add_callback(lambda f, s=s: order.append(s))

    assert h.status(m.Status(0, 3)) == []          # one rank is not enough
    assert not any(f._finished() for f in futures)
    assert len(h) == 3

    done = h.status(m.Status(1, 1))
    assert [n.seq for n in done] == [0]
    for n in done:
        h.resolve(n)
    assert order == [0] and len(h) == 2

    assert h.status(m.Status(0, 1)) == []          # a rank's frontier never goes back
    done = h.status(m.Status(1, 3))
    assert [n.seq for n in done] == [1, 2]
    for n in done:
        h.resolve(n)
    assert order == [0, 1, 2]
    assert [f.result() for f in futures] == [0, 10, 20]
    assert len(h) == 0
    assert h.pending_futures() == []


def test_nodes_are_freed_after_completion():
    h = History([0, 1])
    fs = [fut() for _ in range(4)]
    for s in range(4):
        h.add(s, (), (), site(s), fs[s])
    assert len(h) == 4
    assert h.pending_futures() == fs
    h.set_value(value(0, "a"))
    complete(h, 2, [0, 1])
    assert len(h) == 2
    assert h.pending_futures() == fs[2:]
    assert h.site_of(0) is None and h.site_of(1) is None and h.site_of(2) == site(2)
    assert fs[0].result() == "a"
    assert isinstance(fs[1].exception(), RuntimeError)   # seq 1 completed without a value
    assert "completed without a value" in str(fs[1].exception())
    h.set_value(value(0, "late"))                         # a late reply for a freed seq is ignored
    assert fs[0].result() == "a"
    complete(h, 4, [0, 1])
    assert len(h) == 0


@pytest.mark.parametrize("packed", [False, True], ids=["tensor", "PackedTensor"])
def test_fetched_tensor_value_is_loaded(packed):
    h = History([0])
    f = fut()
    h.add(0, (), (), site(0), f)
    t = torch.arange(6.0).reshape(2, 3)
    wire = codec.pack_tensor(t) if packed else t
    h.set_value(value(0, {"t": wire, "n": [1, wire]}))
    complete(h, 1, [0])
    got = f.result()
    assert type(got["t"]) is torch.Tensor and torch.equal(got["t"], t)
    assert got["n"][0] == 1 and torch.equal(got["n"][1], t)


def test_seqs_must_increase():
    h = History([0])
    h.add(5, (), (), site(5))
    with pytest.raises(AssertionError, match="not above"):
        h.add(5, (), (), site(5))
    with pytest.raises(AssertionError, match="not above"):
        h.add(4, (), (), site(4))
    complete(h, 6, [0])
    assert len(h) == 0
    with pytest.raises(AssertionError, match="not above"):   # still checked once seq 5 is freed
        h.add(3, (), (), site(3))
    h.add(6, (), (), site(6))
    assert len(h) == 1


# ----------------------------------------------------------------- unobserved errors
def test_unobserved_failures_are_recorded_until_a_future_receives_them():
    h = History([0])
    h.add(0, (), (10,), site(0))                  # a failing op nobody fetches
    h.add(1, (), (11,), site(1))
    f = fut()
    h.add(2, (11,), (), site(2), f)              # a fetch of what seq 1 defined
    h.fail(failed(0, message="never fetched"), frames)
    h.fail(failed(1, message="fetched"), frames)
    assert set(h.unobserved) == {0, 1}
    complete(h, 3, [0])
    assert f.exception().message == "fetched"
    assert set(h.unobserved) == {0}               # seq 0's error is still owed to the user
    assert h.unobserved[0].message == "never fetched"
    assert "never fetched" in str(h.unobserved[0])


def test_an_output_less_failure_goes_to_the_next_future_issued_after_it():
    h = History([0, 1])
    early = fut()
    h.add(0, (), (), site(0), early)             # a fetch issued before the check
    h.add(1, (), (), site(1))                    # a check op: no outputs, no future
    h.add(2, (), (12,), site(2))
    first, second = fut(), fut()
    h.add(3, (12,), (), site(3), first)          # the next blocking call
    h.add(4, (12,), (), site(4), second)
    h.set_value(value(0, "early"), 0)
    h.set_value(value(3, "first"), 0)
    h.set_value(value(4, "second"), 0)
    h.fail(failed(1, rank=1, message="check failed"), frames)
    h.fail(failed(1, rank=0, message="check failed"), frames)  # every rank reports it: once
    complete(h, 5, [0, 1])
    assert early.result() == "early"
    assert first.exception().message == "check failed" and first.exception().rank == 1
    assert second.result() == "second"           # raised once: later fetches work
    assert not h.unobserved                      # and the mesh's exit has nothing to raise


def test_the_oldest_output_less_failure_goes_first():
    h = History([0])
    h.add(0, (), (), site(0))
    h.add(1, (), (), site(1))
    futures = [fut(), fut()]
    h.add(2, (), (), site(2), futures[0])
    h.add(3, (), (), site(3), futures[1])
    for s in (2, 3):
        h.set_value(value(s, s), 0)
    h.fail(failed(1, message="second check"), frames)  # reported out of seq order
    h.fail(failed(0, message="first check"), frames)
    complete(h, 4, [0])
    assert [f.exception().message for f in futures] == ["first check", "second check"]


def test_failure_of_an_unknown_seq_is_kept_as_unobserved():
    h = History([0])
    h.fail(failed(41, rank=0), frames)
    assert set(h.unobserved) == {41}
    assert "<not tied to a user call>" in str(h.unobserved[41])


# ----------------------------------------------------------------- what a future gets
def test_dependent_error_without_a_known_failure_resolves_with_an_error():
    h = History([0])
    f = fut()
    h.add(8, (), (), site(8), f)
    h.set_value(m.FetchResult(8, None, m.DependentError(7)))
    complete(h, 9, [0])
    assert f.done()
    exc = f.exception()
    assert isinstance(exc, RuntimeError)
    assert "depends on failed seq 7" in str(exc)
    with pytest.raises(RuntimeError, match="seq 8 depends on failed seq 7"):
        f.result()


def test_remote_exception_text_names_rank_traceback_error_and_call_site():
    h = History([0, 1])
    f = fut()
    user_site = [("/home/me/train.py", 42, "forward"), ("/home/me/train.py", 90, "main")]
    h.add(0, (), (10,), user_site, f)
    worker_tb = ("Traceback (most recent call last):\n"
                 '  File "/w/udfs.py", line 12, in outer_udf\n    return inner_udf(x)\n'
                 '  File "/w/udfs.py", line 5, in do_bogus_tensor_work\n    return x @ y\n'
                 "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)\n")
    h.fail(m.RemoteFunctionFailed(0, 1, "RuntimeError", "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)",
                                  worker_tb), frames)
    complete(h, 1, [0, 1])
    exc = f.exception()
    text = str(exc)
    assert isinstance(exc, RemoteException)
    assert (exc.seq, exc.rank, exc.exc_type) == (0, 1, "RuntimeError")
    assert "rank 1" in text
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)" in text
    assert "outer_udf" in text and "do_bogus_tensor_work" in text and "return x @ y" in text
    assert 'File "/home/me/train.py", line 42, in forward' in text
    assert 'File "/home/me/train.py", line 90, in main' in text
    # the client frames read most recent call last: main, then forward
    assert text.index("in main") < text.index("in forward")
    assert [fs.name for fs in exc.call_site] == ["main", "forward"]
    # it survives pickling (e.g. to be re-raised from another process) with the same text
    back = pickle.loads(pickle.dumps(exc))
    assert str(back) == text and back.seq == 0 and back.rank == 1


def test_remote_exception_renders_explicit_frame_summaries():
    frames_ = traceback.StackSummary.from_list([("/u/a.py", 3, "f", None), ("/u/b.py", 9, "g", None)])
    exc = RemoteException(5, 2, "KeyError", "'missing'", "Traceback ...\nKeyError: 'missing'", list(frames_))
    text = str(exc)
    assert text.startswith("A remote function failed on rank 2: KeyError: 'missing'\n")
    assert 'File "/u/a.py", line 3, in f' in text and 'File "/u/b.py", line 9, in g' in text
    assert "Traceback on worker rank 2:" in text
    assert text.endswith("KeyError: 'missing'")


# ----------------------------------------------------------------- against a plain model
class Model:
    """What History does, without its index: a list of every op, failures marked in place."""

    def __init__(self, ranks):
        self.ops: list[dict] = []
        self.frontier = dict.fromkeys(ranks, 0)
        self.failed_refs: dict = {}

    def pending(self) -> list[dict]:
        bound = min(self.frontier.values())
        return [op for op in self.ops if op["seq"] >= bound]

    def add(self, seq, uses, defs):
        failure = next((self.failed_refs[u] for u in uses if u in self.failed_refs), None)
        if failure is not None:
            self.failed_refs.update(dict.fromkeys(defs, failure))
        self.ops.append({"seq": seq, "uses": uses, "defs": defs, "failure": failure})

    def fail(self, seq, exc_seq):
        pending = self.pending()
        op = next((op for op in pending if op["seq"] == seq), None)
        if op is None or (op["failure"] is not None and op["failure"] <= exc_seq):
            return
        op["failure"] = exc_seq
        poisoned = set(op["defs"])
        for later in pending:
            if later["seq"] > seq and later["failure"] is None and poisoned & set(later["uses"]):
                later["failure"] = exc_seq
                poisoned |= set(later["defs"])
        for r in poisoned:
            self.failed_refs.setdefault(r, exc_seq)


_ADD = st.tuples(st.just("add"), st.integers(1, 2), st.lists(st.integers(0, 3), max_size=2),
                st.lists(st.integers(0, 3), max_size=2), st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_ADD, _ADD, _ADD, st.tuples(st.just("status"), st.integers(0, 1), st.integers(0, 3)),
                          st.tuples(st.just("fail"), st.integers(0, 4))), max_size=80))
def test_history_agrees_with_a_plain_model_through_completion_and_compaction(program):
    """Seqs with gaps, two ranks completing at their own pace, failures of pending, complete and
    unknown seqs: every pending op's site, failure and future, and the count, agree with a plain list,
    every complete op's future is resolved, while History drops complete entries in bulk (compacting after
    2 here, as after 1,024 in use)."""
    h, model, futures, seq = History([0, 1]), Model([0, 1]), {}, -1
    h.compact_after = 2
    for step in program:
        if step[0] == "add":
            _, gap, uses, defs, with_future = step
            seq += gap
            futures[seq] = fut() if with_future else None
            h.add(seq, tuple(uses), tuple(defs), site(seq), futures[seq])
            model.add(seq, tuple(uses), tuple(defs))
        elif step[0] == "status":
            _, rank, ahead = step
            first_uncompleted = min(min(model.frontier.values()) + ahead, seq + 1)  # no rank runs ahead of the client
            for node in h.status(m.Status(rank, first_uncompleted)):
                assert node.future is futures[node.seq] and node.future is not None
                h.resolve(node)
            model.frontier[rank] = max(model.frontier[rank], first_uncompleted)
        else:
            target = max(seq - step[1], 0)
            h.fail(failed(target), frames)
            model.fail(target, target)
        pending = model.pending()
        assert len(h) == len(pending)
        assert h.pending_futures() == [futures[op["seq"]] for op in pending if futures[op["seq"]] is not None]
        for op in pending:
            got = h.failure_of(op["seq"])
            assert h.site_of(op["seq"]) == site(op["seq"])
            assert (got.seq if got is not None else None) == op["failure"], (op, got)
        assert all(h.site_of(op["seq"]) is None and h.failure_of(op["seq"]) is None  # nothing kept of it
                   for op in model.ops if op not in pending)
        assert all(futures[op["seq"]].done() for op in model.ops  # every complete op's future resolved
                   if op not in pending and futures[op["seq"]] is not None)
