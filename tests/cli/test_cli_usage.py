"""The command line's first stage (nanbisect/cli/app.py, checks.py): every usage error is
answered with one line and exit code 2 before torch, numpy, safetensors or any other heavy
module is imported (typer itself is light: tens of milliseconds); the forms it checks without
torch agree with the full parse."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import ROOT, invoke

HEAVY = ("torch", "numpy", "safetensors", "jinja2", "joblib", "rich")

# every case runs in ONE fresh interpreter (an in-process loop over `nanbisect.cli.main`), which
# then says which heavy modules it imported: a usage error answered after an import of torch
# would be caught there even though its message and code were right
PROBE = """
import contextlib, io, json, sys
from nanbisect.cli import main
out, heavy = [], {}
for argv in json.loads(sys.argv[1]):
    if argv == ["--help"]:      # the usage errors are done: the helps render with rich
        heavy["errors"] = [m for m in %r if m in sys.modules]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    out.append([code, err.getvalue()])
heavy["all"] = [m for m in %r if m in sys.modules]
print(json.dumps({"results": out, "heavy": heavy}))
""" % (HEAVY, HEAVY)


def usage_cases(tmp_path):
    """(argv, words the one-line error must hold) for every kind of usage error."""
    bundle = tmp_path / "b"     # passes the path checks (holds manifest.json), nothing more
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("x")
    b, f = str(bundle), str(a_file)
    return [
        (["run", "nope/step000001"], ["'nope/step000001' does not exist"]),
        (["run", "--ckpt", f], ["is a file, not a directory"]),
        (["run", str(full)], ["has no manifest.json"]),
        (["run", str(tmp_path)], ["is a folder of 1 bundle(s) (b)", "nanbisect triage"]),
        (["run"], ["no bundle given", "--ckpt"]),
        (["run", b, "--ckpt", f], ["two bundles"]),
        (["frob"], ["unknown command 'frob'", "nanbisect --help"]),
        (["run", b, "--frob"], ["unrecognized arguments: --frob", "nanbisect run --help"]),
        (["run", b, "--tar", "cpu"], ["unrecognized arguments: --tar"]),    # no abbreviations
        (["run", b, "--steps", "x"], ["--steps", "'x'"]),
        (["run", b, "--steps", "0"], ["--steps", "'0' is out of range", "from 1 to"]),
        (["run", b, "--remedy-budget", "-1"], ["--remedy-budget"]),
        (["run", b, "--target", "cuda:01"], ["not a torch device string"]),
        (["run", b, "--target", "cuda:0:1"], ["device 'cuda:0:1'"]),
        (["run", b, "--reference", "cpu:int8"], ["'int8' is not a floating dtype"]),
        (["run", b, "--entry", "no-colon"], ["is not of the form"]),
        (["run", b, "--inject", "nofunc"], ["--inject 'nofunc'", "FILE.py:FUNC"]),
        (["run", b, "--ranks", "a,b"], ["--ranks 'a,b'"]),
        (["run", b, "--ranks", "-1"], ["--ranks '-1'"]),
        (["run", b, "--out", f], ["--out", "is a file"]),
        (["run", b, "--out", b], ["is the bundle itself"]),
        (["run", b, "--out", str(bundle / "x")], ["is inside the bundle"]),
        (["run", b, "--out", str(full)], ["is not a nanbisect report (it holds mine.txt)"]),
        (["inspect", "nope"], ["'nope' does not exist"]),
        (["inspect", f], ["is a file, not a directory"]),
        (["inspect"], ["required: BUNDLE"]),
        (["triage", "nope"], ["triage: 'nope' does not exist"]),
        (["triage", f], ["is a file, not a directory"]),
        (["triage", b, "--timeout", "0"], ["--timeout", "'0' is out of range"]),
        (["triage", b, "--timeout", "soon"], ["--timeout", "'soon'"]),
        (["triage", b, "--out", f], ["--out", "is a file"]),
        (["triage", b, "--backend", "spark"], ["unknown --backend 'spark'"]),
        (["triage", b, "--scheduler", "tcp://x:1"], ["--scheduler", "--backend dask"]),
        (["triage", b, "--known", "/dev/zero"], ["--known '/dev/zero' is a character device"]),
        (["pack", "nope"], ["pack: 'nope' is not a directory"]),
        (["unpack", "nope.tar.gz", str(tmp_path / "d")], ["unpack: 'nope.tar.gz' is not a file"]),
        (["unpack", f, str(full)], ["exists and is not empty"]),
        (["unpack", f, str(tmp_path / "d"), "--max-bytes", "many"], ["--max-bytes"]),
        (["clean", "nope"], ["clean: 'nope' is not a directory"]),
        (["clean", str(tmp_path), "--min-age", "old"], ["--min-age"]),
        (["selftest", "--device", "gpu 0"], ["not a torch device string"]),
        (["--json"], ["unrecognized arguments: --json"]),
    ]


def test_usage_errors_are_one_line_and_import_nothing_heavy(tmp_path):
    cases = usage_cases(tmp_path)
    helps = [["--help"], ["-h"], ["--version"], ["run", "--help"], ["triage", "-h"]]
    argvs = [argv for argv, _ in cases] + helps
    p = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True,
                       text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    for (argv, words), (code, err) in zip(cases, got["results"]):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (argv, code, err)
        assert lines[0].startswith("nanbisect: error: ") and "Traceback" not in err, (argv, err)
        for w in words:
            assert w in lines[0], (argv, w, lines[0])
    assert [code for code, _ in got["results"][len(cases):]] == [0] * len(helps)
    assert got["heavy"]["errors"] == [], got["heavy"]
    assert got["heavy"]["all"] in ([], ["rich"]), got["heavy"]   # help panels: rich, no torch
    assert not (tmp_path / "b" / "nanbisect-report").exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["b", "f.txt", "full"]


def test_no_command_prints_the_help():
    p = subprocess.run([sys.executable, "-m", "nanbisect"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert p.returncode == 2 and "COMMAND" in p.stderr and "selftest" in p.stderr


# device strings: the check without torch must refuse only what torch refuses, and every string
# torch refuses for its form (not for an unknown type name, which it cannot know)
DEVICES = ["cpu", "cpu:0", "cuda", "cuda:1", "cpu:float64", "cpu:bfloat16", "cpu:half",
           "cuda:01", "cuda:", "CPU", "cpu 0", " cpu", "cpu:-1", "cuda:1:float64", "cpu:int8",
           "cpu:float", "meta", "cdua", "", ":", "cpu:cfloat", "npu:0", "x_y", "cuda:1x"]


@pytest.mark.parametrize("spec", DEVICES)
def test_device_form_agrees_with_torch(spec):
    import torch

    from nanbisect.errors import BadInput
    from nanbisect.util.spec import check_device

    try:
        check_device(spec)
        early = False
    except BadInput:
        early = True
    dev, _, dtype = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if dtype and not dtype.isdigit():     # DEVICE[:INDEX]:DTYPE (nanbisect's form)
        d = getattr(torch, dtype, None)
        bad_dtype = not (isinstance(d, torch.dtype) and d.is_floating_point)
    else:
        dev, bad_dtype = spec, False
    try:
        torch.device(dev)
        form, known = True, True
    except RuntimeError as e:
        form = not any(w in str(e) for w in ("Invalid device string", "must not be empty"))
        known = False
    if early:
        assert bad_dtype or not form or not known, spec
    assert early == (bad_dtype or not form), spec


def test_triage_refusals_have_the_librarys_words(tmp_path):
    """The first stage makes triage's checks before anything heavy is imported (the backend's
    with the library's own `check_backend`, the others repeated): the same words as the
    library's own."""
    from nanbisect.errors import BadInput
    from nanbisect.nightly import triage

    f = tmp_path / "f"
    f.write_text("x")
    for argv, kwargs in [(["nope"], {}), ([str(f)], {}),
                         ([str(tmp_path), "--out", str(f)], {"out": f}),
                         ([str(tmp_path), "--backend", "spark"], {"backend": "spark"})]:
        early = invoke("triage", *argv)
        with pytest.raises(BadInput) as late:
            triage([argv[0]], **{"out": tmp_path / "o", **kwargs})
        assert (early.code, early.stderr) == (2, f"nanbisect: error: {late.value}\n")
