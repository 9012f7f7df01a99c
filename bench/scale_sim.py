"""Scale simulator: 1k to 100k concurrent agents over 8 to 256 SGLang workers, by discrete-event simulation.

    .venv/bin/python bench/scale_sim.py [--agents 1000,10000,100000] [--workers 8,64,256] [--seed 0] [--quick]

Writes bench/results/scale_sim.json and .png. The simulator makes the runtime's
own decisions, through the same pure functions: where a conversation lives
(`session_runtime.placement.place`, consistent hashing with bounded loads),
when a tool wait or an idle chain leaves the device (`session_runtime.offload.
due_owners`). It compares three ways to route the steps of the same seeded
agents: affinity (ours: a conversation's every step goes to its worker),
round-robin per request, and a model of sglang-router's cache-aware policy (a
request goes to the worker whose cache matches the largest share of its prompt
when that share is over 0.3, else to the least loaded worker, and to the least
loaded one whenever the load is imbalanced).

The cost model is fitted from this machine's measured figures
(bench/results/offload.json, sglang.json; GPU figures when a run on one wrote
them): a step costs fixed + prefill x uncached tokens + attention + decode x
output tokens + reload x tokens reloaded from the host tier. Attention is where
the CPU differs: SGLang's torch_native backend (the one that runs on a CPU)
pads each prefill chunk's query to the whole sequence
(`srt/layers/attention/torch_native_backend.py`, `per_req_query_redudant`,
lines 128-172), so a chunk costs its full sequence length squared however much
of it was cached, and a long prompt is cut into `--chunked-prefill-size` chunks
(4096 here); on a GPU (flashinfer, triton) a step attends uncached x context.
Each worker runs `--slots` steps at once, each slowed by slots / speedup
(SGLang's measured batching: steps/s at 8 concurrent over 1). Assumptions are
written next to the results (`assumptions`). The check: the simulator replays
bench/offload.py's single-worker workload and must land within 20% of its
measured resume latency and recomputed tokens.
"""

from __future__ import annotations

import argparse
import heapq
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import RESULTS, write_report  # noqa: E402  (bench/ is on sys.path when run)
from session_runtime import placement  # noqa: E402
from session_runtime.offload import OffloadSettings, due_owners  # noqa: E402

POLICIES = ("affinity", "round_robin", "cache_aware")
# sglang-router's cache_aware defaults: --cache-threshold, --balance-abs-threshold, --balance-rel-threshold
CACHE_THRESHOLD, BALANCE_ABS, BALANCE_REL = 0.3, 64, 1.5


CHUNK = 4096  # SGLang's --chunked-prefill-size on this machine (its log: chunked_prefill_size=4096)


@dataclass(frozen=True)
class Cost:
    """ms of a step: fixed + prefill x uncached + attention_ms_per_token2 x
    attention_pairs + decode x output + reload x tokens reloaded from the host.

    attention "full" (SGLang's torch_native, on a CPU): each prefill chunk of at
    most `chunk` tokens attends with a query padded to its whole sequence, so it
    pairs sequence-length-squared tokens; "extend" (flashinfer, triton): the
    uncached tokens attend over the context."""

    fixed_ms: float
    prefill_ms_per_token: float
    attention_ms_per_token2: float  # per attention pair (see `attention_pairs`)
    decode_ms_per_token: float
    reload_ms_per_token: float
    batch_speedup_at_8: float
    attention: str  # "full" or "extend"
    chunk: int
    source: str

    def attention_pairs(self, uncached: int, context: int) -> float:
        if self.attention == "extend":
            return uncached * context
        cached, pairs, done = context - uncached, 0.0, 0
        while done < uncached:
            done = min(uncached, done + self.chunk)
            pairs += (cached + done) ** 2
        return pairs

    def step_ms(self, uncached: int, context: int, output: int, reloaded: int) -> float:
        return (self.fixed_ms + self.prefill_ms_per_token * uncached
                + self.attention_ms_per_token2 * self.attention_pairs(uncached, context)
                + self.decode_ms_per_token * output + self.reload_ms_per_token * reloaded)


def _relative_least_squares(rows: list[tuple[float, ...]], ys: list[float]) -> list[float]:
    """Non-negative coefficients minimizing the squared relative error: a loaded
    machine slows every step by a share, so a 200 ms step weighs as much as a 4 s one."""
    import numpy as np
    from scipy.optimize import nnls

    a = np.array(rows, dtype=float) / np.array(ys, dtype=float)[:, None]
    coef, _ = nnls(a, np.ones(len(ys)))
    return [float(c) for c in coef]


RESUME_NEW = 75  # bench/offload.py's resume step: a 40-token tool result, template and 8+ forced tokens


def fit_cost(backend: str = "sglang") -> Cost:
    """Fitted on the measured runs, never on the calibration target:
    - fixed, prefill and attention: relative least squares through
      recompute-on-resume at 1k-8k tokens (bench/offload.py: the whole history
      plus RESUME_NEW tokens prefilled) and the ~232-token forced step of
      bench/sglang_server.py's Part B, each with its attention pairs (chunked
      and padded on SGLang's CPU backend);
    - reload per token: the host tier's own copy rate (promoted bytes over
      promote time; bytes per token from the same stats);
    - decode: Part B's sampled single stream; batching: its 8 over 1.
    The resume-after-reload rows are left out of the fit and reported beside it
    (`held_out`): their context is long and their prefill short, as in the
    calibration's resumes, so they test the attention form out of sample."""
    measured = json.loads((RESULTS / "offload.json").read_text())
    result = measured["backends"][backend]
    off = result["reload_vs_recompute"]
    part_b = json.loads((RESULTS / "sglang.json").read_text())["part_b"]["backends"]["sglang_session_runtime"]
    forced = next(r for r in part_b["forced"] if r["concurrency"] == 1)
    # SGLang's attention backend on a CPU is torch_native; the embedded engine attends uncached x context.
    attention = "full" if backend == "sglang" and measured.get("device") == "cpu" else "extend"
    shape = Cost(0, 0, 0, 0, 0, 1, attention, CHUNK, "")
    n_forced = 200 + 32  # Part B: ~200-token prompts plus 32 forced tokens, all prefilled
    points = [(r["recompute_recomputed"] + RESUME_NEW, r["recompute_ttft_ms"]) for r in off] + [(n_forced, forced["mean_ms"])]
    fixed, prefill, pair = _relative_least_squares([(1.0, n, shape.attention_pairs(n, n)) for n, _ in points],
                                                   [y for _, y in points])
    host = result["policies"]["always"]["host"]
    bpt = host["promoted_bytes"] / host["promoted_tokens"]
    reload = bpt / (statistics.fmean(r["h2d_GBps"] for r in off) * 1e6)  # ms per token
    one = next(r for r in part_b["sampled"] if r["concurrency"] == 1)
    eight = next(r for r in part_b["sampled"] if r["concurrency"] == 8)
    cost = dataclasses.replace(shape, fixed_ms=fixed, prefill_ms_per_token=prefill, attention_ms_per_token2=pair,
                               reload_ms_per_token=reload, batch_speedup_at_8=eight["steps_per_s"] / one["steps_per_s"],
                               source=f"{backend} on {measured.get('device')}: bench/results/offload.json "
                                      "(reload_vs_recompute, host stats), sglang.json (part_b)")
    decode = max(0.1, (one["mean_ms"] - cost.step_ms(200, 200, 0, 0)) / one["generated_tokens_mean"])
    return dataclasses.replace(cost, decode_ms_per_token=decode)


def held_out(cost: Cost, backend: str = "sglang") -> list[dict]:
    """The fitted model against the measured resume-after-reload TTFTs, which the
    fit did not see (RESUME_NEW tokens prefilled over the reloaded context)."""
    off = json.loads((RESULTS / "offload.json").read_text())["backends"][backend]["reload_vs_recompute"]
    rows = []
    for r in off:
        loaded = r["reload_host_loaded"]
        model = cost.step_ms(RESUME_NEW, loaded + RESUME_NEW, 0, loaded)
        rows.append({"context": r["context"], "measured_ms": r["reload_ttft_ms"], "model_ms": model,
                     "ratio": model / r["reload_ttft_ms"]})
    return rows


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


# ----- the workload --------------------------------------------------------------


@dataclass
class Agent:
    system: int  # which shared system prompt
    arrive: float
    turns: list  # per turn: (user tokens, think seconds, [(reasoning, answer, result tokens, tool seconds)])
    conv: str = ""
    turn: int = 0
    step: int = 0
    canonical: int = 0  # tokens of the canonical history (closed turns without reasoning)
    open: int = 0  # tokens of the open turn so far (reasoning kept)
    turn_prompt: int = 0  # the open turn's first prompt: where a cached copy of it diverges later


def make_agents(rng: random.Random, n: int, systems: int, system_tokens: int, tool_mean_s: float,
                think_mean_s: float) -> list[Agent]:
    """Seeded agents; their arrival times are set by `spread_arrivals`."""
    out = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(2, 4)):
            steps = [(rng.randint(100, 600), rng.randint(20, 80), rng.randint(20, 200),
                      rng.expovariate(1 / tool_mean_s)) for _ in range(rng.randint(2, 4))]
            turns.append((rng.randint(10, 60), rng.expovariate(1 / think_mean_s), steps))
        out.append(Agent(system=rng.randrange(systems), arrive=rng.random(), turns=turns,
                         conv=f"agent-{i}", canonical=system_tokens))
    return out


def _steps(agent: Agent):
    """(new tokens, prompt, output) of each step of the agent under drop, as the
    simulation computes its prompts."""
    canonical = agent.canonical
    for user, _, steps in agent.turns:
        open_ = 0
        for k, (r, a, _, _) in enumerate(steps):
            new = user if k == 0 else steps[k - 1][2]
            yield new, canonical + open_ + new, r + a
            open_ += new + r + a
        canonical += open_ - sum(x[0] for x in steps)


def spread_arrivals(agents: list[Agent], cost: Cost, workers: int, slots: int, slow: float,
                    utilization: float) -> float:
    """Scale the arrivals (uniform) so that the offered work, with every history
    reused, keeps the workers `utilization` busy: a fair load for every policy
    (they then differ by what they recompute). Returns the arrival window (s)."""
    work = sum(cost.step_ms(new, prompt, out, 0) * slow / 1e3 for ag in agents for new, prompt, out in _steps(ag))
    life = statistics.fmean(sum(think + sum(x[3] for x in steps) for _, think, steps in ag.turns) for ag in agents)
    window = max(1.0, work / (workers * slots * utilization) - life)
    for ag in agents:
        ag.arrive *= window
    return window


# ----- a worker ------------------------------------------------------------------


class Tally(dict):
    """A dict that keeps the sum of `size(value)` over its values, so a worker's
    KV in use is read in O(1) per event."""

    def __init__(self, size=lambda v: v):
        super().__init__()
        self.size, self.total = size, 0

    def __setitem__(self, key, value) -> None:
        self.pop(key, None)
        super().__setitem__(key, value)
        self.total += self.size(value)

    def pop(self, key, *default):
        if key in self:
            value = super().pop(key)
            self.total -= self.size(value)
            return value
        if default:
            return default[0]
        raise KeyError(key)


class Worker:
    def __init__(self, wid: str, capacity: int, host_capacity: int, slots: int, system_tokens: int):
        self.wid, self.capacity, self.host_capacity, self.slots = wid, capacity, host_capacity, slots
        self.system_tokens = system_tokens
        self.busy: list = []  # end times of running steps (a heap, at most `slots`)
        # Every chain starts with its system prompt, which the tree holds once (`systems`).
        beyond = lambda t: max(0, t - system_tokens)  # noqa: E731
        self.held = Tally(beyond)  # conv -> tokens locked by its chain on the device
        self.cached = Tally(lambda c: beyond(c[0]))  # conv -> (tokens, turn, turn prompt): unlocked, LRU order
        self.host = Tally()  # conv -> tokens on the host tier
        self.systems: dict = {}  # system prompt -> last use (unlocked, shared)
        self.waiting: dict = {}  # conv -> (since, settings): the offload table
        self.used_peak = 0

    def used(self) -> int:
        return self.held.total + self.cached.total + len(self.systems) * self.system_tokens

    def make_room(self, need: int, stats: dict) -> None:
        """LRU: unlocked prefixes first, then idle chains and tool waits (oldest
        first) to the host tier, as the runtime retires them under pressure,
        then system prompts."""
        while self.used() + need > self.capacity:
            if self.cached:
                conv = next(iter(self.cached))
                stats["evicted_tokens"] += self.cached.pop(conv)[0]
            elif self.waiting:  # idle chains first, then tool waits, oldest first (the runtime's order)
                conv = min(self.waiting, key=lambda c: (self.waiting[c][1] is not None, self.waiting[c][0]))
                self.waiting.pop(conv)
                tokens = self.held.pop(conv, 0)
                if self.host.total + tokens <= self.host_capacity:
                    self.host[conv] = tokens
                else:
                    stats["evicted_tokens"] += tokens
            elif self.systems:
                self.systems.pop(next(iter(self.systems)))
            else:
                return  # everything left is locked by running steps: the step waits (not modelled)


class Sim:
    def __init__(self, args, policy: str, agents: list[Agent], workers: int, cost: Cost, offload: str):
        self.args, self.policy, self.cost, self.agents = args, policy, cost, agents
        ids = [f"w{i}" for i in range(workers)]
        self.workers = {w: Worker(w, args.capacity, args.host_capacity, args.slots, args.system_tokens) for w in ids}
        self.ring = placement.ring(ids)
        self.where: dict[str, str] = {}
        self.loads = {w: 0 for w in ids}  # live conversations per worker (affinity)
        self.outstanding = {w: 0 for w in ids}  # steps queued or running per worker (cache_aware's load)
        self.peak_load = 0
        self.rr = 0
        self.settings = OffloadSettings(offload, ttl_s=args.ttl_s)
        self.slow = args.slots / (1 + (cost.batch_speedup_at_8 - 1) * (args.slots - 1) / 7)
        self.events = [(a.arrive, i, "step") for i, a in enumerate(agents)]
        heapq.heapify(self.events)
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "host_loaded_tokens": 0, "recomputed_tokens": 0,
                      "evicted_tokens": 0, "steps": 0}
        self.waits: list[float] = []
        self.system_of = {a.conv: a.system for a in agents}
        self.holders: dict = {}  # cache_aware's index: conv or ("system", k) -> workers that may match it
        self.rng = random.Random(args.seed)
        self.resumes: list[float] = []
        self.services: list[float] = []  # resume steps' own cost, without queueing

    # Routing: one function per policy, reading only the state it needs.
    def route(self, agent: Agent, prompt: int) -> str:
        if self.policy == "affinity":
            if agent.conv not in self.where:
                wid = placement.place(agent.conv, self.loads, self.args.epsilon, self.ring)
                self.where[agent.conv] = wid
                self.loads[wid] += 1
                self.peak_load = max(self.peak_load, self.loads[wid])
            return self.where[agent.conv]
        if self.policy == "round_robin":
            self.rr += 1
            return placement.round_robin(self.rr, sorted(self.workers))
        # sglang-router's cache_aware: the least loaded worker while the load is
        # imbalanced, else the best prefix match over the threshold, else the least loaded.
        out = self.outstanding
        hi, lo = max(out.values()), min(out.values())
        least = min(out, key=out.get)
        if hi - lo > BALANCE_ABS and hi > BALANCE_REL * lo:
            return least
        best, share = None, 0.0
        # sorted: a set of strings iterates in the order of this process's string hashes
        for wid in sorted(self.holders.get(agent.conv, set()) | self.holders.get(("system", agent.system), set())):
            match = self.match(self.workers[wid], agent, prompt)[0] / prompt
            if match > share:
                best, share = wid, match
        return best if best is not None and share > CACHE_THRESHOLD else least

    def match(self, w: Worker, agent: Agent, prompt: int) -> tuple[int, int]:
        """(tokens the worker can reuse for this prompt, of which from its host tier)."""
        own = w.held.get(agent.conv, 0)
        if agent.conv in w.cached:  # a plain server's unlocked copy: valid up to where it diverges
            tokens, turn, turn_prompt = w.cached[agent.conv]
            own = max(own, tokens if turn == agent.turn else min(tokens, turn_prompt))
        host = w.host.get(agent.conv, 0)
        system = self.args.system_tokens if agent.system in w.systems else 0
        reuse = min(max(own, host, system), prompt - 1)
        return reuse, (reuse if host and host >= max(own, system) else 0)

    def run(self) -> dict:
        while self.events:
            now, i, kind = heapq.heappop(self.events)
            if kind == "step":
                self.step(now, self.agents[i], i)
            else:  # a step ended on worker `kind`
                self.outstanding[kind] -= 1
        return self.summary()

    def push(self, t: float, i: int, kind: str = "step") -> None:
        heapq.heappush(self.events, (t, i, kind))

    def retire(self, w: Worker, now: float) -> None:
        """The offload and idle-retirement decisions due on this worker now, made by
        the runtime's own function (`due_owners`)."""
        free = 1.0 - w.used() / w.capacity
        for conv in due_owners(w.waiting, now, free, self.args.idle_ttl_s):
            _, settings = w.waiting.pop(conv)
            tokens = w.held.pop(conv, 0)
            if settings is not None and settings.mode == "discard":  # freed, its exclusive prefix with it
                system = self.system_of[conv]
                if not any(self.system_of[c] == system for c in w.held):
                    w.systems.pop(system, None)
                continue
            if w.host.total + tokens <= w.host_capacity:
                w.host[conv] = tokens

    def step(self, now: float, a: Agent, i: int) -> None:
        user, _, steps = a.turns[a.turn]
        reasoning, answer, _, tool_s = steps[a.step]
        new = user if a.step == 0 else steps[a.step - 1][2]
        prompt = a.canonical + a.open + new
        # What counts as recomputed history, as the runtime counts it: a fresh conversation has none.
        history = 0 if a.turn == a.step == 0 else a.canonical + a.open
        if a.step == 0:
            a.turn_prompt = prompt
        w = self.workers[self.route(a, prompt)]
        self.retire(w, now)
        reuse, from_host = self.match(w, a, prompt)
        for table in (w.waiting, w.host, w.cached):
            table.pop(a.conv, None)
        uncached = prompt - reuse
        st = self.stats
        st["prompt_tokens"] += prompt
        st["cached_tokens"] += reuse - from_host
        st["host_loaded_tokens"] += from_host
        st["recomputed_tokens"] += max(0, history - reuse)
        st["steps"] += 1
        w.make_room(uncached + reasoning + answer, st)
        while w.busy and w.busy[0] <= now:  # slots whose step has ended
            heapq.heappop(w.busy)
        start = now if len(w.busy) < w.slots else heapq.heappop(w.busy)  # FIFO: the earliest slot to free
        out = reasoning + answer
        if getattr(self.args, "forced", False):  # forced output is prefilled with the prompt: input, not decode
            service = self.cost.step_ms(uncached + out, prompt + out, 0, from_host) / 1e3
        else:
            service = self.cost.step_ms(uncached, prompt, out, from_host) / 1e3
        end = start + service * self.slow
        heapq.heappush(w.busy, end)
        self.outstanding[w.wid] += 1  # queued or running, until it ends
        self.push(end, -1, w.wid)
        self.waits.append(start - now)
        if a.step > 0:
            self.resumes.append((end - now) * 1e3)
            self.services.append(service * 1e3)
        w.systems.pop(a.system, None)
        w.systems[a.system] = end  # most recently used last
        sequence = prompt + reasoning + answer
        ours = self.policy == "affinity"
        if ours:
            w.held[a.conv] = sequence  # the chain holds the tool chain exactly
        else:
            w.cached[a.conv] = (sequence, a.turn, a.turn_prompt)  # a plain server caches, holds nothing
        w.used_peak = max(w.used_peak, w.used())
        if self.policy == "cache_aware":
            self.holders.setdefault(a.conv, set()).add(w.wid)
            self.holders.setdefault(("system", a.system), set()).add(w.wid)
        a.open += new + reasoning + answer
        a.step += 1
        if a.step < len(steps):  # a tool call: wait for its result
            if ours:
                w.waiting[a.conv] = (end, self.settings)
            self.push(end + tool_s, i)
            return
        a.canonical += a.open - sum(x[0] for x in steps)  # the turn closes: its reasoning is dropped
        a.open, a.step = 0, 0
        a.turn += 1
        if ours:
            w.held[a.conv] = a.canonical  # the chain moves to the canonical branch (P | A)
            w.waiting[a.conv] = (end, None)  # idle until its next turn
        if a.turn < len(a.turns):
            self.push(end + a.turns[a.turn][1], i)
        else:  # the conversation ends and is deleted: its chain is released
            w.held.pop(a.conv, None)
            w.waiting.pop(a.conv, None)
            if self.where.pop(a.conv, None) is not None:
                self.loads[w.wid] -= 1

    def summary(self) -> dict:
        s, ws = self.stats, list(self.workers.values())
        q = sorted(self.waits)
        return {**s, "hit_rate": (s["cached_tokens"] + s["host_loaded_tokens"]) / max(1, s["prompt_tokens"]),
                "queue_delay_ms": {"mean": 1e3 * statistics.fmean(q), "p99": 1e3 * q[int(0.99 * (len(q) - 1))]},
                "resumes": len(self.resumes),
                "resume_ms_median": statistics.median(self.resumes) if self.resumes else None,
                "resume_service_ms_median": statistics.median(self.services) if self.services else None,
                "kv_peak_tokens_per_worker": {"mean": statistics.fmean(w.used_peak for w in ws),
                                              "max": max(w.used_peak for w in ws)},
                "live_conversations_per_worker_peak": self.peak_load if self.policy == "affinity" else None}


# ----- the check against the measured single worker ----------------------------------


def offload_agents() -> tuple[list[Agent], int]:
    """bench/offload.py's own agents (its make_agents: 12 agents, 2048-word system
    prompts, seed 0), in tokens as the DeepSeek template renders its steps: the
    same tool calls, results, latencies and arrivals. Returns (agents, system tokens)."""
    from offload import make_agents  # bench/offload.py
    from session_runtime.templates import build_template
    from session_runtime.templates.base import Message, ToolCall
    from session_runtime.tokenizer import load_tokenizer

    tpl = build_template("deepseek", load_tokenizer("tiny"))
    keep = lambda turn: True  # noqa: E731  (offload.py runs policy keep)
    agents, system = [], 0
    for i, a in enumerate(make_agents(argparse.Namespace(agents=12, context=2048, seed=0))):
        system = len(tpl.render(a["system"], [], [], keep, False).ids)
        history = [Message("user", 0, content=a["user"])]
        prompt = tpl.render(a["system"], [], history, keep, True).ids
        user, steps = len(prompt) - system, []
        for k, forced in enumerate(a["steps"]):
            calls = tuple(ToolCall(f"call_0_{k}", c["name"], c["arguments"]) for c in forced.get("tool_calls", ()))
            out = tpl.forced_ids("", forced["content"], calls)
            history.append(Message("assistant", 0, content=forced["content"], tool_calls=calls, output_ids=tuple(out)))
            result, latency = 0, 0.0
            if calls:
                history.append(Message("tool", 0, content=a["results"][k], tool_call_id=calls[0].id))
                nxt = tpl.render(a["system"], [], history, keep, True).ids
                result, latency, prompt = len(nxt) - len(prompt) - len(out), a["latency"][k], nxt
            steps.append((0, len(out), result, latency))
        agents.append(Agent(system=i, arrive=a["arrive"], turns=[(user, 0.0, steps)], conv=f"cal-{i}",
                            canonical=system))
    return agents, system


def calibrate(args, cost: Cost) -> dict:
    """bench/offload.py's SGLang workload on one worker (its own agents, one step
    at a time): the simulator's resume latency and recomputed tokens against the
    measured ones, under never (the chain held through each tool wait) and
    discard (freed at each tool call, recomputed at the resume)."""
    measured = json.loads((RESULTS / "offload.json").read_text())["backends"]["sglang"]["policies"]
    out = {}
    for mode in ("never", "discard"):
        agents, system = offload_agents()
        one = argparse.Namespace(**{**vars(args), "capacity": 12 * 4096, "slots": 1, "system_tokens": system,
                                    "forced": True})
        sim = Sim(one, "affinity", agents, 1, cost, mode).run()
        want = measured[mode]
        # bench/offload.py times each step alone (its clock is simulated): compare service times.
        out[mode] = {"simulated_resume_ms": sim["resume_service_ms_median"],
                     "measured_resume_ms": want["resume_ttft_ms"]["median"],
                     "simulated_recomputed": sim["recomputed_tokens"], "measured_recomputed": want["recomputed_tokens"],
                     "simulated_resumes": sim["resumes"], "measured_resumes": want["resumes"]}
        out[mode]["resume_ratio"] = sim["resume_service_ms_median"] / want["resume_ttft_ms"]["median"]
        out[mode]["recomputed_ratio"] = (sim["recomputed_tokens"] / want["recomputed_tokens"]
                                         if want["recomputed_tokens"] else float(sim["recomputed_tokens"] == 0))
    out["met"] = all(0.8 <= out[m][k] <= 1.2 for m in ("never", "discard") for k in ("resume_ratio", "recomputed_ratio"))
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for policy, mark in zip(POLICIES, "os^"):
        pts = [r for r in rows if r["policy"] == policy]
        label = lambda r: f"{r['agents'] // 1000}k/{r['workers']}"  # noqa: E731
        xs = range(len(pts))
        axes[0].plot(xs, [r["hit_rate"] for r in pts], mark + "-", label=policy)
        axes[1].plot(xs, [r["recomputed_tokens"] / r["steps"] for r in pts], mark + "-", label=policy)
        axes[2].plot(xs, [r["queue_delay_ms"]["p99"] for r in pts], mark + "-", label=policy)
        for ax in axes:
            ax.set_xticks(list(xs), [label(r) for r in pts], rotation=30, fontsize=8)
    axes[0].set(title="prompt tokens reused (device + host)", ylabel="hit rate", xlabel="agents / workers")
    axes[1].set(title="history recomputed per step", ylabel="tokens", xlabel="agents / workers")
    axes[2].set(title="queueing delay p99", ylabel="ms (symlog)", xlabel="agents / workers", yscale="symlog")
    axes[2].set_ylim(bottom=0)
    for ax in axes:
        ax.legend(fontsize=8)
    cal = result["calibration"]
    fig.suptitle(f"scale simulation, run on {result['machine']['ran_on']} (cost model: {result['cost']['source']}); "
                 f"vs the measured single worker: resume {cal['never']['resume_ratio']:.2f}x (never), "
                 f"{cal['discard']['resume_ratio']:.2f}x (discard), recomputed {cal['discard']['recomputed_ratio']:.2f}x",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", default="1000,10000,100000")
    ap.add_argument("--workers", default="8,64,256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="1k and 10k agents over 8 and 64 workers")
    ap.add_argument("--capacity", type=int, default=400_000, help="device KV tokens per worker")
    ap.add_argument("--host-capacity", type=int, default=1_600_000, help="host-tier KV tokens per worker")
    ap.add_argument("--slots", type=int, default=8, help="steps a worker runs at once (batching)")
    ap.add_argument("--systems", type=int, default=16, help="distinct shared system prompts")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--tool-mean-s", type=float, default=3.0)
    ap.add_argument("--think-mean-s", type=float, default=20.0)
    ap.add_argument("--epsilon", type=float, default=0.25)
    ap.add_argument("--utilization", type=float, default=0.7, help="offered load with perfect reuse")
    ap.add_argument("--ttl-s", type=float, default=2.0)
    ap.add_argument("--idle-ttl-s", type=float, default=300.0)
    ap.add_argument("--offload", default="ttl", choices=["never", "always", "ttl", "pressure", "discard"])
    ap.add_argument("--cost-from", default="sglang", choices=["sglang", "embedded"])
    args = ap.parse_args()
    if args.quick:
        args.agents, args.workers = "1000,10000", "8,64"
    t0 = time.perf_counter()
    cost = fit_cost(args.cost_from)
    check = calibrate(args, cost)
    check["held_out_reload_rows"] = held_out(cost, args.cost_from)
    print(f"calibration within 20%: {check['met']} {json.dumps(check)}", flush=True)
    runs = []
    for n in map(int, args.agents.split(",")):
        for w in map(int, args.workers.split(",")):
            if n < w:
                continue
            agents = make_agents(random.Random(args.seed), n, args.systems, args.system_tokens, args.tool_mean_s,
                                 args.think_mean_s)
            slow = args.slots / (1 + (cost.batch_speedup_at_8 - 1) * (args.slots - 1) / 7)
            window = spread_arrivals(agents, cost, w, args.slots, slow, args.utilization)
            for policy in POLICIES:
                fresh = [Agent(a.system, a.arrive, a.turns, a.conv, canonical=a.canonical) for a in agents]
                t = time.perf_counter()
                res = Sim(args, policy, fresh, w, cost, args.offload).run()
                res.update(agents=n, workers=w, policy=policy, arrival_window_s=window, wall_s=time.perf_counter() - t)
                runs.append(res)
                print(f"{n:>6} agents {w:>3} workers {policy:>11}: hit {res['hit_rate']:.3f} recomputed/step "
                      f"{res['recomputed_tokens'] / res['steps']:8.1f} queue p99 {res['queue_delay_ms']['p99']:9.1f} ms "
                      f"KV peak/worker {res['kv_peak_tokens_per_worker']['max']:>8,} ({res['wall_s']:.1f}s)", flush=True)
    result = {
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": {"ran_on": "cpu", "cpu": _cpu_name(), "cores": os.cpu_count(), "gpu": None,
                    "note": "the simulation is pure Python on this CPU; its cost model is fitted from runs on the "
                            f"device offload.json names ({json.loads((RESULTS / 'offload.json').read_text())['device']})"},
        "cost": vars(cost) | {"source": cost.source},
        "settings": {k: v for k, v in vars(args).items()}, "calibration": check, "runs": runs,
        "assumptions": [
            "A worker runs `slots` steps at once; each takes slots / speedup times its alone cost, speedup "
            "interpolated linearly from SGLang's measured steps/s at 8 concurrent over 1 (processor sharing).",
            "A step costs fixed + prefill x uncached tokens + attention + decode x output (+ the host copy of what it "
            "reloads), fitted by relative least squares on this CPU's recompute-on-resume runs (1k-8k tokens) and "
            "Part B's forced step, never on the calibration target. Attention has the shape of the backend that was "
            "measured: on a CPU SGLang's torch_native pads each prefill chunk's query to the whole sequence "
            "(srt/layers/attention/torch_native_backend.py, lines 128-172), so each chunk of at most 4096 tokens "
            "(--chunked-prefill-size here) costs its sequence length squared, cached or not; on a GPU it would be "
            "uncached x context. The previous model charged a per-context-token term taken from the reload runs' "
            "slope, which also carries each reload's own work: it made a resume on a held chain 1.34x too slow.",
            "Reloading from the host tier costs its copy at the measured host-to-device rate and nothing more: the "
            "held-out resume-after-reload rows (calibration.held_out_reload_rows) come out at 0.6x at 1-2k tokens "
            "and 1.0-1.1x at 4-8k, so each reload's own round trip to the scheduler is missing and host reloads "
            "(offload ttl/always) are cheaper here than measured.",
            "The calibration replays bench/offload.py's own agents (its make_agents, seed 0: 12 agents, 2049-token "
            "system prompts, 52 resumes), their steps counted in tokens by the DeepSeek template, one step at a "
            "time on one worker, and compares the median resume service time and the recomputed tokens under "
            "never and discard with that run's.",
            "Decode costs the same per token at any context (fitted at ~200 tokens); forced output (the calibration) "
            "is prefilled with the prompt: uncached input that lengthens the sequence, not decode. Network and "
            "router latency are zero.",
            "KV is counted in tokens; a worker evicts unlocked prefixes, then system prompts (LRU), then moves "
            "waiting chains to its host tier (pressure), as the runtime's retirement order does.",
            "Reuse is exact token prefixes: a conversation's own chain or cached prefix, its host copy, or its "
            "shared system prompt (16 distinct by default); no partial-page alignment loss.",
            "Under drop, a closed turn's reasoning leaves the canonical history; affinity holds the canonical "
            "branch (materialized), the other policies leave only the prompt part cached (LRU).",
            "cache_aware models sglang-router's policy from its documentation with its defaults: while the busiest "
            "worker has more than 64 steps queued or running over the idlest and 1.5x as many, the least loaded; "
            "else the largest prefix-match share over 0.3; else the least loaded (sglang-router 0.3.2, "
            "src/policies/cache_aware.rs select_worker: min load, though its doc comment says smallest tree). Its "
            "match reads the simulated caches exactly; the router's own tree approximates them, keyed on the "
            "request's text or, for input_ids, the ids written in decimal (src/protocols/generate.rs).",
            "Agents arrive uniformly over a window sized so that the work, with every history reused, would keep "
            "the workers `utilization` busy (default 0.7): policies that recompute more queue more. Tool latencies and think times are exponential "
            "(seeded); 2-4 turns of 2-4 tool steps each; reasoning 100-600 tokens, answers 20-80, results 20-200.",
        ],
        "wall_s": time.perf_counter() - t0,
    }
    write_report("scale_sim", result, plot)
    print(f"wall {result['wall_s']:.1f}s -> {RESULTS}/scale_sim.json")


if __name__ == "__main__":
    main()
