/* gw-pace.h -- step deadlines from each shard's measured step times.
 *
 * A hung shard (stopped, swapping, its link gone quiet) answers nothing, and a
 * fixed step timeout long enough for the slowest healthy step leaves a stream
 * stalled for that long before it fails over. Instead each step waits for what
 * its hops have been measured to need, a multiple of it, with a floor:
 *
 *   deadline = floor + multiple x sum over hops of
 *              (p99 of its 1-position steps
 *               + p99 of its per-position time in longer steps x (n - 1))
 *
 * where n is the step's positions. Each hop's figures are its own (queue +
 * compute time as the shard reports it in the step's timings), over its last
 * GW_PACE_SAMPLES steps of each kind. A hop without both kinds of samples yet
 * gives the configured fallback (the step timeout), as does a deadline above
 * the fallback times (1 + n / GW_PACE_CHUNK). Past its deadline a step's hops
 * are probed (gw-gen.c): a busy shard answers and is waited for, a hung one is
 * failed over at once. GW_PACE_CHUNK is fusion-shard's default
 * --max-batch: a prefill takes about one step per chunk.
 *
 * Threads: thread-safe (one mutex). Ownership: the table copies the addresses
 * it keeps; at most GW_PACE_SERVERS, the least recently updated replaced.
 */
#ifndef FU_GW_PACE_H
#define FU_GW_PACE_H

#include "chain.h"

#define GW_PACE_SAMPLES 128
#define GW_PACE_SERVERS 512
#define GW_PACE_CHUNK 512

typedef struct gw_pace gw_pace;

typedef struct gw_pace_options {
    int floor_ms;    /* added to every deadline (network, scheduling); 0: 2000 */
    double multiple; /* of the measured p99s; 0: 4 */
    int fallback_ms; /* a step on hops not measured yet; 0: 60000 */
} gw_pace_options;

/* A new, empty table (o copied; NULL: defaults). NULL when out of memory. */
gw_pace *gw_pace_new(const gw_pace_options *o);
/* NULL is a no-op. */
void gw_pace_free(gw_pace *p);

/* Records a step of n positions that succeeded over hops[0..n_hops): res->timing[i] is hop
 * i's (a result whose timings do not match the hops one for one is ignored). */
void gw_pace_record(gw_pace *p, const chain_hop *hops, int n_hops, int n, const chain_result *res);

/* The longest a step of n positions is waited for, however its hops answer: fallback_ms x
 * (1 + n / GW_PACE_CHUNK), the bound of every deadline below and of a probed step's wait. */
int64_t gw_pace_cap_ms(int fallback_ms, int n);

/* The deadline in ms for a step of n positions over hops[0..n_hops) (see above). */
int gw_pace_deadline_ms(gw_pace *p, const chain_hop *hops, int n_hops, int n);

#endif
