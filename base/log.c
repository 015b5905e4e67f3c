/* log.c -- leveled logging to stderr. */
#include "log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int fu_log_threshold = FU_LOG_LEVEL_INFO;

static pthread_mutex_t fu_log_lock = PTHREAD_MUTEX_INITIALIZER;
static const char *const fu_log_names[] = {"debug", "info", "warn", "error", "off"};

__attribute__((constructor)) static void fu_log_init_from_env(void) {
    const char *env = getenv("FUSION_LOG");
    int level = env ? fu_log_level_parse(env) : -1;
    if (level >= 0) fu_log_threshold = level;
}

void fu_log_set_level(fu_log_level level) { fu_log_threshold = (int)level; }

int fu_log_level_parse(const char *name) {
    for (int i = 0; i < (int)(sizeof fu_log_names / sizeof fu_log_names[0]); i++)
        if (strcmp(name, fu_log_names[i]) == 0) return i;
    return -1;
}

void fu_log_write(fu_log_level level, const char *id, const char *file, int line,
                  const char *fmt, ...) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);

    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;

    pthread_mutex_lock(&fu_log_lock);
    fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s%s%s%s:%d %s\n",
            tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
            ts.tv_nsec / 1000000, fu_log_names[level], id ? "[" : "", id ? id : "",
            id ? "] " : "", base, line, msg);
    pthread_mutex_unlock(&fu_log_lock);
}
