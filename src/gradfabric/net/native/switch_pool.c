/* The native switch engine: proto.switch.engine.SwitchEngine's checks, then
 * its allocation policy: SwitchML's copies (proto.switch.switchml) or ATP's
 * shared pool (proto.switch.atp), with ESA's preemption (proto.switch.esa).
 * Each function names the reference it mirrors; their theory of operation
 * is told there, once. */
#include "switch.h"

#include <stdlib.h>
#include <string.h>

void pool_clear_range(gf_switch *s, int64_t base, int64_t count) {
    for (int64_t i = 2 * base; s->copies && i < 2 * (base + count) && i < 2 * s->slots; i++) {
        copy_t *c = &s->copies[i];
        int32_t *v = c->values;
        int cap = c->cap;
        memset(c, 0, sizeof *c);
        c->seq = -1;
        c->values = v, c->cap = cap;
    }
}

/* ATPPolicy.retire: the job's aggregators freed (their hold not counted as use). */
void pool_forget(gf_switch *s, int64_t job) {
    for (int64_t i = 0; s->pool && i < s->slots; i++)
        if (s->pool[i].state != FREE && s->pool[i].job == job) s->pool[i].state = FREE;
}

/* The policy's ``missing``: children some partly filled copy or aggregator waits on. */
uint64_t pool_missing(const gf_switch *s, const job_t *j) {
    uint64_t full = gf_full(j->fan_in), bits = 0;
    for (int64_t i = 2 * j->slot_base; s->copies && i < 2 * (j->slot_base + j->slot_count); i++)
        if (s->copies[i].state == AGGREGATING) bits |= full & ~s->copies[i].bitmap;
    for (int64_t i = 0; s->pool && i < s->slots; i++)
        if (s->pool[i].state == HELD && s->pool[i].job == j->id) bits |= full & ~s->pool[i].bitmap;
    return bits;
}

/* Room for ``count`` values in an aggregator's buffer (0: there is; -1: out of memory). */
static int room(int32_t **values, int *cap, int64_t count) {
    if (*cap >= count) return 0;
    int32_t *v = realloc(*values, (size_t)(count ? count : 1) * 4);
    if (!v) return -1;
    *values = v, *cap = (int)count;
    return 0;
}

/* ``count`` int32 values from the wire added into ``values``: int32 sums
 * wrap, as numpy's do. */
static void add_wrapping(int32_t *values, const uint8_t *payload, int64_t count) {
    uint32_t *v = (uint32_t *)values;
    for (int64_t k = 0; k < count; k++) {
        uint32_t x;
        memcpy(&x, payload + 4 * k, 4);
        v[k] += x;
    }
}

/* ---- SwitchML (proto.switch.switchml) ---- */

/* Queue a copy of ``c``'s result for ``rank`` (GF_ALL: every worker). */
static void send_result(gf_switch *s, const job_t *j, const copy_t *c, int64_t agg, int64_t rank) {
    uint8_t *h = sw_reserve(s, j, rank, HEADER + 4 * (int64_t)c->nvalues);
    if (!h) return;
    uint8_t *v = gf_header(h, 0, F_ACK | c->flags, j->id, 0, j->fan_in, c->nvalues, c->seq, agg,
                           gf_full(j->fan_in));
    if (c->nvalues) memcpy(v, c->values, (size_t)(4 * c->nvalues));
}

/* SwitchMLPolicy._notice: the sender's share of seq - NACK_GAP, if its copy
 * still waits on it. */
static void notice(gf_switch *s, const job_t *j, int64_t seq, int64_t wid, uint64_t bit) {
    int64_t lost = seq - NACK_GAP, w = j->slot_count;
    if (lost < 0) return;
    int64_t agg = j->slot_base + lost % w;
    const copy_t *c = &s->copies[2 * agg + ((lost / w) & 1)];
    if (c->seq > lost || (c->seq == lost && (c->state != AGGREGATING || (c->bitmap & bit)))) return;
    s->counters[E_NACK_SENT]++;
    uint8_t *h = sw_reserve(s, j, wid, HEADER); /* the header of ``lost`` alone */
    if (h) gf_header(h, 0, F_NACK, j->id, wid, j->fan_in, 0, lost, agg, bit);
}

/* SwitchMLPolicy.on_gradient (a root's: results are never from above). */
static void switchml_gradient(gf_switch *s, job_t *j, const gf_pkt *p, int64_t now) {
    int64_t w = j->slot_count, seq = p->seq, agg = p->agg, count = p->count;
    if (w == 0 || agg != j->slot_base + seq % w || agg >= s->slots) {
        s->counters[E_BAD_SLOT]++;
        return;
    }
    copy_t *c = &s->copies[2 * agg + ((seq / w) & 1)];
    if (p->flags & F_ACK) { /* SwitchMLPolicy.on_result: never FORWARDED at a root */
        s->counters[E_STALE_RESULT]++;
        return;
    }
    if (p->flags & F_FLOAT) {
        s->counters[E_FLOAT]++;
        return;
    }
    const uint8_t *payload = p->raw + HEADER;
    if (seq != c->seq) {
        if (seq < c->seq) {
            s->counters[E_STALE]++;
            return;
        }
        if (room(&c->values, &c->cap, count)) { /* out of memory: the workers retry */
            s->oom = 1;
            return;
        }
        s->claims++;
        c->seq = seq, c->state = AGGREGATING, c->bitmap = 0, c->count = 0, c->flags = 0;
        c->nvalues = (int)count, c->claim_ns = now;
        if (count) memcpy(c->values, payload, (size_t)count * 4);
    } else if (c->bitmap & p->bitmap) {
        if (c->state == COMPLETE) {
            s->counters[E_RETX_ANSWERED]++;
            send_result(s, j, c, agg, p->wid);
        } else {
            s->counters[E_DUPLICATE]++;
        }
        return;
    } else if (count != c->nvalues) {
        s->counters[E_COUNT_MISMATCH]++;
        return;
    } else {
        add_wrapping(c->values, payload, count);
    }
    c->bitmap |= p->bitmap;
    c->count++;
    c->flags |= (int)(p->flags & F_ECN);
    if ((p->flags & F_NACK) && !(p->flags & F_HELP)) notice(s, j, seq, p->wid, p->bitmap);
    if (c->count < j->fan_in) return;
    s->busy_ns += now - c->claim_ns;
    s->held_ns += now - c->claim_ns;
    c->state = COMPLETE;
    send_result(s, j, c, agg, GF_ALL);
}

/* ---- ATP and ESA (proto.switch.atp, proto.switch.esa) ---- */

static void to_ps(gf_switch *s, const job_t *j, const uint8_t *raw, int64_t len, int64_t seq,
                  int64_t or_flags) {
    uint8_t *d = sw_enqueue(s, j->id, 1, len, seq);
    if (!d) return;
    memcpy(d, raw, (size_t)len);
    if (or_flags) gf_wr16(d + 4, gf_rd16(d + 4) | or_flags);
}

/* ATPPolicy._aggregate, to the aggregator's owner's PS. */
static void aggregate(gf_switch *s, const job_t *j, const agg_t *a, int64_t index, int64_t flag) {
    uint8_t *h = sw_enqueue(s, j->id, 1, HEADER + 4 * (int64_t)a->nvalues, a->seq);
    if (!h) return;
    uint8_t *v = gf_header(h, 0, a->flags | flag, j->id, 0, j->fan_in, a->nvalues, a->seq, index,
                           a->bitmap);
    if (a->nvalues) memcpy(v, a->values, (size_t)(4 * a->nvalues));
}

static void atp_free(gf_switch *s, agg_t *a, int64_t now) {
    s->held_ns += now - a->claim_ns;
    a->state = FREE;
}

static int atp_stale(const agg_t *a, const job_t *j) {
    return a->job == j->id && j->window > 0 && a->seq <= j->newest - j->window;
}

/* ATPPolicy._make_room and ESAPolicy's: may ``p`` take ``a``? (0: yes,
 * the occupant evicted; -1: a collision) */
static int make_room(gf_switch *s, agg_t *a, const job_t *j, const gf_pkt *p, int64_t index,
                     int64_t now) {
    if (atp_stale(a, j)) {
        s->counters[E_STALE_RECLAIMED]++;
        atp_free(s, a, now);
        return 0;
    }
    if (s->policy != P_ESA) return -1;
    if (a->state == DONE) {
        s->counters[E_RECLAIMED_COMPLETE]++;
        atp_free(s, a, now);
        return 0;
    }
    const job_t *owner = (a->job >= 0 && a->job < MAX_JOBS) ? s->jobs[a->job] : NULL;
    if (a->state == HELD && p->prio > a->prio && owner) {
        s->counters[E_PREEMPTIONS]++;
        aggregate(s, owner, a, index, F_PARTIAL);
        atp_free(s, a, now);
        return 0;
    }
    return -1;
}

/* ATPPolicy.on_gradient */
static void atp_gradient(gf_switch *s, job_t *j, const gf_pkt *p, int64_t now) {
    if (p->agg >= s->slots) {
        s->counters[E_BAD_SLOT]++;
        return;
    }
    if (p->flags & (F_OVERFLOW | F_FLOAT)) {
        s->counters[E_PS_OVERFLOW]++;
        to_ps(s, j, p->raw, p->len, p->seq, 0);
        return;
    }
    agg_t *a = &s->pool[p->agg];
    int mine = a->state != FREE && a->job == j->id && a->seq == p->seq;
    if (p->flags & F_RESEND) {
        s->counters[E_PS_RESEND]++;
        if (mine && a->state == HELD) {
            s->counters[E_FLUSH_PARTIAL]++;
            aggregate(s, j, a, p->agg, F_PARTIAL);
            atp_free(s, a, now);
        } else if (mine) { /* COMPLETE: the aggregate may have been lost on its way;
                              * sent again once for every fan_in resends */
            if (a->resends == 0) aggregate(s, j, a, p->agg, 0);
            a->resends = (a->resends + 1) % j->fan_in;
        }
        to_ps(s, j, p->raw, p->len, p->seq, 0);
        return;
    }
    const uint8_t *payload = p->raw + HEADER;
    int64_t count = p->count;
    if (!mine) {
        if (a->state != FREE && make_room(s, a, j, p, p->agg, now)) {
            s->counters[E_PS_COLLISION]++;
            to_ps(s, j, p->raw, p->len, p->seq, F_COLLISION);
            return;
        }
        if (room(&a->values, &a->cap, count)) { /* out of memory: a loss the workers recover */
            s->oom = 1;
            return;
        }
        s->claims++;
        a->state = HELD, a->prio = (int)p->prio, a->job = j->id, a->seq = p->seq;
        a->bitmap = 0, a->count = 0, a->flags = 0, a->nvalues = (int)count, a->claim_ns = now;
        a->resends = 0;
    } else if (a->bitmap & p->bitmap) {
        s->counters[E_DUPLICATE]++;
        return;
    } else if (count != a->nvalues || a->state != HELD) {
        s->counters[a->state == HELD ? E_COUNT_MISMATCH : E_LATE]++;
        return;
    }
    a->bitmap |= p->bitmap;
    if (a->count++ == 0) { /* the first share since the claim */
        if (count) memcpy(a->values, payload, (size_t)count * 4);
    } else {
        add_wrapping(a->values, payload, count);
    }
    a->flags |= (int)(p->flags & F_ECN);
    if (a->count < j->fan_in) return;
    a->state = DONE;
    s->busy_ns += now - a->claim_ns;
    aggregate(s, j, a, p->agg, 0);
}

/* ATPPolicy.on_result: free the aggregator the result names, then on to the
 * workers (a PS's answer to one worker's retransmission: to that one). */
static void atp_result(gf_switch *s, job_t *j, const gf_pkt *p, int64_t now) {
    if (p->agg < s->slots) {
        agg_t *a = &s->pool[p->agg];
        if (a->state != FREE && a->job == j->id && (a->seq == p->seq || atp_stale(a, j)))
            atp_free(s, a, now);
    }
    if (p->seq > j->newest) j->newest = p->seq;
    if (p->flags & F_RESEND) {
        if (p->wid >= j->fan_in) {
            s->counters[E_BAD_RESULT]++;
            return;
        }
        sw_emit(s, j, p->wid, p->raw, p->len);
        return;
    }
    sw_emit(s, j, GF_ALL, p->raw, p->len);
}

/* SwitchEngine.on_packet after the node's checks: worker index, bitmap and
 * fan-in against the job, then the policy. */
void pool_packet(gf_switch *s, job_t *j, const gf_pkt *p, int64_t now) {
    int64_t n = j->fan_in;
    if (p->flags & F_ACK) { /* a result: from above (SwitchML, none at a root), or the PS */
        int64_t fan_in = s->policy == P_SWITCHML ? 1 : n;
        if (p->fan_in != fan_in || p->bitmap != gf_full(p->fan_in)) {
            s->counters[E_BAD_RESULT]++;
            return;
        }
        if (s->policy == P_SWITCHML)
            switchml_gradient(s, j, p, now);
        else
            atp_result(s, j, p, now);
        return;
    }
    if (p->fan_in != n || p->wid >= n || p->bitmap != (1ULL << p->wid)) {
        uint64_t b = p->bitmap;
        int help = (p->flags & F_HELP) && p->fan_in == n && p->wid < n && b && !(b & (b - 1)) &&
                   (n == 64 || !(b >> n));
        if (!help) {
            s->counters[E_BAD_WORKER]++;
            return;
        }
        s->counters[E_RX_HELP]++;
    }
    s->counters[E_RX_GRADIENT]++;
    if (s->policy == P_SWITCHML)
        switchml_gradient(s, j, p, now);
    else
        atp_gradient(s, j, p, now);
    if (j->help) help_observe(s, j, p); /* SA-ATP: after the policy, as the reference */
}
