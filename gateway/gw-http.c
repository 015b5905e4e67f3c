/* gw-http.c -- fusion-gateway's HTTP side: libmicrohttpd (epoll, suspend/resume), OpenAI routes, SSE.
 *
 * Request bodies are parsed, and their routes run, on body threads while the
 * connection waits suspended; a watchdog cancels the generations of clients
 * that leave while suspended (libmicrohttpd does not watch those sockets) and
 * closes connections whose request is past its read deadline (slow clients). */
#include "gw-http.h"

#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "chat-template.h"
#include "clock.h"
#include "gw-files.h"
#include "gw-embed.h"
#include "gw-health.h"
#include "gw-jobs.h"
#include "gw-swarm.h"
#include "gw-web.h"
#include "log.h"
#include "mapped-file.h"
#include "status.h"

/* Threads that parse request bodies and run the tokenizer routes. */
#define GW_BODY_THREADS 2

/* How often the watchdog looks at suspended connections. */
#define GW_WATCH_INTERVAL_MS 100

/* Where the gateway listens without --listen. */
#define GW_DEFAULT_LISTEN "127.0.0.1:8080"

/* A host name as an HTTP Host header names it ("[v6]" with brackets), NUL-terminated. */
#define GW_HOST_MAX 256

typedef struct gw_conn gw_conn;

/* What a connection is doing, for the read deadlines (gw_sock.phase). */
typedef enum gw_phase {
    GW_PHASE_HEAD, /* reading a request's headers: --header-timeout-s */
    GW_PHASE_BODY, /* reading its body: --body-timeout-s */
    GW_PHASE_BUSY, /* the request is in: parsed, generating (suspended) or answered; no deadline */
} gw_phase;

/* One client connection from accept to close (libmicrohttpd's socket context), for the read
 * deadlines and the eviction of slow requests; listed in gw_server.socks under gw_server.mu,
 * unlinked before libmicrohttpd closes its socket, so that a listed fd is always open. */
typedef struct gw_sock {
    struct gw_sock *prev, *next;
    int fd;
    gw_phase phase;
    int64_t since_us; /* when the phase began (fu_now_us) */
    bool cut;         /* shut down (a deadline passed, or evicted): libmicrohttpd is closing it */
} gw_sock;

/* A response prepared off the event loop, queued when the connection resumes. */
typedef struct gw_reply {
    bool ready;
    int status;
    const char *ctype;
    char *body; /* malloc'd */
    size_t len;
} gw_reply;

struct gw_server {
    const gw_config *cfg;
    const gw_model *model;
    gw_engine *engine;
    gw_metrics *metrics;
    gw_files *files; /* /v1/files: the data directory and its database */
    gw_jobs *jobs;   /* /v1/fine_tuning/jobs and their runner */
    gw_health *health; /* /health's readiness and /metrics' per-shard figures */
    gw_embed *embed;   /* /v1/embeddings */
    struct MHD_Daemon *d;
    struct MHD_Daemon *scrape_d; /* --metrics-listen: /metrics without a key; NULL: none */
    int scrape_port;
    int listen_fd;
    int port;                       /* the bound port */
    char listen_name[GW_HOST_MAX];  /* --listen's host, accepted in Host headers */
    char *https_cert, *https_key;
    atomic_bool stopping;
    pthread_mutex_t mu; /* the connection lists */
    gw_conn *conns;
    gw_sock *socks; /* every open connection */
    int n_socks;
    long long started;
    /* the watchdog: libmicrohttpd does not watch suspended connections, so this
     * thread polls their sockets and cancels the generation of a client that left;
     * it also closes the connections past their read deadline (gw_deadlines_once) */
    pthread_t watch;
    bool watch_started;
    pthread_mutex_t watch_mu;
    pthread_cond_t watch_cv;
    /* body threads: parsing request bodies and the CPU-bound routes (/tokenize on a
     * megabyte takes hundreds of milliseconds) run here, off the event loop */
    pthread_t body_threads[GW_BODY_THREADS];
    int n_body_threads;
    pthread_mutex_t body_mu;
    pthread_cond_t body_cv;
    gw_conn *body_head, *body_tail; /* the queue (gw_conn.body_next) */
    bool body_stopping;
};

struct gw_conn {
    gw_server *srv;
    struct MHD_Connection *mc;
    gw_conn *prev, *next;
    gw_route route;
    bool is_post;
    bool is_delete;
    char *url;        /* fine-tuning: the request's URL (malloc'd), for its body thread */
    fu_buf body;
    bool too_large;
    bool responded;
    gw_job *job;
    bool suspended; /* under the job's lock */
    /* body work: the connection stays suspended while a body thread has it */
    gw_conn *body_next;
    bool deferred;  /* responses go to `reply` (set by the body thread while it runs the route) */
    bool body_failed; /* the route could not answer at all: close the connection */
    gw_reply reply;
    char *origin;     /* the request's Origin once allowed, echoed in CORS headers (malloc'd), or NULL */
    bool close;       /* the request's framing is doubtful: close the connection after answering */
    gw_sock *sock;    /* its connection's deadlines (NULL: untracked) */
    char owner[GW_OWNER_MAX]; /* who the API key names (gw_files_owner) */
    bool admin;       /* an --admin-key: sees every owner's files */
    gw_upload *upload; /* POST /v1/files: the body streams here instead of into `body` */
    int status;        /* the answer's HTTP status; 0: none yet */
    double t0;         /* monotonic seconds the request arrived */
    char path[96];     /* its URL's path, for the access log */
};

/* ---- responses --------------------------------------------------------------------------- */

/* The headers of every response to c: CORS for an allowed Origin, a close after a doubtful request. */
static void gw_add_headers(gw_conn *c, struct MHD_Response *r) {
    if (c->origin) {
        MHD_add_response_header(r, "Access-Control-Allow-Origin", c->origin);
        MHD_add_response_header(r, "Vary", "Origin");
    }
    if (c->close) MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
}

/* Hands body[0..len) (malloc'd, taken) to libmicrohttpd (event loop only); ctype NULL: none. */
static enum MHD_Result gw_queue(gw_conn *c, int status, const char *ctype, char *body, size_t len) {
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body ? body : (char *)"",
                                                             body ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    if (ctype) MHD_add_response_header(r, "Content-Type", ctype);
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    gw_add_headers(c, r);
    enum MHD_Result ret = MHD_queue_response(c->mc, (unsigned)status, r);
    MHD_destroy_response(r);
    return ret;
}

/* Counts an answer of `status` to c (the access log tells it). */
static void gw_count(gw_conn *c, int status) {
    c->status = status;
    gw_metrics_request(c->srv->metrics, c->route, status);
}

/* Queues response r (made by the caller, released here) with the common headers, counted. */
static enum MHD_Result gw_queue_made(gw_conn *c, int status, struct MHD_Response *r) {
    gw_add_headers(c, r);
    c->responded = true;
    gw_count(c, status);
    enum MHD_Result ret = MHD_queue_response(c->mc, (unsigned)status, r);
    MHD_destroy_response(r);
    return ret;
}

/* Queues a response with body[0..len) (malloc'd, taken); on a body thread it is
 * kept in c->reply and queued when the connection resumes. */
static enum MHD_Result gw_respond(gw_conn *c, int status, const char *ctype, char *body, size_t len) {
    if (c->deferred) {
        free(c->reply.body);
        c->reply = (gw_reply){true, status, ctype, body, len};
        c->responded = true;
        gw_count(c, status);
        return MHD_YES;
    }
    c->responded = true;
    gw_count(c, status);
    return gw_queue(c, status, ctype, body, len);
}

static enum MHD_Result gw_respond_json(gw_conn *c, int status, json_t *o) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) return MHD_NO;
    return gw_respond(c, status, "application/json", s, strlen(s));
}

/* Answers an error; a server error's message is made public first (gw_error_public). */
static enum MHD_Result gw_respond_error(gw_conn *c, const gw_error *e) {
    gw_error pub = *e;
    gw_error_public(&pub, NULL);
    e = &pub;
    char *s = gw_error_json(e);
    if (!s) return MHD_NO;
    return gw_respond(c, e->http, "application/json", s, strlen(s));
}

static enum MHD_Result gw_fail(gw_conn *c, int http, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static enum MHD_Result gw_fail(gw_conn *c, int http, const char *param, const char *code, const char *fmt, ...) {
    gw_error e;
    gw_error_set(&e, http, param, code, "%s", "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof e.message, fmt, ap);
    va_end(ap);
    return gw_respond_error(c, &e);
}

/* ---- routing and auth ---------------------------------------------------------------------- */

static gw_route gw_route_of(const char *url, bool *post_expected) {
    static const struct {
        const char *path;
        gw_route r;
        bool post;
    } routes[] = {
        {"/v1/chat/completions", GW_ROUTE_CHAT, true},  {"/v1/completions", GW_ROUTE_COMPLETIONS, true},
        {"/v1/models", GW_ROUTE_MODELS, false},         {"/tokenize", GW_ROUTE_TOKENIZE, true},
        {"/detokenize", GW_ROUTE_DETOKENIZE, true},     {"/apply-template", GW_ROUTE_APPLY_TEMPLATE, true},
        {"/health", GW_ROUTE_HEALTH, false},            {"/metrics", GW_ROUTE_METRICS, false},
        {"/livez", GW_ROUTE_HEALTH, false},             {"/v1/embeddings", GW_ROUTE_EMBEDDINGS, true},
        {"/embeddings", GW_ROUTE_EMBEDDINGS, true},
        {"/chat/completions", GW_ROUTE_CHAT, true},     {"/completions", GW_ROUTE_COMPLETIONS, true},
        {"/v1/health", GW_ROUTE_HEALTH, false},         {"/v1/swarm", GW_ROUTE_SWARM, false},
        {"/v1/load_lora_adapter", GW_ROUTE_LOAD_LORA, true}, {"/v1/unload_lora_adapter", GW_ROUTE_UNLOAD_LORA, true},
    };
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(url, routes[i].path)) {
            *post_expected = routes[i].post;
            return routes[i].r;
        }
    if (!strncmp(url, "/v1/models/", 11)) {
        *post_expected = false;
        return GW_ROUTE_MODELS;
    }
    if (!strncmp(url, "/v1/fine_tuning/jobs", 20) && (!url[20] || url[20] == '/')) {
        *post_expected = false; /* per URL: gw_jobs_methods */
        return GW_ROUTE_FINE_TUNING;
    }
    *post_expected = !strcmp(url, "/v1/files"); /* GET too: gw_files_method */
    if (*post_expected || !strncmp(url, "/v1/files/", 10)) return GW_ROUTE_FILES;
    return GW_ROUTE_OTHER;
}

/* Constant-time comparison of a presented key with a configured one. */
static bool gw_key_equal(const char *a, size_t alen, const char *b) {
    size_t blen = strlen(b);
    unsigned char diff = alen != blen;
    for (size_t i = 0; i < blen; i++) diff |= (unsigned char)(b[i] ^ (i < alen ? a[i] : 0));
    return diff == 0;
}

/* The value of header `name` and its length without trailing blanks (not part of a field
 * value, and kept by libmicrohttpd), or NULL. */
static const char *gw_header(gw_conn *c, const char *name, size_t *len) {
    const char *v = NULL;
    *len = 0;
    if (MHD_lookup_connection_value_n(c->mc, MHD_HEADER_KIND, name, strlen(name), &v, len) != MHD_YES) return NULL;
    while (*len && (v[*len - 1] == ' ' || v[*len - 1] == '\t')) --*len;
    return v;
}

/* Whether c's API key is accepted; sets c->owner (and c->admin) from it: without configured
 * keys everyone is the one anonymous owner. */
static bool gw_authorized(gw_conn *c) {
    const gw_config *cfg = c->srv->cfg;
    if (cfg->n_api_keys == 0) {
        gw_files_owner(NULL, 0, c->owner);
        return true;
    }
    size_t hlen;
    const char *h = gw_header(c, "Authorization", &hlen);
    if (!h || hlen < 7 || strncasecmp(h, "Bearer ", 7)) return false;
    size_t skip = 7;
    while (skip < hlen && h[skip] == ' ') skip++;
    const char *key = h + skip;
    size_t len = hlen - skip; /* the whole value: "KEY\0junk" is not KEY */
    bool ok = false, admin = false;
    for (int i = 0; i < cfg->n_api_keys; i++) ok |= gw_key_equal(key, len, cfg->api_keys[i]);
    for (int i = 0; i < cfg->n_admin_keys; i++) admin |= gw_key_equal(key, len, cfg->admin_keys[i]);
    if (ok) gw_files_owner(key, len, c->owner);
    c->admin = ok && admin;
    return ok;
}

/* ---- request checks: framing, Host, Origin (DNS rebinding, CSRF) ------------------------------ */

/* What gw_scan_header counts over a request's headers. */
typedef struct gw_header_scan {
    int n_host, n_length, n_transfer;
    const char *length; /* the first Content-Length */
    size_t length_len;
    bool lengths_differ;
    bool nul;               /* a header line holds a NUL or another control byte */
    const char *value_end;  /* the previous header's value's end */
} gw_header_scan;

/* Whether [p, end) holds a byte other than the NULs and blanks that line ends leave. */
static bool gw_junk_between(const char *p, const char *end) {
    for (; p < end; p++)
        if (*p && *p != ' ' && *p != '\t' && *p != '\r' && *p != '\n') return true;
    return false;
}

/* Whether bytes follow a NUL in a header line. libmicrohttpd parses the header block in place
 * and cuts a value at its first NUL ("Bearer KEY\0junk" reads "Bearer KEY"); what the line
 * held after it stays in the buffer between that value's end and the next header's name (or,
 * after the last header, the end of the header block), where only the NULs and blanks of line
 * ends may be. `next` is that name or block end; NULL when unknown: then the last line's end
 * is taken as a NUL at most two bytes on. */
static bool gw_bytes_after_nul(const char *end, const char *next) {
    if (!end) return false;
    if (next && next > end && next - end < 65536) return gw_junk_between(end, next);
    const char *p = end + 1; /* end[0] is the value's NUL */
    while (*p == ' ' || *p == '\t') p++;
    return *p != '\0' && p != next;
}

/* Whether s[0..len) holds a control byte (NUL and DEL included) other than a tab: no header
 * name or value may (RFC 9110, 5.5). */
static bool gw_has_ctl(const char *s, size_t len) {
    for (size_t i = 0; i < len; i++) {
        unsigned char b = (unsigned char)s[i];
        if ((b < 0x20 && b != '\t') || b == 0x7f) return true;
    }
    return false;
}

/* The end of c's header block (after its empty line) in libmicrohttpd's read buffer, where the
 * request line begins at `method` and the block is REQUEST_HEADER_SIZE bytes long; NULL when that
 * does not hold what the headers' values point at (last: the last value's end). */
static const char *gw_header_block_end(gw_conn *c, const char *method, const char *last) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c->mc, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
    if (!ci || !last || ci->header_size > ((size_t)1 << 20)) return NULL;
    const char *end = method + ci->header_size;
    return last > method && last < end ? end : NULL;
}

static enum MHD_Result gw_scan_header(void *cls, enum MHD_ValueKind kind, const char *key, size_t key_len,
                                      const char *value, size_t value_len) {
    (void)kind;
    gw_header_scan *h = cls;
    h->nul |= strlen(key) != key_len || gw_has_ctl(key, key_len) || (value && gw_has_ctl(value, value_len)) ||
              gw_bytes_after_nul(h->value_end, key);
    h->value_end = value ? value + value_len : NULL;
    if (!strcasecmp(key, MHD_HTTP_HEADER_HOST)) h->n_host++;
    else if (!strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING)) h->n_transfer++;
    else if (!strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH)) {
        if (h->n_length++ == 0) {
            h->length = value;
            h->length_len = value_len;
        } else if (value_len != h->length_len || memcmp(value, h->length, value_len)) {
            h->lengths_differ = true;
        }
    }
    return MHD_YES;
}

/* Whether list holds "*" or v[0..len) (case-insensitive). */
static bool gw_list_has(const fu_opt_list *list, const char *v, size_t len) {
    for (size_t i = 0; i < list->n; i++) {
        const char *e = list->items[i];
        if (!strcmp(e, "*") || (strlen(e) == len && !strncasecmp(e, v, len))) return true;
    }
    return false;
}

/* The local address c arrived on, as a Host header names it ("1.2.3.4", "[v6]"), into
 * out[GW_HOST_MAX]; "" when unknown. */
static void gw_local_name(gw_conn *c, char *out) {
    out[0] = '\0';
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c->mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (!ci || getsockname(ci->connect_fd, (struct sockaddr *)&ss, &sl)) return;
    char text[INET6_ADDRSTRLEN];
    if (ss.ss_family == AF_INET) {
        if (inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, out, GW_HOST_MAX) == NULL) out[0] = '\0';
    } else if (ss.ss_family == AF_INET6) {
        const struct in6_addr *a = &((struct sockaddr_in6 *)&ss)->sin6_addr;
        if (IN6_IS_ADDR_V4MAPPED(a)) {
            if (inet_ntop(AF_INET, &a->s6_addr[12], out, GW_HOST_MAX) == NULL) out[0] = '\0';
        } else if (inet_ntop(AF_INET6, a, text, sizeof text)) {
            snprintf(out, GW_HOST_MAX, "[%s]", text);
        }
    }
}

/* Whether the Host header h[0..len) names this gateway: a loopback name, the --listen
 * host, the address the connection arrived on (an IP, which no rebinding page can use), or
 * an --allowed-host entry (with or without the port); any port. -1 when it is malformed. */
static int gw_host_allowed(gw_conn *c, const char *h, size_t len) {
    size_t nl;
    int port;
    if (!gw_http_authority(h, len, &nl, &port)) return -1;
    const gw_server *s = c->srv;
    if (gw_http_loopback_name(h, nl) || gw_list_has(&s->cfg->allowed_hosts, h, nl) ||
        gw_list_has(&s->cfg->allowed_hosts, h, len))
        return 1;
    if (s->listen_name[0] && strlen(s->listen_name) == nl && !strncasecmp(s->listen_name, h, nl)) return 1;
    char local[GW_HOST_MAX];
    gw_local_name(c, local);
    return strlen(local) == nl && !strncasecmp(local, h, nl);
}

/* Whether a browser's Origin o[0..len) may use the API: a --cors-origin entry, a loopback
 * origin on this gateway's port, or the request's own Host (same origin). */
static bool gw_origin_allowed(gw_conn *c, const char *o, size_t len, const char *host, size_t host_len) {
    const gw_server *s = c->srv;
    if (gw_list_has(&s->cfg->cors_origins, o, len)) return true;
    const char *name;
    size_t nl, hnl;
    int port, hport;
    if (!gw_http_origin(o, len, &name, &nl, &port)) return false;
    if (gw_http_loopback_name(name, nl) && port == s->port) return true;
    if (!host || !gw_http_authority(host, host_len, &hnl, &hport)) return false;
    return hnl == nl && !strncasecmp(host, name, nl) && (hport == port || (hport < 0 && (port == 80 || port == 443)));
}

/* Checks a new request's framing (no NUL or control byte in a header), Host and Origin; fills *e and returns its status when
 * the request is refused, else 0 (an allowed Origin is kept in c->origin). */
static int gw_check_request(gw_conn *c, const char *method, const char *version, gw_error *e) {
    gw_header_scan h = {0};
    MHD_get_connection_values_n(c->mc, MHD_HEADER_KIND, gw_scan_header, &h);
    h.nul |= gw_bytes_after_nul(h.value_end, gw_header_block_end(c, method, h.value_end));
    if (h.lengths_differ || (h.n_length && h.n_transfer)) {
        c->close = true; /* where the body ends is ambiguous */
        return gw_error_set(e, 400, NULL, "invalid_request",
                            "conflicting Content-Length or Transfer-Encoding headers");
    }
    if (h.nul) return gw_error_set(e, 400, NULL, "invalid_request", "a header holds a NUL or control byte");
    if (h.n_host > 1) return gw_error_set(e, 400, NULL, "invalid_request", "more than one Host header");
    size_t host_len = 0, origin_len = 0;
    const char *host = gw_header(c, MHD_HTTP_HEADER_HOST, &host_len);
    if (!host && !strcmp(version, MHD_HTTP_VERSION_1_1))
        return gw_error_set(e, 400, NULL, "invalid_request", "an HTTP/1.1 request needs a Host header");
    if (host) {
        int ok = gw_host_allowed(c, host, host_len);
        if (ok < 0) return gw_error_set(e, 400, NULL, "invalid_request", "the Host header is malformed");
        if (!ok)
            return gw_error_set(e, 403, NULL, "host_not_allowed",
                                "the Host '%.100s' is not served here (the gateway's --allowed-host option adds names)",
                                host);
    }
    const char *origin = gw_header(c, "Origin", &origin_len);
    if (!origin) return 0;
    if (!gw_origin_allowed(c, origin, origin_len, host, host_len))
        return gw_error_set(e, 403, NULL, "origin_not_allowed",
                            "the Origin '%.100s' may not use this API (the gateway's --cors-origin option adds "
                            "origins)", origin);
    if (!(c->origin = strndup(origin, origin_len))) return gw_error_set(e, 500, NULL, NULL, "out of memory");
    return 0;
}

/* Answers a CORS preflight (OPTIONS) on a known route: 204 with the methods it allows. */
static enum MHD_Result gw_preflight(gw_conn *c, const char *methods) {
    struct MHD_Response *r = MHD_create_response_from_buffer(0, (char *)"", MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Allow", methods);
    if (c->origin) {
        MHD_add_response_header(r, "Access-Control-Allow-Methods", methods);
        size_t n = 0;
        const char *asked = gw_header(c, "Access-Control-Request-Headers", &n);
        bool plain = asked && n < 1024 && strspn(asked, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                        "0123456789-_, ") == n;
        MHD_add_response_header(r, "Access-Control-Allow-Headers", plain ? asked : "Authorization, Content-Type");
        MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    }
    return gw_queue_made(c, 204, r);
}

/* ---- simple routes ---------------------------------------------------------------------------- */

static json_t *gw_model_object(gw_server *s) {
    return json_pack("{s:s, s:s, s:I, s:s, s:i}", "id", s->model->name, "object", "model", "created",
                     (json_int_t)s->started, "owned_by", "fusion", "max_model_len", s->model->ctx);
}

static enum MHD_Result gw_route_models(gw_conn *c, const char *url) {
    gw_server *s = c->srv;
    gw_lora_set *ls = s->model->loras;
    if (!strncmp(url, "/v1/models/", 11)) {
        json_t *o = !strcmp(url + 11, s->model->name) ? gw_model_object(s)
                    : ls                             ? gw_lora_model(ls, s->model->name, url + 11)
                                                     : NULL;
        if (!o) return gw_fail(c, 404, "model", "model_not_found", "The model '%.200s' does not exist", url + 11);
        return gw_respond_json(c, 200, o);
    }
    json_t *data = json_pack("[o]", gw_model_object(s));
    if (!data || (ls && gw_lora_models(ls, s->model->name, data))) {
        json_decref(data);
        return gw_fail(c, 500, NULL, NULL, "out of memory");
    }
    return gw_respond_json(c, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

/* A string member of a request body, or NULL with *err (400 naming it). */
static const char *gw_body_string(const json_t *body, const char *key, gw_error *err) {
    const char *v = json_string_value(json_object_get(body, key));
    if (!v) gw_error_set(err, 400, key, "missing_required_parameter", "'%s' is required (a string)", key);
    return v;
}

/* 200 with plain text msg (vLLM's answer to adapter loads). */
static enum MHD_Result gw_respond_text(gw_conn *c, const char *msg) {
    char *copy = strdup(msg);
    if (!copy) return gw_fail(c, 500, NULL, NULL, "out of memory");
    return gw_respond(c, 200, "text/plain; charset=utf-8", copy, strlen(copy));
}

/* POST /v1/load_lora_adapter {lora_name, lora_path} (vLLM's shape). */
static enum MHD_Result gw_route_load_lora(gw_conn *c, const json_t *body) {
    gw_server *s = c->srv;
    gw_error err;
    if (!s->model->loras) return gw_fail(c, 403, NULL, NULL, "this gateway serves no LoRA adapters");
    const char *name = gw_body_string(body, "lora_name", &err), *path = name ? gw_body_string(body, "lora_path", &err) : NULL;
    if (!path || gw_lora_add(s->model->loras, name, path, s->model->name, true, &err)) return gw_respond_error(c, &err);
    char msg[256];
    snprintf(msg, sizeof msg, "Success: LoRA adapter '%.128s' added successfully.", name);
    return gw_respond_text(c, msg);
}

/* POST /v1/unload_lora_adapter {lora_name}. */
static enum MHD_Result gw_route_unload_lora(gw_conn *c, const json_t *body) {
    gw_server *s = c->srv;
    gw_error err;
    const char *name = gw_body_string(body, "lora_name", &err);
    if (name && !s->model->loras)
        return gw_fail(c, 404, "lora_name", "model_not_found", "The lora adapter '%.128s' cannot be found.", name);
    if (!name || gw_lora_remove(s->model->loras, gw_engine_chain(s->engine), name, &err))
        return gw_respond_error(c, &err);
    char msg[256];
    snprintf(msg, sizeof msg, "Success: LoRA adapter '%.128s' removed successfully.", name);
    return gw_respond_text(c, msg);
}

/* The Prometheus page: the gateway's counters and histograms, readiness, every shard's figures. */
static int gw_metrics_page(gw_server *s, fu_buf *b) {
    int rc = gw_metrics_render(s->metrics, s->engine ? gw_engine_queue_depth(s->engine) : 0, b);
    return rc || !s->health ? rc : gw_health_render(s->health, b);
}

static enum MHD_Result gw_route_metrics(gw_conn *c) {
    fu_buf b = {0};
    if (gw_metrics_page(c->srv, &b)) {
        fu_buf_free(&b);
        return gw_fail(c, 500, NULL, NULL, "out of memory");
    }
    return gw_respond(c, 200, "text/plain; version=0.0.4", b.data, b.len);
}

/* /livez and /health?live=1: the process answers. /health: 200 when a full chain can serve,
 * else 503 with the reason (no addresses). *status gets the HTTP status; new reference. */
static json_t *gw_health_json(gw_server *s, struct MHD_Connection *mc, const char *url, int *status) {
    const char *live = MHD_lookup_connection_value(mc, MHD_GET_ARGUMENT_KIND, "live");
    char reason[256];
    *status = 200;
    if (!strcmp(url, "/livez") || (live && strcmp(live, "0")) || !s->health ||
        gw_health_ready(s->health, reason, sizeof reason))
        return json_pack("{s:s}", "status", "ok");
    *status = 503;
    return json_pack("{s:s, s:s}", "status", "unavailable", "reason", reason);
}

static enum MHD_Result gw_route_health(gw_conn *c, const char *url) {
    int status;
    json_t *o = gw_health_json(c->srv, c->mc, url, &status);
    return gw_respond_json(c, status, o);
}

/* GET or HEAD of one of the swarm page's files: served without a key (they carry no data; the
 * page asks for the key and sends it to the API itself), 304 when the client's copy is current. */
static enum MHD_Result gw_route_web(gw_conn *c, const gw_web_file *f, const char *method) {
    if (strcmp(method, "GET") && strcmp(method, "HEAD"))
        return gw_fail(c, 405, NULL, "method_not_allowed", "%s is not allowed on %.200s", method, f->url);
    size_t len;
    const char *inm = gw_header(c, MHD_HTTP_HEADER_IF_NONE_MATCH, &len);
    bool fresh = inm && gw_web_fresh(f, inm, len);
    struct MHD_Response *r = gw_web_response(f, fresh);
    return r ? gw_queue_made(c, fresh ? 304 : 200, r) : MHD_NO;
}

static enum MHD_Result gw_route_swarm(gw_conn *c) {
    json_t *o = gw_engine_swarm_json(c->srv->engine);
    if (!o) return gw_fail(c, 500, NULL, NULL, "out of memory");
    return gw_respond_json(c, 200, o);
}

static bool gw_opt_bool(const json_t *o, const char *key, bool dflt) {
    const json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

/* POST /v1/embeddings (on a body thread: the chain's Forward calls). */
static enum MHD_Result gw_route_embeddings(gw_conn *c, const json_t *body) {
    json_t *out = NULL;
    gw_error err;
    if (gw_embed_run(c->srv->embed, body, &out, &err)) return gw_respond_error(c, &err);
    return gw_respond_json(c, 200, out);
}

static enum MHD_Result gw_route_tokenize(gw_conn *c, const json_t *body) {
    const gw_model *m = c->srv->model;
    const json_t *content = json_object_get(body, "content");
    if (!json_is_string(content))
        return gw_fail(c, 400, "content", "invalid_type", "'content' must be a string");
    int32_t *ids = NULL;
    size_t n = 0;
    if (tok_encode(m->tok, json_string_value(content), json_string_length(content),
                   gw_opt_bool(body, "add_special", false), gw_opt_bool(body, "parse_special", true), &ids, &n))
        return gw_fail(c, 400, "content", NULL, "tokenizer: %s", fu_last_error());
    bool pieces = gw_opt_bool(body, "with_pieces", false);
    json_t *arr = json_array();
    for (size_t i = 0; i < n; i++) {
        if (!pieces) {
            json_array_append_new(arr, json_integer(ids[i]));
            continue;
        }
        const char *b;
        size_t len;
        json_t *piece;
        if (tok_token_piece(m->tok, ids[i], &b, &len)) piece = json_string("");
        else if (gw_utf8_valid(b, len)) piece = json_stringn(b, len);
        else {
            piece = json_array();
            for (size_t k = 0; k < len; k++) json_array_append_new(piece, json_integer((unsigned char)b[k]));
        }
        json_array_append_new(arr, json_pack("{s:i, s:o}", "id", ids[i], "piece", piece));
    }
    free(ids);
    return gw_respond_json(c, 200, json_pack("{s:o}", "tokens", arr));
}

static enum MHD_Result gw_route_detokenize(gw_conn *c, const json_t *body) {
    const gw_model *m = c->srv->model;
    const json_t *toks = json_object_get(body, "tokens");
    if (!json_is_array(toks)) return gw_fail(c, 400, "tokens", "invalid_type", "'tokens' must be an array of token ids");
    size_t n = json_array_size(toks);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) return gw_fail(c, 500, NULL, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(toks, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= m->vocab) {
            free(ids);
            return gw_fail(c, 400, "tokens", "invalid_value", "'tokens[%zu]' is not a token id in [0, %d)", i,
                           m->vocab);
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    char *text = NULL;
    size_t len = 0;
    int rc = tok_decode(m->tok, ids, n, false, &text, &len);
    free(ids);
    if (rc) return gw_fail(c, 400, "tokens", NULL, "%s", fu_last_error());
    json_t *s = gw_json_string_lossy(text, len);
    free(text);
    return gw_respond_json(c, 200, json_pack("{s:o}", "content", s));
}

static enum MHD_Result gw_route_apply_template(gw_conn *c, const json_t *body) {
    const gw_model *m = c->srv->model;
    gw_request r;
    gw_error err;
    if (gw_request_parse(body, GW_KIND_TEMPLATE, &c->srv->cfg->limits, m->vocab, &r, &err)) return gw_respond_error(c, &err);
    char *text = NULL;
    int rc = gw_render_chat(m, &r, &text, &err);
    gw_request_free(&r);
    if (rc) return gw_respond_error(c, &err);
    json_t *o = json_pack("{s:s}", "prompt", text);
    free(text);
    return gw_respond_json(c, 200, o);
}

/* ---- generation ----------------------------------------------------------------------------------- */

/* Called by workers with the job locked: something new to send. */
static void gw_wake(void *arg) {
    gw_conn *c = arg;
    if (c->suspended) {
        c->suspended = false;
        MHD_resume_connection(c->mc);
    }
}

static ssize_t gw_sse_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    gw_conn *c = cls;
    gw_job *j = c->job;
    gw_job_lock(j);
    size_t n = gw_job_take(j, buf, max);
    if (n) {
        gw_job_unlock(j);
        return (ssize_t)n;
    }
    if (gw_job_finished(j)) {
        gw_job_unlock(j);
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    if (gw_job_cancelled(j) || atomic_load(&c->srv->stopping)) {
        gw_job_unlock(j);
        return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    c->suspended = true;
    MHD_suspend_connection(c->mc);
    gw_job_unlock(j);
    return 0;
}

/* Answers a generation request once its job has something to say, or suspends until then. */
static enum MHD_Result gw_job_progress(gw_conn *c) {
    gw_job *j = c->job;
    gw_job_lock(j);
    gw_job_phase ph = gw_job_phase_get(j);
    if (ph == GW_JOB_PENDING) {
        if (atomic_load(&c->srv->stopping)) {
            gw_job_unlock(j);
            return gw_fail(c, 503, NULL, "shutting_down", "the server is shutting down");
        }
        c->suspended = true;
        MHD_suspend_connection(c->mc);
        gw_job_unlock(j);
        return MHD_YES;
    }
    gw_error err = {0};
    char *body = NULL;
    if (ph == GW_JOB_FAILED) err = *gw_job_error(j);
    else if (ph == GW_JOB_DONE) body = strdup(gw_job_body(j));
    gw_job_unlock(j);
    if (ph == GW_JOB_FAILED) return gw_respond_error(c, &err);
    if (ph == GW_JOB_DONE) {
        if (!body) return gw_fail(c, 500, NULL, NULL, "out of memory");
        return gw_respond(c, 200, "application/json", body, strlen(body));
    }
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, gw_sse_reader, c, NULL);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    MHD_add_response_header(r, "X-Accel-Buffering", "no");
    gw_add_headers(c, r);
    enum MHD_Result ret = MHD_queue_response(c->mc, 200, r);
    MHD_destroy_response(r);
    c->responded = true;
    gw_count(c, 200);
    return ret;
}

static enum MHD_Result gw_route_generate(gw_conn *c, const json_t *body) {
    gw_server *s = c->srv;
    gw_kind kind = c->route == GW_ROUTE_CHAT ? GW_KIND_CHAT : GW_KIND_COMPLETION;
    if (atomic_load(&s->stopping)) return gw_fail(c, 503, NULL, "shutting_down", "the server is shutting down");
    gw_request r;
    gw_error err;
    if (gw_request_parse(body, kind, &s->cfg->limits, s->model->vocab, &r, &err)) return gw_respond_error(c, &err);
    gw_lora *lora = NULL;
    if (r.model && strcmp(r.model, s->model->name) && !(s->model->loras && (lora = gw_lora_get(s->model->loras, r.model)))) {
        gw_error_set(&err, 404, "model", "model_not_found",
                     "The model '%.200s' does not exist or you do not have access to it.", r.model);
        err.type = "invalid_request_error";
        gw_request_free(&r);
        return gw_respond_error(c, &err);
    }
    gw_job *j = NULL;
    if (gw_job_new(s->engine, &r, &j)) {
        gw_request_free(&r);
        if (lora) gw_lora_put(s->model->loras, lora);
        return gw_fail(c, 500, NULL, NULL, "out of memory");
    }
    gw_job_set_lora(j, lora);
    gw_job_lock(j);
    gw_job_set_wake(j, gw_wake, c);
    gw_job_unlock(j);
    pthread_mutex_lock(&s->mu); /* the watchdog and gw_server_stop read c->job */
    c->job = j;
    pthread_mutex_unlock(&s->mu);
    if (gw_job_submit(j)) {
        gw_job_lock(j);
        gw_job_set_wake(j, NULL, NULL);
        gw_job_unlock(j);
        return gw_fail(c, 429, NULL, "rate_limit_exceeded",
                       "the server is overloaded: too many requests are waiting, retry later");
    }
    return MHD_YES; /* gw_handle follows the job once the connection resumes */
}

/* ---- slow clients: read deadlines and eviction ------------------------------------------------------ */

/* libmicrohttpd's timeout counts from a connection's last byte, so a client that trickles a
 * header line or a body byte every few seconds keeps a connection forever, and a few hundred
 * such clients fill the table. Here each request must arrive within fixed deadlines from its
 * start, whatever its pace (the watchdog closes the late ones), and a new connection past
 * max_connections - reserve evicts the oldest unfinished request. */

/* A phase's deadline in microseconds, or -1 for none. */
static int64_t gw_phase_limit_us(const gw_server *s, gw_phase ph) {
    if (ph == GW_PHASE_HEAD) return s->cfg->header_timeout_s * 1000000LL;
    if (ph == GW_PHASE_BODY) return s->cfg->body_timeout_s * 1000000LL;
    return -1;
}

/* Ends k's connection (under s->mu): both directions are shut down, which libmicrohttpd's
 * event loop sees as the client's close; it then closes the socket itself (it owns it). */
static void gw_sock_cut(gw_sock *k, const char *why) {
    if (k->cut) return;
    k->cut = true;
    FU_DEBUG("closing a connection: %s", why);
    shutdown(k->fd, SHUT_RDWR);
}

/* The connection that has been sending its request (headers or body) longest, other than
 * `except`, or NULL; under s->mu. */
static gw_sock *gw_sock_oldest_reading(gw_server *s, const gw_sock *except) {
    gw_sock *best = NULL;
    for (gw_sock *k = s->socks; k; k = k->next)
        if (k != except && !k->cut && k->phase != GW_PHASE_BUSY && (!best || k->since_us < best->since_us)) best = k;
    return best;
}

/* A new connection (libmicrohttpd's thread): listed, reading its headers from now on. */
static void gw_sock_open(gw_server *s, struct MHD_Connection *mc, void **ctx) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    gw_sock *k = ci && ci->connect_fd != MHD_INVALID_SOCKET ? calloc(1, sizeof *k) : NULL;
    *ctx = k;
    if (!k) return; /* untracked: libmicrohttpd's own timeout still applies */
    k->fd = ci->connect_fd;
    k->phase = GW_PHASE_HEAD;
    k->since_us = fu_now_us();
    int max = s->cfg->max_connections;
    int reserve = s->cfg->connection_reserve < max / 2 ? s->cfg->connection_reserve : max / 2;
    pthread_mutex_lock(&s->mu);
    k->next = s->socks;
    if (s->socks) s->socks->prev = k;
    s->socks = k;
    if (++s->n_socks > max - reserve) {
        gw_sock *old = gw_sock_oldest_reading(s, k);
        if (old) gw_sock_cut(old, "the connection table is nearly full: the oldest unfinished request makes room");
    }
    pthread_mutex_unlock(&s->mu);
}

/* A closed connection (libmicrohttpd's thread, before it closes the socket): unlisted, freed. */
static void gw_sock_close(gw_server *s, gw_sock *k) {
    if (!k) return;
    pthread_mutex_lock(&s->mu);
    if (k->prev) k->prev->next = k->next;
    else s->socks = k->next;
    if (k->next) k->next->prev = k->prev;
    s->n_socks--;
    pthread_mutex_unlock(&s->mu);
    free(k);
}

static void gw_notify(void *cls, struct MHD_Connection *mc, void **ctx, enum MHD_ConnectionNotificationCode code) {
    if (code == MHD_CONNECTION_NOTIFY_STARTED) gw_sock_open(cls, mc, ctx);
    else if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
        gw_sock_close(cls, *ctx);
        *ctx = NULL;
    }
}

/* Moves c's connection to phase ph from now on. */
static void gw_sock_phase(gw_conn *c, gw_phase ph) {
    if (!c->sock) return;
    pthread_mutex_lock(&c->srv->mu);
    c->sock->phase = ph;
    c->sock->since_us = fu_now_us();
    pthread_mutex_unlock(&c->srv->mu);
}

/* Whether c's body is later than --body-timeout-s (read on libmicrohttpd's thread, which
 * alone writes the phase). */
static bool gw_body_late(gw_conn *c) {
    return c->sock && c->sock->phase == GW_PHASE_BODY &&
           fu_now_us() - c->sock->since_us > gw_phase_limit_us(c->srv, GW_PHASE_BODY);
}

/* Closes every connection past its phase's deadline (the watchdog). */
static void gw_deadlines_once(gw_server *s) {
    int64_t now = fu_now_us();
    pthread_mutex_lock(&s->mu);
    for (gw_sock *k = s->socks; k; k = k->next) {
        int64_t limit = gw_phase_limit_us(s, k->phase);
        if (limit >= 0 && now - k->since_us > limit)
            gw_sock_cut(k, k->phase == GW_PHASE_HEAD ? "its request's headers are late" : "its request's body is late");
    }
    pthread_mutex_unlock(&s->mu);
}

/* ---- the access handler ------------------------------------------------------------------------------ */

static enum MHD_Result gw_route_files(gw_conn *c, const char *url);
static enum MHD_Result gw_begin_files(gw_conn *c, const char *url, const char *method);
static enum MHD_Result gw_route_jobs_get(gw_conn *c, const char *url);
static enum MHD_Result gw_route_jobs_post(gw_conn *c, json_t *body);
static enum MHD_Result gw_begin_jobs(gw_conn *c, const char *url, const char *method);

static enum MHD_Result gw_dispatch(gw_conn *c, const char *url) {
    gw_server *s = c->srv;
    switch (c->route) {
    case GW_ROUTE_HEALTH: return gw_route_health(c, url);
    case GW_ROUTE_MODELS: return gw_route_models(c, url);
    case GW_ROUTE_METRICS: return gw_route_metrics(c);
    case GW_ROUTE_SWARM: return gw_route_swarm(c);
    case GW_ROUTE_FILES:
        if (!c->upload) return gw_route_files(c, url);
        break;
    case GW_ROUTE_FINE_TUNING:
        if (!c->is_post) return gw_route_jobs_get(c, url);
        break;
    default: break;
    }
    if (c->too_large)
        return gw_fail(c, 413, NULL, "request_too_large", "the request body exceeds %zu bytes", s->cfg->max_body_bytes);
    /* the body is parsed and the route run on a body thread; the connection waits suspended */
    MHD_suspend_connection(c->mc);
    pthread_mutex_lock(&s->body_mu);
    c->body_next = NULL;
    if (s->body_tail) s->body_tail->body_next = c;
    else s->body_head = c;
    s->body_tail = c;
    pthread_cond_signal(&s->body_cv);
    pthread_mutex_unlock(&s->body_mu);
    return MHD_YES;
}

/* POST /v1/files, its body in (a body thread): the file checked, stored, its object answered. */
static enum MHD_Result gw_route_upload(gw_conn *c) {
    json_t *o = NULL;
    gw_error e;
    int rc = gw_upload_finish(c->upload, c->owner, &o, &e);
    gw_upload_free(c->upload);
    c->upload = NULL;
    return rc ? gw_respond_error(c, &e) : gw_respond_json(c, 200, o);
}

/* Runs a POST route on a body thread: its response, or its job, is taken up by
 * gw_handle when the connection resumes. */
static void gw_body_run(gw_conn *c) {
    c->deferred = true;
    json_error_t jerr;
    bool empty_ok = c->route == GW_ROUTE_FINE_TUNING && c->body.len == 0; /* a cancel has no body */
    json_t *body = c->upload ? NULL : empty_ok ? json_object() : json_loadb(c->body.data ? c->body.data : "", c->body.len, 0, &jerr);
    enum MHD_Result ret;
    if (c->upload)
        ret = gw_route_upload(c);
    else if (!body)
        ret = gw_fail(c, 400, NULL, "invalid_json", "We could not parse the JSON body of your request: %s (at byte %d)",
                      jerr.text, jerr.position);
    else if (!json_is_object(body))
        ret = gw_fail(c, 400, NULL, "invalid_type", "the request body must be a JSON object");
    else if (c->route == GW_ROUTE_TOKENIZE) ret = gw_route_tokenize(c, body);
    else if (c->route == GW_ROUTE_DETOKENIZE) ret = gw_route_detokenize(c, body);
    else if (c->route == GW_ROUTE_APPLY_TEMPLATE) ret = gw_route_apply_template(c, body);
    else if (c->route == GW_ROUTE_LOAD_LORA) ret = gw_route_load_lora(c, body);
    else if (c->route == GW_ROUTE_UNLOAD_LORA) ret = gw_route_unload_lora(c, body);
    else if (c->route == GW_ROUTE_FINE_TUNING) ret = gw_route_jobs_post(c, body);
    else if (c->route == GW_ROUTE_EMBEDDINGS) ret = gw_route_embeddings(c, body);
    else ret = gw_route_generate(c, body);
    json_decref(body);
    fu_buf_free(&c->body);
    c->deferred = false;
    c->body_failed = ret == MHD_NO && !c->reply.ready;
    MHD_resume_connection(c->mc);
}

static void *gw_body_main(void *arg) {
    gw_server *s = arg;
    pthread_mutex_lock(&s->body_mu);
    for (;;) {
        while (!s->body_head && !s->body_stopping) pthread_cond_wait(&s->body_cv, &s->body_mu);
        gw_conn *c = s->body_head;
        if (!c) break;
        s->body_head = c->body_next;
        if (!s->body_head) s->body_tail = NULL;
        pthread_mutex_unlock(&s->body_mu);
        gw_body_run(c);
        pthread_mutex_lock(&s->body_mu);
    }
    pthread_mutex_unlock(&s->body_mu);
    return NULL;
}

/* A new request's connection state, listed in s->conns; NULL when out of memory. */
static gw_conn *gw_conn_new(gw_server *s, struct MHD_Connection *mc) {
    gw_conn *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->srv = s;
    c->mc = mc;
    c->t0 = fu_now_s();
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    c->sock = ci ? ci->socket_context : NULL;
    gw_sock_phase(c, GW_PHASE_BODY); /* the headers are in; a body may follow */
    pthread_mutex_lock(&s->mu);
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    pthread_mutex_unlock(&s->mu);
    return c;
}

/* The first call for a request, its headers in: checks them, answers at once what it can. */
static enum MHD_Result gw_begin(gw_conn *c, const char *url, const char *method, const char *version) {
    gw_server *s = c->srv;
    bool want_post = false;
    c->route = gw_route_of(url, &want_post);
    snprintf(c->path, sizeof c->path, "%s", url);
    c->is_post = !strcmp(method, "POST");
    c->is_delete = !strcmp(method, "DELETE");
    gw_error e;
    if (gw_check_request(c, method, version, &e)) return gw_respond_error(c, &e);
    const gw_web_file *page = c->route == GW_ROUTE_OTHER ? gw_web_find(url) : NULL;
    if (page) return gw_route_web(c, page, method);
    if (c->route == GW_ROUTE_OTHER)
        return gw_fail(c, 404, NULL, "unknown_url", "Unknown request URL: %s %.200s", method, url);
    if (c->route == GW_ROUTE_FILES) return gw_begin_files(c, url, method);
    if (c->route == GW_ROUTE_FINE_TUNING) return gw_begin_jobs(c, url, method);
    if (!strcmp(method, "OPTIONS")) return gw_preflight(c, want_post ? "POST, OPTIONS" : "GET, HEAD, OPTIONS");
    if (c->is_post != want_post && !(strcmp(method, "HEAD") == 0 && !want_post))
        return gw_fail(c, 405, NULL, "method_not_allowed", "%s is not allowed on %.200s", method, url);
    if (c->route != GW_ROUTE_HEALTH && !gw_authorized(c))
        return gw_fail(c, 401, NULL, "invalid_api_key",
                       "Incorrect or missing API key: send 'Authorization: Bearer <key>'");
    size_t ct_len;
    const char *ct = gw_header(c, MHD_HTTP_HEADER_CONTENT_TYPE, &ct_len);
    if (c->is_post && (!ct || !gw_http_json_type(ct, ct_len)))
        return gw_fail(c, 415, NULL, "unsupported_media_type",
                       "the request body must be JSON sent with 'Content-Type: application/json'");
    const char *cl = MHD_lookup_connection_value(c->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        char *end;
        errno = 0;
        unsigned long long n = strtoull(cl, &end, 10);
        if (errno || end == cl || n > s->cfg->max_body_bytes)
            return gw_fail(c, 413, NULL, "request_too_large", "the request body exceeds %zu bytes",
                           s->cfg->max_body_bytes);
    }
    return MHD_YES;
}

/* ---- /v1/files -------------------------------------------------------------------------------------- */

/* The methods a /v1/files URL allows, or NULL for an unknown one. */
static const char *gw_files_methods(const char *url) {
    if (!strcmp(url, "/v1/files")) return "GET, HEAD, POST, OPTIONS";
    const char *slash = strchr(url + 10, '/');
    if (!slash) return url[10] ? "GET, HEAD, DELETE, OPTIONS" : NULL;
    return !strcmp(slash, "/content") && slash > url + 10 ? "GET, HEAD, OPTIONS" : NULL;
}

/* Whether `method` is one of the comma-separated `methods`. */
static bool gw_method_in(const char *method, const char *methods) {
    size_t n = strlen(method);
    for (const char *p = methods; (p = strstr(p, method)); p += n)
        if ((p == methods || p[-1] == ' ') && (p[n] == ',' || p[n] == '\0')) return true;
    return false;
}

/* Whether a Content-Type value v[0..len) is multipart/form-data (case-insensitive). */
static bool gw_multipart_type(const char *v, size_t len) {
    static const char want[] = "multipart/form-data";
    return len >= sizeof want - 1 && !strncasecmp(v, want, sizeof want - 1);
}

/* What /v1/files and /v1/fine_tuning/jobs check first: a known URL (methods non-NULL), a preflight,
 * an allowed method, the API key. Returns true with *ret when that answers the request. */
static bool gw_begin_answered(gw_conn *c, const char *url, const char *method, const char *methods,
                              enum MHD_Result *ret) {
    if (!methods) *ret = gw_fail(c, 404, NULL, "unknown_url", "Unknown request URL: %s %.200s", method, url);
    else if (!strcmp(method, "OPTIONS")) *ret = gw_preflight(c, methods);
    else if (!gw_method_in(method, methods))
        *ret = gw_fail(c, 405, NULL, "method_not_allowed", "%s is not allowed on %.200s", method, url);
    else if (!gw_authorized(c))
        *ret = gw_fail(c, 401, NULL, "invalid_api_key", "Incorrect or missing API key: send 'Authorization: Bearer <key>'");
    else return false;
    return true;
}

/* gw_begin for /v1/files: the method, the key, and for an upload its type, size and parser. */
static enum MHD_Result gw_begin_files(gw_conn *c, const char *url, const char *method) {
    enum MHD_Result ret;
    if (gw_begin_answered(c, url, method, gw_files_methods(url), &ret)) return ret;
    if (!c->is_post) return MHD_YES;
    size_t ct_len;
    const char *ct = gw_header(c, MHD_HTTP_HEADER_CONTENT_TYPE, &ct_len);
    if (!ct || !gw_multipart_type(ct, ct_len))
        return gw_fail(c, 415, NULL, "unsupported_media_type", "a file is uploaded as multipart/form-data");
    const char *cl = MHD_lookup_connection_value(c->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    unsigned long long n = cl ? strtoull(cl, NULL, 10) : 0;
    if (n > (unsigned long long)c->srv->cfg->max_file_bytes + 64 * 1024)
        return gw_fail(c, 413, "file", "file_too_large", "the file exceeds %lld bytes",
                       (long long)c->srv->cfg->max_file_bytes);
    gw_error e;
    if (gw_upload_new(c->srv->files, c->mc, &c->upload, &e)) return gw_respond_error(c, &e);
    return MHD_YES;
}

/* GET /v1/files/{id}/content: the file's bytes, streamed from disk. */
static enum MHD_Result gw_route_file_content(gw_conn *c, const char *owner, const char *id_slash) {
    char id[GW_FILE_ID_MAX];
    snprintf(id, sizeof id, "%.*s", (int)(strchr(id_slash, '/') - id_slash), id_slash);
    int fd;
    uint64_t size;
    const char *type;
    gw_error e;
    if (gw_files_content(c->srv->files, owner, id, &fd, &size, &type, &e)) return gw_respond_error(c, &e);
    struct MHD_Response *r = MHD_create_response_from_fd64(size, fd); /* owns fd from here */
    if (!r) {
        close(fd);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    return gw_queue_made(c, 200, r);
}

/* The GET and DELETE routes of /v1/files (on libmicrohttpd's thread: a database lookup). */
static enum MHD_Result gw_route_files(gw_conn *c, const char *url) {
    gw_files *f = c->srv->files;
    const char *owner = c->admin ? NULL : c->owner, *id = url + 10;
    json_t *o = NULL;
    gw_error e;
    int rc;
    if (!strcmp(url, "/v1/files")) {
        gw_files_args a = {MHD_lookup_connection_value(c->mc, MHD_GET_ARGUMENT_KIND, "purpose"),
                           MHD_lookup_connection_value(c->mc, MHD_GET_ARGUMENT_KIND, "limit"),
                           MHD_lookup_connection_value(c->mc, MHD_GET_ARGUMENT_KIND, "order"),
                           MHD_lookup_connection_value(c->mc, MHD_GET_ARGUMENT_KIND, "after")};
        rc = gw_files_list(f, owner, &a, &o, &e);
    } else if (strchr(id, '/')) {
        return gw_route_file_content(c, owner, id);
    } else {
        rc = c->is_delete ? gw_files_delete(f, owner, id, &o, &e) : gw_files_get(f, owner, id, &o, &e);
    }
    return rc ? gw_respond_error(c, &e) : gw_respond_json(c, 200, o);
}

/* ---- /v1/fine_tuning/jobs ------------------------------------------------------------------------------ */

/* The methods a fine-tuning URL allows, or NULL for an unknown one; *id_len: the job id's length. */
static const char *gw_jobs_methods(const char *url, size_t *id_len) {
    const char *rest = url + 20; /* after "/v1/fine_tuning/jobs" */
    if (!*rest) return "GET, HEAD, POST, OPTIONS";
    const char *slash = strchr(rest + 1, '/');
    *id_len = slash ? (size_t)(slash - rest - 1) : strlen(rest + 1);
    if (!*id_len || *id_len >= GW_JOB_ID_MAX) return NULL;
    if (!slash) return "GET, HEAD, OPTIONS";
    if (!strcmp(slash, "/cancel")) return "POST, OPTIONS";
    return !strcmp(slash, "/events") || !strcmp(slash, "/checkpoints") ? "GET, HEAD, OPTIONS" : NULL;
}

/* gw_begin for /v1/fine_tuning/jobs: the method, the key, a POST's type and size. */
static enum MHD_Result gw_begin_jobs(gw_conn *c, const char *url, const char *method) {
    size_t id_len = 0;
    enum MHD_Result ret;
    if (gw_begin_answered(c, url, method, gw_jobs_methods(url, &id_len), &ret)) return ret;
    if (!c->is_post) return MHD_YES;
    size_t ct_len;
    const char *ct = gw_header(c, MHD_HTTP_HEADER_CONTENT_TYPE, &ct_len);
    const char *cl = MHD_lookup_connection_value(c->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    bool empty = !cl || !strcmp(cl, "0");
    if (!empty && (!ct || !gw_http_json_type(ct, ct_len)))
        return gw_fail(c, 415, NULL, "unsupported_media_type",
                       "the request body must be JSON sent with 'Content-Type: application/json'");
    if (cl && strtoull(cl, NULL, 10) > c->srv->cfg->max_body_bytes)
        return gw_fail(c, 413, NULL, "request_too_large", "the request body exceeds %zu bytes", c->srv->cfg->max_body_bytes);
    c->url = strdup(url);
    return c->url ? MHD_YES : MHD_NO;
}

/* The job id of a fine-tuning URL into id[GW_JOB_ID_MAX]; the part after it (NULL: none). */
static const char *gw_jobs_id(const char *url, char *id) {
    const char *rest = url + 21, *slash = strchr(rest, '/');
    snprintf(id, GW_JOB_ID_MAX, "%.*s", slash ? (int)(slash - rest) : (int)strlen(rest), rest);
    return slash;
}

/* The GET routes (on libmicrohttpd's thread: database lookups). */
static enum MHD_Result gw_route_jobs_get(gw_conn *c, const char *url) {
    gw_jobs *j = c->srv->jobs;
    const char *after = MHD_lookup_connection_value(c->mc, MHD_GET_ARGUMENT_KIND, "after");
    const char *limit = MHD_lookup_connection_value(c->mc, MHD_GET_ARGUMENT_KIND, "limit");
    json_t *o = NULL;
    gw_error e;
    char id[GW_JOB_ID_MAX];
    int rc;
    if (!url[20]) return (rc = gw_jobs_list(j, c->owner, c->admin, after, limit, &o, &e)) ? gw_respond_error(c, &e)
                                                                                        : gw_respond_json(c, 200, o);
    const char *tail = gw_jobs_id(url, id);
    if (!tail) rc = gw_jobs_get(j, c->owner, c->admin, id, &o, &e);
    else if (!strcmp(tail, "/events")) rc = gw_jobs_events(j, c->owner, c->admin, id, after, limit, &o, &e);
    else rc = gw_jobs_checkpoints(j, c->owner, c->admin, id, after, limit, &o, &e);
    return rc ? gw_respond_error(c, &e) : gw_respond_json(c, 200, o);
}

/* The POST routes (a body thread): create, cancel. */
static enum MHD_Result gw_route_jobs_post(gw_conn *c, json_t *body) {
    json_t *o = NULL;
    gw_error e;
    char id[GW_JOB_ID_MAX];
    int rc = !c->url[20] ? gw_jobs_create(c->srv->jobs, c->owner, c->admin, body, &o, &e)
                         : (gw_jobs_id(c->url, id), gw_jobs_cancel(c->srv->jobs, c->owner, c->admin, id, &o, &e));
    return rc ? gw_respond_error(c, &e) : gw_respond_json(c, 200, o);
}

/* Takes upload[0..*upload_size) of c's body (consumed: *upload_size becomes 0); a body later
 * than --body-timeout-s closes the connection (libmicrohttpd takes no response before the
 * body's end, so no 408 can be sent). */
static enum MHD_Result gw_take_body(gw_conn *c, const char *upload, size_t *upload_size) {
    size_t n = *upload_size, max = c->srv->cfg->max_body_bytes;
    *upload_size = 0;
    if (c->responded) return MHD_YES; /* an early answer: discard the body */
    if (gw_body_late(c)) {
        FU_DEBUG("closing a connection: its request's body is late");
        return MHD_NO;
    }
    if (c->upload) {
        gw_upload_feed(c->upload, upload, n);
        return MHD_YES;
    }
    if (!c->too_large && c->body.len + n <= max) {
        if (fu_buf_append(&c->body, upload, n)) c->too_large = true;
    } else {
        c->too_large = true;
        fu_buf_free(&c->body);
    }
    return MHD_YES;
}

static enum MHD_Result gw_handle(void *cls, struct MHD_Connection *mc, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    gw_conn *c = *con_cls;
    if (!c) {
        if (!(c = *con_cls = gw_conn_new(cls, mc))) return MHD_NO;
        return gw_begin(c, url, method, version);
    }
    if (c->reply.ready) { /* prepared by a body thread */
        gw_reply r = c->reply;
        c->reply = (gw_reply){0};
        return gw_queue(c, r.status, r.ctype, r.body, r.len);
    }
    if (c->body_failed) return MHD_NO;
    if (*upload_size) return gw_take_body(c, upload, upload_size);
    if (c->sock && c->sock->phase == GW_PHASE_BODY) gw_sock_phase(c, GW_PHASE_BUSY); /* the request is in */
    if (c->responded) return MHD_YES;
    if (c->job) return gw_job_progress(c);
    return gw_dispatch(c, url);
}

/* One line per request: method, path, status, the key's fingerprint (never the key), and for a
 * generation its id, model, tokens and time to the first token. Info level; /health, /livez and
 * /metrics at debug, as probes poll them. */
static void gw_access_log(const gw_conn *c) {
    gw_job_summary js = {"-", "-", 0, 0, -1};
    if (c->job) gw_job_summarize(c->job, &js);
    const int level = c->route == GW_ROUTE_HEALTH || c->route == GW_ROUTE_METRICS ? FU_LOG_LEVEL_DEBUG : FU_LOG_LEVEL_INFO;
    FU_LOG(level, js.id,
           "access: %s %s %d key=%.8s model=%.128s prompt_tokens=%lld completion_tokens=%lld ttft_ms=%.0f "
           "ms=%.0f",
           c->is_post ? "POST" : c->is_delete ? "DELETE" : "GET", c->path[0] ? c->path : "-",
           c->responded ? c->status : 499, c->owner[0] ? c->owner : "-", js.model[0] ? js.model : "-",
           (long long)js.prompt_tokens, (long long)js.completion_tokens, js.ttft_s >= 0 ? js.ttft_s * 1e3 : -1.0,
           (fu_now_s() - c->t0) * 1e3);
}

static void gw_completed(void *cls, struct MHD_Connection *mc, void **con_cls, enum MHD_RequestTerminationCode toe) {
    gw_server *s = cls;
    gw_conn *c = *con_cls;
    if (!c) return;
    *con_cls = NULL;
    gw_access_log(c);
    if (c->job) {
        gw_job_lock(c->job);
        gw_job_set_wake(c->job, NULL, NULL);
        bool done = gw_job_finished(c->job) || gw_job_phase_get(c->job) == GW_JOB_DONE;
        gw_job_unlock(c->job);
        if (!done) {
            FU_DEBUG("client went away (%d): cancelling its generation", (int)toe);
            gw_job_cancel(c->job);
        }
        gw_job_release(c->job);
    }
    if (!c->responded) gw_metrics_request(s->metrics, c->route, 499);
    gw_sock_phase(c, GW_PHASE_HEAD); /* a kept-alive connection's next request starts now */
    pthread_mutex_lock(&s->mu);
    if (c->prev) c->prev->next = c->next;
    else s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    pthread_mutex_unlock(&s->mu);
    fu_buf_free(&c->body);
    gw_upload_free(c->upload); /* a body cut off: its temporary file goes */
    free(c->reply.body);
    free(c->origin);
    free(c->url);
    free(c);
}

static void gw_mhd_log(void *cls, const char *fmt, va_list ap) {
    if (FU_LOG_LEVEL_DEBUG < fu_log_threshold) return;
    char buf[512];
    vsnprintf(buf, sizeof buf, fmt, ap);
    size_t n = strlen(buf);
    while (n && buf[n - 1] == '\n') buf[--n] = '\0';
    FU_DEBUG("microhttpd: %s", buf);
}

/* ---- the disconnect watchdog ------------------------------------------------------------------------ */

/* Cancels the generation of each suspended connection whose client has closed
 * or reset its socket: the watched events are the peer's FIN (POLLRDHUP), a hang-up
 * and a socket error; a client sending more bytes (a pipelined request, a TLS
 * alert) is not a disconnect. Holding s->mu keeps every listed connection, and so
 * its socket, open: gw_completed unlinks a connection under s->mu before
 * libmicrohttpd closes its socket. */
static void gw_watch_once(gw_server *s) {
    enum { BATCH = 256 };
    struct pollfd fds[BATCH];
    gw_conn *owner[BATCH];
    pthread_mutex_lock(&s->mu);
    gw_conn *c = s->conns;
    while (c) {
        int n = 0;
        for (; c && n < BATCH; c = c->next) {
            if (!c->job) continue;
            gw_job_lock(c->job);
            bool watch = c->suspended && !gw_job_cancelled(c->job);
            gw_job_unlock(c->job);
            if (!watch) continue;
            const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c->mc, MHD_CONNECTION_INFO_CONNECTION_FD);
            if (!ci || ci->connect_fd == MHD_INVALID_SOCKET) continue;
            fds[n] = (struct pollfd){.fd = ci->connect_fd, .events = POLLRDHUP};
            owner[n++] = c;
        }
        if (n == 0 || poll(fds, (nfds_t)n, 0) <= 0) continue;
        for (int i = 0; i < n; i++)
            if (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) {
                FU_DEBUG("client went away while its request was suspended: cancelling its generation");
                gw_job_cancel(owner[i]->job);
            }
    }
    pthread_mutex_unlock(&s->mu);
}

static void *gw_watch_main(void *arg) {
    gw_server *s = arg;
    pthread_mutex_lock(&s->watch_mu);
    while (!atomic_load(&s->stopping)) {
        struct timespec ts = fu_deadline_us(CLOCK_MONOTONIC, GW_WATCH_INTERVAL_MS * 1000LL);
        pthread_cond_timedwait(&s->watch_cv, &s->watch_mu, &ts);
        if (atomic_load(&s->stopping)) break;
        pthread_mutex_unlock(&s->watch_mu);
        gw_watch_once(s);
        gw_deadlines_once(s);
        pthread_mutex_lock(&s->watch_mu);
    }
    pthread_mutex_unlock(&s->watch_mu);
    return NULL;
}

/* ---- start and stop ---------------------------------------------------------------------------------- */

/* Resolves a listen spec "host:port" ("[v6]:port" too; an empty host: every address) into
 * *res (the caller frees it with freeaddrinfo). FU_OK or FU_ERR_INVALID. */
static int gw_listen_resolve(const char *spec, struct addrinfo **res) {
    char host[GW_HOST_MAX];
    *res = NULL;
    const char *colon = strrchr(spec, ':');
    if (!colon || (size_t)(colon - spec) >= sizeof host)
        return fu_errorf(FU_ERR_INVALID, "listen: expected HOST:PORT, got '%s'", spec);
    size_t hl = (size_t)(colon - spec);
    memcpy(host, spec, hl);
    host[hl] = '\0';
    if (hl >= 2 && host[0] == '[' && host[hl - 1] == ']') {
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = '\0';
    }
    struct addrinfo hints = {0};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int gai = getaddrinfo(host[0] ? host : NULL, colon + 1, &hints, res);
    if (gai) return fu_errorf(FU_ERR_INVALID, "listen %s: %s", spec, gai_strerror(gai));
    return FU_OK;
}

/* Whether a socket address is a loopback one (127.0.0.0/8, ::1, ::ffff:127.x.y.z). */
static bool gw_addr_loopback(const struct sockaddr *sa) {
    if (sa->sa_family == AF_INET) return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    if (sa->sa_family != AF_INET6) return false;
    const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(a) || (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127);
}

int gw_listen_check(const gw_config *cfg) {
    const char *spec = cfg->listen ? cfg->listen : GW_DEFAULT_LISTEN;
    struct addrinfo *res = NULL;
    int rc = gw_listen_resolve(spec, &res);
    if (rc) return rc;
    bool beyond = false;
    for (struct addrinfo *a = res; a; a = a->ai_next) beyond |= !gw_addr_loopback(a->ai_addr);
    freeaddrinfo(res);
    if (beyond && cfg->n_api_keys == 0 && !cfg->no_auth)
        return fu_errorf(FU_ERR_INVALID,
                         "--listen %s is reachable beyond loopback and no API key is set: give --api-key, "
                         "--api-key-file or FUSION_API_KEY (or, to serve anyone who can connect, --no-auth)",
                         spec);
    return FU_OK;
}

/* Binds and listens on "host:port" ("[v6]:port" too); returns the socket or -1. */
static int gw_listen(const char *spec, int *port) {
    struct addrinfo *res = NULL;
    if (gw_listen_resolve(spec, &res)) return -1;
    int fd = -1;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) || listen(fd, 1024)) {
            fu_errorf(FU_ERR_NETWORK, "listen %s: %s", spec, strerror(errno));
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0) return -1;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    *port = 0;
    if (!getsockname(fd, (struct sockaddr *)&ss, &sl))
        *port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                         : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    return fd;
}

/* The largest HTTPS certificate or key file read. */
#define GW_TLS_FILE_MAX (1 << 20)

/* The text of the regular file at path (malloc'd), or NULL with fu_last_error() naming it;
 * a FIFO or a device is refused at once rather than waited on (mf_read). */
static char *gw_read_file(const char *path) {
    char *text;
    size_t len;
    return mf_read(path, GW_TLS_FILE_MAX, &text, &len) ? NULL : text;
}

/* Frees a server that is not (or no longer) running; closes the listening socket when not yet handed over. */
static void gw_server_destroy(gw_server *s, bool close_listen) {
    if (close_listen && s->listen_fd >= 0) close(s->listen_fd);
    free(s->https_cert);
    free(s->https_key);
    gw_health_free(s->health);
    gw_embed_free(s->embed);
    gw_jobs_close(s->jobs);
    gw_files_close(s->files);
    pthread_cond_destroy(&s->watch_cv);
    pthread_mutex_destroy(&s->watch_mu);
    pthread_cond_destroy(&s->body_cv);
    pthread_mutex_destroy(&s->body_mu);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* ---- --metrics-listen ------------------------------------------------------------------------------- */

/* The answer of the scrape listener to GET url: the metrics page, readiness, or a 404/405 error. */
static struct MHD_Response *gw_scrape_answer(gw_server *s, struct MHD_Connection *mc, const char *url,
                                             const char *method, int *status) {
    fu_buf b = {0};
    json_t *o = NULL;
    gw_error e = {0};
    if (strcmp(method, "GET") && strcmp(method, "HEAD")) gw_error_set(&e, 405, NULL, "method_not_allowed", "only GET");
    else if (!strcmp(url, "/metrics") && gw_metrics_page(s, &b)) gw_error_set(&e, 500, NULL, NULL, "out of memory");
    else if (!strcmp(url, "/health") || !strcmp(url, "/livez")) o = gw_health_json(s, mc, url, status);
    else if (strcmp(url, "/metrics")) gw_error_set(&e, 404, NULL, "not_found", "this listener serves /metrics only");
    if (e.http) *status = e.http;
    else if (!o) *status = 200;
    char *text = e.http ? gw_error_json(&e) : o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    const char *type = text ? "application/json" : "text/plain; version=0.0.4";
    struct MHD_Response *r = text ? MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE)
                                  : MHD_create_response_from_buffer(b.len, b.data, MHD_RESPMEM_MUST_FREE);
    if (r) MHD_add_response_header(r, "Content-Type", type);
    else free(text), fu_buf_free(&b);
    return r;
}

static enum MHD_Result gw_scrape_handle(void *cls, struct MHD_Connection *mc, const char *url, const char *method,
                                        const char *version, const char *upload_data, size_t *upload_size,
                                        void **ptr) {
    (void)version, (void)upload_data;
    if (!*ptr) { /* the headers: answer once the (ignored) body is in */
        *ptr = cls;
        return MHD_YES;
    }
    if (*upload_size) {
        *upload_size = 0;
        return MHD_YES;
    }
    int status = 200;
    struct MHD_Response *r = gw_scrape_answer(cls, mc, url, method, &status);
    if (!r) return MHD_NO;
    enum MHD_Result ret = MHD_queue_response(mc, (unsigned)status, r);
    MHD_destroy_response(r);
    return ret;
}

/* Starts the --metrics-listen daemon (no key asked: it serves figures, never data). */
static int gw_start_scrape(gw_server *s) {
    int fd = gw_listen(s->cfg->metrics_listen, &s->scrape_port);
    if (fd < 0) return fu_errorf(FU_ERR_NETWORK, "--metrics-listen %s: %s", s->cfg->metrics_listen, fu_last_error());
    s->scrape_d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG, 0, NULL, NULL,
                                   gw_scrape_handle, s, MHD_OPTION_LISTEN_SOCKET, fd, MHD_OPTION_CONNECTION_LIMIT,
                                   64u, MHD_OPTION_CONNECTION_TIMEOUT, 10u, MHD_OPTION_EXTERNAL_LOGGER, gw_mhd_log,
                                   NULL, MHD_OPTION_END);
    if (s->scrape_d) return FU_OK;
    close(fd);
    return fu_errorf(FU_ERR_NETWORK, "cannot start the --metrics-listen server");
}

int gw_server_metrics_port(const gw_server *s) { return s->scrape_port; }

/* Starts libmicrohttpd on s->listen_fd with the configured limits (and HTTPS when a
 * certificate is configured, read here). FU_OK; else an error, s->d NULL. */
static int gw_start_daemon(gw_server *s) {
    const gw_config *cfg = s->cfg;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    if (cfg->https_cert) {
        if (MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES)
            return fu_errorf(FU_ERR_UNSUPPORTED, "this libmicrohttpd is built without TLS: HTTPS is unavailable");
        if (!(s->https_cert = gw_read_file(cfg->https_cert)) || !(s->https_key = gw_read_file(cfg->https_key)))
            return fu_errorf(FU_ERR_IO, "cannot read the HTTPS certificate or key: %s", fu_last_error());
        flags |= MHD_USE_TLS;
    }
    struct MHD_OptionItem tls_opts[] = {
        {MHD_OPTION_HTTPS_MEM_CERT, 0, s->https_cert},
        {MHD_OPTION_HTTPS_MEM_KEY, 0, s->https_key},
        {MHD_OPTION_END, 0, NULL},
    };
    s->d = MHD_start_daemon(flags, 0, NULL, NULL, gw_handle, s, MHD_OPTION_LISTEN_SOCKET, s->listen_fd,
                            MHD_OPTION_NOTIFY_COMPLETED, gw_completed, s, MHD_OPTION_NOTIFY_CONNECTION, gw_notify, s,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)cfg->max_connections_per_ip,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)cfg->connection_timeout_s,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)cfg->max_connections,
                            MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)128 * 1024, MHD_OPTION_EXTERNAL_LOGGER,
                            gw_mhd_log, NULL, MHD_OPTION_ARRAY, cfg->https_cert ? tls_opts : tls_opts + 2,
                            MHD_OPTION_END);
    if (!s->d)
        return fu_errorf(FU_ERR_NETWORK, "cannot start the HTTP server (libmicrohttpd%s)",
                         cfg->https_cert ? ": check the HTTPS certificate and key" : "");
    return FU_OK;
}

/* A server's struct with its locks (nothing started). NULL when out of memory. */
static gw_server *gw_server_alloc(const gw_config *cfg, const gw_model *model, gw_engine *engine,
                                  gw_metrics *metrics) {
    gw_server *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->cfg = cfg;
    s->model = model;
    s->engine = engine;
    s->metrics = metrics;
    s->started = (long long)time(NULL);
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->watch_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->watch_cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&s->body_mu, NULL);
    pthread_cond_init(&s->body_cv, NULL);
    return s;
}

/* The watcher and the body threads; on failure the server is stopped and freed. */
static int gw_start_threads(gw_server *s) {
    s->watch_started = !pthread_create(&s->watch, NULL, gw_watch_main, s);
    while (s->watch_started && s->n_body_threads < GW_BODY_THREADS &&
           !pthread_create(&s->body_threads[s->n_body_threads], NULL, gw_body_main, s))
        s->n_body_threads++;
    if (s->n_body_threads == GW_BODY_THREADS) return FU_OK;
    gw_server_stop(s);
    return fu_errorf(FU_ERR_INTERNAL, "cannot start the HTTP server's threads");
}

int gw_server_start(const gw_config *cfg, const gw_model *model, gw_engine *engine, gw_metrics *metrics,
                    gw_server **out, int *port) {
    *out = NULL;
    gw_server *s = gw_server_alloc(cfg, model, engine, metrics);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "server");
    const char *spec = cfg->listen ? cfg->listen : GW_DEFAULT_LISTEN;
    int rc = gw_listen_check(cfg);
    if (rc) {
        gw_server_destroy(s, false);
        return rc;
    }
    s->listen_fd = gw_listen(spec, port);
    if (s->listen_fd < 0) {
        gw_server_destroy(s, false);
        return FU_ERR_NETWORK;
    }
    s->port = *port;
    gw_swarm *swarm = engine ? gw_engine_swarm(engine) : NULL;
    if ((rc = gw_files_open(cfg, model, &s->files)) || (rc = gw_jobs_open(cfg, model, s->files, swarm, &s->jobs)) ||
        (rc = gw_health_new(cfg, swarm, &s->health)) || (rc = gw_embed_new(cfg, model, swarm, &s->embed))) {
        gw_server_destroy(s, true);
        return rc;
    }
    const char *colon = strrchr(spec, ':'); /* gw_listen checked it is there */
    snprintf(s->listen_name, sizeof s->listen_name, "%.*s", (int)(colon - spec), spec);
    if (!strcmp(s->listen_name, "0.0.0.0") || !strcmp(s->listen_name, "[::]")) /* a wildcard names no host */
        s->listen_name[0] = '\0';
    rc = gw_start_daemon(s);
    if (!rc && cfg->metrics_listen && (rc = gw_start_scrape(s))) MHD_stop_daemon(s->d); /* closes listen_fd */
    if (rc) {
        gw_server_destroy(s, !s->d);
        return rc;
    }
    if ((rc = gw_start_threads(s))) return rc;
    *out = s;
    return FU_OK;
}

void gw_server_stop(gw_server *s) {
    if (!s) return;
    pthread_mutex_lock(&s->watch_mu);
    atomic_store(&s->stopping, true);
    pthread_cond_broadcast(&s->watch_cv);
    pthread_mutex_unlock(&s->watch_mu);
    if (s->watch_started) pthread_join(s->watch, NULL);
    /* finish the bodies being parsed: their connections resume and see `stopping` */
    pthread_mutex_lock(&s->body_mu);
    s->body_stopping = true;
    pthread_cond_broadcast(&s->body_cv);
    pthread_mutex_unlock(&s->body_mu);
    for (int i = 0; i < s->n_body_threads; i++) pthread_join(s->body_threads[i], NULL);
    /* cancel every generation and wake every waiting connection so that it can finish */
    for (int round = 0; round < 50; round++) {
        int waiting = 0;
        pthread_mutex_lock(&s->mu);
        for (gw_conn *c = s->conns; c; c = c->next) {
            if (!c->job) continue;
            gw_job_cancel(c->job);
            gw_job_lock(c->job);
            if (c->suspended) {
                c->suspended = false;
                MHD_resume_connection(c->mc);
                waiting++;
            }
            gw_job_unlock(c->job);
        }
        pthread_mutex_unlock(&s->mu);
        if (!waiting && round > 0) break;
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (s->scrape_d) MHD_stop_daemon(s->scrape_d);
    MHD_stop_daemon(s->d); /* closes the listening socket too */
    for (gw_sock *k = s->socks, *next; k; k = next) { /* none once every close was notified */
        next = k->next;
        free(k);
    }
    gw_server_destroy(s, false);
}
