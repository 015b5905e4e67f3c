"""Shared helpers for the oracle tests: build random-weight checkpoints in the
Hugging Face layout and run fusion's programs on them."""
import json
import os
import subprocess

import numpy as np

BUILD = os.environ.get("FUSION_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
SOURCE = os.environ.get("FUSION_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


def program(name):
    path = os.path.join(BUILD, "fusion-" + name)
    assert os.path.exists(path), f"{path} not built"
    return path


def default_model():
    out = subprocess.run([os.path.join(SOURCE, "scripts", "fetch-default-model.sh")],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def run_generate(model, ids, max_tokens, logits_path=None, extra=()):
    cmd = [program("generate"), "--model", model, "--prompt-ids", ",".join(map(str, ids)),
           "--max-tokens", str(max_tokens), "--json"]
    if logits_path:
        cmd += ["--logits-out", logits_path]
    cmd += list(extra)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stderr}"
    return json.loads(res.stdout)


def read_logits(path, vocab):
    data = np.fromfile(path, dtype=np.float32)
    assert data.size % vocab == 0
    return data.reshape(-1, vocab)
