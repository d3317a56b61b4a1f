"""The device seam holds: nothing in nanbisect outside ``devices.py`` names a device type to
decide what to do (docs/ARCHITECTURE.md, "A device backend").

Every module is parsed (never imported) and each use of a device-type name is judged by where it
stands. A string equal to a type (``"cuda"``) or starting with one and a colon (``"cuda:1"``,
an f-string ``f"cuda:{i}"``) decides behaviour when it is compared or tested (``==``, ``in``,
``if``, ``match``), a dict key, a subscript or a ``.get`` key (dispatch), a prefix tested
(``startswith``), a ``getattr(torch, ...)`` name, or where a tensor goes (``torch.device(...)``,
``.to(...)``, ``device=``, ``map_location=``). So do ``.is_cuda``/``.is_cpu``/..., a move by
name (``t.cpu()``, ``t.cuda()``) and any ``torch.cuda.*``/``torch.npu.*``/... access.
Docstrings, messages and option defaults are text: not judged. `ALLOWED` lists the legitimate
exceptions with their reasons, `PENDING` the known violations in files owned elsewhere; an entry
that no longer matches anything fails (stale).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "nanbisect"
SEAM = PKG / "devices.py"

TYPES = ("cpu", "cuda", "npu", "xpu", "mps", "meta", "hip", "privateuseone")
IS_ATTRS = {f"is_{t}" for t in TYPES}
MODULES = {"cpu", "cuda", "npu", "xpu", "mps"}          # torch.<type> runtime modules
PLACES = {"device", "map_location"}                     # keywords that say where tensors go
LOOKUPS = {"get", "pop", "setdefault"}
PREFIXES = {"startswith", "endswith"}
WRAPPERS = (ast.Tuple, ast.List, ast.Set, ast.Starred, ast.BoolOp, ast.UnaryOp)

# path (relative to the repository) -> [(a fragment of the flagged line, why it is legitimate)]
ALLOWED: dict[str, list[tuple[str, str]]] = {
    "nanbisect/util/tensors.py": [
        ('.to("cpu")', "util imports nothing of nanbisect but errors (tests/project/"
                       "test_layout.py), so its host copy names the host's type itself"),
    ],
    "nanbisect/integrations/megatron.py": [
        ("torch.cuda.", "megatron-core's CPU shims (opt-in, `on_cpu`) stand in for the torch.cuda "
                        "calls megatron-core 0.16 makes with no GPU present, and restore them"),
        ('== "cuda"', "the shims move what megatron-core names a CUDA device to the host: "
                      "naming CUDA is their one job"),
    ],
}
# the same, for violations in files owned elsewhere: each is to move behind the seam
PENDING: dict[str, list[tuple[str, str]]] = {}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    why: str
    text: str       # the source line

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.why}: {self.text.strip()}"


def _names_type(node: ast.AST) -> bool:
    """A string constant (or an f-string's leading text) that is a device type or starts with
    one and a colon."""
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        return isinstance(first, ast.Constant) and isinstance(first.value, str) \
            and any(first.value.startswith(f"{t}:") for t in TYPES)
    return isinstance(node, ast.Constant) and isinstance(node.value, str) \
        and any(node.value == t or node.value.startswith(f"{t}:") for t in TYPES)


def _is_torch(node: ast.AST, attr: str | None = None) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
        and node.value.id == "torch" and (attr is None or node.attr == attr)


def _context(node: ast.AST, up: dict) -> str | None:
    """Why the device-type literal ``node`` decides behaviour where it stands, or None."""
    parent, field, index = up.get(node, (None, None, None))
    while isinstance(parent, WRAPPERS) or (isinstance(parent, ast.IfExp) and field != "test"):
        node = parent
        parent, field, index = up.get(node, (None, None, None))
    if isinstance(parent, ast.Compare):
        return "compared"
    if isinstance(parent, (ast.If, ast.While, ast.IfExp, ast.Assert)) and field == "test":
        return "tested"
    if isinstance(parent, ast.MatchValue):
        return "matched"
    if isinstance(parent, ast.Dict) and field == "keys":
        return "a dict key"
    if isinstance(parent, ast.Subscript) and field == "slice":
        return "a subscript"
    if isinstance(parent, ast.keyword) and parent.arg in PLACES:
        return f"{parent.arg}="
    if isinstance(parent, ast.Call) and field == "args":
        func = parent.func
        if _is_torch(func, "device"):
            return "torch.device(...)"
        if isinstance(func, ast.Attribute) and func.attr == "to":
            return ".to(...)"
        if isinstance(func, ast.Attribute) and func.attr in LOOKUPS and index == 0:
            return f"a .{func.attr} key"
        if isinstance(func, ast.Attribute) and func.attr in PREFIXES:
            return f".{func.attr}(...)"
        if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and index == 1:
            return f"{func.id}(..., name)"
    return None


def scan(source: str, path: str = "<string>") -> list[Finding]:
    """Every place in ``source`` where a device type decides behaviour."""
    tree = ast.parse(source)
    lines = source.splitlines()
    up: dict = {}
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            for i, child in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(child, ast.AST):
                    up[child] = (parent, field, i)
    out = []
    for node in ast.walk(tree):
        why = None
        if isinstance(node, ast.Attribute) and node.attr in IS_ATTRS:
            why = f".{node.attr}"
        elif isinstance(node, ast.Attribute) and any(_is_torch(node.value, m) for m in MODULES):
            why = f"torch.{node.value.attr}.{node.attr}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MODULES:
            why = f".{node.func.attr}()"
        elif _names_type(node) and not isinstance(up.get(node, (None,))[0], ast.JoinedStr):
            why = _context(node, up)
        if why:
            out.append(Finding(path, node.lineno, why, lines[node.lineno - 1]))
    return out


def _tree() -> list[Finding]:
    root = PKG.parent
    return [f for p in sorted(PKG.rglob("*.py")) if p != SEAM
            for f in scan(p.read_text(), str(p.relative_to(root)))]


def _excused(f: Finding, table: dict) -> bool:
    return any(needle in f.text for needle, _ in table.get(f.path, ()))


def test_nothing_outside_the_seam_decides_by_a_device_type():
    wrong = [str(f) for f in _tree() if not _excused(f, ALLOWED) and not _excused(f, PENDING)]
    assert not wrong, ("a device type decides behaviour outside nanbisect/devices.py; ask "
                       "devices.entry(device).<capability> instead:\n" + "\n".join(wrong))


def test_every_allowed_or_pending_entry_still_matches_something():
    found = _tree()
    stale = [f"{path}: {needle!r} ({why})" for table in (ALLOWED, PENDING)
             for path, entries in table.items() for needle, why in entries
             if not any(f.path == path and needle in f.text for f in found)]
    assert not stale, "stale entries (remove them):\n" + "\n".join(stale)


PLANTED = '''
"""Moves x to "cuda" when it can."""
import torch


def step(x, device):
    """On "cuda": synchronise."""
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    raise ValueError(f"{device} is not cuda; use cuda:0")
'''


def test_the_scanner_finds_a_planted_decision_and_not_text():
    found = scan(PLANTED)
    assert [(f.line, f.why) for f in found] == [(8, "compared"), (9, "torch.cuda.synchronize")]


def test_the_scanner_knows_each_way_a_type_decides():
    decides = {
        'if d in ("cpu", "meta"): pass': "compared",
        'match d:\n    case "npu": pass': "matched",
        'TABLE = {"cuda": 1, "x": 2}': "a dict key",
        'y = TABLE["xpu"]': "a subscript",
        'y = TABLE.get("mps")': "a .get key",
        'ok = str(d).startswith("cpu")': ".startswith(...)",
        'mod = getattr(torch, "npu")': "getattr(..., name)",
        'd = torch.device("cuda", 1)': "torch.device(...)",
        'd = torch.device(f"cuda:{i}")': "torch.device(...)",
        'd = torch.device("cuda" if ok else "cpu")': "torch.device(...)",
        'y = x.to("cuda:1", non_blocking=True)': ".to(...)",
        'y = torch.empty(2, device="meta")': "device=",
        'y = torch.load(f, map_location="cpu")': "map_location=",
        'ok = x.is_cuda': ".is_cuda",
        'n = torch.npu.device_count()': "torch.npu.device_count",
        'y = x.detach().cpu()': ".cpu()",
        'y = x.cuda(1)': ".cuda()",
    }
    for source, why in decides.items():
        assert {f.why for f in scan(source)} == {why}, source     # each literal, this why
    text = ['print("cuda")', 'ap.add_argument("--device", default="cpu")',
            'raise BadInput(f"device {d} is not cuda")', 'KINDS = ("device", "cpu")',
            'def run(device: str = "cpu"): """Run on "cuda" or cpu."""',
            'rng = {"rng/cpu": state}', 'ok = d == devices.HOST.type', 'x = "cudagraph"']
    for source in text:
        assert scan(source) == [], source
