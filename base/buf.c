/* buf.c -- growable byte buffers. */
#include "buf.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"

static int fu_buf_reserve(fu_buf *b, size_t extra) {
    if (extra > SIZE_MAX - b->len - 1) return FU_ERR_NOMEM;
    size_t need = b->len + extra + 1;
    if (need <= b->cap) return FU_OK;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need) cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    char *d = realloc(b->data, cap);
    if (!d) return FU_ERR_NOMEM;
    b->data = d;
    b->cap = cap;
    return FU_OK;
}

int fu_buf_append(fu_buf *b, const void *data, size_t len) {
    if (fu_buf_reserve(b, len)) return fu_errorf(FU_ERR_NOMEM, "buffer");
    if (len) memcpy(b->data + b->len, data, len);
    b->len += len;
    b->data[b->len] = '\0';
    return FU_OK;
}

int fu_buf_appendf(fu_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || fu_buf_reserve(b, (size_t)n)) return fu_errorf(FU_ERR_NOMEM, "buffer");
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return FU_OK;
}

void fu_buf_consume(fu_buf *b, size_t n) {
    if (n >= b->len) {
        b->len = 0;
    } else {
        memmove(b->data, b->data + n, b->len - n);
        b->len -= n;
    }
    if (b->data) b->data[b->len] = '\0';
}

void fu_buf_free(fu_buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}
