/* DLCP's parameter server (proto.dlcp.DlcpServer) in the native switch node.
 *
 * Theory of operation
 * -------------------
 * The reference is DlcpServer: a DlcpReceiver that takes each worker's copy
 * of a tensor within the push bound (its first packet announces it: the
 * tensor's length rides in ``bitmap``), one DlcpSender per worker for the
 * pull, and the float64 sum of the copies once every worker's is complete.
 * Each structure below is one of the reference's, named after it; where the
 * reference keeps a dict whose order shows on the wire (the receiver's
 * tensors, whose missing ranges a timer requests in that order; a sender's
 * tensors, which a timer probes in that order), the C keeps a vector in
 * insertion order and an index by key; a removed entry is a hole until the
 * holes outnumber the live entries.
 *
 * The pull's priority classes are switch_dlcp_classes.c's. The sum goes to
 * every worker from one buffer (``dpull_t``, counted references), as the
 * reference's senders share one array.
 *
 * Counters have the reference's names (net.switchpath.DLCP_COUNTERS, in
 * the order of D_* below); what leaves is queued in the node's outbox, in
 * the reference's order: a completed push's pull (when it completes the
 * sum) before the push's ACK. Timers: one deadline per receiver and per
 * sender, as the reference's (the node fires a job's when its earliest is
 * due, in the order the jobs were added).
 */
#include "dlcp.h"
#include "switch.h" /* (and through wire.h, math.h and string.h) */

#include <stdlib.h>

#define KEEP_DONE 4096         /* DlcpReceiver's keep_done */
#define CONTROL (F_RESEND | F_ACK)
#define MAX_RTO (1LL << 40) /* proto.node.MAX_RTO_NS: 64 waits of it stay in int64 */

/* _Incoming: a worker's copy of a tensor */
typedef struct {
    int64_t sender, tensor, count, received;
    int started, done, live;
    float *values;
    uint8_t *have, *late; /* per value: arrived; arrived after completion */
} din_t;

/* a sum as every worker's sender holds it */
typedef struct {
    float *values;
    uint8_t *prio; /* per packet */
    int64_t refs;
} dpull_t;

/* _Outgoing: a tensor sent to one worker, not yet ACKed */
typedef struct {
    int64_t tensor, count, last_ns, backoff;
    int live;
    dpull_t *sum;
} dout_t;


/* DlcpSender: one worker's pull */
typedef struct {
    VEC(dout_t) out;
    int32_t *at; /* tensor -> index in ``out`` + 1 (0: none) */
    int64_t tick;
} dtx_t;

typedef struct {        /* a sender's share of the receiver's index */
    int32_t *at;       /* tensor -> index in ``in`` + 1 (0: none) */
    uint8_t *finished; /* tensor -> in the finished FIFO */
} dfrom_t;

typedef struct { /* DlcpServer._merge's sum of one tensor */
    double *acc;
    uint8_t *whole; /* per value: every copy summed had it */
    int64_t len, nseen;
    uint64_t seen;
} dsum_t;

struct dlcp_t {
    int64_t workers, per_packet, rto, max_values;
    double bound;
    VEC(din_t) in; /* DlcpReceiver.tensors */
    dfrom_t from[MAX_FAN_IN];
    int64_t fin[KEEP_DONE + 1], fhead, fn; /* DlcpReceiver.finished, a FIFO of keys */
    int64_t heard[MAX_FAN_IN], backoff[MAX_FAN_IN];
    uint64_t heard_any; /* senders ``heard`` has */
    int64_t tick;        /* the receiver's (-1: none) */
    dtx_t tx[MAX_FAN_IN];
    dsum_t *sums[TENSORS];
    int8_t back[TENSORS]; /* tensor -> layer half of its push (-1: none) */
    int64_t counters[ND];
};

dlcp_t *dlcp_new(int64_t workers, double bound, int64_t per_packet, int64_t rto,
                 int64_t max_values) {
    if (workers < 1 || workers > MAX_FAN_IN || !(bound >= 0 && bound < 1) || per_packet < 1 ||
        per_packet > MAX_WIRE_VALUES || rto < 1 || rto > MAX_RTO || max_values < 1 ||
        max_values > INT32_MAX_)
        return NULL;
    dlcp_t *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->workers = workers, d->bound = bound, d->per_packet = per_packet, d->rto = rto;
    d->max_values = max_values;
    d->tick = -1;
    memset(d->back, -1, sizeof d->back);
    for (int64_t w = 0; w < workers; w++) d->backoff[w] = 1, d->tx[w].tick = -1;
    return d;
}

static void free_in(din_t *t) {
    free(t->values), free(t->have), free(t->late);
    *t = (din_t){0};
}

static void free_sum(dsum_t *m) {
    if (m) free(m->acc), free(m->whole), free(m);
}

static void free_pull(dpull_t *p) {
    if (p && --p->refs <= 0) free(p->values), free(p->prio), free(p);
}

static void free_out(dout_t *t) {
    free_pull(t->sum);
    *t = (dout_t){0};
}

void dlcp_free(dlcp_t *d) {
    if (!d) return;
    for (int64_t i = 0; i < d->in.n; i++) free_in(&d->in.v[i]);
    free(d->in.v);
    for (int64_t w = 0; w < MAX_FAN_IN; w++) {
        free(d->from[w].at), free(d->from[w].finished);
        for (int64_t i = 0; i < d->tx[w].out.n; i++) free_out(&d->tx[w].out.v[i]);
        free(d->tx[w].out.v), free(d->tx[w].at);
    }
    for (int64_t t = 0; t < TENSORS; t++) free_sum(d->sums[t]);
    free(d);
}

int64_t *dlcp_counters(dlcp_t *d) { return d->counters; }
/* ---- the ordered vectors ---- */

static void reindex_in(dlcp_t *d) {
    for (int64_t i = 0; i < d->in.n; i++) {
        din_t *t = &d->in.v[i];
        d->from[t->sender].at[t->tensor] = (int32_t)(i + 1);
    }
}

static void reindex_out(dtx_t *x) {
    for (int64_t i = 0; i < x->out.n; i++) x->at[x->out.v[i].tensor] = (int32_t)(i + 1);
}

static din_t *in_get(dlcp_t *d, int64_t sender, int64_t tensor) {
    if (sender < 0 || sender >= d->workers || !d->from[sender].at) return NULL;
    int32_t i = d->from[sender].at[tensor];
    return i ? &d->in.v[i - 1] : NULL;
}

static void in_drop(dlcp_t *d, int64_t sender, int64_t tensor) {
    din_t *t = in_get(d, sender, tensor);
    if (!t) return;
    free_in(t);
    d->in.live--;
    d->from[sender].at[tensor] = 0;
}

/* ---- what the server sends ---- */

/* dlcp_control: an ACK or a RESEND request for ``[off, off + span)`` of
 * worker ``w``'s copy of ``tensor``. */
static void control(gf_switch *s, const job_t *j, int64_t w, int64_t flags, int64_t tensor,
                    int64_t off, int64_t span) {
    uint8_t *h = sw_reserve(s, j, w, HEADER);
    if (!h) return;
    gf_header(h, 0, flags, j->id, 0, span ? MAX_FAN_IN : 1, 0, w, off, (uint64_t)span);
    gf_wr16(h + 12, tensor);
}

/* DlcpSender._packet: values ``[lo, hi)`` of ``t`` to worker ``w``. */
static void data(gf_switch *s, const job_t *j, dlcp_t *d, int64_t w, const dout_t *t,
                 int64_t lo, int64_t hi, int64_t seq) {
    d->counters[D_PACKETS]++;
    uint8_t *h = sw_reserve(s, j, w, HEADER + 4 * (hi - lo));
    if (!h) return;
    uint8_t *v = gf_header(h, t->sum->prio[lo / d->per_packet], F_FLOAT, j->id, 0, MAX_FAN_IN,
                           hi - lo, seq, lo, (uint64_t)t->count);
    gf_wr16(h + 12, t->tensor);
    memcpy(v, t->sum->values + lo, (size_t)(4 * (hi - lo)));
}

/* DlcpReceiver._request: one RESEND per missing range of ``t``. */
static void request(gf_switch *s, const job_t *j, dlcp_t *d, const din_t *t) {
    for (int64_t a = dlcp_find(t->have, 0, 0, t->count), any = 0; a < t->count;) {
        int64_t b = dlcp_find(t->have, 1, a, t->count);
        if (!any) d->counters[D_NACKS]++, any = 1;
        control(s, j, t->sender, F_RESEND, t->tensor, a, b - a);
        a = dlcp_find(t->have, 0, b, t->count);
    }
}

/* ---- the pull ---- */

/* DlcpSender.send of ``sum`` to worker ``w`` (``order``: its packets most
 * important first): kept until ACKed. */
static void pull(gf_switch *s, const job_t *j, dlcp_t *d, int64_t w, int64_t tensor,
                 dpull_t *sum, int64_t count, const int64_t *order, int64_t now) {
    dtx_t *x = &d->tx[w];
    int64_t pp = d->per_packet, np = (count + pp - 1) / pp;
    if (!x->at && !(x->at = calloc(TENSORS, sizeof(int32_t)))) goto oom;
    dout_t *t = x->at[tensor] ? &x->out.v[x->at[tensor] - 1] : NULL;
    if (t) { /* a tensor id not yet ACKed, sent again: it keeps its place */
        free_out(t);
        x->out.live--;
    } else {
        if (GROW(x->out, reindex_out(x))) goto oom;
        t = &x->out.v[x->out.n++];
        x->at[tensor] = (int32_t)x->out.n;
    }
    *t = (dout_t){.tensor = tensor, .count = count, .last_ns = now, .backoff = 1, .live = 1,
                  .sum = sum};
    sum->refs++, x->out.live++;
    if (x->tick < 0) x->tick = now + d->rto;
    for (int64_t k = 0; k < np; k++) {
        int64_t lo = order[k] * pp;
        data(s, j, d, w, t, lo, lo + pp < count ? lo + pp : count, 0);
    }
    return;
oom:
    s->oom = 1;
}

/* DlcpServer._merge: worker ``w``'s complete copy ``t`` into the tensor's
 * sum, and the values it had into those every copy had; the last one sends
 * the sum to every worker. */
static void merge(gf_switch *s, const job_t *j, dlcp_t *d, const din_t *t, int64_t now) {
    int64_t tensor = t->tensor, w = t->sender, n = t->count;
    dsum_t *m = d->sums[tensor];
    if (!m) {
        m = d->sums[tensor] = calloc(1, sizeof *m);
        if (m) m->acc = calloc((size_t)n, sizeof(double)), m->whole = malloc((size_t)n);
        if (!m || !m->acc || !m->whole) {
            free_sum(m), d->sums[tensor] = NULL;
            goto oom;
        }
        memset(m->whole, 1, (size_t)n);
        m->len = n;
    }
    if (m->seen >> w & 1 || m->len != n) {
        d->counters[D_MISMATCH]++;
        return;
    }
    for (int64_t i = 0; i < n; i++) m->acc[i] += (double)t->values[i], m->whole[i] &= t->have[i];
    m->seen |= 1ULL << w, m->nseen++;
    if (m->nseen < d->workers) return;
    d->sums[tensor] = NULL;
    for (int64_t i = 0; i < n; i++) d->counters[D_INCOMPLETE] += !m->whole[i];
    int64_t layer = d->back[tensor] < 0 ? 0 : d->back[tensor];
    d->back[tensor] = -1;
    d->counters[D_SUMS]++;
    int64_t np = (n + d->per_packet - 1) / d->per_packet;
    dpull_t *sum = calloc(1, sizeof *sum);
    int64_t *order = malloc((size_t)np * sizeof *order);
    if (sum) sum->values = malloc((size_t)n * 4), sum->prio = malloc((size_t)np);
    if (!order || !sum || !sum->values || !sum->prio) {
        if (sum) free(sum->values), free(sum->prio), free(sum);
        free(order), free_sum(m);
        goto oom;
    }
    for (int64_t i = 0; i < n; i++) sum->values[i] = (float)m->acc[i];
    sum->refs = 1; /* this call's, until every worker's sender holds it */
    if (dlcp_classify(sum->values, n, d->per_packet, layer, sum->prio, order) == 0)
        for (int64_t u = 0; u < d->workers; u++) pull(s, j, d, u, tensor, sum, n, order, now);
    else
        s->oom = 1;
    free_pull(sum), free(order), free_sum(m);
    return;
oom:
    s->oom = 1;
}

/* ---- the receiver: the workers' pushes ---- */

/* DlcpReceiver.expect under the push bound (a server's: announced by the
 * first packet). */
static din_t *expect(gf_switch *s, dlcp_t *d, int64_t w, int64_t tensor, int64_t count,
                     int64_t now) {
    dfrom_t *f = &d->from[w];
    if (!f->at) {
        f->at = calloc(TENSORS, sizeof(int32_t)), f->finished = calloc(TENSORS, 1);
        if (!f->at || !f->finished) {
            free(f->at), free(f->finished), f->at = NULL, f->finished = NULL;
            goto oom;
        }
    }
    if (GROW(d->in, reindex_in(d))) goto oom;
    din_t *t = &d->in.v[d->in.n];
    *t = (din_t){.sender = w, .tensor = tensor, .count = count, .live = 1,
                 .values = calloc((size_t)count, 4), .have = calloc((size_t)count, 1)};
    if (!t->values || !t->have) {
        free_in(t);
        goto oom;
    }
    d->in.n++, d->in.live++;
    f->at[tensor] = (int32_t)d->in.n;
    if (!(d->heard_any >> w & 1)) d->heard[w] = now, d->heard_any |= 1ULL << w;
    if (d->tick < 0) d->tick = now + d->rto;
    return t;
oom:
    s->oom = 1;
    return NULL;
}

/* DlcpReceiver._complete's server half: the finished FIFO keeps KEEP_DONE. */
static void finish(dlcp_t *d, din_t *t) {
    d->fin[(d->fhead + d->fn++) % (KEEP_DONE + 1)] = t->sender << 16 | t->tensor;
    d->from[t->sender].finished[t->tensor] = 1;
    while (d->fn > KEEP_DONE) {
        int64_t old = d->fin[d->fhead];
        d->fhead = (d->fhead + 1) % (KEEP_DONE + 1), d->fn--;
        d->from[old >> 16].finished[old & 0xFFFF] = 0;
        in_drop(d, old >> 16, old & 0xFFFF);
    }
}

static void on_push(gf_switch *s, const job_t *j, dlcp_t *d, const gf_pkt *p, int64_t now) {
    int64_t w = p->wid, tensor = p->layer;
    int mine = w < d->workers; /* DlcpReceiver.from_sender (the node checked the job) */
    if (mine && d->back[tensor] < 0) d->back[tensor] = (int8_t)(p->prio >> 4);
    din_t *t = in_get(d, w, tensor);
    if (!t && mine && p->bitmap > 0 && !(d->from[w].finished && d->from[w].finished[tensor])) {
        if (p->bitmap > (uint64_t)d->max_values) { /* (not gigabytes for a stranger) */
            d->counters[D_TOO_LONG]++;
            return;
        }
        t = expect(s, d, w, tensor, (int64_t)p->bitmap, now);
        if (!t) return;
    }
    if (!t) {
        d->counters[D_FOREIGN]++;
        return;
    }
    if (p->agg + p->count > t->count) {
        d->counters[D_MALFORMED]++;
        return;
    }
    t->started = 1;
    if (p->seq == PROBE) { /* "what do you miss?": answer at once */
        d->counters[D_PROBES_ANSWERED]++;
        if (t->done)
            control(s, j, w, F_ACK, tensor, 0, 0);
        else
            request(s, j, d, t);
        return;
    }
    d->heard[w] = now, d->heard_any |= 1ULL << w, d->backoff[w] = 1;
    int64_t took = dlcp_store(p, t->done, t->values, t->have, t->late, &d->counters[D_LATE],
                              &d->counters[D_DUPLICATE]);
    if (!took) return;
    t->received += took;
    if (t->done || (double)t->received < (1 - d->bound) * (double)t->count - 1e-9) return;
    t->done = 1;
    t->late = calloc((size_t)t->count, 1);
    if (!t->late) s->oom = 1;
    d->counters[D_COMPLETED]++;
    d->counters[D_VALUES_LOST] += t->count - t->received;
    finish(d, t); /* may drop the oldest finished copy: ``t`` itself stays */
    t = in_get(d, w, tensor);
    merge(s, j, d, t, now);
    control(s, j, w, F_ACK, tensor, 0, 0);
}

/* DlcpSender.on_packet: a worker's ACK or range request for the pull. */
static void on_control(gf_switch *s, const job_t *j, dlcp_t *d, const gf_pkt *p, int64_t now) {
    if (p->wid >= d->workers && d->workers > 1) {
        d->counters[D_FOREIGN]++;
        return;
    }
    int64_t w = d->workers > 1 ? p->wid : 0;
    dtx_t *x = &d->tx[w];
    int32_t at = x->at ? x->at[p->layer] : 0;
    if (!at) {
        d->counters[D_FOREIGN]++;
        return;
    }
    dout_t *t = &x->out.v[at - 1];
    if (p->flags & F_ACK) {
        free_out(t);
        x->out.live--;
        x->at[p->layer] = 0;
        return;
    }
    int64_t lo = p->agg;
    int64_t hi = p->bitmap < (uint64_t)t->count ? lo + (int64_t)p->bitmap : t->count;
    if (hi > t->count) hi = t->count;
    t->last_ns = now, t->backoff = 1;
    d->counters[D_RESENT_RANGES]++;
    for (int64_t a = lo; a < hi; a += d->per_packet)
        data(s, j, d, w, t, a, a + d->per_packet < hi ? a + d->per_packet : hi, 0);
}

void dlcp_packet(gf_switch *s, job_t *j, const gf_pkt *p, int64_t now) {
    if (p->flags & CONTROL)
        on_control(s, j, j->dlcp, p, now);
    else
        on_push(s, j, j->dlcp, p, now);
}

/* ---- timers ---- */

int64_t dlcp_deadline(const dlcp_t *d) {
    int64_t at = d->tick;
    for (int64_t w = 0; w < d->workers; w++)
        if (d->tx[w].tick >= 0 && (at < 0 || d->tx[w].tick < at)) at = d->tx[w].tick;
    return at;
}

/* DlcpReceiver.on_timer: a request round for each silent sender's started,
 * incomplete copies, then that sender's wait doubles. */
static void rx_timer(gf_switch *s, const job_t *j, dlcp_t *d, int64_t now) {
    d->tick = -1;
    uint64_t silent = 0;
    for (int64_t w = 0; w < d->workers; w++)
        if (d->heard_any >> w & 1 && now - d->heard[w] >= d->rto * d->backoff[w])
            silent |= 1ULL << w;
    int waiting = 0;
    for (int64_t i = 0; i < d->in.n; i++) {
        din_t *t = &d->in.v[i];
        if (!t->live || t->done) continue;
        waiting = 1;
        if (t->started && silent >> t->sender & 1) request(s, j, d, t);
    }
    for (int64_t w = 0; w < d->workers; w++)
        if (silent >> w & 1) {
            d->heard[w] = now;
            d->backoff[w] = dlcp_doubled(d->backoff[w]);
        }
    if (waiting) d->tick = now + d->rto;
}

/* DlcpSender.on_timer: probe each tensor not ACKed in its wait (its last
 * packet, marked), then back off. */
static void tx_timer(gf_switch *s, const job_t *j, dlcp_t *d, int64_t w, int64_t now) {
    dtx_t *x = &d->tx[w];
    x->tick = -1;
    for (int64_t i = 0; i < x->out.n; i++) {
        dout_t *t = &x->out.v[i];
        if (!t->live || now - t->last_ns < d->rto * t->backoff) continue;
        t->last_ns = now;
        t->backoff = dlcp_doubled(t->backoff);
        d->counters[D_PROBES]++;
        data(s, j, d, w, t, (t->count - 1) / d->per_packet * d->per_packet, t->count, PROBE);
    }
    if (x->out.live) x->tick = now + d->rto;
}

/* DlcpEndpoint.on_timer: the receiver, then each sender, whichever is due. */
void dlcp_timer(gf_switch *s, job_t *j, int64_t now) {
    dlcp_t *d = j->dlcp;
    if (d->tick >= 0 && d->tick <= now) rx_timer(s, j, d, now);
    for (int64_t w = 0; w < d->workers; w++)
        if (d->tx[w].tick >= 0 && d->tx[w].tick <= now) tx_timer(s, j, d, w, now);
}

/* DlcpServer.missing_peers: workers with a copy of some tensor incomplete. */
uint64_t dlcp_missing(const job_t *j) {
    uint64_t bits = 0;
    const dlcp_t *d = j->dlcp;
    for (int64_t i = 0; d && i < d->in.n; i++)
        if (d->in.v[i].live && !d->in.v[i].done) bits |= 1ULL << d->in.v[i].sender;
    return bits;
}
