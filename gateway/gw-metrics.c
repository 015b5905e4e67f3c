/* gw-metrics.c -- the gateway's Prometheus metrics: request counts, tokens, TTFT/ITL/E2E histograms, gauges. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gw.h"
#include "status.h"

#define GW_HIST_MAX 24

typedef struct gw_hist {
    const char *name, *help;
    int n;                          /* finite buckets */
    double le[GW_HIST_MAX];         /* upper bounds, ascending */
    uint64_t count[GW_HIST_MAX + 1]; /* per bucket (not cumulative); last: +Inf */
    double sum;
    uint64_t total;
} gw_hist;

/* Status classes counted per route. */
static const int gw_codes[] = {200, 400, 401, 404, 405, 413, 429, 500, 503};
#define GW_N_CODES ((int)(sizeof gw_codes / sizeof gw_codes[0]))

struct gw_metrics {
    pthread_mutex_t mu;
    uint64_t requests[GW_ROUTE_COUNT][GW_N_CODES + 1]; /* last: other codes */
    uint64_t prompt_tokens, completion_tokens;
    uint64_t prefix_prompt, prefix_hits; /* chain sessions' first steps: positions, and those from caches */
    int sessions, running;
    gw_hist ttft, itl, e2e, queue;
};

static void gw_hist_init(gw_hist *h, const char *name, const char *help, const double *le, int n) {
    memset(h, 0, sizeof *h);
    h->name = name;
    h->help = help;
    h->n = n;
    memcpy(h->le, le, (size_t)n * sizeof *le);
}

static void gw_hist_observe(gw_hist *h, double v) {
    int i = 0;
    while (i < h->n && v > h->le[i]) i++;
    h->count[i]++;
    h->sum += v;
    h->total++;
}

static int gw_hist_render(const gw_hist *h, fu_buf *out) {
    int rc = fu_buf_appendf(out, "# HELP %s %s\n# TYPE %s histogram\n", h->name, h->help, h->name);
    uint64_t cum = 0;
    for (int i = 0; i < h->n && !rc; i++) {
        cum += h->count[i];
        rc = fu_buf_appendf(out, "%s_bucket{le=\"%g\"} %llu\n", h->name, h->le[i], (unsigned long long)cum);
    }
    if (!rc)
        rc = fu_buf_appendf(out, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.6f\n%s_count %llu\n", h->name,
                            (unsigned long long)h->total, h->name, h->sum, h->name, (unsigned long long)h->total);
    return rc;
}

int gw_metrics_new(gw_metrics **out) {
    gw_metrics *m = calloc(1, sizeof *m);
    if (!m) return fu_errorf(FU_ERR_NOMEM, "metrics");
    pthread_mutex_init(&m->mu, NULL);
    static const double ttft[] = {0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                                  1, 2.5, 5, 7.5, 10, 20, 40, 80};
    static const double itl[] = {0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                                 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5};
    static const double e2e[] = {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300};
    gw_hist_init(&m->ttft, "fusion_gateway_time_to_first_token_seconds",
                 "Time from request arrival to the first generated token, per choice.", ttft,
                 (int)(sizeof ttft / sizeof *ttft));
    gw_hist_init(&m->itl, "fusion_gateway_inter_token_latency_seconds", "Time between consecutive generated tokens.",
                 itl, (int)(sizeof itl / sizeof *itl));
    gw_hist_init(&m->e2e, "fusion_gateway_request_duration_seconds",
                 "Time from arrival to the end of a generation request.", e2e, (int)(sizeof e2e / sizeof *e2e));
    gw_hist_init(&m->queue, "fusion_gateway_queue_wait_seconds",
                 "Time a choice waited from its request's arrival until a generation worker took it.", ttft,
                 (int)(sizeof ttft / sizeof *ttft));
    *out = m;
    return FU_OK;
}

void gw_metrics_free(gw_metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

const char *gw_route_name(gw_route r) {
    static const char *names[GW_ROUTE_COUNT] = {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                                "/tokenize", "/detokenize", "/apply-template",
                                                "/health", "/metrics", "/v1/swarm", "/v1/load_lora_adapter",
                                                "/v1/unload_lora_adapter", "/v1/files", "/v1/fine_tuning/jobs",
                                                "/v1/embeddings", "other"};
    return (unsigned)r < GW_ROUTE_COUNT ? names[r] : "other";
}

void gw_metrics_request(gw_metrics *m, gw_route route, int http_status) {
    if ((unsigned)route >= GW_ROUTE_COUNT) route = GW_ROUTE_OTHER;
    int k = GW_N_CODES;
    for (int i = 0; i < GW_N_CODES; i++)
        if (gw_codes[i] == http_status) k = i;
    pthread_mutex_lock(&m->mu);
    m->requests[route][k]++;
    pthread_mutex_unlock(&m->mu);
}

void gw_metrics_tokens(gw_metrics *m, int64_t prompt, int64_t completion) {
    pthread_mutex_lock(&m->mu);
    m->prompt_tokens += (uint64_t)prompt;
    m->completion_tokens += (uint64_t)completion;
    pthread_mutex_unlock(&m->mu);
}

void gw_metrics_prefix(gw_metrics *m, int64_t prompt, int64_t reused) {
    pthread_mutex_lock(&m->mu);
    m->prefix_prompt += (uint64_t)prompt;
    m->prefix_hits += (uint64_t)reused;
    pthread_mutex_unlock(&m->mu);
}

/* The prefix caches' counters and hit rate (mu held). */
static int gw_metrics_render_prefix(const gw_metrics *m, fu_buf *out) {
    double rate = m->prefix_prompt ? (double)m->prefix_hits / (double)m->prefix_prompt : 0.0;
    return fu_buf_appendf(
        out,
        "# HELP fusion_prefix_prompt_tokens_total Positions of chain sessions' first steps (prompts, replays).\n"
        "# TYPE fusion_prefix_prompt_tokens_total counter\nfusion_prefix_prompt_tokens_total %llu\n"
        "# HELP fusion_prefix_hit_tokens_total Of those, positions every shard took from its prefix cache.\n"
        "# TYPE fusion_prefix_hit_tokens_total counter\nfusion_prefix_hit_tokens_total %llu\n"
        "# HELP fusion_prefix_hit_rate Prefix-cache hit tokens / prompt tokens since start.\n"
        "# TYPE fusion_prefix_hit_rate gauge\nfusion_prefix_hit_rate %.6f\n",
        (unsigned long long)m->prefix_prompt, (unsigned long long)m->prefix_hits, rate);
}

#define GW_OBSERVE(fn, field)                   \
    void fn(gw_metrics *m, double seconds) {    \
        pthread_mutex_lock(&m->mu);             \
        gw_hist_observe(&m->field, seconds);    \
        pthread_mutex_unlock(&m->mu);           \
    }
GW_OBSERVE(gw_metrics_ttft, ttft)
GW_OBSERVE(gw_metrics_itl, itl)
GW_OBSERVE(gw_metrics_e2e, e2e)
GW_OBSERVE(gw_metrics_queue_wait, queue)

void gw_metrics_sessions(gw_metrics *m, int delta) {
    pthread_mutex_lock(&m->mu);
    m->sessions += delta;
    pthread_mutex_unlock(&m->mu);
}

void gw_metrics_running(gw_metrics *m, int delta) {
    pthread_mutex_lock(&m->mu);
    m->running += delta;
    pthread_mutex_unlock(&m->mu);
}

int gw_metrics_render(gw_metrics *m, int queue_depth, fu_buf *out) {
    pthread_mutex_lock(&m->mu);
    int rc = fu_buf_appendf(out, "# HELP fusion_gateway_requests_total HTTP requests by route and status.\n"
                                 "# TYPE fusion_gateway_requests_total counter\n");
    for (int r = 0; r < GW_ROUTE_COUNT && !rc; r++)
        for (int k = 0; k <= GW_N_CODES && !rc; k++) {
            if (!m->requests[r][k]) continue;
            char code[8];
            if (k < GW_N_CODES) snprintf(code, sizeof code, "%d", gw_codes[k]);
            else snprintf(code, sizeof code, "other");
            rc = fu_buf_appendf(out, "fusion_gateway_requests_total{route=\"%s\",code=\"%s\"} %llu\n",
                                gw_route_name((gw_route)r), code, (unsigned long long)m->requests[r][k]);
        }
    if (!rc)
        rc = fu_buf_appendf(
            out,
            "# HELP fusion_gateway_prompt_tokens_total Prompt tokens processed.\n"
            "# TYPE fusion_gateway_prompt_tokens_total counter\nfusion_gateway_prompt_tokens_total %llu\n"
            "# HELP fusion_gateway_generation_tokens_total Tokens generated.\n"
            "# TYPE fusion_gateway_generation_tokens_total counter\nfusion_gateway_generation_tokens_total %llu\n"
            "# HELP fusion_gateway_active_sessions Chain sessions open (one per running choice).\n"
            "# TYPE fusion_gateway_active_sessions gauge\nfusion_gateway_active_sessions %d\n"
            "# HELP fusion_gateway_running_requests Generation requests in flight.\n"
            "# TYPE fusion_gateway_running_requests gauge\nfusion_gateway_running_requests %d\n"
            "# HELP fusion_gateway_queue_depth Choices waiting for a generation worker.\n"
            "# TYPE fusion_gateway_queue_depth gauge\nfusion_gateway_queue_depth %d\n",
            (unsigned long long)m->prompt_tokens, (unsigned long long)m->completion_tokens, m->sessions, m->running,
            queue_depth);
    if (!rc) rc = gw_metrics_render_prefix(m, out);
    if (!rc) rc = gw_hist_render(&m->ttft, out);
    if (!rc) rc = gw_hist_render(&m->itl, out);
    if (!rc) rc = gw_hist_render(&m->e2e, out);
    if (!rc) rc = gw_hist_render(&m->queue, out);
    pthread_mutex_unlock(&m->mu);
    return rc;
}
