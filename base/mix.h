/* mix.h -- a 64-bit mixing function for hashes that must not collide by accident (prefix blocks).
 *
 * Header-only and pure: any thread, no state, nothing owned.
 */
#ifndef FU_MIX_H
#define FU_MIX_H

#include <stdint.h>

/* splitmix64's finalizer: a bijection of 64 bits whose output bits each depend on every input
 * bit. Chain it (h = fu_mix64(h ^ x)) to hash a sequence. */
static inline uint64_t fu_mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

#endif
