/* fusion-proc.c -- child processes of `fusion serve` and `fusion join`: start, watch, stop, explain.
 *
 * Children run in a process group of their own (so that a terminal's Ctrl-C reaches only
 * `fusion`, which then stops them in order) and, on Linux, get SIGTERM should `fusion` die first.
 * Their output goes to a log file whose last line explains a failure.
 * Threading: one thread. Ownership: an fz_child is the caller's value; nothing here allocates
 * past a call.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "clock.h"
#include "fusion-cli.h"
#include "status.h"

/* The path of program `name` next to this executable into out, or `name` itself (for $PATH). */
static void fz_program_path(const char *name, char *out, size_t cap) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    snprintf(out, cap, "%s", name);
    if (n <= 0) return;
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (!slash) return;
    *slash = '\0';
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/%s", self, name);
    if (access(path, X_OK) == 0) snprintf(out, cap, "%s", path);
}

/* In the child after fork(): joins the group, sends output to the log, execs; never returns. */
static void fz_child_exec(const fz_child *c, char *const argv[], char *const env[], int pgid, int parent) {
    setpgid(0, pgid);
#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);
#endif
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null < 0 || dup2(null, 0) < 0) _exit(127);
    if (c->log[0]) { /* else the output stays ours */
        int fd = open(c->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0) _exit(127);
    }
    for (size_t i = 0; env && env[i]; i++) putenv(env[i]);
    char prog[PATH_MAX + 64];
    fz_program_path(argv[0], prog, sizeof prog);
    execvp(prog, argv);
    fprintf(stderr, "cannot run %s: %s\n", prog, strerror(errno));
    _exit(127);
}

int fz_child_start(fz_child *c, char *const argv[], char *const env[], int *pgid) {
    int parent = (int)getpid();
    pid_t pid = fork();
    if (pid < 0) return fu_errorf(FU_ERR_IO, "fork: %s", strerror(errno));
    if (pid == 0) fz_child_exec(c, argv, env, *pgid, parent);
    setpgid(pid, *pgid); /* also here: no race with a kill of the group */
    if (!*pgid) *pgid = (int)pid;
    c->pid = (int)pid;
    c->status = 0;
    return FU_OK;
}

int fz_child_exited(fz_child *c) {
    if (c->pid <= 0) return 1;
    int st;
    pid_t r = waitpid(c->pid, &st, WNOHANG);
    if (r == 0) return 0;
    if (r == c->pid) c->status = st;
    c->pid = 0;
    return 1;
}

void fz_children_stop(fz_child *c, int n, int timeout_ms) {
    for (int i = 0; i < n; i++)
        if (c[i].pid > 0) kill(c[i].pid, SIGTERM);
    double deadline = fu_now_s() + timeout_ms / 1000.0;
    for (int i = 0; i < n; i++) {
        while (!fz_child_exited(&c[i]) && fu_now_s() < deadline) fu_sleep_ms(20);
        if (c[i].pid <= 0) continue;
        kill(c[i].pid, SIGKILL);
        waitpid(c[i].pid, &c[i].status, 0);
        c[i].pid = 0;
    }
}

void fz_last_line(const char *path, char *out, size_t cap) {
    out[0] = '\0';
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[4096];
    while (fgets(line, sizeof line, f)) {
        size_t n = strcspn(line, "\r\n");
        line[n] = '\0';
        if (n == 0) continue;
        if (n + 1 <= cap) memcpy(out, line, n + 1);
        else if (cap > 4) { /* the line's first cap - 4 bytes, then "..." */
            memcpy(out, line, cap - 4);
            memcpy(out + cap - 4, "...", 4);
        }
    }
    fclose(f);
}

void fz_child_why(const fz_child *c, char *out, size_t cap) {
    char last[200];
    fz_last_line(c->log, last, sizeof last);
    int n = WIFSIGNALED(c->status) ? snprintf(out, cap, "%s was killed by signal %d", c->name, WTERMSIG(c->status))
                                   : snprintf(out, cap, "%s exited with status %d", c->name, WEXITSTATUS(c->status));
    if (last[0] && n > 0 && (size_t)n < cap) snprintf(out + n, cap - (size_t)n, ": %s", last);
}

int fz_wait_port_file(const char *path, fz_child *c, int timeout_ms, int *port) {
    for (int waited = 0;; waited += 50) {
        FILE *f = fopen(path, "r");
        int ok = f && fscanf(f, "%d", port) == 1;
        if (f) fclose(f);
        if (ok) return FU_OK;
        if (fz_interrupted) return FU_ERR_CANCELLED;
        if (fz_child_exited(c)) return FU_ERR_IO;
        if (waited >= timeout_ms) return FU_ERR_EXHAUSTED;
        fu_sleep_ms(50);
    }
}

int fz_random_hex(char *out, size_t cap, size_t n) {
    unsigned char b[64];
    if (n > sizeof b || cap <= 2 * n) return fu_errorf(FU_ERR_INVALID, "random: too long");
    FILE *f = fopen("/dev/urandom", "rb");
    size_t got = f ? fread(b, 1, n, f) : 0;
    if (f) fclose(f);
    if (got != n) return fu_errorf(FU_ERR_IO, "cannot read /dev/urandom");
    for (size_t i = 0; i < n; i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
    return FU_OK;
}

int fz_port_free(const char *host, int port, int *err) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai;
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    *err = 0;
    if (getaddrinfo(host, service, &hints, &ai)) return 1; /* the gateway will say what is wrong */
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int ok = fd >= 0 && bind(fd, ai->ai_addr, ai->ai_addrlen) == 0;
    if (!ok) *err = errno;
    if (fd >= 0) close(fd);
    freeaddrinfo(ai);
    return ok;
}

int fz_is_loopback(const char *addr) {
    if (!strncmp(addr, "localhost", 9) && (addr[9] == '\0' || addr[9] == ':')) return 1;
    if (!strncmp(addr, "[::1]", 5) || !strcmp(addr, "::1")) return 1;
    return !strncmp(addr, "127.", 4);
}
