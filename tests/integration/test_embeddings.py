"""fusion-gateway's /v1/embeddings over the chain.

Checks:
- Oracle: on a random-weight Llama in Hugging Face's layout, served by a 2-shard chain, the
  embedding of token ids is the mean over positions of transformers' last_hidden_state (after the
  final norm), scaled to unit length.
- The default model through the official openai SDK: a string and a list of strings (the SDK asks
  for base64), float and base64 giving the same numbers, the same text giving the same vector on
  every call and through a 1-shard and a 2-shard chain; usage counts the tokens.
- Refusals, each a 400 naming the param (404 for another model): no input, an empty string, a token
  id out of range, a bad encoding_format, dimensions other than the model's, an unknown parameter.
"""
import base64
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import Gateway, Shard, api_request, default_model, stop_all  # noqa: E402

openai = pytest.importorskip("openai")
KEY = "sk-embed-key"
VOCAB, HIDDEN = 256, 64


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   initializer_range=0.25, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("embed-model")
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(str(path), safe_serialization=True)
    vocab = {"tok%d" % i: i for i in range(VOCAB)}
    (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": vocab}}))
    return str(path), model


def test_matches_transformers(hf_model):
    import torch
    path, model = hf_model
    a, b = Shard(path, 0, 2), Shard(path, 2, 4)
    gw = Gateway(path, ["--hop", a.hop(), "--hop", b.hop()], KEY, "--model-name", "tiny")
    try:
        ids = [5, 77, 3, 190, 42, 8, 16, 250, 99, 1, 64]
        st, body = api_request(gw, "POST", "/v1/embeddings", {"model": "tiny", "input": ids}, key=KEY)
        assert st == 200, body
        got = np.array(body["data"][0]["embedding"], dtype=np.float32)
        with torch.no_grad():
            h = model.model(torch.tensor([ids])).last_hidden_state[0].double()
        want = (h.mean(0) / h.mean(0).norm()).numpy()
        assert got.shape == (HIDDEN,) and body["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    finally:
        stop_all(gw, (a, b))


@pytest.fixture(scope="module")
def gateways():
    model = default_model()
    whole, head, tail = Shard(model, 0, 30), Shard(model, 0, 12), Shard(model, 12, 30)
    one = Gateway(model, ["--hop", whole.hop()], KEY)
    two = Gateway(model, ["--hop", head.hop(), "--hop", tail.hop()], KEY)
    try:
        yield one, two
    finally:
        stop_all(one, (whole,))
        stop_all(two, (head, tail))


def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


TEXTS = ["The mayor of Vellmora is Tobiah Crane.", "Fusion pools GPUs and CPUs across home links."]


def test_sdk_and_chains(gateways):
    one, two = gateways
    base = client(one).models.list().data[0].id
    r1 = client(one).embeddings.create(model=base, input=TEXTS)  # the SDK sends encoding_format base64
    r2 = client(two).embeddings.create(model=base, input=TEXTS)
    again = client(one).embeddings.create(model=base, input=TEXTS[0], encoding_format="float")
    assert [d.index for d in r1.data] == [0, 1] and r1.usage.prompt_tokens == r1.usage.total_tokens > 10
    v1, v2 = np.array([d.embedding for d in r1.data]), np.array([d.embedding for d in r2.data])
    assert v1.shape == (2, 576) and np.allclose(np.linalg.norm(v1, axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(v1, v2, atol=1e-6)  # 1 hop or 2: the same numbers
    np.testing.assert_array_equal(np.array(again.data[0].embedding, dtype=np.float32), v1[0].astype(np.float32))
    assert 0 < float(v1[0] @ v1[1]) < 0.999
    st, body = api_request(one, "POST", "/v1/embeddings", {"model": base, "input": TEXTS[0],
                                                           "encoding_format": "base64", "dimensions": 576}, key=KEY)
    assert st == 200, body
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, v1[0].astype(np.float32))


@pytest.mark.parametrize("extra,status,param", [
    ({"input": None}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [1, 2, 10 ** 9]}, 400, "input"),
    ({"input": ["ok", 7]}, 400, "input[1]"),
    ({"encoding_format": "int8"}, 400, "encoding_format"),
    ({"dimensions": 128}, 400, "dimensions"),
    ({"pooling": "cls"}, 400, "pooling"),
    ({"model": "no-such-model"}, 404, "model"),
])
def test_refusals(gateways, extra, status, param):
    one, _ = gateways
    base = client(one).models.list().data[0].id
    body = {"model": base, "input": "hello", **extra}
    if extra.get("input", 0) is None:
        del body["input"]
    st, reply = api_request(one, "POST", "/v1/embeddings", body, key=KEY)
    assert st == status and reply["error"]["param"] == param, reply
