"""Tests of the Path-256 training demo (demos/path256.py, path_model.py, path_train.py, results_table.py).

CPU only, tiny sizes. Most runs read stand-in images (random pixels, a learnable label) from a fake generator
with the pooled-resolution API, so a "32 px pooled 4x" run has 64 tokens and a step takes milliseconds.
"""

import io
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demos"))

import path256  # noqa: E402
import path_model  # noqa: E402
import path_train  # noqa: E402
import results_table  # noqa: E402
from path_model import MaskConfig, ModelConfig, PixelTransformer  # noqa: E402

CPU = torch.device("cpu")


def fake_load_or_generate(n, resolution, difficulty, seed, cache_dir=None, workers=None, progress=False, pool=1):
    """Random images whose label is written in the first pixel (so a model can learn it), `resolution // pool` px."""
    side = resolution // pool
    rng = np.random.default_rng([seed, n, side])
    labels = rng.integers(0, 2, n).astype(np.int64)
    images = rng.integers(0, 256, (n, side, side), dtype=np.uint8)
    images[:, 0, 0] = labels * 255
    return images, labels


@pytest.fixture
def fake_data(monkeypatch):
    monkeypatch.setattr(path_train.pathfinder, "load_or_generate", fake_load_or_generate)


def tiny_config(**changes):
    values = dict(side=8, width=16, layers=1, heads=2, mlp_ratio=2, pos="learned+sincos")
    return ModelConfig(**{**values, **changes})


def tiny_model(mask="butterfly", block_size=16, **changes):
    config = tiny_config(**changes)
    masks = path_model.layer_masks(MaskConfig((mask,) * config.layers, block_size), config)
    return PixelTransformer(config, masks, backend="torch")


def run_flags(tmp_path, *extra, out="out", steps=4):
    """A tiny run: 32-px images pooled 4x (8 px, 64 tokens), fake data."""
    return [
        "--preset", "path32", "--pool", "4", "--mask", "butterfly", "--block-size", "16", "--layers", "1",
        "--width", "16", "--heads", "2", "--batch-size", "4", "--n-train", "8", "--n-eval", "8", "--steps",
        str(steps), "--eval-every", "2", "--log-every", "1", "--train-seconds", "0", "--device", "cpu", "--out",
        str(tmp_path / out), "--cache-dir", str(tmp_path / "cache"), "--workers", "1", "--backend", "torch", *extra,
    ]


def error_of(capsys, argv) -> str:
    assert path256.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("path256.py: error:") and "\n" not in err and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------------------------------
# Model: positions, order, masks
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pos, order, head, mask", [
    ("learned+sincos", "row", "mean", "butterfly"),
    ("rope2d", "tile", "max", "neighborhood"),
    ("learned+rope2d", "tile", "mean", "butterfly2d+local"),
    ("sincos", "row", "max", "dense"),
])
def test_forward_backward_gives_finite_loss_and_gradients(pos, order, head, mask):
    torch.manual_seed(0)
    model = tiny_model(mask, pos=pos, order=order, tile=(4, 4) if order == "tile" else (1, 1), head=head)
    logits = model(torch.randint(0, 256, (3, 64), dtype=torch.uint8))
    assert logits.shape == (3, 2)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 1]))
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        if not name.startswith("pixel_head"):
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_sincos_encoding_has_row_and_column_halves():
    resolution, width = 6, 16
    enc = path_model.sincos_2d(resolution, width).reshape(resolution, resolution, width)
    rows, cols = enc[..., : width // 2], enc[..., width // 2 :]
    assert torch.equal(rows, rows[:, :1].expand_as(rows))  # the first half depends on the row only
    assert torch.equal(cols, cols[:1].expand_as(cols))  # the second half on the column only
    assert torch.equal(rows[:, 0], cols[0])  # both halves use the same 1-D encoding
    q = width // 4
    position = (torch.arange(resolution) + 0.5) * path_model.SINCOS_UNITS / resolution
    torch.testing.assert_close(rows[:, 0, 0], torch.sin(position))  # frequency 1 first
    torch.testing.assert_close(rows[:, 0, q - 1], torch.sin(position * 10000 ** (-(q - 1) / q)))
    low, high = path_model.sincos_2d(2, 8).reshape(2, 2, 8), path_model.sincos_2d(6, 8).reshape(6, 6, 8)
    torch.testing.assert_close(high[1::3, 1::3], low)  # image units: the centre of each 3x3 square is a low pixel


def test_rope2d_scores_depend_on_the_offset_only_and_split_row_and_column():
    side, head_dim = 8, 16
    angles = path_model.rope_2d_angles(side, head_dim)
    cos, sin = angles.cos(), angles.sin()
    q, k = torch.randn(2, 1, 1, 1, head_dim, dtype=torch.float64).unbind(0)
    rotated_q = path_model.apply_rope(q.expand(1, 1, side * side, head_dim).float(), cos, sin)[0, 0]
    rotated_k = path_model.apply_rope(k.expand(1, 1, side * side, head_dim).float(), cos, sin)[0, 0]

    def score(a, b):  # a, b: (row, col)
        return rotated_q[a[0] * side + a[1]] @ rotated_k[b[0] * side + b[1]]

    torch.testing.assert_close(score((1, 2), (3, 5)), score((4, 1), (6, 4)), atol=1e-5, rtol=1e-5)
    assert not torch.isclose(score((1, 2), (3, 5)), score((1, 2), (5, 3)))
    quarter = head_dim // 4  # pairs 0..quarter-1 follow the row, the others the column
    grid = angles.reshape(side, side, head_dim // 2)
    assert torch.equal(grid[:, :, :quarter], grid[:, :1, :quarter].expand(side, side, quarter))
    assert torch.equal(grid[:, :, quarter:], grid[:1, :, quarter:].expand(side, side, quarter))


def test_tile_order_matches_to_tiles_and_is_invisible_to_a_dense_model():
    perm = path_model.token_permutation(8, "tile", (4, 2))
    x = torch.arange(64).reshape(1, 64, 1)
    expected = x.reshape(2, 4, 4, 2).permute(0, 2, 1, 3).reshape(-1)  # (tile rows, tile cols, 4x2 pixels)
    assert torch.equal(perm, expected)
    assert torch.equal(path_model.masks.to_tiles(x, 8, 8, (4, 2)).reshape(-1), perm)
    # With dense attention and permutation-invariant pooling, token order must not change anything.
    pixels = torch.randint(0, 256, (2, 64), dtype=torch.uint8)
    for pos in ("learned+sincos", "rope2d"):
        torch.manual_seed(0)
        row = tiny_model("dense", pos=pos)
        torch.manual_seed(0)
        tile = tiny_model("dense", pos=pos, order="tile", tile=(4, 2))
        torch.testing.assert_close(row(pixels), tile(pixels), atol=1e-5, rtol=1e-5)


def test_resize_pos_grid_duplicates_up_and_averages_down():
    grid = torch.arange(4 * 4 * 3, dtype=torch.float32).reshape(4, 4, 3)
    up = path_model.resize_pos_grid(grid, 8)
    assert torch.equal(up, grid.repeat_interleave(2, 0).repeat_interleave(2, 1))
    assert torch.equal(path_model.resize_pos_grid(up, 4), grid)
    assert torch.equal(path_model.resize_pos_grid(grid, 4), grid)


def test_neighborhood_and_butterfly2d_masks_follow_the_tile_grid():
    side, tile = 16, (4, 4)  # 4 x 4 tiles
    config = MaskConfig(("neighborhood",), 16, window=(1, 1), global_blocks=0)
    mask = path_model.build_mask("neighborhood", side, config, "tile", tile)
    layout = mask.layout[0, 0]
    for a in range(16):
        for b in range(16):
            near = abs(a // 4 - b // 4) <= 1 and abs(a % 4 - b % 4) <= 1
            assert bool(layout[a, b]) == near, (a, b)
    with_global = path_model.build_mask("neighborhood", side, replace_mask(config, global_blocks=1), "tile", tile)
    assert with_global.layout[0, 0, 15, 0] and with_global.layout[0, 0, 0, 15]
    fly = path_model.build_mask("butterfly2d", side, replace_mask(config, global_blocks=0), "tile", tile).layout[0, 0]
    assert fly[0, 1] and fly[0, 2] and fly[0, 4] and fly[0, 8] and not fly[0, 3] and not fly[0, 5]
    with pytest.raises(path_model.ConfigError, match="needs --order tile"):
        path_model.build_mask("neighborhood", side, config)


def replace_mask(config, **changes):
    from dataclasses import replace

    return replace(config, **changes)


def test_mask_lists_and_densities():
    assert path_model.mask_specs("local", 3) == ("local",) * 3
    assert path_model.mask_specs("neighborhood,butterfly2d+local", 2) == ("neighborhood", "butterfly2d+local")
    with pytest.raises(path_model.ConfigError, match="lists 2 masks for 3 layers"):
        path_model.mask_specs("local,dense", 3)
    with pytest.raises(path_model.ConfigError, match="joined by"):
        path_model.mask_specs("diagonal", 1)
    config = MaskConfig(("butterfly",), 32)
    default = path_model.build_mask("butterfly", 32, config)
    assert default.nnz == 32 * 6 + 30 + 26 + 26  # butterfly + the band's other neighbour + row and column 0
    assert path_model.build_mask("butterfly", 256, MaskConfig(("butterfly",), 128)).density == pytest.approx(
        0.0253, abs=1e-4)
    local = MaskConfig(("neighborhood",), 128, window=(1, 1), global_blocks=1)
    assert path_model.build_mask("neighborhood", 256, local, "tile", (16, 8)).density == pytest.approx(0.0204, abs=1e-4)
    model = tiny_config(layers=2)
    masks = path_model.layer_masks(MaskConfig(("dense", "local"), 16), model)
    assert masks[0] is None and path_model.describe_masks(masks, MaskConfig(("dense", "local"), 16))["density"] < 1
    assert path_model.default_tile(128) == (16, 8) and path_model.default_tile(64) == (8, 8)


# ----------------------------------------------------------------------------------------------------
# Training pieces
# ----------------------------------------------------------------------------------------------------


def test_dihedral_augmentation_is_the_group_of_the_square():
    perms = path_train.dihedral_permutations(4)
    assert perms.shape == (8, 16) and len({tuple(p.tolist()) for p in perms}) == 8
    assert torch.equal(perms[0], torch.arange(16))
    image = torch.arange(16).reshape(4, 4)
    views = {tuple(v.reshape(-1).tolist()) for v in (image, image.T.flip(0), image.flip(0), image.flip(1))}
    assert views <= {tuple(p.tolist()) for p in perms}
    pixels = torch.randint(0, 256, (64, 16), dtype=torch.uint8)
    out = path_train.augment(pixels, perms, torch.Generator().manual_seed(0))
    candidates = pixels[:, perms]  # (64, 8, 16): every image under every symmetry
    used = [next(k for k in range(8) if torch.equal(candidates[i, k], out[i])) for i in range(64)]
    assert len(set(used)) == 8  # drawn per sample


@pytest.mark.parametrize("world", [2, 3])
def test_step_draws_do_not_depend_on_the_number_of_processes(world):
    """A step's flips and masked pixels are drawn for the global batch: the ranks' rows, in rank order, are one
    process's draws for the same global batch, so 1 and N GPUs train on the same images."""
    perms = path_train.dihedral_permutations(4)
    pixels = torch.randint(0, 256, (6 * world, 16), dtype=torch.uint8)

    def draws(dist, rows):
        generator = path_train.step_generator(7, 11, CPU)
        flipped = path_train.augment(pixels[rows], perms, generator, dist)
        return flipped, path_train.masked_positions(len(flipped), 16, generator, CPU, dist)

    one = draws(path_train.Dist(), slice(None))
    ranks = [draws(path_train.Dist(rank, world), slice(6 * rank, 6 * rank + 6)) for rank in range(world)]
    for whole, parts in zip(one, zip(*ranks)):
        assert torch.equal(torch.cat(parts), whole)
    other_step = path_train.augment(pixels, perms, path_train.step_generator(7, 12, CPU))
    assert not torch.equal(other_step, one[0])


def test_learning_rate_warms_up_then_decays_to_zero():
    lr = path_train.learning_rate
    assert lr(1.0, 10, 0, 0.0) == pytest.approx(0.1)
    assert lr(1.0, 10, 9, 0.0) == pytest.approx(1.0)
    assert lr(1.0, 10, 50, 0.5) == pytest.approx(0.5)
    assert lr(1.0, 10, 99, 1.0) == pytest.approx(0.0, abs=1e-12)


def test_batch_sampler_splits_the_global_batch_by_rank():
    ranks = [path_train.BatchSampler(12, 2, 0, path_train.Dist(rank, 3), CPU) for rank in range(3)]
    epoch = torch.cat([r(step) for step in range(2) for r in ranks])
    assert sorted(epoch.tolist()) == list(range(12))  # one epoch covers every image once
    assert not torch.equal(ranks[0](0), ranks[0](2))  # a new permutation each epoch
    with pytest.raises(path_model.ConfigError, match="global batch"):
        path_train.BatchSampler(5, 2, 0, path_train.Dist(0, 3), CPU)


def test_cache_lock_lets_one_process_generate_while_the_others_wait(tmp_path):
    events = []

    def hold(name, seconds):
        with path_train.file_lock(tmp_path / "set.lock"):
            events.append(f"{name} in")
            time.sleep(seconds)
            events.append(f"{name} out")

    first = threading.Thread(target=hold, args=("a", 0.3))
    first.start()
    time.sleep(0.05)
    second = threading.Thread(target=hold, args=("b", 0.0))
    second.start()
    first.join()
    second.join()
    assert events == ["a in", "a out", "b in", "b out"]


def test_atomic_save_never_leaves_a_partial_file(tmp_path):
    target = tmp_path / "ckpt.pt"
    target.write_text("good")

    def fails(path):
        path.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        path_train.save_atomically(target, fails)
    assert target.read_text() == "good" and list(tmp_path.iterdir()) == [target]


# ----------------------------------------------------------------------------------------------------
# Whole runs (fake data)
# ----------------------------------------------------------------------------------------------------


def test_tiny_run_writes_log_metrics_checkpoint_and_curves(tmp_path, fake_data, capsys):
    assert path256.main(run_flags(tmp_path, "--augment", "--head", "max", "--pos", "rope2d")) == 0
    out = tmp_path / "out"
    metrics = json.loads((out / "path32_sparse.json").read_text())
    assert [e["step"] for e in metrics["evals"]] == [2, 4]
    assert metrics["evals"][-1]["eval_count"] == 8 and metrics["model_config"]["pos"] == "rope2d"
    assert metrics["train_config"]["augment"] is True and metrics["lra_protocol"] is False
    assert (out / "path32_curves.png").stat().st_size > 0 and (out / "path32_sparse_ckpt.pt").exists()
    log = (out / "train.log").read_text()
    assert "\r" not in log and log.endswith("\n")
    line = next(s for s in log.splitlines() if "step 3/4" in s)
    for field in ("samples 12", "loss", "acc", "held-out 50.00%" if "held-out 50.00%" in line else "held-out",
                  "samples/s", "elapsed"):
        assert field in line, line


def test_resume_in_two_pieces_equals_one_run_bit_for_bit(tmp_path, fake_data):
    levers = ["--augment", "--dropout", "0.1", "--pretrain-steps", "2", "--pos", "learned+rope2d"]
    assert path256.main(run_flags(tmp_path, *levers, out="whole", steps=4)) == 0
    assert path256.main(run_flags(tmp_path, *levers, "--stop-after", "3", out="halves", steps=4)) == 0
    first = json.loads((tmp_path / "halves" / "path32_sparse.json").read_text())
    assert first["pieces"][-1]["stop"] == "--stop-after 3 steps" and not first["finished"]
    assert path256.main(run_flags(tmp_path, *levers, "--resume", out="halves", steps=4)) == 0
    whole = torch.load(tmp_path / "whole" / "path32_sparse_ckpt.pt", weights_only=True)
    halves = torch.load(tmp_path / "halves" / "path32_sparse_ckpt.pt", weights_only=True)
    assert whole["state"]["step"] == halves["state"]["step"] == 6
    for key, value in whole["model"].items():
        assert torch.equal(value, halves["model"][key]), key
    for a, b in zip(whole["optimizer"]["state"].values(), halves["optimizer"]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert [t["loss"] for t in whole["metrics"]["train_log"]] == [t["loss"] for t in halves["metrics"]["train_log"]]
    assert [t["phase"] for t in whole["metrics"]["train_log"]][:3] == ["pretrain", "pretrain", "classify"]
    assert len(halves["metrics"]["pieces"]) == 2 and halves["metrics"]["finished"]


def test_transfer_from_32_to_64_px_in_another_order(tmp_path, fake_data):
    assert path256.main(run_flags(tmp_path, out="low", steps=2)) == 0
    low = torch.load(tmp_path / "low" / "path32_sparse_ckpt.pt", weights_only=True)
    flags = run_flags(tmp_path, "--resolution", "64", "--order", "tile", "--tile", "4x4", "--mask", "neighborhood",
                      "--init-from", str(tmp_path / "low" / "path32_sparse_ckpt.pt"), out="high", steps=2)
    assert path256.main(flags) == 0
    metrics = json.loads((tmp_path / "high" / "path32_neighborhood.json").read_text())
    assert metrics["init_from"]["side"] == 8 and metrics["model_config"]["side"] == 16
    config = ModelConfig(**{**metrics["model_config"], "tile": tuple(metrics["model_config"]["tile"])})
    model = PixelTransformer(config, path_model.layer_masks(MaskConfig(("dense",), 16), config), "torch")
    model.load_state_dict(path_model.transfer_state(low["model"], model))
    assert torch.equal(model.pos_embed[::2, ::2], low["model"]["pos_embed"])  # each 8-px entry covers 2x2 pixels
    assert torch.equal(model.blocks[0].mlp[0].weight, low["model"]["blocks.0.mlp.0.weight"])


def test_eval_only_reports_accuracy_with_its_count(tmp_path, fake_data, capsys):
    assert path256.main(run_flags(tmp_path, steps=2)) == 0
    ckpt = str(tmp_path / "out" / "path32_sparse_ckpt.pt")
    capsys.readouterr()
    assert path256.main(["--eval-only", "--init-from", ckpt, "--n-eval", "12", "--device", "cpu", "--out",
                         str(tmp_path / "eval"), "--cache-dir", str(tmp_path / "cache"), "--backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "of 12 images" in out and "seed 1000000" in out
    report = json.loads((tmp_path / "eval" / "eval_only.json").read_text())
    assert report["count"] == 12 and 0 <= report["correct"] <= 12


def test_eval_only_on_another_task_rebuilds_model_and_masks(tmp_path, fake_data, capsys):
    """A tile-order 8-px model evaluated at 16 px (32-px images pooled 2x) with a 4x4 tile: the transfer path."""
    flags = run_flags(tmp_path, steps=2)
    flags[flags.index("--mask") + 1] = "neighborhood"
    assert path256.main(flags + ["--order", "tile", "--tile", "4x4"]) == 0
    ckpt = str(tmp_path / "out" / "path32_neighborhood_ckpt.pt")
    base = ["--eval-only", "--init-from", ckpt, "--n-eval", "12", "--device", "cpu", "--backend", "torch",
            "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "eval")]
    capsys.readouterr()
    assert path256.main(base + ["--pool", "2", "--tile", "8x2"]) == 0
    out = capsys.readouterr().out
    assert "Pathfinder-32 pooled 2x (16 px)" in out and "of 12 images" in out
    assert "must divide the image side 16" in error_of(capsys, base + ["--pool", "2", "--tile", "3x3"])
    assert "drop --width, --mask" in error_of(capsys, base + ["--width", "32", "--mask", "dense"])
    assert "drop --seed" in error_of(capsys, base + ["--seed", "5"])  # the checkpoint's images, model and masks


def test_compile_on_cpu_with_the_smallest_model(tmp_path, fake_data):
    assert path256.main(run_flags(tmp_path, "--compile", "aot_eager", steps=2)) == 0
    assert json.loads((tmp_path / "out" / "path32_sparse.json").read_text())["evals"][-1]["step"] == 2


def test_time_budget_stops_with_a_checkpoint_before_the_wall(tmp_path, fake_data):
    args = path256.parse_args(run_flags(tmp_path, steps=1000))
    spec = path256.plan_runs(args)[0]
    data = path_train.load_data(spec.data, args.cache_dir, 1, CPU, path_train.Dist(), path_train.RunLog(None))
    control = path_train.Control(time_budget=100.0, eval_every=1000, log_every=2, backend="torch",
                                 started=time.monotonic() - 97.0)  # 3 s left: less than the 5-s reserve
    metrics = path_train.Trainer(spec, control, data, CPU, path_train.Dist(), path_train.RunLog(None)).fit()
    assert metrics["pieces"][-1]["stop"].startswith("--time-budget 100 s") and metrics["evals"][-1]["step"] == 2
    assert path_train.read_checkpoint(spec.checkpoint_path, "test")["state"]["step"] == 2


def test_record_add_and_readme_section(tmp_path, fake_data, monkeypatch):
    monkeypatch.setattr(results_table, "CHECKPOINTS", tmp_path / "checkpoints")
    results = tmp_path / "results.json"
    assert path256.main(run_flags(tmp_path, "--record", "--results", str(results), steps=2)) == 0
    assert results_table.main(["--results", str(results), "add", str(tmp_path / "out"), "--stage", "tiny"]) == 0
    records = json.loads(results.read_text())
    assert len(records) == 2 and records[1]["stage"] == "tiny"
    needed = {"task", "resolution", "difficulty", "mask", "density", "layers", "width", "params", "n_train", "passes",
              "n_eval", "held_out_acc", "gpu_minutes", "samples_per_s", "peak_memory_gib", "checkpoint", "commit",
              "date", "gpus", "levers"}
    assert needed <= set(records[0])
    assert records[0]["task"] == "Pathfinder-32 pooled 4x (8 px)" and records[0]["passes"] == 1.0
    assert (tmp_path / "checkpoints" / "tiny.pt").exists()
    small = path_train.read_checkpoint(tmp_path / "checkpoints" / "tiny.pt", "test")
    assert "optimizer" not in small and small["state"]["step"] == 2
    assert path256.main(["--eval-only", "--init-from", str(tmp_path / "checkpoints" / "tiny.pt"), "--device", "cpu",
                         "--out", str(tmp_path / "eval"), "--cache-dir", str(tmp_path / "cache")]) == 0
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Path-256 demo results\n\n{results_table.START}\n{results_table.END}\n\n## after\n")
    assert results_table.main(["--results", str(results), "readme", "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "| Pathfinder-32 pooled 4x (8 px) | easy |" in text and text.endswith("## after\n")
    assert text.count(results_table.END) == 1


def test_bench_reports_sparse_and_dense_throughput(tmp_path, capsys):
    argv = ["--preset", "path32", "--pool", "4", "--layers", "1", "--width", "16", "--heads", "2", "--block-size",
            "16", "--batch-size", "2", "--bench", "--bench-steps", "2", "--device", "cpu", "--backend", "torch",
            "--out", str(tmp_path), "--mask", "local"]
    assert path256.main(argv) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [r["attention"] for r in rows] == ["block-sparse", "dense"] and rows[1]["density"] == 1.0
    assert all(r["samples_per_s"] > 0 and r["attention_tflops"] > 0 and r["step_tflops"] > 0 for r in rows)


def test_flops_count_nonzero_blocks_only():
    config = tiny_config(layers=2)
    dense = path_model.attention_flops(config, [None, None])
    assert dense == 2 * 4 * 64 * 64 * 16 * 3.5
    half = path_model.layer_masks(MaskConfig(("local", "dense"), 16), config)
    assert path_model.attention_flops(config, half) == pytest.approx(dense / 2 * (1 + half[0].density))


# ----------------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, message", [
    (["--width", "30"], "multiple of 4"),
    (["--steps", "0"], "must be a finite positive number"),
    (["--mask", "nope"], "joined by '+'"),
    (["--mask", "local,dense,local"], "lists 3 masks for 1 layers"),
    (["--mask", "neighborhood"], "needs --order tile"),
    (["--order", "tile", "--tile", "3x3"], "must divide the image side 8"),
    (["--order", "tile", "--tile", "4x2"], "in tile order a block is a tile"),
    (["--pool", "3"], "--pool 3 must divide --resolution 32"),
    (["--pool", "8"], "--pool 8 leaves 4-px images"),
    (["--pos", "rope"], "--pos takes components"),
    (["--n-train", "2"], "at least --batch-size"),
    (["--resume"], "--resume: no checkpoint at"),
    (["--init-from", "/nonexistent.pt"], "no such file"),
    (["--eval-only"], "--eval-only needs --init-from"),
    (["--eval-seed", "0"], "must differ from --seed"),
    (["--time-budget", "5"], "leaves no time to train"),
    (["--compile", "fast"], "invalid choice"),
    (["--lr", "nan"], "finite"),
    (["--lr", "inf"], "finite"),
    (["--weight-decay", "nan"], "finite"),
    (["--weight-decay", "inf"], "finite"),
    (["--dropout", "nan"], "finite"),
    (["--train-seconds", "nan"], "finite"),
    (["--ckpt-every-seconds", "inf"], "finite"),
    (["--device", "meta"], "--device meta"),
])
def test_bad_flags_give_one_line_and_exit_2(tmp_path, fake_data, capsys, extra, message):
    assert message in error_of(capsys, run_flags(tmp_path, *extra))


@pytest.mark.parametrize("extra, message", [
    (["--out", "{file}"], "--out must name a folder, got the file"),
    (["--out", "{file}/run"], "is a file, so"),
    (["--cache-dir", "{file}"], "--cache-dir must name a folder"),
    (["--bench", "--record", "x", "--results", "{file}"], "is not a readable results file"),
    (["--eval-only", "--init-from", "/nonexistent.pt", "--record"], "drop --record"),
    (["--device", "mps"], "the demo trains on cpu or cuda"),
    (["--order", "tile", "--mask", "neighborhood", "--window", str(2**70)], "--mask neighborhood with --block-size"),
])
def test_bad_paths_devices_and_masks_are_refused_before_any_work(tmp_path, fake_data, capsys, extra, message):
    """Found by the seventeenth probe: each of these printed a traceback (some after the run's work)."""
    (tmp_path / "not_a_folder").write_text("not json")
    extra = [a.format(file=tmp_path / "not_a_folder") for a in extra]
    assert message in error_of(capsys, run_flags(tmp_path, *extra))
    assert not (tmp_path / "out").exists()  # refused before the run made its folder


def test_smoke_preset_refuses_a_block_size_its_masks_cannot_take(tmp_path, capsys):
    assert "--block-size 7 cannot build" in error_of(capsys, ["--preset", "smoke", "--block-size", "7", "--device",
                                                              "cpu", "--out", str(tmp_path / "out")])


def test_an_explicit_triton_backend_that_cannot_run_is_refused_first(tmp_path, fake_data, capsys, monkeypatch):
    monkeypatch.setattr(path256.sparse_flash.api, "triton_unavailable_reason", lambda device: "no kernels here")
    flags = run_flags(tmp_path)
    flags[flags.index("--backend") + 1] = "triton"
    assert "--backend triton cannot run on cpu: no kernels here" in error_of(capsys, flags)


def test_pool_without_generator_support_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(path_train.pathfinder, "load_or_generate", lambda n, resolution, difficulty, seed, **kw: None)
    assert "not in this checkout" in error_of(capsys, run_flags(tmp_path))


def test_bad_checkpoints_give_one_line_and_exit_2(tmp_path, fake_data, capsys):
    assert path256.main(run_flags(tmp_path, steps=2)) == 0
    ckpt = tmp_path / "out" / "path32_sparse_ckpt.pt"
    good = ckpt.read_bytes()
    assert "was trained with other settings (lr" in error_of(capsys, run_flags(tmp_path, "--resume", "--lr", "0.5"))
    wider = run_flags(tmp_path, "--init-from", str(ckpt), "--width", "32", out="wide")
    assert "the checkpoint's model differs (width 16 vs 32)" in error_of(capsys, wider)
    ckpt.write_bytes(good[: len(good) // 2])
    assert "is corrupt or truncated" in error_of(capsys, run_flags(tmp_path, "--resume"))
    ckpt.write_bytes(b"not a checkpoint at all")
    assert "is corrupt or truncated" in error_of(capsys, ["--eval-only", "--init-from", str(ckpt)])
    torch.save({"weights": 1}, ckpt)
    assert "is not a path256 checkpoint" in error_of(capsys, run_flags(tmp_path, "--resume"))
    # ours in format, but with fields missing or invalid
    checkpoint = torch.load(io.BytesIO(good), weights_only=True)
    damaged = [({"format": checkpoint["format"]}, "lacks"), ({**checkpoint, "model": None}, "lacks model"),
               ({**checkpoint, "model_config": {**checkpoint["model_config"], "colour": 1}}, "invalid"),
               ({**checkpoint, "model_config": {**checkpoint["model_config"], "heads": 0}}, "heads"),
               ({**checkpoint, "model_config": {**checkpoint["model_config"], "width": "abc"}}, "width")]
    for contents, message in damaged:
        torch.save(contents, ckpt)
        assert message in error_of(capsys, ["--eval-only", "--init-from", str(ckpt)])
        assert message in error_of(capsys, run_flags(tmp_path, "--init-from", str(ckpt), out="init"))


def test_presets_fill_unset_flags_and_flags_win():
    args = path256.parse_args(["--preset", "path32hard", "--layers", "3"])
    assert (args.layers, args.width, args.heads, args.batch_size, args.resolution, args.difficulty) == (
        3, 128, 4, 256, 32, "hard")
    assert (args.n_train, args.n_eval, args.lr, args.pos, args.head, args.augment, args.compile) == (
        160_000, 20_000, 1e-3, "sincos", "max", True, "auto")
    assert args.eval_seed == args.seed + path_train.EVAL_SEED_OFFSET and args.out.endswith("runs/path32hard")
    assert path256.make_control(args, CPU, 0.0).compile == "off"  # compiled on the GPU only
    assert [(r.name, r.mask.layers[0]) for r in path256.plan_runs(path256.parse_args(["--preset", "path32"]))] == [
        ("dense", "dense"), ("sparse", "butterfly")]
    runs = path256.plan_runs(path256.parse_args(["--preset", "path256"]))
    assert [(r.name, r.train.steps) for r in runs] == [("sparse", 400), ("dense", 20)]


def test_smoke_preset_pipeline_on_real_images(tmp_path, capsys):
    argv = ["--steps", "12", "--log-every", "4", "--eval-every", "12", "--batch-size", "4", "--n-train", "4",
            "--n-eval", "4", "--out", str(tmp_path / "smoke"), "--cache-dir", str(tmp_path / "cache"), "--workers",
            "1", "--device", "cpu", "--backend", "torch"]
    assert path256.main(argv) == 0
    out = capsys.readouterr().out
    assert "max |out diff|" in out and "smoke preset passed: the loss fell." in out and "neighborhood" in out


def test_a_long_evaluation_prints_its_progress(monkeypatch, capsys):
    """An evaluation that takes longer than EVAL_PROGRESS_SECONDS says how far it is, so a log is never silent."""

    class Constant(torch.nn.Module):
        def forward(self, pixels):
            return torch.stack([torch.zeros(len(pixels)), torch.ones(len(pixels))], 1)

    monkeypatch.setattr(path_train, "EVAL_PROGRESS_SECONDS", 0.0)
    images, labels = torch.zeros(10, 4, dtype=torch.uint8), torch.tensor([1, 0] * 5)
    result = path_train.evaluate(Constant(), images, labels, 4, torch.device("cpu"), path_train.Dist())
    assert (result["correct"], result["count"]) == (5, 10)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("evaluating:")]
    assert lines == ["evaluating: 4/10 held-out images, 0 s, ~0 s left", "evaluating: 8/10 held-out images, 0 s, ~0 s left"]


def test_record_takes_a_larger_evaluation_from_an_eval_only_report(tmp_path, fake_data, monkeypatch):
    monkeypatch.setattr(results_table, "CHECKPOINTS", tmp_path / "checkpoints")
    results = tmp_path / "results.json"
    assert path256.main(run_flags(tmp_path, steps=2)) == 0
    ckpt = tmp_path / "out" / "path32_sparse_ckpt.pt"
    assert path256.main(["--eval-only", "--init-from", str(ckpt), "--n-eval", "12", "--eval-seed", "7", "--device",
                         "cpu", "--out", str(tmp_path / "eval"), "--cache-dir", str(tmp_path / "cache"),
                         "--backend", "torch"]) == 0
    report_path = tmp_path / "eval" / "eval_only.json"
    report = json.loads(report_path.read_text())
    assert report["step"] == 2
    assert results_table.main(["--results", str(results), "add", str(tmp_path / "out"), "--stage", "first",
                               "--eval-report", str(report_path)]) == 0
    record = json.loads(results.read_text())[0]
    assert (record["n_eval"], record["held_out_correct"], record["eval_seed"]) == (12, report["correct"], 7)
    assert record["training_eval"]["eval_seed"] == 1_000_000 and record["training_eval"]["n_eval"] != 12
    assert record["source_checkpoint"].endswith("path32_sparse_ckpt.pt")
    # a run started from the recorded checkpoint names the stage it came from
    assert path256.main(run_flags(tmp_path, "--init-from", str(tmp_path / "checkpoints" / "first.pt"), steps=2,
                                  out="second")) == 0
    assert results_table.main(["--results", str(results), "add", str(tmp_path / "second")]) == 0
    assert json.loads(results.read_text())[1]["levers"]["init_stage"] == "first"
    # a report of another step or another checkpoint is refused
    report_path.write_text(json.dumps(dict(report, step=1)))
    with pytest.raises(SystemExit, match="at step 1, not path32_sparse_ckpt.pt at step 2"):
        results_table.add_run(tmp_path / "out", None, results, report_path)
    report_path.write_text(json.dumps(dict(report, checkpoint="elsewhere/other_ckpt.pt")))
    with pytest.raises(SystemExit, match="no checkpoint of"):
        results_table.add_run(tmp_path / "out", None, results, report_path)


def test_eval_only_batch_fits_a_cpu():
    """A 256-px checkpoint trained with batch 32 evaluates 2 images at a time on a CPU (32 would need ~50 GB)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert path256.eval_batch_size(32, 65_536, cpu) == 2
    assert path256.eval_batch_size(32, 65_536, cuda) == 32
    assert path256.eval_batch_size(256, 1_024, cpu) == 128 and path256.eval_batch_size(8, 1_024, cpu) == 8
    assert path256.eval_batch_size(4, 1_000_000, cpu) == 1
