/* rt-swarm.c -- the swarm model: servers, spans, links, capacity tables, coverage. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "router-impl.h"
#include "status.h"

int rt_swarm_init(rt_swarm *sw, const rt_model *model) {
    if (!sw || !model) return fu_errorf(FU_ERR_INVALID, "rt_swarm_init: NULL argument");
    memset(sw, 0, sizeof *sw);
    if (model->n_layers <= 0 || model->n_layers > 100000)
        return fu_errorf(FU_ERR_INVALID, "model %s: n_layers %d out of range", model->name,
                         model->n_layers);
    sw->model = *model;
    sw->model.name[sizeof sw->model.name - 1] = '\0';
    return FU_OK;
}

static void server_free(rt_server *s) {
    free(s->tput);
    free(s->kv_tokens);
    s->tput = s->kv_tokens = NULL;
}

void rt_swarm_free(rt_swarm *sw) {
    if (!sw) return;
    for (int i = 0; i < sw->n_servers; i++) {
        server_free(&sw->servers[i]);
        rt__adj_free(&sw->out[i]);
        rt__adj_free(&sw->in[i]);
    }
    free(sw->servers);
    free(sw->out), free(sw->in), free(sw->on_default);
    free(sw->from_source);
    free(sw->to_sink);
    sw->servers = NULL;
    sw->out = sw->in = NULL;
    sw->on_default = NULL;
    sw->from_source = sw->to_sink = NULL;
    sw->n_servers = sw->cap = 0;
}

/* Grows the server slots (and their link lists) to at least `want`; existing lists move. */
static int swarm_grow(rt_swarm *sw, int want) {
    if (want <= sw->cap) return FU_OK;
    int cap = sw->cap ? sw->cap : 8;
    while (cap < want) {
        if (cap > (1 << 20)) return fu_errorf(FU_ERR_RANGE, "too many servers (%d)", want);
        cap *= 2;
    }
    rt_server *servers = calloc((size_t)cap, sizeof *servers);
    rt_adj *out = calloc((size_t)cap, sizeof *out), *in = calloc((size_t)cap, sizeof *in);
    unsigned char *dflt = calloc((size_t)cap, 1);
    rt_link *src = calloc((size_t)cap, sizeof *src);
    rt_link *snk = calloc((size_t)cap, sizeof *snk);
    if (!servers || !out || !in || !dflt || !src || !snk) {
        free(servers), free(out), free(in), free(dflt), free(src), free(snk);
        return fu_errorf(FU_ERR_NOMEM, "swarm: out of memory for %d servers", cap);
    }
    size_t n = (size_t)sw->n_servers;
    if (n) {
        memcpy(servers, sw->servers, n * sizeof *servers);
        memcpy(out, sw->out, n * sizeof *out);
        memcpy(in, sw->in, n * sizeof *in);
        memcpy(dflt, sw->on_default, n);
        memcpy(src, sw->from_source, n * sizeof *src);
        memcpy(snk, sw->to_sink, n * sizeof *snk);
    }
    free(sw->servers), free(sw->out), free(sw->in), free(sw->on_default);
    free(sw->from_source), free(sw->to_sink);
    sw->servers = servers;
    sw->out = out;
    sw->in = in;
    sw->on_default = dflt;
    sw->from_source = src;
    sw->to_sink = snk;
    sw->cap = cap;
    return FU_OK;
}

static int copy_tables(rt_server *dst, const rt_server *src) {
    dst->tput = NULL;
    dst->kv_tokens = NULL;
    if (src->n_tput < 0 || src->n_tput > 100000 || (src->n_tput > 0 && !src->tput))
        return fu_errorf(FU_ERR_INVALID, "server %s: bad throughput table", src->name);
    if (src->n_tput == 0) return FU_OK;
    dst->tput = malloc((size_t)src->n_tput * sizeof(double));
    dst->kv_tokens = calloc((size_t)src->n_tput, sizeof(double));
    if (!dst->tput || !dst->kv_tokens) {
        server_free(dst);
        return fu_errorf(FU_ERR_NOMEM, "server %s: out of memory", src->name);
    }
    for (int k = 0; k < src->n_tput; k++) {
        double t = src->tput[k], kv = src->kv_tokens ? src->kv_tokens[k] : 0;
        if (!isfinite(t) || t < 0 || !isfinite(kv) || kv < 0) {
            server_free(dst);
            return fu_errorf(FU_ERR_INVALID, "server %s: bad table entry for %d blocks", src->name,
                             k + 1);
        }
        dst->tput[k] = t;
        dst->kv_tokens[k] = kv;
    }
    return FU_OK;
}

/* Copies server i's tables and links from src into the grown dst (dst->n_servers == i). */
static int clone_server(rt_swarm *dst, const rt_swarm *src, int i) {
    dst->servers[i] = src->servers[i];
    int rc = copy_tables(&dst->servers[i], &src->servers[i]);
    if (rc) {
        memset(&dst->servers[i], 0, sizeof dst->servers[i]);
        return rc;
    }
    if ((rc = rt__adj_copy(&dst->out[i], &src->out[i])) || (rc = rt__adj_copy(&dst->in[i], &src->in[i]))) {
        rt__adj_free(&dst->out[i]);
        server_free(&dst->servers[i]);
        return rc;
    }
    dst->n_servers = i + 1;
    dst->on_default[i] = src->on_default[i];
    dst->from_source[i] = src->from_source[i];
    dst->to_sink[i] = src->to_sink[i];
    return FU_OK;
}

int rt_swarm_clone(rt_swarm *dst, const rt_swarm *src) {
    if (!dst || !src) return fu_errorf(FU_ERR_INVALID, "rt_swarm_clone: NULL argument");
    int rc = rt_swarm_init(dst, &src->model);
    if (rc) return rc;
    if ((rc = swarm_grow(dst, src->n_servers))) return rc;
    for (int i = 0; i < src->n_servers; i++)
        if ((rc = clone_server(dst, src, i))) {
            rt_swarm_free(dst);
            return rc;
        }
    dst->default_link = src->default_link;
    dst->source_nic_out = src->source_nic_out;
    dst->sink_nic_in = src->sink_nic_in;
    dst->version = src->version;
    return FU_OK;
}

int rt_swarm_add_server(rt_swarm *sw, const rt_server *desc) {
    if (!sw || !desc) return fu_errorf(FU_ERR_INVALID, "rt_swarm_add_server: NULL argument");
    int rc = swarm_grow(sw, sw->n_servers + 1);
    if (rc) return rc;
    int id = sw->n_servers;
    rt_server *s = &sw->servers[id];
    *s = *desc;
    s->name[sizeof s->name - 1] = '\0';
    s->address[sizeof s->address - 1] = '\0';
    s->kind[sizeof s->kind - 1] = '\0';
    if ((rc = copy_tables(s, desc))) {
        memset(s, 0, sizeof *s);
        return rc;
    }
    if (s->state == RT_SERVER_GONE) s->state = RT_SERVER_ACTIVE;
    int first = desc->first, last = desc->last;
    s->first = s->last = 0;
    sw->n_servers++;
    rt__links_clear(sw, id);
    sw->from_source[id] = sw->to_sink[id] = (rt_link){0, 0};
    if (first != last && (rc = rt_swarm_set_span(sw, id, first, last))) {
        server_free(s);
        memset(s, 0, sizeof *s);
        sw->n_servers--;
        return rc;
    }
    sw->version++;
    return id;
}

int rt_swarm_add_server_at(rt_swarm *sw, int slot, const rt_server *desc) {
    if (!sw || !desc) return fu_errorf(FU_ERR_INVALID, "rt_swarm_add_server_at: NULL argument");
    if (slot < 0) return rt_swarm_add_server(sw, desc);
    if (slot >= sw->n_servers || sw->servers[slot].state != RT_SERVER_GONE)
        return fu_errorf(FU_ERR_INVALID, "rt_swarm_add_server_at: slot %d is not a GONE server", slot);
    rt_server *s = &sw->servers[slot], old = *s;
    *s = *desc;
    s->name[sizeof s->name - 1] = '\0';
    s->address[sizeof s->address - 1] = '\0';
    s->kind[sizeof s->kind - 1] = '\0';
    int rc = copy_tables(s, desc);
    if (rc) {
        *s = old;
        return rc;
    }
    server_free(&old);
    if (s->state == RT_SERVER_GONE) s->state = RT_SERVER_ACTIVE;
    int first = desc->first, last = desc->last;
    s->first = s->last = 0;
    rt__links_clear(sw, slot);
    sw->from_source[slot] = sw->to_sink[slot] = (rt_link){0, 0};
    if (first != last && (rc = rt_swarm_set_span(sw, slot, first, last))) {
        s->state = RT_SERVER_GONE;
        s->first = s->last = 0;
        return rc;
    }
    sw->version++;
    return slot;
}

int rt_swarm_remove_server(rt_swarm *sw, int id) {
    if (!sw || id < 0 || id >= sw->n_servers)
        return fu_errorf(FU_ERR_INVALID, "rt_swarm_remove_server: bad id %d", id);
    sw->servers[id].state = RT_SERVER_GONE;
    sw->servers[id].first = sw->servers[id].last = 0;
    sw->version++;
    return FU_OK;
}

int rt_swarm_max_layers(const rt_swarm *sw, int id) {
    if (!sw || id < 0 || id >= sw->n_servers) return 0;
    const rt_server *s = &sw->servers[id];
    if (s->state == RT_SERVER_GONE) return 0;
    int k = s->n_tput;
    if (s->vram_bytes > 0 && sw->model.layer_bytes > 0) {
        double frac = sw->model.weight_vram_fraction > 0 ? sw->model.weight_vram_fraction : 1.0;
        double fit = floor(frac * s->vram_bytes / sw->model.layer_bytes + 1e-9);
        if (fit < k) k = (int)fit;
    }
    if (k > sw->model.n_layers) k = sw->model.n_layers;
    /* trailing zero-throughput entries mean "cannot" */
    while (k > 0 && !(s->tput[k - 1] > 0)) k--;
    return k;
}

double rt_swarm_tput(const rt_swarm *sw, int id, int k) {
    if (k <= 0 || k > rt_swarm_max_layers(sw, id)) return 0;
    return sw->servers[id].tput[k - 1];
}

double rt_swarm_kv_tokens(const rt_swarm *sw, int id, int k) {
    if (!sw || id < 0 || id >= sw->n_servers || k <= 0) return 0;
    const rt_server *s = &sw->servers[id];
    if (k > s->n_tput || !s->kv_tokens) return 0;
    return s->kv_tokens[k - 1];
}

int rt_swarm_set_span(rt_swarm *sw, int id, int first, int last) {
    if (!sw || id < 0 || id >= sw->n_servers)
        return fu_errorf(FU_ERR_INVALID, "rt_swarm_set_span: bad id %d", id);
    rt_server *s = &sw->servers[id];
    if (first == last) {
        s->first = s->last = 0;
        sw->version++;
        return FU_OK;
    }
    if (s->state == RT_SERVER_GONE)
        return fu_errorf(FU_ERR_INVALID, "server %s has left the swarm", s->name);
    if (first < 0 || last > sw->model.n_layers || first > last)
        return fu_errorf(FU_ERR_RANGE, "server %s: span [%d, %d) outside [0, %d)", s->name, first,
                         last, sw->model.n_layers);
    int maxk = rt_swarm_max_layers(sw, id);
    if (last - first > maxk)
        return fu_errorf(FU_ERR_RANGE, "server %s: span of %d blocks exceeds its limit of %d "
                         "(profile/VRAM)", s->name, last - first, maxk);
    s->first = first;
    s->last = last;
    if (s->state == RT_SERVER_SPARE) s->state = RT_SERVER_ACTIVE;
    sw->version++;
    return FU_OK;
}

int rt_swarm_serving(const rt_swarm *sw, int id) {
    if (!sw || id < 0 || id >= sw->n_servers) return 0;
    const rt_server *s = &sw->servers[id];
    return s->state == RT_SERVER_ACTIVE && s->last > s->first;
}

int rt_swarm_uncovered(const rt_swarm *sw, int *first_gap) {
    int L = sw->model.n_layers, n = 0, gap = -1;
    /* difference array over blocks */
    int *cnt = calloc((size_t)L + 1, sizeof *cnt);
    if (!cnt) {
        if (first_gap) *first_gap = 0;
        return L;
    }
    for (int i = 0; i < sw->n_servers; i++) {
        if (!rt_swarm_serving(sw, i)) continue;
        cnt[sw->servers[i].first]++;
        cnt[sw->servers[i].last]--;
    }
    int run = 0;
    for (int l = 0; l < L; l++) {
        run += cnt[l];
        if (run <= 0) {
            n++;
            if (gap < 0) gap = l;
        }
    }
    free(cnt);
    if (first_gap) *first_gap = gap;
    return n;
}

int rt_swarm_live(const rt_swarm *sw) {
    int n = 0;
    for (int i = 0; i < sw->n_servers; i++) n += sw->servers[i].state != RT_SERVER_GONE;
    return n;
}

void rt__block_tput(const rt_swarm *sw, double *out) {
    int L = sw->model.n_layers;
    for (int l = 0; l < L; l++) out[l] = 0;
    for (int i = 0; i < sw->n_servers; i++) {
        if (!rt_swarm_serving(sw, i)) continue;
        const rt_server *s = &sw->servers[i];
        double t = rt_swarm_tput(sw, i, s->last - s->first);
        for (int l = s->first; l < s->last; l++) out[l] += t;
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Replaces `out` by `in` in the sorted cur[0..k), keeping it sorted. */
static void window_slide(double *cur, int k, double out, double in) {
    int lo = 0, hi = k - 1;
    while (lo < hi) { /* first index holding a value >= out (out is present) */
        int mid = (lo + hi) / 2;
        if (cur[mid] < out) lo = mid + 1;
        else hi = mid;
    }
    int p = lo;
    while (p > 0 && cur[p - 1] > in) cur[p] = cur[p - 1], p--;
    while (p < k - 1 && cur[p + 1] < in) cur[p] = cur[p + 1], p++;
    cur[p] = in;
}

int rt__petals_best_start(const double *tput, int n_layers, int k, double *scratch) {
    int best = 0;
    double *cur = scratch, *bst = scratch + k;
    if (k <= 0 || k > n_layers) return 0;
    memcpy(cur, tput, (size_t)k * sizeof(double));
    qsort(cur, (size_t)k, sizeof(double), cmp_double);
    memcpy(bst, cur, (size_t)k * sizeof(double));
    /* windows slide by one block: the sorted window changes by one value out and one in */
    for (int s = 1; s + k <= n_layers; s++) {
        window_slide(cur, k, tput[s - 1], tput[s + k - 1]);
        int better = 0;
        for (int t = 0; t < k; t++) {
            if (cur[t] < bst[t]) better = 1;
            if (cur[t] != bst[t]) break;
        }
        if (better) {
            best = s;
            memcpy(bst, cur, (size_t)k * sizeof(double));
        }
    }
    return best;
}

uint64_t rt__rng_next(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

double rt__rng_unit(uint64_t *state) { return (double)(rt__rng_next(state) >> 11) * 0x1.0p-53; }

int rt__rng_int(uint64_t *state, int n) { return (int)(rt__rng_next(state) % (uint64_t)n); }
