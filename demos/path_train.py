"""Training for the Path-256 demo: data, augmentation, the schedule, resumable runs and checkpoints.

A run is defined by four frozen configs (model, masks, data, training) and driven by a `Control` that may
change between the pieces of one run (time budget, logging, checkpoint cadence). Everything a run needs to
continue exactly is in its checkpoint: weights, optimizer, step, training seconds, RNG states and metrics; the
data position is a function of the step (each epoch's permutation is seeded by the epoch, each step's flips
and masked pixels by the step), and the data itself is regenerated from its seed.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import inspect
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathfinder
from path_model import (
    ConfigError, MaskConfig, ModelConfig, PixelTransformer, classifier_parameters, describe_masks, layer_masks,
    transfer_state,
)

ADAM_BETAS = (0.9, 0.98)
GRAD_CLIP = 1.0
CHECKPOINT_FORMAT = 2
EVAL_SEED_OFFSET = 1_000_000  # held-out images come from seed + this: a seed range training never uses
DEVICE_DATA_LIMIT = 4 * 2**30  # larger datasets stay in host memory and go to the GPU batch by batch
MASK_FRACTION = 0.5  # masked-pixel pretraining hides this share of every image's pixels


# ----------------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataConfig:
    """Pathfinder images: generated at `resolution` px, averaged over `pool` x `pool` squares. Training images
    use seed `seed`, held-out images `eval_seed` (different, so never the same images)."""

    resolution: int
    pool: int
    difficulty: str
    n_train: int
    n_eval: int
    seed: int
    eval_seed: int

    @property
    def side(self) -> int:
        return self.resolution // self.pool

    @property
    def lra_protocol(self) -> bool:
        """Whether the run keeps Long Range Arena's fixed 160K training and 20K held-out images."""
        return self.n_train == 160_000 and self.n_eval == 20_000


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation: AdamW, linear warm-up then cosine decay to zero over `steps` steps or `train_seconds`
    seconds of training, whichever ends first (0: steps only); `pretrain_steps` of masked-pixel pretraining
    (same schedule shape over their own steps) come first."""

    batch_size: int
    lr: float
    weight_decay: float
    warmup: int
    steps: int
    train_seconds: float = 0.0
    pretrain_steps: int = 0
    augment: bool = False
    seed: int = 0


@dataclass(frozen=True)
class Control:
    """How this process runs a piece of training; free to change between pieces."""

    time_budget: float = 0.0  # wall seconds for this process from its start; stops early with a checkpoint
    stop_after: int = 0  # steps in this process, then stop with a checkpoint (0: no limit)
    eval_every: int = 500
    log_every: int = 25
    ckpt_every_seconds: float = 60.0
    compile: str = "off"  # off, or a torch.compile backend (inductor, aot_eager, eager)
    backend: str = "auto"
    resume: bool = False
    init_from: str | None = None
    concurrent: int = 1  # runs sharing this GPU (recorded: GPU minutes are wall minutes / concurrent)
    started: float = field(default_factory=time.monotonic)  # the process clock's zero


@dataclass(frozen=True)
class RunSpec:
    """One training run: its name, configs and files."""

    name: str
    preset: str
    model: ModelConfig
    mask: MaskConfig
    data: DataConfig
    train: TrainConfig
    out: Path

    @property
    def metrics_path(self) -> Path:
        return self.out / f"{self.preset}_{self.name}.json"

    @property
    def checkpoint_path(self) -> Path:
        return self.out / f"{self.preset}_{self.name}_ckpt.pt"


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# ----------------------------------------------------------------------------------------------------
# Logging and files
# ----------------------------------------------------------------------------------------------------


class RunLog:
    """Plain newline-terminated lines to stdout and appended to a log file as they come (rank 0 only)."""

    def __init__(self, path: Path | None = None, enabled: bool = True):
        self.path, self.enabled = path, enabled
        if path is not None and enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        print(message, flush=True)
        if self.path is not None:
            with open(self.path, "a") as handle:
                handle.write(message + "\n")


def save_atomically(path: Path, save) -> None:
    """Write through a temporary file in the same folder, flushed to disk, then rename it over `path`: a reader
    sees the old file or the new one, never a partial one, even when the writer is killed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        save(partial)
        with open(partial, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_json(path: Path, data) -> None:
    save_atomically(path, lambda p: p.write_text(json.dumps(data, indent=2, default=str) + "\n"))


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive lock on `path` between processes (released when the holder exits, even when killed)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def git_commit() -> str | None:
    """The commit the code comes from: $SPARSE_FLASH_COMMIT when set (a copy of the tree run elsewhere, e.g. on a
    GPU machine whose repository is not the one the tree came from), else the repository's HEAD, with "+dirty"
    when demos/ or sparse_flash/ have uncommitted changes; None outside git."""
    if os.environ.get("SPARSE_FLASH_COMMIT"):
        return os.environ["SPARSE_FLASH_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "demos", "sparse_flash"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) or None


def environment(device: torch.device, dist: Dist) -> dict:
    """Date, device, commit and library versions, recorded in every result file."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "gpus": dist.world if device.type == "cuda" else 0,
        "commit": git_commit(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
    }


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------


def generator_takes_pool() -> bool:
    """Whether demos/pathfinder.py's load_or_generate has the `pool` argument (256-px images averaged down)."""
    return "pool" in inspect.signature(pathfinder.load_or_generate).parameters


def load_split(config: DataConfig, split: str, cache_dir: str, workers: int, progress: bool) -> tuple:
    """The training or held-out images as uint8 numpy `(n, side*side)` and int64 labels.

    Processes sharing a cache take turns on a lock file: the first generates and caches the set, the others
    wait and then read it.
    """
    n, seed = (config.n_train, config.seed) if split == "train" else (config.n_eval, config.eval_seed)
    cache = Path(cache_dir).expanduser()
    extra = {"pool": config.pool} if config.pool != 1 else {}
    lock = cache / f"pathfinder{config.resolution}_{config.difficulty}_n{n}_seed{seed}_pool{config.pool}.lock"
    with file_lock(lock):  # a process that waits here finds the cache filled by the one that generated it
        images, labels = pathfinder.load_or_generate(
            n, config.resolution, config.difficulty, seed, cache_dir=cache, workers=workers, progress=progress,
            **extra,
        )
    if images.shape[1:] != (config.side, config.side):
        raise ConfigError(f"the generator returned images of {images.shape[1:]}, expected {config.side} px")
    return images.reshape(len(images), -1), labels


@dataclass
class Data:
    """Images as uint8 token rows `(n, side**2)` (row-major) and int64 labels; on the GPU when they fit."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    eval_images: torch.Tensor
    eval_labels: torch.Tensor
    device: torch.device

    def batch(self, images: torch.Tensor, labels: torch.Tensor, index: torch.Tensor):
        """Rows `index` of (images, labels), on the training device."""
        return to_device(images, labels, index, self.device)


def to_device(images: torch.Tensor, labels: torch.Tensor, index: torch.Tensor, device: torch.device):
    return images[index].to(device, non_blocking=True), labels[index].to(device, non_blocking=True)


def load_data(config: DataConfig, cache_dir: str, workers: int, device: torch.device, dist: Dist,
              log: RunLog, splits=("train", "eval")) -> Data:
    """Generate or load the splits (rank 0 first, then the other ranks read the cache) and place them."""
    started = time.perf_counter()
    counts = {"train": (config.n_train, config.seed), "eval": (config.n_eval, config.eval_seed)}
    log(f"data: loading or generating {', '.join(f'{counts[s][0]:,} {s} images (seed {counts[s][1]})' for s in splits)}"
        f" of {config.resolution} px {config.difficulty} in {Path(cache_dir).expanduser()}, {workers} workers")
    arrays = {}
    for turn in (0, 1) if dist.world > 1 else (0,):
        if (turn == 0) == dist.is_main:
            for split in splits:
                # pathfinder's progress line is redrawn with carriage returns: only on a terminal
                arrays[split] = load_split(config, split, cache_dir, workers,
                                           progress=dist.is_main)
        if dist.world > 1 and turn == 0:
            torch.distributed.barrier()
    nbytes = sum(images.nbytes for images, _ in arrays.values())
    place = device if nbytes <= DEVICE_DATA_LIMIT else torch.device("cpu")
    empty = (torch.empty(0, config.side**2, dtype=torch.uint8), torch.empty(0, dtype=torch.int64))
    tensors = {}
    for split in ("train", "eval"):
        images, labels = arrays.get(split, empty)
        tensors[split] = (torch.as_tensor(images).to(place), torch.as_tensor(labels).long().to(place))
    pooled = f", averaged {config.pool}x{config.pool} from {config.resolution} px" if config.pool > 1 else ""
    log(f"data: {len(tensors['train'][1]):,} training (seed {config.seed}) + {len(tensors['eval'][1]):,} held-out "
        f"(seed {config.eval_seed}) Pathfinder images, {config.difficulty}, {config.side} px{pooled} "
        f"({config.side**2:,} tokens), on {place.type}, ready in {time.perf_counter() - started:.1f} s")
    return Data(*tensors["train"], *tensors["eval"], device)


class BatchSampler:
    """Training-set indices for each step: each epoch a fresh permutation seeded by (seed, epoch), so the
    data position is a function of the step; the global batch of `batch_size * world` splits by rank."""

    def __init__(self, n: int, batch_size: int, seed: int, dist: Dist, device: torch.device):
        global_batch = batch_size * dist.world
        if n < global_batch:
            raise ConfigError(f"--n-train ({n}) must be at least the global batch (batch size x GPUs = "
                              f"{global_batch})")
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


def step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """The random stream of one step (flips, masked pixels): a function of (seed, step) alone. Each rank draws
    for the whole global batch and keeps its own rows (`rank_rows`), so a step's images are the same on any
    number of processes."""
    return torch.Generator(device=device).manual_seed((seed * 2**40 + step * 2**10) % 2**63)


def rank_rows(draws: torch.Tensor, dist: Dist) -> torch.Tensor:
    """This rank's rows of draws made for the global batch `(world * B, ...)`: rows rank*B .. (rank+1)*B, the
    rows of the images `BatchSampler` gives this rank."""
    batch = len(draws) // dist.world
    return draws[dist.rank * batch : (dist.rank + 1) * batch]


def dihedral_permutations(side: int) -> torch.Tensor:
    """int64 `(8, side*side)`: the 8 symmetries of the square (4 rotations, each optionally transposed) as
    gathers of row-major pixels; row 0 is the identity."""
    grid = torch.arange(side * side).reshape(side, side)
    views = [torch.rot90(g, k, (0, 1)) for g in (grid, grid.T) for k in range(4)]
    return torch.stack([v.reshape(-1) for v in views])


def augment(pixels: torch.Tensor, permutations: torch.Tensor, generator: torch.Generator,
            dist: Dist = Dist()) -> torch.Tensor:
    """Each image `(B, N)` row-major under one of the 8 symmetries of the square, drawn per sample of the global
    batch (`B` x `dist.world`; this rank keeps its rows). The label (are the circles on one path?) does not
    change under any of them."""
    draws = torch.randint(0, 8, (len(pixels) * dist.world,), generator=generator, device=pixels.device)
    return pixels.gather(1, permutations[rank_rows(draws, dist)])


def masked_positions(batch: int, n: int, generator: torch.Generator, device, dist: Dist = Dist()) -> torch.Tensor:
    """int64 `(batch, n * MASK_FRACTION)`: which token positions of each image are masked (a fixed count, so
    shapes stay static under torch.compile), drawn for the global batch (`batch` x `dist.world`; this rank
    keeps its rows)."""
    scores = rank_rows(torch.rand(batch * dist.world, n, generator=generator, device=device), dist)
    return scores.argsort(dim=1)[:, : int(n * MASK_FRACTION)]


# ----------------------------------------------------------------------------------------------------
# Optimisation
# ----------------------------------------------------------------------------------------------------


def learning_rate(base_lr: float, warmup: int, step: int, progress: float) -> float:
    """Linear warm-up over `warmup` steps times a cosine decay to zero as `progress` goes from 0 to 1."""
    warm = min(1.0, (step + 1) / max(1, warmup))
    return base_lr * warm * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only (not on biases and LayerNorm gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=ADAM_BETAS, fused=device.type == "cuda")


def compiled(model: nn.Module, control: Control) -> nn.Module:
    """`model` under torch.compile with `control`'s backend (itself when "off")."""
    return model if control.compile == "off" else torch.compile(model, backend=control.compile)


def autocast(device: torch.device):
    """bf16 autocast on the GPU; full precision on the CPU."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def optimizer_step(net, optimizer, loss: torch.Tensor, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], GRAD_CLIP)
    optimizer.step()


def classify_step(net, optimizer, pixels, labels, lr: float, device: torch.device):
    """One classification step; the batch's mean loss and correct answers as device tensors, and its size."""
    with autocast(device):
        logits = net(pixels)
    loss = F.cross_entropy(logits.float(), labels)
    optimizer_step(net, optimizer, loss, lr)
    return loss.detach(), (logits.argmax(dim=-1) == labels).sum(), len(labels)


def pretrain_step(net, model: PixelTransformer, optimizer, pixels, lr: float, generator, device: torch.device,
                  dist: Dist = Dist()):
    """One masked-pixel step: half the pixels become the mask token, 256-way cross-entropy on them."""
    masked = masked_positions(len(pixels), pixels.shape[1], generator, pixels.device, dist)
    targets = model.tokens(pixels).gather(1, masked).long()
    with autocast(device):
        logits = net(pixels, masked)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    optimizer_step(net, optimizer, loss, lr)
    return loss.detach(), (logits.argmax(dim=-1) == targets).sum(), targets.numel()


EVAL_PROGRESS_SECONDS = 30.0  # an evaluation longer than this prints how far it is (a long eval is never silent)


@torch.no_grad()
def evaluate(model, images, labels, batch_size: int, device: torch.device, dist: Dist) -> dict:
    """Mean loss, accuracy and the count of correct answers on held-out images; each rank takes every
    world-th batch. Rank 0 prints its progress every `EVAL_PROGRESS_SECONDS`."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, device=device, dtype=torch.float64)  # loss sum, correct, count
    started = last_print = time.monotonic()
    starts = range(dist.rank * batch_size, len(labels), batch_size * dist.world)
    for done, start in enumerate(starts):
        now = time.monotonic()
        if dist.rank == 0 and done and now - last_print >= EVAL_PROGRESS_SECONDS:
            last_print = now
            left = (now - started) / done * (len(starts) - done)
            print(f"evaluating: {done * batch_size * dist.world:,}/{len(labels):,} held-out images, "
                  f"{now - started:.0f} s, ~{left:.0f} s left", flush=True)
        index = torch.arange(start, min(start + batch_size, len(labels)), device=images.device)
        pixels, y = to_device(images, labels, index, device)
        with autocast(device):
            logits = model(pixels)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        totals[1] += (logits.argmax(dim=-1) == y).sum()
        totals[2] += len(y)
    if dist.world > 1:
        torch.distributed.all_reduce(totals)
    model.train(was_training)
    loss_sum, correct, count = totals.tolist()
    return {"loss": loss_sum / max(count, 1), "acc": correct / max(count, 1), "correct": int(correct),
            "count": int(count)}


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


# ----------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------


def rng_state(device: torch.device) -> dict:
    """Every random state a run touches: torch (CPU and CUDA), numpy and Python."""
    numpy_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else [],
        "numpy": {**numpy_state, "state": {"key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                                           "pos": numpy_state["state"]["pos"]}},
        "python": random.getstate(),
    }


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy_state = dict(state["numpy"])
    numpy_state["state"] = {"key": state["numpy"]["state"]["key"].numpy().astype(np.uint32),
                            "pos": state["numpy"]["state"]["pos"]}
    np.random.set_state(numpy_state)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def config_dicts(spec: RunSpec) -> dict:
    return {"model_config": asdict(spec.model), "mask_config": asdict(spec.mask), "data_config": asdict(spec.data),
            "train_config": asdict(spec.train)}


def read_checkpoint(path: str | os.PathLike, flag: str) -> dict:
    """A checkpoint file's contents; ConfigError in one line when it is missing, corrupt or not ours."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag}: no checkpoint at {path}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many kinds on damaged files
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{flag}: {path} is corrupt or truncated, not a readable checkpoint ({reason[:160]})")
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{flag}: {path} is not a path256 checkpoint of format {CHECKPOINT_FORMAT}")
    missing = [key for key in ("model", *CONFIG_KEYS) if not isinstance(checkpoint.get(key), dict)]
    if missing:
        raise ConfigError(f"{flag}: {path} lacks {', '.join(missing)}: not a whole path256 checkpoint")
    try:
        model = checkpoint_configs(checkpoint)[0]
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{flag}: {path} holds an invalid configuration ({str(error)[:160]})") from None
    problems = model.problems()
    if problems:
        raise ConfigError(f"{flag}: {path} holds an invalid model config ({'; '.join(problems)})")
    return checkpoint


CONFIG_KEYS = ("model_config", "mask_config", "data_config", "train_config")


def checkpoint_configs(checkpoint: dict) -> tuple[ModelConfig, MaskConfig, DataConfig, TrainConfig]:
    def build(cls, values: dict):
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        return cls(**values)

    model = build(ModelConfig, checkpoint["model_config"])
    mask = build(MaskConfig, checkpoint["mask_config"])
    return model, mask, build(DataConfig, checkpoint["data_config"]), build(TrainConfig, checkpoint["train_config"])


def differences(theirs: dict, mine: dict, ignore=()) -> list[str]:
    return [f"{key} {theirs.get(key)!r} vs {mine[key]!r}" for key in mine
            if key not in ignore and _plain(theirs.get(key)) != _plain(mine[key])]


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


SCHEDULE_KEYS = ("steps", "train_seconds")  # a resumed run may extend its schedule


def check_resume(spec: RunSpec, checkpoint: dict, world: int = 1) -> list[str]:
    """ConfigError unless `checkpoint` is this run's (same model, masks, data and training but for the
    schedule's length); returns the changes: the schedule's, and the split of the global batch over processes.

    A run resumes on any number of processes (`world`, torchrun ranks) that keeps its global batch, `--batch-size`
    x processes (each step then reads the same images; the sampler splits them by rank): 2 processes of 128 go on
    as 1 of 256.
    """
    mine = config_dicts(spec)
    problems = []
    for key, values in mine.items():
        ignore = (*SCHEDULE_KEYS, "batch_size") if key == "train_config" else ()
        problems += differences(checkpoint.get(key, {}), values, ignore)
    theirs_world = checkpoint.get("world", 1)
    theirs_global = checkpoint["train_config"]["batch_size"] * theirs_world
    if theirs_global != spec.train.batch_size * world:
        problems.append(f"global batch {theirs_global} ({checkpoint['train_config']['batch_size']} x {theirs_world} "
                        f"processes) vs {spec.train.batch_size * world} ({spec.train.batch_size} x {world})")
    if problems:
        raise ConfigError(f"--resume: {spec.checkpoint_path} was trained with other settings "
                          f"({'; '.join(problems)}); pass the same flags or a new --out")
    changes = differences(checkpoint["train_config"], mine["train_config"], ("batch_size",))
    if theirs_world != world:
        changes.append(f"global batch {theirs_global} split over {world} processes instead of {theirs_world}")
    return changes


def check_init(spec: RunSpec, checkpoint: dict, path) -> ModelConfig:
    """ConfigError unless `checkpoint`'s weights fit this run's model; returns the checkpoint's model config."""
    theirs = checkpoint_configs(checkpoint)[0]
    problems = spec.model.shape_mismatch(theirs)
    if problems:
        raise ConfigError(f"--init-from {path}: the checkpoint's model differs ({', '.join(problems)}); "
                          "pass matching flags")
    return theirs


# ----------------------------------------------------------------------------------------------------
# The training run
# ----------------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    step: int = 0  # optimizer steps, pretraining included
    samples: int = 0  # images seen, all ranks together
    seconds: float = 0.0  # training wall time, evaluations included, over all pieces
    pretrain_seconds: float = 0.0  # the part of `seconds` spent pretraining
    pieces: int = 0  # processes that trained this run


@dataclass
class Window:
    """Training totals over an interval, on this rank: loss sum, correct answers, count and seconds."""

    loss_sum: float = 0.0
    correct: float = 0.0
    count: int = 0
    seconds: float = 0.0
    samples: int = 0

    def __add__(self, other: "Window") -> "Window":
        return Window(self.loss_sum + other.loss_sum, self.correct + other.correct, self.count + other.count,
                      self.seconds + other.seconds, self.samples + other.samples)

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.count if self.count else None

    @property
    def acc(self) -> float | None:
        return self.correct / self.count if self.count else None

    def rate(self, world: int) -> float | None:
        """Images per second, all ranks together."""
        return self.samples * world / self.seconds if self.seconds else None


class Meter:
    """Sums of loss and correct answers kept on the device, so training steps never wait for the GPU;
    `flush()` synchronises once and returns the `Window` since the previous flush or reset."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self.correct = torch.zeros((), device=self.device, dtype=torch.float64)
        self.count = self.samples = 0
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, correct: torch.Tensor, count: int, samples: int) -> None:
        self.loss_sum += loss * count
        self.correct += correct
        self.count += count
        self.samples += samples

    def flush(self) -> Window:
        loss_sum, correct = torch.stack([self.loss_sum, self.correct]).tolist()
        window = Window(loss_sum, correct, self.count, time.perf_counter() - self.started, self.samples)
        self.reset()
        return window


class Trainer:
    """One run: builds (or restores) the model and optimizer, trains until the schedule ends or this piece must
    stop, evaluates on the held-out images every `eval_every` classification steps and at the end, and writes
    metrics and checkpoints to the run's files (rank 0).

    `metrics["train_log"]`: step, samples, phase, loss, accuracy, lr, samples/s every `log_every` steps;
    `metrics["evals"]`: step, samples, training and held-out loss and accuracy (with counts), samples/s, peak
    memory and seconds at every evaluation.
    """

    def __init__(self, spec: RunSpec, control: Control, data: Data, device: torch.device, dist: Dist,
                 log: RunLog):
        self.spec, self.control, self.data, self.device, self.dist, self.log = spec, control, data, device, dist, log
        torch.manual_seed(spec.train.seed)
        self.masks = layer_masks(spec.mask, spec.model, device)
        self.model = PixelTransformer(spec.model, self.masks, control.backend).to(device)
        if spec.train.pretrain_steps == 0:
            self.model.pixel_head.requires_grad_(False)
        self.optimizer = make_optimizer(self.model, spec.train.lr, spec.train.weight_decay, device)
        self.state = TrainState()
        self.metrics = {
            "preset": spec.preset, "run": spec.name, "mask": describe_masks(self.masks, spec.mask),
            **config_dicts(spec), "parameters": classifier_parameters(self.model),
            "lra_protocol": spec.data.lra_protocol, "world": dist.world, "concurrent": control.concurrent,
            "environment": environment(device, dist),
            "train_log": [], "evals": [], "pieces": [],
        }
        self.start_from_checkpoints()
        self.net = self.wrap(self.model)
        self.augmentations = dihedral_permutations(spec.model.side).to(device) if spec.train.augment else None
        self.last_saved = time.monotonic()
        self.longest_eval = self.longest_save = 0.0
        self.stop_reason = None
        description = self.metrics["mask"]
        log(f"[{spec.name}] {self.metrics['parameters']:,} parameters; masks {description['name']} "
            f"(density {description['density']:.2%}, block {spec.mask.block_size}); positions {spec.model.pos}, "
            f"{spec.model.order} order, {spec.model.head} pooling")

    # ------------------------------------------------------------------ setup
    def start_from_checkpoints(self) -> None:
        """Resume this run (`--resume`), or initialise from another run's weights (`--init-from`)."""
        path = self.spec.checkpoint_path
        if self.control.resume:
            checkpoint = read_checkpoint(path, "--resume")
            extended = check_resume(self.spec, checkpoint, self.dist.world)
            if extended:
                self.log(f"[{self.spec.name}] resuming with changes: {'; '.join(extended)}")
            self.model.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.state = TrainState(**checkpoint["state"])
            self.metrics = {**checkpoint["metrics"], **config_dicts(self.spec), "concurrent": self.control.concurrent,
                            "world": self.dist.world}
            set_rng_state(checkpoint["rng"], self.device)
            self.log(f"[{self.spec.name}] resumed from {path} at step {self.state.step} "
                     f"({self.state.seconds:.0f} s of training so far)")
        elif self.control.init_from:
            checkpoint = read_checkpoint(self.control.init_from, "--init-from")
            theirs = check_init(self.spec, checkpoint, self.control.init_from)
            self.model.load_state_dict(transfer_state(checkpoint["model"], self.model))
            self.metrics["init_from"] = {"path": str(self.control.init_from), "side": theirs.side,
                                         "order": theirs.order, "tile": list(theirs.tile),
                                         "step": checkpoint["state"]["step"]}
            self.log(f"[{self.spec.name}] initialised from {self.control.init_from} ({theirs.side} px, "
                     f"{theirs.order} order) at {self.spec.model.side} px, {self.spec.model.order} order")

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP across the torchrun ranks, and torch.compile with `--compile`."""
        if self.dist.world > 1:
            device_ids = [self.dist.local_rank] if self.device.type == "cuda" else None
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=device_ids, find_unused_parameters=self.spec.train.pretrain_steps > 0)
        return compiled(model, self.control)

    # ------------------------------------------------------------------ schedule
    @property
    def total_steps(self) -> int:
        return self.spec.train.pretrain_steps + self.spec.train.steps

    def phase(self) -> str:
        return "pretrain" if self.state.step < self.spec.train.pretrain_steps else "classify"

    def classify_seconds(self) -> float:
        return self.state.seconds - self.state.pretrain_seconds if self.phase() == "classify" else 0.0

    def lr(self) -> float:
        train, step = self.spec.train, self.state.step
        if self.phase() == "pretrain":
            return learning_rate(train.lr, train.warmup, step, step / train.pretrain_steps)
        k = step - train.pretrain_steps
        by_time = self.classify_seconds() / train.train_seconds if train.train_seconds else 0.0
        return learning_rate(train.lr, train.warmup, k, max(k / train.steps, by_time))

    def schedule_done(self) -> bool:
        train = self.spec.train
        out_of_time = train.train_seconds and self.classify_seconds() >= train.train_seconds
        return self.state.step >= self.total_steps or bool(out_of_time)

    def wall_left(self, wall: float) -> float:
        return self.control.time_budget - wall if self.control.time_budget else math.inf

    def reserve_seconds(self, rate: float | None) -> float:
        """Time kept back before the wall limit for the last evaluation and checkpoint."""
        eval_guess = self.longest_eval or (len(self.data.eval_labels) / rate if rate else 30.0)
        return 1.5 * (eval_guess + self.longest_save) + 5.0

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict:
        """Train this piece, evaluate and save; returns the metrics."""
        spec, state, control = self.spec, self.state, self.control
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        sampler = BatchSampler(len(self.data.train_labels), spec.train.batch_size, spec.train.seed, self.dist,
                               self.data.train_images.device)
        meter, since_eval = Meter(self.device), Window()
        piece = {"started_step": state.step, "started_seconds": state.seconds,
                 "environment": environment(self.device, self.dist)}
        clock = time.perf_counter() - state.seconds  # training seconds run on from the checkpoint's
        steps_here = 0
        rate = None
        while not self.schedule_done():
            phase, lr = self.phase(), self.lr()
            index = sampler(state.step)
            pixels, labels = self.data.batch(self.data.train_images, self.data.train_labels, index)
            generator = step_generator(spec.train.seed, state.step, self.device)
            if self.augmentations is not None:
                pixels = augment(pixels, self.augmentations, generator, self.dist)
            if phase == "pretrain":
                result = pretrain_step(self.net, self.model, self.optimizer, pixels, lr, generator, self.device,
                                       self.dist)
            else:
                result = classify_step(self.net, self.optimizer, pixels, labels, lr, self.device)
            meter.add(*result, len(labels))
            state.step += 1
            steps_here += 1
            state.samples += len(labels) * self.dist.world
            if steps_here == 1:  # the first step of a piece compiles (torch.compile, Triton): not training time
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.log(f"[{spec.name}] first step of this piece took {time.perf_counter() - clock - state.seconds:.1f} s "
                         "(compilation; not counted as training time)")
                clock = time.perf_counter() - state.seconds
            phase_ends = state.step == spec.train.pretrain_steps
            eval_due = self.phase() == "classify" and not phase_ends and (
                (state.step - spec.train.pretrain_steps) % control.eval_every == 0)
            if not (eval_due or phase_ends or state.step % control.log_every == 0 or self.schedule_done()
                    or steps_here == control.stop_after):
                continue
            window = meter.flush()  # the only host sync of a training step
            since_eval += window
            rate = window.rate(self.dist.world) or rate
            state.seconds, wall = self.agreed_clock(clock)
            if phase_ends:
                state.pretrain_seconds = state.seconds
            self.record_train(window, lr, phase)
            if eval_due:
                self.record_eval(since_eval)
                meter.reset()  # evaluation time is not training time
                since_eval = Window()
            if control.stop_after and steps_here >= control.stop_after:
                self.stop_reason = f"--stop-after {control.stop_after} steps"
            elif self.wall_left(wall) <= self.reserve_seconds(rate):
                self.stop_reason = f"--time-budget {control.time_budget:.0f} s (wall {wall:.0f} s)"
            elif time.monotonic() - self.last_saved >= control.ckpt_every_seconds:
                self.save()
            if self.stop_reason:
                break
        if self.phase() == "classify" and (not self.metrics["evals"] or self.metrics["evals"][-1]["step"] != state.step):
            self.record_eval(since_eval)
        state.pieces += 1
        self.metrics["pieces"].append({**piece, "ended_step": state.step, "ended_seconds": state.seconds,
                                       "stop": self.stop_reason or "schedule done"})
        self.metrics["finished"] = self.schedule_done()
        self.save()
        ending = "stopped by " + self.stop_reason if self.stop_reason else "schedule done"
        self.log(f"[{spec.name}] {ending} at step {state.step}; checkpoint {spec.checkpoint_path}")
        return self.metrics

    def agreed_clock(self, clock: float) -> tuple[float, float]:
        """(training seconds of the run, wall seconds of this process) by rank 0's clocks, the same on every
        rank (they drive stopping and the schedule)."""
        values = [time.perf_counter() - clock, time.monotonic() - self.control.started]
        if self.dist.world > 1:
            tensor = torch.tensor(values, device=self.device, dtype=torch.float64)
            torch.distributed.broadcast(tensor, src=0)
            values = tensor.tolist()
        return values[0], values[1]

    # ------------------------------------------------------------------ records
    def record_train(self, window: Window, lr: float, phase: str) -> None:
        state, rate = self.state, window.rate(self.dist.world)
        self.metrics["train_log"].append({"step": state.step, "samples": state.samples, "phase": phase,
                                          "loss": window.loss, "acc": window.acc, "lr": lr, "samples_per_s": rate})
        evals = self.metrics["evals"]
        held_out = f"{evals[-1]['eval_acc']:.2%}" if evals else "-"
        what = "masked-pixel " if phase == "pretrain" else ""
        self.log(f"[{self.spec.name}] step {state.step}/{self.total_steps} samples {state.samples:,} {phase} "
                 f"{what}loss {window.loss:.4f} {what}acc {window.acc:.3f} held-out {held_out} lr {lr:.2e} "
                 f"samples/s {rate or 0:,.0f} elapsed {state.seconds:.1f}s")

    def record_eval(self, since_eval: Window) -> None:
        """Evaluate on the held-out images, log, and write the metrics and a checkpoint (rank 0)."""
        started = time.perf_counter()
        result = evaluate(self.model, self.data.eval_images, self.data.eval_labels, self.spec.train.batch_size,
                          self.device, self.dist)
        self.longest_eval = max(self.longest_eval, time.perf_counter() - started)
        state = self.state
        self.metrics["evals"].append({
            "step": state.step, "samples": state.samples, "train_loss": since_eval.loss, "train_acc": since_eval.acc,
            "eval_loss": result["loss"], "eval_acc": result["acc"], "eval_correct": result["correct"],
            "eval_count": result["count"], "samples_per_s": since_eval.rate(self.dist.world),
            "peak_memory_gib": peak_memory_gib(self.device), "seconds": state.seconds,
        })
        self.log(f"[{self.spec.name}] eval step {state.step} samples {state.samples:,} held-out loss "
                 f"{result['loss']:.4f} acc {result['acc']:.2%} ({result['correct']:,}/{result['count']:,}) "
                 f"elapsed {state.seconds:.1f}s")
        self.save()

    def save(self) -> None:
        """Metrics JSON and checkpoint, each written atomically (rank 0)."""
        self.last_saved = time.monotonic()
        if not self.dist.is_main:
            return
        started = time.perf_counter()
        write_json(self.spec.metrics_path, self.metrics)
        checkpoint = {
            "format": CHECKPOINT_FORMAT, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            **config_dicts(self.spec), "world": self.dist.world, "state": asdict(self.state),
            "rng": rng_state(self.device),
            "metrics": json.loads(json.dumps(self.metrics, default=str)),
        }
        save_atomically(self.spec.checkpoint_path, lambda p: torch.save(checkpoint, p))
        self.longest_save = max(self.longest_save, time.perf_counter() - started)
