#!/usr/bin/env python3
"""structured.py -- the cost of constrained decoding: decode tokens/s of the same chat with and without a
JSON schema (response_format json_schema), in one run on one cluster, alternating the two so that both
see the same machine.

Starts one fusion-shard with the whole default model (SmolLM2-135M-Instruct) and a gateway on loopback
(tests/integration/shard_cluster.py), then streams `--runs` chats of each kind. A request's decode rate is
(its tokens - 1) / (last token's arrival - first token's arrival), so the prompt's prefill is left out;
the figure is the median over runs. Free text runs with ignore_eos so that its length matches. The gateway
computes each step's allowed-token mask (gm_matcher_mask) between steps, so its cost shows in full here.

  .venv/bin/python bench/structured.py                 # 8 runs of each, 96 tokens, 2 shard threads
  .venv/bin/python bench/structured.py --runs 16 --threads 4
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
import shard_cluster  # noqa: E402

KEY = "sk-bench-structured"
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "qty": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "qty", "tags"], "additionalProperties": False}}},
    "required": ["title", "items"], "additionalProperties": False}
ASK = [{"role": "user", "content": "List the groceries for a week of dinners as JSON, with quantities and tags."}]


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def stream(gw, model, tokens, seed, schema):
    """(tokens generated, decode tokens/s) of one streamed chat."""
    body = {"model": model, "messages": ASK, "max_tokens": tokens, "temperature": 0.8, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "groceries", "schema": schema}}
    else:
        body["ignore_eos"] = True
    req = urllib.request.Request(gw.url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
    times, n = [], 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                n = ev["usage"]["completion_tokens"]
            if ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    if n < 2 or len(times) < 2 or times[-1] <= times[0]:
        return n, 0.0
    return n, (n - 1) / (times[-1] - times[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2, help="the shard's compute threads")
    a = ap.parse_args()
    model = shard_cluster.default_model()
    shard = shard_cluster.Shard(model, 0, 30, threads=a.threads)
    gw = None
    try:
        gw = shard_cluster.Gateway(model, ["--hop", shard.hop()], KEY)
        served = shard_cluster.api_request(gw, "GET", "/v1/models", key=KEY)[1]["data"][0]["id"]
        stream(gw, served, 8, 0, None)  # warm up: weights paged in, the grammar vocabulary built
        stream(gw, served, 8, 0, SCHEMA)
        rates = {"free text": [], "json_schema": []}
        lengths = {"free text": [], "json_schema": []}
        ratios = []  # each run's constrained rate over the free one just before it: drift cancels
        for i in range(a.runs):
            pair = []
            for kind, schema in (("free text", None), ("json_schema", SCHEMA)):
                n, rate = stream(gw, served, a.tokens, 100 + i, schema)
                pair.append(rate)
                if rate:
                    rates[kind].append(rate)
                    lengths[kind].append(n)
            if all(pair):
                ratios.append(pair[1] / pair[0])
        print(f"CPU: {cpu_name()} ({os.cpu_count()} logical CPUs), shard threads {a.threads}")
        print(f"model: {served}, {a.runs} runs of each, max_tokens {a.tokens}, temperature 0.8")
        for kind in rates:
            r = rates[kind]
            print(f"  {kind:<12} decode {statistics.median(r):7.1f} tokens/s (median; min {min(r):.1f}, "
                  f"max {max(r):.1f}), {statistics.mean(lengths[kind]):.0f} tokens per run")
        free, constrained = statistics.median(rates["free text"]), statistics.median(rates["json_schema"])
        print(f"  json_schema vs free text: {100 * (constrained / free - 1):+.1f}% (medians), "
              f"{100 * (statistics.median(ratios) - 1):+.1f}% (median of paired runs)")
    finally:
        if gw:
            gw.stop()
        shard.stop()


if __name__ == "__main__":
    main()
