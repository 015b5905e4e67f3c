/* buf.h -- a growable byte buffer, NUL-terminated: the one text and byte buffer of fusion.
 *
 * A zeroed fu_buf is an empty buffer. The owner of the struct owns its data
 * and frees it with fu_buf_free(); a buffer is used by one thread at a time.
 */
#ifndef FU_BUF_H
#define FU_BUF_H

#include <stddef.h>

typedef struct fu_buf {
    char *data; /* NUL-terminated when non-NULL */
    size_t len, cap;
} fu_buf;

/* Appends len bytes; returns FU_OK or FU_ERR_NOMEM (the buffer is unchanged then). */
int fu_buf_append(fu_buf *b, const void *data, size_t len);
/* Appends printf-formatted text; FU_OK or FU_ERR_NOMEM. */
int fu_buf_appendf(fu_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Drops the first n bytes (all of them when n >= len). */
void fu_buf_consume(fu_buf *b, size_t n);
/* Frees the data and leaves an empty buffer; safe to call twice. */
void fu_buf_free(fu_buf *b);

#endif
