#!/usr/bin/env python3
"""fusion-shard benchmark: continuous batching (aggregate decode tokens/s at 1, 4 and 16
concurrent sessions), peak RSS next to the KV budget, per-hop overhead per decode step on
loopback (client-driven vs server-to-server forwarding) and a 2-shard chain against the
single process. Usage: bench/shard.py [--model PATH | --synthetic] [--build DIR] [--tokens N] [--rounds N]

--synthetic writes a random-weight bf16 checkpoint with Llama-3.2-1B's block dimensions
(16 blocks, hidden 2048, MLP 8192, 32/8 heads; 32k vocabulary) in the Hugging Face layout:
a model whose decode is bound by memory bandwidth, as larger models are, where batching
pays the most. The default is the real SmolLM2-135M (Q4_1), whose batched decode is
bound by compute on a small CPU."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
import shard_cluster  # noqa: E402

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 3451, 28, 7018, 411]


def chain(shards, tokens, sessions, forward=False, wire="bf16"):
    t0 = time.time()
    res = shard_cluster.run_chain(shards, PROMPT, tokens, sessions=sessions, forward=forward, wire=wire,
                                  extra=["--temperature", "0.8", "--seed", "1"])
    wall = time.time() - t0
    out = json.loads(res.stdout)["sessions"]
    # decode rate of each session from its own step latencies (prefill excluded)
    rates = [1e6 / s["step_us_mean"] for s in out if s["step_us_mean"] > 0]
    return out, sum(rates), wall


def synthetic_checkpoint(path):
    """A random bf16 Llama checkpoint with Llama-3.2-1B's block shapes (numpy + safetensors)."""
    import numpy as np
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
           "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
           "hidden_act": "silu", "torch_dtype": "bfloat16"}
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return cfg["num_hidden_layers"]
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)

    def bf16(*shape, scale=0.02):
        x = (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32)
        return (x >> 16).astype(np.uint16)

    D, F, H, KV, L, V = 2048, 8192, 32, 8, 16, 32000
    hd = D // H
    t = {"model.embed_tokens.weight": bf16(V, D, scale=0.5), "model.norm.weight": bf16(D, scale=0) + 0x3F80}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = bf16(D, scale=0) + 0x3F80
        t[p + "post_attention_layernorm.weight"] = bf16(D, scale=0) + 0x3F80
        t[p + "self_attn.q_proj.weight"] = bf16(H * hd, D)
        t[p + "self_attn.k_proj.weight"] = bf16(KV * hd, D)
        t[p + "self_attn.v_proj.weight"] = bf16(KV * hd, D)
        t[p + "self_attn.o_proj.weight"] = bf16(D, H * hd)
        t[p + "mlp.gate_proj.weight"] = bf16(F, D)
        t[p + "mlp.up_proj.weight"] = bf16(F, D)
        t[p + "mlp.down_proj.weight"] = bf16(D, F)
    # numpy has no bfloat16: write the safetensors layout directly (8-byte header
    # length, JSON header, then the tensors' bytes in order)
    header, offset = {}, 0
    for name, arr in t.items():
        header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = os.path.join(path, "model.safetensors.tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in t.values():
            f.write(arr.tobytes())
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return L


def peak_rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def weights_mib(model):
    if os.path.isdir(model):
        return sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
                   if f.endswith(".safetensors")) / 2**20
    return os.path.getsize(model) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--kv-budget-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of 1/4/16 sessions, interleaved; each figure is the median over rounds")
    a = ap.parse_args()
    shard_cluster.BUILD = os.path.abspath(a.build)
    if a.synthetic:
        model = os.path.join(tempfile.gettempdir(), "fusion-bench-llama1b-bf16")
        n_layers = synthetic_checkpoint(model)
    else:
        model = a.model or subprocess.run([os.path.join(HERE, "..", "scripts", "fetch-default-model.sh")],
                                          capture_output=True, text=True, check=True).stdout.strip()
        n_layers = 30
    kv = ["--kv-budget-mib", str(a.kv_budget_mib), "--threads", "2"]

    print(f"model {model}, {a.tokens} tokens per session, KV budget {a.kv_budget_mib} MiB per shard")
    whole = shard_cluster.Shard(model, 0, n_layers, extra=kv, threads=2)
    try:
        # the configurations take turns, so that a slow spell of a shared machine
        # lands on all of them, and each row is the median of its rounds
        runs = {n: [] for n in (1, 4, 16)}
        for _ in range(max(1, a.rounds)):
            for n in runs:
                _, agg, wall = chain([whole], a.tokens, n)
                runs[n].append((agg, wall))
        rows = [(n, statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs),
                 [r[0] for r in rs]) for n, rs in runs.items()]
        base = rows[0][1]
        print(f"\ncontinuous batching, one shard holding every block (median of {max(1, a.rounds)} rounds)")
        print(f"{'sessions':>8} {'agg decode tok/s':>17} {'x vs 1':>7} {'wall s':>7}  rounds")
        for n, agg, wall, each in rows:
            print(f"{n:>8} {agg:>17.1f} {agg / base:>7.2f} {wall:>7.2f}  {' '.join(f'{v:.1f}' for v in each)}")
        rss = peak_rss_mib(whole.proc.pid)
        print(f"peak RSS of the shard after 16 sessions: {rss:.0f} MiB "
              f"(weights {weights_mib(model):.0f} MiB + KV budget {a.kv_budget_mib} MiB)")
    finally:
        whole.stop()

    # single process reference
    gen = subprocess.run([shard_cluster.program("generate"), "--model", model, "--prompt-ids",
                          ",".join(map(str, PROMPT)), "--max-tokens", str(a.tokens), "--json",
                          "--ignore-eos", "--temperature", "0.8", "--seed", "1"],
                         capture_output=True, text=True, check=True)
    g = json.loads(gen.stdout)
    single = (a.tokens - 1) / g["decode_s"]

    half = n_layers // 2
    shards = [shard_cluster.Shard(model, 0, half, extra=kv, threads=2),
              shard_cluster.Shard(model, half, n_layers, extra=kv, threads=2)]
    try:
        print("\n2-shard chain on loopback, one session, bf16 on the wire")
        print(f"{'mode':>22} {'step ms':>8} {'compute ms':>10} {'overhead/hop ms':>15} {'tok/s':>7} {'x single':>8}")
        print(f"{'single process':>22} {1e3 / single:>8.2f} {'':>10} {'':>15} {single:>7.1f} {1.0:>8.2f}")
        for forward in (False, True):
            out, agg, _ = chain(shards, a.tokens, 1, forward=forward)
            s = out[0]
            compute = sum(h["compute_us"] for h in s["hops"]) / 1e3
            step = s["step_us_mean"] / 1e3
            label = "server-to-server" if forward else "client relays"
            print(f"{label:>22} {step:>8.2f} {compute:>10.2f} {(step - compute) / 2:>15.3f} "
                  f"{agg:>7.1f} {agg / single:>8.2f}")
    finally:
        for s in shards:
            s.stop()


if __name__ == "__main__":
    main()
