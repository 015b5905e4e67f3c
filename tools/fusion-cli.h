/* fusion-cli.h -- the parts of the `fusion` command (tools/fusion.c) that its subcommands share.
 *
 * `fusion` is one program with subcommands (serve, join, chat, pull, ls, status); each lives in a
 * tools/fusion-*.c file compiled into it (CMakeLists.txt keeps them out of the one-program-per-file
 * glob). Prefix: fz_.
 *
 * Threading: one thread; signal handlers only set fz_interrupted.
 * Ownership: functions returning char * hand a malloc'd string to the caller; an fz_http owns its
 * curl handle and strings. Errors: FU_OK or a status with fu_last_error() saying why in one line.
 */
#ifndef FZ_CLI_H
#define FZ_CLI_H

#include <jansson.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "buf.h"
#include "hub.h"

#define FZ_DEFAULT_URL "http://127.0.0.1:8080"
#define FZ_DEFAULT_MODEL_FILE "SmolLM2-135M-Instruct.Q4_1.gguf"

/* Exit statuses shared by the subcommands (each subcommand's --help lists its own). */
enum {
    FZ_EXIT_OK = 0,
    FZ_EXIT_FAIL = 1,        /* an error, said in one line on stderr */
    FZ_EXIT_USAGE = 2,       /* a bad command line */
    FZ_EXIT_CHILD = 3,       /* serve/join: a child process died while serving */
    FZ_EXIT_INTERRUPTED = 130,
};

/* Set by SIGINT/SIGTERM once fz_signals_catch() ran; cleared by whoever handles it. */
extern volatile sig_atomic_t fz_interrupted;
/* The signal that set fz_interrupted last (SIGINT or SIGTERM). */
extern volatile sig_atomic_t fz_signal;

/* Installs handlers for SIGINT and SIGTERM that set fz_interrupted (no SA_RESTART, so blocking
 * reads return EINTR). */
void fz_signals_catch(void);

/* ---- subcommands (argv[0] is the subcommand's name) ---- */
int fz_serve_main(int argc, char **argv);
int fz_join_main(int argc, char **argv);
int fz_chat_main(int argc, char **argv);
int fz_pull_main(int argc, char **argv);
int fz_ls_main(int argc, char **argv);
int fz_status_main(int argc, char **argv);

/* ---- the model cache (fusion-models.c) ---- */

/* The cache's root: $FUSION_CACHE, else $XDG_CACHE_HOME/fusion, else ~/.cache/fusion; *out malloc'd. */
int fz_cache_dir(char **out);

/* Resolves what a user calls a model into a local path (*out malloc'd): an existing path, a name
 * that `fusion ls` shows (a file in the cache's models/, ".gguf" optional), or a hub repo id
 * (downloaded with a progress bar when missing). NULL: the default model in the cache. */
int fz_model_resolve(const char *name, char **out);

/* The hub progress callback of `fusion pull`: one bar redrawn on a terminal (bytes, rate, ETA);
 * user points to an int, 1 when stderr is a terminal. */
void fz_pull_progress(const hub_progress *p, void *user);

/* ---- HTTP to a gateway (fusion-http.c) ---- */

typedef struct fz_http {
    void *curl;               /* CURL * */
    char *base;               /* the URL without a trailing "/" or "/v1" */
    char *key;                /* the API key, or NULL */
    char error[256];          /* curl's error text of the last request */
} fz_http;

/* The receiver of a streamed reply's bytes: returns 0 to go on, nonzero to abort. */
typedef int (*fz_http_sink)(const char *data, size_t len, void *user);

/* Opens a client of url (NULL: $FUSION_URL, else FZ_DEFAULT_URL) with key (NULL: $FUSION_API_KEY,
 * else $OPENAI_API_KEY). FU_OK or FU_ERR_NOMEM. */
int fz_http_init(fz_http *h, const char *url, const char *key);
void fz_http_free(fz_http *h);

/* GET or POST (body: JSON text, NULL for GET) to base + path; the reply's JSON into *out (new
 * reference) and its HTTP status into *status. FU_OK for a 2xx with a JSON body; else the error
 * in one line ("503: the server of blocks [15, 30) is unreachable"); *out may still hold the
 * error's JSON body. */
int fz_http_json(fz_http *h, const char *path, const char *body, long *status, json_t **out);

/* POSTs body to base + path and hands the reply's bytes to sink as they arrive. FU_OK for a 2xx;
 * FU_ERR_CANCELLED when the sink aborted or fz_interrupted was set; else the error in one line. */
int fz_http_stream(fz_http *h, const char *path, const char *body, fz_http_sink sink, void *user);

/* The string `key` of object o, or def. */
const char *fz_str(const json_t *o, const char *key, const char *def);

/* ---- child processes (fusion-proc.c) ---- */

/* One child: a fusion-gateway or fusion-shard with its output in a log file. */
typedef struct fz_child {
    char name[64];      /* "gateway", "shard 1 (blocks 15:30)" */
    char log[4096];     /* its stdout and stderr ("": ours) */
    int pid;            /* 0: not running (reaped) */
    int status;         /* its wait status once reaped */
} fz_child;

/* Starts argv (argv[0] a program name found next to this executable, else on $PATH) with its
 * output in c->log, in process group *pgid (0: a new group led by this child, *pgid set), with
 * the environment variables `env` ("NAME=VALUE", NULL-terminated; may be NULL) added. */
int fz_child_start(fz_child *c, char *const argv[], char *const env[], int *pgid);

/* Reaps c if it exited (no wait): 1 when it is no longer running, else 0. */
int fz_child_exited(fz_child *c);

/* Sends SIGTERM to each of n children that runs, then waits for them (SIGKILL after timeout_ms). */
void fz_children_stop(fz_child *c, int n, int timeout_ms);

/* "NAME exited with status N: LAST LOG LINE" (or "was killed by signal S") into out. */
void fz_child_why(const fz_child *c, char *out, size_t cap);

/* The last non-empty line of file path, shortened to fit cap (with "..."); "" when none. */
void fz_last_line(const char *path, char *out, size_t cap);

/* Waits (in steps of 50 ms) until file path is non-empty, while child c runs; reads it as a port
 * into *port. FU_OK; FU_ERR_IO when c exited first; FU_ERR_CANCELLED on fz_interrupted;
 * FU_ERR_EXHAUSTED after timeout_ms. */
int fz_wait_port_file(const char *path, fz_child *c, int timeout_ms, int *port);

/* Random bytes as hex: 2 * n characters into out (cap > 2n). FU_OK or FU_ERR_IO. */
int fz_random_hex(char *out, size_t cap, size_t n);

/* 1 when host:port (an IPv4 host or a name) can be bound now, 0 when it is in use (or cannot be
 * bound for another reason: *err set to errno). */
int fz_port_free(const char *host, int port, int *err);

/* 1 when addr ("HOST:PORT" or a bare host) names a loopback host. */
int fz_is_loopback(const char *addr);

#endif
