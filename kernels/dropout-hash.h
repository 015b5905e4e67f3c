/* dropout-hash.h -- the mask hash of op_dropout (ops.h): one definition for every backend's kernels.
 *
 * Internal to kernels/. The CPU backend includes it as it is (a static inline
 * function); the CUDA backend defines OP_DROPOUT_QUAL as its host-and-device
 * qualifiers (CU_HD) first, so that its kernels call the same code. */
#ifndef FU_DROPOUT_HASH_H
#define FU_DROPOUT_HASH_H

#include <stdint.h>

#ifndef OP_DROPOUT_QUAL
#define OP_DROPOUT_QUAL static inline
#endif

/* Uniform in [0, 1) from (seed, row, col), exactly as ops.h specifies:
 * splitmix64's finalizer over the mixed key, its top 24 bits scaled. */
OP_DROPOUT_QUAL float op_dropout_u(uint64_t seed, uint64_t row, uint64_t col) {
    uint64_t z = seed ^ (row * 0xD1B54A32D192ED03ull) ^ (col * 0x9E3779B97F4A7C15ull);
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * 0x1p-24f;
}

#endif
