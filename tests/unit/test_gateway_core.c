/* test_gateway_core.c -- the gateway's pure parts: request validation, stop strings, SSE, error JSON, config, metrics. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gw.h"
#include "status.h"

/* ---- helpers ---------------------------------------------------------------------------- */

static int parse(const char *text, gw_kind kind, int vocab, gw_request *r, gw_error *e) {
    json_error_t je;
    json_t *body = json_loads(text, 0, &je);
    assert_non_null(body);
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

/* ---- stop strings ------------------------------------------------------------------------------ */

/* Feeds pieces one by one; returns what was released (malloc'd) and whether it matched. */
static char *run_stop(char *const *stops, int n, const char *const *pieces, int n_pieces, bool *matched,
                      char **released_each) {
    gw_stop s;
    assert_int_equal(gw_stop_init(&s, stops, n), FU_OK);
    gw_buf out = {0};
    for (int i = 0; i < n_pieces; i++) {
        size_t before = out.len;
        assert_int_equal(gw_stop_feed(&s, pieces[i], strlen(pieces[i]), &out), FU_OK);
        if (released_each) released_each[i] = strndup(out.data ? out.data + before : "", out.len - before);
    }
    assert_int_equal(gw_stop_flush(&s, &out), FU_OK);
    *matched = s.matched;
    gw_stop_free(&s);
    char *r = strdup(out.data ? out.data : "");
    gw_buf_free(&out);
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

static void test_sse_and_errors(void **state) {
    gw_buf b = {0};
    json_t *o = json_pack("{s:s, s:[i]}", "text", "line1\nline2 \xC3\xA9", "x", 1);
    assert_int_equal(gw_sse_event(&b, o), FU_OK);
    json_decref(o);
    assert_int_equal(gw_sse_done(&b), FU_OK);
    /* one event per "data:" line: the newline inside the text is escaped by JSON */
    assert_string_equal(b.data, "data: {\"text\":\"line1\\nline2 \xC3\xA9\",\"x\":[1]}\n\ndata: [DONE]\n\n");
    gw_buf_consume(&b, 6);
    assert_true(!strncmp(b.data, "{\"text\"", 7));
    gw_buf_free(&b);

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
             "\"hops\": [\"127.0.0.1:7001:0:15\", \"[::1]:7002:15:30\"], \"secret\": \"s\", \"insecure\": true, "
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
    assert_int_equal(gw_config_check(&c), FU_OK);
    /* flags override; bad values are errors naming the option */
    assert_int_equal(gw_config_set(&c, "max-n", "5"), FU_OK);
    assert_int_equal(c.limits.max_n, 5);
    assert_int_equal(gw_config_set(&c, "workers", "0"), FU_ERR_INVALID);
    assert_int_equal(gw_config_set(&c, "workers", "12abc"), FU_ERR_INVALID);
    assert_int_equal(gw_config_set(&c, "no-such-option", "1"), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "no-such-option"));
    assert_int_equal(gw_config_set(&c, "hop", "127.0.0.1:7003"), FU_ERR_INVALID);
    assert_int_equal(gw_config_set(&c, "hop", "127.0.0.1:7003:30:30"), FU_ERR_INVALID);
    assert_int_equal(gw_config_set(&c, "insecure", "maybe"), FU_ERR_INVALID);
    gw_config_free(&c);

    /* a chain with a gap fails the check */
    gw_config_init(&c);
    assert_int_equal(gw_config_set(&c, "model", "/m"), FU_OK);
    assert_int_equal(gw_config_set(&c, "secret", "s"), FU_OK);
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
    gw_buf b = {0};
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
    gw_buf_free(&b);
    gw_metrics_free(m);
    gw_metrics_free(NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_request_full),
        cmocka_unit_test(test_completion_prompts),
        cmocka_unit_test(test_bad_parameters),
        cmocka_unit_test(test_stop_across_pieces_and_holdback),
        cmocka_unit_test(test_stop_utf8),
        cmocka_unit_test(test_utf8_helpers),
        cmocka_unit_test(test_sse_and_errors),
        cmocka_unit_test(test_step_seeds),
        cmocka_unit_test(test_config),
        cmocka_unit_test(test_metrics),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
