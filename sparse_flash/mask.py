"""BlockMask: the one mask type of sparse_flash.

A BlockMask says, for every (batch, head, query block, key block), whether the block of the attention
matrix is computed. It carries its block size and the real sequence lengths (the last block may be
partial). It is an immutable value; the index lists that the kernels walk are derived from it once, when it
is made (`mask_index.build_index`).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple

import torch

from .checks import MAX_INT, as_bool, block_pair, check_device, finite_float, is_int
from .mask_index import (LONG_LIST_BLOCKS, BlockIndex, BlockRuns, KernelIndex, LayoutSizes, MaskGeometry, MaskIndex,
                         build_index, build_topk_index, candidates, complement_runs, gpu_builders, run_sizes, topk_sizes,
                         topk_tables, union_runs, untraced, upload)

__all__ = ["BlockMask", "Tiling"]

_GRID_MAX_BLOCKS = 64  # repr draws an ASCII grid up to this many blocks per side
_GRID_MAX_LAYOUTS = 4  # ... and for at most this many (batch, head) layouts


class Tiling(NamedTuple):
    """How a mask's tokens map to image or video pixels: tile-major order, one block per tile.

    Tokens are ordered tile by tile (each tile row-major inside, tiles row-major over the grid), so that
    block `i` of the mask is tile `i`. `BlockMask.plot` draws such a mask on the pixel grid.

    Attributes:
        grid: `(frames, height, width)` in pixels; `frames == 1` for images.
        tile: `(tile_t, tile_h, tile_w)` in pixels; each divides the matching side of `grid`.
    """

    grid: tuple[int, int, int]
    tile: tuple[int, int, int]

    @property
    def tiles(self) -> tuple[int, int, int]:
        """Tiles along each axis: `grid // tile`."""
        return tuple(g // t for g, t in zip(self.grid, self.tile))


class _ReadOnlyLayout(torch.Tensor):
    """The views of a mask's tensors handed to users (its layout, its index lists): every in-place write
    raises, views stay read-only.

    Everything else (indexing, arithmetic, `.to`, `.numpy()` as a read-only array) works as on a plain tensor
    and returns plain tensors.
    """

    _WRITES = frozenset(
        ["__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
         "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = kwargs.get("out")
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if name in cls._WRITES or _writes(func, name, args, kwargs) or any(
                isinstance(o, _ReadOnlyLayout) for o in outs):
            raise RuntimeError(
                f"a BlockMask's layout and index lists are read-only ({name} writes to it): a mask is an immutable "
                "value. Build a new mask with BlockMask.from_layout(mask.layout.clone() ...) or combine masks with "
                "| and &")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            return _protect_views(result, _read_only_inputs(args, kwargs))

    def numpy(self, *args, **kwargs):
        array = torch.Tensor.numpy(self.as_subclass(torch.Tensor), *args, **kwargs)
        array.setflags(write=False)
        return array

    def __reduce_ex__(self, protocol):
        return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor).clone(), protocol)

    def __dlpack__(self, *args, **kwargs):  # an exchange hands out a copy: the mask's memory stays its own
        return self.as_subclass(torch.Tensor).clone().__dlpack__(*args, **kwargs)

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).clone()


def _writes(func, name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call writes into its arguments: an in-place method or function (`add_`, `torch.relu_`), an
    operator whose schema says so (`torch.ops.aten.add_.Tensor`), or a function told to by its `inplace`
    argument (`F.relu(x, inplace=True)`, `F.dropout(x, 0.5, True, True)`)."""
    schema = getattr(func, "_schema", None)
    if schema is not None:  # an operator: the arguments its schema writes
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                values = value if isinstance(value, (tuple, list)) else (value,)
                if any(isinstance(v, _ReadOnlyLayout) for v in values):
                    return True
        return False
    if name.endswith("_") and not name.endswith("__"):
        return True
    if kwargs.get("inplace"):
        return True
    try:
        position = _inplace_position(func)
    except TypeError:  # not hashable: no cached signature
        return False
    return position is not None and position < len(args) and bool(args[position])


@functools.lru_cache(maxsize=None)
def _inplace_position(func) -> int | None:
    """The position of a Python function's `inplace` parameter (torch.nn.functional's), or None."""
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    return names.index("inplace") if "inplace" in names else None


def _read_only_inputs(args: tuple, kwargs: dict) -> list[int]:
    """The storage addresses of the read-only tensors among a call's arguments, in any position and inside lists
    (`torch.meshgrid(plain, layout)` returns views of its second argument)."""
    found = []
    for value in (*args, *kwargs.values()):
        values = value if isinstance(value, (tuple, list)) else (value,)
        found += [v.untyped_storage().data_ptr() for v in values if isinstance(v, _ReadOnlyLayout) and not v.is_meta]
    return found


def _protect_views(result, sources: list[int]):
    """Results that share memory with a read-only input (views, `.data`; `sources`: `_read_only_inputs`) stay
    read-only."""
    if isinstance(result, (tuple, list)):
        return type(result)(_protect_views(r, sources) for r in result)
    if (sources and isinstance(result, torch.Tensor) and not result.is_meta and result.numel() > 0
            and result.untyped_storage().data_ptr() in sources):
        return torch.Tensor._make_subclass(_ReadOnlyLayout, result)
    return result


def _read_only(record):
    """A record of tensors (`BlockIndex`, `KernelIndex`, ...) with every tensor, at any depth, a read-only view."""
    return type(record)(*(_read_only(x) if isinstance(x, tuple) else
                          torch.Tensor._make_subclass(_ReadOnlyLayout, x) if isinstance(x, torch.Tensor) else x
                          for x in record))


_INDEX_LIMIT = 2**31 - 1  # int32 offsets address the index lists


def _check_layout(layout) -> torch.Tensor:
    """`layout` as a 4-D bool tensor `(B, H, Mq, Mk)`, or a clear error."""
    if not isinstance(layout, torch.Tensor):
        raise TypeError(f"layout must be a torch.Tensor, got {type(layout).__name__}")
    if layout.is_nested or layout.layout != torch.strided:
        raise TypeError(f"layout must be a dense (torch.strided) tensor, got a "
                        f"{'nested' if layout.is_nested else layout.layout} one (densify it with .to_dense())")
    if layout.dim() not in (2, 3, 4):
        raise ValueError(
            f"layout must have shape (Mq, Mk), (H, Mq, Mk) or (B, H, Mq, Mk), got shape {tuple(layout.shape)}")
    if layout.is_meta:
        raise ValueError("layout must hold real values (a cpu or cuda tensor), got a tensor on the meta device")
    if layout.dtype != torch.bool:
        if layout.is_floating_point() or layout.is_complex():
            raise TypeError(f"layout must be a bool or integer tensor, got dtype {layout.dtype}")
        if ((layout != 0) & (layout != 1)).any():
            raise ValueError("layout must hold only 0 and 1")
        layout = layout != 0
    while layout.dim() < 4:
        layout = layout.unsqueeze(0)
    if min(layout.shape) < 1:
        raise ValueError(f"layout must have at least one batch, head and block per side, got shape "
                         f"{tuple(layout.shape)}")
    if layout.numel() > _INDEX_LIMIT:
        raise ValueError(f"layout must have at most {_INDEX_LIMIT} blocks (the index lists are int32), got shape "
                         f"{tuple(layout.shape)}")
    return layout


def _check_length(value, name: str, blocks: int, block: int, where: str = "the layout has") -> int:
    if not is_int(value):  # a float, bool, str or tensor: the wrong kind of value, as every check says it
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if blocks * block > MAX_INT:  # token positions are int64
        raise ValueError(f"block_size {block} x {blocks} blocks = {blocks * block} tokens: more than int64 positions "
                         f"hold (2**63 - 1); use a smaller block_size")
    value, needed = int(value), -(-int(value) // block)
    if needed != blocks:
        raise ValueError(f"{name}={value} with block size {block} needs ceil({value}/{block}) = {needed} blocks, "
                         f"but {where} {blocks}")
    return value


def _check_tiling(tiling, block_size: tuple[int, int], shape, lengths: tuple[int, int]) -> Tiling | None:
    if tiling is None:
        return None
    if not isinstance(tiling, Tiling):
        raise TypeError(f"tiling must be a sparse_flash.mask.Tiling or None, got {type(tiling).__name__}")
    grid, tile = tuple(tiling.grid), tuple(tiling.tile)
    if len(grid) != 3 or len(tile) != 3 or any(not is_int(x) or x < 1 for x in (*grid, *tile)):
        raise ValueError(f"tiling must hold (frames, height, width) and (tile_t, tile_h, tile_w) of positive ints, "
                         f"got {tiling!r}")
    grid, tile = tuple(map(int, grid)), tuple(map(int, tile))  # NumPy ints become Python ints
    if any(g % t for g, t in zip(grid, tile)):
        raise ValueError(f"tiling's tile {tile} must divide its grid {grid} along every axis")
    size = math.prod(tile)
    tiles = math.prod(g // t for g, t in zip(grid, tile))
    if block_size != (size, size) or tuple(shape[-2:]) != (tiles, tiles):
        raise ValueError(f"tiling {tiling!r} needs square blocks of {size} tokens and {tiles} x {tiles} blocks, "
                         f"got block_size {block_size} and {tuple(shape[-2:])} blocks")
    if lengths != (math.prod(grid), math.prod(grid)):
        raise ValueError(f"tiling {tiling!r} covers {math.prod(grid)} tokens on each side, got (seq_len_q, seq_len_k) "
                         f"= {lengths}")
    return Tiling(grid, tile)


def _check_flag(value, name: str) -> bool:
    return as_bool(value, name)


_SCORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_float_tensor(t: torch.Tensor, name: str) -> None:
    """A TypeError naming `name` unless `t` is a dense (strided) float16, bfloat16, float32 or float64 tensor."""
    if t.is_nested or t.layout != torch.strided:
        layout = "nested" if t.is_nested else str(t.layout)
        raise TypeError(f"{name} must be a dense (torch.strided) tensor, got a {layout} one")
    if t.dtype not in _SCORE_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got dtype {t.dtype}")


def _check_scores(scores, block_size, seq_len_q, seq_len_k):
    """Block scores `(B, H, Mq, Mk)` and their geometry `(scores, (block_q, block_k), seq_len_q, seq_len_k)`,
    or a clear error (nothing read from the device)."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    _check_float_tensor(scores, "scores")
    if scores.dim() != 4:
        raise ValueError(f"scores must have shape (B, H, Mq, Mk) (B or H may be 1), got shape {tuple(scores.shape)}")
    if min(scores.shape) < 1:
        raise ValueError(f"scores must have at least one batch, head and block per side, got shape "
                         f"{tuple(scores.shape)}")
    if scores.is_meta:
        raise ValueError("scores must hold real values (a cpu or cuda tensor), got a tensor on the meta device")
    bq, bk = block_pair(block_size)
    Mq, Mk = scores.shape[-2:]
    seq_len_q = _check_length(Mq * bq if seq_len_q is None else seq_len_q, "seq_len_q", Mq, bq, "scores.shape[2] =")
    seq_len_k = _check_length(Mk * bk if seq_len_k is None else seq_len_k, "seq_len_k", Mk, bk, "scores.shape[3] =")
    return scores.detach(), (bq, bk), seq_len_q, seq_len_k


def _check_k(k, heads: int, Mk: int) -> tuple[int, ...]:
    """`k` as host ints: `(k,)`, or one per head (a CUDA tensor is read: one wait for the device)."""
    given = type(k).__name__
    if type(k).__module__ == "numpy" and hasattr(k, "ndim") and hasattr(k, "dtype"):
        if getattr(k.dtype, "kind", "") not in ("i", "u"):
            raise TypeError(f"k must be an int or integers, got a NumPy {given} of dtype {k.dtype}")
        k = torch.as_tensor(k)  # checked as the tensor it makes (0-d: one k; 1-d: one per head)
    if isinstance(k, torch.Tensor) and k.dim() == 0:
        if k.is_floating_point() or k.is_complex() or k.dtype == torch.bool:
            raise TypeError(f"k must be an int (or an integer tensor), got a 0-d tensor of dtype {k.dtype}")
        k = int(k)  # a 0-d int tensor: one k for all heads
    if is_int(k):
        ks = (int(k),)
    elif isinstance(k, torch.Tensor) or (isinstance(k, (tuple, list)) and all(is_int(x) for x in k)):
        if isinstance(k, torch.Tensor) and (k.is_floating_point() or k.is_complex() or k.dtype == torch.bool):
            raise TypeError(f"k given per head must be an integer tensor, got dtype {k.dtype}")
        shape = tuple(k.shape) if isinstance(k, torch.Tensor) else (len(k),)
        if shape != (heads,):
            raise ValueError(f"k given per head must have shape (H,) = ({heads},), one per head of scores, got "
                             f"shape {shape}")
        ks = tuple(int(x) for x in (k.tolist() if isinstance(k, torch.Tensor) else k))
    else:
        raise TypeError(f"k must be an int, or an int tensor or sequence of ints of shape (H,), got "
                        f"{given} {k!r}")
    for h, value in enumerate(ks):
        if not 1 <= value <= Mk:
            head = f" for head {h}" if len(ks) > 1 else ""
            raise ValueError(f"k must be between 1 and Mk = {Mk} (the key blocks of a row), got {value}{head}")
    return ks


def _check_finite(scores: torch.Tensor, hint: str = "", name: str = "scores") -> None:
    """Refuse NaN and infinite scores (or the tensor `name`): one read from the device, skipped where it cannot
    happen (inside torch.compile, during CUDA-graph capture)."""
    if torch.compiler.is_compiling() or (scores.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    bad = int((~torch.isfinite(scores)).sum())
    if bad:
        raise ValueError(f"{name} must be finite (NaN and infinities have no rank), got {bad} non-finite values "
                         f"among {scores.numel()}{hint}")


def _check_threshold_tensor(threshold: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """A threshold given as a tensor for `from_scores`: floating, on the scores' device, broadcasting against
    `scores` without changing its shape; detached (a clear error otherwise; its finiteness is checked apart)."""
    _check_float_tensor(threshold, "threshold given as a tensor")
    if threshold.device != scores.device:
        raise ValueError(f"threshold given as a tensor must be on the scores' device {scores.device}, got "
                         f"{threshold.device}")
    shape = tuple(threshold.shape)
    try:
        fits = len(shape) <= 4 and torch.broadcast_shapes(shape, scores.shape) == scores.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"threshold given as a tensor must broadcast against scores of shape "
                         f"{tuple(scores.shape)} (B, H, Mq, Mk) without growing it, e.g. (B, H, Mq, 1) for one "
                         f"threshold per row; got shape {shape}")
    return threshold.detach()


def _above(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """bool `scores > threshold`, exactly: torch would round the threshold to the scores' dtype first (0.9999
    becomes 1.0 in bfloat16, and a score of 1.0 would no longer count as above it). 16- and 32-bit scores are
    compared in float32 (exact for them) with the smallest float32 above the threshold, which needs no
    float64 on the device."""
    if scores.dtype == torch.float64:
        return scores > threshold  # a Python float is a float64: exact
    t = torch.tensor(threshold, dtype=torch.float64)
    least = t.to(torch.float32)  # the nearest float32, rounded either way
    if least.double() <= t:  # not above the threshold: the next float32 up is
        least = torch.nextafter(least, torch.tensor(float("inf")))
    return scores.float() >= least.item()


def _above_tensor(scores: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """bool `scores > threshold` for a floating threshold tensor broadcasting against the scores, exactly: both
    in the wider of their two dtypes (float32 for float16 against bfloat16), which holds either one exactly."""
    common = torch.promote_types(scores.dtype, threshold.dtype)
    return scores.to(common) > threshold.to(common)


def _choose_topk(scores: torch.Tensor, counts: torch.Tensor, width: int, causal: bool,
                 cand: torch.Tensor) -> torch.Tensor:
    """int64 `(B, H, Mq, width)`: each row's `counts[h, i]` best key blocks, ascending, then Mk (padding).

    One stable sort by descending score, so ties go to the lower key block. With `causal` the last candidate
    (the diagonal) is kept first and the rest chosen among the others; blocks past it are never chosen.
    `cand`: the rows' `candidates`.
    """
    B, H, Mq, Mk = scores.shape
    s = torch.where(torch.isnan(scores), float("-inf"), scores)  # only with check_finite=False
    slot = torch.arange(width, device=scores.device)
    if causal:
        last = cand - 1  # (Mq,): the diagonal block of each row
        # Everything but the other candidates ranks last; among -inf ties the stable sort keeps the candidates
        # (the lower indices) first.
        s = torch.where(torch.arange(Mk, device=scores.device) < last[:, None], s, float("-inf"))
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., : width - 1]
        chosen = torch.where(slot[: width - 1] < counts[:, :, None] - 1, order, Mk)
        chosen = torch.cat([chosen, last.expand(B, H, Mq)[..., None]], dim=-1)
    else:
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :width]
        chosen = torch.where(slot < counts[:, :, None], order, Mk)
    return torch.sort(chosen, dim=-1).values


def _rebuild(layout, block_size, seq_len_q, seq_len_k, name, tiling):
    """Unpickling: the mask is rebuilt from its defining values (index lists and plans are never stored)."""
    return BlockMask(layout, block_size, seq_len_q, seq_len_k, name, tiling=tiling)



_IN_COMPILE = ("a mask pattern or layout cannot be built inside torch.compile with fullgraph=True (its index lists' "
               "sizes depend on the blocks it holds): build the mask before the compiled call and pass it in, or "
               "choose it inside the graph with BlockMask.from_topk (without fullgraph the build runs eagerly)")
_IN_CAPTURE = ("a mask pattern or layout cannot be built inside a CUDA-graph capture (its layout comes from the "
               "host, its lists' sizes from the device): build the mask before the capture, or choose it inside the "
               "graph with BlockMask.from_topk")


def check_eager(layout: torch.Tensor | None) -> None:
    """A pattern or layout mask is built eagerly: inside torch.compile the check raises `_IN_COMPILE` (under
    fullgraph=True the caller gets it; without, Dynamo runs the constructor eagerly, where the check passes and
    the builders run `untraced`), inside a CUDA-graph capture `_IN_CAPTURE` (not CUDA's own error from the first
    wait, deep inside)."""
    if torch.compiler.is_compiling():
        raise RuntimeError(_IN_COMPILE)
    if layout is not None and layout.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(_IN_CAPTURE)


def layout_from_runs(runs: BlockRuns, heads: int, Mq: int, Mk: int, device=None) -> torch.Tensor:
    """bool `(1, heads, Mq, Mk)` on `device` holding the blocks of `runs` (`mask_index.BlockRuns`, CPU tensors): one
    upload from pinned memory, which does not wait for the device, then where the GPU builders run one fill and
    one launch (`index_gpu.runs_layout`), else a difference array (a start and an end mark per run, summed along
    each row) or, where every run is one block long, one fill.

    Example:
        >>> runs = BlockRuns(torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([2, 2]))
        >>> layout_from_runs(runs, 1, 2, 2)[0, 0].tolist()
        [[False, True], [True, True]]
    """
    target = torch.empty(0, device=device)
    if target.is_cuda and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(_IN_CAPTURE)
    index_gpu = gpu_builders(target)
    if index_gpu is not None:  # one fill and one launch
        return index_gpu.runs_layout(upload(torch.stack(tuple(runs)), target.device), heads, Mq, Mk)
    target = target.device
    row, start, end = runs
    single = bool(torch.equal(end - start, torch.ones_like(start)))
    width = Mk if single else Mk + 1
    where = row * width + start
    if not single:  # marks: starts in the first plane, ends in the second; an empty run's go to a spare place
        marks = 2 * heads * Mq * width
        where = torch.cat([where, where + (end - start + heads * Mq * width)]).where(torch.cat([end > start] * 2), marks)
    where = upload(where, target)
    if single:
        layout = torch.zeros(heads * Mq * Mk, dtype=torch.bool, device=target).index_fill_(0, where, True)
        return layout.view(1, heads, Mq, Mk)
    marks = torch.zeros(marks + 1, dtype=torch.int8, device=target).index_fill_(0, where, 1)[:-1].view(2, heads * Mq, width)
    return torch.sub(marks[0], marks[1]).cumsum_(1)[:, :Mk].gt(0).reshape(1, heads, Mq, Mk)


class BlockMask:
    """A block-sparse attention mask: which (query block, key block) tiles are computed.

    Build one with a pattern from `sparse_flash.masks` or directly from a layout with
    `BlockMask.from_layout`. Masks of the same geometry combine with `|` and `&`.

    A BlockMask is an immutable value: it owns a copy of its layout, `mask.layout` is read-only (in-place
    writes raise), attributes cannot be assigned, and two masks are equal (and hash equal) when their
    layouts, block sizes and lengths are. Masks pickle, deep-copy and `torch.save` at any time; the index
    lists and launch plans derived from the layout are rebuilt, never stored. The read-only views share the
    mask's memory (no copy per access): the escapes that strip their protection on purpose
    (`.as_subclass(torch.Tensor)`, `untyped_storage()` and `storage()`, `plain.set_(mask.layout)`,
    `torch.from_numpy` of the read-only NumPy array) reach it too, and a write through them leaves the mask
    undefined; `.clone()` gives a writable copy.

    Attributes:
        layout: bool `(B|1, H|1, Mq, Mk)`, read-only; a batch or head dimension of 1 broadcasts.
        block_size: `(block_q, block_k)` in tokens.
        seq_len_q, seq_len_k: sequence lengths in tokens; `Mq == ceil(seq_len_q / block_q)`.
        name: a short description used by `repr` and `plot`.
        tiling: a `Tiling` when the tokens are image or video tiles in tile-major order, else None.

    Example:
        >>> import torch, sparse_flash
        >>> m = sparse_flash.BlockMask.from_layout(torch.eye(4, dtype=torch.bool), 64)
        >>> m.density
        0.25
    """

    def __init__(self, layout: torch.Tensor, block_size, seq_len_q: int | None = None, seq_len_k: int | None = None,
                 name: str = "custom", *, tiling: Tiling | None = None):
        """Validate and own a layout; arguments as in `BlockMask.from_layout`."""
        layout = _check_layout(layout)
        bq, bk = block_pair(block_size)
        Mq, Mk = layout.shape[-2:]
        seq_len_q = _check_length(Mq * bq if seq_len_q is None else seq_len_q, "seq_len_q", Mq, bq)
        seq_len_k = _check_length(Mk * bk if seq_len_k is None else seq_len_k, "seq_len_k", Mk, bk)
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        tiling = _check_tiling(tiling, (bq, bk), layout.shape, (seq_len_q, seq_len_k))
        # owned: later writes to `layout` do not reach it
        self._own(layout.clone(memory_format=torch.contiguous_format), (bq, bk), seq_len_q, seq_len_k, name, tiling)

    def _own(self, layout: torch.Tensor, block_size: tuple[int, int], seq_len_q: int, seq_len_k: int, name: str,
             tiling: Tiling | None, index: MaskIndex | None = None, sizes: LayoutSizes | None = None,
             runs: BlockRuns | None = None) -> None:
        """Set the mask's values, checked already (`layout`: a contiguous bool tensor that nobody else writes),
        and its index lists: `index`, or built from the layout (with its `sizes` where the host knows them).
        `runs`: the layout's `BlockRuns` where a constructor listed them (host tensors nobody writes), kept so
        that a union with another such mask is listed on the host too."""
        values = dict(
            _layout=layout, block_size=block_size, seq_len_q=seq_len_q, seq_len_k=seq_len_k, name=name, tiling=tiling,
            _copies={}, _hash=None, _kernel_records={}, _runs=runs,  # derived from the values above
        )
        for key, value in values.items():
            object.__setattr__(self, key, value)
        if index is None:
            check_eager(layout)
            index = untraced(build_index)(layout, block_size, seq_len_q, seq_len_k, sizes)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "nnz", index.nnz)

    def __setattr__(self, key, value):
        raise AttributeError(f"BlockMask is immutable: cannot set {key!r}; build a new mask instead")

    def __delattr__(self, key):
        raise AttributeError(f"BlockMask is immutable: cannot delete {key!r}")

    def __reduce__(self):
        return _rebuild, (self._layout, self.block_size, self.seq_len_q, self.seq_len_k, self.name, self.tiling)

    def __copy__(self):
        return self  # an immutable value: a copy is the value itself

    def __deepcopy__(self, memo):
        return _rebuild(*self.__reduce__()[1])

    @property
    def layout(self) -> torch.Tensor:
        """bool `(B|1, H|1, Mq, Mk)`, read-only: in-place writes raise (clone it for a writable copy)."""
        return torch.Tensor._make_subclass(_ReadOnlyLayout, self._layout)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_layout(cls, layout, block_size, *, seq_len_q=None, seq_len_k=None, name="custom",
                    tiling: Tiling | None = None) -> "BlockMask":
        """Build a mask from a block layout.

        Args:
            layout: bool (or 0/1 integer) tensor `(Mq, Mk)`, `(H, Mq, Mk)` or `(B, H, Mq, Mk)`; a batch or
                head size of 1 broadcasts against the attention inputs. The mask keeps its own copy.
            block_size: int, or `(block_q, block_k)`, in tokens.
            seq_len_q, seq_len_k: real sequence lengths; default `Mq * block_q` and `Mk * block_k`. Shorter
                lengths make the last block partial; `Mq` must equal `ceil(seq_len_q / block_q)`.
            name: a short description shown by `repr` and `plot`.
            tiling: a `Tiling` when tokens are image or video tiles in tile-major order (one block per tile).

        Returns:
            BlockMask with a 4-D bool layout.

        Example:
            >>> layout = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
            >>> BlockMask.from_layout(layout, 128, seq_len_q=200, seq_len_k=200).nnz
            3
        """
        return cls(layout, block_size, seq_len_q, seq_len_k, name, tiling=tiling)

    @classmethod
    def from_topk(cls, scores: torch.Tensor, k, *, causal: bool = False, block_size, seq_len_q: int | None = None,
                  seq_len_k: int | None = None, check_finite: bool = True, name: str | None = None) -> "BlockMask":
        """Keep each query block's `k` best key blocks by `scores`: a mask chosen from the data (MoBA, NSA-style
        block selection), built on the scores' device without waiting for it.

        Args:
            scores: float `(B, H, Mq, Mk)` (B or H may be 1), e.g. block-mean query . key affinities. Never
                differentiated: the choice passes no gradient.
            k: blocks kept per query block, an int in `[1, Mk]`, or one per head: an int tensor or a sequence of
                `H` ints (read on the host: a CUDA tensor costs one wait for the device).
            causal: choose only among the key blocks holding a causal pair (`j * block_k <= last query of
                block i`), and always keep the last of them (the diagonal). A row with fewer candidates than
                `k` keeps them all. Use the mask with `causal=True` attention.
            block_size: int, or `(block_q, block_k)`, in tokens.
            seq_len_q, seq_len_k: real lengths (default `Mq * block_q`, `Mk * block_k`), as in `from_layout`.
            check_finite: refuse NaN and infinite scores. The check reads one bool from the device (a wait);
                it is skipped inside torch.compile and CUDA-graph capture. With False, a NaN ranks as -inf.
            name: shown by `repr` (default `top-k`).

        Ties go to the lower key block index (a stable sort: equal scores keep key order). Every row keeps
        `min(k, candidates)` blocks, known before the scores are read, so every size of the index lists is
        known on the host: they are built with static shapes (`mask_index.build_topk_index`), inside
        torch.compile too. Which kept blocks need an element mask is not known without the data: a row's last
        kept blocks are put in the partial lists when they may (see `build_topk_index`; exact, and the same
        lists as `from_layout` for square blocks without sequence tails). Only the lists of the mask's own
        flag are built at once: a causal mask used with `causal=False` attention builds those lists on first
        use (no wait), a non-causal one used with `causal=True` too, which waits for the device. A mask made
        inside a CUDA-graph capture takes only its own flag (a clear error otherwise).

        Returns:
            BlockMask with layout `(B, H, Mq, Mk)`.

        Example:
            >>> scores = torch.randn(1, 4, 8, 8)
            >>> BlockMask.from_topk(scores, 2, causal=True, block_size=64).nnz  # rows 0 keeps 1 block, the rest 2
            60
        """
        scores, (bq, bk), seq_len_q, seq_len_k = _check_scores(scores, block_size, seq_len_q, seq_len_k)
        B, H, Mq, Mk = scores.shape
        causal, check_finite = _check_flag(causal, "causal"), _check_flag(check_finite, "check_finite")
        ks = _check_k(k, H, Mk)
        if check_finite:
            _check_finite(scores, " (check_finite=False ranks a NaN as -inf)")
        geometry = (Mq, Mk, bq, bk, seq_len_q, seq_len_k)
        tables = topk_tables(ks, causal, geometry, scores.device)  # candidates, counts (len(ks), Mq), partials
        cand, counts = tables.cand, tables.counts
        width = topk_sizes(ks, causal, B, H, geometry).longest_row
        gpu = gpu_builders(scores, traceable=True)
        if gpu is not None and gpu.choose_supported(Mk, scores.dtype):  # one Triton launch for the choice and the layout
            selected, layout = gpu.choose_topk(scores, counts, width, causal, cand)
        else:
            selected = _choose_topk(scores, counts, width, causal, cand)
            layout = torch.zeros(B, H, Mq, Mk + 1, dtype=torch.bool, device=scores.device)
            layout = layout.scatter_(-1, selected, True)[..., :Mk].contiguous()  # column Mk takes the padding
        index = build_topk_index(selected, tables, ks, causal, (bq, bk), seq_len_q, seq_len_k, layout)
        if name is None:
            name = (f"top-{ks[0]}" if len(ks) == 1 else "top-k per head") + (" causal" if causal else "")
        return cls._from_index(layout, index, (bq, bk), seq_len_q, seq_len_k, name)

    @classmethod
    def from_scores(cls, scores: torch.Tensor, threshold: float | torch.Tensor, *, causal: bool = False, block_size,
                    seq_len_q: int | None = None, seq_len_k: int | None = None, name: str | None = None) -> "BlockMask":
        """Keep the key blocks whose score is above `threshold`, and always each row's diagonal block.

        Args:
            scores: float `(B, H, Mq, Mk)` (B or H may be 1), finite; never differentiated.
            threshold: a finite real number, or a finite float tensor on the scores' device that broadcasts
                against them without growing them: `(B, H, Mq, 1)` gives each row its own threshold (e.g. a
                fraction of the row's largest score), a 0-d tensor one for all; never differentiated. A block
                is kept where `score > threshold`, compared exactly (a number in float64 or with the nearest
                float32 above it, a tensor in the wider of the two dtypes).
            causal: keep only blocks holding a causal pair (`j * block_k <= last query of block i`).
            block_size, seq_len_q, seq_len_k, name: as in `from_topk`.

        The diagonal block of row i, kept whatever its score, is the one holding key position `last query of
        block i` (the last block when the keys are shorter): with `causal`, the last candidate. How many blocks
        a row keeps depends on the scores, so building the index lists waits for the device (as `from_layout`).

        Example:
            >>> scores = torch.eye(4)[None, None] - 0.5
            >>> BlockMask.from_scores(scores, 0.0, block_size=64).nnz
            4
            >>> scores = torch.tensor([[1.0, 0.2, 0.9, 0.0], [0.1, 0.2, 0.3, 0.1]])[None, None]  # (1, 1, 2, 4)
            >>> half_of_best = 0.5 * scores.amax(-1, keepdim=True)  # (1, 1, 2, 1): one threshold per row
            >>> BlockMask.from_scores(scores, half_of_best, block_size=64).layout[0, 0].int().tolist()
            [[1, 0, 1, 0], [0, 1, 1, 0]]
        """
        scores, (bq, bk), seq_len_q, seq_len_k = _check_scores(scores, block_size, seq_len_q, seq_len_k)
        causal = _check_flag(causal, "causal")
        if isinstance(threshold, torch.Tensor):
            threshold = _check_threshold_tensor(threshold, scores)
            label = f"threshold of shape {tuple(threshold.shape)}"
        else:
            threshold = finite_float(threshold, "threshold", "a finite real number or a float tensor")
            label = f"{threshold:g}"
        _check_finite(scores)
        if isinstance(threshold, torch.Tensor):
            _check_finite(threshold, name="threshold")
        B, H, Mq, Mk = scores.shape
        cand = candidates(True, (Mq, Mk, bq, bk, seq_len_q, seq_len_k), scores.device)
        j = torch.arange(Mk, device=scores.device)
        keep = _above_tensor(scores, threshold) if isinstance(threshold, torch.Tensor) else _above(scores, threshold)
        if causal:
            keep = keep & (j < cand[:, None])
        keep = keep | (j == cand[:, None] - 1)  # the diagonal block
        return cls(keep, (bq, bk), seq_len_q, seq_len_k, name or f"scores > {label}")

    @classmethod
    def _from_runs(cls, runs: BlockRuns, heads: int, block_size: tuple[int, int], seq_len_q: int, seq_len_k: int,
                   name: str, device=None, tiling: Tiling | None = None) -> "BlockMask":
        """A `(1, heads, Mq, Mk)` mask holding the blocks of `runs` (`mask_index.BlockRuns`: CPU tensors, the runs
        of a row disjoint, on the grid of these lengths; the mask constructors check their arguments). The
        layout is made on `device` from one upload (from pinned memory, without waiting), and the sizes of its
        lists are counted on the host (`mask_index.run_sizes`): on a GPU the build never waits for the device.
        `tiling`: as in `from_layout`.

        Example:
            >>> runs = BlockRuns(torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([1, 2]))
            >>> m = BlockMask._from_runs(runs, 1, (64, 64), 128, 128, "diag")
            >>> m.nnz, m.layout[0, 0].tolist()
            (2, [[True, False], [False, True]])
        """
        bq, bk = block_size
        Mq, Mk = -(-seq_len_q // bq), -(-seq_len_k // bk)
        tiling = _check_tiling(tiling, (bq, bk), (1, heads, Mq, Mk), (seq_len_q, seq_len_k))
        check_eager(None)  # before the upload and the host's counts
        mask = cls.__new__(cls)
        mask._own(layout_from_runs(runs, heads, Mq, Mk, device), (bq, bk), seq_len_q, seq_len_k, name, tiling,
                  sizes=run_sizes(runs, heads, (bq, bk), seq_len_q, seq_len_k), runs=runs)
        return mask

    @classmethod
    def _from_made_layout(cls, layout: torch.Tensor, sizes: LayoutSizes | None, block_size: tuple[int, int],
                          seq_len_q: int, seq_len_k: int, name: str) -> "BlockMask":
        """A mask owning `layout` (not copied: a bool `(H, Mq, Mk)` or `(1, H, Mq, Mk)` that a mask constructor
        made on the grid of these lengths and never writes). `sizes`: its lists' sizes where the constructor
        counted them from its pattern on the host (`masks._common.pattern_sizes`; they must be the layout's:
        nothing checks them on the device): on a GPU the build then does not wait for the device."""
        mask = cls.__new__(cls)
        mask._own(_check_layout(layout).contiguous(), tuple(block_size), seq_len_q, seq_len_k, name, None, sizes=sizes)
        return mask

    @classmethod
    def _from_index(cls, layout: torch.Tensor, index: MaskIndex, block_size, seq_len_q: int, seq_len_k: int,
                    name: str = "custom") -> "BlockMask":
        """A mask owning `layout` (not copied: the caller made it and never writes it) whose index lists are
        built already (`mask_index.build_topk_index`). Checks what reads nothing from the device: the layout's
        dtype and shape, the lengths, and that the index's lists fit the layout."""
        if not isinstance(layout, torch.Tensor) or layout.dtype != torch.bool or layout.dim() != 4:
            raise TypeError(f"_from_index takes a 4-D bool layout, got {type(layout).__name__} "
                            f"{getattr(layout, 'dtype', '')} {tuple(getattr(layout, 'shape', ()))}")
        layout = _check_layout(layout)
        bq, bk = block_pair(block_size)
        Mq, Mk = layout.shape[-2:]
        seq_len_q = _check_length(seq_len_q, "seq_len_q", Mq, bq)
        seq_len_k = _check_length(seq_len_k, "seq_len_k", Mk, bk)
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        for flag in dict.keys(index.rows):  # the flags built already
            shapes = (tuple(index.rows[flag].counts.shape), tuple(index.cols[flag].counts.shape))
            if shapes != (tuple(layout.shape[:3]), (*layout.shape[:2], Mk)) or not 0 <= index.nnz <= layout.numel():
                raise ValueError(f"_from_index: the index lists (row counts {shapes[0]}, column counts {shapes[1]}, "
                                 f"{index.nnz} blocks) do not fit a layout of shape {tuple(layout.shape)}")
        mask = cls.__new__(cls)
        mask._own(layout.contiguous(), (bq, bk), seq_len_q, seq_len_k, name, None, index)
        return mask

    # ------------------------------------------------------------------ properties
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The layout's shape `(B|1, H|1, Mq, Mk)`."""
        return tuple(self._layout.shape)

    @property
    def num_blocks(self) -> tuple[int, int]:
        """`(Mq, Mk)`: blocks along the query and key sides."""
        return tuple(self._layout.shape[-2:])

    @property
    def device(self) -> torch.device:
        return self._layout.device

    @property
    def density(self) -> float:
        """Fraction of nonzero blocks, a float in [0, 1]."""
        return self.nnz / self._layout.numel()

    @property
    def is_dense(self) -> bool:
        """True when every block is on: attention runs the dense path, which loads no indices."""
        return self._index.is_dense

    @property
    def covers_causal(self) -> bool:
        """True if the layout holds every block in which some key precedes some query (key <= query).

        With `causal=True` such a mask (the causal mask itself, or any superset of it) allows exactly the
        causal pairs, so the triton backend runs its dense causal path, which loads no index lists.
        """
        return self._index.covers_causal

    def longest_row(self, causal: bool = False) -> int:
        """The most key blocks that one query block walks in an attention call with this `causal` flag."""
        return self._index.longest_row[as_bool(causal, "causal")]

    def has_long_lists(self, causal: bool = False) -> bool:
        """True if the rows walked by an attention call with this `causal` flag average at least
        `LONG_LIST_BLOCKS` blocks; the kernels then use wider tiles."""
        return self._index.long_lists[as_bool(causal, "causal")]

    # ------------------------------------------------------------------ conversions
    def to(self, device) -> "BlockMask":
        """The same mask with its layout on `device` (its index lists are built there once and cached).

        A mask has no dtype: `mask.to(torch.float16)` raises a TypeError.
        """
        if device.__class__ is torch.device and device == self._layout.device:
            return self  # the attention call's case (q's device), checked first: it costs every call host time
        if isinstance(device, torch.dtype):
            raise TypeError(f"BlockMask.to takes a device (a mask has no dtype), got dtype {device}")
        device = check_device(device, "BlockMask.to device")
        if device is None:  # as `tensor.to(None)`: no move
            return self
        here = self.device
        if device.type == here.type and device.index in (None, here.index) or (device.type == here.type == "cpu"):
            return self
        key = str(device)
        if key not in self._copies:  # moving a mask rebuilds its index lists once per device
            self._copies[key] = self._moved(device)
        return self._copies[key]

    def _moved(self, device: torch.device) -> "BlockMask":
        """This mask on another device, its lists built there. From the CPU to a GPU (outside torch.compile and
        CUDA-graph capture) the layout goes up from pinned memory and the lists' sizes come from this mask's
        own lists (`_list_sizes`): the copy never waits for the device."""
        layout, sizes = self._layout, None
        if (device.type == "cuda" and layout.device.type == "cpu" and not torch.compiler.is_compiling()
                and not torch.cuda.is_current_stream_capturing()):
            layout, sizes = upload(layout, device), self._list_sizes()
        else:
            layout = layout.to(device)
        mask = BlockMask.__new__(BlockMask)
        mask._own(layout, self.block_size, self.seq_len_q, self.seq_len_k, self.name, self.tiling, sizes=sizes,
                  runs=self._runs)
        return mask

    def _list_sizes(self) -> LayoutSizes | None:
        """The `LayoutSizes` of this mask's lists (read on the host: call it for a CPU mask), or None where the
        lists of a causal flag are not built yet (a top-k mask builds the other flag's on first use)."""
        index = self._index
        if not all(flag in index.rows for flag in (False, True)):  # `in`: no build on first use
            return None
        totals, longest, lists = [], {}, {}
        for flag in (False, True):
            rows, cols, kernel = index.rows[flag], index.cols[flag], index.kernel[flag]
            totals += [rows.indices.numel(), kernel.row_full.indices.numel(), kernel.row_partial.indices.numel()]
            longest[flag] = (int(rows.counts.max()), int(cols.counts.max()))
            lists[flag] = (rows.counts, cols.counts)
        return LayoutSizes(tuple(totals), longest, lists)

    def cuda(self) -> "BlockMask":
        return self.to("cuda")

    def cpu(self) -> "BlockMask":
        return self.to("cpu")

    def to_flex(self, causal: bool = False, *, eager_exact: bool = True):
        """This mask as a FlexAttention `BlockMask` (needs torch >= 2.5); see `sparse_flash.interop.to_flex`."""
        from .interop import to_flex

        return to_flex(self, causal, eager_exact=eager_exact)

    @classmethod
    def from_flex(cls, flex_mask, name: str = "from flex") -> "BlockMask":
        """The block layout of a FlexAttention `BlockMask`; see `sparse_flash.interop.from_flex`."""
        from .interop import from_flex

        return from_flex(flex_mask, name)

    @classmethod
    def from_dense(cls, element_mask: torch.Tensor, block_size, *, name: str = "from dense") -> "BlockMask":
        """The blocks of a bool element mask that hold any allowed pair; see `sparse_flash.interop.from_dense`."""
        from .interop import from_dense

        return from_dense(element_mask, block_size, name=name)

    @classmethod
    def from_deepspeed(cls, layout, block_size: int, *, seq_len: int | None = None,
                       name: str = "from deepspeed") -> "BlockMask":
        """A DeepSpeed `(H, nb, nb)` 0/1 layout as a BlockMask; see `sparse_flash.interop.from_deepspeed`."""
        from .interop import from_deepspeed

        return from_deepspeed(layout, block_size, seq_len=seq_len, name=name)

    def to_dense(self) -> torch.Tensor:
        """The element mask: bool `(B|1, H|1, seq_len_q, seq_len_k)`, True where attention is allowed. Each
        token's block looked up, so its memory is that of the result (a block larger than its sequence costs
        nothing more).

        Example:
            >>> mask = BlockMask.from_layout(torch.tensor([[True, False], [True, True]]), 2, seq_len_q=3, seq_len_k=4)
            >>> mask.to_dense()[0, 0].int()
            tensor([[1, 1, 0, 0],
                    [1, 1, 0, 0],
                    [1, 1, 1, 1]], dtype=torch.int32)
        """
        bq, bk = self.block_size
        device = self._layout.device
        rows = torch.arange(self.seq_len_q, device=device).div_(bq, rounding_mode="floor")
        cols = torch.arange(self.seq_len_k, device=device).div_(bk, rounding_mode="floor")
        return self._layout.index_select(-2, rows).index_select(-1, cols)

    # ------------------------------------------------------------------ index lists
    def row_index(self, causal: bool = False) -> BlockIndex:
        """For each (batch, head, query block): how many key blocks and which, sorted; read-only views of the
        mask's own lists (in-place writes raise).

        With `causal`, blocks lying entirely above the causal diagonal (no allowed pair) are left out.
        """
        return _read_only(self._index.rows[as_bool(causal, "causal")])

    def col_index(self, causal: bool = False) -> BlockIndex:
        """For each (batch, head, key block): how many query blocks and which, sorted; read-only views."""
        return _read_only(self._index.cols[as_bool(causal, "causal")])

    def kernel_index(self, causal: bool = False) -> KernelIndex:
        """The full/partial row and column lists and work plans that an attention call with this `causal` flag
        walks; read-only views."""
        return _read_only(self._index.kernel[as_bool(causal, "causal")])

    def kernel_geometry(self, causal: bool = False) -> MaskGeometry:
        """The sizes the kernels need beside `kernel_index(causal)`."""
        B, H, Mq, Mk = self._layout.shape
        return MaskGeometry(B, H, Mq, Mk, *self.block_size, self.has_long_lists(causal))

    def kernel_records(self, causal: bool = False) -> tuple[KernelIndex | None, MaskGeometry | None]:
        """What the kernels take for an attention call with this `causal` flag: `(kernel_index, kernel_geometry)`,
        or `(None, None)` when every block the call can reach is in the mask (the dense path, which walks every
        block without loading indices)."""
        index, geometry = self._records(as_bool(causal, "causal"))
        return (None if index is None else _read_only(index)), geometry

    # The library's own readers of the lists, which never write them, take the mask's tensors themselves: a
    # read-only view's dispatch would cost every kernel call host time, and torch.compile would trace it.
    def _records(self, causal: bool) -> tuple[KernelIndex | None, MaskGeometry | None]:
        """`kernel_records(causal)` as the mask's own tensors (kept per flag for eager calls, which all ask;
        torch.compile would guard on the cache's contents and compile again once it fills)."""
        compiling = torch.compiler.is_compiling()
        records = None if compiling else self._kernel_records.get(causal)
        if records is None:
            if self.is_dense or (causal and self.covers_causal):
                records = None, None
            else:
                records = self._index.kernel[causal], self.kernel_geometry(causal)
            if not compiling:
                self._kernel_records[causal] = records
        return records

    def _lists(self, causal: bool) -> KernelIndex:
        """`kernel_index(causal)` as the mask's own tensors."""
        return self._index.kernel[causal]

    def _rows(self, causal: bool) -> BlockIndex:
        """`row_index(causal)` as the mask's own tensors."""
        return self._index.rows[causal]

    # ------------------------------------------------------------------ algebra
    def _check_same_geometry(self, other, op: str) -> None:
        if not isinstance(other, BlockMask):
            raise TypeError(f"BlockMask {op} needs another BlockMask, got {type(other).__name__}")
        mine = (self.block_size, self.seq_len_q, self.seq_len_k)
        theirs = (other.block_size, other.seq_len_q, other.seq_len_k)
        if mine != theirs:
            raise ValueError(
                f"BlockMask {op} needs the same (block_size, seq_len_q, seq_len_k), got {mine} and {theirs}"
            )
        for dim, what in ((0, "batch"), (1, "head")):
            a, b = self._layout.shape[dim], other._layout.shape[dim]
            if a != b and 1 not in (a, b):
                raise ValueError(f"BlockMask {op}: {what} sizes {a} and {b} do not broadcast")
        if self.device != other.device:
            raise ValueError(f"BlockMask {op}: masks are on {self.device} and {other.device}")

    def __or__(self, other: "BlockMask") -> "BlockMask":
        self._check_same_geometry(other, "|")
        name, tiling = f"{self.name} | {other.name}", self._shared_tiling(other)
        if self._runs is not None and other._runs is not None:  # both listed: the union listed too (no device wait)
            heads = max(self._layout.shape[1], other._layout.shape[1])
            runs = union_runs(self._heads_of_runs(heads), other._heads_of_runs(heads), self._layout.shape[-1])
            return BlockMask._from_runs(runs, heads, self.block_size, self.seq_len_q, self.seq_len_k, name,
                                        self.device, tiling)
        return BlockMask(self._layout | other._layout, self.block_size, self.seq_len_q, self.seq_len_k, name,
                         tiling=tiling)

    def _heads_of_runs(self, heads: int) -> BlockRuns:
        """This mask's runs for `heads` heads: its own, or its one head's repeated."""
        runs, Mq = self._runs, self._layout.shape[2]
        if self._layout.shape[1] == heads:
            return runs
        offsets = (torch.arange(heads) * Mq)[:, None]
        return BlockRuns((runs.row + offsets).flatten(), runs.start.repeat(heads), runs.end.repeat(heads))

    def __and__(self, other: "BlockMask") -> "BlockMask":
        self._check_same_geometry(other, "&")
        name, tiling = f"({self.name}) & ({other.name})", self._shared_tiling(other)
        if self._runs is not None and other._runs is not None:  # both listed: a & b = ~(~a | ~b), on the host
            heads, (Mq, Mk) = max(self._layout.shape[1], other._layout.shape[1]), self._layout.shape[-2:]
            gaps = [complement_runs(m._heads_of_runs(heads), heads * Mq, Mk) for m in (self, other)]
            runs = complement_runs(union_runs(*gaps, Mk), heads * Mq, Mk)
            return BlockMask._from_runs(runs, heads, self.block_size, self.seq_len_q, self.seq_len_k, name,
                                        self.device, tiling)
        return BlockMask(self._layout & other._layout, self.block_size, self.seq_len_q, self.seq_len_k, name,
                         tiling=tiling)

    def _shared_tiling(self, other: "BlockMask") -> Tiling | None:
        """A combination keeps the operands' tiling when they agree on it (or only one has one)."""
        if self.tiling is None or other.tiling is None or self.tiling == other.tiling:
            return self.tiling or other.tiling
        return None

    def __eq__(self, other) -> bool:
        if not isinstance(other, BlockMask):
            return NotImplemented
        return (
            self.block_size == other.block_size
            and self.seq_len_q == other.seq_len_q
            and self.seq_len_k == other.seq_len_k
            and self._layout.shape == other._layout.shape
            and bool(torch.equal(self._layout.cpu(), other._layout.cpu()))
        )

    def __hash__(self) -> int:
        if self._hash is None:  # computed once: the value never changes
            flat = self._layout.flatten().to(torch.int64)
            # pseudo-random weights per position (multiply, xor-shift, multiply: no polynomial in the position,
            # so layouts with the same block count and position sums do not collide); products stay in int64
            weights = (torch.arange(flat.numel(), device=flat.device) * 2654435761) % 2147483647
            weights = ((weights ^ (weights >> 13)) * 48271) % 2147483647
            weights = ((weights ^ (weights >> 17)) * 69621) % 2147483647
            digest = int((flat * weights).sum()), int(flat.sum())  # equal layouts give equal digests
            object.__setattr__(self, "_hash", hash((self.block_size, self.seq_len_q, self.seq_len_k,
                                                    tuple(self._layout.shape), digest)))
        return self._hash

    # ------------------------------------------------------------------ display
    def __repr__(self) -> str:
        B, H, Mq, Mk = self.shape
        head = (
            f"BlockMask({self.name}, layout=({B}, {H}, {Mq}, {Mk}), block_size={self.block_size}, "
            f"seq_len=({self.seq_len_q}, {self.seq_len_k}), density={self.density:.4f}"
        )
        if max(Mq, Mk) > _GRID_MAX_BLOCKS or B * H > _GRID_MAX_LAYOUTS:
            return head + ")"
        rows = [head + ","]
        grid = self._layout.cpu()
        for b in range(B):
            for h in range(H):
                if B * H > 1:
                    rows.append(f"  [batch {b}, head {h}]")
                rows.extend("  " + "".join("#" if x else "." for x in row.tolist()) for row in grid[b, h])
        return "\n".join(rows) + "\n)"

    def plot(self, path=None, *, heads: int = 4, ax=None):
        """Draw the mask; see `sparse_flash.plot.plot_mask` (needs matplotlib: the `viz` extra)."""
        from .plot import plot_mask

        return plot_mask(self, path, heads=heads, ax=ax)


# `torch.load` (weights_only, its default) may rebuild masks: their pickles name only these and tensors
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([_rebuild, BlockMask, Tiling])
