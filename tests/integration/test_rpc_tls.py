"""test_rpc_tls.py -- the C RPC layer against an independent client: Python grpcio over TLS, messages
encoded by a protobuf wire codec written here from the encoding spec (not protobuf-c).

The server is fusion-rpc-echo (tools/rpc-echo.c): fusion.Shard with fixed answers (tokens t -> t+1,
F32 hidden x -> 2x+1, span [4, 12)). Certificates are made with the openssl CLI per test session.
"""
import os
import queue
import signal
import struct
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

BUILD = os.environ.get("FUSION_BUILD_DIR", os.path.join(os.path.dirname(__file__), "../../build"))
ECHO = os.path.join(BUILD, "fusion-rpc-echo")
SECRET = "interop-secret-5b1f"

# ---- protobuf wire format (https://protobuf.dev/programming-guides/encoding/) ----------------
# encoding: the fuzz seeds' helpers (tests/fuzz/pbwire.py); decoding below
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "fuzz"))
from pbwire import f_bytes, f_packed, f_varint  # noqa: E402


def read_varint(buf, i):
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def decode(buf):
    """field number -> list of raw values (int for varints, bytes otherwise)."""
    fields, i = {}, 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = read_varint(buf, i)
        elif wt == 1:
            v, i = buf[i:i + 8], i + 8
        elif wt == 2:
            n, i = read_varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wt == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wt}")
        fields.setdefault(num, []).append(v)
    return fields


def signed(v, bits=64):
    return v - (1 << bits) if v >> (bits - 1) else v


def get_int(f, num, default=0):
    return signed(f[num][-1]) if num in f else default


def get_str(f, num):
    return f[num][-1].decode() if num in f else ""


def get_ints(f, num):
    """A repeated integer field, packed or not."""
    out = []
    for v in f.get(num, []):
        if isinstance(v, int):
            out.append(signed(v))
        else:
            i = 0
            while i < len(v):
                x, i = read_varint(v, i)
                out.append(signed(x))
    return out


F32, BF16 = 1, 2


def tensor_f32(a):
    a = np.ascontiguousarray(a, dtype="<f4")
    return f_varint(1, F32) + f_packed(2, a.shape) + f_bytes(3, a.tobytes())


def parse_tensor(b):
    f = decode(b)
    shape = get_ints(f, 2)
    assert get_int(f, 1) == F32
    return np.frombuffer(f[3][-1] if 3 in f else b"", dtype="<f4").reshape(shape)


def input_msg(tokens=(), hidden=None):
    m = f_packed(1, tokens) if len(tokens) else b""
    if hidden is not None:
        m += f_bytes(2, tensor_f32(hidden))
    return m


def parse_output(b):
    f = decode(b)
    hidden = parse_tensor(f[1][-1]) if 1 in f else None
    return get_ints(f, 3), hidden


def open_msg(sid, max_len, first=4, last=12):
    body = f_bytes(1, sid.encode()) + f_varint(2, max_len) + f_varint(6, first) + f_varint(7, last)
    return f_bytes(1, body)


def step_msg(req_id, start, inp, rollback_to=None):
    body = f_varint(1, req_id) + f_varint(2, start) + f_bytes(3, inp)
    if rollback_to is not None:
        body += f_varint(5, rollback_to)
    return f_bytes(2, body)


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    out = {}
    for stem in ("server", "other"):
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(d / f"{stem}.key"), "-out", str(d / f"{stem}.pem"), "-days", "2",
             "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True, capture_output=True)
        out[stem] = (d / f"{stem}.pem", d / f"{stem}.key")
    return out


def start_echo(*args):
    env = dict(os.environ, FUSION_SWARM_SECRET=SECRET)
    p = subprocess.Popen([ECHO, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    line = p.stdout.readline()
    if not line.startswith("port "):
        p.kill()
        raise AssertionError(f"fusion-rpc-echo did not start: {line!r} {p.stderr.read()}")
    return p, int(line.split()[1])


def stop(p):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            raise


@pytest.fixture(scope="module")
def tls_server(certs):
    cert, key = certs["server"]
    p, port = start_echo("--tls-cert", str(cert), "--tls-key", str(key), "--max-message", "65536")
    yield port
    stop(p)
    assert p.returncode == 0


def tls_channel(certs, port, ca="server"):
    creds = grpc.ssl_channel_credentials(root_certificates=certs[ca][0].read_bytes())
    return grpc.secure_channel(f"127.0.0.1:{port}", creds)


def raw_unary(ch, method):
    return ch.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)


def raw_stream(ch):
    return ch.stream_stream("/fusion.Shard/Session", request_serializer=lambda b: b,
                            response_deserializer=lambda b: b)


MD = (("x-fusion-secret", SECRET),)


class Session:
    """A bidi stream driven one message at a time."""

    def __init__(self, ch, metadata=MD):
        self.q = queue.Queue()
        self.replies = raw_stream(ch)(iter(self.q.get, None), metadata=metadata, timeout=30)

    def ask(self, msg):
        self.q.put(msg)
        return decode(next(self.replies))

    def close(self):
        self.q.put(None)
        return list(self.replies)


# ---- tests -----------------------------------------------------------------------------------


def test_info_and_health(certs, tls_server):
    with tls_channel(certs, tls_server) as ch:
        f = decode(raw_unary(ch, "/fusion.Shard/Info")(b"", metadata=MD, timeout=10))
        assert get_str(f, 1) == "fusion-rpc-echo"
        assert (get_int(f, 2), get_int(f, 3), get_int(f, 4)) == (32, 4, 12)
        assert (get_str(f, 7), get_str(f, 8), get_str(f, 13)) == ("f32", "cpu", "0.1.0")
        assert struct.unpack("<d", f[9][-1])[0] == 123.5
        assert (get_int(f, 10), get_int(f, 11)) == (1 << 30, 2 << 30)
        assert (get_int(f, 14), get_int(f, 15), get_int(f, 16)) == (8, 100, 4096)
        assert get_ints(f, 17) == [F32, BF16]
        assert get_int(f, 19) == 65536
        h = decode(raw_unary(ch, "/fusion.Shard/Health")(b"", metadata=MD, timeout=10))
        assert get_int(h, 1) == 1  # SERVING


def test_forward(certs, tls_server):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((3, 8)).astype(np.float32)
    b = rng.standard_normal((5, 8)).astype(np.float32) * 1e3
    req = f_varint(1, 99) + f_bytes(2, input_msg(hidden=a)) + f_bytes(2, input_msg(tokens=[5, -1, 70000], hidden=None))
    req += f_bytes(2, input_msg(tokens=list(range(5)), hidden=b))
    with tls_channel(certs, tls_server) as ch:
        f = decode(raw_unary(ch, "/fusion.Shard/Forward")(req, metadata=MD, timeout=10))
    assert get_int(f, 1) == 99
    outs = [parse_output(o) for o in f[2]]
    assert len(outs) == 3
    np.testing.assert_array_equal(outs[0][1], a * np.float32(2) + np.float32(1))
    assert outs[1] == ([6, 0, 70001], None)
    assert outs[2][0] == [1, 2, 3, 4, 5]
    np.testing.assert_array_equal(outs[2][1], b * np.float32(2) + np.float32(1))


def test_session_stream(certs, tls_server):
    rng = np.random.default_rng(1)
    with tls_channel(certs, tls_server) as ch:
        s = Session(ch)
        opened = decode(s.ask(open_msg("sess-1", 256))[1][-1])
        assert get_str(opened, 1) == "sess-1"
        assert (get_int(opened, 2), get_int(opened, 3), get_int(opened, 4), get_int(opened, 5)) == (4, 12, 256, BF16)
        pos = 0
        for i in range(60):
            if i % 3 == 0:
                toks = [int(t) for t in rng.integers(0, 50000, size=1 + i % 4)]
                inp, n = input_msg(tokens=toks), len(toks)
            else:
                h = rng.standard_normal((1 + i % 5, 8)).astype(np.float32)
                inp, n = input_msg(hidden=h), h.shape[0]
            rollback = pos - 1 if i == 40 else None
            start = pos - 1 if rollback is not None else pos
            r = decode(s.ask(step_msg(1000 + i, start, inp, rollback))[2][-1])
            pos = start + n
            assert get_int(r, 1) == 1000 + i
            assert get_int(r, 2) == pos
            toks_out, hid_out = parse_output(r[3][-1])
            if i % 3 == 0:
                assert toks_out == [t + 1 for t in toks]
            else:
                np.testing.assert_array_equal(hid_out, h * np.float32(2) + np.float32(1))
        s.q.put(f_bytes(3, b""))  # close
        assert s.close() == []
        # a step at the wrong position ends the stream with OUT_OF_RANGE
        s = Session(ch)
        s.ask(open_msg("sess-2", 16))
        s.ask(step_msg(1, 0, input_msg(tokens=[1, 2])))
        with pytest.raises(grpc.RpcError) as e:
            s.ask(step_msg(2, 5, input_msg(tokens=[3])))
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "start_position 5 != length 2" in e.value.details()
        # past max_length
        s = Session(ch)
        s.ask(open_msg("sess-3", 4))
        with pytest.raises(grpc.RpcError) as e:
            s.ask(step_msg(1, 0, input_msg(tokens=[1, 2, 3, 4, 5])))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_rejections(certs, tls_server):
    with tls_channel(certs, tls_server) as ch:
        info = raw_unary(ch, "/fusion.Shard/Info")
        for md in [(("x-fusion-secret", "wrong"),), (("x-fusion-secret", SECRET + "x"),), ()]:
            with pytest.raises(grpc.RpcError) as e:
                info(b"", metadata=md, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            s = Session(ch, metadata=md)
            with pytest.raises(grpc.RpcError) as e:
                s.ask(open_msg("x", 4))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:  # length-delimited field claiming 100 bytes
            raw_unary(ch, "/fusion.Shard/Forward")(b"\x12\x64\x01\x02", metadata=MD, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            raw_unary(ch, "/fusion.Shard/Nope")(b"", metadata=MD, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        big = f_bytes(2, input_msg(hidden=np.zeros((100, 100), np.float32)))  # 40 KB < 64 KiB
        assert len(decode(raw_unary(ch, "/fusion.Shard/Forward")(big, metadata=MD, timeout=10))[2]) == 1
        big = f_bytes(2, input_msg(hidden=np.zeros((200, 100), np.float32)))  # 80 KB > 64 KiB
        with pytest.raises(grpc.RpcError) as e:
            raw_unary(ch, "/fusion.Shard/Forward")(big, metadata=MD, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # plaintext client to the TLS server; TLS client trusting another CA
    for ch in (grpc.insecure_channel(f"127.0.0.1:{tls_server}"), tls_channel(certs, tls_server, ca="other")):
        with ch, pytest.raises(grpc.RpcError) as e:
            raw_unary(ch, "/fusion.Shard/Info")(b"", metadata=MD, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_only_on_loopback():
    p, port = start_echo("--insecure")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert get_int(decode(raw_unary(ch, "/fusion.Shard/Health")(b"", metadata=MD, timeout=10)), 1) == 1
    finally:
        stop(p)
    r = subprocess.run([ECHO, "--insecure", "--address", "0.0.0.0:0"], capture_output=True, text=True,
                       env=dict(os.environ, FUSION_SWARM_SECRET=SECRET), timeout=30)
    assert r.returncode != 0 and "loopback" in r.stderr
    r = subprocess.run([ECHO, "--address", "127.0.0.1:0"], capture_output=True, text=True,
                       env=dict(os.environ, FUSION_SWARM_SECRET=SECRET), timeout=30)
    assert r.returncode != 0 and "TLS" in r.stderr  # neither TLS nor --insecure


def test_sigterm_drains_open_stream(certs):
    cert, key = certs["server"]
    p, port = start_echo("--tls-cert", str(cert), "--tls-key", str(key))
    with tls_channel(certs, port) as ch:
        s = Session(ch)
        s.ask(open_msg("drain", 64))
        s.ask(step_msg(1, 0, input_msg(tokens=[1])))
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as e:  # the open stream is cancelled after the 2 s grace
            s.ask(step_msg(2, 1, input_msg(tokens=[2])))
            s.ask(step_msg(3, 2, input_msg(tokens=[3])))
            next(s.replies)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert p.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 5
