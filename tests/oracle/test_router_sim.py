"""test_router_sim.py -- fusion-sim's max flow vs an independent networkx rebuild of Helix's
flow graph (from the Helix ini/csv files and the formulas in anchors/helix/README.md section 5),
on Helix's clusters with its published placements, random placements, and fusion's own search
(whose placement is also checked for coverage and per-server layer limits)."""
import configparser
import csv
import json
import os
import random
import re
import subprocess
import zlib

import networkx as nx
import pytest

SRC = os.environ.get("FUSION_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
HELIX = os.path.join(SRC, "..", "shared", "anchors", "helix")
AE = os.path.join(HELIX, "artifact_evaluation")
BUILD = os.environ.get("FUSION_BUILD_DIR", os.path.join(SRC, "build"))
SIM = os.path.join(BUILD, "fusion-sim")
UNITS = {"kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9, "Byte": 1,
         "MilliSec": 1e-3}

pytestmark = pytest.mark.skipif(not os.path.isdir(HELIX), reason="Helix anchors not present")


def ev(expr):
    v = 1.0
    for f in expr.split("*"):
        f = f.strip()
        v *= UNITS[f] if f in UNITS else float(f)
    return v


def read_ini(path):
    cp = configparser.ConfigParser(interpolation=None)
    cp.optionxform = str
    cp.read(path)
    return cp


class Cluster:
    """Independent reading of a Helix cluster for one model."""

    def __init__(self, cluster_ini, model):
        consts = json.load(open(os.path.join(HELIX, "derived/model_constants.json")))["models"][model]
        self.L = consts["num_layers"]
        self.tok = consts["token_size_bytes"]
        self.act = consts["activation_size_bytes"]
        c = read_ini(cluster_ini)
        prof = read_ini(os.path.join(HELIX, "simulator/model_manager/google_machine_profiles.ini"))
        n = int(c["NodeNames"]["total_compute_nodes"])
        self.types = [c[f"ComputeNode-{i}"]["type"] for i in range(n)]
        self.nic_in = [ev(prof[t]["inbound_nic_speed"]) for t in self.types]
        self.nic_out = [ev(prof[t]["outbound_nic_speed"]) for t in self.types]
        self.src_nic = ev(prof["SourceNode"]["outbound_nic_speed"])
        self.sink_nic = ev(prof["SinkNode"]["inbound_nic_speed"])
        self.links = {}
        for sec in c.sections():
            m = re.fullmatch(r"Link-(\w+)-(\w+)", sec)
            if not m:
                continue
            a, b = m.groups()
            bw = ev(c[sec]["bandwidth"])
            a = a if a in ("source", "sink") else int(a)
            b = b if b in ("source", "sink") else int(b)
            self.links[(a, b)] = bw
            if a not in ("source",) and b not in ("sink",):
                self.links[(b, a)] = bw
        counts = {}
        for t in self.types:
            counts[t] = counts.get(t, 0) + 1
        key = "+".join(f"{t}x{counts[t]}" for t in sorted(counts))
        self.tp = {}
        for row in csv.DictReader(open(os.path.join(HELIX, "derived/node_capacity_by_layers.csv"))):
            comp = row["cluster_composition"]
            if row["model"] != model or not (comp == key or comp.startswith(key + " (")
                                             or f"({key})" in comp):
                continue
            self.tp[(row["gpu_type"], int(row["num_layers"]))] = float(
                row["typical_token_throughput_tokens_per_s"])
        self.maxk = {t: max(k for (tt, k) in self.tp if tt == t) for t in counts}

    def maxflow(self, spans, conv="runtime", partial=False):
        """spans: {node: (first, last)}; Helix's runtime (5.3) or MILP (5.2) graph."""
        g = nx.DiGraph()
        tok, act, L = self.tok, self.act, self.L

        def valid(i, j):
            ei, sj, ej = spans[i][1], spans[j][0], spans[j][1]
            return ei == sj or (partial and sj <= ei < ej)

        nodes = list(spans)
        hops = [(i, j) for i in nodes for j in nodes if i != j and (i, j) in self.links and valid(i, j)]
        if conv == "runtime":
            g.add_edge("source", "source_out", capacity=self.src_nic / tok)
            g.add_edge("sink_in", "sink", capacity=self.sink_nic / tok)
        else:
            g.add_edge("source", "source_out")
            g.add_edge("sink_in", "sink")
        for i in nodes:
            k = spans[i][1] - spans[i][0]
            tp = self.tp[(self.types[i], k)]
            if conv == "runtime":
                s_in = tok + act if any(j for (j, v) in hops if v == i) or any(v == i for (_, v) in hops) else tok
                s_out = tok + act if any(u == i for (u, _) in hops) else tok
                g.add_edge(("in", i), ("start", i), capacity=self.nic_in[i] / s_in)
                g.add_edge(("start", i), ("end", i), capacity=tp)
                g.add_edge(("end", i), ("out", i), capacity=self.nic_out[i] / s_out)
            else:
                g.add_edge(("in", i), ("start", i))
                g.add_edge(("start", i), ("end", i),
                           capacity=min(tp, min(self.nic_in[i], self.nic_out[i]) / act))
                g.add_edge(("end", i), ("out", i))
            if spans[i][0] == 0 and ("source", i) in self.links:
                g.add_edge("source_out", ("in", i), capacity=self.links[("source", i)] / tok)
            if spans[i][1] == L and (i, "sink") in self.links:
                g.add_edge(("out", i), "sink_in", capacity=self.links[(i, "sink")] / tok)
        for (i, j) in hops:
            g.add_edge(("out", i), ("in", j),
                       capacity=self.links[(i, j)] / (tok + act if conv == "runtime" else act))
        if "sink" not in g or "source" not in g:
            return 0.0
        return nx.maximum_flow_value(g, "source", "sink")


def run_sim(args):
    out = subprocess.run([SIM, "--no-sim", "--quiet"] + args, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    kv = dict(line.split(" = ", 1) for line in out.stdout.splitlines() if " = " in line)
    return kv


def write_sol(path, spans):
    with open(path, "w") as f:
        f.write("[Settings]\noffset=2\n\n[Solution]\n")
        for i, (a, b) in sorted(spans.items()):
            f.write(f"compute_node_{i + 2}={list(range(a, b))}\n")


CASES = [
    # (cluster, model, placement, partial)
    ("single_cluster/config/cluster24.ini", "llama2_70b", "single_cluster/layout_llama70b/ilp/ilp_sol.ini", False),
    ("single_cluster/config/cluster24.ini", "llama2_70b", "single_cluster/layout_llama70b/swarm/swarm_sol.ini", False),
    ("single_cluster/config/cluster24.ini", "llama2_70b", "single_cluster/layout_llama70b/petals/petals_sol.ini", True),
    ("single_cluster/config/cluster24.ini", "llama1_30b", "single_cluster/layout_llama30b/swarm/swarm_sol.ini", False),
    ("single_cluster/config/cluster24.ini", "llama1_30b", "single_cluster/layout_llama30b/petals/petals_sol.ini", True),
    ("single_cluster/config/a100.ini", "llama1_30b", "single_cluster/layout_llama30b/ilp/a100/ilp_sol.ini", False),
    ("single_cluster/config/l4.ini", "llama1_30b", "single_cluster/layout_llama30b/ilp/l4/ilp_sol.ini", False),
    ("single_cluster/config/t4.ini", "llama1_30b", "single_cluster/layout_llama30b/ilp/t4/ilp_sol.ini", False),
    ("distributed_clusters/config/3cluster24.ini", "llama2_70b", "distributed_clusters/layout_llama70b/ilp/ilp_sol.ini", False),
    ("distributed_clusters/config/3cluster24.ini", "llama2_70b", "distributed_clusters/layout_llama70b/swarm/swarm_sol.ini", False),
    ("distributed_clusters/config/3cluster24.ini", "llama2_70b", "distributed_clusters/layout_llama70b/petals/petals_sol.ini", True),
    ("ablation/config/3cluster24.ini", "llama2_70b", "ablation/layouts/no_prune_24/ilp_sol.ini", False),
    ("ablation/config/cluster10.ini", "llama1_30b", "ablation/layouts/quality/ilp_sol.ini", False),
]

# Helix's own figures for the cases above (derived/placement_maxflow.csv; Gurobi objectives).
PUBLISHED = [1289.6, 757.9, 952.1, 889.8, 898.6, 1044.5, 215.0, 397.7, 1212.2, 616.5, 952.1, 952.1, 286.6]


def read_spans(sol):
    c = read_ini(sol)
    off = int(c["Settings"]["offset"])
    spans = {}
    for k, v in c["Solution"].items():
        layers = json.loads(v)
        spans[int(k.split("_")[-1]) - off] = (layers[0], layers[-1] + 1)
    return spans


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_helix_placements(idx):
    cl, model, sol, partial = CASES[idx]
    c = Cluster(os.path.join(AE, cl), model)
    spans = read_spans(os.path.join(AE, sol))
    args = ["--helix-cluster", os.path.join(AE, cl), "--model", model, "--placement", os.path.join(AE, sol)]
    if partial:
        args.append("--partial")
    kv = run_sim(args)
    ref_rt = c.maxflow(spans, "runtime", partial)
    ref_ilp = c.maxflow(spans, "ilp", partial)
    assert float(kv["max_flow_tokens_per_s"]) == pytest.approx(ref_rt, abs=0.06)
    assert float(kv["max_flow_ilp_convention"]) == pytest.approx(ref_ilp, abs=0.06)
    assert ref_ilp == pytest.approx(PUBLISHED[idx], abs=0.06)


@pytest.mark.parametrize("cl,model", [("single_cluster/config/cluster24.ini", "llama2_70b"),
                                      ("distributed_clusters/config/3cluster24.ini", "llama2_70b"),
                                      ("ablation/config/cluster10.ini", "llama1_30b")])
def test_random_placements(tmp_path, cl, model):
    c = Cluster(os.path.join(AE, cl), model)
    rng = random.Random(zlib.crc32(cl.encode()))
    n = len(c.types)
    nonzero = 0
    for trial in range(12):
        # random chains: servers in random order take consecutive spans of random length,
        # wrapping to a new chain at the last layer; some servers get arbitrary spans
        spans, pos = {}, 0
        order = list(range(n))
        rng.shuffle(order)
        for i in order:
            mk = c.maxk[c.types[i]]
            k = mk if rng.random() < 0.7 else rng.randint(1, mk)
            if rng.random() < 0.08:
                a = rng.randint(0, c.L - k)
                spans[i] = (a, a + k)
                continue
            a, b = pos, min(pos + k, c.L)
            spans[i] = (a, b)
            pos = 0 if b == c.L else b
        partial = trial % 3 == 2
        sol = tmp_path / f"r{trial}.ini"
        write_sol(sol, spans)
        args = ["--helix-cluster", os.path.join(AE, cl), "--model", model, "--placement", str(sol)]
        if partial:
            args.append("--partial")
        kv = run_sim(args)
        ref = c.maxflow(spans, "runtime", partial)
        nonzero += ref > 0
        assert float(kv["max_flow_tokens_per_s"]) == pytest.approx(ref, abs=0.06)
        assert float(kv["max_flow_ilp_convention"]) == pytest.approx(
            c.maxflow(spans, "ilp", partial), abs=0.06)
    assert nonzero >= 3


@pytest.mark.parametrize("cl,ilp", [
    ("single_cluster/config/cluster24.ini", 1289.6),
    ("distributed_clusters/config/3cluster24.ini", 1212.2)])
def test_search_beats_milp(tmp_path, cl, ilp):
    out = tmp_path / "placed.json"
    kv = run_sim(["--helix-cluster", os.path.join(AE, cl), "--place", "search", "--time", "3",
                  "--save-json", str(out)])
    flow = float(kv["max_flow_tokens_per_s"])
    assert flow >= ilp, f"fusion search {flow} < Helix MILP {ilp}"
    # the saved placement must be valid and its flow real (independent rebuild)
    c = Cluster(os.path.join(AE, cl), "llama2_70b")
    saved = json.load(open(out))
    # the compact format: profiles once per kind, links as [from, to, bandwidth, latency]
    assert set(saved["kinds"]) == {s.get("profile", s["kind"]) for s in saved["servers"]}
    assert saved["links"] and all(isinstance(l, list) and len(l) == 4 for l in saved["links"])
    spans = {}
    for s in saved["servers"]:
        i = int(s["name"].split("-")[1])
        a, b = s["span"]
        assert 1 <= b - a <= c.maxk[c.types[i]], s
        spans[i] = (a, b)
    covered = set()
    for a, b in spans.values():
        covered.update(range(a, b))
    assert covered == set(range(c.L))
    assert c.maxflow(spans, "runtime") == pytest.approx(flow, abs=0.06)
    # fusion's JSON format round-trips to the same flow
    kv2 = run_sim(["--json", str(out)])
    assert float(kv2["max_flow_tokens_per_s"]) == pytest.approx(flow, abs=0.06)
