"""A soak: normal and hostile traffic together against a small swarm, for FUSION_SOAK_SECONDS (90 s by
default; set it higher for a longer run). Three one-thread fusion-shard processes of the default model,
A=[0,15), B=[15,30) and C=[0,30), behind a gateway (--shard), while:

- streams: greedy streaming completions, each compared token for token with fusion-generate;
- long prompts: prefills of ~1500 tokens competing with the streams' decode steps;
- echo + logprobs of a ~400-token prompt (the reply that once outgrew a message);
- leavers: clients that close their connection mid-stream or mid-prefill;
- hostile requests: malformed bodies, bad parameters, wrong keys and content types;
- slow sockets trickling a header line now and then;
- /health polled every 50 ms.

Asserts: no stream differs from its reference; the hostile requests get 4xx, the others 200; no
member is retired (all stay active, the gateway never fails over); /health's p99 stays under 100 ms;
and once the load stops, the gateway's resident memory is within 32 MiB of where it was before.
"""
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import shard_cluster  # noqa: E402
from shard_cluster import by_address  # noqa: E402

KEY = "sk-test-soak-key"
PROMPT = [504, 1552, 3732, 3434, 359]
MAX_TOKENS = 24
SECONDS = float(os.environ.get("FUSION_SOAK_SECONDS", "90"))
WORDS = ("the", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "are", "with", "as")


def words(n):
    return " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def cluster():
    with shard_cluster.swarm_cluster({"A": (0, 15), "B": (15, 30), "C": (0, 30)}, KEY,
                                     "--connection-timeout-s", "30") as c:
        yield c


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def raw_request(port, head, body=b"", timeout=30):
    """Sends one raw HTTP request; returns the status code (0: no answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body)
        data = s.recv(64)
    try:
        return int(data.split(b" ")[1])
    except (IndexError, ValueError):
        return 0


class Soak:
    """The load's workers and what they saw."""

    def __init__(self, cluster, reference):
        self.c, self.ref = cluster, reference
        self.gw = cluster["gw"]
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.streams = self.mismatches = 0
        self.statuses = {}      # kind -> list of status codes
        self.health_ms = []
        self.errors = []

    def note(self, kind, status):
        with self.lock:
            self.statuses.setdefault(kind, []).append(status)

    def guard(self, fn):
        def run():
            try:
                while not self.stop.is_set():
                    fn()
            except Exception as e:  # noqa: BLE001
                with self.lock:
                    self.errors.append(f"{fn.__name__}: {e!r}")
        return run

    def stream(self):
        body = shard_cluster.completion_body(self.c["id"], PROMPT, MAX_TOKENS, True)
        tokens, errors = shard_cluster.stream_completion(self.gw.url, KEY, body)
        with self.lock:
            self.streams += 1
            self.mismatches += bool(errors or tokens != self.ref)

    def post(self, kind, body, timeout=120):
        st, _ = shard_cluster.api_request(self.gw, "POST", "/v1/completions", body, KEY, timeout)
        self.note(kind, st)

    def long_prompt(self):
        self.post("long", {"model": self.c["id"], "prompt": words(1500), "max_tokens": 1})

    def echo_logprobs(self):
        self.post("echo", {"model": self.c["id"], "prompt": words(400), "max_tokens": 2, "echo": True,
                           "logprobs": 2})

    def leaver(self):
        body = json.dumps({"model": self.c["id"], "prompt": words(800), "max_tokens": 40, "stream": True}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        with socket.create_connection(("127.0.0.1", self.gw.port), timeout=30) as s:
            s.sendall(head + body)
            time.sleep(0.3)
        self.stop.wait(0.5)

    def hostile(self):
        port, auth = self.gw.port, f"Authorization: Bearer {KEY}\r\n".encode()
        cases = [
            (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + auth
             + b"Content-Length: 9\r\n\r\n", b'{"model":'),
            (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n" + auth
             + b"Content-Length: 2\r\n\r\n", b"{}"),
            (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Authorization: Bearer sk-wrong-key-000000\r\nContent-Length: 2\r\n\r\n", b"{}"),
            (b"GET /v1/swarm HTTP/1.1\r\nHost: evil.example\r\n" + auth + b"\r\n", b""),
        ]
        bad = json.dumps({"model": self.c["id"], "prompt": "hi", "max_tokens": -5, "temperature": "hot"}).encode()
        cases.append((b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      + auth + f"Content-Length: {len(bad)}\r\n\r\n".encode(), bad))
        for head, body in cases:
            self.note("hostile", raw_request(port, head, body))
        self.stop.wait(0.2)

    def slow_sockets(self):
        socks = []
        try:
            for _ in range(16):
                s = socket.create_connection(("127.0.0.1", self.gw.port), timeout=5)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                socks.append(s)
            for _ in range(5):
                if self.stop.wait(2):
                    break
                for s in socks:
                    try:
                        s.sendall(b"X-Slow: 1\r\n")
                    except OSError:
                        pass
        finally:
            for s in socks:
                s.close()

    def health(self):
        t0 = time.monotonic()
        with urllib.request.urlopen(self.gw.url + "/health", timeout=10) as r:
            assert r.status == 200
            r.read()
        with self.lock:
            self.health_ms.append((time.monotonic() - t0) * 1000)
        self.stop.wait(0.05)


def test_soak(cluster):
    ref = shard_cluster.reference_tokens(cluster["model"], PROMPT, MAX_TOKENS)
    soak = Soak(cluster, ref)
    gw = cluster["gw"]
    soak.stream()  # warm: the paths are measured, the gateway's buffers exist
    rss_before = rss_mib(gw.proc.pid)
    workers = [soak.stream] * 3 + [soak.long_prompt, soak.echo_logprobs, soak.leaver, soak.hostile,
                                   soak.slow_sockets, soak.health]
    threads = [threading.Thread(target=soak.guard(w), daemon=True) for w in workers]
    for t in threads:
        t.start()
    time.sleep(SECONDS)
    soak.stop.set()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    time.sleep(3)
    rss_after = rss_mib(gw.proc.pid)

    st = soak.statuses
    health = sorted(soak.health_ms)
    p99 = health[int(0.99 * (len(health) - 1))] if health else float("inf")
    summary = (f"{soak.streams} streams, {len(st.get('long', []))} long, {len(st.get('echo', []))} echo, "
               f"{len(st.get('hostile', []))} hostile, {len(health)} health (p99 {p99:.1f} ms), "
               f"gateway RSS {rss_before:.0f} -> {rss_after:.0f} MiB")
    print(summary)
    assert not soak.errors, soak.errors[:5]
    assert soak.streams >= 3 and soak.mismatches == 0, summary
    assert st.get("long") and set(st["long"]) == {200}, st.get("long")
    assert st.get("echo") and set(st["echo"]) == {200}, st.get("echo")
    assert st.get("hostile") and all(400 <= s < 500 for s in st["hostile"]), sorted(set(st["hostile"]))
    doc = by_address(shard_cluster.swarm_doc(gw, KEY))
    assert all(doc[s.address]["state"] == "active" for s in cluster["shards"].values()), doc
    out = gw.output()
    assert "retiring" not in out and "failing over" not in out, out[-3000:]
    assert p99 < 100, summary
    assert rss_after < rss_before + 32, summary
