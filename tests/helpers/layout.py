"""The package's stages, read from the source (not by importing): which stage each folder or
top-level module is, what a module imports. tests/project/test_layout.py enforces the order;
other tests (proc's) read the same map."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "nanbisect"

# stage of each folder / top-level module; a module may import a lower stage or its own folder
# util holds the small utilities every stage shares; it may import only errors (see below)
BASE = {"errors", "task", "records", "step", "devices", "util", "proc", "history", "options",
        "__init__"}
STAGE = {"bundle": 1, "replay": 2, "guard": 3, "compiler": 5,
         "locate": 4, "reference": 4, "report": 4, "finish": 5, "remedies": 5, "chain": 6,
         "multirank": 7, "pipeline": 8, "nightly": 8, "selftest": 8, "api": 8, "cli": 9, "__main__": 10,
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
