/* gw-pace.c -- per-shard step-time figures and the step deadlines derived from them. */
#include "gw-pace.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The last GW_PACE_SAMPLES values of one kind, in microseconds. */
typedef struct pace_ring {
    float v[GW_PACE_SAMPLES];
    int n, next;
} pace_ring;

typedef struct pace_server {
    char address[128];
    uint64_t touched;      /* update counter when last recorded */
    pace_ring decode;      /* 1-position steps: queue + compute */
    pace_ring per_pos;     /* longer steps: (queue + compute) / positions */
} pace_server;

struct gw_pace {
    gw_pace_options o;
    pthread_mutex_t mu;
    pace_server *servers; /* (GW_PACE_SERVERS) */
    int n_servers;
    uint64_t clock;
};

gw_pace *gw_pace_new(const gw_pace_options *o) {
    gw_pace *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->servers = calloc(GW_PACE_SERVERS, sizeof *p->servers);
    if (!p->servers) {
        free(p);
        return NULL;
    }
    if (o) p->o = *o;
    if (p->o.floor_ms <= 0) p->o.floor_ms = 2000;
    if (p->o.multiple <= 0) p->o.multiple = 4;
    if (p->o.fallback_ms <= 0) p->o.fallback_ms = 60000;
    pthread_mutex_init(&p->mu, NULL);
    return p;
}

void gw_pace_free(gw_pace *p) {
    if (!p) return;
    pthread_mutex_destroy(&p->mu);
    free(p->servers);
    free(p);
}

static void ring_add(pace_ring *r, float v) {
    r->v[r->next] = v;
    r->next = (r->next + 1) % GW_PACE_SAMPLES;
    if (r->n < GW_PACE_SAMPLES) r->n++;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* The ring's 99th percentile (its largest value below 100 samples); -1 when empty. */
static double ring_p99(const pace_ring *r) {
    if (!r->n) return -1;
    float v[GW_PACE_SAMPLES];
    memcpy(v, r->v, (size_t)r->n * sizeof *v);
    qsort(v, (size_t)r->n, sizeof *v, cmp_float);
    int i = (int)((double)(r->n - 1) * 0.99 + 0.5);
    return v[i];
}

/* The server's entry (mu held); `make`: a new one, replacing the least recently updated when
 * full. NULL: none. */
static pace_server *pace_find(gw_pace *p, const char *address, bool make) {
    for (int i = 0; i < p->n_servers; i++)
        if (!strcmp(p->servers[i].address, address)) return &p->servers[i];
    if (!make) return NULL;
    pace_server *s = &p->servers[p->n_servers < GW_PACE_SERVERS ? p->n_servers++ : 0];
    if (p->n_servers == GW_PACE_SERVERS)
        for (int i = 0; i < p->n_servers; i++)
            if (p->servers[i].touched < s->touched) s = &p->servers[i];
    memset(s, 0, sizeof *s);
    snprintf(s->address, sizeof s->address, "%s", address);
    return s;
}

void gw_pace_record(gw_pace *p, const chain_hop *hops, int n_hops, int n, const chain_result *res) {
    if (!p || n <= 0 || !res || res->n_timing != n_hops) return;
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < n_hops; i++) {
        const chain_timing *t = &res->timing[i];
        pace_server *s = pace_find(p, hops[i].address, true);
        double us = (double)(t->queue_us + t->compute_us);
        if (us < 0) continue;
        s->touched = ++p->clock;
        if (n == 1) ring_add(&s->decode, (float)us);
        else ring_add(&s->per_pos, (float)(us / n));
    }
    pthread_mutex_unlock(&p->mu);
}

int64_t gw_pace_cap_ms(int fallback_ms, int n) {
    return (int64_t)((double)fallback_ms * (1.0 + (double)n / GW_PACE_CHUNK));
}

int gw_pace_deadline_ms(gw_pace *p, const chain_hop *hops, int n_hops, int n) {
    if (!p) return 0;
    double cap_ms = (double)gw_pace_cap_ms(p->o.fallback_ms, n);
    double sum_us = 0;
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < n_hops && sum_us >= 0; i++) {
        const pace_server *s = pace_find(p, hops[i].address, false);
        double dec = s ? ring_p99(&s->decode) : -1, pos = s ? ring_p99(&s->per_pos) : -1;
        if (dec < 0 || pos < 0) sum_us = -1;
        else sum_us += dec + pos * (double)(n - 1);
    }
    pthread_mutex_unlock(&p->mu);
    if (sum_us < 0) return p->o.fallback_ms;
    double ms = p->o.floor_ms + p->o.multiple * sum_us / 1000.0;
    return (int)(ms < cap_ms ? ms : cap_ms);
}
