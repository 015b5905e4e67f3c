#!/usr/bin/env python3
"""gen-scenarios.py -- writes config/scenarios/*.json from card specs and stated assumptions.

Usage: scripts/gen-scenarios.py [OUT_DIR]   (default: config/scenarios beside this script)

Every scenario is a cluster in fusion's JSON format (router/router.h, rt_swarm_load_json) for
LLaMA-2 70B, plus sections the loader ignores: "scenario" (what it stands for, its sources,
precision, links and placement rule), "cards" (published memory bandwidth, FLOPs, VRAM),
"efficiency" (the share of those fusion's kernels reach, as measured), "derivation" (how the tables
below were computed), "step_profiles" (per-layer step time by batch size, for the simulator)
and, for DT-FM's cases, "dtfm" (nodes, latency and bandwidth matrices as the paper gives them).

Standard library only; the output is deterministic, so tests can regenerate and compare.
"""
import json
import os
import sys

GIB = 2 ** 30
REQ_TOKENS = 750 + 240        # Helix's average request: a 750-token prompt, 240 decode steps
PROMPT, DECODE = 750, 240

# LLaMA-2 70B (Hugging Face config: hidden 8192, 64 heads, 8 KV heads of 128, FFN 28672).
HIDDEN, N_LAYERS, KV_HEADS, HEAD_DIM, FFN = 8192, 80, 8, 128, 28672
LAYER_PARAMS = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * HEAD_DIM + 3 * HIDDEN * FFN + 2 * HIDDEN
LAYER_BYTES = 1.53e9         # Helix's fp16 bytes per block, kept so that figures compare with Helix
KV_BYTES = 2 * KV_HEADS * HEAD_DIM * 2   # K and V, fp16: bytes per token per block
KV_RESERVE = 1 * GIB         # CUDA context, activations and workspace
KV_BATCH_SHARE = 0.3         # Helix: share of the KV capacity a typical batch fills

MODEL = {"name": "llama2_70b", "n_layers": N_LAYERS, "token_bytes": 2, "activation_bytes": 2 * HIDDEN,
         "layer_bytes": LAYER_BYTES, "kv_bytes_per_token_layer": KV_BYTES, "weight_vram_fraction": 1.0}

# fusion's CUDA kernels as fusion-bench-kernels measured them on an H100 SXM (LLaMA-2 70B block,
# fp16 weights and KV cache): each figure over the card's datasheet peak.
EFFICIENCY = {"bandwidth": 0.80, "flops": 0.58, "kv_bandwidth": 0.028, "attention_flops": 0.0128,
              "step_overhead_ms": 0.09,
              "basis": "measured: fusion's CUDA kernels on an NVIDIA H100 80GB HBM3 (SXM), "
                       "fusion-bench-kernels --device cuda --block llama2-70b --types f16, 2026-11-26: "
                       "decode matmuls stream the weights at 2680 GB/s at T=1 (0.80 of the datasheet's "
                       "3.35 TB/s; 0.79 at T=8, 0.77 at T=32); prefill matmuls reach 576 TFLOP/s at "
                       "750 tokens (0.58 of 989.4 dense fp16); decode attention reads the KV cache at "
                       "94.7 GB/s at T=32 over 870 positions (0.028 of the bandwidth); prefill attention "
                       "runs at 0.86 TFLOP/s at 750 tokens on CUDA cores (0.0128 of the 67 TFLOPS fp32 "
                       "peak); the norms, rope, KV stores, swiglu and residual adds add 0.07-0.12 ms a "
                       "block step (0.09 taken). Applied to every card as fractions of its own "
                       "datasheet (the overhead as it is): the same kernels, not measured on the others"}

GA102 = ("NVIDIA Ampere GA102 GPU Architecture whitepaper, Appendix A (GeForce RTX 3080: 760 GB/s GDDR6X; "
         "peak FP16 Tensor TFLOPS 119 with FP16 accumulate, 59.5 with FP32 accumulate; peak FP32 TFLOPS "
         "29.8)")
CARDS = {
    "RTX3080": {"vram_bytes": 10 * GIB, "mem_bandwidth_bytes_per_s": 760e9, "fp16_flops": 59.5e12,
                "fp32_flops": 29.8e12,
                "flops_note": "dense FP16 tensor with FP32 accumulate (cuBLAS/PyTorch default for fp16 "
                              "GEMMs); 119 TFLOPS with FP16 accumulate",
                "source": GA102},
    "H100-SXM": {"vram_bytes": 80 * GIB, "mem_bandwidth_bytes_per_s": 3.35e12, "fp16_flops": 989.4e12,
                 "fp32_flops": 67e12,
                 "flops_note": "dense FP16 tensor (1979 TFLOPS with 2:4 sparsity)",
                 "source": "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 80 GB HBM3, 3.35 TB/s, "
                           "FP16 Tensor Core 1979 TFLOPS with sparsity, half that dense; FP32 67 TFLOPS)"},
    "V100-SXM2": {"vram_bytes": 16 * GIB, "mem_bandwidth_bytes_per_s": 900e9, "fp16_flops": 125e12,
                  "fp32_flops": 15.7e12,
                  "flops_note": "tensor (mixed precision, FP32 accumulate)",
                  "source": "NVIDIA Tesla V100 datasheet (V100 SXM2: 16 GB HBM2, 900 GB/s, 125 TFLOPS "
                            "tensor, 15.7 TFLOPS single precision); the GPU of AWS p3 instances used by DT-FM"},
}

FUSIONAI = ("FusionAI: Decentralized Training and Deploying LLMs with Massive Consumer-Level GPUs "
            "(Tang et al., 2023, arXiv:2309.01172), abstract and performance analysis: \"50 RTX 3080 "
            "GPUs can achieve throughputs comparable to those of 4 H100 GPUs\"")
DTFM = ("Decentralized Training of Foundation Models in Heterogeneous Environments (Yuan et al., "
        "NeurIPS 2022, arXiv:2206.01288), evaluation, experimental setup, Cases 1-5 (64 V100 GPUs); "
        "matrices as in the authors' artifact DS3Lab/DT-FM, scheduler/generate_sim_com_matrices.py")
HELIX = ("Helix: Distributed Serving of Large Language Models via Max-Flow on Heterogeneous GPUs "
         "(Mei et al., ASPLOS 2025): typical token throughput (get_typical_token_throughput), "
         "1.53 GB fp16 per LLaMA-2 70B block, 750/240-token requests")
DERIVATION = {
    "layer_params": LAYER_PARAMS,
    "layer_bytes": LAYER_BYTES,
    "kv_bytes_per_token_layer": KV_BYTES,
    "kv_reserve_bytes": KV_RESERVE,
    "step_time": "per block: max(layer_bytes / (BW * eff.bandwidth), 2 * layer_params * tokens / "
                 "(FLOPs * eff.flops)) + eff.step_overhead_ms; decode adds tokens * context * kv_bytes / "
                 "(BW * eff.kv_bandwidth); t prompt tokens add their causal attention as 750-token prompts, "
                 "2 * hidden * t * 751 FLOPs, at FP32_FLOPs * eff.attention_flops",
    "kv_tokens_by_layers": "floor((VRAM - k * layer_bytes - reserve) / (kv_bytes * k)); a card holds k "
                           "blocks while that is at least one request (990 tokens)",
    "tokens_per_s_by_layers": "Helix's typical throughput, simplified: a homogeneous swarm, so the "
                              "workload ratio is w = k / L; the batch keeps 0.3 of the KV capacity, "
                              "n = 0.3 * kv / 990 requests, d = max(1, round(n * w)) decode tokens a "
                              "step (at most 240); one 750-token prompt per 240 decode steps: "
                              "tput(k) = 990 / (k * (prompt(750) + 240 * decode(d) / d)), decode at "
                              "the mean context of 870 tokens",
    "latency": "links carry one-way latency = RTT / 2",
}


def sig(x, digits=6):
    """x rounded to `digits` significant digits, as a float (stable JSON)."""
    return float(f"{x:.{digits}g}")


def kv_rate(card):
    """Bytes/s at which decode attention reads the KV cache."""
    return card["mem_bandwidth_bytes_per_s"] * EFFICIENCY["kv_bandwidth"]


def prompt_attention_ms(card, tokens):
    """ms of the causal attention of `tokens` prompt tokens in one block, as 750-token prompts: the
    step tables are indexed by a batch's tokens, whatever prompts they come from."""
    flop = 2.0 * HIDDEN * tokens * (PROMPT + 1)
    return flop / (card["fp32_flops"] * EFFICIENCY["attention_flops"]) * 1e3


def roofline_ms(card, tokens, ctx=0.0, prompt=False):
    """Per-block step time in ms for `tokens` tokens attending to `ctx` tokens each (decode), or
    for a prompt of `tokens` tokens."""
    bw = card["mem_bandwidth_bytes_per_s"] * EFFICIENCY["bandwidth"]
    fl = card["fp16_flops"] * EFFICIENCY["flops"]
    if tokens <= 0:
        return 0.0
    t = max(LAYER_BYTES / bw, 2.0 * LAYER_PARAMS * tokens / fl) + tokens * ctx * KV_BYTES / kv_rate(card)
    return t * 1e3 + EFFICIENCY["step_overhead_ms"] + (prompt_attention_ms(card, tokens) if prompt else 0.0)


def kv_tokens(card, k):
    return int((card["vram_bytes"] - k * LAYER_BYTES - KV_RESERVE) // (KV_BYTES * k))


def max_layers(card):
    k = 0
    while k < N_LAYERS and kv_tokens(card, k + 1) >= REQ_TOKENS:
        k += 1
    return k


def typical_tput(card, k):
    """Helix's typical tokens/s of a card holding k blocks (see DERIVATION)."""
    n_req = KV_BATCH_SHARE * kv_tokens(card, k) / REQ_TOKENS
    d = min(DECODE, max(1, round(n_req * k / N_LAYERS)))
    ctx = PROMPT + DECODE / 2
    per_req_ms = roofline_ms(card, PROMPT, prompt=True) + DECODE * roofline_ms(card, d, ctx) / d
    return REQ_TOKENS / (k * per_req_ms * 1e-3)


def step_profile(kind):
    card = CARDS[kind]
    prompt = [0, 1, 16, 64, 128, 256, 512, 750, 1024, 2048, 4096, 8192]
    decode = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    return {"prompt": [[t, sig(roofline_ms(card, t, prompt=True))] for t in prompt],
            "decode": [[b, sig(roofline_ms(card, b))] for b in decode],
            "decode_ctx_ms_per_token": sig(KV_BYTES / kv_rate(card) * 1e3),
            "source": f"roofline of {card['source']}, efficiency as in \"efficiency\""}


def server(name, kind, nic, address=""):
    card = CARDS[kind]
    ks = range(1, max_layers(card) + 1)
    return {"name": name, "address": address, "kind": kind, "vram": card["vram_bytes"],
            "nic_in": nic, "nic_out": nic,
            "tokens_per_s_by_layers": [sig(typical_tput(card, k)) for k in ks],
            "kv_tokens_by_layers": [kv_tokens(card, k) for k in ks]}


def link(a, b, bw, lat, both=True):
    d = {"from": a, "to": b, "bandwidth": sig(bw), "latency": sig(lat)}
    if not both:
        d["bidirectional"] = False
    return d


def scenario(meta, kinds, servers, default_link, links, coord_nic, extra=None):
    doc = {"scenario": meta,
           "cards": {k: CARDS[k] for k in kinds},
           "efficiency": EFFICIENCY,
           "derivation": DERIVATION,
           "step_profiles": {k: step_profile(k) for k in kinds},
           "model": MODEL,
           "coordinator": {"nic_out": coord_nic, "nic_in": coord_nic},
           "default_link": default_link,
           "servers": servers,
           "links": links}
    if extra:
        doc.update(extra)
    return doc


# --- FusionAI: 50 x RTX 3080 at home vs 4 x H100 in one data center ------------------------

HOME_MBIT, HOME_RTT_MS = 100, 30
PLACEMENT_RULE = ("fusion's placement search (rt_place_search, seed 1) beside Petals' rule and Swarm's "
                  "stages; a card holds at most as many blocks as its kv_tokens_by_layers table lists")


def fusionai_3080():
    bw = HOME_MBIT * 1e6 / 8
    meta = {"name": "fusionai-50x3080",
            "title": "FusionAI: 50 x RTX 3080 (10 GB) in 50 homes, LLaMA-2 70B",
            "source": [FUSIONAI, HELIX, GA102],
            "precision": "fp16 weights and KV cache (1.53 GB per block as in Helix); fp16 fits: 50 cards "
                         "x up to 6 blocks each hold the 80 blocks three times over",
            "links": f"home links (assumed): {HOME_MBIT} Mbit/s symmetric per home (its NIC and every link "
                     f"from it), {HOME_RTT_MS} ms RTT between homes and to the coordinator; the "
                     "coordinator sits in a data center with a 1 Gbit/s NIC",
            "home_link": {"mbit_s": HOME_MBIT, "rtt_ms": HOME_RTT_MS},
            "placement_rule": PLACEMENT_RULE}
    servers = [server(f"home-{i:02d}", "RTX3080", bw) for i in range(50)]
    return scenario(meta, ["RTX3080"], servers, {"bandwidth": bw, "latency": HOME_RTT_MS / 2e3}, [], 1.25e8)


def fusionai_h100():
    bw = 400e9 / 8
    meta = {"name": "fusionai-4xh100",
            "title": "FusionAI: 4 x H100 SXM 80 GB in one data center, LLaMA-2 70B",
            "source": [FUSIONAI, HELIX, CARDS["H100-SXM"]["source"]],
            "precision": "fp16 weights and KV cache (1.53 GB per block as in Helix)",
            "links": "one data center: 400 Gbit/s, 10 us between the GPUs and to the coordinator "
                     "(NVLink is faster still; neither binds)",
            "placement_rule": PLACEMENT_RULE}
    servers = [server(f"h100-{i}", "H100-SXM", bw) for i in range(4)]
    return scenario(meta, ["H100-SXM"], servers, {"bandwidth": bw, "latency": 1e-5}, [], bw)


# --- DT-FM's five network cases: 64 V100 GPUs --------------------------------------------

# (RTT ms, Gbit/s) between AWS regions, as DT-FM's world-wide case gives them.
CITY_PAIRS = {
    ("Oregon", "Virginia"): (67, 0.79), ("Oregon", "Ohio"): (49, 1.10), ("Oregon", "Tokyo"): (96, 0.523),
    ("Oregon", "Seoul"): (124, 0.46), ("Oregon", "London"): (136, 0.42), ("Oregon", "Frankfurt"): (143, 0.404),
    ("Oregon", "Ireland"): (124, 0.482), ("Virginia", "Ohio"): (11, 1.12), ("Virginia", "Tokyo"): (143, 0.524),
    ("Virginia", "Seoul"): (172, 0.500), ("Virginia", "London"): (76, 1.16),
    ("Virginia", "Frankfurt"): (90, 1.02), ("Virginia", "Ireland"): (67, 1.05), ("Ohio", "Tokyo"): (130, 0.694),
    ("Ohio", "Seoul"): (159, 0.529), ("Ohio", "London"): (86, 1.05), ("Ohio", "Frankfurt"): (99, 0.799),
    ("Ohio", "Ireland"): (77, 1.14), ("Tokyo", "Seoul"): (34, 1.10), ("Tokyo", "London"): (210, 0.366),
    ("Tokyo", "Frankfurt"): (223, 0.36), ("Tokyo", "Ireland"): (199, 0.465), ("Seoul", "London"): (238, 0.342),
    ("Seoul", "Frankfurt"): (235, 0.358), ("Seoul", "Ireland"): (228, 0.335),
    ("London", "Frankfurt"): (14, 1.14), ("London", "Ireland"): (12, 1.09), ("Frankfurt", "Ireland"): (24, 1.08),
}
REGION_PAIRS = {("Virginia", "Oregon"): (67, 1.15), ("Virginia", "California"): (59, 1.05),
                ("Virginia", "Ohio"): (11, 1.12), ("Oregon", "California"): (12, 1.25),
                ("Oregon", "Ohio"): (49, 1.10), ("California", "Ohio"): (52, 1.02)}


def pair_matrix(groups, pairs, inside):
    """Symmetric latency and bandwidth matrices over `groups` from pair values and the in-group one."""
    lat = [[0.0] * len(groups) for _ in groups]
    bw = [[0.0] * len(groups) for _ in groups]
    for i, a in enumerate(groups):
        for j, b in enumerate(groups):
            v = inside if i == j else pairs.get((a, b)) or pairs[(b, a)]
            lat[i][j], bw[i][j] = v
    return lat, bw


def dtfm_cases():
    """(slug, title, group kind, groups, GPUs per group, latency ms, bandwidth Gbit/s, notes)."""
    inst = [f"instance-{i}" for i in range(8)]
    lat1 = [[0.0] * 8 for _ in range(8)]
    bw1 = [[100.0 if i == j else 3.125 for j in range(8)] for i in range(8)]
    spot = inst + ["p3.2xlarge-pool"]
    lat2 = [[0.0] * 9 for _ in range(9)]
    bw2 = [[100.0 if i == j and i < 8 else 1.25 for j in range(9)] for i in range(9)]
    lat3, bw3 = pair_matrix(["Ohio", "Virginia"], {("Ohio", "Virginia"): (11, 1.12)}, (1, 5))
    regions = ["Virginia", "Oregon", "California", "Ohio"]
    lat4, bw4 = pair_matrix(regions, REGION_PAIRS, (10, 2))
    cities = ["Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland"]
    lat5, bw5 = pair_matrix(cities, CITY_PAIRS, (10, 2))
    return [
        ("1-datacenter", "Case 1: one data center on demand, 8 x p3.16xlarge (8 V100 each)", "instance", inst,
         [8] * 8, lat1, bw1, "NVLink inside an instance (100 Gbit/s); the instances' 25 Gbit/s network "
         "shared by 8 GPUs: 3.125 Gbit/s per GPU pair; no added delay"),
        ("2-spot", "Case 2: spot instances in one data center, 8 x p3.8xlarge (4 V100) + 32 x p3.2xlarge",
         "instance", spot, [4] * 8 + [32], lat2, bw2, "100 Gbit/s inside a p3.8xlarge; 1.25 Gbit/s per GPU "
         "pair between instances (the pool row: any two single-GPU p3.2xlarge instances)"),
        ("3-multi-dc", "Case 3: two data centers, Ohio and Virginia, 32 V100 each", "region",
         ["Ohio", "Virginia"], [32, 32], lat3, bw3, "5 Gbit/s and 1 ms inside a data center"),
        ("4-regional", "Case 4: regional geo-distribution, 4 US regions x 16 V100", "region", regions,
         [16] * 4, lat4, bw4, "2 Gbit/s and 10 ms inside a region"),
        ("5-worldwide", "Case 5: world-wide, 8 cities on 3 continents x 8 V100", "city", cities, [8] * 8,
         lat5, bw5, "2 Gbit/s and 10 ms inside a city; measured between AWS regions"),
    ]


def dtfm_links(names, group_of, lat, bw):
    """default_link (the most common node pair value) and the links that differ from it."""
    def val(ga, gb):
        return (bw[ga][gb] * 1e9 / 8, lat[ga][gb] / 2e3)
    counts = {}
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            v = val(group_of[a], group_of[b])
            counts[v] = counts.get(v, 0) + 1
    dflt = max(sorted(counts), key=lambda v: counts[v])
    links = []
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            v = val(group_of[a], group_of[b])
            if v != dflt:
                links.append(link(names[a], names[b], *v))
    for a in range(len(names)):   # the coordinator sits in the first group
        v = val(0, group_of[a])
        if v != dflt:
            links.append(link("source", names[a], *v, both=False))
            links.append(link(names[a], "sink", *v, both=False))
    return {"bandwidth": sig(dflt[0]), "latency": sig(dflt[1])}, links


def dtfm(case):
    slug, title, gkind, groups, sizes, lat, bw, notes = case
    names, group_of, nodes = [], [], []
    for g, (grp, n) in enumerate(zip(groups, sizes)):
        for i in range(n):
            names.append(f"{grp.lower()}-{i}")
            group_of.append(g)
            nodes.append({"name": names[-1], gkind: grp, "gpu": "V100-SXM2 16 GB"})
    dflt, links = dtfm_links(names, group_of, lat, bw)
    meta = {"name": f"dtfm-{slug}", "title": f"DT-FM {title}, serving LLaMA-2 70B",
            "source": [DTFM, HELIX, CARDS["V100-SXM2"]["source"]],
            "precision": "fp16 weights and KV cache (1.53 GB per block as in Helix); a 16 GB V100 holds "
                         "up to 10 blocks",
            "links": f"DT-FM's matrices between {gkind}s ({notes}); a link carries half the delay as "
                     "one-way latency; NICs unlimited (the matrices give per-GPU shares); the "
                     f"coordinator sits in {groups[0]}",
            "placement_rule": PLACEMENT_RULE}
    servers = [server(n, "V100-SXM2", 0) for n in names]
    extra = {"dtfm": {"case": int(slug[0]), "title": title, "source": DTFM, "group_kind": gkind,
                      "groups": groups, "symmetric": True, "notes": notes,
                      "latency_ms": lat, "bandwidth_gbps": bw, "nodes": nodes}}
    return scenario(meta, ["V100-SXM2"], servers, dflt, links, 0, extra)


def main(argv):
    out = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                     "config", "scenarios")
    os.makedirs(out, exist_ok=True)
    docs = [fusionai_3080(), fusionai_h100()] + [dtfm(c) for c in dtfm_cases()]
    for doc in docs:
        path = os.path.join(out, doc["scenario"]["name"] + ".json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(doc, indent=1) + "\n")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
