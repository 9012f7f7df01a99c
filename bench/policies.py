"""Reasoning-policy benchmark: one seeded multi-turn agent trace replayed under five policies, on both backends.

    .venv/bin/python bench/policies.py [--backend both|embedded|sglang] [--device cpu|cuda] [--turns 8] [--seed 0]
                                       [--page-size 16] [--scale 1] [--reps 2]

Writes bench/results/policies.json and bench/results/policies.png. Every output
is forced from a seeded generator (reasoning and answers are built from words
that are one DeepSeek token each), so all policies replay the identical trace.
On the embedded engine each conversation has its own Runtime (no shared tree);
on SGLang's server (launched once, `--radix-cache-backend session`, the `tiny`
preset's weights) all conversations share one Runtime, each under its own
tenant, so each has its own namespace and its tree figures are its namespace's
nodes. On either, all conversations live at once and are played turn by turn in
a rotating order, so load from other jobs hits every policy alike. keep and
drop+always (the TTFT target's pair) get `--reps` conversations each; their
per-turn TTFTs are medians over those. Under drop+always, `run_pending()` after
each turn stands for the idle time between turns and is timed separately (on
SGLang it runs the canonical branch as a low-priority prefill-only request). A
short page_size=1 replay (embedded only: it needs its own pool) checks that
tool-chain steps recompute strictly nothing without any page in the way; at
page 16 the private partial last page gives the same 0 on both backends.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import torch

from session_runtime.config import RuntimeConfig
from session_runtime.runtime import Runtime
from session_runtime.templates import ToolCall, build_template
from session_runtime.tokenizer import load_tokenizer

from report import RESULTS, plot_backends, write_report  # noqa: E402  (bench/ is on sys.path when run)
WORDS = ("alpha beta gamma delta search file result check value plan step code test data model cache "
         "token query answer error path read write list node tree page time").split()
TOOLS = [{"name": n, "description": f"{n} over the workspace",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
         for n in ("search", "read_file", "run_tests")]
POLICIES = {  # label -> create_conversation kwargs
    "keep": {"policy": "keep"},
    "drop_lazy": {"policy": "drop", "materialize": "never"},
    "drop_materialize": {"policy": "drop", "materialize": "always"},
    "engine_default": {"policy": "engine_default"},
    "strip_thinking_cache": {"policy": "strip_thinking_cache"},
}
TTFT_PAIR, TTFT_LIMIT, KV_SLACK = ("keep", "drop_materialize"), 1.2, 0.03


def words(rng: random.Random, n: int) -> str:
    """n words, each exactly one token (checked in make_trace)."""
    return "".join(" " + rng.choice(WORDS) for _ in range(n))


def make_trace(args, tpl) -> dict:
    """The seeded agent: per turn a user message, 2-4 tool steps and a final answer.
    `tokens` bounds the keep sequence (all reasoning replayed) from above."""
    assert all(len(tpl.tok.encode(" " + w)) == 1 for w in WORDS)
    rng, s = random.Random(args.seed), args.scale
    size = lambda lo, hi: rng.randint(round(lo * s), round(hi * s))  # noqa: E731
    system = "You are a careful coding agent." + words(rng, size(1000, 1000))
    turns, tokens = [], len(tpl.tok.encode(system)) + 2048
    for _ in range(args.turns):
        calls = rng.randint(2, 4)
        steps, results, sizes = [], [], []
        for k in range(calls + 1):
            tc = [] if k == calls else [{"name": rng.choice(TOOLS)["name"], "arguments": {"query": words(rng, size(3, 8)).strip()}}]
            markup = len(tpl.forced_ids("", "", [ToolCall("", c["name"], c["arguments"]) for c in tc])) - 2
            content = words(rng, max(size(20, 60) - markup, 2))
            a = len(tpl.forced_ids("", content, [ToolCall("", c["name"], c["arguments"]) for c in tc])) - 2
            r = round(rng.uniform(5, 20) * a)
            steps.append({"reasoning": words(rng, r), "content": content, "tool_calls": tc})
            sizes.append({"answer_tokens": a, "reasoning_tokens": r})
            if k < calls:
                results.append(words(rng, size(20, 80)))
        turns.append({"user": "Next:" + words(rng, size(10, 30)), "steps": steps, "results": results, "sizes": sizes})
        tokens += 40 + sum(x["reasoning_tokens"] + x["answer_tokens"] + 8 for x in sizes) + sum(len(x.split()) + 16 for x in results)
    return {"system": system, "turns": turns, "tokens": tokens}


def build_runtime(args, page_size: int, tokens: int, backend: str = "embedded", conversations: int = 1) -> Runtime:
    # Room for both branches of every conversation: nothing is ever evicted.
    pool = -(-3 * tokens * conversations // page_size) * page_size + 16384
    # `tokens` bounds the keep sequence from above; SGLang refuses a context past the model's (40,960 for tiny).
    context = 2 * tokens + 4096 if backend == "embedded" else tokens + 4096
    return Runtime(RuntimeConfig(model="tiny", backend=backend, device=args.device, page_size=page_size,
                                 pool_tokens=pool, max_context=context, data_dir=None, offload="never",
                                 idle_ttl_s=0), background=False)


def tree_tokens(rt: Runtime, cid: str) -> int:
    """Device-resident tree tokens in the conversation's namespace (its tenant's)."""
    ns = rt.namespace(rt.get(cid))
    return sum(n.tokens for n in rt.backend.snapshot(lambda ids: "")
               if n.residency in ("device", "both") and (n.namespace, n.cache_salt) == (ns.extra_key, ns.cache_salt))


def stale_tokens(rt: Runtime, cid: str, total: int) -> int:
    """Tree tokens that the next turn's canonical prompt cannot reuse."""
    conv = rt.get(cid)
    tpl = rt.template(conv.template)
    ids = tpl.render(conv.system, conv.tools, conv.history, conv.policy.kept_turns(conv.closed_turns), False).ids
    return total - rt.backend.probe(rt.namespace(conv), ids + [0]).device_len


class Replay:
    """One conversation, in its own Runtime or under its own tenant in a shared
    one (`rt`), fed the trace a turn at a time."""

    def __init__(self, args, label: str, trace: dict, page_size: int, tokens: int, rt: Runtime = None,
                 tenant: str = None):
        self.label, self.rows, self.owns_runtime = label, [], rt is None
        self.rt = build_runtime(args, page_size, tokens) if rt is None else rt
        # offload=never: the host tier stays out of this comparison (the pool never fills anyway)
        self.cid = self.rt.create_conversation(trace["system"], tools=TOOLS, offload="never", tenant=tenant,
                                               **POLICIES[label])

    def turn(self, turn: dict) -> None:
        rt, cid = self.rt, self.cid
        ps, bpt = rt.config.page_size, rt.backend.bytes_per_token
        step = rt.send_message(cid, turn["user"], max_tokens=1, forced=turn["steps"][0])
        accs = [step.accounting]
        for result, forced in zip(turn["results"], turn["steps"][1:]):
            call = step.tool_calls[0]["id"]
            step = rt.send_tool_results(cid, [{"tool_call_id": call, "content": result}], max_tokens=1, forced=forced)
            accs.append(step.accounting)
        assert step.finish_reason == "forced" and not step.tool_calls
        before = rt.materializer.stats["prefill_tokens"]
        t = time.perf_counter()
        jobs = rt.materializer.run_pending()  # the idle time between turns
        idle_ms = (time.perf_counter() - t) * 1e3
        tool = [{"uncached": a.uncached_prefill_tokens, "recomputed": a.recomputed_history_tokens,
                 "new": a.prompt_tokens - p.active_context_length, "tail": p.active_context_length % ps}
                for p, a in zip(accs, accs[1:])]
        cf = accs[0].counterfactual or {}
        # The chain's tree part is whole pages; its private partial last page is not a tree node.
        held = rt.backend.chain_tokens(cid)
        private = held % ps
        total, chain = tree_tokens(rt, cid), held - private
        self.rows.append({
            "prefill_tokens": sum(a.uncached_prefill_tokens for a in accs),
            "first_step_prefill": accs[0].uncached_prefill_tokens, "ttft_ms": accs[0].ttft_ms,
            "tool_chain_prefill": sum(x["uncached"] for x in tool),
            "tool_chain_recomputed": sum(x["recomputed"] for x in tool), "tool_steps": tool,
            "idle_jobs": jobs, "idle_prefill_tokens": rt.materializer.stats["prefill_tokens"] - before,
            "idle_ms": idle_ms, "peak_kv_bytes": max(a.kv_device_bytes for a in accs),
            "chain_bytes": (chain + private) * bpt, "tree_bytes": total * bpt, "orphaned_bytes": (total - chain) * bpt,
            "private_page_tokens": private, "device_pages": total // ps + (1 if private else 0),
            "stale_bytes": stale_tokens(rt, cid, total) * bpt, "cache_state": accs[0].cache_state,
            "counterfactual_prefill": {k: v["prefill_tokens"] for k, v in cf.items()},
        })

    def finish(self) -> dict:
        rows, d = self.rows, self.rt.describe(self.cid)
        for row, t in zip(rows, d["turns"]):
            row["materialized_prefill_tokens"] = t["materialized_prefill_tokens"]  # set when the next turn claims the job
        self.rt.check_integrity()
        if self.owns_runtime:
            self.rt.close()
        return {"turns": rows, "final_kv_bytes": d["chain"]["kv_device_bytes"],
                "final_sequence_tokens": d["chain"]["sequence_tokens"], "final_tree_bytes": rows[-1]["tree_bytes"],
                "final_orphaned_bytes": rows[-1]["orphaned_bytes"], "final_stale_bytes": rows[-1]["stale_bytes"],
                "peak_kv_bytes": max(r["peak_kv_bytes"] for r in rows)}


def play(replays: list[Replay], trace: dict) -> dict[str, list[dict]]:
    """Turn by turn, each conversation in a rotating order, so CPU noise from other
    jobs hits every policy alike. Returns each label's results, in replica order."""
    for i, turn in enumerate(trace["turns"]):
        t, k = time.perf_counter(), i % len(replays)
        for r in replays[k:] + replays[:k]:
            r.turn(turn)
        print(f"turn {i} done for {len(replays)} conversations ({time.perf_counter() - t:.1f}s)", flush=True)
    out: dict[str, list[dict]] = {}
    for r in replays:
        out.setdefault(r.label, []).append(r.finish())
    return out


def summarize(reps: list[dict]) -> dict:
    """Token counts from the first repetition (checked identical); TTFT and idle time as medians."""
    out = reps[0]
    strip = lambda r: [{k: v for k, v in t.items() if k not in ("ttft_ms", "idle_ms")} for t in r["turns"]]  # noqa: E731
    out["deterministic"] = all(strip(r) == strip(out) for r in reps)
    for i, row in enumerate(out["turns"]):
        row["ttft_ms_reps"] = [r["turns"][i]["ttft_ms"] for r in reps]
        row["ttft_ms"] = statistics.median(row["ttft_ms_reps"])
        row["idle_ms"] = statistics.median(r["turns"][i]["idle_ms"] for r in reps)
    t = out["turns"]
    out["totals"] = {k: sum(r[k] for r in t) for k in ("prefill_tokens", "first_step_prefill", "tool_chain_prefill",
                                                        "tool_chain_recomputed", "idle_prefill_tokens", "idle_ms")}
    out["next_turn_ttft_median_ms"] = statistics.median(r["ttft_ms"] for r in t[1:])
    return out


def targets(res: dict, trace: dict, strict: dict = None) -> dict:
    """The issue's targets; `strict` (the page-1 replay) is embedded only."""
    keep, dm, ed, st = (res[k] for k in ("keep", "drop_materialize", "engine_default", "strip_thinking_cache"))
    steps = [s for t in trace["turns"] for s in t["sizes"]]
    dropped = sum(s["reasoning_tokens"] + 1 for s in steps)  # R plus the <think> marker, per step
    expected = 1 - dropped / keep["final_sequence_tokens"]
    ttft = dm["next_turn_ttft_median_ms"] / keep["next_turn_ttft_median_ms"]
    paired = statistics.median(d["ttft_ms"] / k["ttft_ms"] for d, k in zip(dm["turns"][1:], keep["turns"][1:]))
    first = {p: statistics.median(t["first_step_prefill"] for t in res[p]["turns"][1:]) for p in TTFT_PAIR}
    kv = dm["final_kv_bytes"] / keep["final_kv_bytes"]
    dm_tool = [x for t in dm["turns"] for x in t["tool_steps"]]
    st_tool = [x for t in st["turns"] for x in t["tool_steps"]]
    strict_dm = [x["recomputed"] for t in strict["drop_materialize"]["turns"] for x in t["tool_steps"]] if strict else []
    strict_st = [x["recomputed"] for t in strict["strip_thinking_cache"]["turns"] for x in t["tool_steps"]] if strict else [1]
    only_tail = all(x["recomputed"] == x["tail"] and x["uncached"] == x["new"] + x["tail"] for x in dm_tool)
    return {
        "ttft_and_kv": {"ttft_ratio": ttft, "ttft_limit": TTFT_LIMIT, "ttft_ratio_paired_median": paired,
                        "ttft_ms": {p: res[p]["next_turn_ttft_median_ms"] for p in TTFT_PAIR},
                        "first_step_prefill_median": first, "kv_ratio": kv, "kv_ratio_expected": expected,
                        "reasoning_share_of_keep_context": dropped / keep["final_sequence_tokens"],
                        "met": ttft <= TTFT_LIMIT and kv < 1 and abs(kv - expected) <= KV_SLACK},
        "tool_chain_no_recompute": {
            "drop_materialize_recomputed": [x["recomputed"] for x in dm_tool],
            "drop_materialize_page_tails": [x["tail"] for x in dm_tool],
            "met_strict_at_page_size": all(x["recomputed"] == 0 for x in dm_tool),
            "met_modulo_page_tail": only_tail,
            "page1_drop_materialize_recomputed": strict_dm if strict else None,
            "page1_strip_recomputed": strict_st if strict else None,
            "strip_recomputed": [x["recomputed"] for x in st_tool],
            "met": all(x["recomputed"] == 0 for x in dm_tool) and not any(strict_dm)
                   and all(x > 0 for x in strict_st) and all(x["recomputed"] > 0 for x in st_tool)},
        "zero_orphans_for_dropping_policies": {
            p: {"final_orphaned_bytes": res[p]["final_orphaned_bytes"],
                "max_orphaned_bytes": max(t["orphaned_bytes"] for t in res[p]["turns"])}
            for p in ("drop_lazy", "drop_materialize")} | {
            "met": all(max(t["orphaned_bytes"] for t in res[p]["turns"]) == 0 for p in ("drop_lazy", "drop_materialize"))},
        "engine_default_orphaned": {"orphaned_bytes": ed["final_orphaned_bytes"], "stale_bytes": ed["final_stale_bytes"],
                                    "met": ed["final_orphaned_bytes"] > 0 and ed["final_stale_bytes"] > 0},
    }


def plot(result: dict, path: Path) -> None:
    cfg = result["config"]
    plot_backends(result, path, panels, title=(
        f"reasoning policies on {result['device']}: {cfg['turns']} turns, page {cfg['page_size']}, "
        f"scale {cfg['scale']}, seed {cfg['seed']}"))


def panels(axes, part: dict, backend: str) -> None:
    a, b, c = axes
    res, labels = part["policies"], list(part["policies"])
    bottom = [0] * len(labels)
    for key, name in (("first_step_prefill", "first step (user msg)"), ("tool_chain_prefill", "tool-chain steps"),
                      ("idle_prefill_tokens", "idle-time materialization")):
        vals = [res[p]["totals"][key] for p in labels]
        a.bar(labels, vals, bottom=bottom, label=name)
        bottom = [x + v for x, v in zip(bottom, vals)]
    for i, v in enumerate(bottom):
        a.annotate(f"{v:,}", (i, v), ha="center", va="bottom", fontsize=8)
    a.set_ylim(0, max(bottom) * 1.1)
    a.set_ylabel("prefill tokens (all turns)")
    a.set_title(f"[{backend}] (a) prefill tokens by where they are spent")
    a.legend(fontsize=8)
    for p in labels:
        b.plot(range(1, len(res[p]["turns"]) + 1), [t["ttft_ms"] for t in res[p]["turns"]], marker="o", label=p)
    b.set_yscale("log")
    b.set_xlabel("turn")
    b.set_ylabel("TTFT of the turn's first step, ms (log)")
    b.set_title(f"[{backend}] (b) next-turn TTFT (" + ", ".join(
        f"{p} median of {n}" for p, n in part["reps"].items() if n > 1) + ")", fontsize=10)
    b.xaxis.get_major_locator().set_params(integer=True)
    b.legend(fontsize=8, loc="upper right")
    mib, x, w = 2 ** 20, range(len(labels)), 0.27
    for j, (key, name) in enumerate((("final_kv_bytes", "final chain (locked)"), ("final_orphaned_bytes", "orphaned (tree - chain)"),
                                     ("final_stale_bytes", "not reusable next turn"))):
        c.bar([i + (j - 1) * w for i in x], [res[p][key] / mib for p in labels], w, label=name)
    c.set_xticks(list(x), labels)
    c.set_ylabel("KV MiB after the last turn")
    c.set_title(f"[{backend}] (c) KV held vs orphaned")
    c.legend(fontsize=8, loc="upper center")
    for ax in (a, c):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)


def run_backend(args, backend: str, trace: dict) -> dict:
    """All policies on one backend; the embedded engine also replays at page size 1."""
    t0, tokens = time.perf_counter(), trace["tokens"]
    labels = [p for rep in range(args.reps) for p in (POLICIES if rep == 0 else TTFT_PAIR)]
    strict = None
    if backend == "embedded":
        runs = play([Replay(args, p, trace, args.page_size, tokens) for p in labels], trace)
        short = {**trace, "turns": trace["turns"][: min(2, args.turns)]}
        strict = {p: r[0] for p, r in play([Replay(args, p, short, 1, tokens)
                                            for p in ("drop_materialize", "strip_thinking_cache")], short).items()}
    else:
        rt = build_runtime(args, args.page_size, tokens, "sglang", len(labels))
        print(f"[sglang] server up in {time.perf_counter() - t0:.1f}s", flush=True)
        try:
            runs = play([Replay(args, p, trace, args.page_size, tokens, rt, tenant=f"bench-{i}-{p}")
                         for i, p in enumerate(labels)], trace)
        finally:
            rt.close()
    res = {p: summarize(r) for p, r in runs.items()}
    return {"reps": {p: len(r) for p, r in runs.items()}, "policies": res,
            "page1_check": {p: r["turns"] for p, r in strict.items()} if strict else None,
            "targets": targets(res, trace, strict), "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="both", choices=["both", "embedded", "sglang"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every token budget")
    ap.add_argument("--reps", type=int, default=2, help="runs of keep and drop+always (TTFT medians)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on a shared host)")
    args = ap.parse_args()
    if args.device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    trace = make_trace(args, build_template("deepseek", load_tokenizer("tiny")))
    names = ("embedded", "sglang") if args.backend == "both" else (args.backend,)
    backends = {name: run_backend(args, name, trace) for name in names}
    result = {
        "device": args.device, "model": "tiny", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "config": {"turns": args.turns, "seed": args.seed, "page_size": args.page_size, "scale": args.scale},
        "trace_sizes": [t["sizes"] for t in trace["turns"]], "backends": backends,
        "note": ("embedded: one Runtime per conversation, this process. sglang: SGLang's server with "
                 "--radix-cache-backend session (launched by the Runtime, the tiny preset's weights), one Runtime, "
                 "one tenant per conversation; tree figures are that tenant's namespace's device nodes "
                 "(control channel `snapshot`), chain figures the scheduler's (`chain_tokens`). TTFT on SGLang is "
                 "this client's time to the first streamed chunk of a forced step (SGLang reports no per-request "
                 "prefill time). The page-1 strict check needs its own pool: embedded only."),
        "wall_s": time.perf_counter() - t0, "loadavg_1m": {"start": load0, "end": os.getloadavg()[0]},
    }
    write_report("policies", result, plot)
    for name, part in backends.items():
        for p, r in part["policies"].items():
            tt = r["totals"]
            print(f"[{name}] {p:<21} prefill {tt['prefill_tokens']:>7,} (first {tt['first_step_prefill']:>6,} "
                  f"tool {tt['tool_chain_prefill']:>6,} idle {tt['idle_prefill_tokens']:>6,}) recomputed "
                  f"{tt['tool_chain_recomputed']:>5} ttft {r['next_turn_ttft_median_ms']:7.1f} ms  final KV "
                  f"{r['final_kv_bytes'] / 2**20:6.1f} MiB  orphaned {r['final_orphaned_bytes'] / 2**20:6.1f} MiB")
        for k, v in part["targets"].items():
            print(f"[{name}] target {k}: met={v['met']}")
    print(f"wall {result['wall_s']:.1f}s -> {RESULTS}/policies.json, policies.png")


if __name__ == "__main__":
    main()
