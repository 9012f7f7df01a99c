"""Private partial last pages: a chain's KV past its last full page.

The tree caches whole pages only (reuse across conversations is page aligned,
as SGLang's). The tokens a conversation's last step wrote past its last full
page stay attached to its chain instead of going back to the pool: the page
is held by that chain alone (neither in the tree nor free), and the
conversation's next step reuses its head, so its own continuation recomputes
nothing at any page size. Positions map to page offsets (p % page_size), so a
step that continues the tail writes into the rest of the same page.

At a fork inside a page (a turn dropped its reasoning), the valid head of that
page (same positions, same prefix) is copied into a fresh private page, so
the canonical branch starts from the exact fork point.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Optional

import torch

from radix_ext.kv_layout import layout_of


@dataclass(frozen=True)
class PrivateTail:
    """`tokens` (fewer than a page) follow the chain's node; their KV is the
    head of `page` (all page_size slots, in position order)."""

    tokens: array
    page: torch.Tensor

    @property
    def slots(self) -> torch.Tensor:
        return self.page[: len(self.tokens)]

    def head(self, k: int) -> "PrivateTail":
        return self if k == len(self.tokens) else PrivateTail(self.tokens[:k], self.page)


def common_length(a: array, b, start: int, limit: int) -> int:
    """How many of a's tokens equal b[start:limit], from the front."""
    n = min(len(a), max(0, limit - start))
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


def page_of(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The whole page whose head `slots` are (they start at a page boundary),
    computed where the slots are: on a GPU no value is read back to the host,
    so a finishing request does not synchronize the scheduler's thread
    (`check_tail`, in the integrity check, asserts the page is whole)."""
    return slots[:1] + torch.arange(page_size, dtype=slots.dtype, device=slots.device)


def copy_slots(kv_pool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the KV of `src` slots into `dst` slots, every layer, inside one of
    SGLang's pools (any layout of `kv_layout`). The bytes are the pool's own:
    exact. Raises UnsupportedLayout."""
    layout_of(kv_pool).copy_slots(src, dst)


def check_tail(owner: str, tail: Optional[PrivateTail], page_size: int) -> None:
    if tail is None:
        return
    assert 0 < len(tail.tokens) < page_size, f"tail of {owner} holds {len(tail.tokens)} tokens"
    assert len(tail.page) == page_size, f"tail page of {owner} is {len(tail.page)} slots"
    first = int(tail.page[0])
    assert first % page_size == 0 and tail.page.tolist() == list(range(first, first + page_size)), (
        f"tail page of {owner} is not one whole page")
