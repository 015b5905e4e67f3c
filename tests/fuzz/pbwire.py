"""Protobuf wire format by hand, for the fuzz targets' seed scripts: varints and fields."""
import struct


def varint(n):
    n = int(n) & ((1 << 64) - 1)
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def f_varint(num, v):
    return varint(num << 3) + varint(v)


def f_bytes(num, b):
    return varint(num << 3 | 2) + varint(len(b)) + b


def f_packed(num, vals):
    return f_bytes(num, b"".join(varint(v) for v in vals))


def f_float(num, x):
    return varint(num << 3 | 5) + struct.pack("<f", x)


def f_double(num, x):
    return varint(num << 3 | 1) + struct.pack("<d", x)
