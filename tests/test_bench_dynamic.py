"""benchmarks/bench_dynamic.py: its smoke run end to end, the choice it times against the MoBA layer's, flex's
masks against ours, and the ratios it reports (made-up timings)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, triton_usable

from sparse_flash.nn import MoBAAttention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench = pytest.importorskip("bench_dynamic")


def test_smoke_run_writes_the_record_and_prints_the_table_last(tmp_path, capsys):
    backend = "triton" if triton_usable() else "torch"
    assert bench.main(["--smoke", "--backend", backend, "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "dynamic.json").read_text())
    meta = record["meta"]
    for key in ("date", "gpu", "torch", "triton", "commit", "command", "host"):
        assert key in meta
    assert meta["smoke"] and meta["backend"] == backend
    build = record["mask_build"]
    assert len(build) == 8 and all("from_topk_eager_ms" in r and r["flex_same_blocks"] for r in build)
    assert all(r["flex_create_block_mask_same_blocks"] for r in build if r["N"] == 1024)
    ours = [r for r in record["step"] if r["impl"] == "sparse_flash"]
    assert len(ours) == 4 and all("ms" in r and r["flex_same_blocks"] for r in ours)
    if DEVICE == "cpu":
        assert all(r["error"].startswith("not run") for r in record["step"] if r["impl"] in ("flex", "sdpa_cudnn"))
    else:
        assert all(r["max_diff_vs_flex"] < 1e-2 for r in ours)  # float32 inputs; either side may round via TF32
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("bench_dynamic:") and lines[-1].startswith("moba top-2   fwd+bwd")


def test_no_compile_run_times_the_builds_that_compile_nothing(tmp_path):
    """`--no-compile --skip-step`: the quick measurement of from_topk (no create_block_mask, no compiled build)."""
    assert bench.main(["--smoke", "--no-compile", "--skip-step", "--out", str(tmp_path)]) == 0
    build = json.loads((tmp_path / "dynamic.json").read_text())["mask_build"]
    assert len(build) == 8 and all("from_topk_eager_ms" in r and "flex_from_kv_blocks_eager_ms" in r for r in build)
    assert not any(key.startswith(("flex_create_block_mask", "from_topk_compiled")) for r in build for key in r)


def test_a_smoke_run_without_out_writes_no_file_and_a_bad_out_is_refused(tmp_path, monkeypatch, capsys):
    """Found by the seventeenth probe: a smoke run from the repository's root replaced the committed
    benchmarks/results/latest/dynamic.json, and an --out naming a file failed after the work."""
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--smoke", "--skip-build", "--skip-step"]) == 0
    assert list(tmp_path.iterdir()) == [] and "writes no file" in capsys.readouterr().out
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as stop:
        bench.main(["--smoke", "--skip-build", "--skip-step", "--out", str(tmp_path / "file")])
    assert stop.value.code == 2 and "--out must name a folder" in capsys.readouterr().err


@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_the_timed_choice_is_the_moba_layers(top_k):
    torch.manual_seed(0)
    B, H, N, D = 2, 3, 5 * bench.BLOCK, 16
    q, k = (torch.randn(B, H, N, D, device=DEVICE) for _ in range(2))
    layer = MoBAAttention(H * D, H, bench.BLOCK, top_k, device=DEVICE)
    timed = bench.ours_topk_mask(bench.block_scores(q, k, bench.BLOCK), min(top_k, 5), True)
    assert torch.equal(timed.layout, layer.select(q, k).layout)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("k", [1, 2, 6, 7])
def test_flex_mask_holds_our_blocks_with_only_the_diagonal_partial(causal, k):
    pytest.importorskip("torch.nn.attention.flex_attention")
    scores = torch.randn(2, 3, 7, 7, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(k))
    ours = bench.ours_topk_mask(scores, k, causal)
    flex = bench.flex_topk_mask(scores, k, causal)
    assert torch.equal(flex.to_dense().bool(), ours.layout)
    assert torch.equal(flex.full_kv_num_blocks.long(), ours.layout.sum(-1) - int(causal))
    assert torch.all(flex.kv_num_blocks == int(causal))
    if causal:  # the one partial block of a row is its diagonal, masked by q_idx >= kv_idx
        assert torch.equal(flex.kv_indices[..., 0].long(), torch.arange(7, device=DEVICE).expand(2, 3, 7))


def test_ratios_and_table_compare_like_with_like():
    def row(impl, mode, ms, mask="moba top-8"):
        return {"B": 1, "Hq": 16, "N": 32768, "D": 128, "dtype": "bfloat16", "mask": mask, "impl": impl,
                "mode": mode, "ms": ms}

    rows = [row("sparse_flash", "fwd", 1.0), row("sparse_flash_triton_kernels", "fwd", 1.25), row("flex", "fwd", 1.5),
            row("sparse_flash", "fwd+bwd", 4.0), row("flex", "fwd+bwd", 5.0),
            row("sdpa_cudnn", "fwd", 8.0, "dense causal"), row("sdpa_cudnn", "fwd+bwd", 30.0, "dense causal"),
            row("sparse_flash_compiled", "fwd", 0.75)]
    bench.step_ratios(rows)
    assert rows[0]["flex_over_ours"] == pytest.approx(1.5) and rows[0]["cudnn_causal_over_ours"] == pytest.approx(8)
    assert rows[1]["flex_over_ours"] == pytest.approx(1.2)
    assert rows[3]["flex_over_ours"] == pytest.approx(1.25) and rows[3]["cudnn_causal_over_ours"] == pytest.approx(7.5)
    assert "flex_over_ours" not in rows[2] and "flex_over_ours" not in rows[5]
    summary = bench.summarize([], rows)
    assert summary["step_fwd_flex_over_ours"] == {"moba top-8": 1.5}
    assert summary["step_fwd_flex_over_ours_compiled"] == {"moba top-8": 2.0}
    text = bench.table([], rows, smoke=False).splitlines()
    assert text[-2].split() == ["moba", "top-8", "fwd", "|", "1.000", "1.250", "0.750", "1.500", "1.50x", "2.00x",
                                "|", "8.000"]


def test_profile_mode_writes_one_operator_table_per_case(tmp_path):
    assert bench.main(["--smoke", "--backend", "torch", "--profile", "--out", str(tmp_path)]) == 0
    written = sorted(p.name for p in tmp_path.glob("profile_*.txt"))
    assert written == ["profile_butterfly_build_1024.txt", "profile_from_topk_1024_k2.txt", "profile_moba_step_384_top1.txt",
                       "profile_moba_step_384_top1_triton_kernels.txt"]
    text = (tmp_path / "profile_moba_step_384_top1.txt").read_text()
    assert "## by device time" in text and "## by host time" in text and "aten::" in text
    assert not (tmp_path / "dynamic.json").exists()  # a profile is not a timing record
