"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) run by fusion against a
reference built from the same file by nobody here: the `gguf` package dequantizes
every tensor, transformers' LlamaForCausalLM runs them (Q/K rows un-permuted the way
transformers' own GGUF loader does, so the reference uses Hugging Face's rotary
layout while fusion runs the file's). Same greedy continuation, logits within
tolerance, same perplexity on a fixed English passage."""
import os

import numpy as np
import pytest
import torch

from fusion_oracle import default_model, read_logits, run_generate

PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined several existing technologies into a practical system for mass "
    "producing books. Before this invention, texts were copied by hand, a slow and costly "
    "process that limited the spread of knowledge. Within a few decades, printing shops had "
    "appeared in hundreds of European cities, and millions of books were in circulation. "
    "Scholars argue that the printing press played a central role in the Renaissance, the "
    "Reformation and the Scientific Revolution, because it allowed ideas to travel quickly "
    "and to be preserved accurately."
)

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n",
]


def reverse_permute(w, n_head):
    # inverse of convert_hf_to_gguf's permute for the "normal" rope layout
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def setup():
    import gguf
    import transformers
    path = default_model()
    reader = gguf.GGUFReader(path)

    def meta(key):
        f = reader.fields[key]
        return f.parts[f.data[0]][0]

    n_head = int(meta("llama.attention.head_count"))
    n_kv = int(meta("llama.attention.head_count_kv"))
    cfg = transformers.LlamaConfig(
        vocab_size=int(meta("llama.vocab_size")), hidden_size=int(meta("llama.embedding_length")),
        intermediate_size=int(meta("llama.feed_forward_length")),
        num_hidden_layers=int(meta("llama.block_count")), num_attention_heads=n_head,
        num_key_value_heads=n_kv, max_position_embeddings=int(meta("llama.context_length")),
        rms_norm_eps=float(meta("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("llama.rope.freq_base")), tie_word_embeddings=True)
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    sd = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if w.ndim > 1 or len(t.shape) > 1 else w
        parts = t.name.split(".")
        if parts[0] == "blk":
            kind = parts[2]
            if kind == "attn_q":
                w = reverse_permute(w, n_head)
            elif kind == "attn_k":
                w = reverse_permute(w, n_kv)
            name = f"model.layers.{parts[1]}.{names[kind]}.weight"
        else:
            name = names[parts[0]] + ".weight"
        sd[name] = torch.from_numpy(np.ascontiguousarray(w))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                     gguf_file=os.path.basename(path))
    return path, model, tok, cfg.vocab_size


def ref_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_and_logits(setup, prompt, tmp_path):
    path, model, tok, vocab = setup
    ids = tok(prompt, add_special_tokens=False).input_ids
    lp = str(tmp_path / "logits.bin")
    gen = run_generate(path, ids, 32, lp, ["--ignore-eos"])["tokens"]
    ours = read_logits(lp, vocab)
    theirs = ref_logits(model, (ids + gen)[:-1])
    spread = np.abs(theirs).max()
    err = np.abs(ours - theirs).max()
    # fusion multiplies Q4_1/Q8_0 weights by activations that its kernels may
    # round to 8 bits, as llama.cpp does; the reference runs everything in f32
    assert err < 0.03 * spread, f"max |diff| {err:.4f} vs spread {spread:.2f}"
    # the reference's own greedy continuation, step by step
    ref_ids = list(ids)
    for i in range(32):
        row = ref_logits(model, ref_ids)[-1]
        best = int(np.argmax(row))
        if best != gen[i]:
            margin = row[best] - row[gen[i]]
            assert margin < 0.02 * spread, \
                f"step {i}: fusion chose {gen[i]}, reference {best} (margin {margin:.3f})"
            break  # a genuine near-tie: the continuations may part here
        ref_ids.append(best)
    else:
        assert ref_ids[len(ids):] == gen
    print(repr(prompt), "->", repr(tok.decode(gen)))


def test_perplexity_matches(setup, tmp_path):
    path, model, tok, vocab = setup
    ids = tok(PASSAGE, add_special_tokens=False).input_ids
    assert len(ids) > 80
    lp = str(tmp_path / "ppl.bin")
    run_generate(path, ids, 1, lp)
    ours = torch.from_numpy(read_logits(lp, vocab)[: len(ids) - 1])
    theirs = torch.from_numpy(ref_logits(model, ids)[:-1])
    target = torch.tensor(ids[1:])
    ppl_ours = torch.exp(torch.nn.functional.cross_entropy(ours, target)).item()
    ppl_ref = torch.exp(torch.nn.functional.cross_entropy(theirs, target)).item()
    print(f"perplexity fusion {ppl_ours:.3f} reference {ppl_ref:.3f}")
    assert ppl_ref < 40, "the reference itself should find English predictable"
    assert abs(ppl_ours - ppl_ref) / ppl_ref < 0.01
