"""LoRA training against PyTorch autograd with PyPI's peft and transformers: on tiny random
checkpoints (Llama with grouped-query attention, Qwen2 with q/k/v biases, Qwen3 with q/k
norms in a hand-written PyTorch LoRA (transformers 4.47 predates Qwen3), tied embeddings;
f32 and bf16 weights; Q8_0 and Q4_0 GGUF llama files, against the weights gguf dequantizes
and un-permutes), fusion-train --check gives the loss, the gradient of every span's input
hidden states and every LoRA gradient of PeftModel's backward, for chains of 1, 2 and 3
spans in one process; 20 AdamW steps with warm-up, decay and clipping track
torch.optim.AdamW step by step, and the adapter they write is PeftModel's."""
import json
import os
import subprocess

import numpy as np
import pytest
import torch

from fusion_oracle import program
from qwen3_reference import Qwen3Reference, rms_norm, rotate_half

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False)
ARCHS = {
    "llama-gqa": (transformers.LlamaForCausalLM, transformers.LlamaConfig, dict(head_dim=24)),
    "llama-tied": (transformers.LlamaForCausalLM, transformers.LlamaConfig,
                   dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2-bias": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, dict(rope_theta=1e6)),
}
# (input_ids, labels): -100 takes no loss, as Hugging Face's labels
EXAMPLES = [
    (list(range(3, 13)), [-100] * 4 + list(range(7, 13))),
    ([5, 9, 2, 77, 31, 8, 8, 60], None),
    ([90, 1, 44, 17, 3], [-100, -100, 44, 17, 3]),
    ([11, 12, 13, 14, 15, 16, 17], None),
    ([40, 41, 42, 43], [-100, 41, 42, 43]),
    ([7, 70, 7, 70, 7, 70], None),
]


def lora_model(model, tmp_path):
    """model with PEFT's LoRA on every linear layer, B made non-zero, saved to tmp_path/adapter."""
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn_like(p))
    adapter = str(tmp_path / "adapter")
    model.save_pretrained(adapter)
    return model, adapter


def write_data(tmp_path):
    data = str(tmp_path / "data.jsonl")
    with open(data, "w") as f:
        for ids, labels in EXAMPLES:
            f.write(json.dumps({"input_ids": ids, **({"labels": labels} if labels else {})}) + "\n")
    return data


def build(tmp_path, arch, dtype):
    cls, cfg_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    model = cls(cfg_cls(**{**BASE, **extra}))
    with torch.no_grad():  # norms away from 1 and biases away from 0, so that they matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    base = str(tmp_path / "base")
    model.to(dtype).save_pretrained(base, safe_serialization=True)
    model = cls.from_pretrained(base, torch_dtype=torch.float32)  # the rounded weights, in f32
    model, adapter = lora_model(model, tmp_path)
    return base, adapter, write_data(tmp_path), model


class Qwen3Lora(torch.nn.Module):
    """Qwen3Reference's weights with PEFT's LoRA (y = W x + scale B A x) on every linear
    layer, differentiable; parameters named as PEFT saves them."""

    def __init__(self, ref, r=4, alpha=8):
        super().__init__()
        self.ref, self.scale = ref, alpha / r
        torch.manual_seed(1)
        self.lora = {}
        for i, layer in enumerate(ref.layers):
            for t in TARGETS:
                parent = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                out_f, in_f = layer[f"{parent}.{t}.weight"].shape
                pre = f"base_model.model.model.layers.{i}.{parent}.{t}"
                self.lora[f"{pre}.lora_A.weight"] = (torch.rand(r, in_f) * 2 - 1) / in_f ** 0.5
                self.lora[f"{pre}.lora_B.weight"] = 0.05 * torch.randn(out_f, r)
        for v in self.lora.values():
            v.requires_grad_(True)

    def save(self, path):
        from safetensors.torch import save_file
        os.makedirs(path, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.lora.items()},
                  os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none",
                       "target_modules": TARGETS, "task_type": "CAUSAL_LM"}, f)

    def lin(self, x, i, parent, t):
        pre = f"base_model.model.model.layers.{i}.{parent}.{t}"
        w = self.ref.layers[i][f"{parent}.{t}.weight"]
        a, b = self.lora[f"{pre}.lora_A.weight"], self.lora[f"{pre}.lora_B.weight"]
        return x @ w.T + self.scale * (x @ a.T) @ b.T

    def forward(self, ids, keep):
        ref, T = self.ref, len(ids)
        x = ref.embed.detach()[torch.tensor(ids)]
        inv_freq = 1.0 / (ref.theta ** (torch.arange(0, ref.hd, 2, dtype=torch.int64).float() / ref.hd))
        emb = torch.outer(torch.arange(T).float(), inv_freq).repeat(1, 2)
        cos, sin = emb.cos(), emb.sin()
        mask = torch.full((T, T), float("-inf")).triu(1)
        rep = ref.H // ref.KVH
        for i, layer in enumerate(ref.layers):
            keep(i, x)
            h = rms_norm(x, layer["input_layernorm.weight"].detach(), ref.eps)
            q = self.lin(h, i, "self_attn", "q_proj").view(T, ref.H, ref.hd)
            k = self.lin(h, i, "self_attn", "k_proj").view(T, ref.KVH, ref.hd)
            v = self.lin(h, i, "self_attn", "v_proj").view(T, ref.KVH, ref.hd).transpose(0, 1)
            q = rms_norm(q, layer["self_attn.q_norm.weight"].detach(), ref.eps).transpose(0, 1)
            k = rms_norm(k, layer["self_attn.k_norm.weight"].detach(), ref.eps).transpose(0, 1)
            q = q * cos + rotate_half(q) * sin
            k = (k * cos + rotate_half(k) * sin).repeat_interleave(rep, dim=0)
            v = v.repeat_interleave(rep, dim=0)
            att = torch.softmax((q @ k.transpose(1, 2)) / ref.hd ** 0.5 + mask, dim=-1)
            x = x + self.lin((att @ v).transpose(0, 1).reshape(T, -1), i, "self_attn", "o_proj")
            h = rms_norm(x, layer["post_attention_layernorm.weight"].detach(), ref.eps)
            g, u = self.lin(h, i, "mlp", "gate_proj"), self.lin(h, i, "mlp", "up_proj")
            x = x + self.lin(torch.nn.functional.silu(g) * u, i, "mlp", "down_proj")
        return rms_norm(x, ref.norm.detach(), ref.eps) @ ref.lm_head.detach().T


def qwen3_reference(model, batch):
    """reference() for Qwen3Lora."""
    hidden = {i: [] for i in range(BASE["num_hidden_layers"])}

    def keep(i, x):
        if x.requires_grad:
            x.retain_grad()
        hidden[i].append(x)

    total, count = 0.0, 0
    for ids, labels in batch:
        labels = torch.tensor(labels if labels else ids)
        logits = model(ids, keep)[:-1]
        total = total + torch.nn.functional.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum")
        count += int((labels[1:] != -100).sum())
    loss = total / count
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.lora.items()}
    inputs = {i: np.concatenate([h.grad.numpy() for h in hs]) for i, hs in hidden.items() if i}
    return loss.item(), inputs, grads


def build_qwen3(tmp_path, tied):
    cfg = {**BASE, "head_dim": 24, "tie_word_embeddings": tied}
    ref = Qwen3Reference(cfg, seed=1)
    base = str(tmp_path / "base")
    os.makedirs(base)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in ref.state_dict_hf().items()}, os.path.join(base, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(base, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                   "torch_dtype": "float32", "rope_theta": ref.theta, **cfg}, f)
    model = Qwen3Lora(ref)
    adapter = str(tmp_path / "adapter")
    model.save(adapter)
    return base, adapter, write_data(tmp_path), model


def permute(w, n_head):
    """convert_hf_to_gguf's Q/K row order for llama (pairs of each head interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w, n_head):
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def build_gguf(tmp_path, qtype):
    """A random llama written as GGUF with quantized matrices, and the HF model of the
    weights gguf dequantizes back (Q/K rows un-permuted)."""
    gguf = pytest.importorskip("gguf")
    cfg = transformers.LlamaConfig(**BASE)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    H, KVH, L = BASE["num_attention_heads"], BASE["num_key_value_heads"], BASE["num_hidden_layers"]
    w = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    for key, val in [("block_count", L), ("context_length", 64), ("embedding_length", 64),
                     ("feed_forward_length", 96), ("attention.head_count", H), ("attention.head_count_kv", KVH)]:
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
           "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(L):
        for hf, gg in per.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    qt = getattr(gguf.GGMLQuantizationType, qtype.upper())
    back = {}
    for hf, gg in names.items():
        t = sd[hf]
        if "q_proj" in hf:
            t = permute(t, H)
        elif "k_proj" in hf:
            t = permute(t, KVH)
        if t.ndim == 2:
            q = gguf.quants.quantize(t, qt)
            w.add_tensor(gg, q, raw_dtype=qt)
            t = gguf.quants.dequantize(q, qt)
        else:
            w.add_tensor(gg, t)
        if "q_proj" in hf:
            t = unpermute(t, H)
        elif "k_proj" in hf:
            t = unpermute(t, KVH)
        back[hf] = torch.from_numpy(np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.load_state_dict(back)
    model, adapter = lora_model(model, tmp_path)
    return str(tmp_path / "model.gguf"), adapter, write_data(tmp_path), model


def torch_loss(model, examples):
    """Mean cross-entropy over every target token of the batch (as fusion's step)."""
    total, count = 0.0, 0
    for ids, labels in examples:
        labels = torch.tensor(labels if labels else ids)
        logits = model(torch.tensor([ids])).logits[0, :-1]
        tgt = labels[1:]
        total = total + torch.nn.functional.cross_entropy(logits, tgt, ignore_index=-100, reduction="sum")
        count += int((tgt != -100).sum())
    return total / count


def fusion_train(*args):
    res = subprocess.run([program("train"), *args], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"fusion-train {' '.join(args)} failed:\n{res.stderr}"
    return res.stdout


def close(got, ref, name, tol=1e-4):
    scale = np.abs(ref).max()
    assert got.shape == ref.shape and scale > 0, name
    err = np.abs(got - ref).max()
    assert err <= tol * scale + 1e-9, f"{name}: max error {err:.3g} against max {scale:.3g}"


def reference(model, batch):
    """Autograd of the batch's mean loss: the loss, the gradient of the hidden states
    entering each block (rows of the examples concatenated), every LoRA gradient."""
    entering = {}

    def keep(i):
        def hook(module, args):
            if args[0].requires_grad:  # not the embeddings' output
                args[0].retain_grad()
            entering[i] = args[0]
        return hook

    layers = model.base_model.model.model.layers
    handles = [layers[i].register_forward_pre_hook(keep(i)) for i in range(len(layers))]
    model.train()
    hidden = {i: [] for i in range(len(layers))}
    total, count = 0.0, 0
    for ids, labels in batch:
        labels = torch.tensor(labels if labels else ids)
        logits = model(torch.tensor([ids])).logits[0, :-1]
        total = total + torch.nn.functional.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum")
        count += int((labels[1:] != -100).sum())
        for i in hidden:
            hidden[i].append(entering[i])
    loss = total / count
    loss.backward()
    for h in handles:
        h.remove()
    grads = {n.replace(".default", ""): p.grad.numpy() for n, p in model.named_parameters() if "lora_" in n}
    inputs = {i: np.concatenate([h.grad[0].numpy() for h in hs]) for i, hs in hidden.items() if i}
    return loss.item(), inputs, grads


def check_spans(tmp_path, base, adapter, data, model, spans_list, tol=1e-4):
    loss, inputs, grads = (qwen3_reference if isinstance(model, Qwen3Lora) else reference)(model, EXAMPLES[:3])
    for spans in spans_list:
        out = str(tmp_path / f"check{spans}.safetensors")
        memory = ["--memory", "keep"] if spans == 2 else []
        fusion_train("--model", base, "--adapter", adapter, "--data", data, "--batch-size", "3",
                     "--max-tokens", "64", "--spans", str(spans), "--check", out, *memory)
        got = load_file(out)
        assert got["loss"][0, 0] == pytest.approx(loss, rel=1e-5)
        bounds = {i * BASE["num_hidden_layers"] // spans for i in range(1, spans)}
        assert {n for n in got if n.startswith("input_grad.")} == {f"input_grad.{b}" for b in bounds}
        for first in bounds:
            close(got[f"input_grad.{first}"], inputs[first], f"input_grad.{first} ({spans} spans)", tol)
        names = {n for n in got if "lora_" in n}
        assert names == set(grads), f"{spans} spans: {sorted(names ^ set(grads))[:4]}"
        for n, ref in grads.items():
            close(got[n], ref, f"{n} ({spans} spans)", tol)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gradients_match_autograd(tmp_path, arch, dtype):
    check_spans(tmp_path, *build(tmp_path, arch, dtype), (1, 2, 3))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen3_gradients_match_autograd(tmp_path, tied):
    check_spans(tmp_path, *build_qwen3(tmp_path, tied), (1, 3))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantized_gguf_gradients_match_autograd(tmp_path, qtype):
    check_spans(tmp_path, *build_gguf(tmp_path, qtype), (1, 2))


def test_adamw_steps_match_torch(tmp_path):
    base, adapter, data, model = build(tmp_path, "llama-gqa", torch.float32)
    steps, lr, warmup = 20, 5e-3, 3
    out = fusion_train("--model", base, "--adapter", adapter, "--data", data, "--batch-size", "3",
                       "--max-tokens", "64", "--spans", "2", "--steps", str(steps), "--lr", str(lr),
                       "--warmup", str(warmup), "--schedule", "linear", "--weight-decay", "0.01",
                       "--clip", "0.5", "--out", str(tmp_path / "trained"))
    got = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [g["step"] for g in got] == list(range(1, steps + 1))

    params = [p for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    sched = transformers.get_linear_schedule_with_warmup(opt, warmup, steps)
    model.train()
    for s in range(steps):
        batch = EXAMPLES[(s % 2) * 3:(s % 2) * 3 + 3]
        opt.zero_grad()
        loss = torch_loss(model, batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
        assert got[s]["lr"] == pytest.approx(sched.get_last_lr()[0], rel=1e-5)
        assert got[s]["loss"] == pytest.approx(loss.item(), rel=1e-3), f"step {s + 1}"
        assert got[s]["grad_norm"] == pytest.approx(norm.item(), rel=1e-3), f"step {s + 1}"
        opt.step()
        sched.step()
    assert got[-1]["loss"] < 0.9 * got[0]["loss"]

    trained = load_file(os.path.join(tmp_path, "trained", "adapter_model.safetensors"))
    ref = {n.replace(".default", ""): p.detach().numpy() for n, p in model.named_parameters() if "lora_" in n}
    assert set(trained) == set(ref)
    for n, r in ref.items():
        close(trained[n], r, n, tol=1e-3)
    # peft loads what fusion wrote
    plain = transformers.LlamaForCausalLM.from_pretrained(base)
    peft.PeftModel.from_pretrained(plain, str(tmp_path / "trained"))
