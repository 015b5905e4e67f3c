#!/usr/bin/env python3
"""load.py -- a load generator for fusion-gateway (or any OpenAI-compatible server), with vLLM's
benchmark definitions (vllm/benchmarks/serve.py):

  TTFT  time to first token: request sent -> first streamed token
  TPOT  time per output token, per request: (latency - TTFT) / (output tokens - 1), requests with > 1 token
  ITL   inter-token latency: every gap between consecutive streamed token chunks
  output throughput: all output tokens / benchmark wall time; request throughput likewise

Each concurrency level sends `--requests-per-level` streaming /v1/completions requests (default 4 x the
concurrency), keeping exactly C in flight; output lengths are fixed with ignore_eos so that levels compare.

  bench/load.py --start                   # starts 2 shards (0:15, 15:30) + gateway on the default model
  bench/load.py --url http://127.0.0.1:8080 --api-key KEY --concurrency 1 4 16
"""
import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("river mountain engine garden silver window history market winter music station harbor "
         "library forest signal orbit planet letter bridge valley").split()


def make_prompt(i, n_words):
    return "Write a story about " + " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n_words)) + "."


def one_request(url, key, model, prompt, max_tokens):
    """Streams one completion; returns (ttft, latency, [token chunk times], output tokens)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True})
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    times, tokens = [], 0
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        if any(c.get("text") for c in ev.get("choices", [])):
            times.append(time.perf_counter())
    conn.close()
    end = time.perf_counter()
    if not times:
        raise RuntimeError("no tokens streamed")
    return times[0] - t0, end - t0, times, tokens or len(times)


def run_level(url, key, model, concurrency, n_requests, max_tokens, prompt_words):
    results, errors, lock = [], [], threading.Lock()
    next_i = [0]

    def worker():
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= n_requests:
                return
            try:
                r = one_request(url, key, model, make_prompt(i, prompt_words), max_tokens)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.perf_counter() - t0
    ttft = [r[0] * 1000 for r in results]
    tpot = [(r[1] - r[0]) / (r[3] - 1) * 1000 for r in results if r[3] > 1]
    itl = [(b - a) * 1000 for r in results for a, b in zip(r[2], r[2][1:])]
    out_tokens = sum(r[3] for r in results)

    def stats(v):
        if not v:
            return {"mean": 0, "median": 0, "p99": 0}
        s = sorted(v)
        return {"mean": statistics.fmean(s), "median": statistics.median(s), "p99": s[min(len(s) - 1, int(0.99 * len(s)))]}

    return {"concurrency": concurrency, "requests": len(results), "failed": len(errors), "errors": errors[:3],
            "duration_s": duration, "output_tokens": out_tokens, "output_tok_s": out_tokens / duration,
            "request_s": len(results) / duration, "ttft_ms": stats(ttft), "tpot_ms": stats(tpot),
            "itl_ms": stats(itl)}


class LocalCluster:
    """Two fusion-shard processes and a gateway on loopback (the default model)."""

    def __init__(self, build, threads):
        model = subprocess.run([os.path.join(ROOT, "scripts", "fetch-default-model.sh")], capture_output=True,
                               text=True, check=True).stdout.strip().splitlines()[-1]
        self.dir = tempfile.mkdtemp(prefix="fusion-load-")
        self.procs = []
        secret = "load-secret-0123456789"
        ports = []
        for first, last in ((0, 15), (15, 30)):
            pf = os.path.join(self.dir, f"shard{first}.port")
            self.spawn([os.path.join(build, "fusion-shard"), "--model", model, "--blocks", f"{first}:{last}",
                        "--listen", "127.0.0.1:0", "--port-file", pf, "--secret", secret, "--insecure",
                        "--threads", str(threads)], pf)
            ports.append(int(open(pf).read()))
        pf = os.path.join(self.dir, "gateway.port")
        self.spawn([os.path.join(build, "fusion-gateway"), "--model", model, "--listen", "127.0.0.1:0",
                    "--port-file", pf, "--secret", secret, "--insecure",
                    "--hop", f"127.0.0.1:{ports[0]}:0:15", "--hop", f"127.0.0.1:{ports[1]}:15:30"], pf)
        self.url = f"http://127.0.0.1:{int(open(pf).read())}"

    def spawn(self, cmd, port_file):
        log = open(port_file + ".log", "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        deadline = time.time() + 60
        while not os.path.exists(port_file):
            if p.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"{cmd[0]} did not start; see {port_file}.log")
            time.sleep(0.05)

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="gateway base URL (without /v1)")
    ap.add_argument("--api-key", default=os.environ.get("FUSION_API_KEY", ""))
    ap.add_argument("--model", default="", help="model id (default: the first of /v1/models)")
    ap.add_argument("--start", action="store_true", help="start 2 shards + a gateway on the default model")
    ap.add_argument("--build", default=os.environ.get("FUSION_BUILD_DIR", os.path.join(ROOT, "build")))
    ap.add_argument("--shard-threads", type=int, default=1)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests-per-level", type=int, default=0, help="default: 4 x concurrency (at least 8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args()
    cluster = None
    if a.start:
        cluster = LocalCluster(a.build, a.shard_threads)
        a.url = cluster.url
    if not a.url:
        ap.error("--url or --start is required")
    try:
        if not a.model:
            u = urllib.parse.urlparse(a.url)
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
            conn.request("GET", "/v1/models", headers={"Authorization": "Bearer " + a.api_key} if a.api_key else {})
            a.model = json.loads(conn.getresponse().read())["data"][0]["id"]
        one_request(a.url, a.api_key, a.model, "warm up", 4)
        levels = []
        for c in a.concurrency:
            n = a.requests_per_level or max(8, 4 * c)
            levels.append(run_level(a.url, a.api_key, a.model, c, n, a.max_tokens, a.prompt_words))
            r = levels[-1]
            if not a.json:
                print(f"concurrency {c:3d}: {r['requests']} ok / {r['failed']} failed in {r['duration_s']:.1f} s | "
                      f"output {r['output_tok_s']:.1f} tok/s, {r['request_s']:.2f} req/s | "
                      f"TTFT mean {r['ttft_ms']['mean']:.0f} / median {r['ttft_ms']['median']:.0f} / "
                      f"p99 {r['ttft_ms']['p99']:.0f} ms | TPOT mean {r['tpot_ms']['mean']:.1f} / median "
                      f"{r['tpot_ms']['median']:.1f} ms | ITL mean {r['itl_ms']['mean']:.1f} / median "
                      f"{r['itl_ms']['median']:.1f} / p99 {r['itl_ms']['p99']:.1f} ms", flush=True)
                for e in r["errors"]:
                    print("   error:", e)
        if a.json:
            print(json.dumps({"model": a.model, "max_tokens": a.max_tokens, "levels": levels}, indent=1))
        return 0 if all(r["failed"] == 0 for r in levels) else 1
    finally:
        if cluster:
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
