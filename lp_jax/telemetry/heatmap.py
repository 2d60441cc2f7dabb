"""The SQNR heatmap: one row per (layer, Linear), one column per GEMM operand.

Written as a PNG by ``python -m lp_jax.inspect`` and sent to TensorBoard as an image by the
training probe. Needs matplotlib (``pip install lp_jax[report]``); ``available()`` says
whether it is there.
"""
from __future__ import annotations

import numpy as np


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def sqnr_figure(values, row_labels, col_labels, title: str):
    """A matplotlib Figure of ``values`` [rows, cols] (dB; NaN cells, such as BF16 layers
    with nothing to show, are blank; infinite SQNR is drawn as the largest finite value)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    values = np.asarray(values, np.float64)
    finite = values[np.isfinite(values)]
    top = float(finite.max()) if finite.size else 1.0
    bottom = float(finite.min()) if finite.size else 0.0
    shown = np.where(np.isposinf(values), top, np.where(np.isneginf(values), bottom, values))
    height = 1.2 + 0.22 * len(row_labels)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(col_labels), height), dpi=100)
    image = ax.imshow(np.ma.masked_invalid(shown), aspect="auto", cmap="viridis",
                      vmin=bottom, vmax=max(top, bottom + 1e-6))
    ax.set_xticks(range(len(col_labels)), col_labels, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(row_labels)), row_labels, fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="SQNR (dB)")
    fig.tight_layout()
    return fig


def save_png(fig, path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)


def rgb_array(fig) -> np.ndarray:
    """[H, W, 3] uint8 pixels of the figure (for TensorBoard's add_image)."""
    import matplotlib.pyplot as plt

    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return pixels
