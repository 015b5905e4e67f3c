/* gw-affinity.h -- the gateway's memory of which servers recently got which prompt prefixes, for
 * cache-aware routing (router.h, rt_route_cached).
 *
 * A prompt is cut into blocks of GW_AFFINITY_BLOCK tokens whose hashes chain (each covers the
 * blocks before it), so "server v got block k's hash" means v got the prompt's first (k + 1)
 * blocks. Each server remembers at most `per_server` hashes, least recently used forgotten
 * first: a bounded LRU per server, whatever the traffic. What it says is a hint (a server may
 * have evicted the blocks since, or restarted): routing only leans on it.
 *
 * Threads: not thread-safe; the swarm guards it with its mutex. Ownership: the caller owns the
 * table (gw_affinity_free) and passes hashes by pointer for the call.
 */
#ifndef FU_GW_AFFINITY_H
#define FU_GW_AFFINITY_H

#include <stdint.h>

#define GW_AFFINITY_BLOCK 64     /* tokens per block of a prompt's hashes */
#define GW_AFFINITY_MAX_BLOCKS 256 /* blocks of a prompt looked at, at most */

typedef struct gw_affinity gw_affinity;

/* An empty table remembering up to per_server (>= 1) prefixes per server. FU_ERR_NOMEM. */
int gw_affinity_new(int per_server, gw_affinity **out);
void gw_affinity_free(gw_affinity *a); /* NULL is a no-op */

/* The chained hashes of tokens[0..n)'s whole blocks into out[0..GW_AFFINITY_MAX_BLOCKS);
 * returns how many. */
int gw_affinity_hashes(const int32_t *tokens, int n, uint64_t *out);

/* Tokens of the prompt with hashes h[0..n) that server `server` (a router id >= 0) likely holds:
 * GW_AFFINITY_BLOCK times the longest k such that it holds h[0..k) (0: none), which it touches. */
int gw_affinity_cached(gw_affinity *a, int server, const uint64_t *h, int n);

/* Records that `server` got the prompt with hashes h[0..n) (FU_ERR_NOMEM when its table cannot
 * grow; the hint is then lost). */
int gw_affinity_note(gw_affinity *a, int server, const uint64_t *h, int n);

#endif
