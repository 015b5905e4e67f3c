/* fusion-models.c -- the model cache for `fusion`: `fusion pull`, `fusion ls`, and naming a model.
 *
 * The cache (fz_cache_dir) holds models/ (single GGUF files, as scripts/fetch-default-model.sh
 * and `fusion pull FILE` put them) and hub/ (Hugging Face snapshots, formats/hub.h). `fusion pull`
 * reuses hub_resolve() with a progress bar; a local GGUF file is copied in with the same bar.
 * Threading: one thread. Ownership: returned paths are malloc'd and the caller's.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "clock.h"
#include "format.h"
#include "fusion-cli.h"
#include "options.h"
#include "status.h"

int fz_cache_dir(char **out) {
    const char *root = getenv("FUSION_CACHE"), *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    fu_buf b = {0};
    int rc;
    if (root && root[0]) rc = fu_buf_appendf(&b, "%s", root);
    else if (xdg && xdg[0]) rc = fu_buf_appendf(&b, "%s/fusion", xdg);
    else if (home && home[0]) rc = fu_buf_appendf(&b, "%s/.cache/fusion", home);
    else return fu_errorf(FU_ERR_INVALID, "no cache directory: set FUSION_CACHE or HOME");
    if (rc) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    *out = b.data;
    return FU_OK;
}

/* "<cache>/models/<name><ext>" into *out when that file exists. */
static int fz_cached_file(const char *name, const char *ext, char **out) {
    char *cache = NULL;
    fu_buf b = {0};
    struct stat st;
    int rc = fz_cache_dir(&cache);
    if (!rc && fu_buf_appendf(&b, "%s/models/%s%s", cache, name, ext)) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    free(cache);
    if (!rc && (stat(b.data, &st) || !S_ISREG(st.st_mode))) rc = FU_ERR_NOT_FOUND;
    if (rc) fu_buf_free(&b);
    else *out = b.data;
    return rc;
}

/* hub_resolve() with the pull progress bar on stderr. */
static int fz_hub_fetch(const char *repo, char **out) {
    hub_options o;
    hub_options_init(&o);
    int tty = isatty(STDERR_FILENO);
    o.progress = fz_pull_progress;
    o.progress_user = &tty;
    o.progress_interval_ms = tty ? 200 : 2000;
    return hub_resolve(repo, &o, out);
}

int fz_model_resolve(const char *name, char **out) {
    struct stat st;
    *out = NULL;
    if (!name) {
        if (!fz_cached_file(FZ_DEFAULT_MODEL_FILE, "", out)) return FU_OK;
        return fu_errorf(FU_ERR_NOT_FOUND, "the default model %s is not in the cache: run "
                         "scripts/fetch-default-model.sh, or name a model (fusion ls)", FZ_DEFAULT_MODEL_FILE);
    }
    if (!stat(name, &st)) return (*out = strdup(name)) ? FU_OK : fu_errorf(FU_ERR_NOMEM, "out of memory");
    if (!strchr(name, '/') && (!fz_cached_file(name, "", out) || !fz_cached_file(name, ".gguf", out))) return FU_OK;
    if (hub_is_repo_name(name)) {
        int rc = fz_hub_fetch(name, out);
        return rc ? fu_errorf(rc, "model %s: %s", name, fu_last_error()) : FU_OK;
    }
    return fu_errorf(FU_ERR_NOT_FOUND, "model '%s' not found: not a file, a cached model (fusion ls) or a hub repo id",
                     name);
}

/* "1m02s" or "12s" into out. */
static void fz_format_eta(double s, char *out, size_t cap) {
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(out, cap, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else if (t >= 60) snprintf(out, cap, "%ldm%02lds", t / 60, t % 60);
    else snprintf(out, cap, "%lds", t);
}

void fz_pull_progress(const hub_progress *p, void *user) {
    int tty = *(const int *)user;
    char done[32], total[32] = "?", rate[32] = "", eta[32] = "", bar[32] = "";
    fu_format_bytes((double)p->done, done, sizeof done);
    if (p->total > 0) {
        fu_format_bytes((double)p->total, total, sizeof total);
        int fill = (int)(20.0 * (double)p->done / (double)p->total);
        for (int i = 0; i < 20; i++) bar[i] = i < fill ? '#' : '-';
        bar[20] = '\0';
    }
    if (p->rate > 0) {
        fu_format_bytes(p->rate, rate, sizeof rate);
        strcat(rate, "/s");
    }
    if (p->rate > 0 && p->total > p->done && !p->finished) {
        char t[24];
        fz_format_eta((double)(p->total - p->done) / p->rate, t, sizeof t);
        snprintf(eta, sizeof eta, "  ETA %s", t);
    }
    fprintf(stderr, "%s[%d/%d] %s  [%s]  %s / %s  %s%s%s%s", tty ? "\r\033[K" : "", p->file_index + 1, p->n_files,
            p->path, bar, done, total, rate, eta, p->finished ? (p->status == FU_OK ? "  done" : "  failed") : "",
            tty && !p->finished ? "" : "\n");
    fflush(stderr);
}

/* Copies src to dst (through dst.incomplete and a rename) with the progress bar. */
static int fz_copy_file(const char *src, const char *dst, int64_t size) {
    char tmp[4096], buf[1 << 16];
    snprintf(tmp, sizeof tmp, "%s.incomplete", dst);
    FILE *in = fopen(src, "rb"), *out = in ? fopen(tmp, "wb") : NULL;
    int tty = isatty(STDERR_FILENO), rc = in && out ? FU_OK : fu_errorf(FU_ERR_IO, "%s: %s", in ? tmp : src,
                                                                         strerror(errno));
    hub_progress p = {.path = strrchr(src, '/') ? strrchr(src, '/') + 1 : src, .n_files = 1, .total = size};
    double t0 = fu_now_s(), shown = 0;
    for (size_t n; !rc && (n = fread(buf, 1, sizeof buf, in)) > 0;) {
        if (fwrite(buf, 1, n, out) != n) rc = fu_errorf(FU_ERR_IO, "%s: %s", tmp, strerror(errno));
        p.done += (int64_t)n;
        p.rate = (double)p.done / (fu_now_s() - t0 + 1e-9);
        if (fu_now_s() - shown > (tty ? 0.2 : 2.0)) fz_pull_progress(&p, &tty), shown = fu_now_s();
        if (fz_interrupted) rc = fu_errorf(FU_ERR_CANCELLED, "interrupted");
    }
    if (in) fclose(in);
    if (out && fclose(out) && !rc) rc = fu_errorf(FU_ERR_IO, "%s: %s", tmp, strerror(errno));
    if (!rc && rename(tmp, dst)) rc = fu_errorf(FU_ERR_IO, "%s: %s", dst, strerror(errno));
    if (rc && out) unlink(tmp);
    p.finished = 1, p.status = rc;
    fz_pull_progress(&p, &tty);
    return rc;
}

/* `fusion pull FILE.gguf`: copies a local GGUF file into <cache>/models/; its path into *out. */
static int fz_pull_file(const char *path, char **out) {
    struct stat st;
    char *cache = NULL;
    fu_buf dst = {0};
    if (stat(path, &st)) return fu_errorf(FU_ERR_NOT_FOUND, "%s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return fu_errorf(FU_ERR_INVALID, "%s is not a file: a model directory is used where it is "
                         "(fusion serve %s)", path, path);
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    int rc = fz_cache_dir(&cache);
    if (!rc && fu_buf_appendf(&dst, "%s/models", cache)) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    if (!rc && mkdir(cache, 0755) && errno != EEXIST) rc = fu_errorf(FU_ERR_IO, "%s: %s", cache, strerror(errno));
    if (!rc && mkdir(dst.data, 0755) && errno != EEXIST) rc = fu_errorf(FU_ERR_IO, "%s: %s", dst.data, strerror(errno));
    if (!rc && fu_buf_appendf(&dst, "/%s", base)) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    if (!rc) rc = fz_copy_file(path, dst.data, (int64_t)st.st_size);
    free(cache);
    if (rc) fu_buf_free(&dst);
    *out = dst.data;
    return rc;
}

static const fu_opt fz_pull_options[] = {FU_OPT_END};

static const fu_opt_spec fz_pull_spec = {
    "fusion pull", "usage: fusion pull REPO_ID[@REVISION] | FILE.gguf\n"
                   "Downloads a Hugging Face model (safetensors, or a GGUF file) into the model cache,\n"
                   "or copies a local GGUF file into it, with a progress bar (bytes, rate, ETA), then\n"
                   "prints the model's local path. `fusion serve NAME` takes what `fusion ls` lists.\n",
    fz_pull_options,
    "\nExit status: 0 pulled (or already cached); 1 an error; 2 a usage error.\n"
    "Environment: FUSION_CACHE (the cache root), HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE.\n"};

int fz_pull_main(int argc, char **argv) {
    int n = 0, status = fu_opt_main(&fz_pull_spec, argc, argv, &n);
    if (status >= 0) return status;
    if (n != 1) return fu_opt_fail(&fz_pull_spec, "give one model: a hub repo id or a GGUF file");
    fz_signals_catch();
    char *path = NULL;
    struct stat st;
    int rc = !stat(argv[1], &st) ? fz_pull_file(argv[1], &path)
             : hub_is_repo_name(argv[1]) ? fz_hub_fetch(argv[1], &path)
                                         : fu_errorf(FU_ERR_NOT_FOUND, "%s: no such file, and not a hub repo id "
                                                     "(org/name[@revision])", argv[1]);
    if (rc) fprintf(stderr, "fusion pull: %s\n", fu_last_error());
    else printf("%s\n", path);
    free(path);
    return rc ? (fz_interrupted ? FZ_EXIT_INTERRUPTED : FZ_EXIT_FAIL) : FZ_EXIT_OK;
}

/* ---- fusion ls ---------------------------------------------------------------------------- */

/* The bytes of the regular files under dir (following links), recursively. */
static int64_t fz_dir_bytes(const char *dir) {
    DIR *d = opendir(dir);
    int64_t sum = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[4096];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (stat(path, &st)) continue;
        if (S_ISDIR(st.st_mode)) sum += fz_dir_bytes(path);
        else if (S_ISREG(st.st_mode)) sum += (int64_t)st.st_size;
    }
    if (d) closedir(d);
    return sum;
}

static void fz_ls_row(const char *name, int64_t bytes, const char *where) {
    char size[32];
    fu_format_bytes((double)bytes, size, sizeof size);
    printf("%-48s %10s  %s\n", name, size, where);
}

/* Calls fn(dir, name) for each entry of <cache>/<sub> not starting with '.'; the rows fn showed. */
static int fz_ls_each(const char *cache, const char *sub, int (*fn)(const char *dir, const char *name)) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", cache, sub);
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.') n += fn(dir, e->d_name);
    if (d) closedir(d);
    return n;
}

/* A GGUF file of models/, named without ".gguf"; 1 when shown. */
static int fz_ls_file(const char *dir, const char *entry) {
    char path[4096 + 256], name[256];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, entry);
    if (stat(path, &st) || !S_ISREG(st.st_mode) || strstr(entry, ".incomplete")) return 0;
    snprintf(name, sizeof name, "%s", entry);
    size_t len = strlen(name);
    if (len > 5 && !strcmp(name + len - 5, ".gguf")) name[len - 5] = '\0';
    fz_ls_row(name, (int64_t)st.st_size, path);
    return 1;
}

/* A repo of hub/ ("org--name" shown as "org/name") with its snapshots' size; 1 when shown. */
static int fz_ls_repo(const char *dir, const char *entry) {
    char snaps[4096 + 512], name[256], *sep;
    snprintf(snaps, sizeof snaps, "%s/%s/snapshots", dir, entry);
    snprintf(name, sizeof name, "%s", entry);
    if (!(sep = strstr(name, "--")) || access(snaps, R_OK)) return 0;
    memmove(sep + 1, sep + 2, strlen(sep + 2) + 1);
    *sep = '/';
    fz_ls_row(name, fz_dir_bytes(snaps), snaps);
    return 1;
}

static const fu_opt_spec fz_ls_spec = {
    "fusion ls", "usage: fusion ls\n"
                 "Lists the models in the cache with their sizes: GGUF files in models/ and\n"
                 "Hugging Face snapshots in hub/. `fusion serve NAME` takes a name shown here.\n",
    fz_pull_options, "\nExit status: 0; 1 when the cache cannot be found; 2 a usage error.\n"
                     "Environment: FUSION_CACHE (default $XDG_CACHE_HOME/fusion, else ~/.cache/fusion).\n"};

int fz_ls_main(int argc, char **argv) {
    int n = 0, status = fu_opt_main(&fz_ls_spec, argc, argv, &n);
    if (status >= 0) return status;
    if (n) return fu_opt_fail(&fz_ls_spec, "no arguments expected");
    char *cache = NULL;
    if (fz_cache_dir(&cache)) {
        fprintf(stderr, "fusion ls: %s\n", fu_last_error());
        return FZ_EXIT_FAIL;
    }
    printf("%-48s %10s  %s\n", "NAME", "SIZE", "PATH");
    int found = fz_ls_each(cache, "models", fz_ls_file) + fz_ls_each(cache, "hub", fz_ls_repo);
    if (!found) fprintf(stderr, "fusion ls: no models in %s (fusion pull REPO)\n", cache);
    free(cache);
    return FZ_EXIT_OK;
}
