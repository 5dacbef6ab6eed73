"""The Path-256 demo's model: a pixel transformer whose attention is `sparse_flash.block_sparse_attention`.

Pixels (uint8, row-major) go in; the model reorders them into its token order (row-major, or tile-major so
that one mask block is one 2-D tile of the image), embeds each value, adds positions measured in image units,
runs pre-LN transformer blocks with one block mask per layer, and pools into a 2-class head. A second head
predicts the value of masked pixels for self-pretraining.

Positions (`ModelConfig.pos`, components joined by "+"):
  learned  a trainable `(side, side, width)` grid in image space; `resize_pos_grid` carries it to another
           resolution (each 64-px entry covers a 4 x 4 square at 256 px, as in the FlashAttention paper).
  sincos   a fixed 2-D sin/cos encoding added to the input: half the channels encode the row, half the column.
  rope2d   2-D rotary embedding of queries and keys: half of each head's dims rotate with the row, half with
           the column.
sincos and rope2d measure a pixel's centre in 1/32 of the image side, so they mean the same place at every
resolution and transfer as they are.

Masks (`MaskConfig.layers`, one spec per layer; a spec is names joined by "+", their union):
  butterfly    flat block butterfly | local band (window 1) | one global block (the 1-D default)
  dense        every block: dense FlashAttention (`sparse_flash.flash_attention`), density 1
  local        the 1-D band of blocks (window 1)
  bigbird      BigBird's defaults
  random       random blocks at the butterfly mask's density, plus the diagonal
  neighborhood tiles within a 2-D window of tiles (`--window`), plus `global_blocks` global tiles
  butterfly2d  the block butterfly along each tile axis, plus `global_blocks` global tiles
neighborhood and butterfly2d need tile order (`--order tile`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

import sparse_flash
from sparse_flash import masks

SINCOS_UNITS = 32  # positions are measured in 1/32 of the image side (a pixel of a 32-px image)
ROPE_BASE = 100.0  # rope2d frequencies run from 1 to 1/ROPE_BASE rad per unit: phases span 32 .. 0.32 rad
POS_KINDS = ("learned", "sincos", "rope2d")
ORDERS = ("row", "tile")
HEADS = ("mean", "max")
MASK_NAMES = ("butterfly", "dense", "local", "bigbird", "random", "neighborhood", "butterfly2d")
TILED_MASKS = ("neighborhood", "butterfly2d")
MASK_TOKEN = 256  # pixel_embed index of a masked pixel (values are 0..255)


class ConfigError(ValueError):
    """A flag or checkpoint that cannot make a model: reported in one line, never as a traceback."""


# ----------------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """What a model is. `side` is the image side the model reads (after pooling); `tile` is (rows, cols) of
    pixels per token block in tile order; `pos` names the positional components joined by "+"."""

    side: int
    width: int
    layers: int
    heads: int
    mlp_ratio: int
    pos: str = "learned+sincos"
    order: str = "row"
    tile: tuple[int, int] = (1, 1)
    head: str = "mean"
    dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def pos_kinds(self) -> tuple[str, ...]:
        return tuple(self.pos.split("+"))

    def problems(self) -> list[str]:
        """What makes this config unbuildable (for one read from a file): sizes that are not positive ints,
        a width that the heads do not divide, a tile that is not two positive ints, a dropout outside [0, 1)."""
        out = [f"{key} must be a positive int, got {getattr(self, key)!r}" for key in
               ("side", "width", "layers", "heads", "mlp_ratio")
               if isinstance(getattr(self, key), bool) or not isinstance(getattr(self, key), int)
               or getattr(self, key) < 1]
        if not out and self.width % self.heads:
            out.append(f"width {self.width} must be a multiple of heads {self.heads}")
        if not (isinstance(self.tile, tuple) and len(self.tile) == 2
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in self.tile)):
            out.append(f"tile must be two positive ints, got {self.tile!r}")
        if not all(isinstance(getattr(self, key), str) for key in ("pos", "order", "head")):
            out.append("pos, order and head must be strings")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            out.append(f"dropout must be a float in [0, 1), got {self.dropout!r}")
        return out

    def shape_mismatch(self, other: "ModelConfig") -> list[str]:
        """The differences that stop `other`'s weights from loading into this model (side, order, tile, head
        and dropout may differ)."""
        return [f"{key} {getattr(other, key)} vs {getattr(self, key)}"
                for key in ("width", "layers", "heads", "mlp_ratio", "pos") if getattr(self, key) != getattr(other, key)]


@dataclass(frozen=True)
class MaskConfig:
    """The attention mask of every layer: `layers` holds one spec per layer ("neighborhood", "butterfly2d+local",
    ...); `window` is (rows, cols) of tiles; `global_blocks` global tiles join the 2-D masks."""

    layers: tuple[str, ...]
    block_size: int
    window: tuple[int, int] = (1, 1)
    global_blocks: int = 1
    seed: int = 0


def parse_pos(text: str) -> str:
    """The canonical positional spec ("sincos+learned" -> "learned+sincos"); ConfigError when unknown."""
    parts = [p.strip() for p in text.split("+")]
    unknown = [p for p in parts if p not in POS_KINDS]
    if unknown or not parts:
        raise ConfigError(f"--pos takes components of {'/'.join(POS_KINDS)} joined by '+', got {text!r}")
    return "+".join(k for k in POS_KINDS if k in parts)


def parse_pair(text: str, name: str) -> tuple[int, int]:
    """'16x8' -> (16, 8), '8' -> (8, 8); ConfigError otherwise."""
    try:
        values = [int(v) for v in str(text).lower().split("x")]
    except ValueError:
        values = []
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or min(values) < 0:
        raise ConfigError(f"{name} takes N or RxC with non-negative integers, got {text!r}")
    return values[0], values[1]


def default_tile(block_size: int) -> tuple[int, int]:
    """The most square tile of `block_size` pixels, taller than wide: 128 -> 16x8, 64 -> 8x8, 32 -> 8x4."""
    rows = next(r for r in range(math.isqrt(block_size), 0, -1) if block_size % r == 0)
    return block_size // rows, rows


def mask_specs(text: str, layers: int) -> tuple[str, ...]:
    """One spec for every layer: "neighborhood" -> all layers; "a,b" needs exactly `layers` entries."""
    specs = tuple(s.strip() for s in text.split(","))
    if len(specs) == 1:
        specs *= layers
    if len(specs) != layers:
        raise ConfigError(f"--mask lists {len(specs)} masks for {layers} layers; give one, or one per layer")
    for spec in specs:
        names = spec.split("+")
        unknown = [n for n in names if n not in MASK_NAMES]
        if unknown or not spec:
            raise ConfigError(f"--mask entries are names of {', '.join(MASK_NAMES)} joined by '+', got {spec!r}")
        if "dense" in names and len(names) > 1:
            raise ConfigError(f"--mask: 'dense' already holds every block; drop the rest of {spec!r}")
    return specs


# ----------------------------------------------------------------------------------------------------
# Token order and positions
# ----------------------------------------------------------------------------------------------------


def token_permutation(side: int, order: str, tile: tuple[int, int]) -> torch.Tensor:
    """int64 `(side*side,)`: position i of the model's sequence holds row-major pixel `perm[i]`.

    Tile order: tiles row-major over the tile grid, pixels row-major inside each tile (as `masks.to_tiles`).
    """
    n = side * side
    if order == "row":
        return torch.arange(n)
    rows, cols = tile
    if side % rows or side % cols:
        raise ConfigError(f"--tile {rows}x{cols} must divide the image side {side}")
    return masks.tile_order(side, side, (rows, cols))


def image_units(side: int, permutation: torch.Tensor) -> torch.Tensor:
    """float64 `(N, 2)`: each token's pixel centre (row, column) in 1/SINCOS_UNITS of the image side."""
    rows, cols = permutation // side, permutation % side
    return (torch.stack([rows, cols], dim=1).double() + 0.5) * (SINCOS_UNITS / side)


def _axis_angles(positions: torch.Tensor, count: int, base: float) -> torch.Tensor:
    """`(N, count)`: positions times `count` frequencies from 1 down to `base ** (-(count-1)/count)`."""
    freqs = base ** (-torch.arange(count, dtype=torch.float64) / count)
    return positions[:, None] * freqs


def sincos_2d(resolution: int, width: int, permutation: torch.Tensor | None = None) -> torch.Tensor:
    """Fixed 2-D sin/cos positional encoding, float32 `(resolution**2, width)`, in the order of `permutation`
    (default row-major).

    Channels `[0, width/2)` depend only on the pixel's row, `[width/2, width)` only on its column. In each
    half the first `width/4` channels are `sin(p * w_k)` and the next `width/4` are `cos(p * w_k)`, with
    `w_k = 10000 ** (-k / (width/4))` and `p` the pixel centre in 1/32 of the image side (`i + 0.5` at 32 px),
    so a pixel's encoding depends on where it lies in the image, not on the resolution.
    """
    if width % 4:
        raise ConfigError(f"width must be a multiple of 4 for the 2-D sin/cos encoding, got {width}")
    permutation = torch.arange(resolution * resolution) if permutation is None else permutation
    units = image_units(resolution, permutation)
    halves = [_axis_angles(units[:, axis], width // 4, 10000.0) for axis in (0, 1)]
    return torch.cat([torch.cat([a.sin(), a.cos()], dim=1) for a in halves], dim=1).float()


def rope_2d_angles(resolution: int, head_dim: int, permutation: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `(N, head_dim/2)` rotation angles of 2-D RoPE, in the order of `permutation`.

    Dim j of a head is paired with dim j + head_dim/2; pairs j < head_dim/4 rotate by the row's position times
    frequency k = j, the others by the column's (k = j - head_dim/4); frequencies `ROPE_BASE ** (-k/(head_dim/4))`
    per 1/32 of the image side.
    """
    if head_dim % 4:
        raise ConfigError(f"rope2d needs a head dim (width / heads) that is a multiple of 4, got {head_dim}")
    permutation = torch.arange(resolution * resolution) if permutation is None else permutation
    units = image_units(resolution, permutation)
    return torch.cat([_axis_angles(units[:, axis], head_dim // 4, ROPE_BASE) for axis in (0, 1)], dim=1).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (j, j + D/2) of `x` `(B, H, N, D)` by the angles whose cos and sin are `(N, D/2)`."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def resize_pos_grid(grid: torch.Tensor, resolution: int) -> torch.Tensor:
    """Carry a learned positional grid `(h, w, C)` to `(resolution, resolution, C)`.

    Upwards each entry is duplicated into a square (nearest neighbour: the FlashAttention paper's 64 -> 256 px
    transfer); downwards squares are averaged.
    """
    if grid.shape[0] == resolution:
        return grid.clone()
    channels_first = rearrange(grid, "h w c -> 1 c h w")
    mode = "nearest" if resolution > grid.shape[0] else "area"
    resized = F.interpolate(channels_first, size=(resolution, resolution), mode=mode)
    return rearrange(resized, "1 c h w -> h w c").contiguous()


# ----------------------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------------------


def _pattern(name: str, seq_len: int, config: MaskConfig, side: int, tile, device) -> sparse_flash.BlockMask:
    block = config.block_size
    if name == "dense":
        return masks.dense(seq_len, block, device=device)
    if name == "local":
        return masks.local(seq_len, block, window=1, device=device)
    if name == "bigbird":
        return masks.bigbird(seq_len, block, seed=config.seed, device=device)
    default = (
        masks.butterfly(seq_len, block, device=device)
        | masks.local(seq_len, block, window=1, device=device)
        | masks.global_(seq_len, block, num_global_blocks=1, device=device)
    )
    if name == "butterfly":
        return default
    if name == "random":
        diagonal = masks.local(seq_len, block, window=0, device=device)
        return masks.random(seq_len, block, density=default.density, seed=config.seed, device=device) | diagonal
    if name in TILED_MASKS:
        mask = (masks.neighborhood_2d(side, side, tile, config.window, device=device) if name == "neighborhood"
                else masks.butterfly_2d(side, side, tile, device=device))
        if config.global_blocks:
            mask = mask | masks.global_(seq_len, block, num_global_blocks=config.global_blocks, device=device)
        return mask
    raise ConfigError(f"mask must be one of {MASK_NAMES}, got {name!r}")


def build_mask(spec: str, side: int, config: MaskConfig, order: str = "row", tile=(1, 1),
               device=None) -> sparse_flash.BlockMask:
    """The block mask of one layer for a `side` x `side` image: the union of the names in `spec`."""
    names = spec.split("+")
    if order != "tile" and any(n in TILED_MASKS for n in names):
        raise ConfigError(f"--mask {spec} is a 2-D mask over image tiles: it needs --order tile")
    if order == "tile" and tile[0] * tile[1] != config.block_size:
        raise ConfigError(f"--tile {tile[0]}x{tile[1]} holds {tile[0] * tile[1]} pixels, but the block size is "
                          f"{config.block_size}: in tile order a block is a tile")
    seq_len = side * side
    mask = _pattern(names[0], seq_len, config, side, tile, device)
    for name in names[1:]:
        mask = mask | _pattern(name, seq_len, config, side, tile, device)
    return mask


def layer_masks(config: MaskConfig, model: ModelConfig, device=None) -> list[sparse_flash.BlockMask | None]:
    """One mask per layer; None for "dense" (the layer calls `sparse_flash.flash_attention`). Layers with the
    same spec share one mask object."""
    built: dict[str, sparse_flash.BlockMask | None] = {}
    for spec in config.layers:
        if spec not in built:
            built[spec] = None if spec == "dense" else build_mask(spec, model.side, config, model.order,
                                                                  model.tile, device)
    return [built[spec] for spec in config.layers]


def mask_density(mask: sparse_flash.BlockMask | None) -> float:
    return 1.0 if mask is None else mask.density


def describe_masks(layer_list: list[sparse_flash.BlockMask | None], config: MaskConfig) -> dict:
    """What the metrics and results record about the masks: names, per-layer density and their mean."""
    densities = [mask_density(m) for m in layer_list]
    return {
        "name": config.layers[0] if len(set(config.layers)) == 1 else ",".join(config.layers),
        "layers": [m.name if m is not None else "dense (flash_attention)" for m in layer_list],
        "block_size": config.block_size, "densities": densities, "density": sum(densities) / len(densities),
        "window": list(config.window), "global_blocks": config.global_blocks,
    }


# ----------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head self-attention through `block_sparse_attention` (or `flash_attention` when `mask` is None),
    with optional rotary positions."""

    def __init__(self, width: int, heads: int, mask: sparse_flash.BlockMask | None, backend: str, dropout: float):
        super().__init__()
        self.heads, self.mask, self.backend = heads, mask, backend
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.mask is None:
            out = sparse_flash.flash_attention(q, k, v, backend=self.backend)
        else:
            out = sparse_flash.block_sparse_attention(q, k, v, self.mask, backend=self.backend)
        return self.dropout(self.proj(rearrange(out, "b h n d -> b n (h d)")))


class Block(nn.Module):
    """Pre-LN transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: ModelConfig, mask: sparse_flash.BlockMask | None, backend: str):
        super().__init__()
        width, hidden = config.width, config.mlp_ratio * config.width
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, config.heads, mask, backend, config.dropout)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Dropout(config.dropout),
                                 nn.Linear(hidden, width), nn.Dropout(config.dropout))

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class PixelTransformer(nn.Module):
    """Pathfinder classifier: uint8 pixels `(B, side**2)` in row-major order in, logits `(B, 2)` out.

    Called with masked token positions it serves masked-pixel self-pretraining with the same weights (the
    pixel head is extra).
    """

    def __init__(self, config: ModelConfig, layer_mask_list: list[sparse_flash.BlockMask | None],
                 backend: str = "auto"):
        super().__init__()
        if len(layer_mask_list) != config.layers:
            raise ConfigError(f"{len(layer_mask_list)} masks for {config.layers} layers")
        self.config = c = config
        perm = token_permutation(c.side, c.order, c.tile)
        self.register_buffer("permutation", perm, persistent=False)
        self.pixel_embed = nn.Embedding(257, c.width)  # 256 values and the mask token
        if "learned" in c.pos_kinds:
            self.pos_embed = nn.Parameter(0.02 * torch.randn(c.side, c.side, c.width))  # (H, W, C), image space
        if "sincos" in c.pos_kinds:
            self.register_buffer("pos_sincos", sincos_2d(c.side, c.width, perm), persistent=False)
        if "rope2d" in c.pos_kinds:
            angles = rope_2d_angles(c.side, c.head_dim, perm)
            self.register_buffer("rope_cos", angles.cos(), persistent=False)
            self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.embed_dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c, m, backend) for m in layer_mask_list)
        self.norm = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, 2)
        self.pixel_head = nn.Linear(c.width, 256)

    def tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """Row-major pixels `(B, N)` in the model's token order."""
        return pixels if self.config.order == "row" else pixels[:, self.permutation]

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token values `(B, N)` (0..255, or MASK_TOKEN) in token order -> final features `(B, N, C)`."""
        x = self.pixel_embed(tokens.long())
        if "learned" in self.config.pos_kinds:
            grid = self.pos_embed.flatten(0, 1)
            x = x + (grid if self.config.order == "row" else grid[self.permutation])
        if "sincos" in self.config.pos_kinds:
            x = x + self.pos_sincos
        rope = (self.rope_cos, self.rope_sin) if "rope2d" in self.config.pos_kinds else None
        x = self.embed_dropout(x)
        for block in self.blocks:
            x = block(x, rope)
        return self.norm(x)

    def forward(self, pixels: torch.Tensor, masked: torch.Tensor | None = None) -> torch.Tensor:
        """Class logits `(B, 2)`; with `masked` (int64 `(B, K)` token positions), masked-pixel pretraining:
        those tokens become the mask token and the result is their 256-way value logits `(B, K, 256)`."""
        tokens = self.tokens(pixels)
        if masked is None:
            features = self.encode(tokens)
            pooled = features.amax(dim=1) if self.config.head == "max" else features.mean(dim=1)
            return self.head(pooled)
        tokens = tokens.long().scatter(1, masked, MASK_TOKEN)
        features = self.encode(tokens)
        picked = features.gather(1, masked[..., None].expand(-1, -1, features.shape[-1]))
        return self.pixel_head(picked)


def classifier_parameters(model: PixelTransformer) -> int:
    """Parameters the classifier uses (the pretraining pixel head excluded)."""
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith("pixel_head"))


def transfer_state(state: dict, model: PixelTransformer) -> dict:
    """A state dict from another resolution made loadable: the learned grid resized to this model's side."""
    state = dict(state)
    if "pos_embed" in state:
        state["pos_embed"] = resize_pos_grid(state["pos_embed"], model.config.side)
    return state


def attention_flops(config: ModelConfig, layer_mask_list, training: bool = True) -> float:
    """FLOPs of attention per sample on the nonzero blocks: 4 N^2 d density per head forward, x3.5 to train."""
    n = config.side**2
    forward = sum(4 * n * n * config.width * mask_density(m) for m in layer_mask_list)
    return forward * (3.5 if training else 1.0)


def step_flops(config: ModelConfig, layer_mask_list) -> float:
    """Training FLOPs per sample: attention plus 6 (4 + 2e) N d^2 per layer for the linear layers."""
    n, d, e = config.side**2, config.width, config.mlp_ratio
    return attention_flops(config, layer_mask_list) + config.layers * 6 * (4 + 2 * e) * n * d * d
