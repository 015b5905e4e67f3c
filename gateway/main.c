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

static void usage(FILE *f) {
    fprintf(f,
            "usage: fusion-gateway --model PATH|ORG/NAME (--hop HOST:PORT:FIRST:LAST ... | --shard HOST:PORT ...) [options]\n"
            "  --config FILE             JSON config (keys as the long options; see config/gateway.example.json)\n"
            "  --model PATH|REPO         model for the tokenizer, chat template and context length\n"
            "  --model-name NAME         id served in /v1/models (default: the model file's name)\n"
            "  --listen HOST:PORT        (default 127.0.0.1:8080; port 0 picks one)\n"
            "  --port-file F             write the bound port to F once serving\n"
            "  --hop HOST:PORT:A:B       a shard serving blocks [A, B); in chain order (a static chain)\n"
            "  --shard HOST:PORT         a swarm member (repeatable; spans may overlap): each request is\n"
            "                            routed over the live shards, with failover; GET /v1/swarm\n"
            "  --swarm-listen HOST:PORT  host fusion.Swarm: shards started with --join register and heartbeat\n"
            "                            here; the gateway assigns spans, keeps spares, GET /v1/swarm\n"
            "  --swarm-tls-cert F --swarm-tls-key F   its TLS (default: the HTTPS pair; --insecure: loopback)\n"
            "  --swarm-port-file F       write the membership service's bound port to F\n"
            "  --spares N                spares kept waiting once every block is covered (default 1)\n"
            "  --min-gain-percent P      a surplus spare serves if that raises the max flow by P%% (default 5)\n"
            "  --rebalance-interval-ms N least time between two moves of serving members (default 30000;\n"
            "                            0: never move one)\n"
            "  --heartbeat-ms N --heartbeat-timeout-ms N   member heartbeats (default 500 / 3000)\n"
            "  --route-wait-ms N         wait for a spare loading an uncovered span (default 5000)\n"
            "  --measure-links true|false --measure-interval-ms N   RTT/bandwidth probes (true, 5000)\n"
            "  --link FROM,TO,BW,LAT     given link figures (bytes/s, s; FROM/TO: HOST:PORT or gateway)\n"
            "  --secret S | --secret-file F   swarm secret (or env FUSION_SECRET)\n"
            "  --insecure | --tls-ca F   plaintext to loopback shards, or the shards' CA\n"
            "  --forward                 server-to-server forwarding along the chain\n"
            "  --api-key K               accepted API key (repeatable; env FUSION_API_KEY, comma-separated)\n"
            "  --api-key-file F          API keys, one per line (env FUSION_API_KEY_FILE)\n"
            "  --https-cert F --https-key F   serve HTTPS\n"
            "  --workers N               concurrent generations (default 32)\n"
            "  --max-queue N             waiting generations before 429 (default 64)\n"
            "  --max-body-bytes N        request body limit (default 8 MiB)\n"
            "  --connection-timeout-s N  idle connection timeout (default 30)\n"
            "  --max-connections N       (default 1024)\n"
            "  --default-max-tokens N    max_tokens when a request gives none (default 512)\n"
            "  --step-timeout-ms N       per chain step (default 60000)\n"
            "  --max-n N --max-choices N --max-prompts N --max-stop N --max-stop-bytes N\n"
            "  --max-logit-bias N --max-top-logprobs N --max-messages N   request limits\n"
            "  --log-level debug|info|warn|error\n");
}

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

    /* the config file first, so that flags override it */
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--config") && gw_config_load(&cfg, argv[i + 1])) {
            fprintf(stderr, "fusion-gateway: %s\n", fu_last_error());
            goto done;
        }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            status = 0;
            goto done;
        }
        if (strncmp(a, "--", 2)) goto bad;
        a += 2;
        char key[64];
        const char *val = NULL;
        const char *eq = strchr(a, '=');
        size_t kl = eq ? (size_t)(eq - a) : strlen(a);
        if (kl >= sizeof key) goto bad;
        memcpy(key, a, kl);
        key[kl] = '\0';
        if (eq) val = eq + 1;
        else if (!strcmp(key, "insecure") || !strcmp(key, "forward")) val = "true";
        else if (i + 1 < argc) val = argv[++i];
        else goto bad;
        if (!strcmp(key, "config")) continue;
        if (!strcmp(key, "log-level")) {
            int lv = fu_log_level_parse(val);
            if (lv < 0) goto bad;
            fu_log_set_level((fu_log_level)lv);
            continue;
        }
        if (gw_config_set(&cfg, key, val)) {
            fprintf(stderr, "fusion-gateway: %s\n", fu_last_error());
            usage(stderr);
            status = 2;
            goto done;
        }
    }
    const char *env;
    if (!cfg.secret && (env = getenv("FUSION_SECRET"))) gw_config_set(&cfg, "secret", env);
    if ((env = getenv("FUSION_API_KEY_FILE")) && gw_config_load_keys(&cfg, env)) {
        fprintf(stderr, "fusion-gateway: %s\n", fu_last_error());
        goto done;
    }
    if ((env = getenv("FUSION_API_KEY"))) {
        char *copy = strdup(env);
        for (char *k = copy; k && *k;) {
            char *comma = strchr(k, ',');
            if (comma) *comma = '\0';
            if (*k) gw_config_set(&cfg, "api-key", k);
            k = comma ? comma + 1 : NULL;
        }
        free(copy);
    }
    if (gw_config_check(&cfg)) {
        fprintf(stderr, "fusion-gateway: %s\n", fu_last_error());
        usage(stderr);
        status = 2;
        goto done;
    }
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
bad:
    usage(stderr);
    gw_config_free(&cfg);
    return 2;
}
