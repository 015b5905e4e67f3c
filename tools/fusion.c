/* fusion.c -- fusion: one command for serving and using a model (serve, join, chat, pull, ls, status).
 *
 * This file dispatches argv[1] to a subcommand (tools/fusion-*.c, see fusion-cli.h) and holds the
 * signal flag they share. The fusion-* programs stay for scripts; `fusion` starts them
 * (fusion-gateway, fusion-shard) or speaks to a gateway over HTTP.
 * Threading: one thread. Ownership: nothing outlives a subcommand.
 */
#include <curl/curl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fusion-cli.h"
#include "log.h"

volatile sig_atomic_t fz_interrupted;
volatile sig_atomic_t fz_signal;

static void fz_on_signal(int sig) {
    fz_interrupted = 1;
    fz_signal = sig;
}

void fz_signals_catch(void) {
    struct sigaction sa = {.sa_handler = fz_on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

/* One subcommand: its name, its entry and a line for the overview. */
typedef struct fz_command {
    const char *name;
    int (*main)(int argc, char **argv);
    const char *summary;
} fz_command;

static const fz_command fz_commands[] = {
    {"serve", fz_serve_main, "run a gateway and shards sized to this machine, until Ctrl-C"},
    {"join", fz_join_main, "join a gateway's swarm with this machine's GPU or CPU"},
    {"chat", fz_chat_main, "chat with a gateway in the terminal (streamed)"},
    {"pull", fz_pull_main, "download a model into the cache (a hub repo id or a GGUF file)"},
    {"ls", fz_ls_main, "list the cache's models with their sizes"},
    {"status", fz_status_main, "show a gateway's health and swarm as a table"},
};
#define FZ_N_COMMANDS (sizeof fz_commands / sizeof *fz_commands)

static void fz_usage(FILE *f) {
    fprintf(f, "usage: fusion COMMAND [options] [arguments]\n"
               "Serves Llama-family models on this machine or a swarm of machines.\n\nCommands:\n");
    for (size_t i = 0; i < FZ_N_COMMANDS; i++) fprintf(f, "  %-8s %s\n", fz_commands[i].name, fz_commands[i].summary);
    fprintf(f, "\n`fusion COMMAND --help` describes a command. Quick start:\n"
               "  fusion serve                 # the default model on http://127.0.0.1:8080\n"
               "  fusion chat                  # in another terminal, with FUSION_API_KEY set\n"
               "\nExit status: 0 success; 1 an error (one line on stderr); 2 a usage error;\n"
               "3 a child process died while serving; 130 interrupted.\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fz_usage(stderr);
        return FZ_EXIT_USAGE;
    }
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        fz_usage(stdout);
        return FZ_EXIT_OK;
    }
    for (size_t i = 0; i < FZ_N_COMMANDS; i++) {
        if (strcmp(argv[1], fz_commands[i].name)) continue;
        if (!getenv("FUSION_LOG")) fu_log_set_level(FU_LOG_LEVEL_WARN); /* the libraries' info lines */
        curl_global_init(CURL_GLOBAL_DEFAULT);
        int rc = fz_commands[i].main(argc - 1, argv + 1);
        curl_global_cleanup();
        return rc;
    }
    fprintf(stderr, "fusion: unknown command '%s' (see fusion --help)\n", argv[1]);
    return FZ_EXIT_USAGE;
}
