"""The package layout is the data flow: every module imports only from the stages before it
(or from its own folder), and nothing imports in a cycle. Read from the source, not by importing."""
from __future__ import annotations

import re

from helpers.layout import BASE, PKG, STAGE, imports, module_name, stage  # noqa: F401


def test_every_module_has_a_stage():
    for path in PKG.rglob("*.py"):
        stage(module_name(path))


def test_nothing_imports_a_later_stage():
    wrong = []
    for path in PKG.rglob("*.py"):
        me = module_name(path)
        if me == "nanbisect":   # the package's lazy attributes point everywhere
            continue
        my_top, my_stage = stage(me)
        for other in imports(path):
            top, s = stage(other)
            if other == "nanbisect" or top == my_top or (my_stage == s == 0):
                continue
            if s >= my_stage and not (s == my_stage == 8):
                wrong.append(f"{me} (stage {my_stage}) imports {other} (stage {s})")
    assert not wrong, "\n".join(wrong)


def test_util_imports_nothing_of_nanbisect_but_errors():
    wrong = [f"{module_name(p)} imports {o}" for p in (PKG / "util").rglob("*.py")
             for o in imports(p) if o != "nanbisect.errors" and not o.startswith("nanbisect.util")]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {module_name(p): imports(p) - {"nanbisect"} for p in PKG.rglob("*.py")}
    graph.pop("nanbisect", None)
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> bool:
        if state.get(m) == 1:
            cycle.extend(path[path.index(m):] + [m])
            return True
        if state.get(m) == 2:
            return False
        state[m] = 1
        if any(visit(n, path + [m]) for n in sorted(graph.get(m, ()))):
            return True
        state[m] = 2
        return False

    for m in sorted(graph):
        if visit(m, []):
            break
    assert not cycle, " -> ".join(cycle)


def _stages() -> set[str]:
    return (BASE | set(STAGE)) - {"__init__"}


def test_the_architecture_names_every_stage_in_its_diagram_and_its_table():
    """docs/ARCHITECTURE.md is drawn from the code: its diagram and its table name every stage
    this test enforces, and name no folder the package does not have."""
    text = (PKG.parent / "docs" / "ARCHITECTURE.md").read_text()
    diagram = text.split("```")[1]
    table = "\n".join(line for line in text.splitlines() if line.startswith("| "))
    for name in sorted(_stages()):
        word = re.compile(rf"(?<![\w.]){re.escape(name)}(?:/|\.py|\b)")
        assert word.search(diagram), f"the diagram does not name {name}"
        assert word.search(table), f"the table does not name {name}"
    named = set(re.findall(r"`(\w+)/`", table))
    assert named <= _stages(), f"the table names folders the package has not: {named - _stages()}"


def test_the_tests_mirror_the_package():
    """Every test file sits in the folder of its stage (tests/project: the layout, the docs and
    the examples); none at the top."""
    tests = PKG.parent / "tests"
    assert not list(tests.glob("test_*.py"))
    folders = {p.parent.name for p in tests.rglob("test_*.py")}
    stages = _stages() | {"base", "project"}
    assert folders <= stages, f"test folders that are no stage: {folders - stages}"
