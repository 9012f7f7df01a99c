"""Where every benchmark writes: JSON plus a PNG under bench/results/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parent / "results"


def write_report(name: str, result: dict, plot: Callable[[dict, Path], None]) -> tuple[Path, Path]:
    """Write results/NAME.json and draw results/NAME.png; returns both paths."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    js, png = RESULTS / f"{name}.json", RESULTS / f"{name}.png"
    js.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, png)
    return js, png


def plot_backends(result: dict, path: Path, panels: Callable, title: str, width: float = 18) -> None:
    """One row of three panels per backend in result["backends"]; `panels(axes, part, name)` draws a row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = result["backends"]
    fig, axes = plt.subplots(len(backends), 3, figsize=(width, 5.2 * len(backends)), squeeze=False)
    for row, (name, part) in zip(axes, backends.items()):
        panels(row, part, name)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
