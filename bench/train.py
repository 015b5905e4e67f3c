#!/usr/bin/env python3
"""train.py -- LoRA training throughput: fusion-train beside PyTorch + PEFT, in one run, on one machine.

Both train SmolLM2-135M-Instruct (the default GGUF, dequantized to f32 weights that both load:
fusion from a Hugging Face directory written here, PyTorch from the same tensors) with LoRA
r = 16 on all seven linear layers, AdamW, batches of 8 sequences of 256 tokens, on the same
number of CPU threads. Each runs in its own process; reported: training tokens per second
(forward + backward + optimizer step, after a warm-up step) and peak RSS. fusion is also run
on the GGUF itself (Q4_1 weights, held as they are), as a 2-span chain in one process, with
activations kept instead of recomputed, and through two fusion-shard processes on loopback
(micro-batches one at a time, then two in flight).

  bench/train.py [--threads 2] [--steps 3] [--seq 256] [--batch 8]
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "oracle"))


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def build_hf(gguf_path, out):
    """The GGUF's tensors dequantized to f32, in the Hugging Face layout (Q/K un-permuted)."""
    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(gguf_path)

    def meta(key):
        f = reader.fields[key]
        return f.parts[f.data[0]][0]

    n_head, n_kv = int(meta("llama.attention.head_count")), int(meta("llama.attention.head_count_kv"))
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               vocab_size=int(meta("llama.vocab_size")), hidden_size=int(meta("llama.embedding_length")),
               intermediate_size=int(meta("llama.feed_forward_length")),
               num_hidden_layers=int(meta("llama.block_count")), num_attention_heads=n_head,
               num_key_value_heads=n_kv, max_position_embeddings=int(meta("llama.context_length")),
               rms_norm_eps=float(meta("llama.attention.layer_norm_rms_epsilon")),
               rope_theta=float(meta("llama.rope.freq_base")), tie_word_embeddings=True, torch_dtype="float32")
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_norm": "input_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    sd = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if len(t.shape) > 1 else w
        parts = t.name.split(".")
        if parts[0] == "blk":
            heads = {"attn_q": n_head, "attn_k": n_kv}.get(parts[2])
            if heads:
                w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
            sd[f"model.layers.{parts[1]}.{names[parts[2]]}.weight"] = np.ascontiguousarray(w)
        else:
            sd[names[parts[0]] + ".weight"] = np.ascontiguousarray(w)
    os.makedirs(out, exist_ok=True)
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return cfg


def write_data(path, vocab, n, seq):
    import random
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(seq)]}) + "\n")


TORCH = r"""
import json, sys, time, resource
import torch, transformers, peft
cfg_dir, data, steps, batch, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
model = transformers.LlamaForCausalLM.from_pretrained(cfg_dir, torch_dtype=torch.float32)
model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
model.train()
rows = [json.loads(l)["input_ids"] for l in open(data)]
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
times = []
for s in range(steps + 1):
    ids = torch.tensor(rows[(s * batch) % len(rows):(s * batch) % len(rows) + batch])
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
print(json.dumps({"step_s": times[1:], "loss": loss.item()}))
"""


def run(cmd):
    """Runs cmd; returns (stdout, its own peak RSS in MiB)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} failed:\n{err.read()[-2000:]}")
        return out.read(), usage.ru_maxrss / 1024.0


def fusion(build, model, data, args, extra):
    cmd = [os.path.join(build, "fusion-train"), "--model", model, "--data", data, "--threads", str(args.threads),
           "--r", "16", "--alpha", "32", "--targets", "all-linear", "--batch-size", str(args.batch),
           "--max-tokens", str(args.batch * args.seq), "--steps", str(args.steps + 1), "--lr", "1e-4", *extra]
    out, rss = run(cmd)
    steps = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [s["seconds"] for s in steps[1:]], rss


def chain(build, model, data, args, extra):
    """fusion-train through two fusion-shard processes (blocks 0:15 and 15:30) on loopback; the
    peak RSS is the largest of the three processes'."""
    secret = "bench-train-secret-0123456789"
    tmp = tempfile.mkdtemp(prefix="fusion-bench-chain-")
    procs, hops = [], []
    try:
        for i, (a, b) in enumerate([(0, 15), (15, 30)]):
            pf = os.path.join(tmp, f"port{i}")
            procs.append(subprocess.Popen(
                [os.path.join(build, "fusion-shard"), "--model", model, "--blocks", f"{a}:{b}", "--listen",
                 "127.0.0.1:0", "--port-file", pf, "--secret", secret, "--insecure", "--threads",
                 str(args.threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            while not os.path.exists(pf):
                time.sleep(0.1)
            hops += ["--hop", f"127.0.0.1:{open(pf).read().strip()}:{a}:{b}"]
        os.environ["FUSION_SECRET"] = secret
        secs, rss = fusion(build, model, data, args, hops + ["--insecure"] + extra)
        return secs, max(rss, *(shard_rss(p.pid) for p in procs))
    finally:
        for p in procs:
            p.terminate()
            p.wait()


def shard_rss(pid):
    """A running process's peak RSS in MiB (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--build", default=os.environ.get("FUSION_BUILD_DIR", os.path.join(ROOT, "build")))
    args = ap.parse_args()
    from fusion_oracle import default_model

    gguf_path = default_model()
    tmp = tempfile.mkdtemp(prefix="fusion-bench-train-")
    hf = os.path.join(tmp, "hf")
    cfg = build_hf(gguf_path, hf)
    data = os.path.join(tmp, "data.jsonl")
    write_data(data, cfg["vocab_size"], args.batch * (args.steps + 1), args.seq)
    tokens = args.batch * args.seq
    print(f"CPU: {cpu_name()}, {args.threads} threads; SmolLM2-135M, LoRA r=16 all-linear, "
          f"batch {args.batch} x {args.seq} tokens, {args.steps} timed steps after one warm-up")
    rows = []
    out, rss = run([sys.executable, "-c", TORCH, hf, data, str(args.steps), str(args.batch), str(args.threads)])
    torch_s = json.loads(out.splitlines()[-1])["step_s"]
    torch_tps = tokens * len(torch_s) / sum(torch_s)
    rows.append(("PyTorch + PEFT (f32 weights)", torch_tps, rss))
    for name, model, extra in [("fusion (f32 weights)", hf, []),
                               ("fusion (f32 weights, activations kept)", hf, ["--memory", "keep"]),
                               ("fusion (Q4_1 GGUF)", gguf_path, []),
                               ("fusion (Q4_1 GGUF, 2 spans)", gguf_path, ["--spans", "2"])]:
        secs, rss = fusion(args.build, model, data, args, extra)
        rows.append((name, tokens * len(secs) / sum(secs), rss))
    half = ["--max-tokens", str(args.batch * args.seq // 4)]  # 4 micro-batches per step
    for name, extra in [("fusion (Q4_1, 2 shard processes)", half),
                        ("fusion (Q4_1, 2 shard processes, pipeline 2)", half + ["--pipeline", "2"])]:
        secs, rss = chain(args.build, gguf_path, data, args, extra)
        rows.append((name, tokens * len(secs) / sum(secs), rss))
    print(f"{'':42s} {'tokens/s':>9s} {'vs torch':>9s} {'peak RSS MiB':>13s}")
    for name, tps, rss in rows:
        print(f"{name:42s} {tps:9.1f} {tps / torch_tps:8.2f}x {rss:13.0f}")


if __name__ == "__main__":
    main()
