/* fusion-chat.c -- `fusion chat`: an interactive terminal chat with a gateway, streamed.
 *
 * Reads a line, sends the whole history to POST /v1/chat/completions with "stream": true and
 * prints each delta as its server-sent event arrives; the answer joins the history. Commands:
 * /system TEXT, /reset, /help, /exit (also Ctrl-D). Ctrl-C stops an answer; at the prompt it leaves.
 * Threading: one thread; SIGINT sets fz_interrupted, which aborts the transfer.
 * Ownership: an fz_chat owns its client, its history (a jansson array) and its buffers.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fusion-cli.h"
#include "options.h"
#include "status.h"

typedef struct fz_chat_args {
    char *url, *api_key, *model, *system;
    int max_tokens;
    double temperature;
} fz_chat_args;

static fz_chat_args ca = {.max_tokens = -1};

static const fu_opt fz_chat_options[] = {
    {"url", 0, FU_OPT_STRING, FU_OPT_TO(ca.url), "URL", "the gateway (default $FUSION_URL, else\n" FZ_DEFAULT_URL ")"},
    {"api-key", 0, FU_OPT_STRING, FU_OPT_TO(ca.api_key), "KEY", "bearer token (default $FUSION_API_KEY)"},
    {"model", 'm', FU_OPT_STRING, FU_OPT_TO(ca.model), "ID", "the model (default: the first of /v1/models)"},
    {"system", 's', FU_OPT_STRING, FU_OPT_TO(ca.system), "TEXT", "a system prompt (also /system TEXT)"},
    {"max-tokens", 0, FU_OPT_INT, FU_OPT_TO(ca.max_tokens), .help = "most tokens per answer (default: the server's)",
     .lo = 1, .hi = 1 << 20},
    {"temperature", 0, FU_OPT_FLOAT, FU_OPT_TO(ca.temperature), "T", "sampling temperature (default: the server's)"},
    FU_OPT_END,
};

static const fu_opt_spec fz_chat_spec = {
    "fusion chat",
    "usage: fusion chat [options]\n"
    "Chats with a fusion gateway (or any OpenAI-compatible server) in the terminal: the\n"
    "answer streams in as it is generated and the conversation is kept. Commands:\n"
    "  /system TEXT   set the system prompt      /reset   forget the conversation\n"
    "  /help          these commands             /exit    leave (also Ctrl-D)\n"
    "Ctrl-C stops an answer; at the prompt it leaves.\n",
    fz_chat_options,
    "\nExit status: 0 after /exit or Ctrl-D; 1 when the gateway cannot be used (one line\n"
    "says why); 2 a usage error.\n"
    "Environment: FUSION_URL, FUSION_API_KEY, OPENAI_API_KEY.\n"};

/* One chat session. */
typedef struct fz_chat {
    fz_http h;
    const fz_chat_args *a;
    char *model;        /* malloc'd */
    json_t *history;    /* the user and assistant messages, oldest first */
    char *system;       /* malloc'd or NULL */
    fu_buf pending;     /* an event's bytes not yet ended by a newline */
    fu_buf answer;      /* the answer so far */
    char error[512];    /* an error event's message */
    int done;           /* [DONE] seen */
} fz_chat;

/* One "data: ..." payload of the stream. */
static void fz_chat_event(fz_chat *c, const char *data, size_t len) {
    if (len == 6 && !memcmp(data, "[DONE]", 6)) {
        c->done = 1;
        return;
    }
    json_t *ev = json_loadb(data, len, 0, NULL), *err = json_object_get(ev, "error");
    if (err) snprintf(c->error, sizeof c->error, "%s", fz_str(err, "message", "the server reported an error"));
    json_t *delta = json_object_get(json_array_get(json_object_get(ev, "choices"), 0), "delta");
    const char *text = fz_str(delta, "content", NULL);
    if (text && text[0]) {
        fputs(text, stdout);
        fflush(stdout);
        fu_buf_append(&c->answer, text, strlen(text));
    }
    json_decref(ev);
}

/* The sink of the stream: splits the bytes into lines and hands on the data lines. */
static int fz_chat_sink(const char *data, size_t len, void *user) {
    fz_chat *c = user;
    if (fu_buf_append(&c->pending, data, len)) return 1;
    size_t start = 0;
    for (size_t i = 0; i < c->pending.len; i++) {
        if (c->pending.data[i] != '\n') continue;
        const char *line = c->pending.data + start;
        size_t n = i - start;
        if (n && line[n - 1] == '\r') n--;
        if (n >= 5 && !memcmp(line, "data:", 5)) {
            size_t skip = n > 5 && line[5] == ' ' ? 6 : 5;
            fz_chat_event(c, line + skip, n - skip);
        }
        start = i + 1;
    }
    fu_buf_consume(&c->pending, start);
    return 0;
}

/* The request body for the history (new reference). */
static json_t *fz_chat_body(const fz_chat *c) {
    json_t *msgs = json_array();
    if (c->system) json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "system", "content", c->system));
    json_array_extend(msgs, c->history);
    json_t *body = json_pack("{s:s, s:o, s:b}", "model", c->model, "messages", msgs, "stream", 1);
    if (body && c->a->max_tokens > 0) json_object_set_new(body, "max_tokens", json_integer(c->a->max_tokens));
    if (body && !isnan(c->a->temperature)) json_object_set_new(body, "temperature", json_real(c->a->temperature));
    return body;
}

/* Sends the history and streams the answer; FU_OK with the answer in the history. */
static int fz_chat_turn(fz_chat *c) {
    json_t *body = fz_chat_body(c);
    char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    if (!text) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    fu_buf_free(&c->pending);
    fu_buf_free(&c->answer);
    c->error[0] = '\0';
    c->done = 0;
    int rc = fz_http_stream(&c->h, "/v1/chat/completions", text, fz_chat_sink, c);
    free(text);
    if (c->answer.len || rc == FU_ERR_CANCELLED) fputc('\n', stdout);
    if (!rc && c->error[0]) rc = fu_errorf(FU_ERR_NETWORK, "%s", c->error);
    if (!rc && !c->done) rc = fu_errorf(FU_ERR_NETWORK, "the answer ended early");
    if (!rc)
        json_array_append_new(c->history, json_pack("{s:s, s:s%}", "role", "assistant", "content",
                                                    c->answer.data ? c->answer.data : "", c->answer.len));
    return rc;
}

/* A line the user typed: a command, or a message sent with the history. 1 to leave. */
static int fz_chat_line(fz_chat *c, char *line) {
    if (!strcmp(line, "/exit") || !strcmp(line, "/bye") || !strcmp(line, "/quit")) return 1;
    if (!strcmp(line, "/reset")) {
        json_array_clear(c->history);
        printf("(the conversation is forgotten)\n");
    } else if (!strncmp(line, "/system", 7) && (line[7] == ' ' || line[7] == '\0')) {
        free(c->system);
        c->system = line[7] && line[8] ? strdup(line + 8) : NULL;
        printf(c->system ? "(system prompt set)\n" : "(system prompt cleared)\n");
    } else if (!strcmp(line, "/help") || line[0] == '/') {
        printf("/system TEXT  set the system prompt\n/reset        forget the conversation\n"
               "/exit         leave (also Ctrl-D)\n");
    } else if (line[0]) {
        json_array_append_new(c->history, json_pack("{s:s, s:s}", "role", "user", "content", line));
        if (fz_chat_turn(c)) {
            if (!fz_interrupted) fprintf(stderr, "fusion chat: %s\n", fu_last_error());
            json_array_remove(c->history, json_array_size(c->history) - 1);
        }
        fz_interrupted = 0;
    }
    fflush(stdout);
    return 0;
}

/* Reads one line of any length into *line (its newline dropped); 0 at the end of input. */
static int fz_chat_read(fu_buf *line) {
    char part[4096];
    fu_buf_free(line);
    while (fgets(part, sizeof part, stdin)) {
        size_t n = strlen(part);
        int end = n && part[n - 1] == '\n';
        if (fu_buf_append(line, part, n - (size_t)end)) return 0;
        if (end) break;
    }
    if (!line->len && (feof(stdin) || ferror(stdin))) return 0;
    return fu_buf_append(line, "", 1) ? 0 : 1; /* NUL-terminated */
}

/* The prompt loop; the exit status. */
static int fz_chat_loop(fz_chat *c) {
    fu_buf line = {0};
    int tty = isatty(STDIN_FILENO), leave = 0;
    if (tty) printf("fusion chat with %s at %s (/help for commands)\n", c->model, c->h.base);
    while (!leave) {
        if (tty) printf(">>> "), fflush(stdout);
        if (!fz_chat_read(&line)) break;
        leave = fz_chat_line(c, line.data);
    }
    if (tty && !leave) printf("\n");
    fu_buf_free(&line);
    return FZ_EXIT_OK;
}

/* The first model of GET /v1/models into *out (malloc'd). */
static int fz_chat_default_model(fz_http *h, char **out) {
    long status;
    json_t *doc = NULL;
    int rc = fz_http_json(h, "/v1/models", NULL, &status, &doc);
    const char *id = rc ? NULL : fz_str(json_array_get(json_object_get(doc, "data"), 0), "id", NULL);
    if (!rc && !id) rc = fu_errorf(FU_ERR_NOT_FOUND, "%s serves no model (GET /v1/models)", h->base);
    if (!rc && !(*out = strdup(id))) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    json_decref(doc);
    return rc;
}

int fz_chat_main(int argc, char **argv) {
    ca.temperature = NAN;
    int n = 0, status = fu_opt_main(&fz_chat_spec, argc, argv, &n);
    if (status < 0 && n) status = fu_opt_fail(&fz_chat_spec, "no arguments expected ('%s')", argv[1]);
    if (status >= 0) return fu_opt_free(fz_chat_options), status;
    fz_signals_catch();
    fz_chat c = {.a = &ca, .history = json_array()};
    int rc = fz_http_init(&c.h, ca.url, ca.api_key);
    if (!rc && ca.model) c.model = strdup(ca.model);
    else if (!rc) rc = fz_chat_default_model(&c.h, &c.model);
    if (!rc && ca.system) c.system = strdup(ca.system);
    if (rc) fprintf(stderr, "fusion chat: %s\n", fu_last_error());
    status = rc ? FZ_EXIT_FAIL : fz_chat_loop(&c);
    fz_http_free(&c.h);
    json_decref(c.history);
    free(c.model);
    free(c.system);
    fu_buf_free(&c.pending);
    fu_buf_free(&c.answer);
    fu_opt_free(fz_chat_options);
    return status;
}
