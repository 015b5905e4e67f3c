"""fusion-gateway routing over a swarm and failover: 4 fusion-shard processes on the real default model
(SmolLM2-135M-Instruct Q4_1, 30 blocks) with overlapping spans A=[0,15), B=[15,30), C=[0,30), D=[15,30),
given to the gateway as --shard addresses (spans learnt from Info heartbeats).

Checks: /v1/swarm lists every server with its span, state and flow; a greedy streaming completion equals
fusion-generate token for token; SIGKILL of the shard holding block 0 on the request's path mid-stream
(the replacement always covers a different sub-span: C=[0,30) replaces A=[0,15), or A=[0,15) + B/D replace
C=[0,30)) leaves the stream complete with exactly the reference tokens; killing every server of [0, 15)
gives a quick 503 "no server covers blocks [0, 15)"; a shard restarted on the same address rejoins.
"""
import os
import signal
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import shard_cluster  # noqa: E402
from shard_cluster import Gateway, Shard, default_model, by_address, wait_for  # noqa: E402

KEY = "sk-test-failover-key"
PROMPT = [504, 1552, 3732, 3434, 359]  # any ids; the reference is computed from them
MAX_TOKENS = 64


def request(gw, method, path, body=None, key=KEY, timeout=60):
    return shard_cluster.api_request(gw, method, path, body, key, timeout)


def swarm(gw):
    return shard_cluster.swarm_doc(gw, KEY)


MODEL_ID = []


def completion_body(stream):
    return shard_cluster.completion_body(MODEL_ID[0], PROMPT, MAX_TOKENS, stream)


def stream_tokens(gw, on_chunk=None):
    """A streaming greedy completion; returns (token ids, error events). on_chunk(n_tokens) after each chunk."""
    return shard_cluster.stream_completion(gw.url, KEY, completion_body(True), on_chunk)


@pytest.fixture(scope="module")
def cluster():
    model = default_model()
    shards = {}
    gw = None
    try:
        for name, (a, b) in {"A": (0, 15), "B": (15, 30), "C": (0, 30), "D": (15, 30)}.items():
            shards[name] = Shard(model, a, b)
        gw = Gateway(model, [flag for s in shards.values() for flag in ("--shard", s.address)], KEY,
                     "--connection-timeout-s", "5", "--step-timeout-ms", "20000")
        st, models = request(gw, "GET", "/v1/models")
        assert st == 200, models
        MODEL_ID[:] = [models["data"][0]["id"]]
        yield {"model": model, "shards": shards, "gw": gw}
    finally:
        if gw:
            gw.stop()
        for s in shards.values():
            s.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def reference(cluster):
    return shard_cluster.reference_tokens(cluster["model"], PROMPT, MAX_TOKENS)


def test_swarm_route_failover_and_503(cluster, reference):
    gw, shards = cluster["gw"], cluster["shards"]
    addr = {n: s.address for n, s in shards.items()}

    # /v1/swarm: auth like the other routes; every server active with its span and a share of the flow
    assert request(gw, "GET", "/v1/swarm", key=None)[0] == 401
    doc = swarm(gw)
    assert doc["n_layers"] == 30 and doc["uncovered_blocks"] == 0 and doc["max_flow"] > 0
    servers = by_address(doc)
    spans = {"A": [0, 15], "B": [15, 30], "C": [0, 30], "D": [15, 30]}
    for n, a in addr.items():
        assert servers[a]["state"] == "active", servers[a]
        assert servers[a]["span"] == spans[n]
        assert servers[a]["tokens_per_s"] > 0 and servers[a]["last_heartbeat"] is not None
        assert servers[a]["total_kv_bytes"] > 0
        # static shards report one block's step times in Info, the planner's profile of each
        steps = servers[a]["step_ms"]
        assert steps["prompt"][0][0] == 16 and steps["decode"][0][0] == 1, steps
        assert all(ms >= 0 for table in steps.values() for _, ms in table), steps
    assert doc["planner"]["profiled_members"] == 4 and doc["planner"]["decode_tokens_per_s"] > 0, doc["planner"]
    assert abs(sum(servers[addr[n]]["flow"] for n in ("A", "C")) - doc["max_flow"]) < 1e-6 * doc["max_flow"] + 1e-9

    # undisturbed: streaming greedy equals the single-process engine
    tokens, errors = stream_tokens(gw)
    assert not errors and tokens == reference

    # failover: kill the block-0 server of the request's path after a few tokens
    killed = {}

    def on_chunk(n):
        if n < 4 or killed:
            return
        live = [s for s in swarm(gw)["servers"] if s["load"] > 0]
        first = [s for s in live if s["span"][0] == 0]
        assert len(first) == 1, live
        name = next(k for k, v in addr.items() if v == first[0]["address"])
        shards[name].proc.send_signal(signal.SIGKILL)
        killed[name] = n

    tokens, errors = stream_tokens(gw, on_chunk)
    assert killed, "the request finished before a shard could be killed"
    dead = next(iter(killed))
    assert killed[dead] < MAX_TOKENS
    assert not errors, errors
    assert tokens == reference, f"after killing {dead} at token {killed[dead]}"
    assert "failing over" in gw.output()
    print(f"killed {dead} at token {killed[dead]}")
    wait_for(lambda: by_address(swarm(gw))[addr[dead]]["state"] == "gone", f"{dead} gone in /v1/swarm", timeout=15)

    # a shard restarted on its address rejoins
    port = addr[dead].rsplit(":", 1)[1]
    span = spans[dead]
    shards[dead] = Shard(cluster["model"], span[0], span[1], extra=["--listen", f"127.0.0.1:{port}"])
    assert shards[dead].address == addr[dead]
    wait_for(lambda: by_address(swarm(gw))[addr[dead]]["state"] == "active", f"{dead} rejoining", timeout=30)

    # five concurrent streams spread over both kinds of path (IWRR by load over the flow: A's path carries
    # ~3x C's, so the 4th or 5th goes over C); kill C=[0,30) on one of them:
    # its replacement is A=[0,15) + B or D, a different split whose caches are rebuilt from position 0
    n_streams = 5
    progress, results = [0] * n_streams, [None] * n_streams

    def run(i):
        def note(n):
            progress[i] = n
        results[i] = stream_tokens(gw, note)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_streams)]
    for t in threads:
        t.start()
    wait_for(lambda: min(progress) >= 4 or not all(t.is_alive() for t in threads), "the streams under way", timeout=15)
    loads = by_address(swarm(gw))
    # Routing by load normally puts a stream over C; on a machine so loaded that
    # the measured speeds skew the flow, every stream may take A's path -- then
    # A is the victim (C, a different split, replaces it, as above).
    victim = "C" if loads[addr["C"]]["load"] > 0 else "A"
    shards[victim].proc.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(120)
    for toks, errs in results:
        assert not errs and toks == reference, f"after killing {victim}: {loads}"
    wait_for(lambda: by_address(swarm(gw))[addr[victim]]["state"] == "gone", f"{victim} gone in /v1/swarm", timeout=15)
    print(f"second failover: killed {victim}")

    # every server of [0, 15) gone: a quick 503 naming the blocks
    survivor = "A" if victim == "C" else "C"
    shards[survivor].proc.send_signal(signal.SIGKILL)
    wait_for(lambda: swarm(gw)["uncovered_blocks"] == 15, "blocks [0, 15) uncovered", timeout=15)
    t0 = time.time()
    st, body = request(gw, "POST", "/v1/completions", completion_body(False), timeout=20)
    assert st == 503, body
    assert "no server covers blocks [0, 15)" in body["error"]["message"]
    assert time.time() - t0 < 5
    doc = swarm(gw)
    states = {n: by_address(doc)[a]["state"] for n, a in addr.items()}
    assert states == {"A": "gone", "B": "active", "C": "gone", "D": "active"}, states
