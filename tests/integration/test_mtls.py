"""Mutual TLS between peers: fusion-shard --tls-client-ca and fusion-gateway --swarm-tls-client-ca make the
server require a client certificate signed by that CA; clients show theirs (--tls-client-cert/--tls-client-key,
by default their own TLS pair). A CA, certificates it signs and one from an unrelated CA are made with the
openssl CLI per test module; the shards run the real default model (SmolLM2-135M-Instruct Q4_1, 30 blocks).

Checks: a PEM file that is a FIFO is refused at once (never waited on); a forwarding chain over mTLS answers a
chat exactly as the same chain in plaintext; a client (gateway or forwarding shard) without a certificate or with
one from another CA is refused with a clear error while the shard stays up and serving (and active in a swarm
gateway's view); the secret is still checked; SIGKILL of a shard mid-stream with mTLS everywhere fails over to the identical stream;
a shard joins a gateway requiring client certificates, one with a certificate from another CA is refused.
"""
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import shard_cluster  # noqa: E402
from shard_cluster import (SECRET, Gateway, Shard, by_address, default_model, program, stop_process,  # noqa: E402
                           wait_for)

KEY = "sk-test-mtls-key"
PROMPT = [504, 1552, 3732, 3434, 359]
MAX_TOKENS = 48
QUESTION = "What is the capital of France?"
SHARD_REFUSED = "peer did not return a certificate"
SHARD_UNTRUSTED = "certificate verify failed"


# ---- certificates ----------------------------------------------------------------------------------------


def openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(d, name):
    key, cert = str(d / f"{name}.key"), str(d / f"{name}.pem")
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key,
            "-out", cert, "-days", "2", "-subj", f"/CN=fusion test {name}", "-addext",
            "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return {"cert": cert, "key": key}


def make_leaf(d, name, ca):
    """A certificate for localhost / 127.0.0.1 signed by ca, good for serving and as a client."""
    key, csr, cert, ext = (str(d / f"{name}{s}") for s in (".key", ".csr", ".pem", ".ext"))
    with open(ext, "w") as f:
        f.write("basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"
                "extendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key,
            "-out", csr, "-subj", f"/CN={name}")
    openssl("x509", "-req", "-in", csr, "-CA", ca["cert"], "-CAkey", ca["key"], "-CAcreateserial", "-out", cert,
            "-days", "2", "-extfile", ext)
    return {"cert": cert, "key": key}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(d, "ca"), make_ca(d, "other")
    return {"dir": d, "ca": ca["cert"], "node": make_leaf(d, "node", ca), "gateway": make_leaf(d, "gateway", ca),
            "rogue": make_leaf(d, "rogue", other)}


def mtls_shard(model, pki, first, last, extra=()):
    """A shard serving TLS with the node certificate that requires client certificates of the CA (given in a
    config file, so that its key is covered too); as a client it shows the node certificate (the default)."""
    config = pki["dir"] / f"shard-{first}-{last}-{time.monotonic_ns()}.json"
    config.write_text(json.dumps({"tls_client_ca": pki["ca"]}))
    return Shard(model, first, last, tls=pki["node"], extra=["--config", str(config), "--tls-ca", pki["ca"],
                                                              *extra])


def tls_gateway(model, route, pki, client=None, *extra):
    """A gateway speaking TLS to its shards (the CA's), showing `client` ({"cert", "key"}) if given."""
    flags = ["--insecure=false", "--tls-ca", pki["ca"], "--connection-timeout-s", "5"]
    if client:
        flags += ["--tls-client-cert", client["cert"], "--tls-client-key", client["key"]]
    return Gateway(model, route, KEY, *flags, *extra)


def request(gw, method, path, body=None, key=KEY, timeout=60):
    return shard_cluster.api_request(gw, method, path, body, key, timeout)


def chat(gw, max_tokens=16):
    st, models = request(gw, "GET", "/v1/models")
    assert st == 200, models
    body = {"model": models["data"][0]["id"], "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": max_tokens, "temperature": 0}
    return request(gw, "POST", "/v1/chat/completions", body)


def answer(gw):
    st, out = chat(gw)
    assert st == 200, out
    return out["choices"][0]["message"]["content"]


def wait_log(proc, text, what, timeout=20):
    """Waits for `text` in the log of proc (a Shard, Gateway or JoinShard); fails showing the log's end."""
    try:
        wait_for(lambda: text in proc.output(), what, timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}; the log ends:\n{proc.output()[-3000:]}") from None


# ---- PEM files are regular files ---------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-client-ca"])
def test_pem_fifo_refused(pki, tmp_path, flag):
    """A FIFO named as a PEM file (no writer: opening it to read would block forever) is refused at once."""
    fifo = str(tmp_path / "pem.fifo")
    os.mkfifo(fifo)
    pair = {"--tls-cert": fifo, "--tls-key": pki["node"]["key"]}
    if flag == "--tls-client-ca":
        pair = {"--tls-cert": pki["node"]["cert"], "--tls-key": pki["node"]["key"], "--tls-client-ca": fifo}
    cmd = [program("shard"), "--model", default_model(), "--blocks", "0:1", "--listen", "127.0.0.1:0", "--secret",
           SECRET, "--threads", "1"] + [x for kv in pair.items() for x in kv]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert res.returncode != 0
    assert "not a regular file" in res.stderr and fifo in res.stderr, res.stderr


def test_option_errors(pki):
    """Half a client pair, or a client CA without TLS, is a usage error naming the options; a client key
    that does not belong to its certificate is refused."""
    base = [program("shard"), "--model", default_model(), "--blocks", "0:1", "--secret", SECRET]
    res = subprocess.run(base + ["--insecure", "--tls-client-ca", pki["ca"]], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 2 and "--tls-client-ca (mTLS) needs TLS" in res.stderr, res.stderr
    res = subprocess.run(base + ["--insecure", "--tls-client-cert", pki["node"]["cert"]], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 2 and "--tls-client-cert and --tls-client-key go together" in res.stderr, res.stderr
    gw = [program("gateway"), "--model", default_model(), "--secret", SECRET, "--no-auth"]
    res = subprocess.run(gw + ["--shard", "127.0.0.1:1", "--tls-client-key", pki["node"]["key"]],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "--tls-client-cert and --tls-client-key go together" in res.stderr, res.stderr
    res = subprocess.run(gw + ["--swarm-listen", "127.0.0.1:0", "--insecure", "--swarm-tls-client-ca", pki["ca"]],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "--swarm-tls-client-ca (mTLS) needs --swarm-listen with TLS" in res.stderr, \
        res.stderr
    # a key that is not the certificate's fails when the first channel is made (here at start-up)
    res = subprocess.run(gw + ["--shard", "127.0.0.1:1", "--tls-ca", pki["ca"], "--tls-client-cert",
                               pki["node"]["cert"], "--tls-client-key", pki["gateway"]["key"]],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "the client key does not belong to the client certificate" in res.stderr, \
        res.stderr


# ---- a chain with mTLS -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chain(pki):
    """Shards A=[0,15) and B=[15,30) requiring client certificates, and a forwarding gateway over them that
    shows its own certificate (A shows its node certificate to B)."""
    model = default_model()
    shards, gws = [], []
    try:
        shards += [mtls_shard(model, pki, 0, 15), mtls_shard(model, pki, 15, 30)]
        gws.append(tls_gateway(model, [f for s in shards for f in ("--hop", s.hop())], pki, pki["gateway"],
                               "--forward"))
        yield {"model": model, "shards": shards, "gw": gws[0]}
    finally:
        for g in gws:
            g.stop()
        for s in shards:
            s.stop()


def test_mtls_chain_answers_as_plaintext(chain):
    model = chain["model"]
    plain, gw = [], None
    try:
        plain += [Shard(model, 0, 15), Shard(model, 15, 30)]
        gw = Gateway(model, [f for s in plain for f in ("--hop", s.hop())], KEY, "--forward")
        reference = answer(gw)
    finally:
        if gw:
            gw.stop()
        for s in plain:
            s.stop()
    assert "Paris" in reference
    assert answer(chain["gw"]) == reference
    for s in chain["shards"]:
        assert SHARD_REFUSED not in s.output() and SHARD_UNTRUSTED not in s.output()


@pytest.mark.parametrize("client, note, shard_log", [
    (None, "it may require a client certificate, and none is configured", SHARD_REFUSED),
    ("rogue", "it may require client certificates signed by another CA", SHARD_UNTRUSTED),
])
def test_client_refused(chain, pki, client, note, shard_log):
    """A gateway without a certificate, or with one of another CA: a 503 in OpenAI's form naming no address,
    the reason in its log; the shard logs the refused handshake and goes on serving the good gateway."""
    first = chain["shards"][0]
    gw = tls_gateway(chain["model"], ["--hop", first.hop(), "--hop", chain["shards"][1].hop()], pki,
                     pki[client] if client else None)
    try:
        st, out = chat(gw)
        assert st == 503, out
        assert out["error"]["code"] == "shard_unavailable" and "127.0.0.1" not in json.dumps(out), out
        wait_log(gw, note, "the reason in the gateway's log")
        assert f"shard {first.address}: unavailable" in gw.output()
    finally:
        gw.stop()
    wait_log(first, shard_log, "the refused handshake in the shard's log")
    assert first.proc.poll() is None
    assert "Paris" in answer(chain["gw"])


def test_forwarding_shard_refused(chain, pki):
    """Shard to shard: a first hop showing a certificate of another CA to the next hop is refused there; the
    gateway gets the next hop's refusal through it (its log names the cause), the next hop serves on."""
    second = chain["shards"][1]
    first = mtls_shard(chain["model"], pki, 0, 15, ["--tls-client-cert", pki["rogue"]["cert"], "--tls-client-key",
                                                    pki["rogue"]["key"]])
    gw = None
    try:
        gw = tls_gateway(chain["model"], ["--hop", first.hop(), "--hop", second.hop()], pki, pki["gateway"],
                         "--forward")
        st, out = chat(gw)
        assert st == 503 and "127.0.0.1" not in json.dumps(out), out
        wait_log(gw, f"shard {first.address}: unavailable: next hop {second.address}: the server closed the TLS "
                     "connection while it was set up: it may require client certificates signed by another CA",
                 "the cause in the log")
    finally:
        if gw:
            gw.stop()
        first.stop()
    assert second.proc.poll() is None and SHARD_UNTRUSTED in second.output()
    assert "Paris" in answer(chain["gw"])


def test_secret_still_checked(chain, pki):
    """With a good client certificate the swarm secret still decides; without one no call gets through."""
    addr = chain["shards"][1].address
    ca = open(pki["ca"], "rb").read()
    node = pki["node"]
    with_cert = grpc.ssl_channel_credentials(ca, open(node["key"], "rb").read(), open(node["cert"], "rb").read())
    info = "/fusion.Shard/Info"

    def call(creds, secret):
        with grpc.secure_channel(addr, creds) as ch:
            return ch.unary_unary(info, request_serializer=lambda b: b, response_deserializer=lambda b: b)(
                b"", metadata=(("x-fusion-secret", secret),), timeout=10)

    assert call(with_cert, SECRET)  # a non-empty InfoReply
    with pytest.raises(grpc.RpcError) as e:
        call(with_cert, SECRET + "-wrong")
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        call(grpc.ssl_channel_credentials(ca), SECRET)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- failover with mTLS ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    res = subprocess.run([program("generate"), "--model", default_model(), "--prompt-ids", ",".join(map(str, PROMPT)),
                          "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", "--threads", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["tokens"]


def test_failover_over_mtls(pki, reference):
    """A swarm of mTLS shards A=[0,15), B=[15,30), C=[0,30): SIGKILL of the block-0 shard on the path mid-stream
    leaves the stream identical to the reference; a refused client meanwhile retires nothing."""
    model = default_model()
    spans = {"A": (0, 15), "B": (15, 30), "C": (0, 30)}
    shards, gw = {}, None
    try:
        for name, (a, b) in spans.items():
            shards[name] = mtls_shard(model, pki, a, b)
        gw = tls_gateway(model, [f for s in shards.values() for f in ("--shard", s.address)], pki, pki["gateway"],
                         "--step-timeout-ms", "20000")
        addr = {n: s.address for n, s in shards.items()}
        wait_for(lambda: all(s["state"] == "active" for s in shard_cluster.swarm_doc(gw, KEY)["servers"]),
                 "every member active", timeout=30)
        model_id = request(gw, "GET", "/v1/models")[1]["data"][0]["id"]
        body = shard_cluster.completion_body(model_id, PROMPT, MAX_TOKENS, True)

        # a client without a certificate is refused by every member; none is retired
        rogue = tls_gateway(model, [f for s in shards.values() for f in ("--shard", s.address)], pki)
        try:
            for s in shards.values():
                wait_log(s, SHARD_REFUSED, "the rogue gateway refused by every member")
            wait_for(lambda: all("none is configured" in (m["error"] or "") and m["state"] != "active"
                                 for m in shard_cluster.swarm_doc(rogue, KEY)["servers"]),
                     "the reason in the rogue gateway's /v1/swarm")
        finally:
            rogue.stop()
        doc = by_address(shard_cluster.swarm_doc(gw, KEY))
        assert all(doc[a]["state"] == "active" for a in addr.values()), doc

        killed = {}

        def on_chunk(n):
            if n < 4 or killed:
                return
            live = [s for s in shard_cluster.swarm_doc(gw, KEY)["servers"] if s["load"] > 0 and s["span"][0] == 0]
            assert len(live) == 1, live
            name = next(k for k, v in addr.items() if v == live[0]["address"])
            shards[name].proc.send_signal(signal.SIGKILL)
            killed[name] = n

        tokens, errors = shard_cluster.stream_completion(gw.url, KEY, body, on_chunk)
        assert killed, "the request finished before a shard could be killed"
        dead = next(iter(killed))
        assert not errors, errors
        assert tokens == reference, f"after killing {dead} at token {killed[dead]}"
        assert "failing over" in gw.output()
    finally:
        if gw:
            gw.stop()
        for s in shards.values():
            s.stop(signal.SIGKILL)


# ---- joining a gateway that requires client certificates ----------------------------------------------------


class JoinShard:
    """A fusion-shard with TLS pair `pair` that joins the gateway's membership service at `join`."""

    def __init__(self, model, join, pair, pki, tmp_path, name):
        self.log_path = str(tmp_path / f"{name}.log")
        self.log = open(self.log_path, "w+")
        cmd = [program("shard"), "--model", model, "--join", join, "--listen", "127.0.0.1:0", "--threads", "1",
               "--secret", SECRET, "--tls-cert", pair["cert"], "--tls-key", pair["key"], "--tls-ca", pki["ca"],
               "--tls-client-ca", pki["ca"]]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self):
        return open(self.log_path).read()


def test_join_requires_client_certificate(pki, tmp_path):
    """The gateway's membership service with --swarm-tls-client-ca: a shard showing a certificate of the CA
    joins, gets the model and serves (Join, Heartbeat and the gateway's calls to it all over mTLS); one
    showing a certificate of another CA is refused with a clear error and never listed."""
    model = default_model()
    swarm_port = str(tmp_path / "swarm-port")
    gw = tls_gateway(model, ["--swarm-listen", "127.0.0.1:0", "--swarm-port-file", swarm_port], pki, None,
                     "--swarm-tls-cert", pki["gateway"]["cert"], "--swarm-tls-key", pki["gateway"]["key"],
                     "--swarm-tls-client-ca", pki["ca"], "--heartbeat-ms", "250")
    shards = []
    try:
        wait_for(lambda: os.path.exists(swarm_port), "the membership service")
        join = f"127.0.0.1:{int(open(swarm_port).read())}"
        assert "mutual TLS" in gw.output()
        shards.append(JoinShard(model, join, pki["rogue"], pki, tmp_path, "rogue"))
        shards.append(JoinShard(model, join, pki["node"], pki, tmp_path, "good"))
        wait_for(lambda: (lambda d: d["active"] == 1 and d["uncovered_blocks"] == 0)(shard_cluster.swarm_doc(gw, KEY)),
                 "the mTLS member serving", timeout=60)
        assert "Paris" in answer(gw)
        wait_for(lambda: "signed by another CA" in shards[0].output(), "the refusal in the rogue's log")
        assert "gateway " + join + ": Join: unavailable" in shards[0].output()
        assert len(shard_cluster.swarm_doc(gw, KEY)["servers"]) == 1
        assert SHARD_UNTRUSTED in gw.output()
        assert gw.alive()
    finally:
        for s in shards:
            stop_process(s.proc, signal.SIGKILL)
        gw.stop()
