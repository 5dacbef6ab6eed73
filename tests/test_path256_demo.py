"""Tests of the Path-256 training demo in demos/path256.py (CPU, torch backend, tiny sizes)."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demos"))

import path256  # noqa: E402


def tiny_model(resolution=8, block_size=16, mask="butterfly", width=16, heads=2, layers=1):
    mask = path256.build_mask(mask, resolution**2, block_size)
    config = path256.ModelConfig(resolution=resolution, width=width, layers=layers, heads=heads, mlp_ratio=2)
    return path256.PixelTransformer(config, mask, backend="torch")


@pytest.mark.parametrize("mask", ["butterfly", "dense"])
def test_forward_backward_gives_finite_loss_and_gradients(mask):
    torch.manual_seed(0)
    model = tiny_model(mask=mask)
    pixels = torch.randint(0, 256, (3, 64), dtype=torch.uint8)
    logits = model(pixels)
    assert logits.shape == (3, 2)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 1]))
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.pos_embed.grad.abs().sum() > 0


def test_sincos_encoding_has_row_and_column_halves():
    resolution, width = 6, 16
    enc = path256.sincos_2d(resolution, width).reshape(resolution, resolution, width)
    rows, cols = enc[..., : width // 2], enc[..., width // 2 :]
    assert torch.equal(rows, rows[:, :1].expand_as(rows))  # the first half depends on the row only
    assert torch.equal(cols, cols[:1].expand_as(cols))  # the second half on the column only
    assert not torch.equal(rows[0], rows[1]) and not torch.equal(cols[:, 0], cols[:, 1])
    assert torch.equal(rows[:, 0], cols[0])  # both halves use the same 1-D encoding
    q = width // 4
    sin, cos = rows[:, 0, :q], rows[:, 0, q:]
    torch.testing.assert_close(sin**2 + cos**2, torch.ones(resolution, q))
    position = (torch.arange(resolution) + 0.5) * path256.SINCOS_UNITS / resolution
    torch.testing.assert_close(sin[:, 0], torch.sin(position))  # frequency 1 first
    torch.testing.assert_close(sin[:, -1], torch.sin(position * 10000 ** (-(q - 1) / q)))


def test_sincos_encoding_depends_on_place_not_resolution():
    low = path256.sincos_2d(2, 8).reshape(2, 2, 8)
    high = path256.sincos_2d(6, 8).reshape(6, 6, 8)
    torch.testing.assert_close(high[1::3, 1::3], low)  # the centre of each 3 x 3 square is the low-res pixel
    with pytest.raises(ValueError, match="multiple of 4"):
        path256.sincos_2d(4, 6)


def test_upsample_pos_grid_duplicates_4x4_onto_8x8():
    grid = torch.arange(4 * 4 * 3, dtype=torch.float32).reshape(4, 4, 3)
    up = path256.upsample_pos_grid(grid, 8)
    assert up.shape == (8, 8, 3)
    for i in range(8):
        for j in range(8):
            assert torch.equal(up[i, j], grid[i // 2, j // 2])
    assert torch.equal(path256.upsample_pos_grid(grid, 4), grid)


def test_init_from_loads_a_lower_resolution_checkpoint(tmp_path):
    torch.manual_seed(0)
    small = tiny_model(resolution=4, block_size=16)
    optimizer = path256.make_optimizer(small, 1e-3, 0.0, torch.device("cpu"))
    path = tmp_path / "small.pt"
    path256.save_checkpoint(path, small, optimizer, path256.TrainState(), {})
    large = tiny_model(resolution=8, block_size=16)
    assert path256.init_from_mismatch(path, large.config) is None
    path256.init_from_checkpoint(large, path)
    assert torch.equal(large.pos_embed, path256.upsample_pos_grid(small.pos_embed.detach(), 8))
    assert torch.equal(large.head.weight, small.head.weight)
    wider = path256.ModelConfig(resolution=8, width=32, layers=1, heads=2, mlp_ratio=2)
    assert "width 16 vs 32" in path256.init_from_mismatch(path, wider)


def test_mask_choices_have_the_expected_densities():
    n, block = 1024, 32  # 32 blocks a side, as in the smoke preset
    assert path256.build_mask("dense", n, block).density == 1.0
    assert path256.build_mask("local", n, block).nnz == 3 * 32 - 2
    # butterfly (6 per row) + the other neighbour of the band (30) + row and column 0 (26 each)
    default = path256.build_mask("butterfly", n, block)
    assert default.nnz == 32 * 6 + 30 + 26 + 26
    layout = default.layout[0, 0]
    assert layout[0].all() and layout[:, 0].all() and layout.diagonal(1).all() and layout.diagonal(-1).all()
    random = path256.build_mask("random", n, block, seed=1)
    assert random.layout[0, 0].diagonal().all()
    assert abs(random.density - default.density) < 0.1
    bigbird = path256.build_mask("bigbird", n, block)
    assert default.density > bigbird.density > path256.build_mask("local", n, block).density
    assert path256.build_mask("butterfly", 65536, 128).density == pytest.approx(0.0253, abs=1e-4)
    with pytest.raises(ValueError, match="mask must be one of"):
        path256.build_mask("diagonal", n, block)


def test_learning_rate_warms_up_then_decays_to_zero():
    lr = path256.learning_rate
    assert lr(1.0, 10, 0, 0.0) == pytest.approx(0.1)
    assert lr(1.0, 10, 9, 0.0) == pytest.approx(1.0)
    assert lr(1.0, 10, 50, 0.5) == pytest.approx(0.5)
    assert lr(1.0, 10, 99, 1.0) == pytest.approx(0.0, abs=1e-12)


def test_batch_sampler_splits_the_global_batch_by_rank():
    cpu = torch.device("cpu")
    ranks = [path256.BatchSampler(12, 2, 0, path256.Dist(rank, 3), cpu) for rank in range(3)]
    epoch = torch.cat([r(step) for step in range(2) for r in ranks])
    assert sorted(epoch.tolist()) == list(range(12))  # one epoch covers every image once
    assert torch.equal(ranks[0](0), path256.BatchSampler(12, 2, 0, path256.Dist(0, 3), cpu)(0))  # reproducible
    assert not torch.equal(ranks[0](0), ranks[0](2))  # a new permutation each epoch
    with pytest.raises(ValueError, match="global batch"):
        path256.BatchSampler(5, 2, 0, path256.Dist(0, 3), cpu)


def test_presets_fill_unset_flags_and_flags_win():
    args = path256.parse_args(["--preset", "path32", "--layers", "3"])
    assert (args.layers, args.width, args.batch_size, args.resolution) == (3, 128, 256, 32)
    assert args.out.endswith("results/path32")
    assert [(r.name, r.mask) for r in path256.plan_runs(args)] == [("dense", "dense"), ("sparse", "butterfly")]
    runs = path256.plan_runs(path256.parse_args(["--preset", "path256"]))
    assert [(r.name, r.steps) for r in runs] == [("sparse", 400), ("dense", 20)]
    assert [r.name for r in path256.plan_runs(path256.parse_args(["--mask", "local"]))] == ["local"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--width", "30"], "multiple of 4"),
        (["--heads", "3"], "multiple of 4 and of --heads"),
        (["--steps", "0"], "must be positive"),
        (["--mask", "nope"], "invalid choice"),
        (["--n-train", "4"], "at least --batch-size"),
        (["--init-from", "/nonexistent.pt"], "no such file"),
    ],
)
def test_bad_flags_give_plain_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        path256.parse_args(argv)
    assert message in capsys.readouterr().err


def test_naive_attention_memory_at_65536_tokens():
    args = types.SimpleNamespace(resolution=256, batch_size=8, heads=2, layers=2)
    naive = path256.naive_attention_memory(args, 2, 141 * 10**9, {})
    assert naive["bytes_per_head_per_sample"] == 8 * 2**30
    assert naive["gib_total"] == 256 and naive["fits"] is False
    assert "does not fit" in naive["statement"]


def test_smoke_check_of_block_sparse_against_dense(capsys):
    args = types.SimpleNamespace(resolution=32, block_size=32, heads=2, width=16, seed=0)
    out_error, grad_error = path256.check_against_reference(args)
    assert out_error < 1e-5 and grad_error < 1e-5
    assert "max |out diff|" in capsys.readouterr().out


def tiny_run_flags(tmp_path, steps):
    return [
        "--preset", "path32", "--mask", "butterfly", "--layers", "1", "--width", "16", "--heads", "2",
        "--batch-size", "4", "--n-train", "8", "--n-eval", "4", "--steps", str(steps), "--eval-every", "2",
        "--log-every", "1", "--time-budget", "0", "--device", "cpu", "--out", str(tmp_path / "out"),
        "--cache-dir", str(tmp_path / "cache"), "--workers", "1",
    ]


def test_tiny_run_writes_results_and_resumes(tmp_path):
    out = tmp_path / "out"
    path256.main(tiny_run_flags(tmp_path, steps=4))
    metrics = json.loads((out / "path32_sparse.json").read_text())
    assert [e["step"] for e in metrics["evals"]] == [2, 4]
    assert {"step", "samples", "train_loss", "train_acc", "eval_loss", "eval_acc", "samples_per_s",
            "peak_memory_gib"} <= set(metrics["evals"][0])
    assert {"date", "device", "torch", "triton"} <= set(metrics["environment"])
    assert (out / "path32_curves.png").stat().st_size > 0
    summary = json.loads((out / "path32_summary.json").read_text())
    assert summary["runs"]["sparse"]["steps"] == 4 and "statement" in summary["naive_attention"]

    path256.main(tiny_run_flags(tmp_path, steps=6) + ["--resume"])
    metrics = json.loads((out / "path32_sparse.json").read_text())
    assert [e["step"] for e in metrics["evals"]] == [2, 4, 6]
    assert [t["step"] for t in metrics["train_log"]] == [1, 2, 3, 4, 5, 6]


def test_time_budget_stops_training(tmp_path):
    flags = tiny_run_flags(tmp_path, steps=100)
    flags[flags.index("--time-budget") + 1] = "0.001"
    path256.main(flags)
    metrics = json.loads((tmp_path / "out" / "path32_sparse.json").read_text())
    assert [e["step"] for e in metrics["evals"]] == [1]  # the clock is read at every log step
