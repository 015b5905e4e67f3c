#!/usr/bin/env python3
"""Writes seed inputs for fuzz_config: the gateway's example configs and a few variants of them
(every option type: strings, integers, numbers, flags, lists, spans, file options)."""
import json
import os
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
out = sys.argv[1]
seeds = []
for name in ("gateway.example.json", "gateway.swarm.example.json"):
    with open(os.path.join(root, "config", name)) as f:
        seeds.append(f.read())
seeds += [
    json.dumps({"model": "m.gguf", "hops": ["127.0.0.1:7001:0:15", "[::1]:7002:15:30"], "insecure": True,
                "secret": "0123456789abcdef0", "workers": 4, "max_queue": 0, "temperature": 0.5}),
    json.dumps({"model": "org/name", "shards": ["127.0.0.1:7001"], "swarm_listen": "127.0.0.1:0",
                "step_timeout_ms": 1, "max_request_seconds": 0, "api_keys": ["sk-" + "x" * 20], "no_auth": False}),
    json.dumps({"model": "m", "hop": "127.0.0.1:1:0:1", "secret_file": "/nonexistent", "links": [],
                "listen": "0.0.0.0:8080", "allowed_hosts": ["*"], "cors_origins": ["https://a.example"]}),
    '{"model": "m", "hops": [null, 1, 2.5, true, {"a": []}]}',
    '{"_c": "x", "model": "\\u0000", "workers": 1e400}',
]
for i, s in enumerate(seeds):
    with open(os.path.join(out, f"seed-{i}.json"), "w") as f:
        f.write(s)
