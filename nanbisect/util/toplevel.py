"""The import gate: what an entry file's top level may do when a replay imports it.

A replay imports the entry file to rebuild the task, and importing runs the file's module-level
statements. The gate exists to stop a replay from *acting* at import (the first-hour case: a
script that trains at module level, without ``if __name__ == "__main__":``), not to judge its
arithmetic. `first_refused` reads the top level as an AST, never executing it, and returns the
first statement that acts; `nanbisect.task` refuses such an entry (one line, `BadInput`) unless
the run opts in (``--run-top-level``, ``Task(run_top_level=True)``). While the file is imported,
`nanbisect.task` also trips on training calls the AST could not see (``backward``,
``Optimizer.step``).

The rule is about effects. Refused at the top level (`ACTS`, `ACTING_METHODS`):

- training: ``.backward()``, ``.step()``, ``.zero_grad()``, ``.fit()``, and ``.train()`` of a
  trainer (a name bound from a ``*Trainer(...)`` call); a bare call of an entry point of the
  user's code (``main()``, ``train()``: `ENTRY_POINTS`);
- loops that iterate data (their iterable names a loader, a dataset, data or batches, or calls
  the user's code) or that call this file's functions;
- file writes: ``open`` for writing, ``torch.save``, ``numpy.save``, ``json.dump``, ``shutil``,
  ``os.makedirs`` and the other file-system changes, ``.write_text()``, ``.save()``,
  ``.mkdir()``, a log file handler; ``os.chdir``;
- the network (``requests``, ``urllib.request``, ``socket``, ``torch.hub``, ``huggingface_hub``,
  ``datasets.load_dataset``, any call with ``download=True``), subprocesses (``subprocess``,
  ``os.system``, ``multiprocessing``' processes), process-group initialisation
  (``torch.distributed`` beyond its queries, ``deepspeed.init_distributed``, ``Accelerator()``),
  experiment trackers (``wandb.init``, ``mlflow.start_run``, a ``SummaryWriter``, ...), ending
  or pausing the process (``sys.exit``, ``input()``, ``breakpoint()``, ``signal.signal``,
  ``atexit.register``), running text as code (``exec``, ``eval``);
- a call of a function of this file whose body does any of that (read through the file's
  functions it calls in turn, a few levels deep).

Everything else is allowed: pure computation with torch, numpy, math and the standard library
(tensor factories with or without a generator, views, arithmetic, comprehensions, ``print``),
reading files, process settings (threads, precision, determinism, ``torch.backends.*`` flags,
seeds, device selection, warnings and logging configuration, environment variables), argument
parsing (``sys.argv`` is the entry file alone while it is imported), and ``with``, ``if``,
``try``, ``for`` and ``while`` statements whose parts are allowed (``with np.errstate(...)``,
``with torch.no_grad():``, a loop that builds a table). ``def`` and ``class`` are definitions:
their decorators and default values run at import and are judged; their bodies are not (a class
body, a lambda's body), except a function's when the top level calls it.

Not guaranteed: a library function whose name says nothing of what it does (a framework's own
``run_training(...)``) is not recognised here; the import's trip wires catch its training calls.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

# what a call does, by its dotted name (an exact name, or a prefix ending with "."), when it acts
ACTS = {
    # training and the script's own entry
    "torch.autograd.backward": "trains (backward)",
    # file writes and the file system
    "torch.save": "writes a file", "numpy.save": "writes a file", "numpy.savez": "writes a file",
    "numpy.savez_compressed": "writes a file", "numpy.savetxt": "writes a file",
    "json.dump": "writes a file", "pickle.dump": "writes a file", "yaml.dump": "writes a file",
    "shutil.": "changes files", "os.makedirs": "writes a directory",
    "os.mkdir": "writes a directory", "os.remove": "removes a file",
    "os.unlink": "removes a file", "os.rename": "moves a file", "os.replace": "moves a file",
    "os.rmdir": "removes a directory", "os.removedirs": "removes a directory",
    "os.symlink": "writes a link", "os.link": "writes a link", "os.chmod": "changes a file",
    "os.chown": "changes a file", "os.truncate": "changes a file", "os.write": "writes a file",
    "os.utime": "changes a file", "os.chdir": "changes the working directory",
    "tempfile.mkdtemp": "writes a directory", "tempfile.mkstemp": "writes a file",
    "tempfile.NamedTemporaryFile": "writes a file",
    "tempfile.TemporaryDirectory": "writes a directory",
    "logging.FileHandler": "writes a log file", "logging.handlers.": "writes a log file",
    "torch.onnx.export": "writes a file", "torch.jit.save": "writes a file",
    "safetensors.torch.save_file": "writes a file", "safetensors.torch.save_model":
    "writes a file",
    "nanbisect.capture": "writes a bundle", "nanbisect.run": "replays a bundle",
    "nanbisect.triage": "replays bundles",
    # the network
    "urllib.request.": "uses the network", "requests.": "uses the network",
    "httpx.": "uses the network", "http.client.": "uses the network",
    "socket.": "uses the network", "ftplib.": "uses the network",
    "smtplib.": "uses the network", "aiohttp.": "uses the network",
    "torch.hub.": "uses the network", "huggingface_hub.": "uses the network",
    "datasets.load_dataset": "uses the network", "wget.": "uses the network",
    "gdown.": "uses the network",
    # subprocesses and other processes
    "subprocess.": "starts a subprocess", "os.system": "starts a subprocess",
    "os.popen": "starts a subprocess", "os.spawn": "starts a subprocess",
    "os.exec": "starts a subprocess", "os.posix_spawn": "starts a subprocess",
    "os.fork": "starts a process", "os.kill": "signals a process",
    "os.killpg": "signals a process", "pty.spawn": "starts a subprocess",
    "multiprocessing.Process": "starts a process", "multiprocessing.Pool": "starts processes",
    "torch.multiprocessing.spawn": "starts processes",
    "torch.multiprocessing.start_processes": "starts processes",
    "torch.multiprocessing.Process": "starts a process",
    "concurrent.futures.ProcessPoolExecutor": "starts processes",
    # process groups
    "deepspeed.init_distributed": "initialises a process group",
    "deepspeed.initialize": "initialises a process group",
    "accelerate.Accelerator": "initialises a process group",
    "accelerate.PartialState": "initialises a process group",
    "megatron.core.parallel_state.initialize_model_parallel": "initialises a process group",
    "colossalai.launch": "initialises a process group",
    # experiment trackers
    "wandb.": "starts an experiment tracker", "mlflow.": "starts an experiment tracker",
    "comet_ml.": "starts an experiment tracker", "neptune.": "starts an experiment tracker",
    "clearml.": "starts an experiment tracker", "aim.Run": "starts an experiment tracker",
    "swanlab.": "starts an experiment tracker", "dvclive.": "starts an experiment tracker",
    "tensorboardX.SummaryWriter": "starts an experiment tracker",
    "torch.utils.tensorboard.SummaryWriter": "starts an experiment tracker",
    # the process itself
    "sys.exit": "ends the process", "os._exit": "ends the process", "os.abort": "ends the process",
    "signal.signal": "installs a signal handler", "signal.alarm": "sets an alarm",
    "atexit.register": "runs code at exit", "faulthandler.dump_traceback_later":
    "sets a timer", "code.interact": "waits for the terminal", "pdb.set_trace":
    "waits for the terminal",
}
# queries under a prefix of `ACTS`: they act on nothing
QUERIES = frozenset({"socket.gethostname", "socket.getfqdn", "shutil.which",
                     "shutil.get_terminal_size", "shutil.disk_usage", "requests.utils.quote"})
# what acts in torch.distributed (its types, queries and decorators do not: ``@record``,
# ``MixedPrecision(...)``, ``get_rank()``)
DIST_ACTS = frozenset({"init_process_group", "init_device_mesh", "new_group", "new_subgroups",
                       "new_subgroups_by_enumeration", "destroy_process_group", "barrier",
                       "monitored_barrier", "all_reduce", "all_gather", "all_gather_object",
                       "all_gather_into_tensor", "broadcast", "broadcast_object_list", "reduce",
                       "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                       "all_to_all_single", "send", "recv", "isend", "irecv",
                       "batch_isend_irecv", "scatter", "gather", "gather_object",
                       "scatter_object_list", "start_processes", "elastic_launch"})
# builtins that act (unless the file rebinds the name)
ACTING_BUILTINS = {"exit": "ends the process", "quit": "ends the process",
                   "input": "waits for the terminal", "breakpoint": "waits for the terminal",
                   "exec": "runs text as code", "eval": "runs text as code"}
# methods that act, whatever they are called on
ACTING_METHODS = {"backward": "trains (backward)", "step": "trains (an optimizer's step)",
                  "zero_grad": "trains (zero_grad)", "fit": "trains (fit)",
                  "write_text": "writes a file", "write_bytes": "writes a file",
                  "touch": "writes a file", "unlink": "removes a file",
                  "rmdir": "removes a directory", "mkdir": "writes a directory",
                  "symlink_to": "writes a link", "hardlink_to": "writes a link",
                  "save": "writes a file", "save_pretrained": "writes a file",
                  "push_to_hub": "uses the network", "to_csv": "writes a file",
                  "to_parquet": "writes a file", "savefig": "writes a file",
                  "launch": "launches processes"}
# ``.train()`` and friends act on a trainer (a name bound from a ``*Trainer(...)`` call)
TRAINER_METHODS = frozenset({"train", "evaluate", "predict", "test", "validate"})
# functions that run the script: a bare top-level call of one of the user's code (``main()``)
ENTRY_POINTS = frozenset({"main", "train", "run", "fit"})
# words of a name (split at ``_`` and case changes) that make a loop's iterable data
# (``for x, y in train_loader``, ``trainloader``, ``val_ds``); not ``metadata``, ``num_batches``
# inside ``range(...)`` (`COUNTS`)
DATA_WORDS = frozenset({"loader", "dataloader", "dataset", "datasets", "data", "batch",
                        "batches", "ds", "dl"})
COUNTS = frozenset({"range", "len"})
PATHS = frozenset({"pathlib.Path", "pathlib.PosixPath", "pathlib.WindowsPath"})
# how deep the bodies of this file's functions are read through their calls of one another
DEPTH = 4

_IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError"})


@dataclass(frozen=True)
class Refusal:
    """The first top-level statement that acts at import: its line, its text (the first
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
    """One file's top level: the names it defines, imports and binds, and the rule above."""

    def __init__(self, tree: ast.Module, source: str, here: Path | None) -> None:
        self.source, self.here = source, here
        self.defined: set[str] = set()       # def/class at the top level (any depth of if/try)
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}   # the defs
        self._read: dict[str, tuple[ast.Call, str] | None] = {}   # a def -> its acting call
        self._reading: list[str] = []        # the defs being read (depth, cycles)
        self._cut = False                    # a read stopped at the depth or a cycle
        self.names: dict[str, str] = {}      # imported name -> dotted origin
        self.siblings: set[str] = set()      # names bound to the user's own code
        self.made: dict[str, str] = {}       # top-level name -> the dotted callee that made it
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
            else:
                for part in ("body", "orelse", "finalbody"):
                    self._collect(getattr(node, part, None) or [])
                for h in getattr(node, "handlers", None) or []:
                    self._collect(h.body)

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
        head = self.names.get(node.id, node.id)
        return ".".join([head, *reversed(parts)])

    def _root(self, node: ast.expr) -> str | None:
        while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return node.id if isinstance(node, ast.Name) else None

    def _users(self, name: str | None) -> bool:
        """A name of the user's code: defined in this file or imported from a sibling."""
        return name is not None and (name in self.defined or name in self.siblings)

    def _is_path(self, node: ast.expr) -> bool:
        """Does ``node`` compute a `pathlib.Path` (a ``Path(...)`` call, a step or ``/`` on one,
        a name bound to one)?"""
        if isinstance(node, ast.Call):
            if self.dotted(node.func) in PATHS:
                return True
            return isinstance(node.func, ast.Attribute) and self._is_path(node.func.value)
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            return self._is_path(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return self._is_path(node.left)
        return isinstance(node, ast.Name) and self.made.get(node.id) in PATHS

    def call_acts(self, call: ast.Call) -> str | None:
        """What ``call`` does when it acts (the rule of the module docstring); None when it
        computes."""
        f = call.func
        if any(k.arg == "download" and isinstance(k.value, ast.Constant) and k.value.value
               for k in call.keywords):
            return "downloads (download=True)"
        if isinstance(f, ast.Name):
            if f.id in self.functions and f.id not in self.names:
                inner = self.def_acts(f.id)
                if inner is not None:
                    icall, what = inner
                    return (f"{what}: {shorten(ast.unparse(f), 40)}, a function of this file, "
                            f"calls {shorten(ast.unparse(icall.func), 40)} (line "
                            f"{icall.lineno})")
                return None
            if f.id in ACTING_BUILTINS and f.id not in self.names and f.id not in self.defined:
                return ACTING_BUILTINS[f.id]
            if f.id == "open" and f.id not in self.names and f.id not in self.defined:
                return "writes a file" if _writes(call) else None
        name = self.dotted(f)
        if name is not None and name.endswith(".open") and not self._is_path(f.value):
            # io.open, codecs.open, gzip.open, tarfile.open, PIL's Image.open: mode second
            return "writes a file" if _writes(call) else None
        if name is not None:
            if name.startswith("torch.distributed."):
                last = name.rsplit(".", 1)[1]
                return "initialises a process group" if last in DIST_ACTS else None
            if name == "logging.basicConfig" and any(k.arg == "filename"
                                                     for k in call.keywords):
                return "writes a log file"
            if name in QUERIES:
                return None
            for key, what in ACTS.items():
                if name == key or (key.endswith(".") and name.startswith(key)) or \
                        (key in ("os.spawn", "os.exec") and name.startswith(key)):
                    return what
        if isinstance(f, ast.Attribute):
            if f.attr in ACTING_METHODS:
                return ACTING_METHODS[f.attr]
            if f.attr == "open" and self._is_path(f.value) and _writes(call, 0):
                return "writes a file"                   # ``Path(...).open("a")``
            if f.attr in TRAINER_METHODS and isinstance(f.value, ast.Name) and \
                    self.made.get(f.value.id, "").endswith("Trainer"):
                return f"trains ({f.value.id}.{f.attr})"
        return None

    def def_acts(self, name: str) -> tuple[ast.Call, str] | None:
        """The first acting call in the body of this file's function ``name`` (read through
        the file's functions it calls, `DEPTH` levels), None when there is none. The bodies
        of functions and lambdas defined inside it are not read; their decorators and defaults
        are."""
        if name in self._read:
            return self._read[name]
        if name in self._reading or len(self._reading) >= DEPTH:
            self._cut = True        # not read to the end: not remembered as harmless
            return None
        self._reading.append(name)
        cut, self._cut = self._cut, False
        try:
            found = self.acts(self.functions[name].body)
        finally:
            self._reading.pop()
        if found is not None or not self._cut:
            self._read[name] = found
        self._cut = self._cut or cut
        return found

    def acts(self, node) -> tuple[ast.Call, str] | None:
        """The first call in ``node`` (a node or a list of them) that acts, with what it does
        (the bodies of lambdas and of functions and classes defined in it skipped)."""
        todo = list(reversed(node)) if isinstance(node, list) else [node]   # a stack: in order
        while todo:
            n = todo.pop()
            if isinstance(n, ast.Lambda):
                todo.extend(reversed(n.args.defaults
                                     + [d for d in n.args.kw_defaults if d is not None]))
                continue
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                todo.extend(reversed(_header(n)))
                continue
            if isinstance(n, ast.Call):
                what = self.call_acts(n)
                if what is not None:
                    return n, what
            todo.extend(reversed(list(ast.iter_child_nodes(n))))
        return None

    # -- statements -----------------------------------------------------------------------

    def text(self, node: ast.AST) -> str:
        return shorten(ast.get_source_segment(self.source, node) or type(node).__name__)

    def refuse(self, node: ast.stmt, what: str) -> Refusal:
        return Refusal(node.lineno, self.text(node), what)

    def body(self, body: list[ast.stmt]) -> Refusal | None:
        for node in body:
            found = self.stmt(node)
            if found is not None:
                return found
        return None

    def _acting(self, node: ast.stmt, parts) -> Refusal | None:
        found = self.acts(parts)
        if found is None:
            return None
        call, what = found
        if ":" not in what:
            what = f"{what}: {shorten(ast.unparse(call.func), 40)}"
        return self.refuse(node, what)

    def stmt(self, node: ast.stmt) -> Refusal | None:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass, ast.Global, ast.Nonlocal,
                             ast.Break, ast.Continue)):
            return None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found = self.acts(_header(node))     # decorators, defaults, bases run: their line
            if found is None:      # a class body runs at import too (its methods' do not)
                return self.body(node.body) if isinstance(node, ast.ClassDef) else None
            call, what = found
            shown = ("@" + self.text(call.func) if getattr(call, "decorator", False)
                     else self.text(call))
            return Refusal(call.lineno, shown, what)
        if isinstance(node, ast.If):
            if _never_at_import(node.test):
                return self.body(node.orelse)
            return (self._acting(node, node.test) or self.body(node.body)
                    or self.body(node.orelse))
        if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            return (self.body(node.body) or next((r for h in node.handlers
                                                  if (r := self.body(h.body))), None)
                    or self.body(node.orelse) or self.body(node.finalbody))
        if isinstance(node, (ast.With, ast.AsyncWith)):
            return self._acting(node, [i.context_expr for i in node.items]) or \
                self.body(node.body)
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            return self._loop(node)
        if isinstance(node, ast.Match):
            return self._acting(node, node.subject) or next(
                (r for c in node.cases if (r := self._acting(node, c.guard or ast.Pass())
                                           or self.body(c.body))), None)
        if isinstance(node, ast.Expr):
            v = node.value
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) \
                    and v.func.id in ENTRY_POINTS and self._users(v.func.id):
                return self.refuse(node, f"runs the script ({v.func.id})")
            return self._acting(node, v)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            found = self._acting(node, node)
            value = getattr(node, "value", None)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            made = ("pathlib.Path" if value is not None and self._is_path(value) else
                    self.dotted(value.func) if isinstance(value, ast.Call) else None)
            for t in targets:
                if isinstance(t, ast.Name):
                    if made:
                        self.made[t.id] = made
                    else:
                        self.made.pop(t.id, None)
            return found
        return self._acting(node, node)     # assert, raise, del, return, ...: their calls

    def _loop(self, node: ast.For | ast.AsyncFor | ast.While) -> Refusal | None:
        """A loop acts when it iterates data (`DATA_WORDS`, the user's code), calls a function
        of this file, or its parts act."""
        it = node.iter if isinstance(node, (ast.For, ast.AsyncFor)) else node.test
        if isinstance(node, (ast.For, ast.AsyncFor)):
            todo = [it]
            while todo:
                n = todo.pop()
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and \
                        n.func.id in COUNTS:
                    continue        # ``range(num_batches)``: a count, not the data
                name = n.id if isinstance(n, ast.Name) else \
                    n.attr if isinstance(n, ast.Attribute) else None
                if name is not None and (_names_data(name) or name in self.functions
                                         or name in self.siblings):
                    return self.refuse(node, f"loops over data ({name})")
                todo.extend(ast.iter_child_nodes(n))
        for part in [*node.body, *node.orelse]:
            for n in ast.walk(part):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and (
                        (n.func.id in self.functions and n.func.id not in self.names)
                        or n.func.id in self.siblings):
                    return self.refuse(node, f"loops calling {n.func.id}, a function of your "
                                             "code")
        return self._acting(node, it) or self.body(node.body) or self.body(node.orelse)


def _names_data(name: str) -> bool:
    """Does the identifier ``name`` name data (a loader, a dataset, batches)?

    >>> [_names_data(n) for n in ("train_loader", "trainloader", "valDataset", "metadata", "x")]
    [True, True, True, False, False]
    """
    words = [w.lower() for w in re.split(r"_+|(?<=[a-z0-9])(?=[A-Z])", name) if w]
    return any(w in DATA_WORDS for w in words) or name.lower().endswith("loader")


def _header(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list[ast.expr]:
    """What a definition runs at import: its decorators and default values (a class: its bases
    and keywords)."""
    # a decorator that is no call (``@wandb.init``) is called with the definition: a call
    out = []
    for d in node.decorator_list:
        if not isinstance(d, ast.Call):
            d = ast.copy_location(ast.Call(func=d, args=[], keywords=[]), d)
            d.decorator = True      # shown as the decorator it is
        out.append(d)
    if isinstance(node, ast.ClassDef):
        return out + list(node.bases) + [k.value for k in node.keywords]
    return out + list(node.args.defaults) + [d for d in node.args.kw_defaults if d is not None]


def _writes(call: ast.Call, at: int = 1) -> bool:
    """Does this ``open(...)`` call (its mode the positional argument ``at``, or ``mode=``) open
    for writing (a mode with w, a, x or +; a mode that is not a constant counts as writing)?"""
    mode = call.args[at] if len(call.args) > at else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    if mode is None:
        return False
    if not (isinstance(mode, ast.Constant) and isinstance(mode.value, str)):
        return True
    return any(c in mode.value for c in "wax+")


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


def first_refused(source: str, here: Path | None = None) -> Refusal | None:
    """The first top-level statement of ``source`` that a replay must not run at import, or
    None when the whole top level only defines. ``here``: the entry file's directory, where
    sibling modules (the user's code) are looked for. Source that does not parse is None: its
    import fails before anything runs, with Python's own error.

    >>> first_refused("import torch\\ntorch.save({}, 'x.pt')\\n").line
    2
    >>> first_refused("def main(): ...\\nif __name__ == '__main__':\\n    main()\\n") is None
    True
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    except (RecursionError, MemoryError):
        return Refusal(1, "", "is nested too deeply for the gate to read")
    try:
        return _Reader(tree, source, here).body(tree.body)
    except RecursionError:
        return Refusal(1, "", "is nested too deeply for the gate to read")


def check_file(path: Path) -> Refusal | None:
    """`first_refused` of the file at ``path`` (its siblings looked for next to it), decoded as
    Python decodes it (PEP 263: a coding cookie, else UTF-8). A file that cannot be decoded is
    refused (a `Refusal` at line 1), never skipped: its import would run what the gate did not
    read. None when it cannot be read at all (the import then says why)."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        source = raw.decode(encoding)
    except (SyntaxError, LookupError, UnicodeDecodeError) as e:
        return Refusal(1, Path(path).name, f"cannot be decoded as Python source ({e})")
    return first_refused(source, Path(path).parent)
