"""fusion-gateway over HTTPS: a certificate made by the test (openssl CLI), one fusion-shard on the real default
model, driven by curl (--cacert) and the official openai SDK (httpx verifying the certificate), streaming and not.

Checks: chat and completions over TLS, SSE streaming over TLS, a client that disconnects from a non-streaming
request over TLS frees its session, a plain-HTTP client to the HTTPS port fails cleanly (no HTTP reply) and the
server keeps serving, and a client that does not trust the certificate is refused.
"""
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import Gateway, Shard, default_model, make_tls  # noqa: E402

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "sk-test-gateway-tls"
QUESTION = "What is the capital of France?"
MODEL = "SmolLM2-135M-Instruct"  # the default model's served id (its file name without .gguf and .Q4_1)


@pytest.fixture(scope="module")
def cluster():
    model = default_model()
    tls = make_tls(tempfile.mkdtemp(prefix="gateway-tls-"))
    shard = Shard(model, 0, 30)
    gw = None
    try:
        gw = Gateway(model, ["--hop", shard.hop()], KEY, "--https-cert", tls["cert"], "--https-key", tls["key"],
                     "--connection-timeout-s", "5")
        yield {"gw": gw, "shard": shard, "ca": tls["cert"], "url": f"https://127.0.0.1:{gw.port}"}
    finally:
        if gw:
            rc = gw.stop()
            out = gw.output()
            assert rc == 0, f"gateway exited {rc}:\n{out[-3000:]}"
            assert "AddressSanitizer" not in out and "runtime error" not in out, out[-3000:]
        shard.stop()


@pytest.fixture(scope="module")
def client(cluster):
    http_client = httpx.Client(verify=ssl.create_default_context(cafile=cluster["ca"]), timeout=120)
    yield openai.OpenAI(base_url=cluster["url"] + "/v1", api_key=KEY, max_retries=0, http_client=http_client)
    http_client.close()


def curl(cluster, path, *args):
    res = subprocess.run(["curl", "-sS", "-N", "--cacert", cluster["ca"], "-H", f"Authorization: Bearer {KEY}",
                          "-H", "Content-Type: application/json", *args, cluster["url"] + path],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_curl_over_https(cluster):
    assert json.loads(curl(cluster, "/health")) == {"status": "ok"}
    body = json.loads(curl(cluster, "/v1/chat/completions", "-d", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "temperature": 0})))
    assert "Paris" in body["choices"][0]["message"]["content"]
    raw = curl(cluster, "/v1/chat/completions", "-d", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "temperature": 0, "stream": True}))
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if json.loads(e[6:])["choices"])
    assert text == body["choices"][0]["message"]["content"]


def test_openai_sdk_over_https(client):
    m = client.models.list().data[0].id
    r = client.chat.completions.create(model=m, messages=[{"role": "user", "content": QUESTION}], temperature=0,
                                       max_tokens=16)
    assert "Paris" in r.choices[0].message.content
    chunks = list(client.chat.completions.create(model=m, messages=[{"role": "user", "content": QUESTION}],
                                                 temperature=0, max_tokens=16, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    c = client.completions.create(model=m, prompt="The three primary colors are", max_tokens=8, temperature=0)
    s = client.completions.create(model=m, prompt="The three primary colors are", max_tokens=8, temperature=0,
                                  stream=True)
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == c.choices[0].text


def test_untrusted_certificate_is_refused(cluster):
    untrusting = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key=KEY, max_retries=0,
                               http_client=httpx.Client(verify=True, timeout=30))
    with pytest.raises(openai.APIConnectionError):
        untrusting.models.list()
    res = subprocess.run(["curl", "-sS", cluster["url"] + "/health"], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0  # curl: the certificate is not trusted


def test_plain_http_to_https_port(cluster, client):
    """Plain HTTP to the HTTPS port gets no HTTP reply: the connection just closes; the server stays up."""
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", cluster["gw"].port), timeout=15)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        try:
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        except ConnectionResetError:
            pass
        s.close()
        assert not got.startswith(b"HTTP/"), got
    res = subprocess.run(["curl", "-sS", "http://127.0.0.1:%d/health" % cluster["gw"].port], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0
    assert cluster["gw"].alive()
    assert client.models.list().data


def test_disconnect_over_https_frees_session(cluster, client):
    """A TLS client that closes its socket during a non-streaming generation cancels it."""
    ctx = ssl.create_default_context(cafile=cluster["ca"])
    body = json.dumps({"model": client.models.list().data[0].id, "prompt": "Count: 1, 2, 3,", "max_tokens": 4000,
                       "ignore_eos": True, "temperature": 0})
    raw = socket.create_connection(("127.0.0.1", cluster["gw"].port), timeout=30)
    s = ctx.wrap_socket(raw, server_hostname="localhost")
    s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    deadline = time.time() + 30
    while sessions(cluster) != 1:
        assert time.time() < deadline, "the generation did not start"
        time.sleep(0.05)
    time.sleep(0.5)
    s.close()
    deadline = time.time() + 10
    while sessions(cluster) != 0 and time.time() < deadline:
        time.sleep(0.1)
    assert sessions(cluster) == 0
    r = client.completions.create(model=client.models.list().data[0].id, prompt="The capital of France is",
                                  max_tokens=3, temperature=0)
    assert "Paris" in r.choices[0].text


def sessions(cluster):
    """The gateway's open chain sessions, from /metrics."""
    out = subprocess.run(["curl", "-sS", "--cacert", cluster["ca"], "-H", f"Authorization: Bearer {KEY}",
                          cluster["url"] + "/metrics"], capture_output=True, text=True, timeout=60).stdout
    for line in out.splitlines():
        if line.startswith("fusion_gateway_active_sessions "):
            return float(line.split()[1])
    raise AssertionError("fusion_gateway_active_sessions not in /metrics")
