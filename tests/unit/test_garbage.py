"""The client's garbage-collector thresholds: raised while a mesh is live, put back after, and never
changed where the user's process has its own settings (tdmesh/garbage.py)."""

import gc

import pytest

from tdmesh import garbage


@pytest.fixture
def fresh(monkeypatch):
    """No live client in this process's bookkeeping, and the collector's settings as they were after."""
    monkeypatch.setattr(garbage, "_live_clients", 0)
    monkeypatch.setattr(garbage, "_found", None)
    monkeypatch.setattr(garbage, "_set", None)
    monkeypatch.setenv("TDMESH_GC_THRESHOLD", "5000")
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if enabled else gc.disable)()


def test_the_first_threshold_is_raised_while_any_client_is_live_and_put_back_after_the_last(fresh):
    garbage.hold_for_client()
    assert gc.get_threshold() == (5000, 10, 10)
    garbage.hold_for_client()  # a second mesh of the same process
    garbage.release_for_client()
    assert gc.get_threshold() == (5000, 10, 10)
    garbage.release_for_client()
    assert gc.get_threshold() == (700, 10, 10)
    garbage.release_for_client()  # one release too many changes nothing
    assert gc.get_threshold() == (700, 10, 10)


def test_the_users_own_settings_are_left_as_they_are(fresh, monkeypatch):
    gc.set_threshold(20000, 5, 5)  # already higher: never lowered
    garbage.hold_for_client()
    assert gc.get_threshold() == (20000, 5, 5)
    garbage.release_for_client()
    assert gc.get_threshold() == (20000, 5, 5)

    gc.set_threshold(0)  # collection off by threshold
    garbage.hold_for_client()
    assert gc.get_threshold()[0] == 0
    garbage.release_for_client()

    gc.set_threshold(700, 10, 10)
    gc.disable()
    garbage.hold_for_client()
    assert gc.get_threshold() == (700, 10, 10)
    garbage.release_for_client()
    gc.enable()

    monkeypatch.setenv("TDMESH_GC_THRESHOLD", "0")  # tdmesh told to leave the collector alone
    garbage.hold_for_client()
    assert gc.get_threshold() == (700, 10, 10)
    garbage.release_for_client()


def test_thresholds_the_user_changes_while_a_mesh_is_live_are_kept_at_its_exit(fresh):
    garbage.hold_for_client()
    gc.set_threshold(1234, 10, 10)
    garbage.release_for_client()
    assert gc.get_threshold() == (1234, 10, 10)
