"""The kernels: Triton (`triton/`) and Gluon (`gluon/`) families, the one place that picks between them
(`dispatch.py`), the one place that holds their switches (`settings.py`), launches and plans (`launch.py`),
host-side scheduling of the Gluon kernels' work (`schedule.py`), autograd (`function.py`) and custom ops
(`ops.py`). Internal: the public entry points are in `sparse_flash.api`.

Importing this package loads nothing heavy; `attention_triton` and `BlockSparseAttentionFunction` load Triton
on first use.
"""

__all__ = ["BlockSparseAttentionFunction", "attention_triton"]


def __getattr__(name):
    if name in __all__:
        from . import function

        return getattr(function, name)
    raise AttributeError(f"module 'sparse_flash.kernels' has no attribute {name!r}")
