/* shard-prefix.h -- a shard's prefix cache: the KV of token blocks that earlier sessions computed,
 * for later sessions that start with the same tokens (automatic prefix caching).
 *
 * A block is `block_tokens` consecutive positions starting at a multiple of block_tokens. It is
 * keyed by a hash that chains the previous block's (the first block's parent is the session's
 * seed, pfx_seed: the adapter and the span) and covers the block's token ids; a lookup compares
 * the parent and the tokens too, so a hash collision never serves another prefix. Hidden states
 * into a span are a function of the tokens, the adapter and the span, so the same key serves the
 * chain's first span (which gets tokens) and the others (which get hidden states and the tokens
 * beside them). A block's data is what eng_seq_kv_export writes for its positions: sessions
 * copy it into their own caches (eng_seq_kv_import) and never write into it.
 *
 * Blocks are reference-counted: a session pins the blocks it will import, and a pinned block is
 * never evicted. Unpinned ready blocks sit on an LRU list and are evicted, least recently used
 * first, when the owner needs their memory (pfx_cache_evict). A new block is reserved (not yet
 * visible), filled outside the owner's lock, then published or abandoned.
 *
 * Threads: not thread-safe; the shard core guards a cache with its mutex (filling a reserved
 * block's data needs no lock). Ownership: the cache owns its blocks; pointers to blocks stay
 * valid while pinned (or reserved).
 */
#ifndef FU_SHARD_PREFIX_H
#define FU_SHARD_PREFIX_H

#include <stddef.h>
#include <stdint.h>

typedef struct pfx_cache pfx_cache;
typedef struct pfx_block pfx_block;

/* Creates an empty cache of blocks of block_tokens (>= 1) positions, each holding block_bytes
 * bytes of KV. FU_ERR_INVALID or FU_ERR_NOMEM. */
int pfx_cache_new(int block_tokens, size_t block_bytes, pfx_cache **out);
/* Frees the cache and every block (none may be pinned or reserved any more). NULL is a no-op. */
void pfx_cache_free(pfx_cache *c);

int pfx_cache_block_tokens(const pfx_cache *c);
/* Bytes the cache's blocks hold (ready, pinned and reserved), and how many blocks that is. */
uint64_t pfx_cache_bytes(const pfx_cache *c);
int pfx_cache_blocks(const pfx_cache *c);

/* The first block's parent for sessions with adapter `adapter_id` (NULL or "": none) in its
 * load `version` (an adapter replaced under the same id is another adapter) over blocks
 * [first, last) of a model: the identity of a span's input beside the tokens. */
uint64_t pfx_seed(const char *adapter_id, uint64_t version, int first, int last);
/* The hash of a block of tokens[0..n) whose parent hash is `parent`. */
uint64_t pfx_hash(uint64_t parent, const int32_t *tokens, int n);

/* Pins the longest run of ready cached blocks that starts tokens[0..n) under `seed`, at most
 * max_blocks of them, into out[] (the caller's, max_blocks entries), each touched as most
 * recently used. Returns how many (0..max_blocks). */
int pfx_cache_acquire(pfx_cache *c, uint64_t seed, const int32_t *tokens, int n, int max_blocks, pfx_block **out);
/* Unpins blocks[0..n) (from acquire); an unpinned block becomes evictable. */
void pfx_cache_release(pfx_cache *c, pfx_block *const *blocks, int n);

/* A pinned or reserved block's KV data (block_bytes). */
const void *pfx_block_data(const pfx_block *b);
const int32_t *pfx_block_tokens(const pfx_block *b); /* (block_tokens) */
void *pfx_block_fill(pfx_block *b); /* a reserved block's, to fill before publishing */

/* Reserves a new block of tokens[0..block_tokens) under parent: NULL when it is already cached
 * (then touched) or out of memory. The block is invisible to lookups and not evictable until
 * pfx_cache_publish (which makes it an unpinned ready block) or pfx_cache_abandon (which frees
 * it). The caller evicts to make room first (it owns the memory budget). */
pfx_block *pfx_cache_reserve(pfx_cache *c, uint64_t parent, const int32_t *tokens);
void pfx_cache_publish(pfx_cache *c, pfx_block *b);
void pfx_cache_abandon(pfx_cache *c, pfx_block *b);

/* Frees unpinned ready blocks, least recently used first, until `bytes` are freed or none is
 * left. Returns the bytes freed. */
uint64_t pfx_cache_evict(pfx_cache *c, uint64_t bytes);

#endif
