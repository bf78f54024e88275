/* The native helped host: proto.host.HostEngine in C, behind the datagram
 * interface, for an SA-ATP worker host on a route of one switch (SwitchML's
 * static slots, ATP's and ESA's hashed pool).
 *
 * Theory of operation
 * -------------------
 * A host is its own stream and, once it helps, one shadow stream per
 * straggler it sends for (proto.host). Each stream is a
 * proto.worker.WorkerEngine and each function below names the method it
 * mirrors, whose docstring says why. A stream keeps what the reference
 * keeps: the queue of pushed packets not sent yet (a FIFO), the outstanding
 * ones sorted by sequence, the sequences answered above ``base`` (a ring of
 * bits), and the retransmission deadlines as a FIFO of (deadline, seq) (one
 * RTO: created sorted; stale entries skipped where they surface). A pushed
 * packet's values are copied in: the caller may reuse its array at once.
 *
 * Unlike the native worker (worker.c), results come for sequences this host
 * has not sent (someone helped it), taken up to ``max_ahead`` past
 * ``base``; pushes may skip sequences (``at_seq``); a shadow sends under the
 * straggler's bit, flagged HELP, never past its host's own window; a NOTIFY
 * is an event for the application, which owns the compute and decides
 * whether to help. Results go into one int64 array it registers (the sink),
 * each sequence's values at ``seq * vpp``; a result delivered, a help
 * request and a stream giving up are events. Datagrams are built whole when
 * queued (a result may free a packet's values while it waits to leave).
 * Sequences are the wire's 32 bits as they come, as in the reference's
 * asyncio driver: a host's job lives below 2**32.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "wire.h"

enum { ROUTE_STATIC = 0, ROUTE_HASHED = 1 };
/* counter indices, net.hostpath.COUNTERS names them: WorkerEngine's, then HostEngine's
 * and the envelope's (only the own stream counts those) */
enum {
    C_RESULTS, C_AHEAD, C_DUPLICATE, C_FOREIGN, C_STALE_NACK, C_NACK_RESENDS, C_FAST,
    C_RETRANSMITS, C_REARMED, C_HALVINGS, C_BAD_TOKEN, C_MALFORMED, C_BAD_NOTIFY, C_HELP_REQUESTS,
    NCOUNTERS
};
/* events, as (kind, a, b): a result delivered (seq, count), a help request
 * (straggler, from seq), a stream gave up (stream, seq) */
enum { EV_RESULT = 1, EV_HELP = 2, EV_FAIL = 3 };
#define OWN (-1)

typedef struct {
    int64_t seq, count, prio, deadline, tries;
    int32_t *vals;
} pkt_t;

typedef struct {
    uint64_t bit; /* the header every packet of the stream carries */
    int64_t flags;
    int64_t base, next_seq, highest, fast_seq, fast_from, recover_seq;
    double cwnd, max_cwnd;
    pkt_t *queue; /* [qhead, qlen) */
    int64_t qhead, qlen, qcap;
    pkt_t *out; /* sorted by seq */
    int64_t olen, ocap;
    uint64_t *done; /* the sequences answered above base, bit seq % ndone of a ring */
    int64_t ndone;  /* its bits: a power of two, 0 until the first */
    int64_t *timers; /* pairs (deadline, seq), [thead, tlen) */
    int64_t thead, tlen, tcap;
    int64_t counters[NCOUNTERS];
} stream_t;

typedef struct {
    int64_t job, worker, fan_in, route, slot_base, slot_count, pool_slots, resend_flag, rto_ns,
        max_retries, fast_k, ecn_window, nack, max_ahead, window, vpp, first_seq;
    double max_cwnd;
    uint8_t token[TOKEN];
    stream_t own;
    stream_t *shadow[MAX_FAN_IN];
    int64_t order[MAX_FAN_IN], nshadows; /* the shadows in the order they were made */
    int64_t *sink, sink_seqs;
    int64_t *events, elen, ecap;
    uint8_t *tx; /* datagrams to send, laid end to end, [txsent, txlen) */
    int64_t *txlens, txn, txsent, txbytes, txcap, txlcap;
    gf_dgram *outbox; /* what pending hands the driver: all that waits */
    int64_t outcap;
} gf_host;

GF_API const char *gf_source(void) { return GRADFABRIC_SOURCE; }

/* A vector of ``size``-byte items with room for ``need``. */
static int room(void **buf, int64_t *cap, int64_t need, size_t size) {
    if (need <= *cap) return 0;
    int64_t c = *cap ? *cap * 2 : 64;
    while (c < need) c *= 2;
    void *n = realloc(*buf, (size_t)c * size);
    if (!n) return -1;
    *buf = n, *cap = c;
    return 0;
}

static int event(gf_host *h, int64_t kind, int64_t a, int64_t b) {
    if (room((void **)&h->events, &h->ecap, h->elen + 3, 8)) return -1;
    h->events[h->elen++] = kind, h->events[h->elen++] = a, h->events[h->elen++] = b;
    return 0;
}

/* The index of the first outstanding packet at or above ``seq`` (binary search). */
static int64_t out_lower(const stream_t *s, int64_t seq) {
    int64_t lo = 0, hi = s->olen;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (s->out[mid].seq < seq) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static int64_t out_find(const stream_t *s, int64_t seq) {
    int64_t i = out_lower(s, seq);
    return i < s->olen && s->out[i].seq == seq ? i : -1;
}

/* WorkerEngine.done_above, a ring of bits over (base, base + ndone): every
 * answered sequence lies there (results are taken below base + max_ahead
 * and base only rises), each found, added and dropped in constant time. */
static int is_done(const stream_t *s, int64_t seq) {
    return seq > s->base && seq - s->base < s->ndone &&
           (s->done[(seq & (s->ndone - 1)) >> 6] >> (seq & 63) & 1);
}

static void undone(stream_t *s, int64_t seq) {
    s->done[(seq & (s->ndone - 1)) >> 6] &= ~(1ULL << (seq & 63));
}

static int add_done(stream_t *s, int64_t seq) {
    if (seq - s->base >= s->ndone) { /* a larger ring, every answered sequence moved over */
        int64_t n = s->ndone ? s->ndone : 256;
        while (n <= seq - s->base) n *= 2;
        uint64_t *bits = calloc((size_t)n / 64, 8);
        if (!bits) return -1;
        for (int64_t x = s->base + 1; x < s->base + s->ndone; x++)
            if (is_done(s, x)) bits[(x & (n - 1)) >> 6] |= 1ULL << (x & 63);
        free(s->done);
        s->done = bits, s->ndone = n;
    }
    s->done[(seq & (s->ndone - 1)) >> 6] |= 1ULL << (seq & 63);
    return 0;
}

static uint32_t agg_index(const gf_host *h, int64_t seq) {
    if (h->route == ROUTE_STATIC) return (uint32_t)(h->slot_base + seq % h->slot_count);
    return (uint32_t)(((uint64_t)seq + (uint64_t)h->job * 2654435761ULL) % (uint64_t)h->pool_slots);
}

/* A datagram of ``p`` from ``s`` into the send buffer (Send). */
static int send(gf_host *h, const stream_t *s, const pkt_t *p, int64_t flags) {
    int64_t size = TOKEN + HEADER + 4 * p->count;
    if (room((void **)&h->tx, &h->txcap, h->txbytes + size, 1) ||
        room((void **)&h->txlens, &h->txlcap, h->txn + 1, 8))
        return -1;
    uint8_t *d = h->tx + h->txbytes;
    memcpy(d, h->token, TOKEN);
    uint8_t *v = gf_header(d + TOKEN, p->prio, flags, h->job, h->worker, h->fan_in, p->count,
                           p->seq, agg_index(h, p->seq), s->bit);
    memcpy(v, p->vals, (size_t)p->count * 4);
    h->txlens[h->txn++] = size, h->txbytes += size;
    return 0;
}

static int arm(stream_t *s, int64_t deadline, int64_t seq) {
    if (s->thead + s->tlen == s->tcap && s->thead) { /* compact before growing */
        memmove(s->timers, s->timers + 2 * s->thead, (size_t)s->tlen * 16);
        s->thead = 0;
    }
    if (room((void **)&s->timers, &s->tcap, s->thead + s->tlen + 1, 16)) return -1;
    int64_t k = 2 * (s->thead + s->tlen++);
    s->timers[k] = deadline, s->timers[k + 1] = seq;
    return 0;
}

/* WorkerEngine._resend */
static int resend(gf_host *h, stream_t *s, pkt_t *o, int64_t deadline) {
    if (o->deadline != deadline && arm(s, deadline, o->seq)) return -1;
    o->deadline = deadline;
    return send(h, s, o, s->flags | (h->resend_flag ? F_RESEND : 0));
}

/* WorkerEngine._pump, a shadow capped by its host's own window */
static int pump(gf_host *h, stream_t *s, int64_t now) {
    int64_t limit = s->base + (int64_t)s->cwnd, deadline = now + h->rto_ns;
    if (s != &h->own) {
        int64_t cap = h->own.base + (int64_t)h->own.cwnd;
        if (cap < limit) limit = cap;
    }
    while (s->qlen && s->queue[s->qhead].seq < limit) {
        pkt_t p = s->queue[s->qhead++];
        s->qlen--;
        if (p.seq < s->base || is_done(s, p.seq)) { /* already answered (helped ahead) */
            free(p.vals);
            continue;
        }
        if (room((void **)&s->out, &s->ocap, s->olen + 1, sizeof(pkt_t))) return -1;
        p.deadline = deadline, p.tries = 0;
        int64_t i = out_lower(s, p.seq);
        memmove(s->out + i + 1, s->out + i, (size_t)(s->olen - i) * sizeof(pkt_t));
        s->out[i] = p, s->olen++;
        if (arm(s, deadline, p.seq) || send(h, s, &s->out[i], s->flags)) return -1;
    }
    if (!s->qlen) s->qhead = 0;
    return 0;
}

/* WorkerEngine._adjust_window */
static void adjust_window(stream_t *s, int64_t seq, int64_t flags) {
    if (flags & F_ECN) {
        if (seq >= s->recover_seq) {
            s->cwnd = s->cwnd / 2 > 1.0 ? s->cwnd / 2 : 1.0;
            s->recover_seq = s->next_seq;
            s->counters[C_HALVINGS]++;
        }
    } else {
        double c = s->cwnd + 1.0 / s->cwnd;
        s->cwnd = s->max_cwnd < c ? s->max_cwnd : c;
    }
}

/* WorkerEngine._fast_retransmit */
static int fast_retransmit(gf_host *h, stream_t *s, int64_t seq, int64_t now) {
    if (seq > s->highest) s->highest = seq;
    if (s->fast_seq != s->base) s->fast_seq = s->fast_from = s->base;
    if (s->highest - s->fast_from < h->fast_k) return 0;
    int64_t i = out_find(s, s->base);
    if (i < 0 || s->out[i].tries >= h->max_retries) return 0;
    s->fast_from = s->highest;
    s->out[i].tries++;
    s->counters[C_FAST]++;
    return resend(h, s, &s->out[i], now + h->rto_ns);
}

/* WorkerEngine.on_packet for a result or notice; ``*deliver``: hand it to the application */
static int on_packet(gf_host *h, stream_t *s, const gf_pkt *p, int64_t now, int *deliver) {
    int64_t seq = p->seq;
    *deliver = 0;
    if (!(p->flags & F_ACK) || p->job != h->job) {
        if ((p->flags & F_NACK) && h->nack && p->job == h->job && p->wid == h->worker &&
            !(p->flags & F_ACK)) { /* _on_notice: the switch lacks this stream's share */
            int64_t i = out_find(s, seq);
            if (i < 0 || s->out[i].tries >= h->max_retries) {
                s->counters[C_STALE_NACK]++;
                return 0;
            }
            s->out[i].tries++;
            s->counters[C_NACK_RESENDS]++;
            return resend(h, s, &s->out[i], now + h->rto_ns);
        }
        s->counters[C_FOREIGN]++;
        return 0;
    }
    int64_t i = out_find(s, seq);
    if (i >= 0) {
        free(s->out[i].vals);
        memmove(s->out + i, s->out + i + 1, (size_t)(s->olen - i - 1) * sizeof(pkt_t));
        s->olen--;
    } else {
        if (seq < s->base || is_done(s, seq) || seq >= s->base + h->max_ahead) {
            s->counters[C_DUPLICATE]++;
            return 0;
        }
        s->counters[C_AHEAD]++; /* someone helped this stream's host: taken */
    }
    s->counters[C_RESULTS]++;
    if (seq == s->base) {
        int64_t b = seq + 1;
        while (is_done(s, b)) undone(s, b++);
        s->base = b;
    } else if (add_done(s, seq)) {
        return -1;
    }
    if (h->ecn_window) adjust_window(s, seq, p->flags);
    if (pump(h, s, now)) return -1;
    if (h->fast_k && fast_retransmit(h, s, seq, now)) return -1;
    *deliver = 1;
    return 0;
}

/* The application's copy of result ``p`` (HelpedWorker._deliver): into the
 * sink when it has room for the sequence, and an event. A result in floats
 * is never taken: it is an event of its own count (-1). */
static int deliver(gf_host *h, const gf_pkt *p) {
    if (p->seq >= h->sink_seqs) return 0;
    if (p->flags & F_FLOAT) return event(h, EV_RESULT, p->seq, -1);
    int64_t n = p->count < h->vpp ? p->count : h->vpp, *dst = h->sink + p->seq * h->vpp;
    for (int64_t j = 0; j < n; j++) {
        int32_t v;
        memcpy(&v, p->raw + HEADER + 4 * j, 4);
        dst[j] = v;
    }
    return event(h, EV_RESULT, p->seq, n);
}

static void stream_init(const gf_host *h, stream_t *s, int64_t helping) {
    s->base = s->next_seq = h->first_seq; /* the job's sequences start alike in every stream */
    s->bit = 1ULL << (helping >= 0 ? helping : h->worker);
    s->flags = helping >= 0 ? F_HELP : h->nack ? F_NACK : 0;
    s->highest = s->fast_seq = s->fast_from = -1;
    s->cwnd = (double)h->window, s->max_cwnd = h->max_cwnd;
}

static void stream_free(stream_t *s) {
    for (int64_t i = 0; i < s->qlen; i++) free(s->queue[s->qhead + i].vals);
    for (int64_t i = 0; i < s->olen; i++) free(s->out[i].vals);
    free(s->queue), free(s->out), free(s->done), free(s->timers);
}

GF_API gf_host *gf_h_new(int64_t job, int64_t worker, int64_t fan_in, int64_t route,
                         int64_t slot_base, int64_t slot_count, int64_t pool_slots,
                         int64_t resend_flag, int64_t rto_ns, int64_t max_retries, int64_t fast_k,
                         int64_t ecn_window, int64_t nack, int64_t max_ahead, int64_t window,
                         double max_cwnd, int64_t vpp, const uint8_t *token, int64_t first_seq) {
    if (fan_in < 1 || fan_in > MAX_FAN_IN || worker < 0 || worker >= fan_in || job < 0 ||
        job > 0xFFFF || (route != ROUTE_STATIC && route != ROUTE_HASHED) || vpp < 1 ||
        vpp > MAX_WIRE_VALUES || window < 1 || rto_ns < 1 || max_retries < 0 || fast_k < 0 ||
        max_ahead < 0 || !(max_cwnd >= 1) || (route == ROUTE_STATIC && slot_count < 1) ||
        (route == ROUTE_HASHED && pool_slots < 1) || first_seq < 0 || first_seq >= (1LL << 32))
        return NULL; /* (the Python side checks too, and says why) */
    gf_host *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->job = job, h->worker = worker, h->fan_in = fan_in, h->route = route;
    h->slot_base = slot_base, h->slot_count = slot_count, h->pool_slots = pool_slots;
    h->resend_flag = resend_flag, h->rto_ns = rto_ns, h->max_retries = max_retries;
    h->fast_k = fast_k, h->ecn_window = ecn_window, h->nack = nack, h->max_ahead = max_ahead;
    h->window = window, h->max_cwnd = max_cwnd, h->vpp = vpp, h->first_seq = first_seq;
    memcpy(h->token, token, TOKEN);
    stream_init(h, &h->own, -1);
    return h;
}

GF_API void gf_h_free(gf_host *h) {
    if (!h) return;
    stream_free(&h->own);
    for (int64_t k = 0; k < h->nshadows; k++) {
        stream_free(h->shadow[h->order[k]]);
        free(h->shadow[h->order[k]]);
    }
    free(h->events), free(h->tx), free(h->txlens), free(h->outbox), free(h);
}

/* The stream ``which`` names: OWN, or the shadow sending ``which``'s share
 * (HostEngine.shadow: made on first use). NULL: not a worker this host may
 * send for, or out of memory. */
static stream_t *stream(gf_host *h, int64_t which) {
    if (which == OWN) return &h->own;
    if (which < 0 || which >= h->fan_in || which == h->worker) return NULL;
    if (!h->shadow[which]) {
        stream_t *s = calloc(1, sizeof *s);
        if (!s) return NULL;
        stream_init(h, s, which);
        h->shadow[which] = s, h->order[h->nshadows++] = which;
    }
    return h->shadow[which];
}

GF_API void gf_h_sink(gf_host *h, int64_t *sink, int64_t seqs) {
    h->sink = sink, h->sink_seqs = seqs;
}

GF_API int64_t *gf_h_counters(gf_host *h, int64_t which) {
    stream_t *s = which == OWN ? &h->own : NULL;
    if (which >= 0 && which < MAX_FAN_IN) s = h->shadow[which];
    return s ? s->counters : NULL;
}

/* A stream's base, next sequence, and whether it is idle. */
GF_API int gf_h_state(gf_host *h, int64_t which, int64_t *st) {
    stream_t *s = stream(h, which);
    if (!s) return -1;
    st[0] = s->base, st[1] = s->next_seq, st[2] = s->base >= s->next_seq;
    return 0;
}

/* WorkerEngine.skip_to: -1 unless the stream is idle and ``seq`` not behind it. */
GF_API int gf_h_skip_to(gf_host *h, int64_t which, int64_t seq) {
    stream_t *s = stream(h, which);
    if (!s || s->qlen || s->olen || seq < s->next_seq) return -1;
    for (int64_t x = s->base + 1; x <= seq && x < s->base + s->ndone; x++)
        if (is_done(s, x)) undone(s, x); /* done_above keeps what lies above */
    s->base = s->next_seq = seq;
    return 0;
}

/* WorkerEngine.push: ``n`` values into stream ``which`` from ``at_seq`` (-1:
 * the next). -1: out of memory; -2: ``at_seq`` behind; -3: no such stream. */
GF_API int gf_h_push(gf_host *h, int64_t which, const int32_t *vals, int64_t n, int64_t now,
                     int64_t prio, int64_t at_seq) {
    stream_t *s = stream(h, which);
    if (!s) return -3;
    if (at_seq >= 0) {
        if (at_seq < s->next_seq) return -2;
        s->next_seq = at_seq;
    }
    int64_t npkts = (n + h->vpp - 1) / h->vpp;
    if (s->qhead) { /* what was sent is gone from the front */
        memmove(s->queue, s->queue + s->qhead, (size_t)s->qlen * sizeof(pkt_t));
        s->qhead = 0;
    }
    if (room((void **)&s->queue, &s->qcap, s->qhead + s->qlen + npkts, sizeof(pkt_t))) return -1;
    for (int64_t off = 0; off < n; off += h->vpp) {
        int64_t c = n - off < h->vpp ? n - off : h->vpp;
        int32_t *v = malloc((size_t)(c ? c : 1) * 4);
        if (!v) return -1;
        memcpy(v, vals + off, (size_t)c * 4);
        s->queue[s->qhead + s->qlen++] = (pkt_t){s->next_seq++, c, prio, 0, 0, v};
    }
    return pump(h, s, now);
}

/* The envelope, then HostEngine.on_packet. -1: out of memory. */
GF_API int gf_h_datagram(gf_host *h, const uint8_t *data, int64_t len, int64_t now) {
    stream_t *own = &h->own;
    gf_pkt p;
    int drop = gf_unseal(&p, data, len, h->token);
    if (drop) {
        own->counters[drop == GF_BAD_TOKEN ? C_BAD_TOKEN : C_MALFORMED]++;
        return 0;
    }
    if (p.flags & F_NOTIFY) {
        if (p.job != h->job || p.wid >= h->fan_in) {
            own->counters[C_BAD_NOTIFY]++;
            return 0;
        }
        own->counters[C_HELP_REQUESTS]++;
        return event(h, EV_HELP, p.wid, p.seq);
    }
    int dlv, ignored;
    if (on_packet(h, own, &p, now, &dlv)) return -1;
    for (int64_t k = 0; k < h->nshadows; k++) { /* results reach every stream, in order */
        stream_t *s = h->shadow[h->order[k]];
        if (on_packet(h, s, &p, now, &ignored) || pump(h, s, now)) return -1;
    }
    return dlv ? deliver(h, &p) : 0;
}

/* WorkerEngine.next_deadline */
static int64_t deadline(stream_t *s) {
    while (s->tlen) {
        int64_t dl = s->timers[2 * s->thead], i = out_find(s, s->timers[2 * s->thead + 1]);
        if (i >= 0 && s->out[i].deadline == dl) return dl;
        s->thead++, s->tlen--;
    }
    s->thead = 0;
    return -1;
}

/* HostEngine.next_deadline; -1: none */
GF_API int64_t gf_h_deadline(gf_host *h) {
    int64_t d = deadline(&h->own);
    for (int64_t k = 0; k < h->nshadows; k++) {
        int64_t e = deadline(h->shadow[h->order[k]]);
        if (e >= 0 && (d < 0 || e < d)) d = e;
    }
    return d;
}

/* WorkerEngine.on_timer: 1 when a packet ran out of retransmissions (an event), -1 on memory */
static int on_timer(gf_host *h, stream_t *s, int64_t which, int64_t now) {
    int64_t n = 0, later = now + h->rto_ns;
    int rc = -1;
    if (!s->tlen || s->timers[2 * s->thead] > now) return 0;
    int64_t *due = malloc((size_t)s->tlen * 8); /* at most every timer is due */
    if (!due) return -1;
    while (s->tlen && s->timers[2 * s->thead] <= now) {
        int64_t dl = s->timers[2 * s->thead], seq = s->timers[2 * s->thead + 1], i;
        s->thead++, s->tlen--;
        if ((i = out_find(s, seq)) < 0 || s->out[i].deadline != dl) continue;
        due[n++] = seq;
    }
    if ((h->fast_k || h->nack) && n > 1) { /* the lowest alone; the rest re-armed */
        int64_t low = 0;
        for (int64_t j = 1; j < n; j++)
            if (due[j] < due[low]) low = j;
        for (int64_t j = 0; j < n; j++) {
            if (j == low) continue;
            s->out[out_find(s, due[j])].deadline = later;
            if (arm(s, later, due[j])) goto end;
        }
        s->counters[C_REARMED] += n - 1;
        due[0] = due[low], n = 1;
    }
    for (int64_t j = 0; j < n; j++) {
        pkt_t *o = &s->out[out_find(s, due[j])];
        if (++o->tries > h->max_retries) { /* the rest still due, at the front, as they were */
            int64_t rest = n - j - 1;
            if (room((void **)&s->timers, &s->tcap, s->thead + s->tlen + rest, 16)) goto end;
            if (s->thead < rest) {
                memmove(s->timers + 2 * rest, s->timers + 2 * s->thead, (size_t)s->tlen * 16);
                s->thead = rest;
            }
            for (int64_t r = n - 1; r > j; r--) {
                s->thead--, s->tlen++;
                s->timers[2 * s->thead] = s->out[out_find(s, due[r])].deadline;
                s->timers[2 * s->thead + 1] = due[r];
            }
            rc = event(h, EV_FAIL, which, due[j]) ? -1 : 1;
            goto end;
        }
        s->counters[C_RETRANSMITS]++;
        if (o->deadline != later && arm(s, later, o->seq)) goto end;
        o->deadline = later;
    }
    rc = 0; /* the resends, queued only once none gave up (the reference returns its Fail alone) */
    for (int64_t j = 0; j < n && !rc; j++)
        rc = send(h, s, &s->out[out_find(s, due[j])], s->flags | (h->resend_flag ? F_RESEND : 0));
end:
    free(due);
    return rc;
}

/* HostEngine.on_timer: every stream's, the own first. 1: one gave up; -1: memory */
GF_API int gf_h_timer(gf_host *h, int64_t now) {
    int rc = on_timer(h, &h->own, OWN, now), failed = rc == 1;
    for (int64_t k = 0; k < h->nshadows && rc >= 0; k++) {
        rc = on_timer(h, h->shadow[h->order[k]], h->order[k], now);
        failed |= rc == 1;
    }
    return rc < 0 ? -1 : failed;
}

/* The events since the last call, as (kind, a, b) triples into ``buf`` (at
 * most ``cap`` triples; the rest stay): how many. */
GF_API int64_t gf_h_events(gf_host *h, int64_t *buf, int64_t cap) {
    int64_t n = h->elen / 3 < cap ? h->elen / 3 : cap;
    if (n <= 0) return 0;
    memcpy(buf, h->events, (size_t)n * 24);
    memmove(h->events, h->events + 3 * n, (size_t)(h->elen - 3 * n) * 8);
    h->elen -= 3 * n;
    return n;
}

/* What waits to leave, all of it, to the one switch (rank 0 of the job in
 * the driver's book); none if there is no memory for the list (it waits). */
GF_API int64_t gf_h_pending(gf_host *h, int64_t now, const gf_dgram **out) {
    int64_t n = h->txn - h->txsent, at = ((void)now, 0);
    *out = h->outbox;
    if (room((void **)&h->outbox, &h->outcap, n, sizeof(gf_dgram))) return 0;
    for (int64_t k = 0; k < h->txsent; k++) at += h->txlens[k];
    for (int64_t k = 0; k < n; k++) {
        int64_t size = h->txlens[h->txsent + k];
        h->outbox[k] = (gf_dgram){(int32_t)h->job, 0, h->tx + at, size, NULL, 0};
        at += size;
    }
    *out = h->outbox;
    return n;
}

GF_API void gf_h_sent(gf_host *h, int64_t n, int64_t now) {
    h->txsent += n, (void)now;
    if (h->txsent >= h->txn) h->txsent = h->txn = h->txbytes = 0;
}

/* The datagrams waiting, each a u32 length and its bytes, into ``buf`` (for
 * a driver in Python and the differential harness); the bytes written. */
GF_API int64_t gf_h_take(gf_host *h, uint8_t *buf, int64_t cap) {
    const gf_dgram *d;
    int64_t n = gf_h_pending(h, 0, &d), at = 0, k = 0;
    for (; k < n; k++) {
        uint32_t size = (uint32_t)d[k].head_len;
        if (at + 4 + (int64_t)size > cap) break;
        memcpy(buf + at, &size, 4);
        memcpy(buf + at + 4, d[k].head, size);
        at += 4 + size;
    }
    gf_h_sent(h, k, 0);
    return at;
}

static int ops_receive(void *e, const uint8_t *data, int64_t len, int64_t now) {
    return gf_h_datagram(e, data, len, now);
}
static int64_t ops_pending(void *e, int64_t now, const gf_dgram **out) {
    return gf_h_pending(e, now, out);
}
static void ops_sent(void *e, int64_t n, int64_t now) { gf_h_sent(e, n, now); }
static int64_t ops_timer(void *e) { return gf_h_deadline(e); }
static int ops_handle_timer(void *e, int64_t now) {
    int64_t d = gf_h_deadline(e);
    return d >= 0 && d <= now ? gf_h_timer(e, now) : 0;
}
static int ops_done(void *e, int quiet) { return (void)e, (void)quiet, 0; } /* the application's */
static int64_t ops_read_wait(void *e, int64_t now) { return (void)e, (void)now, 0; }

static const gf_ops OPS = {ops_receive,      ops_pending, ops_sent,     ops_timer,
                           ops_handle_timer, ops_done,    ops_read_wait};

/* The datagram interface as function pointers, for the native driver (udp.c's drain). */
GF_API const gf_ops *gf_h_ops(void) { return &OPS; }
