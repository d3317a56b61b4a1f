"""The chain rule read from the code (the AST, never the text), over every module of a package:

- **passes only through the chain** (`passes_outside`): no module but ``chain.py`` and the
  modules of the passes themselves (`PASS_HOMES`: where they are defined, and the passes that
  call the passes below them) imports a pass (`PASSES`), calls one through an imported module
  (``ops.record_ops(...)``), or calls a pass that is a method of the replayer
  (`PASS_METHODS`: ``rep.input_faults(...)``);
- **every chain says how its collectives are served** (`chains_without_serving`): each call of
  ``Chain(...)`` passes a member of `nanbisect.chain.Serving` (``Serving.LOCKSTEP``), as its
  second argument or as ``serving=``, never a variable or a string.

Both take the package root, like `helpers.rules`, so a test can plant a violation in a temporary
package and see it found. Findings are `helpers.rules.Finding` (``path:line: what``).
"""
from __future__ import annotations

import ast
from pathlib import Path

from helpers.rules import PKG, Aliases, Finding, absolute_module, parsed, rel_path


# the passes: a module that imports or calls one of these wires a pass itself, and the other
# paths would not get it. Pass 1 (the module probe), the reference side's replay and its
# comparison, the input-fault check, the finisher, the op check, the classification's evidence,
# the remedies, a divergence's isolation, the compiler bisection.
PASSES = {
    # passes 2 and 3, the finisher, the remedies, a divergence's isolation
    "record_ops", "catch_inputs", "catch_module_call", "AheadCatch", "RowTracer", "finish",
    "try_remedies", "not_tried", "isolate_window", "diverging_call", "forward_producer",
    "backward_producer", "first_bad_parameter", "safe_check",
    # pass 1 and the reference side
    "ModuleProbe", "probing", "RandomTape", "RandomReplay", "step_state", "first_divergence",
    # the classification and the compiler bisection
    "Evidence", "classify_culprit", "bisect_compiled",
}
# passes that are methods of the replayer: called on anything, they are a pass wired by hand
PASS_METHODS = {"input_faults"}
# the modules allowed to import and call the passes: the chain, and the stages that define
# them (a pass may call the passes below it: the finisher the op check, the compiler's child
# its own module-call catch)
PASS_HOMES = ("chain.py", "finish.py", "replay/", "locate/", "reference/", "remedies/",
              "compiler/")


def _home(rel: str, pkg: Path) -> bool:
    inside = rel.split("/", 1)[1]
    return any(inside == h or (h.endswith("/") and inside.startswith(h)) for h in PASS_HOMES)


def _from_home(module: str, pkg: Path) -> bool:
    """Is dotted ``module`` (``nanbisect.locate.ops``) one of the passes' (a ``finish`` of
    `nanbisect.proc` is no pass)?"""
    parts = module.split(".")
    if parts[0] != pkg.name or len(parts) < 2:
        return False
    return _home(f"{pkg.name}/{parts[1]}.py", pkg) or _home(f"{pkg.name}/{parts[1]}/", pkg)


def passes_outside(pkg: Path = PKG) -> list[Finding]:
    out = []
    for path, tree, al in parsed(pkg):
        rel = rel_path(path, pkg)
        if _home(rel, pkg):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = absolute_module(node, path, pkg)
                if not _from_home(base, pkg):
                    continue
                for a in node.names:
                    if a.name in PASSES:
                        out.append(Finding(rel, node.lineno, f"from {base} import {a.name}: "
                                           "call it through nanbisect.chain"))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = al.dotted(node.func)
                if name is not None and _from_home(name.rpartition(".")[0], pkg) \
                        and node.func.attr in PASSES:
                    out.append(Finding(rel, node.lineno,
                                       f"{name}(...): call it through nanbisect.chain"))
                elif node.func.attr in PASS_METHODS:
                    out.append(Finding(rel, node.lineno, f".{node.func.attr}(...): call it "
                                       "through nanbisect.chain"))
    return out


def _serving_members() -> set[str]:
    from nanbisect.chain import Serving

    return {m.name for m in Serving}


def _is_chain(func: ast.AST, al: Aliases, pkg: Path) -> bool:
    if isinstance(func, ast.Name):
        return al.of.get(func.id) == f"{pkg.name}.chain.Chain"
    return al.dotted(func) == f"{pkg.name}.chain.Chain"


def _chains(pkg: Path):
    """(module path, line, the Serving member given or None, what was given) of every
    ``Chain(...)`` call."""
    members = _serving_members()
    for path, tree, al in parsed(pkg):
        rel = rel_path(path, pkg)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and _is_chain(node.func, al, pkg)):
                continue
            given = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "serving"), None)
            ok = (isinstance(given, ast.Attribute) and given.attr in members
                  and al.dotted(given.value) == f"{pkg.name}.chain.Serving")
            yield rel, node.lineno, given.attr if ok else None, given


def chains_without_serving(pkg: Path = PKG) -> list[Finding]:
    return [Finding(rel, line, f"Chain(...) given "
                               f"{ast.unparse(given) if given is not None else 'nothing'} as how "
                               "its collectives are served: pass a Serving member")
            for rel, line, member, given in _chains(pkg) if member is None]


def servings(pkg: Path = PKG) -> dict[str, set[str]]:
    """Each module that builds a `Chain` -> the `Serving` members it passes."""
    out: dict[str, set[str]] = {}
    for rel, _, member, _ in _chains(pkg):
        if member is not None:
            out.setdefault(rel, set()).add(member)
    return out
