#!/usr/bin/env python3
"""Writes seed inputs for fuzz_http_request: a mode byte (0/2 chat body, 1/3 completions body,
4 a header value) then the body or the value."""
import json
import os
import sys

CHAT = [
    {"model": "m", "messages": [{"role": "user", "content": "Hi!"}]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}],
     "max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "stop": ["\n", "END"], "n": 2, "seed": 7, "stream": True,
     "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2, "logit_bias": {"5": -100}},
    {"messages": [{"role": "user", "content": "weather?"}], "tool_choice": "auto",
     "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]},
    {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                        "function": {"name": "get", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "c", "content": "sunny"}]},
    {"model": "m", "messages": [{"role": "user", "content": "json"}],
     "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
         "type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}, "required": ["a"]}}}},
    {"model": "m", "messages": [{"role": "user", "content": "json"}], "response_format": {"type": "json_object"}},
    {"model": "m", "messages": [{"role": "user", "content": "?"}], "grammar": "root ::= \"yes\" | \"no\"\n"},
    {"model": "m", "messages": [{"role": "wizard", "content": "?"}], "frobnicate": 1},
]
COMPLETIONS = [
    {"model": "m", "prompt": "Once upon", "max_tokens": 4},
    {"prompt": [[1, 2, 3], "text", [4]], "echo": True, "logprobs": 2, "n": 1, "best_of": 1, "ignore_eos": True,
     "return_tokens_as_token_ids": True, "stop": "x", "presence_penalty": 0.5, "frequency_penalty": -0.5},
    {"prompt": [1, 2, 3], "max_tokens": 0, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "user": "u"},
    {"model": "m", "prompt": "x", "json_schema": {"enum": ["a", "b"]}},
]
HEADERS = ["localhost", "localhost:8080", "127.0.0.1:65535", "[::1]:8080", "[::1]", "example.com:99999",
           "http://localhost:8080", "https://app.example.test", "null", "application/json",
           "application/json; charset=utf-8", "text/plain", " Application/JSON ;x=y"]


def main(out):
    os.makedirs(out, exist_ok=True)
    seeds = [bytes([m]) + json.dumps(b).encode() for b in CHAT for m in (0, 2)]
    seeds += [bytes([m]) + json.dumps(b).encode() for b in COMPLETIONS for m in (1, 3)]
    seeds += [b"\x04" + h.encode() for h in HEADERS]
    for i, s in enumerate(seeds):
        with open(os.path.join(out, "seed-%03d" % i), "wb") as f:
            f.write(s)


if __name__ == "__main__":
    main(sys.argv[1])
