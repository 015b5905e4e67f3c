/* rt-sim.c -- discrete-event simulator of requests flowing through IWRR-chosen chains. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "router-impl.h"
#include "status.h"

/*
 * Model (documented in router.h): a request takes a chain from rt_route (reserving prompt +
 * output tokens of KV on every hop), then runs its prompt step (w = prompt_len tokens) and
 * output_len decode steps (w = 1) one after another. A step goes source -> hop 1 -> ... ->
 * sink. Each server is one processor with two FIFO queues, decode steps served before
 * prompts (as continuous-batching servers prioritise running sequences); a job of w tokens
 * over j of its k blocks takes w * (j / k) / tput(k) seconds (tput is the batched throughput
 * the profile measured, so the server is a fluid token processor and concurrency is what
 * fills it). Closed-loop requests start spread over the first 10 s. Each transfer
 * costs latency + w * bytes / bandwidth with tok bytes to/from the coordinator and tok + act
 * between servers; links are not shared queues (they are far from binding in Helix's data).
 */

enum { EV_ARRIVE = 0, EV_NEW = 1, EV_DONE = 2 };

typedef struct sim_event {
    double t;
    uint64_t seq;
    int kind;
    int req;
    int hop;
} sim_event;

typedef struct sim_req {
    rt_path *path;
    double arrival, step_start;
    int prompt_len, output_len, step, w;
    int next_free;
} sim_req;

typedef struct job_queue {
    int *req, *hop;
    int head, tail, cap;
} job_queue;

typedef struct srv_state {
    int busy;
    job_queue q[2]; /* 0: decode steps, 1: prompts */
} srv_state;

static int jq_push(job_queue *q, int req, int hop) {
    if (q->tail == q->cap) {
        int live = q->tail - q->head;
        if (q->head > 0 && live < q->cap / 2) {
            memmove(q->req, q->req + q->head, (size_t)live * sizeof(int));
            memmove(q->hop, q->hop + q->head, (size_t)live * sizeof(int));
        } else {
            int c = q->cap ? q->cap * 2 : 64;
            int *r = malloc((size_t)c * sizeof(int)), *h = malloc((size_t)c * sizeof(int));
            if (!r || !h) {
                free(r), free(h);
                return fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
            }
            if (live) {
                memcpy(r, q->req + q->head, (size_t)live * sizeof(int));
                memcpy(h, q->hop + q->head, (size_t)live * sizeof(int));
            }
            free(q->req), free(q->hop);
            q->req = r, q->hop = h, q->cap = c;
        }
        q->head = 0;
        q->tail = live;
    }
    q->req[q->tail] = req;
    q->hop[q->tail++] = hop;
    return FU_OK;
}

typedef struct sim {
    const rt_swarm *sw;
    rt_router *router;
    sim_event *heap;
    int nh, caph;
    uint64_t seq;
    sim_req *req;
    int nreq, capreq, free_head;
    int *wait; /* FIFO of requests waiting for KV room */
    int wait_head, wait_tail, capwait;
    srv_state *srv; /* [n] */
    const rt_sim_opts *o;
    rt_sim_result *res;
    double t0, t1;
    double prompt_lat_sum, decode_lat_sum;
    long prompt_n, decode_n;
    uint64_t rng;
} sim;

static int heap_push(sim *s, double t, int kind, int req, int hop) {
    if (s->nh == s->caph) {
        int c = s->caph ? s->caph * 2 : 1024;
        sim_event *h = realloc(s->heap, (size_t)c * sizeof *h);
        if (!h) return fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
        s->heap = h;
        s->caph = c;
    }
    sim_event e = {t, s->seq++, kind, req, hop};
    int i = s->nh++;
    while (i > 0) {
        int p = (i - 1) / 2;
        sim_event *q = &s->heap[p];
        if (q->t < e.t || (q->t == e.t && q->seq < e.seq)) break;
        s->heap[i] = *q;
        i = p;
    }
    s->heap[i] = e;
    return FU_OK;
}

static sim_event heap_pop(sim *s) {
    sim_event top = s->heap[0], last = s->heap[--s->nh];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= s->nh) break;
        if (c + 1 < s->nh && (s->heap[c + 1].t < s->heap[c].t ||
                              (s->heap[c + 1].t == s->heap[c].t && s->heap[c + 1].seq < s->heap[c].seq)))
            c++;
        if (last.t < s->heap[c].t || (last.t == s->heap[c].t && last.seq < s->heap[c].seq)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    s->heap[i] = last;
    return top;
}

static int req_new(sim *s, double now, int prompt_len, int output_len) {
    if (s->free_head < 0) {
        if (s->nreq == s->capreq) {
            int c = s->capreq ? s->capreq * 2 : 256;
            sim_req *r = realloc(s->req, (size_t)c * sizeof *r);
            if (!r) return fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
            s->req = r;
            s->capreq = c;
        }
        s->req[s->nreq].next_free = -1;
        s->free_head = s->nreq++;
    }
    int id = s->free_head;
    sim_req *r = &s->req[id];
    s->free_head = r->next_free;
    memset(r, 0, sizeof *r);
    r->arrival = now;
    r->prompt_len = prompt_len > 0 ? prompt_len : 1;
    r->output_len = output_len > 0 ? output_len : 0;
    return id;
}

static double link_delay(const sim *s, int from, int to, int w) {
    rt_link l = rt_swarm_link(s->sw, from, to);
    double bytes = (from == RT_SOURCE || to == RT_SINK) ? s->sw->model.token_bytes
                                                        : s->sw->model.token_bytes + s->sw->model.act_bytes;
    return l.latency + (l.bandwidth > 0 ? w * bytes / l.bandwidth : 0);
}

static int start_step(sim *s, int id, double now) {
    sim_req *r = &s->req[id];
    r->step_start = now;
    r->w = r->step == 0 ? r->prompt_len : 1;
    return heap_push(s, now + link_delay(s, RT_SOURCE, r->path->servers[0], r->w), EV_ARRIVE, id, 0);
}

/* Tries to route request id; queues it if the swarm is full. 1 if started, 0 if queued or
 * rejected, < 0 on error. */
static int admit(sim *s, int id, double now, int may_queue) {
    sim_req *r = &s->req[id];
    int rc = rt_route(s->router, r->prompt_len + r->output_len, &r->path);
    if (rc == FU_ERR_EXHAUSTED && may_queue) {
        if (s->wait_tail - s->wait_head == s->capwait || s->wait_tail == s->capwait) {
            int live = s->wait_tail - s->wait_head;
            int c = s->capwait ? s->capwait * 2 : 256;
            int *w = malloc((size_t)c * sizeof(int));
            if (!w) return fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
            for (int i = 0; i < live; i++) w[i] = s->wait[s->wait_head + i];
            free(s->wait);
            s->wait = w;
            s->capwait = c;
            s->wait_head = 0;
            s->wait_tail = live;
        }
        s->wait[s->wait_tail++] = id;
        return 0;
    }
    if (rc == FU_ERR_EXHAUSTED) return 2; /* still full */
    if (rc) {
        s->res->rejected++;
        r->next_free = s->free_head;
        s->free_head = id;
        return rc == FU_ERR_NOT_FOUND ? 0 : rc;
    }
    int e = start_step(s, id, now);
    return e ? e : 1;
}

static int new_request(sim *s, double now) {
    int pl = s->o->prompt_len > 0 ? s->o->prompt_len : 750;
    int ol = s->o->output_len > 0 ? s->o->output_len : 240;
    int id = req_new(s, now, pl, ol);
    if (id < 0) return id;
    int rc = admit(s, id, now, 1);
    return rc < 0 ? rc : 0;
}

/* Starts the next queued job on idle server v. */
static int serve_next(sim *s, int v, double now) {
    srv_state *st = &s->srv[v];
    job_queue *q = st->q[0].head < st->q[0].tail ? &st->q[0] : &st->q[1];
    if (st->busy || q->head == q->tail) return FU_OK;
    int id = q->req[q->head], hop = q->hop[q->head];
    q->head++;
    sim_req *r = &s->req[id];
    const rt_server *sv = &s->sw->servers[v];
    int k = sv->last - sv->first, j = r->path->last[hop] - r->path->first[hop];
    double tp = rt_swarm_tput(s->sw, v, k);
    st->busy = 1;
    return heap_push(s, now + (tp > 0 ? r->w * ((double)j / k) / tp : 0), EV_DONE, id, hop);
}

static int on_done(sim *s, const sim_event *ev, double now) {
    sim_req *r = &s->req[ev->req];
    int v = r->path->servers[ev->hop];
    s->srv[v].busy = 0;
    int next = ev->hop + 1 < r->path->n_hops ? r->path->servers[ev->hop + 1] : RT_SINK;
    int rc = heap_push(s, now + link_delay(s, v, next, r->w), EV_ARRIVE, ev->req, ev->hop + 1);
    return rc ? rc : serve_next(s, v, now);
}

static int on_arrive(sim *s, const sim_event *ev, double now) {
    sim_req *r = &s->req[ev->req];
    rt_path *p = r->path;
    if (ev->hop < p->n_hops) {
        int v = p->servers[ev->hop];
        int rc = jq_push(&s->srv[v].q[r->step == 0], ev->req, ev->hop);
        return rc ? rc : serve_next(s, v, now);
    }
    /* step finished at the coordinator */
    int in_window = now >= s->t0 && now <= s->t1;
    if (r->step == 0) {
        if (in_window) s->res->prompt_tps += r->prompt_len;
        s->prompt_lat_sum += now - r->arrival;
        s->prompt_n++;
    } else {
        if (in_window) s->res->decode_tps += 1;
        s->decode_lat_sum += now - r->step_start;
        s->decode_n++;
    }
    r->step++;
    if (r->step <= r->output_len) return start_step(s, ev->req, now);
    /* done */
    rt_release(r->path);
    r->path = NULL;
    if (in_window) s->res->completed++;
    r->next_free = s->free_head;
    s->free_head = ev->req;
    while (s->wait_head < s->wait_tail) {
        int rc = admit(s, s->wait[s->wait_head], now, 0);
        if (rc < 0) return rc;
        if (rc == 2) break;
        s->wait_head++;
    }
    if (!s->o->trace && s->o->arrival_rate <= 0) return new_request(s, now);
    return FU_OK;
}

int rt_sim_run(const rt_swarm *sw, const rt_sim_opts *opts, rt_sim_result *res) {
    if (!sw || !opts || !res) return fu_errorf(FU_ERR_INVALID, "rt_sim_run: NULL argument");
    memset(res, 0, sizeof *res);
    sim s;
    memset(&s, 0, sizeof s);
    s.sw = sw;
    s.o = opts;
    s.res = res;
    s.free_head = -1;
    s.rng = opts->seed ^ 0xabcdef12345ULL;
    double dur = opts->duration_s > 0 ? opts->duration_s : 600;
    double warm = opts->warmup_s > 0 ? opts->warmup_s : (opts->warmup_s < 0 ? 0 : 60);
    if (warm >= dur) warm = 0;
    s.t0 = warm;
    s.t1 = dur;
    int rc = rt_router_init(&s.router, sw, &opts->route);
    if (rc) return rc;
    res->max_flow = rt_router_flow(s.router)->value;
    s.srv = calloc((size_t)sw->n_servers + 1, sizeof *s.srv);
    if (!s.srv) {
        rc = fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
        goto out;
    }
    if (opts->trace) {
        for (int i = 0; i < opts->n_trace && !rc; i++)
            if (opts->trace[i].arrival_s <= dur)
                rc = heap_push(&s, opts->trace[i].arrival_s, EV_NEW, i, 0);
    } else if (opts->arrival_rate > 0) {
        rc = heap_push(&s, -log(1 - rt__rng_unit(&s.rng)) / opts->arrival_rate, EV_NEW, -1, 0);
    } else {
        int c = opts->concurrency > 0 ? opts->concurrency : 256;
        for (int i = 0; i < c && !rc; i++) rc = heap_push(&s, 10.0 * i / c, EV_NEW, -1, 0);
    }
    while (!rc && s.nh > 0) {
        sim_event ev = heap_pop(&s);
        if (ev.t > dur) break;
        if (ev.kind == EV_NEW) {
            if (opts->trace) {
                const rt_sim_request *q = &opts->trace[ev.req];
                int id = req_new(&s, ev.t, q->prompt_len, q->output_len);
                rc = id < 0 ? id : admit(&s, id, ev.t, 1);
            } else if (opts->arrival_rate <= 0) {
                rc = new_request(&s, ev.t);
            } else {
                rc = new_request(&s, ev.t);
                double nt = ev.t - log(1 - rt__rng_unit(&s.rng)) / opts->arrival_rate;
                if (!rc && nt <= dur) rc = heap_push(&s, nt, EV_NEW, -1, 0);
            }
            if (rc > 0) rc = 0;
        } else if (ev.kind == EV_DONE) {
            rc = on_done(&s, &ev, ev.t);
        } else {
            rc = on_arrive(&s, &ev, ev.t);
        }
    }
    if (rc > 0) rc = 0;
    double span = dur - warm;
    res->decode_tps /= span;
    res->prompt_tps /= span;
    res->mean_prompt_latency_s = s.prompt_n ? s.prompt_lat_sum / s.prompt_n : 0;
    res->mean_decode_latency_s = s.decode_n ? s.decode_lat_sum / s.decode_n : 0;
out:
    for (int i = 0; i < s.nreq; i++)
        if (s.req[i].path) rt_release(s.req[i].path);
    rt_router_free(s.router);
    for (int i = 0; s.srv && i < sw->n_servers; i++)
        for (int k = 0; k < 2; k++) free(s.srv[i].q[k].req), free(s.srv[i].q[k].hop);
    free(s.heap), free(s.req), free(s.wait), free(s.srv);
    return rc;
}
