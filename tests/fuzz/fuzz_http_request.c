/* fuzz_http_request.c -- libFuzzer target: arbitrary bytes as what a client sends the gateway:
 * chat and completions bodies through gw_request_parse, and header values through the
 * Host / Origin / Content-Type checks; server errors made public (gw_error_public).
 *
 * Input: the first byte picks what the rest is (see `mode`); the rest is a JSON body or a
 * header value. A parsed request is checked for the invariants gw_request_parse promises. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gw.h"
#include "log.h"

#define FUZZ_VOCAB 49152

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fu_log_set_level(FU_LOG_LEVEL_OFF);
    return 0;
}

/* The promises of a successful parse: counts within the limits, ids within the vocabulary. */
static void check_request(const gw_request *r, const gw_limits *lim) {
    if (r->n < 1 || r->n > lim->max_n || r->n_stop < 0 || r->n_stop > lim->max_stop ||
        r->n_bias > lim->max_logit_bias || r->top_logprobs < 0 || r->top_logprobs > lim->max_top_logprobs)
        abort();
    for (int i = 0; i < r->n_stop; i++)
        if (!r->stop[i] || !r->stop[i][0] || strlen(r->stop[i]) > (size_t)lim->max_stop_bytes) abort();
    for (int i = 0; i < r->n_bias; i++)
        if (r->bias[i].token < 0 || r->bias[i].token >= FUZZ_VOCAB) abort();
    if (r->kind == GW_KIND_CHAT && !json_is_array(r->messages)) abort();
    if (r->kind == GW_KIND_COMPLETION && (r->n_prompts < 1 || r->n_prompts > lim->max_prompts)) abort();
    for (int p = 0; r->kind == GW_KIND_COMPLETION && p < r->n_prompts; p++) {
        const gw_prompt *pr = &r->prompts[p];
        if (!pr->text == !pr->ids) abort();
        for (size_t k = 0; pr->ids && k < pr->n_ids; k++)
            if (pr->ids[k] < 0 || pr->ids[k] >= FUZZ_VOCAB) abort();
    }
}

static void fuzz_body(const char *data, size_t size, gw_kind kind, bool tight) {
    json_t *body = json_loadb(data, size, JSON_DECODE_ANY, NULL);
    if (!body) return;
    gw_limits lim;
    gw_limits_default(&lim);
    if (tight) { /* small limits reach the limit checks with small inputs */
        lim.max_n = 2, lim.max_choices = 3, lim.max_prompts = 2, lim.max_stop = 2, lim.max_stop_bytes = 4;
        lim.max_logit_bias = 2, lim.max_top_logprobs = 2, lim.max_messages = 3;
    }
    gw_request r;
    gw_error err;
    if (gw_request_parse(body, kind, &lim, FUZZ_VOCAB, &r, &err) == 0) {
        check_request(&r, &lim);
        gw_request_free(&r);
    } else {
        if (err.http < 400 || err.http > 599 || !memchr(err.message, '\0', sizeof err.message)) abort();
        char *s = gw_error_json(&err);
        if (!s) abort();
        free(s);
    }
    json_decref(body);
}

static void fuzz_headers(const char *v, size_t len) {
    size_t name_len = 0;
    int port = 0;
    if (gw_http_authority(v, len, &name_len, &port)) {
        if (name_len == 0 || name_len > len || port < -1 || port > 65535) abort();
        gw_http_loopback_name(v, name_len);
    }
    const char *host = NULL;
    size_t host_len = 0;
    if (gw_http_origin(v, len, &host, &host_len, &port)) {
        if (host < v || host + host_len > v + len || port < 0 || port > 65535) abort();
    }
    gw_http_json_type(v, len);
    gw_error e;
    gw_error_set(&e, 503, NULL, len && v[0] & 1 ? "shard_unavailable" : NULL, "%.*s", (int)len, v);
    gw_error_public(&e, NULL);
    if (strstr(e.message, "127.0.0.1")) abort(); /* a 5xx message never keeps client-chosen text */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const char *rest = (const char *)data + 1;
    size_t n = size - 1;
    switch (data[0] % 5) { /* mode */
    case 0: fuzz_body(rest, n, GW_KIND_CHAT, false); break;
    case 1: fuzz_body(rest, n, GW_KIND_COMPLETION, false); break;
    case 2: fuzz_body(rest, n, GW_KIND_CHAT, true); break;
    case 3: fuzz_body(rest, n, GW_KIND_COMPLETION, true); break;
    default: fuzz_headers(rest, n); break;
    }
    return 0;
}
