"""fusion-gateway's readiness, liveness and per-shard metrics, with real shards on loopback.

Checks:
- Static chain: /health is 200 while both hops serve; killing the only shard of blocks [15, 30)
  turns it 503 within seconds, with a reason that names the blocks and no address, while /livez
  and /health?live=1 stay 200; a shard started again on the same port turns it 200 again.
  /metrics carries fusion_gateway_ready and every shard's up, KV bytes, sessions and tokens/s.
- A shard that refuses the gateway's swarm secret makes /health 503 saying so.
- Routed swarm (--shard): killing the only member of a span makes /health 503 (blocks uncovered).
- --metrics-listen serves /metrics, /health and /livez without an API key, and nothing else.
- Each request leaves one access-log line: method, path, status, the key's fingerprint, and for a
  generation its id, model, tokens and time to the first token.
"""
import os
import signal
import sys
import tempfile
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import Gateway, Shard, api_request, default_model, stop_all, swarm_cluster, wait_for  # noqa: E402

KEY = "sk-health-key"


def wait_health(gw, want, timeout=20):
    """Polls /health until it answers `want`; returns the body."""
    deadline = time.time() + timeout
    while True:
        st, body = api_request(gw, "GET", "/health")
        if st == want or time.time() > deadline:
            assert st == want, body
            return body
        time.sleep(0.2)


def metric_lines(text, name):
    return [ln for ln in text.splitlines() if ln.startswith(name + "{") or ln.startswith(name + " ")]


def test_static_chain_health():
    model = default_model()
    a, b = Shard(model, 0, 15), Shard(model, 15, 30)
    port_file = os.path.join(tempfile.mkdtemp(prefix="metrics-"), "port")
    gw = Gateway(model, ["--hop", a.hop(), "--hop", b.hop()], KEY, "--metrics-listen", "127.0.0.1:0",
                 "--metrics-port-file", port_file)
    try:
        assert wait_health(gw, 200) == {"status": "ok"}
        st, models = api_request(gw, "GET", "/v1/models", key=KEY)
        st, reply = api_request(gw, "POST", "/v1/chat/completions", key=KEY,
                                body={"model": models["data"][0]["id"], "max_tokens": 3,
                                      "messages": [{"role": "user", "content": "Hi"}]})
        assert st == 200, reply

        def access_lines():
            return [ln for ln in gw.output().splitlines() if "access: POST /v1/chat/completions 200" in ln]
        wait_for(access_lines, "the access-log line")  # written after the reply, maybe after it arrives
        line = access_lines()[0]
        assert reply["id"] in line and "completion_tokens=3" in line and "ttft_ms=" in line, line
        assert KEY not in gw.output()  # a fingerprint of the key, never the key
        st, page = api_request(gw, "GET", "/metrics", key=KEY)
        assert st == 200 and metric_lines(page, "fusion_gateway_ready") == ["fusion_gateway_ready 1"], page
        assert metric_lines(page, "fusion_gateway_queue_wait_seconds_count") == [
            "fusion_gateway_queue_wait_seconds_count 1"], page
        up = metric_lines(page, "fusion_shard_up")
        assert len(up) == 2 and all(ln.endswith(" 1") for ln in up), up
        assert f'shard="{b.address}",first="15",last="30",state="serving"' in up[1], up
        assert all(float(ln.split()[-1]) > 0 for ln in metric_lines(page, "fusion_shard_kv_total_bytes"))

        scrape = f"http://127.0.0.1:{int(open(port_file).read())}"
        with urllib.request.urlopen(scrape + "/metrics", timeout=10) as r:  # no key asked
            assert r.status == 200 and "fusion_shard_up" in r.read().decode()
        for path, code in (("/v1/models", 404), ("/nope", 404)):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(scrape + path, timeout=10)
            assert e.value.code == code and "error" in e.value.read().decode()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(scrape + "/metrics", data=b"x", method="POST"), timeout=10)
        assert e.value.code == 405

        port = b.port
        b.stop(signal.SIGKILL)
        body = wait_health(gw, 503, timeout=10)
        assert body["status"] == "unavailable" and "[15, 30)" in body["reason"], body
        assert "127.0.0.1" not in body["reason"], body
        assert api_request(gw, "GET", "/livez")[0] == 200
        assert api_request(gw, "GET", "/health?live=1")[0] == 200
        st, page = api_request(gw, "GET", "/metrics", key=KEY)
        assert metric_lines(page, "fusion_gateway_ready") == ["fusion_gateway_ready 0"], page

        b = Shard(model, 15, 30, extra=("--listen", f"127.0.0.1:{port}"))  # back on the same address
        assert wait_health(gw, 200, timeout=20) == {"status": "ok"}
    finally:
        stop_all(gw, (a, b))


def test_wrong_secret():
    model = default_model()
    a = Shard(model, 0, 30, secret="another-secret-of-the-shard")
    gw = Gateway(model, ["--hop", a.hop()], KEY)
    try:
        body = wait_health(gw, 503)
        assert "refuses the swarm secret" in body["reason"], body
    finally:
        stop_all(gw, (a,))


def test_swarm_health():
    with swarm_cluster({"head": (0, 15), "tail": (15, 30)}, KEY) as sc:
        gw = sc["gw"]
        wait_health(gw, 200)
        sc["shards"]["tail"].stop(signal.SIGKILL)
        body = wait_health(gw, 503, timeout=30)
        assert "15 of the model's 30 blocks" in body["reason"], body
