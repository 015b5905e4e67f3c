#!/usr/bin/env python3
"""ft_itl.py -- a chat's inter-token latency on a 2-shard chain while a fine-tuning job trains there.

In one run: 2 fusion-shard processes (blocks 0:15 and 15:30 of the default model) behind a
gateway, and a streaming chat load of --clients clients (max_tokens 64, greedy, ignore_eos) for
--duration seconds, in three phases:
  1. no fine-tuning job;
  2. a fine-tuning job training on the same shards, started with --train-priority inference
     (the default: training waits between its passes while inference steps are queued or running);
  3. the same with the shards restarted with --train-priority fair (training and inference take
     turns op by op on the shard's backend).
Reported per phase: ITL (every gap between consecutive streamed content chunks) p50 and p99, output
tokens/s of all clients, the job's training steps per minute, and each figure's ratio to phase 1.
The job (LoRA r 16 on all linear layers, through the OpenAI SDK) trains on the facts of
tests/data/vellmora-facts.jsonl, repeated so that no epoch ends (and no checkpoint is written and
served) within a phase; its micro-batches hold about 400 tokens.

  .venv/bin/python bench/ft_itl.py [--duration 30] [--clients 4] [--shard-threads 1] [--build build]
  .venv/bin/python bench/ft_itl.py --quick        # a few seconds a phase: a smoke test
"""
import argparse
import contextlib
import http.client
import json
import os
import shutil
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import shard_cluster  # noqa: E402
from train import cpu_name  # noqa: E402  (bench/train.py)

KEY = "sk-bench-ft-itl"
FACTS = os.path.join(ROOT, "tests", "data", "vellmora-facts.jsonl")
LORA = {"r": 16, "alpha": 32, "target_modules": "all-linear"}
TOPICS = ("a lighthouse keeper", "the first snow of winter", "a market in the rain", "an old clock",
          "a river crossing", "a letter never sent", "the night train", "a garden in spring")


def percentile(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def chat_stream(port, model, prompt, max_tokens):
    """One streaming chat completion; returns (content chunk times, completion tokens)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn.request("POST", "/v1/chat/completions", body,
                 {"Content-Type": "application/json", "Authorization": "Bearer " + KEY})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    times, tokens = [], 0
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            if line == b"data: [DONE]":
                break
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        if any(c.get("delta", {}).get("content") for c in ev.get("choices", [])):
            times.append(time.perf_counter())
    conn.close()
    return times, tokens or len(times)


def run_load(port, model, clients, duration, max_tokens):
    """`clients` threads stream chats back to back for `duration` s (those in flight then finish)."""
    gaps, errors, lock = [], [], threading.Lock()
    totals = {"tokens": 0, "requests": 0}
    t0 = time.perf_counter()
    stop_at = t0 + duration

    def client(k):
        i = 0
        while time.perf_counter() < stop_at:
            prompt = f"Write a short story about {TOPICS[(k * 3 + i) % len(TOPICS)]}."
            i += 1
            try:
                times, tokens = chat_stream(port, model, prompt, max_tokens)
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(repr(e))
                time.sleep(0.5)
                continue
            with lock:
                gaps.extend((b - a) * 1000 for a, b in zip(times, times[1:]))
                totals["tokens"] += tokens
                totals["requests"] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99), "tok_s": totals["tokens"] / wall,
            "requests": totals["requests"], "gaps": len(gaps), "errors": errors[:3], "n_errors": len(errors)}


@contextlib.contextmanager
def cluster(model, priority, threads):
    """2 shards with --train-priority `priority` and a gateway with a data directory; yields the gateway."""
    data = tempfile.mkdtemp(prefix="ft-itl-")
    shards, gw = [], None
    try:
        extra = ["--train-priority", priority]
        shards = [shard_cluster.Shard(model, 0, 15, extra=extra, threads=threads),
                  shard_cluster.Shard(model, 15, 30, extra=extra, threads=threads)]
        gw = shard_cluster.Gateway(model, ["--hop", shards[0].hop(), "--hop", shards[1].hop()], KEY,
                                   "--data-dir", data)
        yield gw
    finally:
        if gw:
            gw.stop()
        for s in shards:
            s.stop()
        shutil.rmtree(data, ignore_errors=True)


def training_file(client, directory, copies):
    """The facts repeated `copies` times, uploaded for fine-tuning; returns the file id."""
    lines = [ln for ln in open(FACTS).read().splitlines() if ln.strip()]
    path = os.path.join(directory, "facts.jsonl")
    with open(path, "w") as f:
        for k in range(copies):
            for i in range(len(lines)):
                f.write(lines[(i * 7 + k) % len(lines)] + "\n")
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="fine-tune").id


def job_step(client, job_id):
    """The last training step the job reported (0: none yet)."""
    steps = [e.data["step"] for e in client.fine_tuning.jobs.list_events(job_id, limit=20)
             if e.type == "metrics" and e.data]
    return max(steps, default=0)


def start_job(client, model_id, batch):
    """Creates a job and waits until it has finished a training step; returns its id."""
    with tempfile.TemporaryDirectory() as d:
        fid = training_file(client, d, 25)
    job = client.fine_tuning.jobs.create(
        model=model_id, training_file=fid, seed=1,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": batch}}},
        extra_body={"lora": LORA})
    deadline = time.time() + 300
    while job_step(client, job.id) < 1:
        st = client.fine_tuning.jobs.retrieve(job.id)
        if st.status in ("failed", "cancelled", "succeeded") or time.time() > deadline:
            raise RuntimeError(f"fine-tuning job {job.id} is {st.status} before its first step: {st.error}")
        time.sleep(0.5)
    return job.id


def phase(gw, model_id, a, with_job):
    """Warms up, then runs the load (with a training job started first when with_job)."""
    import openai
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    run_load(gw.port, model_id, a.clients, 1 if a.quick else 3, a.max_tokens)  # warm-up
    job_id = start_job(client, model_id, a.batch) if with_job else None
    s0, t0 = (job_step(client, job_id), time.time()) if job_id else (0, 0)
    r = run_load(gw.port, model_id, a.clients, a.duration, a.max_tokens)
    if job_id:
        r["train_steps_min"] = (job_step(client, job_id) - s0) * 60 / (time.time() - t0)
        if client.fine_tuning.jobs.retrieve(job_id).status == "succeeded":
            r["note"] = "the job ended during the phase"
        client.fine_tuning.jobs.cancel(job_id)
    return r


def print_table(a, model, rows):
    base = rows[0][1]
    print(f"CPU: {cpu_name()} ({os.cpu_count()} CPUs); model {os.path.basename(model)}; shards 0:15 + 15:30, "
          f"{a.shard_threads} thread(s) each")
    print(f"load: {a.clients} streaming chat clients, max_tokens {a.max_tokens}, {a.duration:g} s a phase; "
          f"job: LoRA r 16 all-linear, batch {a.batch} (~{a.batch * 40} tokens a micro-batch)")
    head = (f"{'phase':<34}{'ITL p50 ms':>11}{'ITL p99 ms':>11}{'tok/s':>8}{'train steps/min':>16}"
            f"{'p50 x':>8}{'p99 x':>8}{'tok/s x':>9}")
    print(head)
    print("-" * len(head))
    for name, r in rows:
        steps = f"{r['train_steps_min']:.1f}" if "train_steps_min" in r else "-"
        print(f"{name:<34}{r['itl_p50']:>11.1f}{r['itl_p99']:>11.1f}{r['tok_s']:>8.1f}{steps:>16}"
              f"{r['itl_p50'] / base['itl_p50']:>8.2f}{r['itl_p99'] / base['itl_p99']:>8.2f}"
              f"{r['tok_s'] / base['tok_s']:>9.2f}")
    for name, r in rows:
        if r["n_errors"] or r.get("note"):
            print(f"  {name}: {r['n_errors']} failed requests {r['errors']} {r.get('note', '')}")
    inf, fair = rows[1][1], rows[2][1]
    steps = (f"{fair['train_steps_min'] / inf['train_steps_min']:.2f}x" if inf["train_steps_min"] > 0
             else "- (no step finished under inference priority)")
    print(f"fair / inference: ITL p50 {fair['itl_p50'] / inf['itl_p50']:.2f}x, p99 "
          f"{fair['itl_p99'] / inf['itl_p99']:.2f}x, tok/s {fair['tok_s'] / inf['tok_s']:.2f}x, "
          f"training steps/min {steps}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.environ.get("FUSION_BUILD_DIR", os.path.join(ROOT, "build")))
    ap.add_argument("--model", help="a GGUF of SmolLM2-135M's shape (default: the default model)")
    ap.add_argument("--duration", type=float, default=30, help="seconds of load per phase")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=10, help="the job's batch size (examples of ~40 tokens)")
    ap.add_argument("--shard-threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a few seconds a phase (a smoke test)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    a = ap.parse_args()
    if a.quick:
        a.duration = min(a.duration, 4)
    shard_cluster.BUILD = os.path.abspath(a.build)
    model = a.model or shard_cluster.subprocess.run(
        [os.path.join(ROOT, "scripts", "fetch-default-model.sh")], capture_output=True, text=True,
        check=True).stdout.strip().splitlines()[-1]
    rows = []
    with cluster(model, "inference", a.shard_threads) as gw:
        _, models = shard_cluster.api_request(gw, "GET", "/v1/models", key=KEY)
        model_id = models["data"][0]["id"]
        rows.append(("no fine-tuning job", phase(gw, model_id, a, False)))
        rows.append(("job, --train-priority inference", phase(gw, model_id, a, True)))
    with cluster(model, "fair", a.shard_threads) as gw:
        rows.append(("job, --train-priority fair", phase(gw, model_id, a, True)))
    print_table(a, model, rows)
    if a.json:
        print(json.dumps({name: r for name, r in rows}, indent=1))
    return 0 if all(r["gaps"] > 0 for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
