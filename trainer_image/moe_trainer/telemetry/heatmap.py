"""Expert-load heatmap (layers x experts) from a RoutingStats v1 document."""

from __future__ import annotations

from pathlib import Path


def save_heatmap(doc: dict, path: str | Path) -> Path:
    """Colour = load / fair share (1.0 = balanced), so layers of any size read the same way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    load = np.asarray(doc["load"], dtype=np.float64)  # [L, E]
    fair = load.sum(axis=1, keepdims=True) / load.shape[1]
    rel = np.divide(load, fair, out=np.zeros_like(load), where=fair > 0)
    L, E = rel.shape
    fig, ax = plt.subplots(figsize=(max(6.0, min(16.0, 2 + 0.2 * E)), 2.0 + 0.45 * L))
    im = ax.imshow(rel, aspect="auto", cmap="magma", vmin=0, vmax=max(2.0, float(rel.max())))
    ax.set_xlabel("expert (original id)")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(L))
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    mm = rel.max(axis=1)
    ax.set_title(
        f"{doc.get('model', '')}: expert load / fair share, {doc['tokens']} tokens\n"
        f"max/mean per layer: {', '.join(f'{x:.2f}' for x in mm)}",
        fontsize=9,
    )
    fig.colorbar(im, ax=ax, label="load / fair share")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
