/* shard-prefix.c -- the prefix cache's blocks: a hash table of chained block hashes, pins and an LRU list. */
#include "shard-prefix.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "mix.h"
#include "status.h"

struct pfx_block {
    uint64_t hash, parent;
    int refs;                     /* pins (a reserved block: 1) */
    bool ready;                   /* published: visible to lookups */
    pfx_block *hnext;             /* the bucket's chain */
    pfx_block *prev, *next;       /* the LRU list, while ready and unpinned */
    int32_t *tokens;              /* (block_tokens), inside the same allocation */
    uint8_t data[];               /* (block_bytes) KV, then the tokens */
};

struct pfx_cache {
    int block_tokens;
    size_t block_bytes;
    pfx_block **buckets;          /* (n_buckets), a power of two */
    size_t n_buckets;
    int n_blocks;
    pfx_block *mru, *lru;         /* unpinned ready blocks, most recently used first */
};

int pfx_cache_new(int block_tokens, size_t block_bytes, pfx_cache **out) {
    *out = NULL;
    if (block_tokens < 1 || block_tokens > 4096 || !block_bytes)
        return fu_errorf(FU_ERR_INVALID, "prefix cache: blocks of %d tokens, %zu bytes", block_tokens, block_bytes);
    pfx_cache *c = calloc(1, sizeof *c);
    if (c) c->buckets = calloc(64, sizeof *c->buckets);
    if (!c || !c->buckets) {
        free(c);
        return fu_errorf(FU_ERR_NOMEM, "prefix cache");
    }
    c->n_buckets = 64;
    c->block_tokens = block_tokens;
    c->block_bytes = block_bytes;
    *out = c;
    return FU_OK;
}

void pfx_cache_free(pfx_cache *c) {
    if (!c) return;
    for (size_t i = 0; i < c->n_buckets; i++)
        for (pfx_block *b = c->buckets[i], *nx; b; b = nx) {
            nx = b->hnext;
            free(b);
        }
    free(c->buckets);
    free(c);
}

int pfx_cache_block_tokens(const pfx_cache *c) { return c->block_tokens; }
uint64_t pfx_cache_bytes(const pfx_cache *c) { return (uint64_t)c->n_blocks * c->block_bytes; }
int pfx_cache_blocks(const pfx_cache *c) { return c->n_blocks; }

uint64_t pfx_hash(uint64_t parent, const int32_t *tokens, int n) {
    uint64_t h = fu_mix64(parent ^ 0x9e3779b97f4a7c15ULL);
    for (int i = 0; i < n; i++) h = fu_mix64(h ^ (uint32_t)tokens[i]) + (uint64_t)i;
    return h;
}

uint64_t pfx_seed(const char *adapter_id, uint64_t version, int first, int last) {
    uint64_t h = fu_mix64(fu_mix64(((uint64_t)(uint32_t)first << 32) | (uint32_t)last) ^ version);
    for (const char *p = adapter_id ? adapter_id : ""; *p; p++) h = fu_mix64(h ^ (unsigned char)*p);
    return fu_mix64(h ^ 0x51ed270b27a4c4a3ULL); /* NULL and "" are both the base model */
}

/* ---- the LRU list ------------------------------------------------------------------------ */

static void pfx_lru_unlink(pfx_cache *c, pfx_block *b) {
    if (b->prev) b->prev->next = b->next;
    else c->mru = b->next;
    if (b->next) b->next->prev = b->prev;
    else c->lru = b->prev;
    b->prev = b->next = NULL;
}

static void pfx_lru_push(pfx_cache *c, pfx_block *b) {
    b->prev = NULL;
    b->next = c->mru;
    if (c->mru) c->mru->prev = b;
    else c->lru = b;
    c->mru = b;
}

/* ---- the table ----------------------------------------------------------------------------- */

static pfx_block **pfx_bucket(pfx_cache *c, uint64_t hash) { return &c->buckets[hash & (c->n_buckets - 1)]; }

/* The block of tokens[0..block_tokens) under parent (ready or not); NULL if none. */
static pfx_block *pfx_find(pfx_cache *c, uint64_t hash, uint64_t parent, const int32_t *tokens) {
    for (pfx_block *b = *pfx_bucket(c, hash); b; b = b->hnext)
        if (b->hash == hash && b->parent == parent &&
            !memcmp(b->tokens, tokens, (size_t)c->block_tokens * sizeof *tokens))
            return b;
    return NULL;
}

/* Doubles the buckets once the blocks outnumber them (best effort: a failed growth keeps
 * longer chains). */
static void pfx_grow(pfx_cache *c) {
    if ((size_t)c->n_blocks <= c->n_buckets) return;
    size_t n = c->n_buckets * 2;
    pfx_block **nb = calloc(n, sizeof *nb);
    if (!nb) return;
    for (size_t i = 0; i < c->n_buckets; i++)
        for (pfx_block *b = c->buckets[i], *nx; b; b = nx) {
            nx = b->hnext;
            b->hnext = nb[b->hash & (n - 1)];
            nb[b->hash & (n - 1)] = b;
        }
    free(c->buckets);
    c->buckets = nb;
    c->n_buckets = n;
}

/* Takes b out of the table and frees it. */
static void pfx_remove(pfx_cache *c, pfx_block *b) {
    for (pfx_block **pp = pfx_bucket(c, b->hash); *pp; pp = &(*pp)->hnext)
        if (*pp == b) {
            *pp = b->hnext;
            break;
        }
    c->n_blocks--;
    free(b);
}

/* ---- pins ------------------------------------------------------------------------------------ */

int pfx_cache_acquire(pfx_cache *c, uint64_t seed, const int32_t *tokens, int n, int max_blocks, pfx_block **out) {
    const int B = c->block_tokens;
    uint64_t parent = seed;
    int k = 0;
    while (k < max_blocks && (k + 1) * B <= n) {
        const int32_t *t = tokens + (size_t)k * B;
        uint64_t h = pfx_hash(parent, t, B);
        pfx_block *b = pfx_find(c, h, parent, t);
        if (!b || !b->ready) break;
        if (b->refs++ == 0) pfx_lru_unlink(c, b);
        out[k++] = b;
        parent = h;
    }
    return k;
}

void pfx_cache_release(pfx_cache *c, pfx_block *const *blocks, int n) {
    /* the last block first, so that a prefix's first block ends up the most recently used and
     * eviction takes a run from its end */
    for (int i = n - 1; i >= 0; i--)
        if (--blocks[i]->refs == 0) pfx_lru_push(c, blocks[i]);
}

const void *pfx_block_data(const pfx_block *b) { return b->data; }
const int32_t *pfx_block_tokens(const pfx_block *b) { return b->tokens; }
void *pfx_block_fill(pfx_block *b) { return b->data; }

pfx_block *pfx_cache_reserve(pfx_cache *c, uint64_t parent, const int32_t *tokens) {
    const int B = c->block_tokens;
    uint64_t h = pfx_hash(parent, tokens, B);
    pfx_block *b = pfx_find(c, h, parent, tokens);
    if (b) {
        if (b->ready && b->refs == 0) {
            pfx_lru_unlink(c, b);
            pfx_lru_push(c, b);
        }
        return NULL;
    }
    b = malloc(sizeof *b + c->block_bytes + (size_t)B * sizeof(int32_t));
    if (!b) return NULL;
    memset(b, 0, sizeof *b);
    b->hash = h;
    b->parent = parent;
    b->refs = 1;
    b->tokens = (int32_t *)(b->data + c->block_bytes);
    memcpy(b->tokens, tokens, (size_t)B * sizeof *tokens);
    pfx_block **bucket = pfx_bucket(c, h);
    b->hnext = *bucket;
    *bucket = b;
    c->n_blocks++;
    pfx_grow(c);
    return b;
}

void pfx_cache_publish(pfx_cache *c, pfx_block *b) {
    b->ready = true;
    pfx_cache_release(c, &b, 1);
}

void pfx_cache_abandon(pfx_cache *c, pfx_block *b) { pfx_remove(c, b); }

uint64_t pfx_cache_evict(pfx_cache *c, uint64_t bytes) {
    uint64_t freed = 0;
    while (freed < bytes && c->lru) {
        pfx_block *b = c->lru;
        pfx_lru_unlink(c, b);
        pfx_remove(c, b);
        freed += c->block_bytes;
    }
    return freed;
}
