"""The house rules read from the code (the AST, never the text): every module is parsed, its
imports resolved with their aliases, and each rule returns its findings as ``path:line: what``.
tests/project/test_rules.py asserts there are none and plants a violation of each rule in a
temporary package to see it found.

- **process control** (`process_control`): starting, signalling, waiting for or reaping a
  process, and installing a signal handler, only in ``nanbisect/proc``;
- **private names of other libraries** (`foreign_private`): ``torch._x`` (any depth, through
  any alias: ``dist._world``, ``from torch.x import _y``, ``import torch._dynamo``), and an
  underscored attribute that nanbisect itself never defines (``scaler._per_optimizer_states``,
  ``sys._getframe``), only in ``nanbisect/util/torch_internals.py`` (torch's) and
  ``nanbisect/util/library_internals.py`` (CPython's and other libraries', never torch's);
- **underscore names across modules** (`private_across`): ``from nanbisect.x import _y`` or
  ``module._y`` on an imported nanbisect module, and ``obj._y`` where ``_y`` is defined only in
  another module (a private attribute reached from outside its class's module);
- **raw manifest reads** (`manifest_reads`): a subscript or ``.get`` on a manifest dict outside
  ``nanbisect/bundle``; code elsewhere reads the `Manifest` view;
- **device specs parsed** (`spec_parses`): ``DeviceSpec.parse`` / ``parse_device`` called
  outside the options' one parse (``nanbisect/options.py``) and the seam that resolves it;
- **import cycles at any level** (`import_cycles`): module-level, function-level and
  ``importlib.import_module("nanbisect....")`` imports all count (the package's own lazy
  attributes in ``nanbisect/__init__.py`` excepted: it is the top, imported by nobody);
- **callable modules** (`module_tricks`): a module whose ``__class__`` is swapped;
- **one name per responsibility** (`same_names`): two modules with one file name.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "nanbisect"


@dataclass(frozen=True)
class Finding:
    path: str       # relative to the package's parent
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def modules(pkg: Path = PKG) -> list[Path]:
    return sorted(pkg.rglob("*.py"))


def rel_path(path: Path, pkg: Path) -> str:
    """``path`` as the findings name it (``nanbisect/guard/core.py``)."""
    return path.relative_to(pkg.parent).as_posix()


def _modname(path: Path, pkg: Path) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def absolute_module(node: ast.ImportFrom, path: Path, pkg: Path) -> str:
    """The module a from-import names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    me = _modname(path, pkg).split(".")
    base = me if path.name == "__init__.py" else me[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


class Aliases:
    """What each name bound by an import in one module stands for (a dotted path):
    ``import torch.distributed as dist`` binds ``dist`` -> ``torch.distributed``;
    ``from nanbisect.util import torch_internals as ti`` binds ``ti`` ->
    ``nanbisect.util.torch_internals``. Function-level imports count too (a module is small
    enough that one name means one thing)."""

    def __init__(self, tree: ast.AST, path: Path, pkg: Path):
        self.of: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.of[a.asname] = a.name
                    else:
                        self.of[a.name.split(".")[0]] = a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = absolute_module(node, path, pkg)
                for a in node.names:
                    if a.name != "*":
                        self.of[a.asname or a.name] = f"{base}.{a.name}" if base else a.name

    def dotted(self, node: ast.AST) -> str | None:
        """``dist.distributed_c10d._world`` -> ``torch.distributed.distributed_c10d._world``
        when ``dist`` was imported; None for a chain that does not start at an import."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.of:
            return None
        return ".".join([self.of[node.id]] + parts[::-1])


def parsed(pkg: Path):
    """Each module of ``pkg``: (path, its AST, its import `Aliases`)."""
    for path in modules(pkg):
        tree = ast.parse(path.read_text(), str(path))
        yield path, tree, Aliases(tree, path, pkg)


# ---------------------------------------------------------------- process control
# calls that start, signal, wait for or reap a process, or install a signal handler
CONTROL = {
    "os.kill", "os.killpg", "os.fork", "os.forkpty", "os.waitpid", "os.wait", "os.wait3",
    "os.wait4", "os.waitid", "os.setsid", "os.setpgid", "os.setpgrp", "os.posix_spawn",
    "os.posix_spawnp", "os.execv", "os.execve", "os.execvp", "os.execvpe", "os.execl",
    "os.execle", "os.execlp", "os.execlpe", "os.spawnv", "os.spawnl", "os.system", "os.popen",
    "os.pidfd_open", "signal.signal", "signal.pthread_sigmask", "signal.pthread_kill",
    "signal.setitimer", "signal.alarm", "signal.sigwait", "signal.sigtimedwait",
    "signal.set_wakeup_fd", "subprocess.Popen", "subprocess.run", "subprocess.call",
    "subprocess.check_call", "subprocess.check_output", "subprocess.getoutput",
    "subprocess.getstatusoutput", "multiprocessing.Process", "multiprocessing.Pool",
    "multiprocessing.get_context", "concurrent.futures.ProcessPoolExecutor",
    "torch.multiprocessing.spawn", "torch.multiprocessing.start_processes",
    "torch.multiprocessing.Process",
}
# methods that signal or reap whatever object they are called on (a Popen, a Process)
CONTROL_METHODS = {"send_signal", "terminate", "kill"}


def process_control(pkg: Path = PKG) -> list[Finding]:
    out = []
    for path, tree, al in parsed(pkg):
        rel = rel_path(path, pkg)
        if rel.startswith(f"{pkg.name}/proc/"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = al.dotted(node.func)
            if name in CONTROL:
                out.append(Finding(rel, node.lineno, f"{name}(...): through nanbisect.proc"))
            elif isinstance(node.func, ast.Attribute) and node.func.attr in CONTROL_METHODS \
                    and name is None:
                out.append(Finding(rel, node.lineno,
                                   f".{node.func.attr}(): a process is stopped through "
                                   "nanbisect.proc"))
    return out


# ---------------------------------------------------------------- private names
def defined_private(pkg: Path = PKG) -> dict[str, set[str]]:
    """Each underscored name nanbisect defines (function, class, attribute assigned on
    ``self``/an object, a class-level or module-level name) -> the modules defining it."""
    out: dict[str, set[str]] = {}
    for path, tree, _ in parsed(pkg):
        me = _modname(path, pkg)

        def add(name: str) -> None:
            if _private(name):
                out.setdefault(name, set()).add(me)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                add(node.id)
            elif isinstance(node, ast.arg):
                add(node.arg)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("setattr", "getattr", "hasattr") and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant) and node.func.id == "setattr":
                add(str(node.args[1].value))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                add(node.target.id)
            elif isinstance(node, ast.keyword) and node.arg:
                add(node.arg)      # dataclass fields built by keyword, namedtuple fields
    return out


ROOM = "util/torch_internals.py"
# the private names of CPython and of other libraries (imports no torch)
LIBRARY_ROOM = "util/library_internals.py"
# underscored names that are documented public API
PUBLIC = {"os._exit", "sys._getframe"}


def foreign_private(pkg: Path = PKG) -> list[Finding]:
    """Private names of torch (or of CPython, or any library) used outside the room."""
    ours = defined_private(pkg)
    out = []
    for path, tree, al in parsed(pkg):
        rel = rel_path(path, pkg)
        if rel == f"{pkg.name}/{ROOM}":
            continue
        library_room = rel == f"{pkg.name}/{LIBRARY_ROOM}"
        for node in ast.walk(tree):
            if library_room and not any(
                    n.split(".")[0] == "torch" for n in _imported_names(node, al)):
                continue           # another library's private names: their room
            if isinstance(node, ast.Import):
                for a in node.names:
                    if any(_private(p) for p in a.name.split(".")) \
                            and a.name.split(".")[0] != pkg.name:
                        out.append(Finding(rel, node.lineno, f"import {a.name}"))
            elif isinstance(node, ast.ImportFrom):
                base = absolute_module(node, path, pkg)
                if base.split(".")[0] == pkg.name:
                    continue
                bad = [p for p in base.split(".") if _private(p)] + \
                    [a.name for a in node.names if _private(a.name)]
                if bad:
                    out.append(Finding(rel, node.lineno, f"from {base} import "
                                       f"{', '.join(a.name for a in node.names)}"))
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                name = al.dotted(node)
                if name is not None:
                    if name.split(".")[0] != pkg.name and name not in PUBLIC:
                        out.append(Finding(rel, node.lineno, f"{name}"))
                elif node.attr not in ours:
                    out.append(Finding(rel, node.lineno,
                                       f".{node.attr}: nanbisect defines no such name"))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr", "setattr", "delattr") \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str) and _private(node.args[1].value) \
                    and node.args[1].value not in ours:
                out.append(Finding(rel, node.lineno,
                                   f"{node.func.id}(..., {node.args[1].value!r})"))
    return out


def _imported_names(node: ast.AST, al: Aliases) -> list[str]:
    """The dotted names a node reaches: what it imports, or the chain it names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""]
    if isinstance(node, ast.Attribute):
        return [al.dotted(node) or "torch"]     # an object's attribute: torch's, as the room
    return [""]                                  # would not know otherwise


def private_across(pkg: Path = PKG) -> list[Finding]:
    """Another module's underscore names: imported, reached through its module, or reached as
    an attribute that only another module defines."""
    ours = defined_private(pkg)
    out = []
    for path, tree, al in parsed(pkg):
        rel, me = rel_path(path, pkg), _modname(path, pkg)
        in_room = rel == f"{pkg.name}/{ROOM}"     # its objects' attributes are torch's
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = absolute_module(node, path, pkg)
                if base.split(".")[0] != pkg.name:
                    continue
                for a in node.names:
                    if _private(a.name):
                        out.append(Finding(rel, node.lineno, f"from {base} import {a.name}"))
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                name = al.dotted(node)
                if name is not None:
                    if name.split(".")[0] == pkg.name:
                        out.append(Finding(rel, node.lineno, name))
                    continue
                owners = ours.get(node.attr)
                if owners and me not in owners and not in_room:
                    out.append(Finding(rel, node.lineno,
                                       f".{node.attr} (defined in {', '.join(sorted(owners))})"))
    return out


# ---------------------------------------------------------------- manifests
def _names_manifest(node: ast.AST) -> bool:
    last = node.attr if isinstance(node, ast.Attribute) else \
        node.id if isinstance(node, ast.Name) else ""
    return last.lower().endswith("manifest")


def manifest_reads(pkg: Path = PKG) -> list[Finding]:
    """Reads of a manifest dict: on a name or attribute ending in ``manifest``, or on a name
    the module binds to one (``m = bundle.manifest``; ``m`` means the manifest module-wide)."""
    out = []
    for path, tree, _ in parsed(pkg):
        rel = rel_path(path, pkg)
        if rel.startswith(f"{pkg.name}/bundle/"):
            continue
        bound = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and _names_manifest(node.value) for t in node.targets if isinstance(t, ast.Name)}

        def _names_manifest_here(node: ast.AST) -> bool:
            return _names_manifest(node) or (isinstance(node, ast.Name) and node.id in bound)
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and _names_manifest_here(node.value):
                out.append(Finding(rel, node.lineno, "manifest[...]: read the Manifest view"))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("get", "items", "keys", "values", "setdefault",
                                           "pop", "update") \
                    and _names_manifest_here(node.func.value):
                out.append(Finding(rel, node.lineno,
                                   f"manifest.{node.func.attr}(...): read the Manifest view"))
    return out


# ---------------------------------------------------------------- device specs
PARSERS = {"DeviceSpec.parse", "parse_device", "check_device"}
# where a device string becomes a value: the options' one parse; the grammar itself; the seam
SPEC_HOMES = {"options.py", "util/spec.py", "devices.py"}


def spec_parses(pkg: Path = PKG) -> list[Finding]:
    out = []
    for path, tree, _ in parsed(pkg):
        rel = rel_path(path, pkg)
        if rel.split("/", 1)[1] in SPEC_HOMES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else \
                    (f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute)
                     and isinstance(f.value, ast.Name) else
                     (f.attr if isinstance(f, ast.Attribute) else ""))
                if name in PARSERS or (isinstance(f, ast.Attribute) and f.attr == "parse_device"):
                    out.append(Finding(rel, node.lineno, f"{name}(...): parse options once "
                                       "(nanbisect.options)"))
    return out


# ---------------------------------------------------------------- cycles, tricks, names
def module_imports(pkg: Path = PKG) -> dict[str, set[str]]:
    """Each module -> the package's modules it imports, at any level, ``importlib`` strings
    included (a name imported from a package that is a module counts as that module)."""
    graph: dict[str, set[str]] = {}
    names = {_modname(p, pkg) for p in modules(pkg)}
    for path, tree, al in parsed(pkg):
        me, out = _modname(path, pkg), set()
        for node in ast.walk(tree):
            found = []
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = absolute_module(node, path, pkg)
                found = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base
                         for a in node.names]
            elif isinstance(node, ast.Call) and al.dotted(node.func) == "importlib.import_module" \
                    and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr)):
                arg = node.args[0]
                text = arg.value if isinstance(arg, ast.Constant) else \
                    "".join(v.value for v in arg.values if isinstance(v, ast.Constant))
                found = [str(text).rstrip(".")]
            for name in found:
                while name and name not in names:
                    name = name.rpartition(".")[0]
                if name and name != me and name.split(".")[0] == pkg.name:
                    out.add(name)
        graph[me] = out
    return graph


def import_cycles(pkg: Path = PKG) -> list[Finding]:
    graph = module_imports(pkg)
    graph.pop(pkg.name, None)      # the package's lazy attributes: imported by nobody
    for deps in graph.values():
        deps.discard(pkg.name)
    state: dict[str, int] = {}
    out: list[Finding] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cyc = path[path.index(n):] + [n] if n in path else [m, n]
                out.append(Finding(m.replace(".", "/") + ".py", 0,
                                   "import cycle: " + " -> ".join(cyc)))
            elif n in graph and not state.get(n):
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if not state.get(m):
            visit(m, [m])
    return out


def module_tricks(pkg: Path = PKG) -> list[Finding]:
    out = []
    for path, tree, _ in parsed(pkg):
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == "__class__":
                    out.append(Finding(rel_path(path, pkg), node.lineno,
                                       "a __class__ swapped: no callable-module trick"))
    return out


def same_names(pkg: Path = PKG) -> list[Finding]:
    seen: dict[str, list[str]] = {}
    for path in modules(pkg):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.stem, []).append(rel_path(path, pkg))
    return [Finding(paths[0], 0, f"one module name, {len(paths)} modules: {', '.join(paths)}")
            for paths in seen.values() if len(paths) > 1]
