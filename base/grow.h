/* grow.h -- growing an array on demand: the one helper every buffer owner shares.
 *
 * The caller owns the array (free() it) and serializes access to it.
 */
#ifndef FU_GROW_H
#define FU_GROW_H

#include <stdlib.h>

/* Makes *p (an array of elements of `size` bytes, `*cap` of them allocated)
 * hold at least n elements, doubling from 16; contents are kept. Returns 0, or
 * -1 on allocation failure (then *p and *cap are unchanged). */
static inline int fu_grow(void **p, size_t *cap, size_t n, size_t size) {
    if (n <= *cap) return 0;
    size_t c = *cap ? *cap : 16;
    while (c < n) c *= 2;
    void *q = realloc(*p, c * size);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

#endif
