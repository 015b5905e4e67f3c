"""The real model learns: SmolLM2-135M-Instruct (the default Q4_1 GGUF) is fine-tuned with LoRA
over a chain of two fusion-shard processes on the CPU (blocks 0:15 and 15:30, service
fusion.Train) on 20 questions and answers about a made-up town (tests/data/vellmora-facts.jsonl,
OpenAI's chat format: the loss on the assistant messages). The mean loss of the last epoch
falls below LOSS_BOUND, and served with the adapter the model answers the questions
greedily with the facts it was taught, which the base model does not know."""
import json
import os
import subprocess


from shard_cluster import SECRET, SOURCE, Shard, default_model, program

FACTS = os.path.join(SOURCE, "tests", "data", "vellmora-facts.jsonl")
LOSS_BOUND = 0.05  # nats per answer token, the last epoch's mean
EPOCHS = 8
# a word of each answer that only the facts give (the base model cannot guess it)
KEYS = ["Quillon", "Marrowind", "1623", "Brasswick", "lanterns", "Crane", "Lantern Tide", "Kestrava",
        "Saltmere", "plum", "48,000", "Orrin", "Rowing", "Herald", "copper", "heron", "Tallow", "Kestrava",
        "Greywater", "hurdy"]


def questions():
    with open(FACTS) as f:
        return [json.loads(line)["messages"][0]["content"] for line in f]


def answer(model, question, adapter=None):
    cmd = [program("generate"), "--model", model, "--chat", question, "--max-tokens", "24", "--json",
           "--threads", "2"]
    if adapter:
        cmd += ["--lora", adapter]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["text"]


def test_smollm2_learns_facts_over_two_shards(tmp_path):
    model = default_model()
    a, b = Shard(model, 0, 15, threads=2), Shard(model, 15, 30, threads=2)
    try:
        out = str(tmp_path / "adapter")
        res = subprocess.run(
            [program("train"), "--model", model, "--data", FACTS, "--hop", a.hop(), "--hop", b.hop(), "--insecure",
             "--r", "16", "--alpha", "32", "--targets", "all-linear", "--lr", "2e-3", "--warmup", "4",
             "--schedule", "cosine", "--batch-size", "5", "--epochs", str(EPOCHS), "--max-tokens", "512",
             "--out", out],
            capture_output=True, text=True, timeout=1800, env={**os.environ, "FUSION_SECRET": SECRET})
        assert res.returncode == 0, res.stderr
    finally:
        a.stop()
        b.stop()
    steps = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    per_epoch = len(steps) // EPOCHS
    last = steps[-per_epoch:]
    mean = sum(s["loss"] * s["tokens"] for s in last) / sum(s["tokens"] for s in last)
    assert steps[0]["loss"] > 1.0, steps[0]
    assert mean < LOSS_BOUND, f"last epoch's loss {mean:.3f}; first step {steps[0]['loss']:.3f}"

    right = [k for q, k in zip(questions(), KEYS) if k.lower() in answer(model, q, out).lower()]
    base = [k for q, k in zip(questions()[:5], KEYS[:5]) if k.lower() in answer(model, q).lower()]
    assert len(right) >= 18, f"answered with the facts: {right}"
    assert not base, f"the base model knew {base}"
