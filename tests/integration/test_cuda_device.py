"""--device for fusion-generate, fusion-shard and fusion-bench-generate. Everywhere: a device
name that is not cpu / cuda / cuda:N, or a GPU that cannot be used, is refused with a message
and a failing exit status before anything is served. On a machine with a usable GPU (the tests
skip without one): the default model (SmolLM2's GGUF) on the GPU gives the CPU's greedy tokens
and logits within 1% of their largest magnitude, alone and as the first hop of a chain whose
second hop runs on the CPU."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from shard_cluster import SECRET, Shard, default_model, program, run_chain

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "oracle"))
from fusion_oracle import read_logits, run_generate  # noqa: E402

PROMPT = [1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
N_GEN = 24
VOCAB = 49152
LOGIT_TOL = 0.01  # of the largest |logit| per position: f16 operands in cuBLAS prefill


@pytest.fixture(scope="module")
def model():
    return default_model()


@pytest.fixture(scope="module")
def gpu(model):
    """Skips the test unless `--device cuda` works here."""
    res = subprocess.run([program("generate"), "--model", model, "--prompt-ids", "1,2", "--max-tokens", "1",
                          "--device", "cuda", "--json"], capture_output=True, text=True, timeout=300)
    if res.returncode:
        pytest.skip("no usable GPU: " + res.stderr.strip().splitlines()[-1])


def test_unknown_or_missing_device_refused(model, tmp_path):
    port_file = str(tmp_path / "port")
    for device, message in (("tpu", "unknown device 'tpu'"), ("cuda:x", "unknown device 'cuda:x'"),
                            ("cuda:1000", "")):
        res = subprocess.run([program("shard"), "--model", model, "--blocks", "0:2", "--listen", "127.0.0.1:0",
                              "--insecure", "--secret", SECRET, "--port-file", port_file, "--device", device],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode != 0, res.stderr
        assert not os.path.exists(port_file), "the shard started serving"
        assert "fusion-shard:" in res.stderr and message in res.stderr, res.stderr
        res = subprocess.run([program("generate"), "--model", model, "--prompt-ids", "1,2", "--max-tokens", "1",
                              "--device", device], capture_output=True, text=True, timeout=120)
        assert res.returncode != 0 and message in res.stderr, res.stderr
    res = subprocess.run([program("bench-generate"), "--random", "smollm2-135m", "--device", "tpu"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "unknown device 'tpu'" in res.stderr, res.stderr


def close_logits(got, want):
    n = min(len(got), len(want))
    scale = np.abs(want[:n]).max(axis=1, keepdims=True)
    return float((np.abs(got[:n] - want[:n]) / scale).max())


@pytest.fixture(scope="module")
def cpu_reference(model, tmp_path_factory):
    lp = str(tmp_path_factory.mktemp("cpu") / "logits.bin")
    res = run_generate(model, PROMPT, N_GEN, lp, ["--threads", "2", "--ignore-eos"])
    return res["tokens"], read_logits(lp, VOCAB)


def test_generate_on_gpu_matches_cpu(gpu, model, cpu_reference, tmp_path):
    lp = str(tmp_path / "logits.bin")
    res = run_generate(model, PROMPT, N_GEN, lp, ["--device", "cuda", "--ignore-eos"])
    assert res["device"].startswith("cuda:0 (")
    tokens, logits = cpu_reference
    assert res["tokens"] == tokens
    got = read_logits(lp, VOCAB)
    assert got.shape == logits.shape
    assert close_logits(got, logits) < LOGIT_TOL


def test_chain_with_a_gpu_hop(gpu, model, cpu_reference, tmp_path):
    shards = [Shard(model, 0, 15, extra=["--device", "cuda"]), Shard(model, 15, 30, threads=2)]
    try:
        prefix = str(tmp_path / "chain")
        res = run_chain(shards, PROMPT, N_GEN, wire="f32", logits=prefix)
        session = json.loads(res.stdout)["sessions"][0]
        tokens, logits = cpu_reference
        assert session["tokens"] == tokens
        assert close_logits(read_logits(prefix + ".0.bin", VOCAB), logits) < LOGIT_TOL
        assert "on cuda:0 (" in shards[0].output(), shards[0].output()
    finally:
        for s in shards:
            assert s.stop() == 0, s.output()
