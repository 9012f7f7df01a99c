"""GET /debug/tree.html: a page that draws what the cache holds, and why.

Two views of `GET /debug/tree` (fetched by a relative URL, so the page works
behind a path prefix, redrawn every 2 s while auto-refresh is on):

- the chains: each conversation's chain as a path of tokens, held on the
  device, on the host (a tool wait offloaded), or in its private partial
  page; the turns and steps marked where their output began; every closed
  turn's fork point; the branch the last close dropped as a ghost with its
  size (freed, or left to LRU); the canonical branch and when it was built;
  and each step's uncached tokens by reason;
- the tree: the radix tree's nodes with hits, locks, residency and owners;
  a node with several children is marked as a fork.

`?conversation=ID` preselects one conversation, `?refresh=0` starts with
auto-refresh off. The page, its stylesheet and its script are this package's
files, served from /debug/ (no external asset, no inline script or style, so
the Content-Security-Policy allows only this origin). Every value from the
server reaches the DOM through `textContent` or an attribute, never
`innerHTML`; special tokens show as labelled ASCII chips.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

_HERE = files(__name__)
_ASSETS = {
    "tree.html": ("page.html", "text/html; charset=utf-8"),
    "tree.css": ("page.css", "text/css; charset=utf-8"),
    "tree.js": ("page.js", "text/javascript; charset=utf-8"),
}

# The page's own policy: its script, stylesheet and data from this origin only.
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def asset(name: str) -> str:
    return (_HERE / _ASSETS[name][0]).read_text(encoding="utf-8")


def tree_page_router() -> APIRouter:
    """The router serving the page and its assets; include it in the app next to /debug/tree."""
    router = APIRouter()
    for name, (_, media_type) in _ASSETS.items():
        body = asset(name)

        def serve(body: str = body, media_type: str = media_type) -> Response:
            return Response(body, media_type=media_type, headers={"content-security-policy": PAGE_CSP})

        router.add_api_route(f"/debug/{name}", serve, methods=["GET"], include_in_schema=False)
    return router
