"""A PNG of each request's prompt composition under keep and under drop."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from session_runtime.replay.composition import CATEGORIES, Composition, ReasoningShare

COLORS = {"system": "#7f7f7f", "user": "#1f77b4", "reasoning": "#d62728", "answer": "#2ca02c",
          "tool_call": "#ff7f0e", "tool_result": "#9467bd", "markup": "#c7c7c7"}


def plot_composition(path: str | Path, title: str, compositions: Mapping[str, Sequence[Composition]],
                     shares: Mapping[str, ReasoningShare]) -> None:
    """Stacked bars, one per request (labelled turn.step, 1-based), one panel per
    rendering (keep, drop) on a shared token axis; written with matplotlib's Agg
    backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(compositions)
    fig, axes = plt.subplots(len(names), 1, figsize=(max(6.0, 0.35 * max(len(v) for v in compositions.values()) + 2),
                                                     3.2 * len(names)), sharex=True, sharey=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        comps = compositions[name]
        x = range(len(comps))
        bottom = [0] * len(comps)
        for cat in CATEGORIES:
            heights = [getattr(c, cat) for c in comps]
            ax.bar(x, heights, bottom=bottom, color=COLORS[cat], label=cat, width=0.8)
            bottom = [b + h for b, h in zip(bottom, heights)]
        share = shares[name]
        ax.set_title(f"{name}: reasoning {share.last_view:.1%} of the last request (lastView), "
                     f"{share.burden:.1%} of all requests' tokens (burden)", fontsize=8)
        ax.set_ylabel("prompt tokens")
        ax.set_xticks(list(x), [f"{c.turn + 1}.{c.step + 1}" for c in comps], rotation=90, fontsize=7)
    axes[-1, 0].set_xlabel("request (turn.step)")
    axes[0, 0].legend(loc="upper left", fontsize=7, ncol=4)
    fig.suptitle(f"prompt composition per request: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
