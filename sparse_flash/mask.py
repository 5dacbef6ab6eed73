"""BlockMask: the one mask type of sparse_flash.

A BlockMask says, for every (batch, head, query block, key block), whether the block of the attention
matrix is computed. It carries its block size and the real sequence lengths (the last block may be
partial). It is an immutable value; the index lists that the kernels walk are derived from it once, when it
is made (`mask_index.build_index`).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from .mask_index import LONG_LIST_BLOCKS, BlockIndex, KernelIndex, MaskGeometry, build_index

__all__ = ["BlockMask", "Tiling"]

_GRID_MAX_BLOCKS = 64  # repr draws an ASCII grid up to this many blocks per side
_GRID_MAX_LAYOUTS = 4  # ... and for at most this many (batch, head) layouts


def _is_int(value) -> bool:
    """A Python or NumPy integer, never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_pair(block_size, name: str = "block_size") -> tuple[int, int]:
    """`block_size` (an int or a pair of ints, Python or NumPy) as `(block_q, block_k)`."""
    if _is_int(block_size):
        pair = (int(block_size), int(block_size))
    elif isinstance(block_size, (tuple, list)) and len(block_size) == 2 and all(_is_int(b) for b in block_size):
        pair = (int(block_size[0]), int(block_size[1]))
    else:
        raise TypeError(f"{name} must be an int or a pair of ints (block_q, block_k), got {block_size!r}")
    if min(pair) < 1:
        raise ValueError(f"{name} must be positive, got {block_size!r}")
    return pair


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
    """The view of a mask's layout handed to users: every in-place write raises, views stay read-only.

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
        if name in cls._WRITES or (name.endswith("_") and not name.endswith("__")) or any(
                isinstance(o, _ReadOnlyLayout) for o in outs):
            raise RuntimeError(
                f"BlockMask.layout is read-only ({name} writes to it): a mask is an immutable value. Build a new "
                "mask with BlockMask.from_layout(mask.layout.clone() ...) or combine masks with | and &")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        return _protect_views(result, args[0] if args else None)

    def numpy(self, *args, **kwargs):
        array = torch.Tensor.numpy(self.as_subclass(torch.Tensor), *args, **kwargs)
        array.setflags(write=False)
        return array

    def __reduce_ex__(self, protocol):
        return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor).clone(), protocol)

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).clone()


def _protect_views(result, source):
    """Results that share memory with a read-only layout (views, `.data`) stay read-only."""
    if isinstance(result, (tuple, list)):
        return type(result)(_protect_views(r, source) for r in result)
    if (isinstance(result, torch.Tensor) and isinstance(source, torch.Tensor) and not result.is_meta
            and result.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
            and result.numel() > 0):
        return torch.Tensor._make_subclass(_ReadOnlyLayout, result)
    return result


_INDEX_LIMIT = 2**31 - 1  # int32 offsets address the index lists


def _check_layout(layout) -> torch.Tensor:
    """`layout` as a 4-D bool tensor `(B, H, Mq, Mk)`, or a clear error."""
    if not isinstance(layout, torch.Tensor):
        raise TypeError(f"layout must be a torch.Tensor, got {type(layout).__name__}")
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


def _check_length(value, name: str, blocks: int, block: int) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    value, needed = int(value), -(-int(value) // block)
    if needed != blocks:
        raise ValueError(f"{name}={value} with block size {block} needs ceil({value}/{block}) = {needed} blocks, "
                         f"but the layout has {blocks}")
    return value


def _check_tiling(tiling, block_size: tuple[int, int], shape) -> Tiling | None:
    if tiling is None:
        return None
    if not isinstance(tiling, Tiling):
        raise TypeError(f"tiling must be a sparse_flash.mask.Tiling or None, got {type(tiling).__name__}")
    grid, tile = tuple(tiling.grid), tuple(tiling.tile)
    if len(grid) != 3 or len(tile) != 3 or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in (*grid, *tile)):
        raise ValueError(f"tiling must hold (frames, height, width) and (tile_t, tile_h, tile_w) of positive ints, "
                         f"got {tiling!r}")
    if any(g % t for g, t in zip(grid, tile)):
        raise ValueError(f"tiling's tile {tile} must divide its grid {grid} along every axis")
    size = math.prod(tile)
    tiles = math.prod(g // t for g, t in zip(grid, tile))
    if block_size != (size, size) or tuple(shape[-2:]) != (tiles, tiles):
        raise ValueError(f"tiling {tiling!r} needs square blocks of {size} tokens and {tiles} x {tiles} blocks, "
                         f"got block_size {block_size} and {tuple(shape[-2:])} blocks")
    return Tiling(grid, tile)


def _rebuild(layout, block_size, seq_len_q, seq_len_k, name, tiling):
    """Unpickling: the mask is rebuilt from its defining values (index lists and plans are never stored)."""
    return BlockMask(layout, block_size, seq_len_q, seq_len_k, name, tiling=tiling)


class BlockMask:
    """A block-sparse attention mask: which (query block, key block) tiles are computed.

    Build one with a pattern from `sparse_flash.masks` or directly from a layout with
    `BlockMask.from_layout`. Masks of the same geometry combine with `|` and `&`.

    A BlockMask is an immutable value: it owns a copy of its layout, `mask.layout` is read-only (in-place
    writes raise), attributes cannot be assigned, and two masks are equal (and hash equal) when their
    layouts, block sizes and lengths are. Masks pickle, deep-copy and `torch.save` at any time; the index
    lists and launch plans derived from the layout are rebuilt, never stored.

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
        bq, bk = _as_pair(block_size)
        Mq, Mk = layout.shape[-2:]
        seq_len_q = _check_length(Mq * bq if seq_len_q is None else seq_len_q, "seq_len_q", Mq, bq)
        seq_len_k = _check_length(Mk * bk if seq_len_k is None else seq_len_k, "seq_len_k", Mk, bk)
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        values = dict(
            _layout=layout.clone(memory_format=torch.contiguous_format),  # owned: later writes to `layout` do not reach it
            block_size=(bq, bk), seq_len_q=seq_len_q, seq_len_k=seq_len_k, name=name,
            tiling=_check_tiling(tiling, (bq, bk), layout.shape),
            _copies={}, _hash=None,  # caches derived from the values above
        )
        for key, value in values.items():
            object.__setattr__(self, key, value)
        index = build_index(self._layout, self.block_size, seq_len_q, seq_len_k)
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
        return self._index.longest_row[bool(causal)]

    def has_long_lists(self, causal: bool = False) -> bool:
        """True if the rows walked by an attention call with this `causal` flag average at least
        `LONG_LIST_BLOCKS` blocks; the kernels then use wider tiles."""
        return self._index.long_lists[bool(causal)]

    # ------------------------------------------------------------------ conversions
    def to(self, device) -> "BlockMask":
        """The same mask with its layout on `device` (its index lists are built there once and cached).

        A mask has no dtype: `mask.to(torch.float16)` raises a TypeError.
        """
        if isinstance(device, torch.dtype):
            raise TypeError(f"BlockMask.to takes a device (a mask has no dtype), got dtype {device}")
        if not isinstance(device, (str, int, torch.device)):
            raise TypeError(f"BlockMask.to takes a device, got {type(device).__name__} {device!r}")
        device = torch.device(device)
        if device.type == "meta":
            raise ValueError("BlockMask.to: a mask needs real values, it cannot move to the meta device")
        here = self.device
        if device.type == here.type and device.index in (None, here.index):
            return self
        key = str(device)
        if key not in self._copies:  # moving a mask rebuilds its index lists once per device
            self._copies[key] = BlockMask(self._layout.to(device), self.block_size, self.seq_len_q, self.seq_len_k,
                                          self.name, tiling=self.tiling)
        return self._copies[key]

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
    def from_deepspeed(cls, layout, block_size: int, *, seq_len: int | None = None) -> "BlockMask":
        """A DeepSpeed `(H, nb, nb)` 0/1 layout as a BlockMask; see `sparse_flash.interop.from_deepspeed`."""
        from .interop import from_deepspeed

        return from_deepspeed(layout, block_size, seq_len=seq_len)

    def to_dense(self) -> torch.Tensor:
        """The element mask: bool `(B|1, H|1, seq_len_q, seq_len_k)`, True where attention is allowed."""
        bq, bk = self.block_size
        dense = self._layout.repeat_interleave(bq, dim=-2).repeat_interleave(bk, dim=-1)
        return dense[..., : self.seq_len_q, : self.seq_len_k]

    # ------------------------------------------------------------------ index lists
    def row_index(self, causal: bool = False) -> BlockIndex:
        """For each (batch, head, query block): how many key blocks and which, sorted.

        With `causal`, blocks lying entirely above the causal diagonal (no allowed pair) are left out.
        """
        return self._index.rows[bool(causal)]

    def col_index(self, causal: bool = False) -> BlockIndex:
        """For each (batch, head, key block): how many query blocks and which, sorted."""
        return self._index.cols[bool(causal)]

    def kernel_index(self, causal: bool = False) -> KernelIndex:
        """The full/partial row and column lists that an attention call with this `causal` flag walks."""
        return self._index.kernel[bool(causal)]

    def kernel_geometry(self, causal: bool = False) -> MaskGeometry:
        """The sizes the kernels need beside `kernel_index(causal)`."""
        B, H, Mq, Mk = self._layout.shape
        return MaskGeometry(B, H, Mq, Mk, *self.block_size, self.has_long_lists(causal))

    def kernel_records(self, causal: bool = False) -> tuple[KernelIndex | None, MaskGeometry | None]:
        """What the kernels take for an attention call with this `causal` flag: `(kernel_index, kernel_geometry)`,
        or `(None, None)` when every block the call can reach is in the mask (the dense path, which walks every
        block without loading indices)."""
        if self.is_dense or (causal and self.covers_causal):
            return None, None
        return self.kernel_index(causal), self.kernel_geometry(causal)

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
        return BlockMask(self._layout | other._layout, self.block_size, self.seq_len_q, self.seq_len_k,
                         f"{self.name} | {other.name}", tiling=self._shared_tiling(other))

    def __and__(self, other: "BlockMask") -> "BlockMask":
        self._check_same_geometry(other, "&")
        return BlockMask(self._layout & other._layout, self.block_size, self.seq_len_q, self.seq_len_k,
                         f"({self.name}) & ({other.name})", tiling=self._shared_tiling(other))

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
            weights = (torch.arange(flat.numel(), device=flat.device) * 2654435761) % 2147483647
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
