#!/usr/bin/env python3
"""Writes seed inputs for fuzz_train_messages: valid fusion.Train requests (protobuf wire format,
encoded here by hand), each after the byte that picks the method (train_svc_method's order:
Open, Forward, Backward, Norm, Step, GetState, PutState, Close; then fusion.Shard's LoadAdapter and
UnloadAdapter)."""
import os
import struct
import sys


from pbwire import f_bytes, f_float, f_packed, f_varint  # noqa: E402

OPEN, FORWARD, BACKWARD, NORM, STEP, GET_STATE, PUT_STATE, CLOSE, LOAD_ADAPTER, UNLOAD_ADAPTER = range(10)


def tensor(shape, dtype):
    n = 1
    for d in shape:
        n *= d
    vals = [((i * 37) % 19 - 9) / 7.0 for i in range(n)]
    data = struct.pack(f"<{n}f", *vals)
    if dtype == 2:  # bf16: upper halves
        data = b"".join(struct.pack("<f", v)[2:] for v in vals)
    return f_varint(1, dtype) + f_packed(2, shape) + f_bytes(3, data)


def lora(r, targets, seed=7):
    body = f_varint(1, r) + f_float(2, 2.0 * r) + f_float(3, 0.05) + f_varint(4, 1)
    for t in targets:
        body += f_bytes(5, t.encode())
    return body + f_varint(6, seed)


def state(first, last, n, moments=True):
    body = f_varint(1, first) + f_varint(2, last) + f_bytes(3, lora(4, ["q_proj", "v_proj"]))
    body += f_bytes(4, tensor([n], 1))
    if moments:
        body += f_bytes(5, tensor([n], 1)) + f_bytes(6, tensor([n], 1))
    return body


def job(name=b"job-1"):
    return f_bytes(1, name)


def main(out):
    os.makedirs(out, exist_ok=True)
    seeds = {
        "open": (OPEN, job() + f_varint(2, 0) + f_varint(3, 2) + f_bytes(4, lora(8, ["all-linear"])) +
                 f_varint(6, 64) + f_varint(7, 2) + f_varint(8, 1) + f_varint(9, 30000)),
        "open_state": (OPEN, job() + f_varint(2, 2) + f_varint(3, 4) + f_bytes(4, lora(4, ["q_proj", "v_proj"])) +
                       f_bytes(5, state(2, 4, 16)) + f_varint(6, 8) + f_varint(7, 1)),
        "forward_tokens": (FORWARD, job() + f_varint(2, 0) + f_bytes(3, f_packed(1, [1, 2, 3, 4])) +
                           f_packed(4, [0, 0, 2, 2]) + f_packed(5, [2, -1, 4, -1]) + f_float(6, 0.25) +
                           f_varint(7, 99) + f_varint(8, 1)),
        "forward_hidden": (FORWARD, job() + f_varint(2, 1) + f_bytes(3, f_bytes(2, tensor([4, 8], 2))) +
                           f_packed(4, [0, 0, 0, 0]) + f_packed(5, [3, 5, 7, -1]) + f_float(6, 1.0)),
        "backward": (BACKWARD, job() + f_varint(2, 0) + f_bytes(3, tensor([4, 8], 2)) + f_varint(4, 1) +
                     f_varint(5, 2)),
        "backward_head": (BACKWARD, job() + f_varint(2, 1)),
        "norm": (NORM, job()),
        "step": (STEP, job() + f_varint(2, 1) + f_float(3, 1e-4) + f_float(4, 1.0) + f_float(5, 0.9) +
                 f_float(6, 0.999) + f_float(7, 1e-8) + f_float(8, 0.01)),
        "step_discard": (STEP, job() + f_varint(2, 2) + f_varint(9, 1)),
        "get_state": (GET_STATE, job()),
        "put_state": (PUT_STATE, job() + f_bytes(2, state(0, 2, 8, moments=False))),
        "close": (CLOSE, job()),
        "close_bad_id": (CLOSE, job(b"job\x01")),
        "forward_bad_target": (FORWARD, job() + f_packed(5, [1 << 40])),
        "load_adapter": (LOAD_ADAPTER, f_bytes(1, b"ad-1") + f_bytes(2, state(0, 2, 8, moments=False))),
        "load_adapter_no_state": (LOAD_ADAPTER, f_bytes(1, b"ad-1")),
        "load_adapter_bad_id": (LOAD_ADAPTER, f_bytes(1, b"ad\x02") + f_bytes(2, state(1, 2, 4, moments=False))),
        "unload_adapter": (UNLOAD_ADAPTER, f_bytes(1, b"ad-1")),
        "unload_adapter_empty": (UNLOAD_ADAPTER, b""),
    }
    for name, (method, data) in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(bytes([method]) + data)


if __name__ == "__main__":
    main(sys.argv[1])
