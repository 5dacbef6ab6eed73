"""A Hugging Face causal LM trained at a long context with block-sparse attention, against dense SDPA.

The same small Llama-style model (from a config, random weights, GQA) trains on one task with two attention
implementations: `attn_implementation="sdpa"` (dense; FlashAttention inside PyTorch on the GPU) and sparse_flash's
`"block_sparse"` with a block pattern from `config.sparse_flash` (butterfly by default). The task is a copy: each
sequence is random tokens whose second half repeats the first, and the loss is taken on the second half, so a model
can only lower it by attending half a sequence back (the butterfly pattern holds that block offset exactly).
Each run reports samples/s and tokens/s over the timed steps (after a warm-up that compiles the kernels), peak GPU
memory, and the copy loss at the start and the end.

Usage:
    python demos/hf_long_context.py --cpu-smoke                    # CPU, tiny sizes, under a minute
    python demos/hf_long_context.py                                # GPU: 32,768 tokens, 300 steps per run
    python demos/hf_long_context.py --pattern bigbird --seq-len 65536 --runs block_sparse

Results go to --out (default demos/results/hf_long_context/ on the GPU, the git-ignored demos/runs/hf_long_context/
with --cpu-smoke): `results.json` and `results.md`; `--out ''` writes nothing. Exit status 2 with one line on stderr for a bad flag.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import sparse_flash
import sparse_flash.integrations.transformers

RUNS = ("sdpa", "block_sparse", "block_sparse_dense")
PATTERNS = {  # config.sparse_flash of each --pattern (block size and backend are added from the flags)
    "butterfly": {"pattern": "butterfly"},
    "bigbird": {"pattern": "bigbird", "num_random_blocks": 2, "num_sliding_window_blocks": 3, "num_global_blocks": 1,
                "seed": 0},
    "longformer": {"pattern": "longformer"},
}
GPU_DEFAULTS = dict(seq_len=32768, batch_size=2, steps=300, warmup=10, layers=2, width=256, heads=4, kv_heads=2,
                    vocab=256, block_size=128, lr=1e-3, backend="auto")
CPU_SMOKE = dict(seq_len=256, batch_size=2, steps=6, warmup=1, layers=2, width=64, heads=4, kv_heads=2, vocab=64,
                 block_size=32, lr=3e-3, backend="torch")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hf_long_context.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (under a minute)")
    p.add_argument("--runs", default="sdpa,block_sparse", help=f"comma-separated, from {RUNS}")
    p.add_argument("--pattern", default="butterfly", choices=sorted(PATTERNS))
    for name, value in GPU_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=type(value), default=None, help=f"default {value} (--cpu-smoke: {CPU_SMOKE[name]})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results folder (default demos/results/hf_long_context, with "
                   "--cpu-smoke demos/runs/hf_long_context); '' writes nothing")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = "demos/runs/hf_long_context" if args.cpu_smoke else "demos/results/hf_long_context"
    defaults = CPU_SMOKE if args.cpu_smoke else GPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.runs = [r for r in args.runs.split(",") if r]
    bad = [r for r in args.runs if r not in RUNS]
    if bad or not args.runs or len(set(args.runs)) < len(args.runs):
        p.error(f"--runs takes distinct names from {RUNS}, got {args.runs}")
    if args.seq_len < 4 or args.seq_len % 2:
        p.error(f"--seq-len must be an even number of at least 4, got {args.seq_len}")
    check_sizes(p, args)
    if not args.cpu_smoke and not torch.cuda.is_available():
        p.error("no CUDA GPU: run with --cpu-smoke")
    return args


def check_sizes(p: argparse.ArgumentParser, args) -> None:
    """The model, batch and optimiser flags the run can take, and --out, before any work (one line, exit 2)."""
    for name in ("batch_size", "steps", "layers", "width", "heads", "kv_heads", "vocab", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be at least 0, got {args.warmup}")
    if args.width % args.heads or (args.width // args.heads) % 2:
        p.error(f"--width ({args.width}) must be --heads ({args.heads}) times an even head dimension")
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads ({args.kv_heads}) must divide --heads ({args.heads})")
    if not math.isfinite(args.lr) or args.lr <= 0:
        p.error(f"--lr must be a finite positive number, got {args.lr}")
    if args.backend not in sparse_flash.api.BACKENDS:
        p.error(f"--backend must be one of {sparse_flash.api.BACKENDS}, got {args.backend!r}")
    spec = {**PATTERNS[args.pattern], "block_size": args.block_size, "backend": args.backend}
    try:  # the pattern's block size, parameters and backend, as the model will read them
        sparse_flash.integrations.transformers.prepare(SimpleNamespace(sparse_flash=spec), args.seq_len)
    except (ValueError, TypeError) as error:
        p.error(f"--pattern {args.pattern} with --block-size {args.block_size} and --backend {args.backend}: {error}")
    if args.out:
        try:
            sparse_flash.checks.output_folder(args.out, "--out")
        except ValueError as error:
            p.error(str(error))


def copy_batch(args, generator: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens whose second half repeats the first; labels only on the second half."""
    half = torch.randint(0, args.vocab, (args.batch_size, args.seq_len // 2), generator=generator)
    ids = torch.cat([half, half], dim=1)
    labels = ids.clone()
    labels[:, : args.seq_len // 2] = -100
    return ids.to(device), labels.to(device)


def build_model(args, run: str, device):
    import transformers

    from sparse_flash.integrations.transformers import register

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=2 * args.width,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, rope_theta=500_000.0, tie_word_embeddings=True,
    )
    if run == "block_sparse":
        config.sparse_flash = {**PATTERNS[args.pattern], "block_size": args.block_size, "backend": args.backend}
    elif run == "block_sparse_dense":
        config.sparse_flash = {"block_size": args.block_size, "backend": args.backend}
    attn = "sdpa" if run == "sdpa" else register()
    torch.manual_seed(args.seed)  # the same weights for every run
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn).to(device)


def train(args, run: str, device) -> dict:
    model = build_model(args, run, device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    losses, start = [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        ids, labels = copy_batch(args, generator, device)
        with torch.autocast(device.type, torch.bfloat16, enabled=cuda):
            loss = model(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    losses = torch.stack(losses).float().cpu()
    density = 1.0
    if run == "block_sparse":
        from sparse_flash.integrations.transformers import prepare

        density = prepare(model.config, args.seq_len, device).density
    return {
        "attention": run,
        "pattern": args.pattern if run == "block_sparse" else "dense",
        "mask_density": round(density, 4),
        "steps": args.steps,
        "seconds": round(seconds, 3),
        "samples_per_s": round(args.steps * args.batch_size / seconds, 3),
        "tokens_per_s": round(args.steps * args.batch_size * args.seq_len / seconds, 1),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if cuda else None,
        "first_loss": round(float(losses[: max(1, args.warmup)].mean()), 4),
        "final_loss": round(float(losses[-max(1, args.steps // 10):].mean()), 4),
    }


def table(rows: list[dict]) -> str:
    header = ("attention", "pattern", "density", "steps", "samples/s", "tokens/s", "peak memory GiB",
              "copy loss start -> end")
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for r in rows:
        memory = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        lines.append(f"| {r['attention']} | {r['pattern']} | {r['mask_density']:.3f} | {r['steps']} | "
                     f"{r['samples_per_s']:.2f} | {r['tokens_per_s']:,.0f} | {memory} | "
                     f"{r['first_loss']:.3f} -> {r['final_loss']:.3f} |")
    return "\n".join(lines)


def environment(device) -> dict:
    import transformers

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d")}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    settings = {k: getattr(args, k) for k in ("seq_len", "batch_size", "steps", "warmup", "layers", "width", "heads",
                                              "kv_heads", "vocab", "block_size", "lr", "backend", "pattern", "seed")}
    print(f"hf_long_context: {settings}", flush=True)
    rows = []
    for run in args.runs:
        rows.append(train(args, run, device))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record = {"environment": environment(device), "settings": settings, "runs": rows}
        (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
        (out / "results.md").write_text(f"{table(rows)}\n\nSettings: {settings}; {record['environment']}\n")
        print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return rows


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
