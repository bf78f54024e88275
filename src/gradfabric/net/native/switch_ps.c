/* The native parameter server: proto.ps.ParameterServer for one job, as the
 * switch node hosts it (ATP's and ESA's fallback, whose results go back
 * through the switch; or the PS baseline, which answers the workers itself).
 * Merge by bitmap: a packet disjoint from what is merged is added, one
 * inside it is a duplicate, one that overlaps partly is dropped (its new
 * contributors resend alone), one of every contribution replaces the partial
 * merge (it is the sum); results are kept for ``window`` sequences to
 * answer retransmissions, then forgotten (the floor). */
#include "switch.h"

#include <stdlib.h>
#include <string.h>

static void acc_free(acc_t *a) { free(a->iv), free(a->fv), free(a); }

void ps_clear(ps_t *ps) {
    for (int64_t i = 0; i < ps->naccs; i++) acc_free(ps->accs[i]);
    for (int64_t i = 0; i < ps->nres; i++) free(ps->res[i].raw);
    free(ps->accs), free(ps->res);
    memset(ps, 0, sizeof *ps);
}

/* ParameterServer.missing_workers, as a bitmap. */
uint64_t ps_missing(const job_t *j) {
    uint64_t full = gf_full(j->fan_in), bits = 0;
    for (int64_t i = 0; i < j->ps.naccs; i++) bits |= full & ~j->ps.accs[i]->bitmap;
    return bits;
}

/* where ``key`` is or would go in a sorted array of ``n`` (binary search) */
#define LOWER_BOUND(arr, n, key, field, out)                                                    \
    do {                                                                                        \
        int64_t lo_ = 0, hi_ = (n);                                                             \
        while (lo_ < hi_) {                                                                     \
            int64_t mid_ = lo_ + (hi_ - lo_) / 2;                                               \
            if ((arr)[mid_] field < (key)) lo_ = mid_ + 1; else hi_ = mid_;                     \
        }                                                                                       \
        (out) = lo_;                                                                            \
    } while (0)

/* ParameterServer._unicast: a kept result for worker ``wid`` alone, through
 * the switch flagged RESEND (ATP's fallback), or straight to it (PS). */
static void unicast(gf_switch *s, const job_t *j, const res_t *r, int64_t wid) {
    uint8_t *d = s->policy == P_PS ? sw_reserve(s, j, wid, r->len)
                                   : sw_enqueue(s, j->id, 0, r->len, r->seq);
    if (!d) return;
    memcpy(d, r->raw, (size_t)r->len);
    gf_wr16(d + 8, wid);
    if (s->policy != P_PS) gf_wr16(d + 4, gf_rd16(d + 4) | F_RESEND);
}

/* A result's bytes, to be kept (NULL: out of memory, a loss the workers recover). */
static uint8_t *result_room(gf_switch *s, ps_t *ps, int64_t len) {
    if (ps->nres == ps->capres) {
        int64_t cap = ps->capres ? 2 * ps->capres : 16;
        res_t *r = realloc(ps->res, (size_t)cap * sizeof *r);
        if (!r) goto oom;
        ps->res = r, ps->capres = cap;
    }
    uint8_t *raw = malloc((size_t)len);
    if (raw) return raw;
oom:
    s->oom = 1;
    return NULL;
}

/* Keep the result of ``seq`` (``raw``, ``len`` bytes, from result_room) and
 * send it back through the switch (ATP's fallback) or to every worker (PS);
 * results ``window`` sequences behind it are forgotten (ParameterServer's
 * done heap, here the sorted results). */
static void keep(gf_switch *s, job_t *j, int64_t seq, uint8_t *raw, int64_t len) {
    ps_t *ps = &j->ps;
    int64_t at;
    LOWER_BOUND(ps->res, ps->nres, seq, .seq, at);
    memmove(ps->res + at + 1, ps->res + at, (size_t)(ps->nres - at) * sizeof *ps->res);
    ps->res[at] = (res_t){seq, len, raw};
    ps->nres++;
    int64_t gone = 0;
    while (gone < ps->nres && ps->res[gone].seq <= seq - ps->window) {
        if (ps->res[gone].seq > ps->floor) ps->floor = ps->res[gone].seq;
        free(ps->res[gone++].raw);
    }
    memmove(ps->res, ps->res + gone, (size_t)(ps->nres - gone) * sizeof *ps->res);
    ps->nres -= gone;
    if (s->policy == P_PS) {
        sw_emit(s, j, GF_ALL, raw, len);
        return;
    }
    uint8_t *d = sw_enqueue(s, j->id, 0, len, seq); /* via the switch */
    if (d) memcpy(d, raw, (size_t)len);
}

/* ParameterServer._result: the merged sequence's result (int32 where it
 * fits, else floats at the job's scale, flagged OVERFLOW). */
static void complete(gf_switch *s, job_t *j, acc_t *acc) {
    ps_t *ps = &j->ps;
    int64_t n = acc->nvalues, flags = F_ACK | acc->flags, over = 0;
    for (int64_t k = 0; acc->has_i && !acc->has_f && k < n; k++)
        over |= acc->iv[k] > INT32_MAX_ || -acc->iv[k] > INT32_MAX_;
    if (acc->has_f || over) flags |= F_FLOAT | F_OVERFLOW;
    int64_t len = HEADER + 4 * n;
    uint8_t *raw = result_room(s, ps, len);
    if (!raw) return;
    uint8_t *v = gf_header(raw, 0, flags, j->id, 0, j->fan_in, n, acc->seq, acc->agg,
                           gf_full(j->fan_in));
    for (int64_t k = 0; k < n; k++) {
        if (acc->has_f || over) {
            double x = acc->has_f ? acc->fv[k] + (acc->has_i ? (double)acc->iv[k] / ps->scale : 0.0)
                                  : (double)acc->iv[k] / ps->scale;
            float f = (float)x;
            memcpy(v + 4 * k, &f, 4);
        } else {
            int32_t x = (int32_t)acc->iv[k];
            memcpy(v + 4 * k, &x, 4);
        }
    }
    keep(s, j, acc->seq, raw, len);
}

/* Does a packet hold INT32_MIN, a value past the integer domain as the
 * result reads it (|x| > INT32_MAX: floats, flagged OVERFLOW)? */
static int holds_int32_min(const gf_pkt *p) {
    for (int64_t k = 0; k < p->count; k++) {
        int32_t x;
        memcpy(&x, p->raw + HEADER + 4 * k, 4);
        if (x == -INT32_MAX_ - 1) return 1;
    }
    return 0;
}

/* ParameterServer.on_packet: merge by bitmap. */
void ps_packet(gf_switch *s, job_t *j, const gf_pkt *p) {
    ps_t *ps = &j->ps;
    int64_t n = j->fan_in, seq = p->seq, at;
    uint64_t full = gf_full(n);
    if ((p->flags & F_ACK) || p->fan_in != n || !p->bitmap || (p->bitmap & ~full) || p->wid >= n) {
        j->counters[S_BAD_PACKET]++;
        return;
    }
    if (seq <= ps->floor) {
        j->counters[S_STALE]++;
        return;
    }
    LOWER_BOUND(ps->res, ps->nres, seq, .seq, at);
    if (at < ps->nres && ps->res[at].seq == seq) {
        if (!(p->bitmap & (p->bitmap - 1))) { /* one worker (or its helper) asking again */
            j->counters[S_RESEND_ANSWERED]++;
            unicast(s, j, &ps->res[at], p->wid);
        } else {
            j->counters[S_LATE_PARTIAL]++;
        }
        return;
    }
    LOWER_BOUND(ps->accs, ps->naccs, seq, ->seq, at);
    acc_t *acc = at < ps->naccs && ps->accs[at]->seq == seq ? ps->accs[at] : NULL;
    int64_t ecn = 0;
    if (acc && p->bitmap == full && p->count == acc->nvalues) { /* the whole sum supersedes a
                                                                 * partial merge (its ECN kept) */
        ecn = acc->flags & F_ECN;
        memmove(ps->accs + at, ps->accs + at + 1, (size_t)(ps->naccs - at - 1) * sizeof *ps->accs);
        ps->naccs--;
        acc_free(acc);
        acc = NULL;
        j->counters[S_SUPERSEDED]++;
    }
    if (!acc && p->bitmap == full && !(p->flags & F_FLOAT) && !holds_int32_min(p)) {
        /* every contribution at once (a complete aggregate, the common case):
         * the int32 values are their own int64 sum and fit (INT32_MIN does
         * not: the merge below makes it an overflow), so the result is them
         * under a result's header (what the merge below would give) */
        uint8_t *raw = result_room(s, ps, p->len);
        if (!raw) return;
        j->counters[S_MERGED]++;
        uint8_t *v = gf_header(raw, 0, F_ACK | ((p->flags | ecn) & F_ECN), j->id, 0, n, p->count,
                               seq, p->agg, full);
        if (p->count) memcpy(v, p->raw + HEADER, (size_t)(4 * p->count));
        keep(s, j, seq, raw, p->len);
        return;
    }
    if (!acc) {
        if (ps->naccs >= PENDING_WINDOWS * ps->window && p->bitmap != full) { /* the bound */
            j->counters[S_PENDING_FULL]++;
            return;
        }
        if (ps->naccs == ps->capaccs) {
            int64_t cap = ps->capaccs ? 2 * ps->capaccs : 16;
            acc_t **a = realloc(ps->accs, (size_t)cap * sizeof *a);
            if (!a) goto oom;
            ps->accs = a, ps->capaccs = cap;
        }
        acc = calloc(1, sizeof *acc);
        if (!acc) goto oom;
        acc->seq = seq, acc->nvalues = p->count, acc->agg = p->agg;
        memmove(ps->accs + at + 1, ps->accs + at, (size_t)(ps->naccs - at) * sizeof *ps->accs);
        ps->accs[at] = acc;
        ps->naccs++;
    }
    if (acc->bitmap & p->bitmap) {
        j->counters[(acc->bitmap & p->bitmap) == p->bitmap ? S_DUPLICATE : S_OVERLAP]++;
        return;
    }
    if (p->count != acc->nvalues) {
        j->counters[S_COUNT_MISMATCH]++;
        return;
    }
    int64_t count = p->count, size = count ? count : 1;
    const uint8_t *payload = p->raw + HEADER;
    if (p->flags & F_FLOAT) {
        if (!acc->fv && !(acc->fv = malloc((size_t)size * sizeof(double)))) goto oom;
        for (int64_t k = 0; k < count; k++) {
            float f;
            memcpy(&f, payload + 4 * k, 4);
            acc->fv[k] = (double)f + (acc->has_f ? acc->fv[k] : 0.0); /* + 0: -0.0 becomes 0.0 */
        }
        acc->has_f = 1;
    } else {
        if (!acc->iv && !(acc->iv = malloc((size_t)size * sizeof(int64_t)))) goto oom;
        for (int64_t k = 0; k < count; k++) {
            int32_t x;
            memcpy(&x, payload + 4 * k, 4);
            acc->iv[k] = acc->has_i ? acc->iv[k] + x : x;
        }
        acc->has_i = 1;
    }
    j->counters[S_MERGED]++;
    acc->bitmap |= p->bitmap;
    acc->flags |= (p->flags | ecn) & F_ECN;
    if (!(p->flags & (F_COLLISION | F_RESEND | F_OVERFLOW))) acc->agg = p->agg;
    if (acc->bitmap != full) return;
    memmove(ps->accs + at, ps->accs + at + 1, (size_t)(ps->naccs - at - 1) * sizeof *ps->accs);
    ps->naccs--;
    complete(s, j, acc);
    acc_free(acc);
    return;
oom:
    s->oom = 1;
}
