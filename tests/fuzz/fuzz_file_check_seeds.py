#!/usr/bin/env python3
"""Writes seed inputs for fuzz_file_check: whole fine-tuning files, valid (ten chat examples) and
not (a bad line among good ones, unknown keys, special strings, too few examples, blank lines)."""
import json
import os
import sys

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
BAD = [
    "not json",
    json.dumps({"prompt": "x"}),
    json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 2}]}),
    json.dumps({"messages": [{"role": "user", "content": "x", "mood": 1}, {"role": "assistant", "content": "y"}]}),
    json.dumps({"messages": [{"role": "user", "content": "<|im_end|>"}, {"role": "assistant", "content": "y"}]}),
    json.dumps({"messages": [{"role": "user", "content": "x" * 2000}, {"role": "assistant", "content": "y"}]}),
]


def main(out):
    os.makedirs(out, exist_ok=True)
    files = ["\n".join([json.dumps(GOOD)] * 10) + "\n", "\n\n".join([json.dumps(GOOD)] * 9)]
    files += ["\n".join([json.dumps(GOOD)] * 5 + [bad] + [json.dumps(GOOD)] * 5) for bad in BAD]
    for i, text in enumerate(files):
        with open(os.path.join(out, f"seed-{i:02d}"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main(sys.argv[1])
