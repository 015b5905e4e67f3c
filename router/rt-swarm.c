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
    for (int i = 0; i < sw->n_servers; i++) server_free(&sw->servers[i]);
    free(sw->servers);
    free(sw->links);
    free(sw->from_source);
    free(sw->to_sink);
    sw->servers = NULL;
    sw->links = sw->from_source = sw->to_sink = NULL;
    sw->n_servers = sw->cap = 0;
}

/* Grows the server slots (and the link matrix) to at least `want`. */
static int swarm_grow(rt_swarm *sw, int want) {
    if (want <= sw->cap) return FU_OK;
    int cap = sw->cap ? sw->cap : 8;
    while (cap < want) {
        if (cap > (1 << 14)) return fu_errorf(FU_ERR_RANGE, "too many servers (%d)", want);
        cap *= 2;
    }
    rt_server *servers = calloc((size_t)cap, sizeof *servers);
    rt_link *links = calloc((size_t)cap * (size_t)cap, sizeof *links);
    rt_link *src = calloc((size_t)cap, sizeof *src);
    rt_link *snk = calloc((size_t)cap, sizeof *snk);
    if (!servers || !links || !src || !snk) {
        free(servers), free(links), free(src), free(snk);
        return fu_errorf(FU_ERR_NOMEM, "swarm: out of memory for %d servers", cap);
    }
    for (int i = 0; i < sw->n_servers; i++) {
        servers[i] = sw->servers[i];
        src[i] = sw->from_source[i];
        snk[i] = sw->to_sink[i];
        for (int j = 0; j < sw->n_servers; j++)
            links[(size_t)i * cap + j] = sw->links[(size_t)i * sw->cap + j];
    }
    free(sw->servers), free(sw->links), free(sw->from_source), free(sw->to_sink);
    sw->servers = servers;
    sw->links = links;
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

int rt_swarm_clone(rt_swarm *dst, const rt_swarm *src) {
    if (!dst || !src) return fu_errorf(FU_ERR_INVALID, "rt_swarm_clone: NULL argument");
    int rc = rt_swarm_init(dst, &src->model);
    if (rc) return rc;
    if ((rc = swarm_grow(dst, src->n_servers))) return rc;
    for (int i = 0; i < src->n_servers; i++) {
        dst->servers[i] = src->servers[i];
        if ((rc = copy_tables(&dst->servers[i], &src->servers[i]))) {
            dst->n_servers = i;
            rt_swarm_free(dst);
            return rc;
        }
        dst->n_servers = i + 1;
        dst->from_source[i] = src->from_source[i];
        dst->to_sink[i] = src->to_sink[i];
    }
    for (int i = 0; i < src->n_servers; i++)
        for (int j = 0; j < src->n_servers; j++)
            dst->links[(size_t)i * dst->cap + j] = src->links[(size_t)i * src->cap + j];
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
    for (int j = 0; j < sw->n_servers; j++) {
        sw->links[(size_t)id * sw->cap + j] = (rt_link){0, 0};
        sw->links[(size_t)j * sw->cap + id] = (rt_link){0, 0};
    }
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
    for (int j = 0; j < sw->n_servers; j++) {
        sw->links[(size_t)slot * sw->cap + j] = (rt_link){0, 0};
        sw->links[(size_t)j * sw->cap + slot] = (rt_link){0, 0};
    }
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

int rt_swarm_set_link(rt_swarm *sw, int from, int to, double bandwidth, double latency) {
    if (!sw) return fu_errorf(FU_ERR_INVALID, "rt_swarm_set_link: NULL swarm");
    if (!isfinite(bandwidth) || !isfinite(latency) || latency < 0)
        return fu_errorf(FU_ERR_INVALID, "link %d->%d: bad bandwidth/latency", from, to);
    rt_link l = {bandwidth > 0 ? bandwidth : 0, latency};
    if (from == RT_SOURCE && to >= 0 && to < sw->n_servers) sw->from_source[to] = l;
    else if (to == RT_SINK && from >= 0 && from < sw->n_servers) sw->to_sink[from] = l;
    else if (from >= 0 && from < sw->n_servers && to >= 0 && to < sw->n_servers && from != to)
        sw->links[(size_t)from * sw->cap + to] = l;
    else return fu_errorf(FU_ERR_INVALID, "link %d->%d: bad endpoints", from, to);
    sw->version++;
    return FU_OK;
}

rt_link rt_swarm_link(const rt_swarm *sw, int from, int to) {
    rt_link none = {0, 0};
    if (!sw) return none;
    if (from == RT_SOURCE && to >= 0 && to < sw->n_servers) return sw->from_source[to];
    if (to == RT_SINK && from >= 0 && from < sw->n_servers) return sw->to_sink[from];
    if (from >= 0 && from < sw->n_servers && to >= 0 && to < sw->n_servers)
        return sw->links[(size_t)from * sw->cap + to];
    return none;
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

int rt__petals_best_start(const double *tput, int n_layers, int k, double *scratch) {
    int best = 0;
    double *cur = scratch, *bst = scratch + k;
    for (int s = 0; s + k <= n_layers; s++) {
        memcpy(cur, tput + s, (size_t)k * sizeof(double));
        qsort(cur, (size_t)k, sizeof(double), cmp_double);
        int better = s == 0;
        for (int t = 0; !better && t < k; t++) {
            if (cur[t] < bst[t]) better = 1;
            else if (cur[t] > bst[t]) break;
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
