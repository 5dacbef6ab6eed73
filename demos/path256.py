"""Path-256: a pixel transformer that reads 65,536 tokens, trainable because its attention is block-sparse.

A Pathfinder image (see demos/pathfinder.py) asks whether two circles lie on the same dashed path.
Flattened, a 256 x 256 image is a sequence of 65,536 pixel tokens. Naive attention builds a 65,536 x 65,536
score matrix per head, 8 GiB per head per sample in bf16, and training keeps one for every head of every
layer. `sparse_flash.block_sparse_attention` computes exact softmax attention over the nonzero blocks of a
block mask and never builds that matrix, so the same small transformer trains at this length in a few GiB.

The model (demos/path_model.py): pixel values through an embedding, positions in image units (learned grid,
2-D sin/cos, 2-D RoPE), pre-LN blocks with one block mask per layer, row-major or tile-major token order,
mean or max pooling, and a pixel head for masked-pixel self-pretraining. Training (demos/path_train.py):
AdamW, warm-up + cosine, bf16 autocast on GPU, dihedral flips, resumable in pieces. Results
(demos/results_table.py): records in demos/results/results.json and the README section.

Presets set the default of every flag; flags given explicitly override them:
  smoke      (default) CPU pipeline check in under 3 minutes: masks, block-sparse against dense attention,
             and overfitting one small batch. Learning the task needs a GPU.
  path32     GPU: dense and block-sparse attention on easy 32-px images, 4 minutes each.
  path32hard GPU: LRA's Pathfinder-32 hard (160K training, 20K held-out images), 4 layers, width 128,
             sin/cos positions, flips, max pooling, compiled: the starting point of the recipe search.
  path256    GPU: 65,536 tokens. Block-sparse training, a short dense FlashAttention run for comparison.
`--mask` runs that one mask (or one per layer) instead of the preset's comparison.

Modes: `--prepare-data` generates the data cache and exits; `--eval-only --init-from CKPT` evaluates a
checkpoint on freshly generated held-out images; `--bench` times training steps with block-sparse and dense
FlashAttention on the same model.

Usage:
    python demos/path256.py
    python demos/path256.py --preset path32hard --out runs/a --cache-dir .cache/pathfinder
    python demos/path256.py --preset path32hard --out runs/a --cache-dir .cache/pathfinder --resume
    python demos/path256.py --preset path256 --resolution 256 --pool 4 --order tile --mask neighborhood --out r64
    python demos/path256.py --preset path256 --order tile --mask neighborhood --init-from r64/path256_neighborhood_ckpt.pt
    python demos/path256.py --eval-only --init-from demos/checkpoints/path32hard.pt
    python demos/path256.py --preset path256 --order tile --mask neighborhood --bench --record

Everything goes to --out (default demos/runs/<preset>/, git-ignored): `train.log` (plain lines), `<preset>_<run>.json`
metrics, `<preset>_<run>_ckpt.pt` checkpoints (atomic), `<preset>_summary.json` and `<preset>_curves.png`.
Exit status 2 with one line on stderr for every bad flag, checkpoint or combination.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

import pathfinder
import results_table
import sparse_flash
from path_model import (
    HEADS, MASK_NAMES, ORDERS, TILED_MASKS, ConfigError, MaskConfig, ModelConfig, PixelTransformer,
    attention_flops, build_mask, default_tile, describe_masks, layer_masks, mask_specs, parse_pair, parse_pos,
    step_flops, transfer_state,
)
from path_train import (
    EVAL_SEED_OFFSET, Control, Data, DataConfig, Dist, RunLog, RunSpec, TrainConfig, Trainer, autocast,
    check_init, compiled, check_resume, checkpoint_configs, classify_step, environment, evaluate, generator_takes_pool,
    load_data, make_optimizer, peak_memory_gib, read_checkpoint, write_json,
)

COMPILE_CHOICES = ("off", "auto", "inductor", "aot_eager", "eager")
PRESETS: dict[str, dict] = {
    "smoke": dict(
        resolution=32, difficulty="easy", block_size=32, layers=2, width=32, heads=2, mlp_ratio=2, pos="sincos+learned",
        batch_size=8, lr=1e-2, weight_decay=0.0, warmup=5, steps=40, train_seconds=0.0, compare_steps=0,
        n_train=8, n_eval=16, eval_every=20, log_every=5,
    ),
    "path32": dict(
        resolution=32, difficulty="easy", block_size=32, layers=4, width=128, heads=4, mlp_ratio=2,
        pos="sincos+learned", batch_size=256, lr=1e-3, weight_decay=0.05, warmup=100, steps=20_000,
        train_seconds=240.0, compare_steps=0, n_train=160_000, n_eval=10_000, eval_every=500, log_every=25,
    ),
    "path32hard": dict(
        resolution=32, difficulty="hard", block_size=32, layers=4, width=128, heads=4, mlp_ratio=2, pos="sincos",
        head="max", augment=True, compile="auto", batch_size=256, lr=1e-3, weight_decay=0.05, warmup=500,
        steps=200_000, train_seconds=1200.0, compare_steps=0, n_train=160_000, n_eval=20_000, eval_every=1000,
        log_every=50, mask="butterfly",
    ),
    "path256": dict(
        resolution=256, difficulty="easy", block_size=128, layers=2, width=64, heads=2, mlp_ratio=2,
        pos="sincos+learned", batch_size=8, lr=1e-3, weight_decay=0.05, warmup=30, steps=400, train_seconds=240.0,
        compare_steps=20, n_train=2048, n_eval=256, eval_every=100, log_every=5,
    ),
}
FLAG_DEFAULTS = dict(  # defaults of the flags no preset sets
    pool=1, order="row", window="1", global_blocks=1, head="mean", dropout=0.0, augment=False, pretrain_steps=0,
    compile="off", mask=None, tile=None, seed=0,
)


class Parser(argparse.ArgumentParser):
    """Flag errors as one line (and exit status 2), never a usage dump or a traceback."""

    def error(self, message: str):
        raise ConfigError(message)


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a finite positive number, got {text}")
        return value

    return parse


def non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"must be a finite number, zero or positive, got {text}")
        return value

    return parse


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build_parser() -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0], epilog=__doc__[__doc__.index("Presets"):],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("task and data")
    add = group.add_argument
    add("--preset", choices=sorted(PRESETS), default="smoke", help="defaults for every flag (default: smoke)")
    add("--resolution", type=int, choices=sorted(pathfinder.PRESETS), help="generated image side in pixels")
    add("--pool", type=positive(int), help="average pool x pool squares: the model reads resolution/pool px")
    add("--difficulty", choices=list(pathfinder.DIFFICULTIES), help="Pathfinder difficulty")
    add("--n-train", type=positive(int), help="distinct training images (LRA: 160,000; more departs from it)")
    add("--n-eval", type=positive(int), help="held-out images (LRA: 20,000)")
    add("--seed", type=non_negative(int), help="training images, model and mask seed (default 0)")
    add("--eval-seed", type=non_negative(int), help=f"held-out images' seed (default: seed + {EVAL_SEED_OFFSET:,})")
    add("--cache-dir", default="~/.cache/sparse_flash/pathfinder", help="dataset cache (shared by concurrent runs)")
    add("--workers", type=positive(int), default=default_workers(), help="dataset generation processes")
    group = parser.add_argument_group("model")
    add = group.add_argument
    add("--layers", type=positive(int), help="transformer blocks")
    add("--width", type=positive(int), help="model width (a multiple of 4 and of --heads)")
    add("--heads", type=positive(int), help="attention heads")
    add("--mlp-ratio", type=positive(int), help="MLP hidden width / model width")
    add("--pos", help="positions: learned, sincos, rope2d, or several joined by '+' (sincos+learned)")
    add("--order", choices=ORDERS, help="token order: row-major pixels, or tile by tile (a block = a tile)")
    add("--tile", help="tile RxC in pixels for --order tile (default: the most square tile of --block-size)")
    add("--mask", help=f"one mask for every layer or a comma list, one per layer; names {', '.join(MASK_NAMES)}, "
                       "joined by '+' for a union (default: the preset's comparison)")
    add("--block-size", type=positive(int), help="mask block size in tokens (in tile order: the tile's pixels)")
    add("--window", help="neighborhood window in tiles, N or RxC (default 1)")
    add("--global-blocks", type=non_negative(int), help="global tiles added to neighborhood and butterfly2d")
    add("--head", choices=HEADS, help="pooling over the tokens before the classifier")
    add("--dropout", type=non_negative(float), help="dropout on embeddings, attention and MLP outputs")
    group = parser.add_argument_group("training")
    add = group.add_argument
    add("--batch-size", type=positive(int), help="images per step per GPU")
    add("--lr", type=positive(float), help="peak learning rate")
    add("--weight-decay", type=non_negative(float), help="AdamW weight decay")
    add("--warmup", type=non_negative(int), help="linear warm-up steps")
    add("--steps", type=positive(int), help="classification steps of the cosine schedule")
    add("--train-seconds", type=non_negative(float), help="training seconds the schedule spans over all pieces "
                                                          "(ends the run; 0: steps only)")
    add("--pretrain-steps", type=non_negative(int), help="masked-pixel self-pretraining steps before classifying")
    add("--augment", action=argparse.BooleanOptionalAction, help="the 8 flips/rotations of the square per sample")
    add("--compare-steps", type=positive(int), help="steps of path256's short dense comparison run")
    add("--compile", nargs="?", const="inductor", choices=COMPILE_CHOICES,
        help="torch.compile the model (bare flag: inductor; auto: inductor on GPU, off on CPU)")
    add("--backend", choices=sparse_flash.api.BACKENDS, default="auto", help="attention backend")
    add("--device", help="torch device (default: cuda when available, else cpu)")
    group = parser.add_argument_group("pieces, output and modes")
    add = group.add_argument
    add("--out", help="run folder (default: demos/runs/<preset>, git-ignored)")
    add("--time-budget", type=non_negative(float), default=0.0,
        help="wall seconds this process may run; it stops in time for a last evaluation and checkpoint")
    add("--stop-after", type=non_negative(int), default=0, help="stop this process after N steps (a piece)")
    add("--resume", action="store_true", help="continue the run from its checkpoint in --out (exactly)")
    add("--init-from", metavar="CKPT", help="start from another run's weights (any resolution, order, tile)")
    add("--eval-every", type=positive(int), help="classification steps between held-out evaluations")
    add("--log-every", type=positive(int), help="steps between log lines (GPU syncs)")
    add("--ckpt-every-seconds", type=positive(float), default=60.0, help="checkpoint cadence (default 60)")
    add("--concurrent", type=positive(int), default=1, help="runs sharing this GPU (recorded in the results)")
    add("--record", nargs="?", const="", metavar="STAGE",
        help="append the run to demos/results/results.json; with STAGE also export demos/checkpoints/STAGE.pt")
    add("--results", default=str(results_table.RESULTS), help="results file for --record")
    add("--prepare-data", action="store_true", help="generate the data cache and exit")
    add("--eval-only", action="store_true", help="evaluate --init-from on fresh held-out images and exit")
    add("--bench", action="store_true", help="time training with block-sparse and dense attention and exit")
    add("--bench-steps", type=positive(int), default=10, help="timed steps per model in --bench")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse flags, fill every flag left unset from the preset, and check them together (ConfigError)."""
    args = build_parser().parse_args(argv)
    args.explicit = {key for key, value in vars(args).items() if value is not None}
    for key, value in {**FLAG_DEFAULTS, **PRESETS[args.preset]}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = str(Path(__file__).resolve().parent / "runs" / args.preset)  # git-ignored
    if args.eval_seed is None:
        args.eval_seed = args.seed + EVAL_SEED_OFFSET
    args.pos = parse_pos(args.pos)
    args.window = parse_pair(args.window, "--window")
    check_args(args)
    return args


def check_args(args) -> None:
    """Every combination that cannot run, as a ConfigError naming the flags."""
    modes = [flag for flag in ("prepare_data", "eval_only", "bench") if getattr(args, flag)]
    if len(modes) > 1:
        raise ConfigError(f"--{modes[0].replace('_', '-')} and --{modes[1].replace('_', '-')} are separate modes")
    if args.resume and args.init_from:
        raise ConfigError("--resume continues this run from --out; --init-from starts a new one: pass one of them")
    if args.eval_only and not args.init_from:
        raise ConfigError("--eval-only needs --init-from CKPT (the checkpoint to evaluate)")
    if args.eval_only and args.record is not None:
        raise ConfigError("--record keeps training and --bench runs; --eval-only prints its result: drop --record")
    check_paths(args)
    if args.resolution % args.pool:
        raise ConfigError(f"--pool {args.pool} must divide --resolution {args.resolution}")
    if args.resolution // args.pool < 8:
        raise ConfigError(f"--pool {args.pool} leaves {args.resolution // args.pool}-px images of --resolution "
                          f"{args.resolution}; the model needs 8 px or more")
    if args.pool > 1 and not args.bench and not generator_takes_pool():  # --bench reads no images
        raise ConfigError("--pool needs demos/pathfinder.py's load_or_generate(..., pool=...), not in this checkout")
    if args.eval_seed == args.seed:
        raise ConfigError(f"--eval-seed must differ from --seed ({args.seed}): held-out images must be new images")
    if args.eval_only:
        return  # the model and data come from the checkpoint
    side = args.resolution // args.pool
    if args.width % args.heads or args.width % 4:
        raise ConfigError(f"--width must be a multiple of 4 and of --heads ({args.heads}), got {args.width}")
    head_dim, (lo, hi) = args.width // args.heads, sparse_flash.api.HEAD_DIM_RANGE
    if not lo <= head_dim <= hi:
        raise ConfigError(f"--width / --heads must be between {lo} and {hi} (the head dimension), got {head_dim}")
    if "rope2d" in args.pos and head_dim % 4:
        raise ConfigError(f"--pos rope2d needs a head dimension (width / heads) that is a multiple of 4, got {head_dim}")
    if args.n_train < args.batch_size and not args.bench:
        raise ConfigError(f"--n-train ({args.n_train}) must be at least --batch-size ({args.batch_size})")
    if args.dropout >= 1:
        raise ConfigError(f"--dropout must be below 1, got {args.dropout}")
    if args.order == "tile":
        args.tile = parse_pair(args.tile, "--tile") if args.tile else default_tile(args.block_size)
        if min(args.tile) < 1 or side % args.tile[0] or side % args.tile[1]:
            raise ConfigError(f"--tile {args.tile[0]}x{args.tile[1]} must divide the image side {side} "
                              f"(resolution {args.resolution} / pool {args.pool})")
        if "block_size" in args.explicit and args.tile[0] * args.tile[1] != args.block_size:
            raise ConfigError(f"--tile {args.tile[0]}x{args.tile[1]} holds {args.tile[0] * args.tile[1]} pixels but "
                              f"--block-size is {args.block_size}: in tile order a block is a tile")
        args.block_size = args.tile[0] * args.tile[1]
    elif args.tile:
        raise ConfigError("--tile applies to --order tile")
    else:
        args.tile = (1, 1)
    if args.mask is not None:
        specs = mask_specs(args.mask, args.layers)
        if args.order != "tile" and any(name in TILED_MASKS for spec in specs for name in spec.split("+")):
            raise ConfigError(f"--mask {args.mask} holds a 2-D mask over image tiles: it needs --order tile")
    if args.resume:
        for spec in plan_runs(args):
            if not spec.checkpoint_path.is_file():
                raise ConfigError(f"--resume: no checkpoint at {spec.checkpoint_path}; start the run without --resume")
    if args.init_from and not Path(args.init_from).is_file():
        raise ConfigError(f"--init-from: no such file: {args.init_from}")
    if args.time_budget and args.time_budget < 30:
        raise ConfigError(f"--time-budget {args.time_budget:g} s leaves no time to train; give 30 s or more (0: none)")
    if not args.resume:
        for spec in plan_runs(args):  # a mask the flags cannot build fails here, not after the data is made
            try:
                layer_masks(spec.mask, spec.model, device="cpu")
            except (ValueError, TypeError) as error:
                raise ConfigError(f"--mask {args.mask or 'of the preset'} with --block-size {args.block_size}, "
                                  f"--window and --tile as given: {error}") from None


def check_paths(args) -> None:
    """--out, --cache-dir (unless --bench, which reads no images) and, with --record, --results: usable before
    any work (ConfigError)."""
    folders = {"--out": args.out, "--cache-dir": None if args.bench else args.cache_dir,
               "--results' folder": Path(args.results).parent if args.record is not None else None}
    for flag, folder in folders.items():
        if folder is not None:
            try:
                sparse_flash.checks.output_folder(folder, flag)
            except ValueError as error:
                raise ConfigError(str(error)) from None
    if args.record is not None and Path(args.results).exists():
        try:
            json.loads(Path(args.results).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise ConfigError(f"--results {args.results} is not a readable results file (JSON): {error}") from None


# ----------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------


def run_name(mask: str) -> str:
    """Runs are named "dense", "sparse" (the default butterfly mask) or after their masks."""
    return {"dense": "dense", "butterfly": "sparse"}.get(mask, mask.replace(",", "_").replace("+", "-"))


def model_config(args) -> ModelConfig:
    return ModelConfig(side=args.resolution // args.pool, width=args.width, layers=args.layers, heads=args.heads,
                       mlp_ratio=args.mlp_ratio, pos=args.pos, order=args.order, tile=tuple(args.tile),
                       head=args.head, dropout=args.dropout)


def data_config(args) -> DataConfig:
    return DataConfig(resolution=args.resolution, pool=args.pool, difficulty=args.difficulty, n_train=args.n_train,
                      n_eval=args.n_eval, seed=args.seed, eval_seed=args.eval_seed)


def plan_runs(args) -> list[RunSpec]:
    """The runs of a preset: its comparison (dense and butterfly; path256: butterfly, then a short dense timing
    run), or the one `--mask` names."""

    def spec(mask: str, steps: int, train_seconds: float) -> RunSpec:
        train = TrainConfig(batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                            warmup=args.warmup, steps=steps, train_seconds=train_seconds,
                            pretrain_steps=args.pretrain_steps, augment=args.augment, seed=args.seed)
        masks_ = MaskConfig(layers=mask_specs(mask, args.layers), block_size=args.block_size,
                            window=tuple(args.window), global_blocks=args.global_blocks, seed=args.seed)
        return RunSpec(run_name(mask), args.preset, model_config(args), masks_, data_config(args), train,
                       Path(args.out))

    if args.mask is not None:
        return [spec(args.mask, args.steps, args.train_seconds)]
    if args.preset == "path256":
        return [spec("butterfly", args.steps, args.train_seconds),
                spec("dense", args.compare_steps, args.train_seconds / 4)]
    return [spec("dense", args.steps, args.train_seconds), spec("butterfly", args.steps, args.train_seconds)]


def make_control(args, device: torch.device, started: float) -> Control:
    compile_backend = args.compile
    if compile_backend == "auto":
        compile_backend = "inductor" if device.type == "cuda" else "off"
    return Control(time_budget=args.time_budget, stop_after=args.stop_after, eval_every=args.eval_every,
                   log_every=args.log_every, ckpt_every_seconds=args.ckpt_every_seconds, compile=compile_backend,
                   backend=args.backend, resume=args.resume, init_from=args.init_from, concurrent=args.concurrent,
                   started=started)


def write_summary(args, results: dict[str, dict], specs: list[RunSpec], device: torch.device, dist: Dist) -> None:
    """Print and write the runs' outcomes, the naive-attention estimate and the learning curves (rank 0)."""
    rows = {name: results_table.final_row(m) for name, m in results.items() if m["evals"]}
    if not rows:
        return
    on_gpu = device.type == "cuda"
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if on_gpu else None
    side = specs[0].model.side
    naive = results_table.naive_attention_memory(side**2, args.batch_size, args.heads, args.layers,
                                                 2 if on_gpu else 4, gpu_bytes, rows)
    results_table.print_summary(rows)
    print(naive["statement"])
    out = Path(args.out)
    summary = {"preset": args.preset, "runs": rows, "naive_attention": naive, "environment": environment(device, dist)}
    write_json(out / f"{args.preset}_summary.json", summary)
    title = f"Pathfinder {side} px ({args.difficulty}), {args.layers} layers, width {args.width}"
    results_table.plot_curves({n: results[n] for n in rows}, out / f"{args.preset}_curves.png", title)
    print(f"wrote {out / f'{args.preset}_summary.json'} and {out / f'{args.preset}_curves.png'}")


def record_runs(args, results: dict[str, dict], specs: list[RunSpec]) -> None:
    """`--record [STAGE]`: append each run to the results file (exporting its checkpoint for a stage)."""
    for spec in specs:
        metrics = results[spec.name]
        if not metrics["evals"]:
            continue
        checkpoint, curves = spec.checkpoint_path, Path(args.out) / f"{args.preset}_curves.png"
        if args.record:
            checkpoint = results_table.export_checkpoint(checkpoint, args.record)
        record = results_table.make_record(metrics, results_table.repo_relative(checkpoint),
                                           results_table.repo_relative(curves) if curves.exists() else None)
        if args.record:
            record["stage"] = args.record
        results_table.append_records([record], Path(args.results))
        print(f"recorded {record['run']} in {args.results}: held-out {record['held_out_acc']:.2%}")


def run_training(args, device: torch.device, dist: Dist, log: RunLog, started: float) -> dict[str, dict]:
    """Train the planned runs one after the other, then summarise and record them."""
    specs = plan_runs(args)
    for spec in specs:  # checkpoints that cannot serve fail now, before the data is made
        if args.resume:
            check_resume(spec, read_checkpoint(spec.checkpoint_path, "--resume"), dist.world)
        elif args.init_from:
            check_init(spec, read_checkpoint(args.init_from, "--init-from"), args.init_from)
    data = load_data(data_config(args), args.cache_dir, args.workers, device, dist, log)
    control = make_control(args, device, started)
    results = {spec.name: Trainer(spec, control, data, device, dist, log).fit() for spec in specs}
    if dist.is_main:
        write_summary(args, results, specs, device, dist)
        if args.record is not None:
            record_runs(args, results, specs)
    return results


# ----------------------------------------------------------------------------------------------------
# Modes: prepare data, evaluate a checkpoint, benchmark
# ----------------------------------------------------------------------------------------------------


EVAL_TRANSFER_FLAGS = ("resolution", "pool", "difficulty", "tile")  # --eval-only on another task than training's
EVAL_MODEL_FLAGS = ("layers", "width", "heads", "mlp_ratio", "pos", "order", "mask", "block_size", "window",
                    "global_blocks", "head", "dropout", "n_train", "lr", "weight_decay", "warmup", "steps",
                    "train_seconds", "pretrain_steps", "augment", "compare_steps", "seed")  # the checkpoint's own


def eval_configs(args, checkpoint: dict) -> tuple[ModelConfig, MaskConfig, DataConfig]:
    """The checkpoint's model, mask and data configs, moved to the task that `EVAL_TRANSFER_FLAGS` name (another
    resolution, pooling, difficulty or tile: positions are in image units, masks are rebuilt for the new side)."""
    model_cfg, mask_cfg, data_cfg, _ = checkpoint_configs(checkpoint)
    ignored = [f"--{name.replace('_', '-')}" for name in EVAL_MODEL_FLAGS if name in args.explicit]
    if ignored:
        raise ConfigError(f"--eval-only takes the model, mask and training flags from the checkpoint; drop "
                          f"{', '.join(ignored)} (it may change {', '.join('--' + f for f in EVAL_TRANSFER_FLAGS)})")
    given = {name: getattr(args, name) for name in ("resolution", "pool", "difficulty", "n_eval", "eval_seed")
             if name in args.explicit}
    data_cfg = replace(data_cfg, **given)
    if data_cfg.eval_seed == data_cfg.seed:
        raise ConfigError(f"--eval-seed {data_cfg.eval_seed} is the checkpoint's training seed: pick another")
    if data_cfg.resolution % data_cfg.pool:
        raise ConfigError(f"--pool {data_cfg.pool} must divide the resolution {data_cfg.resolution}")
    if data_cfg.pool > 1 and not generator_takes_pool():
        raise ConfigError("pooled images need demos/pathfinder.py's load_or_generate(..., pool=...), not in this checkout")
    side = data_cfg.resolution // data_cfg.pool
    tile = model_cfg.tile
    if "tile" in args.explicit:
        if model_cfg.order != "tile":
            raise ConfigError(f"--tile applies to a model in tile order; the checkpoint's order is {model_cfg.order}")
        tile = parse_pair(args.tile, "--tile")
    if model_cfg.order == "tile":
        if min(tile) < 1 or side % tile[0] or side % tile[1]:
            raise ConfigError(f"tile {tile[0]}x{tile[1]} must divide the image side {side} (resolution "
                              f"{data_cfg.resolution} / pool {data_cfg.pool}): pass --tile")
        mask_cfg = replace(mask_cfg, block_size=tile[0] * tile[1])
    return replace(model_cfg, side=side, tile=tuple(tile)), mask_cfg, data_cfg


CPU_EVAL_TOKENS = 131_072  # tokens per evaluation batch on a CPU: about 2 GB per 65,536 (torch backend, no grad)


def eval_batch_size(train_batch: int, tokens: int, device: torch.device) -> int:
    """`--eval-only`'s batch when `--batch-size` is not given: the training batch on a GPU; on a CPU at most
    `CPU_EVAL_TOKENS` tokens (2 images at 256 px, where the training batch of 32 would need ~50 GB)."""
    return train_batch if device.type == "cuda" else max(1, min(train_batch, CPU_EVAL_TOKENS // tokens))


def eval_only(args, device: torch.device, dist: Dist, log: RunLog) -> dict:
    """Evaluate `--init-from` on freshly generated held-out images of its own task, or of the task the
    `EVAL_TRANSFER_FLAGS` name; print accuracy and count."""
    checkpoint = read_checkpoint(args.init_from, "--init-from")
    train_cfg = checkpoint_configs(checkpoint)[3]
    model_cfg, mask_cfg, data_cfg = eval_configs(args, checkpoint)
    model = PixelTransformer(model_cfg, layer_masks(mask_cfg, model_cfg, device), args.backend).to(device)
    try:
        model.load_state_dict(transfer_state(checkpoint["model"], model))
    except RuntimeError as error:
        raise ConfigError(f"--init-from {args.init_from}: weights do not fit its own config ({str(error)[:160]})")
    data = load_data(data_cfg, args.cache_dir, args.workers, device, dist, log, splits=("eval",))
    started = time.perf_counter()
    batch_size = args.batch_size if "batch_size" in args.explicit else eval_batch_size(
        train_cfg.batch_size, model_cfg.side**2, device)
    result = evaluate(model, data.eval_images, data.eval_labels, batch_size, device, dist)
    seconds = time.perf_counter() - started
    task = results_table.task_name(data_cfg.resolution, data_cfg.pool)
    log(f"held-out accuracy {result['acc']:.2%} ({result['correct']:,} of {result['count']:,} images; {task} "
        f"{data_cfg.difficulty}, seed {data_cfg.eval_seed}, never trained on) of {args.init_from} at step "
        f"{checkpoint['state']['step']}, in {seconds:.1f} s")
    report = {"checkpoint": str(args.init_from), "step": checkpoint["state"]["step"], "task": task,
              "difficulty": data_cfg.difficulty, "eval_seed": data_cfg.eval_seed, **result, "seconds": seconds, "environment": environment(device, dist)}
    if dist.is_main:
        write_json(Path(args.out) / "eval_only.json", report)
    return report


def time_call(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call of `fn` after one warm-up call."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / repeats


def bench(args, device: torch.device, dist: Dist, log: RunLog) -> list[dict]:
    """Training throughput, peak memory and TFLOP/s of block-sparse and dense attention on the same model.

    Random pixels stand in for images (speed does not depend on them). Attention TFLOP/s count the nonzero
    blocks only (4 N^2 d density per head forward, x3.5 for training) and come from timing the attention alone
    on the model's q, k, v shapes; step TFLOP/s divide the whole step's FLOPs by its time.
    """
    config = model_config(args)
    sparse_specs = mask_specs(args.mask or "butterfly", args.layers)
    variants = {"block-sparse": sparse_specs, "dense": ("dense",) * args.layers}
    generator = torch.Generator().manual_seed(args.seed)
    pixels = torch.randint(0, 256, (args.batch_size, config.side**2), generator=generator, dtype=torch.uint8)
    labels = torch.randint(0, 2, (args.batch_size,), generator=generator)
    pixels, labels = pixels.to(device), labels.to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name, specs in variants.items():
        mask_cfg = MaskConfig(specs, args.block_size, tuple(args.window), args.global_blocks, args.seed)
        masks_ = layer_masks(mask_cfg, config, device)
        model = PixelTransformer(config, masks_, args.backend).to(device)
        optimizer = make_optimizer(model, args.lr, 0.0, device)
        net = compiled(model, make_control(args, device, 0.0))
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        step_seconds = time_call(lambda: classify_step(net, optimizer, pixels, labels, args.lr, device), device,
                                 args.bench_steps)
        peak = peak_memory_gib(device)  # of training, before the attention-only timing
        shape = (args.batch_size, config.heads, config.side**2, config.head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

        def attention_pass():
            for mask in masks_:
                with autocast(device):
                    out = (sparse_flash.flash_attention(q, k, v, backend=args.backend) if mask is None else
                           sparse_flash.block_sparse_attention(q, k, v, mask, backend=args.backend))
                out.sum().backward()

        attention_seconds = time_call(attention_pass, device, max(1, args.bench_steps // 2))
        described = describe_masks(masks_, mask_cfg)
        row = {
            "task": "bench", "attention": name, "mask": described["name"], "density": described["density"],
            "resolution": config.side, "layers": config.layers, "width": config.width, "heads": config.heads,
            "batch_size": args.batch_size, "samples_per_s": args.batch_size / step_seconds,
            "peak_memory_gib": peak,
            "attention_tflops": attention_flops(config, masks_) * args.batch_size / attention_seconds / 1e12,
            "step_tflops": step_flops(config, masks_) * args.batch_size / step_seconds / 1e12,
            "step_seconds": step_seconds, "attention_seconds": attention_seconds, "levers": {
                "pos": config.pos, "order": config.order, "tile": list(config.tile), "block_size": args.block_size},
            **{k: environment(device, dist)[k] for k in ("date", "commit", "device", "gpus")},
        }
        rows.append(row)
        memory = "-" if row["peak_memory_gib"] is None else f"{row['peak_memory_gib']:.2f}"
        log(f"bench {name:<12} {described['name']:<24} density {row['density']:7.2%}  {row['samples_per_s']:9.1f} "
            f"samples/s  peak {memory} GiB  attention {row['attention_tflops']:.2f} TFLOP/s  step "
            f"{row['step_tflops']:.2f} TFLOP/s")
        del model, optimizer, net, q, k, v
    if dist.is_main:
        write_json(Path(args.out) / "bench.json", rows)
        if args.record is not None:
            results_table.append_records(rows, Path(args.results))
    return rows


# ----------------------------------------------------------------------------------------------------
# Smoke checks
# ----------------------------------------------------------------------------------------------------


def mask_table(args) -> None:
    """Density of each mask at this preset's length and at Path-256's (65,536 tokens, block 128, 16x8 tiles)."""
    here = args.resolution**2
    small_tile, large_tile = default_tile(args.block_size), (16, 8)
    print(f"{'mask':<14}{f'density at {here:,} tokens':>28}{'density at 65,536 tokens':>28}")
    for name in MASK_NAMES:
        order = "tile" if name in TILED_MASKS else "row"
        small = MaskConfig((name,), args.block_size, seed=args.seed)
        large = MaskConfig((name,), 128, seed=args.seed)
        try:
            small = build_mask(name, args.resolution, small, order, small_tile)
        except (ValueError, TypeError) as error:
            raise ConfigError(f"--block-size {args.block_size} cannot build the {name} mask: {error}") from None
        large = build_mask(name, 256, large, order, large_tile)
        print(f"{name:<14}{f'{small.density:.2%} of {small.num_blocks[0]}^2 blocks':>28}"
              f"{f'{large.density:.2%} of {large.num_blocks[0]}^2 blocks':>28}")


def check_against_reference(spec: RunSpec) -> tuple[float, float]:
    """Max |block-sparse - dense| for outputs and gradients on random q, k, v of the model's attention shape
    with the first layer's mask: the torch backend against the reference backend (the dense oracle with the
    same mask), float32 on the CPU."""
    model = spec.model
    mask = build_mask(spec.mask.layers[0], model.side, spec.mask, model.order, model.tile)
    generator = torch.Generator().manual_seed(spec.train.seed)
    shape = (2, model.heads, model.side**2, model.head_dim)
    q, k, v = (torch.randn(shape, generator=generator).requires_grad_() for _ in range(3))
    grad_out = torch.randn(shape, generator=generator)
    results = {}
    for backend in ("torch", "reference"):
        out = sparse_flash.block_sparse_attention(q, k, v, mask, backend=backend)
        results[backend] = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    diffs = [(a - b).abs().max().item() for a, b in zip(results["torch"], results["reference"])]
    print(f"block-sparse (torch backend) vs dense reference on q, k, v {shape}, float32: "
          f"max |out diff| {diffs[0]:.2e}, max |grad diff| {max(diffs[1:]):.2e}")
    return diffs[0], max(diffs[1:])


def run_smoke(args, device: torch.device, dist: Dist, log: RunLog, started: float) -> None:
    """Pipeline check: masks, block-sparse vs dense agreement, and overfitting one small batch."""
    print("smoke preset: a pipeline check. Nothing is learned about Pathfinder on a CPU in minutes; learning "
          "the task needs a GPU (--preset path32hard, --preset path256).")
    if args.mask is None:
        args.mask = "butterfly"
    spec = plan_runs(args)[0]
    print(build_mask(spec.mask.layers[0], spec.model.side, spec.mask, spec.model.order, spec.model.tile))
    mask_table(args)
    if spec.mask.layers[0] != "dense":
        out_error, grad_error = check_against_reference(spec)
        if max(out_error, grad_error) > 1e-4:
            raise SystemExit(f"block-sparse and dense attention disagree (max error {max(out_error, grad_error):.2e})")
    print(f"overfitting one batch of {args.n_train} images for {spec.train.steps} steps on {device.type}:")
    metrics = run_training(args, device, dist, log, started)[spec.name]
    log_ = [t for t in metrics["train_log"] if t["phase"] == "classify"]
    first, last = log_[0]["loss"], log_[-1]["loss"]
    print(f"training loss: {first:.4f} over the first {args.log_every} steps -> {last:.4f} over the last "
          f"{args.log_every} (training accuracy {log_[-1]['acc']:.0%})")
    if not last < first:
        raise SystemExit(f"the training loss did not fall ({first:.4f} -> {last:.4f})")
    print("smoke preset passed: the loss fell.")


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------


def on_cpu(requested: str | None) -> bool:
    """Whether the run's processes work on the CPU: `--device cpu` asked for, or no GPU here."""
    return not torch.cuda.is_available() or (requested is not None and requested.split(":")[0] == "cpu")


def setup_distributed(requested: str | None = None) -> Dist:
    """Join the torchrun process group when RANK and WORLD_SIZE are set (NCCL, one GPU per rank; gloo on the
    CPU where `--device cpu` is asked for or there is no GPU); else run as a single process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Dist()
    dist = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if not on_cpu(requested):
        device = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl", device_id=device)
    else:
        torch.distributed.init_process_group("gloo")
    return dist


def pick_device(requested: str | None, dist: Dist) -> torch.device:
    if dist.world > 1:
        return torch.device("cpu") if on_cpu(requested) else torch.device("cuda", dist.local_rank)
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ConfigError(f"--device: not a torch device: {requested!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {requested}: the demo trains on cpu or cuda, got {device.type}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {requested}: no CUDA GPU here")
    return device


def main(argv: list[str] | None = None) -> int:
    """Run the command line; 0 on success, 2 (with one line on stderr) for bad flags, checkpoints or data."""
    started = time.monotonic()
    dist = Dist()
    try:
        args = parse_args(argv)
        dist = setup_distributed(args.device)
        if args.preset == "smoke" and dist.world > 1:
            raise ConfigError("the smoke preset runs as a single process; launch it with python, not torchrun")
        device = pick_device(args.device, dist)
        if args.backend == "triton" and not args.prepare_data:
            reason = sparse_flash.api.triton_unavailable_reason(device)
            if reason is not None:
                raise ConfigError(f"--backend triton cannot run on {device}: {reason}")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        log = RunLog(Path(args.out) / "train.log", enabled=dist.is_main)
        if args.prepare_data:
            load_data(data_config(args), args.cache_dir, args.workers, torch.device("cpu"), dist, log)
        elif args.eval_only:
            eval_only(args, device, dist, log)
        elif args.bench:
            bench(args, device, dist, log)
        elif args.preset == "smoke":
            run_smoke(args, device, dist, log, started)
        else:
            run_training(args, device, dist, log, started)
        if dist.world > 1:  # every rank done with its collectives before any tears the group down (gloo's
            torch.distributed.barrier()  # worker threads could abort a rank that still had one in flight)
    except ConfigError as error:
        print(f"path256.py: error: {error}", file=sys.stderr)
        return 2
    finally:
        if dist.world > 1:
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
