"""Tests of the Pathfinder image generator in demos/pathfinder.py."""

import json
import sys
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

    def must_not_generate(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(pathfinder, "generate_dataset", must_not_generate)
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


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="resolution"):
        pathfinder.generate_image(48, "easy", np.random.default_rng(0))
    with pytest.raises(ValueError, match="difficulty"):
        pathfinder.generate_dataset(2, 32, "medium")
