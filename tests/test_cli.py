"""The `sparse-flash` command: outputs, files written, plain errors with a non-zero exit code."""

import shutil
import subprocess
import sys

import pytest
import torch

from sparse_flash import cli, masks

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv", [[], ["masks"], ["masks", "show"], ["masks", "gallery"], ["bench"], ["demo"], ["info"]], ids=" ".join
)
def test_help_everywhere(capsys, argv):
    code, out, _ = run(capsys, *argv, "--help")
    assert code == 0
    assert out.startswith("usage: sparse-flash")


def test_masks_show_small_prints_a_grid(capsys):
    code, out, err = run(capsys, "masks", "show", "local", "--seq-len", "512", "--param", "window=1")
    assert code == 0 and err == ""
    assert str(masks.local(512, 128, window=1)) in out
    assert "##.." in out and "nonzero blocks: 10 of 16" in out


def test_masks_show_large_prints_a_summary(capsys):
    code, out, _ = run(capsys, "masks", "show", "butterfly", "--seq-len", "16384", "--block-size", "64")
    assert code == 0
    assert "layout=(1, 1, 256, 256)" in out and "density=" in out
    assert "#" not in out


def test_masks_show_params_and_heads(capsys):
    code, out, _ = run(
        capsys, "masks", "show", "random", "--seq-len", "256", "--block-size", "64",
        "--param", "density=0.5", "--param", "seed=3", "--num-heads", "2",
    )
    assert code == 0
    assert str(masks.random(256, 64, density=0.5, seed=3, num_heads=2)) in out
    code, out, _ = run(
        capsys, "masks", "show", "longformer", "--seq-len", "1024", "--param", "global_block_indices=0,4"
    )
    assert code == 0 and "longformer" in out


def test_masks_show_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "mask.png"
    code, out, _ = run(capsys, "masks", "show", "bigbird", "--seq-len", "1024", "--png", str(path))
    assert code == 0 and f"wrote {path}" in out
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_masks_gallery_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "gallery.png"
    code, _, _ = run(capsys, "masks", "gallery", str(path), "--seq-len", "1024")
    assert code == 0
    assert path.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["masks", "show", "nope"], "unknown mask pattern 'nope'; known patterns: dense, causal, local, butterfly"),
        (["masks", "show", "local", "--param", "window"], "--param expects the form name=value"),
        (["masks", "show", "local", "--param", "=2"], "--param expects the form name=value"),
        (["masks", "show", "local", "--param", "width=2"],
         "pattern 'local' has no parameter 'width'; its parameters are: window"),
        (["masks", "show", "random"], "pattern 'random' needs --param density=VALUE"),
        (["masks", "show", "local", "--num-heads", "2"], "--num-heads does not apply"),
        (["masks", "show", "local", "--param", "window=-1"], "cannot build 'local': window must be at least 0, got -1"),
        (["masks", "show", "local", "--seq-len", "256", "--png", "/no/such/dir/x.png"],
         "the folder '/no/such/dir' of '/no/such/dir/x.png' does not exist"),
        # Python's parser may run out of memory on this literal (read as a string then) or read -1: refused either way
        (["masks", "show", "local", "--param", "window=" + "-" * 10001 + "1"], "cannot build 'local': window must be"),
    ],
    ids=["pattern", "param-form", "param-name-missing", "param-unknown", "param-required", "heads", "param-value",
         "png", "param-deeply-nested"],
)
def test_user_errors_are_plain(capsys, argv, message):
    if "--png" in argv:
        pytest.importorskip("matplotlib")
    code, out, err = run(capsys, *argv)
    assert code != 0
    assert err.startswith("sparse-flash: error: ") and message in err
    assert "Traceback" not in err
    assert out == ""  # said before any work (a missing folder was reported after the mask was printed)


@pytest.mark.parametrize("name", ["x.png", "pictures"])
def test_a_png_naming_a_folder_is_a_usage_error_before_any_work(capsys, tmp_path, name):
    pytest.importorskip("matplotlib")
    (tmp_path / name).mkdir()  # a folder where the file would go
    code, out, err = run(capsys, "masks", "show", "local", "--seq-len", "256", "--png", str(tmp_path / name) + "/")
    assert code == 2 and "must name a file, got the folder" in err and "Traceback" not in err
    assert out == ""  # said before the mask is printed


@pytest.mark.parametrize(
    "argv", [["masks", "show", "local", "--bogus"], ["frobnicate"], ["masks", "show", "local", "--seq-len", "x"]]
)
def test_usage_errors(capsys, argv):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert "usage: sparse-flash" in err and "error:" in err


def test_info_lists_versions_and_backends(capsys):
    code, out, _ = run(capsys, "info")
    assert code == 0
    assert f"torch        {torch.__version__}" in out
    for line in ("sparse_flash ", "python ", "triton ", "CUDA ", "GPU "):
        assert line in out
    for backend in ("triton", "torch", "reference"):
        assert any(line.strip().startswith(backend + " ") for line in out.splitlines()), backend
    assert "reference  usable" in out and "backend='auto' runs" in out


def test_info_says_why_triton_cannot_run(capsys, monkeypatch):
    monkeypatch.setattr(cli, "triton_unavailable_reason", lambda device: "triton is not installed (pip install x)")
    _, out, _ = run(capsys, "info")
    assert "triton     not usable: triton is not installed" in out


@pytest.fixture
def fake_checkout(tmp_path, monkeypatch):
    """A checkout whose scripts print their arguments and exit with code 3."""
    monkeypatch.setattr(cli, "_search_roots", lambda: [tmp_path])
    for relative in (cli.BENCH, *cli.DEMOS.values()):
        script = tmp_path / relative
        script.parent.mkdir(exist_ok=True)
        script.write_text("import sys\nprint('args', sys.argv[1:])\nsys.exit(3)\n")
    return tmp_path


def test_demo_runs_the_script_with_the_arguments(fake_checkout, capfd):
    code = cli.main(["demo", "path256", "--preset", "smoke", "--", "--steps", "2"])
    assert code == 3
    assert "args ['--preset', 'smoke', '--steps', '2']" in capfd.readouterr().out


def test_bench_runs_the_script_with_the_arguments(fake_checkout, capfd, monkeypatch):
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)
    code = cli.main(["bench", "--quick", "--out", "results"])
    assert code == 3
    assert "args ['--quick', '--out', 'results']" in capfd.readouterr().out


def test_bench_needs_cuda(fake_checkout, capsys, monkeypatch):
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)
    code, _, err = run(capsys, "bench", "--quick")
    assert code == 1 and "the benchmark needs a CUDA GPU" in err


@pytest.mark.parametrize("argv, relative", [(["bench"], cli.BENCH), (["demo", "path256"], cli.DEMOS["path256"])])
def test_missing_scripts_are_reported(tmp_path, monkeypatch, capsys, argv, relative):
    monkeypatch.setattr(cli, "_search_roots", lambda: [tmp_path])
    code, _, err = run(capsys, *argv)
    assert code == 1
    assert f"{relative} was not found (looked at {tmp_path / relative})" in err


def test_console_script_and_module_run_as_processes():
    exe = shutil.which("sparse-flash") or pytest.skip("the sparse-flash console script is not installed")
    bad = subprocess.run([exe, "masks", "show", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.startswith("sparse-flash: error: unknown mask pattern 'nope'") and "Traceback" not in bad.stderr
    info = subprocess.run([sys.executable, "-m", "sparse_flash", "info"], capture_output=True, text=True)
    assert info.returncode == 0 and "reference  usable" in info.stdout


def test_an_empty_png_name_is_a_usage_error(capsys):
    code, _, err = run(capsys, "masks", "show", "dense", "--png", "")
    assert code == 2 and "--png" in err and "Traceback" not in err


def test_version_flag(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip().startswith("sparse-flash ")
