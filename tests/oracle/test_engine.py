"""The engine against Hugging Face transformers (PyTorch) on random-weight
checkpoints in the real HF layout: logits, greedy continuations, incremental
decode vs full recomputation, for llama / mistral / qwen2 / qwen3, f32 / bf16 /
f16, grouped-query heads, tied embeddings, llama3 and linear rope scaling,
head_dim != hidden / heads, sharded safetensors."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fusion_oracle import read_logits, run_generate
from qwen3_reference import Qwen3Reference

torch.manual_seed(0)

N_GEN = 32
PROMPT = [1, 17, 93, 5, 250, 61, 8, 199, 42, 7, 300, 11]

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, initializer_range=0.25)

CASES = {
    # name: (architecture, dtype, config overrides, save options)
    "llama_f32_gqa": ("llama", torch.float32, {}, {}),
    "llama_bf16_tied_llama3rope": ("llama", torch.bfloat16, dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), {}),
    "llama_f16_headdim_sharded": ("llama", torch.float16, dict(head_dim=32, num_key_value_heads=1),
                                  dict(max_shard_size="60KB")),
    "llama_f32_linear_rope_mha": ("llama", torch.float32, dict(
        num_key_value_heads=4, rope_scaling={"type": "linear", "factor": 4.0}), {}),
    "mistral_bf16": ("mistral", torch.bfloat16, dict(sliding_window=None), {}),
    "qwen2_f32_bias": ("qwen2", torch.float32, dict(tie_word_embeddings=True), {}),
    "qwen2_bf16": ("qwen2", torch.bfloat16, {}, {}),
    "qwen3_f32": ("qwen3", torch.float32, dict(head_dim=24), {}),
    "qwen3_bf16_tied": ("qwen3", torch.bfloat16, dict(tie_word_embeddings=True), {}),
}

# logits tolerance relative to the logits' spread: the engine computes in f32
# with the same (rounded) weights as the reference, so differences are
# accumulation-order rounding only.
TOL = 2e-3


def build_hf(arch, dtype, overrides, save_opts, path):
    import transformers
    cfg_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM}[arch]
    kw = dict(BASE)
    kw.update(overrides)
    kw.setdefault("tie_word_embeddings", False)
    cfg = cfg_cls(**kw)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # norms away from 1 so they matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    model = model.to(dtype)
    model.save_pretrained(path, safe_serialization=True, **save_opts)
    # the reference runs in f32 on exactly the rounded weights
    ref = model_cls.from_pretrained(path, torch_dtype=torch.float32).eval()
    return ref


def build_qwen3(dtype, overrides, path):
    kw = dict(BASE)
    kw.update(overrides)
    ref = Qwen3Reference(kw, seed=1)
    ref.round_to(dtype)
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in ref.state_dict_hf().items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
           "torch_dtype": str(dtype).replace("torch.", ""), **{k: v for k, v in kw.items()
                                                              if k != "initializer_range"}}
    cfg.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    cfg.setdefault("tie_word_embeddings", False)
    cfg.setdefault("rope_theta", 1000000.0)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return ref


def reference_logits(ref, ids):
    with torch.no_grad():
        x = torch.tensor([ids])
        out = ref(x)
        return (out.logits if hasattr(out, "logits") else out)[0].float().numpy()


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, dtype, overrides, save_opts = CASES[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    if arch == "qwen3":
        ref = build_qwen3(dtype, overrides, path)
    else:
        ref = build_hf(arch, dtype, overrides, save_opts, path)
    vocab = BASE["vocab_size"]
    return request.param, path, ref, vocab


def check_close(ours, theirs, what):
    spread = float(np.abs(theirs).max())
    err = float(np.abs(ours - theirs).max())
    assert err <= TOL * max(spread, 1.0), f"{what}: max |diff| {err:.3g} vs spread {spread:.3g}"


def test_logits_and_greedy(case, tmp_path):
    name, path, ref, vocab = case
    lp = str(tmp_path / "logits.bin")
    res = run_generate(path, PROMPT, N_GEN, lp)
    gen = res["tokens"]
    assert len(gen) == N_GEN
    ours = read_logits(lp, vocab)
    assert ours.shape[0] == len(PROMPT) + N_GEN - 1
    # teacher-forced: the reference sees the same sequence
    seq = PROMPT + gen
    theirs = reference_logits(ref, seq[:-1])
    check_close(ours, theirs, name)
    # greedy: every choice is the reference's argmax; a disagreement is only
    # acceptable on a genuine near-tie
    for i, tok in enumerate(gen):
        row = theirs[len(PROMPT) - 1 + i]
        best = int(np.argmax(row))
        if tok != best:
            assert row[best] - row[tok] < 1e-4 * max(1.0, abs(row[best])), \
                f"{name}: step {i} chose {tok}, reference {best}"
    # and the reference's own greedy continuation (no teacher forcing) matches
    with torch.no_grad():
        ids = list(PROMPT)
        for _ in range(N_GEN):
            ids.append(int(np.argmax(reference_logits(ref, ids)[-1])))
    assert ids[len(PROMPT):] == gen, f"{name}: greedy continuation differs"


def test_incremental_equals_recompute(case, tmp_path):
    name, path, ref, vocab = case
    a, b = str(tmp_path / "inc.bin"), str(tmp_path / "full.bin")
    ra = run_generate(path, PROMPT, 12, a)
    rb = run_generate(path, PROMPT, 12, b, ["--recompute"])
    assert ra["tokens"] == rb["tokens"]
    la, lb = read_logits(a, vocab), read_logits(b, vocab)
    assert np.abs(la - lb).max() <= 1e-4 * max(1.0, np.abs(lb).max())


def test_f16_kv_cache_and_small_batches(case, tmp_path):
    name, path, ref, vocab = case
    lp = str(tmp_path / "kv16.bin")
    res = run_generate(path, PROMPT, 8, lp, ["--kv", "f16", "--batch", "5"])
    ours = read_logits(lp, vocab)
    theirs = reference_logits(ref, (PROMPT + res["tokens"])[:-1])
    spread = float(np.abs(theirs).max())
    assert float(np.abs(ours - theirs).max()) <= 1e-2 * max(spread, 1.0)
