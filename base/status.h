/* status.h -- the project's one status enum, error details and their strings.
 *
 * Every library function that can fail returns FU_OK (0) or a negative
 * fu_status and leaves a message for fu_last_error(). The message is per
 * thread (thread-local storage), so threads never see each other's errors;
 * the strings of fu_status_str() are static.
 */
#ifndef FU_STATUS_H
#define FU_STATUS_H

/* X(name, value, description). 0 is success, errors are negative. */
#define FU_STATUS_LIST(X)                                   \
    X(FU_OK, 0, "ok")                                       \
    X(FU_ERR_NOMEM, -1, "out of memory")                    \
    X(FU_ERR_IO, -2, "i/o error")                           \
    X(FU_ERR_FORMAT, -3, "malformed input")                 \
    X(FU_ERR_UNSUPPORTED, -4, "unsupported")                \
    X(FU_ERR_INVALID, -5, "invalid argument")               \
    X(FU_ERR_NOT_FOUND, -6, "not found")                    \
    X(FU_ERR_RANGE, -7, "out of range")                     \
    X(FU_ERR_NETWORK, -8, "network error")                  \
    X(FU_ERR_CHECKSUM, -9, "checksum mismatch")             \
    X(FU_ERR_TEMPLATE, -10, "template error")               \
    X(FU_ERR_AUTH, -11, "not authorized")                   \
    X(FU_ERR_EXHAUSTED, -12, "resource exhausted")          \
    X(FU_ERR_CANCELLED, -13, "cancelled")                   \
    X(FU_ERR_INTERNAL, -14, "internal error")

typedef enum fu_status {
#define FU_STATUS_ENUM_(name, value, desc) name = value,
    FU_STATUS_LIST(FU_STATUS_ENUM_)
#undef FU_STATUS_ENUM_
} fu_status;

/* Static description of a status code; never NULL. */
const char *fu_status_str(int status);

/* Records a detailed message for the calling thread's last error and returns
 * `status`, so callers can write `return fu_errorf(FU_ERR_FORMAT, "...")`.
 * The arguments may include fu_last_error() to wrap the previous message. */
int fu_errorf(int status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The calling thread's last detailed error message ("" if none). The string
 * is owned by the thread and valid until its next fu_errorf(). */
const char *fu_last_error(void);

/* Clears the calling thread's last error message. */
void fu_error_clear(void);

#endif
