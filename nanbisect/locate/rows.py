"""Which batch rows the culprit's first bad value depends on, and which of them carry it on to
where the rows meet, traced through the ops.

A row is an index along dim 0 of the batch's tensors (B rows). `RowTracer` is a dispatch mode
(an `ObserverMode`) that rides along a pass that replays the step anyway (the op recording, or
the input catch: no replay of its own) and keeps, for every value the step makes, one of three
states:

- free: made from no batch tensor (parameters, constants, what the model makes from them);
- row-aligned (`Aligned`): along one dim (``axis``) the value has B*g entries, and entry i
  belongs to batch row i // g (the batch itself: axis 0, g = 1; a reshape of (B, T, C) into
  (B*T, C): g = T; the standard ``qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)``: axis 1);
- mixed: some entry may hold several rows' values. The state names the op that mixed them.

The batch's dim moves by index arithmetic on the shapes: a view or reshape keeps it where some
dim of the result spans whole rows (its inner size divides the rows' and its length is B times
the ratio), a permute or transpose moves it, an unsqueeze, select, unbind, squeeze or reduction
shifts it, a broadcast aligns it from the right. An op keeps its outputs row-aligned only when the
tracer knows that it keeps rows apart: pointwise ops; the matmul family with the batch on the
side that keeps it (``bmm`` row by row); reductions, softmax, norms, cat/stack/split, indexing
and sorting along other dims; embedding lookups; convolutions; attention kernels (batch in dim
0). Ops that only read shapes (``ones_like``, ``new_zeros``) make free values. Any other op that
reads a batch-dependent value makes mixed values. So `RowTrace.samples` is exact or null, never
a guess: at the culprit op the rows whose outputs hold the bad value are mapped back to batch
rows; a bad value in a mixed output (a reduction over the batch: batch norm, a mean over the
batch, a loss) gives null and the reason, as does one made from the model's state alone.

Past the culprit the tracer follows the bad rows (`seed`: the culprit's, or in the op recording
every op that makes the failure's kind from clean inputs): a row-aligned output holds a root's
bad row r only where its entries of row r are bad and an input held it; the first op that mixes
rows and makes a bad value from bad rows (the loss, a weight's gradient) is where they meet, and
the rows that reach it (`RowTrace.reached`) are each enough, on their own, to make it bad (the
value of row r depends on row r alone up to there). A row bad at the culprit and masked later (a
``where`` that drops it) does not reach.

Values are keyed by their storage and view (address, offset, shape, strides, dtype), so a
tensor autograd saved for backward is found again when it is unpacked. Not tracked: a write
through one view changes other views of the same storage; those become mixed (never wrong, at
worst null). A failure inside the tracer makes the answer null, never the pass fail.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from nanbisect import devices
from nanbisect.bundle.state import iter_tensors, local
from nanbisect.records import OpSite, RowTrace
from nanbisect.replay.recorder import SKIP, written_tensors
from nanbisect.util import torch_internals as ti
from nanbisect.util.tensors import widened


class Aligned(NamedTuple):
    """Row-aligned along dim ``axis``: B*g entries there, entry i of batch row i // g."""

    axis: int
    g: int


# a state: None (free), an `Aligned`, or a str (mixed: the op that mixed the rows)
State = "Aligned | str | None"
Key = tuple

# ops whose output depends only on the shapes of what they read
SHAPE_ONLY = {"ones_like", "zeros_like", "empty_like", "full_like", "rand_like", "randn_like",
              "randint_like", "new_ones", "new_zeros", "new_empty", "new_full",
              "new_empty_strided", "fill_", "zero_", "normal_", "uniform_", "empty_strided",
              "zeros", "ones", "full", "arange", "scalar_tensor", "empty"}
# ops that keep rows apart when dim 0 is not among the dims they work along (a "dim"/"dims"/
# "dim0"/"dim1" argument; a norm's normalized_shape)
ALONG_DIMS = {"sum", "mean", "amax", "amin", "logsumexp", "var", "std", "var_mean", "std_mean",
              "linalg_vector_norm", "norm", "max", "min", "argmax", "argmin", "any", "all",
              "prod", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "sort", "topk",
              "_softmax", "_log_softmax", "softmax", "log_softmax", "_softmax_backward_data",
              "_log_softmax_backward_data", "cat", "stack", "split", "split_with_sizes", "chunk",
              "narrow", "index_select", "gather", "flip", "roll", "native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm",
              "diff", "unsafe_split", "unsafe_chunk", "glu"}
# same-shape ops the pointwise tag does not carry
SAME_SHAPE = {"_to_copy", "detach", "alias", "lift_fresh", "lift_fresh_copy", "contiguous",
              "native_dropout", "dropout", "mse_loss_backward", "clamp_min", "clamp_max",
              "_masked_scale", "bernoulli"}
# kernels that compute each entry of dim 0 (the batch) from that entry of every input
BATCHED = {"bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
           "_scaled_dot_product_flash_attention_for_cpu_backward",
           "_scaled_dot_product_flash_attention_backward",
           "_scaled_dot_product_efficient_attention_backward",
           "_scaled_dot_product_cudnn_attention_backward"}
VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "view_as"}
# ops that move, add or remove dims without reading values
MOVES = {"expand", "permute", "transpose", "t", "unsqueeze", "squeeze", "select", "unbind",
         "slice", "movedim", "swapaxes"}
MATMUL = {"mm", "addmm", "mv", "addmv"}


def _name(func) -> str:
    return ti.schema_name(func).split("::", 1)[-1]


def _arg(func, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    for i, a in enumerate(ti.schema_arguments(func)):
        if a.name == name:
            if i < len(args):
                return args[i]
            return kwargs.get(name, a.default_value if a.has_default_value() else default)
    return default


def _tensors(values) -> list[torch.Tensor]:
    """The tensors in (nested lists, tuples, dicts of) ``values``, in order (no pytree: this
    runs for every op)."""
    out, todo = [], [values]
    while todo:
        v = todo.pop()
        if isinstance(v, torch.Tensor):
            out.append(local(v))
        elif isinstance(v, (list, tuple)):
            todo.extend(reversed(v))
        elif isinstance(v, dict):
            todo.extend(reversed(list(v.values())))
    return out


def viewed(shape: tuple, s: Aligned, out: tuple, rows: int) -> Aligned | None:
    """Where the rows are in a view of ``shape`` (rows ``s``) as ``out``; None when no dim of
    ``out`` spans whole rows. In row-major order a row owns runs of ``unit`` elements (the size
    of what follows its dim, times g), one run in every ``unit * B``; a dim of ``out`` keeps
    them when its inner size divides ``unit`` and its length is B times the quotient.

    >>> viewed((4, 8, 48), Aligned(0, 1), (4, 8, 3, 2, 8), 4)      # qkv.view(B, T, 3, H, D)
    Aligned(axis=0, g=1)
    >>> viewed((4, 8, 16), Aligned(0, 1), (32, 16), 4)             # (B, T, C) -> (B*T, C)
    Aligned(axis=0, g=8)
    >>> viewed((32, 16), Aligned(0, 8), (4, 8, 16), 4), viewed((4, 6), Aligned(0, 1), (6, 4), 4)
    (Aligned(axis=0, g=1), None)
    """
    unit = math.prod(shape[s.axis + 1:]) * s.g
    for b in range(len(out)):
        inner = math.prod(out[b + 1:])
        if inner and unit % inner == 0 and out[b] == unit // inner * rows:
            return Aligned(b, unit // inner)
    return None


class RowTracer(ti.ObserverMode):
    """Trace the batch's rows to the culprit op at ``site`` and on to where they meet; set
    ``.phase`` as the step moves on (`nanbisect.locate.catch.catch_inputs` does, with
    ``rows=``). Hand `start` to the replayer's ``batch_edits`` so that the tracer knows the
    batch; read `result` afterwards.

    >>> site = OpSite("aten.sqrt.default", "forward", 0)
    >>> tracer, x = RowTracer(site, "nan"), torch.ones(4, 3)
    >>> x[2] = -1.0
    >>> x[3] = -1.0
    >>> w = torch.ones(3, 3)
    >>> batch = tracer.start(x)
    >>> with tracer:
    ...     y = (x @ w).view(4, 3, 1).permute(2, 0, 1).sqrt()        # the rows on dim 1
    ...     y = torch.where(torch.arange(4).view(1, 4, 1) == 3, 0.0, y)   # row 3: dropped
    ...     loss = y.sum()
    >>> tracer.result().samples, tracer.result().reached, tracer.result().reached_at
    ([2, 3], [2], 'aten.sum.default in forward')
    """

    SITE = -1        # the root `seed` names for the site's op

    def __init__(self, site: OpSite | None, kind: str) -> None:
        super().__init__()
        self.site, self.kind = site, kind
        self.phase = "forward"
        self.rows: int | None = None
        self.states: dict[Key, State] = {}
        self.views: dict[tuple, set[Key]] = {}     # storage -> the keys of its views
        self.bad: dict[Key, dict[int, frozenset[int]]] = {}  # root -> its bad rows held there
        self.reached: dict[int, set[int]] = {}     # root -> the rows that reached where they met
        self.met: dict[int, str] = {}              # root -> the first op where they met
        self.seeded: int | None = None
        self.seen = 0
        self.done = False
        self.decided = False
        self.samples: list[int] | None = None
        self.why: str | None = "the replay did not reach the culprit op"

    # -- the batch ----------------------------------------------------------------------------
    def start(self, batch: Any) -> Any:
        """Mark ``batch``'s tensors (a `Replayer.batch_edits` entry: returns the batch as is)."""
        self.states.clear()
        self.views.clear()
        self.bad.clear()
        self.reached.clear()
        self.met.clear()
        self.seen, self.done, self.decided, self.samples, self.seeded = 0, False, False, None, None
        self.why = "the replay did not reach the culprit op"
        leaves = [local(t) for _, t in iter_tensors(batch)]
        sized = [t for t in leaves if t.dim() >= 1]
        self.rows = sized[0].shape[0] if sized else None
        for t in leaves:
            aligned = self.rows is not None and t.dim() >= 1 and t.shape[0] == self.rows
            self._set(t, Aligned(0, 1) if aligned else
                      f"the batch tensor of shape {tuple(t.shape)}, whose dim 0 is not the "
                      f"batch's {self.rows} rows")
        return batch

    def _key(self, t: torch.Tensor) -> Key | None:
        if t.numel() == 0 or not devices.holds_values(t.device):
            return None
        st = t.untyped_storage()
        return (str(t.device), st.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
                t.dtype)

    def _get(self, t: torch.Tensor) -> State:
        key = self._key(t)
        return self.states.get(key) if key is not None else None

    def _set(self, t: torch.Tensor, state: State, inplace: bool = False,
             bad: dict[int, frozenset[int]] | None = None) -> None:
        key = self._key(t)
        if key is None:
            return
        views = self.views.setdefault(key[:2], set())
        if inplace:   # a write through this view: the storage's other views are not followed
            for other in views:
                if other != key and self.states.get(other) != state:
                    self.states[other] = f"a write into it through another view ({state})"
                    self.bad.pop(other, None)
        views.add(key)
        if state is None:
            self.states.pop(key, None)
        else:
            self.states[key] = state
        if bad:
            self.bad[key] = bad
        else:
            self.bad.pop(key, None)

    def _bad(self, t: torch.Tensor) -> torch.Tensor:
        """Where ``t`` holds the failure's kind (NaN; or NaN and inf)."""
        w = widened(t)
        return w.isnan() if self.kind == "nan" else ~w.isfinite()

    def _bad_rows(self, o: torch.Tensor, s: Aligned, bad: torch.Tensor | None = None
                  ) -> set[int]:
        """The batch rows whose entries of ``o`` (rows ``s``) hold the failure's kind (``bad``:
        `_bad` of ``o``, when the caller has it)."""
        bad = self._bad(o) if bad is None else bad
        if not bool(bad.any()):
            return set()
        per = bad.movedim(s.axis, 0).reshape(o.shape[s.axis], -1).any(1)
        return {r // s.g for r in per.nonzero().flatten().tolist()}

    # -- the ops ------------------------------------------------------------------------------
    def wants(self, func) -> bool:
        return func not in SKIP and not self.done and self.rows is not None

    def seed(self, root: int) -> None:
        """The op being run is a root of the failure (``root``: its index in the step): follow
        its bad rows from its outputs on."""
        self.seeded = root

    def before(self, call: ti.OpCall) -> bool:
        """At the culprit (the site's occurrence of its op): decide, and follow its bad rows
        from there on."""
        site = self.site
        if site is not None and not self.decided and self.phase == site.phase \
                and call.name == site.op:
            if self.seen == site.occurrence:
                self.decided = True
                try:
                    self._decide(call.func, call.args, call.kwargs)
                except Exception as e:  # noqa: BLE001 - the pass it rides on must go on
                    self.samples, self.why = None, f"the row trace failed at {call.func}: {e}"
                self.seed(self.SITE)
            else:
                self.seen += 1
        return True

    def after(self, call: ti.OpCall, out: Any) -> None:
        """The states of what the op returned and wrote, from its inputs'; the bad rows it
        carries on, and where they meet."""
        func, args, kwargs = call.func, call.args, call.kwargs
        seeded, self.seeded = self.seeded, None
        try:
            returned, mutated = written_tensors(func, out, args, kwargs)
            outs = _tensors(returned + mutated)
            states = self._outputs(func, args, kwargs, outs)
            written = {id(t) for t in _tensors(mutated)}
            carried: dict[int, frozenset[int]] = {}
            if self.bad:
                for t in _tensors((list(args), kwargs)):
                    key = self._key(t)
                    for root, rows in (self.bad.get(key, {}) if key is not None else {}).items():
                        carried[root] = carried.get(root, frozenset()) | rows
            for t, s in zip(outs, states):
                bad = None
                if carried or seeded is not None:
                    with ti.disable_current_modes():   # the modes below see no op of ours
                        bad = self._carry(call.name, t, s, carried, seeded)
                self._set(t, s, inplace=id(t) in written, bad=bad)
        except Exception as e:  # noqa: BLE001 - the pass it rides on must go on
            self.done, self.samples = True, None
            self.why = f"the row trace failed at {func}: {type(e).__name__}: {e}"

    def _carry(self, op: str, t: torch.Tensor, s: State, carried: dict[int, frozenset[int]],
               seeded: int | None) -> dict[int, frozenset[int]] | None:
        """The roots' bad rows ``t`` (an output, in state ``s``) holds; an output that mixes
        rows and holds a bad value is where the rows it read meet."""
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            return None
        if isinstance(s, Aligned):
            rows = self._bad_rows(t, s)
            out = {root: rs & rows for root, rs in carried.items() if rs & rows}
            if seeded is not None and rows:
                out[seeded] = frozenset(rows)
            return out or None
        if carried and bool(self._bad(t).any()):
            for root, rows in carried.items():
                self.reached.setdefault(root, set()).update(rows)
                self.met.setdefault(root, f"{op} in {self.phase}")
        return None

    def _decide(self, func, args: tuple, kwargs: dict) -> None:
        """At the culprit: run it once more on copies of its inputs (modes off), find the rows of
        its outputs that hold the bad value, map them to batch rows."""
        self.samples, self.why = self._rows_at(func, args, kwargs)

    def trace_at(self, func, args: tuple, kwargs: dict) -> RowTrace:
        """The rows an op's bad value depends on, asked at that op (its inputs as they were
        when it ran), for a tracer made without a site (``site=None``: it follows every op
        and decides nowhere by itself): what `result` would say were that op the culprit,
        without where its rows meet (`reached`, once the pass is over)."""
        try:
            samples, why = self._rows_at(func, args, kwargs)
        except Exception as e:  # noqa: BLE001 - the pass it rides on must go on
            samples, why = None, f"the row trace failed at {func}: {e}"
        if self.rows is None:
            why = "the batch has no tensor with a row dimension"
        elif self.done:      # a failure inside the tracer before this op
            samples, why = None, self.why
        return RowTrace(samples, self.rows, None if samples is not None else why)

    def reached_by(self, trace: RowTrace, root: int) -> RowTrace:
        """``trace`` (of root ``root``) with the rows that reached where they met."""
        if trace.samples is None or self.done or root not in self.reached:
            return trace
        return RowTrace(trace.samples, trace.rows, trace.why,
                        sorted(self.reached[root] & set(trace.samples)), self.met[root])

    def _rows_at(self, func, args: tuple, kwargs: dict) -> tuple[list[int] | None, str | None]:
        with ti.disable_current_modes():
            copy = lambda x: x.clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
            cargs = ti.tree_map(copy, list(args))
            ckwargs = ti.tree_map(copy, dict(kwargs))
            out = func(*cargs, **ckwargs)
            returned, mutated = written_tensors(func, out, tuple(cargs), ckwargs)
            outs = _tensors(returned + mutated)
            states = self._outputs(func, args, kwargs, outs)
            found: set[int] = set()
            for o, s in zip(outs, states):
                if not (o.is_floating_point() or o.is_complex()):
                    continue
                bad = self._bad(o)
                if not bool(bad.any()):
                    continue
                if s is None:
                    return None, ("the first bad value depends on no batch row: it is made "
                                  "from the model's state alone")
                if isinstance(s, str):
                    return None, f"the first bad value mixes the batch's rows ({s})"
                found |= self._bad_rows(o, s, bad)
        return (sorted(found), None) if found else (
            None, "no output of the culprit op held the bad value again")

    # -- how an op moves the rows ---------------------------------------------------------------
    def _outputs(self, func, args: tuple, kwargs: dict, outs: list[torch.Tensor]
                 ) -> list[State]:
        """The states of an op's outputs (returned and written) from its inputs' states."""
        name = _name(func)
        if name in SHAPE_ONLY:     # the first argument gives a shape; a value it reads is not
            read = [self._get(t) for t in _tensors((list(args[1:]), kwargs))]
            return [f"{func} filled it with a batch-dependent value" if any(
                s is not None for s in read) else None] * len(outs)
        if name == "copy_":
            read = args[1:]
        elif name in VIEWS or name in MOVES:
            read = args[:1]         # the rest are sizes and dims
        else:
            read = args
        ins = [(t, self._get(t)) for t in _tensors((list(read), kwargs))]
        deps = [(t, s) for t, s in ins if s is not None]
        if not deps:
            return [None] * len(outs)
        mixed = next((s for _, s in deps if isinstance(s, str)), None)
        if mixed is not None:
            return [mixed] * len(outs)
        if any(t.dim() <= s.axis or t.shape[s.axis] != s.g * self.rows for t, s in deps):
            return [f"{func} combined values of different row layouts"] * len(outs)
        why = f"{func} mixed them"
        got = self._moved(func, name, args, kwargs, outs, deps, why)
        return [s if isinstance(s, str) or s is None or self._fits(o, s) else why
                for o, s in zip(outs, got)]

    def _fits(self, o: torch.Tensor, s: Aligned) -> bool:
        return o.dim() > s.axis and o.shape[s.axis] == s.g * self.rows

    def _moved(self, func, name: str, args: tuple, kwargs: dict, outs: list[torch.Tensor],
               deps: list[tuple[torch.Tensor, Aligned]], why: str) -> list[State]:
        """Each output's state, before checking that it holds the rows where it says."""
        t, s = deps[0]
        n, nd = len(outs), max(t.dim(), 1)
        same = all(u.dim() == t.dim() and r == s for u, r in deps)
        if name in VIEWS:
            return [viewed(tuple(t.shape), s, tuple(o.shape), self.rows) or why for o in outs]
        if name in MOVES:
            return [self._move(func, name, args, kwargs, t, s, o, why) for o in outs]
        if name in MATMUL:
            mat = 0 if name in ("mm", "mv") else 1
            lhs, rhs = local(args[mat]), local(args[mat + 1])
            ls, rs = self._get(lhs), self._get(rhs)
            bias = self._get(local(args[0])) if mat else None
            if bias is None and rs is None and isinstance(ls, Aligned) and ls.axis == 0:
                return [Aligned(0, ls.g)] * n
            if bias is None and ls is None and isinstance(rs, Aligned) and rs.axis == 1 \
                    and name == "mm":
                return [Aligned(1, rs.g)] * n
            return [why] * n
        if name == "embedding":
            if self._get(local(args[0])) is not None:
                return [why] * n
            return [s] * n
        if name in BATCHED:
            if not (same or all(r == Aligned(0, s.g) for _, r in deps)) or s.axis != 0:
                return [why] * n
            return [None if o.dim() == 0 else s for o in outs]    # 0-dim: the RNG's seeds
        if name in ("convolution", "convolution_backward", "native_layer_norm_backward"):
            if name == "convolution_backward":
                data = [local(args[0]), local(args[1])]
                weight = local(args[2])
            elif name == "convolution":
                data, weight = [local(args[0])], local(args[1])
            else:
                data, weight = [local(args[0]), local(args[1])], None
                ns = _arg(func, args, kwargs, "normalized_shape") or []
                if s.axis >= t.dim() - len(ns):
                    return [why] * n
            if (weight is not None and self._get(weight) is not None) or s.axis != (
                    0 if weight is not None else s.axis) or not all(
                    self._get(d) in (None, s) for d in data):
                return [why] * n
            return [s if tuple(o.shape) == tuple(t.shape) else why for o in outs]
        if name in ALONG_DIMS:
            if not same:
                return [why] * n
            dims = self._dims(func, name, args, kwargs, t)
            if dims is None or s.axis in dims:
                return [why] * n
            if name == "stack":
                d = (_arg(func, args, kwargs, "dim", 0)) % (nd + 1)
                return [Aligned(s.axis + (d <= s.axis), s.g)] * n
            gone = sum(1 for d in set(dims) if d < s.axis)
            return [s if o.dim() == t.dim() else Aligned(s.axis - gone, s.g)
                    if o.dim() == t.dim() - len(set(dims)) else why for o in outs]
        if name in SAME_SHAPE or name == "copy_" or torch.Tag.pointwise in func.tags:
            if not outs:
                return []
            od = outs[0].dim()
            at = {Aligned(r.axis + od - u.dim(), r.g) for u, r in deps}
            if len(at) != 1 or any(o.dim() != od for o in outs):
                return [why] * n     # the rows of two inputs broadcast onto different dims
            (a,) = at
            return [a] * n
        return [why] * n

    def _move(self, func, name: str, args: tuple, kwargs: dict, t: torch.Tensor, s: Aligned,
              o: torch.Tensor, why: str) -> State:
        """Where an op that moves, adds or removes dims puts the rows (``o``: one output)."""
        nd = max(t.dim(), 1)
        a = s.axis
        if name == "expand":
            return Aligned(a + o.dim() - t.dim(), s.g)
        if name == "permute":
            dims = [d % nd for d in _arg(func, args, kwargs, "dims") or []]
            return Aligned(dims.index(a), s.g) if a in dims else why
        if name in ("transpose", "swapaxes", "t"):
            if name == "t":
                pair = (0, 1) if t.dim() == 2 else (0, 0)
            else:
                pair = (_arg(func, args, kwargs, "dim0") % nd, _arg(func, args, kwargs, "dim1") % nd)
            return Aligned(pair[1] if a == pair[0] else pair[0] if a == pair[1] else a, s.g)
        if name == "movedim":
            src = _arg(func, args, kwargs, "source")
            dst = _arg(func, args, kwargs, "destination")
            src = [src] if isinstance(src, int) else list(src)
            dst = [dst] if isinstance(dst, int) else list(dst)
            order = [d for d in range(nd) if d not in {x % nd for x in src}]
            for x, y in sorted(zip((x % nd for x in dst), (x % nd for x in src))):
                order.insert(x, y)
            return Aligned(order.index(a), s.g)
        if name == "unsqueeze":
            d = _arg(func, args, kwargs, "dim", 0) % (t.dim() + 1)
            return Aligned(a + 1 if d <= a else a, s.g)
        if name in ("select", "unbind"):
            d = _arg(func, args, kwargs, "dim", 0) % nd
            return why if d == a else Aligned(a - (d < a), s.g)
        if name == "squeeze":
            dims = _arg(func, args, kwargs, "dim", None)
            if dims is None:
                dims = _arg(func, args, kwargs, "dims", None)
            dims = range(t.dim()) if dims is None else [dims] if isinstance(dims, int) else dims
            gone = {d % nd for d in dims if t.shape[d % nd] == 1}
            return why if a in gone else Aligned(a - sum(1 for d in gone if d < a), s.g)
        if name == "slice":       # along the rows' dim only the whole of it keeps them
            d, end = _arg(func, args, kwargs, "dim", 0) % nd, _arg(func, args, kwargs, "end")
            whole = (_arg(func, args, kwargs, "start") in (None, 0)
                     and (end is None or end >= t.shape[d])
                     and _arg(func, args, kwargs, "step", 1) == 1)
            return s if d != a or whole else why
        return why

    @staticmethod
    def _dims(func, name: str, args: tuple, kwargs: dict, t: torch.Tensor) -> list[int] | None:
        """The dims an op works along, normalized (None: every dim)."""
        nd = max(t.dim(), 1)
        if name in ("native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm"):
            ns = _arg(func, args, kwargs, "normalized_shape") or []
            return list(range(t.dim() - len(ns), t.dim()))
        dims: list[int] = []
        found = False
        for arg in ("dim", "dims"):
            if not any(a.name == arg for a in ti.schema_arguments(func)):
                continue
            found = True
            v = _arg(func, args, kwargs, arg, None)
            if v is None or (isinstance(v, (list, tuple)) and len(v) == 0
                             and name not in ("flip", "roll")):
                return None         # every dim: the batch's too
            dims += list(v) if isinstance(v, (list, tuple)) else [v]
        if not found:
            return None
        return [d % (nd + 1 if name == "stack" else nd) for d in dims]

    def result(self) -> RowTrace:
        got = RowTrace(self.samples, self.rows,
                       None if self.samples is not None else
                       ("the batch has no tensor with a row dimension" if self.rows is None
                        else self.why))
        return self.reached_by(got, self.SITE)
