#!/usr/bin/env python3
"""Writes seed inputs for fuzz_cluster: the small cluster files of config/, a compact-form cluster
with step profiles, Helix-style INI text, a trace and a set of lengths."""
import json
import os
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
out = sys.argv[1]
seeds = []
with open(os.path.join(root, "config", "clusters", "example-4.json")) as f:
    seeds.append(f.read())
with open(os.path.join(root, "config", "scenarios", "fusionai-4xh100.json")) as f:
    seeds.append(f.read())
seeds += [
    json.dumps({"model": {"name": "m", "n_layers": 4, "activation_bytes": 64, "layer_bytes": 1e6},
                "kinds": {"G": {"tokens_per_s_by_layers": [400, 200, 130, 100], "kv_tokens_by_layers": [9e4, 5e4, 3e4, 2e4]}},
                "default_link": {"bandwidth": 1e8, "latency": 0.001},
                "servers": [{"name": "a", "kind": "G", "span": [0, 2]}, {"name": "b", "kind": "G", "span": [2, 4]}],
                "links": [[-1, 0, 1e9, 0.001], [0, 1, 1e8, 0.002], [1, -2, 1e9, 0.001]],
                "step_profiles": {"G": {"prompt": [[0, 0], [100, 3]], "decode": [[1, 1], [64, 2]],
                                        "decode_max_tokens": 8, "single_decode_factor": 2}}}),
    "[NodeNames]\ntotal_compute_nodes=2\n[ComputeNode-0]\ntype=A100\nconnected_nodes=[1, 'source', 'sink']\n"
    "[Link-0-1]\nbandwidth=1250 * mbps\nlatency=1 * MilliSec\n",
    "[Settings]\noffset=2\n[Solution]\ncompute_node_2=[0, 1, 2]\ncompute_node_3=[3]\n",
    "# arrival prompt output\n0.5 120 30\n0.1 7 1\n\n2.25\t900 0\n",
    "374 44\n396 109\n# a comment\n879 55\r\n91 16",
]
for i, s in enumerate(seeds):
    with open(os.path.join(out, f"seed-{i}.json"), "w") as f:
        f.write(s)
