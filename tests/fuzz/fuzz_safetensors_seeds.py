#!/usr/bin/env python3
"""Writes seed inputs for fuzz_safetensors: small safetensors files (several dtypes and ranks,
metadata, a scalar, an empty tensor)."""
import json
import os
import struct
import sys


def st_file(tensors, metadata=None):
    header, data = {}, b""
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    seeds = {
        "small": st_file({"w": ("F32", [2, 3], struct.pack("<6f", *range(6))),
                          "b": ("BF16", [3], b"\x80\x3f" * 3),
                          "h": ("F16", [1, 2], b"\x00\x3c" * 2)}, {"format": "pt"}),
        "odd": st_file({"s": ("I64", [], struct.pack("<q", 7)), "e": ("U8", [0, 4], b""),
                        "x": ("F8_E4M3", [4], b"\x01\x02\x03\x04"), "q": ("F64", [1, 1, 1, 1, 1], b"\0" * 8)}),
    }
    for name, blob in seeds.items():
        with open(os.path.join(out, "seed-" + name + ".safetensors"), "wb") as f:
            f.write(blob)


if __name__ == "__main__":
    main()
