"""test_hub.py -- fusion-fetch against a local fake Hugging Face hub (API + resolve) and a fake LFS CDN.

The fake hub speaks the hub's protocol: GET /api/models/{repo}/revision/{rev} answers the
listing JSON (sha, siblings with size and lfs.sha256); GET/HEAD /{repo}/resolve/{rev}/{path}
serves small files directly and redirects LFS files (302) to a second server on another
port (the "CDN"). Both support Range and can misbehave on demand: require a token, drop the
connection mid-file, serve corrupted bytes, ignore Range, stall, fail with 5xx, list unsafe
file names. huggingface_hub (the reference client) is run against the same server to check
that the fake speaks the real protocol and that both clients get identical bytes.
"""
import hashlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save as st_save

BUILD = Path(os.environ.get("FUSION_BUILD_DIR", Path(__file__).resolve().parents[2] / "build"))
FETCH = BUILD / "fusion-fetch"
REPO = "test-org/tiny-llama"
TOKEN = "hf_testtoken123"


def git_blob_sha(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Repo:
    def __init__(self, commit, files, lfs, branches=None):
        self.commit = commit
        self.files = dict(files)  # path -> bytes
        self.lfs = set(lfs)  # paths stored in LFS (redirected to the CDN)
        self.branches = dict(branches or {"main": commit})
        self.extra_siblings = []  # raw sibling entries (unsafe names)

    def listing(self, blobs):
        """Like the hub: sizes and LFS info only with ?blobs=true."""
        sib = []
        for path, data in self.files.items():
            e = {"rfilename": path}
            if blobs:
                e.update(size=len(data), blobId=git_blob_sha(data))
            if blobs and path in self.lfs:
                e["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            sib.append(e)
        sib.extend(self.extra_siblings)
        return {"_id": "x", "id": "repo", "sha": self.commit, "private": False, "siblings": sib}


class FakeHub:
    """Two HTTP servers on 127.0.0.1 (hub and CDN) sharing state and a request log."""

    def __init__(self):
        self.repos = {}
        self.log = []  # dicts: role, method, path, headers
        self.lock = threading.Lock()
        self.token = None  # required bearer token, or None
        self.drop_once = {}  # repo path -> bytes to send before dropping the connection (once)
        self.corrupt = set()  # repo paths served with one byte flipped
        self.ignore_range = False
        self.api_fail = []  # statuses for the next API calls
        self.stall = set()  # repo paths whose body stalls after 1000 bytes
        self.api_stall = False  # the API accepts the request and never answers
        self.chunk_delay = 0.0  # seconds between 64 KiB chunks
        self.file_status = {}  # repo path -> (status, X-Error-Code, message) for its resolve URL
        self.stop = threading.Event()
        self.hub = self._serve("hub")
        self.cdn = self._serve("cdn")
        self.url = "http://127.0.0.1:%d" % self.hub.server_address[1]
        self.cdn_url = "http://127.0.0.1:%d" % self.cdn.server_address[1]

    def _serve(self, role):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                hub._handle(self, role, head=False)

            def do_HEAD(self):
                hub._handle(self, role, head=True)

        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        srv.daemon_threads = True
        srv.block_on_close = False
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return srv

    def close(self):
        self.stop.set()
        for s in (self.hub, self.cdn):
            s.shutdown()
            s.server_close()

    def requests(self, role=None, kind=None):
        with self.lock:
            out = list(self.log)
        if role:
            out = [r for r in out if r["role"] == role]
        if kind == "api":
            out = [r for r in out if r["path"].startswith("/api/")]
        elif kind == "file":
            out = [r for r in out if r["role"] == "cdn" or "/resolve/" in r["path"]]
        return out

    # --- request handling -------------------------------------------------

    def _reply(self, h, status, body=b"", headers=None, head=False):
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, str(v))
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _error(self, h, status, code, msg, head):
        body = json.dumps({"error": msg}).encode()
        self._reply(h, status, body, {"Content-Type": "application/json", "X-Error-Code": code,
                                       "X-Error-Message": msg}, head)

    def _authorized(self, h):
        return self.token is None or h.headers.get("Authorization") == "Bearer " + self.token

    def _handle(self, h, role, head):
        raw, _, query = h.path.partition("?")
        query = urllib.parse.parse_qs(query)
        with self.lock:
            self.log.append({"role": role, "method": h.command, "path": raw, "query": query,
                             "headers": dict(h.headers.items())})
        parts = raw.split("/")
        if role == "cdn":
            if len(parts) == 3 and parts[1] == "blobs":
                for repo in self.repos.values():
                    for path, data in repo.files.items():
                        if hashlib.sha256(data).hexdigest() == parts[2]:
                            return self._send_file(h, path, data, {}, head)
            return self._error(h, 404, "EntryNotFound", "no such blob", head)
        if len(parts) >= 7 and parts[1] == "api" and parts[2] == "models" and parts[5] == "revision":
            if self.api_stall:
                self.stop.wait(15)
                return
            if self.api_fail:
                status = self.api_fail.pop(0)
                return self._error(h, status, "Internal", "try again", head)
            repo_id = parts[3] + "/" + parts[4]
            rev = urllib.parse.unquote("/".join(parts[6:]))
            repo = self._lookup(h, repo_id, rev, head)
            if repo is None:
                return
            blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
            listing = dict(repo.listing(blobs), sha=repo.branches.get(rev, rev), id=repo_id)
            return self._reply(h, 200, json.dumps(listing).encode(), {"Content-Type": "application/json"}, head)
        if len(parts) >= 6 and parts[3] == "resolve":
            repo_id = parts[1] + "/" + parts[2]
            rev = urllib.parse.unquote(parts[4])
            path = urllib.parse.unquote("/".join(parts[5:]))
            repo = self._lookup(h, repo_id, rev, head)
            if repo is None:
                return
            if path not in repo.files:
                return self._error(h, 404, "EntryNotFound", "%s does not exist" % path, head)
            if path in self.file_status:
                return self._error(h, *self.file_status[path], head)
            data = repo.files[path]
            commit = repo.branches.get(rev, rev)
            if path in repo.lfs:
                sha = hashlib.sha256(data).hexdigest()
                return self._reply(h, 302, b"", {
                    "Location": "%s/blobs/%s?sig=abc" % (self.cdn_url, sha),
                    "X-Repo-Commit": commit, "ETag": '"%s"' % git_blob_sha(data),
                    "X-Linked-Etag": '"%s"' % sha, "X-Linked-Size": len(data)}, head)
            return self._send_file(h, path, data, {"X-Repo-Commit": commit, "ETag": '"%s"' % git_blob_sha(data)}, head)
        return self._error(h, 404, "NotFound", "no route", head)

    def _lookup(self, h, repo_id, rev, head):
        if not self._authorized(h):
            self._error(h, 401, "RepoNotFound", "Invalid credentials in Authorization header", head)
            return None
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 404, "RepoNotFound", "Repository not found", head)
            return None
        if rev not in repo.branches and rev != repo.commit:
            self._error(h, 404, "RevisionNotFound", "Invalid rev id: %s" % rev, head)
            return None
        return repo

    def _send_file(self, h, path, data, headers, head):
        if path in self.corrupt:
            data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]
        start, status = 0, 200
        rng = h.headers.get("Range")
        if rng and not self.ignore_range:
            m = re.fullmatch(r"bytes=(\d+)-", rng)
            assert m, rng
            start = int(m.group(1))
            if start >= len(data):
                return self._reply(h, 416, b"", dict(headers, **{"Content-Range": "bytes */%d" % len(data)}), head)
            status = 206
        body = data[start:]
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, str(v))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(body)))
        if status == 206:
            h.send_header("Content-Range", "bytes %d-%d/%d" % (start, len(data) - 1, len(data)))
        h.end_headers()
        if head:
            return
        with self.lock:
            drop = self.drop_once.pop(path, None)
        if drop is not None:
            h.wfile.write(body[:drop])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if path in self.stall:
            h.wfile.write(body[:1000])
            h.wfile.flush()
            self.stop.wait(15)
            h.close_connection = True
            return
        for i in range(0, len(body), 65536):
            h.wfile.write(body[i:i + 65536])
            if self.chunk_delay:
                time.sleep(self.chunk_delay)


# --- repo contents ---------------------------------------------------------

def make_model_repo(commit="a" * 40):
    rng = np.random.default_rng(1234)
    shard1 = st_save({"model.embed.weight": rng.standard_normal((400, 1000), dtype=np.float32)})
    shard2 = st_save({"model.norm.weight": rng.standard_normal((1000,), dtype=np.float32),
                      "lm_head.weight": rng.standard_normal((200, 1000), dtype=np.float32)})
    index = {"metadata": {"total_size": len(shard1) + len(shard2)},
             "weight_map": {"model.embed.weight": "model-00001-of-00002.safetensors",
                            "model.norm.weight": "model-00002-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    vocab = {"tok%d" % i: i for i in range(3000)}
    files = {
        "config.json": json.dumps({"model_type": "llama", "hidden_size": 1000, "num_hidden_layers": 1}).encode(),
        "generation_config.json": b'{"do_sample": false}',
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": vocab}}).encode(),
        "tokenizer_config.json": b'{"bos_token": "<s>"}',
        "special_tokens_map.json": b'{"bos_token": "<s>"}',
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": shard1,
        "model-00002-of-00002.safetensors": shard2,
        # Not needed by fusion: must not be downloaded.
        "README.md": b"# tiny llama\n",
        "pytorch_model.bin": os.urandom(300000),
        "consolidated.safetensors": st_save({"x": np.zeros(50000, dtype=np.float32)}),
        "original/params.json": b"{}",
    }
    lfs = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "pytorch_model.bin",
           "consolidated.safetensors"}
    return Repo(commit, files, lfs)


WANTED = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
          "model-00002-of-00002.safetensors"]
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


@pytest.fixture
def hub():
    h = FakeHub()
    h.repos[REPO] = make_model_repo()
    yield h
    h.close()


@pytest.fixture
def env(tmp_path, hub):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "FUSION_"))}
    e.update(HOME=str(tmp_path / "home"), FUSION_CACHE=str(tmp_path / "cache"), HF_ENDPOINT=hub.url,
             FUSION_LOG="info", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return e


def fetch(env, *args, extra_env=None, timeout=60):
    e = dict(env, **(extra_env or {}))
    t0 = time.time()
    p = subprocess.run([str(FETCH), "--retry-delay", "20", *args], env=e, capture_output=True, text=True,
                       timeout=timeout)
    p.elapsed = time.time() - t0
    return p


def snapshot(env, repo=REPO, commit="a" * 40):
    org, name = repo.split("/")
    return Path(env["FUSION_CACHE"]) / "hub" / ("%s--%s" % (org, name)) / "snapshots" / commit


def tree(root):
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())


def assert_ok(p):
    assert p.returncode == 0, "fusion-fetch failed (rc %d):\n%s" % (p.returncode, p.stderr)


# --- tests ----------------------------------------------------------------

def test_full_download(hub, env):
    p = fetch(env, REPO)
    assert_ok(p)
    snap = snapshot(env)
    assert p.stdout.strip() == str(snap)
    assert tree(snap) == sorted(WANTED), "exactly what a model needs, nothing else"
    for f in WANTED:
        assert (snap / f).read_bytes() == hub.repos[REPO].files[f], f
    repo_dir = snap.parent.parent
    assert (repo_dir / "refs" / "main").read_text() == "a" * 40
    assert json.loads((repo_dir / "meta" / ("a" * 40 + ".json")).read_text())["sha"] == "a" * 40
    assert not list(Path(env["FUSION_CACHE"]).rglob("*.incomplete"))
    # LFS shards went through the CDN redirect; listing asked for blob metadata.
    cdn_paths = [r["path"] for r in hub.requests("cdn")]
    assert len(cdn_paths) == 2
    api = hub.requests("hub", "api")
    assert len(api) == 1 and api[0]["path"] == "/api/models/%s/revision/main" % REPO
    assert api[0]["query"] == {"blobs": ["True"]}, "sizes and sha256 are only listed with blobs"
    assert all("Authorization" not in r["headers"] for r in hub.requests())
    # progress on stderr names the files with sizes
    assert SHARD1 in p.stderr and "MiB" in p.stderr


def test_same_bytes_as_huggingface_hub(hub, env, tmp_path):
    """The reference client downloads the same files from the same fake hub: bytes must match."""
    p = fetch(env, REPO, "-q")
    assert_ok(p)
    ref_dir = tmp_path / "hf"
    code = ("import sys, huggingface_hub as h; "
            "print(h.snapshot_download(sys.argv[1], allow_patterns=sys.argv[2:], local_dir=%r))" % str(ref_dir))
    e = dict(env, HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_CACHE=str(tmp_path / "hfcache"),
             HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_ENABLE_HF_TRANSFER="0", HF_HUB_DISABLE_XET="1")
    r = subprocess.run([sys.executable, "-c", code, REPO, *WANTED], env=e, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    ref_files = sorted(f for f in tree(ref_dir) if not f.startswith(".cache"))
    assert ref_files == sorted(WANTED)
    for f in WANTED:
        assert (snapshot(env) / f).read_bytes() == (ref_dir / f).read_bytes(), f


def test_second_run_downloads_nothing(hub, env):
    assert_ok(fetch(env, REPO))
    n = len(hub.requests(kind="file"))
    p = fetch(env, REPO)
    assert_ok(p)
    assert p.stdout.strip() == str(snapshot(env))
    assert len(hub.requests(kind="file")) == n, "no file requests on the second run"
    assert len(hub.requests("hub", "api")) == 2, "only the listing is asked again"


def test_resume_after_interrupted_run(hub, env):
    hub.drop_once[SHARD1] = 600000
    p = fetch(env, REPO, "--retries", "0")
    assert p.returncode == 1
    assert "network error" in p.stderr and SHARD1 in p.stderr
    part = snapshot(env) / (SHARD1 + ".incomplete")
    assert part.exists() and 0 < part.stat().st_size < len(hub.repos[REPO].files[SHARD1])
    have = part.stat().st_size
    assert not (snapshot(env) / SHARD1).exists()
    p = fetch(env, REPO)
    assert_ok(p)
    ranged = [r for r in hub.requests("cdn") if "Range" in r["headers"]]
    assert [r["headers"]["Range"] for r in ranged] == ["bytes=%d-" % have]
    assert (snapshot(env) / SHARD1).read_bytes() == hub.repos[REPO].files[SHARD1]
    assert not part.exists()


def test_resume_within_run_after_dropped_connection(hub, env):
    hub.drop_once[SHARD2] = 300000
    hub.drop_once["tokenizer.json"] = 5000  # non-LFS file, served by the hub itself
    p = fetch(env, REPO)
    assert_ok(p)
    cdn_ranges = [r["headers"]["Range"] for r in hub.requests("cdn") if "Range" in r["headers"]]
    assert cdn_ranges == ["bytes=300000-"]
    tok = [r["headers"].get("Range") for r in hub.requests("hub") if r["path"].endswith("/tokenizer.json")]
    assert tok == [None, "bytes=5000-"]
    for f in WANTED:
        assert (snapshot(env) / f).read_bytes() == hub.repos[REPO].files[f], f


def test_server_ignoring_range_restarts_cleanly(hub, env):
    hub.drop_once[SHARD1] = 500000
    assert fetch(env, REPO, "--retries", "0").returncode == 1
    hub.ignore_range = True
    p = fetch(env, REPO)
    assert_ok(p)
    assert any("Range" in r["headers"] for r in hub.requests("cdn"))
    assert (snapshot(env) / SHARD1).read_bytes() == hub.repos[REPO].files[SHARD1]


def test_corrupt_partial_file_is_replaced(hub, env):
    snap = snapshot(env)
    snap.mkdir(parents=True)
    (snap / (SHARD1 + ".incomplete")).write_bytes(b"\0" * 100000)  # a wrong prefix
    p = fetch(env, REPO)
    assert_ok(p)
    assert "sha256 mismatch after resuming" in p.stderr
    assert (snap / SHARD1).read_bytes() == hub.repos[REPO].files[SHARD1]


def test_sha256_mismatch_rejected(hub, env):
    hub.corrupt.add(SHARD2)
    p = fetch(env, REPO)
    assert p.returncode == 1
    assert "checksum mismatch" in p.stderr and "sha256 mismatch" in p.stderr and SHARD2 in p.stderr
    snap = snapshot(env)
    assert not (snap / SHARD2).exists()
    assert not (snap / (SHARD2 + ".incomplete")).exists()
    assert not (Path(env["FUSION_CACHE"]) / "hub/test-org--tiny-llama/refs/main").exists()
    hub.corrupt.clear()
    assert_ok(fetch(env, REPO))
    assert (snap / SHARD2).read_bytes() == hub.repos[REPO].files[SHARD2]


def test_auth_required(hub, env):
    hub.token = TOKEN
    p = fetch(env, REPO)
    assert p.returncode == 1
    assert "not authorized" in p.stderr and "401" in p.stderr and "HF_TOKEN" in p.stderr
    p = fetch(env, REPO, extra_env={"HF_TOKEN": "hf_wrong"})
    assert p.returncode == 1 and "rejected" in p.stderr
    hub.log.clear()
    p = fetch(env, REPO, extra_env={"HF_TOKEN": TOKEN})
    assert_ok(p)
    for f in WANTED:
        assert (snapshot(env) / f).read_bytes() == hub.repos[REPO].files[f], f
    hub_reqs, cdn_reqs = hub.requests("hub"), hub.requests("cdn")
    assert hub_reqs and all(r["headers"].get("Authorization") == "Bearer " + TOKEN for r in hub_reqs)
    assert len(cdn_reqs) == 2
    assert all("Authorization" not in r["headers"] for r in cdn_reqs), "token leaked to the CDN host"


def test_forbidden_and_missing_files(hub, env):
    hub.file_status[SHARD2] = (403, "GatedRepo", "Access to model test-org/tiny-llama is restricted")
    p = fetch(env, REPO)
    assert p.returncode == 1
    assert "403 Forbidden" in p.stderr and "gated" in p.stderr and "GatedRepo" in p.stderr
    assert "HF_TOKEN" in p.stderr and SHARD2 in p.stderr
    hub.file_status[SHARD2] = (404, "EntryNotFound", "gone")
    p = fetch(env, REPO)
    assert p.returncode == 1 and "not found" in p.stderr and SHARD2 in p.stderr
    assert not (snapshot(env) / SHARD2).exists()
    assert not list(Path(env["FUSION_CACHE"]).rglob("*.incomplete")), "no empty partial files left"


def test_disk_error_is_reported(hub, env, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    p = fetch(env, REPO, extra_env={"FUSION_CACHE": str(blocker)})
    assert p.returncode == 1
    assert "i/o error" in p.stderr and "is not a directory" in p.stderr


def test_write_error_keeps_partial_for_resume(hub, env):
    """A failing write (here: RLIMIT_FSIZE, as on a full disk) is an i/o error, not retried."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (500000, 500000))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG

    p = subprocess.run([str(FETCH), "-q", REPO], env=env, capture_output=True, text=True, timeout=60,
                       preexec_fn=limit)
    assert p.returncode == 1
    assert "i/o error" in p.stderr and "writing" in p.stderr and "File too large" in p.stderr
    part = snapshot(env) / (SHARD1 + ".incomplete")
    assert part.stat().st_size == 500000
    assert len([r for r in hub.requests("cdn")]) == 1, "disk errors are not retried"
    assert_ok(fetch(env, REPO))
    assert [r["headers"].get("Range") for r in hub.requests("cdn")][1] == "bytes=500000-"
    assert (snapshot(env) / SHARD1).read_bytes() == hub.repos[REPO].files[SHARD1]


def test_offline_mode(hub, env):
    p = fetch(env, REPO, extra_env={"HF_HUB_OFFLINE": "1"})
    assert p.returncode == 1
    assert "offline" in p.stderr and "not in the cache" in p.stderr
    assert not hub.requests()
    assert_ok(fetch(env, REPO))
    hub.log.clear()
    for extra, args in (({"HF_HUB_OFFLINE": "1"}, ()), ({}, ("--offline",))):
        p = fetch(env, REPO, *args, extra_env=extra)
        assert_ok(p)
        assert p.stdout.strip() == str(snapshot(env))
    assert not hub.requests(), "offline mode must not touch the network"
    # A file missing from the cache is an error offline, not a silent partial model.
    (snapshot(env) / SHARD2).unlink()
    p = fetch(env, REPO, "--offline")
    assert p.returncode == 1 and SHARD2 in p.stderr


def test_cached_snapshot_used_when_hub_unreachable(hub, env):
    assert_ok(fetch(env, REPO))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = "http://127.0.0.1:%d" % s.getsockname()[1]
    s.close()
    p = fetch(env, REPO, "--retries", "1", extra_env={"HF_ENDPOINT": dead})
    assert_ok(p)
    assert p.stdout.strip() == str(snapshot(env)) and "using the cached snapshot" in p.stderr
    p = fetch(env, "test-org/other", "--retries", "1", extra_env={"HF_ENDPOINT": dead})
    assert p.returncode == 1 and "network error" in p.stderr and "cannot reach" in p.stderr


@pytest.mark.parametrize("bad", ["../evil.safetensors", "/tmp/evil.safetensors", "sub/../../evil.safetensors",
                                 "evil\n.safetensors", "sub\\..\\evil.safetensors", "./evil.safetensors"])
def test_unsafe_file_names_rejected(hub, env, tmp_path, bad):
    hub.repos[REPO].extra_siblings.append({"rfilename": bad, "size": 10})
    p = fetch(env, REPO)
    assert p.returncode == 1
    assert "unsafe file name" in p.stderr
    assert not hub.requests(kind="file"), "nothing may be downloaded from a malicious listing"
    assert not list(tmp_path.rglob("evil*"))
    assert not Path("/tmp/evil.safetensors").exists()


def test_unsafe_shard_in_index_rejected(hub, env, tmp_path):
    repo = hub.repos[REPO]
    index = json.loads(repo.files["model.safetensors.index.json"])
    index["weight_map"]["lm_head.weight"] = "../../evil.safetensors"
    repo.files["model.safetensors.index.json"] = json.dumps(index).encode()
    p = fetch(env, REPO)
    assert p.returncode == 1 and "unsafe" in p.stderr
    assert not list(tmp_path.rglob("evil*"))


def test_not_found_errors(hub, env):
    p = fetch(env, "test-org/missing")
    assert p.returncode == 1 and "not found" in p.stderr and "RepoNotFound" in p.stderr
    p = fetch(env, REPO + "@nope")
    assert p.returncode == 1 and "revision not found" in p.stderr
    p = fetch(env, REPO, "--file", "missing.txt")
    assert p.returncode == 1 and "missing.txt is not in the repo" in p.stderr
    for name in ("test-org/../x", "org/na me", "org--x/y", "-org/x", REPO + "@", REPO + "@../x"):
        p = fetch(env, "--", name)
        assert p.returncode == 1 and "not an existing path, nor a hub repo id" in p.stderr, name
    assert not hub.requests(kind="file")


def test_transient_errors_are_retried(hub, env):
    hub.api_fail = [503, 502]
    p = fetch(env, REPO)
    assert_ok(p)
    assert len(hub.requests("hub", "api")) == 3 and "retrying (2/5)" in p.stderr
    hub.log.clear()
    hub.api_fail = [500] * 10
    p = fetch(env, REPO, "--retries", "2", extra_env={"FUSION_CACHE": env["FUSION_CACHE"] + "-2"})
    assert p.returncode == 1 and "HTTP 500" in p.stderr
    assert len(hub.requests("hub", "api")) == 3, "bounded: 1 try + 2 retries"
    # With the revision cached, a hub that keeps failing does not block the start.
    hub.api_fail = [500] * 10
    p = fetch(env, REPO, "--retries", "1")
    assert_ok(p)
    assert "using the cached snapshot" in p.stderr


def test_stalled_transfer_times_out(hub, env):
    hub.stall.add(SHARD1)
    p = fetch(env, REPO, "--retries", "0", "--low-speed-time", "1", timeout=30)
    assert p.returncode == 1 and "network error" in p.stderr
    assert p.elapsed < 10
    hub.api_stall = True
    p = fetch(env, "test-org/other", "--retries", "0", "--low-speed-time", "1", timeout=30)
    assert p.returncode == 1 and "network error" in p.stderr and "cannot reach the hub" in p.stderr
    assert p.elapsed < 10


def test_concurrent_fetches_share_the_cache(hub, env):
    hub.chunk_delay = 0.05
    cmd = [str(FETCH), "-q", REPO]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip() == str(snapshot(env))
    for f in WANTED:
        assert (snapshot(env) / f).read_bytes() == hub.repos[REPO].files[f], f
    resolves = [r["path"] for r in hub.requests("hub", kind="file")]
    blobs = [r["path"] for r in hub.requests("cdn")]
    assert len(resolves) == len(set(resolves)) == len(WANTED), "each file downloaded exactly once"
    assert len(blobs) == len(set(blobs)) == 2
    assert not list(Path(env["FUSION_CACHE"]).rglob("*.incomplete"))


def test_gguf_repos(hub, env):
    q4, q8 = os.urandom(200000), os.urandom(300000)
    hub.repos["test-org/multi-GGUF"] = Repo("b" * 40, {"m.Q4_0.gguf": q4, "m.Q8_0.gguf": q8, "README.md": b"x"},
                                            {"m.Q4_0.gguf", "m.Q8_0.gguf"})
    p = fetch(env, "test-org/multi-GGUF")
    assert p.returncode == 1 and "choose one with --file" in p.stderr and "m.Q8_0.gguf" in p.stderr
    p = fetch(env, "test-org/multi-GGUF", "--file", "m.Q8_0.gguf")
    assert_ok(p)
    snap = snapshot(env, "test-org/multi-GGUF", "b" * 40)
    assert tree(snap) == ["m.Q8_0.gguf"] and (snap / "m.Q8_0.gguf").read_bytes() == q8
    parts = {"x-00001-of-00002.gguf": os.urandom(1000), "x-00002-of-00002.gguf": os.urandom(2000)}
    hub.repos["test-org/split"] = Repo("c" * 40, dict(parts, **{"config.json": b"{}"}), set(parts))
    assert_ok(fetch(env, "test-org/split"))
    snap = snapshot(env, "test-org/split", "c" * 40)
    assert tree(snap) == sorted(parts)
    hub.repos["test-org/bin-only"] = Repo("d" * 40, {"config.json": b"{}", "pytorch_model.bin": b"x"}, set())
    p = fetch(env, "test-org/bin-only")
    assert p.returncode == 1 and "no top-level *.safetensors and no *.gguf" in p.stderr


def test_revision_with_slash_and_commit(hub, env):
    repo = hub.repos[REPO]
    repo.branches["refs/pr/1"] = "e" * 40
    repo.commit = "e" * 40  # the fake serves the same files for any known revision
    repo.branches["main"] = "e" * 40
    p = fetch(env, REPO + "@refs/pr/1")
    assert_ok(p)
    assert p.stdout.strip() == str(snapshot(env, commit="e" * 40))
    assert hub.requests("hub", "api")[0]["path"] == "/api/models/%s/revision/refs%%2Fpr%%2F1" % REPO
    refs = snapshot(env).parent.parent / "refs"
    assert (refs / "refs%2Fpr%2F1").read_text() == "e" * 40
    p = fetch(env, REPO + "@" + "e" * 40, "--offline")
    assert_ok(p)


def test_local_path_passes_through(env, tmp_path, hub):
    d = tmp_path / "model"
    d.mkdir()
    p = fetch(env, str(d))
    assert_ok(p)
    assert p.stdout.strip() == str(d)
    assert not hub.requests()
