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
