#!/usr/bin/env python3
"""Writes seed inputs for fuzz_shard_messages: valid fusion.Shard SessionRequests (protobuf
wire format, encoded here by hand) for the fuzz target's span (hidden size 32, vocab 40)."""
import os
import struct
import sys


from pbwire import f_bytes, f_float, f_packed, f_varint  # noqa: E402


def tensor(rows, cols, dtype):
    vals = [((i * 37) % 19 - 9) / 7.0 for i in range(rows * cols)]
    if dtype == 1:
        data = struct.pack(f"<{len(vals)}f", *vals)
        return f_varint(1, 1) + f_packed(2, [rows, cols]) + f_bytes(3, data)
    if dtype == 2:  # bf16: upper halves
        data = b"".join(struct.pack("<f", v)[2:] for v in vals)
        return f_varint(1, 2) + f_packed(2, [rows, cols]) + f_bytes(3, data)
    block = 16  # int8 blocks with f32 scales
    q = bytes((i * 7) % 256 for i in range(rows * cols))
    scales = struct.pack(f"<{rows * cols // block}f", *([0.01] * (rows * cols // block)))
    return (f_varint(1, 4) + f_packed(2, [rows, cols]) + f_bytes(3, q) + f_bytes(4, scales) +
            f_varint(5, block) + f_varint(6, 1))


def step(inp, output=b"", start=0, rollback=None):
    body = f_varint(1, 7) + f_varint(2, start) + f_bytes(3, inp)
    if output:
        body += f_bytes(4, output)
    if rollback is not None:
        body += f_varint(5, rollback)
    return f_bytes(2, body)


def main(out):
    os.makedirs(out, exist_ok=True)
    sampling = f_float(1, 0.7) + f_float(2, 0.9) + f_varint(3, 5) + f_varint(5, 42) + \
        f_bytes(9, f_varint(1, 3) + f_float(2, 2.0))
    seeds = {
        "open": f_bytes(1, f_bytes(1, b"s1") + f_varint(2, 32) + f_varint(3, 2) + f_varint(6, 1) + f_varint(7, 2)),
        "open_chain": f_bytes(1, f_bytes(1, b"s2") + f_varint(2, 8) + f_bytes(8, f_bytes(1, b"127.0.0.1:1") +
                                                                            f_varint(2, 2) + f_varint(3, 3))),
        "step_f32": step(f_bytes(2, tensor(2, 32, 1))),
        "step_bf16_tokens": step(f_packed(1, [1, 2, 3]) + f_bytes(2, tensor(3, 32, 2)), f_varint(1, 1)),
        "step_int8_sample": step(f_bytes(2, tensor(1, 32, 4)), f_bytes(3, sampling) + f_varint(4, 3)),
        "step_all_logits": step(f_bytes(2, tensor(4, 32, 1)), f_varint(1, 1) + f_varint(2, 1)),
        "step_rollback": step(f_bytes(2, tensor(1, 32, 1)), b"", 0, 0),
        "close": f_bytes(3, f_bytes(1, b"bye")),
    }
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main(sys.argv[1])
