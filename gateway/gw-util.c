/* gw-util.c -- UTF-8 checks, step seeds, OpenAI error JSON and SSE framing for the gateway. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "gw.h"
#include "log.h"
#include "status.h"

/* ---- UTF-8 ---------------------------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s[0..len), 0 if invalid, -1 if it is a
 * valid but incomplete prefix. */
static int utf8_seq(const unsigned char *s, size_t len) {
    unsigned c = s[0];
    int need;
    unsigned lo = 0x80, hi = 0xBF;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) need = 1;
    else if (c == 0xE0) need = 2, lo = 0xA0;
    else if (c == 0xED) need = 2, hi = 0x9F;
    else if (c >= 0xE1 && c <= 0xEF) need = 2;
    else if (c == 0xF0) need = 3, lo = 0x90;
    else if (c == 0xF4) need = 3, hi = 0x8F;
    else if (c >= 0xF1 && c <= 0xF3) need = 3;
    else return 0;
    for (int i = 1; i <= need; i++) {
        if ((size_t)i >= len) return -1;
        unsigned d = s[i];
        if (d < (i == 1 ? lo : 0x80) || d > (i == 1 ? hi : 0xBF)) return 0;
    }
    return need + 1;
}

size_t gw_utf8_complete_prefix(const char *s, size_t len) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        int k = utf8_seq(u + i, len - i);
        if (k < 0) return i;
        i += k ? (size_t)k : 1;
    }
    return len;
}

bool gw_utf8_valid(const char *s, size_t len) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        int k = utf8_seq(u + i, len - i);
        if (k <= 0) return false;
        i += (size_t)k;
    }
    return true;
}

json_t *gw_json_string_lossy(const char *s, size_t len) {
    if (gw_utf8_valid(s, len)) return json_stringn(s, len);
    fu_buf b = {0};
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        int k = utf8_seq(u + i, len - i);
        if (k > 0) {
            if (fu_buf_append(&b, u + i, (size_t)k)) break;
            i += (size_t)k;
            continue;
        }
        /* one U+FFFD per maximal invalid subsequence */
        if (fu_buf_append(&b, "\xEF\xBF\xBD", 3)) break;
        size_t j = i + 1;
        if (k < 0) j = len;
        else
            while (j < len && (u[j] & 0xC0) == 0x80 && u[i] >= 0xC0) j++;
        i = j;
    }
    json_t *r = i >= len ? json_stringn(b.data ? b.data : "", b.len) : NULL;
    fu_buf_free(&b);
    return r;
}

/* ---- seeds -------------------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

uint64_t gw_step_seed(uint64_t seed, int choice, int64_t position) {
    uint64_t h = splitmix64(seed);
    h = splitmix64(h ^ (uint64_t)(uint32_t)choice);
    return splitmix64(h ^ (uint64_t)position);
}

/* ---- errors ---------------------------------------------------------------------------------- */

static const char *gw_error_type(int http) {
    switch (http) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    default: return http >= 500 ? "server_error" : "invalid_request_error";
    }
}

int gw_error_set(gw_error *e, int http, const char *param, const char *code, const char *fmt, ...) {
    e->http = http;
    e->type = gw_error_type(http);
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return http;
}

json_t *gw_error_object(const gw_error *e) {
    size_t mlen = strnlen(e->message, sizeof e->message);
    mlen = gw_utf8_complete_prefix(e->message, mlen); /* truncation may split a character */
    json_t *inner = json_object();
    json_object_set_new(inner, "message", gw_json_string_lossy(e->message, mlen));
    json_object_set_new(inner, "type", json_string(e->type ? e->type : "invalid_request_error"));
    json_object_set_new(inner, "param", e->param[0] ? gw_json_string_lossy(e->param, strlen(e->param)) : json_null());
    json_object_set_new(inner, "code", e->code ? json_string(e->code) : json_null());
    json_t *o = json_object();
    json_object_set_new(o, "error", inner);
    return o;
}

void gw_error_public(gw_error *e, const char *id) {
    static const struct {
        const char *code, *message;
    } fixed[] = {
        {"shard_unavailable", "a shard of the swarm is unavailable; retry later"},
        {"overloaded", "the shard servers are at capacity; retry later"},
        {"no_route", "no chain of shard servers can serve the request now; retry later"},
        {"shutting_down", "the server is shutting down"},
    };
    if (e->http < 500) return;
    int a, b, end = -1; /* the swarm's gap names blocks only: it stays */
    if (sscanf(e->message, "no server covers blocks [%d, %d)%n", &a, &b, &end) == 2 && end >= 0 &&
        !e->message[end])
        return;
    const char *msg = "the server could not complete the request";
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
        if (e->code && !strcmp(e->code, fixed[i].code)) msg = fixed[i].message;
    if (!strcmp(e->message, msg)) return;
    FU_LOG(FU_LOG_LEVEL_WARN, id, "answering %d %s: %s", e->http, e->code ? e->code : "server_error", e->message);
    snprintf(e->message, sizeof e->message, "%s", msg);
}

char *gw_error_json(const gw_error *e) {
    json_t *o = gw_error_object(e);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

/* ---- HTTP header checks --------------------------------------------------------------------- */

static bool gw_host_char(char ch, bool bracketed) {
    if ((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F') || ch == '.') return true;
    if (bracketed) return ch == ':';
    return (ch >= 'g' && ch <= 'z') || (ch >= 'G' && ch <= 'Z') || ch == '-' || ch == '_';
}

bool gw_http_authority(const char *v, size_t len, size_t *name_len, int *port) {
    size_t i = 0;
    bool bracketed = len > 0 && v[0] == '[';
    if (bracketed) {
        for (i = 1; i < len && v[i] != ']'; i++)
            if (!gw_host_char(v[i], true)) return false;
        if (i == len || i == 1) return false;
        i++; /* past ']' */
    } else {
        while (i < len && v[i] != ':')
            if (!gw_host_char(v[i++], false)) return false;
        if (i == 0) return false;
    }
    *name_len = i;
    *port = -1;
    if (i == len) return true;
    if (v[i] != ':' || len - i - 1 < 1 || len - i - 1 > 5) return false;
    long p = 0;
    for (size_t k = i + 1; k < len; k++) {
        if (v[k] < '0' || v[k] > '9') return false;
        p = p * 10 + (v[k] - '0');
    }
    if (p > 65535) return false;
    *port = (int)p;
    return true;
}

bool gw_http_loopback_name(const char *name, size_t len) {
    static const char *const names[] = {"localhost", "127.0.0.1", "[::1]"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (len == strlen(names[i]) && !strncasecmp(name, names[i], len)) return true;
    return false;
}

bool gw_http_origin(const char *v, size_t len, const char **host, size_t *host_len, int *port) {
    int dflt;
    size_t skip;
    if (len > 7 && !strncasecmp(v, "http://", 7)) skip = 7, dflt = 80;
    else if (len > 8 && !strncasecmp(v, "https://", 8)) skip = 8, dflt = 443;
    else return false;
    if (!gw_http_authority(v + skip, len - skip, host_len, port)) return false;
    *host = v + skip;
    if (*port < 0) *port = dflt;
    return true;
}

bool gw_http_json_type(const char *v, size_t len) {
    static const char json[] = "application/json";
    const size_t n = sizeof json - 1;
    size_t i = 0;
    while (i < len && (v[i] == ' ' || v[i] == '\t')) i++;
    if (len - i < n || strncasecmp(v + i, json, n)) return false;
    for (i += n; i < len && (v[i] == ' ' || v[i] == '\t'); i++) {}
    return i == len || v[i] == ';';
}

/* ---- server-sent events ------------------------------------------------------------------------- */

int gw_sse_event(fu_buf *out, const json_t *obj) {
    char *s = json_dumps(obj, JSON_COMPACT);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "sse event");
    int rc = fu_buf_appendf(out, "data: %s\n\n", s);
    free(s);
    return rc;
}

int gw_sse_done(fu_buf *out) { return fu_buf_append(out, "data: [DONE]\n\n", 14); }
