/* test_gateway_core.c -- the gateway's pure parts: request validation, stop strings, tool calls, SSE, error JSON, config, metrics. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chat-template.h"
#include "gw-tools.h"
#include "gw.h"
#include "status.h"

/* ---- helpers ---------------------------------------------------------------------------- */

/* Parses text as a request body; a body without "model" gets one (test_strict_requests checks
 * the missing model). */
static int parse(const char *text, gw_kind kind, int vocab, gw_request *r, gw_error *e) {
    json_error_t je;
    json_t *body = json_loads(text, 0, &je);
    assert_non_null(body);
    if (json_is_object(body) && !json_object_get(body, "model")) json_object_set_new(body, "model", json_string("m"));
    gw_limits lim;
    gw_limits_default(&lim);
    int rc = gw_request_parse(body, kind, &lim, vocab, r, e);
    json_decref(body);
    return rc;
}

/* Expects a 400 naming `param`. */
static void expect_bad(const char *text, gw_kind kind, const char *param) {
    gw_request r;
    gw_error e;
    int rc = parse(text, kind, 1000, &r, &e);
    if (rc != 400) fail_msg("expected 400 for %s, got %d", text, rc);
    assert_string_equal(e.type, "invalid_request_error");
    if (param && strcmp(e.param, param)) fail_msg("%s: param '%s', expected '%s' (%s)", text, e.param, param, e.message);
    assert_true(strlen(e.message) > 0);
}

/* ---- requests ------------------------------------------------------------------------------ */

static void test_chat_request_full(void **state) {
    gw_request r;
    gw_error e;
    int rc = parse("{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"be brief\"},"
                   "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]}],"
                   "\"max_completion_tokens\":7,\"max_tokens\":99,\"temperature\":0.5,\"top_p\":0.9,\"top_k\":40,"
                   "\"min_p\":0.05,\"seed\":-3,\"stop\":[\"x\",\"\",\"yz\"],\"n\":3,\"presence_penalty\":1,"
                   "\"frequency_penalty\":-0.5,\"logit_bias\":{\"5\":-100,\"7\":2.5},\"logprobs\":true,"
                   "\"top_logprobs\":4,\"stream\":true,\"stream_options\":{\"include_usage\":true},\"user\":\"u1\"}",
                   GW_KIND_CHAT, 1000, &r, &e);
    assert_int_equal(rc, 0);
    assert_string_equal(r.model, "m");
    assert_int_equal(json_array_size(r.messages), 2);
    /* text parts are joined into a string for the template */
    assert_string_equal(json_string_value(json_object_get(json_array_get(r.messages, 1), "content")), "ab");
    assert_int_equal(r.max_tokens, 7); /* max_completion_tokens wins */
    assert_true(r.sampling.temperature == 0.5f && r.sampling.top_p == 0.9f && r.sampling.top_k == 40);
    assert_true(r.sampling.min_p == 0.05f);
    assert_true(r.has_seed);
    assert_int_equal((int64_t)r.seed, -3);
    assert_int_equal(r.n_stop, 2); /* the empty string is dropped */
    assert_string_equal(r.stop[0], "x");
    assert_string_equal(r.stop[1], "yz");
    assert_int_equal(r.n, 3);
    assert_true(r.sampling.presence_penalty == 1.0f && r.sampling.frequency_penalty == -0.5f);
    assert_int_equal(r.n_bias, 2);
    assert_int_equal(r.sampling.n_bias, 2);
    assert_ptr_equal(r.sampling.bias, r.bias);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 4);
    assert_true(r.stream && r.include_usage);
    assert_string_equal(r.user, "u1");
    gw_request_free(&r);
    gw_request_free(&r); /* a freed request is zeroed: freeing again is harmless */
}

static void test_completion_prompts(void **state) {
    gw_request r;
    gw_error e;
    assert_int_equal(parse("{\"prompt\":\"hello\",\"logprobs\":2,\"echo\":true}", GW_KIND_COMPLETION, 1000, &r, &e), 0);
    assert_int_equal(r.n_prompts, 1);
    assert_string_equal(r.prompts[0].text, "hello");
    assert_true(r.logprobs && r.echo);
    assert_int_equal(r.top_logprobs, 2);
    assert_int_equal(r.max_tokens, -1);
    assert_true(r.sampling.temperature == 1.0f); /* OpenAI's default */
    gw_request_free(&r);

    assert_int_equal(parse("{\"prompt\":[1,2,999]}", GW_KIND_COMPLETION, 1000, &r, &e), 0);
    assert_int_equal(r.n_prompts, 1);
    assert_int_equal(r.prompts[0].n_ids, 3);
    assert_int_equal(r.prompts[0].ids[2], 999);
    gw_request_free(&r);

    assert_int_equal(parse("{\"prompt\":[\"a\",[4,5],\"b\"],\"n\":2}", GW_KIND_COMPLETION, 1000, &r, &e), 0);
    assert_int_equal(r.n_prompts, 3);
    assert_string_equal(r.prompts[0].text, "a");
    assert_int_equal(r.prompts[1].n_ids, 2);
    assert_string_equal(r.prompts[2].text, "b");
    gw_request_free(&r);

    expect_bad("{\"prompt\":[1,2,1000]}", GW_KIND_COMPLETION, "prompt");   /* outside the vocabulary */
    expect_bad("{\"prompt\":[1,-2]}", GW_KIND_COMPLETION, "prompt");
    expect_bad("{\"prompt\":[[1],[]]}", GW_KIND_COMPLETION, "prompt[1]");
    expect_bad("{\"prompt\":[]}", GW_KIND_COMPLETION, "prompt");
    expect_bad("{\"prompt\":{}}", GW_KIND_COMPLETION, "prompt");
    expect_bad("{\"prompt\":[\"a\", 3.5]}", GW_KIND_COMPLETION, "prompt");
    expect_bad("{}", GW_KIND_COMPLETION, "prompt");
    expect_bad("{\"prompt\":\"x\",\"logprobs\":true}", GW_KIND_COMPLETION, "logprobs");
}

static void test_bad_parameters(void **state) {
    const char *m = "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]";
    char buf[512];
    struct {
        const char *extra, *param;
    } cases[] = {
        {"\"temperature\":\"hot\"", "temperature"},
        {"\"temperature\":2.5", "temperature"},
        {"\"temperature\":-1", "temperature"},
        {"\"top_p\":1.5", "top_p"},
        {"\"max_tokens\":0", "max_tokens"},
        {"\"max_tokens\":1e300", "max_tokens"},
        {"\"max_tokens\":99999999999", "max_tokens"},
        {"\"max_tokens\":\"10\"", "max_tokens"},
        {"\"n\":0", "n"},
        {"\"n\":1000", "n"},
        {"\"seed\":1.5", "seed"},
        {"\"stop\":5", "stop"},
        {"\"stop\":[\"a\",1]", "stop"},
        {"\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\",\"12\",\"13\",\"14\",\"15\",\"16\",\"17\"]",
         "stop"},
        {"\"logit_bias\":[]", "logit_bias"},
        {"\"logit_bias\":{\"abc\":1}", "logit_bias"},
        {"\"logit_bias\":{\"5\":101}", "logit_bias"},
        {"\"logit_bias\":{\"1000\":1}", "logit_bias"},
        {"\"logprobs\":1", "logprobs"},
        {"\"top_logprobs\":3", "top_logprobs"}, /* without logprobs */
        {"\"logprobs\":true,\"top_logprobs\":21", "top_logprobs"},
        {"\"stream\":\"yes\"", "stream"},
        {"\"stream_options\":{\"include_usage\":true}", "stream_options"}, /* without stream */
        {"\"stream\":true,\"stream_options\":{\"include_usage\":1}", "stream_options.include_usage"},
        {"\"presence_penalty\":3", "presence_penalty"},
        {"\"frequency_penalty\":null,\"model\":5", "model"},
        {"\"user\":[]", "user"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(buf, sizeof buf, "{%s,%s}", m, cases[i].extra);
        expect_bad(buf, GW_KIND_CHAT, cases[i].param);
    }
    expect_bad("{\"messages\":[]}", GW_KIND_CHAT, "messages");
    expect_bad("{\"messages\":\"hi\"}", GW_KIND_CHAT, "messages");
    expect_bad("{}", GW_KIND_CHAT, "messages");
    expect_bad("{\"messages\":[5]}", GW_KIND_CHAT, "messages[0]");
    expect_bad("{\"messages\":[{\"content\":\"x\"}]}", GW_KIND_CHAT, "messages[0].role");
    expect_bad("{\"messages\":[{\"role\":\"user\",\"content\":7}]}", GW_KIND_CHAT, "messages[0].content");
    expect_bad("{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", GW_KIND_CHAT,
               "messages[0].content");
    expect_bad("[1,2]", GW_KIND_CHAT, NULL);
    /* null means "not given" */
    gw_request r;
    gw_error e;
    snprintf(buf, sizeof buf, "{%s,\"temperature\":null,\"stop\":null,\"n\":null,\"seed\":null}", m);
    assert_int_equal(parse(buf, GW_KIND_CHAT, 1000, &r, &e), 0);
    assert_int_equal(r.n, 1);
    assert_false(r.has_seed);
    gw_request_free(&r);
}

/* logit_bias holds at most SMP_MAX_LOGIT_BIAS entries, the sampler's own limit. */
static void test_logit_bias_limit(void **state) {
    static char body[16384];
    for (int n = SMP_MAX_LOGIT_BIAS; n <= SMP_MAX_LOGIT_BIAS + 1; n++) {
        size_t len = (size_t)snprintf(body, sizeof body, "{\"prompt\":\"x\",\"logit_bias\":{");
        for (int i = 0; i < n; i++)
            len += (size_t)snprintf(body + len, sizeof body - len, "%s\"%d\":1", i ? "," : "", i);
        snprintf(body + len, sizeof body - len, "}}");
        assert_true(len + 2 < sizeof body);
        gw_request r;
        gw_error e;
        int rc = parse(body, GW_KIND_COMPLETION, 1000, &r, &e);
        if (n == SMP_MAX_LOGIT_BIAS) {
            assert_int_equal(rc, 0);
            assert_int_equal(r.n_bias, SMP_MAX_LOGIT_BIAS);
            gw_request_free(&r);
        } else {
            assert_int_equal(rc, 400);
            assert_string_equal(e.param, "logit_bias");
        }
    }
}

/* ---- stop strings ------------------------------------------------------------------------------ */

/* Feeds pieces one by one; returns what was released (malloc'd) and whether it matched. */
static char *run_stop(char *const *stops, int n, const char *const *pieces, int n_pieces, bool *matched,
                      char **released_each) {
    gw_stop s;
    assert_int_equal(gw_stop_init(&s, stops, n), FU_OK);
    fu_buf out = {0};
    for (int i = 0; i < n_pieces; i++) {
        size_t before = out.len;
        assert_int_equal(gw_stop_feed(&s, pieces[i], strlen(pieces[i]), &out), FU_OK);
        if (released_each) released_each[i] = strndup(out.data ? out.data + before : "", out.len - before);
    }
    assert_int_equal(gw_stop_flush(&s, &out), FU_OK);
    *matched = s.matched;
    gw_stop_free(&s);
    char *r = strdup(out.data ? out.data : "");
    fu_buf_free(&out);
    return r;
}

static void test_stop_across_pieces_and_holdback(void **state) {
    char *stops[] = {"STOP", "\n\n"};
    const char *pieces[] = {"Hello ", "ST", "O", "P world"};
    char *each[4];
    bool matched;
    char *r = run_stop(stops, 2, pieces, 4, &matched, each);
    assert_true(matched);
    assert_string_equal(r, "Hello ");
    /* "ST" and "O" could begin "STOP": nothing of them is released before the match */
    assert_string_equal(each[0], "Hello ");
    assert_string_equal(each[1], "");
    assert_string_equal(each[2], "");
    assert_string_equal(each[3], "");
    for (int i = 0; i < 4; i++) free(each[i]);
    free(r);

    /* a false start is released once it cannot be a stop string any more */
    const char *p2[] = {"a ST", "OR", "Y\n", "x"};
    r = run_stop(stops, 2, p2, 4, &matched, each);
    assert_false(matched);
    assert_string_equal(r, "a STORY\nx");
    assert_string_equal(each[0], "a ");
    assert_string_equal(each[1], "STOR");
    assert_string_equal(each[2], "Y"); /* "\n" could start "\n\n" */
    assert_string_equal(each[3], "\nx");
    for (int i = 0; i < 4; i++) free(each[i]);
    free(r);

    /* the earliest of several matches wins, even when a later-listed stop string matches first */
    char *s3[] = {"world", "lo"};
    const char *p3[] = {"hello world"};
    r = run_stop(s3, 2, p3, 1, &matched, NULL);
    assert_true(matched);
    assert_string_equal(r, "hel");
    free(r);

    /* no stop strings: everything passes through */
    r = run_stop(NULL, 0, p3, 1, &matched, NULL);
    assert_false(matched);
    assert_string_equal(r, "hello world");
    free(r);
}

static void test_stop_utf8(void **state) {
    /* "é" is C3 A9, "€" is E2 82 AC: a stop string sharing a lead byte must not split characters */
    char *stops[] = {"\xC3\xA9t\xC3\xA9", "\xE2\x82\xAC!"};
    const char *pieces[] = {"caf\xC3\xA9", " 5\xE2\x82\xAC", " \xC3\xA9t", "\xC3\xA9 fin"};
    char *each[4];
    bool matched;
    char *r = run_stop(stops, 2, pieces, 4, &matched, each);
    assert_true(matched);
    assert_string_equal(r, "caf\xC3\xA9 5\xE2\x82\xAC ");
    for (int i = 0; i < 4; i++) {
        assert_true(gw_utf8_valid(each[i], strlen(each[i]))); /* every release is whole characters */
        free(each[i]);
    }
    free(r);
}

/* ---- UTF-8, SSE, errors, seeds ----------------------------------------------------------------------- */

static void test_utf8_helpers(void **state) {
    assert_true(gw_utf8_valid("abc\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80", 12));
    assert_false(gw_utf8_valid("\xC3", 1));
    assert_false(gw_utf8_valid("\xC0\x80", 2));         /* overlong */
    assert_false(gw_utf8_valid("\xED\xA0\x80", 3));     /* surrogate */
    assert_false(gw_utf8_valid("\xF4\x90\x80\x80", 4)); /* > U+10FFFF */
    assert_int_equal(gw_utf8_complete_prefix("ab\xE2\x82", 4), 2);
    assert_int_equal(gw_utf8_complete_prefix("ab\xE2\x82\xAC", 5), 5);
    json_t *s = gw_json_string_lossy("a\xFF" "b\xE2\x82", 5);
    assert_non_null(s);
    assert_string_equal(json_string_value(s), "a\xEF\xBF\xBD" "b\xEF\xBF\xBD");
    json_decref(s);
}

/* The Host / Origin / Content-Type checks and the public form of server errors. */
static void test_http_checks(void **state) {
    (void)state;
    size_t nl = 0, hl = 0;
    int port = 0;
    assert_true(gw_http_authority("localhost", 9, &nl, &port) && nl == 9 && port == -1);
    assert_true(gw_http_authority("127.0.0.1:8080", 14, &nl, &port) && nl == 9 && port == 8080);
    assert_true(gw_http_authority("[::1]:80", 8, &nl, &port) && nl == 5 && port == 80);
    assert_true(gw_http_loopback_name("[::1]", 5) && gw_http_loopback_name("LocalHost", 9));
    assert_false(gw_http_loopback_name("localhost.evil", 14));
    const char *bad[] = {"", ":80", "a b", "x:", "x:99999", "x:8a", "[]", "[::1", "[zz]", "x\0y", "x/y"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_false(gw_http_authority(bad[i], i == 9 ? 3 : strlen(bad[i]), &nl, &port));
    const char *host = NULL;
    assert_true(gw_http_origin("http://localhost:8080", 21, &host, &hl, &port));
    assert_true(hl == 9 && !strncmp(host, "localhost", 9) && port == 8080);
    assert_true(gw_http_origin("https://app.example", 19, &host, &hl, &port) && port == 443);
    assert_false(gw_http_origin("null", 4, &host, &hl, &port));
    assert_false(gw_http_origin("http://a.example/path", 21, &host, &hl, &port));
    assert_false(gw_http_origin("file://x", 8, &host, &hl, &port));
    assert_true(gw_http_json_type("application/json", 16));
    assert_true(gw_http_json_type("Application/JSON; charset=utf-8", 31));
    assert_false(gw_http_json_type("text/plain", 10));
    assert_false(gw_http_json_type("application/jsonp", 17));
    assert_false(gw_http_json_type("application/json\0", 17 + 1));
    /* a server error's text may name a shard: the client gets the code's fixed message */
    gw_error e;
    gw_error_set(&e, 503, NULL, "shard_unavailable", "generation failed: shard 127.0.0.1:1: unavailable");
    gw_error_public(&e, NULL);
    assert_string_equal(e.message, "a shard of the swarm is unavailable; retry later");
    gw_error_set(&e, 500, NULL, NULL, "decoder: %s", "10.0.0.7:7001");
    gw_error_public(&e, NULL);
    assert_null(strstr(e.message, "10.0.0.7"));
    gw_error_set(&e, 503, NULL, "no_route", "no server covers blocks [0, 15)");
    gw_error_public(&e, NULL);
    assert_string_equal(e.message, "no server covers blocks [0, 15)");
    gw_error_set(&e, 400, "prompt", NULL, "the prompt is empty");
    gw_error_public(&e, NULL);
    assert_string_equal(e.message, "the prompt is empty");
}

static void test_sse_and_errors(void **state) {
    fu_buf b = {0};
    json_t *o = json_pack("{s:s, s:[i]}", "text", "line1\nline2 \xC3\xA9", "x", 1);
    assert_int_equal(gw_sse_event(&b, o), FU_OK);
    json_decref(o);
    assert_int_equal(gw_sse_done(&b), FU_OK);
    /* one event per "data:" line: the newline inside the text is escaped by JSON */
    assert_string_equal(b.data, "data: {\"text\":\"line1\\nline2 \xC3\xA9\",\"x\":[1]}\n\ndata: [DONE]\n\n");
    fu_buf_consume(&b, 6);
    assert_true(!strncmp(b.data, "{\"text\"", 7));
    fu_buf_free(&b);

    gw_error e;
    assert_int_equal(gw_error_set(&e, 400, "temperature", "invalid_value", "bad %s", "value"), 400);
    char *s = gw_error_json(&e);
    json_t *j = json_loads(s, 0, NULL);
    assert_non_null(j);
    json_t *in = json_object_get(j, "error");
    assert_string_equal(json_string_value(json_object_get(in, "message")), "bad value");
    assert_string_equal(json_string_value(json_object_get(in, "type")), "invalid_request_error");
    assert_string_equal(json_string_value(json_object_get(in, "param")), "temperature");
    assert_string_equal(json_string_value(json_object_get(in, "code")), "invalid_value");
    json_decref(j);
    free(s);
    gw_error_set(&e, 401, NULL, NULL, "no key");
    s = gw_error_json(&e);
    j = json_loads(s, 0, NULL);
    in = json_object_get(j, "error");
    assert_string_equal(json_string_value(json_object_get(in, "type")), "authentication_error");
    assert_true(json_is_null(json_object_get(in, "param")) && json_is_null(json_object_get(in, "code")));
    json_decref(j);
    free(s);
    /* a message truncated inside a multi-byte character still gives valid JSON */
    char longmsg[600];
    memset(longmsg, 'a', sizeof longmsg);
    for (int i = 500; i < 598; i += 2) longmsg[i] = '\xC3', longmsg[i + 1] = '\xA9';
    longmsg[599] = '\0';
    gw_error_set(&e, 500, NULL, NULL, "%s", longmsg + 1);
    s = gw_error_json(&e);
    assert_non_null(s);
    j = json_loads(s, 0, NULL);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_object_get(json_object_get(j, "error"), "type")), "server_error");
    json_decref(j);
    free(s);
}

static void test_step_seeds(void **state) {
    assert_true(gw_step_seed(1, 0, 10) == gw_step_seed(1, 0, 10));
    assert_true(gw_step_seed(1, 0, 10) != gw_step_seed(1, 0, 11));
    assert_true(gw_step_seed(1, 0, 10) != gw_step_seed(1, 1, 10));
    assert_true(gw_step_seed(1, 0, 10) != gw_step_seed(2, 0, 10));
}

/* ---- config and metrics -------------------------------------------------------------------------------- */

static void test_config(void **state) {
    char path[] = "/tmp/gw-config-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    char keys[] = "/tmp/gw-keys-XXXXXX";
    int kfd = mkstemp(keys);
    assert_true(kfd >= 0);
    const char *kt = "# keys\nk-one\n  k-two  \n\n";
    assert_int_equal(write(kfd, kt, strlen(kt)), (ssize_t)strlen(kt));
    close(kfd);
    char text[1024];
    snprintf(text, sizeof text,
             "{\"_comment\": \"x\", \"model\": \"/m.gguf\", \"listen\": \"127.0.0.1:0\", "
             "\"hops\": [\"127.0.0.1:7001:0:15\", \"[::1]:7002:15:30\"], \"secret\": \"unit-test-secret-0123\", \"insecure\": true, "
             "\"api_keys\": [\"k0\"], \"api_key_file\": \"%s\", \"workers\": 4, \"max_n\": 3, "
             "\"max_body_bytes\": 4096}",
             keys);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    gw_config c;
    gw_config_init(&c);
    assert_int_equal(gw_config_load(&c, path), FU_OK);
    assert_string_equal(c.model, "/m.gguf");
    assert_int_equal(c.n_hops, 2);
    assert_string_equal(c.hops[0].address, "127.0.0.1:7001");
    assert_int_equal(c.hops[0].first, 0);
    assert_int_equal(c.hops[0].last, 15);
    assert_string_equal(c.hops[1].address, "[::1]:7002");
    assert_int_equal(c.hops[1].first, 15);
    assert_true(c.insecure);
    assert_int_equal(c.n_api_keys, 3);
    assert_string_equal(c.api_keys[1], "k-one");
    assert_string_equal(c.api_keys[2], "k-two");
    assert_int_equal(c.workers, 4);
    assert_int_equal(c.limits.max_n, 3);
    assert_int_equal(c.max_body_bytes, 4096);
    /* slow clients: per-address cap, reserve and read deadlines, with their defaults */
    assert_int_equal(c.max_connections_per_ip, 64);
    assert_int_equal(c.connection_reserve, 16);
    assert_int_equal(c.header_timeout_s, 10);
    assert_int_equal(c.body_timeout_s, 60);
    assert_int_equal(gw_config_set(&c, "max-connections-per-ip", "0"), FU_OK); /* no cap */
    assert_int_equal(gw_config_set(&c, "header-timeout-s", "0"), FU_ERR_INVALID);
    assert_int_equal(gw_config_set(&c, "body_timeout_s", "5"), FU_OK);
    assert_int_equal(c.body_timeout_s, 5);
    assert_int_equal(gw_config_check(&c), FU_OK);
    /* a secret shorter than 16 bytes is refused; so are API keys with --no-auth */
    assert_int_equal(gw_config_set(&c, "secret", "fifteen-bytes.."), FU_OK);
    assert_int_equal(gw_config_check(&c), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "at least 16"));
    assert_int_equal(gw_config_set(&c, "secret", "sixteen-bytes..."), FU_OK);
    assert_int_equal(gw_config_check(&c), FU_OK);
    assert_int_equal(gw_config_set(&c, "no-auth", "true"), FU_OK);
    assert_int_equal(gw_config_check(&c), FU_ERR_INVALID);
    assert_int_equal(gw_config_set(&c, "no-auth", "false"), FU_OK);
    /* flags override; bad values are errors naming the option */
    assert_int_equal(gw_config_set(&c, "max-n", "5"), FU_OK);
    assert_int_equal(c.limits.max_n, 5);
    assert_int_equal(gw_config_set(&c, "workers", "0"), FU_ERR_INVALID);
    assert_int_equal(gw_config_set(&c, "workers", "12abc"), FU_ERR_INVALID);
    assert_int_equal(gw_config_set(&c, "no-such-option", "1"), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "no-such-option"));
    /* a key file that is missing, or a FIFO (refused at once rather than waited on) */
    assert_int_equal(gw_config_set(&c, "api-key-file", "/nonexistent/keys"), FU_ERR_NOT_FOUND);
    assert_non_null(strstr(fu_last_error(), "/nonexistent/keys: cannot open"));
    char fifo[] = "/tmp/gw-fifo-XXXXXX";
    assert_non_null(mkdtemp(fifo));
    char fifo_path[64];
    snprintf(fifo_path, sizeof fifo_path, "%s/keys", fifo);
    assert_int_equal(mkfifo(fifo_path, 0600), 0);
    assert_int_equal(gw_config_set(&c, "api-key-file", fifo_path), FU_ERR_IO);
    assert_non_null(strstr(fu_last_error(), "not a regular file"));
    assert_int_equal(c.n_api_keys, 3);
    unlink(fifo_path);
    rmdir(fifo);
    assert_int_equal(gw_config_set(&c, "hop", "127.0.0.1:7003"), FU_ERR_INVALID);
    assert_int_equal(gw_config_set(&c, "hop", "127.0.0.1:7003:30:30"), FU_ERR_INVALID);
    assert_int_equal(gw_config_set(&c, "insecure", "maybe"), FU_ERR_INVALID);
    gw_config_free(&c);

    /* a chain with a gap fails the check */
    gw_config_init(&c);
    assert_int_equal(gw_config_set(&c, "model", "/m"), FU_OK);
    assert_int_equal(gw_config_set(&c, "secret", "unit-test-secret-0123"), FU_OK);
    assert_int_equal(gw_config_set(&c, "hop", "h:1:0:10"), FU_OK);
    assert_int_equal(gw_config_set(&c, "hop", "h:2:12:30"), FU_OK);
    assert_int_equal(gw_config_check(&c), FU_ERR_INVALID);
    gw_config_free(&c);

    /* malformed files */
    FILE *f = fopen(path, "w");
    fputs("{\"workers\": ", f);
    fclose(f);
    gw_config_init(&c);
    assert_int_equal(gw_config_load(&c, path), FU_ERR_FORMAT);
    gw_config_free(&c);
    unlink(path);
    unlink(keys);

    /* the shipped example config loads and passes the check */
    const char *src = getenv("FUSION_SOURCE_DIR");
    char example[4096];
    snprintf(example, sizeof example, "%s/config/gateway.example.json", src ? src : ".");
    gw_config_init(&c);
    assert_int_equal(gw_config_load(&c, example), FU_OK);
    assert_int_equal(gw_config_check(&c), FU_OK);
    assert_int_equal(c.n_hops, 2);
    assert_int_equal(c.hops[1].last, 30);
    assert_true(c.n_api_keys >= 1);
    gw_config_free(&c);
}

static void test_metrics(void **state) {
    gw_metrics *m;
    assert_int_equal(gw_metrics_new(&m), FU_OK);
    gw_metrics_request(m, GW_ROUTE_CHAT, 200);
    gw_metrics_request(m, GW_ROUTE_CHAT, 200);
    gw_metrics_request(m, GW_ROUTE_COMPLETIONS, 400);
    gw_metrics_tokens(m, 10, 5);
    gw_metrics_ttft(m, 0.02);
    gw_metrics_ttft(m, 100);
    gw_metrics_itl(m, 0.012);
    gw_metrics_sessions(m, 2);
    gw_metrics_sessions(m, -1);
    fu_buf b = {0};
    assert_int_equal(gw_metrics_render(m, 3, &b), FU_OK);
    const char *want[] = {
        "fusion_gateway_requests_total{route=\"/v1/chat/completions\",code=\"200\"} 2\n",
        "fusion_gateway_requests_total{route=\"/v1/completions\",code=\"400\"} 1\n",
        "fusion_gateway_prompt_tokens_total 10\n",
        "fusion_gateway_generation_tokens_total 5\n",
        "fusion_gateway_active_sessions 1\n",
        "fusion_gateway_queue_depth 3\n",
        "fusion_gateway_time_to_first_token_seconds_bucket{le=\"0.025\"} 1\n",
        "fusion_gateway_time_to_first_token_seconds_bucket{le=\"80\"} 1\n",
        "fusion_gateway_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2\n",
        "fusion_gateway_time_to_first_token_seconds_count 2\n",
        "fusion_gateway_inter_token_latency_seconds_bucket{le=\"0.01\"} 0\n",
        "fusion_gateway_inter_token_latency_seconds_bucket{le=\"0.015\"} 1\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(b.data, want[i])) fail_msg("missing %s in\n%s", want[i], b.data);
    fu_buf_free(&b);
    gw_metrics_free(m);
    gw_metrics_free(NULL);
}

/* ---- tool calls ------------------------------------------------------------------------------------ */

/* The name and arguments of call i in an OpenAI tool_calls array. */
static void expect_call(const json_t *calls, size_t i, const char *name, const char *args) {
    const json_t *c = json_array_get(calls, i);
    assert_non_null(c);
    const char *id = json_string_value(json_object_get(c, "id"));
    assert_non_null(id);
    assert_int_equal(strlen(id), 29);
    assert_memory_equal(id, "call_", 5);
    assert_string_equal(json_string_value(json_object_get(c, "type")), "function");
    const json_t *fn = json_object_get(c, "function");
    assert_string_equal(json_string_value(json_object_get(fn, "name")), name);
    assert_string_equal(json_string_value(json_object_get(fn, "arguments")), args);
}

static int tool_parse(gw_tool_format f, const char *text, json_t **calls, json_t **content) {
    return gw_tool_parse(f, 42, text, strlen(text), calls, content);
}

static void test_tool_parse_whole(void **state) {
    (void)state;
    json_t *calls, *content;
    /* Hermes: two calls, text before them */
    const char *two = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
                      "</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>\n";
    assert_int_equal(tool_parse(GW_TOOL_FORMAT_HERMES, two, &calls, &content), 2);
    expect_call(calls, 0, "get_weather", "{\"city\":\"Paris\"}");
    expect_call(calls, 1, "get_time", "{}");
    assert_string_not_equal(json_string_value(json_object_get(json_array_get(calls, 0), "id")),
                            json_string_value(json_object_get(json_array_get(calls, 1), "id")));
    assert_string_equal(json_string_value(content), "Let me check.\n");
    json_decref(calls);
    json_decref(content);
    /* only calls: content is null */
    assert_int_equal(tool_parse(GW_TOOL_FORMAT_HERMES, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, 2]}}</tool_call>",
                                &calls, &content), 1);
    expect_call(calls, 0, "f", "{\"a\":[1,2]}");
    assert_true(json_is_null(content));
    json_decref(calls);
    json_decref(content);
    /* unterminated but complete JSON (the model stopped before the closing tag) */
    assert_int_equal(tool_parse(GW_TOOL_FORMAT_HERMES, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n", &calls, &content), 1);
    json_decref(calls);
    json_decref(content);
    /* malformed JSON, a call without a name, an unterminated broken call, plain text: no calls */
    const char *plain[] = {
        "<tool_call>{\"name\": \"f\", \"arguments\": {</tool_call>",
        "<tool_call>{\"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"f\", \"argu",
        "<tool_call>{\"name\": \"f\", \"arguments\": 5}</tool_call>",
        "The weather is <b>nice</b> <tool_",
        "",
    };
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++) {
        assert_int_equal(tool_parse(GW_TOOL_FORMAT_HERMES, plain[i], &calls, &content), 0);
        assert_null(calls);
        assert_null(content);
    }
    /* a malformed call next to a good one stays in the content verbatim */
    assert_int_equal(tool_parse(GW_TOOL_FORMAT_HERMES,
                                "<tool_call>{bad}</tool_call><tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>",
                                &calls, &content), 1);
    expect_call(calls, 0, "g", "{}");
    assert_string_equal(json_string_value(content), "<tool_call>{bad}</tool_call>");
    json_decref(calls);
    json_decref(content);

    /* Llama 3 JSON: "parameters", an optional <|python_tag|>, several calls separated by ';' */
    assert_int_equal(tool_parse(GW_TOOL_FORMAT_LLAMA3, " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
                                &calls, &content), 1);
    expect_call(calls, 0, "get_weather", "{\"city\":\"Oslo\"}");
    assert_true(json_is_null(content));
    json_decref(calls);
    json_decref(content);
    assert_int_equal(tool_parse(GW_TOOL_FORMAT_LLAMA3,
                                "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}}",
                                &calls, &content), 2);
    expect_call(calls, 0, "a", "{}");
    expect_call(calls, 1, "b", "{\"x\":1}");
    json_decref(calls);
    json_decref(content);
    const char *llama_plain[] = {"Hello {\"name\": \"a\", \"parameters\": {}}", "{\"name\": \"a\", \"param",
                                 "{\"answer\": 42}", "{not json}", "  "};
    for (size_t i = 0; i < sizeof llama_plain / sizeof llama_plain[0]; i++)
        assert_int_equal(tool_parse(GW_TOOL_FORMAT_LLAMA3, llama_plain[i], &calls, &content), 0);

    /* the format from the template's text */
    assert_int_equal(gw_tool_format_detect("{% if tools %}<tool_call>{% endif %}"), GW_TOOL_FORMAT_HERMES);
    assert_int_equal(gw_tool_format_detect("<|start_header_id|>ipython{% if tools %}<|python_tag|>{% endif %}"),
                     GW_TOOL_FORMAT_LLAMA3);
    assert_int_equal(gw_tool_format_detect(NULL), GW_TOOL_FORMAT_HERMES);
    json_t *tools = json_loads("[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]", 0, NULL);
    json_t *none = json_string("none"), *required = json_string("required");
    assert_true(gw_tools_active(tools, NULL));
    assert_true(gw_tools_active(tools, required));
    assert_false(gw_tools_active(tools, none));
    assert_false(gw_tools_active(NULL, required));
    json_decref(tools);
    json_decref(none);
    json_decref(required);
}

/* Feeds text in pieces of `step` bytes; returns the content and the deltas. */
static json_t *stream_pieces(gw_tool_format f, const char *text, size_t step, fu_buf *content, int *n_calls) {
    gw_tool_stream t;
    gw_tool_stream_init(&t, f, 7);
    json_t *deltas = json_array();
    size_t len = strlen(text);
    for (size_t i = 0; i < len; i += step) {
        size_t n = len - i < step ? len - i : step;
        assert_int_equal(gw_tool_stream_feed(&t, text + i, n, content, deltas), FU_OK);
    }
    assert_int_equal(gw_tool_stream_flush(&t, content, deltas), FU_OK);
    *n_calls = t.n_calls;
    gw_tool_stream_free(&t);
    return deltas;
}

static void test_tool_stream(void **state) {
    (void)state;
    const char *text = "Sure<tool_call>{\"name\": \"f\", \"arguments\": {\"q\": \"<tool_call>\"}}</tool_call>\n"
                       "<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";
    for (size_t step = 1; step <= strlen(text); step++) {
        fu_buf content = {0};
        int n = 0;
        json_t *d = stream_pieces(GW_TOOL_FORMAT_HERMES, text, step, &content, &n);
        assert_int_equal(n, 2);
        assert_string_equal(content.data, "Sure");
        /* per call: index, id, type and name with empty arguments, then the arguments */
        assert_int_equal(json_array_size(d), 4);
        for (int i = 0; i < 2; i++) {
            const json_t *first = json_array_get(d, (size_t)(2 * i)), *second = json_array_get(d, (size_t)(2 * i + 1));
            assert_int_equal(json_integer_value(json_object_get(first, "index")), i);
            assert_int_equal(json_integer_value(json_object_get(second, "index")), i);
            assert_non_null(json_object_get(first, "id"));
            assert_null(json_object_get(second, "id"));
            assert_string_equal(json_string_value(json_object_get(first, "type")), "function");
            assert_string_equal(json_string_value(json_object_get(json_object_get(first, "function"), "name")),
                                i ? "g" : "f");
            assert_string_equal(json_string_value(json_object_get(json_object_get(first, "function"), "arguments")), "");
        }
        assert_string_equal(json_string_value(json_object_get(json_object_get(json_array_get(d, 1), "function"),
                                                              "arguments")),
                            "{\"q\":\"<tool_call>\"}");
        json_decref(d);
        fu_buf_free(&content);
    }
    /* a partial tag is held back, then released once it cannot be a call */
    gw_tool_stream t;
    gw_tool_stream_init(&t, GW_TOOL_FORMAT_HERMES, 1);
    fu_buf content = {0};
    json_t *d = json_array();
    assert_int_equal(gw_tool_stream_feed(&t, "a <tool", 7, &content, d), FU_OK);
    assert_string_equal(content.data, "a ");
    assert_int_equal(gw_tool_stream_feed(&t, "box>", 4, &content, d), FU_OK);
    assert_string_equal(content.data, "a <toolbox>");
    assert_int_equal(gw_tool_stream_feed(&t, " <tool_call>{\"name\"", 20, &content, d), FU_OK);
    assert_string_equal(content.data, "a <toolbox>");
    assert_int_equal(json_array_size(d), 0);
    /* the output ends inside a broken call: it comes out as text */
    assert_int_equal(gw_tool_stream_flush(&t, &content, d), FU_OK);
    assert_string_equal(content.data, "a <toolbox> <tool_call>{\"name\"");
    assert_int_equal(json_array_size(d), 0);
    gw_tool_stream_free(&t);
    fu_buf_free(&content);
    json_decref(d);

    /* Llama 3: plain text streams through at once; a JSON call is held and parsed */
    gw_tool_stream_init(&t, GW_TOOL_FORMAT_LLAMA3, 1);
    d = json_array();
    assert_int_equal(gw_tool_stream_feed(&t, "  ", 2, &content, d), FU_OK);
    assert_int_equal(content.len, 0);
    assert_int_equal(gw_tool_stream_feed(&t, "Hi {", 4, &content, d), FU_OK);
    assert_string_equal(content.data, "  Hi {");
    gw_tool_stream_free(&t);
    fu_buf_free(&content);
    for (size_t step = 1; step < 12; step++) {
        int n = 0;
        json_t *dd = stream_pieces(GW_TOOL_FORMAT_LLAMA3, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": {\"b\": 1}}}",
                                   step, &content, &n);
        assert_int_equal(n, 1);
        assert_int_equal(content.len, 0);
        json_decref(dd);
        fu_buf_free(&content);
    }
    json_decref(d);
}

/* OpenAI's strictness: a missing model, an unknown role, unknown arguments, and structured output
 * parameters (response_format, grammar, json_schema) compiled or refused naming the parameter. */
static void test_strict_requests(void **state) {
    (void)state;
    gw_request r;
    gw_error e;
    gw_limits lim;
    gw_limits_default(&lim);
    json_t *b = json_loads("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", 0, NULL);
    assert_int_equal(gw_request_parse(b, GW_KIND_CHAT, &lim, 1000, &r, &e), 400);
    assert_string_equal(e.param, "model");
    assert_int_equal(gw_request_parse(b, GW_KIND_TEMPLATE, &lim, 1000, &r, &e), 0); /* /apply-template */
    assert_int_equal(r.kind, GW_KIND_CHAT);
    gw_request_free(&r);
    json_decref(b);
    const char *msgs = "\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]";
    char buf[1024];
    struct { const char *extra, *param, *msg; } bad[] = {
        {"\"foo\":1", "foo", "Unrecognized request argument supplied: foo"},
        {"\"echo\":true", "echo", "Unrecognized"}, /* a completions argument */
        {"\"response_format\":{\"type\":\"bogus\"}", "response_format", "bogus"},
        {"\"response_format\":\"json\"", "response_format", "type"},
        {"\"response_format\":{\"type\":\"json_schema\"}", "response_format", "json_schema"},
        {"\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":"
         "{\"type\":\"integer\",\"minimum\":1}}}", "response_format", "'minimum'"},
        {"\"grammar\":\"root ::= foo\"", "grammar", "not defined"},
        {"\"grammar\":5", "grammar", "string"},
        {"\"json_schema\":{\"type\":\"bogus\"}", "json_schema", "bogus"},
        {"\"response_format\":{\"type\":\"json_object\"},\"grammar\":\"root ::= \\\"a\\\"\"", "grammar", "combined"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(buf, sizeof buf, "{%s,%s}", msgs, bad[i].extra);
        if (parse(buf, GW_KIND_CHAT, 1000, &r, &e) != 400 || strcmp(e.param, bad[i].param) || !strstr(e.message, bad[i].msg))
            fail_msg("%s: param '%s' message '%s'", buf, e.param, e.message);
    }
    expect_bad("{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", GW_KIND_CHAT, "messages[0].role");
    expect_bad("{\"messages\":[{\"role\":5,\"content\":\"x\"}]}", GW_KIND_CHAT, "messages[0].role");
    const char *good[] = {"\"response_format\":{\"type\":\"json_object\"}", "\"response_format\":{\"type\":\"text\"}",
                          "\"grammar\":\"root ::= [a-z]+\"", "\"parallel_tool_calls\":false,\"metadata\":{}",
                          "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p\",\"strict\":true,"
                          "\"schema\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"}}}}}"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        snprintf(buf, sizeof buf, "{%s,%s}", msgs, good[i]);
        if (parse(buf, GW_KIND_CHAT, 1000, &r, &e)) fail_msg("%s: %s", buf, e.message);
        assert_true(i == 1 || i == 3 ? !r.grammar : r.grammar != NULL);
        gw_request_free(&r);
    }
}

/* Whether grammar g accepts s whole (a vocabulary of the 256 single bytes). */
static bool grammar_accepts(const gm_grammar *g, const char *s) {
    static char bytes[256];
    const char *toks[257];
    size_t lens[257];
    for (int i = 0; i < 256; i++) bytes[i] = (char)i, toks[i] = &bytes[i], lens[i] = 1;
    toks[256] = NULL, lens[256] = 0;
    int32_t eog = 256;
    gm_vocab *v;
    gm_matcher *m;
    assert_int_equal(gm_vocab_new(toks, lens, 257, &eog, 1, &v), FU_OK);
    assert_int_equal(gm_matcher_new(g, v, &m), FU_OK);
    bool ok = gm_matcher_accept_bytes(m, s, strlen(s)) == FU_OK && gm_matcher_accepting(m);
    gm_matcher_free(m);
    gm_vocab_free(v);
    return ok;
}

/* tool_choice "required" / a named function: the call grammar, in each format, parses back. */
static void test_tool_grammar(void **state) {
    (void)state;
    json_t *tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":"
                               "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}},"
                               "{\"type\":\"function\",\"function\":{\"name\":\"now\"}}]", 0, NULL);
    json_t *req = json_string("required"), *named = json_loads("{\"type\":\"function\",\"function\":{\"name\":\"now\"}}", 0, NULL);
    gm_grammar *g;
    gw_error e;
    assert_int_equal(gw_tools_grammar(tools, req, GW_TOOL_FORMAT_HERMES, &g, &e), 0);
    const char *call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    assert_true(grammar_accepts(g, call));
    assert_false(grammar_accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>"));
    assert_false(grammar_accepts(g, "Sure!"));
    json_t *calls, *content;
    assert_int_equal(gw_tool_parse(GW_TOOL_FORMAT_HERMES, 1, call, strlen(call), &calls, &content), 1);
    json_decref(calls), json_decref(content), gm_grammar_free(g);
    assert_int_equal(gw_tools_grammar(tools, named, GW_TOOL_FORMAT_LLAMA3, &g, &e), 0);
    assert_true(grammar_accepts(g, "{\"name\": \"now\", \"parameters\": {}}"));
    assert_false(grammar_accepts(g, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"x\"}}"));
    gm_grammar_free(g);
    json_t *auto_ = json_string("auto"), *missing = json_loads("{\"type\":\"function\",\"function\":{\"name\":\"x\"}}", 0, NULL);
    assert_int_equal(gw_tools_grammar(tools, auto_, GW_TOOL_FORMAT_HERMES, &g, &e), 0);
    assert_null(g);
    assert_int_equal(gw_tools_grammar(tools, missing, GW_TOOL_FORMAT_HERMES, &g, &e), 400);
    assert_string_equal(e.param, "tool_choice");
    json_decref(tools), json_decref(req), json_decref(named), json_decref(auto_), json_decref(missing);
}

static void test_tool_requests(void **state) {
    (void)state;
    gw_request r;
    gw_error e;
    const char *ok = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [{\"type\": \"function\", "
                     "\"function\": {\"name\": \"f\", \"parameters\": {}}}], \"tool_choice\": \"required\"}";
    assert_int_equal(parse(ok, GW_KIND_CHAT, 1000, &r, &e), 0);
    assert_int_equal(json_array_size(r.tools), 1);
    assert_string_equal(json_string_value(r.tool_choice), "required");
    gw_request_free(&r);
    expect_bad("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": {}}", GW_KIND_CHAT, "tools");
    expect_bad("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [{\"type\": \"x\"}]}", GW_KIND_CHAT,
               "tools[0]");
    expect_bad("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tool_choice\": \"maybe\"}", GW_KIND_CHAT,
               "tool_choice");
    expect_bad("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tool_choice\": \"required\"}", GW_KIND_CHAT,
               "tool_choice");

    /* history: string arguments become objects; a template without tool support gets
     * the calls inline and a system prompt with the tools */
    json_t *msgs = json_loads("[{\"role\": \"user\", \"content\": \"weather?\"},"
                              " {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"call_1\", "
                              "\"type\": \"function\", \"function\": {\"name\": \"w\", \"arguments\": \"{\\\"c\\\": 1}\"}}]},"
                              " {\"role\": \"tool\", \"tool_call_id\": \"call_1\", \"content\": \"sunny\"}]",
                              0, NULL);
    json_t *tools = json_loads("[{\"type\": \"function\", \"function\": {\"name\": \"w\"}}]", 0, NULL);
    assert_non_null(msgs);
    json_t *copy = json_deep_copy(msgs);
    assert_int_equal(gw_tools_prepare_chat(copy, tools, GW_TOOL_FORMAT_HERMES, "{{ tools }} {{ m.tool_calls }}", &e), 0);
    assert_int_equal(json_array_size(copy), 3);
    const json_t *args = json_object_get(json_object_get(json_array_get(json_object_get(json_array_get(copy, 1),
                                                                                        "tool_calls"), 0), "function"),
                                         "arguments");
    assert_true(json_is_object(args));
    assert_int_equal(json_integer_value(json_object_get(args, "c")), 1);
    json_decref(copy);
    copy = json_deep_copy(msgs);
    assert_int_equal(gw_tools_prepare_chat(copy, tools, GW_TOOL_FORMAT_HERMES, "{{ messages }}", &e), 0);
    assert_int_equal(json_array_size(copy), 4);
    assert_string_equal(json_string_value(json_object_get(json_array_get(copy, 0), "role")), "system");
    assert_non_null(strstr(json_string_value(json_object_get(json_array_get(copy, 0), "content")), "\"name\":\"w\""));
    const json_t *asst = json_array_get(copy, 2);
    assert_null(json_object_get(asst, "tool_calls"));
    assert_string_equal(json_string_value(json_object_get(asst, "content")),
                        "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\":1}}\n</tool_call>");
    json_decref(copy);
    /* a malformed tool_calls entry is a 400 naming it */
    json_object_set_new(json_array_get(msgs, 1), "tool_calls", json_loads("[{\"function\": 3}]", 0, NULL));
    assert_int_equal(gw_tools_prepare_chat(msgs, tools, GW_TOOL_FORMAT_HERMES, "", &e), 400);
    assert_string_equal(e.param, "messages[1].tool_calls");
    json_decref(msgs);
    json_decref(tools);
}

/* A tool-call history through Qwen3's own template (which handles tools and tool_calls). */
static void test_tool_history_qwen3_template(void **state) {
    (void)state;
    const char *src = getenv("FUSION_SOURCE_DIR");
    char path[512];
    snprintf(path, sizeof path, "%s/../shared/tokenizers/qwen3/tokenizer_config.json", src ? src : ".");
    json_t *cfg = json_load_file(path, 0, NULL);
    if (!cfg) skip();
    const char *text = json_string_value(json_object_get(cfg, "chat_template"));
    assert_non_null(text);
    assert_int_equal(gw_tool_format_detect(text), GW_TOOL_FORMAT_HERMES);
    tpl_template *tpl = NULL;
    assert_int_equal(tpl_compile(text, &tpl), FU_OK);
    json_t *msgs = json_loads("[{\"role\": \"user\", \"content\": \"weather?\"},"
                              " {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"call_1\", "
                              "\"type\": \"function\", \"function\": {\"name\": \"w\", \"arguments\": \"{\\\"c\\\": 1}\"}}]},"
                              " {\"role\": \"tool\", \"tool_call_id\": \"call_1\", \"content\": \"sunny\"}]",
                              0, NULL);
    json_t *tools = json_loads("[{\"type\": \"function\", \"function\": {\"name\": \"w\"}}]", 0, NULL);
    gw_error e;
    assert_int_equal(gw_tools_prepare_chat(msgs, tools, GW_TOOL_FORMAT_HERMES, text, &e), 0);
    assert_int_equal(json_array_size(msgs), 3); /* the template describes the tools itself */
    char *out = NULL;
    assert_int_equal(tpl_apply_chat(tpl, msgs, tools, 1, NULL, "<|im_end|>", NULL, &out), FU_OK);
    if (!strstr(out, "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"w\"}}\n</tools>") ||
        !strstr(out, "<|im_start|>assistant\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": 1}}\n</tool_call><|im_end|>") ||
        !strstr(out, "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>"))
        fail_msg("unexpected rendering:\n%s", out);
    free(out);
    json_decref(msgs);
    json_decref(tools);
    json_decref(cfg);
    tpl_free(tpl);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_request_full),
        cmocka_unit_test(test_completion_prompts),
        cmocka_unit_test(test_bad_parameters),
        cmocka_unit_test(test_logit_bias_limit),
        cmocka_unit_test(test_stop_across_pieces_and_holdback),
        cmocka_unit_test(test_stop_utf8),
        cmocka_unit_test(test_utf8_helpers),
        cmocka_unit_test(test_sse_and_errors),
        cmocka_unit_test(test_http_checks),
        cmocka_unit_test(test_step_seeds),
        cmocka_unit_test(test_config),
        cmocka_unit_test(test_metrics),
        cmocka_unit_test(test_tool_parse_whole),
        cmocka_unit_test(test_tool_stream),
        cmocka_unit_test(test_tool_requests),
        cmocka_unit_test(test_strict_requests),
        cmocka_unit_test(test_tool_grammar),
        cmocka_unit_test(test_tool_history_qwen3_template),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
