/* test-pb.h -- protobuf messages written by hand, byte by byte, for tests that must send what the
 * generated types cannot express (a field wider than its declared type, an embedded NUL).
 *
 * Threads: a pbuf is used by one thread. Ownership: a pbuf is a plain value (fixed buffer).
 */
#ifndef FU_TEST_PB_H
#define FU_TEST_PB_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

/* A protobuf message built by hand. */
typedef struct pbuf {
    uint8_t b[1024];
    size_t n;
} pbuf;

static inline void pb_varint(pbuf *p, uint64_t v) {
    do {
        assert_true(p->n < sizeof p->b);
        p->b[p->n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
}

/* Field `field` as varint `v` (a negative int64 goes as its two's complement, 10 bytes). */
static inline void pb_uint(pbuf *p, int field, uint64_t v) {
    pb_varint(p, (uint64_t)field << 3);
    pb_varint(p, v);
}

/* Field `field` as `n` length-delimited bytes. */
static inline void pb_bytes(pbuf *p, int field, const void *d, size_t n) {
    pb_varint(p, (uint64_t)field << 3 | 2);
    pb_varint(p, n);
    assert_true(p->n + n <= sizeof p->b);
    memcpy(p->b + p->n, d, n);
    p->n += n;
}

/* Field `field` as the sub-message `body`. */
static inline void pb_msg(pbuf *p, int field, const pbuf *body) { pb_bytes(p, field, body->b, body->n); }

#endif
