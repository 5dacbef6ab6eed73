"""Tests of the Pathfinder image generator in demos/pathfinder.py.

Run as a script, ``python tests/test_pathfinder.py --reference OLD_PATHFINDER.py --commit REV`` remakes
the reference statistics in tests/data/pathfinder_stats.json from another version of the generator.
"""

import argparse
import importlib.util
import io
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demos"))

import pathfinder  # noqa: E402

RESOLUTIONS = sorted(pathfinder.PRESETS)


def test_presets_follow_the_lra_table():
    fields = (
        "dash_length", "margins", "thickness", "continuity", "seed_distance", "padding", "marker_radius",
        "path_contrast", "dash_contrast", "distractor_budget", "antialias",
    )
    table = {
        32: (2, (1,), 0.5, 1.0, 7, 1, 1.5, 2.0, 0.75, 20, 2),
        64: (5, (1,), 1.0, 1.8, 12, 1, 2.5, 0.8, 1.0, 22, 2),
        128: (5, (2, 3), 1.5, 1.8, 20, 1, 3.0, 0.9, 1.0, 35, 2),
        256: (5, (3,), 2.0, 1.8, 27, 22, 5.0, 1.0, 1.0, 30, 2),
    }
    for resolution, expected in table.items():
        params = pathfinder.PRESETS[resolution]
        assert params.resolution == resolution
        assert tuple(getattr(params, name) for name in fields) == expected
    assert pathfinder.DIFFICULTIES == {"easy": 6, "intermediate": 9, "hard": 14}


@pytest.mark.parametrize("resolution", RESOLUTIONS, ids=lambda r: f"{r}px")
def test_image_shape_dtype_and_content(resolution):
    image, label = pathfinder.generate_image(resolution, "easy", np.random.default_rng(resolution))
    assert image.shape == (resolution, resolution)
    assert image.dtype == np.uint8
    assert label in (0, 1)
    assert image.max() == 255
    lit = np.count_nonzero(image)
    assert 0.01 * image.size < lit < 0.5 * image.size


@pytest.mark.parametrize("resolution", RESOLUTIONS, ids=lambda r: f"{r}px")
def test_circles_sit_on_target_path_ends(resolution):
    params = pathfinder.PRESETS[resolution]
    layout = pathfinder._sample_layout(params, 6, np.random.default_rng(7))
    image = pathfinder._render(params, layout)
    start, end = pathfinder._circle_positions(layout)
    for centre in (start, end):
        y, x = np.rint(centre).astype(int)
        assert image[y, x] >= 250
    assert layout.geometry.yx(layout.targets[layout.origin].tail) == pytest.approx(start)
    distance = np.linalg.norm(start - end)
    assert distance > params.marker_radius


def test_dataset_is_deterministic_and_independent_of_workers():
    serial = pathfinder.generate_dataset(24, 32, "easy", seed=3, workers=1)
    parallel = pathfinder.generate_dataset(24, 32, "easy", seed=3, workers=2)
    again = pathfinder.generate_dataset(24, 32, "easy", seed=3, workers=1)
    other = pathfinder.generate_dataset(24, 32, "easy", seed=4, workers=1)
    for a, b in zip(serial, parallel):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(serial, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(serial[0], other[0])
    first, label = pathfinder.generate_image(32, "easy", np.random.default_rng([3, 0]))
    np.testing.assert_array_equal(serial[0][0], first)
    assert serial[1][0] == label


@pytest.mark.parametrize("resolution", RESOLUTIONS, ids=lambda r: f"{r}px")
def test_dataset_shapes_and_dtypes(resolution):
    images, labels = pathfinder.generate_dataset(3, resolution, "easy", seed=0, workers=1)
    assert images.shape == (3, resolution, resolution) and images.dtype == np.uint8
    assert labels.shape == (3,) and labels.dtype == np.int64


def test_labels_are_balanced():
    images, labels = pathfinder.generate_dataset(300, 32, "easy", seed=0, workers=2)
    assert set(np.unique(labels)) == {0, 1}
    assert 0.4 < labels.mean() < 0.6
    assert len({image.tobytes() for image in images}) == len(images)


def _dashes_in_creation_order(layout):
    """(path id, index in path, dash) in the order the generator placed them."""
    first, second = layout.targets
    order = []
    for index, (a, b) in enumerate(zip(first.dashes, second.dashes)):
        order += [(0, index, a), (1, index, b)]
    for path_id, path in enumerate(layout.distractors, start=2):
        order += [(path_id, index, dash) for index, dash in enumerate(path.dashes)]
    return order


@pytest.mark.parametrize(
    ("resolution", "difficulty", "count"),
    [(32, "easy", 40), (32, "hard", 10), (64, "easy", 15), (128, "intermediate", 5), (256, "easy", 5)],
)
def test_dashes_avoid_earlier_footprints(resolution, difficulty, count):
    """Every dash stays inside the padding and off the footprints of all earlier dashes except the
    one just before it on its own path."""
    params = pathfinder.PRESETS[resolution]
    n_dashes = pathfinder.DIFFICULTIES[difficulty]
    for image_index in range(count):
        layout = pathfinder._sample_layout(params, n_dashes, np.random.default_rng([11, image_index]))
        geometry = layout.geometry
        assert all(len(path.dashes) == n_dashes for path in layout.targets)
        assert all(len(path.dashes) == n_dashes // 3 for path in layout.distractors)
        placed = _dashes_in_creation_order(layout)
        inks = [set((anchor + geometry.ink_offsets[kind]).tolist()) for _, _, (kind, anchor) in placed]
        footprints = [set((anchor + geometry.footprints[kind]).tolist()) for _, _, (kind, anchor) in placed]
        border = set(np.flatnonzero(geometry.base_occupancy).tolist())
        for later, (path, index, _) in enumerate(placed):
            assert not inks[later] & border
            for earlier in range(later):
                earlier_path, earlier_index, _ = placed[earlier]
                if earlier_path == path and earlier_index == index - 1:
                    continue
                assert not inks[later] & footprints[earlier], (image_index, later, earlier)


def test_consecutive_dashes_follow_the_continuity_rule():
    """Each turn between consecutive dashes stays below 90 degrees / continuity."""
    params = pathfinder.PRESETS[64]
    geometry = pathfinder._geometry(params, params.margins[0])
    headings = np.arctan2(geometry.far_ends[:, 0], geometry.far_ends[:, 1])
    max_turn = np.pi / 2 / params.continuity
    for image_index in range(10):
        layout = pathfinder._sample_layout(params, 9, np.random.default_rng([5, image_index]))
        for path in (*layout.targets, *layout.distractors):
            kinds = [kind for kind, _ in path.dashes]
            turns = np.angle(np.exp(1j * np.diff(headings[kinds])))
            assert np.all(np.abs(turns) < max_turn)


def _must_not_generate(*args, **kwargs):
    raise AssertionError("the cache should have been used")


def test_cache_round_trip(tmp_path, monkeypatch):
    images, labels = pathfinder.load_or_generate(10, 32, "easy", 1, cache_dir=tmp_path, workers=1)
    metadata_files = list(tmp_path.glob("*.json"))
    assert len(metadata_files) == 1
    metadata = json.loads(metadata_files[0].read_text())
    identity = (metadata["n"], metadata["resolution"], metadata["difficulty"], metadata["seed"])
    assert identity == (10, 32, "easy", 1)
    assert metadata["params"]["dash_length"] == 2
    assert metadata["generator_version"] == pathfinder.GENERATOR_VERSION
    assert metadata["seconds"] >= 0
    assert {np.load(path).dtype for path in tmp_path.glob("*.npy")} == {np.dtype(np.uint8)}

    monkeypatch.setattr(pathfinder, "generate_dataset", _must_not_generate)
    cached_images, cached_labels = pathfinder.load_or_generate(10, 32, "easy", 1, cache_dir=tmp_path)
    np.testing.assert_array_equal(cached_images, images)
    np.testing.assert_array_equal(cached_labels, labels)
    assert cached_labels.dtype == np.int64
    monkeypatch.undo()

    metadata["generator_version"] = -1
    metadata_files[0].write_text(json.dumps(metadata))
    regenerated, _ = pathfinder.load_or_generate(10, 32, "easy", 1, cache_dir=tmp_path, workers=1)
    np.testing.assert_array_equal(regenerated, images)
    assert json.loads(metadata_files[0].read_text())["generator_version"] == pathfinder.GENERATOR_VERSION


def test_show_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    images, labels = pathfinder.generate_dataset(5, 32, "easy", seed=0, workers=1)
    path = tmp_path / "grid.png"
    pathfinder.show(images, labels, path, ncols=4)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_command_line(tmp_path, capsys):
    png = tmp_path / "out.png"
    pathfinder.main(
        ["--resolution", "32", "-n", "6", "--workers", "1", "--cache-dir", str(tmp_path), "--show", str(png)]
    )
    assert png.exists()
    assert "6 images of 32x32" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        pathfinder.main(["--resolution", "48"])


@pytest.mark.parametrize("flags, words", [
    (["--cache-dir", "{file}"], "--cache-dir: "), (["--cache-dir", "{file}/x"], "is not a folder"),
    (["--show", "{tmp}/no/such/grid.png"], "--show: must name a .png file"), (["--show", "{tmp}/grid.txt"], "--show"),
    (["--show", "{tmp}"], "--show"),
])
def test_command_line_refuses_output_paths_before_generating(tmp_path, capsys, flags, words):
    """Found by the seventeenth probe: these failed after the images were made, and a folder given to --show
    was reported written while matplotlib wrote another file."""
    (tmp_path / "file").write_text("")
    flags = [f.format(file=tmp_path / "file", tmp=tmp_path) for f in flags]
    with pytest.raises(SystemExit) as stop:
        pathfinder.main(["-n", "2", "--workers", "1", "--cache-dir", str(tmp_path / "cache"), *flags])
    assert stop.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()  # nothing generated


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: pathfinder.generate_image(48, "easy", np.random.default_rng(0)), ValueError, "resolution must be"),
        (lambda: pathfinder.generate_dataset(2, 32, "medium"), ValueError, "difficulty must be one of"),
        (lambda: pathfinder.generate_image(32, "easy", 0), TypeError, "rng must be a numpy.random.Generator, got int"),
        (lambda: pathfinder.generate_dataset(2.0, 32, "easy"), TypeError, "n must be an integer, got float 2.0"),
        (lambda: pathfinder.generate_dataset(-1, 32, "easy"), ValueError, "n must be at least 0, got -1"),
        (lambda: pathfinder.load_or_generate(2, 32, "easy", -3), ValueError, "seed must be at least 0, got -3"),
        (lambda: pathfinder.generate_dataset(2, 32, "easy", workers=0), ValueError, "workers must be at least 1"),
    ],
    ids=["resolution", "difficulty", "rng", "n-type", "n-value", "seed", "workers"],
)
def test_bad_arguments_raise(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ----------------------------------------------------------------------------------------------------
# The batched sampler against the algorithm run one attempt at a time.
# ----------------------------------------------------------------------------------------------------


def _uniform_index(uniform, count):
    return min(int(uniform * count), count - 1)


def _fits(geometry, occupied, kind, anchor):
    return not occupied[anchor + geometry.ink_offsets[kind]].any()


def _mark(geometry, occupied, kind, anchor):
    occupied[anchor + geometry.footprints[kind]] = True


def _seed_one(geometry, occupied, places, directions):
    """The first of the seed tries (tail pixel, direction uniform) whose dash fits, or None."""
    for tail, direction in zip(places, directions):
        kind = len(geometry.candidates) + _uniform_index(direction, 360)
        if _fits(geometry, occupied, kind, int(tail)):
            return [(kind, int(tail))]
    return None


def _next_dash(geometry, seen, head, uniforms):
    """pathfinder.md step 5 for one path: the next dash (kind, anchor) or None, one uniform per try."""
    kind, anchor = head
    centre = anchor + geometry.next_centres[kind]
    cumulative = np.cumsum(geometry.turn_weights[kind] * ~seen[centre + geometry.candidates])
    if cumulative[-1] <= 0:
        return None
    for uniform in uniforms:
        choice = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
        if _fits(geometry, seen, choice, centre):
            return choice, int(centre)
    return None


def _target_attempt(geometry, n_dashes, row):
    """One attempt at the target pair from its row of uniforms: (paths, occupancy) or None."""
    seeds = row[1 : pathfinder.TARGET_COLUMN].reshape(2, pathfinder.SEED_TRIES, 2)
    base = geometry.base_occupancy
    tails = [geometry.target_tails[_uniform_index(u, len(geometry.target_tails))] for u in seeds[0, :, 1]]
    first = _seed_one(geometry, base, tails, seeds[0, :, 0])
    if first is None:
        return None
    seen = base.copy()
    _mark(geometry, seen, *first[0])
    tails = [first[0][1] + geometry.partner_offsets[_uniform_index(u, 360)] for u in seeds[1, :, 1]]
    second = _seed_one(geometry, seen, tails, seeds[1, :, 0])
    if second is None:
        return None
    paths, occupied = (first, second), base.copy()
    column = pathfinder.TARGET_COLUMN
    for _ in range(n_dashes - 1):
        for path, rival in ((0, 1), (1, 0)):
            seen = occupied.copy()
            _mark(geometry, seen, *paths[rival][-1])
            dash = _next_dash(geometry, seen, paths[path][-1], row[column : column + pathfinder.DASH_TRIES])
            column += pathfinder.DASH_TRIES
            if dash is None:
                return None
            _mark(geometry, occupied, *paths[path][-1])
            paths[path].append(dash)
    for path in paths:
        _mark(geometry, occupied, *path[-1])
    return paths, occupied


def _distractor_try(geometry, occupied, free, n_dashes, uniforms):
    """One try at a distractor from its uniforms: (path, occupancy) or None."""
    trial = occupied.copy()
    seeds = uniforms[: pathfinder.SEED_COLUMNS].reshape(pathfinder.SEED_TRIES, 2)
    path = _seed_one(geometry, trial, [free[_uniform_index(u, free.size)] for u in seeds[:, 1]], seeds[:, 0])
    if path is None:
        return None
    for step in range(n_dashes - 1):
        column = pathfinder.SEED_COLUMNS + step * pathfinder.DASH_TRIES
        dash = _next_dash(geometry, trial, path[-1], uniforms[column : column + pathfinder.DASH_TRIES])
        if dash is None:
            return None
        _mark(geometry, trial, *path[-1])
        path.append(dash)
    _mark(geometry, trial, *path[-1])
    return path, trial


def _layout_one_attempt_at_a_time(params, n_dashes, rng):
    """pathfinder.md steps 1-6 read plainly, with the uniforms in the order pathfinder.py reads them:
    (label, origin, geometry, target dashes, distractor dashes)."""
    length = n_dashes // 3
    count = params.distractor_budget // length
    columns = pathfinder.SEED_COLUMNS + (length - 1) * pathfinder.DASH_TRIES
    head = rng.random(2 + count * pathfinder.DISTRACTOR_TRIES * columns)
    attempt, grown = 0, None
    while grown is None:
        row = rng.random(pathfinder.TARGET_COLUMN + 2 * (n_dashes - 1) * pathfinder.DASH_TRIES)
        if attempt % pathfinder.TARGET_BLOCK == 0:
            geometry = pathfinder._geometry(params, params.margins[_uniform_index(row[0], len(params.margins))])
        grown = _target_attempt(geometry, n_dashes, row)
        attempt += 1
    targets, occupied = grown
    distractors = []
    for tries in head[2:].reshape(count, pathfinder.DISTRACTOR_TRIES, columns):
        free = np.flatnonzero(~occupied)
        if free.size == 0:
            break
        for uniforms in tries:
            placed = _distractor_try(geometry, occupied, free, length, uniforms)
            if placed is not None:
                distractors.append(placed[0])
                occupied = placed[1]
                break
    label, origin = _uniform_index(head[0], 2), _uniform_index(head[1], 2)
    return label, origin, geometry, list(targets), distractors


def _layout_summary(layout):
    return (
        layout.label, layout.origin, layout.geometry,
        [path.dashes for path in layout.targets], [path.dashes for path in layout.distractors],
    )


@pytest.mark.parametrize(
    ("resolution", "difficulty", "count"),
    [(32, "easy", 20), (32, "hard", 10), (64, "easy", 10), (64, "intermediate", 3), (128, "easy", 6),
     (128, "hard", 2), (256, "easy", 4), (256, "hard", 4)],
)
def test_batched_sampler_equals_one_attempt_at_a_time(resolution, difficulty, count):
    """Same uniforms, same layouts: the lockstep sampler on bit-packed maps makes exactly the images of
    a plain reading of pathfinder.md (one attempt, one try, one boolean map at a time)."""
    params, n_dashes = pathfinder.PRESETS[resolution], pathfinder.DIFFICULTIES[difficulty]
    layouts = pathfinder._sample_layouts(params, n_dashes, [np.random.default_rng([13, i]) for i in range(count)])
    for index, layout in enumerate(layouts):
        plain = _layout_one_attempt_at_a_time(params, n_dashes, np.random.default_rng([13, index]))
        assert _layout_summary(layout) == plain, index


def test_images_do_not_depend_on_how_attempts_are_batched(monkeypatch):
    params, n_dashes = pathfinder.PRESETS[128], pathfinder.DIFFICULTIES["hard"]  # two margins: blocks matter

    def generators():
        return [np.random.default_rng([17, index]) for index in range(12)]

    together = pathfinder._sample_layouts(params, n_dashes, generators())
    monkeypatch.setattr(pathfinder, "_batch_size", lambda *args: pathfinder.TARGET_BLOCK)
    alone = [pathfinder._sample_layout(params, n_dashes, rng) for rng in generators()]
    assert [_layout_summary(layout) for layout in together] == [_layout_summary(layout) for layout in alone]


def test_an_interrupted_sampler_leaves_its_reusable_maps_clean(monkeypatch):
    params, n_dashes = pathfinder.PRESETS[32], pathfinder.DIFFICULTIES["hard"]
    expected = _layout_summary(pathfinder._sample_layout(params, n_dashes, np.random.default_rng([19, 0])))
    grow = pathfinder._Attempts.grow

    def grow_then_fail(self, *args):
        grow(self, *args)  # the maps now hold dashes
        raise KeyboardInterrupt

    monkeypatch.setattr(pathfinder._Attempts, "grow", grow_then_fail)
    with pytest.raises(KeyboardInterrupt):
        pathfinder._sample_layout(params, n_dashes, np.random.default_rng([19, 0]))
    monkeypatch.undo()
    geometry = pathfinder._geometry(params, params.margins[0])
    assert (pathfinder._target_maps(geometry) == geometry.packed_base).all()
    assert _layout_summary(pathfinder._sample_layout(params, n_dashes, np.random.default_rng([19, 0]))) == expected


def _stamp_pixels(stamps, kind, position):
    """The pixels a stamp sets when anchored at `position`, as a sorted list (with repeats dropped)."""
    indices, masks = stamps.at(np.array([kind]), np.array([position]), 0)
    return sorted({8 * int(byte) + bit for byte, mask in zip(indices[:, 0], masks[:, 0])
                   for bit in range(8) if mask >> bit & 1})


@pytest.mark.parametrize("resolution", RESOLUTIONS, ids=lambda r: f"{r}px")
def test_packed_stamps_are_the_pixel_sets(resolution):
    params = pathfinder.PRESETS[resolution]
    geometry = pathfinder._geometry(params, params.margins[-1])
    centre = (geometry.stride // 2) * geometry.stride + geometry.stride // 2
    n_kinds = len(geometry.footprints)
    for kind in range(0, n_kinds, 7):
        for position in range(centre, centre + 8):
            assert _stamp_pixels(geometry.ink_stamps, kind, position) == sorted(position + geometry.ink_offsets[kind])
            footprint = sorted(position + geometry.footprints[kind])
            assert _stamp_pixels(geometry.footprint_stamps, kind, position) == footprint
            indices, masks = geometry.step_stamps.at(np.array([kind]), np.array([position]), 0)
            candidates = 8 * indices[:, 0] + np.log2(masks[:, 0]).astype(int)
            np.testing.assert_array_equal(candidates, position + geometry.candidates[geometry.step_kinds[:, kind]])


# ----------------------------------------------------------------------------------------------------
# Image statistics against the generator that sampled one attempt at a time (commit f59dcde).
# ----------------------------------------------------------------------------------------------------

REFERENCE = json.loads((Path(__file__).resolve().parent / "data" / "pathfinder_stats.json").read_text())
STATISTIC_IMAGES = 256  # images per case here; the reference has REFERENCE["images"]
# Each mean must lie within STATISTIC_Z standard errors of the difference of two independent means.
# With 12 cases x 10 statistics, an unchanged distribution fails one of them with probability ~1e-3
# (normal tails); a change of a third of a standard deviation in any statistic fails it.
STATISTIC_Z = 4.5


def image_statistics(module, params, layout) -> dict[str, float]:
    """Numbers describing one image of `module` (this generator or another version of it)."""
    geometry = layout.geometry
    image = module._render(params, layout)
    lengths, turns = [], []
    for path in layout.targets:
        kinds = [kind for kind, _ in path.dashes]
        kind, anchor = path.dashes[-1]
        lengths.append(np.linalg.norm(geometry.yx(anchor) + geometry.far_ends[kind] - geometry.yx(path.tail)))
        headings = np.arctan2(geometry.far_ends[kinds, 0], geometry.far_ends[kinds, 1])
        turns.append(np.abs(np.angle(np.exp(1j * np.diff(headings)))).mean())
    start, end = module._circle_positions(layout)
    margin = next(margin for margin in params.margins if module._geometry(params, margin) is geometry)
    return {
        "label": layout.label,
        "lit": np.count_nonzero(image) / image.size,  # fraction of pixels above 0
        "brightness": image.mean() / 255,
        "bright": np.count_nonzero(image >= 128) / image.size,
        "distractors": len(layout.distractors),  # placed, out of budget // (dashes // 3)
        "target_length": np.mean(lengths),  # tail to far end of each target path, pixels
        "circle_distance": np.linalg.norm(start - end),
        "turn": np.degrees(np.mean(turns)),  # mean absolute turn between consecutive target dashes
        "centre_distance": np.linalg.norm(geometry.yx(layout.targets[0].tail) - (params.resolution - 1) / 2),
        "wide_margin": float(margin == max(params.margins)),
    }


def _case_seeds(seed, case, count):
    resolution, difficulty = case.split("/")
    return [np.random.default_rng([seed, int(resolution), len(difficulty), index]) for index in range(count)]


@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=[pytest.mark.slow] if case == "64/hard" else []) for case in REFERENCE["cases"]]
)
def test_image_statistics_match_the_one_attempt_at_a_time_generator(case):
    resolution, difficulty = case.split("/")
    params, n_dashes = pathfinder.PRESETS[int(resolution)], pathfinder.DIFFICULTIES[difficulty]
    layouts = pathfinder._sample_layouts(params, n_dashes, _case_seeds(7, case, STATISTIC_IMAGES))
    rows = [image_statistics(pathfinder, params, layout) for layout in layouts]
    for name, (reference_mean, reference_deviation) in REFERENCE["cases"][case].items():
        values = np.array([row[name] for row in rows], dtype=float)
        error = math.sqrt(reference_deviation**2 / REFERENCE["images"] + values.var(ddof=1) / len(values))
        difference = values.mean() - reference_mean
        assert abs(difference) <= STATISTIC_Z * error + 1e-12, (
            f"{case} {name}: mean {values.mean():.5g} here, {reference_mean:.5g} in the reference "
            f"({difference / error:+.1f} standard errors)"
        )


# ----------------------------------------------------------------------------------------------------
# Speed, pooling, progress.
# ----------------------------------------------------------------------------------------------------

GENEROUS_SECONDS_PER_IMAGE = 0.3  # ten times the 30 ms per image and core the generator is built for


@pytest.mark.slow
@pytest.mark.parametrize("resolution", RESOLUTIONS, ids=lambda r: f"{r}px")
def test_hard_images_are_fast(resolution):
    """A bound, not a benchmark: CPU seconds per hard image in this process, far above the measured
    times (module docstring) and far below the 0.4-0.9 s that 64-px hard images took before."""
    pathfinder.generate_dataset(4, resolution, "hard", seed=1, workers=1, progress=False)  # tables, rates
    started = time.process_time()
    pathfinder.generate_dataset(16, resolution, "hard", seed=2, workers=1, progress=False)
    assert (time.process_time() - started) / 16 < GENEROUS_SECONDS_PER_IMAGE


def test_pool_images_averages_blocks_rounding_halves_up():
    images = np.array([[[0, 1, 0, 0], [1, 1, 1, 0], [0, 1, 255, 255], [0, 0, 255, 254]]], dtype=np.uint8)
    np.testing.assert_array_equal(pathfinder.pool_images(images, 2), [[[1, 0], [0, 255]]])
    np.testing.assert_array_equal(pathfinder.pool_images(images, 1), images)
    np.testing.assert_array_equal(pathfinder.pool_images(images, 4), [[[np.round(images.mean())]]])
    with pytest.raises(ValueError, match="pool must divide the resolution 4, got 3"):
        pathfinder.pool_images(images, 3)
    with pytest.raises(ValueError, match="images must be a uint8 array"):
        pathfinder.pool_images(images.astype(float), 2)


def test_pooled_dataset_is_the_full_one_averaged(tmp_path, monkeypatch):
    full_images, full_labels = pathfinder.generate_dataset(6, 64, "easy", seed=2, workers=1, progress=False)
    images, labels = pathfinder.generate_dataset(6, 64, "easy", seed=2, workers=1, progress=False, pool=4)
    assert images.shape == (6, 16, 16) and images.dtype == np.uint8
    np.testing.assert_array_equal(images, pathfinder.pool_images(full_images, 4))
    np.testing.assert_array_equal(labels, full_labels)

    cached, cached_labels = pathfinder.load_or_generate(6, 64, "easy", 2, tmp_path, workers=1, pool=4)
    np.testing.assert_array_equal(cached, images)
    np.testing.assert_array_equal(cached_labels, labels)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "pathfinder64_easy_n6_seed2_pool4.json", "pathfinder64_easy_n6_seed2_pool4_images.npy",
        "pathfinder64_easy_n6_seed2_pool4_labels.npy",
    ]
    assert json.loads((tmp_path / "pathfinder64_easy_n6_seed2_pool4.json").read_text())["pool"] == 4

    pathfinder.load_or_generate(6, 64, "easy", 3, tmp_path, workers=1)  # full resolution, cached
    monkeypatch.setattr(pathfinder, "generate_dataset", _must_not_generate)
    again, _ = pathfinder.load_or_generate(6, 64, "easy", 2, tmp_path, pool=4)
    np.testing.assert_array_equal(again, images)
    from_full, _ = pathfinder.load_or_generate(6, 64, "easy", 3, tmp_path, pool=4)  # pooled from the full set
    assert from_full.shape == (6, 16, 16)
    assert (tmp_path / "pathfinder64_easy_n6_seed3_pool4_images.npy").exists()


@pytest.mark.parametrize(
    ("pool", "error", "message"),
    [(3, ValueError, "pool must divide the resolution 64, got 3"), (0, ValueError, "pool must be at least 1, got 0"),
     (2.0, TypeError, "pool must be an integer, got float 2.0")],
)
def test_bad_pool_raises(pool, error, message, tmp_path):
    with pytest.raises(error, match=message):
        pathfinder.load_or_generate(2, 64, "easy", 0, tmp_path, pool=pool)
    with pytest.raises(error, match=message):
        pathfinder.generate_dataset(2, 64, "easy", pool=pool)


def test_command_line_pool(tmp_path, capsys):
    pathfinder.main(["--resolution", "64", "-n", "3", "--pool", "4", "--workers", "1", "--cache-dir", str(tmp_path)])
    assert "3 images of 16x16 (pooled 4x4 from 64 px)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        pathfinder.main(["--resolution", "64", "--pool", "3"])
    assert "argument --pool: must be at least 1 and divide --resolution 64, got 3" in capsys.readouterr().err


def test_progress_lines():
    """Plain lines: one per 10% of the images or 30 s, never two within 2 s, and a last one."""
    stream = io.StringIO()
    times = iter([0.0, 1.0, 3.0, 4.0, 40.0, 41.0, 50.0])
    progress = pathfinder._Progress(1000, "images of 32 px (hard)", stream, clock=lambda: next(times))
    for done in (100, 200, 210, 220, 230, 1000):
        progress.update(done)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines == [
        "pathfinder: 200/1,000 images of 32 px (hard) (20%), 67 images/s, 12 s left",
        "pathfinder: 220/1,000 images of 32 px (hard) (22%), 6 images/s, 2m22s left",
        "pathfinder: 1,000 images of 32 px (hard) in 50.0 s, 20 images/s",
    ]


def test_generation_reports_progress_on_stderr_unless_told_not_to(capsys):
    pathfinder.generate_dataset(3, 32, "easy", seed=0, workers=1)
    err = capsys.readouterr().err
    assert err.startswith("pathfinder: 3 images of 32 px (easy) in ") and err.endswith("images/s\n")
    pathfinder.generate_dataset(3, 32, "easy", seed=0, workers=1, progress=False)
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------------------------------
# Remaking the reference statistics.
# ----------------------------------------------------------------------------------------------------


def _reference_statistics(generator_path: str, images: int, commit: str) -> dict:
    spec = importlib.util.spec_from_file_location("pathfinder_reference", generator_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cases = {}
    for resolution in sorted(module.PRESETS):
        for difficulty, n_dashes in module.DIFFICULTIES.items():
            case, params = f"{resolution}/{difficulty}", module.PRESETS[resolution]
            rows = [
                image_statistics(module, params, module._sample_layout(params, n_dashes, rng))
                for rng in _case_seeds(20261201, case, images)
            ]
            cases[case] = {
                name: [float(f"{np.mean(values):.6g}"), float(f"{np.std(values, ddof=1):.6g}")]
                for name, values in ((name, [row[name] for row in rows]) for name in rows[0])
            }
            print(case, "done", file=sys.stderr, flush=True)
    return {"about": REFERENCE["about"], "generator_commit": commit, "images": images, "cases": cases}


def _reference_json(statistics: dict) -> str:
    """The reference as JSON with one statistic per line."""
    lines = ["{"] + [f" {json.dumps(key)}: {json.dumps(statistics[key])}," for key in statistics if key != "cases"]
    cases = []
    for case, stats in statistics["cases"].items():
        rows = ",\n".join(f"   {json.dumps(name)}: {json.dumps(value)}" for name, value in stats.items())
        cases.append(f"  {json.dumps(case)}: {{\n{rows}\n  }}")
    return "\n".join(lines + [' "cases": {', ",\n".join(cases), " }", "}"]) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Remake tests/data/pathfinder_stats.json from a generator file.")
    parser.add_argument("--reference", required=True, help="path of the pathfinder.py to describe")
    parser.add_argument("--commit", required=True, help="the commit that file comes from, recorded in the JSON")
    parser.add_argument("--images", type=int, default=2000, help="images per case (default 2000)")
    args = parser.parse_args()
    statistics = _reference_statistics(args.reference, args.images, args.commit)
    (Path(__file__).resolve().parent / "data" / "pathfinder_stats.json").write_text(_reference_json(statistics))
