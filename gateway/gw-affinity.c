/* gw-affinity.c -- per-server LRU sets of prompt-prefix hashes for cache-aware routing. */
#include "gw-affinity.h"

#include <stdlib.h>
#include <string.h>

#include "mix.h"
#include "status.h"

typedef struct gw_aff_entry {
    uint64_t hash;
    uint64_t used;  /* the table's clock when last noted or found; 0: empty slot */
} gw_aff_entry;

struct gw_affinity {
    int per_server;
    gw_aff_entry *slots; /* (n_servers, per_server) */
    int n_servers;
    uint64_t clock;
};

int gw_affinity_new(int per_server, gw_affinity **out) {
    *out = calloc(1, sizeof **out);
    if (!*out) return fu_errorf(FU_ERR_NOMEM, "affinity table");
    (*out)->per_server = per_server > 0 ? per_server : 1;
    return FU_OK;
}

void gw_affinity_free(gw_affinity *a) {
    if (!a) return;
    free(a->slots);
    free(a);
}

int gw_affinity_hashes(const int32_t *tokens, int n, uint64_t *out) {
    uint64_t h = 0x6a09e667f3bcc909ULL;
    int k = 0;
    for (; k < GW_AFFINITY_MAX_BLOCKS && (k + 1) * GW_AFFINITY_BLOCK <= n; k++) {
        for (int i = 0; i < GW_AFFINITY_BLOCK; i++) h = fu_mix64(h ^ (uint32_t)tokens[k * GW_AFFINITY_BLOCK + i]);
        out[k] = h;
    }
    return k;
}

/* Server s's slots (NULL: none yet). */
static gw_aff_entry *gw_aff_row(gw_affinity *a, int s) {
    return s >= 0 && s < a->n_servers ? a->slots + (size_t)s * a->per_server : NULL;
}

/* The slot of hash h in row (NULL: absent). */
static gw_aff_entry *gw_aff_find(const gw_affinity *a, gw_aff_entry *row, uint64_t h) {
    for (int i = 0; row && i < a->per_server; i++)
        if (row[i].used && row[i].hash == h) return &row[i];
    return NULL;
}

int gw_affinity_cached(gw_affinity *a, int server, const uint64_t *h, int n) {
    gw_aff_entry *row = gw_aff_row(a, server);
    int k = 0;
    for (; row && k < n; k++) {
        gw_aff_entry *e = gw_aff_find(a, row, h[k]);
        if (!e) break;
        e->used = ++a->clock;
    }
    return k * GW_AFFINITY_BLOCK;
}

/* Grows the table to hold server s's row. */
static int gw_aff_grow(gw_affinity *a, int s) {
    if (s < a->n_servers) return FU_OK;
    int n = s + 8;
    gw_aff_entry *p = realloc(a->slots, (size_t)n * (size_t)a->per_server * sizeof *p);
    if (!p) return fu_errorf(FU_ERR_NOMEM, "affinity table");
    memset(p + (size_t)a->n_servers * a->per_server, 0, (size_t)(n - a->n_servers) * a->per_server * sizeof *p);
    a->slots = p;
    a->n_servers = n;
    return FU_OK;
}

int gw_affinity_note(gw_affinity *a, int server, const uint64_t *h, int n) {
    if (server < 0 || n <= 0) return FU_OK;
    int rc = gw_aff_grow(a, server);
    if (rc) return rc;
    gw_aff_entry *row = gw_aff_row(a, server);
    for (int k = 0; k < n; k++) {
        gw_aff_entry *e = gw_aff_find(a, row, h[k]), *lru = row;
        for (int i = 1; !e && i < a->per_server; i++)
            if (row[i].used < lru->used) lru = &row[i];
        if (!e) {
            e = lru;
            e->hash = h[k];
        }
        e->used = ++a->clock;
    }
    return FU_OK;
}
