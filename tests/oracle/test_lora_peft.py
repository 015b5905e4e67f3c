"""LoRA adapters against PyPI's peft, both ways, on a tiny random Llama: an adapter peft
saves (f32 and bf16, B made non-zero) is read by fusion-lora inspect with the same names,
shapes and values; an adapter fusion-lora init writes (B made non-zero) loads into peft's
PeftModel.from_pretrained with every tensor as fusion wrote it and peft's config and scale;
fusion-generate --lora gives the PeftModel's logits (multi-head and grouped-query attention)."""
import json
import os
import subprocess

import numpy as np
import pytest
import torch

from fusion_oracle import program, read_logits, run_generate

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("base"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def fusion_lora(*args):
    res = subprocess.run([program("lora"), *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"fusion-lora {' '.join(args)} failed:\n{res.stderr}"
    return res.stdout


def peft_adapter(base_model):
    model = transformers.LlamaForCausalLM.from_pretrained(base_model)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                          task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peft_adapter_read_by_fusion(base_model, tmp_path, dtype):
    torch.manual_seed(1)
    model = peft_adapter(base_model).to(dtype)
    out = str(tmp_path / "adapter")
    model.save_pretrained(out)
    saved = peft.utils.get_peft_model_state_dict(model)
    assert len(saved) == 2 * len(TARGETS) * BASE["num_hidden_layers"]

    got = json.loads(fusion_lora("--model", base_model, "inspect", out))
    assert got["config"]["r"] == 4 and got["config"]["lora_alpha"] == 8
    assert got["config"]["target_modules"] == TARGETS
    assert got["config"]["scale"] == pytest.approx(2.0)
    assert (got["first"], got["last"]) == (0, BASE["num_hidden_layers"])
    by_name = {t["name"]: t for t in got["tensors"]}
    assert set(by_name) == set(saved)
    for name, value in saved.items():
        ref = value.float().numpy().astype(np.float64)
        t = by_name[name]
        assert t["shape"] == list(ref.shape), name
        assert t["sum"] == pytest.approx(ref.sum(), rel=1e-5, abs=1e-5), name
        assert t["max_abs"] == pytest.approx(np.abs(ref).max(), rel=1e-6), name

    # a span reads only its blocks' tensors
    span = json.loads(fusion_lora("--model", base_model, "--span", "1:2", "inspect", out))
    assert {t["name"] for t in span["tensors"]} == {n for n in saved if ".layers.1." in n}


def test_fusion_adapter_loaded_by_peft(base_model, tmp_path):
    from safetensors.numpy import load_file
    out = str(tmp_path / "fusion-adapter")
    fusion_lora("--model", base_model, "-r", "4", "--alpha", "8", "--targets", "all-linear",
                "--seed", "5", "--random-b", "0.1", "init", out)
    written = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert all(v.dtype == np.float32 for v in written.values())

    base = transformers.LlamaForCausalLM.from_pretrained(base_model)
    model = peft.PeftModel.from_pretrained(base, out).eval()
    cfg = model.peft_config["default"]
    assert cfg.r == 4 and cfg.lora_alpha == 8 and cfg.bias == "none" and not cfg.use_rslora
    assert set(cfg.target_modules) == set(TARGETS)
    assert cfg.base_model_name_or_path == base_model  # --base-model defaults to --model

    loaded = peft.utils.get_peft_model_state_dict(model)
    assert set(loaded) == set(written)
    for name, value in loaded.items():
        np.testing.assert_array_equal(value.numpy(), written[name], err_msg=name)
    # A as PEFT initialises it (kaiming-uniform, a = sqrt(5)): within 1/sqrt(in); B non-zero
    for name, value in written.items():
        if "lora_A" in name:
            assert np.abs(value).max() <= 1 / np.sqrt(value.shape[1]), name
        else:
            assert np.abs(value).max() > 0, name
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.scaling["default"] == pytest.approx(2.0)
    # the adapter changes the model's output (B != 0)
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        with_lora = model(ids).logits
        with model.disable_adapter():
            without = model(ids).logits
    assert not torch.allclose(with_lora, without)


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_generate_with_lora_matches_peft(tmp_path, n_kv_heads):
    torch.manual_seed(2)
    base = str(tmp_path / "base")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, "num_key_value_heads": n_kv_heads}))
    model.eval().save_pretrained(base, safe_serialization=True)
    torch.manual_seed(3)
    peft_model = peft_adapter(base).eval()
    adapter = str(tmp_path / "adapter")
    peft_model.save_pretrained(adapter)

    ids = [1, 5, 9, 13, 77, 2, 127, 64]
    with torch.no_grad():
        ref = peft_model(torch.tensor([ids])).logits[0].numpy()
        with peft_model.disable_adapter():
            plain = peft_model(torch.tensor([ids])).logits[0].numpy()
    out = str(tmp_path / "logits.f32")
    run_generate(base, ids, 0, out, extra=["--lora", adapter])
    got = read_logits(out, BASE["vocab_size"])
    assert got.shape == ref.shape
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * scale)
    assert np.abs(ref - plain).max() > 100 * 1e-4 * scale  # the adapter matters at this tolerance
