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
  box.title = "namespace: " + (n.namespace || "-") + "\ndepth: " + n.depth_tokens + " tokens";
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
  box.append(row, preview(n.preview));
  return box;
}

// Special tokens (DeepSeek's <｜User｜>, Qwen's <|im_start|>, <think>) as labelled
// chips in plain ASCII: readable without a CJK font, and never markup.
const SPECIAL = /(<｜[^｜<>]{1,40}｜>|<\|[A-Za-z_]{1,30}\|>|<\/?think>|<\/?tool_call>|<\/?tool_response>)/;

function preview(text) {
  const box = el("div", "preview");
  for (const part of text.split(SPECIAL)) {
    if (!part) continue;
    if (SPECIAL.test(part)) {
      const label = part.replace(/[<>｜|]/g, "").replace(/▁/g, "_").replace(/^\//, "/");
      const chip = el("span", "chip", label);
      chip.title = part;
      box.append(chip);
    } else {
      box.append(document.createTextNode(part.replace(/\n/g, "\u23ce")));
    }
  }
  return box;
}

function render() {
  if (!data) return;
  renderChains();
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

// ----- the chains view: each conversation's chain as a path through the tree -----

function seg(cls, from, to, scale, label, title) {
  const s = el("div", "seg " + cls);
  s.style.left = (from * scale) + "%";
  s.style.width = Math.max(0.3, (to - from) * scale) + "%";
  if (label) s.append(el("span", "label", label));
  s.title = title || label || "";
  s.dataset.from = from;
  s.dataset.to = to;
  return s;
}

function mark(cls, at, scale, label, title) {
  const m = el("div", "mark " + cls);
  m.style.left = (at * scale) + "%";
  if (label) m.append(el("span", "label", label));
  m.title = title || label || "";
  m.dataset.at = at;
  return m;
}

function reasons(list) {
  const td = el("td");
  if (!list || !list.length) { td.append(el("span", "muted", "-")); return td; }
  for (const r of list) {
    const chip = el("span", "reason " + r.reason, r.reason + " " + r.tokens);
    chip.dataset.reason = r.reason;
    td.append(chip);
  }
  return td;
}

function privateTokens(c) {
  // Past the deepest node of its chain on the device: the chain's private partial page.
  let deepest = 0;
  for (const n of data.nodes) {
    if (n.owners.includes(c.id) && n.residency !== "evicted" && n.residency !== "host") {
      deepest = Math.max(deepest, n.depth_tokens);
    }
  }
  return c.device_tokens ? Math.max(0, c.device_tokens - deepest) : 0;
}

function chainBox(c) {
  const box = el("div", "chain");
  box.id = "chain-" + c.id;
  box.dataset.id = c.id;
  const device = c.device_tokens || 0, host = c.host_tokens || 0;
  const closed = c.turns.filter((t) => t.closed && t.fork !== null);
  const last = closed.length ? closed[closed.length - 1] : null;
  const ghostEnd = last && last.dropped ? last.fork + last.dropped : 0;
  let end = Math.max(device + host, c.sequence_tokens, ghostEnd, 1);
  for (const t of c.turns) for (const s of t.steps) end = Math.max(end, s.prompt_tokens + s.output_tokens);
  const scale = 100 / end;
  const head = el("div", "head");
  head.append(el("span", "owner", c.id), el("span", "tok", device + " tok on the device"),
              el("span", host ? "tok" : "muted", host + " tok on the host"),
              el("span", "muted", "policy " + c.policy + ", offload " + c.offload),
              el("span", "muted", c.state === "tool_wait" ? "waiting for tool results" : c.state));
  head.querySelector(".owner").style.color = ownerColor(c.id);
  box.append(head);

  const bar = el("div", "bar");
  const priv = privateTokens(c);
  if (device - priv > 0) bar.append(seg("device", 0, device - priv, scale, "", "held on the device"));
  if (priv > 0) {
    bar.append(seg("private", device - priv, device, scale, "private page " + priv + " tok",
                   "the chain's partial last page, a private copy no other chain shares"));
  }
  if (host > 0) bar.append(seg("host", device, device + host, scale, "on the host " + host + " tok",
                               "offloaded to the host tier while the tool runs; reloaded before the next step"));
  if (last && last.dropped > 0) {
    const g = seg("ghost", last.fork, last.fork + last.dropped, scale,
                  "dropped " + last.dropped + " tok (" + (last.freed ? "freed" : "left to LRU") + ")",
                  "turn " + last.turn + "'s generated branch past its fork: the reasoning and what followed it");
    g.dataset.dropped = last.dropped;
    bar.append(g);
  }
  if (c.kind === "canonical" && last && last.canonical && device > last.fork) {
    // A stripe over the part of the chain past the fork: the canonical branch.
    const at = new Date(last.canonical.at * 1000).toLocaleTimeString();
    bar.append(seg("canonical", last.fork, device, scale, "canonical branch, built " + at,
                   "the closed history without its reasoning, prefilled in idle time (" +
                   last.canonical.prefill_tokens + " tok) at " + at));
  }
  for (const t of c.turns) {
    t.steps.forEach((s, i) => {
      bar.append(i === 0 ? mark("turn", s.prompt_tokens, scale, "turn " + t.turn, "turn " + t.turn + " starts its output")
                         : mark("step", s.prompt_tokens, scale, "", "turn " + t.turn + ", step " + i));
    });
  }
  for (const t of closed) {
    const m = mark("fork-point", t.fork, scale, "fork t" + t.turn,
                   "turn " + t.turn + " closed: its chain is held up to token " + t.fork);
    m.dataset.turn = t.turn;
    bar.append(m);
  }
  box.append(bar);

  const list = el("ul", "turns-list");
  for (const t of closed) {
    let text = "turn " + t.turn + ": fork at " + t.fork + " tok";
    if (t.dropped) text += ", dropped " + t.dropped + " tok (" + (t.freed ? "freed" : "left to LRU") + ")";
    if (t.canonical) text += ", canonical branch built " + new Date(t.canonical.at * 1000).toLocaleTimeString() +
                             " (" + t.canonical.prefill_tokens + " tok prefilled in idle time)";
    else if (t.materialize) text += "; canonical branch " + t.materialize;
    if (t.auto) text += "; auto " + (t.auto.choice === "keep" ? "kept" : "dropped") + " its reasoning (" +
                        (t.auto.reason === "not_resident" ? "the chain was gone; " : "") + "keep " +
                        t.auto.keep_cost_flops.toExponential(2) + " vs drop " +
                        t.auto.drop_cost_flops.toExponential(2) + " FLOPs)";
    list.append(el("li", "", text));
  }
  if (closed.length) box.append(list);

  const table = el("table", "steps");
  const hr = el("tr");
  for (const h of ["turn.step", "prompt", "reused", "prefilled", "why prefilled"]) hr.append(el("th", "", h));
  table.append(hr);
  for (const t of c.turns) {
    t.steps.forEach((s, i) => {
      const tr = el("tr");
      tr.append(el("td", "", t.turn + "." + i), el("td", "", s.prompt_tokens), el("td", "", s.cached_tokens),
                el("td", "", s.uncached_tokens === null ? "-" : s.uncached_tokens), reasons(s.uncached));
      table.append(tr);
    });
  }
  box.append(table);
  return box;
}

function renderChains() {
  const root = $("chains");
  root.replaceChildren();
  const shown = (data.conversations || []).filter((c) => !filter || c.id === filter);
  for (const c of shown) root.append(chainBox(c));
  if (!shown.length) root.append(el("div", "empty", "no conversation"));
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
