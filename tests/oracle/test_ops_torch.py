"""test_ops_torch.py -- CPU backend ops (via fusion-opcheck) against PyTorch / Hugging Face formulas.

Each op runs on every ISA path this CPU has, with 2 threads, and is compared
with torch in float64 (tolerances next to each check).
"""
import os
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

BUILD = os.environ.get("FUSION_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
TOOL = os.path.join(BUILD, "fusion-opcheck")


def have_isa(isa):
    r = subprocess.run([TOOL, "--isa", isa, "softmax", "1", "1"], input=np.zeros(1, np.float32).tobytes(),
                       capture_output=True)
    return r.returncode == 0 and f"on {isa} " in r.stderr.decode()


ISAS = [i for i in ("portable", "avx2", "avx512") if os.path.exists(TOOL) and have_isa(i)]


def run(isa, args, *arrays, n_out, opts=()):
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    r = subprocess.run([TOOL, "--isa", isa, "--threads", "2", *opts, *map(str, args)], input=data,
                       capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    out = np.frombuffer(r.stdout, dtype=np.float32)
    assert out.size == n_out, (out.size, n_out)
    return out


rng = np.random.default_rng(1234)


def randn(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def test_tool_exists():
    assert os.path.exists(TOOL), f"build fusion-opcheck first ({TOOL})"
    assert "portable" in ISAS


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("t", [1, 3, 7, 16, 31, 37])
def test_matmul_vs_torch_linear(isa, wtype, t):
    n, k = 70, 224
    w = torch.from_numpy(randn(n, k))
    if wtype == "f16":
        w = w.half()
        raw = w.numpy().view(np.uint16)
    elif wtype == "bf16":
        w = w.bfloat16()
        raw = w.view(torch.int16).numpy()
    else:
        raw = w.numpy()
    x = randn(t, k)
    y = run(isa, ["matmul", wtype, t, n, k], raw, x, n_out=t * n).reshape(t, n)
    ref = F.linear(torch.from_numpy(x).double(), w.double()).numpy()
    mag = (np.abs(x).astype(np.float64) @ np.abs(w.double().numpy()).T)
    assert np.all(np.abs(y - ref) <= 1e-5 * mag + 1e-6)  # f32 accumulation


def quantize_rows(w, wtype):
    """GGUF blocks of w (n, k) via the gguf package, and their dequantized values."""
    import gguf
    from gguf import quants

    qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
          "q4_1": gguf.GGMLQuantizationType.Q4_1}[wtype]
    raw = quants.quantize(w, qt)
    return raw, quants.dequantize(raw, qt).astype(np.float64)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wtype", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("t", [1, 2, 5, 8, 9, 16, 31, 37])
def test_quantized_matmul_vs_gguf_dequantize(isa, wtype, t):
    # decode (matvec), batched decode (16-token GEMM blocks) and prefill all compute in f32 over the weights as
    # gguf dequantizes them: same tolerance as the plain types, at a long K
    n, k = 45, 2048
    raw, wd = quantize_rows(randn(n, k), wtype)
    x = randn(t, k) + 0.5
    y = run(isa, ["matmul", wtype, t, n, k], raw, x, n_out=t * n).reshape(t, n)
    ref = x.astype(np.float64) @ wd.T
    mag = np.abs(x).astype(np.float64) @ np.abs(wd).T
    assert np.all(np.abs(y - ref) <= 1e-5 * mag + 1e-6), np.max(np.abs(y - ref) / (1e-5 * mag + 1e-6))


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "portable"])
@pytest.mark.parametrize("wtype", ["q8_0", "q4_0", "q4_1"])
def test_int8_activation_opt_in_is_not_exact(isa, wtype):
    # the opt-in llama.cpp-style path (x rounded to int8 per block of 32) misses
    # the tolerance above at T <= 8, which the exact default meets
    n, k, t = 45, 2048, 3
    raw, wd = quantize_rows(randn(n, k), wtype)
    x = randn(t, k) + 0.5
    y = run(isa, ["matmul", wtype, t, n, k], raw, x, n_out=t * n, opts=["--int8-x"]).reshape(t, n)
    ref = x.astype(np.float64) @ wd.T
    mag = np.abs(x).astype(np.float64) @ np.abs(wd).T
    assert np.max(np.abs(y - ref) / (1e-5 * mag + 1e-6)) > 2
    assert np.all(np.abs(y - ref) <= 2e-2 * mag)  # but close: ~1/254 of |x| per element


@pytest.mark.parametrize("isa", ISAS)
def test_rmsnorm_vs_hf_formula(isa):
    r, d, eps = 5, 2048, 1e-5
    x, w = randn(r, d, scale=3), randn(d)
    y = run(isa, ["rmsnorm", r, d, eps], x, w, n_out=r * d).reshape(r, d)
    xt = torch.from_numpy(x).double()
    # LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight
    ref = (xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + eps) * torch.from_numpy(w).double()).numpy()
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=1e-6)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", ["neox", "norm"])
@pytest.mark.parametrize("rot", [64, 32])
def test_rope_vs_hf_rotate_half(isa, mode, rot):
    t, h, hd, theta = 6, 4, 64, 500000.0
    x = randn(t, h, hd)
    pos = np.array([0, 1, 5, 77, 1000, 8191], dtype=np.int32)
    # Hugging Face: inv_freq and the angles in float32
    inv = (1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))).float()
    y = run(isa, ["rope", mode, t, h, hd, rot], x, pos, inv.numpy(), n_out=t * h * hd).reshape(t, h, hd)
    freqs = torch.from_numpy(pos).float()[:, None] * inv[None, :]  # (t, rot/2), f32 like HF
    emb = torch.cat((freqs, freqs), dim=-1).double()
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    xt = torch.from_numpy(x).double()
    xr = xt[..., :rot]
    if mode == "norm":  # pairs (2i, 2i+1): de-interleave, rotate as HF, interleave back
        xr = torch.cat((xr[..., 0::2], xr[..., 1::2]), dim=-1)
    out = xr * cos + rotate_half(xr) * sin
    if mode == "norm":
        out = torch.stack((out[..., : rot // 2], out[..., rot // 2:]), dim=-1).reshape(t, h, rot)
    ref = torch.cat((out, xt[..., rot:]), dim=-1).numpy()
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ctype", ["f32", "f16"])
@pytest.mark.parametrize("h,kvh", [(4, 4), (8, 2), (8, 1)])
def test_attention_vs_torch_causal(isa, ctype, h, kvh):
    t, hd = 90, 64
    q, k, v = randn(t, h, hd), randn(t, kvh, hd), randn(t, kvh, hd)
    y = run(isa, ["attention", ctype, t, h, kvh, hd], q, k, v, n_out=t * h * hd).reshape(t, h, hd)
    kt, vt = torch.from_numpy(k), torch.from_numpy(v)
    if ctype == "f16":  # the cache holds f16
        kt, vt = kt.half().float(), vt.half().float()
    qd = torch.from_numpy(q).double().transpose(0, 1)  # (h, t, hd)
    kd = kt.double().transpose(0, 1).repeat_interleave(h // kvh, dim=0)
    vd = vt.double().transpose(0, 1).repeat_interleave(h // kvh, dim=0)
    scores = qd @ kd.transpose(1, 2) / np.sqrt(hd)
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    ref = (torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ vd).transpose(0, 1).numpy()
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_softmax_log_softmax_swiglu(isa):
    r, n = 3, 5000
    x = randn(r, n, scale=8)
    sm = run(isa, ["softmax", r, n], x, n_out=r * n).reshape(r, n)
    ls = run(isa, ["log_softmax", r, n], x, n_out=r * n).reshape(r, n)
    xt = torch.from_numpy(x).double()
    np.testing.assert_allclose(sm, torch.softmax(xt, -1).numpy(), rtol=1e-5, atol=1e-10)
    np.testing.assert_allclose(ls, torch.log_softmax(xt, -1).numpy(), rtol=1e-5, atol=1e-5)
    g, u = randn(r, n, scale=4), randn(r, n)
    sw = run(isa, ["swiglu", r, n], g, u, n_out=r * n).reshape(r, n)
    ref = (F.silu(torch.from_numpy(g).double()) * torch.from_numpy(u).double()).numpy()
    np.testing.assert_allclose(sw, ref, rtol=2e-6, atol=1e-7)
