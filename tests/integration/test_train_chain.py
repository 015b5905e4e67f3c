"""Fine-tuning through a chain of fusion-shard processes (service fusion.Train): fusion-train
--hop drives each server's span, and with the f32 wire the adapter it writes equals the one
a single process trains (bf16 wire: the same losses within bf16's rounding). A server
SIGKILLed mid-run is replaced by a --spare of its span from the last snapshot, the step runs
again, and the finished adapter still equals the undisturbed one. Micro-batches pipelined over
three servers give the adapter of a sequential run. Refusals: a span the server does not hold,
a rank over the server's limit, a wrong secret. The adapter written is then served:
fusion-shard --lora NAME=DIR loads its span's blocks at start-up."""
import json
import os
import signal
import subprocess
import threading

import numpy as np
import pytest

from shard_cluster import SECRET, Shard, program

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402

CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
STEPS = 6
TRAIN = ["--r", "4", "--alpha", "8", "--targets", "all-linear", "--init-seed", "3", "--lr", "5e-3",
         "--batch-size", "3", "--max-tokens", "64", "--steps", str(STEPS), "--warmup", "1", "--clip", "1",
         "--weight-decay", "0.01"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    base = tmp_path_factory.mktemp("train-chain")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).save_pretrained(base / "model",
                                                                                  safe_serialization=True)
    rng = np.random.default_rng(1)
    with open(base / "data.jsonl", "w") as f:
        for i in range(6):
            ids = rng.integers(0, CFG["vocab_size"], size=5 + 2 * i).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100, -100] + ids[2:]}) + "\n")
    return str(base / "model"), str(base / "data.jsonl")


def train(args, timeout=300, check=True):
    res = subprocess.run([program("train"), *args], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "FUSION_SECRET": SECRET})
    if check:
        assert res.returncode == 0, f"fusion-train failed:\n{res.stderr}"
    return res


def steps_of(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def adapter(path):
    return load_file(os.path.join(path, "adapter_model.safetensors"))


def assert_same_adapter(a, b, rtol):
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=rtol * np.abs(b[name]).max(), err_msg=name)


@pytest.fixture(scope="module")
def local_run(model, tmp_path_factory):
    path, data = model
    out = str(tmp_path_factory.mktemp("local") / "adapter")
    res = train(["--model", path, "--data", data, "--spans", "2", "--threads", "1", "--out", out, *TRAIN])
    return steps_of(res.stdout), adapter(out), out


@pytest.fixture
def shards(model):
    path, _ = model
    started = []

    def start(first, last, *extra):
        s = Shard(path, first, last, extra=extra)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def test_chain_equals_one_process_f32_wire(model, local_run, shards, tmp_path):
    path, data = model
    a, b = shards(0, 1), shards(1, 3)
    out = str(tmp_path / "adapter")
    res = train(["--model", path, "--data", data, "--hop", a.hop(), "--hop", b.hop(), "--insecure", "--wire", "f32",
                 "--out", out, *TRAIN])
    got, (ref_steps, ref, _) = steps_of(res.stdout), local_run
    assert [g["step"] for g in got] == list(range(1, STEPS + 1))
    for g, r in zip(got, ref_steps):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
    assert got[-1]["loss"] < got[0]["loss"]
    assert_same_adapter(adapter(out), ref, 1e-5)


def test_pipelined_chain_equals_sequential(model, shards, tmp_path):
    """Micro-batches of at most 16 rows, up to 3 in flight over 3 servers, against one process running
    them one at a time."""
    path, data = model
    small = [a if a != "64" else "16" for a in TRAIN]
    ref = str(tmp_path / "ref")
    train(["--model", path, "--data", data, "--spans", "3", "--threads", "1", "--out", ref, *small])
    hops = [shards(0, 1), shards(1, 2), shards(2, 3)]
    out = str(tmp_path / "adapter")
    res = train(["--model", path, "--data", data, *sum((["--hop", h.hop()] for h in hops), []), "--insecure",
                 "--wire", "f32", "--pipeline", "3", "--out", out, *small])
    assert all(g["micro_batches"] >= 2 for g in steps_of(res.stdout))
    assert_same_adapter(adapter(out), adapter(ref), 1e-5)


def test_bf16_wire_tracks_f32(model, local_run, shards, tmp_path):
    path, data = model
    a, b = shards(0, 2), shards(2, 3)
    res = train(["--model", path, "--data", data, "--hop", a.hop(), "--hop", b.hop(), "--insecure", *TRAIN])
    for g, r in zip(steps_of(res.stdout), local_run[0]):
        assert g["loss"] == pytest.approx(r["loss"], rel=2e-2)


def test_sigkill_mid_run_spare_takes_over(model, local_run, shards, tmp_path):
    path, data = model
    a, b, spare = shards(0, 1), shards(1, 3), shards(1, 3)
    out = str(tmp_path / "adapter")
    cmd = [program("train"), "--model", path, "--data", data, "--hop", a.hop(), "--hop", b.hop(), "--spare",
           spare.hop(), "--insecure", "--wire", "f32", "--out", out, *TRAIN]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "FUSION_SECRET": SECRET})
    errs = []
    drain = threading.Thread(target=lambda: errs.append(proc.stderr.read()))
    drain.start()
    lines = []
    for line in proc.stdout:  # kill the second hop once two steps are done
        lines.append(line)
        if len(steps_of("".join(lines))) == 2:
            b.stop(signal.SIGKILL)
            break
    # the rest through the same buffered reader: lines it already read ahead are not lost
    rest = proc.stdout.read()
    proc.wait(timeout=300)
    drain.join(timeout=60)
    err = "".join(errs)
    assert proc.returncode == 0, err
    got = steps_of("".join(lines) + rest)
    assert [g["step"] for g in got] == list(range(1, STEPS + 1))
    assert "takes over" in err
    assert_same_adapter(adapter(out), local_run[1], 1e-5)


def test_refusals(model, shards, tmp_path):
    path, data = model
    a, b = shards(0, 1, "--max-lora-rank", "8"), shards(1, 3)
    res = train(["--model", path, "--data", data, "--hop", f"{a.address}:0:2", "--hop", f"{b.address}:2:3",
                 "--insecure", *TRAIN], check=False)
    assert res.returncode != 0 and "holds [0, 1)" in res.stderr
    res = train(["--model", path, "--data", data, "--hop", a.hop(), "--hop", b.hop(), "--insecure",
                 *TRAIN, "--r", "16"], check=False)
    assert res.returncode != 0 and "lora.r: 16 outside [1, 8]" in res.stderr
    res = train(["--model", path, "--data", data, "--hop", a.hop(), "--hop", b.hop(), "--insecure",
                 "--secret", "a-wrong-secret-of-some-length", *TRAIN], check=False)
    assert res.returncode != 0 and "unauthenticated" in res.stderr.lower()
    assert a.proc.poll() is None and b.proc.poll() is None  # refusals retire nobody


def test_trained_adapter_served_with_lora(local_run, shards, tmp_path):
    s = shards(1, 3, "--lora", f"tuned={local_run[2]}")
    assert "adapter 'tuned' loaded: rank 4, blocks [1, 3)" in s.output()
    with pytest.raises(RuntimeError, match="--lora missing"):
        shards(0, 1, "--lora", f"missing={tmp_path}")
    with pytest.raises(RuntimeError, match="NAME=DIR"):
        shards(0, 1, "--lora", "no-directory")
