/* router.h -- fusion's router core: swarm model, Helix-style flow network and max flow,
 * span placement (Petals, Swarm, fusion's search, join/rebalance), IWRR routing, simulator.
 *
 * Pure computation over numbers: no I/O besides loading and saving cluster files, no
 * threads. An rt_swarm is not thread-safe; its owner serializes access (the
 * gateway's gw_swarm holds one mutex over it). Objects are created and freed
 * in pairs (rt_*_init / rt_*_free); the caller owns what it is handed.
 */
#ifndef RT_ROUTER_H
#define RT_ROUTER_H

#include <stddef.h>
#include <stdint.h>

/*
 * Units everywhere: bandwidth and NIC speed in bytes/s, latency in seconds, sizes in bytes,
 * throughput and flow in tokens/s (one unit of flow = one token passing through every layer).
 *
 * Ownership: an rt_swarm owns its servers' tables and names; every function that takes a
 * `const rt_server *` description copies what it needs. Functions return FU_OK or a negative
 * FU_ERR_* (base/status.h) and set fu_last_error() on failure; none aborts on bad input.
 */

/* ---------------------------------------------------------------------------------------- */
/* Model and swarm                                                                            */

typedef struct rt_model {
    char name[64];
    int n_layers;                    /* transformer blocks L */
    double token_bytes;              /* bytes per token between coordinator and a server (Helix: 2) */
    double act_bytes;                /* bytes per token of hidden state between servers */
    double layer_bytes;              /* weight bytes per block */
    double kv_bytes_per_token_layer; /* KV-cache bytes per token per block (0 = unknown) */
    double weight_vram_fraction;     /* weights may use at most this share of VRAM (0 = 1.0) */
} rt_model;

typedef enum rt_server_state {
    RT_SERVER_GONE = 0,   /* left the swarm; its id is reused only by rt_swarm_add_server_at */
    RT_SERVER_ACTIVE = 1, /* serves its span (if it has one) */
    RT_SERVER_SPARE = 2,  /* backup pool: joined but holds no span */
} rt_server_state;

/* Pseudo server ids for links to and from the coordinator (gateway). */
#define RT_SOURCE (-1)
#define RT_SINK (-2)

typedef struct rt_server {
    char name[64];
    char address[128];
    char kind[32];         /* machine/profile type ("A100", "cpu-avx512", ...) */
    int is_cpu;
    rt_server_state state;
    int first, last;       /* span [first, last) of blocks; first == last: no span */
    double nic_in, nic_out; /* bytes/s; <= 0 means unlimited */
    double vram_bytes;      /* <= 0 means unknown (only the throughput table bounds the span) */
    int n_tput;             /* length of the tables below = most blocks the profile knows */
    double *tput;           /* [n_tput] tokens/s when holding k = i + 1 blocks (owned) */
    double *kv_tokens;      /* [n_tput] KV capacity in tokens with k blocks; 0 = unlimited (owned,
                               may be NULL) */
} rt_server;

typedef struct rt_link {
    double bandwidth; /* bytes/s; <= 0 means no link */
    double latency;   /* seconds */
} rt_link;

typedef struct rt_adj rt_adj; /* one server's links in one direction (router internals) */

/* Links are sparse: each server keeps adjacency lists of its out- and in-links, so memory grows
 * with servers x links, not servers^2. A pair without an entry reads as `default_link` when both
 * servers are `on_default` (a cluster file's "default_link" fills every pair this way without
 * storing the pairs), and as absent ({0, 0}) otherwise. */
typedef struct rt_swarm {
    rt_model model;
    int n_servers;           /* ids 0 .. n_servers-1 (GONE ones stay in place) */
    int cap;                 /* allocated server slots */
    rt_server *servers;      /* [cap] */
    rt_adj *out, *in;        /* [cap] each server's links i -> j and j -> i (entries mirror) */
    unsigned char *on_default; /* [cap] 1: pairs of such servers without an entry read default_link */
    rt_link default_link;    /* bandwidth <= 0: none */
    rt_link *from_source;    /* [cap] coordinator -> server */
    rt_link *to_sink;        /* [cap] server -> coordinator */
    double source_nic_out;   /* coordinator NICs in bytes/s (<= 0 unlimited) */
    double sink_nic_in;
    uint64_t version;        /* incremented by every mutation, so users can see changes */
} rt_swarm;

/* Initialises an empty swarm for `model` (copied). Free with rt_swarm_free. */
int rt_swarm_init(rt_swarm *sw, const rt_model *model);
/* Frees everything the swarm owns; NULL and a zeroed swarm are no-ops. */
void rt_swarm_free(rt_swarm *sw);
/* Deep copy of `src` into the uninitialised `dst`. */
int rt_swarm_clone(rt_swarm *dst, const rt_swarm *src);

/* Adds a server described by `desc` (its tables are copied; its state is taken as given,
 * GONE becomes ACTIVE). Links to the new server start absent. Returns the new id (>= 0) or a
 * negative status. */
int rt_swarm_add_server(rt_swarm *sw, const rt_server *desc);
/* The same, reusing the slot of the GONE server `slot` (slot < 0: appends, as above), so that
 * churn does not grow the swarm. The slot's links are reset. Returns `slot` or a status. */
int rt_swarm_add_server_at(rt_swarm *sw, int slot, const rt_server *desc);
/* Marks server `id` GONE (it keeps its id; it carries no flow). */
int rt_swarm_remove_server(rt_swarm *sw, int id);
/* Sets the span [first, last) of server `id` (first == last clears it); checks the bounds,
 * the profile table and VRAM (rt_swarm_max_layers). */
int rt_swarm_set_span(rt_swarm *sw, int id, int first, int last);
/* Sets the directed link from -> to (ids or RT_SOURCE / RT_SINK). */
int rt_swarm_set_link(rt_swarm *sw, int from, int to, double bandwidth, double latency);
/* The directed link from -> to (ids or RT_SOURCE / RT_SINK); absent links read as {0, 0}. */
rt_link rt_swarm_link(const rt_swarm *sw, int from, int to);
/* Server i's explicit out-links (k < rt_swarm_out_degree): *to receives the peer. Links that
 * only exist through default_link are not listed. Returns {0, 0} for bad arguments. */
int rt_swarm_out_degree(const rt_swarm *sw, int i);
rt_link rt_swarm_out_link(const rt_swarm *sw, int i, int k, int *to);
/* Helix's link pruning with min_keep = max_keep = k: a server-to-server link survives when it
 * is among the k fastest out-links of its source or among the k fastest in-links of its
 * destination (ties: lower peer id first), so every server keeps its k best links each way and
 * memory is O(servers x k). Links through default_link count as candidates (the survivors
 * become explicit and default_link is dropped). Coordinator links are kept. k >= 1. */
int rt_swarm_prune_links(rt_swarm *sw, int k);
/* Most blocks server `id` can hold: its table length, bounded by
 * weight_vram_fraction * vram / layer_bytes when VRAM is known; 0 for GONE/invalid ids. */
int rt_swarm_max_layers(const rt_swarm *sw, int id);
/* Compute capacity (tokens/s) of server `id` holding k blocks; 0 if it cannot. */
double rt_swarm_tput(const rt_swarm *sw, int id, int k);
/* KV capacity in tokens of server `id` holding k blocks; 0 means unlimited. */
double rt_swarm_kv_tokens(const rt_swarm *sw, int id, int k);
/* 1 if server `id` is ACTIVE and holds a span. */
int rt_swarm_serving(const rt_swarm *sw, int id);
/* Number of blocks no serving server covers; if `first_gap` is not NULL it receives the first
 * uncovered block (or -1). */
int rt_swarm_uncovered(const rt_swarm *sw, int *first_gap);
/* Number of non-GONE servers. */
int rt_swarm_live(const rt_swarm *sw);

/* ---------------------------------------------------------------------------------------- */
/* Loaders                                                                                    */

/* Model constants for `model_name` ("llama2_70b", "llama1_30b") from Helix's
 * derived/model_constants.json. */
int rt_helix_load_model(rt_model *model, const char *constants_json, const char *model_name);
/* Builds the swarm of a Helix cluster file (`[ComputeNode-i] type`, `[Link-a-b]` bidirectional
 * links) with NICs/VRAM from the machine-profile ini and per-type throughput + KV tables from
 * derived/node_capacity_by_layers.csv (the rows of sw->model.name whose composition matches
 * the cluster's type counts, e.g. "A100x4+L4x8+T4x12"). `sw` must be initialised and empty. */
int rt_helix_load_cluster(rt_swarm *sw, const char *cluster_ini, const char *profiles_ini,
                          const char *capacity_csv);
/* Where Helix's data lies: `dir` (anchors/helix) and the model ("llama2_70b"); the three files
 * default (NULL) to the dir's derived/model_constants.json,
 * simulator/model_manager/google_machine_profiles.ini and derived/node_capacity_by_layers.csv. */
typedef struct rt_helix_files {
    const char *dir;
    const char *model;
    const char *constants_json, *profiles_ini, *capacity_csv;
} rt_helix_files;

/* The swarm of Helix cluster file `cluster_ini` (rt_helix_load_model + rt_swarm_init +
 * rt_helix_load_cluster over the files of `f`). `sw` must be uninitialised; on error it is left
 * empty (rt_swarm_free is a no-op on it). */
int rt_helix_load_swarm(rt_swarm *sw, const rt_helix_files *f, const char *cluster_ini);
/* Applies a Helix placement file (ilp_sol.ini, swarm_sol.ini, petals_sol.ini, ...:
 * `[Settings] offset`, `[Solution] compute_node_k=[l0, l1, ...]`); servers not listed lose
 * their span. Layers must be contiguous. */
int rt_helix_load_placement(rt_swarm *sw, const char *sol_ini);

/* fusion's own cluster format (JSON), which shard servers fill from measurements:
 *   {"model": {"name", "n_layers", "token_bytes" (default 2), "activation_bytes",
 *              "layer_bytes", "kv_bytes_per_token_layer", "weight_vram_fraction"},
 *    "coordinator": {"nic_out", "nic_in"},                     bytes/s, optional
 *    "kinds": {"A100": {"tokens_per_s_by_layers", "kv_tokens_by_layers", "vram", "nic_in",
 *                       "nic_out", "cpu"}, ...},               optional profiles, see below
 *    "default_link": {"bandwidth", "latency"},                 optional, fills every pair of
 *                                                              the file's servers (not stored)
 *    "servers": [{"name", "address", "kind", "profile" (a key of "kinds"; default: kind),
 *                 "cpu", "state": "active"|"spare", "nic_in", "nic_out", "vram",
 *                 "tokens_per_s_by_layers": [tput with 1, 2, ... blocks]
 *                   or "layer_tokens_per_s" + "max_layers" (tput(k) = value / k),
 *                 "kv_tokens_by_layers": [...] (optional), "span": [first, last],
 *                 "default_link": false (this server is off the default link)}],
 *    "links": [{"from", "to" (server names, "source", "sink"), "bandwidth", "latency",
 *               "bidirectional" (default true)}
 *              or [from, to, bandwidth, latency]: directed, by index in "servers"
 *                 (-1 the coordinator as source, -2 as sink)]}
 * A server's own fields win over its profile's. Other top-level keys are ignored. Examples:
 * config/clusters/. `sw` must be uninitialised; free with rt_swarm_free. Files up to 1 GiB. */
int rt_swarm_load_json(rt_swarm *sw, const char *path);
int rt_swarm_parse_json(rt_swarm *sw, const char *text, size_t len);
/* Writes `sw` compactly: one "kinds" profile per distinct (kind, tables, VRAM, NICs, cpu)
 * ("kind#N" for a kind's other profiles), servers referring to it, links as directed arrays
 * (pairs on the default link stay implicit), GONE servers left out, numbers exact. Streams to
 * a temporary file beside `path` and renames it over `path`, so readers never see half a file.
 * O(servers + links). */
int rt_swarm_save_json(const rt_swarm *sw, const char *path);
typedef struct rt_sim_profiles rt_sim_profiles;
/* rt_swarm_save_json, with the step-time profiles `prof` (NULL or none: left out) as the file's
 * "step_profiles" (rt_sim_profiles_parse_json reads them back the same, batch limits per block
 * count included). */
int rt_swarm_save_json_with(const rt_swarm *sw, const rt_sim_profiles *prof, const char *path);

/* ---------------------------------------------------------------------------------------- */
/* Max flow on a general graph (Dinic's algorithm on real-valued capacities)                  */

typedef struct rt_graph rt_graph;

/* New graph with `n_nodes` nodes and no edges; *out owned by the caller (rt_graph_free). */
int rt_graph_init(rt_graph **out, int n_nodes);
void rt_graph_free(rt_graph *g);
/* Adds the directed edge u -> v with capacity cap >= 0; returns its index (>= 0) or a status. */
int rt_graph_add_edge(rt_graph *g, int u, int v, double cap);
/* Max flow from s to t; resets any previous flow. Returns the value (>= 0), or -1 on bad ids. */
double rt_graph_max_flow(rt_graph *g, int s, int t);
/* Flow on edge `e` after rt_graph_max_flow (0 for bad indices). */
double rt_graph_edge_flow(const rt_graph *g, int e);

/* ---------------------------------------------------------------------------------------- */
/* The swarm's flow network                                                                   */

typedef enum rt_convention {
    /* Helix's runtime scheduler (network_flow.py): coordinator NIC edges, per-server
     * in -> start -> end -> out with NIC / (tok or tok+act) and compute capacities, server
     * links carry bandwidth / (tok + act). fusion uses this one. */
    RT_CONV_RUNTIME = 0,
    /* Helix's placement MILP: node capacity min(tput, min(NIC)/act), server links
     * bandwidth / act, coordinator links bandwidth / tok, no coordinator NIC edges. */
    RT_CONV_ILP = 1,
} rt_convention;

typedef struct rt_flow_opts {
    rt_convention conv;
    int allow_partial; /* also link i -> j when start_j <= end_i < end_j (j runs [end_i, end_j)) */
} rt_flow_opts;

/* One hop of the flow: from a server or RT_SOURCE to a server or RT_SINK. */
typedef struct rt_flow_hop {
    int from, to;
    double flow;         /* tokens/s */
} rt_flow_hop;

typedef struct rt_flow {
    double value;        /* max flow, tokens/s */
    int n;               /* server slots covered (sw->n_servers when computed) */
    double *server_flow; /* [n] tokens/s through each server's compute edge */
    int n_hops;          /* hops carrying flow (> 0) */
    rt_flow_hop *hops;   /* [n_hops] ordered by from (servers by id, then RT_SOURCE), then to
                            (servers by id, then RT_SINK) */
    int *hop_start;      /* [n + 2]: the hops out of server u are hops[hop_start[u] ..
                            hop_start[u + 1]); out of the source: hop_start[n] .. n_hops */
} rt_flow;

/* Flow on the hop from -> to (server ids, RT_SOURCE, RT_SINK); 0 when it carries none. */
double rt_flow_hop_value(const rt_flow *flow, int from, int to);

/* Builds the flow network of `sw` and computes its max flow. `flow` may be NULL (value only,
 * returned through `value`); otherwise it is (re)filled and must be freed with rt_flow_free,
 * and among the max flows it is the one whose servers are least busy in sum (sum of flow /
 * capacity: flow a fast server can carry does not go through a slow one), refined within a
 * fixed amount of work, so a very large swarm may get a max flow short of the least busy.
 * `opts` NULL means RT_CONV_RUNTIME without partial execution. */
int rt_flow_compute(const rt_swarm *sw, const rt_flow_opts *opts, rt_flow *flow, double *value);
/* Max flow value of `sw`, or 0 on error. */
double rt_max_flow(const rt_swarm *sw, const rt_flow_opts *opts);
void rt_flow_free(rt_flow *flow);

/* ---------------------------------------------------------------------------------------- */
/* Placement                                                                                  */

/* Petals' rule: servers join in id order, each taking rt_swarm_max_layers blocks at the
 * window whose sorted per-block throughputs are lexicographically smallest, then Petals'
 * rebalancing passes (a server moves when that lifts the weakest block). Every non-GONE
 * server gets a span. Needs sum of spans >= L. */
int rt_place_petals(rt_swarm *sw);
/* Swarm's rule (Helix's baseline): equal stages of s = min over servers of max layers blocks,
 * ceil(L / s) stages (the last one shorter), servers in decreasing throughput order to the
 * stage with the lowest total throughput. */
int rt_place_swarm(rt_swarm *sw);

typedef struct rt_search_opts {
    double time_limit_s;   /* wall-clock budget; <= 0: 5 s, or no clock when max_evals > 0 */
    uint64_t seed;
    rt_flow_opts flow;     /* how the flow is evaluated */
    int keep_current;      /* also start from the swarm's current placement if it covers */
    long max_evals;        /* > 0: the search stops after this many max-flow evaluations in
                              all (its seeds, a dozen or so at scale, are evaluated even past
                              it); without a clock (time_limit_s <= 0) it is deterministic: the
                              same swarm, seed and max_evals give the same placement anywhere */
} rt_search_opts;

typedef struct rt_search_stats {
    double seconds;        /* time taken */
    long evaluations;      /* max-flow evaluations */
    double start_flow;     /* best seed's flow */
    double flow;           /* final flow */
} rt_search_stats;

/* fusion's placement search. Seeds: Petals, Swarm, equal stages of every length, the current
 * placement (keep_current), chains that follow each server's fastest links (so consecutive
 * stages are linked in a sparse swarm), and a stage-packing dynamic program: servers grouped into
 * regions (components of fast links) and types; for a target flow F it searches (depth
 * first, pruned by the capacity the unused servers can still add) for a cut of the blocks
 * into consecutive stages, each held by a minimal same-region group with capacity >= F,
 * consecutive stages in different regions needing |prev| * |cur| * slowest link >= F; F is
 * raised by galloping + bisection for up to 60% of the budget; leftover servers then join
 * where they add the most flow. The rest of the budget runs simulated annealing over
 * (start, length) of each server (shift / resize / align to another span / join a stage /
 * swap / bridge) on the true max flow, ties broken by the weakest block's capacity.
 * Large swarms get fewer seeds (at most 8 stage lengths when over 256 servers; the packing
 * search's leftovers go to Petals' weakest window past 256 servers), and the budget bounds the
 * packing search too (by time, or by a fixed amount of work without a clock), so the search
 * takes O(evaluations x servers x links). Writes the best placement into `sw`: every block
 * covered, every span within rt_swarm_max_layers. `stats` may be NULL. */
int rt_place_search(rt_swarm *sw, const rt_search_opts *opts, rt_search_stats *stats);

/* Where should the new (or spare) server `id` load? Tries every window the server can hold with
 * the others fixed and picks: most uncovered blocks covered, then highest max flow, then
 * Petals' weakest window. Does not change `sw`. *gain is the flow increase (may be 0: the
 * caller may keep the server as a spare). */
int rt_place_join(const rt_swarm *sw, int id, const rt_flow_opts *opts, int *first, int *last,
                  double *gain);

typedef struct rt_move {
    int server;
    int old_first, old_last;
    int new_first, new_last;
} rt_move;

/* Rebalances `sw` one server at a time: first gives uncovered blocks to spares / servers
 * whose departure keeps coverage, then moves a server when that raises the max flow by more
 * than `min_gain` (fraction, e.g. 0.05). A server is only moved if every block stays covered
 * without it, so applying the moves in order never uncovers a block. Applies the moves to
 * `sw`, writes at most `max_moves` into `moves` (may be NULL) and their count to *n_moves. */
int rt_place_rebalance(rt_swarm *sw, const rt_flow_opts *opts, double min_gain, int max_moves,
                       rt_move *moves, int *n_moves);

/* ---------------------------------------------------------------------------------------- */
/* Request routing (interleaved weighted round-robin over the max flow)                        */

typedef struct rt_router rt_router;

/* What a hop's IWRR load counts. */
typedef enum rt_iwrr_load {
    RT_IWRR_LIVE = 0,   /* the work of the requests routed over it now: each request's
                           request_len, held until rt_release (the gateway's) */
    RT_IWRR_CUMULATIVE  /* every token routed over it so far: each request's prompt when it is
                           routed, then each decode step's (rt_path_step); never released, so
                           each hop's share of all tokens follows its flow (Helix's scheduler) */
} rt_iwrr_load;

typedef struct rt_route_opts {
    rt_flow_opts flow;
    double min_share;     /* skip hops carrying less than this share of a node's out-flow
                             (default 0.05 when <= 0); where the flow fans out so widely that
                             no hop reaches it, less than this share of the strongest hop */
    rt_iwrr_load load;    /* RT_IWRR_LIVE by default */
} rt_route_opts;

typedef struct rt_path {
    rt_router *router;   /* the router that issued it */
    uint64_t id;
    int n_hops;
    int *servers;        /* [n_hops] server ids in order */
    int *first, *last;   /* [n_hops] blocks each hop runs ([first, last), contiguous) */
    int request_len;     /* tokens reserved in each hop's KV cache */
    int work;            /* tokens of IWRR load it added to each hop when routed */
} rt_path;

/* A router over `sw` (borrowed: it must outlive the router; call rt_router_update after
 * changing it). `opts` may be NULL. *out owned by the caller (rt_router_free). */
int rt_router_init(rt_router **out, const rt_swarm *sw, const rt_route_opts *opts);
/* Frees the router; paths still held must be released first. NULL is a no-op. */
void rt_router_free(rt_router *r);
/* Recomputes the max flow from the swarm (membership, spans or measurements changed).
 * In-flight load and KV reservations are kept per server id. */
int rt_router_update(rt_router *r);
/* The current flow (valid until the next rt_router_update). */
const rt_flow *rt_router_flow(const rt_router *r);

/* As rt_route, with cache affinity: cached[v] (by server id; NULL: none) is how many of the
 * request's leading tokens server v likely holds in its prefix cache, work it will not redo. A
 * hop's score becomes (load + request_len - min(cached[v], request_len)) / flow, so a server
 * holding the prefix wins ties and near-ties among the hops the flow allows, and a hit offsets
 * at most one request's work: the balance IWRR keeps is off by at most one request per server. */
int rt_route_cached(rt_router *r, int request_len, const int *cached, rt_path **path);

/* Chooses a chain for a request of `request_len` tokens (prompt + max new tokens): from the
 * source, at each hop among next servers whose hop carries >= min_share of the flow out of the
 * current node and whose KV cache can admit request_len more tokens, the one minimising
 * (load + request_len) / flow, where load is the work currently routed over that hop
 * (interleaved weighted round-robin; rt_iwrr_load); backtracks on dead ends. Reserves KV and load until
 * rt_release. *path is owned by the caller. FU_ERR_EXHAUSTED: no chain can admit it now
 * (caller may queue or return 503); FU_ERR_NOT_FOUND: no chain at all. Decode steps of the
 * request reuse the same path. */
int rt_route(rt_router *r, int request_len, rt_path **path);
/* As rt_route_cached (cached may be NULL), for a request whose prompt is prompt_len of its
 * request_len tokens (1 <= prompt_len <= request_len): under RT_IWRR_CUMULATIVE a hop's score
 * weighs the prompt, (load + prompt_len) / flow, and the prompt is what the path adds to each
 * hop's load; under RT_IWRR_LIVE, request_len as rt_route. rt_route(r, n, p) is
 * rt_route_request(r, n, n, NULL, p). */
int rt_route_request(rt_router *r, int prompt_len, int request_len, const int *cached, rt_path **path);
/* Counts `tokens` more routed over each hop of the path (a decode step) under
 * RT_IWRR_CUMULATIVE; no-op under RT_IWRR_LIVE, for NULL, or for tokens <= 0. FU_OK, or
 * FU_ERR_NOMEM. */
int rt_path_step(rt_path *p, int tokens);
/* Releases the path's reservations and frees it. NULL is a no-op. */
void rt_release(rt_path *path);
/* Work currently routed over server `id` (tokens); for tests and /v1/swarm. */
double rt_router_load(const rt_router *r, int id);
/* 1 if a path still holds load or KV on server `id` (its slot must not be reused yet). */
int rt_router_busy(const rt_router *r, int id);

/* A chain for training: servers whose whole spans tile [0, n_layers) exactly, one after
 * another (a trainer holds its server's whole span, so a chain of partial spans will not do).
 * Only RT_SERVER_ACTIVE servers with a span, and not in avoid[0..n_avoid) (servers a run lost),
 * are taken. Of such chains the one with the fewest hops wins, then the one whose slowest
 * server (tput for its span's length; 0 when unknown) is fastest. *n (<= max) server ids into
 * ids[] in block order. FU_OK; FU_ERR_NOT_FOUND when no chain tiles the model (within max
 * hops); FU_ERR_NOMEM. */
int rt_train_chain(const rt_swarm *sw, const int *avoid, int n_avoid, int max, int *ids, int *n);

/* ---------------------------------------------------------------------------------------- */
/* Step-time profiles (the simulator's per-server cost model)                                 */

/* How long one batched step takes on one kind of server, per block it runs: Helix's
 * prompt_bs2time / decode_bs2time tables, or fusion's own measurements. Times are seconds for
 * ONE block; a server running j blocks of a batch takes j times as long. Between table points
 * the time is interpolated linearly, beyond the last point extrapolated from the last two. */
typedef struct rt_step_profile {
    char kind[32];             /* matches rt_server.kind */
    int n_prompt, n_decode;
    double *prompt_tokens;     /* [n_prompt] ascending prompt tokens in a batch (owned) */
    double *prompt_s;          /* [n_prompt] seconds per block */
    double *decode_tokens;     /* [n_decode] ascending decode tokens (= sequences) in a batch */
    double *decode_s;          /* [n_decode] seconds per block */
    double decode_ctx_s;       /* extra seconds per block per context token a decode batch reads */
    double single_decode_factor; /* time factor of a one-token decode batch (Helix: 2; 0 = 1) */
    /* Batch limits when holding k blocks: entry min(k, n_limits) - 1; 0 means no limit. */
    int n_limits;
    int *prompt_max_requests, *prompt_max_tokens, *decode_max_tokens; /* [n_limits] (owned) */
    double *decode_max_context;                                        /* [n_limits] (owned) */
} rt_step_profile;

struct rt_sim_profiles {
    int n;
    rt_step_profile *items; /* [n] (owned) */
};

/* Helix's per-GPU tables for `model_name` ("llama2_70b"): every <gpu>/prompt_bs2time.csv and
 * decode_bs2time.csv under `model_dir` (simulator/model_manager/<model>), kinds named as in
 * Helix's cluster files (a100 -> "A100", t4x2 -> "T4x2"), with the batch limits of
 * derived/model_constants.json (`constants_json`) and Helix's one-token decode factor 2.
 * `p` must be zeroed; free with rt_sim_profiles_free. */
int rt_sim_profiles_load_helix(rt_sim_profiles *p, const char *model_dir, const char *constants_json,
                               const char *model_name);
/* rt_sim_profiles_load_helix for f->model with the tables under f->dir and f's constants. */
int rt_helix_load_step_profiles(rt_sim_profiles *p, const rt_helix_files *f);
/* The "step_profiles" object of a fusion cluster file:
 *   {"<kind>": {"prompt": [[tokens, ms_per_block], ...], "decode": [[batch, ms_per_block], ...],
 *               "decode_ctx_ms_per_token": x, "single_decode_factor": f,
 *               "prompt_max_requests": n, "prompt_max_tokens": n, "decode_max_tokens": n,
 *               "decode_max_context": n}, ...}
 * where each limit is a number (any block count) or an array by block count ([n1, n2, ...]:
 * entry min(k, length) - 1 holds k blocks; the arrays as long as each other).
 * A file without the key yields no profiles (p->n == 0). `p` must be zeroed. */
int rt_sim_profiles_parse_json(rt_sim_profiles *p, const char *text, size_t len);
int rt_sim_profiles_load_json(rt_sim_profiles *p, const char *path);
void rt_sim_profiles_free(rt_sim_profiles *p);
/* Adds the profile `kind` from measured tables (per block: prompt_s[i] seconds for a prompt of
 * prompt_tokens[i] tokens, decode_s[i] for decode_tokens[i] sequences of one token each), with
 * no batch limits. The tables are copied and checked as a file's are (1..4096 points, tokens
 * ascending, times finite and >= 0). FU_ERR_FORMAT on a bad table or a duplicate or too long
 * a kind, FU_ERR_NOMEM; `p` is unchanged on failure. */
int rt_sim_profiles_add(rt_sim_profiles *p, const char *kind, int n_prompt, const double *prompt_tokens,
                        const double *prompt_s, int n_decode, const double *decode_tokens, const double *decode_s);
/* The profile of `kind`, or NULL. */
const rt_step_profile *rt_sim_profile_find(const rt_sim_profiles *p, const char *kind);
/* Seconds one block takes for a batch of `prompt_tokens` prompt tokens and `decode_tokens`
 * decode sequences reading `decode_ctx` context tokens in all (one of them may be 0). */
double rt_step_seconds(const rt_step_profile *p, int prompt_tokens, int decode_tokens, double decode_ctx);

/* ---------------------------------------------------------------------------------------- */
/* Simulator                                                                                  */

typedef struct rt_sim_request {
    double arrival_s; /* 0 in a set of lengths */
    int prompt_len;
    int output_len;
} rt_sim_request;

/* Parses request lines from `text` (`len` bytes): "arrival_seconds prompt_len output_len"
 * (with_arrival; sorted by arrival on return) or "prompt_len output_len" (a set of lengths).
 * Blank lines and '#' comments are skipped; prompts are >= 1 token, outputs >= 0. *out is
 * malloc'ed (free it), with at least one request. FU_ERR_FORMAT names the bad line. */
int rt_sim_requests_parse(const char *text, size_t len, int with_arrival, rt_sim_request **out, int *n);
/* The same from the file at `path` (errors are prefixed with the path). */
int rt_sim_requests_load(const char *path, int with_arrival, rt_sim_request **out, int *n);
/* The mean prompt and output lengths of v[n] (0 when n is 0). */
void rt_sim_requests_mean(const rt_sim_request *v, int n, double *prompt, double *output);

typedef enum rt_sim_feed {
    /* Closed loop: `concurrency` requests in flight, each replaced when it finishes. */
    RT_FEED_CLOSED = 0,
    /* Helix's offline feeder: `initial_requests` 0.1 s apart, then one more 0.1 s after each
     * prompt or request that finishes while the busiest block's expected KV use is at most
     * `feed_hwm` of what the servers holding it have. */
    RT_FEED_KV = 1,
    /* Poisson arrivals at `arrival_rate` requests/s. */
    RT_FEED_POISSON = 2,
    /* The requests of `trace`. */
    RT_FEED_TRACE = 3,
} rt_sim_feed;

typedef enum rt_sim_routing {
    /* The gateway's: IWRR over the max flow, a request's whole chain chosen when it is admitted
     * within the servers' KV room. */
    RT_SIM_ROUTE_IWRR = 0,
    /* Swarm's (as Helix simulates it): each node sends a prompt on to the server that can go on
     * from its last block by IWRR weighted by the smoothed time its requests took through each
     * (start 0.05 s, new observations weigh 0.8); decode steps follow the prompt's servers.
     * Every request is admitted (no KV bound): feed it a closed loop, Poisson arrivals or a
     * trace (RT_FEED_KV is refused). */
    RT_SIM_ROUTE_SWARM = 1,
} rt_sim_routing;

typedef struct rt_sim_opts {
    double duration_s;     /* simulated seconds (default 660) */
    double warmup_s;       /* excluded from the figures (default 60; < 0: none) */
    rt_sim_feed feed;
    int concurrency;       /* RT_FEED_CLOSED (default 256) */
    int initial_requests;  /* RT_FEED_KV (default 20) */
    double feed_hwm;       /* RT_FEED_KV (default 0.8) */
    double arrival_rate;   /* RT_FEED_POISSON, requests/s */
    const rt_sim_request *trace; /* RT_FEED_TRACE, sorted by arrival */
    int n_trace;
    int prompt_len;        /* synthetic requests (default 750 / 240, Helix's averages) */
    int output_len;
    double prompt_sigma;   /* > 0: prompt lengths drawn lognormal with mean prompt_len and this
                              sigma, within [4, max_prompt_len]; 0: all prompt_len */
    double output_sigma;   /* the same for output lengths */
    int max_prompt_len, max_output_len; /* (default 2047 / 1000, Helix's Azure Conversation set) */
    const rt_sim_request *lengths; /* when set, synthetic requests draw their lengths from these
                                      pairs, uniformly with replacement (Helix's LengthSampler);
                                      prompt_len, output_len and the sigmas are then unused */
    int n_lengths;
    double kv_hwm;         /* a server admits requests while its KV stays within this share of
                              its capacity (default 0.85, Helix's offline setting) */
    int kv_output_tokens;  /* a request reserves KV for its prompt and this many outputs, as
                              Helix expects (> 0), or for its own output length (0) */
    double host_s_per_byte; /* host-side copy cost per activation byte entering a server
                              (default Helix's 1/4e9 + 1/5e9 s; < 0: none) */
    const rt_sim_profiles *profiles; /* step times by server kind (NULL: throughput tables only) */
    uint64_t seed;
    rt_sim_routing routing;
    rt_route_opts route;   /* RT_SIM_ROUTE_IWRR's options */
} rt_sim_opts;

/* Makes so's synthetic requests draw their lengths from v[n] (borrowed), and sets its
 * prompt_len / output_len to the set's means, rounded, which the quick estimate reads. */
void rt_sim_opts_draw_lengths(rt_sim_opts *so, const rt_sim_request *v, int n);

typedef struct rt_sim_result {
    double max_flow;          /* tokens/s of the placement */
    double decode_tps;        /* decode tokens/s in the measured window */
    double prompt_tps;        /* prompt tokens/s in the measured window */
    double ttft_p50, ttft_p95, ttft_p99; /* seconds from arrival to the prompt's end */
    double tpot_p50, tpot_p95, tpot_p99; /* seconds per decode step */
    double mean_prompt_latency_s;
    double mean_decode_latency_s;
    double mean_hops;         /* servers per admitted request's chain */
    double mean_in_flight;    /* admitted requests, time-averaged over the window */
    long completed;           /* requests finished in the measured window */
    long rejected;            /* routing failures (no chain at all) */
    long events;              /* events processed */
} rt_sim_result;

/* Discrete-event simulation of serving over `sw`, requests routed by rt_route_request (the
 * gateway's IWRR, counting load as route.load says; each decode step is counted with
 * rt_path_step) on servers whose KV capacity is scaled by kv_hwm; a request that cannot be
 * admitted waits (FIFO) for a release. Each request runs its prompt step, then output_len
 * decode steps, each step going source -> its chain's servers -> sink.
 * - Servers: continuous batching. An idle server takes, in arrival order, every queued step
 *   within its profile's batch limits, and runs the batch in (blocks run) x rt_step_seconds
 *   plus the host copy cost of the tokens it received; a server whose kind has no profile
 *   runs (batch tokens) x (blocks run / blocks held) / tput(k).
 * - Links: a transfer of w tokens (tok bytes to/from the coordinator, tok + act between
 *   servers) passes the link, the sender's outbound NIC and the receiver's inbound NIC, each a
 *   FIFO at its own bandwidth (so a NIC's links share it, as Helix's NIC bandwidth pools do),
 *   ends when the slowest has passed it, then arrives one latency later.
 * A batch takes at least 1 us. Figures cover [warmup_s, duration_s]. Deterministic for the
 * same inputs and seed. FU_ERR_RANGE when a run exceeds 4e8 events (near-zero step times and
 * links over a long run). */
int rt_sim_run(const rt_swarm *sw, const rt_sim_opts *opts, rt_sim_result *res);

/* ---------------------------------------------------------------------------------------- */
/* Placement for throughput                                                                   */

typedef struct rt_tplace_opts {
    rt_search_opts search; /* the max-flow search that gives the first candidate */
    rt_sim_opts sim;       /* how a candidate is scored (rt_sim_run's defaults: 660 s, 60 s warm-up) */
    double max_tpot_s;     /* latency bound on the median time per output token (0: none) */
    double max_hops;       /* bound on the mean servers per chain (0: none) */
    int max_evals;         /* simulations of the final local search (default 60) */
    int restarts;          /* local searches on the quick estimate from each seed (default 4) */
    uint64_t seed;
} rt_tplace_opts;

typedef struct rt_tplace_stats {
    int evals;                  /* simulations run */
    double start_decode_tps;    /* the best seed placement's simulated decode tokens/s */
    double decode_tps;          /* the result's */
    double tpot_p50;            /* the result's median time per output token */
    double mean_hops;           /* the result's servers per chain */
    const char *start;          /* which seed won: "search", "petals", "swarm", "current", "stripes" */
} rt_tplace_stats;

/* Places `sw` for simulated decode throughput under bounds rather than for max flow. Seeds:
 * the max-flow search's placement, Petals', Swarm's and the current one (when it covers every
 * block). Each seed is simulated (rt_sim_run), and so is each of `restarts` local searches from
 * it on a quick estimate (max flow shares, the KV bound on requests in flight, a fixed point of
 * batch cycles by Little's law with the servers' batch and prompt limits, M/G/1 link waits);
 * then the stripe placements are simulated too, the 6 the estimate ranks first of each grouping
 * (servers grouped by kind and site, or by site alone with kinds mixed and, the lean way, only
 * the fewest members that hold the range; each group one pipeline over a head, a tail or the
 * whole model at a common cut, its ends chosen by their links; swarms of at most 512 servers in
 * at most 16 groups); the moves (resize, shift, start where another ends, copy another's span,
 * become a spare, swap two) are repaired to keep every block covered. The best is refined by
 * simulated moves while the evaluations (max_evals, the seeds' simulations included) last: first
 * a sweep that moves each boundary between spans a block either way, then random moves (a
 * boundary by one or two blocks, a swap with a server of the same kind, or a perturbation),
 * each kept when the simulated decode tokens/s rise. A placement whose median TPOT
 * exceeds max_tpot_s, or whose mean hops exceed max_hops, scores its throughput scaled down by
 * the excess. Deterministic for the same inputs and seeds when search.max_evals > 0 (then the
 * max-flow search runs no clock). Writes the best placement into `sw`. */
int rt_place_throughput(rt_swarm *sw, const rt_tplace_opts *opts, rt_tplace_stats *stats);

/* The quick estimate rt_place_throughput searches on, alone: the decode tokens/s of `sw` under
 * the workload, profiles and KV setting of `so` (NULL: the defaults), 0 when a block is uncovered.
 * Costs one max flow and a fixed point over the servers; no simulation. */
int rt_estimate_decode_tps(const rt_swarm *sw, const rt_sim_opts *so, double *tps);

/* rt_place_join by the estimate: where should server `id` (new, spare or being moved) load, with
 * the others fixed? Tries every window it can hold and picks: fewest blocks left uncovered, then
 * the highest rt_estimate_decode_tps, then the longer span, then the earlier start. When the
 * others cover every block and partial execution is off, only windows that meet their spans (or
 * the model's ends) on both sides are tried, since another would carry no flow (every window if
 * none of those fits). So a window
 * that adds flow but lengthens chains more than it helps loses to one that does not. Does not
 * change `sw`. *gain (may be NULL) is the estimate's increase over the server holding nothing
 * (may be <= 0: the caller may keep it as a spare). */
int rt_place_join_throughput(const rt_swarm *sw, int id, const rt_sim_opts *so, int *first, int *last,
                             double *gain);

#endif
