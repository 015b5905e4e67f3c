"""fusion-gateway's exposure and request checks, with real processes on loopback.

Checks: a --listen beyond loopback without an API key is refused at start-up unless --no-auth is
given (nothing but loopback traffic: the refusal comes before serving); swarm secrets shorter than
16 bytes are refused by the gateway and the shard; Host names other than loopback, the listen host,
the connection's own address or an --allowed-host get 403 (DNS rebinding); a browser Origin other
than this gateway's loopback origins or a --cors-origin gets 403, an allowed one gets CORS headers
and preflights (CSRF); JSON routes want Content-Type: application/json (415); conflicting
Content-Length headers, a NUL or control byte in a header and HTTP/1.1 without Host are 400; errors name no shard
address (the log does). The gateway's only hop is a closed loopback port: no shard is needed.
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import requests

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import SECRET, Gateway, default_model, program, stop_process as stop  # noqa: E402

openai = pytest.importorskip("openai")

KEY = "sk-test-security-key"
DEAD_HOP = "127.0.0.1:1:0:30"  # nothing listens on port 1: every generation fails


@pytest.fixture(scope="module")
def model():
    return default_model()


@pytest.fixture(scope="module")
def gw(model):
    g = Gateway(model, ["--hop", DEAD_HOP], KEY)
    yield g
    rc = g.stop()
    out = g.output()
    assert rc == 0, f"gateway exited {rc}:\n{out[-3000:]}"
    assert "AddressSanitizer" not in out and "runtime error" not in out, out[-3000:]


def raw(port, data, timeout=20):
    """Sends raw bytes to 127.0.0.1:port; returns (status, headers dict lower-cased, body bytes)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(data)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(body) < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    s.close()
    return int(lines[0].split()[1]), headers, body


def get(gw, path, key=KEY, **headers):
    if key:
        headers["Authorization"] = "Bearer " + key
    return requests.get(gw.url + path, headers=headers, timeout=30)


def post(gw, path, body, key=KEY, ctype="application/json", **headers):
    if key:
        headers["Authorization"] = "Bearer " + key
    if ctype:
        headers["Content-Type"] = ctype
    return requests.post(gw.url + path, data=json.dumps(body).encode(), headers=headers, timeout=60)


def assert_error(r, status, code=None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code:
        assert err["code"] == code, err


def start(cmd, port_file, timeout=30):
    """Starts a program that writes port_file once serving; returns (process, log path)."""
    log = port_file + ".log"
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not os.path.exists(port_file):
        time.sleep(0.05)
    return proc, log


def gateway_cmd(model, port_file, *extra, secret=SECRET):
    return [program("gateway"), "--model", model, "--port-file", port_file, "--secret", secret, "--insecure",
            "--hop", DEAD_HOP] + list(extra)


# ---- start-up refusals ------------------------------------------------------------------------------------


def test_listen_beyond_loopback_without_key_is_refused(model, tmp_path):
    port_file = str(tmp_path / "port")
    proc, log = start(gateway_cmd(model, port_file, "--listen", "0.0.0.0:0"), port_file)
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        rc = None
    stop(proc)
    out = open(log).read()
    assert not os.path.exists(port_file), "the gateway served 0.0.0.0 without an API key:\n" + out
    assert rc not in (None, 0), out
    assert "--no-auth" in out and "API key" in out and "0.0.0.0:0" in out, out


def test_listen_beyond_loopback_with_no_auth_or_a_key_starts(model, tmp_path):
    for i, extra in enumerate((["--no-auth"], ["--api-key", KEY])):
        port_file = str(tmp_path / f"port{i}")
        proc, log = start(gateway_cmd(model, port_file, "--listen", "0.0.0.0:0", *extra), port_file)
        served = os.path.exists(port_file)
        rc = stop(proc)
        out = open(log).read()
        assert served and rc == 0, f"{extra}: rc {rc}\n{out}"
    assert "--no-auth" in open(str(tmp_path / "port0.log")).read()  # it warns


def test_no_auth_with_a_key_is_refused(model, tmp_path):
    res = subprocess.run(gateway_cmd(model, str(tmp_path / "port"), "--no-auth", "--api-key", KEY),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "--no-auth" in res.stderr, res.stderr


def test_fifo_files_are_refused_at_once(model, tmp_path):
    """A FIFO given as the HTTPS certificate, the API key file or the secret file is refused with
    a message naming it, rather than waited on for a writer that never comes."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    for flags in (["--api-key", KEY, "--https-cert", fifo, "--https-key", fifo], ["--api-key-file", fifo],
                  ["--api-key", KEY, "--secret-file", fifo]):
        try:
            res = subprocess.run(gateway_cmd(model, str(tmp_path / "port"), *flags), capture_output=True,
                                 text=True, timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{flags[-2]}: the gateway waited on the FIFO")
        assert res.returncode != 0, (flags, res.stderr)
        assert fifo in res.stderr and "not a regular file" in res.stderr, (flags, res.stderr)
    assert not os.path.exists(tmp_path / "port")


def test_short_secrets_are_refused(model, tmp_path):
    short = "fifteen-bytes.."
    res = subprocess.run(gateway_cmd(model, str(tmp_path / "port"), "--api-key", KEY, secret=short),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "at least 16" in res.stderr, res.stderr
    res = subprocess.run([program("shard"), "--model", model, "--blocks", "0:15", "--listen", "127.0.0.1:0",
                          "--insecure", "--port-file", str(tmp_path / "shard-port")],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, FUSION_SECRET=short))
    assert res.returncode != 0 and "at least 16" in res.stderr, res.stderr
    assert not os.path.exists(tmp_path / "shard-port")


def test_secret_conflicts_are_refused(model, tmp_path):
    """A secret from the config file (or a flag) never silently wins over FUSION_SECRET, on the gateway or a shard."""
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"secret": "the-secret-of-the-config-file"}))
    cmd = [program("gateway"), "--model", model, "--config", str(config), "--hop", "127.0.0.1:1:0:30", "--insecure",
           "--port-file", str(tmp_path / "port")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, FUSION_SECRET="another-secret-from-the-environment"))
    assert res.returncode != 0 and "FUSION_SECRET differs" in res.stderr, res.stderr
    assert not os.path.exists(tmp_path / "port")
    res = subprocess.run([program("shard"), "--model", model, "--blocks", "0:15", "--listen", "127.0.0.1:0",
                          "--insecure", "--secret", "the-secret-of-the-command-line"], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, FUSION_SECRET="another-secret-from-the-environment"))
    assert res.returncode != 0 and "FUSION_SECRET differs" in res.stderr, res.stderr


# ---- Host (DNS rebinding) ----------------------------------------------------------------------------------


def test_host_header_is_checked(gw):
    for host in ("evil.example", "evil.example:%d" % gw.port, "rebind.attacker.test", "localhost.evil.example"):
        assert_error(get(gw, "/v1/models", Host=host), 403, "host_not_allowed")
        assert_error(get(gw, "/v1/swarm", Host=host), 403, "host_not_allowed")
    status, _, text = raw(gw.port, b"GET /v1/models HTTP/1.1\r\nHost: localhost  \r\nAuthorization: Bearer " +
                          KEY.encode() + b" \r\n\r\n")  # trailing blanks are no part of a value
    assert status == 200, text
    for host in ("localhost", "localhost:%d" % gw.port, "127.0.0.1", "127.0.0.1:%d" % gw.port, "[::1]",
                 "[::1]:%d" % gw.port, "LOCALHOST:%d" % gw.port):
        r = get(gw, "/v1/models", Host=host)
        assert r.status_code == 200, (host, r.text)
    assert_error(get(gw, "/v1/models", Host="bad host"), 400)


def test_allowed_host_and_cors_origin_options(model):
    g = Gateway(model, ["--hop", DEAD_HOP], KEY, "--allowed-host", "api.example.test", "--cors-origin",
                "https://app.example.test")
    try:
        assert get(g, "/v1/models", Host="api.example.test").status_code == 200
        assert get(g, "/v1/models", Host="api.example.test:443").status_code == 200
        assert_error(get(g, "/v1/models", Host="other.example.test"), 403, "host_not_allowed")
        r = get(g, "/v1/models", Origin="https://app.example.test")
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "https://app.example.test"
        r = requests.options(g.url + "/v1/chat/completions", timeout=30, headers={
            "Origin": "https://app.example.test", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert r.status_code == 204, r.text
        assert r.headers["Access-Control-Allow-Origin"] == "https://app.example.test"
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()
        assert_error(get(g, "/v1/models", Origin="https://evil.example"), 403, "origin_not_allowed")
    finally:
        assert g.stop() == 0, g.output()[-3000:]
    g = Gateway(model, ["--hop", DEAD_HOP], KEY, "--allowed-host", "*", "--cors-origin", "*")
    try:
        assert get(g, "/v1/models", Host="anything.example").status_code == 200
        r = get(g, "/v1/models", Origin="https://anything.example")
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "https://anything.example"
    finally:
        assert g.stop() == 0, g.output()[-3000:]


# ---- Origin (browser CSRF) ---------------------------------------------------------------------------------


def test_origin_is_checked(gw):
    for origin in ("https://evil.example", "http://evil.example:%d" % gw.port, "null",
                   "http://localhost:%d" % (gw.port + 1 if gw.port < 65535 else 1)):
        assert_error(get(gw, "/v1/models", Origin=origin), 403, "origin_not_allowed")
        assert_error(post(gw, "/tokenize", {"content": "hi"}, Origin=origin), 403, "origin_not_allowed")
        r = requests.options(gw.url + "/v1/chat/completions", timeout=30,
                             headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
        assert r.status_code == 403 and "Access-Control-Allow-Origin" not in r.headers, r.headers
    for origin in ("http://localhost:%d" % gw.port, "http://127.0.0.1:%d" % gw.port):
        r = get(gw, "/v1/models", Origin=origin)
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == origin, r.headers
        r = requests.options(gw.url + "/v1/chat/completions", timeout=30,
                             headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
        assert r.status_code == 204 and r.headers["Access-Control-Allow-Origin"] == origin, r.headers
    assert get(gw, "/v1/models").status_code == 200  # no Origin: curl, SDKs


# ---- Content-Type ------------------------------------------------------------------------------------------


def test_json_routes_want_application_json(gw):
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None,
                  "application/jsonp"):
        for path in ("/tokenize", "/v1/chat/completions", "/v1/completions"):
            body = {"content": "hi", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
            assert_error(post(gw, path, body, ctype=ctype), 415, "unsupported_media_type")
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"):
        r = post(gw, "/tokenize", {"content": "hi"}, ctype=ctype)
        assert r.status_code == 200 and r.json()["tokens"], (ctype, r.text)


# ---- framing ---------------------------------------------------------------------------------------------


def test_conflicting_content_length_is_400(gw):
    body = b'{"content": "hi"}'
    req = (b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
           b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\nContent-Length: 5\r\n\r\n" % len(body) + body)
    status, _, text = raw(gw.port, req)
    assert status == 400, text


def test_nul_in_authorization_is_400(gw):
    req = (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
           b"\x00junk\r\n\r\n")
    status, _, text = raw(gw.port, req)
    assert status == 400, text
    status, _, text = raw(gw.port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " +
                          KEY.encode() + b"\r\n\r\n")
    assert status == 200, text


def test_nul_or_control_byte_in_any_header_is_400(gw):
    """However many NULs come first (libmicrohttpd cuts a value at the first), and in any header."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    auth = b"Authorization: Bearer " + KEY.encode()
    for bad in (auth + b"\x00\x00junk\r\n", auth + b"\x00\x00\x00\x00\x00junk\r\n", auth + b"\x01\r\n",
                auth + b"\x1b[0m\r\n", b"X-Note: a\x7fb\r\n" + auth + b"\r\n",
                auth + b"\r\nX-Note: a\x00\x00b\r\n", b"X-No\x01te: a\r\n" + auth + b"\r\n"):
        status, _, text = raw(gw.port, head + bad + b"\r\n")
        assert status == 400, (bad, text)
        assert json.loads(text)["error"]["code"] == "invalid_request", text
    status, _, text = raw(gw.port, head + b"X-Note: a\tb \xc3\xa9\r\n" + auth + b"\r\n\r\n")  # tabs, UTF-8
    assert status == 200, text


def test_http11_without_host_is_400(gw):
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
    status, _, text = raw(gw.port, b"GET /v1/models HTTP/1.1\r\n" + auth + b"\r\n")
    assert status == 400, text
    status, _, text = raw(gw.port, b"GET /v1/models HTTP/1.0\r\n" + auth + b"\r\n")
    assert status == 200, text


# ---- errors name no internal address -----------------------------------------------------------------------


def test_errors_name_no_shard_address(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    mid = client.models.list().data[0].id
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=mid, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.status_code == 503
    for stream in (False, True):
        r = post(gw, "/v1/completions", {"model": mid, "prompt": "hi", "max_tokens": 2, "stream": stream})
        assert_error(r, 503)
        text = r.text
        assert "127.0.0.1" not in text and ":1" not in text, text
        assert "a shard of the swarm is unavailable" in r.json()["error"]["message"], text
    assert "127.0.0.1:1" in gw.output()  # the log keeps the details
