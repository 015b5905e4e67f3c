"""Chains of 1, 2 and 3 fusion-shard processes on loopback compute what the
single-process engine computes: f32 on the wire exactly, bf16 / int8 within
tolerance; with and without server-to-server forwarding; several sessions at
once; TLS; refusals (wrong secret, cache full, over-long sessions); SIGTERM drains."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from shard_cluster import SECRET, Shard, make_tls, program, run_chain

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "oracle"))
from fusion_oracle import read_logits, run_generate  # noqa: E402

VOCAB = 256
PROMPT = [5, 77, 3, 190, 42, 8, 16, 250, 99, 1, 64]
N_GEN = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import transformers
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, initializer_range=0.25,
                                   tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("chain-model"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """Single-process logits for the prompt rotated by i (fusion-chain's session i)."""
    out = {}
    d = tmp_path_factory.mktemp("ref")
    for i in range(4):
        prompt = [PROMPT[(k + i) % len(PROMPT)] for k in range(len(PROMPT))]
        lp = str(d / f"ref{i}.bin")
        res = run_generate(model, prompt, N_GEN, lp, ["--threads", "1"])
        out[i] = (res["tokens"], read_logits(lp, VOCAB))
    return out


SPLITS = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}


@pytest.fixture(scope="module", params=[1, 2, 3])
def cluster(request, model):
    shards = [Shard(model, a, b) for a, b in SPLITS[request.param]]
    yield shards
    for s in shards:
        assert s.stop() == 0, s.output()


def chain_logits(cluster, tmp_path, **kw):
    prefix = str(tmp_path / "chain")
    res = run_chain(cluster, PROMPT, N_GEN, logits=prefix, **kw)
    sessions = json.loads(res.stdout)["sessions"]
    return [(s["tokens"], read_logits(f"{prefix}.{i}.bin", VOCAB)) for i, s in enumerate(sessions)], sessions


@pytest.mark.parametrize("forward", [False, True])
def test_f32_wire_is_exact(cluster, reference, tmp_path, forward):
    (tokens, logits), = chain_logits(cluster, tmp_path, wire="f32", forward=forward)[0]
    ref_tokens, ref_logits = reference[0]
    assert tokens == ref_tokens
    assert logits.shape == ref_logits.shape
    assert np.array_equal(logits, ref_logits)


@pytest.mark.parametrize("wire,tol", [("bf16", 0.02), ("int8", 0.05)])
def test_compressed_wire_within_tolerance(cluster, reference, tmp_path, wire, tol):
    (tokens, logits), = chain_logits(cluster, tmp_path, wire=wire, forward=len(cluster) > 1)[0]
    ref_tokens, ref_logits = reference[0]
    # compare up to the first differing token (after it the sequences differ)
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
    rows = len(PROMPT) + first_diff
    spread = np.abs(ref_logits).max()
    assert np.abs(logits[:rows] - ref_logits[:rows]).max() < tol * spread
    if len(cluster) == 1:
        assert tokens == ref_tokens  # nothing crosses the wire
    elif first_diff < len(tokens):
        # rounding on the wire may only flip a near-tie
        row = ref_logits[len(PROMPT) - 1 + first_diff]
        margin = row[ref_tokens[first_diff]] - row[tokens[first_diff]]
        assert margin < 2 * tol * spread, f"{wire}: step {first_diff} lost a margin of {margin:.3f}"


def test_concurrent_sessions(cluster, reference, tmp_path):
    results, sessions = chain_logits(cluster, tmp_path, wire="f32", sessions=4, forward=len(cluster) > 1)
    for i, (tokens, logits) in enumerate(results):
        ref_tokens, ref_logits = reference[i]
        assert tokens == ref_tokens, f"session {i}"
        # batched with other sessions: same math, possibly another summation order
        assert np.abs(logits - ref_logits).max() <= 1e-4 * np.abs(ref_logits).max()
    assert all(len(s["hops"]) == len(cluster) for s in sessions)


def test_wrong_secret_is_refused(cluster):
    res = run_chain(cluster, PROMPT, 2, secret="not-the-swarm-secret", check=False)
    assert res.returncode != 0
    assert "unauthenticated" in res.stderr


def test_session_longer_than_context_is_refused(cluster):
    res = run_chain(cluster, PROMPT, 200, check=False)  # 11 + 200 > 128
    assert res.returncode != 0
    assert "max_length" in res.stderr


def test_cache_full_is_refused(model):
    # 4 layers x 2 x 32 floats x 4 bytes = 1 KiB per position; 1 MiB holds 1024 positions
    s = Shard(model, 0, 4, extra=["--kv-budget-mib", "1", "--kv", "f32"])
    try:
        ok = run_chain([s], PROMPT, 4, sessions=2)
        assert all(x["ok"] for x in json.loads(ok.stdout)["sessions"])
        # 12 sessions x 15 positions fit in 1024 positions; 12 x 111 do not
        res = run_chain([s], PROMPT, 4, sessions=12, check=False)
        assert res.returncode == 0
        big = subprocess.run([program("chain"), "--secret", SECRET, "--insecure", "--hop", s.hop(),
                              "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "100",
                              "--sessions", "12"], capture_output=True, text=True, timeout=120)
        assert big.returncode != 0
        assert "resource exhausted" in big.stderr and "KV cache full" in big.stderr
    finally:
        assert s.stop() == 0


def test_tls_chain(model, reference, tmp_path):
    tls = make_tls(str(tmp_path))
    shards = [Shard(model, 0, 2, tls=tls), Shard(model, 2, 4, tls=tls)]
    try:
        prefix = str(tmp_path / "tls")
        res = run_chain(shards, PROMPT, N_GEN, wire="f32", forward=True, tls=tls, logits=prefix)
        tokens = json.loads(res.stdout)["sessions"][0]["tokens"]
        assert tokens == reference[0][0]
        # a plaintext client cannot talk to a TLS server
        bad = subprocess.run([program("chain"), "--secret", SECRET, "--insecure", "--hop", shards[0].hop(),
                              "--hop", shards[1].hop(), "--prompt-ids", "1,2"], capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode != 0 and "unavailable" in bad.stderr
    finally:
        for s in shards:
            assert s.stop() == 0


def test_sigterm_drains_open_sessions(model):
    s = Shard(model, 0, 4, extra=["--drain-ms", "20000"])
    chain = subprocess.Popen([program("chain"), "--secret", SECRET, "--insecure", "--hop", s.hop(),
                              "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "100",
                              "--sessions", "2", "--json"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    s.proc.send_signal(signal.SIGTERM)
    out, _ = chain.communicate(timeout=120)
    assert s.proc.wait(60) == 0
    # sessions running at SIGTERM finish their generation
    assert chain.returncode == 0, s.output()
    assert all(len(x["tokens"]) == 100 for x in json.loads(out)["sessions"])
