"""Every ``TDMESH_*`` environment variable, in one table, with its default.

"Controller" in ``TDMESH_CONTROLLER_HOST`` and ``ControllerParams`` names the client process
(Monarch's word for it, kept in the public names); everywhere else tdmesh calls it the client.
Read a variable with ``env_str``/``env_int``/``env_float`` (an unlisted name is a KeyError).
"""

from __future__ import annotations

import os
from typing import NamedTuple

VARIABLES = {
    "TDMESH_BACKEND": ("", "process-group backend for workers: nccl or gloo (default: nccl with CUDA, else gloo)"),
    "TDMESH_DEVICE": ("", "'cpu' forces CPU workers even where CUDA is present"),
    "TDMESH_DEVICE_INDEX": ("", "CUDA device of this worker (default LOCAL_RANK); set by local_mesh"),
    "TDMESH_STORE": ("", "host:port of the c10d store (default MASTER_ADDR:MASTER_PORT from torchrun)"),
    "TDMESH_LOG_LEVEL": ("WARNING", "log level of tdmesh's own loggers on workers"),
    "TDMESH_LOG_FILE": ("", "a file each worker also appends its tdmesh log to, named in errors; '{rank}' in it "
                            "becomes the rank (local_mesh names each worker's stderr file instead)"),
    "TDMESH_SELF_ERROR_EXIT_CODE": ("1", "worker exit code when the job fails and this worker caused it"),
    "TDMESH_PEER_ERROR_EXIT_CODE": ("1", "worker exit code when the job fails because of another process"),
    "TDMESH_PEER_EXIT_DELAY": ("2.0", "seconds a torchrun worker waits, after rank 0 says it leaves, before exiting "
                                      "for another process's failure, so that rank 0 (the script) is torchrun's root "
                                      "cause"),
    "TDMESH_SCOPE": ("", "store key prefix of a local_mesh fleet (set by local_mesh)"),
    "TDMESH_CONTROLLER_HOST": ("", "the address workers use to reach the client (default: this host's name, "
                                   "or 127.0.0.1 when the name does not resolve)"),
    "TDMESH_CONNECT_TIMEOUT": ("120", "seconds the client waits for every worker to connect"),
    "TDMESH_PG_TIMEOUT": ("120", "seconds a collective may wait before torch.distributed fails it "
                                 "(torch's default is 10 min)"),
    "TDMESH_HEARTBEAT_INTERVAL": ("2.0", "SupervisionParams.heartbeat_interval: seconds between worker heartbeats"),
    "TDMESH_HEARTBEAT_TIMEOUT": ("20.0", "SupervisionParams.heartbeat_timeout: silence after which a worker is dead"),
    "TDMESH_PROGRESS_CHECK_INTERVAL": ("10.0", "ControllerParams.progress_check_interval: seconds between "
                                               "progress checks"),
    "TDMESH_OPERATION_TIMEOUT": ("120.0", "ControllerParams.operation_timeout: seconds before a stuck op is reported"),
    "TDMESH_FLUSH_INTERVAL": ("auto", "seconds between the client's timed sends of the ops it queues while it issues: "
                                      "'auto' is 0.002, or 0.005 where this host runs more worker processes than it "
                                      "has cores besides the client's (there an early send only preempts the client)"),
    "TDMESH_BACKWARD": ("auto", "where loss.backward() runs: 'auto' on the workers' own autograd, one message, where "
                                "the graph allows it (else on the client's engine, one message per backward op: "
                                "tdmesh/engine/backward.py says when); 'client' always on the client's engine (read "
                                "when a mesh is activated and at each backward)"),
    "TDMESH_WHOLE_LINEAR": ("on", "'on' issues F.linear (every nn.Linear) on mesh tensors as one op, whose workers "
                                  "run torch's decomposition of it (tdmesh/engine/composites.py says where); 'off' "
                                  "issues that decomposition op by op, as torch dispatches it (read when a mesh is "
                                  "activated)"),
    "TDMESH_GC_THRESHOLD": ("5000", "the first threshold of Python's garbage collector while a mesh is live in the "
                                    "client (never lowered; the client's own is put back when its last mesh exits) "
                                    "and in workers, which also freeze what they hold when a session starts "
                                    "(tdmesh/garbage.py says why); 0 leaves the collector alone"),
    "TDMESH_OPS_PER_PROGRESS_REQUEST": ("100", "ControllerParams.ops_per_progress_request: ops between "
                                               "progress probes"),
    "TDMESH_REQUIRE_BROWSER": ("", "tests: 1 makes a missing Chromium fail the dashboard's browser test instead of "
                                    "skipping it (set by .ci/run)"),
    "TDMESH_DASHBOARD_INTERVAL": ("1.0", "seconds between the samples each worker sends while tdmesh.dashboard() is "
                                         "open (at least 1)"),
    "TDMESH_FAIL_ON_OPERATION_TIMEOUT": ("0", "ControllerParams.fail_on_operation_timeout: 1 makes a stuck op a "
                                              "DeviceException"),
    "TDMESH_SPARES": ("0", "under torchrun: how many of the WORLD_SIZE ranks (the last ones) stay outside world_mesh() "
                           "as spares, connected and authenticated like the others (local_mesh takes spares=)"),
    "TDMESH_GRAPH_TRIALS": ("3", "a compiled function's calls timed as a program, then as a CUDA graph, before a "
                                 "worker keeps the faster (0: a captured graph is kept untimed)"),
    "TDMESH_HEALABLE": ("auto", "under torchrun: 1 runs each rank's worker one process below torchrun's, so that its "
                                "death heals (tdmesh.FaultTolerance) without torchrun restarting the job; 'auto': when "
                                "TDMESH_SPARES > 0; 0: never"),
    "TDMESH_KEPT": ("", "internal: 1 in a worker that a torchrun rank's keeper started (worker/keeper.py)"),
    "TDMESH_RELAYS": ("auto", "per-host relays: 'auto' (when the job spans hosts, or its one host has a core for each "
                              "rank and the client), '1' or '0' (every rank connects to the client itself); attach "
                              "mode never uses them"),
    "TDMESH_FANOUT": ("32", "most children of the client or of one relay in the relay tree (hosts beyond it connect "
                            "through other hosts' relays)"),
    "TDMESH_RELAY_HOST": ("", "the address other hosts use to reach this host's relay (default: this host's name, or "
                              "127.0.0.1 when the name does not resolve)"),
    "TDMESH_POOL_IDLE": ("60", "seconds the workers of a finished local_mesh stay warm for the next local_mesh of the "
                               "same shape (0: no warm pool; local_mesh(pool=False) opts one mesh out)"),
    "TDMESH_SECRET": ("", "a secret shared by every rank and attaching client: the job token is derived from it "
                          "(nothing secret goes into the store); see docs/SECURITY.md"),
    "TDMESH_SECRET_FILE": ("", "a file holding that secret, readable by its owner only (chmod 600)"),
    "TDMESH_TLS_CERT": ("", "this process's certificate (PEM): with _KEY and _CA, every control-plane socket is TLS, "
                            "certificates checked on both sides against the CA"),
    "TDMESH_TLS_KEY": ("", "the private key of TDMESH_TLS_CERT (PEM)"),
    "TDMESH_TLS_CA": ("", "the CA (PEM) that signs every certificate of the job"),
    "TDMESH_MAX_FRAME": (str(1 << 34), "bytes of the largest frame a peer may send once it has authenticated (a fetch "
                                       "of a big tensor is one frame); a larger one ends that peer's session"),
    "TDMESH_MAX_TEXT": (str(1 << 24), "characters of the longest string field of a message (an import path, a "
                                      "traceback); a longer one ends the sender's session"),
    "TDMESH_MAX_ITEMS": (str(1 << 22), "entries of the largest tuple or dict field of a message (refs, arguments); "
                                       "a larger one ends the sender's session"),
    "TDMESH_STACKS_DIR": ("", "a directory where each worker writes its stacks on SIGUSR1 (stacks-PID.txt); "
                              "empty: to its stderr"),
    "TDMESH_TEST_MESH": ("2x2", "tests only: HOSTSxGPUS, the mesh of the collective and stream suites"),
    "TDMESH_TEST_TIMEOUT": ("600", "tests only: seconds a test may run before it fails with its stacks (0: none)"),
    "TDMESH_DIFFERENTIAL_EXAMPLES": ("150", "tests only: examples of the eager-vs-compiled differential test"),
    "TDMESH_HEAL_EXAMPLES": ("7", "tests only: examples (3 drawn faults each) of the healed-vs-fault-free test"),
    "TDMESH_DIFFERENTIAL_SEED": ("26", "tests only: hypothesis's seed for the differential test"),
}


class SupervisionParams(NamedTuple):
    """How the client watches worker liveness: heartbeats every ``heartbeat_interval``
    seconds; a worker silent for ``heartbeat_timeout`` seconds is declared dead."""
    heartbeat_interval: float = 2.0
    heartbeat_timeout: float = 20.0

    @staticmethod
    def from_env() -> SupervisionParams:
        return SupervisionParams(env_float("TDMESH_HEARTBEAT_INTERVAL"), env_float("TDMESH_HEARTBEAT_TIMEOUT"))


class ControllerParams(NamedTuple):
    """Stuck-op detection: every ``progress_check_interval`` seconds (and every
    ``ops_per_progress_request`` ops) the client asks the workers how far they are; an op
    not done after ``operation_timeout`` seconds is a warning, or a DeviceException when
    ``fail_on_operation_timeout``."""
    progress_check_interval: float = 10.0
    operation_timeout: float = 120.0
    ops_per_progress_request: int = 100
    fail_on_operation_timeout: bool = False

    @staticmethod
    def from_env() -> ControllerParams:
        return ControllerParams(env_float("TDMESH_PROGRESS_CHECK_INTERVAL"), env_float("TDMESH_OPERATION_TIMEOUT"),
                                env_int("TDMESH_OPS_PER_PROGRESS_REQUEST"),
                                env_str("TDMESH_FAIL_ON_OPERATION_TIMEOUT") not in ("", "0", "false", "False"))


def env_str(name: str) -> str:
    """The variable's value, or its default from ``VARIABLES`` (an unlisted name is a KeyError)."""
    return os.environ.get(name, VARIABLES[name][0])


def env_int(name: str) -> int:
    return int(env_str(name))


def env_float(name: str) -> float:
    return float(env_str(name))


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform has one): what the client's
    flush interval and a host's relay decision weigh the processes of a host against."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_forced() -> bool:
    """``TDMESH_DEVICE=cpu``: CPU workers even where CUDA is present."""
    return env_str("TDMESH_DEVICE") == "cpu"
