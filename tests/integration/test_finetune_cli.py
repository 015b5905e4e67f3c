"""fusion-finetune against a gateway over a 2-shard chain, run as a subprocess.

Checks: a whole job on tests/data/vellmora-facts.jsonl (settings from --config, --epochs overriding
it; a --validation file uploaded too) exits 0 with one progress line per metrics event, the fine_tuned_model as the last line of
stdout, a model that answers a chat completion, and the job's result files written by --results: the metrics
CSV, the loss curve and the adapter in PEFT's format.
Errors exit 1 with one line: a file with a line that is not JSON (the server's message naming the
line), a wrong API key (the 401 message), an unreachable URL, a server whose replies are broken
(not JSON, 5xx pages, missing fields). --no-follow prints the job id;
--follow follows it, and SIGINT once the progress shows cancels the job and exits 130.
"""
import http.server
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import SOURCE, Gateway, Shard, api_request, default_model, program  # noqa: E402

KEY = "sk-cli-key"
FACTS = os.path.join(SOURCE, "tests", "data", "vellmora-facts.jsonl")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A gateway over two shards of the default model (a static chain, which jobs train through)."""
    model = default_model()
    shards = [Shard(model, 0, 15, threads=2), Shard(model, 15, 30, threads=2)]
    hops = [flag for s in shards for flag in ("--hop", s.hop())]
    try:
        gw = Gateway(model, hops, KEY, "--data-dir", str(tmp_path_factory.mktemp("ft-cli-data")))
    except Exception:
        for s in shards:
            s.stop()
        raise
    yield gw
    rc, log = gw.stop(), gw.output()
    for s in shards:
        s.stop()
    assert rc == 0, f"gateway exited {rc}:\n{log[-3000:]}"


def finetune(gw, *argv, key=KEY, timeout=120):
    """Runs fusion-finetune against gw (url and key from the environment); returns the result."""
    env = dict(os.environ, FUSION_URL=gw.url if gw else "http://127.0.0.1:1", FUSION_API_KEY=key)
    return subprocess.run([program("finetune"), *argv], capture_output=True, text=True, timeout=timeout, env=env)


def test_whole_job(cluster, tmp_path):
    config = tmp_path / "finetune.json"
    config.write_text(json.dumps({"epochs": 1, "batch_size": 10, "lr_multiplier": 10, "lora_r": 8,
                                  "suffix": "cli", "seed": 3}))
    res = finetune(cluster, "--config", str(config), "--epochs", "2", "--results", str(tmp_path / "out"),
                   "--validation", FACTS, FACTS)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    model = lines[-1]
    assert model.startswith("ft:") and ":cli:ftjob-" in model, res.stdout
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/4", "2/4", "3/4", "4/4"], res.stdout
    assert all("  loss " in s for s in steps), steps
    assert "valid " in steps[1] and "valid " in steps[3], steps  # each epoch's end has a validation loss

    job_id = model.rsplit(":", 1)[1]
    st, job = api_request(cluster, "GET", f"/v1/fine_tuning/jobs/{job_id}", key=KEY)
    assert st == 200 and job["status"] == "succeeded", job
    assert job["hyperparameters"]["n_epochs"] == 2 and job["hyperparameters"]["batch_size"] == 10, job
    assert job["lora"]["r"] == 8 and job["seed"] == 3 and job["validation_file"].startswith("file-"), job

    csv = (tmp_path / "out" / "step_metrics.csv").read_text().splitlines()
    assert csv[0].startswith("step,train_loss") and len(csv) == 5, csv
    peft = json.loads((tmp_path / "out" / "adapter_config.json").read_text())  # --results DIR is a PEFT adapter
    assert peft["peft_type"] == "LORA" and peft["r"] == 8, peft
    assert (tmp_path / "out" / "adapter_model.safetensors").stat().st_size > 0
    assert (tmp_path / "out" / "loss_curve.svg").read_text().startswith("<?xml")

    st, answer = api_request(cluster, "POST", "/v1/chat/completions", key=KEY, timeout=120,
                             body={"model": model, "max_tokens": 8, "temperature": 0,
                                   "messages": [{"role": "user", "content": "Who founded Vellmora?"}]})
    assert st == 200 and answer["choices"][0]["message"]["content"], answer


def test_bad_file(cluster, tmp_path):
    bad = tmp_path / "bad.jsonl"
    with open(FACTS) as f:
        bad.write_text(f.readline() + "this is not JSON\n")
    res = finetune(cluster, str(bad))
    assert res.returncode == 1, res.stdout + res.stderr
    err = res.stderr.strip()
    assert err.startswith("fusion-finetune: 400 ") and "line 2" in err.lower() and "\n" not in err, err


def test_wrong_key(cluster):
    res = finetune(cluster, FACTS, key="sk-wrong")
    assert res.returncode == 1
    assert res.stderr.strip().startswith("fusion-finetune: 401 ") and "API key" in res.stderr, res.stderr


def test_unreachable_url():
    """Also loads config/finetune.example.json, whose url the flag overrides."""
    example = os.path.join(SOURCE, "config", "finetune.example.json")
    res = finetune(None, "--config", example, "--url", "http://127.0.0.1:1", FACTS, timeout=30)
    assert res.returncode == 1
    assert "cannot reach http://127.0.0.1:1" in res.stderr, res.stderr


def read_lines(stream, q):
    for line in stream:
        q.put(line)
    q.put(None)


def test_sigint_cancels(cluster):
    res = finetune(cluster, "--epochs", "50", "--batch-size", "1", "--no-follow", "--quiet", FACTS)
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.splitlines()[-1]
    assert job_id.startswith("ftjob-"), res.stdout

    env = dict(os.environ, FUSION_URL=cluster.url, FUSION_API_KEY=KEY)
    proc = subprocess.Popen([program("finetune"), "--follow", job_id], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines = queue.Queue()
    threading.Thread(target=read_lines, args=(proc.stdout, lines), daemon=True).start()
    deadline, seen = time.time() + 60, []
    try:
        while not any(ln.startswith("step ") for ln in seen):
            line = lines.get(timeout=max(0.1, deadline - time.time()))
            assert line is not None and time.time() < deadline, "".join(seen)
            seen.append(line)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert rc == 130 and "cancel" in err, err
    st, job = api_request(cluster, "GET", f"/v1/fine_tuning/jobs/{job_id}", key=KEY)
    assert st == 200 and job["status"] == "cancelled", job


class BrokenGateway(http.server.BaseHTTPRequestHandler):
    """Answers the job's polls with a page that is not JSON, a 502 page, events without ids or
    data, then a succeeded job without a fine_tuned_model."""
    polls = 0

    def reply(self, status, body, kind="application/json"):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.reply(200, '{"id": "file-1"}' if self.path == "/v1/files" else '{"id": "ftjob-1", "status": 3}')

    def do_GET(self):
        if self.path == "/v1/models":
            return self.reply(200, '{"data": [{"id": "base"}]}')
        if "/events" in self.path:
            return self.reply(200, '{"data": [{"id": 5}, "x", {"id": "e1", "type": "metrics", "data": {"step": "a"}},'
                                   ' {"id": "e2", "type": "metrics"}], "has_more": true}')
        BrokenGateway.polls += 1
        if BrokenGateway.polls == 1:
            return self.reply(200, "{not json")
        if BrokenGateway.polls == 2:
            return self.reply(502, "<html>bad gateway</html>", "text/html")
        self.reply(200, '{"id": "ftjob-1", "status": "succeeded", "result_files": "x"}')

    def log_message(self, *args):
        pass


def test_broken_replies(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), BrokenGateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = dict(os.environ, FUSION_URL=f"http://127.0.0.1:{server.server_address[1]}/v1/")
        res = subprocess.run([program("finetune"), "--results", str(tmp_path / "out"), FACTS], capture_output=True,
                             text=True, timeout=30, env=env)
    finally:
        server.shutdown()
    assert res.returncode == 1, res.stdout + res.stderr
    assert "not a JSON object (retrying)" in res.stderr and "502: <html>bad gateway</html> (retrying)" in res.stderr
    assert "succeeded without a fine_tuned_model" in res.stderr, res.stderr
