/* main.c -- fusion-gateway: the OpenAI-compatible HTTP API over a chain of fusion-shard servers. */
#include <ctype.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "chat-template.h"
#include "gw-gen.h"
#include "gw-http.h"
#include "gw.h"
#include "hub.h"
#include "log.h"
#include "model.h"
#include "status.h"
#include "tokenizer.h"

/* Loads the tokenizer: the GGUF metadata, or tokenizer.json in the model directory. */
static int load_model_info(const char *path, mdl_model **m, tok_tokenizer **tok, tpl_template **tpl) {
    mdl_open_options mo = {.first = 0, .last = 0, .embed = false, .head = false};
    int rc = mdl_open(path, &mo, m);
    if (rc) return rc;
    gguf_file *gf = mdl_gguf(*m);
    rc = gf ? tok_load_gguf(gf, tok) : tok_load_hf(path, tok);
    if (rc) return rc;
    const char *src = tok_chat_template(*tok);
    if (src && (rc = tpl_compile(src, tpl))) {
        FU_WARN("the chat template does not compile (%s): /v1/chat/completions is disabled", fu_last_error());
        *tpl = NULL;
    }
    return FU_OK;
}

/* The model the gateway serves: gw_model borrows its tokenizer, template and name. */
typedef struct gw_loaded {
    char *path;          /* the resolved model path */
    char *name;          /* the id served in /v1/models */
    mdl_model *m;        /* the model's metadata (no blocks loaded) */
    tok_tokenizer *tok;
    tpl_template *tpl;   /* NULL: no chat template that compiles */
} gw_loaded;

/* Loads cfg->model's metadata and tokenizer, checks that a static chain ends at its last
 * block, and names it: --model-name, else the file's name without ".gguf". Says why on stderr. */
/* Whether tag names a GGUF quantization or float type (Q4_1, q8_0, Q4_K_M, IQ2_XS, F16, BF16). */
static bool gw_quant_tag(const char *t) {
    if ((t[0] == 'Q' || t[0] == 'q') && isdigit((unsigned char)t[1])) return true;
    if ((t[0] == 'I' || t[0] == 'i') && (t[1] == 'Q' || t[1] == 'q') && isdigit((unsigned char)t[2])) return true;
    return !strcasecmp(t, "F16") || !strcasecmp(t, "F32") || !strcasecmp(t, "BF16");
}

/* The id a model file is served as without --model-name: its name without ".gguf" and without a
 * trailing quantization tag ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"), so that
 * the id names the model whatever its file's precision. malloc'd; NULL when out of memory. */
static char *gw_default_name(const char *path) {
    const char *base = strrchr(path, '/');
    char *name = strdup(base && base[1] ? base + 1 : path);
    char *dot = name ? strrchr(name, '.') : NULL;
    if (dot && !strcmp(dot, ".gguf")) *dot = '\0';
    char *sep = name ? name + strlen(name) : NULL;
    while (sep && sep > name && sep[-1] != '.' && sep[-1] != '-') sep--;
    if (sep && sep - 1 > name && gw_quant_tag(sep)) sep[-1] = '\0';
    return name;
}

static int gw_load(const gw_config *cfg, gw_loaded *l) {
    hub_options ho;
    hub_options_init(&ho);
    if (hub_resolve(cfg->model, &ho, &l->path) || load_model_info(l->path, &l->m, &l->tok, &l->tpl)) {
        fprintf(stderr, "fusion-gateway: %s: %s\n", cfg->model, fu_last_error());
        return FU_ERR_INVALID;
    }
    if (cfg->n_hops && cfg->hops[cfg->n_hops - 1].last != l->m->cfg.n_layers) {
        fprintf(stderr, "fusion-gateway: the chain ends at block %d but the model has %d blocks\n",
                cfg->hops[cfg->n_hops - 1].last, l->m->cfg.n_layers);
        return FU_ERR_INVALID;
    }
    l->name = cfg->model_name ? strdup(cfg->model_name) : gw_default_name(l->path);
    return l->name ? FU_OK : fu_errorf(FU_ERR_NOMEM, "name");
}

static void gw_loaded_free(gw_loaded *l) {
    tpl_free(l->tpl);
    tok_free(l->tok);
    mdl_free(l->m);
    free(l->path);
    free(l->name);
}

/* Writes port to path atomically (path.tmp, then a rename). */
static int write_port_file(const char *path, int port) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%d\n", port) < 0 || fclose(f) || rename(tmp, path))
        return fu_errorf(FU_ERR_IO, "cannot write %s", path);
    return FU_OK;
}

/* The adapter set with every --lora NAME=DIR loaded. */
static int gw_loras_open(const gw_config *cfg, const gw_loaded *l, gw_lora_set **out) {
    gw_lora_options lo = {&l->m->cfg, cfg->lora_dir, cfg->max_lora_rank, cfg->max_loras};
    int rc = gw_lora_set_new(&lo, out);
    for (size_t i = 0; !rc && i < cfg->loras.n; i++) {
        char *spec = cfg->loras.items[i], *eq = strchr(spec, '=');
        gw_error err;
        if (!eq) return fu_errorf(FU_ERR_INVALID, "--lora %s: expected NAME=DIR", spec);
        *eq = '\0';
        if (gw_lora_add(*out, spec, eq + 1, l->name, false, &err)) rc = fu_errorf(FU_ERR_INVALID, "--lora %s: %s", spec, err.message);
        *eq = '=';
    }
    return rc;
}

/* Serves the OpenAI API over the shards until SIGINT or SIGTERM; the exit status. */
static int serve(gw_config *cfg, const gw_loaded *l) {
    const mdl_config *mc = &l->m->cfg;
    /* token ids are checked against the model's vocabulary (the LM head's rows) */
    gw_model model = {l->tok, l->tpl, l->name, mc->vocab_size, mc->max_seq_len, mc->n_layers,
                      gw_tool_format_detect(tok_chat_template(l->tok)), NULL, mc};
    cfg->hidden_size = mc->dim; /* what a token costs on the wire between servers */
    signal(SIGPIPE, SIG_IGN);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL); /* every thread inherits the mask; main waits for them */
    gw_metrics *metrics = NULL;
    gw_engine *engine = NULL;
    gw_server *server = NULL;
    int port = 0, sig = 0;
    int rc = gw_loras_open(cfg, l, &model.loras);
    if (!rc) rc = gw_metrics_new(&metrics);
    if (!rc) rc = gw_engine_new(cfg, &model, metrics, &engine);
    if (!rc) rc = gw_server_start(cfg, &model, engine, metrics, &server, &port);
    if (!rc)
        FU_INFO("serving %s on %s (port %d), %d hops, %d swarm shards%s%s, %d workers, %d API keys", l->name,
                cfg->listen ? cfg->listen : "127.0.0.1:8080", port, cfg->n_hops, cfg->n_shards,
                cfg->swarm_listen ? ", members join at " : "", cfg->swarm_listen ? cfg->swarm_listen : "",
                cfg->workers, cfg->n_api_keys);
    if (!rc && cfg->port_file) rc = write_port_file(cfg->port_file, port);
    if (!rc && cfg->metrics_port_file) rc = write_port_file(cfg->metrics_port_file, gw_server_metrics_port(server));
    if (rc) {
        fprintf(stderr, "fusion-gateway: %s\n", fu_last_error());
    } else {
        sigwait(&set, &sig);
        FU_INFO("signal %d: shutting down", sig);
    }
    gw_server_stop(server);
    gw_engine_free(engine);
    gw_metrics_free(metrics);
    gw_lora_set_free(model.loras);
    return rc ? 1 : 0;
}

/* Large blocks (a long prompt's tokens, an echo + logprobs body) are mapped and unmapped on
 * their own, so that the memory of a burst of big requests goes back to the system instead of
 * staying in the heap (glibc would raise its mapping threshold after the first such free); free
 * memory above 1 MiB at a heap's top is returned; and the worker threads share 4 heaps, not one
 * each up to 8 per core, each of which would keep its own free memory. */
static void gw_malloc_tune(void) {
#ifdef __GLIBC__
    mallopt(M_MMAP_THRESHOLD, 256 * 1024);
    mallopt(M_TRIM_THRESHOLD, 1024 * 1024);
    mallopt(M_ARENA_MAX, 4);
#endif
}

int main(int argc, char **argv) {
    gw_malloc_tune();
    gw_config cfg;
    gw_config_init(&cfg);
    gw_loaded loaded = {0};
    int status = gw_config_args(&cfg, argc, argv);
    if (status < 0 && gw_listen_check(&cfg)) {
        fprintf(stderr, "fusion-gateway: %s\n", fu_last_error());
        status = 2;
    }
    if (status < 0 && cfg.no_auth) FU_WARN("--no-auth: no API key is asked of anyone who can connect");
    else if (status < 0 && cfg.n_api_keys == 0) FU_WARN("no API keys configured: every local client is accepted");
    if (status < 0) status = gw_load(&cfg, &loaded) ? 1 : serve(&cfg, &loaded);
    gw_loaded_free(&loaded);
    gw_config_free(&cfg);
    return status;
}
