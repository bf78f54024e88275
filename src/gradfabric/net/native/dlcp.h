/* What DLCP's two native engines share: the parameter server in the switch
 * node (switch_dlcp.c) and the worker's client (dlcp_client.c). */
#ifndef GF_DLCP_H
#define GF_DLCP_H

#include <stdint.h>
#include <stdlib.h>

#include "wire.h" /* (and math.h and string.h) */

#define PROBE 1        /* proto.dlcp.PROBE */
#define MAX_BACKOFF 64 /* proto.dlcp.MAX_BACKOFF */
#define TENSORS 65536  /* the header's tensor ids (``layer``) */

/* switch_dlcp_classes.c: a tensor's classes by packet (``back``: of the
 * model's back half), and its packets most important first
 * (proto.dlcp.classify of packet_norms; -1: out of memory) */
int dlcp_classify(const float *v, int64_t count, int64_t pp, int64_t back, uint8_t *prio,
                  int64_t *order);

/* A silent round's wait: twice the last, up to MAX_BACKOFF. */
static inline int64_t dlcp_doubled(int64_t backoff) {
    return 2 * backoff < MAX_BACKOFF ? 2 * backoff : MAX_BACKOFF;
}

/* Where the first byte equal to ``v`` is in ``[a, n)`` of ``x`` (n: none). */
static inline int64_t dlcp_find(const uint8_t *x, int v, int64_t a, int64_t n) {
    const uint8_t *at = a < n ? memchr(x + a, v, (size_t)(n - a)) : NULL;
    return at ? at - x : n;
}

/* DlcpReceiver._store: the values of ``p`` that a tensor lacks (``have``
 * per value, written to ``values``), the number it took (0: a duplicate,
 * counted). Once the tensor is ``done`` nothing is stored: the values it
 * went without, arriving now, are counted once each in ``late_by``, by the
 * packet's drop precedence (16 counters), and ``late`` marks them. */
static inline int64_t dlcp_store(const gf_pkt *p, int done, float *values, uint8_t *have,
                                 uint8_t *late, int64_t *late_by, int64_t *duplicate) {
    int64_t lo = p->agg, hi = p->agg + p->count, fresh = 0;
    for (int64_t i = lo; i < hi; i++) fresh += !have[i];
    if (done && fresh && late) {
        int64_t n = 0;
        for (int64_t i = lo; i < hi; i++)
            if (!have[i]) n += !late[i], late[i] = 1;
        late_by[p->prio & 0xF] += n;
    }
    if (done || !fresh) {
        ++*duplicate;
        return 0;
    }
    const uint8_t *v = p->raw + HEADER;
    for (int64_t i = lo; i < hi; i++) {
        if (have[i]) continue;
        if (p->flags & F_FLOAT) {
            memcpy(&values[i], v + 4 * (i - lo), 4);
        } else {
            int32_t x;
            memcpy(&x, v + 4 * (i - lo), 4);
            values[i] = (float)x;
        }
        have[i] = 1;
    }
    return fresh;
}

/* A vector in insertion order with an index by key (a dict's order). */
#define VEC(T) struct { T *v; int64_t n, cap, live; } /* NOLINT */

/* Room for one more entry at the end (0), compacting holes first where
 * they outnumber the live entries; ``at`` is rebuilt by ``reindex``. */
#define GROW(vec, reindex)                                                                      \
    ({                                                                                          \
        int _r = 0;                                                                             \
        if ((vec).n - (vec).live > (vec).live && (vec).n >= 64) {                               \
            int64_t _k = 0;                                                                     \
            for (int64_t _i = 0; _i < (vec).n; _i++)                                            \
                if ((vec).v[_i].live) (vec).v[_k++] = (vec).v[_i];                              \
            (vec).n = _k;                                                                       \
            reindex;                                                                            \
        }                                                                                       \
        if ((vec).n == (vec).cap) {                                                             \
            int64_t _cap = (vec).cap ? 2 * (vec).cap : 16;                                      \
            void *_v = realloc((vec).v, (size_t)_cap * sizeof *(vec).v);                        \
            if (_v)                                                                             \
                (vec).v = _v, (vec).cap = _cap;                                                 \
            else                                                                                \
                _r = -1;                                                                        \
        }                                                                                       \
        _r;                                                                                     \
    })

#endif
