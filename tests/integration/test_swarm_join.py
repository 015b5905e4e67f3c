"""Shards joining a gateway (fusion.Swarm) on the real default model (SmolLM2-135M-Instruct Q4_1, 30 blocks).

The gateway starts with no shards (--swarm-listen only). Shards start with --join and no --blocks, each able
to hold at most 12 blocks: the gateway assigns spans until every block is covered, and a chat completion
works. A fourth shard waits as the spare. A streaming greedy completion is under way when the shard holding
block 0 is SIGKILLed: the spare is told to load the gap, the stream fails over and completes with exactly the
reference tokens. A new small shard (a spare again) and then a bigger one join during a load: the bigger one
adds flow, so it serves and shows in /v1/swarm's flow. With the spares gone, killing every server of block 0 gives
a quick 503. /v1/swarm shows spans or "spare", states, device, dtype, speeds, KV and measured link figures.
"""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import shard_cluster  # noqa: E402
from shard_cluster import SECRET, Gateway, default_model, make_tls, program, by_address, wait_for  # noqa: E402

KEY = "sk-test-swarm-join-key"
PROMPT = [504, 1552, 3732, 3434, 359]
MAX_TOKENS = 48
MODEL_ID = []


class JoinShard:
    """A fusion-shard process that joins the gateway at `gateway` (HOST:PORT) on 127.0.0.1."""

    def __init__(self, model, gateway, extra=()):
        self.dir = tempfile.mkdtemp(prefix="join-shard-")
        port_file = os.path.join(self.dir, "port")
        cmd = [program("shard"), "--model", model, "--join", gateway, "--listen", "127.0.0.1:0", "--port-file",
               port_file, "--secret", SECRET, "--insecure", "--threads", "1"] + list(extra)
        self.log = open(os.path.join(self.dir, "log"), "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.port_file = port_file
        self.address = None

    def wait_started(self, timeout=60):
        deadline = time.time() + timeout
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                raise RuntimeError("fusion-shard did not start: " + self.output())
            time.sleep(0.05)
        self.address = f"127.0.0.1:{int(open(self.port_file).read())}"
        return self

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def request(gw, method, path, body=None, key=KEY, timeout=60):
    return shard_cluster.api_request(gw, method, path, body, key, timeout)


def swarm(gw):
    return shard_cluster.swarm_doc(gw, KEY)


def completion_body(stream):
    return shard_cluster.completion_body(MODEL_ID[0], PROMPT, MAX_TOKENS, stream)


def stream_tokens(gw, on_chunk=None):
    """A streaming greedy completion; returns (token ids, error events). on_chunk(n_tokens) after each chunk."""
    return shard_cluster.stream_completion(gw.url, KEY, completion_body(True), on_chunk)


def covered(doc):
    blocks = set()
    for s in doc["servers"]:
        if s["state"] == "active":
            blocks.update(range(s["span"][0], s["span"][1]))
    return blocks


@pytest.fixture(scope="module")
def cluster():
    model = default_model()
    shards = []
    gw = None
    tmp = tempfile.mkdtemp(prefix="swarm-join-")
    port_file = os.path.join(tmp, "swarm-port")
    try:
        gw = Gateway(model, ["--swarm-listen", "127.0.0.1:0", "--swarm-port-file", port_file], KEY,
                     "--heartbeat-ms", "250", "--heartbeat-timeout-ms", "1500", "--measure-interval-ms", "1000",
                     "--spares", "1", "--connection-timeout-s", "5", "--step-timeout-ms", "20000")
        wait_for(lambda: os.path.exists(port_file), "the swarm port file")
        st, models = request(gw, "GET", "/v1/models")
        assert st == 200, models
        MODEL_ID[:] = [models["data"][0]["id"]]
        yield {"model": model, "gw": gw, "shards": shards, "join": f"127.0.0.1:{int(open(port_file).read())}"}
    finally:
        if gw:
            gw.stop()
        for s in shards:
            s.kill()


@pytest.fixture(scope="module")
def reference(cluster):
    return shard_cluster.reference_tokens(cluster["model"], PROMPT, MAX_TOKENS)


def test_join_spares_failover_and_503(cluster, reference):
    gw, shards, model, join = cluster["gw"], cluster["shards"], cluster["model"], cluster["join"]

    def start(*extra):
        s = JoinShard(model, join, ["--max-blocks", "12"] + list(extra))
        shards.append(s)
        return s

    # an empty swarm: 503 naming every block
    st, body = request(gw, "POST", "/v1/completions", completion_body(False), timeout=20)
    assert st == 503 and "no server covers blocks [0, 30)" in body["error"]["message"], body

    # three shards without spans: the gateway places them so that all 30 blocks are covered
    first3 = [start() for _ in range(3)]
    for s in first3:
        s.wait_started()
    wait_for(lambda: swarm(gw)["uncovered_blocks"] == 0 and swarm(gw)["active"] == 3, "three shards covering")
    doc = swarm(gw)
    servers = by_address(doc)
    assert covered(doc) == set(range(30))
    for s in first3:
        sv = servers[s.address]
        assert sv["kind"] == "joined" and sv["state"] == "active", sv
        assert 0 < sv["span"][1] - sv["span"][0] <= 12
        assert sv["device"].startswith("cpu") and sv["dtype"] and sv["tokens_per_s"] > 0, sv
        assert sv["block_tokens_per_s"] > 0 and sv["total_kv_bytes"] > 0 and sv["free_kv_bytes"] > 0
        # one block's measured step times, the planner's profile of the member
        steps = sv["step_ms"]
        for table in (steps["prompt"], steps["decode"]):
            assert table and all(ms >= 0 for _, ms in table), steps
            assert [n for n, _ in table] == sorted(n for n, _ in table), steps
        assert steps["prompt"][0][0] == 16 and steps["decode"][0][0] == 1, steps
    assert doc["max_flow"] > 0 and doc["flow"], doc
    assert doc["planner"]["profiled_members"] == 3 and doc["planner"]["decode_tokens_per_s"] > 0, doc["planner"]
    # the gateway measures its links to every member
    wait_for(lambda: all(by_address(swarm(gw))[s.address]["link"]["source"] == "measured" for s in first3),
             "link measurements")
    for s in first3:
        link = by_address(swarm(gw))[s.address]["link"]
        assert 0 < link["rtt_s"] < 1 and link["bandwidth_bytes_per_s"] > 1e6, link
    # ... and the members to their peers
    wait_for(lambda: all(by_address(swarm(gw))[s.address]["peer_links"] for s in first3), "peer link reports")

    st, body = request(gw, "POST", "/v1/chat/completions",
                       {"model": MODEL_ID[0], "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8,
                        "temperature": 0})
    assert st == 200, body
    assert body["choices"][0]["message"]["content"]
    tokens, errors = stream_tokens(gw)
    assert not errors and tokens == reference

    # a fourth waits as the spare
    spare = start().wait_started()
    wait_for(lambda: by_address(swarm(gw)).get(spare.address, {}).get("state") == "spare", "the spare")
    assert swarm(gw)["spares"] == 1
    assert by_address(swarm(gw))[spare.address]["span"] == "spare"

    # kill the server holding block 0 mid-stream: the spare loads the gap; the stream completes unchanged
    killed = {}

    def on_chunk(n):
        if n < 4 or killed:
            return
        doc = swarm(gw)
        holder = [s for s in doc["servers"] if s["state"] == "active" and s["span"][0] == 0]
        assert len(holder) == 1, doc
        victim = next(s for s in shards if s.address == holder[0]["address"])
        victim.proc.send_signal(signal.SIGKILL)
        killed["shard"], killed["at"], killed["span"] = victim, n, holder[0]["span"]

    t0 = time.time()
    tokens, errors = stream_tokens(gw, on_chunk)
    assert killed, "the request finished before a shard could be killed"
    assert not errors, errors
    assert tokens == reference, f"after the kill at token {killed['at']}"
    print(f"killed {killed['shard'].address} {killed['span']} at token {killed['at']}; stream done in "
          f"{time.time() - t0:.1f} s")
    wait_for(lambda: by_address(swarm(gw))[spare.address]["state"] == "active", "the spare serving")
    doc = swarm(gw)
    assert by_address(doc)[killed["shard"].address]["state"] == "gone"
    assert by_address(doc)[spare.address]["span"][0] == 0
    assert doc["uncovered_blocks"] == 0 and doc["spares"] == 0
    assert "asking " + spare.address + " to load blocks" in gw.output()

    # during a load: a new shard becomes the spare, and a bigger one serves and carries flow
    progress, result = [0], []

    def run():
        result.append(stream_tokens(gw, lambda n: progress.__setitem__(0, n)))

    th = threading.Thread(target=run)
    th.start()
    try:
        spare2 = start("--max-blocks", "3").wait_started()  # too small to add flow: it stays the spare
        wait_for(lambda: by_address(swarm(gw)).get(spare2.address, {}).get("state") == "spare", "the new spare")
        big = JoinShard(model, join, ["--max-blocks", "30"])
        shards.append(big)
        big.wait_started()
        wait_for(lambda: by_address(swarm(gw)).get(big.address, {}).get("state") == "active", "the big shard serving")
        doc = swarm(gw)
        assert by_address(doc)[big.address]["flow"] > 0, doc
        assert any(h["from"] == big.address or h["to"] == big.address for h in doc["flow"]), doc["flow"]
        assert by_address(doc)[spare2.address]["state"] == "spare"
    finally:
        th.join(120)
    assert result and not result[0][1] and result[0][0] == reference

    # the spare leaves (killed): retired by missed heartbeats; then every server of block 0 dies: 503
    spare2.kill()
    wait_for(lambda: by_address(swarm(gw))[spare2.address]["state"] == "gone", "the spare retired")
    for sv in swarm(gw)["servers"]:
        if sv["state"] == "active" and sv["span"][0] == 0:
            next(s for s in shards if s.address == sv["address"]).kill()
    wait_for(lambda: swarm(gw)["uncovered_blocks"] > 0, "block 0 uncovered")
    t0 = time.time()
    st, body = request(gw, "POST", "/v1/completions", completion_body(False), timeout=20)
    assert st == 503, body
    assert "no server covers blocks [0, " in body["error"]["message"], body
    assert time.time() - t0 < 5



def test_failed_load_promotion_and_move(cluster, reference, tmp_path):
    """A second swarm. (1) A spare whose model file is truncated after it joined is told to load the gap a
    killed server leaves: the load fails, the gateway withdraws it and shows the error, and a new shard fills
    the gap. (2) With two serving the whole model and one spare, killing one mid-stream promotes the spare
    (a departure, no gap) and the stream completes unchanged. (3) Moves: fixed shards on [0, 15) x2 and
    [15, 30) beside a joined one the gateway placed on [0, 15) (the gap when it joined): the joined one moves to
    [15, 30), loading it beside its old span, while requests keep completing with the reference tokens.
    The first shard listens on 127.0.0.1 and announces itself as localhost (--advertise)."""
    model = cluster["model"]
    port_file = str(tmp_path / "swarm-port")
    gw = Gateway(model, ["--swarm-listen", "127.0.0.1:0", "--swarm-port-file", port_file], KEY,
                 "--heartbeat-ms", "200", "--heartbeat-timeout-ms", "1000", "--spares", "1",
                 "--rebalance-interval-ms", "500", "--route-wait-ms", "8000", "--step-timeout-ms", "20000")
    shards = []
    try:
        wait_for(lambda: os.path.exists(port_file), "the swarm port file")
        join = f"127.0.0.1:{int(open(port_file).read())}"

        def start(path=model, *extra):
            s = JoinShard(path, join, list(extra))
            shards.append(s)
            return s.wait_started()

        def state(s):
            return by_address(swarm(gw)).get(s.address, {}).get("state")

        # (1) a failed load; the first shard announces the name given by --advertise
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        a = start(model, "--listen", f"127.0.0.1:{port}", "--advertise", f"localhost:{port}")
        a.address = f"localhost:{port}"
        wait_for(lambda: state(a) == "active", "the first shard serving")
        copy = str(tmp_path / "copy.gguf")
        with open(model, "rb") as src, open(copy, "wb") as dst:
            dst.write(src.read())
        b = start(copy)
        wait_for(lambda: state(b) == "spare", "the spare")
        with open(copy, "r+b") as f:  # the file loses its tail: the next load of it fails
            f.truncate(os.path.getsize(copy) // 2)
        a.kill()
        wait_for(lambda: by_address(swarm(gw))[b.address].get("failed_loads") == 1, "the failed load reported")
        sv = by_address(swarm(gw))[b.address]
        assert sv["state"] == "spare" and sv["assigned"] is None and sv["failed_spans"] == [[0, 30]], sv
        assert "loading blocks [0, 30) failed" in sv["error"], sv
        c = start()
        # its Join may land after its port file: route once the gateway has given it the gap
        wait_for(lambda: state(c) in ("loading", "active"), "the new shard taking the gap")
        st, body = request(gw, "POST", "/v1/completions", completion_body(False))
        assert st == 200, body
        assert by_address(swarm(gw))[c.address]["state"] == "active"
        assert by_address(swarm(gw))[b.address]["state"] == "spare"  # not asked again

        # (2) promotion when a server leaves: a fourth waits (one spare wanted), a fifth serves
        d = start()
        wait_for(lambda: state(d) == "spare", "a spare")
        e = start()
        wait_for(lambda: swarm(gw)["active"] == 2, "two shards serving")
        spare = next(s for s in (d, e) if state(s) == "spare")
        killed = {}

        def on_chunk(n):
            if n >= 4 and not killed:
                killed["at"] = n
                c.kill()

        tokens, errors = stream_tokens(gw, on_chunk)
        assert killed and not errors and tokens == reference
        wait_for(lambda: state(spare) == "active", "the spare promoted")
        assert "(a server left)" in gw.output()
        for s in (d, e, b):
            s.kill()
        wait_for(lambda: swarm(gw)["live"] == 0, "the swarm empty")

        # (3) a move
        f2 = start(model, "--blocks", "15:30")
        j = start(model, "--max-blocks", "15")
        wait_for(lambda: state(j) == "active", "the joined shard serving")
        assert by_address(swarm(gw))[j.address]["span"] == [0, 15]
        progress, result = [0], []
        th = threading.Thread(target=lambda: result.append(stream_tokens(gw, lambda n: progress.__setitem__(0, n))))
        th.start()
        try:
            start(model, "--blocks", "0:15")
            start(model, "--blocks", "0:15")
            wait_for(lambda: by_address(swarm(gw))[j.address]["span"] == [15, 30], "the move", timeout=30)
        finally:
            th.join(120)
        assert result and not result[0][1] and result[0][0] == reference
        doc = swarm(gw)
        assert doc["moves"] >= 1 and doc["uncovered_blocks"] == 0, doc
        assert by_address(doc)[f2.address]["span"] == [15, 30]  # fixed: never moved
        st, body = request(gw, "POST", "/v1/completions", completion_body(False))
        assert st == 200, body
        assert [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]] == reference
        wait_for(lambda: "freed blocks [0, 15)" in j.output(), "the old span freed")
        assert "to [15, 30)" in gw.output()
    finally:
        gw.stop()
        for s in shards:
            s.kill()


def test_wildcard_listen_needs_advertise():
    """A joining shard listening on 0.0.0.0 would announce an address nobody can call: refused, naming
    --advertise; with --advertise it starts."""
    model = default_model()
    base = [program("shard"), "--model", model, "--join", "127.0.0.1:1", "--secret", SECRET, "--insecure",
            "--threads", "1"]
    res = subprocess.run(base + ["--listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "--advertise HOST:PORT" in res.stderr, res.stderr
    res = subprocess.run(base + ["--listen", "127.0.0.1:0", "--advertise", "shard-7"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0 and "--advertise 'shard-7' is not HOST:PORT" in res.stderr, res.stderr


def test_join_over_tls_and_secret(tmp_path):
    """The membership service over TLS (no --insecure anywhere): a shard with the CA and the secret joins,
    gets the whole model and serves; one with a wrong secret is refused, never listed, and exits with one line
    that says to use the gateway's secret."""
    model = default_model()
    tls = make_tls(str(tmp_path))
    port_file, http_port_file = str(tmp_path / "swarm-port"), str(tmp_path / "http-port")
    cmd = [program("gateway"), "--model", model, "--listen", "127.0.0.1:0", "--port-file", http_port_file,
           "--secret", SECRET, "--api-key", KEY, "--swarm-listen", "127.0.0.1:0", "--swarm-port-file", port_file,
           "--swarm-tls-cert", tls["cert"], "--swarm-tls-key", tls["key"], "--tls-ca", tls["cert"],
           "--heartbeat-ms", "250"]
    log = open(str(tmp_path / "gateway.log"), "w+")
    gw_proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    procs = []

    class Handle:
        url = None

    gw = Handle()
    try:
        wait_for(lambda: os.path.exists(http_port_file) and os.path.exists(port_file) or gw_proc.poll() is not None,
                 "the gateway")
        assert gw_proc.poll() is None, open(str(tmp_path / "gateway.log")).read()
        gw.url = f"http://127.0.0.1:{int(open(http_port_file).read())}"
        join = f"127.0.0.1:{int(open(port_file).read())}"
        base = [program("shard"), "--model", model, "--join", join, "--listen", "127.0.0.1:0", "--threads", "1",
                "--tls-cert", tls["cert"], "--tls-key", tls["key"], "--tls-ca", tls["cert"]]
        bad_log = open(str(tmp_path / "bad.log"), "w+")
        procs.append(subprocess.Popen(base + ["--secret", "not-the-swarm-secret"], stdout=bad_log,
                                      stderr=subprocess.STDOUT))
        good_log = open(str(tmp_path / "good.log"), "w+")
        procs.append(subprocess.Popen(base + ["--secret", SECRET], stdout=good_log, stderr=subprocess.STDOUT))
        wait_for(lambda: swarm(gw)["active"] == 1 and swarm(gw)["uncovered_blocks"] == 0, "the TLS member serving",
                 timeout=30)
        doc = swarm(gw)
        assert len(doc["servers"]) == 1 and doc["servers"][0]["span"] == [0, 30], doc
        st, models = request(gw, "GET", "/v1/models")
        body = {"model": models["data"][0]["id"], "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        st, out = request(gw, "POST", "/v1/completions", body)
        assert st == 200, out
        wait_for(lambda: procs[0].poll() is not None, "the refused shard to exit")
        assert procs[0].returncode != 0
        errors = [line for line in open(str(tmp_path / "bad.log")).read().splitlines()
                  if line.startswith("fusion-shard:")]
        assert len(errors) == 1 and "refused this server's swarm secret" in errors[0], errors
        assert "--secret" in errors[0] and "usage" not in errors[0]
        assert len(swarm(gw)["servers"]) == 1
    finally:
        for p in procs:
            p.kill()
            p.wait()
        gw_proc.terminate()
        try:
            gw_proc.wait(20)
        except subprocess.TimeoutExpired:
            gw_proc.kill()
            gw_proc.wait()
