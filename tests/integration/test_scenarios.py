"""test_scenarios.py -- config/scenarios/: the seeds' claims as cluster files.

The committed files are what scripts/gen-scenarios.py writes (regenerated into a temporary
folder and compared byte for byte); every file loads in fusion-sim; DT-FM's matrices are square,
symmetric, positive and carry the paper's numbers, and the swarm form's links agree with them;
the FusionAI tables follow the stated roofline; fusion-bench-scenarios prints every scenario and a
verdict, and refuses a missing folder or a broken file with a clear error.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("FUSION_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BUILD = Path(os.environ.get("FUSION_BUILD_DIR", ROOT / "build"))
SCEN = ROOT / "config" / "scenarios"
GEN = ROOT / "scripts" / "gen-scenarios.py"
NAMES = ["dtfm-1-datacenter", "dtfm-2-spot", "dtfm-3-multi-dc", "dtfm-4-regional", "dtfm-5-worldwide",
         "fusionai-4xh100", "fusionai-50x3080"]


def load(name):
    return json.loads((SCEN / f"{name}.json").read_text())


def test_generator_reproduces_the_committed_files(tmp_path):
    subprocess.run([sys.executable, str(GEN), str(tmp_path)], check=True, capture_output=True, timeout=60)
    made = sorted(p.name for p in tmp_path.glob("*.json"))
    assert made == sorted(p.name for p in SCEN.glob("*.json")) == sorted(f"{n}.json" for n in NAMES)
    for name in made:
        assert (tmp_path / name).read_bytes() == (SCEN / name).read_bytes(), f"{name} differs: rerun {GEN.name}"


@pytest.mark.parametrize("name", NAMES)
def test_every_scenario_loads_in_fusion_sim(name):
    doc = load(name)
    path = str(SCEN / f"{name}.json")
    out = subprocess.run([str(BUILD / "fusion-sim"), "--json", path, "--no-sim", "--quiet"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"servers = {len(doc['servers'])}" in out.stdout
    placed = subprocess.run([str(BUILD / "fusion-sim"), "--json", path, "--place", "swarm", "--no-sim", "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert placed.returncode == 0, placed.stderr
    flow = float(re.search(r"max_flow_tokens_per_s = ([0-9.]+)", placed.stdout).group(1))
    assert flow > 0 and "uncovered_blocks = 0" in placed.stdout


# (case, group a, group b, RTT ms, Gbit/s) as DT-FM gives them
PAPER = [
    (1, "instance-0", "instance-0", 0, 100), (1, "instance-0", "instance-5", 0, 3.125),
    (2, "instance-3", "instance-3", 0, 100), (2, "instance-3", "p3.2xlarge-pool", 0, 1.25),
    (2, "p3.2xlarge-pool", "p3.2xlarge-pool", 0, 1.25),
    (3, "Ohio", "Virginia", 11, 1.12), (3, "Ohio", "Ohio", 1, 5),
    (4, "Virginia", "Oregon", 67, 1.15), (4, "Oregon", "California", 12, 1.25),
    (4, "California", "Ohio", 52, 1.02), (4, "Ohio", "Ohio", 10, 2),
    (5, "Oregon", "Virginia", 67, 0.79), (5, "Tokyo", "Seoul", 34, 1.10), (5, "Seoul", "London", 238, 0.342),
    (5, "London", "Frankfurt", 14, 1.14), (5, "Virginia", "Ireland", 67, 1.05), (5, "Tokyo", "Tokyo", 10, 2),
]
DTFM = {int(n.split("-")[1]): n for n in NAMES if n.startswith("dtfm")}


@pytest.mark.parametrize("case", sorted(DTFM))
def test_dtfm_matrices_are_square_symmetric_positive(case):
    d = load(DTFM[case])["dtfm"]
    lat, bw, groups = d["latency_ms"], d["bandwidth_gbps"], d["groups"]
    assert d["case"] == case and d["symmetric"] is True and "Yuan et al." in d["source"]
    assert len(lat) == len(bw) == len(groups) and all(len(r) == len(groups) for r in lat + bw)
    for i in range(len(groups)):
        for j in range(len(groups)):
            assert bw[i][j] > 0 and lat[i][j] >= 0
            assert lat[i][j] == lat[j][i] and bw[i][j] == bw[j][i]
            if case >= 3 and i != j:
                assert lat[i][j] > 0
    assert len(d["nodes"]) == 64 and all(n["gpu"].startswith("V100") for n in d["nodes"])
    assert {n[d["group_kind"]] for n in d["nodes"]} == set(groups)
    if case == 5:
        assert groups == ["Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland"]


@pytest.mark.parametrize("case,a,b,rtt,gbps", PAPER)
def test_dtfm_matrices_carry_the_papers_numbers(case, a, b, rtt, gbps):
    d = load(DTFM[case])["dtfm"]
    i, j = d["groups"].index(a), d["groups"].index(b)
    assert d["latency_ms"][i][j] == rtt and d["bandwidth_gbps"][i][j] == gbps


def swarm_link(doc, a, b):
    for ln in doc["links"]:
        if {ln["from"], ln["to"]} == {a, b}:
            return ln["bandwidth"], ln["latency"]
    return doc["default_link"]["bandwidth"], doc["default_link"]["latency"]


@pytest.mark.parametrize("case", sorted(DTFM))
def test_dtfm_swarm_links_follow_the_matrices(case):
    doc = load(DTFM[case])
    d = doc["dtfm"]
    group = {n["name"]: d["groups"].index(n[d["group_kind"]]) for n in d["nodes"]}
    names = [s["name"] for s in doc["servers"]]
    assert names == [n["name"] for n in d["nodes"]]
    for a in names[::7]:
        for b in names[3::11]:
            if a == b:
                continue
            ga, gb = group[a], group[b]
            bw, lat = swarm_link(doc, a, b)
            assert bw == pytest.approx(d["bandwidth_gbps"][ga][gb] * 1e9 / 8, rel=1e-5)
            assert lat == pytest.approx(d["latency_ms"][ga][gb] / 2e3, rel=1e-5)


@pytest.mark.parametrize("name,kind,k_max", [("fusionai-50x3080", "RTX3080", 6), ("fusionai-4xh100", "H100-SXM", 55)])
def test_fusionai_tables_follow_the_roofline(name, kind, k_max):
    doc = load(name)
    card, eff, m = doc["cards"][kind], doc["efficiency"], doc["model"]
    assert eff["basis"].startswith("measured: fusion's CUDA kernels")
    for key in ("bandwidth", "flops", "kv_bandwidth", "attention_flops"):
        assert 0 < eff[key] <= 1, key
    assert 0 <= eff["step_overhead_ms"] < 1
    s = doc["servers"][0]
    kv = s["kv_tokens_by_layers"]
    assert len(kv) == len(s["tokens_per_s_by_layers"]) == k_max
    reserve = doc["derivation"]["kv_reserve_bytes"]
    for k, tokens in enumerate(kv, 1):
        assert tokens == (card["vram_bytes"] - k * m["layer_bytes"] - reserve) // (m["kv_bytes_per_token_layer"] * k)
    tput = s["tokens_per_s_by_layers"]
    assert all(x > y for x, y in zip(tput, tput[1:]))
    prof = doc["step_profiles"][kind]
    bw, over = card["mem_bandwidth_bytes_per_s"] * eff["bandwidth"], eff["step_overhead_ms"]
    assert dict(prof["decode"])[1] == pytest.approx(m["layer_bytes"] / bw * 1e3 + over, rel=1e-5)
    flops = card["fp16_flops"] * eff["flops"]
    attention = 2 * 8192 * 8192 * 751 / (card["fp32_flops"] * eff["attention_flops"])  # 8192 tokens of 750-token prompts
    assert dict(prof["prompt"])[8192] == pytest.approx(
        (2 * doc["derivation"]["layer_params"] * 8192 / flops + attention) * 1e3 + over, rel=1e-5)
    kv_rate = card["mem_bandwidth_bytes_per_s"] * eff["kv_bandwidth"]
    assert prof["decode_ctx_ms_per_token"] == pytest.approx(m["kv_bytes_per_token_layer"] / kv_rate * 1e3, rel=1e-5)
    assert "FusionAI" in doc["scenario"]["source"][0]


def bench(*args):
    return subprocess.run([str(BUILD / "fusion-bench-scenarios"), "--evals", "30", "--sim-duration", "30", *args],
                          capture_output=True, text=True, timeout=300)


def test_bench_prints_every_scenario_and_the_verdict():
    out = bench("--dir", str(SCEN))
    assert out.returncode == 0, out.stderr
    assert re.search(r"^fusion-bench-scenarios: CPU .+;", out.stdout, re.M)
    for name in NAMES:
        assert load(name)["scenario"]["title"] in out.stdout
    assert out.stdout.count("fusion search") == len(NAMES)
    assert "home link sweep" in out.stdout and "RTT sweep" in out.stdout
    for measure in ("max flow", "simulated decode"):
        assert re.search(rf"^  by {measure}: FusionAI's claim (is refuted|holds)", out.stdout, re.M), measure
    assert re.search(r"^  efficiency: weights 0\.80 of bandwidth, matmuls 0\.58 of FLOPs, KV reads 0\.028 of "
                     r"bandwidth, prompt attention 0\.0128 of fp32 FLOPs, 0\.09 ms a block step besides \(measured: ",
                     out.stdout, re.M)


def test_bench_refuses_bad_input(tmp_path):
    out = bench("--dir", str(tmp_path / "absent"))
    assert out.returncode == 1 and "cannot open the scenario folder" in out.stderr
    out = bench("--dir", str(tmp_path))
    assert out.returncode == 1 and "no *.json scenarios" in out.stderr
    (tmp_path / "broken.json").write_text('{"model": ')
    out = bench("--dir", str(tmp_path))
    assert out.returncode == 1 and "broken.json" in out.stderr
