"""GET /debug/tree.html: a self-contained page that draws the radix tree.

The page fetches `GET /debug/tree` (a relative URL, so it also works behind a
path prefix) and redraws every 2 s while auto-refresh is on. It always fetches
the whole tree and filters by conversation in the browser, so a node keeps its
fork marker when the view shows one conversation's chain. `?conversation=ID`
preselects the filter, `?refresh=0` starts with auto-refresh off.

No external assets. Every value from the tree reaches the DOM through
`textContent` or an attribute, never `innerHTML`, so previews are escaped.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>radix tree - session-runtime</title>
<style>
  body { font: 13px/1.4 system-ui, sans-serif; margin: 0; color: #222; background: #fafafa; }
  header { position: sticky; top: 0; background: #fff; border-bottom: 1px solid #ddd;
           padding: 8px 16px; display: flex; gap: 16px; align-items: center; flex-wrap: wrap; z-index: 1; }
  header h1 { font-size: 16px; margin: 0; }
  #status { color: #666; }
  #status.error { color: #b00020; font-weight: 600; }
  main { padding: 8px 16px; }
  #legend span { margin-right: 12px; }
  #summary { margin: 6px 0 10px; color: #444; }
  .sw { display: inline-block; width: 10px; height: 10px; border-radius: 2px; vertical-align: -1px; margin-right: 3px; }
  ul.tree, ul.tree ul { list-style: none; margin: 0; padding-left: 22px; }
  ul.tree { padding-left: 0; }
  ul.tree ul { border-left: 1px dotted #bbb; margin-left: 10px; }
  li { margin: 4px 0; }
  .node { display: inline-block; max-width: 100%; box-sizing: border-box; background: #fff;
          border: 1px solid #ccc; border-left: 5px solid var(--res); border-radius: 4px; padding: 3px 8px; }
  .node.locked { background: #fff8e1; border-color: #e0a800; border-left-color: var(--res);
                 box-shadow: 0 0 0 1px #e0a800; }
  .node.res-evicted { opacity: .6; border-style: dashed; }
  .res-device { --res: #2e7d32; } .res-host { --res: #1565c0; } .res-both { --res: #00897b; } .res-evicted { --res: #9e9e9e; }
  .res-other { --res: #7b1fa2; }
  .row > span { margin-right: 8px; white-space: nowrap; }
  .nid { color: #888; font-family: ui-monospace, monospace; }
  .tok { font-weight: 600; }
  .res { color: #fff; background: var(--res); border-radius: 3px; padding: 0 5px; font-size: 11px; }
  .fork-mark { color: #fff; background: #d81b60; border-radius: 3px; padding: 0 5px; font-size: 11px; font-weight: 600; }
  .lock { color: #8a6100; font-weight: 600; }
  .muted { color: #888; }
  .owner { font-family: ui-monospace, monospace; font-size: 11px; border-radius: 3px; padding: 0 4px;
           margin-right: 4px; cursor: pointer; border: 1px solid; }
  .preview { font-family: ui-monospace, monospace; font-size: 12px; color: #333; background: #f3f3f3;
             padding: 1px 4px; margin-top: 2px; white-space: pre-wrap; word-break: break-all; }
  .empty { color: #888; font-style: italic; }
</style>
</head>
<body>
<header>
  <h1>Radix tree</h1>
  <label>conversation <select id="conv"><option value="">all conversations</option></select></label>
  <label><input type="checkbox" id="auto"> auto-refresh (2 s)</label>
  <button id="reload" type="button">refresh now</button>
  <span id="status">loading...</span>
</header>
<main>
  <div id="legend">
    <span><i class="sw res-device" style="background:var(--res)"></i>device</span>
    <span><i class="sw res-host" style="background:var(--res)"></i>host</span>
    <span><i class="sw res-both" style="background:var(--res)"></i>both (device + host copy)</span>
    <span><i class="sw res-evicted" style="background:var(--res)"></i>evicted</span>
    <span><i class="sw" style="background:#fff8e1;border:1px solid #e0a800"></i>locked (held by a chain)</span>
    <span><span class="fork-mark">fork</span> several children</span>
  </div>
  <div id="summary"></div>
  <ul id="tree" class="tree"></ul>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
let filter = params.get("conversation") || "";
let data = null, timer = null, fetches = 0;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = String(text);
  return e;
}

function ownerColor(id) {
  let h = 0;
  for (const c of id) h = (h * 31 + c.charCodeAt(0)) % 360;
  return "hsl(" + h + ",60%,40%)";
}

function nodeBox(n, nChildren) {
  const res = ["device", "host", "both", "evicted"].includes(n.residency) ? n.residency : "other";
  const box = el("div", "node res-" + res);
  box.id = "node-" + n.id;
  box.dataset.id = n.id;
  box.dataset.tokens = n.tokens;
  box.dataset.residency = n.residency;
  box.dataset.children = nChildren;
  if (n.lock_count > 0) box.classList.add("locked");
  if (nChildren > 1) box.classList.add("fork");
  box.title = "namespace: " + (n.namespace || "-") + "\\ndepth: " + n.depth_tokens + " tokens";
  const row = el("div", "row");
  row.append(el("span", "nid", "#" + n.id), el("span", "tok", n.tokens + " tok"),
             el("span", "muted", "depth " + n.depth_tokens));
  if (nChildren > 1) row.append(el("span", "fork-mark", "fork x" + nChildren));
  row.append(el("span", "res", n.residency), el("span", "hits", "hits " + n.hit_count));
  row.append(n.lock_count > 0 ? el("span", "lock", "locked x" + n.lock_count) : el("span", "muted", "unlocked"));
  row.append(el("span", "muted", n.last_access_age_s.toFixed(1) + " s ago"));
  const owners = el("span", "owners");
  if (!n.owners.length) owners.append(el("span", "muted", "no owner"));
  for (const o of n.owners) {
    const chip = el("span", "owner", o);
    chip.style.color = chip.style.borderColor = ownerColor(o);
    chip.title = "show only " + o;
    chip.addEventListener("click", () => setFilter(o));
    owners.append(chip);
  }
  row.append(owners);
  box.append(row, el("div", "preview", n.preview.replace(/\\n/g, "\\u23ce")));
  return box;
}

function render() {
  if (!data) return;
  const children = new Map();  // counted on the whole tree: forks stay marked when filtered
  for (const n of data.nodes) {
    const p = n.parent === null ? "root" : n.parent;
    if (!children.has(p)) children.set(p, []);
    children.get(p).push(n);
  }
  const shown = data.nodes.filter((n) => !filter || n.owners.includes(filter));
  const shownIds = new Set(shown.map((n) => n.id));
  const items = new Map();
  const tree = $("tree");
  tree.replaceChildren();
  for (const n of shown) {  // parents come before children
    const li = el("li");
    li.append(nodeBox(n, (children.get(n.id) || []).length));
    items.set(n.id, li);
    const parent = shownIds.has(n.parent) ? items.get(n.parent) : null;
    if (!parent) { tree.append(li); continue; }
    let ul = parent.querySelector(":scope > ul");
    if (!ul) { ul = el("ul"); parent.append(ul); }
    ul.append(li);
  }
  if (!shown.length) tree.append(el("li", "empty", filter ? "no nodes held by " + filter : "the tree is empty"));
  const tokens = shown.reduce((s, n) => s + n.tokens, 0);
  const locked = shown.filter((n) => n.lock_count > 0).reduce((s, n) => s + n.tokens, 0);
  const forks = shown.filter((n) => (children.get(n.id) || []).length > 1).length;
  $("summary").textContent = (filter ? "conversation " + filter + ": " : "") + shown.length + " nodes, " +
    tokens + " tokens (" + locked + " locked), " + forks + " forks, page size " + data.page_size +
    ", " + Object.keys(data.chains).length + " conversations";
  const sel = $("conv");
  const ids = Object.keys(data.chains);
  if (filter && !ids.includes(filter)) ids.push(filter);
  sel.replaceChildren(new Option("all conversations", ""));
  for (const id of ids) {
    const label = id + (id in data.chains ? " (" + data.chains[id] + " tok)" : " (unknown)");
    sel.append(new Option(label, id, id === filter, id === filter));
  }
}

function setFilter(id) {
  filter = id;
  const q = new URLSearchParams(location.search);
  if (id) q.set("conversation", id); else q.delete("conversation");
  history.replaceState(null, "", location.pathname + (q.toString() ? "?" + q : ""));
  render();
}

async function load() {
  try {
    const r = await fetch("tree", {cache: "no-store"});
    if (!r.ok) throw new Error("GET /debug/tree: HTTP " + r.status);
    data = await r.json();
    fetches += 1;
    document.body.dataset.fetches = fetches;
    render();
    $("status").className = "";
    $("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    $("status").className = "error";
    $("status").textContent = String(e.message || e);
  }
}

function setAuto(on) {
  clearInterval(timer);
  timer = on ? setInterval(load, 2000) : null;
}

$("conv").addEventListener("change", (e) => setFilter(e.target.value));
$("reload").addEventListener("click", load);
$("auto").checked = params.get("refresh") !== "0";
$("auto").addEventListener("change", (e) => setAuto(e.target.checked));
setAuto($("auto").checked);
load();
</script>
</body>
</html>
"""


def tree_page_router() -> APIRouter:
    """The router serving PAGE; include it in the app next to /debug/tree."""
    router = APIRouter()

    @router.get("/debug/tree.html", response_class=HTMLResponse, include_in_schema=False)
    def tree_page() -> HTMLResponse:
        return HTMLResponse(PAGE)

    return router
