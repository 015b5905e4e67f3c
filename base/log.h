/* log.h -- leveled logging for every component; the level is checked before formatting.
 *
 * One process-wide level and sink (stderr), set once at start-up; lines from
 * any thread are written whole under one lock. Nothing is allocated.
 */
#ifndef FU_LOG_H
#define FU_LOG_H

typedef enum fu_log_level {
    FU_LOG_LEVEL_DEBUG = 0,
    FU_LOG_LEVEL_INFO = 1,
    FU_LOG_LEVEL_WARN = 2,
    FU_LOG_LEVEL_ERROR = 3,
    FU_LOG_LEVEL_OFF = 4,
} fu_log_level;

/* Current threshold; initialised from FUSION_LOG (debug|info|warn|error|off),
 * default info. */
extern int fu_log_threshold;

void fu_log_set_level(fu_log_level level);

/* Parses "debug", "info", ... into a level; returns -1 if unknown. */
int fu_log_level_parse(const char *name);

/* Writes one line to stderr: time, level, `id` (a request or session id,
 * may be NULL), source location and the message. Thread-safe. */
void fu_log_write(fu_log_level level, const char *id, const char *file, int line,
                  const char *fmt, ...) __attribute__((format(printf, 5, 6)));

#define FU_LOG(level, id, ...)                                          \
    do {                                                                \
        if ((int)(level) >= fu_log_threshold)                           \
            fu_log_write((level), (id), __FILE__, __LINE__, __VA_ARGS__); \
    } while (0)

#define FU_DEBUG(...) FU_LOG(FU_LOG_LEVEL_DEBUG, NULL, __VA_ARGS__)
#define FU_INFO(...) FU_LOG(FU_LOG_LEVEL_INFO, NULL, __VA_ARGS__)
#define FU_WARN(...) FU_LOG(FU_LOG_LEVEL_WARN, NULL, __VA_ARGS__)
#define FU_ERROR(...) FU_LOG(FU_LOG_LEVEL_ERROR, NULL, __VA_ARGS__)

#endif
