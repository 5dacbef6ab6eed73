"""Pathfinder images: is there a path between the two circles?

A grayscale image shows several curved paths, each a chain of short dashes, and two small circles.
Label 1: both circles sit on the two ends of the same path. Label 0: they sit on ends of two different
paths. Flattened row-major, a 32x32 image is a sequence of 1,024 pixel tokens, 128x128 (Path-X) is 16,384
and 256x256 (Path-256) is 65,536.

How an image is made (after Linsley et al. 2018, with the Long Range Arena parameters in ``PRESETS``):

1. Draw the label and a margin m. An occupancy map marks a border band of ``padding`` pixels.
2. A dash is a line of length L and width ``thickness``, drawn at ``antialias`` times the resolution and
   averaged down. Its footprint is the line dilated by a disk of radius m. A dash may not draw on an
   occupied pixel, and every accepted dash eventually adds its footprint to the occupancy map, so paths
   keep a gap of about m.
3. Two target paths are seeded ``seed_distance`` apart near the centre and grow in alternation, one dash
   per turn. With c the point m past the previous dash's head, the next dash runs from c + m*u to
   c + (L+m)*u toward a pixel sampled on the circle of radius L + m around c, weighted by
   cos(turn * continuity)^2 (zero beyond 90 degrees / continuity) times whether that pixel is free.
   A dash is accepted if it avoids the occupied pixels (3 tries); only then does the previous dash's
   footprint join the occupancy map. A path also treats the other target path's newest dash as occupied.
   A pair that cannot grow is thrown away and regrown (4 retries, then a new image).
4. ``distractor_budget // (dashes // 3)`` distractor paths of ``dashes // 3`` dashes are seeded uniformly
   in free space and grown the same way; one that fails 5 times is skipped.
5. Circles of ``marker_radius`` mark the start of one target path and the far end of the same path
   (label 1) or of the other one (label 0). The image is the maximum of dashes (times the contrast) and
   circles, divided by its maximum and scaled to uint8.

Image i of a dataset depends only on (seed, i, resolution, difficulty), so any number of worker
processes gives the same arrays.

Command line::

    python demos/pathfinder.py --resolution 32 --difficulty easy -n 64 --seed 0 --show grid.png
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

GENERATOR_VERSION = 1
DIFFICULTIES = {"easy": 6, "intermediate": 9, "hard": 14}

DASH_TRIES = 3  # samples of the next dash before a path counts as stuck
SEED_TRIES = 3  # samples of a seed dash before a seeding fails
TARGET_RETRIES = 4  # regrowths of a failed target pair before starting a new image
DISTRACTOR_TRIES = 5  # attempts at one distractor path before it is skipped
MAX_IMAGE_ATTEMPTS = 100_000  # new images tried before giving up with an error
FOOTPRINT_COVERAGE = 0.5  # a pixel is in a footprint when at least this fraction of it is covered


@dataclass(frozen=True)
class PathfinderParams:
    """Generator parameters for one image resolution (lengths in pixels).

    The brightness of a dash is ``path_contrast * dash_contrast`` times its antialiased coverage;
    circles have brightness 1.
    """

    resolution: int
    dash_length: int
    margins: tuple[int, ...]
    thickness: float
    continuity: float
    seed_distance: int
    padding: int
    marker_radius: float
    path_contrast: float
    dash_contrast: float
    distractor_budget: int
    antialias: int


PRESETS: dict[int, PathfinderParams] = {
    32: PathfinderParams(
        resolution=32, dash_length=2, margins=(1,), thickness=0.5, continuity=1.0, seed_distance=7,
        padding=1, marker_radius=1.5, path_contrast=2.0, dash_contrast=0.75, distractor_budget=20,
        antialias=2,
    ),
    64: PathfinderParams(
        resolution=64, dash_length=5, margins=(1,), thickness=1.0, continuity=1.8, seed_distance=12,
        padding=1, marker_radius=2.5, path_contrast=0.8, dash_contrast=1.0, distractor_budget=22,
        antialias=2,
    ),
    128: PathfinderParams(
        resolution=128, dash_length=5, margins=(2, 3), thickness=1.5, continuity=1.8, seed_distance=20,
        padding=1, marker_radius=3.0, path_contrast=0.9, dash_contrast=1.0, distractor_budget=35,
        antialias=2,
    ),
    256: PathfinderParams(
        resolution=256, dash_length=5, margins=(3,), thickness=2.0, continuity=1.8, seed_distance=27,
        padding=22, marker_radius=5.0, path_contrast=1.0, dash_contrast=1.0, distractor_budget=30,
        antialias=2,
    ),
}


# ----------------------------------------------------------------------------------------------------
# Geometry: everything that depends only on (params, margin), precomputed once per process.
#
# Positions are flat indices into a padded square canvas of side `stride`; the image sits at offset
# `pad`, and the pad counts as occupied, so every stamp can be placed and checked without bounds tests.
# A dash "kind" fixes a dash's shape relative to its anchor pixel:
#   kinds 0 .. n_candidates-1: a grown dash toward candidate pixel k, anchored at the centre c;
#   kinds n_candidates + d:    a seed dash leaving its tail pixel at d degrees (d = 0 .. 359).
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Geometry:
    size: int
    pad: int
    stride: int
    base_occupancy: np.ndarray  # bool (stride * stride,): pad and padding band
    target_tails: np.ndarray  # flat positions allowed for the first target path's tail
    partner_offsets: np.ndarray  # (360,) flat offset from the first to the second target tail
    candidates: np.ndarray  # (n_candidates,) flat offsets of the end pixels around a centre
    turn_weights: np.ndarray  # (n_kinds, n_candidates) continuity weight of each next dash
    next_centres: np.ndarray  # (n_kinds,) flat offset from a dash's anchor to the next centre
    far_ends: np.ndarray  # (n_kinds, 2) (y, x) of the dash's far end relative to its anchor
    footprints: list[np.ndarray]  # per kind: flat offsets of the footprint
    ink_offsets: list[np.ndarray]  # per kind: flat offsets of drawn pixels
    ink_values: list[np.ndarray]  # per kind: antialiased coverage of those pixels

    def seed_kind(self, degree: int) -> int:
        return len(self.candidates) + degree

    def yx(self, position: int) -> np.ndarray:
        y, x = divmod(int(position), self.stride)
        return np.array([y - self.pad, x - self.pad], dtype=float)


def _unit(angles: np.ndarray) -> np.ndarray:
    """(..., 2) unit vectors (sin, cos), rounded so that axis-aligned directions are exact."""
    return np.round(np.stack([np.sin(angles), np.cos(angles)], axis=-1), 12)


def _circle_pixels(radius: float) -> np.ndarray:
    """(k, 2) integer (dy, dx) offsets of the pixels on a circle of the given radius."""
    angles = np.arange(0.0, 2 * np.pi, 1.0 / (4 * radius))
    return np.unique(np.rint(radius * _unit(angles)).astype(int), axis=0)


def _turn_weights(headings: np.ndarray, candidate_angles: np.ndarray, continuity: float) -> np.ndarray:
    """max(cos(min(turn * continuity, pi/2)), 0)^2 for every (heading, candidate) pair."""
    turn = np.abs(np.angle(np.exp(1j * (candidate_angles[None, :] - headings[:, None]))))
    bend = turn * continuity
    return np.where(bend < np.pi / 2, np.cos(bend) ** 2, 0.0)


def _subpixel_centres(reach: int, aa: int) -> np.ndarray:
    """Centres of the aa sub-pixels of pixels -reach .. reach along one axis, in pixel units."""
    pixels = np.arange(-reach, reach + 1)
    return (pixels[:, None] + (np.arange(aa) + 0.5) / aa - 0.5).ravel()


def _block_mean(subpixels: np.ndarray, aa: int) -> np.ndarray:
    """Average (..., n*aa, n*aa) sub-pixel values down to (..., n, n) pixels."""
    *lead, height, width = subpixels.shape
    blocks = subpixels.reshape(*lead, height // aa, aa, width // aa, aa)
    return blocks.mean(axis=(-3, -1))


def _draw_lines(
    starts: np.ndarray, directions: np.ndarray, length: float, width: int, aa: int, reach: int
) -> np.ndarray:
    """Sub-pixel masks of raster lines around their anchor, shape (n, m, m) with m = (2*reach+1)*aa.

    Line i runs from starts[i] over `length` pixels along directions[i]. Like a raster line drawn at
    `aa` times the resolution, each sub-pixel column the line crosses (each row, for a steep line) gets
    a run of round(width / cos(slope)) sub-pixels centred on the line, so its width is `width` sub-pixels.
    """
    tolerance = 1e-9
    centres = _subpixel_centres(reach, aa)
    rel_y = centres[None, :, None] - starts[:, 0, None, None]
    rel_x = centres[None, None, :] - starts[:, 1, None, None]
    steep = (np.abs(directions[:, 0]) > np.abs(directions[:, 1]))[:, None, None]
    major_step = np.where(steep, directions[:, 0, None, None], directions[:, 1, None, None])
    minor_step = np.where(steep, directions[:, 1, None, None], directions[:, 0, None, None])
    along = np.where(steep, rel_y, rel_x) / major_step
    offset = (np.where(steep, rel_x, rel_y) - along * minor_step) * aa
    half_run = np.rint(width / np.abs(major_step)) / 2
    on_segment = (along >= -tolerance) & (along <= length + tolerance)
    return on_segment & (offset >= -half_run - tolerance) & (offset < half_run - tolerance)


def _dilate(masks: np.ndarray, radius: float) -> np.ndarray:
    """Dilate (..., m, m) boolean masks by a disk of `radius` sub-pixels, cut off at the window edge."""
    reach = int(radius)
    size = masks.shape[-1]
    padded = np.pad(masks, [(0, 0)] * (masks.ndim - 2) + [(reach, reach), (reach, reach)])
    dilated = np.zeros_like(masks)
    for dy in range(-reach, reach + 1):
        for dx in range(-reach, reach + 1):
            if dy * dy + dx * dx <= radius * radius:
                dilated |= padded[..., reach + dy : reach + dy + size, reach + dx : reach + dx + size]
    return dilated


def _window_offsets(mask: np.ndarray, reach: int, stride: int) -> np.ndarray:
    """Flat canvas offsets of the nonzero pixels of a (2*reach+1)^2 window centred on its anchor."""
    y, x = np.nonzero(mask)
    return (y - reach) * stride + (x - reach)


def _base_occupancy(size: int, pad: int, padding: int) -> np.ndarray:
    stride = size + 2 * pad
    occupied = np.ones((stride, stride), dtype=bool)
    inner = slice(pad + padding, pad + size - padding)
    occupied[inner, inner] = False
    return occupied.ravel()


@functools.lru_cache(maxsize=None)
def _geometry(params: PathfinderParams, margin: int) -> _Geometry:
    """Precompute candidate pixels, turn weights and dash stamps for one preset and margin."""
    size, length, aa = params.resolution, params.dash_length, params.antialias
    reach = length + 2 * margin + math.ceil(params.thickness) + 2  # how far a stamp extends from its anchor
    pad = 2 * reach  # room for stamps anchored at centres just outside the free area
    stride = size + 2 * pad

    candidate_yx = _circle_pixels(length + margin)
    candidate_angles = np.arctan2(candidate_yx[:, 0], candidate_yx[:, 1])
    seed_angles = np.deg2rad(np.arange(360))
    headings = np.concatenate([candidate_angles, seed_angles])
    lead_in = np.concatenate([np.full(len(candidate_angles), float(margin)), np.zeros(360)])
    directions = _unit(headings)
    starts = lead_in[:, None] * directions
    far_ends = (lead_in + length)[:, None] * directions
    next_centre_yx = np.rint((lead_in + length + margin)[:, None] * directions).astype(int)

    lines = _draw_lines(starts, directions, length, round(params.thickness * aa), aa, reach)
    ink = _block_mean(lines.astype(float), aa)
    footprint = _block_mean(_dilate(lines, margin * aa).astype(float), aa) >= FOOTPRINT_COVERAGE

    base = _base_occupancy(size, pad, params.padding)
    band = 2 * params.seed_distance
    tail_y, tail_x = np.mgrid[band : size - band, band : size - band]
    tails = ((tail_y + pad) * stride + tail_x + pad).ravel()
    partner_yx = np.rint(params.seed_distance * _unit(seed_angles)).astype(int)

    return _Geometry(
        size=size,
        pad=pad,
        stride=stride,
        base_occupancy=base,
        target_tails=tails[~base[tails]],
        partner_offsets=partner_yx[:, 0] * stride + partner_yx[:, 1],
        candidates=candidate_yx[:, 0] * stride + candidate_yx[:, 1],
        turn_weights=_turn_weights(headings, candidate_angles, params.continuity),
        next_centres=next_centre_yx[:, 0] * stride + next_centre_yx[:, 1],
        far_ends=far_ends,
        footprints=[_window_offsets(window, reach, stride) for window in footprint],
        ink_offsets=[_window_offsets(window, reach, stride) for window in ink],
        ink_values=[window[window > 0] for window in ink],
    )


# ----------------------------------------------------------------------------------------------------
# Layout: sampling the paths on the occupancy map.
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Path:
    """A chain of dashes; each dash is (kind, anchor position), the first one is the seed dash."""

    tail: int
    dashes: list[tuple[int, int]]


@dataclass
class _Layout:
    geometry: _Geometry
    targets: tuple[_Path, _Path]
    distractors: list[_Path]
    label: int
    origin: int  # index of the target path whose tail carries the first circle


def _mark(geometry: _Geometry, occupied: np.ndarray, dash: tuple[int, int]) -> None:
    kind, anchor = dash
    occupied[anchor + geometry.footprints[kind]] = True


def _fits(geometry: _Geometry, occupied: np.ndarray, dash: tuple[int, int]) -> bool:
    """Whether the drawn pixels of `dash` avoid every occupied pixel."""
    kind, anchor = dash
    return not occupied[anchor + geometry.ink_offsets[kind]].any()


def _next_dash(
    geometry: _Geometry, occupied: np.ndarray, head: tuple[int, int], rng: np.random.Generator
) -> tuple[int, int] | None:
    """Sample the dash that continues `head`, or None if no acceptable dash was found."""
    kind, anchor = head
    centre = anchor + geometry.next_centres[kind]
    free = ~occupied[centre + geometry.candidates]
    cumulative = np.cumsum(geometry.turn_weights[kind] * free)
    total = cumulative[-1]
    if total <= 0:
        return None
    for _ in range(DASH_TRIES):
        choice = int(np.searchsorted(cumulative, rng.random() * total, side="right"))
        if _fits(geometry, occupied, (choice, centre)):
            return choice, int(centre)
    return None


def _extend(
    geometry: _Geometry,
    path: _Path,
    occupied: np.ndarray,
    rng: np.random.Generator,
    rival: _Path | None = None,
) -> bool:
    """Add one dash to `path`; on success the previous head's footprint joins `occupied`.

    The newest dash of `rival` (not yet in `occupied`) counts as occupied for this step.
    """
    seen = occupied
    if rival is not None:
        seen = occupied.copy()
        _mark(geometry, seen, rival.dashes[-1])
    dash = _next_dash(geometry, seen, path.dashes[-1], rng)
    if dash is None:
        return False
    _mark(geometry, occupied, path.dashes[-1])
    path.dashes.append(dash)
    return True


def _seed_first_target(geometry: _Geometry, rng: np.random.Generator) -> _Path | None:
    for _ in range(SEED_TRIES):
        kind = geometry.seed_kind(int(rng.integers(360)))
        tail = int(geometry.target_tails[rng.integers(len(geometry.target_tails))])
        if _fits(geometry, geometry.base_occupancy, (kind, tail)):
            return _Path(tail, [(kind, tail)])
    return None


def _seed_second_target(geometry: _Geometry, first: _Path, rng: np.random.Generator) -> _Path | None:
    occupied = geometry.base_occupancy.copy()
    _mark(geometry, occupied, first.dashes[0])
    for _ in range(SEED_TRIES):
        kind = geometry.seed_kind(int(rng.integers(360)))
        tail = first.tail + int(geometry.partner_offsets[rng.integers(360)])
        if _fits(geometry, occupied, (kind, tail)):
            return _Path(tail, [(kind, tail)])
    return None


def _grow_target_pair(
    geometry: _Geometry, n_dashes: int, rng: np.random.Generator
) -> tuple[tuple[_Path, _Path], np.ndarray] | None:
    """One attempt at the two target paths; returns them with the occupancy map, or None."""
    first = _seed_first_target(geometry, rng)
    if first is None:
        return None
    second = _seed_second_target(geometry, first, rng)
    if second is None:
        return None
    occupied = geometry.base_occupancy.copy()
    for _ in range(n_dashes - 1):
        for path, rival in ((first, second), (second, first)):
            if not _extend(geometry, path, occupied, rng, rival):
                return None
    _mark(geometry, occupied, first.dashes[-1])
    _mark(geometry, occupied, second.dashes[-1])
    return (first, second), occupied


def _grow_targets(
    geometry: _Geometry, n_dashes: int, rng: np.random.Generator
) -> tuple[tuple[_Path, _Path], np.ndarray] | None:
    """The two target paths and the occupancy map, or None after 1 + TARGET_RETRIES failed attempts."""
    for _ in range(1 + TARGET_RETRIES):
        grown = _grow_target_pair(geometry, n_dashes, rng)
        if grown is not None:
            return grown
    return None


def _seed_distractor(geometry: _Geometry, occupied: np.ndarray, rng: np.random.Generator) -> _Path | None:
    free = np.flatnonzero(~occupied)
    if free.size == 0:
        return None
    for _ in range(SEED_TRIES):
        kind = geometry.seed_kind(int(rng.integers(360)))
        tail = int(free[rng.integers(free.size)])
        if _fits(geometry, occupied, (kind, tail)):
            return _Path(tail, [(kind, tail)])
    return None


def _grow_distractor(
    geometry: _Geometry, occupied: np.ndarray, n_dashes: int, rng: np.random.Generator
) -> tuple[_Path, np.ndarray] | None:
    """One attempt at a distractor path; returns it with the updated occupancy map, or None."""
    trial = occupied.copy()
    path = _seed_distractor(geometry, trial, rng)
    if path is None:
        return None
    for _ in range(n_dashes - 1):
        if not _extend(geometry, path, trial, rng):
            return None
    _mark(geometry, trial, path.dashes[-1])
    return path, trial


def _grow_distractors(
    geometry: _Geometry, occupied: np.ndarray, count: int, n_dashes: int, rng: np.random.Generator
) -> list[_Path]:
    distractors = []
    for _ in range(count):
        for _ in range(DISTRACTOR_TRIES):
            grown = _grow_distractor(geometry, occupied, n_dashes, rng)
            if grown is not None:
                path, occupied = grown
                distractors.append(path)
                break
    return distractors


def _sample_layout(params: PathfinderParams, n_dashes: int, rng: np.random.Generator) -> _Layout:
    """Sample label, margin and all paths of one image."""
    distractor_length = n_dashes // 3
    for _ in range(MAX_IMAGE_ATTEMPTS):
        label = int(rng.integers(2))
        geometry = _geometry(params, int(rng.choice(params.margins)))
        grown = _grow_targets(geometry, n_dashes, rng)
        if grown is None:
            continue
        targets, occupied = grown
        count = params.distractor_budget // distractor_length
        distractors = _grow_distractors(geometry, occupied, count, distractor_length, rng)
        origin = int(rng.integers(2))
        return _Layout(geometry, targets, distractors, label, origin)
    raise RuntimeError(
        f"no Pathfinder image with {n_dashes} dashes per path at {params.resolution} px "
        f"after {MAX_IMAGE_ATTEMPTS} attempts"
    )


def _circle_positions(layout: _Layout) -> tuple[np.ndarray, np.ndarray]:
    """(y, x) of the two circles: a target tail and the far end of the same or the other target."""
    geometry = layout.geometry
    start_path = layout.targets[layout.origin]
    end_path = layout.targets[layout.origin if layout.label else 1 - layout.origin]
    kind, anchor = end_path.dashes[-1]
    return geometry.yx(start_path.tail), geometry.yx(anchor) + geometry.far_ends[kind]


# ----------------------------------------------------------------------------------------------------
# Rendering.
# ----------------------------------------------------------------------------------------------------


def _draw_paths(layout: _Layout, brightness: float) -> np.ndarray:
    geometry = layout.geometry
    dashes = [dash for path in (*layout.targets, *layout.distractors) for dash in path.dashes]
    positions = np.concatenate([anchor + geometry.ink_offsets[kind] for kind, anchor in dashes])
    values = np.concatenate([geometry.ink_values[kind] for kind, _ in dashes])
    canvas = np.zeros(geometry.stride * geometry.stride)
    np.maximum.at(canvas, positions, values * brightness)
    inner = slice(geometry.pad, geometry.pad + geometry.size)
    return canvas.reshape(geometry.stride, geometry.stride)[inner, inner]


def _draw_disk(image: np.ndarray, centre: np.ndarray, radius: float, aa: int) -> None:
    """Draw an antialiased disk of brightness 1 into `image` (maximum with what is there)."""
    reach = math.ceil(radius) + 1
    anchor = np.rint(centre).astype(int)
    centres = _subpixel_centres(reach, aa)
    dy = centres[:, None] + anchor[0] - centre[0]
    dx = centres[None, :] + anchor[1] - centre[1]
    disk = _block_mean((dy**2 + dx**2 <= radius**2).astype(float), aa)
    rows = np.arange(-reach, reach + 1) + anchor[0]
    cols = np.arange(-reach, reach + 1) + anchor[1]
    keep_rows = (rows >= 0) & (rows < image.shape[0])
    keep_cols = (cols >= 0) & (cols < image.shape[1])
    window = np.ix_(rows[keep_rows], cols[keep_cols])
    image[window] = np.maximum(image[window], disk[np.ix_(keep_rows, keep_cols)])


def _render(params: PathfinderParams, layout: _Layout) -> np.ndarray:
    image = _draw_paths(layout, params.path_contrast * params.dash_contrast)
    for centre in _circle_positions(layout):
        _draw_disk(image, centre, params.marker_radius, params.antialias)
    return np.rint(image / image.max() * 255).astype(np.uint8)


# ----------------------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------------------


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")


def generate_image(resolution: int, difficulty: str, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Generate one Pathfinder image.

    Args:
        resolution: image side in pixels, a key of ``PRESETS`` (32, 64, 128 or 256).
        difficulty: a key of ``DIFFICULTIES`` ("easy", "intermediate" or "hard").
        rng: the random generator; the image is a deterministic function of its state.

    Returns:
        (image, label): a uint8 array of shape (resolution, resolution) and 1 if both circles lie on
        the same path, else 0.
    """
    _check_choice("resolution", resolution, PRESETS)
    _check_choice("difficulty", difficulty, DIFFICULTIES)
    params = PRESETS[resolution]
    layout = _sample_layout(params, DIFFICULTIES[difficulty], rng)
    return _render(params, layout), layout.label


def _generate_block(task: tuple[int, int, int, str, int]) -> tuple[int, np.ndarray, np.ndarray]:
    """Images start .. stop-1 of a dataset; image i uses np.random.default_rng([seed, i])."""
    start, stop, resolution, difficulty, seed = task
    images = np.empty((stop - start, resolution, resolution), dtype=np.uint8)
    labels = np.empty(stop - start, dtype=np.int64)
    for row, index in enumerate(range(start, stop)):
        rng = np.random.default_rng([seed, index])
        images[row], labels[row] = generate_image(resolution, difficulty, rng)
    return start, images, labels


def _report_progress(done: int, total: int) -> None:
    end = "\n" if done == total else ""
    print(f"\rpathfinder: {done}/{total} images", end=end, file=sys.stderr, flush=True)


def generate_dataset(
    n: int,
    resolution: int = 32,
    difficulty: str = "easy",
    seed: int = 0,
    workers: int | None = None,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Generate n Pathfinder images in parallel.

    Image i is ``generate_image(resolution, difficulty, np.random.default_rng([seed, i]))``, so the
    result does not depend on the number of workers. Labels are drawn 50/50 per image.

    Args:
        n: number of images.
        resolution: image side in pixels (32, 64, 128 or 256).
        difficulty: "easy", "intermediate" or "hard".
        seed: dataset seed (a non-negative integer).
        workers: worker processes; default ``os.cpu_count()``; 1 runs in this process.
        progress: print a progress line to stderr.

    Returns:
        (images, labels): uint8 array (n, resolution, resolution) and int64 array (n,) of 0/1.
    """
    _check_choice("resolution", resolution, PRESETS)
    _check_choice("difficulty", difficulty, DIFFICULTIES)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    workers = workers or os.cpu_count() or 1
    block = max(1, min(256, math.ceil(n / (8 * workers))))
    tasks = [(start, min(start + block, n), resolution, difficulty, seed) for start in range(0, n, block)]
    images = np.empty((n, resolution, resolution), dtype=np.uint8)
    labels = np.empty(n, dtype=np.int64)
    done = 0

    def collect(results) -> None:
        nonlocal done
        for start, block_images, block_labels in results:
            images[start : start + len(block_labels)] = block_images
            labels[start : start + len(block_labels)] = block_labels
            done += len(block_labels)
            if progress:
                _report_progress(done, n)

    workers = min(workers, len(tasks))
    if workers <= 1:
        collect(map(_generate_block, tasks))
    else:
        with multiprocessing.Pool(workers) as pool:
            collect(pool.imap_unordered(_generate_block, tasks))
    return images, labels


def _cache_metadata(n: int, resolution: int, difficulty: str, seed: int) -> dict:
    """What identifies a cached dataset, in its JSON form."""
    metadata = {
        "n": n,
        "resolution": resolution,
        "difficulty": difficulty,
        "seed": seed,
        "params": asdict(PRESETS[resolution]),
        "generator_version": GENERATOR_VERSION,
    }
    return json.loads(json.dumps(metadata))


def _cache_paths(directory: Path, n: int, resolution: int, difficulty: str, seed: int) -> dict[str, Path]:
    stem = f"pathfinder{resolution}_{difficulty}_n{n}_seed{seed}"
    return {
        "images": directory / f"{stem}_images.npy",
        "labels": directory / f"{stem}_labels.npy",
        "metadata": directory / f"{stem}.json",
    }


def _read_cache(paths: dict[str, Path], expected: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached arrays if all files exist and the metadata matches, else None."""
    try:
        metadata = json.loads(paths["metadata"].read_text())
        metadata.pop("seconds", None)
        if metadata != expected:
            return None
        images = np.load(paths["images"])
        labels = np.load(paths["labels"])
    except (OSError, ValueError, EOFError):
        return None
    side = expected["resolution"]
    if images.shape != (expected["n"], side, side) or labels.shape != (expected["n"],):
        return None
    return images, labels.astype(np.int64)


def _save_atomically(path: Path, write) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        write(handle)
    partial.replace(path)


def _write_cache(paths: dict[str, Path], metadata: dict, images: np.ndarray, labels: np.ndarray) -> None:
    paths["metadata"].parent.mkdir(parents=True, exist_ok=True)
    _save_atomically(paths["images"], lambda handle: np.save(handle, images))
    _save_atomically(paths["labels"], lambda handle: np.save(handle, labels.astype(np.uint8)))
    _save_atomically(paths["metadata"], lambda handle: handle.write(json.dumps(metadata, indent=2).encode()))


def load_or_generate(
    n: int,
    resolution: int,
    difficulty: str,
    seed: int,
    cache_dir: str | os.PathLike = "~/.cache/sparse_flash/pathfinder",
    workers: int | None = None,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Load a dataset from the disk cache, generating and caching it when missing or stale.

    The cache holds ``<stem>_images.npy`` and ``<stem>_labels.npy`` (uint8) and ``<stem>.json`` with
    n, resolution, difficulty, seed, the preset parameters, the generator version and the seconds
    generation took; it is reused only when that metadata matches.

    Args:
        n, resolution, difficulty, seed, workers, progress: as for ``generate_dataset``.
        cache_dir: directory of the cache files (created when missing; ``~`` is expanded).

    Returns:
        (images, labels): uint8 array (n, resolution, resolution) and int64 array (n,).
    """
    _check_choice("resolution", resolution, PRESETS)
    _check_choice("difficulty", difficulty, DIFFICULTIES)
    paths = _cache_paths(Path(cache_dir).expanduser(), n, resolution, difficulty, seed)
    expected = _cache_metadata(n, resolution, difficulty, seed)
    cached = _read_cache(paths, expected)
    if cached is not None:
        return cached
    started = time.perf_counter()
    images, labels = generate_dataset(n, resolution, difficulty, seed, workers, progress)
    metadata = {**expected, "seconds": round(time.perf_counter() - started, 3)}
    _write_cache(paths, metadata, images, labels)
    return images, labels


def show(images: np.ndarray, labels: np.ndarray, path: str | os.PathLike, ncols: int = 8) -> None:
    """Write a PNG grid of images titled with their labels.

    Args:
        images: uint8 array (n, H, W).
        labels: array (n,) of 0/1.
        path: output PNG file.
        ncols: images per row.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    count = len(images)
    nrows = max(1, math.ceil(count / ncols))
    figure = Figure(figsize=(1.6 * ncols, 1.8 * nrows))
    FigureCanvasAgg(figure)
    axes = figure.subplots(nrows, ncols, squeeze=False).ravel()
    for index, ax in enumerate(axes):
        ax.set_axis_off()
        if index < count:
            ax.imshow(images[index], cmap="gray", vmin=0, vmax=255, interpolation="nearest")
            ax.set_title(f"label {int(labels[index])}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Generate (through the disk cache) Pathfinder images and optionally save a grid of them."
    )
    parser.add_argument("--resolution", type=int, choices=sorted(PRESETS), default=32)
    parser.add_argument("--difficulty", choices=list(DIFFICULTIES), default="easy")
    parser.add_argument("-n", type=int, default=64, help="number of images (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: all cores)")
    parser.add_argument("--cache-dir", default="~/.cache/sparse_flash/pathfinder")
    parser.add_argument("--show", metavar="PNG", help="write a grid of the first 64 images to this file")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"argument -n: must be at least 1, got {args.n}")
    if args.seed < 0:
        parser.error(f"argument --seed: must be non-negative, got {args.seed}")
    if args.workers is not None and args.workers < 1:
        parser.error(f"argument --workers: must be at least 1, got {args.workers}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    started = time.perf_counter()
    images, labels = load_or_generate(
        args.n, args.resolution, args.difficulty, args.seed, args.cache_dir, args.workers, progress=True
    )
    seconds = time.perf_counter() - started
    print(
        f"{len(images)} images of {args.resolution}x{args.resolution} ({args.difficulty}), "
        f"{labels.mean():.1%} label 1, ready in {seconds:.2f} s"
    )
    if args.show:
        show(images[:64], labels[:64], args.show)
        print(f"wrote {args.show}")


if __name__ == "__main__":
    main()
