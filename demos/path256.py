"""Path-256: a pixel transformer that reads 65,536 tokens, trainable because its attention is block-sparse.

A Pathfinder image (see demos/pathfinder.py) asks whether two circles lie on the same dashed path.
Flattened row-major, a 256 x 256 image is a sequence of 65,536 pixel tokens. Naive attention builds a
65,536 x 65,536 score matrix per head, 8 GiB per head per sample in bf16, and training keeps one for every
head of every layer for the backward pass: 256 GiB for this demo's batch of 8 with 2 heads and 2 layers,
more than an H200 holds.
`sparse_flash.block_sparse_attention` computes exact softmax attention over the nonzero blocks of a block
mask and never builds that matrix. The default mask (butterfly | local band | one global block) keeps
about 2.5% of the blocks at 65,536 tokens with block 128, so the same small transformer trains at this
length in a few GiB of memory.

The model: pixel values (0..255) through an embedding, plus a learned positional embedding and a fixed
2-D sin/cos encoding; pre-LN transformer blocks whose attention calls `block_sparse_attention`; a final
LayerNorm, mean pooling over the pixels and a 2-class head.

Presets set the default of every flag; flags given explicitly override them:
  smoke    (default) CPU pipeline check in well under 3 minutes: prints the masks, checks block-sparse
           against dense attention and overfits one small batch. Learning the task needs a GPU.
  path32   GPU: dense and block-sparse attention on easy 32-px images, 4 minutes each, each aiming at
           65% held-out accuracy or more.
  path256  GPU: 65,536 tokens. Block-sparse training, a short dense FlashAttention run for comparison
           (samples/s, peak memory), and what naive attention would need.
`--mask` runs that one mask instead of the preset's comparison.

Usage:
    python demos/path256.py
    python demos/path256.py --preset path32 --workers 16
    python demos/path256.py --preset path256 --workers 16
    torchrun --nproc-per-node 4 demos/path256.py --preset path32
    python demos/path256.py --preset path32 --resolution 64 --block-size 64 --mask butterfly --n-train 40000 --out r64
    python demos/path256.py --preset path256 --mask butterfly --init-from r64/path32_sparse_ckpt.pt

Everything goes to --out (default demos/results/<preset>/): `<preset>_<run>.json` metrics (one entry per
held-out evaluation), `<preset>_<run>_ckpt.pt` checkpoints, `<preset>_summary.json` and
`<preset>_curves.png`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from tqdm import tqdm

import pathfinder
import sparse_flash
from sparse_flash import masks

MASKS = ("butterfly", "dense", "local", "bigbird", "random")
SINCOS_UNITS = 32  # the sin/cos encoding measures positions in 1/32 of the image side
GRAD_CLIP = 1.0
ADAM_BETAS = (0.9, 0.98)

PRESETS: dict[str, dict] = {
    "smoke": dict(
        resolution=32, difficulty="easy", block_size=32, layers=2, width=32, heads=2, mlp_ratio=2,
        batch_size=8, lr=1e-2, weight_decay=0.0, warmup=5, steps=40, time_budget=0.0, compare_steps=0,
        n_train=8, n_eval=32, eval_every=20, log_every=5,
    ),
    "path32": dict(
        resolution=32, difficulty="easy", block_size=32, layers=4, width=128, heads=4, mlp_ratio=2,
        batch_size=256, lr=1e-3, weight_decay=0.05, warmup=100, steps=20_000, time_budget=240.0,
        compare_steps=0, n_train=160_000, n_eval=10_000, eval_every=500, log_every=25,
    ),
    "path256": dict(
        resolution=256, difficulty="easy", block_size=128, layers=2, width=64, heads=2, mlp_ratio=2,
        batch_size=8, lr=1e-3, weight_decay=0.05, warmup=30, steps=400, time_budget=240.0, compare_steps=20,
        n_train=2048, n_eval=256, eval_every=100, log_every=5,
    ),
}


# ----------------------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------------------


def build_mask(name: str, seq_len: int, block_size: int, seed: int = 0, device=None) -> sparse_flash.BlockMask:
    """The attention mask called `name` (one of MASKS) for `seq_len` tokens.

    butterfly: flat block butterfly | local band (window 1) | one global block (the default);
    dense: every block (dense FlashAttention through the same kernels); local: the band alone;
    bigbird: BigBird's defaults; random: random blocks at the butterfly mask's density, plus the diagonal.
    """
    if name == "dense":
        return masks.dense(seq_len, block_size, device=device)
    if name == "local":
        return masks.local(seq_len, block_size, window=1, device=device)
    if name == "bigbird":
        return masks.bigbird(seq_len, block_size, seed=seed, device=device)
    default = (
        masks.butterfly(seq_len, block_size, device=device)
        | masks.local(seq_len, block_size, window=1, device=device)
        | masks.global_(seq_len, block_size, num_global_blocks=1, device=device)
    )
    if name == "butterfly":
        return default
    if name == "random":
        diagonal = masks.local(seq_len, block_size, window=0, device=device)
        return masks.random(seq_len, block_size, density=default.density, seed=seed, device=device) | diagonal
    raise ValueError(f"mask must be one of {MASKS}, got {name!r}")


def describe_mask(mask: sparse_flash.BlockMask) -> dict:
    return {
        "name": mask.name, "block_size": mask.block_size[0], "num_blocks": mask.num_blocks[0],
        "nnz": mask.nnz, "density": mask.density,
    }


# ----------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    resolution: int
    width: int
    layers: int
    heads: int
    mlp_ratio: int


def sincos_2d(resolution: int, width: int) -> torch.Tensor:
    """Fixed 2-D sin/cos positional encoding, float32 `(resolution * resolution, width)` in row-major pixel order.

    Channels `[0, width/2)` depend only on the pixel's row, `[width/2, width)` only on its column. In each
    half the first `width/4` channels are `sin(p * w_k)` and the next `width/4` are `cos(p * w_k)`, with
    `w_k = 10000 ** (-k / (width/4))` and `p` the pixel centre measured in 1/32 of the image side
    (`i + 0.5` at 32 px), so a pixel's encoding depends on where it lies in the image, not on the resolution.
    """
    if width % 4:
        raise ValueError(f"width must be a multiple of 4 for the 2-D sin/cos encoding, got {width}")
    quarter = width // 4
    freqs = 10000.0 ** (-torch.arange(quarter, dtype=torch.float64) / quarter)
    positions = (torch.arange(resolution, dtype=torch.float64) + 0.5) * (SINCOS_UNITS / resolution)
    angles = positions[:, None] * freqs  # (resolution, width/4)
    axis = torch.cat([angles.sin(), angles.cos()], dim=1)  # (resolution, width/2)
    rows = axis[:, None, :].expand(resolution, resolution, 2 * quarter)
    cols = axis[None, :, :].expand(resolution, resolution, 2 * quarter)
    return torch.cat([rows, cols], dim=-1).reshape(resolution * resolution, width).float()


class Attention(nn.Module):
    """Multi-head self-attention through `sparse_flash.block_sparse_attention` with a fixed block mask."""

    def __init__(self, width: int, heads: int, mask: sparse_flash.BlockMask, backend: str):
        super().__init__()
        self.heads, self.mask, self.backend = heads, mask, backend
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, C)
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        out = sparse_flash.block_sparse_attention(q, k, v, self.mask, backend=self.backend)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))


class Block(nn.Module):
    """Pre-LN transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, width: int, heads: int, mlp_ratio: int, mask: sparse_flash.BlockMask, backend: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, mask, backend)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PixelTransformer(nn.Module):
    """Pathfinder classifier: uint8 pixels `(B, resolution**2)` in, logits `(B, 2)` out."""

    def __init__(self, config: ModelConfig, mask: sparse_flash.BlockMask, backend: str = "auto"):
        super().__init__()
        self.config = config
        c = config
        self.pixel_embed = nn.Embedding(256, c.width)
        self.pos_embed = nn.Parameter(0.02 * torch.randn(c.resolution, c.resolution, c.width))  # learned (H, W, C)
        self.register_buffer("pos_sincos", sincos_2d(c.resolution, c.width), persistent=False)
        self.blocks = nn.ModuleList(Block(c.width, c.heads, c.mlp_ratio, mask, backend) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, 2)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.pixel_embed(pixels.long()) + self.pos_embed.flatten(0, 1) + self.pos_sincos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def upsample_pos_grid(grid: torch.Tensor, resolution: int) -> torch.Tensor:
    """Resize a learned positional grid `(h, w, C)` to `(resolution, resolution, C)`, nearest neighbour.

    For an integer factor every position is duplicated into a factor x factor square, as in the
    FlashAttention paper's 64 -> 256 px transfer (each 64-px embedding covers a 4 x 4 square at 256 px).
    """
    channels_first = rearrange(grid, "h w c -> 1 c h w")
    resized = F.interpolate(channels_first, size=(resolution, resolution), mode="nearest")
    return rearrange(resized, "1 c h w -> h w c").contiguous()


def init_from_checkpoint(model: PixelTransformer, path: str | os.PathLike) -> None:
    """Load a checkpoint's weights, upsampling its positional grid when it was trained at a lower resolution."""
    state = dict(torch.load(path, map_location="cpu", weights_only=False)["model"])
    state["pos_embed"] = upsample_pos_grid(state["pos_embed"], model.config.resolution)
    model.load_state_dict(state)


def init_from_mismatch(path: str | os.PathLike, config: ModelConfig) -> str | None:
    """Why a checkpoint cannot initialise a model of `config` (any resolution is fine), or None."""
    theirs, mine = torch.load(path, map_location="cpu", weights_only=False)["model_config"], asdict(config)
    differ = [f"{key} {theirs[key]} vs {mine[key]}" for key in mine if key != "resolution" and theirs[key] != mine[key]]
    return f"the checkpoint's model differs ({', '.join(differ)}); pass matching flags" if differ else None


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------


@dataclass
class Data:
    """Images as uint8 token rows `(n, resolution**2)` and int64 labels, on the training device."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    eval_images: torch.Tensor
    eval_labels: torch.Tensor


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def load_data(args, device: torch.device, dist: Dist) -> Data:
    """The first n_train images of one cached Pathfinder set train, the next n_eval are held out.

    Rank 0 generates (or loads) the set while the other ranks wait, then they read the cache.
    """

    def fetch():
        return pathfinder.load_or_generate(
            args.n_train + args.n_eval, args.resolution, args.difficulty, args.seed,
            cache_dir=args.cache_dir, workers=args.workers, progress=dist.is_main and sys.stderr.isatty(),
        )

    started = time.perf_counter()
    if dist.is_main:
        images, labels = fetch()
    if dist.world > 1:
        torch.distributed.barrier()
    if not dist.is_main:
        images, labels = fetch()
    tokens = torch.from_numpy(images).reshape(len(images), -1).to(device)
    labels = torch.from_numpy(labels).to(device)
    n = args.n_train
    log(dist, f"{args.n_train:,} training + {args.n_eval:,} held-out Pathfinder images of {args.resolution} px "
              f"({args.difficulty}, {args.resolution**2:,} tokens each) ready in {time.perf_counter() - started:.1f} s")
    return Data(tokens[:n], labels[:n], tokens[n:], labels[n:])


class BatchSampler:
    """Training-set indices for each step, on the device.

    Each epoch is a fresh permutation seeded by (seed, epoch), so a resumed run sees the same order; the
    global batch of `batch_size * world` images is split by rank.
    """

    def __init__(self, n: int, batch_size: int, seed: int, dist: Dist, device: torch.device):
        global_batch = batch_size * dist.world
        if n < global_batch:
            raise ValueError(f"--n-train ({n}) must be at least the global batch (batch size x GPUs = {global_batch})")
        self.n, self.batch_size, self.seed, self.dist, self.device = n, batch_size, seed, dist, device
        self.steps_per_epoch = n // global_batch
        self.epoch, self.order = -1, None

    def __call__(self, step: int) -> torch.Tensor:
        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch != self.epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self.order = torch.randperm(self.n, generator=generator).to(self.device)
            self.epoch = epoch
        start = (i * self.dist.world + self.dist.rank) * self.batch_size
        return self.order[start : start + self.batch_size]


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    name: str  # "dense", "sparse" (the butterfly mask) or the mask's name
    mask: str
    steps: int
    time_budget: float  # seconds of training per run, 0 for no limit


@dataclass
class TrainState:
    step: int = 0
    samples: int = 0  # images seen, all ranks together
    seconds: float = 0.0  # training wall time, evaluations included


@dataclass
class Window:
    """Training totals over an interval, on this rank: loss sum, correct answers, images and seconds."""

    loss_sum: float = 0.0
    correct: float = 0.0
    count: int = 0
    seconds: float = 0.0

    def __add__(self, other: "Window") -> "Window":
        return Window(self.loss_sum + other.loss_sum, self.correct + other.correct, self.count + other.count,
                      self.seconds + other.seconds)

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.count if self.count else None

    @property
    def acc(self) -> float | None:
        return self.correct / self.count if self.count else None

    def rate(self, world: int) -> float | None:
        """Images per second, all ranks together."""
        return self.count * world / self.seconds if self.seconds else None


class Meter:
    """Sums of loss and correct answers kept on the device, so that training steps never wait for the GPU.

    `flush()` synchronises once and returns the `Window` since the previous flush or reset.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device)
        self.correct = torch.zeros((), device=self.device)
        self.count = 0
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, correct: torch.Tensor, count: int) -> None:
        self.loss_sum += loss * count
        self.correct += correct
        self.count += count

    def flush(self) -> Window:
        loss_sum, correct = torch.stack([self.loss_sum, self.correct]).tolist()
        window = Window(loss_sum, correct, self.count, time.perf_counter() - self.started)
        self.reset()
        return window


def autocast(device: torch.device):
    """bf16 autocast on the GPU; full precision on the CPU."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def learning_rate(base_lr: float, warmup: int, step: int, progress: float) -> float:
    """Linear warm-up over `warmup` steps times a cosine decay to zero as `progress` goes from 0 to 1."""
    warm = min(1.0, (step + 1) / max(1, warmup))
    return base_lr * warm * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only (not on biases and LayerNorm gains)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=ADAM_BETAS, fused=device.type == "cuda")


def train_step(net, optimizer, pixels, labels, lr: float, device: torch.device):
    """One optimizer step; returns the batch's mean loss and number of correct answers, as device tensors."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    with autocast(device):
        logits = net(pixels)
    loss = F.cross_entropy(logits.float(), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), GRAD_CLIP)
    optimizer.step()
    return loss.detach(), (logits.argmax(dim=-1) == labels).sum()


@torch.no_grad()
def evaluate(model, images, labels, batch_size: int, device: torch.device, dist: Dist) -> tuple[float, float]:
    """Mean loss and accuracy on held-out images; each rank takes every world-th batch."""
    model.eval()
    totals = torch.zeros(3, device=device)  # loss sum, correct, count
    for start in range(dist.rank * batch_size, len(labels), batch_size * dist.world):
        pixels, y = images[start : start + batch_size], labels[start : start + batch_size]
        with autocast(device):
            logits = model(pixels)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        totals[1] += (logits.argmax(dim=-1) == y).sum()
        totals[2] += len(y)
    if dist.world > 1:
        torch.distributed.all_reduce(totals)
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count


def agreed_elapsed(started: float, dist: Dist, device: torch.device) -> float:
    """Seconds since `started` by rank 0's clock, the same on every rank (it drives stopping and the schedule)."""
    elapsed = time.perf_counter() - started
    if dist.world == 1:
        return elapsed
    value = torch.tensor([elapsed], device=device)
    torch.distributed.broadcast(value, src=0)
    return value.item()


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def environment(device: torch.device, dist: Dist) -> dict:
    """Date, device and library versions, recorded in every result file."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "gpus": dist.world if device.type == "cuda" else 0,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
    }


def save_atomically(path: Path, save) -> None:
    """Write through a temporary file, so that a killed run never leaves a truncated result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save(partial)
    partial.replace(path)


def write_json(path: Path, data: dict) -> None:
    save_atomically(path, lambda p: p.write_text(json.dumps(data, indent=2, default=str)))


def save_checkpoint(path: Path, model: PixelTransformer, optimizer, state: TrainState, metrics: dict) -> None:
    checkpoint = {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "model_config": asdict(model.config),
        "state": asdict(state), "metrics": metrics,
    }
    save_atomically(path, lambda p: torch.save(checkpoint, p))


def restore_checkpoint(path: Path, model: PixelTransformer, optimizer) -> tuple[TrainState, dict]:
    """Model and optimizer state, training progress and metrics so far, from a `save_checkpoint` file."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if checkpoint["model_config"] != asdict(model.config):
        raise ValueError(f"--resume: {path} holds a model {checkpoint['model_config']}, not {asdict(model.config)}")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return TrainState(**checkpoint["state"]), checkpoint["metrics"]


def run_files(args, run: RunSpec) -> tuple[Path, Path]:
    """(metrics JSON, checkpoint) of one run."""
    stem = f"{args.preset}_{run.name}"
    return Path(args.out) / f"{stem}.json", Path(args.out) / f"{stem}_ckpt.pt"


class Trainer:
    """One training run: a fresh model with `run.mask`, trained until `run.steps` or `run.time_budget`.

    It evaluates on the held-out images every `--eval-every` steps and at the end; rank 0 then writes the
    metrics JSON and a checkpoint. `metrics["train_log"]` holds step, samples, loss, accuracy and samples/s
    every `--log-every` steps; `metrics["evals"]` holds step, samples, training and held-out loss and
    accuracy, samples/s, peak GPU memory and seconds at every evaluation.
    """

    def __init__(self, args, run: RunSpec, data: Data, device: torch.device, dist: Dist):
        self.args, self.run, self.data, self.device, self.dist = args, run, data, device, dist
        torch.manual_seed(args.seed)
        mask = build_mask(run.mask, args.resolution**2, args.block_size, args.seed, device)
        config = ModelConfig(args.resolution, args.width, args.layers, args.heads, args.mlp_ratio)
        self.model = PixelTransformer(config, mask, args.backend).to(device)
        self.optimizer = make_optimizer(self.model, args.lr, args.weight_decay, device)
        self.metrics_path, self.checkpoint_path = run_files(args, run)
        self.state = TrainState()
        self.started = time.perf_counter()  # the run's clock, set again when training starts
        self.metrics = {
            "preset": args.preset, "run": run.name, "mask": describe_mask(mask), "model": asdict(config),
            "parameters": sum(p.numel() for p in self.model.parameters()), "steps": run.steps,
            "time_budget": run.time_budget, "args": vars(args), "environment": environment(device, dist),
            "train_log": [], "evals": [],
        }
        self.load_weights()
        self.net = self.wrap(self.model)
        log(dist, f"[{run.name}] {self.metrics['parameters']:,} parameters; mask {mask.name}, "
                  f"{mask.num_blocks[0]}^2 blocks of {args.block_size}, density {mask.density:.2%}")

    def load_weights(self) -> None:
        """Resume from this run's checkpoint (`--resume`) or start from another one (`--init-from`)."""
        if self.args.resume and self.checkpoint_path.exists():
            self.state, self.metrics = restore_checkpoint(self.checkpoint_path, self.model, self.optimizer)
            self.metrics.update(steps=self.run.steps, time_budget=self.run.time_budget)
            log(self.dist, f"[{self.run.name}] resumed from {self.checkpoint_path} at step {self.state.step}")
        elif self.args.init_from:
            init_from_checkpoint(self.model, self.args.init_from)
            log(self.dist, f"[{self.run.name}] initialised from {self.args.init_from}")

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP across the torchrun ranks, and torch.compile with `--compile`."""
        if self.dist.world > 1:
            device_ids = [self.dist.local_rank] if self.device.type == "cuda" else None
            model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        return torch.compile(model) if self.args.compile else model

    def time_fraction(self) -> float:
        return self.state.seconds / self.run.time_budget if self.run.time_budget else 0.0

    def finished(self) -> bool:
        return self.state.step >= self.run.steps or self.time_fraction() >= 1.0

    def fit(self) -> dict:
        """Train, evaluate and save; returns the metrics."""
        args, state = self.args, self.state
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        sampler = BatchSampler(len(self.data.train_labels), args.batch_size, args.seed, self.dist, self.device)
        meter, since_eval = Meter(self.device), Window()
        self.started = time.perf_counter() - state.seconds
        bar = tqdm(
            total=self.run.steps, initial=state.step, desc=self.run.name, disable=not self.dist.is_main,
            mininterval=1.0 if sys.stderr.isatty() else 30.0,  # a log file gets a line every 30 s
        )
        while not self.finished():
            progress = max(state.step / self.run.steps, self.time_fraction())
            lr = learning_rate(args.lr, args.warmup, state.step, progress)
            index = sampler(state.step)
            pixels, labels = self.data.train_images[index], self.data.train_labels[index]
            loss, correct = train_step(self.net, self.optimizer, pixels, labels, lr, self.device)
            meter.add(loss, correct, args.batch_size)
            state.step += 1
            state.samples += args.batch_size * self.dist.world
            bar.update()
            eval_due = state.step % args.eval_every == 0
            if eval_due or state.step % args.log_every == 0 or state.step == self.run.steps:
                window = meter.flush()  # the only host sync of a training step
                since_eval += window
                self.record_train(window, lr, bar)
            if eval_due:
                self.record_eval(since_eval)
                meter.reset()  # evaluation time is not training time
                since_eval = Window()
        bar.close()
        if not self.metrics["evals"] or self.metrics["evals"][-1]["step"] != state.step:
            self.record_eval(since_eval)
        return self.metrics

    def record_train(self, window: Window, lr: float, bar: tqdm) -> None:
        """Log a training window and update the clock that stops the run."""
        self.state.seconds = agreed_elapsed(self.started, self.dist, self.device)
        rate = window.rate(self.dist.world)
        self.metrics["train_log"].append({
            "step": self.state.step, "samples": self.state.samples, "loss": window.loss, "acc": window.acc,
            "samples_per_s": rate,
        })
        bar.set_postfix(
            loss=f"{window.loss:.4f}", acc=f"{window.acc:.3f}", samples_per_s=f"{rate:.1f}", lr=f"{lr:.1e}",
            refresh=False,
        )

    def record_eval(self, since_eval: Window) -> None:
        """Evaluate on the held-out images, log, and (rank 0) write the metrics and a checkpoint."""
        args, state = self.args, self.state
        eval_loss, eval_acc = evaluate(
            self.model, self.data.eval_images, self.data.eval_labels, args.batch_size, self.device, self.dist
        )
        state.seconds = agreed_elapsed(self.started, self.dist, self.device)
        self.metrics["evals"].append({
            "step": state.step, "samples": state.samples, "train_loss": since_eval.loss, "train_acc": since_eval.acc,
            "eval_loss": eval_loss, "eval_acc": eval_acc, "samples_per_s": since_eval.rate(self.dist.world),
            "peak_memory_gib": peak_memory_gib(self.device), "seconds": state.seconds,
        })
        log(self.dist, f"[{self.run.name}] step {state.step}, {state.samples:,} images, {state.seconds:.0f} s: "
                       f"held-out loss {eval_loss:.4f}, accuracy {eval_acc:.2%}")
        if self.dist.is_main:
            write_json(self.metrics_path, self.metrics)
            save_checkpoint(self.checkpoint_path, self.model, self.optimizer, state, self.metrics)


# ----------------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------------


def log(dist: Dist, message: str) -> None:
    if dist.is_main:
        tqdm.write(message)


def final_row(metrics: dict) -> dict:
    """One run's outcome: its last evaluation, steady-state samples/s and peak GPU memory.

    Samples/s is the median over the training log windows after the first (which holds compilation).
    """
    last = metrics["evals"][-1]
    rates = [t["samples_per_s"] for t in metrics["train_log"][1:] or metrics["train_log"]]
    memory = [e["peak_memory_gib"] for e in metrics["evals"] if e["peak_memory_gib"] is not None]
    return {
        "mask": metrics["mask"]["name"], "density": metrics["mask"]["density"], "steps": last["step"],
        "samples": last["samples"], "seconds": last["seconds"], "eval_acc": last["eval_acc"],
        "eval_loss": last["eval_loss"], "best_eval_acc": max(e["eval_acc"] for e in metrics["evals"]),
        "samples_per_s": statistics.median(rates) if rates else None,
        "peak_memory_gib": max(memory) if memory else None,
        "finite_loss": all(math.isfinite(t["loss"]) for t in metrics["train_log"]),
    }


def print_summary(rows: dict[str, dict]) -> None:
    print(f"{'run':<10}{'density':>9}{'steps':>8}{'samples':>10}{'held-out acc':>14}{'loss':>8}"
          f"{'samples/s':>11}{'peak GiB':>10}{'finite loss':>13}")
    for name, r in rows.items():
        rate = f"{r['samples_per_s']:.1f}" if r["samples_per_s"] else "-"
        memory = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "-"
        print(f"{name:<10}{r['density']:>9.2%}{r['steps']:>8}{r['samples']:>10}{r['eval_acc']:>14.2%}"
              f"{r['eval_loss']:>8.4f}{rate:>11}{memory:>10}{'yes' if r['finite_loss'] else 'NO':>13}")


def naive_attention_memory(args, element_bytes: int, gpu_bytes: int | None, rows: dict[str, dict]) -> dict:
    """What keeping the N x N score matrices for the backward pass would take for this model and batch size.

    Args:
        args: the run's flags (resolution, batch size, heads, layers).
        element_bytes: bytes per score (2 in bf16).
        gpu_bytes: the GPU's memory, or None on a CPU.
        rows: `final_row` of each run, whose measured peak memory the statement quotes.
    """
    n = args.resolution**2
    per_head = n * n * element_bytes
    total = args.batch_size * args.heads * args.layers * per_head
    fits = gpu_bytes is not None and total < gpu_bytes
    measured = "; ".join(
        f"{name} ({r['mask']}) peaked at {r['peak_memory_gib']:.2f} GiB"
        for name, r in rows.items() if r["peak_memory_gib"] is not None
    )
    statement = (
        f"Naive attention materialises an N x N score matrix per head: {n:,}^2 x {element_bytes} bytes = "
        f"{per_head / 2**30:.3g} GiB per head per sample. Training keeps one per head of every layer for the "
        f"backward pass: batch {args.batch_size} x {args.heads} heads x {args.layers} layers x "
        f"{per_head / 2**30:.3g} GiB = {total / 2**30:.4g} GiB, a lower bound (the softmax output is kept too)"
        + (f", against {gpu_bytes / 2**30:.1f} GiB on this GPU: it {'fits' if fits else 'does not fit'}."
           if gpu_bytes else ".")
        + (f" Never building the matrix, {measured}." if measured else "")
    )
    return {
        "seq_len": n, "bytes_per_element": element_bytes, "bytes_per_head_per_sample": per_head,
        "batch_size": args.batch_size, "heads": args.heads, "layers": args.layers, "bytes_total": total,
        "gib_total": total / 2**30, "gpu_memory_gib": gpu_bytes / 2**30 if gpu_bytes else None, "fits": fits,
        "statement": statement,
    }


def plot_curves(results: dict[str, dict], path: Path, title: str) -> None:
    """Loss and accuracy against samples seen: training (every log step) and held-out (every evaluation)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4))
    FigureCanvasAgg(figure)
    ax_loss, ax_acc = figure.subplots(1, 2)
    for index, (name, metrics) in enumerate(results.items()):
        color = f"C{index}"
        train, evals = metrics["train_log"], metrics["evals"]
        for ax, key in ((ax_loss, "loss"), (ax_acc, "acc")):
            ax.plot([t["samples"] for t in train], [t[key] for t in train], color=color, alpha=0.35,
                    label=f"{name} train")
            ax.plot([e["samples"] for e in evals], [e[f"eval_{key}"] for e in evals], "o-", color=color,
                    label=f"{name} held-out")
    ax_acc.axhline(0.5, color="grey", linestyle=":", label="chance")
    for ax, label in ((ax_loss, "cross-entropy"), (ax_acc, "accuracy")):
        ax.set_xlabel("training images seen")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def write_summary(args, results: dict[str, dict], device: torch.device, dist: Dist) -> dict:
    """Print and write the runs' outcomes, the naive-attention estimate and the learning curves (rank 0)."""
    rows = {name: final_row(m) for name, m in results.items()}
    on_gpu = device.type == "cuda"
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if on_gpu else None
    naive = naive_attention_memory(args, 2 if on_gpu else 4, gpu_bytes, rows)  # bf16 under autocast, else fp32
    print_summary(rows)
    print(naive["statement"])
    summary = {"preset": args.preset, "runs": rows, "naive_attention": naive, "environment": environment(device, dist)}
    out = Path(args.out)
    write_json(out / f"{args.preset}_summary.json", summary)
    title = f"Pathfinder {args.resolution} px ({args.difficulty}), {args.layers} layers, width {args.width}"
    plot_curves(results, out / f"{args.preset}_curves.png", title)
    print(f"wrote {out / f'{args.preset}_summary.json'} and {out / f'{args.preset}_curves.png'}")
    return summary


# ----------------------------------------------------------------------------------------------------
# Smoke checks
# ----------------------------------------------------------------------------------------------------


def mask_table(args) -> None:
    """Density of every mask choice at this preset's length and at Path-256's (65,536 tokens, block 128)."""
    here = args.resolution**2
    print(f"{'mask':<11}{f'density at {here:,} tokens':>28}{'density at 65,536 tokens':>28}")
    for name in MASKS:
        small = build_mask(name, here, args.block_size, args.seed)
        large = build_mask(name, 65536, 128, args.seed)
        print(f"{name:<11}{f'{small.density:.2%} of {small.num_blocks[0]}^2 blocks':>28}"
              f"{f'{large.density:.2%} of {large.num_blocks[0]}^2 blocks':>28}")


def check_against_reference(args, mask_name: str = "butterfly") -> tuple[float, float]:
    """Max |block-sparse - dense| for outputs and gradients on random q, k, v of the model's attention shape.

    The block-sparse side is the torch backend, the dense side the reference backend (the dense oracle with
    the same mask), both in float32 on the CPU.
    """
    mask = build_mask(mask_name, args.resolution**2, args.block_size, args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    shape = (2, args.heads, args.resolution**2, args.width // args.heads)
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


def run_smoke(args, device: torch.device, dist: Dist) -> None:
    """Pipeline check: masks, block-sparse vs dense agreement, and overfitting one small batch."""
    print("smoke preset: a pipeline check. Nothing is learned about Pathfinder on a CPU in minutes; learning "
          "the task needs a GPU (--preset path32, --preset path256).")
    data = load_data(args, device, dist)
    mask_name = args.mask or "butterfly"
    print(build_mask(mask_name, args.resolution**2, args.block_size, args.seed))
    mask_table(args)
    out_error, grad_error = check_against_reference(args, mask_name)
    if max(out_error, grad_error) > 1e-4:
        raise SystemExit(f"block-sparse and dense attention disagree (max error {max(out_error, grad_error):.2e})")
    run = RunSpec(run_name(mask_name), mask_name, args.steps, args.time_budget)
    print(f"overfitting one batch of {args.n_train} images for {run.steps} steps on {device.type}:")
    metrics = Trainer(args, run, data, device, dist).fit()
    first, last = metrics["train_log"][0]["loss"], metrics["train_log"][-1]["loss"]
    print(f"training loss: {first:.4f} over the first {args.log_every} steps -> {last:.4f} over the last "
          f"{args.log_every} (training accuracy {metrics['train_log'][-1]['acc']:.0%})")
    write_summary(args, {run.name: metrics}, device, dist)
    if not last < first:
        raise SystemExit(f"the training loss did not fall ({first:.4f} -> {last:.4f})")
    print("smoke preset passed: the loss fell.")


# ----------------------------------------------------------------------------------------------------
# Presets and the command line
# ----------------------------------------------------------------------------------------------------


def run_name(mask: str) -> str:
    """Runs are named "dense", "sparse" (the default butterfly mask) or after their mask."""
    return {"dense": "dense", "butterfly": "sparse"}.get(mask, mask)


def plan_runs(args) -> list[RunSpec]:
    """The runs of a preset: its comparison, or the one mask `--mask` names.

    path256's dense run is a short timing run: `--compare-steps` steps within a quarter of the time budget.
    """
    def spec(mask: str, steps: int, time_budget: float) -> RunSpec:
        return RunSpec(run_name(mask), mask, steps, time_budget)

    if args.mask is not None:
        return [spec(args.mask, args.steps, args.time_budget)]
    if args.preset == "path256":
        return [
            spec("butterfly", args.steps, args.time_budget),
            spec("dense", args.compare_steps, args.time_budget / 4),
        ]
    return [spec("dense", args.steps, args.time_budget), spec("butterfly", args.steps, args.time_budget)]


def run_preset(args, device: torch.device, dist: Dist) -> None:
    """Train the preset's runs one after the other, then summarise them."""
    data = load_data(args, device, dist)
    results = {}
    for run in plan_runs(args):
        results[run.name] = Trainer(args, run, data, device, dist).fit()
    if dist.is_main:
        write_summary(args, results, device, dist)


def setup_distributed() -> Dist:
    """Join the torchrun process group when RANK and WORLD_SIZE are set (NCCL, one GPU per rank; gloo on a
    machine without GPUs); else run as a single process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Dist()
    dist = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if torch.cuda.is_available():
        device = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl", device_id=device)
    else:
        torch.distributed.init_process_group("gloo")
    return dist


def pick_device(requested: str | None, dist: Dist) -> torch.device:
    if dist.world > 1:
        return torch.device("cuda", dist.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be zero or positive, got {text}")
        return value

    return parse


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__[__doc__.index("Presets"):],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--preset", choices=sorted(PRESETS), default="smoke", help="defaults for every flag below (default: smoke)")
    add("--mask", choices=MASKS, help="run only this mask (default: the preset's comparison)")
    add("--block-size", type=positive(int), help="mask block size in tokens (a multiple of 16 for triton)")
    add("--resolution", type=int, choices=sorted(pathfinder.PRESETS), help="image side in pixels")
    add("--difficulty", choices=list(pathfinder.DIFFICULTIES), help="Pathfinder difficulty")
    add("--layers", type=positive(int), help="transformer blocks")
    add("--width", type=positive(int), help="model width (a multiple of 4 and of --heads)")
    add("--heads", type=positive(int), help="attention heads")
    add("--mlp-ratio", type=positive(int), help="MLP hidden width / model width")
    add("--batch-size", type=positive(int), help="images per step per GPU")
    add("--lr", type=positive(float), help="peak learning rate")
    add("--weight-decay", type=non_negative(float), help="AdamW weight decay")
    add("--warmup", type=non_negative(int), help="linear warm-up steps")
    add("--steps", type=positive(int), help="most optimizer steps per run")
    add("--time-budget", type=non_negative(float), help="seconds of training per run, then a last evaluation (0: none)")
    add("--compare-steps", type=positive(int), help="steps of path256's short dense comparison run")
    add("--n-train", type=positive(int), help="training images")
    add("--n-eval", type=positive(int), help="held-out images")
    add("--eval-every", type=positive(int), help="steps between held-out evaluations")
    add("--log-every", type=positive(int), help="steps between progress-bar and train-log updates (GPU syncs)")
    add("--out", help="results directory (default: demos/results/<preset>)")
    add("--cache-dir", default="~/.cache/sparse_flash/pathfinder", help="dataset cache directory")
    add("--seed", type=non_negative(int), default=0, help="dataset, model and mask seed")
    add("--device", help="torch device (default: cuda when available, else cpu)")
    add("--workers", type=positive(int), default=default_workers(), help="dataset generation processes")
    add("--backend", choices=sparse_flash.api.BACKENDS, default="auto", help="attention backend")
    add("--compile", action="store_true", help="torch.compile the model")
    add("--resume", action="store_true", help="continue each run from its checkpoint in --out when there is one")
    add("--init-from", metavar="CKPT", help="start from a checkpoint (a lower resolution's grid is upsampled)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse flags and fill every flag left unset from the preset."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = str(Path(__file__).resolve().parent / "results" / args.preset)
    if args.width % args.heads or args.width % 4:
        parser.error(f"--width must be a multiple of 4 and of --heads ({args.heads}), got {args.width}")
    head_dim, (lo, hi) = args.width // args.heads, sparse_flash.api.HEAD_DIM_RANGE
    if not lo <= head_dim <= hi:
        parser.error(f"--width / --heads must be between {lo} and {hi} (the head dimension), got {head_dim}")
    if args.n_train < args.batch_size:
        parser.error(f"--n-train ({args.n_train}) must be at least --batch-size ({args.batch_size})")
    if args.init_from and not Path(args.init_from).is_file():
        parser.error(f"--init-from: no such file: {args.init_from}")
    if args.init_from:
        config = ModelConfig(args.resolution, args.width, args.layers, args.heads, args.mlp_ratio)
        problem = init_from_mismatch(args.init_from, config)
        if problem:
            parser.error(f"--init-from {args.init_from}: {problem}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist = setup_distributed()
    if args.preset == "smoke" and dist.world > 1:
        raise SystemExit("the smoke preset runs as a single process; launch it with python, not torchrun")
    device = pick_device(args.device, dist)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    try:
        if args.preset == "smoke":
            run_smoke(args, device, dist)
        else:
            run_preset(args, device, dist)
    finally:
        if dist.world > 1:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
