"""fusion-gateway against slow clients (slowloris), with real processes on loopback.

A gateway with small limits (64 connections, 16 per address, a reserve of 8, 2 s for a
request's headers and 2 s for its body) faces hundreds of connections that trickle header
lines from many loopback addresses (127.0.0.2, 127.0.0.3, ...: each its own client address):
/livez still answers (within 3 s; /health is 503: the mute shard serves nothing) during the attack and after it, because a new connection past
64 - 8 closes the oldest unfinished request. A connection that trickles header lines, or a
chunked body, faster than the idle timeout is still closed at its deadline; an address past its
cap gets its excess connections closed; a completion waiting suspended on its generation is not
"reading" and keeps its connection past the deadlines and through the attack. The gateway's only
shard is a listener that accepts and never answers.
"""
import json
import os
import socket
import sys
import threading
import time

import pytest
import requests

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import Gateway, default_model  # noqa: E402

KEY = "sk-test-slowloris-key"
MODEL = "SmolLM2-135M-Instruct"  # the default model's served id (its file name without .gguf and .Q4_1)
DEAD_HOP = "127.0.0.1:1:0:30"  # nothing listens on port 1
DEADLINE_S = 2
LIMITS = ["--max-connections", "64", "--max-connections-per-ip", "16", "--connection-reserve", "8",
          "--header-timeout-s", str(DEADLINE_S), "--body-timeout-s", str(DEADLINE_S),
          "--connection-timeout-s", "120"]  # the idle timeout alone would keep trickling clients


@pytest.fixture(scope="module")
def model():
    return default_model()


def check_stopped(g):
    rc = g.stop()
    out = g.output()
    assert rc == 0, f"gateway exited {rc}:\n{out[-3000:]}"
    assert "AddressSanitizer" not in out and "runtime error" not in out, out[-3000:]


@pytest.fixture(scope="module")
def mute():
    """A listener that accepts connections and never answers: the gateway's only shard."""
    m = socket.socket()
    m.bind(("127.0.0.1", 0))
    m.listen(16)
    yield m
    m.close()


@pytest.fixture(scope="module")
def gw(model, mute):
    g = Gateway(model, ["--hop", "127.0.0.1:%d:0:30" % mute.getsockname()[1]], KEY, *LIMITS,
                "--step-timeout-ms", "8000")
    yield g
    check_stopped(g)


@pytest.fixture(scope="module")
def pending_chat(gw):
    """A completion that waits suspended on the mute shard (until the chain gives up on it) while
    the other tests run; {"status", "seconds"} once its thread is joined."""
    out = {}

    def run():
        start = time.time()
        try:
            r = requests.post(gw.url + "/v1/completions", timeout=60,
                              headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"},
                              data=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}))
            out["status"], out["body"] = r.status_code, r.text
        except requests.RequestException as e:
            out["status"], out["body"] = None, repr(e)
        out["seconds"] = time.time() - start

    t = threading.Thread(target=run)
    t.start()
    # wait until the request is in (a new connection evicts the oldest one still sending)
    deadline = time.time() + 10
    while time.time() < deadline and t.is_alive() and running(gw) < 1:
        time.sleep(0.05)
    yield t, out
    t.join()


def running(gw):
    """The gateway's generation requests in flight (/metrics)."""
    r = requests.get(gw.url + "/metrics", headers={"Authorization": "Bearer " + KEY}, timeout=10)
    for line in r.text.splitlines():
        if line.startswith("fusion_gateway_running_requests "):
            return float(line.split()[1])
    raise AssertionError("fusion_gateway_running_requests not in /metrics")


def slow_socket(port, source, request=b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n"):
    """A connection from `source` that has sent the start of a request; None if it cannot connect."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(request)
    except OSError:
        s.close()
        return None
    s.setblocking(False)
    return s


def is_closed(s):
    """Whether the server has closed s (EOF or a reset); bytes it sent (a response) count as closed too."""
    try:
        s.recv(4096)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def wait_closed(s, timeout):
    """Seconds until the server closes s (None: still open after timeout); a response's bytes are returned too."""
    start = time.time()
    got = b""
    s.setblocking(True)
    s.settimeout(0.2)
    while time.time() - start < timeout:
        try:
            chunk = s.recv(4096)
        except socket.timeout:
            continue
        except OSError:
            return time.time() - start, got
        if not chunk:
            return time.time() - start, got
        got += chunk
    return None, got


def health_ok(gw, timeout=3.0):
    r = requests.get(gw.url + "/livez", timeout=timeout, headers={"Connection": "close"})
    return r.status_code == 200 and r.json() == {"status": "ok"}


def test_health_answers_through_a_slowloris(gw, pending_chat):
    """300 trickling connections from 20 addresses, reopened as they are closed, for 3 deadlines."""
    sources = ["127.0.0.%d" % (2 + i // 15) for i in range(300)]
    slots = [slow_socket(gw.port, src) for src in sources]
    served = 0
    end = time.time() + 3 * DEADLINE_S
    try:
        while time.time() < end:
            for i, s in enumerate(slots):
                if s is None or is_closed(s):
                    if s is not None:
                        s.close()
                    slots[i] = slow_socket(gw.port, sources[i])
                else:
                    try:
                        s.send(b"X-Slow: 1\r\n")
                    except OSError:
                        pass
            assert health_ok(gw), "/health failed during the attack"
            served += 1
            time.sleep(0.2)
    finally:
        for s in slots:
            if s is not None:
                s.close()
    assert served >= 5
    for _ in range(3):
        assert health_ok(gw), "/health failed after the attack"
    assert gw.alive()


def test_per_address_cap_closes_the_excess(gw):
    held = [slow_socket(gw.port, "127.0.0.200") for _ in range(16)]
    assert all(held)
    extra = [slow_socket(gw.port, "127.0.0.200") for _ in range(4)]
    try:
        for s in extra:
            if s is not None:  # refused outright is fine too
                waited, _ = wait_closed(s, DEADLINE_S / 2)
                assert waited is not None, "a connection past the address's cap was kept"
        time.sleep(0.2)
        assert not any(is_closed(s) for s in held), "a connection within the cap was closed"
        assert health_ok(gw)  # another address is not affected
    finally:
        for s in held + extra:
            if s is not None:
                s.close()


def trickle_until_closed(s, pieces, every=0.3):
    """Sends pieces on s one by one, `every` seconds apart, until the server closes s (at most
    DEADLINE_S + 3 s); returns wait_closed's (seconds or None, bytes received)."""
    stop = threading.Event()

    def trickle():
        for piece in pieces:
            try:
                s.send(piece)
            except OSError:
                return
            if stop.wait(every):
                return

    t = threading.Thread(target=trickle)
    t.start()
    try:
        return wait_closed(s, DEADLINE_S + 3)
    finally:
        stop.set()
        t.join()
        s.close()


def test_trickled_headers_are_cut_at_the_deadline(gw):
    s = slow_socket(gw.port, "127.0.0.201")
    waited, got = trickle_until_closed(s, [b"X-Slow: 1\r\n"] * 1000)
    assert waited is not None, "a connection trickling header lines was kept past the header deadline"
    assert waited > DEADLINE_S / 2, f"closed after {waited:.1f} s, before its deadline"


def test_trickled_chunked_body_is_cut_at_the_deadline(gw):
    head = (b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    s = slow_socket(gw.port, "127.0.0.202", head)
    waited, got = trickle_until_closed(s, [b"1\r\n%c\r\n" % c for c in b'{"content": "' + b"x" * 1000])
    assert waited is not None, "a connection trickling a chunked body was kept past the body deadline"
    assert waited > DEADLINE_S / 2, f"closed after {waited:.1f} s, before its deadline"
    assert got == b"", got  # libmicrohttpd takes no response before a body's end: closed unanswered


def test_suspended_generation_outlives_the_deadlines(pending_chat):
    """The completion started with the module waited suspended past both deadlines, through the
    attack, and got its error answer (a 5xx once the chain gave up), not a cut connection."""
    t, out = pending_chat
    t.join(60)
    assert out.get("status") is not None and out["status"] >= 500, out
    assert json.loads(out["body"])["error"]["message"], out
    assert out["seconds"] > 2 * DEADLINE_S, f"answered after {out['seconds']:.1f} s: it never waited on the shard"
