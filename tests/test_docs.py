"""Every docstring example of the package runs and shows what it says (the examples are documentation: one
that no longer holds misleads its reader; `masks.gallery.build`'s said 156 blocks where the mask has 154)."""

import doctest
import importlib
import pkgutil

import pytest
import torch

import sparse_flash

MODULES = sorted(m.name for m in pkgutil.walk_packages(sparse_flash.__path__, "sparse_flash.")
                 if not m.name.endswith("__main__"))  # the command line runs on import
OPTIONAL = {"sparse_flash.plot": "matplotlib", "sparse_flash.masks.gallery": "matplotlib"}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name, tmp_path, monkeypatch, capsys):
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
        import matplotlib

        matplotlib.use("Agg")  # no display
    try:
        module = importlib.import_module(name)
    except ImportError as e:  # Triton or Gluon missing: those modules cannot load here
        pytest.skip(f"{name} does not import here: {e}")
    monkeypatch.chdir(tmp_path)  # examples that save figures write here
    result = doctest.testmod(module, extraglobs={"torch": torch, "sparse_flash": sparse_flash,
                                                 "masks": sparse_flash.masks},
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, capsys.readouterr().out[-4000:]
