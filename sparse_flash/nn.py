"""Multi-head attention layers for `(batch, seq, embed)` inputs.

`BlockSparseAttention`: a drop-in for `torch.nn.MultiheadAttention(batch_first=True)` whose attention runs
through `block_sparse_attention`, with grouped-query heads, cross-attention input sizes and masks given as a
`BlockMask` or as a pattern name rebuilt for each sequence length. `MoBAAttention`: the same layer choosing
its key blocks per call from the data (MoBA).
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import types
from collections import OrderedDict

import torch
from einops import rearrange
from torch import nn

from . import masks
from .api import BACKENDS, HEAD_DIM_RANGE, block_sparse_attention, flash_attention
from .mask import BlockMask
from .checks import as_bool, block_pair, check_device, is_bool, is_int, positive_int, triton_blocks
from .masks._common import GridError

__all__ = ["BlockSparseAttention", "MoBAAttention"]

# Arguments of a pattern constructor that the layer fills in itself.
_GEOMETRY_ARGS = ("seq_len", "block_size", "seq_len_k", "device")
MASK_CACHE_SIZE = 16  # pattern masks kept per layer, least recently used dropped first


def _canonical_device(device) -> torch.device:
    """`cuda` as `cuda:<current>`, so that it names the same cache entry as a tensor's device (a bad `device` is
    a clear error: `checks.check_device`)."""
    device = check_device(device, "device")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_pattern(name: str, params: dict, block_size) -> None:
    """Refuse what no sequence length makes valid, at construction: unknown, missing or invalid parameters.

    A small mask is built to run the pattern's own checks; parameters that only need a longer grid (a global
    block past the last block of that small mask) are checked when a mask is built for real lengths."""
    if name not in masks.PATTERNS:
        raise ValueError(f"mask must be a BlockMask, None or a pattern name in {sorted(masks.PATTERNS)}, got {name!r}")
    accepted = inspect.signature(masks.PATTERNS[name]).parameters
    for param in params:
        if param in _GEOMETRY_ARGS:
            raise ValueError(
                f"mask_params must not set {param!r}: the layer passes the sequence lengths, block_size and device"
            )
        if param not in accepted:
            known = sorted(p for p in accepted if p not in _GEOMETRY_ARGS)
            raise TypeError(f"mask pattern {name!r} takes the parameters {known}, got {param!r} in mask_params")
    for param, spec in accepted.items():
        if param not in _GEOMETRY_ARGS and spec.default is inspect.Parameter.empty and param not in params:
            raise TypeError(f"mask pattern {name!r} needs {param!r} in mask_params, got mask_params {params}")
    if isinstance(params.get("seed"), torch.Generator):
        raise TypeError(
            "mask_params 'seed' must be an int, got a torch.Generator: it advances with every mask the layer "
            "builds, so a mask rebuilt for a length (after a copy, or once the cache dropped it) would differ")
    try:
        masks.build(name, block_pair(block_size)[0], block_size, **params)
    except GridError:
        pass
    except (TypeError, ValueError) as e:
        raise type(e)(f"mask_params of pattern {name!r} are invalid: {e}") from e


def _parameter_device(device):
    """`device` for the layer's parameters, checked as a mask's (`checks.check_device`), where the meta device
    is valid too (deferred initialisation: parameters without memory)."""
    try:
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "meta":
            return torch.device("meta")
    except (RuntimeError, ValueError):  # not a device name: check_device says so
        pass
    return check_device(device, "device")


class BlockSparseAttention(nn.Module):
    """Multi-head block-sparse attention over `(batch, seq, embed)` inputs.

    Projects the inputs to heads, attends with `sparse_flash.block_sparse_attention` and projects back.
    `dropout` is applied to the layer's output: the kernels do not drop attention probabilities, so
    unlike `nn.MultiheadAttention` there is no dropout on the attention weights.

    Args:
        embed_dim: model width `E`, the size of the query input and of the output.
        num_heads: query heads; `embed_dim` must be a multiple of it, and the head size
            `embed_dim // num_heads` between 8 and 256.
        num_kv_heads: key/value heads for grouped-query attention (a divisor of `num_heads`);
            default `num_heads`.
        kdim, vdim: sizes of the key and value inputs (cross-attention); default `embed_dim`.
        mask: a `BlockMask` (fixed sequence lengths), a pattern name from `sparse_flash.masks.PATTERNS`
            (rebuilt for each (query, key) length), or None for dense attention. Pattern masks are cached per
            (query length, key length, device), at most `MASK_CACHE_SIZE` (16) of them: the least recently
            used is dropped first.
        mask_params: keyword parameters of the pattern, e.g. `{"window": 2}`; only with a pattern name.
            Checked at construction (a small mask is built); a parameter that depends on the length (a global
            block index) is checked for each length when its mask is built.
        block_size: block size of the masks built from a pattern name, int or `(block_q, block_k)`, from 1
            (default 128); with a `BlockMask`, None or the mask's own.
        causal: also require `key position <= query position` (top-left aligned); a bool.
        dropout: probability of zeroing an element of the output (in training mode), a float in [0, 1].
        bias: add biases to the four projections; a bool.
        sinks: learn an attention sink per query head (a bool): a logit `sink[h]` that each row's softmax
            takes as one more key with a zero value, so a row may give part of its weight to nothing. Exact, as
            `out * sigmoid(lse - sink[h])` through the differentiable log-sum-exp; the parameter `sink`
            `(num_heads,)` starts at 0 (then half a row's weight goes to the sink where its scores are ~0).
        backend: `"auto"`, `"triton"`, `"torch"` or `"reference"`, as in `block_sparse_attention`.
        device, dtype: where and in which dtype to create the parameters.

    Under `torch.compile`, call `prepare(seq_len_q, seq_len_k, device)` for every length before the
    first compiled call: masks built from a pattern name are made outside the compiled graph.

    The layer pickles, `torch.save`s and deep-copies at any time, also after a forward: the cache of pattern
    masks is not part of its state and is rebuilt on demand.

    Example:
        >>> import torch
        >>> from sparse_flash.nn import BlockSparseAttention
        >>> attn = BlockSparseAttention(256, 4, mask="local", mask_params={"window": 1}, block_size=64)
        >>> x = torch.randn(2, 500, 256)
        >>> attn(x).shape
        torch.Size([2, 500, 256])
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        mask: BlockMask | str | None = None,
        mask_params: dict | None = None,
        block_size=None,
        causal: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
        sinks: bool = False,
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        embed_dim = positive_int(embed_dim, "embed_dim")
        num_heads = positive_int(num_heads, "num_heads")
        num_kv_heads = num_heads if num_kv_heads is None else positive_int(num_kv_heads, "num_kv_heads")
        kdim = embed_dim if kdim is None else positive_int(kdim, "kdim")
        vdim = embed_dim if vdim is None else positive_int(vdim, "vdim")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim must be a multiple of num_heads ({num_heads}), got {embed_dim}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads ({num_heads}), got {num_kv_heads}")
        head_dim = embed_dim // num_heads
        lo, hi = HEAD_DIM_RANGE
        if not lo <= head_dim <= hi:
            raise ValueError(
                f"embed_dim // num_heads (the head size) must be between {lo} and {hi}, got {embed_dim} // "
                f"{num_heads} = {head_dim}"
            )
        causal = as_bool(causal, "causal")
        bias = as_bool(bias, "bias")
        sinks = as_bool(sinks, "sinks")
        if is_bool(dropout) or not isinstance(dropout, numbers.Real):
            raise TypeError(f"dropout must be a float in [0, 1], got {type(dropout).__name__} {dropout!r}")
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be a float in [0, 1], got {dropout!r}")
        dropout = float(dropout)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if mask_params is not None and not isinstance(mask_params, dict):
            raise TypeError(
                f"mask_params must be a dict of pattern parameters or None, got {type(mask_params).__name__}"
            )
        if block_size is not None:
            pair = block_pair(block_size)
            if isinstance(mask, BlockMask) and pair != mask.block_size:
                raise ValueError(f"block_size must be None or the mask's block size {mask.block_size}, got "
                                 f"{block_size!r}")
            if not is_int(block_size):
                block_size = pair  # a tuple of the layer's own: the caller's list stays the caller's
        if isinstance(mask, BlockMask):
            block_size = mask.block_size
            if mask.shape[1] not in (1, num_heads):
                raise ValueError(f"mask head count must be 1 or num_heads ({num_heads}), got {mask.shape[1]}")
        if isinstance(mask, str) and mask_params and "num_heads" in mask_params and \
                mask_params["num_heads"] not in (1, num_heads):
            raise ValueError(f"mask_params num_heads must be 1 or the layer's num_heads ({num_heads}), got "
                             f"{mask_params['num_heads']!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        if isinstance(mask, str):
            block_size = 128 if block_size is None else block_size
            mask_params = copy.deepcopy(dict(mask_params or {}))  # the caller's lists stay the caller's
            _check_pattern(mask, mask_params, block_size)
        elif mask_params:
            raise ValueError(f"mask_params only applies to a pattern name, but mask is {type(mask).__name__}")
        elif mask is not None and not isinstance(mask, BlockMask):
            raise TypeError(f"mask must be a BlockMask, a pattern name or None, got {type(mask).__name__}")
        if backend == "triton" and block_size is not None:
            triton_blocks(block_pair(block_size), "block_size (backend='triton')")
        device = _parameter_device(device)

        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim, self.kdim, self.vdim = head_dim, kdim, vdim
        self.mask, self._mask_params, self.block_size = mask, mask_params, block_size
        self.causal, self.backend = causal, backend
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(kdim, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(vdim, num_kv_heads * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.sink = nn.Parameter(torch.empty(num_heads, **factory)) if sinks else None
        self.dropout = nn.Dropout(dropout)
        self._masks: OrderedDict[tuple[int, int, str], BlockMask] = OrderedDict()  # LRU by (Nq, Nk, device)
        self.reset_parameters()
        self._fixed = True  # from here on `mask`, `mask_params` and `block_size` cannot change (`__setattr__`)

    _FIXED = ("mask", "mask_params", "_mask_params", "block_size")

    def __setattr__(self, name, value):
        if name in self._FIXED and self.__dict__.get("_fixed"):
            raise AttributeError(
                f"{type(self).__name__}.{name} is fixed at construction (the layer's cached masks were built from it): "
                "build a new layer")
        super().__setattr__(name, value)

    @property
    def mask_params(self):
        """The pattern's parameters (a read-only copy: editing a list in it changes nothing; None without a pattern
        name)."""
        return None if self._mask_params is None else types.MappingProxyType(copy.deepcopy(self._mask_params))

    def __getstate__(self):
        state = super().__getstate__().copy()
        state["_masks"] = OrderedDict()  # a cache: rebuilt on demand, never serialised
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._masks = OrderedDict()  # also for layers saved before the cache was left out

    def reset_parameters(self) -> None:
        """Xavier-uniform input projections and zero biases, as in `nn.MultiheadAttention`; zero sinks."""
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        if self.sink is not None:
            nn.init.zeros_(self.sink)

    def prepare(self, seq_len_q: int, seq_len_k: int | None = None, device=None) -> BlockMask | None:
        """Build (and cache) the mask that inputs of these lengths use, outside any compiled graph.

        Args:
            seq_len_q: query length in tokens.
            seq_len_k: key length; default `seq_len_q`.
            device: where the inputs will live; default the device of the parameters.

        Returns:
            The BlockMask the layer will use, or None for dense attention.

        Example:
            >>> attn = BlockSparseAttention(256, 4, mask="butterfly", block_size=64)
            >>> attn.prepare(1024).num_blocks
            (16, 16)
        """
        seq_len_q = positive_int(seq_len_q, "seq_len_q")
        seq_len_k = seq_len_q if seq_len_k is None else positive_int(seq_len_k, "seq_len_k")
        device = _canonical_device(self.q_proj.weight.device if device is None else device)
        if self.mask is None:
            return None
        if isinstance(self.mask, BlockMask):
            self._check_lengths(self.mask, seq_len_q, seq_len_k, "the layer's mask")
            return self.mask.to(device)  # the copy is cached on the mask
        return self._pattern_mask(seq_len_q, seq_len_k, device)

    def _pattern_mask(self, seq_len_q: int, seq_len_k: int, device: torch.device) -> BlockMask:
        """The cached mask of these lengths, built on a miss; the least recently used leaves the cache first.
        Inside torch.compile the cache is only read: reordering it there mutates the layer's state, which Dynamo
        refuses inside `torch.utils.checkpoint` (so uses in compiled calls do not count as recent)."""
        key = (seq_len_q, seq_len_k, str(device))
        mask = self._masks.get(key)
        if torch.compiler.is_compiling():
            if mask is None:
                raise RuntimeError(
                    f"BlockSparseAttention has no {self.mask!r} mask for lengths ({seq_len_q}, {seq_len_k}) on "
                    f"{device}; call .prepare({seq_len_q}, {seq_len_k}, {str(device)!r}) before torch.compile"
                )
            return mask
        if mask is not None:
            self._masks.move_to_end(key)
        else:
            mask = self._build_pattern(seq_len_q, seq_len_k, device)
            self._masks[key] = mask
            if len(self._masks) > MASK_CACHE_SIZE:
                self._masks.popitem(last=False)
        return mask

    def _build_pattern(self, seq_len_q: int, seq_len_k: int, device: torch.device) -> BlockMask:
        params = dict(self.mask_params)
        if seq_len_k != seq_len_q:
            if "seq_len_k" not in inspect.signature(masks.PATTERNS[self.mask]).parameters:
                raise ValueError(
                    f"mask pattern {self.mask!r} is for self-attention only, but the query and key lengths differ "
                    f"({seq_len_q} and {seq_len_k})"
                )
            params["seq_len_k"] = seq_len_k
        try:
            return masks.build(self.mask, seq_len_q, self.block_size, device=device, **params)
        except ValueError as e:
            raise type(e)(
                f"BlockSparseAttention cannot build its {self.mask!r} mask for lengths ({seq_len_q}, {seq_len_k}): {e}"
            ) from e

    @staticmethod
    def _check_lengths(mask: BlockMask, seq_len_q: int, seq_len_k: int, what: str) -> None:
        if (mask.seq_len_q, mask.seq_len_k) != (seq_len_q, seq_len_k):
            raise ValueError(
                f"{what} covers (seq_len_q, seq_len_k) = ({mask.seq_len_q}, {mask.seq_len_k}) but the inputs have "
                f"lengths ({seq_len_q}, {seq_len_k})"
            )

    def _check_inputs(self, query, key, value) -> None:
        for name, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or t.shape[-1] != width:
                raise ValueError(f"{name} must have shape (batch, seq, {width}), got shape {tuple(t.shape)}")
        if not query.shape[0] == key.shape[0] == value.shape[0]:
            raise ValueError(
                f"query, key and value must share the batch size, got {query.shape[0]}, {key.shape[0]} and "
                f"{value.shape[0]}"
            )
        if key.shape[1] != value.shape[1]:
            raise ValueError(f"key and value must have the same length, got {key.shape[1]} and {value.shape[1]}")
        if query.shape[1] == 0 or key.shape[1] == 0:
            raise ValueError(f"query and key must hold at least one token, got shapes {tuple(query.shape)} and "
                             f"{tuple(key.shape)}")
        weight = self.q_proj.weight
        if not torch.is_autocast_enabled(query.device.type):
            for name, t in (("query", query), ("key", key), ("value", value)):
                if t.dtype != weight.dtype:
                    raise TypeError(f"{name} must have the layer's dtype {weight.dtype} (or run under autocast), "
                                    f"got {t.dtype}")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask: BlockMask | None = None,
    ) -> torch.Tensor:
        """Attend from `query` to `key`/`value`.

        Args:
            query: `(B, Nq, embed_dim)`.
            key: `(B, Nk, kdim)`; default `query` (self-attention).
            value: `(B, Nk, vdim)`; default `key`.
            mask: a `BlockMask` for this call, overriding the layer's mask; its lengths must be `(Nq, Nk)`.

        Returns:
            `(B, Nq, embed_dim)`.
        """
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        n_q, n_k = query.shape[1], key.shape[1]
        if mask is not None and not isinstance(mask, BlockMask):
            raise TypeError(f"mask must be a BlockMask or None, got {type(mask).__name__}")
        if mask is None and isinstance(self.mask, str):
            mask = self._pattern_mask(n_q, n_k, query.device)
        elif mask is None:
            mask = self.mask
        if mask is not None:
            self._check_lengths(mask, n_q, n_k, "the mask")
        return self._attend(*self._heads(query, key, value), mask)

    def _heads(self, query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projected inputs: q `(B, num_heads, Nq, D)`, k and v `(B, num_kv_heads, Nk, D)`."""
        q = rearrange(self.q_proj(query), "b n (h d) -> b h n d", h=self.num_heads)
        k = rearrange(self.k_proj(key), "b n (h d) -> b h n d", h=self.num_kv_heads)
        v = rearrange(self.v_proj(value), "b n (h d) -> b h n d", h=self.num_kv_heads)
        return q, k, v

    def _attend(self, q, k, v, mask: BlockMask | None) -> torch.Tensor:
        """Attention of the heads under `mask` (None: dense), then the output projection and dropout."""
        sinks = self.sink is not None
        if mask is None:
            out = flash_attention(q, k, v, causal=self.causal, return_lse=sinks, backend=self.backend)
        else:
            out = block_sparse_attention(q, k, v, mask, causal=self.causal, return_lse=sinks, backend=self.backend)
        if sinks:  # the row's weight on its keys: e^lse / (e^lse + e^sink); an empty row (lse -inf) stays 0
            out, lse = out
            out = out * torch.sigmoid(lse - self.sink[:, None].to(lse.dtype)).to(out.dtype)[..., None]
        out = rearrange(out, "b h n d -> b n (h d)")
        return self.dropout(self.out_proj(out))

    def extra_repr(self) -> str:
        mask = self.mask.name if isinstance(self.mask, BlockMask) else self.mask
        params = f", mask_params={dict(self.mask_params)}" if self.mask_params else ""
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"mask={mask!r}{params}, block_size={self.block_size}, causal={self.causal}, "
            f"dropout={self.dropout.p}{', sinks=True' if self.sink is not None else ''}, backend={self.backend!r}"
        )


def _block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 `(B, H, ceil(N / block), D)`: the mean of each block of `block` rows of `x` `(B, H, N, D)` (the
    last block's mean over its real rows)."""
    B, H, N, D = x.shape
    M, whole = -(-N // block), N // block
    # summed in float32 from x itself: no float32 copy of x (at 32,768 tokens and 16 heads of 128, a copy took
    # 0.19 ms of a 2.7 ms call on the H200)
    # Divided by Python numbers: torch 2.11's Inductor failed to compile the mean over a clamped row count
    # (`clamp(N - arange(M) * block, max=block)`) for CUDA, with a sympy error, once fused with the gate
    means = x[:, :, :whole * block].reshape(B, H, whole, block, D).sum(3, dtype=torch.float32) / block
    if whole < M:  # the tail block: the mean of its real rows
        tail = x[:, :, whole * block:].sum(2, keepdim=True, dtype=torch.float32) / (N - whole * block)
        means = torch.cat([means, tail], 2)
    return means


def _overlapping(Nq: int, Nk: int, bq: int, bk: int, device) -> torch.Tensor:
    """bool `(Mq, Mk)`: key blocks that hold a causal pair with query block i (`j * bk <= its last query`) and
    do not end before its first token (keys at or after `i * bq`)."""
    i = torch.arange(-(-Nq // bq), device=device)[:, None]
    j = torch.arange(-(-Nk // bk), device=device)[None, :]
    last_query = torch.clamp((i + 1) * bq, max=Nq) - 1
    return (j * bk <= last_query) & (torch.clamp((j + 1) * bk, max=Nk) > i * bq)


def _most_overlapping(bq: int, bk: int) -> int:
    """The most key blocks of `bk` tokens that overlap one query block of `bq` tokens (the first `bq` tokens of
    each block, which start at multiples of `bq`; the pattern repeats every `bk / gcd` query blocks)."""
    return max(-(-(i + 1) * bq // bk) - (i * bq) // bk for i in range(bk // math.gcd(bq, bk)))


def _check_causal_top_k(causal: bool, top_k: int, pair: tuple[int, int]) -> None:
    """A causal choice keeps the key blocks that overlap each query block, which count among its `top_k`."""
    if causal and top_k < _most_overlapping(*pair):
        raise ValueError(f"top_k must be at least {_most_overlapping(*pair)} with causal=True and block_size "
                         f"{pair}: each query block keeps the key blocks that overlap it (up to "
                         f"{_most_overlapping(*pair)}), which count among the top_k; got {top_k}")


class MoBAAttention(BlockSparseAttention):
    """Multi-head attention that chooses, per call, the key blocks each query block attends to: MoBA (Lu et al.,
    2025, "MoBA: Mixture of Block Attention for Long-Context LLMs"), on the block-sparse kernels.

    The gate of key block j for query block i is, per head, `mean(q over block i) . mean(k over block j)`: the
    mean over the block's queries of MoBA's per-token gate `q . mean(k over block j)` (MoBA chooses per query
    token; a block mask chooses per query block). Each query block keeps its `top_k` best key blocks
    (`BlockMask.from_topk`: ties go to the lower block, and no gradient flows through the choice). The chosen
    mask then runs `block_sparse_attention` with the layer's `causal` flag.

    With `causal`, the choice is causal too: no token's output depends on a later token. Every token of a
    query block shares one choice, so it reads only what precedes the block's first token: the gate's query
    is the mean over the block before (`mean(q over block i - 1)`), only key blocks that end before the block
    starts compete, and the key blocks that overlap it (the diagonal; more where key blocks are shorter than
    query blocks) are always kept, counting among the `top_k` (so `top_k` must be at least their number).
    Choosing by the block's own queries would let a later token change which keys an earlier one attends.

    A gate that is not finite (a NaN or an infinity among a block's keys or queries) ranks first, after the
    kept overlapping blocks: a key block holding one is chosen wherever it competes, so the value reaches the
    rows that attend it as in dense attention; a query block whose gates are all NaN (a NaN among the queries
    its gate reads) keeps its first candidates.

    Args:
        embed_dim, num_heads: as in `BlockSparseAttention`.
        block_size: int, or `(block_q, block_k)`: the blocks that are chosen, in tokens.
        top_k: key blocks kept per query block, an int from 1 (capped at the key blocks of a call).
        causal: bool, default True (self-attention in a decoder).
        num_kv_heads, kdim, vdim, dropout, bias, sinks, backend, device, dtype: as in `BlockSparseAttention`.

    The whole call, choice included, traces with `torch.compile(fullgraph=True)`, and builds the mask's index
    lists without waiting for the GPU; there is nothing to `prepare`.

    Example:
        >>> from sparse_flash.nn import MoBAAttention
        >>> attn = MoBAAttention(256, 4, block_size=64, top_k=3)
        >>> attn(torch.randn(2, 500, 256)).shape
        torch.Size([2, 500, 256])
    """

    def __init__(self, embed_dim: int, num_heads: int, block_size, top_k: int, *, causal: bool = True,
                 num_kv_heads: int | None = None, kdim: int | None = None, vdim: int | None = None,
                 dropout: float = 0.0, bias: bool = True, sinks: bool = False, backend: str = "auto", device=None,
                 dtype=None):
        pair, top_k = block_pair(block_size), positive_int(top_k, "top_k")
        _check_causal_top_k(as_bool(causal, "causal"), top_k, pair)
        super().__init__(embed_dim, num_heads, num_kv_heads=num_kv_heads, kdim=kdim, vdim=vdim, mask=None,
                         block_size=block_size, causal=causal, dropout=dropout, bias=bias, sinks=sinks,
                         backend=backend, device=device, dtype=dtype)
        for name, value in (("block_pair", pair), ("top_k", top_k)):  # fixed, as `block_size` (`__setattr__`)
            object.__setattr__(self, name, value)

    _FIXED = BlockSparseAttention._FIXED + ("block_pair", "top_k")

    def prepare(self, seq_len_q: int, seq_len_k: int | None = None, device=None) -> None:
        """Nothing to build ahead: the layer chooses its mask in each call (kept for layers used alike)."""
        return None

    def select(self, q: torch.Tensor, k: torch.Tensor) -> BlockMask:
        """The mask of a call with heads q `(B, num_heads, Nq, D)` and k `(B, num_kv_heads, Nk, D)`: each query
        block's `top_k` key blocks by gate score, `(B, num_heads, Mq, Mk)`."""
        bq, bk = self.block_pair
        _check_causal_top_k(self.causal, self.top_k, self.block_pair)  # `causal` may have been set since
        with torch.no_grad():
            keys = _block_means(k, bk).repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
            queries = _block_means(q, bq)  # (B, H, Mq, D)
            if self.causal:  # block i's gate reads the block before it (block 0 has no key block to choose)
                queries = torch.cat([torch.zeros_like(queries[:, :, :1]), queries[:, :, :-1]], 2)
            scores = queries @ keys.transpose(-1, -2)  # (B, H, Mq, Mk)
            # A gate that is not finite ranks first: a key block holding a NaN or an infinity is chosen wherever
            # it may be, so the value reaches the rows that attend it, as in attention (ranked last, it would
            # vanish). The choice reads nothing from the device to check the scores.
            top = torch.finfo(scores.dtype).max
            scores = torch.nan_to_num(scores, nan=top, posinf=top, neginf=top)
            if self.causal:  # the key blocks overlapping the query block rank before all: always kept
                scores = scores.masked_fill(_overlapping(q.shape[2], k.shape[2], bq, bk, q.device), float("inf"))
        return BlockMask.from_topk(scores, min(self.top_k, scores.shape[-1]), causal=self.causal,
                                   block_size=self.block_pair, seq_len_q=q.shape[2], seq_len_k=k.shape[2],
                                   check_finite=False, name="moba")

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        """Attend from `query` `(B, Nq, embed_dim)` to `key` `(B, Nk, kdim)` (default `query`) and `value`
        `(B, Nk, vdim)` (default `key`) through the key blocks chosen for this call; returns `(B, Nq, embed_dim)`."""
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        if query.shape[0] == 0:  # an empty batch: nothing to choose from (the output is empty too)
            return self.out_proj(self.q_proj(query))
        q, k, v = self._heads(query, key, value)
        return self._attend(q, k, v, self.select(q, k))

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"block_size={self.block_size}, top_k={self.top_k}, causal={self.causal}, dropout={self.dropout.p}"
                f"{', sinks=True' if self.sink is not None else ''}, backend={self.backend!r}")
