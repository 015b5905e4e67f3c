"""LoRA adapters served by fusion-gateway over a chain of two fusion-shard processes (the default
SmolLM2 model): --lora NAME=DIR at start and vLLM's load/unload endpoints at run time; /v1/models
lists each adapter with the base as its parent; "model": NAME decodes with the adapter, the same
greedy tokens as fusion-generate --lora in one process, while requests with another adapter and
with none run at the same time through the same shards (batched together); the shards get each
adapter's slices on first use. Refusals: an unknown model (404 model_not_found), an adapter
directory outside --lora-dir (403), a malformed adapter (400 naming the tensor), a name taken
(400), unloading an unknown name (404), runtime loads without --lora-dir (403)."""
import json
import os
import subprocess
import threading

import numpy as np
import pytest

from shard_cluster import Gateway, Shard, api_request, default_model, program

KEY = "lora-test-key-0123456789"
PROMPT = [1, 504, 3458, 282, 4582, 314]  # token ids: a fixed prompt
SHAPES = dict(q_proj=(576, 576), k_proj=(192, 576), v_proj=(192, 576), o_proj=(576, 576),
              gate_proj=(1536, 576), up_proj=(1536, 576), down_proj=(576, 1536))


def write_adapter(path, seed, targets=("q_proj", "v_proj", "down_proj"), r=4, layers=30):
    """A PEFT adapter for SmolLM2-135M with random A and B, large enough to change its output."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for t in targets:
            out_f, in_f = SHAPES[t]
            parent = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            pre = f"base_model.model.model.layers.{layer}.{parent}.{t}"
            tensors[f"{pre}.lora_A.weight"] = (rng.uniform(-1, 1, (r, in_f)) / np.sqrt(in_f)).astype(np.float32)
            tensors[f"{pre}.lora_B.weight"] = (0.5 * rng.standard_normal((out_f, r))).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "lora_dropout": 0.0, "bias": "none",
                   "target_modules": list(targets), "task_type": "CAUSAL_LM"}, f)
    return path


def reference(model, adapter=None, max_tokens=8):
    cmd = [program("generate"), "--model", model, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens",
           str(max_tokens), "--json", "--ignore-eos", "--threads", "2"]
    if adapter:
        cmd += ["--lora", adapter]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["text"]


def complete(gw, model_id, max_tokens=8):
    st, body = api_request(gw, "POST", "/v1/completions", {"model": model_id, "prompt": PROMPT, "max_tokens": max_tokens,
                                                         "temperature": 0, "ignore_eos": True}, key=KEY)
    return st, body


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    lora_dir = root / "served"
    alpha = write_adapter(str(lora_dir / "alpha"), 1)
    beta = write_adapter(str(lora_dir / "beta"), 2, targets=("k_proj", "o_proj", "gate_proj", "up_proj"), r=8)
    outside = write_adapter(str(root / "outside"), 3)
    model = default_model()
    a, b = Shard(model, 0, 15), Shard(model, 15, 30)
    gw = Gateway(model, ["--hop", a.hop(), "--hop", b.hop()], KEY, "--lora", f"alpha={alpha}", "--lora-dir",
                 str(lora_dir), "--model-name", "smollm2")
    try:
        yield dict(model=model, gw=gw, shards=(a, b), alpha=alpha, beta=beta, outside=outside, root=root)
    finally:
        gw.stop()
        a.stop()
        b.stop()


def test_models_list_adapters(cluster):
    st, models = api_request(cluster["gw"], "GET", "/v1/models", key=KEY)
    assert st == 200
    by_id = {m["id"]: m for m in models["data"]}
    assert by_id["alpha"]["parent"] == "smollm2" and "parent" not in by_id["smollm2"]
    st, one = api_request(cluster["gw"], "GET", "/v1/models/alpha", key=KEY)
    assert st == 200 and one["id"] == "alpha"


def test_adapter_matches_one_process_and_mixes_with_base(cluster):
    gw, model = cluster["gw"], cluster["model"]
    st, load = api_request(gw, "POST", "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": cluster["beta"]},
                           key=KEY)
    assert st == 200, load
    want = {None: reference(model), "alpha": reference(model, cluster["alpha"]),
            "beta": reference(model, cluster["beta"])}
    assert len(set(want.values())) == 3  # each adapter changes the output
    got = {}

    def run(name):
        st, body = complete(gw, name or "smollm2")
        got[name] = (st, body)

    threads = [threading.Thread(target=run, args=(n,)) for n in (None, "alpha", "beta") * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, text in want.items():
        st, body = got[name]
        assert st == 200, body
        assert body["choices"][0]["text"] == text, name


def test_openai_sdk_selects_adapter(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster["gw"].url + "/v1", api_key=KEY)
    out = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == reference(cluster["model"], cluster["alpha"])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=2)


def test_load_unload_refusals(cluster):
    gw, root = cluster["gw"], cluster["root"]
    st, err = api_request(gw, "POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": cluster["outside"]},
                          key=KEY)
    assert st == 403, err
    bad = root / "served" / "broken"
    write_adapter(str(bad), 4)
    with open(bad / "adapter_model.safetensors", "r+b") as f:  # a tensor of the wrong shape in the header
        data = f.read()
        data = data.replace(b'"shape":[4,576]', b'"shape":[4,575]', 1)
        f.seek(0)
        f.write(data)
    st, err = api_request(gw, "POST", "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(bad)}, key=KEY)
    assert st == 400 and "lora_A" in err["error"]["message"], err
    st, err = api_request(gw, "POST", "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": cluster["alpha"]},
                          key=KEY)
    assert st == 400 and "already been loaded" in err["error"]["message"]
    st, err = api_request(gw, "POST", "/v1/unload_lora_adapter", {"lora_name": "nope"}, key=KEY)
    assert st == 404 and err["error"]["code"] == "model_not_found"
    st, _ = api_request(gw, "POST", "/v1/unload_lora_adapter", {"lora_name": "alpha"}, key=KEY)
    assert st == 200
    st, err = complete(gw, "alpha")
    assert st == 404 and err["error"]["code"] == "model_not_found"
    st, body = complete(gw, "smollm2")  # the base is unaffected
    assert st == 200 and body["choices"][0]["text"] == reference(cluster["model"])
    assert all(s.proc.poll() is None for s in cluster["shards"])


def test_runtime_loads_need_lora_dir(tmp_path):
    model = default_model()
    a = Shard(model, 0, 30)
    gw = Gateway(model, ["--hop", a.hop()], KEY)
    try:
        path = write_adapter(str(tmp_path / "a"), 5)
        st, err = api_request(gw, "POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": path}, key=KEY)
        assert st == 403 and "--lora-dir" in err["error"]["message"]
    finally:
        gw.stop()
        a.stop()
