"""A model under ``torch.compile``: what it was compiled with, and compiling it again.

`compile_args` reads ``{backend, mode, options}`` from a ``torch._dynamo`` ``OptimizedModule``
(what ``torch.compile(model, ...)`` returns): torch keeps the backend object, and for inductor the
mode and options merged into one dict (``mode`` is given back when the merged dict is exactly one
mode's options). `compile_model` compiles an eager module with such a record. Every name
nanbisect shows is the eager module's (``model._orig_mod``), never ``_orig_mod.``-prefixed.

A bundle keeps and a replay applies only the inductor options of `REPLAYED`: those that change
numerics or the code generated (what can make a compiled-only NaN appear or vanish), each with
the values it may take. The others (debug traces, caches, remote services, test-only settings,
anything naming a program or a path) are dropped at capture and named in the manifest
(``task.compiled_dropped``); a manifest whose options hold one is refused (`option_problem`).
`debug_output` keeps torch's compile debug output of a replay out of the working directory.

Not covered: a model compiled in place (``model.compile()``) or a ``loss_fn`` compiled by the user;
the Task declares those (``Task(compiled={...})``, docs/guide/compiled.md).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from nanbisect.util import torch_internals as ti

_MODES = ("reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# inductor options a bundle records and a replay applies: name -> the values it may take (bool:
# true or false; a range or tuple: those integers, None where listed). Each exists in torch 2.13's
# torch/_inductor/config.py with that type (tests/compiler/test_compiled_options.py checks it).
REPLAYED: dict[str, Any] = {
    **dict.fromkeys((
        "emulate_precision_casts", "fallback_random", "max_autotune", "max_autotune_gemm",
        "max_autotune_pointwise", "coordinate_descent_tuning", "epilogue_fusion",
        "aggressive_fusion", "permute_fusion", "loop_ordering_after_fusion", "freezing",
        "shape_padding", "comprehensive_padding", "split_reductions",
        "force_fuse_int_mm_with_mul", "use_mixed_mm", "size_asserts", "layout_optimization",
        "keep_output_stride", "cpp_wrapper", "pattern_matcher", "online_softmax",
        "use_fast_math", "conv_1x1_as_mm", "reorder_for_locality", "triton.cudagraphs",
        "triton.persistent_reductions", "triton.codegen_upcast_to_fp32",
        "cpp.enable_unsafe_math_opt_flag", "cpp.use_decompose_tanh", "cpp.dynamic_threads",
        "cpp.fallback_scatter_reduce_sum"), bool),
    "cpp.simdlen": (None, 0, 1, 128, 256, 512),     # vector width in bits; 0, 1: none
    "cpp.threads": range(-1, 1025),                  # < 1: torch.get_num_threads()
    "cpp.min_chunk_size": range(1, (1 << 20) + 1),
    "unroll_reductions_threshold": range(1, 1025),
    "max_fusion_size": range(1, 1025),
    "triton.multi_kernel": range(0, 4),
    "triton.max_tiles": (None, 1, 2, 3),
}
MAX_DROPPED = 64      # option names a bundle lists as dropped
MAX_NAME = 128        # characters of one


def allowed(name: str) -> str:
    """What option ``name`` (one of `REPLAYED`) may be, in words.

    >>> allowed("fallback_random"), allowed("cpp.threads"), allowed("triton.max_tiles")
    ('true or false', 'an integer from -1 to 1024', 'null or one of 1, 2, 3')
    """
    want = REPLAYED[name]
    if want is bool:
        return "true or false"
    if isinstance(want, range):
        return f"an integer from {want.start} to {want.stop - 1}"
    ints = ", ".join(str(v) for v in want if v is not None)
    return f"null or one of {ints}" if None in want else f"one of {ints}"


def option_problem(name: Any, value: Any) -> str | None:
    """Why ``name: value`` is not an inductor option a replay applies, in words (None: it is).

    >>> option_problem("emulate_precision_casts", True) is None
    True
    >>> option_problem("trace.enabled", True)
    'is not an option nanbisect replays'
    >>> option_problem("cpp.simdlen", 3)
    'is 3, not null or one of 0, 1, 128, 256, 512'
    """
    want = REPLAYED.get(name) if isinstance(name, str) else None
    if want is None:
        return "is not an option nanbisect replays"
    if want is bool:
        ok = type(value) is bool
    else:       # NB: True is not an integer here, nor 128.0
        ok = (value is None or type(value) is int) and value in want
    if ok:
        return None
    from nanbisect.util.text import show

    return f"is {show(value, 40)}, not {allowed(name)}"


def replayable(options: dict | None) -> tuple[dict | None, list[str]]:
    """``options`` split: (those a replay applies, or None when none; the names of the others,
    at most `MAX_DROPPED`, each cut to `MAX_NAME` characters). torch's ``-`` spelling of a name
    is read as its ``_`` one, as torch.compile does.

    >>> replayable({"emulate-precision-casts": True, "trace.enabled": True, "cpp.cxx": "g++"})
    ({'emulate_precision_casts': True}, ['trace.enabled', 'cpp.cxx'])
    """
    kept, dropped = {}, []
    for k, v in (options or {}).items():
        name = str(k).replace("-", "_")
        if option_problem(name, v) is None:
            kept[name] = v
        elif len(dropped) < MAX_DROPPED:
            dropped.append(name[:MAX_NAME])
    return kept or None, dropped


def point_debug_output(root: str) -> Callable[[], None]:
    """Make torch's compile debug output go under ``root`` (a ``torch_compile_debug`` directory:
    ``torch._dynamo.config.debug_dir_root``, and the structured trace that
    ``TORCH_COMPILE_DEBUG=1`` turns on, whose directory torch fixed at import); a function that
    points it back. The trace is left where ``TORCH_TRACE`` named it."""
    before = ti.dynamo_debug_dir(root)
    handler = None
    try:
        handler = ti.trace_log_handler()
        if os.environ.get("TORCH_TRACE") or getattr(handler, "root_dir", None) != \
                os.path.join(before, "tlparse") or getattr(handler, "stream", None) is not None:
            handler = None      # named by the user, off, or already writing: left as it is
        else:
            handler.root_dir = os.path.join(root, "tlparse")
    except Exception:  # noqa: BLE001 - a torch whose logging internals moved
        handler = None

    def restore() -> None:
        ti.dynamo_debug_dir(before)
        if handler is not None:
            handler.acquire()
            try:
                if handler.stream is not None:      # a file under ``root``, about to go
                    handler.stream.close()
                    handler.stream = None
                handler.root_dir = os.path.join(before, "tlparse")
            except Exception:  # noqa: BLE001 - as above
                pass
            finally:
                handler.release()

    return restore


@contextmanager
def debug_output() -> Iterator[None]:
    """torch's compile debug output (``torch_compile_debug/``: inductor traces, the minifier,
    dynamo's logs, ``TORCH_COMPILE_DEBUG=1``'s structured trace), which torch puts in the
    working directory it was imported in, goes to a private temporary directory, removed on
    exit; unless the user named a place for it (``TORCH_COMPILE_DEBUG_DIR``). Torch's kernel
    cache (``TORCHINDUCTOR_CACHE_DIR``) is left where it is."""
    if os.environ.get("TORCH_COMPILE_DEBUG_DIR"):
        yield
        return
    scratch = tempfile.mkdtemp(prefix="nanbisect-inductor-")
    restore = point_debug_output(os.path.join(scratch, "torch_compile_debug"))
    try:
        yield
    finally:
        restore()
        shutil.rmtree(scratch, ignore_errors=True)


def is_compiled(model: Any) -> bool:
    """Is ``model`` what ``torch.compile(module)`` returned?

    >>> is_compiled(torch.nn.Linear(1, 1))
    False
    """
    return ti.compiled_original(model) is not None


def captured_args(model: torch.nn.Module) -> dict:
    """``{backend, mode, options}`` of an ``OptimizedModule``: all the options it was compiled
    with (see `compile_args` for those a bundle records)."""
    try:
        backend = ti.compiled_backend(model)
    except Exception:  # noqa: BLE001 - a torch whose internals moved: the default backend
        backend = None
    name = (getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
            or "inductor")
    config = dict(getattr(backend, "config", None) or {})
    mode = None
    if name == "inductor" and config:
        mode = next((m for m in _MODES if ti.inductor_mode_options(m) == config), None)
    return {"backend": str(name), "mode": mode, "options": None if mode else (config or None)}


def recorded(spec: dict) -> tuple[dict, list[str]]:
    """``spec`` ({backend, mode, options}) as a bundle records it, its options those a replay
    applies (`replayable`); and the names of those left out."""
    options, dropped = replayable(spec.get("options"))
    return {**spec, "options": options}, dropped


def compile_args(model: torch.nn.Module) -> dict:
    """``{backend, mode, options}`` of an ``OptimizedModule`` as a bundle records it: options not
    in `REPLAYED` (debug traces, caches, custom pass callables, paths) are left out."""
    return recorded(captured_args(model))[0]


def compile_model(model: torch.nn.Module, spec: dict, backend: str | None = None
                  ) -> torch.nn.Module:
    """``torch.compile(model, ...)`` as ``spec`` ({backend, mode, options}) says; ``backend``
    replaces the spec's (mode and options apply to inductor only). An active
    ``CompilerBisector`` replaces the backend again, as torch.compile always lets it."""
    name = backend or spec.get("backend") or "inductor"
    kw: dict = {}
    if name == "inductor":
        if spec.get("mode"):
            kw["mode"] = spec["mode"]
        elif spec.get("options"):
            kw["options"] = dict(spec["options"])
    return torch.compile(model, backend=name, **kw)
