/* fetch.c -- fusion-fetch: download a model from the Hugging Face hub into the cache, print its directory. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "format.h"
#include "hub.h"
#include "log.h"
#include "status.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: fusion-fetch [options] [--] REPO_ID[@REVISION]\n"
            "Downloads what a model needs from the Hugging Face hub (config, tokenizer,\n"
            "safetensors weights; or one GGUF file) into the cache and prints the local\n"
            "directory. A name that is an existing path is printed as is.\n"
            "\n"
            "  --file F            also fetch repo file F (repeatable); naming a .gguf\n"
            "                      fetches that GGUF model instead of safetensors\n"
            "  --cache-dir DIR     cache root (default $FUSION_CACHE/hub, else\n"
            "                      $XDG_CACHE_HOME/fusion/hub or ~/.cache/fusion/hub)\n"
            "  --endpoint URL      hub endpoint (default $HF_ENDPOINT, else https://huggingface.co)\n"
            "  --offline           use the cache only (also HF_HUB_OFFLINE=1)\n"
            "  --retries N         retries of transient failures (default 5)\n"
            "  --retry-delay MS    first retry delay, doubled each time (default 1000)\n"
            "  --connect-timeout S connection timeout in seconds (default 15)\n"
            "  --low-speed-time S  abort a transfer slower than 1 KiB/s for S seconds (default 60)\n"
            "  --verify            re-check the sha256 of cached files before trusting them\n"
            "  -q, --quiet         no progress output\n"
            "  -h, --help          this text\n"
            "\n"
            "Environment: HF_TOKEN (sent as a bearer token to the endpoint only),\n"
            "HF_ENDPOINT, HF_HUB_OFFLINE, FUSION_CACHE, FUSION_LOG.\n");
}

/* Parses a non-negative long; 0 on success. */
static int parse_long(const char *s, long max, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < 0 || v > max) return -1;
    *out = v;
    return 0;
}

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

int main(int argc, char **argv) {
    hub_options o;
    hub_options_init(&o);
    const char **files = NULL;
    size_t n_files = 0;
    const char *name = NULL;
    int tty = isatty(STDERR_FILENO);
    int options_done = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!options_done && strcmp(a, "--") == 0) {
            options_done = 1;
            continue;
        }
        if (options_done || a[0] != '-' || a[1] == '\0') {
            if (name) {
                fprintf(stderr, "fusion-fetch: more than one model name ('%s', '%s')\n", name, a);
                free(files);
                return 2;
            }
            name = a;
            continue;
        }
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        long v = 0;
        int takes = strcmp(a, "--file") == 0 || strcmp(a, "--cache-dir") == 0 || strcmp(a, "--endpoint") == 0 ||
                    strcmp(a, "--retries") == 0 || strcmp(a, "--retry-delay") == 0 ||
                    strcmp(a, "--connect-timeout") == 0 || strcmp(a, "--low-speed-time") == 0;
        if (takes && !val) {
            fprintf(stderr, "fusion-fetch: %s needs a value\n", a);
            free(files);
            return 2;
        }
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            free(files);
            return 0;
        } else if (strcmp(a, "-q") == 0 || strcmp(a, "--quiet") == 0) {
            o.quiet = 1;
        } else if (strcmp(a, "--offline") == 0) {
            o.offline = 1;
        } else if (strcmp(a, "--verify") == 0) {
            o.verify_existing = 1;
        } else if (strcmp(a, "--file") == 0) {
            const char **grown = realloc(files, (n_files + 1) * sizeof *grown);
            if (!grown) {
                fprintf(stderr, "fusion-fetch: out of memory\n");
                free(files);
                return 1;
            }
            files = grown;
            files[n_files++] = val;
            i++;
        } else if (strcmp(a, "--cache-dir") == 0) {
            o.cache_dir = val;
            i++;
        } else if (strcmp(a, "--endpoint") == 0) {
            o.endpoint = val;
            i++;
        } else if (takes) {
            long max = strcmp(a, "--retries") == 0 ? 100 : strcmp(a, "--retry-delay") == 0 ? 600000 : 86400;
            if (parse_long(val, max, &v) != 0 || (v == 0 && strcmp(a, "--retries") != 0 &&
                                                  strcmp(a, "--retry-delay") != 0)) {
                fprintf(stderr, "fusion-fetch: bad value '%s' for %s\n", val, a);
                free(files);
                return 2;
            }
            if (strcmp(a, "--retries") == 0) o.max_retries = (int)v;
            else if (strcmp(a, "--retry-delay") == 0) o.retry_base_ms = (int)v;
            else if (strcmp(a, "--connect-timeout") == 0) o.connect_timeout_s = v;
            else o.low_speed_time_s = v;
            i++;
        } else {
            fprintf(stderr, "fusion-fetch: unknown option %s\n", a);
            usage(stderr);
            free(files);
            return 2;
        }
    }
    if (!name) {
        usage(stderr);
        free(files);
        return 2;
    }
    o.files = files;
    o.n_files = n_files;
    if (o.quiet) {
        if (fu_log_threshold < FU_LOG_LEVEL_WARN) fu_log_set_level(FU_LOG_LEVEL_WARN);
    } else {
        o.progress = print_progress;
        o.progress_user = &tty;
        o.progress_interval_ms = tty ? 200 : 2000;
    }
    char *dir = NULL;
    int rc = hub_resolve(name, &o, &dir);
    free(files);
    if (rc != FU_OK) {
        fprintf(stderr, "fusion-fetch: %s: %s\n", fu_status_str(rc), fu_last_error());
        return 1;
    }
    printf("%s\n", dir);
    free(dir);
    return fflush(stdout) == 0 ? 0 : 1;
}
