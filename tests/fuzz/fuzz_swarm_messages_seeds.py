#!/usr/bin/env python3
"""Writes seed inputs for fuzz_swarm_messages: valid Join and Heartbeat requests of fusion.Swarm
and Info replies of fusion.Shard (protobuf wire format, encoded here by hand), each after the byte
that picks the message, for the target's 4-block model."""
import os
import struct
import sys


from pbwire import f_bytes, f_double, f_varint  # noqa: E402


def member(address, first, last, links=(), fixed=False):
    m = f_bytes(1, address.encode()) + f_bytes(2, b"model") + f_varint(3, 4) + f_varint(4, first)
    m += f_varint(5, last) + f_bytes(6, b"cpu") + f_bytes(7, b"q4_1") + f_double(8, 120.0) + f_double(9, 900.0)
    m += f_varint(11, 1 << 30) + f_varint(12, 1 << 30) + f_varint(13, 4096) + f_varint(15, int(fixed))
    for peer, rtt, bw in links:
        m += f_bytes(16, f_bytes(1, peer.encode()) + f_double(2, rtt) + f_double(3, bw))
    return m + f_varint(23, 576)


def doubles(num, vals):
    return f_bytes(num, b"".join(struct.pack("<d", v) for v in vals))


# one block's step times (MemberStatus and InfoReply fields 24-27)
STEPS = (doubles(24, [16, 64, 256]) + doubles(25, [0.001, 0.003, 0.011]) + doubles(26, [1, 2, 4, 8]) +
         doubles(27, [2e-4, 2.5e-4, 3e-4, 4e-4]))


def info(first, last, steps=STEPS):
    return (f_bytes(1, b"model") + f_varint(2, 4) + f_varint(3, first) + f_varint(4, last) + f_bytes(7, b"f32") +
            f_bytes(8, b"cpu") + f_double(9, 300.0) + f_varint(10, 1 << 20) + f_varint(11, 1 << 21) + steps)


out = sys.argv[1]
seeds = {
    "join-spare": b"\0" + f_bytes(1, member("127.0.0.1:7001", 0, 0)),
    "join-span": b"\0" + f_bytes(1, member("10.0.0.2:7002", 0, 2, fixed=True)),
    "join-links": b"\0" + f_bytes(1, member("10.0.0.3:7003", 2, 4, [("10.0.0.2:7002", 0.002, 1e8)])),
    "join-bad-range": b"\0" + f_bytes(1, f_bytes(1, b"10.0.0.4:1") + f_varint(3, 1 << 40)),
    "heartbeat": b"\1" + f_varint(1, 1) + f_bytes(2, member("127.0.0.1:7001", 0, 4)),
    "heartbeat-leaving": b"\1" + f_varint(1, 2) + f_varint(3, 1),
    "heartbeat-steps": b"\1" + f_varint(1, 1) + f_bytes(2, member("127.0.0.1:7001", 0, 4) + STEPS),
    "info": b"\2" + info(0, 4),
    "info-uneven-steps": b"\2" + info(0, 2, doubles(24, [16, 64]) + doubles(25, [0.001])),
    "heartbeat-draining": b"\1" + f_varint(1, 1) + f_bytes(2, member("127.0.0.1:7001", 0, 2) + f_varint(20, 2)
                                                             + f_varint(21, 4) + f_varint(22, 3)),
}
for name, data in seeds.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(data)
