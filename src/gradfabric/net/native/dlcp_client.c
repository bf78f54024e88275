/* DLCP's worker (runtime.dlcp.DlcpClient's proto.dlcp.DlcpEndpoint: one
 * DlcpReceiver of the server's sums, one DlcpSender of the worker's
 * gradients) as a native engine, driven by udp.c's gf_udp_run.
 *
 * Theory of operation
 * -------------------
 * The reference is the endpoint behind the UDP driver's envelope (a job
 * token, then the packet: wire.envelope). Each structure below is one of
 * the reference's, named after it; where the reference keeps a dict whose
 * order shows on the wire (the receiver's tensors, whose missing ranges a
 * timer requests in that order; the sender's, which a timer probes in that
 * order), the C keeps a vector in insertion order and an index by tensor id
 * (dlcp.h's VEC); a removed entry is a hole until the holes outnumber the
 * live entries.
 *
 * Two things differ from the reference by design, neither on the wire:
 * - ``gf_dc_begin`` copies the caller's tensor (the sender resends from its
 *   copy until the server ACKs it, which may be after the caller has its
 *   sum and has moved on), and the sum is written into the caller's ``out``
 *   when the tensor completes (the reference delivers an array the client
 *   copies);
 * - a queued datagram owns its bytes: an ACK read in the same batch as a
 *   range request may free the tensor the request's answer was cut from.
 *
 * One thread drives the engine (gf_udp_run, the GIL released) while DDP's
 * thread begins the next bucket: every entry point takes the engine's
 * mutex, and ``pending`` hands the driver datagrams that only ``sent``
 * frees, so a begin that grows the queue meanwhile moves nothing the driver
 * holds. A run ends each time a sum completes (``fresh``: the caller then
 * wakes whoever waits for it), or once the engine is idle: nothing queued,
 * nothing unACKed, no sum awaited.
 *
 * Counters have the reference's names (net.dlcp_native.COUNTERS, in the
 * order of C_* below).
 */
#include <pthread.h>

#include "dlcp.h"
#include "wire.h"

#define OUTBOX 64           /* datagrams handed to the driver at a time */
#define CONTROL (F_RESEND | F_ACK)
#define MAX_RTO (1LL << 40) /* proto.node.MAX_RTO_NS: 64 waits of it stay in int64 */

enum {
    C_FOREIGN, C_MALFORMED, C_BAD_TOKEN, C_DUPLICATE, C_PROBES_ANSWERED, C_COMPLETED,
    C_VALUES_LOST, C_NACKS, C_PACKETS, C_RESENT_RANGES, C_PROBES, C_LATE, /* p0 to p15 */
    NC = C_LATE + 16
};

typedef struct { /* _Incoming: a sum coming back */
    int64_t tensor, count, received;
    double bound;
    int started, done, live;
    float *values, *out; /* as it arrives; the caller's, written once complete */
    uint8_t *have, *late; /* per value: arrived; arrived after completion */
} cin_t;

typedef struct { /* _Outgoing: a tensor pushed, not yet ACKed */
    int64_t tensor, count, last_ns, backoff;
    int live;
    float *values;
    uint8_t *prio; /* per packet */
} cout_t;

typedef struct { /* a datagram waiting to leave: token, header and values */
    uint8_t *buf;
    int64_t len;
} qd_t;

typedef struct {
    pthread_mutex_t mu;
    int64_t job, rank, pp, rto, keep;
    uint8_t token[TOKEN];
    VEC(cin_t) in; /* DlcpReceiver.tensors */
    VEC(cout_t) out; /* DlcpSender.tensors */
    int32_t in_at[TENSORS], out_at[TENSORS]; /* tensor -> index + 1 (0: none) */
    uint8_t finished[TENSORS], ready[TENSORS]; /* in the finished FIFO; its sum is in */
    int64_t *fin, fhead, fn; /* DlcpReceiver.finished: the last ``keep`` completed */
    int64_t heard, backoff, heard_set; /* of the server (the receiver's one sender) */
    int64_t rx_tick, tx_tick;          /* -1: none */
    qd_t *q;
    int64_t qcap, qhead, qlen;
    gf_dgram outd[OUTBOX];
    int fresh; /* a sum completed since gf_dc_settle */
    int oom;
    int64_t counters[NC];
} gf_dc;

GF_API const char *gf_source(void) { return GRADFABRIC_SOURCE; }

GF_API gf_dc *gf_dc_new(int64_t job, int64_t rank, int64_t pp, int64_t rto, int64_t keep,
                        const uint8_t *token) {
    if (job < 0 || job > 0xFFFF || rank < 0 || rank > 0xFFFF || pp < 1 ||
        pp > MAX_WIRE_VALUES || rto < 1 || rto > MAX_RTO || keep < 1 || keep > TENSORS)
        return NULL;
    gf_dc *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->fin = calloc((size_t)keep + 1, sizeof *e->fin);
    if (!e->fin || pthread_mutex_init(&e->mu, NULL)) {
        free(e->fin), free(e);
        return NULL;
    }
    e->job = job, e->rank = rank, e->pp = pp, e->rto = rto, e->keep = keep;
    memcpy(e->token, token, TOKEN);
    e->backoff = 1, e->rx_tick = e->tx_tick = -1;
    return e;
}

static void free_in(cin_t *t) {
    free(t->values), free(t->have), free(t->late);
    t->values = NULL, t->have = t->late = NULL, t->live = 0;
}

static void free_out(cout_t *t) {
    free(t->values), free(t->prio);
    t->values = NULL, t->prio = NULL, t->live = 0;
}

GF_API void gf_dc_free(gf_dc *e) {
    if (!e) return;
    for (int64_t i = 0; i < e->in.n; i++) free_in(&e->in.v[i]);
    for (int64_t i = 0; i < e->out.n; i++) free_out(&e->out.v[i]);
    for (int64_t i = 0; i < e->qlen; i++) free(e->q[(e->qhead + i) % e->qcap].buf);
    free(e->in.v), free(e->out.v), free(e->q), free(e->fin);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

/* The counters (NC of them) into ``out``, read under the engine's lock. */
GF_API void gf_dc_counters(gf_dc *e, int64_t *out) {
    pthread_mutex_lock(&e->mu);
    memcpy(out, e->counters, sizeof e->counters);
    pthread_mutex_unlock(&e->mu);
}

static void reindex_in(gf_dc *e) {
    for (int64_t i = 0; i < e->in.n; i++) e->in_at[e->in.v[i].tensor] = (int32_t)(i + 1);
}

static void reindex_out(gf_dc *e) {
    for (int64_t i = 0; i < e->out.n; i++) e->out_at[e->out.v[i].tensor] = (int32_t)(i + 1);
}

/* ---- what the worker sends ---- */

/* Queue a datagram: the token, a header, ``count`` values from ``v``. */
static void enqueue(gf_dc *e, int64_t prio, int64_t flags, int64_t fan_in, int64_t count,
                    int64_t seq, int64_t agg, uint64_t bitmap, int64_t tensor, const float *v) {
    if (e->qlen == e->qcap) {
        int64_t cap = e->qcap ? 2 * e->qcap : 256;
        qd_t *q = malloc((size_t)cap * sizeof *q);
        if (!q) goto oom;
        for (int64_t i = 0; i < e->qlen; i++) q[i] = e->q[(e->qhead + i) % e->qcap];
        free(e->q);
        e->q = q, e->qcap = cap, e->qhead = 0;
    }
    int64_t len = TOKEN + HEADER + 4 * count;
    uint8_t *b = malloc((size_t)len);
    if (!b) goto oom;
    memcpy(b, e->token, TOKEN);
    uint8_t *h = b + TOKEN;
    uint8_t *vals = gf_header(h, prio, flags, e->job, e->rank, fan_in, count, seq, agg, bitmap);
    gf_wr16(h + 12, tensor);
    if (count) memcpy(vals, v, (size_t)(4 * count));
    e->q[(e->qhead + e->qlen++) % e->qcap] = (qd_t){b, len};
    return;
oom:
    e->oom = 1;
}

/* dlcp_control: an ACK, or a RESEND request for ``[off, off + span)``, of
 * the server's (sender 0's) ``tensor``. */
static void control(gf_dc *e, int64_t flags, int64_t tensor, int64_t off, int64_t span) {
    enqueue(e, 0, flags, span ? MAX_FAN_IN : 1, 0, 0, off, (uint64_t)span, tensor, NULL);
}

/* DlcpSender._packet: values ``[lo, hi)`` of ``t``. */
static void data(gf_dc *e, const cout_t *t, int64_t lo, int64_t hi, int64_t seq) {
    e->counters[C_PACKETS]++;
    enqueue(e, t->prio[lo / e->pp], F_FLOAT, MAX_FAN_IN, hi - lo, seq, lo, (uint64_t)t->count,
            t->tensor, t->values + lo);
}

/* DlcpReceiver._request: one RESEND per missing range of ``t``. */
static void request(gf_dc *e, const cin_t *t) {
    for (int64_t a = dlcp_find(t->have, 0, 0, t->count), any = 0; a < t->count;) {
        int64_t b = dlcp_find(t->have, 1, a, t->count);
        if (!any) e->counters[C_NACKS]++, any = 1;
        control(e, F_RESEND, t->tensor, a, b - a);
        a = dlcp_find(t->have, 0, b, t->count);
    }
}

/* ---- a tensor begun: DlcpReceiver.expect, then DlcpSender.send ---- */

/* Drop ``tensor`` from the finished FIFO (a key popped from the reference's dict). */
static void unfinish(gf_dc *e, int64_t tensor) {
    if (!e->finished[tensor]) return;
    e->finished[tensor] = 0;
    const int64_t cap = e->keep + 1;
    int64_t k = 0;
    for (int64_t i = 0; i < e->fn; i++) {
        int64_t id = e->fin[(e->fhead + i) % cap];
        if (id != tensor) e->fin[(e->fhead + k++) % cap] = id;
    }
    e->fn = k;
}

/* Forget the receiver's entry of ``tensor``: its sum, its masks, its flag. */
static void in_drop(gf_dc *e, int64_t tensor) {
    e->ready[tensor] = 0;
    if (!e->in_at[tensor]) return;
    free_in(&e->in.v[e->in_at[tensor] - 1]);
    e->in.live--;
    e->in_at[tensor] = 0;
}

/* The sum of ``tensor`` (``n`` values) is written to ``out`` once at least
 * ``(1 - bound) n`` of it is in; ``x`` is pushed, its packets most
 * important first (``back``: of the model's back half). 0, -1 on memory
 * (nothing changed), -2 for arguments the reference refuses. The copy and
 * the classes are made before the engine is locked: a large bucket does not
 * hold up the driver's reads. An entry of ``tensor`` is kept where it is, as
 * a dict keeps a key's place, and leaves the finished FIFO. */
GF_API int gf_dc_begin(gf_dc *e, int64_t tensor, const float *x, int64_t n, int64_t back,
                       double bound, float *out, int64_t now) {
    if (tensor < 0 || tensor >= TENSORS || n < 1 || !(bound >= 0 && bound < 1)) return -2;
    const int64_t np = (n + e->pp - 1) / e->pp;
    float *copy = malloc((size_t)n * 4), *sum = calloc((size_t)n, 4);
    uint8_t *have = calloc((size_t)n, 1), *prio = malloc((size_t)np);
    int64_t *order = malloc((size_t)np * sizeof *order);
    int ok = copy && sum && have && prio && order &&
             dlcp_classify(x, n, e->pp, back, prio, order) == 0;
    if (ok) memcpy(copy, x, (size_t)n * 4);
    pthread_mutex_lock(&e->mu);
    if (ok && !e->in_at[tensor] && GROW(e->in, reindex_in(e))) ok = 0;
    if (ok && !e->out_at[tensor] && GROW(e->out, reindex_out(e))) ok = 0;
    if (!ok) {
        e->oom = 1;
        pthread_mutex_unlock(&e->mu);
        free(copy), free(sum), free(have), free(prio), free(order);
        return -1;
    }
    /* DlcpReceiver.expect */
    unfinish(e, tensor);
    e->ready[tensor] = 0;
    cin_t *r;
    if (e->in_at[tensor]) {
        r = &e->in.v[e->in_at[tensor] - 1];
        free_in(r);
    } else {
        r = &e->in.v[e->in.n++];
        e->in_at[tensor] = (int32_t)e->in.n;
    }
    e->in.live++;
    *r = (cin_t){.tensor = tensor, .count = n, .bound = bound, .live = 1, .out = out,
                 .values = sum, .have = have};
    if (!e->heard_set) e->heard = now, e->heard_set = 1;
    if (e->rx_tick < 0) e->rx_tick = now + e->rto;
    /* DlcpSender.send */
    cout_t *t;
    if (e->out_at[tensor]) {
        t = &e->out.v[e->out_at[tensor] - 1];
        if (t->live) free_out(t), e->out.live--;
    } else {
        t = &e->out.v[e->out.n++];
        e->out_at[tensor] = (int32_t)e->out.n;
    }
    e->out.live++;
    *t = (cout_t){.tensor = tensor, .count = n, .last_ns = now, .backoff = 1, .live = 1,
                  .values = copy, .prio = prio};
    if (e->tx_tick < 0) e->tx_tick = now + e->rto;
    for (int64_t k = 0; k < np; k++) {
        int64_t lo = order[k] * e->pp;
        data(e, t, lo, lo + e->pp < n ? lo + e->pp : n, 0);
    }
    int rc = e->oom ? -1 : 0;
    pthread_mutex_unlock(&e->mu);
    free(order);
    return rc;
}

/* Whether ``tensor``'s sum is in its ``out``. */
GF_API int gf_dc_ready(gf_dc *e, int64_t tensor) {
    pthread_mutex_lock(&e->mu);
    int r = tensor >= 0 && tensor < TENSORS && e->ready[tensor];
    pthread_mutex_unlock(&e->mu);
    return r;
}

/* DlcpReceiver.forget: the caller gave ``tensor`` up; its sum is neither
 * awaited nor written (its push is still resent until the server ACKs). */
GF_API void gf_dc_forget(gf_dc *e, int64_t tensor) {
    if (tensor < 0 || tensor >= TENSORS) return;
    pthread_mutex_lock(&e->mu);
    unfinish(e, tensor);
    in_drop(e, tensor);
    pthread_mutex_unlock(&e->mu);
}

/* Nothing queued, nothing unACKed, no sum awaited (the caller holds the mutex). */
static int idle(const gf_dc *e) {
    if (e->qlen || e->out.live) return 0;
    for (int64_t i = 0; i < e->in.n; i++)
        if (e->in.v[i].live && !e->in.v[i].done) return 0;
    return 1;
}

GF_API int gf_dc_idle(gf_dc *e) {
    pthread_mutex_lock(&e->mu);
    int r = idle(e);
    pthread_mutex_unlock(&e->mu);
    return r;
}

/* The sums completed so far are seen: the next run ends at the next one. */
GF_API void gf_dc_settle(gf_dc *e) {
    pthread_mutex_lock(&e->mu);
    e->fresh = 0;
    pthread_mutex_unlock(&e->mu);
}

/* ---- what arrives ---- */

/* DlcpReceiver._complete's forgetting: the finished FIFO keeps ``keep``. */
static void finish(gf_dc *e, const cin_t *t) {
    if (e->finished[t->tensor]) return; /* (a dict's key set again keeps its place) */
    e->finished[t->tensor] = 1;
    e->fin[(e->fhead + e->fn++) % (e->keep + 1)] = t->tensor;
    while (e->fn > e->keep) {
        int64_t old = e->fin[e->fhead];
        e->fhead = (e->fhead + 1) % (e->keep + 1), e->fn--;
        e->finished[old] = 0;
        in_drop(e, old);
    }
}

/* DlcpReceiver.on_packet: the server's sum. */
static void on_sum(gf_dc *e, const gf_pkt *p, int64_t now) {
    cin_t *t = p->wid == 0 && e->in_at[p->layer] ? &e->in.v[e->in_at[p->layer] - 1] : NULL;
    if (p->job != e->job || !t) {
        e->counters[C_FOREIGN]++;
        return;
    }
    if (p->agg + p->count > t->count) {
        e->counters[C_MALFORMED]++;
        return;
    }
    t->started = 1;
    if (p->seq == PROBE) { /* "what do you miss?": answer at once */
        e->counters[C_PROBES_ANSWERED]++;
        if (t->done)
            control(e, F_ACK, t->tensor, 0, 0);
        else
            request(e, t);
        return;
    }
    e->heard = now, e->backoff = 1;
    int64_t took = dlcp_store(p, t->done, t->values, t->have, t->late, &e->counters[C_LATE],
                              &e->counters[C_DUPLICATE]);
    if (!took) return;
    t->received += took;
    if ((double)t->received < (1 - t->bound) * (double)t->count - 1e-9) return;
    t->done = 1;
    t->late = calloc((size_t)t->count, 1);
    if (!t->late) e->oom = 1;
    e->counters[C_COMPLETED]++;
    e->counters[C_VALUES_LOST] += t->count - t->received;
    if (t->out) memcpy(t->out, t->values, (size_t)t->count * 4);
    free(t->values), t->values = NULL; /* (a late value is counted, never stored) */
    e->ready[t->tensor] = 1, e->fresh = 1;
    int64_t tensor = t->tensor;
    finish(e, t); /* may forget the oldest finished sum: ``t`` itself stays */
    control(e, F_ACK, tensor, 0, 0);
}

/* DlcpSender.on_packet: the server's ACK or range request for a push. */
static void on_control(gf_dc *e, const gf_pkt *p, int64_t now) {
    int32_t at = e->out_at[p->layer];
    if (p->job != e->job || !at) {
        e->counters[C_FOREIGN]++;
        return;
    }
    cout_t *t = &e->out.v[at - 1];
    if (p->flags & F_ACK) {
        free_out(t);
        e->out.live--;
        e->out_at[p->layer] = 0;
        return;
    }
    int64_t lo = p->agg;
    int64_t hi = p->bitmap < (uint64_t)t->count ? lo + (int64_t)p->bitmap : t->count;
    if (hi > t->count) hi = t->count;
    t->last_ns = now, t->backoff = 1;
    e->counters[C_RESENT_RANGES]++;
    for (int64_t a = lo; a < hi; a += e->pp) data(e, t, a, a + e->pp < hi ? a + e->pp : hi, 0);
}

/* The UDP driver's datagram: the token, then DlcpEndpoint.on_packet. 0, -1
 * on memory. */
GF_API int gf_dc_datagram(gf_dc *e, const uint8_t *d, int64_t len, int64_t now) {
    pthread_mutex_lock(&e->mu);
    gf_pkt p;
    int drop = gf_unseal(&p, d, len, e->token);
    if (drop) {
        e->counters[drop == GF_BAD_TOKEN ? C_BAD_TOKEN : C_MALFORMED]++;
    } else if (p.flags & CONTROL) {
        on_control(e, &p, now);
    } else {
        on_sum(e, &p, now);
    }
    int rc = e->oom ? -1 : 0;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

/* ---- timers ---- */

GF_API int64_t gf_dc_deadline(gf_dc *e) {
    pthread_mutex_lock(&e->mu);
    int64_t at = e->rx_tick;
    if (e->tx_tick >= 0 && (at < 0 || e->tx_tick < at)) at = e->tx_tick;
    pthread_mutex_unlock(&e->mu);
    return at;
}

/* DlcpReceiver.on_timer: once the server has been silent its wait, a
 * request round for the started, incomplete sums; then the wait doubles. */
static void rx_timer(gf_dc *e, int64_t now) {
    e->rx_tick = -1;
    int silent = e->heard_set && now - e->heard >= e->rto * e->backoff, waiting = 0;
    for (int64_t i = 0; i < e->in.n; i++) {
        const cin_t *t = &e->in.v[i];
        if (!t->live || t->done) continue;
        waiting = 1;
        if (t->started && silent) request(e, t);
    }
    if (silent) e->heard = now, e->backoff = dlcp_doubled(e->backoff);
    if (waiting) e->rx_tick = now + e->rto;
}

/* DlcpSender.on_timer: probe each push not ACKed in its wait (its last
 * packet, marked), then back off. */
static void tx_timer(gf_dc *e, int64_t now) {
    e->tx_tick = -1;
    for (int64_t i = 0; i < e->out.n; i++) {
        cout_t *t = &e->out.v[i];
        if (!t->live || now - t->last_ns < e->rto * t->backoff) continue;
        t->last_ns = now;
        t->backoff = dlcp_doubled(t->backoff);
        e->counters[C_PROBES]++;
        data(e, t, (t->count - 1) / e->pp * e->pp, t->count, PROBE);
    }
    if (e->out.live) e->tx_tick = now + e->rto;
}

/* DlcpEndpoint.on_timer: the receiver, then the sender, whichever is due.
 * 0, -1 on memory. */
GF_API int gf_dc_timer(gf_dc *e, int64_t now) {
    pthread_mutex_lock(&e->mu);
    if (e->rx_tick >= 0 && e->rx_tick <= now) rx_timer(e, now);
    if (e->tx_tick >= 0 && e->tx_tick <= now) tx_timer(e, now);
    int rc = e->oom ? -1 : 0;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

/* The next datagram to send, copied into ``buf`` (``cap`` bytes) and
 * dequeued: its length (0: none; -1: larger than ``cap``, left queued). */
GF_API int64_t gf_dc_next(gf_dc *e, uint8_t *buf, int64_t cap) {
    pthread_mutex_lock(&e->mu);
    int64_t len = 0;
    if (e->qlen) {
        qd_t *d = &e->q[e->qhead];
        len = d->len <= cap ? d->len : -1;
        if (len > 0) {
            memcpy(buf, d->buf, (size_t)len);
            free(d->buf);
            e->qhead = (e->qhead + 1) % e->qcap, e->qlen--;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return len;
}

/* ---- the driver's interface (wire.h's gf_ops) ---- */

static int ops_receive(void *e, const uint8_t *d, int64_t len, int64_t now) {
    return gf_dc_datagram(e, d, len, now);
}

static int64_t ops_pending(void *v, int64_t now, const gf_dgram **out) {
    (void)now;
    gf_dc *e = v;
    pthread_mutex_lock(&e->mu);
    int64_t n = e->qlen < OUTBOX ? e->qlen : OUTBOX;
    for (int64_t i = 0; i < n; i++) {
        const qd_t *d = &e->q[(e->qhead + i) % e->qcap];
        e->outd[i] = (gf_dgram){.job = (int32_t)e->job, .rank = GF_PEER, .head = d->buf,
                                .head_len = d->len};
    }
    *out = e->outd;
    pthread_mutex_unlock(&e->mu);
    return n;
}

static void ops_sent(void *v, int64_t n, int64_t now) {
    (void)now;
    gf_dc *e = v;
    pthread_mutex_lock(&e->mu);
    for (int64_t i = 0; i < n && e->qlen; i++) {
        free(e->q[e->qhead].buf);
        e->qhead = (e->qhead + 1) % e->qcap, e->qlen--;
    }
    pthread_mutex_unlock(&e->mu);
}

static int64_t ops_timer(void *e) { return gf_dc_deadline(e); }

static int ops_handle_timer(void *e, int64_t now) { return gf_dc_timer(e, now); }

/* A sum completed since gf_dc_settle, or the engine is idle. */
static int ops_done(void *v, int quiet) {
    (void)quiet;
    gf_dc *e = v;
    pthread_mutex_lock(&e->mu);
    int done = e->fresh || idle(e);
    pthread_mutex_unlock(&e->mu);
    return done;
}

static int64_t ops_read_wait(void *e, int64_t now) {
    (void)e, (void)now;
    return 0; /* read as datagrams come */
}

static const gf_ops OPS = {ops_receive, ops_pending, ops_sent,     ops_timer,
                           ops_handle_timer, ops_done, ops_read_wait};

GF_API const gf_ops *gf_dc_ops(void) { return &OPS; }
