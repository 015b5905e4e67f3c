#!/usr/bin/env python3
"""Prefix caching benchmark: time to first token through the gateway and a 2-shard chain with
the shards' prefix caches on and off, side by side in one run.

1. A long system prompt (about --system-tokens tokens) repeated with a new question each time:
   TTFT of a hit (its system prompt cached on both shards by an earlier request) against a miss
   (the same request on the chain with --prefix-cache off).
2. A multi-turn chat: each turn sends the whole history (system prompt, earlier questions and
   answers) plus a new question; TTFT per turn with and without the cache.

Both chains run at once on loopback and the requests alternate between them, so that a slow
spell of a shared machine hits both alike. Usage:
  bench/prefix.py [--model PATH] [--build DIR] [--system-tokens N] [--questions N] [--turns N]"""
import argparse
import json
import os
import statistics
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
import shard_cluster  # noqa: E402
from train import cpu_name  # noqa: E402  (bench/train.py)

KEY = "sk-bench-prefix"
QUESTIONS = ["Which of our rules matter most for a new member?", "How should a lost book be reported?",
             "What are the opening hours on holidays?", "Can children borrow rare books?",
             "Who decides which magazines we keep?", "How long may a laptop be borrowed?",
             "Is food allowed in the reading room?", "How are late fees paid?"]


def system_prompt(n_tokens, place="public library"):
    """Numbered rules of `place`, about n_tokens tokens of SmolLM2's tokenizer."""
    rules = [f"Rule {i}: members return item {i} within {7 + i % 21} days and keep it dry."
             for i in range(n_tokens // 22)]
    return f"You are the assistant of a {place}. Its rules follow.\n" + "\n".join(rules)


class Chain:
    """Two shards (blocks 0:15 and 15:30) and a gateway over them; `flags` for the shards."""

    def __init__(self, model, flags, threads):
        self.shards = [shard_cluster.Shard(model, 0, 15, flags, threads=threads),
                       shard_cluster.Shard(model, 15, 30, flags, threads=threads)]
        route = [f for s in self.shards for f in ("--hop", s.hop())]
        self.gw = shard_cluster.Gateway(model, route, KEY, "--step-timeout-ms", "600000")
        with urllib.request.urlopen(self.request("/v1/models"), timeout=30) as r:
            self.model_id = json.loads(r.read())["data"][0]["id"]

    def request(self, path, body=None):
        req = urllib.request.Request(self.gw.url + path, data=json.dumps(body).encode() if body else None,
                                     method="POST" if body else "GET")
        req.add_header("Authorization", "Bearer " + KEY)
        req.add_header("Content-Type", "application/json")
        return req

    def ttft(self, messages, max_tokens=24):
        """(seconds to the first streamed token, the reply's text, prompt tokens)."""
        body = {"model": self.model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        t0, first, text, prompt = time.time(), None, "", 0
        with urllib.request.urlopen(self.request("/v1/chat/completions", body), timeout=900) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    prompt = ev["usage"]["prompt_tokens"]
                for ch in ev.get("choices", []):
                    piece = ch.get("delta", {}).get("content") or ""
                    if piece and first is None:
                        first = time.time() - t0
                    text += piece
        return first if first is not None else time.time() - t0, text, prompt

    def stop(self):
        shard_cluster.stop_all(self.gw, self.shards)


def repeated_system(chains, system, n_questions):
    """Median TTFT per chain of n_questions new questions after one warm-up request each."""
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    times, n_prompt = {k: [] for k in chains}, 0
    for k, c in chains.items():
        c.ttft(msgs("Hello."))  # the first request: a miss everywhere (fills the cache when on)
    for q in QUESTIONS[:n_questions]:
        for k, c in chains.items():
            t, _, n_prompt = c.ttft(msgs(q))
            times[k].append(t)
    return {k: statistics.median(v) for k, v in times.items()}, n_prompt


def multi_turn(chains, system, turns):
    """TTFT of each turn of one conversation per chain (each with its own history)."""
    hist = {k: [{"role": "system", "content": system}] for k in chains}
    rows = []
    for t in range(turns):
        row = {}
        for k, c in chains.items():
            hist[k].append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            secs, text, n_prompt = c.ttft(hist[k])
            hist[k].append({"role": "assistant", "content": text})
            row[k] = (secs, n_prompt)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct, Q4_1)")
    ap.add_argument("--build", help="build directory (default: FUSION_BUILD_DIR or build/)")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per shard")
    a = ap.parse_args()
    if a.build:
        shard_cluster.BUILD = a.build
    model = a.model or shard_cluster.default_model()
    system = system_prompt(a.system_tokens)
    chains = {}
    try:
        chains["on"] = Chain(model, [], a.threads)
        chains["off"] = Chain(model, ["--prefix-cache", "off"], a.threads)
        print(f"CPU: {cpu_name()}; model {os.path.basename(model)}; 2-shard chain on loopback, "
              f"{a.threads} thread(s) per shard; greedy, TTFT of streamed chat completions")
        med, n_prompt = repeated_system(chains, system, a.questions)
        print(f"\nrepeated system prompt + a new question ({n_prompt} prompt tokens; median of {a.questions})")
        print(f"{'cache':>6} {'TTFT s':>8}")
        print(f"{'off':>6} {med['off']:>8.3f}   (miss)")
        print(f"{'on':>6} {med['on']:>8.3f}   (hit)   {med['off'] / med['on']:.1f}x lower")
        print("\nmulti-turn chat (each turn: the whole history + a new question), TTFT per turn")
        print(f"{'turn':>4} {'prompt tok':>10} {'off s':>8} {'on s':>8} {'off/on':>7}")
        # another system prompt: the first turn is a miss on both chains
        for i, row in enumerate(multi_turn(chains, system_prompt(a.system_tokens, "city museum"), a.turns)):
            off, on = row["off"][0], row["on"][0]
            print(f"{i + 1:>4} {row['on'][1]:>10} {off:>8.3f} {on:>8.3f} {off / on:>7.1f}")
    finally:
        for c in chains.values():
            c.stop()


if __name__ == "__main__":
    main()
