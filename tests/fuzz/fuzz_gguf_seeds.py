#!/usr/bin/env python3
"""Writes seed inputs for fuzz_gguf: small GGUF v3 files, one a complete tiny llama configuration
with a gpt2-style tokenizer in its metadata, one with every metadata value type."""
import os
import struct
import sys


def s(x):
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, payload):
    return s(key) + struct.pack("<I", vtype) + payload


def u32(key, v):
    return kv(key, 4, struct.pack("<I", v))


def f32(key, v):
    return kv(key, 6, struct.pack("<f", v))


def string(key, v):
    return kv(key, 8, s(v))


def arr_str(key, items):
    return kv(key, 9, struct.pack("<IQ", 8, len(items)) + b"".join(s(i) for i in items))


def arr_num(key, fmt, vtype, items):
    return kv(key, 9, struct.pack("<IQ", vtype, len(items)) + b"".join(struct.pack(fmt, i) for i in items))


def gguf(kvs, tensors):
    """tensors: (name, dims (innermost first), ggml type, data bytes)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs)
    off, infos, data = 0, b"", b""
    for name, dims, ttype, blob in tensors:
        infos += s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", ttype, off)
        pad = -len(blob) % 32
        data += blob + b"\0" * pad
        off += len(blob) + pad
    out = head + infos
    return out + b"\0" * (-len(out) % 32) + data


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    toks = ["<s>", "</s>", "h", "e", "l", "o", "he", "ll", "hell", "hello", "\u0120", "\u0120w"]
    llama = [
        string("general.architecture", "llama"),
        u32("llama.block_count", 1), u32("llama.embedding_length", 8), u32("llama.feed_forward_length", 16),
        u32("llama.attention.head_count", 2), u32("llama.attention.head_count_kv", 1),
        u32("llama.context_length", 64), f32("llama.attention.layer_norm_rms_epsilon", 1e-5),
        f32("llama.rope.freq_base", 10000.0), string("llama.rope.scaling.type", "linear"),
        f32("llama.rope.scaling.factor", 2.0),
        string("tokenizer.ggml.model", "gpt2"), string("tokenizer.ggml.pre", "default"),
        arr_str("tokenizer.ggml.tokens", toks),
        arr_num("tokenizer.ggml.token_type", "<i", 5, [3, 3] + [1] * (len(toks) - 2)),
        arr_str("tokenizer.ggml.merges", ["h e", "l l", "he ll", "hell o"]),
        u32("tokenizer.ggml.bos_token_id", 0), u32("tokenizer.ggml.eos_token_id", 1),
    ]
    tensors = [("token_embd.weight", [8, len(toks)], 0, b"\0" * 4 * 8 * len(toks)),
               ("output_norm.weight", [8], 0, struct.pack("<8f", *[1.0] * 8))]
    every = [
        kv("u8", 0, b"\x01"), kv("i8", 1, b"\xff"), kv("u16", 2, b"\x01\x00"), kv("i16", 3, b"\xff\xff"),
        u32("u32", 5), kv("i32", 5, struct.pack("<i", -5)), f32("f32", 1.5), kv("bool", 7, b"\x01"),
        string("str", "text"), kv("u64", 10, struct.pack("<Q", 1 << 40)), kv("i64", 11, struct.pack("<q", -1)),
        kv("f64", 12, struct.pack("<d", 2.5)), arr_num("arr", "<f", 6, [1.0, 2.0]),
        kv("nested", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 2) + struct.pack("<II", 1, 2)),
    ]
    seeds = {"llama": gguf(llama, tensors),
             "types": gguf(every, [("q", [32], 8, b"\0" * 34), ("h", [2, 2], 1, b"\0" * 8)])}
    for name, blob in seeds.items():
        with open(os.path.join(out, "seed-" + name + ".gguf"), "wb") as f:
            f.write(blob)


if __name__ == "__main__":
    main()
