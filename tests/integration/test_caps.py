"""What one holder of the swarm secret may cost the swarm, end to end on the default model.

A gateway with --swarm-listen and --max-members 2; two shards join it holding every block, each with
--max-step-tokens 16. A third shard's Join is refused (RESOURCE_EXHAUSTED naming the cap) and
completions go on working. A completion whose prompt is over a shard's step budget is the client's
400 ("request_too_large", in OpenAI's error shape, with the shard's figures and no internal
address), and neither shard is retired for it: the next request is served by the same members.
"""
import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import shard_cluster  # noqa: E402
from shard_cluster import Gateway, by_address, default_model, wait_for  # noqa: E402
from test_swarm_join import JoinShard  # noqa: E402

KEY = "sk-test-caps-key"
PROMPT = [504, 1552, 3732, 3434, 359]
STEP_BUDGET = 16


def request(gw, method, path, body=None, timeout=60):
    return shard_cluster.api_request(gw, method, path, body, KEY, timeout)


def swarm(gw):
    return shard_cluster.swarm_doc(gw, KEY)


@pytest.fixture(scope="module")
def cluster():
    model = default_model()
    shards, gw = [], None
    port_file = os.path.join(tempfile.mkdtemp(prefix="caps-"), "swarm-port")
    try:
        gw = Gateway(model, ["--swarm-listen", "127.0.0.1:0", "--swarm-port-file", port_file], KEY,
                     "--max-members", "2", "--heartbeat-ms", "250", "--heartbeat-timeout-ms", "3000",
                     "--spares", "0", "--step-timeout-ms", "20000")
        wait_for(lambda: os.path.exists(port_file), "the swarm port file")
        join = f"127.0.0.1:{int(open(port_file).read())}"
        st, models = request(gw, "GET", "/v1/models")
        assert st == 200, models
        for _ in range(2):
            shards.append(JoinShard(model, join, ["--blocks", "0:30", "--max-step-tokens", str(STEP_BUDGET)]))
        for s in shards:
            s.wait_started()
        wait_for(lambda: swarm(gw)["active"] == 2, "two members serving")
        yield {"model": model, "gw": gw, "shards": shards, "join": join, "model_id": models["data"][0]["id"]}
    finally:
        if gw:
            gw.stop()
        for s in shards:
            s.kill()


def completion(cluster, prompt, max_tokens=4):
    body = shard_cluster.completion_body(cluster["model_id"], prompt, max_tokens, False)
    return request(cluster["gw"], "POST", "/v1/completions", body)


def test_member_cap(cluster):
    gw = cluster["gw"]
    extra = JoinShard(cluster["model"], cluster["join"], ["--blocks", "0:30"])
    cluster["shards"].append(extra)
    extra.wait_started()
    wait_for(lambda: "resource exhausted" in extra.output(), "the third member's refusal")
    assert "--max-members" in extra.output(), extra.output()
    assert extra.address not in by_address(swarm(gw))
    st, body = completion(cluster, PROMPT)
    assert st == 200, body
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 4
    extra.kill()


def test_step_over_budget_retires_no_one(cluster):
    gw, shards = cluster["gw"], cluster["shards"][:2]
    st, body = completion(cluster, PROMPT * 8)  # 40 positions in the first step: over 16
    assert st == 400, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "request_too_large", err
    assert f"budget of {STEP_BUDGET} positions" in err["message"] and "127.0.0.1" not in err["message"], err
    assert "resource exhausted" not in err["message"], err
    assert "retiring" not in gw.output(), gw.output()
    servers = by_address(swarm(gw))
    assert all(servers[s.address]["state"] == "active" for s in shards), servers
    st, body = completion(cluster, PROMPT)
    assert st == 200, body
