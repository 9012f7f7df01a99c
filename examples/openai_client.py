"""The example agent through the official `openai` client and /v1/chat/completions.

    .venv/bin/session-runtime serve --data-dir ""            # in one terminal
    .venv/bin/python examples/openai_client.py [--url http://127.0.0.1:8000] [--no-fallback]

The client is stateless: every request sends the whole history. The extra body
field `conversation_id` maps it to one server-side conversation, so the server
checks the history against the conversation's, runs only the new user message
or tool results, and reuses the conversation's KV: see
`usage.prompt_tokens_details.cached_tokens` per request.

The OpenAI API has no forced output, so the model samples every reply (keep
`--max-tokens` small on CPU). The default `tiny` model has random weights and
practically never calls a tool; when it makes no call where the scripted policy
wants one, the agent substitutes the policy's tool-call message for the sampled
reply in its history and sends `"replace": true` with the next request, so the
server adopts the rewritten history (and still reuses the common prefix) instead
of refusing it with 409. `--no-fallback` keeps the pure sampled
loop, which is what a real model (`serve --model PATH`) needs.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_tools import SYSTEM, TASKS, TOOLS, ScriptedPolicy, call_summary, run_tool  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--root", type=Path, default=ROOT, help="folder read_file may read (default: the repository)")
    ap.add_argument("--max-tokens", type=int, default=16, help="sampled tokens per request")
    ap.add_argument("--max-steps", type=int, default=3, help="requests per turn before the agent stops it")
    ap.add_argument("--no-fallback", action="store_true", help="never substitute the scripted tool calls")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's, from /v1/models)")
    ap.add_argument("--api-key", default="not-needed", help="the server's API key, if it has one")
    args = ap.parse_args(argv)

    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0, timeout=300)
    model = args.model or client.models.list().data[0].id  # a server checks the name against the one it serves
    policy = ScriptedPolicy()
    cid = "openai-agent-" + uuid.uuid4().hex[:8]
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    print(f"conversation_id {cid}; sampled output, max_tokens {args.max_tokens}")
    requests = 0
    cached_total = prompt_total = 0
    rewritten = False  # the agent changed what the model said: the next request replaces the stored history

    def ask() -> object:
        nonlocal requests, cached_total, prompt_total, rewritten
        # "create" on the first request makes the conversation under our id; later
        # ones continue it, and the server refuses (409) a history that differs
        # from the stored one unless the request says "replace".
        resp = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=args.max_tokens, temperature=0.0,
            extra_body={"conversation_id": cid, "create": requests == 0, "replace": rewritten},
        )
        rewritten = False
        requests += 1
        u = resp.usage
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        cached_total += cached
        prompt_total += u.prompt_tokens
        acc = (resp.model_extra or {}).get("accounting") or {}
        extra = f"  prefill {acc.get('uncached_prefill_tokens')}" if acc else ""
        if acc.get("cache_state"):
            extra += f"  cache_state {acc['cache_state']}"
        print(f"  request {requests}: prompt_tokens {u.prompt_tokens:5d}  cached_tokens {cached:5d}  "
              f"completion_tokens {u.completion_tokens:3d}{extra}  finish {resp.choices[0].finish_reason}")
        return resp

    for task in TASKS:
        print(f"\nuser: {task}")
        messages.append({"role": "user", "content": task})
        for step in range(args.max_steps):
            msg = ask().choices[0].message
            reasoning = getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get("reasoning_content") or ""
            reply = {"role": "assistant", "content": msg.content or "", "reasoning_content": reasoning}
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                     for c in msg.tool_calls or ()]
            sampled = " ".join((reasoning + " " + (msg.content or "")).split())
            print(f"    sampled: {sampled[:90]!r}{' ...' if len(sampled) > 90 else ''}")
            if not calls and step == 0 and not args.no_fallback:
                plan = policy.plan(task)
                if plan["tool_calls"]:
                    print("    the model made no tool call; the scripted policy's calls replace its reply")
                    rewritten = True
                    reply = {"role": "assistant", "content": "", "reasoning_content": plan["reasoning"]}
                    calls = [{"id": f"call_{requests}_{k}", "type": "function",
                              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                             for k, c in enumerate(plan["tool_calls"])]
            if not calls:
                messages.append(reply)
                break
            messages.append({**reply, "tool_calls": calls})
            for c in calls:
                try:
                    arguments = json.loads(c["function"]["arguments"] or "{}")
                except ValueError:
                    arguments = {}
                result = run_tool(c["function"]["name"], arguments, args.root)
                shown = result.replace("\n", " | ")
                print(f"    tool {c['id']}: {call_summary(c['function']['name'], arguments)} -> {shown[:90]}")
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
        else:
            print(f"    (stopped after {args.max_steps} requests)")
            if messages[-1]["role"] == "tool":  # the history must not end with unanswered results
                messages.append({"role": "assistant", "content": "(step limit reached)"})
                rewritten = True

    print(f"\n{requests} requests: {cached_total} of {prompt_total} prompt tokens were cached "
          f"({100 * cached_total / max(prompt_total, 1):.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
