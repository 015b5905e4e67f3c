#!/usr/bin/env python3
"""Writes seed inputs for fuzz_tokenizer: small tokenizer.json files (byte-level BPE with added
tokens and a regex split, SentencePiece-style BPE with byte fallback and a template processor)."""
import json
import os
import sys


def bytelevel():
    vocab = {"<|end|>": 0, "h": 1, "e": 2, "l": 3, "o": 4, "w": 5, "r": 6, "d": 7, "\u0120": 8, "\u010a": 9,
             "1": 10, "2": 11, "he": 12, "ll": 13, "hell": 14, "hello": 15, "\u0120w": 16, "or": 17}
    return {
        "added_tokens": [{"id": 0, "content": "<|end|>", "special": True, "normalized": False},
                         {"id": 18, "content": "<tool>", "special": False, "normalized": False}],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+|\\s+"},
             "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel"},
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": vocab,
                  "merges": ["h e", "l l", "he ll", "hell o", "\u0120 w", "o r"]},
    }


def spm():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = 3 + b
    vocab.update({"\u2581": 259, "h": 260, "i": 261, "\u2581h": 262, "\u2581hi": 263})
    return {
        "added_tokens": [{"id": i, "content": c, "special": True, "normalized": False}
                         for i, c in enumerate(["<unk>", "<s>", "</s>"])],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True,
                  "vocab": vocab, "merges": [["\u2581", "h"], ["\u2581h", "i"]]},
    }


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for name, t in (("bytelevel", bytelevel()), ("spm", spm())):
        with open(os.path.join(out, "seed-" + name + ".json"), "w", encoding="utf-8") as f:
            json.dump(t, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
