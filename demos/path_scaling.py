#!/usr/bin/env python3
"""Scaling of the Path demo over the GPUs of one machine: the same run on 1 GPU and on G GPUs (torchrun, DDP),
and a run that switches between them through its checkpoints.

Three runs of `path256.py` with the flags given after `--`, each `--steps S` at the global batch `--batch-size B`
(B / G per process on G GPUs), on a step-based schedule so that all three take the same steps on the same images
(a step's images, flips and masked pixels do not depend on the number of processes):

- `one`: 1 GPU, steps 0..S;
- `many`: G GPUs, steps 0..S (samples/s against `one`: the scaling efficiency, at the same global batch);
- `switch`: 1 GPU to S/3, G GPUs to 2S/3, 1 GPU to S (each piece resumes the last one's checkpoint).

It prints each run's samples/s, held-out accuracy and how far its weights are from `one`'s, writes
`<out>/scaling.json` and, with `--record STAGE`, appends a record (task "scaling", `gpus` = G) to
`demos/results/results.json`. Example (the 256-px stage from its committed weights, 240 steps)::

    python demos/path_scaling.py --gpus 2 --steps 240 --batch-size 32 --out demos/runs/scale256 \\
        --init-from demos/checkpoints/path256hard.pt --record path256hard -- \\
        --preset path32hard --resolution 256 --order tile --tile 16x8 \\
        --mask neighborhood,neighborhood,butterfly2d,butterfly2d --global-blocks 1 --pos rope2d --lr 1e-4 --warmup 50

On a machine without GPUs the processes use gloo on the CPU (`--device cpu` among the flags).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import results_table  # noqa: E402

# NVLink multicast stays off in every process this starts (NCCL, PyTorch's symmetric memory, NVSHMEM).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
STDERR_LINES = 60  # the end of a failed piece's stderr that the driver's error repeats


@dataclass(frozen=True)
class Piece:
    """Part of a run: `processes` processes train up to step `until` (the run's last step: to the end)."""
    processes: int
    until: int


@dataclass(frozen=True)
class Outcome:
    """One run's result, read from its checkpoint."""
    name: str
    processes: str  # e.g. "1", "2", "1 -> 2 -> 1"
    steps: int
    samples_per_s: float | None
    held_out_acc: float
    held_out_correct: int
    n_eval: int
    weights_vs_one: float  # ||w - w_one|| / ||w_one|| over all parameters (0 for `one`)
    seconds: float  # wall seconds of all its processes, start-up and compilation included


def plan(steps: int, gpus: int) -> dict[str, list[Piece]]:
    """The three runs as pieces (module docstring)."""
    return {"one": [Piece(1, steps)], "many": [Piece(gpus, steps)],
            "switch": [Piece(1, steps // 3), Piece(gpus, 2 * steps // 3), Piece(1, steps)]}


def piece_command(piece: Piece, first: bool, start: int, args, flags: list[str], out: Path) -> list[str]:
    """The command line of one piece: python, or torchrun when it has several processes."""
    launcher = [sys.executable]
    if piece.processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={piece.processes}"]
    command = launcher + [str(HERE / "path256.py"), *flags, "--batch-size", str(args.batch_size // piece.processes),
                          "--steps", str(args.steps), "--train-seconds", "0", "--out", str(out)]
    if first and args.init_from:
        command += ["--init-from", args.init_from]
    if not first:
        command.append("--resume")
    if piece.until < args.steps:
        command += ["--stop-after", str(piece.until - start)]
    return command


def checkpoint_of(out: Path) -> Path:
    found = sorted(out.glob("*_ckpt.pt"))
    if len(found) != 1:
        raise RuntimeError(f"expected one checkpoint in {out}, found {[p.name for p in found]}")
    return found[0]


def weights_distance(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all floating-point tensors of two state dicts."""
    diff = sum(float((a[k].double() - v.double()).square().sum()) for k, v in b.items() if v.is_floating_point())
    norm = sum(float(v.double().square().sum()) for v in b.values() if v.is_floating_point())
    return math.sqrt(diff / norm)


def outcome(name: str, pieces: list[Piece], out: Path, seconds: float, one_weights: dict | None) -> Outcome:
    checkpoint = torch.load(checkpoint_of(out), map_location="cpu", weights_only=False)
    metrics, last = checkpoint["metrics"], checkpoint["metrics"]["evals"][-1]
    distance = 0.0 if one_weights is None else weights_distance(checkpoint["model"], one_weights)
    return Outcome(name, " -> ".join(str(p.processes) for p in pieces), checkpoint["state"]["step"],
                   results_table.median_rate(metrics), last["eval_acc"], last["eval_correct"], last["eval_count"],
                   distance, seconds)


def noise_band(acc: float, n: int) -> float:
    """Two standard errors of the difference of two accuracies of `n` images each."""
    return 2 * math.sqrt(2 * acc * (1 - acc) / n)


def summary(outcomes: dict[str, Outcome], gpus: int, args) -> dict:
    one, many = outcomes["one"], outcomes["many"]
    efficiency = (many.samples_per_s / (gpus * one.samples_per_s)
                  if many.samples_per_s and one.samples_per_s else None)
    band = noise_band(one.held_out_acc, one.n_eval)
    return {
        "gpus": gpus, "global_batch": args.batch_size, "steps": args.steps, "efficiency": efficiency,
        "noise_band": band,
        "accuracy_within_noise": all(abs(o.held_out_acc - one.held_out_acc) <= band for o in outcomes.values()),
        "runs": {name: asdict(o) for name, o in outcomes.items()},
    }


def record(result: dict, stage: str, command: str) -> dict:
    """The results.json record of a scaling run."""
    one, many, switch = (result["runs"][k] for k in ("one", "many", "switch"))
    return {
        "task": "scaling", "stage": stage, "gpus": result["gpus"], "global_batch": result["global_batch"],
        "steps": result["steps"], "samples_per_s_1gpu": one["samples_per_s"], "samples_per_s": many["samples_per_s"],
        "efficiency": result["efficiency"], "n_eval": one["n_eval"], "held_out_acc_1gpu": one["held_out_acc"],
        "held_out_acc": many["held_out_acc"], "held_out_acc_switch": switch["held_out_acc"],
        "switch": switch["processes"], "weights_vs_1gpu": many["weights_vs_one"],
        "weights_vs_1gpu_switch": switch["weights_vs_one"], "accuracy_within_noise": result["accuracy_within_noise"],
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "commit": os.environ.get("SPARSE_FLASH_COMMIT"), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
    }


def print_table(result: dict) -> None:
    print(f"{'run':8} {'GPUs':>12} {'steps':>6} {'samples/s':>10} {'held-out':>16} {'weights vs one':>15} {'wall s':>7}")
    for o in result["runs"].values():
        rate = f"{o['samples_per_s']:,.1f}" if o["samples_per_s"] else "-"
        print(f"{o['name']:8} {o['processes']:>12} {o['steps']:>6} {rate:>10} "
              f"{o['held_out_acc']:>8.2%} ({o['held_out_correct']:,}/{o['n_eval']:,}) "
              f"{o['weights_vs_one']:>15.2e} {o['seconds']:>7.0f}")
    efficiency = result["efficiency"]
    print(f"scaling efficiency at {result['gpus']} GPUs (same global batch {result['global_batch']}): "
          + (f"{efficiency:.1%}" if efficiency is not None else "-")
          + f"; held-out accuracies within noise (+-{result['noise_band']:.2%}): {result['accuracy_within_noise']}")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        argv, flags = argv[:cut], argv[cut + 1:]
    else:
        flags = []
    parser = argparse.ArgumentParser(prog="path_scaling.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=max(torch.cuda.device_count(), 2),
                        help="processes of the many-GPU runs (default: the GPUs here, at least 2)")
    parser.add_argument("--steps", type=int, required=True, help="steps of each run")
    parser.add_argument("--batch-size", type=int, required=True, help="global batch (divisible by --gpus)")
    parser.add_argument("--init-from", help="checkpoint the runs start from (path256.py --init-from)")
    parser.add_argument("--out", type=Path, required=True, help="folder of the three runs and scaling.json")
    parser.add_argument("--runs", default="one,many,switch", help="which runs (a comma list; default all three)")
    parser.add_argument("--record", metavar="STAGE", help="append a record of task 'scaling' to results.json")
    args = parser.parse_args(argv)
    if args.gpus < 2:
        parser.error(f"--gpus must be at least 2, got {args.gpus}")
    if args.batch_size < args.gpus:
        parser.error(f"--batch-size (the global batch) must be at least --gpus ({args.gpus}), got {args.batch_size}")
    if args.batch_size % args.gpus:
        parser.error(f"--batch-size (the global batch, {args.batch_size}) must be divisible by --gpus ({args.gpus})")
    if args.steps < 3:
        parser.error(f"--steps must be at least 3 (the switch run has three pieces), got {args.steps}")
    on_cpu = "--device" in flags and flags[flags.index("--device") + 1:][:1] == ["cpu"]
    if not on_cpu and torch.cuda.is_available() and args.gpus > torch.cuda.device_count():
        parser.error(f"--gpus ({args.gpus}) is more than the GPUs here ({torch.cuda.device_count()}); pass "
                     "--device cpu among the run's flags for processes on the CPU")
    runs = args.runs.split(",")
    if not set(runs) <= {"one", "many", "switch"} or "one" not in runs:
        parser.error(f"--runs takes one, many, switch and must include one; got {args.runs!r}")
    if args.record and set(runs) != {"one", "many", "switch"}:
        parser.error("--record needs all three runs")
    return args, flags


def main(argv: list[str] | None = None) -> int:
    args, flags = parse(sys.argv[1:] if argv is None else argv)
    # a piece killed by a signal (an abort in a C++ thread) dumps every Python thread's stack into its stderr
    environment = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    pieces_of = {name: pieces for name, pieces in plan(args.steps, args.gpus).items() if name in args.runs.split(",")}
    outcomes: dict[str, Outcome] = {}
    one_weights = None
    for name, pieces in pieces_of.items():
        out, started, start = args.out / name, time.perf_counter(), 0
        for i, piece in enumerate(pieces):
            command = piece_command(piece, i == 0, start, args, flags, out)
            print(f"[{name}] piece {i + 1}/{len(pieces)}: {piece.processes} process(es), steps {start}..{piece.until}: "
                  + " ".join(command), flush=True)
            # stdout streams as it comes; stderr is kept so that a failed piece's error names its cause
            done = subprocess.run(command, env=environment, stderr=subprocess.PIPE, text=True, errors="replace")
            sys.stderr.write(done.stderr)
            if done.returncode:
                tail = "\n".join(done.stderr.strip().splitlines()[-STDERR_LINES:])
                print(f"path_scaling.py: error: run {name!r} piece {i + 1} exited with status {done.returncode}; the "
                      f"end of its stderr:\n{tail}", file=sys.stderr)
                return 1
            start = piece.until
        outcomes[name] = outcome(name, pieces, out, time.perf_counter() - started, one_weights)
        if name == "one":
            one_weights = torch.load(checkpoint_of(out), map_location="cpu", weights_only=False)["model"]
        print(f"[{name}] done: {outcomes[name]}", flush=True)
    if set(outcomes) != {"one", "many", "switch"}:
        return 0
    result = summary(outcomes, args.gpus, args)
    results_table.write_json(args.out / "scaling.json", result)
    if args.record:
        command = "demos/path_scaling.py " + " ".join(sys.argv[1:] if argv is None else argv)
        results_table.append_records([record(result, args.record, command)])
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
