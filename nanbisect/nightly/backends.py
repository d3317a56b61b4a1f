"""Where the replays run: loky processes here, or the workers of a Dask or Ray cluster reached
within a bounded time; and how many run at once.

Guarantees: a cluster that cannot be reached, has no workers or too few CPUs is `BadInput` with
the address and the fix, within ``NANBISECT_CONNECT_TIMEOUT`` (twice that for Ray).
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import tempfile
import threading
from pathlib import Path

from nanbisect.errors import BadInput
from nanbisect.util.numbers import env

CONNECT_TIMEOUT = 15.0              # seconds to reach a Dask scheduler / Ray cluster (default of
#                                     NANBISECT_CONNECT_TIMEOUT)
BACKENDS = ("loky", "dask", "ray")
_CLUSTER_HINT = "pip install 'nanbisect[cluster]'"



def check_backend(backend: str, scheduler: str | None, address: str | None) -> None:
    """BadInput unless ``backend`` is one of `BACKENDS` and ``scheduler`` (Dask) and ``address``
    (Ray) go with it. Light: the CLI checks its arguments with it before importing torch."""
    if backend not in BACKENDS:
        raise BadInput(f"triage: unknown --backend {backend!r}; pass one of {', '.join(BACKENDS)}")
    if scheduler and backend != "dask":
        raise BadInput("triage: --scheduler is the Dask scheduler's address; pass it with "
                       "--backend dask")
    if address and backend != "ray":
        raise BadInput("triage: --address is the Ray cluster's address; pass it with "
                       "--backend ray")


def _host_port(address: str) -> tuple[str, int] | None:
    m = re.fullmatch(r"(?:(?:tcp|tls|ray)://)?\[?([^\]/]+?)\]?:(\d+)/?", address.strip())
    return (m.group(1), int(m.group(2))) if m else None


def _connect_timeout() -> float:
    """``NANBISECT_CONNECT_TIMEOUT`` (seconds) as it is now, else `CONNECT_TIMEOUT`."""
    return env("NANBISECT_CONNECT_TIMEOUT", CONNECT_TIMEOUT)


def _reachable(address: str, what: str, flag: str, greets: bool = False) -> None:
    """A TCP connection within `_connect_timeout`; with ``greets`` (a Dask scheduler over plain
    TCP sends its handshake first), also its first byte: a port that accepts and stays silent
    would otherwise hold the client library's connect for minutes."""
    hp = _host_port(address)
    if hp is None:      # a form we cannot probe (ray "auto", ucx://): the library's time-out
        return
    wait = _connect_timeout()
    try:
        sock = socket.create_connection(hp, timeout=wait)
    except OSError as e:
        raise BadInput(f"triage: cannot reach the {what} at {flag} {address} "
                       f"({e.strerror or type(e).__name__}); start it or pass its address"
                       ) from None
    with sock:
        if not greets or address.strip().startswith("tls://"):
            return
        try:
            first = sock.recv(1)
        except OSError:
            first = b""
        if not first:
            raise BadInput(f"triage: {flag} {address} accepts connections but sent no Dask "
                           f"handshake within {wait:g}s; pass the scheduler's "
                           "address (its log prints it; the default port is 8786)")


@contextlib.contextmanager
def connect_backend(backend: str, scheduler: str | None, address: str | None, jobs: int | None):
    """Connect to the cluster; yields (joblib parallel_config kwargs, n_jobs, wave size or None
    when results come back one by one)."""
    check_backend(backend, scheduler, address)
    if backend == "loky":
        yield {"backend": "loky"}, jobs, None
        return
    wait = _connect_timeout()
    with (_dask(scheduler, jobs, wait) if backend == "dask" else
          _ray(address, jobs, wait)) as got:
        yield got


@contextlib.contextmanager
def _dask(scheduler: str | None, jobs: int | None, wait: float):
    """`connect_backend` on the Dask cluster whose scheduler is at ``scheduler``."""
    if not scheduler:
        raise BadInput("triage: --backend dask needs --scheduler ADDR (e.g. "
                       "tcp://10.0.0.5:8786), the scheduler of a running Dask cluster")
    try:
        import distributed
    except ImportError as e:
        raise BadInput(f"triage: --backend dask needs dask.distributed ({e}); "
                       f"{_CLUSTER_HINT}") from None
    _reachable(scheduler, "Dask scheduler", "--scheduler", greets=True)
    try:
        client = distributed.Client(scheduler, timeout=wait, set_as_default=False)
    except Exception as e:  # noqa: BLE001 - OSError, TimeoutError, a version mismatch...
        raise BadInput(f"triage: cannot connect to the Dask scheduler at --scheduler "
                       f"{scheduler} ({type(e).__name__}: {str(e)[:160]}); check the "
                       "address and that its dask version matches") from None
    try:
        try:
            client.wait_for_workers(1, timeout=wait)
        except Exception:  # noqa: BLE001
            raise BadInput(f"triage: the Dask scheduler at {scheduler} has no workers "
                           f"after {wait:g}s; start some (dask worker "
                           f"{scheduler})") from None
        yield {"backend": _dask_backend(), "client": client}, jobs or -1, None
    finally:
        with contextlib.suppress(Exception):
            client.close(timeout=5)


@contextlib.contextmanager
def _ray(address: str | None, jobs: int | None, wait: float):
    """`connect_backend` on the Ray cluster at ``address`` (None: the local one, "auto")."""
    try:
        import ray
        from ray.util.joblib import register_ray
    except ImportError as e:
        raise BadInput(f"triage: --backend ray needs ray ({e}); {_CLUSTER_HINT}") from None
    if address:
        _reachable(address, "Ray cluster", "--address")
    register_ray()
    # ray.init retries for minutes on an address that accepts and never answers: it runs in a
    # daemon thread and is given up on after a bounded time
    outcome: list = []

    def init() -> None:
        try:
            ray.init(address=address or "auto", log_to_driver=False, logging_level="ERROR",
                     ignore_reinit_error=True)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below, in the caller's thread
            outcome.append(e)

    t = threading.Thread(target=init, name="nanbisect-ray-init", daemon=True)
    with _stderr_held() as held:         # Ray's C++ client logs its retries to fd 2
        t.start()
        t.join(2 * wait)
        ok = bool(outcome) and outcome[0] is None
        held.release = ok                # kept when it connected; a failure is one line
    if not ok:
        why = (f"{type(outcome[0]).__name__}: {str(outcome[0])[:160]}" if outcome else
               f"no answer within {2 * wait:g}s")
        raise BadInput(f"triage: cannot connect to the Ray cluster at --address "
                       f"{address or 'auto'} ({why}); check the address (ray status prints "
                       "it)")
    try:
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus < 2:                    # joblib would replay in this process, not on the cluster
            raise BadInput(f"triage: the Ray cluster at {address or 'auto'} has {cpus} CPU(s); "
                           "joblib's Ray backend needs at least 2 to replay on the cluster "
                           "(with 1 it runs everything here); add CPUs or use --backend dask")
        n = min(cpus, max(2, jobs or cpus))
        yield {"backend": "ray"}, n, n
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()


def _dask_backend() -> str:
    """joblib's Dask backend, except that a cluster with a single worker thread still counts two
    slots: joblib replays in the calling process when it counts one, and a replay meant for the
    cluster must run there."""
    from joblib import register_parallel_backend

    from nanbisect.util.library_internals import joblib_dask_backend

    DaskDistributedBackend = joblib_dask_backend()
    if DaskDistributedBackend is None:  # a joblib that moved it: its plain backend
        return "dask"

    class _ClusterOnly(DaskDistributedBackend):
        def effective_n_jobs(self, n_jobs):
            return max(2, super().effective_n_jobs(n_jobs))

    register_parallel_backend("nanbisect-dask", _ClusterOnly)
    return "nanbisect-dask"


@contextlib.contextmanager
def _stderr_held():
    """File descriptor 2 goes to a temporary file for the block; what was written is copied to
    the real stderr afterwards when the block sets ``.release`` (and dropped otherwise)."""
    class Held:
        release = True

    held = Held()
    try:
        sys.stderr.flush()
        tmp = tempfile.TemporaryFile()
    except (OSError, ValueError):
        tmp = None
    try:
        saved = os.dup(2) if tmp is not None else -1
    except OSError:                      # no fd 2 to hold: leave it as it is
        saved = -1
    if saved < 0:
        if tmp is not None:
            tmp.close()
        yield held
        return
    os.dup2(tmp.fileno(), 2)
    try:
        yield held
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if held.release:
            with contextlib.suppress(OSError):
                tmp.seek(0)
                os.write(2, tmp.read()[-65536:])
        tmp.close()


def jobs_for(bundles: list[Path], jobs: int | None) -> int:
    if jobs:
        return max(1, jobs)
    cores = os.cpu_count() or 1
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return cores
    biggest = 0
    for b in bundles:
        with contextlib.suppress(OSError):
            # a bundle's tensors are at its top or in its rank parts: no recursive walk
            files = [*b.glob("*.safetensors"), *b.glob("rank*/*.safetensors")]
            biggest = max(biggest, sum(f.stat().st_size for f in files))
    return max(1, min(cores, len(bundles), int(avail // max(3 * biggest, 1 << 28))))
