"""Which batch rows the culprit's first bad value depends on, traced through the ops.

A row is an index along dim 0 of the batch's tensors (B rows). `RowTracer` is a dispatch mode
(an `ObserverMode`) that rides along the input-catch pass (no replay of its own) and keeps, for
every value the step makes, one of three states:

- free: made from no batch tensor (parameters, constants, what the model makes from them);
- row-aligned with ``g`` rows per sample: dim 0 has B*g entries and entry r belongs to batch row
  r // g (the batch itself: g = 1; a reshape of (B, T, C) into (B*T, C): g = T);
- mixed: some entry may hold several rows' values. The state names the op that mixed them.

An op keeps its outputs row-aligned only when the tracer knows that it keeps rows apart:
pointwise ops; the matmul family with a free right-hand side (``bmm`` row by row); views and
reshapes that keep dim 0 or split and merge it into whole rows; reductions, softmax, norms,
cat/stack/split, indexing and sorting along other dims; embedding lookups; attention kernels
(batch in dim 0). Ops that only read shapes (``ones_like``, ``new_zeros``) make free values. Any
other op that reads a batch-dependent value makes mixed values. So `RowTrace.samples` is exact or
null, never a guess: at the culprit op the rows whose outputs hold the bad value are mapped back
to batch rows; a bad value in a mixed output (a reduction over the batch: batch norm, a mean over
dim 0, a loss) gives null and the reason, as does one made from the model's state alone.

Values are keyed by their storage and view (address, offset, shape, strides, dtype), so a
tensor autograd saved for backward is found again when it is unpacked. Not tracked: a write
through one view changes other views of the same storage; those become mixed (never wrong, at
worst null). A failure inside the tracer makes the answer null, never the pass fail.
"""
from __future__ import annotations

from typing import Any

import torch

from nanbisect import devices
from nanbisect.bundle.state import iter_tensors, local
from nanbisect.records import OpSite, RowTrace
from nanbisect.replay.recorder import SKIP, written_tensors
from nanbisect.util import torch_internals as ti
from nanbisect.util.tensors import widened

# a state: None (free), an int g >= 1 (row-aligned, g rows per batch row), or a str (mixed: the
# op that mixed the rows)
State = "int | str | None"
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
              "unbind", "narrow", "index_select", "gather", "flip", "roll", "select", "transpose",
              "squeeze", "native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm",
              "diff", "unsafe_split", "unsafe_chunk", "glu", "slice"}
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


class RowTracer(ti.ObserverMode):
    """Trace the batch's rows to the culprit op at ``site``; set ``.phase`` as the step moves
    on (`nanbisect.locate.catch.catch_inputs` does, with ``rows=``). Hand `start` to the
    replayer's ``batch_edits`` so that the tracer knows the batch; read `result` afterwards.

    >>> site = OpSite("aten.sqrt.default", "forward", 0)
    >>> tracer, x = RowTracer(site, "nan"), torch.ones(4, 3)
    >>> x[2] = -1.0
    >>> w = torch.ones(3, 3)
    >>> batch = tracer.start(x)
    >>> with tracer:
    ...     y = (x @ w).sqrt()
    >>> tracer.result().samples
    [2]
    """

    def __init__(self, site: OpSite | None, kind: str) -> None:
        super().__init__()
        self.site, self.kind = site, kind
        self.phase = "forward"
        self.rows: int | None = None
        self.states: dict[Key, State] = {}
        self.views: dict[tuple, set[Key]] = {}     # storage -> the keys of its views
        self.seen = 0
        self.done = False
        self.samples: list[int] | None = None
        self.why: str | None = "the replay did not reach the culprit op"

    # -- the batch ----------------------------------------------------------------------------
    def start(self, batch: Any) -> Any:
        """Mark ``batch``'s tensors (a `Replayer.batch_edits` entry: returns the batch as is)."""
        self.states.clear()
        self.views.clear()
        self.seen, self.done, self.samples = 0, False, None
        self.why = "the replay did not reach the culprit op"
        leaves = [local(t) for _, t in iter_tensors(batch)]
        sized = [t for t in leaves if t.dim() >= 1]
        self.rows = sized[0].shape[0] if sized else None
        for t in leaves:
            aligned = self.rows is not None and t.dim() >= 1 and t.shape[0] == self.rows
            self._set(t, 1 if aligned else f"the batch tensor of shape {tuple(t.shape)}, whose "
                      f"dim 0 is not the batch's {self.rows} rows")
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

    def _set(self, t: torch.Tensor, state: State, inplace: bool = False) -> None:
        key = self._key(t)
        if key is None:
            return
        views = self.views.setdefault(key[:2], set())
        if inplace:   # a write through this view: the storage's other views are not followed
            for other in views:
                if other != key and self.states.get(other) != state:
                    self.states[other] = f"a write into it through another view ({state})"
        views.add(key)
        if state is None:
            self.states.pop(key, None)
        else:
            self.states[key] = state

    # -- the ops ------------------------------------------------------------------------------
    def wants(self, func) -> bool:
        return func not in SKIP and not self.done and self.rows is not None

    def before(self, call: ti.OpCall) -> bool:
        """At the culprit (the site's occurrence of its op): decide, and follow no more ops."""
        site = self.site
        if site is not None and self.phase == site.phase and call.name == site.op:
            if self.seen == site.occurrence:
                self.done = True
                try:
                    self._decide(call.func, call.args, call.kwargs)
                except Exception as e:  # noqa: BLE001 - the pass it rides on must go on
                    self.samples, self.why = None, f"the row trace failed at {call.func}: {e}"
                return False
            self.seen += 1
        return True

    def after(self, call: ti.OpCall, out: Any) -> None:
        """The states of what the op returned and wrote, from its inputs'."""
        func, args, kwargs = call.func, call.args, call.kwargs
        try:
            returned, mutated = written_tensors(func, out, args, kwargs)
            outs = _tensors(returned + mutated)
            states = self._outputs(func, args, kwargs, outs)
            written = {id(t) for t in _tensors(mutated)}
            for t, s in zip(outs, states):
                self._set(t, s, inplace=id(t) in written)
        except Exception as e:  # noqa: BLE001 - the pass it rides on must go on
            self.done, self.samples = True, None
            self.why = f"the row trace failed at {func}: {type(e).__name__}: {e}"

    def _decide(self, func, args: tuple, kwargs: dict) -> None:
        """At the culprit: run it once more on copies of its inputs (modes off), find the rows of
        its outputs that hold the bad value, map them to batch rows."""
        self.samples, self.why = self._rows_at(func, args, kwargs)

    def trace_at(self, func, args: tuple, kwargs: dict) -> RowTrace:
        """The rows an op's bad value depends on, asked at that op (its inputs as they were
        when it ran), for a tracer made without a site (``site=None``: it follows every op
        and decides nowhere by itself): what `result` would say were that op the culprit."""
        try:
            samples, why = self._rows_at(func, args, kwargs)
        except Exception as e:  # noqa: BLE001 - the pass it rides on must go on
            samples, why = None, f"the row trace failed at {func}: {e}"
        if self.rows is None:
            why = "the batch has no tensor with a row dimension"
        elif self.done:      # a failure inside the tracer before this op
            samples, why = None, self.why
        return RowTrace(samples, self.rows, None if samples is not None else why)

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
                w = widened(o)
                bad = w.isnan() if self.kind == "nan" else ~w.isfinite()
                if not bool(bad.any()):
                    continue
                if s is None:
                    return None, ("the first bad value depends on no batch row: it is made "
                                  "from the model's state alone")
                if isinstance(s, str):
                    return None, f"the first bad value mixes the batch's rows ({s})"
                rows = bad.reshape(o.shape[0], -1).any(1).nonzero().flatten().tolist()
                found |= {r // s for r in rows}
        return (sorted(found), None) if found else (
            None, "no output of the culprit op held the bad value again")

    def _outputs(self, func, args: tuple, kwargs: dict, outs: list[torch.Tensor]
                 ) -> list[State]:
        """The states of an op's outputs (returned and written) from its inputs' states."""
        name = _name(func)
        if name in SHAPE_ONLY:     # the first argument gives a shape; a value it reads is not
            read = [self._get(t) for t in _tensors((list(args[1:]), kwargs))]
            return [f"{func} filled it with a batch-dependent value" if any(
                s is not None for s in read) else None] * len(outs)
        read = args[1:] if name == "copy_" else args
        ins = [(t, self._get(t)) for t in _tensors((list(read), kwargs))]
        deps = [(t, s) for t, s in ins if s is not None]
        if not deps:
            return [None] * len(outs)
        mixed = next((s for _, s in deps if isinstance(s, str)), None)
        if mixed is not None:
            return [mixed] * len(outs)
        per_row = {t.shape[0] // s for t, s in deps}
        if len(per_row) != 1 or per_row != {self.rows}:
            return [f"{func} combined values of different row layouts"] * len(outs)
        n = {t.shape[0] for t, _ in deps}
        why = f"{func} mixed them"
        if len(n) != 1:
            return [why] * len(outs)
        (N,), g = n, deps[0][1]
        reshaped = self._reshaped(func, name, args, kwargs, outs, deps[0][0], g, why)
        if reshaped is not None:
            return reshaped
        if name in ("mm", "addmm", "mv", "addmv"):
            right = args[2] if name in ("addmm", "addmv") else args[1]
            lhs = args[1] if name in ("addmm", "addmv") else args[0]
            if self._get(local(right)) is not None or self._get(local(lhs)) is None:
                return [why] * len(outs)
        elif name == "embedding":
            if self._get(local(args[0])) is not None:
                return [why] * len(outs)
            return [g if o.dim() >= 1 and o.shape[0] == N else why for o in outs]
        elif name in ALONG_DIMS:
            if self._touches_rows(func, name, args, kwargs, deps[0][0]):
                return [why] * len(outs)
        elif name in BATCHED or name in SAME_SHAPE or torch.Tag.pointwise in func.tags \
                or name == "copy_":
            if name not in BATCHED and outs and any(t.dim() != outs[0].dim() for t, _ in deps):
                return [why] * len(outs)     # broadcast: dim 0 lands elsewhere
        elif name == "native_layer_norm_backward":
            ns = _arg(func, args, kwargs, "normalized_shape") or []
            if len(ns) >= deps[0][0].dim():
                return [why] * len(outs)
            return [g] + [why] * (len(outs) - 1)
        else:
            return [why] * len(outs)
        return [g if o.dim() >= 1 and o.shape[0] == N else why for o in outs]

    def _reshaped(self, func, name: str, args: tuple, kwargs: dict, outs: list[torch.Tensor],
                  first: torch.Tensor, g: int, why: str) -> list[State] | None:
        """The states of a view, expand, permute, transpose or unsqueeze's outputs (``first``:
        its first batch-dependent input, of ``g`` rows per batch row); None for another op."""
        if name in VIEWS or name == "expand":
            o = outs[0] if outs else None
            if o is None or o.dim() == 0 or o.shape[0] % self.rows or (
                    name == "expand" and (o.dim() != first.dim() or
                                          o.shape[0] != first.shape[0])):
                return [why] * len(outs)
            return [o.shape[0] // self.rows] * len(outs)
        if name in ("permute",):
            dims = list(_arg(func, args, kwargs, "dims") or [])
            return [g if dims and dims[0] % first.dim() == 0 else why] * len(outs)
        if name == "t":
            return [g if first.dim() < 2 else why] * len(outs)
        if name == "unsqueeze":
            d = _arg(func, args, kwargs, "dim", 0)
            return [why if d % (first.dim() + 1) == 0 else g] * len(outs)
        return None

    @staticmethod
    def _touches_rows(func, name: str, args: tuple, kwargs: dict, t: torch.Tensor) -> bool:
        """Does the op work along dim 0 (a reduction over the batch, a cat along it, ...)?"""
        nd = max(t.dim(), 1)
        if name in ("native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm"):
            ns = _arg(func, args, kwargs, "normalized_shape") or []
            return len(ns) >= t.dim()
        if name == "slice":     # along dim 0 only the whole of it keeps the rows
            d, end = _arg(func, args, kwargs, "dim", 0), _arg(func, args, kwargs, "end")
            whole = (_arg(func, args, kwargs, "start") in (None, 0)
                     and (end is None or end >= t.shape[0])
                     and _arg(func, args, kwargs, "step", 1) == 1)
            return d % nd == 0 and not whole
        if name == "squeeze":
            dims = _arg(func, args, kwargs, "dim", None)
            if dims is None:
                dims = _arg(func, args, kwargs, "dims", None)
            if dims is None:        # squeeze(): every size-1 dim
                return t.shape[0] == 1
        dims: list[int] = []
        found = False
        for arg in ("dim", "dims", "dim0", "dim1"):
            present = any(a.name == arg for a in ti.schema_arguments(func))
            if not present:
                continue
            found = True
            v = _arg(func, args, kwargs, arg, None)
            if v is None or (isinstance(v, (list, tuple)) and len(v) == 0
                             and name not in ("flip", "roll")):
                return True         # every dim: the batch's too
            dims += list(v) if isinstance(v, (list, tuple)) else [v]
        if not found:
            return True
        stack_like = name == "stack"
        return any(d % (nd + 1 if stack_like else nd) == 0 for d in dims)

    def result(self) -> RowTrace:
        return RowTrace(self.samples, self.rows,
                        None if self.samples is not None else
                        ("the batch has no tensor with a row dimension" if self.rows is None
                         else self.why))
