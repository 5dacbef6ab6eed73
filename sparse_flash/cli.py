"""The `sparse-flash` command: look at masks, check the installation, run the benchmark and the demo.

    sparse-flash masks show butterfly --seq-len 4096 --block-size 128 --png butterfly.png
    sparse-flash masks show local --seq-len 1024 --param window=2
    sparse-flash masks gallery masks.png
    sparse-flash info
    sparse-flash bench --quick
    sparse-flash demo path256 --preset smoke

`python -m sparse_flash` is the same command.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import platform
import subprocess
import sys
from pathlib import Path

import torch

from . import __version__, masks
from .api import triton_unavailable_reason
from .checks import positive_int
from .kernels import settings
from .kernels.settings import EnvironmentSettingError
from .masks._common import geometry

PROG = "sparse-flash"
DEMOS = {"path256": "demos/path256.py"}
BENCH = "benchmarks/bench_attention.py"
# Pattern arguments the `masks show` options set, so `--param` may not.
_SET_BY_OPTIONS = ("seq_len", "block_size", "device")


class UserError(Exception):
    """A mistake in the command's environment: reported in plain words, without a traceback; exit code 1."""

    exit_code = 1


class UsageError(UserError):
    """A bad argument: reported in one line, without a traceback; exit code 2, as argparse's own errors."""

    exit_code = 2


# ---------------------------------------------------------------------------------------------- helpers
def _parse_value(text: str):
    """`--param` values: Python literals (`2`, `0.1`, `True`, `0,16`), `true`/`false`, floats such as `nan`
    and `inf` (so that the pattern says what is wrong with them), else the string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # the last two: deep nesting
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _parse_params(pairs: list[str]) -> dict:
    params, given = {}, {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.isidentifier() or not value:
            raise UsageError(f"--param expects the form name=value (e.g. --param window=2), got {pair!r}")
        if name in given:
            raise UsageError(f"--param {name} must be given once, got {given[name]} and {pair}")
        params[name], given[name] = _parse_value(value), pair
    return params


def _check_sizes(args) -> None:
    """The token and head counts of `masks` commands: ints from 1 (how large a grid may be, the pattern says)."""
    for option in ("seq_len", "block_size", "num_heads"):
        value = getattr(args, option, None)
        if value is not None:
            try:
                positive_int(value, "--" + option.replace("_", "-"))
            except ValueError as e:
                raise UsageError(str(e)) from e


def _png_path(path: str, what: str) -> Path:
    """A PNG file to write: named `*.png` or without a suffix, and written under exactly that name."""
    if not path or Path(path).name in ("", ".", ".."):
        raise UsageError(f"{what} must name a file, got {path!r}")
    if Path(path).suffix.lower() not in ("", ".png"):
        raise UsageError(f"{what} must name a .png file (or a name without a suffix), got {path!r}")
    if Path(path).is_dir():
        raise UsageError(f"{what} must name a file, got the folder {path!r}")
    folder = Path(path).parent
    if not folder.is_dir():  # said before any work, not after it
        raise UsageError(f"{what}: the folder {str(folder)!r} of {path!r} does not exist")
    return Path(path)


def _write_png(draw, path: Path) -> None:
    """Draw into memory as PNG, then write `path` (nothing is written when drawing fails)."""
    buffer = io.BytesIO()
    try:
        draw(buffer)
    except ImportError as e:
        raise UserError(str(e)) from e
    try:
        path.write_bytes(buffer.getvalue())
    except OSError as e:
        raise UserError(f"cannot write the picture: {e}") from e


def _search_roots() -> list[Path]:
    """Where the repository's scripts may live: the current directory and the checkout holding the package."""
    roots = [Path.cwd(), Path(__file__).resolve().parent.parent]
    return list(dict.fromkeys(roots))


def _find_script(relative: str) -> Path:
    for root in _search_roots():
        path = root / relative
        if path.is_file():
            return path
    looked = ", ".join(str(root / relative) for root in _search_roots())
    raise UserError(
        f"{relative} was not found (looked at {looked}); it ships with the source repository, so run this "
        "command from a checkout of sparse_flash"
    )


def _run_script(path: Path, args: list[str]) -> int:
    return subprocess.run([sys.executable, str(path), *args]).returncode


# ---------------------------------------------------------------------------------------------- commands
def _masks_show(args) -> int:
    if args.pattern not in masks.PATTERNS:
        raise UsageError(f"unknown mask pattern {args.pattern!r}; known patterns: {', '.join(masks.PATTERNS)}")
    _check_sizes(args)
    png = None if args.png is None else _png_path(args.png, "--png")
    params = _parse_params(args.param)
    accepted = inspect.signature(masks.PATTERNS[args.pattern]).parameters
    known = [p for p in accepted if p not in _SET_BY_OPTIONS]
    for name in params:
        if name not in known:
            raise UsageError(
                f"pattern {args.pattern!r} has no parameter {name!r}; its parameters are: {', '.join(known)}"
            )
    for name, param in accepted.items():
        if name in known and param.default is inspect.Parameter.empty and name not in params:
            raise UsageError(f"pattern {args.pattern!r} needs --param {name}=VALUE")
    if args.num_heads is not None:
        if "num_heads" not in accepted:
            raise UsageError(f"pattern {args.pattern!r} draws one layout for all heads; --num-heads does not apply")
        if "num_heads" in params:
            raise UsageError("num_heads must be given once, got --num-heads and --param num_heads")
        params["num_heads"] = args.num_heads
    try:
        mask = masks.build(args.pattern, args.seq_len, args.block_size, **params)
    except (TypeError, ValueError) as e:
        raise UsageError(f"cannot build {args.pattern!r}: {e}") from e
    print(mask)
    print(f"nonzero blocks: {mask.nnz} of {mask.layout.numel()}")
    if png is not None:
        _write_png(mask.plot, png)
        print(f"wrote {png}")
    return 0


def _masks_gallery(args) -> int:
    _check_sizes(args)
    out = _png_path(args.out, "OUT")
    try:
        geometry(args.seq_len, args.block_size)  # the gallery's patterns all have this grid
    except ValueError as e:
        raise UsageError(f"cannot draw the gallery: {e}") from e
    _write_png(lambda buffer: masks.gallery(buffer, seq_len=args.seq_len, block_size=args.block_size), out)
    print(f"wrote {out}")
    return 0


def _bench(args) -> int:
    script = _find_script(BENCH)
    if not torch.cuda.is_available():
        raise UserError("the benchmark needs a CUDA GPU, and none is available here")
    return _run_script(script, args.script_args)


def _demo(args) -> int:
    return _run_script(_find_script(DEMOS[args.name]), args.script_args)


def info_lines() -> list[str]:
    """Versions, the device, and whether each backend can run here (and why not)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    has_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if has_cuda else "cpu")
    lines = [
        f"sparse_flash {__version__}",
        f"python       {platform.python_version()}",
        f"torch        {torch.__version__}",
        f"triton       {triton_version}",
        f"CUDA         {torch.version.cuda or 'none (CPU build of torch)'}"
        + ("" if has_cuda or not torch.version.cuda else " (no GPU visible)"),
        f"GPU          {torch.cuda.get_device_name(0) if has_cuda else 'none'}",
        "backends:",
    ]
    reason = triton_unavailable_reason(device)
    if reason is not None:
        lines.append(f"  triton     not usable: {reason}")
    elif has_cuda:
        lines.append("  triton     usable (compiled kernels on the GPU)")
    else:
        lines.append("  triton     usable (Triton interpreter on the CPU, TRITON_INTERPRET=1: slow, for testing)")
    lines.append("  torch      usable (block-sparse in plain PyTorch, any device)")
    lines.append("  reference  usable (dense oracle: for tests and small inputs)")
    auto = "triton" if has_cuda and reason is None else "torch"
    lines.append(f"backend='auto' runs {auto} for {'CUDA' if has_cuda else 'CPU'} tensors here")
    switches = ", ".join(f"{name}={'on' if on else 'off'}" for name, on in vars(settings.current()).items())
    lines.append(f"kernel settings: {switches}")
    return lines


def _info(args) -> int:
    print("\n".join(info_lines()))
    return 0


# ---------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Block-sparse FlashAttention for PyTorch: tools.")
    parser.add_argument("-V", "--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    masks_parser = commands.add_parser("masks", help="show mask patterns", description="Show mask patterns.")
    masks_commands = masks_parser.add_subparsers(dest="masks_command", metavar="SUBCOMMAND", required=True)
    show = masks_commands.add_parser(
        "show",
        help="print one pattern, optionally draw it",
        description="Print a mask pattern (an ASCII grid when small, a summary otherwise), optionally as a PNG.",
        epilog=f"patterns: {', '.join(masks.PATTERNS)}",
    )
    show.add_argument("pattern", help="a pattern name, e.g. butterfly")
    show.add_argument("--seq-len", type=int, default=4096, help="sequence length in tokens (default 4096)")
    show.add_argument("--block-size", type=int, default=128, help="block size in tokens (default 128)")
    show.add_argument(
        "--param", action="append", default=[], metavar="NAME=VALUE",
        help="a pattern parameter, e.g. --param window=2 (repeatable)",
    )
    show.add_argument("--num-heads", type=int, help="heads, for patterns that differ per head")
    show.add_argument("--png", metavar="PATH", help="also draw the mask into this PNG file")
    show.set_defaults(run=_masks_show)
    gallery = masks_commands.add_parser(
        "gallery", help="draw every pattern into one PNG", description="Draw every mask pattern side by side."
    )
    gallery.add_argument("out", metavar="OUT", help="the PNG file to write")
    gallery.add_argument("--seq-len", type=int, default=4096, help="sequence length in tokens (default 4096)")
    gallery.add_argument("--block-size", type=int, default=128, help="block size in tokens (default 128)")
    gallery.set_defaults(run=_masks_gallery)

    bench = commands.add_parser(
        "bench",
        help=f"run {BENCH} (needs a CUDA GPU)",
        description=f"Run {BENCH} from the source checkout. Needs a CUDA GPU.",
        epilog="Other arguments go to the script, e.g. `sparse-flash bench --quick`; "
        "after `--` everything does, e.g. `sparse-flash bench -- --help`.",
    )
    bench.set_defaults(run=_bench, passes_args=True)

    demo = commands.add_parser(
        "demo",
        help="run a demo script",
        description="Run a demo script from the source checkout.",
        epilog="Other arguments go to the script, e.g. `sparse-flash demo path256 --preset smoke`; "
        "after `--` everything does, e.g. `sparse-flash demo path256 -- --help`.",
    )
    demos = ", ".join(f"{name} ({path})" for name, path in DEMOS.items())
    demo.add_argument("name", choices=sorted(DEMOS), help=f"the demo: {demos}")
    demo.set_defaults(run=_demo, passes_args=True)

    info = commands.add_parser(
        "info", help="versions, GPU and usable backends", description="Print versions, the GPU and which backends run."
    )
    info.set_defaults(run=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default `sys.argv[1:]`); returns the exit code: 0 on success, 2 for a bad
    argument (one line on stderr, as argparse does), 1 when the environment fails (no GPU, a file not written).

    Example:
        >>> main(["masks", "show", "local", "--seq-len", "512"])  # doctest: +SKIP
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    after = []  # everything after the first `--` goes to the bench or demo script untouched
    if "--" in argv:
        split = argv.index("--")
        argv, after = argv[:split], argv[split + 1 :]
    try:
        args, extra = parser.parse_known_args(argv)
        if (extra or after) and not getattr(args, "passes_args", False):
            parser.error(f"unrecognized arguments: {' '.join(extra + after)}")
    except SystemExit as e:  # --help, or a usage error already printed by argparse
        return e.code if isinstance(e.code, int) else 1
    args.script_args = extra + after
    try:
        return args.run(args)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.exit_code
    except EnvironmentSettingError as e:  # a SPARSE_FLASH_* variable that is not a switch
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
