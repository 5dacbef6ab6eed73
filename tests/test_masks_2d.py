"""Image and video masks: tile-major token order and the 2-D/3-D patterns, checked against pixel-level definitions.

Every layout is compared with an element mask built from pixel coordinates in row-major order (pixel p attends
pixel q iff their tiles are within the window), and attention on tile-ordered tokens with the block mask with
dense attention on row-major tokens with that element mask.
"""

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import sparse_flash
from sparse_flash import masks
from sparse_flash.mask import Tiling


# ---------------------------------------------------------------------------------------------- definitions
def slow_order(frames, height, width, tile):
    """Tile-major order by plain loops: position i holds row-major token slow_order[i]."""
    tt, th, tw = tile
    return [
        (t * height + y) * width + x
        for t0 in range(0, frames, tt) for y0 in range(0, height, th) for x0 in range(0, width, tw)
        for t in range(t0, t0 + tt) for y in range(y0, y0 + th) for x in range(x0, x0 + tw)
    ]


def pixel_tiles(frames, height, width, tile):
    """`(3, N)`: the (t, y, x) tile coordinates of every row-major pixel."""
    n = torch.arange(frames * height * width)
    t, y, x = n // (height * width), n // width % height, n % width
    return torch.stack([t // tile[0], y // tile[1], x // tile[2]])


def element_neighborhood(frames, height, width, tile, window):
    """bool `(N, N)`, row-major pixels: p attends q iff their tiles differ by at most `window` (t, h, w) per axis."""
    c = pixel_tiles(frames, height, width, tile)
    d = (c[:, :, None] - c[:, None, :]).abs()
    return (d[0] <= window[0]) & (d[1] <= window[1]) & (d[2] <= window[2])


def element_butterfly(height, width, tile, n_factors=None):
    """bool `(N, N)`, row-major pixels: same tile row and butterfly-linked columns, or the other way round."""
    _, r, c = pixel_tiles(1, height, width, (1, *tile))

    def linked(a, n_tiles):
        factors = math.ceil(math.log2(n_tiles)) if n_factors is None else n_factors
        xor = a[:, None] ^ a[None, :]
        return (xor == 0) | torch.isin(xor, torch.tensor([1 << k for k in range(factors)], dtype=xor.dtype))

    same_r, same_c = r[:, None] == r[None, :], c[:, None] == c[None, :]
    return (same_r & linked(c, width // tile[1])) | (same_c & linked(r, height // tile[0]))


def in_tile_order(element_mask, frames, height, width, tile):
    order = torch.tensor(slow_order(frames, height, width, tile))
    return element_mask[order][:, order]


def as_triple(window):
    return (0, window, window) if isinstance(window, int) else (0, *window)


# ---------------------------------------------------------------------------------------------- token order
image_sizes = st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 5), st.integers(1, 5))  # tile, tiles
video_sizes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3),
                        st.integers(1, 3))


@given(sizes=image_sizes, heads=st.sampled_from([None, 1, 3]), square=st.booleans())
@example(sizes=(1, 1, 1, 1), heads=None, square=False)
def test_to_tiles_is_the_slow_permutation_and_from_tiles_inverts_it(sizes, heads, square):
    th, tw, rows, cols = sizes
    tile = th if square else (th, tw)
    th, tw = (th, th) if square else (th, tw)
    height, width = th * rows, tw * cols
    shape = (2, height * width, 3) if heads is None else (2, heads, height * width, 5)
    x = torch.randn(shape)
    order = slow_order(1, height, width, (1, th, tw))
    y = masks.to_tiles(x, height, width, tile)
    assert torch.equal(y, x[..., order, :])
    assert torch.equal(masks.from_tiles(y, height, width, tile), x)
    assert torch.equal(masks.to_tiles(masks.from_tiles(x, height, width, tile), height, width, tile), x)
    index = masks.tile_order(height, width, tile)
    assert index.dtype == torch.int64 and index.tolist() == order
    assert torch.equal(masks.tile_order(height, width, tile, inverse=True), torch.argsort(index))


@given(sizes=video_sizes)
def test_video_token_order(sizes):
    tt, th, tw, tf, rows, cols = sizes
    frames, height, width = tt * tf, th * rows, tw * cols
    x = torch.randn(1, 2, frames * height * width, 4)
    order = slow_order(frames, height, width, (tt, th, tw))
    y = masks.to_tiles(x, height, width, (tt, th, tw), frames=frames)
    assert torch.equal(y, x[..., order, :])
    assert torch.equal(masks.from_tiles(y, height, width, (tt, th, tw), frames=frames), x)
    assert masks.tile_order(height, width, (tt, th, tw), frames=frames).tolist() == order
    if tt == th == tw:  # an int tile is a cube
        assert torch.equal(masks.to_tiles(x, height, width, tt, frames=frames), y)


def test_tile_order_example_and_positional_table():
    assert masks.tile_order(4, 4, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    table = torch.randn(6 * 8, 16)  # a positional table, one row per row-major pixel
    x = table.expand(3, -1, -1)
    assert torch.equal(masks.to_tiles(x, 6, 8, (3, 2))[0], table[masks.tile_order(6, 8, (3, 2))])


def test_to_tiles_is_differentiable_and_takes_views():
    x = torch.randn(2, 3, 4 * 6, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: masks.to_tiles(t, 4, 6, (2, 3)), (x,))
    assert torch.autograd.gradcheck(lambda t: masks.from_tiles(t, 4, 6, (2, 3)), (x,))
    view = torch.randn(2, 5, 24).transpose(1, 2)  # (B, N, C), not contiguous
    assert torch.equal(masks.to_tiles(view, 4, 6, 2), masks.to_tiles(view.contiguous(), 4, 6, 2))


def test_to_tiles_under_torch_compile():
    def roundtrip(x):
        return masks.from_tiles(masks.to_tiles(x, 8, 12, (4, 3)) * 2, 8, 12, (4, 3))

    x = torch.randn(2, 96, 4)
    compiled = torch.compile(roundtrip, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), 2 * x)


# ---------------------------------------------------------------------------------------------- layouts
windows_2d = st.one_of(st.integers(0, 3), st.tuples(st.integers(0, 3), st.integers(0, 3)))


@given(sizes=image_sizes, window=windows_2d)
@example(sizes=(1, 1, 1, 1), window=0)
@example(sizes=(2, 3, 5, 4), window=(0, 2))
def test_neighborhood_2d_matches_pixel_definition(sizes, window):
    th, tw, rows, cols = sizes
    height, width = th * rows, tw * cols
    m = masks.neighborhood_2d(height, width, (th, tw), window)
    assert m.block_size == (th * tw, th * tw) and m.seq_len_q == m.seq_len_k == height * width
    assert m.tiling == Tiling((1, height, width), (1, th, tw))
    expected = element_neighborhood(1, height, width, (1, th, tw), as_triple(window))
    assert torch.equal(m.to_dense()[0, 0], in_tile_order(expected, 1, height, width, (1, th, tw)))


@given(sizes=video_sizes, window=st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2)))
def test_neighborhood_3d_matches_pixel_definition(sizes, window):
    tt, th, tw, tf, rows, cols = sizes
    frames, height, width = tt * tf, th * rows, tw * cols
    m = masks.neighborhood_3d(frames, height, width, (tt, th, tw), window)
    assert m.tiling == Tiling((frames, height, width), (tt, th, tw))
    expected = element_neighborhood(frames, height, width, (tt, th, tw), window)
    assert torch.equal(m.to_dense()[0, 0], in_tile_order(expected, frames, height, width, (tt, th, tw)))


@given(sizes=image_sizes, n_factors=st.sampled_from([None, 0, 1, 2]))
@example(sizes=(2, 1, 8, 5), n_factors=None)
def test_butterfly_2d_matches_pixel_definition(sizes, n_factors):
    th, tw, rows, cols = sizes
    height, width = th * rows, tw * cols
    m = masks.butterfly_2d(height, width, (th, tw), n_factors=n_factors)
    expected = element_butterfly(height, width, (th, tw), n_factors)
    assert torch.equal(m.to_dense()[0, 0], in_tile_order(expected, 1, height, width, (1, th, tw)))


CASES = {  # a fixed matrix: name -> (constructor, element mask per head, (frames, height, width, tile))
    "2d-square-w1": (lambda: masks.neighborhood_2d(8, 8, 2, 1), [(0, 1, 1)], (1, 8, 8, (1, 2, 2))),
    "2d-oblong-w(1,0)": (lambda: masks.neighborhood_2d(9, 10, (3, 5), (1, 0)), [(0, 1, 0)], (1, 9, 10, (1, 3, 5))),
    "2d-per-head": (lambda: masks.neighborhood_2d(6, 9, (2, 3), [0, 1, (2, 0)]), [(0, 0, 0), (0, 1, 1), (0, 2, 0)],
                    (1, 6, 9, (1, 2, 3))),
    "3d-w(1,0,1)": (lambda: masks.neighborhood_3d(4, 6, 4, (2, 3, 2), (1, 0, 1)), [(1, 0, 1)], (4, 6, 4, (2, 3, 2))),
    "3d-per-head": (lambda: masks.neighborhood_3d(2, 4, 4, (1, 2, 2), [0, (1, 1, 0)], num_heads=2),
                    [(0, 0, 0), (1, 1, 0)], (2, 4, 4, (1, 2, 2))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fixed_matrix_per_head(case):
    build, windows, (frames, height, width, tile) = CASES[case]
    m = build()
    assert m.shape[:2] == (1, len(windows))
    dense = m.to_dense()
    for head, window in enumerate(windows):
        expected = element_neighborhood(frames, height, width, tile, window)
        assert torch.equal(dense[0, head], in_tile_order(expected, frames, height, width, tile)), f"head {head}"


def test_shared_window_with_num_heads_repeats_it():
    m = masks.neighborhood_2d(8, 8, 2, (1, 2), num_heads=3)
    one = masks.neighborhood_2d(8, 8, 2, (1, 2))
    assert m.shape == (1, 3, 16, 16) and all(torch.equal(m.layout[0, h], one.layout[0, 0]) for h in range(3))


def test_pixel_transformer_geometry_and_density():
    m = masks.neighborhood_2d(256, 256, (16, 8), window=1)
    assert m.block_size == (128, 128) and m.num_blocks == (512, 512) and m.seq_len_q == 65536
    # 16 x 32 tiles: interior tiles see 9, edge tiles 6, corner tiles 4
    assert m.nnz == (14 * 30) * 9 + 2 * (14 + 30) * 6 + 4 * 4
    assert m.density < 0.02


# ---------------------------------------------------------------------------------------------- composition
def test_compose_with_global_and_one_dimensional_patterns():
    height, width, tile = 12, 12, (2, 3)  # block size 6: not a power of two
    n, block = height * width, 6
    near = masks.neighborhood_2d(height, width, tile, 1)
    with_global = near | masks.global_(n, block, num_global_blocks=1)
    assert with_global.tiling == near.tiling
    assert with_global.layout[0, 0, 0].all() and with_global.layout[0, 0, :, 0].all()
    assert torch.equal(with_global.layout[0, 0, 1:, 1:], near.layout[0, 0, 1:, 1:])
    for other in (masks.local(n, block, window=1), masks.butterfly(n, block), masks.random(n, block, density=0.3),
                  masks.bigbird(n, block), masks.causal(n, block), masks.dense(n, block)):
        for combined in (near | other, near & other, other | near):
            assert combined.tiling == near.tiling and combined.block_size == (block, block)
    assert torch.equal((near & masks.dense(n, block)).layout, near.layout)


def test_windows_intersect_and_unite_per_axis():
    a = masks.neighborhood_2d(16, 24, (2, 3), 2)
    b = masks.neighborhood_2d(16, 24, (2, 3), (1, 3))
    assert a & b == masks.neighborhood_2d(16, 24, (2, 3), (1, 2))
    both = masks.neighborhood_2d(16, 24, (2, 3), [2, (1, 3)])
    assert torch.equal((a | b).layout[0, 0], both.layout[0].any(0))
    assert (both | masks.butterfly_2d(16, 24, (2, 3))).shape == (1, 2, 64, 64)


def test_different_tilings_of_one_geometry_drop_the_tiling():
    wide, tall = masks.neighborhood_2d(8, 8, (2, 4), 1), masks.neighborhood_2d(8, 8, (4, 2), 1)
    assert (wide | tall).tiling is None and (wide | wide).tiling == wide.tiling


# ---------------------------------------------------------------------------------------------- attention
def dense_attention(q, k, v, allowed):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


ATTENTION_CASES = {
    "neighborhood_2d": (lambda: masks.neighborhood_2d(6, 8, (2, 4), 1),
                        lambda: element_neighborhood(1, 6, 8, (1, 2, 4), (0, 1, 1)), (None, 6, 8, (2, 4))),
    "per-head|global": (lambda: masks.neighborhood_2d(6, 8, (2, 4), [0, (1, 0)]) | masks.global_(48, 8),
                        None, (None, 6, 8, (2, 4))),
    "butterfly_2d": (lambda: masks.butterfly_2d(8, 8, 2), lambda: element_butterfly(8, 8, (2, 2)), (None, 8, 8, 2)),
    "neighborhood_3d": (lambda: masks.neighborhood_3d(4, 4, 4, 2, (0, 1, 1)),
                        lambda: element_neighborhood(4, 4, 4, (2, 2, 2), (0, 1, 1)), (4, 4, 4, 2)),
}


def per_head_global(heads=2):
    """The element mask of "per-head|global": windows 0 and (1, 0) on 2 x 4 tiles, and tile 0 global."""
    order = torch.tensor(slow_order(1, 6, 8, (1, 2, 4)))
    in_tile_0 = torch.zeros(48, dtype=torch.bool)
    in_tile_0[order[:8]] = True
    glob = in_tile_0[:, None] | in_tile_0[None, :]
    return torch.stack([element_neighborhood(1, 6, 8, (1, 2, 4), w) | glob for w in ((0, 0, 0), (0, 1, 0))][:heads])


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_attention_on_tiles_equals_dense_attention_on_pixels(case, backend):
    build, element, (frames, height, width, tile) = ATTENTION_CASES[case]
    mask = build()
    allowed = per_head_global() if element is None else element()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, allowed.shape[-1], 8, dtype=torch.float64, generator=gen, requires_grad=True)
               for _ in range(3))
    tiles = dict(frames=frames)
    out = sparse_flash.block_sparse_attention(*(masks.to_tiles(t, height, width, tile, **tiles) for t in (q, k, v)),
                                              mask, backend=backend)
    out = masks.from_tiles(out, height, width, tile, **tiles)
    expected = dense_attention(q, k, v, allowed)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------- bad input
x16 = torch.zeros(1, 16, 3)
BAD = {
    "x not a tensor": (lambda: masks.to_tiles([[0.0]], 4, 4, 2), TypeError, "x must be a torch.Tensor"),
    "x 2-D": (lambda: masks.to_tiles(torch.zeros(16, 3), 4, 4, 2), ValueError, r"x must have shape \(B, N, C\)"),
    "x token count": (lambda: masks.from_tiles(torch.zeros(1, 15, 3), 4, 4, 2), ValueError,
                      r"x has 15 tokens .* height \* width = 4 \* 4 = 16"),
    "video token count": (lambda: masks.to_tiles(x16, 4, 4, 2, frames=2), ValueError,
                          r"frames \* height \* width = 2 \* 4 \* 4 = 32"),
    "tile does not divide": (lambda: masks.to_tiles(x16, 4, 4, (2, 3)), ValueError,
                             r"tile \(2, 3\) must divide \(height, width\) = \(4, 4\)"),
    "tile triple for image": (lambda: masks.to_tiles(x16, 4, 4, (2, 2, 2)), TypeError,
                              r"tile must be an int or a \(tile_h, tile_w\) tuple"),
    "tile pair for video": (lambda: masks.tile_order(4, 4, (2, 2), frames=2), TypeError,
                            r"tile must be an int or a \(tile_t, tile_h, tile_w\) tuple"),
    "tile float": (lambda: masks.to_tiles(x16, 4, 4, 2.0), TypeError, "tile must be an int"),
    "tile zero": (lambda: masks.to_tiles(x16, 4, 4, (2, 0)), ValueError, r"tile\[1\] \(w\) must be at least 1"),
    "height float": (lambda: masks.to_tiles(x16, 4.0, 4, 2), TypeError, "height must be an int"),
    "frames zero": (lambda: masks.to_tiles(x16, 4, 4, 2, frames=0), ValueError, "frames must be at least 1"),
    "frames not divided": (lambda: masks.neighborhood_3d(3, 8, 8, 2), ValueError,
                           r"must divide \(frames, height, width\) = \(3, 8, 8\)"),
    "window negative": (lambda: masks.neighborhood_2d(8, 8, 2, -1), ValueError, "window must be at least 0"),
    "window bool": (lambda: masks.neighborhood_2d(8, 8, 2, True), TypeError, "window must be an int or a"),
    "window triple for image": (lambda: masks.neighborhood_2d(8, 8, 2, (1, 2, 3)), TypeError,
                                r"window must be an int or a \(window_h, window_w\) tuple"),
    "window per head bad": (lambda: masks.neighborhood_2d(8, 8, 2, [1, -1]), ValueError,
                            "window\\[1\\] must be at least 0"),
    "window list empty": (lambda: masks.neighborhood_2d(8, 8, 2, []), ValueError, "per-head list"),
    "window list vs heads": (lambda: masks.neighborhood_2d(8, 8, 2, [1, 2], num_heads=3), ValueError,
                             "2 per-head windows but num_heads=3"),
    "num_heads zero": (lambda: masks.neighborhood_2d(8, 8, 2, num_heads=0), ValueError, "num_heads must be at least 1"),
    "n_factors negative": (lambda: masks.butterfly_2d(8, 8, 2, n_factors=-1), ValueError, "n_factors"),
    "other geometry": (lambda: masks.neighborhood_2d(8, 8, 2) | masks.global_(64, 8), ValueError, "same"),
    # grids past the int32 lists: refused before any run is built (these allocated gigabytes, then failed)
    "grid too big 2d": (lambda: masks.neighborhood_2d(65536, 65536, 1), ValueError,
                        r"4294967296 tiles \(1 x 65536 x 65536 of 1 x 1 x 1 tokens\) and 1 head\(s\)"),
    "grid too big 3d": (lambda: masks.neighborhood_3d(1024, 1024, 1024, 1), ValueError, "int32 index lists"),
    "grid too big butterfly": (lambda: masks.butterfly_2d(65536, 65536, 1), ValueError, "int32 index lists"),
    "tokens too many": (lambda: masks.neighborhood_2d(2**62, 2**62, 2**62), ValueError,
                        r"the grid \(1, 4611686018427387904, 4611686018427387904\) holds"),
    "heads too many": (lambda: masks.neighborhood_2d(64, 64, 8, 1, num_heads=2**40), ValueError,
                       "1099511627776 head"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_names_the_argument(case):
    call, error, message = BAD[case]
    with pytest.raises(error, match=message):
        call()


# ---------------------------------------------------------------------------------------------- plots
def test_plot_draws_tiled_masks_on_the_pixel_grid(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    m = masks.neighborhood_2d(8, 8, 2, [1, 0])
    path = tmp_path / "neighborhood.png"
    fig = m.plot(path)
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
    assert len(fig.axes) == 2 * 4  # per head: the layout, then the corner, edge and centre tiles
    corner = fig.axes[1].images[0].get_array()  # head 0, query tile (0, 0): itself (3) and its neighbours (1)
    assert corner.tolist() == [[3, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert fig.axes[7].images[0].get_array().sum() == 3  # head 1, centre tile: only itself
    video = tmp_path / "video.png"
    masks.neighborhood_3d(4, 8, 8, (2, 4, 4), 1).plot(video)
    assert video.read_bytes()[:4] == b"\x89PNG"
    fig, ax = plt.subplots()
    assert m.plot(ax=ax) is fig and len(ax.images) == 1  # a gallery panel: the block layout only
    plt.close("all")
