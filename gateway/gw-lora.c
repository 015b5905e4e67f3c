/* gw-lora.c -- the gateway's LoRA adapters: loading, naming, versions, and their slices sent to the shards. */
#include "gw-lora.h"

#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "lora.h"
#include "status.h"

#define GW_LORA_MAX_NAME 128

typedef struct gw_lora_entry {
    gw_lora pub;           /* first: a gw_lora * is the entry */
    char *name, *path, *shard_id;
    lora_adapter *whole;   /* every block, PEFT's row order */
    long long created;
    int refs;              /* the set's own (until removed) + requests' */
    bool removed;
    char **sent;           /* hops holding it: "address|first|last" */
    int n_sent, cap_sent;
    struct gw_lora_entry *next;
} gw_lora_entry;

struct gw_lora_set {
    gw_lora_options o;
    char *dir_real;        /* realpath of lora_dir, NULL: none */
    pthread_mutex_t mu;
    gw_lora_entry *head;   /* loaded ones, newest first */
    int n;                 /* not removed */
    uint64_t gen;
};

static void entry_free(gw_lora_entry *e) {
    for (int i = 0; i < e->n_sent; i++) free(e->sent[i]);
    free(e->sent);
    lora_free(e->whole);
    free(e->name), free(e->path), free(e->shard_id);
    free(e);
}

int gw_lora_set_new(const gw_lora_options *o, gw_lora_set **out) {
    *out = NULL;
    gw_lora_set *s = calloc(1, sizeof *s);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "adapters");
    s->o = *o;
    if (o->lora_dir && !(s->dir_real = realpath(o->lora_dir, NULL))) {
        free(s);
        return fu_errorf(FU_ERR_INVALID, "--lora-dir %s: no such directory", o->lora_dir);
    }
    pthread_mutex_init(&s->mu, NULL);
    *out = s;
    return FU_OK;
}

void gw_lora_set_free(gw_lora_set *s) {
    if (!s) return;
    while (s->head) {
        gw_lora_entry *e = s->head;
        s->head = e->next;
        entry_free(e);
    }
    free(s->dir_real);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* The entry named `name` that is not removed (under s->mu), or NULL. */
static gw_lora_entry *find(gw_lora_set *s, const char *name) {
    for (gw_lora_entry *e = s->head; e; e = e->next)
        if (!e->removed && !strcmp(e->name, name)) return e;
    return NULL;
}

/* 0 when a runtime load may read `path` (inside lora_dir), else 403 with *err. */
static int check_path(const gw_lora_set *s, const char *path, gw_error *err) {
    if (!s->dir_real)
        return gw_error_set(err, 403, "lora_path", NULL,
                            "loading adapters at run time is disabled (start the gateway with --lora-dir)");
    char *real = realpath(path, NULL);
    const size_t n = strlen(s->dir_real);
    bool inside = real && !strncmp(real, s->dir_real, n) && (real[n] == '/' || real[n] == '\0');
    free(real);
    return inside ? 0 : gw_error_set(err, 403, "lora_path", NULL, "lora_path is not an adapter directory within --lora-dir");
}

/* 0 when `name` may name a new adapter, else 400 with *err. */
static int check_name(gw_lora_set *s, const char *name, const char *base_name, gw_error *err) {
    size_t n = strlen(name);
    bool ok = n > 0 && n <= GW_LORA_MAX_NAME && !strchr(name, '@');
    for (size_t i = 0; ok && i < n; i++) ok = (unsigned char)name[i] > 0x20 && name[i] != 0x7f;
    if (!ok)
        return gw_error_set(err, 400, "lora_name", NULL,
                            "lora_name must be 1..%d printable characters without spaces or '@'", GW_LORA_MAX_NAME);
    if (!strcmp(name, base_name) || find(s, name))
        return gw_error_set(err, 400, "lora_name", NULL, "The lora adapter '%s' has already been loaded.", name);
    if (s->n >= s->o.max_loras)
        return gw_error_set(err, 400, "lora_name", NULL, "%d adapters are loaded, the most this gateway serves",
                            s->o.max_loras);
    return 0;
}

/* A new entry for the adapter read from path (PEFT's row order). */
static int entry_make(gw_lora_set *s, const char *name, const char *path, gw_lora_entry **out, gw_error *err) {
    lora_adapter *ad = NULL;
    if (lora_load(path, s->o.model, 0, -1, s->o.max_rank, &ad) || lora_set_qk_order(ad, false)) {
        lora_free(ad);
        return gw_error_set(err, 400, "lora_path", NULL, "%s", fu_last_error());
    }
    gw_lora_entry *e = calloc(1, sizeof *e);
    char id[GW_LORA_MAX_NAME + 32];
    pthread_mutex_lock(&s->mu);
    snprintf(id, sizeof id, "%s@%llu", name, (unsigned long long)++s->gen);
    pthread_mutex_unlock(&s->mu);
    if (e) *e = (gw_lora_entry){.name = strdup(name), .path = strdup(path), .shard_id = strdup(id), .whole = ad,
                                .created = (long long)time(NULL), .refs = 1};
    if (!e || !e->name || !e->path || !e->shard_id) {
        if (e) entry_free(e);
        else lora_free(ad);
        return gw_error_set(err, 500, NULL, NULL, "out of memory");
    }
    e->pub = (gw_lora){e->name, e->shard_id};
    *out = e;
    return 0;
}

int gw_lora_add(gw_lora_set *s, const char *name, const char *path, const char *base_name, bool runtime,
                gw_error *err) {
    if (runtime && check_path(s, path, err)) return err->http;
    pthread_mutex_lock(&s->mu);
    int http = check_name(s, name, base_name, err);
    pthread_mutex_unlock(&s->mu);
    gw_lora_entry *e = NULL;
    if (http || (http = entry_make(s, name, path, &e, err))) return http;
    pthread_mutex_lock(&s->mu);
    if (!(http = check_name(s, name, base_name, err))) { /* a concurrent load of the same name */
        e->next = s->head;
        s->head = e;
        s->n++;
    }
    pthread_mutex_unlock(&s->mu);
    if (http) entry_free(e);
    return http;
}

/* Drops one reference of e; the last of a removed entry unlinks and frees it (under s->mu). */
static void entry_unref(gw_lora_set *s, gw_lora_entry *e) {
    if (--e->refs) return;
    for (gw_lora_entry **p = &s->head; *p; p = &(*p)->next)
        if (*p == e) {
            *p = e->next;
            break;
        }
    entry_free(e);
}

/* "address|first|last" of a hop into key. */
static void hop_key(const chain_hop *h, char *key, size_t size) {
    snprintf(key, size, "%s|%d|%d", h->address, h->first_block, h->last_block);
}

/* Unloads e from the hops it was sent to (best effort; e's list is taken). */
static void unload_sent(chain_client *c, gw_lora_entry *e, char **sent, int n) {
    for (int i = 0; i < n; i++) {
        char *bar = strchr(sent[i], '|');
        chain_hop h = {sent[i], 0, 0, NULL};
        if (bar && sscanf(bar, "|%d|%d", &h.first_block, &h.last_block) == 2) {
            *bar = '\0';
            if (c && chain_adapter_unload(c, &h, e->shard_id)) FU_WARN("adapter %s: %s", e->shard_id, fu_last_error());
        }
        free(sent[i]);
    }
    free(sent);
}

int gw_lora_remove(gw_lora_set *s, chain_client *c, const char *name, gw_error *err) {
    pthread_mutex_lock(&s->mu);
    gw_lora_entry *e = find(s, name);
    if (!e) {
        pthread_mutex_unlock(&s->mu);
        return gw_error_set(err, 404, "lora_name", "model_not_found", "The lora adapter '%s' cannot be found.", name);
    }
    e->removed = true;
    s->n--;
    e->refs++; /* held while its shards are told */
    char **sent = e->sent;
    int n = e->n_sent;
    e->sent = NULL, e->n_sent = e->cap_sent = 0;
    pthread_mutex_unlock(&s->mu);
    unload_sent(c, e, sent, n);
    pthread_mutex_lock(&s->mu);
    entry_unref(s, e); /* the hold */
    entry_unref(s, e); /* the set's own */
    pthread_mutex_unlock(&s->mu);
    return 0;
}

gw_lora *gw_lora_get(gw_lora_set *s, const char *name) {
    pthread_mutex_lock(&s->mu);
    gw_lora_entry *e = find(s, name);
    if (e) e->refs++;
    pthread_mutex_unlock(&s->mu);
    return e ? &e->pub : NULL;
}

void gw_lora_put(gw_lora_set *s, gw_lora *l) {
    if (!l) return;
    pthread_mutex_lock(&s->mu);
    entry_unref(s, (gw_lora_entry *)l);
    pthread_mutex_unlock(&s->mu);
}

/* Whether hop key `key` is in e's list (under s->mu); with forget, removes it. */
static bool sent_has(gw_lora_entry *e, const char *key, bool forget) {
    for (int i = 0; i < e->n_sent; i++) {
        if (strcmp(e->sent[i], key)) continue;
        if (!forget) return true;
        free(e->sent[i]);
        e->sent[i] = e->sent[--e->n_sent];
        return false;
    }
    return false;
}

/* Adds hop key `key` to e's list (under s->mu); FU_ERR_NOMEM. */
static int sent_add(gw_lora_entry *e, const char *key) {
    if (sent_has(e, key, false)) return FU_OK;
    if (e->n_sent == e->cap_sent) {
        int cap = e->cap_sent ? 2 * e->cap_sent : 8;
        char **p = realloc(e->sent, (size_t)cap * sizeof *p);
        if (!p) return fu_errorf(FU_ERR_NOMEM, "out of memory");
        e->sent = p, e->cap_sent = cap;
    }
    return (e->sent[e->n_sent] = strdup(key)) ? (e->n_sent++, FU_OK) : fu_errorf(FU_ERR_NOMEM, "out of memory");
}

int gw_lora_ensure(gw_lora_set *s, chain_client *c, gw_lora *l, const chain_hop *hops, int n, bool forget) {
    gw_lora_entry *e = (gw_lora_entry *)l;
    for (int i = 0; i < n; i++) {
        char key[512];
        hop_key(&hops[i], key, sizeof key);
        pthread_mutex_lock(&s->mu);
        bool has = sent_has(e, key, forget);
        pthread_mutex_unlock(&s->mu);
        if (has) continue;
        int rc = chain_adapter_load(c, &hops[i], e->shard_id, e->whole);
        pthread_mutex_lock(&s->mu);
        if (!rc && !e->removed) rc = sent_add(e, key);
        pthread_mutex_unlock(&s->mu);
        if (rc) return rc;
    }
    return FU_OK;
}

/* The /v1/models entry of e. */
static json_t *entry_json(const gw_lora_entry *e, const char *base_name) {
    return json_pack("{s:s, s:s, s:I, s:s, s:s}", "id", e->name, "object", "model", "created",
                     (json_int_t)e->created, "owned_by", "fusion", "parent", base_name);
}

int gw_lora_models(gw_lora_set *s, const char *base_name, json_t *data) {
    int rc = FU_OK;
    pthread_mutex_lock(&s->mu);
    for (gw_lora_entry *e = s->head; e && !rc; e = e->next)
        if (!e->removed && json_array_append_new(data, entry_json(e, base_name))) rc = FU_ERR_NOMEM;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

json_t *gw_lora_model(gw_lora_set *s, const char *base_name, const char *name) {
    pthread_mutex_lock(&s->mu);
    gw_lora_entry *e = find(s, name);
    json_t *o = e ? entry_json(e, base_name) : NULL;
    pthread_mutex_unlock(&s->mu);
    return o;
}
