"""Step deadlines from measured step times: a hung shard is failed over within seconds, a busy one is
waited for and kept. Three fusion-shard processes of the default model, A=[0,15), B=[15,30) and
C=[0,30), given to the gateway as --shard addresses, with a 30 s step timeout.

- A long prompt's prefill beside a stream, on a gateway whose step timeout (3 s) is shorter than the
  prefill: the steps wait past their deadlines, the shards answer probes, so no member is retired,
  nothing fails over and both requests complete.
- SIGSTOP of the block-0 server of a stream's path: the stream stalls for about the measured deadline
  plus one probe, not the step timeout, then completes on the other path with exactly the reference
  tokens, and the stopped server is retired.
"""
import os
import signal
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import shard_cluster  # noqa: E402
from shard_cluster import Gateway, by_address, wait_for  # noqa: E402

KEY = "sk-test-hung-shard-key"
PROMPT = [504, 1552, 3732, 3434, 359]
MAX_TOKENS = 48
STEP_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def cluster():
    with shard_cluster.swarm_cluster({"A": (0, 15), "B": (15, 30), "C": (0, 30)}, KEY, "--connection-timeout-s", "60",
                                     "--step-timeout-ms", str(STEP_TIMEOUT_S * 1000)) as c:
        yield c


@pytest.fixture(scope="module")
def reference(cluster):
    return shard_cluster.reference_tokens(cluster["model"], PROMPT, MAX_TOKENS)


def stream(cluster, on_chunk=None):
    body = shard_cluster.completion_body(cluster["id"], PROMPT, MAX_TOKENS, True)
    return shard_cluster.stream_completion(cluster["gw"].url, KEY, body, on_chunk)


def states(cluster):
    doc = by_address(shard_cluster.swarm_doc(cluster["gw"], KEY))
    return {n: doc[s.address]["state"] for n, s in cluster["shards"].items()}


def test_a_busy_shard_is_waited_for(cluster, reference):
    words = " ".join(("the", "of", "and", "to", "in", "is")[i % 6] for i in range(1500))
    long_body = {"model": cluster["id"], "prompt": words, "max_tokens": 1}
    out = {}
    shards = cluster["shards"]
    gw = Gateway(cluster["model"], [f for s in shards.values() for f in ("--shard", s.address)], KEY,
                 "--connection-timeout-s", "60", "--step-timeout-ms", "3000")

    def run_long():
        out["long"] = shard_cluster.api_request(gw, "POST", "/v1/completions", long_body, KEY, 300)

    first = []

    def on_chunk(n):
        if n >= 2 and not first:  # the stream's path is measured: now the prefill competes with it
            first.append(n)
            t.start()

    t = threading.Thread(target=run_long)
    try:
        tokens, errors = stream(dict(cluster, gw=gw), on_chunk)
        t.join(300)
        assert not errors and tokens == reference
        assert out["long"][0] == 200, out["long"]
        assert states(dict(cluster, gw=gw)) == {"A": "active", "B": "active", "C": "active"}
        assert "failing over" not in gw.output() and "retiring" not in gw.output(), gw.output()[-3000:]
    finally:
        assert gw.stop() == 0


def test_a_hung_shard_is_failed_over_within_seconds(cluster, reference):
    gw, shards = cluster["gw"], cluster["shards"]
    stopped, times = {}, []

    def on_chunk(n):
        times.append(time.monotonic())
        if n < 4 or stopped:
            return
        live = [s for s in shard_cluster.swarm_doc(gw, KEY)["servers"] if s["load"] > 0]
        first = [s for s in live if s["span"][0] == 0]
        assert len(first) == 1, live
        name = next(k for k, s in shards.items() if s.address == first[0]["address"])
        shards[name].proc.send_signal(signal.SIGSTOP)
        stopped[name] = n

    tokens, errors = stream(cluster, on_chunk)
    assert stopped, "the request finished before a shard could be stopped"
    assert not errors and tokens == reference
    stall = max(b - a for a, b in zip(times, times[1:]))
    # the measured deadline (2 s floor + 4 x the p99 step) plus a 1 s probe, far below the step timeout
    assert stall < STEP_TIMEOUT_S / 3, f"the stream stalled {stall:.1f} s"
    assert "failing over" in gw.output()
    name = next(iter(stopped))
    wait_for(lambda: states(cluster)[name] == "gone", f"{name} retired", timeout=15)
    print(f"stopped {name} at token {stopped[name]}: the stream stalled {stall:.2f} s")
