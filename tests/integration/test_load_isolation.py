"""A long prompt must not hold up other clients, nor outlive its own: fusion-shard runs a prefill in
chunks (--max-batch) with other sessions' steps between them, stops it when its client goes
away, and the last shard scores a prompt's tokens itself, so that echo + logprobs of a long prompt
sends a few numbers per token instead of full-vocabulary logits rows.

One one-thread shard holding the whole default model behind a gateway on loopback.
"""
import json
import os
import re
import socket
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import Gateway, Shard, api_request, default_model, wait_for  # noqa: E402

KEY = "sk-test-isolation-key"
LONG_WORDS = 2500


@pytest.fixture(scope="module")
def cluster():
    model = default_model()
    shards = [Shard(model, 0, 30, ("--max-batch", "128"))]
    gw = None
    try:
        hops = [f for s in shards for f in ("--hop", s.hop())]
        gw = Gateway(model, hops, KEY, "--connection-timeout-s", "30")
        st, doc = api_request(gw, "GET", "/v1/models", key=KEY)
        assert st == 200, doc
        yield {"gw": gw, "shards": shards, "model": doc["data"][0]["id"], "path": model}
    finally:
        if gw:
            assert gw.stop() == 0, gw.output()[-3000:]
        for s in shards:
            s.stop()


WORDS = ("the", "a", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "are", "with", "as", "at",
         "be", "this", "have", "from", "or", "one", "had", "by", "word", "but", "not", "what", "all", "were")


def long_prompt(words, topic="news"):
    """About `words` tokens: common words, one token each, after a topic of its own: prompts of
    other topics share no prefix, so that the shards' prefix caches do not shorten their prefill."""
    return f"{topic}: " + " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(words))


def completion(cluster, prompt, **extra):
    body = {"model": cluster["model"], "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    return api_request(cluster["gw"], "POST", "/v1/completions", body, key=KEY, timeout=300)


def test_long_prefill_does_not_hold_up_a_short_request(cluster):
    done = {}

    def run_long():
        done["long"] = completion(cluster, long_prompt(LONG_WORDS))
        done["long_at"] = time.monotonic()

    t = threading.Thread(target=run_long)
    t.start()
    time.sleep(0.5)  # the long prompt is being prefilled
    st, doc = completion(cluster, "Hello")
    short_at = time.monotonic()
    t.join(300)
    assert st == 200, doc
    assert done["long"][0] == 200, done["long"]
    # answered between the chunks of the long prefill, not after it
    assert short_at < done["long_at"], "the short request waited for the whole long prefill"


def test_a_client_that_leaves_stops_its_prefill(cluster):
    body = json.dumps({"model": cluster["model"], "prompt": long_prompt(LONG_WORDS, "sport"), "max_tokens": 1,
                       "stream": True}).encode()
    gw = cluster["gw"]
    s = socket.create_connection(("127.0.0.1", gw.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(1.0)
    s.close()
    first = cluster["shards"][0]
    pattern = re.compile(r"step cancelled after (\d+) of (\d+) positions")
    wait_for(lambda: pattern.search(first.output()), "the first shard to stop the prefill", timeout=30)
    done, total = map(int, pattern.search(first.output()).groups())
    assert done < total
    # the shard is free again at once
    st, doc = completion(cluster, "Hello")
    assert st == 200, doc


def test_echo_logprobs_of_a_long_prompt(cluster):
    prompt = long_prompt(700)
    st, doc = completion(cluster, prompt, echo=True, logprobs=2)
    assert st == 200, doc
    lp = doc["choices"][0]["logprobs"]
    n_prompt = doc["usage"]["prompt_tokens"]
    assert n_prompt > 600 and len(lp["tokens"]) == n_prompt + 1
    assert lp["token_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    # causal: a prefix's tokens score the same alone (computed in one chunk instead of many)
    st, short = completion(cluster, long_prompt(40), echo=True, logprobs=2)
    assert st == 200, short
    k = short["usage"]["prompt_tokens"]
    a, b = lp["token_logprobs"][1:k], short["choices"][0]["logprobs"]["token_logprobs"][1:k]
    assert max(abs(x - y) for x, y in zip(a, b)) < 2e-2


def test_request_budgets(cluster):
    """--max-request-tokens refuses a request before any work (400); --max-request-seconds ends one that
    runs too long (408) and stops its prefill on the shard."""
    shard = cluster["shards"][0]
    gw = Gateway(cluster["path"], ["--hop", shard.hop()], KEY, "--max-request-tokens", "400",
                 "--max-request-seconds", "1")
    try:
        body = {"model": cluster["model"], "prompt": long_prompt(300), "max_tokens": 50, "n": 2}
        st, doc = api_request(gw, "POST", "/v1/completions", body, key=KEY)
        assert st == 400 and doc["error"]["code"] == "request_too_large", doc
        assert "400" in doc["error"]["message"]
        before = shard.output().count("step cancelled after")
        gw2 = Gateway(cluster["path"], ["--hop", shard.hop()], KEY, "--max-request-seconds", "1")
        try:
            t0 = time.monotonic()
            st, doc = api_request(gw2, "POST", "/v1/completions",
                                  {"model": cluster["model"], "prompt": long_prompt(LONG_WORDS, "travel"),
                                   "max_tokens": 1},
                                  key=KEY)
            assert st == 408 and doc["error"]["code"] == "request_timeout", doc
            assert time.monotonic() - t0 < 5
        finally:
            assert gw2.stop() == 0
        wait_for(lambda: shard.output().count("step cancelled after") > before, "the shard to stop the prefill")
    finally:
        assert gw.stop() == 0
