"""pytest's fixtures and hooks for the suite (what test files share otherwise is the `helpers`
package): the environment every test runs in, copies of the shipped bundles, one replay of a
shipped bundle shared by the tests that read it, a capture made on this machine, the per-file
progress line, slow tests first, and the session's multi-rank capture cache."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the helpers package
from helpers.paths import FIXTURES, TASKS, TEST_TASKS  # noqa: E402
from helpers.run import _ZYGOTE, cli, invoke, run_json  # noqa: E402
sys.path.insert(0, str(TASKS))   # the fixture tasks' modules (tinygpt: the GPT and plain_step)
sys.path.insert(0, str(TEST_TASKS))   # the tests' own task modules (loops, traps, ...)
# Remedies (issue 27) replay a culprit's step up to 4 more times by default; the suite's other
# tests are not about them: one remedy each keeps the machinery exercised on every culprit at a
# quarter of the cost (the CLI children inherit it). tests/remedies/test_remedies.py and the remedies
# assertions elsewhere ask for their budgets explicitly.
os.environ.setdefault("NANBISECT_REMEDY_BUDGET", "1")
# torch's inductor reuses kernels and its precompiled header from its cache directory whatever
# ATEN_CPU_CAPABILITY says: a suite run forced to another instruction set (issue 44: the suite
# under default, avx2 and unset) then fails to compile ("'at::vec' has not been declared"). Each
# forced instruction set gets a cache of its own (torch 2.13; a user's own setting is kept).
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor-nanbisect-tests-{os.getuid()}-"
                               f"{os.environ['ATEN_CPU_CAPABILITY'].lower()}")


@pytest.fixture(autouse=True)
def _no_leaked_settings():
    """Each test starts from the worker's environment and intra-op thread count: libraries some
    tests run in-process change them for good (dask's Nanny writes its ``pre-spawn-environ``,
    ``OMP_NUM_THREADS=1`` among it, into the parent's ``os.environ``; Lightning's
    `_set_num_threads_if_needed` does the same and calls ``torch.set_num_threads``), and a replay
    later in the same worker then ran capped below the capture's threads
    (`fidelity.match_threads`): a CI failure of test_fidelity_tiers when the dask test ran first."""
    environ = dict(os.environ)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def reported(tmp_path):
    """A copy of the nan_batch bundle with its report (in-process run)."""
    b = tmp_path / "b"
    shutil.copytree(FIXTURES / "nan_batch", b, ignore=shutil.ignore_patterns("nanbisect-report"))
    assert invoke("run", b).code == 1
    return b


@pytest.fixture
def fixture_bundle(tmp_path):
    """Copy a shipped bundle into tmp_path (so reports never land in the repository)."""

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(FIXTURES / name, dst, ignore=shutil.ignore_patterns("nanbisect-report"))
        return dst

    return copy


@pytest.fixture(scope="session")
def npu_env():
    """The environment of a process that uses the emulated ``npu`` device (helpers.npu): the
    device built once; skipped, in one line, where no C++ compiler can build it."""
    from helpers import npu

    return npu.environment()


@pytest.fixture(scope="session")
def replayed(tmp_path_factory):
    """``replayed(name)``: (a copy of the shipped bundle ``name``, the report that `nanbisect run
    --json` printed for it, exit code 1 checked); ``replayed(name, json_=False)``: (another copy,
    the `CliResult` of a plain `nanbisect run` of it). Each is run once per worker, however
    many tests read it (mark those with `same_run`); they only read the copy and its report."""
    done: dict = {}

    def get(name: str, json_: bool = True):
        if (name, json_) not in done:
            bundle = tmp_path_factory.mktemp("replayed") / name
            shutil.copytree(FIXTURES / name, bundle,
                            ignore=shutil.ignore_patterns("nanbisect-report"))
            if json_:
                done[name, json_] = bundle, run_json(bundle)
            else:
                done[name, json_] = bundle, cli("run", "--ckpt", bundle)
        return done[name, json_]

    return get


@pytest.fixture(scope="session")
def travel_bundle(tmp_path_factory):
    """One capture of tests/tasks/travel.py on this machine (an optimizer NaN after a finite
    loss whose last bits depend on the CPU's instruction set), shared by the session's tests:
    replay a copy (`shutil.copytree`), never the bundle itself."""
    import travel

    from nanbisect import Guard, NonFiniteStep

    guard = Guard(travel.task(), entry=f"{TEST_TASKS / 'travel.py'}:task",
                  out=tmp_path_factory.mktemp("travel"))
    with pytest.raises(NonFiniteStep) as e:
        guard.step(travel.batch())
        guard.close()      # the NaN is born in the update: read here
    return e.value.bundle


def pytest_configure(config):
    """One progress line per test file as it finishes (tests/helpers/progress.py)."""
    from helpers.progress import FileProgress

    config.pluginmanager.register(FileProgress(config), "nanbisect-file-progress")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (tens of seconds under a loaded -n 3) run first, in their collection
    order, then the rest as collected: a long test started last would leave the other workers idle
    at the end (with ``--dist loadgroup``, scripts/test.sh, xdist_group groups go out first)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def _captured_bundle_cache(tmp_path_factory):
    """Multi-rank captures shared by the session's tests and workers (tests/helpers/bundles.py)."""
    from helpers import bundles

    bundles.CACHE = bundles.session_cache(tmp_path_factory.getbasetemp())
    yield
    _ZYGOTE.close()
