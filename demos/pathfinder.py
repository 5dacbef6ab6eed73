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

How it is computed. Rejection sampling dominates: a 64-px hard image needs about 3,500 attempts at the
target pair on average (most die within 8 dashes), a 128-px hard one about 180. Steps 3 and 4 run as
written, but for many attempts and images at once (see "Layout" below): every attempt reads a fixed
row of uniforms from its image's generator and the image keeps its first successful attempt, so the
result is the one a one-attempt-at-a-time loop over the same uniforms gives, whatever the batch sizes
(tests/test_pathfinder.py runs such a loop and compares layouts exactly, and compares image statistics
with the generator before this scheme, commit f59dcde). Occupancy maps are bit-packed, dash stamps are
precomputed per kind and anchor alignment.

CPU time per image and core (ms), ``generate_dataset(..., workers=1)`` on the 2-core development VM
(AMD EPYC), hundreds of images per cell (64 px hard before: 64 images); repeated runs differ by up to
20%; before = commit f59dcde (GENERATOR_VERSION 1):

    ============  ====================  ====================  ====================
    resolution    easy (before/now)     intermediate          hard
    ============  ====================  ====================  ====================
    32            0.92 / 0.46           1.55 / 0.47           4.2 / 0.73
    64            1.34 / 0.56           31 / 2.1              511 / 20
    128           1.51 / 1.08           3.0 / 1.14            34 / 3.4
    256           1.88 / 1.23           1.84 / 0.99           3.6 / 1.18
    ============  ====================  ====================  ====================

At 0.73 ms a 32-px hard image, 16 cores make the 200,000 of an LRA set in about 10 s. ``generate_image``
makes one image alone and pays the batching overhead for it (about 3-5 ms at 32 px, 31 ms at 64 px hard);
use ``generate_dataset`` for many.

Pooled resolution: ``load_or_generate(..., pool=4)`` (``--pool 4``) averages each image over 4x4 pixel
blocks (``pool_images``), e.g. Path-256 images at 64 px with the same labels, cached under its own name.
Progress: generation prints plain lines to stderr (images done, rate, time left) every 10% or 30 s;
``progress=False`` (``--quiet``) turns them off.

Command line::

    python demos/pathfinder.py --resolution 32 --difficulty easy -n 64 --seed 0 --show grid.png
    python demos/pathfinder.py --resolution 256 --difficulty hard -n 20000 --pool 4
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

GENERATOR_VERSION = 2
DIFFICULTIES = {"easy": 6, "intermediate": 9, "hard": 14}

DASH_TRIES = 3  # samples of the next dash before a path counts as stuck
SEED_TRIES = 3  # samples of a seed dash before a seeding fails
TARGET_RETRIES = 4  # regrowths of a failed target pair before starting a new image
DISTRACTOR_TRIES = 5  # attempts at one distractor path before it is skipped
MAX_TARGET_ATTEMPTS = 500_000  # attempts at the target pair before giving up with an error
FOOTPRINT_COVERAGE = 0.5  # a pixel is in a footprint when at least this fraction of it is covered
PROGRESS_STEP = 0.1  # progress: a line per this fraction of the images ...
PROGRESS_SECONDS = 30.0  # ... or after this many seconds without one ...
PROGRESS_GAP = 2.0  # ... but never two lines closer than this


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
class _Stamps:
    """Pixel sets, one per kind, as bytes and bits of a bit-packed map (pixel q is bit q % 8 of byte
    q // 8), for each position of the anchor pixel within its byte: column kind * 8 + anchor % 8 lists
    the bytes (offsets from the anchor's byte) and bit masks. Short columns repeat their first entry,
    which reads or sets the same bits again and so changes nothing."""

    bytes: np.ndarray  # (width, n_kinds * 8) intp
    masks: np.ndarray  # (width, n_kinds * 8) uint8

    def at(self, kinds: np.ndarray, positions: np.ndarray, map_starts) -> tuple[np.ndarray, np.ndarray]:
        """(width, a) byte indices and bit masks of the stamps of `kinds` anchored at pixel `positions`
        of the maps starting at bytes `map_starts`."""
        columns = kinds * 8 + (positions & 7)
        return self.bytes.take(columns, axis=1) + (map_starts + (positions >> 3)), self.masks.take(columns, axis=1)


def _stamps(offset_sets: list[np.ndarray], merge: bool) -> _Stamps:
    """Stamps of flat pixel offset sets; with `merge`, one entry per byte (bits joined), else one per
    offset in the given order."""
    columns = []
    for offsets in offset_sets:
        for align in range(8):
            shifted = align + np.asarray(offsets)
            bytes_, masks = shifted >> 3, (1 << (shifted & 7)).astype(np.uint8)
            if merge:
                order = np.argsort(bytes_, kind="stable")
                bytes_, first = np.unique(bytes_[order], return_index=True)
                masks = np.bitwise_or.reduceat(masks[order], first)
            columns.append((bytes_, masks))
    width = max(len(bytes_) for bytes_, _ in columns)
    table_bytes = np.empty((width, len(columns)), dtype=np.intp)
    table_masks = np.empty((width, len(columns)), dtype=np.uint8)
    for index, (bytes_, masks) in enumerate(columns):
        table_bytes[:, index], table_masks[:, index] = bytes_[0], masks[0]
        table_bytes[: len(bytes_), index], table_masks[: len(masks), index] = bytes_, masks
    return _Stamps(table_bytes, table_masks)


@dataclass(frozen=True, eq=False)
class _Geometry:
    size: int
    pad: int
    stride: int
    base_occupancy: np.ndarray  # bool (stride * stride,): pad and padding band
    free_span: tuple[int, int]  # the flat positions between which pixels can be free
    target_tails: np.ndarray  # flat positions allowed for the first target path's tail
    partner_offsets: np.ndarray  # (360,) flat offset from the first to the second target tail
    candidates: np.ndarray  # (n_candidates,) flat offsets of the end pixels around a centre
    turn_weights: np.ndarray  # (n_kinds, n_candidates) continuity weight of each next dash
    next_centres: np.ndarray  # (n_kinds,) flat offset from a dash's anchor to the next centre
    far_ends: np.ndarray  # (n_kinds, 2) (y, x) of the dash's far end relative to its anchor
    footprints: list[np.ndarray]  # per kind: flat offsets of the footprint
    ink_offsets: list[np.ndarray]  # per kind: flat offsets of drawn pixels
    ink_values: list[np.ndarray]  # per kind: antialiased coverage of those pixels
    # For the sampler, per kind one column: the K candidates a dash may turn to (turn weight and kind,
    # weight 0 pads), and the candidate, ink and footprint pixels as stamps on bit-packed maps.
    step_weights: np.ndarray  # (K, n_kinds)
    step_kinds: np.ndarray  # (K, n_kinds)
    step_stamps: _Stamps  # candidate pixels around the next centre, in slot order
    ink_stamps: _Stamps
    footprint_stamps: _Stamps
    packed_base: np.ndarray  # uint8 (stride * stride / 8,): base_occupancy packed

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
    pad = 4 * math.ceil(reach / 2)  # room for stamps anchored at centres just outside the free area;
    # at least 2 * reach and a multiple of 4, so that map rows are whole bytes when packed
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

    footprints = [_window_offsets(window, reach, stride) for window in footprint]
    ink_offsets = [_window_offsets(window, reach, stride) for window in ink]
    turn_weights = _turn_weights(headings, candidate_angles, params.continuity)
    # Only candidates with a positive weight can be sampled: keep those (in candidate order) per kind.
    allowed = turn_weights > 0
    step_kinds = np.argsort(~allowed, axis=1, kind="stable")[:, : allowed.sum(axis=1).max()]
    candidates = candidate_yx[:, 0] * stride + candidate_yx[:, 1]

    return _Geometry(
        size=size,
        pad=pad,
        stride=stride,
        base_occupancy=base,
        free_span=(int(np.argmin(base)), base.size - int(np.argmin(base[::-1]))),
        target_tails=tails[~base[tails]],
        partner_offsets=partner_yx[:, 0] * stride + partner_yx[:, 1],
        candidates=candidates,
        turn_weights=turn_weights,
        next_centres=next_centre_yx[:, 0] * stride + next_centre_yx[:, 1],
        far_ends=far_ends,
        footprints=footprints,
        ink_offsets=ink_offsets,
        ink_values=[window[window > 0] for window in ink],
        step_weights=np.ascontiguousarray(np.take_along_axis(turn_weights, step_kinds, axis=1).T),
        step_kinds=np.ascontiguousarray(step_kinds.T),
        step_stamps=_stamps(list(candidates[step_kinds]), merge=False),
        ink_stamps=_stamps(ink_offsets, merge=True),
        footprint_stamps=_stamps(footprints, merge=True),
        packed_base=np.packbits(base, bitorder="little"),
    )


# ----------------------------------------------------------------------------------------------------
# Layout: sampling the paths on the occupancy map.
#
# The distribution is that of steps 3 and 4 above, run one attempt at a time; the work is arranged so
# that each numpy call serves many attempts, of one image and of several images at once:
# * Image j reads its uniforms from its own generator in a fixed order: label, origin and every try at
#   every distractor first, then one row per target attempt, whether the attempt needs it all or not.
#   The image takes its first target attempt that succeeds. So attempts can run in batches of any size,
#   in lockstep, and an image does not depend on the batch sizes or on which images share a batch.
#   Blocks of 1 + TARGET_RETRIES attempts share one margin draw, as "4 retries, then a new image" has it.
# * An attempt keeps one occupancy map per path: map p is what path p must avoid, the border and every
#   dash so far except path p's newest. A new dash of path p puts p's previous dash into map p and itself
#   into the other path's map: "the previous dash joins the occupancy map, the other path's newest dash
#   counts as occupied".
# * The DISTRACTOR_TRIES tries at one distractor run at once, each on its own copy of the image's map,
#   and the first that succeeds is kept; distractor k of every image in the batch is placed together.
# ----------------------------------------------------------------------------------------------------

TARGET_BLOCK = 1 + TARGET_RETRIES  # target attempts per margin draw
SEED_COLUMNS = 2 * SEED_TRIES  # uniforms for seeding one path: (direction, place) per try
TARGET_COLUMN = 1 + 2 * SEED_COLUMNS  # first growth column of a target attempt (after margin and seeds)
SCRATCH_BYTES = 8 << 20  # packed occupancy maps kept per geometry and process for target attempts
RELIABLE_SUCCESSES = 10  # successes after which the success rate sizes the attempt batches
BATCH_SUCCESSES = 0.25  # expected successes per batch of target attempts for one image, at least ...
FILL_SUCCESSES = 1.0  # ... and at most, when the batch has room
LOCKSTEP_IMAGES = 64  # images whose layouts are sampled together

# Free pixels of a packed byte: how many, and where the r-th one is (bit 0 is the first pixel).
_FREE_BITS = np.array([8 - bin(value).count("1") for value in range(256)], dtype=np.uint8)
_FREE_SELECT = np.array(
    [([bit for bit in range(8) if not value >> bit & 1] + [0] * 8)[:8] for value in range(256)], dtype=np.intp
).ravel()

# (attempts, successes) of target attempts per (params, n_dashes) in this process. It sizes the batches
# and, since the images do not depend on batch sizes, nothing else.
_TARGET_RECORD: dict[tuple[PathfinderParams, int], list[int]] = {}


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


@dataclass
class _Attempts:
    """Attempts at growing `n_paths` paths each, on bit-packed occupancy maps in one flat uint8 array.

    Map p of attempt r is the `size` bytes from (r * n_paths + p) * size of `maps`: what path p must
    avoid. Attempt r reads its uniforms from ``draws[r]``. The live attempts are `rows` (increasing);
    `kinds` and `anchors` hold the newest dash of each path of each live attempt, and `history` every
    dash placed, as (rows, kinds, anchors) per placement step, from which `dashes` reads the paths.
    """

    geometry: _Geometry
    maps: np.ndarray  # (R * n_paths * size,) uint8
    size: int  # bytes per map
    n_paths: int
    draws: np.ndarray  # (R, columns) uniforms on [0, 1)
    rows: np.ndarray  # (a,) live attempts
    kinds: list[np.ndarray]  # per path: (a,) kind of its newest dash
    anchors: list[np.ndarray]  # per path: (a,) anchor of its newest dash
    history: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]  # per path: one entry per dash
    bases: np.ndarray  # (a,) first byte of the maps of each live attempt

    def starts(self, path: int) -> np.ndarray:
        """(a,) first byte of map `path` of each live attempt."""
        return self.bases + path * self.size

    def keep(self, alive: np.ndarray) -> None:
        """Drop the live attempts where `alive` is False."""
        self.rows = self.rows[alive]
        self.bases = self.bases[alive]
        self.kinds = [kind[alive] for kind in self.kinds]
        self.anchors = [anchor[alive] for anchor in self.anchors]

    def mark(self, path: int, anchors: np.ndarray, kinds: np.ndarray) -> None:
        """Put the footprints of dashes (one per live attempt) into map `path` of each live attempt."""
        indices, masks = self.geometry.footprint_stamps.at(kinds, anchors, self.starts(path))
        self.maps[indices] |= masks

    def place(self, path: int, kinds: np.ndarray, anchors: np.ndarray) -> None:
        """Make (kinds, anchors) the newest dash of `path`; it joins the maps of the other paths."""
        for other in range(self.n_paths):
            if other != path:
                self.mark(other, anchors, kinds)
        self.kinds[path] = kinds
        self.anchors[path] = anchors
        self.history[path].append((self.rows, kinds, anchors))

    def seed(self, path: int, tails: np.ndarray, directions: np.ndarray) -> None:
        """Seed `path` of every live attempt with the first of SEED_TRIES tries that fits its map.

        Args:
            tails: (a, SEED_TRIES) tail pixel of each try.
            directions: (a, SEED_TRIES) uniforms that pick each try's direction in whole degrees.
        """
        tried = len(self.geometry.candidates) + _uniform_index(directions, 360)
        starts = np.repeat(self.starts(path), SEED_TRIES)
        fits = self._fits(starts, tails.ravel(), tried.ravel()).reshape(tried.shape)
        seeded = fits.any(axis=1)
        chosen = np.arange(len(fits)) * SEED_TRIES + fits.argmax(axis=1)
        self.keep(seeded)
        self.place(path, tried.take(chosen[seeded]), tails.take(chosen[seeded]))

    def grow(self, first_column: int, n_steps: int) -> None:
        """Add `n_steps` dashes to every path, paths taking turns; attempts where a path gets stuck end.

        One step of one path (step 3 of the module docstring): with c the centre past its newest dash, a
        try samples a candidate end pixel with probability proportional to its turn weight times whether
        it is free, and the first of up to DASH_TRIES tries whose dash avoids the path's map is taken;
        then the previous dash joins that map. Step t of path p reads DASH_TRIES uniforms, one per try,
        from column first_column + (t * n_paths + p) * DASH_TRIES; a try after the first runs only for the
        attempts still without a dash.
        """
        geometry = self.geometry
        columns = self.draws.shape[1]
        uniforms = self.draws.reshape(-1)
        for step in range(n_steps):
            for path in range(self.n_paths):
                if self.rows.size == 0:
                    return
                kind, anchor = self.kinds[path], self.anchors[path]
                centre = anchor + geometry.next_centres.take(kind)
                starts = self.starts(path)
                # (K, a): cumulative weight of the free candidates, summed in slot order
                indices, masks = geometry.step_stamps.at(kind, centre, starts)
                cumulative = geometry.step_weights.take(kind, axis=1) * ((self.maps[indices] & masks) == 0)
                _accumulate(cumulative)
                free = cumulative[-1] > 0  # some candidate is free
                cells = self.rows * columns + (first_column + (step * self.n_paths + path) * DASH_TRIES)
                chosen = self._sample(kind, cumulative, uniforms.take(cells))
                grown = free & self._fits(starts, centre, chosen)
                trying = np.flatnonzero(free & ~grown)
                for attempt in range(1, DASH_TRIES):
                    if trying.size == 0:
                        break
                    tried = self._sample(
                        kind.take(trying), cumulative[:, trying], uniforms.take(cells.take(trying) + attempt)
                    )
                    fits = self._fits(starts.take(trying), centre.take(trying), tried)
                    chosen[trying[fits]] = tried[fits]
                    grown[trying[fits]] = True
                    trying = trying[~fits]
                if not grown.all():
                    self.keep(grown)
                    kind, anchor, centre, chosen = kind[grown], anchor[grown], centre[grown], chosen[grown]
                self.mark(path, anchor, kind)
                self.place(path, chosen, centre)

    def _sample(self, kind: np.ndarray, cumulative: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
        """The kind of the next dash: slot searchsorted(cumulative, u * total, side="right") per column.

        For u < 1, u * total is below total in floating point, so the slot found has a positive weight
        (a column with total 0 is clipped to the last slot; its attempt is stuck anyway).
        """
        step_kinds = self.geometry.step_kinds
        slots = np.minimum((cumulative <= uniforms * cumulative[-1]).sum(axis=0), len(step_kinds) - 1)
        return step_kinds.take(slots * step_kinds.shape[1] + kind)

    def _fits(self, starts: np.ndarray, anchors: np.ndarray, kinds: np.ndarray) -> np.ndarray:
        """Whether the dash of each kind at each anchor pixel avoids its map (starting at byte `starts`)."""
        indices, masks = self.geometry.ink_stamps.at(kinds, anchors, starts)
        return ~(self.maps[indices] & masks).any(axis=0)

    def dashes(self, rows: np.ndarray, path: int) -> tuple[np.ndarray, np.ndarray]:
        """(kinds, anchors), each (len(rows), n_dashes): the dashes of `path` of attempts `rows` that
        are still live."""
        kinds, anchors = [], []
        for placed_rows, placed_kinds, placed_anchors in self.history[path]:
            where = placed_rows.searchsorted(rows)
            kinds.append(placed_kinds.take(where))
            anchors.append(placed_anchors.take(where))
        return np.stack(kinds, axis=1), np.stack(anchors, axis=1)

    def occupancy(self, row_index: int, path: int = 0) -> np.ndarray:
        """The full packed occupancy map of live attempt self.rows[row_index]: map `path` plus that
        path's newest dash."""
        start = (int(self.rows[row_index]) * self.n_paths + path) * self.size
        occupied = self.maps[start : start + self.size].copy()
        head = slice(row_index, row_index + 1)
        indices, masks = self.geometry.footprint_stamps.at(self.kinds[path][head], self.anchors[path][head], 0)
        occupied[indices] |= masks
        return occupied


def _accumulate(values: np.ndarray) -> None:
    """Running sums down the rows of a (K, a) float array, in place, added in row order (as
    np.cumsum(axis=0), which is slower for wide arrays and faster for narrow ones)."""
    if values.shape[1] < 256:
        np.cumsum(values, axis=0, out=values)
        return
    for row in range(1, len(values)):
        np.add(values[row - 1], values[row], out=values[row])


def _attempts(geometry: _Geometry, maps: np.ndarray, n_paths: int, draws: np.ndarray) -> _Attempts:
    """Attempts with one row of `draws` each, on `maps` (R, n_paths, S / 8), none seeded yet."""
    unseeded = np.zeros(len(draws), dtype=np.intp)
    rows, size = np.arange(len(draws)), geometry.packed_base.size
    return _Attempts(
        geometry, maps.reshape(-1), size, n_paths, draws, rows, [unseeded] * n_paths, [unseeded] * n_paths,
        [[] for _ in range(n_paths)], rows * (n_paths * size),
    )


def _uniform_index(uniforms: np.ndarray, count: int) -> np.ndarray:
    """Integers uniform on 0 .. count-1 from uniforms on [0, 1)."""
    return np.minimum((uniforms * count).astype(np.intp), count - 1)


def _path(kinds: np.ndarray, anchors: np.ndarray) -> _Path:
    return _Path(int(anchors[0]), [(int(kind), int(anchor)) for kind, anchor in zip(kinds, anchors)])


_TARGET_MAPS_LOCK = threading.Lock()  # the reusable maps serve one sampler at a time


@functools.lru_cache(maxsize=None)
def _target_maps(geometry: _Geometry) -> np.ndarray:
    """Reusable (rows, 2, S / 8) packed maps for target attempts, each equal to the base map between uses."""
    size = geometry.packed_base.size
    rows = max(TARGET_BLOCK, SCRATCH_BYTES // (2 * size) // TARGET_BLOCK * TARGET_BLOCK)
    return np.broadcast_to(geometry.packed_base, (rows, 2, size)).copy()


def _target_attempts(geometry: _Geometry, draws: np.ndarray, n_dashes: int) -> _Attempts:
    """Run the target attempts of `draws` (one per row) on the first len(draws) reusable maps; the
    attempts that succeeded are left live. The caller puts the maps back to the base map."""
    count = len(draws)
    attempts = _attempts(geometry, _target_maps(geometry)[:count], 2, draws)
    seeds = draws[:, 1:TARGET_COLUMN].reshape(count, 2, SEED_TRIES, 2)
    tails = geometry.target_tails.take(_uniform_index(seeds[:, 0, :, 1], len(geometry.target_tails)))
    attempts.seed(0, tails, seeds[:, 0, :, 0])
    second = seeds[attempts.rows, 1]
    partners = geometry.partner_offsets.take(_uniform_index(second[:, :, 1], 360))
    attempts.seed(1, attempts.anchors[0][:, None] + partners, second[:, :, 0])
    attempts.grow(TARGET_COLUMN, n_dashes - 1)
    return attempts


def _batch_size(record: list[int], capacity: int, pending: int, failed: int) -> int:
    """Target attempts to run next for one of `pending` images, a multiple of TARGET_BLOCK.

    With the success rate q of this (preset, difficulty) known from RELIABLE_SUCCESSES successes:
    BATCH_SUCCESSES / q attempts, so that few attempts run past an image's first success, or more, up
    to FILL_SUCCESSES / q, where the batch has room (a batch costs a fixed overhead per step). Before
    that, twice the `failed` batch (TARGET_BLOCK at first).
    """
    attempts, successes = record
    if successes >= RELIABLE_SUCCESSES:
        mean = attempts / successes
        wanted = max(BATCH_SUCCESSES * mean, min(capacity / pending, FILL_SUCCESSES * mean))
    else:
        wanted = 2 * failed
    return TARGET_BLOCK * max(1, min(capacity // TARGET_BLOCK, math.ceil(wanted / TARGET_BLOCK)))


def _first_successes(groups: list[tuple[np.ndarray, _Attempts]], owner: np.ndarray) -> dict[int, tuple]:
    """Per image with a successful attempt: (row, attempts, index among its live attempts) of the first.

    Args:
        groups: (rows of the batch, their attempts) per margin.
        owner: (batch,) image of each row; an image's rows are in attempt order.
    """
    best: dict[int, tuple] = {}
    for rows, attempts in groups:
        live = rows.take(attempts.rows)
        winners, first = np.unique(owner.take(live), return_index=True)
        for image, index in zip(winners.tolist(), first.tolist()):
            if image not in best or live[index] < best[image][0]:
                best[image] = (int(live[index]), attempts, index)
    return best


def _grow_targets(
    params: PathfinderParams, n_dashes: int, rngs: list[np.random.Generator]
) -> list[tuple[_Geometry, tuple[_Path, _Path], np.ndarray]]:
    """Per image: the margin's geometry, the two target paths, the occupancy map with their dashes.

    Image j's attempts read rows of uniforms from rngs[j] in attempt order, and the image takes its first
    successful attempt, so the result does not depend on how attempts are batched (see `_batch_size`).
    """
    columns = TARGET_COLUMN + 2 * (n_dashes - 1) * DASH_TRIES
    geometries = [_geometry(params, margin) for margin in params.margins]
    capacity = min(len(_target_maps(geometry)) for geometry in geometries)
    record = _TARGET_RECORD.setdefault((params, n_dashes), [0, 0])
    sizes = dict.fromkeys(range(len(rngs)), _batch_size(record, capacity, len(rngs), 0))  # pending: next batch
    spent = dict.fromkeys(sizes, 0)  # attempts made per image
    results: list = [None] * len(rngs)
    while sizes:
        images, counts = [], []
        for image, size in sizes.items():
            if images and sum(counts) + size > capacity:
                break
            images.append(image)
            counts.append(size)
        draws = np.concatenate([rngs[image].random((count, columns)) for image, count in zip(images, counts)])
        owner = np.repeat(images, counts)
        margin_choice = np.repeat(_uniform_index(draws[::TARGET_BLOCK, 0], len(geometries)), TARGET_BLOCK)
        used = {}  # geometry: maps used, put back to the base map whatever happens
        try:
            groups = []
            for choice, geometry in enumerate(geometries):
                rows = np.flatnonzero(margin_choice == choice)
                if rows.size:
                    used[geometry] = rows.size
                    groups.append((rows, _target_attempts(geometry, draws[rows], n_dashes)))
            best = _first_successes(groups, owner)
            first_row = 0
            for image, count in zip(images, counts):
                if image in best:
                    row, attempts, index = best[image]
                    paths = []
                    for path in range(2):
                        kinds, anchors = attempts.dashes(attempts.rows[index : index + 1], path)
                        paths.append(_path(kinds[0], anchors[0]))
                    results[image] = (attempts.geometry, tuple(paths), attempts.occupancy(index))
                    record[0] += row - first_row + 1
                    record[1] += 1
                    del sizes[image]
                else:
                    record[0] += count
                    spent[image] += count
                    if spent[image] >= MAX_TARGET_ATTEMPTS:
                        raise RuntimeError(
                            f"no pair of target paths with {n_dashes} dashes at {params.resolution} px "
                            f"after {spent[image]} attempts"
                        )
                    sizes[image] = _batch_size(record, capacity, len(sizes), count)
                first_row += count
        finally:
            for geometry, count in used.items():
                _target_maps(geometry)[:count] = geometry.packed_base
    return results


def _free_pixels(occupied: np.ndarray, first_byte: int, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pixels uniform over the free pixels of packed maps: pixel floor(u * count) of the free ones in
    increasing order, found by counting free bits per byte rather than listing the free pixels.

    Args:
        occupied: (m, B) packed maps, the bytes from `first_byte` on (those that can hold free pixels).
        uniforms: (m, t) uniforms on [0, 1).

    Returns:
        (pixels, counts): (m, t) flat pixel positions (meaningless where the count is 0) and (m,) number
        of free pixels per map.
    """
    m, width = occupied.shape
    cumulative = _FREE_BITS.take(occupied).cumsum(axis=1, dtype=np.int64)
    counts = cumulative[:, -1]
    ranks = np.minimum((uniforms * counts[:, None]).astype(np.int64), np.maximum(counts - 1, 0)[:, None])
    # one sorted array for all maps: map i's running counts shifted by i * (8 * width + 1)
    shift = (8 * width + 1) * np.arange(m)[:, None]
    flat = (cumulative + shift).ravel()
    found = np.minimum(flat.searchsorted(ranks + shift, side="right"), flat.size - 1)
    byte = found - width * np.arange(m)[:, None]
    before = np.where(byte > 0, flat.take(found - 1) - shift, 0)
    values = occupied.ravel().take(found)
    bits = _FREE_SELECT.take(values.astype(np.intp) * 8 + np.minimum(ranks - before, 7))
    return 8 * (first_byte + byte) + bits, counts


def _grow_distractors(
    geometries: list[_Geometry], occupancies: list[np.ndarray], n_dashes: int, draws: np.ndarray
) -> list[list[_Path]]:
    """Distractor paths of `n_dashes` dashes per image, added to its occupancy map (in place).

    Args:
        geometries, occupancies: per image (maps packed).
        draws: (images, count, DISTRACTOR_TRIES, columns) uniforms: seeding, then growth, per try.

    Returns:
        Per image, the distractors placed (a distractor none of whose tries succeeded is skipped).
    """
    paths: list[list[_Path]] = [[] for _ in occupancies]
    by_geometry: dict[_Geometry, list[int]] = {}
    for image, geometry in enumerate(geometries):
        by_geometry.setdefault(geometry, []).append(image)
    for geometry, images in by_geometry.items():
        occupied = np.stack([occupancies[image] for image in images])
        first_byte, stop_byte = geometry.free_span[0] // 8, -(-geometry.free_span[1] // 8)
        for tries in draws[images].transpose(1, 0, 2, 3):  # distractor k of every image
            seeds = tries[:, :, :SEED_COLUMNS].reshape(len(images), DISTRACTOR_TRIES, SEED_TRIES, 2)
            places = seeds[..., 1].reshape(len(images), DISTRACTOR_TRIES * SEED_TRIES)
            tails, counts = _free_pixels(occupied[:, first_byte:stop_byte], first_byte, places)
            members = np.flatnonzero(counts)
            if members.size == 0:
                break
            rows = tries[members].reshape(len(members) * DISTRACTOR_TRIES, -1)
            attempts = _attempts(geometry, np.repeat(occupied[members], DISTRACTOR_TRIES, axis=0), 1, rows)
            directions = seeds[members, :, :, 0].reshape(len(rows), SEED_TRIES)
            attempts.seed(0, tails[members].reshape(len(rows), SEED_TRIES), directions)
            attempts.grow(SEED_COLUMNS, n_dashes - 1)
            winners, first = np.unique(attempts.rows // DISTRACTOR_TRIES, return_index=True)
            kinds, anchors = attempts.dashes(attempts.rows.take(first), 0)
            for member, index, path_kinds, path_anchors in zip(winners.tolist(), first.tolist(), kinds, anchors):
                occupied[members[member]] = attempts.occupancy(index)
                paths[images[members[member]]].append(_path(path_kinds, path_anchors))
        for index, image in enumerate(images):
            occupancies[image] = occupied[index]
    return paths


def _sample_layouts(params: PathfinderParams, n_dashes: int, rngs: list[np.random.Generator]) -> list[_Layout]:
    """Sample label, margin and all paths of one image per generator; image j depends on rngs[j] only."""
    distractor_length = n_dashes // 3
    count = params.distractor_budget // distractor_length
    columns = SEED_COLUMNS + (distractor_length - 1) * DASH_TRIES
    uniforms = np.stack([rng.random(2 + count * DISTRACTOR_TRIES * columns) for rng in rngs])
    labels = _uniform_index(uniforms[:, 0], 2).tolist()
    origins = _uniform_index(uniforms[:, 1], 2).tolist()
    with _TARGET_MAPS_LOCK:
        targets = _grow_targets(params, n_dashes, rngs)
    geometries = [geometry for geometry, _, _ in targets]
    distractor_draws = uniforms[:, 2:].reshape(len(rngs), count, DISTRACTOR_TRIES, columns)
    distractors = _grow_distractors(geometries, [occupied for _, _, occupied in targets], distractor_length,
                                    distractor_draws)
    return [
        _Layout(geometry, paths, placed, label, origin)
        for (geometry, paths, _), placed, label, origin in zip(targets, distractors, labels, origins)
    ]


def _sample_layout(params: PathfinderParams, n_dashes: int, rng: np.random.Generator) -> _Layout:
    """Sample label, margin and all paths of one image."""
    return _sample_layouts(params, n_dashes, [rng])[0]


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


@functools.lru_cache(maxsize=4096)
def _disk_stamp(radius: float, aa: int, offset_y: float, offset_x: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Antialiased disk of brightness 1 centred `offset` (y, x) away from its anchor pixel: (rows, cols,
    values), rows and cols relative to the anchor."""
    reach = math.ceil(radius) + 1
    centres = _subpixel_centres(reach, aa)
    dy = centres[:, None] - offset_y
    dx = centres[None, :] - offset_x
    disk = _block_mean((dy**2 + dx**2 <= radius**2).astype(float), aa)
    pixels = np.arange(-reach, reach + 1)
    return pixels, pixels, disk


def _draw_disk(image: np.ndarray, centre: np.ndarray, radius: float, aa: int) -> None:
    """Draw an antialiased disk of brightness 1 into `image` (maximum with what is there)."""
    anchor = np.rint(centre).astype(int)
    offset = centre - anchor
    rows, cols, disk = _disk_stamp(radius, aa, float(offset[0]), float(offset[1]))
    rows, cols = rows + anchor[0], cols + anchor[1]
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


def _check_integer(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def _check_pool(pool, resolution: int) -> None:
    _check_integer("pool", pool, 1)
    if resolution % pool:
        raise ValueError(f"pool must divide the resolution {resolution}, got {pool}")


def generate_image(resolution: int, difficulty: str, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Generate one Pathfinder image.

    Args:
        resolution: image side in pixels, a key of ``PRESETS`` (32, 64, 128 or 256).
        difficulty: a key of ``DIFFICULTIES`` ("easy", "intermediate" or "hard").
        rng: the random generator; the image is a deterministic function of its state.

    Returns:
        (image, label): a uint8 array of shape (resolution, resolution) and 1 if both circles lie on
        the same path, else 0.

    Example::

        image, label = generate_image(32, "hard", np.random.default_rng(0))
    """
    _check_choice("resolution", resolution, PRESETS)
    _check_choice("difficulty", difficulty, DIFFICULTIES)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    params = PRESETS[resolution]
    layout = _sample_layout(params, DIFFICULTIES[difficulty], rng)
    return _render(params, layout), layout.label


def pool_images(images: np.ndarray, pool: int) -> np.ndarray:
    """Average uint8 images over pool x pool pixel blocks, rounded to the nearest integer (halves up).

    Args:
        images: uint8 array (n, H, W) with H and W multiples of `pool`.
        pool: block side in pixels, at least 1.

    Returns:
        uint8 array (n, H / pool, W / pool).

    Example::

        small = pool_images(images_256px, 4)  # (n, 64, 64)
    """
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ValueError(f"images must be a uint8 array (n, H, W), got {images.dtype} {images.shape}")
    count, height, width = images.shape
    _check_pool(pool, math.gcd(height, width))
    blocks = images.reshape(count, height // pool, pool, width // pool, pool)
    sums = blocks.sum(axis=(2, 4), dtype=np.uint32)
    area = pool * pool
    return ((2 * sums + area) // (2 * area)).astype(np.uint8)


def _generate_block(task: tuple[int, int, int, str, int, int]) -> tuple[int, np.ndarray, np.ndarray]:
    """Images start .. stop-1 of a dataset, pooled; image i uses np.random.default_rng([seed, i])."""
    start, stop, resolution, difficulty, seed, pool = task
    params = PRESETS[resolution]
    side = resolution // pool
    images = np.empty((stop - start, side, side), dtype=np.uint8)
    labels = np.empty(stop - start, dtype=np.int64)
    for chunk in range(start, stop, LOCKSTEP_IMAGES):
        indices = range(chunk, min(chunk + LOCKSTEP_IMAGES, stop))
        rngs = [np.random.default_rng([seed, index]) for index in indices]
        layouts = _sample_layouts(params, DIFFICULTIES[difficulty], rngs)
        rendered = np.stack([_render(params, layout) for layout in layouts])
        images[chunk - start : chunk - start + len(indices)] = pool_images(rendered, pool) if pool > 1 else rendered
        labels[chunk - start : chunk - start + len(indices)] = [layout.label for layout in layouts]
    return start, images, labels


def _duration(seconds: float) -> str:
    if seconds < 100:
        return f"{seconds:.0f} s"
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


class _Progress:
    """Progress of a generation as plain lines on stderr (no carriage returns, so logs read well).

    A line when another PROGRESS_STEP of the images is done or PROGRESS_SECONDS passed since the last
    one, but not within PROGRESS_GAP seconds of it; and a last line when all are done.
    """

    def __init__(self, total: int, what: str, stream=None, clock=time.perf_counter):
        self.total, self.what, self.stream, self.clock = total, what, stream, clock
        self.started = self.last_time = clock()
        self.last_done = 0

    def update(self, done: int) -> None:
        now = self.clock()
        if done >= self.total:
            elapsed = now - self.started
            rate = f", {done / elapsed:,.0f} images/s" if elapsed > 0 else ""
            self._print(f"{done:,} {self.what} in {elapsed:.1f} s{rate}")
            return
        since = now - self.last_time
        stepped = done - self.last_done >= PROGRESS_STEP * self.total
        if since < PROGRESS_GAP or not (stepped or since >= PROGRESS_SECONDS):
            return
        rate = done / (now - self.started)
        left = f", {_duration((self.total - done) / rate)} left" if rate > 0 else ""
        self._print(f"{done:,}/{self.total:,} {self.what} ({done / self.total:.0%}), {rate:,.0f} images/s{left}")
        self.last_time, self.last_done = now, done

    def _print(self, text: str) -> None:
        print(f"pathfinder: {text}", file=self.stream or sys.stderr, flush=True)


def generate_dataset(
    n: int,
    resolution: int = 32,
    difficulty: str = "easy",
    seed: int = 0,
    workers: int | None = None,
    progress: bool = True,
    pool: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Generate n Pathfinder images in parallel.

    Image i is ``generate_image(resolution, difficulty, np.random.default_rng([seed, i]))``, so the
    result does not depend on the number of workers. Labels are drawn 50/50 per image.

    Args:
        n: number of images (at least 0).
        resolution: image side in pixels (32, 64, 128 or 256).
        difficulty: "easy", "intermediate" or "hard".
        seed: dataset seed (a non-negative integer).
        workers: worker processes (at least 1); default ``os.cpu_count()``; 1 runs in this process.
        progress: print progress lines to stderr (images done, rate, time left; see ``_Progress``).
        pool: average each image over pool x pool pixel blocks (``pool_images``); must divide the
            resolution; 1 keeps full resolution.

    Returns:
        (images, labels): uint8 array (n, resolution / pool, resolution / pool) and int64 array (n,)
        of 0/1.

    Example::

        images, labels = generate_dataset(1000, 256, "hard", seed=0, pool=4)  # (1000, 64, 64)
    """
    _check_integer("n", n, 0)
    _check_choice("resolution", resolution, PRESETS)
    _check_choice("difficulty", difficulty, DIFFICULTIES)
    _check_integer("seed", seed, 0)
    _check_pool(pool, resolution)
    if workers is not None:
        _check_integer("workers", workers, 1)
    workers = workers or os.cpu_count() or 1
    block = max(1, min(256, math.ceil(n / (8 * workers))))
    tasks = [(start, min(start + block, n), resolution, difficulty, seed, pool) for start in range(0, n, block)]
    side = resolution // pool
    images = np.empty((n, side, side), dtype=np.uint8)
    labels = np.empty(n, dtype=np.int64)
    what = f"images of {resolution} px ({difficulty})" + (f" pooled {pool}x{pool}" if pool > 1 else "")
    report = _Progress(n, what) if progress else None
    done = 0

    def collect(results) -> None:
        nonlocal done
        for start, block_images, block_labels in results:
            images[start : start + len(block_labels)] = block_images
            labels[start : start + len(block_labels)] = block_labels
            done += len(block_labels)
            if report:
                report.update(done)

    workers = min(workers, len(tasks))
    if workers <= 1:
        collect(map(_generate_block, tasks))
    else:
        with multiprocessing.Pool(workers) as processes:
            collect(processes.imap_unordered(_generate_block, tasks))
    return images, labels


def _cache_metadata(n: int, resolution: int, difficulty: str, seed: int, pool: int) -> dict:
    """What identifies a cached dataset, in its JSON form."""
    metadata = {
        "n": n,
        "resolution": resolution,
        "difficulty": difficulty,
        "seed": seed,
        "pool": pool,
        "params": asdict(PRESETS[resolution]),
        "generator_version": GENERATOR_VERSION,
    }
    return json.loads(json.dumps(metadata))


def _cache_paths(directory: Path, n: int, resolution: int, difficulty: str, seed: int, pool: int) -> dict[str, Path]:
    stem = f"pathfinder{resolution}_{difficulty}_n{n}_seed{seed}" + (f"_pool{pool}" if pool > 1 else "")
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
    side = expected["resolution"] // expected["pool"]
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
    progress: bool = True,
    pool: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Load a dataset from the disk cache, generating and caching it when missing or stale.

    The cache holds ``<stem>_images.npy`` and ``<stem>_labels.npy`` (uint8) and ``<stem>.json`` with
    n, resolution, difficulty, seed, pool, the preset parameters, the generator version and the seconds
    generation took; it is reused only when that metadata matches. A pooled set has its own files
    (stem ending ``_pool<pool>``); it is made from the full-resolution set when that one is cached,
    else generated (pooled in the workers, so the full-resolution images are never all in memory).

    Args:
        n, resolution, difficulty, seed, workers, progress, pool: as for ``generate_dataset``.
        cache_dir: directory of the cache files (created when missing; ``~`` is expanded).

    Returns:
        (images, labels): uint8 array (n, resolution / pool, resolution / pool) and int64 array (n,).

    Example::

        images, labels = load_or_generate(20_000, 256, "hard", seed=0, pool=4, progress=False)
    """
    _check_integer("n", n, 0)
    _check_choice("resolution", resolution, PRESETS)
    _check_choice("difficulty", difficulty, DIFFICULTIES)
    _check_integer("seed", seed, 0)
    _check_pool(pool, resolution)
    directory = Path(cache_dir).expanduser()
    paths = _cache_paths(directory, n, resolution, difficulty, seed, pool)
    expected = _cache_metadata(n, resolution, difficulty, seed, pool)
    cached = _read_cache(paths, expected)
    if cached is None and pool > 1:
        full_paths = _cache_paths(directory, n, resolution, difficulty, seed, 1)
        full = _read_cache(full_paths, _cache_metadata(n, resolution, difficulty, seed, 1))
        if full is not None:
            cached = pool_images(full[0], pool), full[1]
            _write_cache(paths, {**expected, "seconds": 0.0}, *cached)
    if cached is not None:
        if progress:
            print(f"pathfinder: {n:,} images loaded from {paths['images']}", file=sys.stderr, flush=True)
        return cached
    started = time.perf_counter()
    images, labels = generate_dataset(n, resolution, difficulty, seed, workers, progress, pool)
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
    parser.add_argument(
        "--pool", type=int, default=1,
        help="average over POOL x POOL pixel blocks, e.g. 4 turns 256-px images into 64 px (default 1)",
    )
    parser.add_argument("--cache-dir", default="~/.cache/sparse_flash/pathfinder")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--show", metavar="PNG", help="write a grid of the first 64 images to this file")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"argument -n: must be at least 1, got {args.n}")
    if args.seed < 0:
        parser.error(f"argument --seed: must be non-negative, got {args.seed}")
    if args.workers is not None and args.workers < 1:
        parser.error(f"argument --workers: must be at least 1, got {args.workers}")
    if args.pool < 1 or args.resolution % args.pool:
        parser.error(f"argument --pool: must be at least 1 and divide --resolution {args.resolution}, got {args.pool}")
    cache = Path(args.cache_dir).expanduser()
    existing = next(p for p in (cache, *cache.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f"argument --cache-dir: {args.cache_dir!r} cannot be a folder to write in ({existing} is "
                     f"{'not a folder' if not existing.is_dir() else 'not writable'})")
    if args.show is not None:
        show_path = Path(args.show)
        if show_path.suffix.lower() != ".png" or show_path.is_dir() or not show_path.parent.is_dir():
            parser.error(f"argument --show: must name a .png file in an existing folder, got {args.show!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    started = time.perf_counter()
    images, labels = load_or_generate(
        args.n, args.resolution, args.difficulty, args.seed, args.cache_dir, args.workers,
        progress=not args.quiet, pool=args.pool,
    )
    seconds = time.perf_counter() - started
    side = images.shape[1]
    pooled = f" (pooled {args.pool}x{args.pool} from {args.resolution} px)" if args.pool > 1 else ""
    print(
        f"{len(images)} images of {side}x{side}{pooled} ({args.difficulty}), "
        f"{labels.mean():.1%} label 1, ready in {seconds:.2f} s"
    )
    if args.show:
        show(images[:64], labels[:64], args.show)
        print(f"wrote {args.show}")


if __name__ == "__main__":
    main()
