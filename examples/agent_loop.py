"""A tool-using agent over the session HTTP API.

    .venv/bin/session-runtime serve --data-dir ""            # in one terminal
    .venv/bin/python examples/agent_loop.py [--url http://127.0.0.1:8000] [--sample]

The agent creates a conversation with two tools (calculator, read_file), then
runs a few tasks. Each turn: POST the user message, execute the tool calls the
step returns locally, POST their results to /tool_results, until a step makes
no call. Every step prints its accounting; the end prints the tree's hit counts.

The default `tiny` model has random weights, so by default the model's output is
*forced*: a scripted policy (agent_tools.ScriptedPolicy) writes the reasoning and
decides which tools to call, and the server appends that output as if the model
had produced it (same tokens, same KV, same accounting). The tool calls the
agent executes are the ones the server parsed back from that output. With
`--sample` the model samples instead (with random weights it rarely calls a
tool, so turns are mostly one step; a real model via `serve --model PATH` works).
Only the standard library is used.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_tools import SYSTEM, TASKS, TOOLS, ScriptedPolicy, call_summary, run_tool  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent  # the repository: README.md, pyproject.toml


class Api:
    def __init__(self, url: str, timeout: float = 300.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise SystemExit(f"{method} {path}: HTTP {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:
            raise SystemExit(f"cannot reach {self.url} ({exc.reason}); start the server with "
                             "`.venv/bin/session-runtime serve --data-dir ''`") from None


def show_step(step: dict) -> None:
    a = step["accounting"]
    line = (f"  turn {step['turn'] + 1} step {step['step']}: prompt {a['prompt_tokens']:5d}  "
            f"cached {a['cached_input_tokens']:5d}  prefill {a['uncached_prefill_tokens']:4d}  "
            f"recomputed {a['recomputed_history_tokens']:4d}  output {a['output_tokens']:4d}")
    if a.get("cache_state") is not None:
        line += f"  cache_state {a['cache_state']}"
        cf = a.get("counterfactual") or {}
        if cf:
            line += f"  (keep would prefill {cf['keep']['prefill_tokens']}, drop {cf['drop']['prefill_tokens']})"
    print(line)
    if step["reasoning"]:
        text = " ".join(step["reasoning"].split())
        print(f"    reasoning: {text[:110]}{'...' if len(text) > 110 else ''}")
    if step["content"]:
        print(f"    answer:    {' '.join(step['content'].split())[:200]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--root", type=Path, default=ROOT, help="folder read_file may read (default: the repository)")
    ap.add_argument("--sample", action="store_true", help="let the model sample instead of forcing scripted output")
    ap.add_argument("--max-tokens", type=int, default=32, help="sampled tokens per step (--sample)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-steps", type=int, default=4, help="steps per turn before the agent closes it")
    ap.add_argument("--policy", default="drop", help="reasoning policy of the conversation")
    ap.add_argument("--materialize", default="auto", choices=["auto", "always", "never"])
    ap.add_argument("--pause", type=float, default=0.5,
                    help="seconds between turns (user think time: the server materializes then)")
    args = ap.parse_args(argv)

    api, policy = Api(args.url), ScriptedPolicy()
    health = api.call("GET", "/health")
    conv = api.call("POST", "/v1/conversations", {"system": SYSTEM, "tools": TOOLS, "policy": args.policy,
                                                 "materialize": args.materialize})
    cid = conv["id"]
    mode = "sampled" if args.sample else "forced by the scripted policy"
    print(f"conversation {cid} on {health['model']} ({health['device']}): policy {conv['policy']}, "
          f"materialize {conv['materialize']}, output {mode}")
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    totals = {"prompt": 0, "cached": 0, "prefill": 0, "recomputed": 0, "calls": 0}

    def count(step: dict) -> dict:
        a = step["accounting"]
        totals["prompt"] += a["prompt_tokens"]
        totals["cached"] += a["cached_input_tokens"]
        totals["prefill"] += a["uncached_prefill_tokens"]
        totals["recomputed"] += a["recomputed_history_tokens"]
        show_step(step)
        return step

    for turn, task in enumerate(TASKS):
        if turn and args.pause > 0:
            time.sleep(args.pause)
        print(f"\nuser: {task}")
        body = {"content": task, **sampling} if args.sample else {"content": task, "forced": policy.plan(task)}
        step = count(api.call("POST", f"/v1/conversations/{cid}/messages", body))
        steps = 1
        while step["tool_calls"]:
            calls = step["tool_calls"]
            results = [run_tool(c["name"], c["arguments"], args.root) for c in calls]
            totals["calls"] += len(calls)
            for c, r in zip(calls, results):
                shown = r.replace("\n", " | ")
                print(f"    tool {c['id']}: {call_summary(c['name'], c['arguments'])} -> {shown[:100]}")
            body = {"results": [{"tool_call_id": c["id"], "content": r} for c, r in zip(calls, results)]}
            if not args.sample:
                body["forced"] = policy.answer(task, calls, results)
            elif steps + 1 >= args.max_steps:  # close the turn: the next user message needs it closed
                body["forced"] = {"content": "(step limit reached)"}
            else:
                body.update(sampling)
            step = count(api.call("POST", f"/v1/conversations/{cid}/tool_results", body))
            steps += 1

    print(f"\ntotals over {sum(len(t['steps']) for t in api.call('GET', f'/v1/conversations/{cid}')['turns'])} "
          f"steps: prompt {totals['prompt']}, cached {totals['cached']}, prefill {totals['prefill']}, "
          f"recomputed {totals['recomputed']}; {totals['calls']} tool calls run locally")
    described = api.call("GET", f"/v1/conversations/{cid}")
    for t in described["turns"]:
        print(f"  turn {t['turn'] + 1}: cache_state {t['cache_state']}, fork at {t['fork_tokens']} tokens, "
              f"materialize {t['materialize']}, materialized prefill {t['materialized_prefill_tokens']}")

    tree = api.call("GET", "/debug/tree")
    nodes = tree["nodes"]
    print(f"\n/debug/tree: {len(nodes)} nodes, page size {tree['page_size']}, "
          f"{sum(n['hit_count'] for n in nodes)} hits in all; chain of {cid}: {tree['chains'].get(cid, 0)} tokens")
    print(f"  {'node':>5} {'parent':>6} {'tokens':>6} {'depth':>6} {'hits':>5} {'locks':>5}  owner  preview")
    for n in nodes[:40]:
        mine = "*" if cid in n["owners"] else ""
        preview = " ".join(n["preview"].split())[:48]
        print(f"  {n['id']:>5} {str(n['parent']):>6} {n['tokens']:>6} {n['depth_tokens']:>6} {n['hit_count']:>5} "
              f"{n['lock_count']:>5}  {mine:<5}  {preview}")
    if len(nodes) > 40:
        print(f"  ... {len(nodes) - 40} more nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
