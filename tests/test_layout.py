"""The package layout is the data flow: every module imports only from the stages before it
(or from its own folder), and nothing imports in a cycle. Read from the source, not by importing."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "nanbisect"

# stage of each folder / top-level module; a module may import a lower stage or its own folder
# util holds the small utilities every stage shares; it may import only errors (see below)
BASE = {"errors", "task", "records", "step", "devices", "util", "proc", "history", "__init__"}
STAGE = {"bundle": 1, "replay": 2, "guard": 3, "compiler": 5,
         "locate": 4, "reference": 4, "report": 4, "finish": 5, "remedies": 5, "chain": 6,
         "multirank": 7, "pipeline": 8, "triage": 8, "selftest": 8, "cli": 9, "__main__": 10,
         "integrations": 10}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """nanbisect modules ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    me = module_name(path).split(".")
    pkg = me if path.name == "__init__.py" else me[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "nanbisect"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "nanbisect":
                continue
            for a in node.names:   # `from nanbisect.reference import kernels` names a module
                sub = f"{base}.{a.name}"
                out.add(sub if (PKG.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                        else base)
    return out


def stage(module: str) -> tuple[str, int]:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return top, 0 if top in BASE else STAGE[top]


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
