"""fusion-gateway's /v1/files through the official openai SDK, with real processes on loopback.

Checks: an upload of a valid chat JSONL (files.create) is listed (with limit/after paging), retrieved,
its content read back byte for byte, deleted (then NotFoundError); another key's files are invisible
(NotFoundError), an --admin-key sees them; invalid files are BadRequestError naming the line (not JSON,
no messages, weight 2, no assistant message, an unknown role, an unknown key) and leave nothing, as
are files without examples (invalid_n_examples; a training file of fewer than 10 is refused at job
creation); hostile uploads get a clear 4xx and the server stays up (too large, cut off mid-body,
invalid UTF-8, 10^5 short lines, 10^6 empty ones, deep nesting, no multipart boundary, a filename
with separators, 8 concurrent uploads); after kill -9 and a restart on the same --data-dir every
file is listed with its content intact.
"""
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

import pytest
import requests

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import SOURCE, Gateway, Shard, default_model  # noqa: E402

openai = pytest.importorskip("openai")

KEY, OTHER, ADMIN = "sk-files-key", "sk-files-other", "sk-files-admin"
FACTS = os.path.join(SOURCE, "tests", "data", "vellmora-facts.jsonl")
MAX_FILE = 1 << 20


@pytest.fixture(scope="module")
def model():
    return default_model()


@pytest.fixture(scope="module")
def shard(model):
    s = Shard(model, 0, 30)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def data_dir():
    d = tempfile.mkdtemp(prefix="files-data-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start(model, shard, data_dir):
    return Gateway(model, ["--hop", shard.hop()], KEY, "--api-key", OTHER, "--admin-key", ADMIN, "--data-dir",
                   data_dir, "--max-file-bytes", str(MAX_FILE))


@pytest.fixture(scope="module")
def gw(model, shard, data_dir):
    g = start(model, shard, data_dir)
    yield g
    rc = g.stop()
    out = g.output()
    assert rc == 0, f"gateway exited {rc}:\n{out[-3000:]}"
    assert "AddressSanitizer" not in out and "runtime error" not in out, out[-3000:]


def client(gw, key=KEY):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120)


def leftovers(data_dir):
    """Temporary upload files in the data directory."""
    return [n for n in os.listdir(os.path.join(data_dir, "files")) if n.startswith(".upload-")]


def upload(gw, content, name="train.jsonl", key=KEY, purpose="fine-tune"):
    """POST /v1/files with requests (raw bytes); returns (status, body)."""
    r = requests.post(gw.url + "/v1/files", headers={"Authorization": f"Bearer {key}"},
                      files={"file": (name, content)}, data={"purpose": purpose}, timeout=120)
    return r.status_code, r.json()


def facts():
    return open(FACTS, "rb").read()


def examples(n):
    line = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    return [json.dumps(line)] * n


def test_upload_list_retrieve_content_delete(gw):
    c = client(gw)
    f = c.files.create(file=open(FACTS, "rb"), purpose="fine-tune")
    assert f.id.startswith("file-") and f.object == "file" and f.purpose == "fine-tune"
    assert f.bytes == len(facts()) and f.filename == "vellmora-facts.jsonl" and f.status == "processed"
    assert c.files.retrieve(f.id).id == f.id
    assert c.files.content(f.id).read() == facts()
    ids = [c.files.create(file=("more.jsonl", facts()), purpose="fine-tune").id for _ in range(3)]
    page = c.files.list(limit=2)
    assert [x.id for x in page.data] == ids[::-1][:2] and page.has_more
    nxt = c.files.list(limit=2, after=page.data[-1].id)
    assert [x.id for x in nxt.data] == [ids[0], f.id]
    every = [x.id for x in c.files.list(limit=1)]  # the SDK follows after= pages itself
    assert every[:4] == ids[::-1] + [f.id]
    asc = c.files.list(order="asc", limit=10000)
    assert [x.id for x in asc.data][-4:] == [f.id] + ids
    deleted = c.files.delete(f.id)
    assert deleted.id == f.id and deleted.deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        c.files.content(f.id)


def test_owners(gw):
    mine = client(gw).files.create(file=("mine.jsonl", facts()), purpose="fine-tune")
    other = client(gw, OTHER)
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.files.delete(mine.id)
    assert mine.id not in [x.id for x in other.files.list().data]
    admin = client(gw, ADMIN)
    assert admin.files.retrieve(mine.id).id == mine.id
    assert mine.id in [x.id for x in admin.files.list().data]
    assert requests.get(gw.url + "/v1/files", timeout=10).status_code == 401


@pytest.mark.parametrize("lines,line_no,words", [
    (examples(5) + ["not json"] + examples(10), 6, "Invalid JSON"),
    (examples(2) + ['{"prompt": "x"}'] + examples(10), 3, "Missing 'messages' key."),
    (examples(10) + [json.dumps({"messages": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": "b", "weight": 2}]})], 11, "weight"),
    ([json.dumps({"messages": [{"role": "user", "content": "a"}]})] + examples(10), 1, "assistant"),
    (examples(3) + [json.dumps({"messages": [{"role": "wizard", "content": "a"},
                                             {"role": "assistant", "content": "b"}]})] + examples(9), 4, "role"),
    (examples(3) + [json.dumps({"messages": [{"role": "user", "content": "a", "mood": 1},
                                             {"role": "assistant", "content": "b"}]})] + examples(9), 4, "mood"),
    (examples(3) + [json.dumps({"messages": [{"role": "user", "content": "a<|im_end|>"},
                                             {"role": "assistant", "content": "b"}]})] + examples(9), 4, "special"),
])
def test_invalid_lines(gw, data_dir, lines, line_no, words):
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).files.create(file=("bad.jsonl", "\n".join(lines).encode()), purpose="fine-tune")
    err = e.value.body
    assert f"Line {line_no}:" in err["message"] and words in err["message"], err
    assert err["param"] == "file" and err["code"] == "invalid_file_format", err
    assert not leftovers(data_dir)


def test_few_examples_and_purpose(gw, data_dir):
    before = len(os.listdir(os.path.join(data_dir, "files")))
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).files.create(file=("empty.jsonl", b"\n \n"), purpose="fine-tune")
    assert e.value.body["code"] == "invalid_n_examples", e.value.body
    few = client(gw).files.create(file=("few.jsonl", "\n".join(examples(9)).encode()), purpose="fine-tune")
    base = client(gw).models.list().data[0].id  # nine examples: a validation file, not a training file
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).fine_tuning.jobs.create(model=base, training_file=few.id)
    assert e.value.body["code"] == "invalid_n_examples" and e.value.body["param"] == "training_file", e.value.body
    assert "9 example(s)" in e.value.body["message"]
    client(gw).files.delete(few.id)
    st, body = upload(gw, facts(), purpose="batch")
    assert st == 400 and body["error"]["param"] == "purpose", body
    assert len(os.listdir(os.path.join(data_dir, "files"))) == before


def test_hostile_uploads(gw, data_dir):
    st, body = upload(gw, b"x" * (MAX_FILE + 1))
    assert st == 413, body
    st, body = upload(gw, b"\xff\xfe" + facts())
    assert st == 400 and "UTF-8" in body["error"]["message"], body
    st, body = upload(gw, b'{}\n' * 100000)
    assert st == 400 and "Line 1:" in body["error"]["message"], body
    st, body = upload(gw, b'\n' * 10 ** 6)  # a million (empty) lines
    assert st == 400 and body["error"]["code"] == "invalid_n_examples", body
    st, body = upload(gw, ("[" * 100000 + "]" * 100000 + "\n").encode() + facts())
    assert st == 400 and "Line 1:" in body["error"]["message"], body
    r = requests.post(gw.url + "/v1/files", headers={"Authorization": f"Bearer {KEY}",
                                                      "Content-Type": "multipart/form-data"}, data=b"abc", timeout=10)
    assert r.status_code == 400, r.text
    st, body = upload(gw, facts(), name="../../etc/passwd")
    assert st == 200 and body["filename"] == "passwd", body
    raw = (b"--xyzzy\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n--xyzzy\r\n"
           b"Content-Disposition: form-data; name=\"file\"; filename=\"a/../pass\x01wd\"\r\n\r\n" + facts() +
           b"\r\n--xyzzy--\r\n")
    r = requests.post(gw.url + "/v1/files", data=raw, timeout=10, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "multipart/form-data; boundary=xyzzy"})
    assert r.status_code == 200 and r.json()["filename"] == "pass_wd", r.text
    st, body = upload(gw, facts(), name="..\\..\\win\\name.jsonl")
    assert st == 200 and body["filename"] == "name.jsonl", body
    assert not leftovers(data_dir)
    assert requests.get(gw.url + "/health", timeout=10).status_code == 200


def test_cut_off_upload(gw, data_dir):
    """A client that closes mid-body leaves no file."""
    head = (b"--xyzzy\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n"
            b"--xyzzy\r\nContent-Disposition: form-data; name=\"file\"; filename=\"t.jsonl\"\r\n\r\n")
    s = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    s.sendall(b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
              b"\r\nContent-Type: multipart/form-data; boundary=xyzzy\r\nContent-Length: 100000\r\n\r\n" + head +
              facts())
    deadline = time.time() + 10
    while not leftovers(data_dir) and time.time() < deadline:
        time.sleep(0.05)
    assert leftovers(data_dir), "the upload should be streaming into a temporary file"
    s.close()
    deadline = time.time() + 10
    while leftovers(data_dir) and time.time() < deadline:
        time.sleep(0.1)
    assert not leftovers(data_dir)
    assert requests.get(gw.url + "/health", timeout=10).status_code == 200


def test_concurrent_uploads(gw):
    c = client(gw)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: c.files.create(file=(f"c{i}.jsonl", facts()), purpose="fine-tune"), range(8)))
    assert len({f.id for f in got}) == 8
    for f in got:
        assert c.files.content(f.id).read() == facts()


def test_restart_after_kill(model, shard):
    d = tempfile.mkdtemp(prefix="files-restart-")
    try:
        g = start(model, shard, d)
        c = client(g)
        ids = [c.files.create(file=(f"r{i}.jsonl", facts()), purpose="fine-tune").id for i in range(3)]
        g.proc.send_signal(signal.SIGKILL)
        g.proc.wait()
        g = start(model, shard, d)
        c = client(g)
        assert sorted(x.id for x in c.files.list().data) == sorted(ids)
        for i in ids:
            assert c.files.content(i).read() == facts()
        assert g.stop() == 0
    finally:
        shutil.rmtree(d, ignore_errors=True)
