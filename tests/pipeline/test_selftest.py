"""nanbisect selftest: the built-in faults are found, and a wrong expectation is reported."""
import json

from helpers import cli

from nanbisect import selftest


def test_selftest_finds_every_builtin_fault(tmp_path):
    res = cli("selftest", "--json", cwd=tmp_path)       # works outside the repository
    assert res.code == 0, res.stdout + res.stderr
    rows = json.loads(res.stdout)
    assert len(rows) == 3 and all(r["ok"] for r in rows)
    assert {r["found"]["phase"] for r in rows} == {"forward", "backward", "optimizer"}


def test_selftest_reports_a_miss(monkeypatch):
    real = selftest.cases

    def wrong():
        cs = real()[:1]
        return [selftest.Case(cs[0].name, cs[0].entry, cs[0].batch,
                              {**cs[0].expect, "module": "fc"})]

    monkeypatch.setattr(selftest, "cases", wrong)
    (row,) = selftest.run("cpu")
    assert row["ok"] is False and row["found"]["module"] == "act"
