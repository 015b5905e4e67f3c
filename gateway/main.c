/* main.c -- fusion-gateway: the OpenAI-compatible HTTP API over a chain of fusion-shard servers. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat-template.h"
#include "gw-gen.h"
#include "gw-http.h"
#include "gw.h"
#include "hub.h"
#include "log.h"
#include "model.h"
#include "status.h"
#include "tokenizer.h"

static volatile sig_atomic_t stop_flag;

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

int main(int argc, char **argv) {
    gw_config cfg;
    gw_config_init(&cfg);
    int status = 1;
    char *model_path = NULL;
    mdl_model *m = NULL;
    tok_tokenizer *tok = NULL;
    tpl_template *tpl = NULL;
    gw_metrics *metrics = NULL;
    gw_engine *engine = NULL;
    gw_server *server = NULL;
    char *name = NULL;

    if ((status = gw_config_args(&cfg, argc, argv)) >= 0) goto done;
    status = 1;
    if (cfg.n_api_keys == 0) FU_WARN("no API keys configured: every client is accepted");

    hub_options ho;
    hub_options_init(&ho);
    if (hub_resolve(cfg.model, &ho, &model_path) || load_model_info(model_path, &m, &tok, &tpl)) {
        fprintf(stderr, "fusion-gateway: %s: %s\n", cfg.model, fu_last_error());
        goto done;
    }
    if (cfg.n_hops && cfg.hops[cfg.n_hops - 1].last != m->cfg.n_layers) {
        fprintf(stderr, "fusion-gateway: the chain ends at block %d but the model has %d blocks\n",
                cfg.hops[cfg.n_hops - 1].last, m->cfg.n_layers);
        goto done;
    }
    if (cfg.model_name) name = strdup(cfg.model_name);
    else {
        const char *base = strrchr(model_path, '/');
        base = base && base[1] ? base + 1 : model_path;
        name = strdup(base);
        char *dot = strrchr(name, '.');
        if (dot && !strcmp(dot, ".gguf")) *dot = '\0';
    }
    /* token ids are checked against the model's vocabulary (the LM head's rows) */
    gw_model model = {tok, tpl, name, m->cfg.vocab_size, m->cfg.max_seq_len, m->cfg.n_layers,
                      gw_tool_format_detect(tok_chat_template(tok))};
    cfg.hidden_size = m->cfg.dim; /* what a token costs on the wire between servers */

    signal(SIGPIPE, SIG_IGN);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL); /* every thread inherits the mask; main waits for them */

    int port = 0;
    if (gw_metrics_new(&metrics) || gw_engine_new(&cfg, &model, metrics, &engine) ||
        gw_server_start(&cfg, &model, engine, metrics, &server, &port)) {
        fprintf(stderr, "fusion-gateway: %s\n", fu_last_error());
        goto done;
    }
    FU_INFO("serving %s on %s (port %d), %d hops, %d swarm shards%s%s, %d workers, %d API keys", name,
            cfg.listen ? cfg.listen : "127.0.0.1:8080", port, cfg.n_hops, cfg.n_shards,
            cfg.swarm_listen ? ", members join at " : "", cfg.swarm_listen ? cfg.swarm_listen : "", cfg.workers,
            cfg.n_api_keys);
    if (cfg.port_file) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", cfg.port_file);
        FILE *f = fopen(tmp, "w");
        if (!f || fprintf(f, "%d\n", port) < 0 || fclose(f) || rename(tmp, cfg.port_file)) {
            fprintf(stderr, "fusion-gateway: cannot write %s\n", cfg.port_file);
            goto done;
        }
    }
    int sig = 0;
    sigwait(&set, &sig);
    FU_INFO("signal %d: shutting down", sig);
    status = 0;
done:
    gw_server_stop(server);
    gw_engine_free(engine);
    gw_metrics_free(metrics);
    tpl_free(tpl);
    tok_free(tok);
    mdl_free(m);
    free(model_path);
    free(name);
    gw_config_free(&cfg);
    return status;
}
