/* router-impl.h -- router internals shared by the rt-*.c files: file and INI readers, sparse
 * links and valid hops, flow-network layout, random numbers. Not a public interface;
 * single-threaded like the router. */
#ifndef RT_ROUTER_IMPL_H
#define RT_ROUTER_IMPL_H

#include <stdint.h>

#include "router.h"

/* --- files --------------------------------------------------------------------------------- */

/* Largest file the loaders read (a 10,000-server cluster file is a few tens of MB). */
#define RT_MAX_FILE ((size_t)1 << 30)
/* Reads a whole file (NUL-terminated, at most RT_MAX_FILE). *out malloc'ed. */
int rt__read_text(const char *path, char **out, size_t *len);
/* A parser of a file's text into dst. */
typedef int (*rt__parse_fn)(void *dst, const char *text, size_t len);
/* Reads `path` and parses it into dst; a parse error is prefixed with the path. */
int rt__load_file(const char *path, rt__parse_fn parse, void *dst);
/* `given`, or else f->dir + "/" + rel written into buf[cap]. */
const char *rt__helix_path(char *buf, size_t cap, const rt_helix_files *f, const char *given, const char *rel);

/* --- INI files (Helix clusters, profiles, placements) ------------------------------------ */

typedef struct rt_ini_item {
    char *section;
    char *key;
    char *value;
} rt_ini_item;

typedef struct rt_ini {
    rt_ini_item *items;
    int n, cap;
} rt_ini;

/* Reads `path` ("[section]" headers, "key = value" lines, '#'/';' comments). Keys before any
 * section go to section "". On error nothing needs freeing. */
int rt__ini_load(rt_ini *ini, const char *path);
int rt__ini_parse(rt_ini *ini, const char *text, size_t len);
void rt__ini_free(rt_ini *ini);
/* Value of section/key or NULL (the last one wins). */
const char *rt__ini_get(const rt_ini *ini, const char *section, const char *key);
/* Evaluates Helix's numeric expressions: a product of numbers and unit names (kbps, mbps,
 * gbps, KB, MB, GB, Byte, MilliSec), e.g. "12.5 * mbps". */
int rt__eval_expr(const char *s, double *out);
/* Parses "[1, 2, 'source', ...]" into ints (RT_SOURCE / RT_SINK for the names); *out is
 * malloc'ed (free it). */
int rt__parse_int_list(const char *s, int **out, int *n);

/* --- sparse links -------------------------------------------------------------------------- */

/* One server's explicit links in one direction, sorted by peer id. An entry with bandwidth 0
 * overrides default_link for its pair (it is kept only while the pair is on the default). */
struct rt_adj {
    int n, cap;
    int *peer;     /* [cap] */
    rt_link *link; /* [cap] */
};

/* Index of `peer` in `a`, or -1. */
int rt__adj_find(const rt_adj *a, int peer);
/* 1 if the pair i -> j reads default_link when it has no entry. */
int rt__on_default(const rt_swarm *sw, int i, int j);
/* Drops every link to and from server i (both lists and their mirrors) and its default. */
void rt__links_clear(rt_swarm *sw, int i);
void rt__adj_free(rt_adj *a);
/* Deep copy of `src` into the uninitialised `dst`; FU_OK or FU_ERR_NOMEM. */
int rt__adj_copy(rt_adj *dst, const rt_adj *src);

/* Valid server-to-server hops with a link (bandwidth > 0), in CSR form: the hops out of server
 * i are to[start[i] .. start[i + 1]) with bandwidth bw[...]. Reused across calls. */
typedef struct rt_hops {
    int n, cap;      /* hops */
    int n_srv;       /* servers covered (start has n_srv + 1 entries) */
    int *start, *to; /* [n_srv + 1], [cap] */
    double *bw;      /* [cap] */
    int start_cap;
    int *by_first;   /* [n_srv] on-default serving servers sorted by first block (scratch) */
    int *first_at;   /* [L + 2] start of each block in by_first (scratch) */
    int first_cap, by_cap;
} rt_hops;
int rt__hops_build(const rt_swarm *sw, int allow_partial, rt_hops *h);
void rt__hops_free(rt_hops *h);

/* --- the swarm's flow network ------------------------------------------------------------ */

/* Node numbering: 0 source, 1 sink, 2 source_out, 3 sink_in, then 4 per server i:
 * in = 4 + 4i, start = +1, end = +2, out = +3. */
#define RT_N_SOURCE 0
#define RT_N_SINK 1
#define RT_N_SRC_OUT 2
#define RT_N_SINK_IN 3
#define RT_N_IN(i) (4 + 4 * (i))
#define RT_N_START(i) (5 + 4 * (i))
#define RT_N_END(i) (6 + 4 * (i))
#define RT_N_OUT(i) (7 + 4 * (i))

/* 1 if a hop i -> j is valid for the spans (exact boundary, or partial when allowed). */
int rt__hop_valid(const rt_swarm *sw, int i, int j, int allow_partial);

/* Max flow of the swarm with a reusable workspace (no allocation after the first call of a
 * given size); used by the placement search. */
typedef struct rt_flow_ws {
    rt_graph *g;
    int cap_nodes;
    rt_hops hops;
} rt_flow_ws;
double rt__flow_eval(const rt_swarm *sw, const rt_flow_opts *opts, rt_flow_ws *ws);
void rt__flow_ws_free(rt_flow_ws *ws);

/* Graph reset for reuse: drops all edges, keeps the allocation; grows to n_nodes. */
int rt__graph_reset(rt_graph *g, int n_nodes);

/* --- Swarm's adaptive routing (rt-swroute.c) ---------------------------------------------- */

typedef struct rt__swroute rt__swroute;
/* Next-hop choosers for every node of `sw` (borrowed; its spans and links as they are now):
 * the coordinator and each serving server pick among the serving servers that hold the block
 * where they end and that they link to. Each candidate starts at priority and weight
 * `initial_s`; `smoothing` is the weight of a new observation. *out: rt__swroute_free. */
int rt__swroute_init(rt__swroute **out, const rt_swarm *sw, double initial_s, double smoothing);
void rt__swroute_free(rt__swroute *r);
/* The next server for a request leaving `from` (RT_SOURCE or a server): the candidate of least
 * priority, whose priority then grows by its weight (interleaved weighted round robin); -1 when
 * `from` has none. */
int rt__swroute_next(rt__swroute *r, int from);
/* A request sent from `from` took `seconds` until it had been through `to`: `to`'s weight at
 * `from` moves toward it. */
void rt__swroute_observe(rt__swroute *r, int from, int to, double seconds);

/* --- stripe placements (rt-stripe.c) ------------------------------------------------------ */

/* Scores a candidate placement for rt__stripe_best: *score higher is better, < 0 unusable. */
typedef int (*rt__stripe_score_fn)(void *ctx, const rt_swarm *sw, double *score);
/* How rt__stripe_best groups the servers: by kind and site, or by site alone. */
typedef enum rt__stripe_groups { RT__STRIPE_KIND_SITE, RT__STRIPE_SITE } rt__stripe_groups;
/* Stripe placements of `base`: its placeable servers grouped by kind and site, or by site alone
 * (a site: servers linked within 5 ms), each group one pipeline over a head [0, c), a tail
 * [c, L), the whole model or nothing, every group at the same cut c (multiples of L / 20).
 * A group's pipeline takes its members in id order (at most one a block), or, by site, also
 * the lean way: the fewest members that hold its range, those that hold the most first. Each
 * member's share of the range is in proportion to the most blocks it holds; a head's last
 * member is the one best linked into the tails, a tail's first the one best linked from the
 * heads' last members, and the ends of the model the ones best linked from and back to the
 * coordinator. A boundary between two members that meets another site's moves by up to 2
 * blocks where the limits allow, so that chains do not cross between sites midway. When the
 * choices at a cut number at most 1024 (5 groups by kind and site, 3 by site) every one that
 * covers the model within the groups' limits is scored; with up to 16 groups, a descent from
 * each group's widest role changes one group's choice at a time while the score rises (4000
 * scores at most in all, cuts in ascending order). The k best (at most 16) with distinct
 * spans, best first, are written as copies of `base` into out[0 .. *n) (the caller frees
 * each). *n = 0 when the swarm has more than 512 servers or 16 groups. Deterministic. */
int rt__stripe_best(const rt_swarm *base, rt__stripe_groups by, rt__stripe_score_fn score, void *ctx, int k,
                    rt_swarm *out, int *n);

/* --- misc ------------------------------------------------------------------------------- */

uint64_t rt__rng_next(uint64_t *state); /* splitmix64 */
double rt__rng_unit(uint64_t *state);   /* uniform [0, 1) */
int rt__rng_int(uint64_t *state, int n); /* uniform 0 .. n-1 (n > 0) */

/* 1 if server i may be given a span: not gone, and able to hold a block. */
int rt__placeable(const rt_swarm *sw, int i);
/* Per-block total throughput of serving servers ([n_layers], caller-allocated). */
void rt__block_tput(const rt_swarm *sw, double *out);
/* Petals' window choice: the start s in [0, L-k] whose sorted tput[s..s+k) is
 * lexicographically smallest. */
int rt__petals_best_start(const double *tput, int n_layers, int k, double *scratch);

#endif
