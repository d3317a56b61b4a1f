"""Bad input through the CLI: exit 2, one or two lines naming the problem and the fix, no
traceback, nothing written. In-process (`invoke`) where a subprocess adds nothing; a few end to
end through `python -m nanbisect` (`cli`)."""
from __future__ import annotations

import json
import shutil

import pytest

from helpers import TEST_TASKS, cli, invoke


def assert_clean_error(res, *needles):
    assert res.code == 2, (res.code, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2, res.stderr
    for n in needles:
        assert n in res.stderr, (n, res.stderr)


def _no_report(bundle):
    assert not (bundle / "nanbisect-report").exists()
    assert not [p for p in bundle.parent.iterdir() if p.name.startswith(".")]


def test_missing_path(tmp_path):
    assert_clean_error(cli("run", "--ckpt", tmp_path / "nope"), "does not exist")


def test_file_not_dir(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    assert_clean_error(invoke("run", "--ckpt", f), "is a file")


def test_missing_manifest(tmp_path):
    (tmp_path / "b").mkdir()
    assert_clean_error(invoke("run", tmp_path / "b"), "no manifest.json")
    _no_report(tmp_path / "b")


def test_garbage_manifest(fixture_bundle):
    b = fixture_bundle("healthy")
    (b / "manifest.json").write_text("{not json")
    assert_clean_error(invoke("run", b), "not valid JSON")
    _no_report(b)


def test_truncated_tensor_file(fixture_bundle):
    b = fixture_bundle("healthy")
    data = (b / "model.safetensors").read_bytes()
    (b / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_clean_error(invoke("run", "--ckpt", b), "model.safetensors", "sha256")
    _no_report(b)


def test_altered_tensor_file(fixture_bundle):
    b = fixture_bundle("healthy")
    data = bytearray((b / "batch.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (b / "batch.safetensors").write_bytes(bytes(data))
    assert_clean_error(invoke("inspect", b), "batch.safetensors", "sha256")


def test_future_schema(fixture_bundle):
    b = fixture_bundle("healthy")
    m = json.loads((b / "manifest.json").read_text())
    m["schema"] = "nanbisect.bundle/7"
    (b / "manifest.json").write_text(json.dumps(m))
    assert_clean_error(invoke("run", b), "schema 7", "upgrade nanbisect")
    _no_report(b)


@pytest.mark.parametrize("entry, needle", [
    ("no_such_pkg_xyz.mod:task", "cannot be imported"),
    (f"{TEST_TASKS / 'import_error.py'}:task", "failed to import"),
    (f"{TEST_TASKS / 'missing.py'}:task", "not found"),
    (f"{TEST_TASKS / 'bad_entries.py'}:not_a_task", "not nanbisect.Task"),
    (f"{TEST_TASKS / 'bad_entries.py'}:raises", "config file missing"),
    (f"{TEST_TASKS / 'bad_entries.py'}:NOT_CALLABLE", "not a function"),
    ("no-colon", "is not of the form"),
])
def test_bad_entry(fixture_bundle, entry, needle):
    b = fixture_bundle("healthy")
    m = json.loads((b / "manifest.json").read_text())
    m["entry"], m["entry_file"], m["entry_file_from_bundle"] = entry, None, None
    (b / "manifest.json").write_text(json.dumps(m))
    assert_clean_error(invoke("run", "--ckpt", b), needle)
    _no_report(b)


def test_entry_override_that_does_not_match_model(fixture_bundle):
    b = fixture_bundle("healthy")
    res = invoke("run", "--ckpt", b, "--entry", f"{TEST_TASKS / 'transient.py'}:task")
    assert_clean_error(res, "does not match")
    _no_report(b)


def test_unavailable_device(fixture_bundle):
    assert_clean_error(invoke("run", "--ckpt", fixture_bundle("healthy"), "--target", "cuda:7"),
                       "not available")


def test_usage_error_exit_2():
    res = cli("run")
    assert res.code == 2 and "nanbisect run BUNDLE" in res.stderr and "--ckpt" in res.stderr
    assert "Traceback" not in res.stderr


def test_two_different_bundles_are_refused(tmp_path):
    assert_clean_error(invoke("run", tmp_path / "a", "--ckpt", tmp_path / "b"), "two bundles")


def test_inspect_imports_no_user_code(fixture_bundle, tmp_path):
    """inspect must not import the entry: point it at a file that would leave a marker."""
    b = fixture_bundle("healthy")
    marker = tmp_path / "imported"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').write('x')\ndef task():\n    pass\n")
    m = json.loads((b / "manifest.json").read_text())
    m["entry"] = f"{evil}:task"
    (b / "manifest.json").write_text(json.dumps(m))
    res = cli("inspect", b)
    assert res.code == 0, res.stderr
    assert "evil.py:task" in res.stdout and "checksums ok" in res.stdout
    assert not marker.exists()


def test_inspect_json(fixture_bundle):
    res = invoke("inspect", fixture_bundle("optimizer_adam_eps0"), "--json")
    info = json.loads(res.stdout)
    assert info["optimizer"]["class"] == "torch.optim.adam.Adam"
    assert info["observed"]["first"] == "param"
    assert info["files"]["model.safetensors"]["tensors"] == 3
    # a history but no lookback: the text says what --steps needs, never "up to 0"
    text = invoke("inspect", info["bundle"]).stdout
    assert "history of 1, no lookback (--steps needs a bundle captured with Guard(..., " \
           "lookback=K))" in text and "up to 0" not in text, text
    shutil.rmtree(info["bundle"])  # tmp copy; proves the path printed is the one inspected


def test_a_folder_of_bundles_names_them_and_suggests_triage(fixture_bundle, tmp_path):
    """`--ckpt` on a Guard's `out` folder (the bundles are inside it)."""
    out = tmp_path / "out"
    out.mkdir()
    healthy = fixture_bundle("healthy")
    for name in ("step000012", "step000051"):
        shutil.copytree(healthy, out / name)
    (out / "notes").mkdir()
    res = invoke("run", "--ckpt", out)
    assert_clean_error(res, "folder of 2 bundle(s)", "step000012, step000051",
                       f"nanbisect triage '{out}'")
    assert not (out / "nanbisect-report").exists()


def test_selftest_device_error_names_its_own_flag():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    res = invoke("selftest", "--device", "cuda")
    assert_clean_error(res, "pass --device")
    assert "--target" not in res.stderr


def test_help_shows_boolean_flags_as_flags():
    for cmd in ("run", "selftest", "inspect"):
        out = invoke(cmd, "--help").stdout
        assert "--json" in out and "<bool>" not in out and "None" not in out, out
    assert "report.html" in invoke("run", "--help").stdout


@pytest.mark.slow
def test_repro_on_a_device_this_torch_lacks_is_a_one_line_exit_2(fixture_bundle):
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    bundle = fixture_bundle("forward_nan_behind_mask")
    assert cli("run", "--ckpt", bundle).code == 1
    script = bundle / "nanbisect-report" / "repro" / "repro.py"
    p = subprocess.run([sys.executable, str(script), "--device", "cuda"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "--device cpu" in p.stderr
