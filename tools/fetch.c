/* fetch.c -- fusion-fetch: download a model from the Hugging Face hub into the cache, print its directory. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "format.h"
#include "hub.h"
#include "log.h"
#include "options.h"
#include "status.h"

/* What the command line gives beside hub_options' own fields. */
typedef struct fetch_args {
    hub_options o;
    fu_opt_list files;
    char *cache_dir, *endpoint;
} fetch_args;

static fetch_args args;

static const fu_opt fetch_options[] = {
    {"file", 0, FU_OPT_LIST, FU_OPT_TO(args.files), "F",
     "also fetch repo file F (repeatable); naming a .gguf\nfetches that GGUF model instead of safetensors"},
    {"cache-dir", 0, FU_OPT_STRING, FU_OPT_TO(args.cache_dir), "DIR",
     "cache root (default $FUSION_CACHE/hub, else\n$XDG_CACHE_HOME/fusion/hub or ~/.cache/fusion/hub)"},
    {"endpoint", 0, FU_OPT_STRING, FU_OPT_TO(args.endpoint), "URL",
     "hub endpoint (default $HF_ENDPOINT, else https://huggingface.co)"},
    {"offline", 0, FU_OPT_FLAG, FU_OPT_TO(args.o.offline), .help = "use the cache only (also HF_HUB_OFFLINE=1)"},
    {"retries", 0, FU_OPT_INT, FU_OPT_TO(args.o.max_retries),
     .help = "retries of transient failures (default 5)", .lo = 0, .hi = 100},
    {"retry-delay", 0, FU_OPT_INT, FU_OPT_TO(args.o.retry_base_ms), "MS",
     "first retry delay, doubled each time (default 1000)", .lo = 0, .hi = 600000},
    {"connect-timeout", 0, FU_OPT_INT, FU_OPT_TO(args.o.connect_timeout_s), "S",
     "connection timeout in seconds (default 15)", .lo = 1, .hi = 86400},
    {"low-speed-time", 0, FU_OPT_INT, FU_OPT_TO(args.o.low_speed_time_s), "S",
     "abort a transfer slower than 1 KiB/s for S seconds (default 60)", .lo = 1, .hi = 86400},
    {"verify", 0, FU_OPT_FLAG, FU_OPT_TO(args.o.verify_existing),
     .help = "re-check the sha256 of cached files before trusting them"},
    {"quiet", 'q', FU_OPT_FLAG, FU_OPT_TO(args.o.quiet), .help = "no progress output"},
    FU_OPT_END,
};

static const fu_opt_spec fetch_spec = {
    "fusion-fetch",
    "usage: fusion-fetch [options] [--] REPO_ID[@REVISION]\n"
    "Downloads what a model needs from the Hugging Face hub (config, tokenizer,\n"
    "safetensors weights; or one GGUF file) into the cache and prints the local\n"
    "directory. A name that is an existing path is printed as is.\n",
    fetch_options,
    "\n"
    "Environment: HF_TOKEN (sent as a bearer token to the endpoint only),\n"
    "HF_ENDPOINT, HF_HUB_OFFLINE, FUSION_CACHE, FUSION_LOG.\n"};

/* Progress on stderr: one redrawn line on a terminal, plain lines otherwise. */
static void print_progress(const hub_progress *p, void *user) {
    int tty = *(const int *)user;
    char done[32], total[32], rate[32], pct[16] = "";
    fu_format_bytes((double)p->done, done, sizeof done);
    fu_format_bytes(p->rate, rate, sizeof rate);
    if (p->total >= 0) {
        fu_format_bytes((double)p->total, total, sizeof total);
        if (p->total > 0) snprintf(pct, sizeof pct, " %3d%%", (int)(100.0 * (double)p->done / (double)p->total));
    } else {
        snprintf(total, sizeof total, "?");
    }
    fprintf(stderr, "%s[%d/%d] %s  %s / %s%s%s%s%s%s%s", tty ? "\r\033[K" : "", p->file_index + 1, p->n_files,
            p->path, done, total, pct, p->rate > 0 ? "  " : "", p->rate > 0 ? rate : "", p->rate > 0 ? "/s" : "",
            p->finished ? (p->status == FU_OK ? "  done" : "  failed") : "",
            tty && !p->finished ? "" : "\n");
    fflush(stderr);
}

/* Fetches `name` into the cache and prints its directory; the exit status. */
static int fetch(fetch_args *a, const char *name) {
    hub_options *o = &a->o;
    int tty = isatty(STDERR_FILENO);
    o->files = (const char *const *)a->files.items;
    o->n_files = a->files.n;
    o->cache_dir = a->cache_dir;
    o->endpoint = a->endpoint;
    if (o->quiet) {
        if (fu_log_threshold < FU_LOG_LEVEL_WARN) fu_log_set_level(FU_LOG_LEVEL_WARN);
    } else {
        o->progress = print_progress;
        o->progress_user = &tty;
        o->progress_interval_ms = tty ? 200 : 2000;
    }
    char *dir = NULL;
    int rc = hub_resolve(name, o, &dir);
    if (rc != FU_OK) {
        fprintf(stderr, "fusion-fetch: %s: %s\n", fu_status_str(rc), fu_last_error());
        return 1;
    }
    printf("%s\n", dir);
    free(dir);
    return fflush(stdout) == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    hub_options_init(&args.o);
    int n_names = 0;
    int status = fu_opt_main(&fetch_spec, argc, argv, &n_names);
    if (status < 0 && n_names > 1) {
        fprintf(stderr, "fusion-fetch: more than one model name ('%s', '%s')\n", argv[1], argv[2]);
        status = 2;
    }
    if (status < 0 && n_names == 0) status = fu_opt_fail(&fetch_spec, "no model name");
    if (status < 0) status = fetch(&args, argv[1]);
    fu_opt_free(fetch_options);
    return status;
}
