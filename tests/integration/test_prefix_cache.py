"""Prefix caching across requests on a two-shard chain: the same prompt twice gives the same tokens
(greedy and seeded) with the second request's prefix taken from the cache on both shards, with
the gateway driving each hop and with server-to-server forwarding; a chain with --prefix-cache
off gives the same tokens too."""
import json
import os
import sys
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import shard_cluster  # noqa: E402
from shard_cluster import Gateway, Shard, default_model, shard_info  # noqa: E402

KEY = "sk-test-prefix-key"
SYSTEM = ("You are a careful assistant for a library. " * 20).strip()
QUESTION = "Which books about the sea would you recommend to a child?"


def get(gw, path):
    req = urllib.request.Request(gw.url + path)
    req.add_header("Authorization", "Bearer " + KEY)
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


def chat(gw, seed=None, temperature=0.0, question=QUESTION):
    body = {"model": json.loads(get(gw, "/v1/models"))["data"][0]["id"], "max_tokens": 12, "temperature": temperature,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    if seed is not None:
        body["seed"] = seed
    req = urllib.request.Request(gw.url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", "Bearer " + KEY)
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens"]


def metric(gw, name):
    for line in get(gw, "/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def hit_tokens(shard):
    return shard_info(shard).get(22, 0)  # InfoReply.prefix_hit_tokens


def run_cluster(model, *shard_flags, gateway_flags=()):
    shards = [Shard(model, 0, 15, shard_flags), Shard(model, 15, 30, shard_flags)]
    route = [f for s in shards for f in ("--hop", s.hop())]
    return shards, Gateway(model, route, KEY, *gateway_flags)


def stop(gw, shards):
    rc = gw.stop()
    out = gw.output()
    for s in shards:
        s.stop()
    assert rc == 0, out[-3000:]


def test_prefix_cache_same_tokens_and_hits_on_every_shard():
    pytest.importorskip("grpc")
    model = default_model()
    shards, gw = run_cluster(model)
    try:
        greedy1, n_prompt = chat(gw)
        assert [hit_tokens(s) for s in shards] == [0, 0]
        greedy2, _ = chat(gw)
        assert greedy2 == greedy1
        hits = [hit_tokens(s) for s in shards]
        assert all(h > 0 for h in hits), hits
        assert hits[0] == hits[1] and hits[0] <= n_prompt - 1, (hits, n_prompt)
        assert metric(gw, "fusion_prefix_hit_tokens_total") == hits[0]
        assert metric(gw, "fusion_prefix_prompt_tokens_total") == 2 * n_prompt
        assert shard_info(shards[0]).get(21, 0) > 0  # InfoReply.prefix_cached_blocks
        shard_cluster.wait_for(lambda: metric(gw, "fusion_prefix_cached_blocks") > 0,
                               "the health probe to see the cached blocks")
        seeded1, _ = chat(gw, seed=1234, temperature=0.9)
        seeded2, _ = chat(gw, seed=1234, temperature=0.9)
        assert seeded2 == seeded1
        # the same system prompt with another question still reuses the shared part
        before = hit_tokens(shards[1])
        other, _ = chat(gw, question="What is the capital of France?")
        assert hit_tokens(shards[1]) > before
    finally:
        stop(gw, shards)

    shards, gw = run_cluster(model, "--prefix-cache", "off")
    try:
        assert chat(gw)[0] == greedy1
        assert chat(gw, seed=1234, temperature=0.9)[0] == seeded1
        assert chat(gw, question="What is the capital of France?")[0] == other
        assert [hit_tokens(s) for s in shards] == [0, 0]
        assert metric(gw, "fusion_prefix_hit_tokens_total") == 0
    finally:
        stop(gw, shards)

    # server-to-server forwarding: the first shard opens the second with the prompt and answers
    # the least of the two cached prefixes
    shards, gw = run_cluster(model, gateway_flags=("--forward",))
    try:
        assert chat(gw)[0] == greedy1
        assert chat(gw)[0] == greedy1
        hits = [hit_tokens(s) for s in shards]
        assert hits[0] == hits[1] > 0, hits
    finally:
        stop(gw, shards)
