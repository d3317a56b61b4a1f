"""The import gate: what an entry file's top level may do when a replay imports it.

A replay imports the entry file to rebuild the task, and importing runs the file's module-level
statements. `first_refused` reads the top level as an AST, never executing it, and returns the
first statement that does more than define; `nanbisect.task` refuses such an entry (one line,
`BadInput`) unless the run opts in (``--run-top-level``, ``Task(run_top_level=True)``).

Allowed at the top level (docs/guide/tasks.md):

- the docstring and other constant expressions; ``pass``; imports, also in a ``try`` whose
  handlers catch only ``ImportError``/``ModuleNotFoundError`` (their bodies checked alike, where a
  ``raise`` is allowed too), or catch anything (``except Exception:``, a bare ``except:``) when
  the ``try`` body holds only imports and assignments (``try: import apex``);
- ``def`` and ``class`` with any decorators: decorators and default arguments are evaluated at
  import and are not judged (nor is a class body);
- ``if __name__ == "__main__":`` and ``if TYPE_CHECKING:`` (bodies not checked: they do not run at
  import; an ``else`` is checked); any other ``if`` whose test and branches pass these rules;
- assignments and expression statements whose calls are all definitional: a call of a class
  defined in this file (``cfg = Config()``); a call of a function defined in this file whose own
  body's calls are all definitional by these rules, read one level deep (there a call of another
  function of this file is not, and ``torch.library.*`` and a ``.register_*(...)`` method are:
  ``FUSED_GELU = _define()`` registering a custom op passes, ``args = get_args()`` wrapping
  argparse is refused; the bodies of functions and lambdas defined inside are not read); a call
  of a name imported from a sibling module (a ``.py`` file or package in the entry file's
  directory, or a relative import: the user's own code), of an attribute of either or of a
  function of this file (``op.register_autograd(...)``; not of what calling them returned:
  ``parser = make_parser()`` then ``parser.parse_args()`` is refused), or of a name bound at the
  top level to a value the file built (a literal or a builtin's: ``CONFIG.update(...)``); a call
  on the `ALLOWED` list (or under `ALLOWED_PREFIXES`, or ``torch.backends.*.is_available()``:
  the settings, seeds and device checks of an ordinary script, ``logger.setLevel`` of a name
  bound from ``logging.getLogger``); a builtin in `BUILTINS`;
  ``getattr(torch.ops.<namespace>, name)``; ``pathlib.Path(...)`` with only `PATH_PURE` methods
  chained; a call of what an allowed call returned (a decorator
  factory: ``nanbisect.reference_impl("lib::op")(fn)``); except a bare top-level call of a
  function of this file or a sibling named in `ENTRY_POINTS` (``main()``: it runs the script);
- ``assert`` without calls.

Everything else is refused: another call (``argparse.ArgumentParser()``, ``open()``,
``wandb.init()``, ``Path(...).write_text()``), a loop, ``with``, a ``try`` not around imports,
``global``, ``del``, a ``raise`` outside an import's handler, ``match``. Calls inside a
``lambda`` body do not run at import and are not checked; a class body's statements are not
checked (a class is a definition). Not guaranteed: that user code deemed definitional (a
class of the file, what a function of the file calls beyond its own body, a sibling module's
functions) does nothing else; those are the user's own.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# builtins that construct values (or print): allowed unless the file rebinds the name
BUILTINS = frozenset({"int", "float", "str", "bool", "tuple", "list", "dict", "set", "frozenset",
                      "range", "len", "min", "max", "abs", "sorted", "print", "hasattr",
                      "isinstance"})
# pure or definitional callables, by their imported dotted name
ALLOWED = frozenset({
    "torch.device", "torch.ops.load_library", "torch.manual_seed", "contextvars.ContextVar",
    "os.environ.get", "os.getenv", "pathlib.Path", "sys.path.insert", "sys.path.append",
    "logging.getLogger", "collections.namedtuple", "re.compile", "functools.partial",
    "dataclasses.field", "warnings.filterwarnings", "warnings.simplefilter",
    "nanbisect.reference_impl",
    "os.path.join", "os.path.dirname", "os.path.abspath", "os.path.basename", "os.path.realpath",
    "os.path.expanduser", "os.path.normpath", "os.path.split", "os.path.splitext",
    "os.path.relpath", "tempfile.gettempdir",
    # the settings and seeds of an ordinary training script
    "logging.basicConfig", "logging.getLogger().setLevel", "os.environ.setdefault",
    "os.environ.update", "torch.set_float32_matmul_precision", "torch.set_default_dtype",
    "torch.use_deterministic_algorithms", "random.seed", "numpy.random.seed",
    "transformers.set_seed", "lightning.seed_everything", "pytorch_lightning.seed_everything",
    "lightning.pytorch.seed_everything", "lightning.fabric.seed_everything",
    "lightning_fabric.seed_everything",
    # what the machine has (``device = "cuda" if torch.cuda.is_available() else "cpu"``)
    "torch.cuda.is_available", "torch.cuda.device_count",
    # constant tensors
    "torch.tensor", "torch.zeros", "torch.ones", "torch.arange", "torch.full",
    # pure conversions in memory (nothing read or written)
    "json.loads", "json.dumps", "struct.pack", "struct.unpack", "struct.calcsize",
    "safetensors.torch.save",
    # Hugging Face example scripts' version checks
    "transformers.utils.check_min_version", "transformers.utils.versions.require_version",
    "diffusers.utils.check_min_version"})
# every callable under these (torch.library.Library, torch.library.custom_op, typing.TypeVar)
ALLOWED_PREFIXES = ("torch.library.", "typing.", "typing_extensions.")
# ``torch.backends.<name>.is_available()`` (``torch.backends.mps.is_available()``)
_BACKEND_AVAILABLE = ("torch.backends.", ".is_available")
# the methods and attributes of a Path that compute another path (nothing read or written)
PATH_PURE = frozenset({"resolve", "parent", "parents", "joinpath", "absolute", "expanduser",
                       "with_suffix", "with_name", "name", "stem", "suffix"})
# functions that run the script: a bare top-level call of one (``main()``) is refused
ENTRY_POINTS = frozenset({"main", "train", "run", "fit"})

_PATH = "pathlib.Path"
_IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError"})
# what a broad handler catches: allowed around a ``try`` body of imports (and assignments) only
_BROAD = frozenset({"Exception", "BaseException"})


@dataclass(frozen=True)
class Refusal:
    """The first top-level statement that does more than define: its line, its text (the first
    source line, shortened) and what it does ("calls parser.parse_args", "loops", ...)."""

    line: int
    text: str
    what: str


def shorten(text: str, width: int = 70) -> str:
    """The first line of ``text``, ``...`` where more was cut.

    >>> shorten("for x in y:\\n    f(x)")
    'for x in y: ...'
    """
    lines = text.strip().splitlines() or [""]
    first = lines[0].rstrip()
    more = len(lines) > 1
    if len(first) > width:
        first, more = first[:width - 3].rstrip(), True
    return first + (" ..." if more else "")


class _Reader:
    """One file's top level: the names it defines, imports and binds, and the rules above."""

    def __init__(self, tree: ast.Module, source: str, here: Path | None) -> None:
        self.source, self.here = source, here
        self.defined: set[str] = set()       # def/class at the top level (any depth of if/try)
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}   # the defs
        self._read: dict[str, ast.Call | None] = {}     # a def's name -> its body's first bad call
        self._depth = 0                      # 1 while a called def's body is read
        self.names: dict[str, str] = {}      # imported name -> dotted origin
        self.siblings: set[str] = set()      # names bound to the user's own code
        self.bound: dict[str, str] = {}      # name bound from an allowed call -> its origin
        self._collect(tree.body)

    # -- what the file binds ------------------------------------------------------------------

    def _collect(self, body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined.add(node.name)
                if isinstance(node, ast.ClassDef):
                    self.functions.pop(node.name, None)
                else:
                    self.functions[node.name] = node
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.names[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.names[top] = top
                    if self._sibling(a.name, 0):
                        self.siblings.add(a.asname or a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    name = a.asname or a.name
                    self.names[name] = f"{node.module or ''}.{a.name}".lstrip(".")
                    if self._sibling(node.module or "", node.level):
                        self.siblings.add(name)
            elif isinstance(node, ast.If):
                self._collect(node.body)
                self._collect(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, node.orelse, node.finalbody,
                             *(h.body for h in node.handlers)):
                    self._collect(part)

    def _sibling(self, module: str, level: int) -> bool:
        """Is ``module`` the user's own code: a relative import, or a module or package in the
        entry file's directory?"""
        if level:
            return True
        if self.here is None or not module:
            return False
        top = module.split(".")[0]
        return (self.here / f"{top}.py").is_file() or (self.here / top / "__init__.py").is_file()

    # -- names and calls --------------------------------------------------------------------

    def dotted(self, node: ast.expr) -> str | None:
        """``a.b.c`` with its head replaced by what the file imported it as, else None."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        head = self.names.get(node.id, self.bound.get(node.id, node.id))
        return ".".join([head, *reversed(parts)])

    def _root(self, node: ast.expr) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def _user_code(self, root: str | None) -> bool:
        """A name of the user's code: defined here, imported from a sibling, or bound to a value
        the file built (a literal, a builtin's: ``CONFIG``). NB: not a name bound from a call
        of the user's code (``parser = make_parser()``: ``parser.parse_args()`` must not run)."""
        return root is not None and (root in self.defined or root in self.siblings
                                     or self.bound.get(root) == "<value>")

    def _is_path(self, node: ast.expr) -> bool:
        """Does ``node`` compute a `pathlib.Path` with pure steps only?"""
        if isinstance(node, ast.Call):
            if self.dotted(node.func) == _PATH:
                return True
            f = node.func
            return isinstance(f, ast.Attribute) and f.attr in PATH_PURE and self._is_path(f.value)
        if isinstance(node, ast.Attribute):
            return node.attr in PATH_PURE and self._is_path(node.value)
        if isinstance(node, ast.Subscript):
            return self._is_path(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return self._is_path(node.left)
        if isinstance(node, ast.Name):
            return self.bound.get(node.id) == _PATH + "()"
        return False

    def call_ok(self, call: ast.Call) -> bool:
        """Is ``call`` definitional (the rules of the module docstring)?"""
        f = call.func
        if isinstance(f, ast.Name) and f.id in BUILTINS and f.id not in self.names \
                and f.id not in self.defined and f.id not in self.bound:
            return True
        if isinstance(f, ast.Name) and f.id == "getattr" and f.id not in self.names \
                and f.id not in self.defined and f.id not in self.bound and call.args \
                and (self.dotted(call.args[0]) or "").startswith("torch.ops."):
            return True     # an op looked up by name: ``getattr(torch.ops.mylib, name)``
        if isinstance(f, ast.Name) and f.id in self.functions and f.id not in self.bound:
            # a function of this file: its own body is read with these rules, one level deep
            return self._depth == 0 and self.def_bad_call(f.id) is None
        if self._user_code(self._root(f)):
            return True
        if self._is_path(call):
            return True
        if isinstance(f, ast.Call) and self.call_ok(f):
            return True     # what an allowed factory made: ``torch.library.register_fake(n)(f)``
        if self._depth and isinstance(f, ast.Attribute) and f.attr.startswith("register_"):
            return True     # in a called def: ``fused_gelu.register_autograd(backward)``
        name = self.dotted(f)
        return name is not None and (
            name in ALLOWED or name.startswith(ALLOWED_PREFIXES)
            or (name.startswith(_BACKEND_AVAILABLE[0]) and name.endswith(_BACKEND_AVAILABLE[1])))

    def def_bad_call(self, name: str) -> ast.Call | None:
        """The first call in the body of this file's function ``name`` that is not definitional
        by the same rules, None when there is none. One level deep: in that body, a call of
        another function of this file is not definitional; ``torch.library.*`` and a
        ``.register_*(...)`` method are. The bodies of functions and lambdas defined inside it
        are not read (they do not run when it does); their decorators and defaults are."""
        if name in self._read:
            return self._read[name]
        node = self.functions[name]
        saved = self.bound
        self.bound = dict(saved)
        self._depth += 1
        found = None
        try:
            todo: list[ast.AST] = list(node.body)
            while todo and found is None:
                n = todo.pop(0)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    todo[:0] = [*n.decorator_list, *n.args.defaults,
                                *(d for d in n.args.kw_defaults if d is not None)]
                    self.bound.pop(n.name, None)
                    continue
                if isinstance(n, ast.Assign):      # a local bound from an allowed call: ``lib``
                    found = self.bad_call(n.value)
                    for t in n.targets:
                        if isinstance(t, ast.Name):
                            kind = self.origin(n.value)
                            if kind is None:
                                self.bound.pop(t.id, None)
                            else:
                                self.bound[t.id] = kind
                    continue
                if not isinstance(n, ast.expr):   # a statement, handler, argument list...
                    todo[:0] = list(ast.iter_child_nodes(n))
                    continue
                found = self.bad_call(n)
        finally:
            self._depth -= 1
            self.bound = saved
        self._read[name] = found
        return found

    def origin(self, value: ast.expr) -> str | None:
        """What a top-level name bound to ``value`` is, for calls on it later."""
        if isinstance(value, (ast.Constant, ast.JoinedStr, ast.List, ast.Tuple, ast.Set,
                              ast.Dict, ast.ListComp, ast.SetComp, ast.DictComp)):
            return "<value>"
        if self._is_path(value):
            return _PATH + "()"
        if not isinstance(value, ast.Call):
            return None
        f = value.func
        if isinstance(f, ast.Name) and f.id in BUILTINS and f.id not in self.names \
                and f.id not in self.defined:
            return "<value>"
        name = self.dotted(value.func)
        if name and (name.startswith("torch.library.") or name == "logging.getLogger"):
            return f"{name}()"
        return None

    def bad_call(self, node: ast.AST) -> ast.Call | None:
        """The first call in ``node`` that is not definitional (lambda bodies skipped)."""
        todo = [node]
        while todo:
            n = todo.pop(0)
            if isinstance(n, ast.Lambda):
                todo.extend(n.args.defaults + [d for d in n.args.kw_defaults if d is not None])
                continue
            if isinstance(n, ast.Call) and not self.call_ok(n):
                return n
            todo.extend(ast.iter_child_nodes(n))
        return None

    # -- statements -----------------------------------------------------------------------

    def text(self, node: ast.AST) -> str:
        return shorten(ast.get_source_segment(self.source, node) or type(node).__name__)

    def refuse(self, node: ast.stmt, what: str) -> Refusal:
        return Refusal(node.lineno, self.text(node), what)

    def body(self, body: list[ast.stmt], in_handler: bool = False) -> Refusal | None:
        for node in body:
            found = self.stmt(node, in_handler)
            if found is not None:
                return found
        return None

    def stmt(self, node: ast.stmt, in_handler: bool = False) -> Refusal | None:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass)):
            return None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return None
        if isinstance(node, ast.If):
            if _never_at_import(node.test):
                return self.body(node.orelse, in_handler)
            if self.bad_call(node.test) is not None:
                return self._calls(node, node.test)
            return self.body(node.body, in_handler) or self.body(node.orelse, in_handler)
        if isinstance(node, ast.Try):
            return self._try(node)
        if isinstance(node, ast.Raise) and in_handler:
            return None
        if isinstance(node, ast.Expr):
            if isinstance(node.value, ast.Constant):
                return None
            v = node.value
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) \
                    and v.func.id in ENTRY_POINTS and self._user_code(v.func.id):
                return self.refuse(node, f"runs the script ({v.func.id})")
            return self._calls(node, v)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            if self.bad_call(node) is not None:
                return self._calls(node, node)
            value = getattr(node, "value", None)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and value is not None:
                    kind = self.origin(value)
                    if kind is not None:
                        self.bound[t.id] = kind
                    else:
                        self.bound.pop(t.id, None)
            return None
        if isinstance(node, ast.Assert):
            has_call = any(isinstance(n, ast.Call) for n in ast.walk(node))
            return self.refuse(node, "asserts with a call") if has_call else None
        what = {ast.For: "loops", ast.AsyncFor: "loops", ast.While: "loops",
                ast.With: "opens a `with` block", ast.AsyncWith: "opens a `with` block"}
        return self.refuse(node, what.get(type(node), "runs a statement"))

    def _calls(self, node: ast.stmt, where: ast.AST) -> Refusal | None:
        """The refusal of ``node`` for the first call in ``where`` that is not definitional."""
        call = self.bad_call(where)
        if call is None:
            return None
        what = f"calls {shorten(ast.unparse(call.func), 40)}"
        f = call.func
        if isinstance(f, ast.Name) and f.id in self.functions and f.id not in self.bound:
            inner = self.def_bad_call(f.id)
            if inner is not None:
                what += (f", a function of this file that calls "
                         f"{shorten(ast.unparse(inner.func), 40)} (line {inner.lineno})")
        return self.refuse(node, what)

    def _try(self, node: ast.Try) -> Refusal | None:
        imports = any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body)
        # a broad handler only around imports (and assignments): ``except Exception:`` of
        # ``try: import apex``
        only_imports = all(isinstance(n, (ast.Import, ast.ImportFrom, ast.Assign, ast.Pass))
                           for n in node.body)
        handlers_ok = bool(node.handlers) and all(
            _catches_import_error(h.type) or (only_imports and _broad(h.type))
            for h in node.handlers)
        if not (imports and handlers_ok):
            return self.refuse(node, "runs a `try` that is not around imports")
        return (self.body(node.body) or self.body(node.orelse) or self.body(node.finalbody)
                or next((r for h in node.handlers if (r := self.body(h.body, True))), None))


def _never_at_import(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round), ``TYPE_CHECKING`` or
    ``typing.TYPE_CHECKING``: false whenever the file is imported."""
    if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
        return True
    if isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
        return True
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        sides = [test.left, test.comparators[0]]
        return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
                and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))
    return False


def _broad(t: ast.expr | None) -> bool:
    """A bare ``except:`` or one of ``Exception``/``BaseException`` (alone or in a tuple)."""
    names = t.elts if isinstance(t, ast.Tuple) else [t]
    return t is None or all(isinstance(n, ast.Name) and n.id in _BROAD | _IMPORT_ERRORS
                            for n in names)


def _catches_import_error(t: ast.expr | None) -> bool:
    names = t.elts if isinstance(t, ast.Tuple) else [t]
    return all(isinstance(n, ast.Name) and n.id in _IMPORT_ERRORS for n in names)


def first_refused(source: str, here: Path | None = None) -> Refusal | None:
    """The first top-level statement of ``source`` that a replay must not run at import, or
    None when the whole top level only defines. ``here``: the entry file's directory, where
    sibling modules (the user's code) are looked for. Source that does not parse is None: its
    import fails before anything runs, with Python's own error.

    >>> first_refused("import argparse\\np = argparse.ArgumentParser()\\n").line
    2
    >>> first_refused("def main(): ...\\nif __name__ == '__main__':\\n    main()\\n") is None
    True
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    return _Reader(tree, source, here).body(tree.body)


def check_file(path: Path) -> Refusal | None:
    """`first_refused` of the file at ``path`` (its siblings looked for next to it); None when
    it cannot be read (the import then says why)."""
    try:
        source = Path(path).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return first_refused(source, Path(path).parent)

