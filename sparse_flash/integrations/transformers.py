"""Hugging Face transformers (>= 5): an `attn_implementation` that runs attention through `block_sparse_attention`.

    >>> from sparse_flash.integrations.transformers import register
    >>> config.sparse_flash = {"pattern": "bigbird", "block_size": 128, "seed": 0}  # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation=register())  # doctest: +SKIP

(a transformers config and model class; without a `sparse_flash` attribute the model runs dense attention).

`register()` adds an attention function to transformers' `AttentionInterface` and a mask function to its
`AttentionMaskInterface` under one name. Once per forward the mask function turns what the model's mask creator
knows (query and key lengths, cache offset, causal or bidirectional, the 2-D padding mask) into a `CallPlan`: the
BlockMask, keys and query rows of the attention calls. Every layer runs that plan. What is exact and what is refused:

- The pattern covers the absolute positions 0..L-1 of the sequence, L = cached tokens + new tokens (for causal
  models the last query's position + 1). Queries are the last Nq of those positions; each sees its row of the
  pattern and, in causal models, the keys at or before its position (bottom-right alignment, as in the model's own
  masks). Decoding (Nq = 1) runs its one mask row; a prefill chunk (1 < Nq < L) prepends dummy query rows whose
  mask rows are empty, so that the kernels' top-left causal rule is exact, and drops them from the output.
  A pattern is rebuilt for each L (cached), so one whose early rows change with L (random, bigbird, fixed and
  strided do) gives cached tokens the rows of the length they were computed at: generation with a cache then differs
  from one forward over the whole sequence; dense, causal, local, butterfly, global and longformer agree.
- Padding (2-D `attention_mask`): padded keys are masked. A per-token mask is exact when, in each row of the
  batch, the kept keys up to the last kept one fill whole key blocks (a padded tail of any length is fine: the
  call ends at the last kept key); with no pattern (dense) any contiguous run of kept keys is exact (left and
  right padding). Anything else is refused with a ValueError naming `attention_mask` and the block size.
- torch.compile (fullgraph too): call `prepare(config, seq_len, device)` for each length first, so that the config
  is checked and the mask built outside the graph; padding masks are read on the host, so compiled calls take none.
- Loading: `config.sparse_flash` is saved with the model, but transformers picks the attention implementation at
  load time: pass `attn_implementation=register()` to `from_pretrained` again, or the model runs dense SDPA.
- Refused: `output_attentions=True`, attention dropout > 0, sliding windows (`config.sliding_window`,
  `config.layer_types`), softcapping, attention sinks, position biases, packed sequences and other mask
  overlays, prepared 4-D masks, sliding-window caches, and a pattern on cross-attention (dense works there).
"""

from __future__ import annotations

import inspect
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .. import masks
from ..api import BACKENDS, block_sparse_attention, flash_attention
from ..mask import BlockMask
from ..checks import block_pair, check_device, positive_int
from ..masks._common import GridError

__all__ = ["CONFIG_FIELD", "DEFAULT_NAME", "CallPlan", "attention_forward", "plan_call", "prepare", "register"]

DEFAULT_NAME = "block_sparse"
CONFIG_FIELD = "sparse_flash"  # the model config attribute that holds the pattern
MASK_CACHE_SIZE = 32  # pattern masks kept (per spec, length and device), least recently used dropped first
_GEOMETRY_ARGS = ("seq_len", "block_size", "seq_len_k", "device")
_SPEC_KEYS = ("pattern", "block_size", "backend")
_FIELD = f"config.{CONFIG_FIELD}"
_PATTERN_MASKS: OrderedDict[tuple, BlockMask] = OrderedDict()
_CHECKED_SPECS: dict[int, tuple[object, "_Spec"]] = {}  # id(config.sparse_flash) -> (that value, its spec)


# ---------------------------------------------------------------------------------------------- config


class _Spec(NamedTuple):
    """`config.sparse_flash`, checked: a pattern name (None: dense) or a callable, and how to run it."""

    pattern: str | Callable | None
    block_size: tuple[int, int]
    backend: str
    params: dict
    key: tuple  # identifies the masks this spec builds (for the cache)


_DENSE_SPEC = _Spec(None, (128, 128), "auto", {}, ("dense",))


def _read_spec(config) -> _Spec:
    """The spec in `config.sparse_flash`; dense when the attribute is absent or None. Checked eagerly; inside
    torch.compile the spec that the last eager check (a forward, or `prepare`) made of the same value is used."""
    raw = getattr(config, CONFIG_FIELD, None) if config is not None else None
    if raw is None:
        return _DENSE_SPEC
    if torch.compiler.is_compiling():
        for checked, spec in _CHECKED_SPECS.values():  # by identity; id() does not trace on every torch
            if checked is raw:
                return spec
        raise RuntimeError(f"{_FIELD} was never checked outside torch.compile: call sparse_flash.integrations."
                           "transformers.prepare(config, seq_len, device) for each length before compiling")
    spec = _check_spec(raw)
    _CHECKED_SPECS[id(raw)] = (raw, spec)
    if len(_CHECKED_SPECS) > MASK_CACHE_SIZE:
        _CHECKED_SPECS.pop(next(iter(_CHECKED_SPECS)))
    return spec


def _check_spec(raw) -> _Spec:
    if callable(raw):
        raw = {"pattern": raw}
    if not isinstance(raw, dict):
        raise TypeError(f"{_FIELD} must be a dict such as {{'pattern': 'bigbird', 'block_size': 128}}, a callable "
                        f"(seq_len, device) -> BlockMask or None, got {type(raw).__name__} {raw!r}")
    pattern = raw.get("pattern")
    pattern = None if pattern == "dense" else pattern
    backend = raw.get("backend", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"{_FIELD}['backend'] must be one of {BACKENDS}, got {backend!r}")
    params = {k: v for k, v in raw.items() if k not in _SPEC_KEYS}
    try:
        block_size = block_pair(raw.get("block_size", 128))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{_FIELD}['block_size']: {e}") from e
    if backend in ("triton", "auto") and (block_size[0] % 16 or block_size[1] % 16):
        raise ValueError(f"{_FIELD}['block_size'] must be a multiple of 16 for the triton kernels (backend "
                         f"{backend!r}), got {raw.get('block_size')!r}; use 64 or 128, or backend 'torch'")
    if callable(pattern):
        if params or "block_size" in raw:
            raise ValueError(f"{_FIELD}: a callable pattern builds its own BlockMask, so it takes no block_size "
                             f"or pattern parameters, got {sorted(set(raw) - {'pattern', 'backend'})}")
        return _Spec(pattern, block_size, backend, {}, ("callable", pattern))
    if pattern is not None and (not isinstance(pattern, str) or pattern not in masks.PATTERNS):
        raise ValueError(f"{_FIELD}['pattern'] must be a name in {sorted(masks.PATTERNS)}, a callable "
                         f"(seq_len, device) -> BlockMask or None (dense), got {pattern!r}")
    _check_params(pattern, params)
    key = ("name", pattern, block_size, json.dumps(params, sort_keys=True, default=repr))
    return _Spec(pattern, block_size, backend, params, key)


def _check_params(pattern: str | None, params: dict) -> None:
    if pattern is None:
        if params:
            raise ValueError(f"{_FIELD}: the dense pattern takes no parameters, got {sorted(params)}")
        return
    accepted = inspect.signature(masks.PATTERNS[pattern]).parameters
    known = sorted(p for p in accepted if p not in _GEOMETRY_ARGS)
    for name, value in params.items():
        if name in _GEOMETRY_ARGS:
            raise ValueError(f"{_FIELD} must not set {name!r}: the model passes the lengths and device")
        if name not in accepted:
            raise ValueError(f"{_FIELD}: pattern {pattern!r} takes the parameters {known} (besides 'block_size' "
                             f"and 'backend'), got {name!r}")
        if isinstance(value, torch.Generator):
            raise TypeError(f"{_FIELD}[{name!r}] must be an int seed (a config must describe the same mask every "
                            "time), got a torch.Generator")
    missing = [p for p, s in accepted.items()
               if p not in _GEOMETRY_ARGS and s.default is inspect.Parameter.empty and p not in params]
    if missing:
        raise ValueError(f"{_FIELD}: pattern {pattern!r} needs {missing}, got {params}")


def _pattern_mask(spec: _Spec, seq_len: int, device: torch.device) -> BlockMask | None:
    """The pattern over `seq_len` tokens (self-attention), cached; None for the dense pattern."""
    if spec.pattern is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (spec.key, seq_len, str(device))
    mask = _PATTERN_MASKS.get(key)
    if mask is not None:
        if not torch.compiler.is_compiling():
            _PATTERN_MASKS.move_to_end(key)
        return mask
    if torch.compiler.is_compiling():  # no lengths in the message: a compiled length may be symbolic
        raise RuntimeError(f"no {_FIELD} mask is cached for this sequence length: call sparse_flash.integrations."
                           "transformers.prepare(config, seq_len, device) for every length before torch.compile")
    mask = _build_pattern(spec, seq_len, device)
    _PATTERN_MASKS[key] = mask
    if len(_PATTERN_MASKS) > MASK_CACHE_SIZE:
        _PATTERN_MASKS.popitem(last=False)
    return mask


def _build_pattern(spec: _Spec, seq_len: int, device: torch.device) -> BlockMask:
    if callable(spec.pattern):
        mask = spec.pattern(seq_len, device)
        if not isinstance(mask, BlockMask):
            raise TypeError(f"{_FIELD}['pattern'] (a callable) must return a sparse_flash.BlockMask for "
                            f"(seq_len={seq_len}, device), got {type(mask).__name__}")
        if (mask.seq_len_q, mask.seq_len_k) != (seq_len, seq_len):
            raise ValueError(f"{_FIELD}['pattern'] (a callable) must return a mask of lengths ({seq_len}, {seq_len}), "
                             f"got ({mask.seq_len_q}, {mask.seq_len_k})")
        return mask.to(device)
    try:
        return masks.build(spec.pattern, seq_len, spec.block_size, device=device, **spec.params)
    except GridError as e:
        raise ValueError(f"{_FIELD} = {_describe(spec)} does not fit {seq_len} tokens "
                         f"({-(-seq_len // spec.block_size[0])} blocks of {spec.block_size[0]}): {e}") from e
    except (TypeError, ValueError) as e:
        raise type(e)(f"{_FIELD} = {_describe(spec)} is invalid: {e}") from e


def _describe(spec: _Spec) -> str:
    return repr({"pattern": spec.pattern, "block_size": spec.block_size, **spec.params})


def prepare(config, seq_len: int, device=None) -> BlockMask | None:
    """Build (and cache) the pattern mask of `config.sparse_flash` for `seq_len` tokens, e.g. before torch.compile.

    Args:
        config: a transformers config (or any object) with a `sparse_flash` attribute; absent means dense.
        seq_len: sequence length in tokens.
        device: where the model runs; default the CPU.

    Returns:
        The BlockMask every layer uses at that length (before the causal rule and padding), or None for dense.

    Example:
        >>> from types import SimpleNamespace
        >>> config = SimpleNamespace(sparse_flash={"pattern": "local", "block_size": 64, "window": 1})
        >>> prepare(config, 1024).num_blocks
        (16, 16)
    """
    seq_len = positive_int(seq_len, "seq_len")
    device = check_device(device, "device")
    return _pattern_mask(_read_spec(config), seq_len, torch.device("cpu") if device is None else device)


# ---------------------------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class _Group:
    """Batch rows that run one attention call: keys `[key_start, key_end)` of the (sliced) keys, call rows from
    `row_start` of the (padded) queries, and the mask (None: dense); `key_end == 0` means every key is padded."""

    index: torch.Tensor | None  # batch rows (None: all of them)
    row_start: int
    key_start: int
    key_end: int
    mask: BlockMask | None


@dataclass(frozen=True)
class CallPlan:
    """What every attention layer of one forward runs: made once per forward by the mask function.

    The model passes it to each layer as `attention_mask`. Queries get `pad_queries` dummy rows in front, keys are
    cut to `keys`, and each group of batch rows runs one `block_sparse_attention` call. `error`, when set, is raised
    by the first layer that uses the plan (models build masks they may not use, e.g. for sliding layers).
    """

    q_length: int
    kv_length: int
    keys: int = 0
    pad_queries: int = 0
    causal: bool = False
    groups: tuple[_Group, ...] = ()
    backend: str = "auto"
    heads: int = 1  # heads of the pattern (1: shared by all heads)
    error: str | None = None
    ndim = 4  # transformers passes a plan made ahead (generate with a static cache) through as a prepared mask

    def contiguous(self) -> "CallPlan":
        """The plan itself: generate with a static cache asks the mask it prepares for a contiguous copy
        (transformers 5.20 and earlier 5.x); a plan holds no strided data and never changes."""
        return self

    def run(self, query, key, value, scale) -> torch.Tensor:
        """Attention `(B, Hq, Nq, D)` for `query (B, Hq, Nq, D)`, `key`, `value (B, Hkv, Nk, D)`."""
        if self.error is not None:
            raise ValueError(self.error)
        if (query.shape[2], key.shape[2]) != (self.q_length, self.kv_length):
            raise ValueError(f"the attention inputs have query and key lengths ({query.shape[2]}, {key.shape[2]}) but "
                             f"the model's mask was made for ({self.q_length}, {self.kv_length})")
        if self.heads not in (1, query.shape[1]):
            raise ValueError(f"{_FIELD} gives a mask of {self.heads} heads but the layer has {query.shape[1]} query "
                             f"heads: set {_FIELD}['num_heads'] to {query.shape[1]} or leave it out")
        B, H, Nq, D = query.shape
        q = torch.nn.functional.pad(query, (0, 0, self.pad_queries, 0)) if self.pad_queries else query
        k, v = key[:, :, : self.keys], value[:, :, : self.keys]
        outs = []
        for g in self.groups:
            pick = (lambda t: t) if g.index is None else (lambda t: t.index_select(0, g.index))
            rows = (B if g.index is None else len(g.index), H)
            if g.key_end == 0:  # every key padded: the rows attend nothing and output 0, like SDPA's
                outs.append(query.new_zeros(*rows, Nq, D))
                continue
            qg = pick(q)[:, :, g.row_start:]
            kg, vg = (pick(t)[:, :, g.key_start: g.key_end] for t in (k, v))
            if g.mask is None:
                out = flash_attention(qg, kg, vg, causal=self.causal, scale=scale, backend=self.backend)
            else:
                out = block_sparse_attention(qg, kg, vg, g.mask, causal=self.causal, scale=scale, backend=self.backend)
            skip = self.pad_queries - g.row_start  # call rows before the real queries (dummy rows)
            if skip >= 0:
                out = out[:, :, skip:]
            else:  # padded rows dropped from the call: they attend nothing
                out = torch.cat([out.new_zeros(*rows, -skip, D), out], dim=2)
            outs.append(out)
        if len(self.groups) == 1 and self.groups[0].index is None:
            return outs[0]
        order = torch.cat([g.index for g in self.groups])
        return torch.cat(outs).index_select(0, torch.argsort(order))


def plan_call(config, *, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0, causal: bool,
              padding_mask: torch.Tensor | None = None, device=None) -> CallPlan:
    """The plan of one forward: queries at positions `[q_offset, q_offset + q_length)`, keys at
    `[kv_offset, kv_offset + kv_length)`, `padding_mask` bool `(B, >= kv_offset + kv_length)` (True: a real key).

    Raises:
        ValueError: what the plan cannot express exactly (see the module docstring), naming the field to change.
    """
    spec = _read_spec(config)
    device = torch.device("cpu" if device is None else device)
    plan = dict(q_length=q_length, kv_length=kv_length, causal=causal, backend=spec.backend)
    if kv_offset:
        raise ValueError(f"the cache drops its first {kv_offset} keys (a sliding-window cache): sparse_flash needs "
                         "every key from position 0; use a full (dynamic or static) cache")
    cross = not causal and q_offset == 0 and q_length != kv_length
    if cross:  # cross attention (or a prefix): dense only
        if spec.pattern is not None:
            raise ValueError(f"{_FIELD} sets a pattern but this layer attends {q_length} queries to {kv_length} other "
                             f"keys (cross attention): a self-attention pattern does not apply to it; remove the "
                             f"pattern or use a model without cross attention")
        keys, rows_total, pad, mode = kv_length, q_length, 0, "full"
    else:
        keys = q_offset + q_length if causal else kv_length
        if keys > kv_length or q_offset + q_length > keys:
            raise ValueError(f"queries at positions [{q_offset}, {q_offset + q_length}) do not fit {kv_length} keys")
        if q_length == keys:
            rows_total, pad, mode = q_length, 0, "full"
        elif q_length == 1:
            rows_total, pad, mode = 1, 0, "row"
        else:
            rows_total, pad, mode = q_offset + q_length, q_offset, "padded"
        plan.update(causal=causal and mode != "row")  # one query at the last key: no causal rule left
    pattern = None if cross else _pattern_mask(spec, keys, device)
    block = pattern.block_size if pattern is not None else spec.block_size
    groups = []
    for start, end, keep, index in _key_runs(padding_mask, keys, device):
        if end == 0:
            groups.append(_Group(index, 0, 0, 0, None))
        elif pattern is None:
            if keep is not None and not bool(keep[:, start:].all()):
                raise ValueError(_padding_error(keep, block[1], dense=True))
            row_start = start if plan["causal"] else 0  # rows and keys both start there: top-left causal stays exact
            mask = _dense_rows(pad - row_start, rows_total - row_start, end - start, block, device)
            groups.append(_Group(index, row_start, start, end, mask))
        elif mode == "full" and keep is None and end == keys and (index is None or pattern.shape[0] == 1):
            groups.append(_Group(index, 0, 0, end, pattern))  # the cached mask itself: its index lists are built
        else:
            sub = _row_layout(pattern, mode, q_offset, rows_total)[..., : -(-end // block[1])]
            if sub.shape[0] > 1 and index is not None:  # a per-batch pattern: the group's rows
                sub = sub.index_select(0, index.to(sub.device))
            if keep is not None:
                blocks = _keep_blocks(keep, block[1])
                if blocks is None:
                    raise ValueError(_padding_error(keep, block[1], dense=False))
                sub = sub & blocks.to(sub.device)[:, None, None, :]
            mask = BlockMask.from_layout(sub, block, seq_len_q=rows_total, seq_len_k=end, name=pattern.name)
            groups.append(_Group(index, 0, 0, end, mask))
    heads = pattern.shape[1] if pattern is not None else 1
    return CallPlan(keys=keys, pad_queries=pad, groups=tuple(groups), heads=heads, **plan)


def _row_layout(pattern: BlockMask, mode: str, q_offset: int, rows_total: int) -> torch.Tensor:
    """The block rows of the pattern that the call's query rows fall in; dummy block rows in front empty."""
    bq = pattern.block_size[0]
    if mode == "row":
        r = q_offset // bq
        return pattern.layout[..., r: r + 1, :].clone()
    layout = pattern.layout[..., : -(-rows_total // bq), :].clone()
    layout[..., : q_offset // bq if mode == "padded" else 0, :] = False
    return layout


def _dense_rows(dummy_rows: int, rows: int, keys: int, block, device) -> BlockMask | None:
    """Dense attention for `rows` query rows whose first `dummy_rows` are dummies: None (the dense kernels) when
    no whole block row is dummy, else a mask whose dummy block rows are empty."""
    bq, bk = block
    if dummy_rows < bq:
        return None
    grid = torch.ones(-(-rows // bq), -(-keys // bk), dtype=torch.bool, device=device)
    grid[: dummy_rows // bq] = False
    return BlockMask.from_layout(grid, block, seq_len_q=rows, seq_len_k=keys, name="dense")


def _key_runs(padding_mask: torch.Tensor | None, keys: int, device):
    """Batch rows grouped by their kept keys: `(start, end, keep, index)` per group, `[start, end)` the span from
    the first to the last kept key (`end == 0`: none kept), `keep` the rows' bool `(G, end)` mask when some key
    before `end` is padded (else None) and `index` the batch rows (None: all of them, one group)."""
    if padding_mask is None:
        return [(0, keys, None, None)]
    if padding_mask.dim() != 2:
        raise ValueError(f"attention_mask must be a 2-D padding mask (batch, keys), got shape "
                         f"{tuple(padding_mask.shape)}")
    if torch.compiler.is_compiling():
        raise RuntimeError("sparse_flash reads a padding attention_mask on the host: pass attention_mask=None under "
                           "torch.compile, or run the model eagerly")
    keep = padding_mask[:, :keys].to("cpu", torch.bool)
    if keep.shape[1] < keys:  # as transformers does: keys past the mask's end are padding
        keep = torch.nn.functional.pad(keep, (0, keys - keep.shape[1]))
    if bool(keep.all()):
        return [(0, keys, None, None)]
    pos = torch.arange(keys)
    kept = keep.any(dim=1)
    starts = torch.where(kept, torch.where(keep, pos, keys).amin(dim=1), 0).tolist()
    ends = torch.where(kept, torch.where(keep, pos, -1).amax(dim=1) + 1, 0).tolist()
    rows: dict[tuple[int, int], list[int]] = {}
    for b, span in enumerate(zip(starts, ends)):
        rows.setdefault(span, []).append(b)
    runs = []
    for (start, end), batch in rows.items():
        sub = keep[batch, :end]
        runs.append((start, end, None if bool(sub.all()) else sub, torch.tensor(batch, device=device)))
    return runs


def _block_view(keep: torch.Tensor, bk: int) -> torch.Tensor:
    """`keep (G, n)` as `(G, ceil(n / bk), bk)`; the tail past n counts as kept (the call ends at n)."""
    mk = -(-keep.shape[1] // bk)
    return torch.nn.functional.pad(keep, (0, mk * bk - keep.shape[1]), value=True).view(keep.shape[0], mk, bk)


def _keep_blocks(keep: torch.Tensor, bk: int) -> torch.Tensor | None:
    """Which key blocks each row keeps, bool `(G, Mk)`; None when a block is only partly padded."""
    blocks = _block_view(keep, bk)
    full = blocks.all(dim=2)
    return full if bool((full == blocks.any(dim=2)).all()) else None


def _padding_error(keep: torch.Tensor, bk: int, *, dense: bool) -> str:
    if dense:
        return ("attention_mask cannot be expressed exactly: a batch row's real keys are not one contiguous run "
                "(padding inside the sequence); use left or right padding")
    blocks = _block_view(keep, bk)
    j = int((blocks.all(dim=2) != blocks.any(dim=2)).nonzero()[0, 1])
    return (f"attention_mask cannot be expressed exactly with the {_FIELD} pattern: key block {j} (keys {j * bk}.."
            f"{min((j + 1) * bk, keep.shape[1]) - 1}) of a batch row is only partly padded, and a block mask keeps or "
            f"drops whole blocks of {bk} keys. Right padding of any length is exact; pad on the left by whole blocks "
            f"of {bk} tokens, or run rows of different lengths separately")


def _sliding_error(window) -> str:
    return (f"this layer uses a sliding window of {window} tokens (config.sliding_window, config.layer_types), an "
            "element-level band sparse_flash cannot express: set config.sliding_window = None or make every "
            f"config.layer_types entry 'full_attention', and use the 'local' pattern in {_FIELD} for a windowed block "
            "pattern")


def _mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    config=None,
    device=None,
    **kwargs,
) -> CallPlan:
    """transformers' mask interface: called once per forward by `create_causal_mask` and its siblings."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    if isinstance(attention_mask, CallPlan):  # made ahead by generate (static cache) for this very step
        return attention_mask
    sizes = dict(q_length=q_length, kv_length=kv_length)
    if mask_function is causal_mask_function or mask_function is bidirectional_mask_function:
        causal = mask_function is causal_mask_function
    elif local_size is not None or getattr(config, "sliding_window", None) is not None:
        return CallPlan(**sizes, error=_sliding_error(local_size if local_size is not None else config.sliding_window))
    else:
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        return CallPlan(**sizes, error=f"the model combines its mask with an element-level rule ({name}: packed "
                        "sequences whose position_ids restart, a token-type or image overlay, or chunked attention) "
                        "that sparse_flash cannot express; pass unpacked sequences or use another attn_implementation")
    if isinstance(q_offset, torch.Tensor):
        q_offset = int(q_offset)
    return plan_call(config, q_offset=q_offset, kv_offset=kv_offset, causal=causal, padding_mask=attention_mask,
                     device=device, **sizes)


# ---------------------------------------------------------------------------------------------- attention


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: `query (B, Hq, Nq, D)`, `key`, `value (B, Hkv, Nk, D)` (GQA when
    `Hkv < Hq`) to `(attn_output (B, Nq, Hq, D), None)`.

    `attention_mask` is the `CallPlan` that the mask function made for this forward; None (a model that builds
    no mask) plans here from the shapes: self-attention when the lengths agree, one decoding query at the last
    key, or (bidirectional, other lengths) dense cross attention.
    """
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
        raise ValueError("output_attentions=True: sparse_flash never materialises attention weights; load the "
                         "model with attn_implementation='eager' to get them")
    if dropout:
        raise ValueError(f"attention dropout {dropout} (config.attention_dropout, attention_probs_dropout_prob in "
                         "BERT-style configs): sparse_flash does not drop attention probabilities; set it to 0.0")
    if kwargs.get("sliding_window") is not None:  # the config's window (the model may pass it off by one)
        raise ValueError(_sliding_error(getattr(config, "sliding_window", None) or kwargs["sliding_window"]))
    for name, field in (("softcap", "config.attn_logit_softcapping"), ("s_aux", "attention sinks"),
                        ("position_bias", "a relative position bias")):
        if kwargs.get(name) is not None:
            raise ValueError(f"this layer passes {name}={kwargs[name]!r} ({field}), which sparse_flash cannot "
                             "apply exactly; use a model (or config) without it")
    if isinstance(attention_mask, CallPlan):
        plan = attention_mask
    elif attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        Nq, Nk = query.shape[2], key.shape[2]
        if causal and Nq not in (1, Nk):
            raise ValueError(f"no attention_mask reached this causal layer with {Nq} queries and {Nk} keys, so the "
                             "queries' positions are unknown: build the mask through transformers' mask functions")
        plan = plan_call(config, q_length=Nq, kv_length=Nk, q_offset=Nk - Nq if causal else 0, causal=bool(causal),
                         device=query.device)
    else:
        raise ValueError(f"attention_mask reached the attention as a {type(attention_mask).__name__} of shape "
                         f"{tuple(getattr(attention_mask, 'shape', ()))}: sparse_flash takes 2-D padding masks, "
                         "which its mask function plans from; a prepared 4-D element mask is not expressible")
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # as SDPA under autocast: q, k, v in the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    out = plan.run(query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = DEFAULT_NAME) -> str:
    """Add sparse_flash to transformers' attention and mask interfaces under `name`; returns `name`.

    Then `AutoModel.from_config(config, attn_implementation=name)` (or `from_pretrained`) runs every attention
    layer through `block_sparse_attention` with the pattern of `config.sparse_flash`. Calling it again is a no-op.

    Args:
        name: the implementation's name. It must not contain "flash": transformers treats such names as
            FlashAttention variants and tries to load a kernel for them.

    Raises:
        ImportError: transformers is not installed (`pip install sparse-flash[hf]`).
        ValueError: a name with "flash" in it, or one that transformers already uses for another implementation.

    Example:
        >>> config.sparse_flash = {"pattern": "butterfly", "block_size": 128}  # doctest: +SKIP
        >>> model = AutoModelForCausalLM.from_config(config, attn_implementation=register())  # doctest: +SKIP
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(f"name must not contain 'flash' (transformers would load a FlashAttention kernel for it), "
                         f"got {name!r}; the default is {DEFAULT_NAME!r}")
    if name == "eager" or "|" in name:
        raise ValueError(f"name {name!r} is reserved by transformers; the default is {DEFAULT_NAME!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("sparse_flash.integrations.transformers needs transformers >= 5: "
                          "pip install 'sparse-flash[hf]'") from e
    for interface, fn in ((AttentionInterface, attention_forward), (AttentionMaskInterface, _mask_function)):
        current = interface._global_mapping.get(name)
        if current is not None and current is not fn:
            raise ValueError(f"transformers already has an attention implementation called {name!r}; pick another name")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _mask_function)
    return name
