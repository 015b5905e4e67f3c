"""Helpers for tests that run real fusion-shard processes on loopback."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

BUILD = os.environ.get("FUSION_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
SOURCE = os.environ.get("FUSION_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
SECRET = "integration-secret"


def program(name):
    path = os.path.join(BUILD, "fusion-" + name)
    assert os.path.exists(path), f"{path} not built"
    return path


def stop_process(proc, sig=signal.SIGTERM, timeout=20):
    """Sends sig to a running process, kills it after timeout seconds; returns its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Shard:
    """One fusion-shard process serving [first, last) of a model on 127.0.0.1."""

    def __init__(self, model, first, last, extra=(), secret=SECRET, tls=None, threads=1):
        self.first, self.last = first, last
        self.dir = tempfile.mkdtemp(prefix="shard-")
        port_file = os.path.join(self.dir, "port")
        cmd = [program("shard"), "--model", model, "--blocks", f"{first}:{last}", "--listen",
               "127.0.0.1:0", "--port-file", port_file, "--secret", secret, "--threads", str(threads)]
        if tls:
            cmd += ["--tls-cert", tls["cert"], "--tls-key", tls["key"], "--tls-ca", tls["cert"]]
        else:
            cmd += ["--insecure"]
        cmd += list(extra)
        self.log = open(os.path.join(self.dir, "log"), "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while not os.path.exists(port_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"fusion-shard exited {self.proc.returncode}: {self.output()}")
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("fusion-shard did not start: " + self.output())
            time.sleep(0.05)
        self.port = int(open(port_file).read())
        self.address = f"127.0.0.1:{self.port}"

    def hop(self):
        return f"{self.address}:{self.first}:{self.last}"

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self, sig=signal.SIGTERM, timeout=30):
        return stop_process(self.proc, sig, timeout)


def shard_info(shard, secret=SECRET):
    """The varint fields of a shard's InfoReply by number (fusion.proto), read with grpcio."""
    import grpc
    with grpc.insecure_channel(shard.address) as ch:
        info = ch.unary_unary("/fusion.Shard/Info", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        buf = info(b"", metadata=(("x-fusion-secret", secret),), timeout=10)
    i, fields = 0, {}
    while i < len(buf):  # protobuf wire format: skip all but varints
        key, i = read_varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            fields[num], i = read_varint(buf, i)
        elif wt == 2:
            n, i = read_varint(buf, i)
            i += n
        elif wt in (1, 5):
            i += 8 if wt == 1 else 4
        else:
            raise ValueError(wt)
    return fields


def read_varint(buf, i):
    """A protobuf varint at buf[i]: (value, the index after it)."""
    n = 0
    for k in range(10):
        b = buf[i + k]
        n |= (b & 0x7F) << (7 * k)
        if b < 0x80:
            return n, i + k + 1
    raise ValueError("varint longer than 10 bytes")


def default_model():
    """The default model's path (fetched into the cache if needed); skips the test if unavailable."""
    import pytest
    out = subprocess.run([os.path.join(SOURCE, "scripts", "fetch-default-model.sh")], capture_output=True,
                         text=True, timeout=600)
    path = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode or not os.path.exists(path):
        pytest.skip(f"default model unavailable: {out.stderr[-300:]}")
    return path


class Gateway:
    """A fusion-gateway process on 127.0.0.1 with a port file. `route` are the flags naming
    its shards (["--hop", "addr:a:b", ...] or ["--shard", "addr", ...]); `extra` more flags."""

    def __init__(self, model, route, key, *extra, secret=SECRET):
        self.dir = tempfile.mkdtemp(prefix="gateway-")
        port_file = os.path.join(self.dir, "port")
        cmd = [program("gateway"), "--model", model, "--listen", "127.0.0.1:0", "--port-file", port_file,
               "--secret", secret, "--insecure", "--api-key", key] + list(route) + list(extra)
        self.log = open(os.path.join(self.dir, "log"), "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("fusion-gateway did not start: " + self.output())
            time.sleep(0.05)
        self.port = int(open(port_file).read())
        self.url = f"http://127.0.0.1:{self.port}"

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        return stop_process(self.proc, signal.SIGTERM, 20)


def stop_all(gw, shards, *dirs):
    """Stops the gateway, then the shards, removes dirs; asserts that the gateway exited 0."""
    rc = gw.stop()
    out = gw.output()
    for s in shards:
        s.stop()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    assert rc == 0, f"gateway exited {rc}:\n{out[-3000:]}"


@contextlib.contextmanager
def swarm_cluster(spans, key, *gateway_flags):
    """Shards of the default model named by `spans` ({name: (first, last)}) behind a gateway that
    routes over them (--shard); yields {"model", "shards", "gw", "id" (the served model id)}. On
    the way out every shard is resumed (if stopped) and killed, and the gateway stopped."""
    model = default_model()
    shards, gw = {}, None
    try:
        for name, (a, b) in spans.items():
            shards[name] = Shard(model, a, b)
        gw = Gateway(model, [f for s in shards.values() for f in ("--shard", s.address)], key, *gateway_flags)
        st, models = api_request(gw, "GET", "/v1/models", key=key)
        assert st == 200, models
        yield {"model": model, "shards": shards, "gw": gw, "id": models["data"][0]["id"]}
    finally:
        for s in shards.values():
            s.proc.send_signal(signal.SIGCONT)
            s.stop(signal.SIGKILL)
        if gw:
            gw.stop()


def make_tls(directory):
    """A self-signed certificate for localhost / 127.0.0.1, made with the openssl CLI."""
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return {"cert": cert, "key": key}


def run_chain(shards, prompt, max_tokens, *, wire=None, forward=False, sessions=1, logits=None,
              secret=SECRET, tls=None, extra=(), check=True):
    cmd = [program("chain"), "--secret", secret, "--prompt-ids", ",".join(map(str, prompt)),
           "--max-tokens", str(max_tokens), "--sessions", str(sessions), "--json"]
    for s in shards:
        cmd += ["--hop", s.hop()]
    cmd += ["--tls-ca", tls["cert"]] if tls else ["--insecure"]
    if wire:
        cmd += ["--wire", wire]
    if forward:
        cmd += ["--forward"]
    if logits:
        cmd += ["--logits-out", logits]
    cmd += list(extra)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if check:
        assert res.returncode == 0, f"fusion-chain failed: {res.stderr}"
    return res


def reference_tokens(model, prompt_ids, max_tokens):
    """The greedy continuation of prompt_ids (ignoring EOS) by the single-process engine, fusion-generate."""
    res = subprocess.run([program("generate"), "--model", model, "--prompt-ids", ",".join(map(str, prompt_ids)),
                          "--max-tokens", str(max_tokens), "--ignore-eos", "--json", "--threads", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    ref = json.loads(res.stdout)["tokens"]
    assert len(ref) == max_tokens
    return ref


def wait_for(pred, what, timeout=20):
    """Polls pred() every 0.1 s until it is true; fails the test naming `what` after timeout seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def completion_body(model_id, prompt, max_tokens, stream):
    """A greedy /v1/completions body over token ids that reports every token's id in its logprobs."""
    return {"model": model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, "logprobs": 1, "return_tokens_as_token_ids": True}


def stream_completion(url, key, body, on_chunk=None):
    """Runs a streaming completion (body from completion_body); returns (token ids, error events).
    on_chunk(n_tokens) after each chunk."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {key}")
    tokens, errors, done = [], [], False
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            ev = json.loads(line[6:])
            if "error" in ev:
                errors.append(ev["error"])
                continue
            for ch in ev["choices"]:
                if ch.get("logprobs"):
                    tokens += [int(t.split(":")[1]) for t in ch["logprobs"]["tokens"]]
            if on_chunk:
                on_chunk(len(tokens))
    assert done, "the stream ended without [DONE]"
    return tokens, errors


def api_request(gw, method, path, body=None, key=None, timeout=60):
    """One JSON request to a Gateway (body: JSON-able or None); returns (status, the body parsed as
    JSON, or as text when it is not JSON)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(gw.url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if r.headers.get_content_type() == "application/json" else raw.decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def swarm_doc(gw, key):
    """GET /v1/swarm, which must answer 200."""
    st, doc = api_request(gw, "GET", "/v1/swarm", key=key)
    assert st == 200, doc
    return doc


def by_address(doc):
    """/v1/swarm's servers by address."""
    return {s["address"]: s for s in doc["servers"]}
