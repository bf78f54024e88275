/* The native worker node: proto.worker_node.WorkerNode in C, behind the same
 * datagram interface, for a worker that takes no help (SA-ATP's stay on the
 * reference) on a route of one destination (SwitchML's static slots, ATP's
 * and ESA's hashed pool, a parameter server).
 *
 * Theory of operation
 * -------------------
 * The reference is WorkerNode around proto.worker.ResumableWorker; each
 * function below names the method it mirrors, whose docstring says why.
 * Per sequence the state is UNSENT -> OUTSTANDING -> SETTLED (answered, or
 * retired as a replay nobody needs), with ``dlv`` (its result delivered:
 * below ``base`` or ``done_above`` in the reference) and ``rep`` (being
 * replayed) beside it, over the sequences the node tracks, [lo, end): the
 * last ``keep`` of the previous call, whose values were copied into ``prev``
 * when it completed (the caller may reuse its tensor), then the call's,
 * whose values are the caller's ``q``. The retransmission deadlines are a
 * FIFO of (deadline, seq) (one RTO: created sorted; stale entries skipped
 * where they surface, as the reference's). What leaves waits in ``txq``,
 * resends at its front when paced, and gf_w_pending hands the driver what
 * the pace allows, each datagram a header of its own and the values where
 * they are (no copy).
 *
 * Semantics that must match the reference, in its order: the token, then
 * wire.packet.decode's checks, then the engine (not a result of this job:
 * drop_foreign, or a loss notice for this worker; a result for a sequence
 * not outstanding: drop_duplicate_result), the replay rules, the window
 * (ATP's ECN window), new sends, fast retransmit, the delivery into ``out``.
 */
#define _GNU_SOURCE
#include "worker.h"

#include <stdlib.h>
#include <string.h>

#define FRAME_BYTES 42          /* Ethernet, IPv4 and UDP headers */
#define PACE_BURST_NS 100000LL  /* proto.worker_node.PACE_BURST_NS */
#define PACE_AHEAD_NS 300000LL  /* proto.worker_node.PACE_AHEAD_NS */
#define READ_BATCH 32           /* proto.worker_node.READ_BATCH */
#define READ_WAIT_MAX_NS 200000LL
#define A_RESEND (1 << 16) /* a txq mark (not a wire flag): a resend */

GF_API const char *gf_source(void) { return GRADFABRIC_SOURCE; }

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* A ring of pairs grown (unrolled) to twice its size. */
static int ring_grow(int64_t **buf, int64_t *cap, int64_t *head, int64_t len) {
    int64_t old = *cap, c = old ? old * 2 : 256;
    int64_t *n = malloc((size_t)c * 2 * sizeof(int64_t));
    if (!n) return -1;
    for (int64_t i = 0; i < len; i++) {
        int64_t k = (*head + i) % old;
        n[2 * i] = (*buf)[2 * k], n[2 * i + 1] = (*buf)[2 * k + 1];
    }
    free(*buf);
    *buf = n, *cap = c, *head = 0;
    return 0;
}

static int ring_push(int64_t **buf, int64_t *cap, int64_t *head, int64_t *len, int64_t a,
                     int64_t b, int front) {
    if (*len == *cap && ring_grow(buf, cap, head, *len)) return -1;
    int64_t k = front ? (*head = (*head + *cap - 1) % *cap) : (*head + *len) % *cap;
    (*buf)[2 * k] = a, (*buf)[2 * k + 1] = b;
    (*len)++;
    return 0;
}

static void ring_pop(int64_t *cap, int64_t *head, int64_t *len) {
    *head = (*head + 1) % *cap;
    (*len)--;
}

GF_API gf_worker *gf_w_new(int64_t job, int64_t worker, int64_t fan_in, int64_t route,
                           int64_t slot_base, int64_t slot_count, int64_t pool_slots,
                           int64_t resend_flag, int64_t rto_ns, int64_t max_retries,
                           int64_t fast_k, int64_t ecn_window, int64_t vpp, int64_t nack,
                           int64_t window, double max_cwnd, double pace_gbps,
                           const uint8_t *token, int64_t first_seq) {
    if (fan_in < 1 || fan_in > MAX_FAN_IN || worker < 0 || worker >= fan_in || job < 0 ||
        job > 0xFFFF || route < ROUTE_STATIC || route > ROUTE_ONE || vpp < 1 ||
        vpp > MAX_WIRE_VALUES || window < 1 || rto_ns < 1 || max_retries < 0 || fast_k < 0 ||
        !(max_cwnd >= 1) || !(pace_gbps >= 0) || (route == ROUTE_STATIC && slot_count < 1) ||
        (route == ROUTE_HASHED && pool_slots < 1) || first_seq < 0)
        return NULL; /* (the Python side checks too, and says why) */
    gf_worker *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->job = job, w->worker = worker, w->fan_in = fan_in, w->route = route;
    w->slot_base = slot_base, w->slot_count = slot_count, w->pool_slots = pool_slots;
    w->resend_flag = resend_flag, w->rto_ns = rto_ns, w->max_retries = max_retries;
    w->fast_k = fast_k, w->ecn_window = ecn_window, w->vpp = vpp, w->nack = nack;
    w->keep = (int64_t)max_cwnd > window ? (int64_t)max_cwnd : window;
    w->bitmap = 1ULL << worker;
    w->cwnd = (double)window, w->max_cwnd = max_cwnd;
    w->ns_per_byte = pace_gbps > 0 ? 8.0 / pace_gbps : 0.0;
    memcpy(w->token, token, TOKEN);
    w->highest = w->fast_seq = w->fast_from = -1;
    w->lo = w->first = w->end = w->base = w->next = first_seq, w->sent_high = first_seq - 1;
    w->fail_seq = w->error_seq = -1;
    w->repairs = -1;
    return w;
}

GF_API void gf_w_free(gf_worker *w) {
    if (!w) return;
    free(w->st), free(w->dlv), free(w->rep), free(w->deadline), free(w->tries);
    free(w->prev), free(w->prev_count), free(w->fifo), free(w->txq), free(w);
}

GF_API int64_t *gf_w_counters(gf_worker *w) { return w->counters; }

/* base, next_seq, whether the call is done, whether nothing is outstanding
 * or queued (quiet), the sequence given up on, the first error's sequence
 * and kind (1: left the integer domain, 2: another count) */
GF_API void gf_w_state(const gf_worker *w, int64_t *s) {
    int64_t quiet = w->base >= w->end && !w->txq_len && !w->outstanding;
    s[0] = w->base, s[1] = w->end, s[2] = w->base >= w->end && !w->txq_len, s[3] = quiet;
    s[4] = w->fail_seq, s[5] = w->error_seq, s[6] = w->error_kind;
}

GF_API void gf_w_set_priority(gf_worker *w, int64_t p) { w->priority = p; }

/* A sequence's new state (the count of outstanding ones kept with it: the
 * driver asks whether any is left after every wake-up). */
static void set_state(gf_worker *w, int64_t i, uint8_t st) {
    w->outstanding += (st == OUTSTANDING) - (w->st[i] == OUTSTANDING);
    w->st[i] = st;
}

static int outstanding(const gf_worker *w, int64_t seq) {
    return seq >= w->lo && seq < w->end && w->st[seq - w->lo] == OUTSTANDING;
}

/* The values of ``seq`` and how many (the call's from q, the previous call's from prev). */
static const int32_t *values(const gf_worker *w, int64_t seq, int64_t *count) {
    if (seq >= w->first) {
        int64_t lo = (seq - w->first) * w->vpp;
        *count = min64(w->vpp, w->nvalues - lo);
        return w->q + lo;
    }
    *count = w->prev_count[seq - w->lo];
    return w->prev + (seq - w->lo) * w->vpp;
}

static uint32_t agg_index(const gf_worker *w, int64_t seq) {
    if (w->route == ROUTE_STATIC) return (uint32_t)(w->slot_base + seq % w->slot_count);
    if (w->route == ROUTE_HASHED)
        return (uint32_t)(((uint64_t)seq + (uint64_t)w->job * 2654435761ULL) % (uint64_t)w->pool_slots);
    return 0;
}

static int queue_send(gf_worker *w, int64_t seq, int64_t flags) {
    int resend = seq <= w->sent_high;
    if (!resend) w->sent_high = seq;
    return ring_push(&w->txq, &w->txq_cap, &w->txq_head, &w->txq_len, seq,
                     flags | (resend ? A_RESEND : 0), resend && w->ns_per_byte > 0);
}

static int arm(gf_worker *w, int64_t seq, int64_t deadline) {
    return ring_push(&w->fifo, &w->fifo_cap, &w->fifo_head, &w->fifo_len, deadline, seq, 0);
}

/* WorkerEngine._resend's timer: due again at ``deadline`` (later than every pending one). */
static int rearm(gf_worker *w, int64_t seq, int64_t deadline) {
    int64_t i = seq - w->lo;
    if (w->deadline[i] == deadline) return 0; /* (a second resend in the same instant: one timer) */
    w->deadline[i] = deadline;
    return arm(w, seq, deadline);
}

/* WorkerEngine._resend */
static int resend(gf_worker *w, int64_t seq, int64_t deadline) {
    return rearm(w, seq, deadline) || queue_send(w, seq, w->resend_flag ? F_RESEND : 0) ? -1 : 0;
}

/* WorkerEngine._pump, each packet's values quantised as it first leaves */
static int pump(gf_worker *w, int64_t now) {
    int64_t limit = w->base + (int64_t)w->cwnd, deadline = now + w->rto_ns;
    while (w->next < w->end && w->next < limit) {
        int64_t seq = w->next++, i = seq - w->lo, count;
        if (seq < w->base || w->dlv[i]) continue;
        if (w->x) { /* the fused quantiser: this packet is one block */
            int64_t k = seq - w->first;
            values(w, seq, &count);
            w->enc(w->x + k * w->vpp, count, w->vpp, w->enc_scale + k, w->q + k * w->vpp);
        }
        set_state(w, i, OUTSTANDING), w->deadline[i] = deadline, w->tries[i] = 0;
        if (arm(w, seq, deadline) || queue_send(w, seq, 0)) return -1;
    }
    return 0;
}

/* Room for the sequences [lo, end) in the per-sequence arrays. */
static int table_room(gf_worker *w, int64_t need) {
    if (need <= w->cap) return 0;
    int64_t c = w->cap ? w->cap : 64;
    while (c < need) c *= 2;
    uint8_t *st = realloc(w->st, (size_t)c), *dlv = st ? realloc(w->dlv, (size_t)c) : NULL;
    if (st) w->st = st;
    if (dlv) w->dlv = dlv;
    uint8_t *rep = dlv ? realloc(w->rep, (size_t)c) : NULL;
    if (rep) w->rep = rep;
    int64_t *dl = rep ? realloc(w->deadline, (size_t)c * 8) : NULL;
    if (dl) w->deadline = dl;
    int64_t *tr = dl ? realloc(w->tries, (size_t)c * 8) : NULL;
    if (!tr) return -1;
    w->tries = tr, w->cap = c;
    return 0;
}

/* The call is complete (base reached its end): the last ``keep`` sequences
 * stay tracked, their values copied out of the caller's tensor
 * (ResumableWorker.own_kept); what is older is forgotten. */
static int settle_call(gf_worker *w) {
    int64_t lo = max64(w->lo, w->end - w->keep);
    for (int64_t j = 0; j < w->txq_len; j++) /* (and whatever still waits to leave, */
        lo = min64(lo, w->txq[2 * ((w->txq_head + j) % w->txq_cap)]);
    for (int64_t s = w->lo; s < lo; s++) /* or is outstanding) */
        if (w->st[s - w->lo] == OUTSTANDING) {
            lo = s;
            break;
        }
    int64_t n = w->end - lo;
    int32_t *prev = malloc((size_t)(n ? n : 1) * (size_t)w->vpp * 4);
    int64_t *cnt = malloc((size_t)(n ? n : 1) * 8);
    if (!prev || !cnt) {
        free(prev), free(cnt);
        return -1;
    }
    for (int64_t s = lo; s < w->end; s++) {
        int64_t c;
        const int32_t *v = values(w, s, &c);
        memcpy(prev + (s - lo) * w->vpp, v, (size_t)c * 4);
        cnt[s - lo] = c;
    }
    int64_t gone = lo - w->lo;
    memmove(w->st, w->st + gone, (size_t)n);
    memmove(w->dlv, w->dlv + gone, (size_t)n);
    memmove(w->rep, w->rep + gone, (size_t)n);
    memmove(w->deadline, w->deadline + gone, (size_t)n * 8);
    memmove(w->tries, w->tries + gone, (size_t)n * 8);
    free(w->prev), free(w->prev_count);
    w->prev = prev, w->prev_count = cnt, w->prev_priority = w->call_priority;
    w->lo = lo, w->first = w->end, w->nvalues = 0;
    w->q = NULL, w->out = NULL, w->x = NULL, w->outf = NULL;
    return 0;
}

/* WorkerNode.push: a collective of ``n`` values. -1: out of memory; -2: the
 * previous one has not finished. */
GF_API int gf_w_push(gf_worker *w, int32_t *q, int64_t *out, int64_t n, int64_t now,
                     const float *x, const double *enc_scale, const double *dec_scale,
                     float *outf, encode_fn enc, decode_fn dec) {
    if (w->base < w->end || w->txq_len) return -2;
    if (n < 1) return -3;
    int64_t npkts = (n + w->vpp - 1) / w->vpp;
    if (table_room(w, w->end - w->lo + npkts)) return -1;
    int64_t at = w->end - w->lo;
    memset(w->st + at, UNSENT, (size_t)npkts);
    memset(w->dlv + at, 0, (size_t)npkts);
    memset(w->rep + at, 0, (size_t)npkts);
    memset(w->deadline + at, 0, (size_t)npkts * 8);
    memset(w->tries + at, 0, (size_t)npkts * 8);
    w->first = w->end, w->end += npkts, w->nvalues = n, w->call_priority = w->priority;
    w->q = q, w->out = out, w->x = x, w->enc_scale = enc_scale, w->dec_scale = dec_scale;
    w->outf = outf, w->enc = enc, w->dec = dec;
    w->error_seq = -1, w->error_kind = 0;
    w->repairs = -1; /* a call's reads start on the period (WorkerNode.read_wait_ns) */
    return pump(w, now) ? -1 : 0;
}

/* ResumableWorker._retire_replays */
static void retire_replays(gf_worker *w) {
    int64_t top = w->base - 1;
    for (int64_t s = w->end - 1; s > w->base && s >= w->lo; s--)
        if (w->dlv[s - w->lo]) { top = s; break; }
    int64_t low = top + 1 - w->keep;
    for (int64_t s = w->lo; s < low && s < w->end && w->replaying; s++) {
        int64_t i = s - w->lo;
        if (!w->rep[i]) continue;
        w->rep[i] = 0, w->replaying--;
        if (w->st[i] == OUTSTANDING) set_state(w, i, SETTLED);
        w->counters[C_REPLAYS_RETIRED]++;
    }
}

/* WorkerEngine._adjust_window */
static void adjust_window(gf_worker *w, int64_t seq, int64_t flags) {
    if (flags & F_ECN) {
        if (seq >= w->recover_seq) {
            w->cwnd = w->cwnd / 2 > 1.0 ? w->cwnd / 2 : 1.0;
            w->recover_seq = w->end;
            w->counters[C_HALVINGS]++;
        }
    } else {
        double c = w->cwnd + 1.0 / w->cwnd;
        w->cwnd = w->max_cwnd < c ? w->max_cwnd : c;
    }
}

/* WorkerEngine._fast_retransmit */
static int fast_retransmit(gf_worker *w, int64_t seq, int64_t now) {
    if (seq > w->highest) w->highest = seq;
    int64_t base = w->base;
    if (w->fast_seq != base) w->fast_seq = w->fast_from = base;
    if (w->highest - w->fast_from < w->fast_k) return 0;
    if (!outstanding(w, base) || w->tries[base - w->lo] >= w->max_retries) return 0;
    w->fast_from = w->highest;
    w->tries[base - w->lo]++;
    w->counters[C_FAST]++;
    return resend(w, base, now + w->rto_ns);
}

/* WorkerEngine._on_notice: the switch lacks this worker's share. */
static int on_notice(gf_worker *w, int64_t seq, int64_t now) {
    if (!outstanding(w, seq) || w->tries[seq - w->lo] >= w->max_retries) {
        w->counters[C_STALE_NACK]++;
        return 0;
    }
    w->tries[seq - w->lo]++;
    w->counters[C_NACK_RESENDS]++;
    return resend(w, seq, now + w->rto_ns);
}

/* WorkerNode._deliver: a result into ``out`` (and decoded, fused). */
static void deliver(gf_worker *w, const gf_pkt *p) {
    int64_t seq = p->seq, k = seq - w->first, sent;
    if (seq < w->first || !w->out) return;
    values(w, seq, &sent);
    if ((p->flags & F_FLOAT) || p->count != sent) {
        if (w->error_seq < 0) w->error_seq = seq, w->error_kind = p->flags & F_FLOAT ? 1 : 2;
        return;
    }
    int64_t *dst = w->out + k * w->vpp;
    for (int64_t j = 0; j < sent; j++) {
        int32_t v;
        memcpy(&v, p->raw + HEADER + 4 * j, 4);
        dst[j] = v;
    }
    if (w->x) w->dec(dst, sent, w->vpp, w->dec_scale + k, w->outf + k * w->vpp);
}

/* ResumableWorker.on_packet's replay rule, then WorkerEngine.on_packet
 * (``*answered``: a replay's answer, taken alone) */
static int on_result(gf_worker *w, const gf_pkt *p, int64_t now, int *answered) {
    int64_t seq = p->seq;
    if (outstanding(w, seq) && w->rep[seq - w->lo]) {
        w->rep[seq - w->lo] = 0, w->replaying--;
        if (seq < w->base || w->dlv[seq - w->lo]) { /* delivered already */
            set_state(w, seq - w->lo, SETTLED);
            w->counters[C_REPLAY_ANSWERED]++;
            *answered = 1;
            return 0;
        }
    }
    if (!outstanding(w, seq)) { /* no help is taken: nothing ahead of what was sent */
        w->counters[C_DUPLICATE]++;
        return 0;
    }
    set_state(w, seq - w->lo, SETTLED), w->dlv[seq - w->lo] = 1;
    w->counters[C_RESULTS]++;
    if (seq == w->base) {
        int64_t b = seq + 1;
        while (b < w->end && w->dlv[b - w->lo]) b++;
        w->base = b;
    }
    if (w->ecn_window) adjust_window(w, seq, p->flags);
    if (pump(w, now)) return -1;
    if (w->fast_k && fast_retransmit(w, seq, now)) return -1;
    deliver(w, p);
    return 0;
}

/* WorkerNode.receive_datagram: unseal, decode, the engine. -1: out of memory. */
GF_API int gf_w_datagram(gf_worker *w, const uint8_t *data, int64_t len, int64_t now) {
    gf_pkt p;
    int drop = gf_unseal(&p, data, len, w->token);
    if (drop) {
        w->counters[drop == GF_BAD_TOKEN ? C_BAD_TOKEN : C_MALFORMED]++;
        return 0;
    }
    p.seq = gf_unwrap(p.seq, w->base); /* what can come lies within a window of base */
    int rc = 0, answered = 0;
    if (!(p.flags & F_ACK) || p.job != w->job) {
        if ((p.flags & F_NACK) && w->nack && p.job == w->job && p.wid == w->worker &&
            !(p.flags & F_ACK))
            rc = on_notice(w, p.seq, now);
        else
            w->counters[C_FOREIGN]++;
    } else {
        rc = on_result(w, &p, now, &answered);
    }
    if (!answered && w->replaying) retire_replays(w); /* after every packet, as the reference */
    if (!rc && w->base >= w->end && w->q && settle_call(w)) rc = -1; /* then, WorkerNode._take */
    return rc;
}

/* ResumableWorker.replay: the switch restarted empty. */
GF_API int gf_w_replay(gf_worker *w, int64_t floor, int64_t now) {
    int64_t low = max64(floor, w->base - w->keep), deadline = now + w->rto_ns;
    for (int64_t s = max64(low, w->lo); s < w->end; s++) /* kept: what was answered */
        if (w->dlv[s - w->lo] && w->st[s - w->lo] == SETTLED) /* as a new entry: no deadline */
            set_state(w, s - w->lo, OUTSTANDING), w->deadline[s - w->lo] = 0;
    w->replaying = 0;
    w->counters[C_REPLAYS]++;
    for (int64_t s = w->lo; s < w->end; s++) {
        int64_t i = s - w->lo;
        w->rep[i] = w->st[i] == OUTSTANDING;
        if (!w->rep[i]) continue;
        w->replaying++;
        w->tries[i] = 0; /* a fresh budget against the new switch */
        if (resend(w, s, deadline)) return -1;
    }
    return 0;
}

/* WorkerEngine.next_deadline, with the pace's (WorkerNode.get_timer); -1: none. */
GF_API int64_t gf_w_deadline(gf_worker *w) {
    int64_t d = -1;
    while (w->fifo_len) {
        int64_t k = w->fifo_head, dl = w->fifo[2 * k], seq = w->fifo[2 * k + 1];
        if (outstanding(w, seq) && w->deadline[seq - w->lo] == dl) {
            d = dl;
            break;
        }
        ring_pop(&w->fifo_cap, &w->fifo_head, &w->fifo_len);
    }
    if (w->txq_len && w->ns_per_byte > 0) {
        int64_t pace = w->next_tx - PACE_AHEAD_NS;
        d = d < 0 ? pace : min64(d, pace);
    }
    return d;
}

/* WorkerEngine.on_timer (ResumableWorker's while replaying: every due packet),
 * if its deadline passed. 1: a packet ran out of retransmissions (fail_seq);
 * -1: out of memory. */
GF_API int gf_w_timer(gf_worker *w, int64_t now) {
    int64_t n = 0, later = now + w->rto_ns, *due = NULL;
    while (w->fifo_len && w->fifo[2 * w->fifo_head] <= now) {
        int64_t k = w->fifo_head, dl = w->fifo[2 * k], seq = w->fifo[2 * k + 1];
        ring_pop(&w->fifo_cap, &w->fifo_head, &w->fifo_len);
        if (!outstanding(w, seq) || w->deadline[seq - w->lo] != dl) continue;
        int64_t *d = realloc(due, (size_t)(n + 1) * 8);
        if (!d) goto oom;
        due = d, due[n++] = seq;
    }
    if ((w->fast_k || w->nack) && !w->replaying && n > 1) {
        int64_t low = 0;
        for (int64_t j = 1; j < n; j++)
            if (due[j] < due[low]) low = j;
        for (int64_t j = 0; j < n; j++) {
            if (j == low) continue;
            w->deadline[due[j] - w->lo] = later;
            if (arm(w, due[j], later)) goto oom;
        }
        w->counters[C_REARMED] += n - 1;
        due[0] = due[low], n = 1;
    }
    /* each due packet counts a try and is re-armed, in order; the reference
     * returns its Fail alone, so the resends are queued only if none gives up */
    for (int64_t j = 0; j < n; j++) {
        int64_t seq = due[j];
        if (++w->tries[seq - w->lo] > w->max_retries) {
            for (int64_t r = n - 1; r > j; r--) /* still due, as they were (the reference's) */
                if (ring_push(&w->fifo, &w->fifo_cap, &w->fifo_head, &w->fifo_len,
                              w->deadline[due[r] - w->lo], due[r], 1))
                    goto oom;
            w->fail_seq = seq;
            free(due);
            return 1;
        }
        w->counters[C_RETRANSMITS]++;
        if (rearm(w, seq, later)) goto oom;
    }
    for (int64_t j = 0; j < n; j++)
        if (queue_send(w, due[j], w->resend_flag ? F_RESEND : 0)) goto oom;
    free(due);
    return 0;
oom:
    free(due);
    return -1;
}

/* WorkerNode.read_wait_ns */
GF_API int64_t gf_w_read_wait(gf_worker *w, int64_t now) {
    if (w->ns_per_byte <= 0) return 0;
    int64_t repairs = w->counters[C_RETRANSMITS] + w->counters[C_FAST] + w->counters[C_NACK_RESENDS];
    if (repairs != w->repairs) {
        if (w->repairs >= 0) w->repairing_until = now + w->rto_ns;
        w->repairs = repairs;
    }
    if (now < w->repairing_until) return 0;
    int64_t half = READ_BATCH / 2 * (TOKEN + HEADER + FRAME_BYTES + 4 * w->vpp);
    return min64((int64_t)((double)half * w->ns_per_byte), READ_WAIT_MAX_NS);
}

/* WorkerNode.datagrams_to_send, in two steps for a driver in C: what may
 * leave now (at most OUTBOX, each a header and the values where they are),
 * then ``gf_w_sent``: the first ``n`` left. */
GF_API int64_t gf_w_pending(gf_worker *w, int64_t now, const gf_dgram **out) {
    int64_t n = 0, due = w->next_tx;
    if (w->ns_per_byte > 0) due = max64(due, now - PACE_BURST_NS);
    for (; n < OUTBOX && n < w->txq_len; n++) {
        if (w->ns_per_byte > 0 && due > now + PACE_AHEAD_NS) break;
        int64_t k = (w->txq_head + n) % w->txq_cap, seq = w->txq[2 * k], count;
        int64_t flags = (w->txq[2 * k + 1] & ~A_RESEND) | (w->nack ? F_NACK : 0);
        const int32_t *v = values(w, seq, &count);
        uint8_t *h = w->heads[n];
        memcpy(h, w->token, TOKEN);
        gf_header(h + TOKEN, seq >= w->first ? w->call_priority : w->prev_priority, flags, w->job,
                  w->worker, w->fan_in, count, seq, agg_index(w, seq), w->bitmap);
        w->out_dgrams[n] = (gf_dgram){(int32_t)w->job, GF_PEER, h, TOKEN + HEADER,
                                      (const uint8_t *)v, 4 * count};
        due += (int64_t)(w->ns_per_byte * (double)(TOKEN + HEADER + FRAME_BYTES + 4 * count));
    }
    *out = w->out_dgrams;
    return n;
}

GF_API void gf_w_sent(gf_worker *w, int64_t n, int64_t now) {
    if (w->ns_per_byte > 0) w->next_tx = max64(w->next_tx, now - PACE_BURST_NS);
    for (int64_t j = 0; j < n; j++) {
        if (w->ns_per_byte > 0)
            w->next_tx += (int64_t)(w->ns_per_byte * (double)(TOKEN + HEADER + FRAME_BYTES +
                                                               w->out_dgrams[j].body_len));
        ring_pop(&w->txq_cap, &w->txq_head, &w->txq_len);
    }
}

/* WorkerNode.datagrams_to_send for a driver in Python (and the differential
 * harness): each datagram as a u32 length and its bytes; returns the bytes
 * written (what does not fit in ``cap`` stays queued). */
GF_API int64_t gf_w_take(gf_worker *w, uint8_t *buf, int64_t cap, int64_t now) {
    int64_t at = 0;
    for (;;) {
        const gf_dgram *d;
        int64_t n = gf_w_pending(w, now, &d), k = 0;
        for (; k < n; k++) {
            uint32_t size = (uint32_t)(d[k].head_len + d[k].body_len);
            if (at + 4 + (int64_t)size > cap) break;
            memcpy(buf + at, &size, 4);
            memcpy(buf + at + 4, d[k].head, (size_t)d[k].head_len);
            if (d[k].body_len) memcpy(buf + at + 4 + d[k].head_len, d[k].body, (size_t)d[k].body_len);
            at += 4 + size;
        }
        gf_w_sent(w, k, now);
        if (k < n || n < OUTBOX) return at;
    }
}

static int ops_receive(void *e, const uint8_t *data, int64_t len, int64_t now) {
    return gf_w_datagram(e, data, len, now);
}
static int64_t ops_pending(void *e, int64_t now, const gf_dgram **out) {
    return gf_w_pending(e, now, out);
}
static void ops_sent(void *e, int64_t n, int64_t now) { gf_w_sent(e, n, now); }
static int64_t ops_timer(void *e) { return gf_w_deadline(e); }
static int ops_handle_timer(void *e, int64_t now) {
    int64_t d = gf_w_deadline(e);
    return d >= 0 && d <= now ? gf_w_timer(e, now) : 0;
}

static int ops_done(void *e, int quiet) {
    int64_t st[7];
    gf_w_state(e, st);
    return (int)st[quiet ? 3 : 2];
}
static int64_t ops_read_wait(void *e, int64_t now) { return gf_w_read_wait(e, now); }

static const gf_ops OPS = {ops_receive,      ops_pending, ops_sent,     ops_timer,
                           ops_handle_timer, ops_done,    ops_read_wait};

/* The datagram interface as function pointers, for the native driver (udp.c). */
GF_API const gf_ops *gf_w_ops(void) { return &OPS; }
