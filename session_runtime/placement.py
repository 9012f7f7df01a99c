"""Where a conversation lives: consistent hashing with bounded loads.

Pure functions of the state they read, so the runtime and the scale simulator
(`bench/scale_sim.py`) make the same decisions. A conversation is placed once,
at creation (or when its worker dies or drains): walk the hash ring clockwise
from the conversation's point and take the first live worker whose load stays
within `ceil((1 + epsilon) * (total + 1) / live)` (Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018). The same id lands
on the same worker while the set of workers stays the same, and no worker ever
holds more than (1 + epsilon) times the mean.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from typing import Mapping, Optional, Sequence

VNODES = 64  # ring points per worker: spreads each worker's arcs


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def ring(workers: Sequence[str], vnodes: int = VNODES) -> list[tuple[int, str]]:
    """The hash ring: (point, worker), sorted by point."""
    return sorted((_point(f"{w}#{i}"), w) for w in workers for i in range(vnodes))


def bound(total: int, live: int, epsilon: float) -> int:
    """The most conversations one live worker may hold once one more is placed."""
    return max(1, math.ceil((1 + epsilon) * (total + 1) / live))


def place(key: str, loads: Mapping[str, int], epsilon: float = 0.25,
          points: Optional[list[tuple[int, str]]] = None) -> str:
    """The worker for `key` among the live workers in `loads` (worker -> how many
    conversations it holds). Raises ValueError when no worker is live."""
    if not loads:
        raise ValueError("no live worker")
    points = points if points is not None else ring(sorted(loads))
    cap = bound(sum(loads.values()), len(loads), epsilon)
    start = bisect.bisect_left(points, (_point(key), ""))
    for k in range(len(points)):
        worker = points[(start + k) % len(points)][1]
        if worker in loads and loads[worker] + 1 <= cap:
            return worker
    return min(loads, key=lambda w: (loads[w], w))  # unreachable: the cap leaves room somewhere


def round_robin(counter: int, workers: Sequence[str]) -> str:
    """The baseline the simulator compares against."""
    return workers[counter % len(workers)]
