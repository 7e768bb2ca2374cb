"""The run page's loss curve as a PNG, drawn server-side with matplotlib (Agg: no display, no
script from the internet). Fixed size and metadata, so one log draws the same bytes."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

SIZE_IN = (7.0, 3.2)
DPI = 100
# Bump when ``loss_png`` draws differently: the run page's plot ETag (operators/ui.py), and so
# browsers' and the app's kept copies, follow it.
PLOT_VERSION = 1


def loss_png(points: Sequence[tuple[int, float]], title: str = "training loss") -> bytes:
    """``points``: (step, loss). An empty or all-NaN curve still draws, saying so, so the page
    never shows a broken image."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE_IN, dpi=DPI)
    ax = fig.add_subplot()
    finite = [(s, v) for s, v in points if math.isfinite(v)]
    if finite:
        steps, losses = zip(*finite, strict=True)
        ax.plot(steps, losses, color="#1f6feb", linewidth=1.4)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, "no loss logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()
