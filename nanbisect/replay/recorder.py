"""Op recorder: every aten op of the recorded phases, with dataflow and NaN/inf flags on device.

`OpRecorder` is a dispatch mode (an `nanbisect.util.torch_internals.ObserverMode`), so it sees
ops below autograd, including the bodies of custom `autograd.Function.backward`, backward
formulas, optimizer kernels (for-loop, foreach, fused) and opaque `torch.library` custom ops.
For each op it records its inputs and outputs as *values*: a value is a storage at a write
count kept by the recorder (NB: not torch's version counter, which foreach ops do not bump and
which ADInplaceOrView bumps only after the mode returns), so a view is the same value as its
base, and an in-place op (``masked_fill_``) makes a new value whose inputs include the old one.
Each floating or complex value gets one ``aminmax`` on the device (NaN propagates into both,
+inf into the max, -inf into the min; a complex value's over its real and imaginary parts); all
of them are read back once, by `OpRecorder.read`. Ops are counted over the whole step
(``op_index``) but recorded only in ``phases``. Not recorded: Python-side values that never pass
through an aten op.

Collectives (``c10d::*``, ``_c10d_functional::*``: the all-reduce inside a tensor-parallel layer,
FSDP's all-gather and reduce-scatter) write their tensors in place without saying so in their
schema and may finish after they return. The recorder waits for each one before reading its
flags (so the recording pass is synchronous: a bug that reads a collective's output before
waiting for it shows in the first pass, not in this one) and treats what it writes as a new
value produced by the collective; its output buffers are not inputs. Values of ops that return
uninitialised memory (``empty``) are clean by definition, and ``copy_``/``fill_``/``zero_`` do
not read their destination.

Autograd nodes: every backward op records the node it runs in (``OpRecord.node``, the node's
sequence number, and ``formula``: a built-in backward formula rather than a custom
``autograd.Function``'s or a custom op's backward). With ``nodes=True`` a forward op records the
node it created (read from its outputs' ``grad_fn`` when the next op starts, so nothing is held),
which links a backward formula to the forward op it differentiates.
"""
from __future__ import annotations

import math
import weakref
from contextlib import nullcontext
from typing import Any, Callable

import torch

from nanbisect import devices
from nanbisect.bundle.state import local
from nanbisect.replay.table import (CLEAN, Flags, InputRef, OpRecord,  # noqa: F401 - re-exported
                                    OpTable, OutputRef)
from nanbisect.records import CallId
from nanbisect.replay.p2p import StandIns, is_p2p, is_receive, rank_timeout
from nanbisect.replay.tracker import ModuleTracker
from nanbisect.step import op_phase, pipelined_running
from nanbisect.util import torch_internals as ti
from nanbisect.util.tensors import finite_absmax, floating, parts

aten = torch.ops.aten
# Pure metadata ops: counting them would make op_index depend on Python-side shape queries.
SKIP = ti.METADATA_OPS

Sid = tuple[str, int, int]            # (device, storage address, generation at that address)
Key = tuple[str, int, int, int]       # a Sid + the writes the recorder saw to that storage

# Ops whose output is uninitialised memory: its bits (NaN or not) mean nothing until written.
UNINITIALISED = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                 aten.new_empty.default, aten.new_empty_strided.default}
# In-place ops that overwrite their first argument without reading it.
OVERWRITE = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
# c10d arguments a collective writes into (their schemas carry no alias annotation); of these,
# only "tensors" (in-place collectives: all-reduce, broadcast) is also read, except by a receive
_C10D_WRITES = ("tensors", "output_tensors", "output_tensor", "output", "outputs",
                "output_lists")
_C10D_WRITE_ONLY = ("output_tensors", "output_tensor", "output", "outputs", "output_lists")
_C10D_RECEIVES = ("c10d::recv_", "c10d::recv_any_source_")    # "tensors": written, not read


def is_collective(op: str) -> bool:
    """``op`` is ``str()`` of an overload, e.g. "c10d.allreduce_.default"."""
    return op.split(".", 1)[0] in COLLECTIVE_NAMESPACES


def collective_writes(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a ``c10d`` collective writes into (nested lists flattened)."""
    if func.namespace != "c10d" or ti.schema_name(func).endswith("::send"):
        return []
    vals = [v for a, v in zip(ti.schema_arguments(func), args) if a.name in _C10D_WRITES]
    vals += [kwargs[n] for n in _C10D_WRITES if n in kwargs]
    return [local(t) for t in ti.tree_leaves(vals) if isinstance(t, torch.Tensor)]


def _stats(t: torch.Tensor) -> torch.Tensor | None:
    """A value's row of flags (min, max, largest finite magnitude), as `OpRecorder._row`
    computes it; None for a value that has none (not floating, empty)."""
    if not floating(t) or t.numel() == 0:
        return None
    t = parts(t.detach())
    lo, hi = torch.aminmax(t)
    return torch.stack([lo.float(), hi.float(), finite_absmax(t).float().to(lo.device)])


def _clone(x: Any) -> Any:
    return local(x).detach().clone() if isinstance(x, torch.Tensor) else x


def written_tensors(func, out: Any, args: tuple, kwargs: dict) -> tuple[list, list]:
    """(returned values, arguments the op writes to), from the op's schema."""
    returned = list(out) if isinstance(out, tuple) else [out]
    schema = ti.schema_arguments(func)
    mutated = [v for a, v in zip(schema, args)
               if a.alias_info is not None and a.alias_info.is_write]
    mutated += [kwargs[a.name] for a in schema[len(args):]
                if a.alias_info is not None and a.alias_info.is_write and a.name in kwargs]
    return returned, mutated


def _wait(out: Any) -> None:
    """Wait for the Work objects a c10d op returned: until then its output is not written (gloo
    even finishes some collectives with a copy at wait time)."""
    for x in ti.tree_leaves(out):
        if isinstance(x, torch.ScriptObject) and hasattr(x, "wait"):
            x.wait()


def _whole(t: torch.Tensor) -> bool:
    """Does ``t`` cover all of its storage, contiguously?"""
    return t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()


def _storage_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s whole storage as a flat tensor of ``t``'s dtype (``t`` itself when it is that)."""
    if _whole(t):
        return t
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)


def read_args(func, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments whose values an op reads: all but a collective's output buffers and the
    destination of an op that overwrites all of it (``copy_``, ``fill_``, ``zero_`` into a whole
    storage; into a slice, the rest of the storage still carries what it held)."""
    if func in OVERWRITE and isinstance(args[0], torch.Tensor) and _whole(local(args[0])):
        return [*args[1:], *kwargs.values()]
    if func.namespace == "c10d":
        names = [a.name for a in ti.schema_arguments(func)]
        skip = _C10D_WRITE_ONLY + (("tensors",) if ti.schema_name(func) in _C10D_RECEIVES
                                   else ())
        return [v for n, v in zip(names, args) if n not in skip] + [
            v for n, v in kwargs.items() if n not in skip]
    return [*args, *kwargs.values()]


def tensor_args(values: list[Any]):
    """Yield ``(tensor, list position)`` for top-level op arguments or results.

    A tensor inside a list argument gets its position, which pairs the lists of foreach ops;
    anything else gets None.
    """
    for v in values:
        if isinstance(v, torch.Tensor):
            yield local(v), None
        elif isinstance(v, (list, tuple)):
            for i, t in enumerate(v):
                if isinstance(t, torch.Tensor):
                    yield local(t), i


def made_node(refs: list) -> Any:
    """The autograd node an op made, from weak references to its outputs (autograd sets their
    ``grad_fn`` after the op returns: read when the next op starts): the first output's that
    has one; None when none has (no grad, or the outputs are gone)."""
    for ref in refs:
        t = ref()
        fn = t.grad_fn if t is not None else None
        if fn is not None:
            return fn
    return None


class OpRecorder(ti.ObserverMode):
    """Record ops of ``phases``; set ``.phase`` as the step moves on.

    >>> model = torch.nn.Linear(2, 1)
    >>> tracker = ModuleTracker(model)
    >>> rec = OpRecorder(tracker, phases={"forward"})
    >>> with tracker, rec:
    ...     loss = (model(torch.ones(3, 2)) - 1e3).sqrt().sum()
    >>> table, _ = rec.read()
    >>> [(op.op, op.outputs[0].flags.nan) for op in table.ops if op.op == "aten.sqrt.default"]
    [('aten.sqrt.default', True)]
    """

    def __init__(self, tracker: ModuleTracker | None, phases: set[str],
                 keep: Callable[[], bool] | None = None,
                 scope: Callable[[], bool] | None = None, nodes: bool = False,
                 born: Callable[..., None] | None = None, kind: str = "nan") -> None:
        super().__init__()
        # called as born(index, func, args, kwargs) right after a recorded op on the CPU turned
        # inputs free of ``kind`` into an output that holds it (a root candidate: the
        # root provenance finds later is one of them), when the op wrote none of its arguments,
        # drew no random numbers and took no list of tensors: its arguments are still what it
        # read (`nanbisect.locate.catch.AheadCatch` clones them then, instead of a replay)
        self.born, self.kind = born, kind
        self._host: dict[int, tuple[bool, bool, bool]] = {}  # row -> (nan, +inf, -inf), CPU
        self.tracker = tracker
        self.keep = keep
        self.scope = scope      # when given, only ops for which scope() is true are recorded
        self.nodes = nodes      # forward ops: remember the autograd node each one created
        self._pending: list[tuple[int, list]] = []   # (op, weak refs to its outputs)
        self._occ: dict[tuple[str, str], int] = {}
        # pos -> (args, kwargs, written tensors) cloned, for ops where ``keep()`` was true
        self.kept: dict[int, tuple[list, dict, list[torch.Tensor]]] = {}
        self.phases = phases
        self.phase = "forward"
        self.micro = -1                  # becomes 0 when the first forward starts
        self.count = 0
        self._ops: list[dict] = []
        self._producer: dict[Key, tuple[int, int]] = {}
        self._ext: dict[Key, int] = {}
        self._rows: list[torch.Tensor] = []
        self._marks: dict[str, tuple[int, int] | int] = {}
        self._writes: dict[Sid, int] = {}
        self._gen: dict[tuple[str, int], int] = {}
        self._alive: dict[tuple[str, int], Any] = {}     # address -> weak ref to its storage
        self._stand_ins: StandIns | None = None            # receives' works (`run`)
        self._arrivals: list[tuple[int, list, int]] = []   # (row, its receive's flags, which)

    def _sid(self, t: torch.Tensor) -> Sid:
        """(device, address, generation): the generation moves on when the storage at that
        address is not the one last seen there, so memory that C++ code (a collective, a
        kernel's scratch) allocated unseen at an old value's address is never taken for that
        value. Not only when that storage died: FSDP2 frees an unsharded parameter's memory with
        ``untyped_storage().resize_(0)``, and the storage lives on while its address is reused.
        (The weak reference pins the storage object, so its ``cdata`` names no other storage.)"""
        t = local(t)
        st = t.untyped_storage()
        addr = (str(t.device), st.data_ptr())
        ref = self._alive.get(addr)
        if ref is None or ref.expired() or not ti.same_storage(ref, st):
            if ref is not None:
                self._gen[addr] = self._gen.get(addr, 0) + 1
            self._alive[addr] = ti.storage_ref(st)
        return addr + (self._gen.get(addr, 0),)

    def value_key(self, t: torch.Tensor, sid: Sid | None = None) -> Key:
        sid = sid or self._sid(t)
        return sid + (self._writes.get(sid, 0),)

    # -- recording ------------------------------------------------------------------------
    def _row(self, t: torch.Tensor) -> int | None:
        """One row of flags for a value: (min, max, largest finite magnitude or NaN when that
        is max(|min|, |max|)). On the CPU, reading min and max costs no device synchronisation,
        so the finite magnitude is computed only for values that hold inf or NaN (a masked
        attention score); on accelerators it is always computed, on the device. A complex value
        is flagged through its parts (`nanbisect.util.tensors.parts`): NaN when a real or
        imaginary part is NaN, +inf/-inf when a part is and none is NaN; its magnitude is the
        largest finite part, not the modulus."""
        if not floating(t) or t.numel() == 0:
            return None
        t = parts(t.detach())
        lo, hi = torch.aminmax(t)
        host = None
        if devices.on_host(t.device):
            lv, hv = lo.item(), hi.item()
            nan = math.isnan(lv) or math.isnan(hv)
            host = (nan, not nan and hv == math.inf, not nan and lv == -math.inf)
        if host is not None and not any(host):
            fin = torch.full((), math.nan)
        else:
            fin = finite_absmax(t)
        self._rows.append(torch.stack([lo.float(), hi.float(), fin.float().to(lo.device)]))
        if host is not None:
            self._host[len(self._rows) - 1] = host
        return len(self._rows) - 1

    def _bad_on_host(self, row: int | None) -> bool | None:
        """Does a CPU value hold ``self.kind``? None: not known on the host (another device)."""
        if row is None:
            return False
        h = self._host.get(row)
        if h is None:
            return None
        return h[0] if self.kind == "nan" else any(h)

    def _is_born(self, func, ins: list, outs: list, mutated: set) -> bool:
        """Did this op make ``kind`` from inputs free of it (see ``born``)?"""
        if mutated or func.namespace in COLLECTIVE_NAMESPACES or \
                torch.Tag.nondeterministic_seeded in func.tags:
            return False
        for src, elem, _ in ins:
            if elem is not None:
                return False
            row = self._ops[src[1]]["outs"][src[2]][0] if src[0] == "op" else src[1]
            if self._bad_on_host(row) is not False:
                return False
        return any(self._bad_on_host(r) for r, _ in outs)

    def _where(self, node, phase: str) -> tuple[str | None, int | None]:
        """The module call of the running op (``node``: the autograd node running, backward)."""
        if self.tracker is None:
            return None, None
        if phase == "backward":
            call = self.tracker.node_call(node)
        elif phase == "forward":
            call = self.tracker.current()
            if call is None:
                return "", None
        else:
            return None, None
        return call if call is not None else (None, None)

    def _resolve(self) -> None:
        """The nodes the last recorded forward op created: autograd sets its outputs'
        ``grad_fn`` after the op returns, so they are read when the next op starts."""
        for pos, refs in self._pending:
            fn = made_node(refs)
            if fn is not None:
                self._ops[pos]["node"] = ti.node_sequence_nr(fn)
        self._pending.clear()

    # -- the hooks of the observer mode ------------------------------------------------------
    def wants(self, func) -> bool:
        if self._pending:
            self._resolve()
        return func not in SKIP

    def before(self, call: ti.OpCall) -> bool:
        """Count the op; for a recorded one, note (on ``call``) its index, occurrence, the
        clones ``keep()`` asks for and the values it reads (flagged before it runs)."""
        call.index = self.count
        self.count += 1
        call.phase = self.phase
        if pipelined_running():      # (what the rule reads, only where it applies: every op)
            call.phase = op_phase(self.phase, collective=(
                is_collective(call.name) and not is_p2p(call.func)), in_module=(
                self.tracker is None or self.tracker.current() is not None))
        if call.phase not in self.phases:
            return False
        occ_key = (call.phase, call.name)
        call.occurrence = self._occ.get(occ_key, 0)
        self._occ[occ_key] = call.occurrence + 1
        if self.scope is not None and not self.scope():
            return False
        call.kept = None
        if self.keep is not None and self.keep():
            call.kept = (ti.tree_map(_clone, list(call.args)),
                         ti.tree_map(_clone, dict(call.kwargs)))
        call.ins, call.in_keys = self._inputs(call)
        return True

    def _inputs(self, call: ti.OpCall) -> tuple[list, set]:
        """(inputs as (source, list position, tensor), their value keys); a value made outside
        the recorded ops is flagged here, all of its storage."""
        ins, in_keys = [], set()
        for t, elem in tensor_args(read_args(call.func, call.args, call.kwargs)):
            key = self.value_key(t)
            in_keys.add(key)
            if key in self._producer:
                ins.append((("op",) + self._producer[key], elem, t))
            else:
                if key not in self._ext:
                    self._ext[key] = self._row(_storage_view(t))   # the value: all of it
                ins.append((("ext", self._ext[key]), elem, t))
        return ins, in_keys

    def run(self, call: ti.OpCall) -> Any:
        """A receive runs with its work handed back as a stand-in (`StandIns`) that completes
        once what arrived is flagged; never waited here (a schedule waits later, and gloo's
        works never return from a second wait)."""
        out = call.func(*call.args, **call.kwargs)
        if not is_receive(call.func):
            return out
        if self._stand_ins is None:
            self._stand_ins = StandIns(rank_timeout())
        arrived = call.arrived = []
        got = [t for t, _ in tensor_args(collective_writes(call.func, call.args, call.kwargs))]

        def flag() -> None:
            arrived.extend(_stats(t) for t in got)

        return self._stand_ins.hand_back(out, f"{call.func} (a replay's op recording)", flag)

    def _written(self, func, args: tuple, kwargs: dict, out: Any) -> tuple[list, list]:
        """(returned values, written arguments), once the op's output is written: a
        collective is waited for (a send or receive is not: `run`), and what a ``c10d`` one
        writes counts as written."""
        returned, mutated_args = written_tensors(func, out, args, kwargs)
        if func.namespace == "c10d" and is_p2p(func):
            mutated_args = mutated_args + [collective_writes(func, args, kwargs)]
        elif func.namespace == "c10d":
            _wait(out)
            mutated_args = mutated_args + [collective_writes(func, args, kwargs)]
        elif func.namespace in COLLECTIVE_NAMESPACES and \
                ti.schema_name(func).split("::")[-1] != "wait_tensor":
            for t, _ in tensor_args(returned):
                ti.wait_tensor(t)
        return returned, mutated_args

    def _outputs(self, func, written: list, mutated: set, in_keys: set, pos: int,
                 arrived: list | None = None) -> list:
        """The op's new values (a view of an input is that input's value), flagged; each
        becomes a value this op (at ``pos``) produced. A receive's (``arrived``) are flagged
        when they arrive: their rows are filled by `read`."""
        in_storages = {k[:3] for k in in_keys}
        outs, seen = [], set()
        if arrived is not None:
            for j, (t, elem) in enumerate(tensor_args(written)):
                key = self.value_key(t)
                self._producer[key] = (pos, len(outs))
                self._rows.append(None)
                self._arrivals.append((len(self._rows) - 1, arrived, j))
                outs.append((len(self._rows) - 1, elem))
            return outs
        for t, elem in tensor_args(written):
            sid = self._sid(t)
            if sid not in mutated and sid not in in_storages:
                self._writes[sid] = 0  # fresh memory, perhaps at the address of a dead value
            key = self.value_key(t, sid)
            if key in in_keys or key in seen:  # a view of an input: the same value
                continue
            seen.add(key)
            self._producer[key] = (pos, len(outs))
            # a write through a view makes a new value of the whole storage: flag all of it
            outs.append((None if func in UNINITIALISED else
                         self._row(_storage_view(t) if sid in mutated else t), elem))
        return outs

    def after(self, call: ti.OpCall, out: Any) -> None:
        func, args, kwargs = call.func, call.args, call.kwargs
        returned, mutated_args = self._written(func, args, kwargs, out)
        written = returned + mutated_args
        mutated = {self._sid(t) for t, _ in tensor_args(mutated_args)}
        for sid in mutated:
            self._writes[sid] = self._writes.get(sid, 0) + 1
        pos = len(self._ops)
        outs = self._outputs(func, written, mutated, call.in_keys, pos,
                             getattr(call, "arrived", None))
        if call.kept is not None:
            self.kept[pos] = (*call.kept, [t.detach().clone() for t, _ in tensor_args(written)])
        if pipelined_running() and is_p2p(func) and not is_receive(func):
            # a pipeline stage's failure may leave it only through a send: what each send
            # carried is a value the trace starts from, as the loss is
            for t, _ in tensor_args(read_args(func, args, kwargs)):
                self._marks[f"sent {len(self._marks)}"] = self._producer.get(
                    self.value_key(t), -1)
        if self.born is not None and self._is_born(func, call.ins, outs, mutated):
            self.born(call.index, func, args, kwargs)
        self._ops.append(self._entry(call, returned, outs, pos))

    def _entry(self, call: ti.OpCall, returned: list, outs: list, pos: int) -> dict:
        """The op's row of the table, with its module call and autograd node."""
        node, formula, node_name = None, False, None
        phase = call.phase
        if phase == "backward":
            fn = ti.current_autograd_node()
            if fn is not None:
                node, formula = ti.node_sequence_nr(fn), not ti.is_custom_function_node(fn)
                node_name = fn.name()
            module, mcall = self._where(fn, phase)
        else:
            module, mcall = self._where(None, phase)
            if self.nodes and phase == "forward":
                self._pending.append((pos, [weakref.ref(t) for t, _ in tensor_args(returned)]))
        micro = max(self.micro, 0)
        if pipelined_running() and self.tracker is not None and mcall is not None:
            # a pipeline stage: its micro-batches are the calls of its model
            micro = self.tracker.micro(CallId(module, mcall))
        return {"index": call.index, "op": call.name, "phase": phase, "module": module,
                "occurrence": call.occurrence, "micro": micro,
                "call": mcall, "ins": [(src, elem, str(t.dtype).removeprefix("torch."),
                                        tuple(t.shape)) for src, elem, t in call.ins],
                "outs": outs, "node": node, "formula": formula, "node_name": node_name}

    def follow(self, phase: str) -> nullcontext:
        """For `Replayer.run`'s ``phase``: label the ops that follow with ``phase`` (each
        forward starts the next micro-batch)."""
        if self._pending:
            self._resolve()
        self.phase = phase
        if phase == "forward":
            self.micro += 1
        return nullcontext()

    def mark(self, name: str, t: torch.Tensor) -> None:
        """Remember which recorded value ``t`` is now (the loss, a gradient, a parameter)."""
        key = self.value_key(t)
        self._marks[name] = self._producer.get(key, -1)

    # -- reading ---------------------------------------------------------------------------
    def read(self) -> tuple[OpTable, dict[str, tuple[int, int] | None]]:
        """One transfer of all flags; returns the table and the marked values' producers."""
        if self._pending:
            self._resolve()
        if self._stand_ins is not None:
            self._stand_ins.finish()          # every receive arrived (or its deadline passed)
        for row, arrived, j in self._arrivals:
            got = arrived[j] if j < len(arrived) else None
            # nothing to flag (not floating), or it never arrived (the step failed there)
            self._rows[row] = got if got is not None else torch.tensor([0.0, 0.0, math.nan])
        self._arrivals.clear()
        raw = torch.stack([r.to(devices.HOST) for r in self._rows]).tolist() if self._rows else []

        def flags(row: int | None) -> Flags:
            if row is None:
                return CLEAN
            lo, hi, fin = raw[row]
            nan = math.isnan(lo) or math.isnan(hi)
            big = max(abs(lo), abs(hi)) if math.isnan(fin) and not nan else \
                (0.0 if math.isnan(fin) else fin)
            return Flags(nan, (not nan) and hi == math.inf, (not nan) and lo == -math.inf, big)

        ops = []
        for pos, o in enumerate(self._ops):
            ins = []
            for src, elem, dtype, shape in o["ins"]:
                if src[0] == "op":
                    p, j = src[1], src[2]
                    ins.append(InputRef(p, j, flags(self._ops[p]["outs"][j][0]), elem, dtype,
                                        shape))
                else:
                    ins.append(InputRef(None, 0, flags(src[1]), elem, dtype, shape))
            outs = tuple(OutputRef(flags(r), elem) for r, elem in o["outs"])
            ops.append(OpRecord(pos, o["index"], o["op"], o["phase"], o["module"], o["call"],
                                tuple(ins), outs, o["occurrence"], o["micro"], o["node"],
                                o["formula"], o["node_name"]))
        marks = {k: (v if isinstance(v, tuple) else None) for k, v in self._marks.items()}
        return OpTable(ops, self.count), marks
