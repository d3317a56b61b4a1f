"""A progress line per test file, as each file finishes: a person watching a long run sees which
files are done, how far the run is, and what failed so far, not only dots.

    [ 37%]  4:12  tests/bundle/test_bundle.py: 19 passed (1 failed)

Works alone and under pytest-xdist (on the controller, which sees every worker's reports).
Registered by tests/conftest.py.
"""
from __future__ import annotations

import time
from collections import Counter

import pytest


class FileProgress:
    def __init__(self, config) -> None:
        self.config = config
        self.left: Counter = Counter()
        self.outcomes: dict[str, Counter] = {}
        self.total = 0
        self.finished = 0
        self.start = time.monotonic()

    def _expect(self, nodeids) -> None:
        if self.total:       # xdist: every worker collects the same tests; count them once
            return
        for nodeid in nodeids:
            self.left[nodeid.split("::")[0]] += 1
        self.total = sum(self.left.values())

    def pytest_collection_finish(self, session) -> None:
        if not hasattr(self.config, "workerinput"):   # a worker reports to its controller
            self._expect(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)    # pytest-xdist's hook: absent without it
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self._expect(ids)

    def pytest_runtest_logreport(self, report) -> None:
        if hasattr(self.config, "workerinput"):
            return
        path = report.nodeid.split("::")[0]
        counts = self.outcomes.setdefault(path, Counter())
        if report.failed and report.when != "call":
            counts["error"] += 1
        elif report.when == "call" or (report.skipped and report.when == "setup"):
            counts[report.outcome] += 1
        if report.when != "teardown":
            return
        self.finished += 1
        self.left[path] -= 1
        if self.left[path] != 0:
            return
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is None or not self.total:
            return
        spent = int(time.monotonic() - self.start)
        bad = ", ".join(f"{counts[k]} {k}" for k in ("failed", "error") if counts[k])
        line = (f"[{100 * self.finished // self.total:3d}%] {spent // 60:2d}:{spent % 60:02d}  "
                f"{path}: {counts['passed']} passed" + (f", {counts['skipped']} skipped"
                                                        if counts["skipped"] else "")
                + (f" ({bad})" if bad else ""))
        if getattr(tr._tw, "width_of_current_line", 0):    # after the dots of -q
            tr._tw.line()
        tr.write_line(line, red=bool(bad))
