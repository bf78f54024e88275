/* DLCP's priority classes for a pull (proto.dlcp.packet_norms, classify),
 * for switch_dlcp.c: each packet's L2 norm exactly as numpy computes it,
 * since ties and near-ties decide a class (``pairwise`` is numpy's pairwise
 * summation of float64 squares: blocks of 8 partial sums up to 128 values,
 * halves above), then the ranks as the reference's stable argsorts. */
#include <math.h>
#include <stdlib.h>

#include "dlcp.h"

#define MAG_CLASSES 4 /* proto.dlcp.MAG_CLASSES */

/* numpy's pairwise summation of ``n`` doubles (its add.reduce's inner loop) */
static double pairwise(const double *a, int64_t n) {
    if (n < 8) {
        double r = 0.;
        for (int64_t i = 0; i < n; i++) r += a[i];
        return r;
    }
    if (n <= 128) {
        double r[8];
        int64_t i;
        for (int k = 0; k < 8; k++) r[k] = a[k];
        for (i = 8; i < n - n % 8; i += 8)
            for (int k = 0; k < 8; k++) r[k] += a[i + k];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t half = n / 2;
    half -= half % 8;
    return pairwise(a, half) + pairwise(a + half, n - half);
}

typedef struct {
    double key;
    int64_t i;
} ranked_t;

/* on (key, index): a stable argsort's order */
static int by_key(const void *x, const void *y) {
    const ranked_t *a = x, *b = y;
    if (a->key != b->key) return a->key < b->key ? -1 : 1;
    return (a->i > b->i) - (a->i < b->i);
}

/* Each packet's traffic class for a tensor of ``layer``'s half, into
 * ``prio``, and the packets most important first, into ``order``. */
int dlcp_classify(const float *v, int64_t count, int64_t pp, int64_t back, uint8_t *prio,
                  int64_t *order) {
    int64_t np = (count + pp - 1) / pp;
    ranked_t *r = malloc((size_t)np * sizeof *r);
    double *sq = malloc((size_t)pp * sizeof *sq);
    if (!r || !sq) {
        free(r), free(sq);
        return -1;
    }
    for (int64_t k = 0; k < np; k++) {
        for (int64_t i = 0; i < pp; i++) {
            double x = k * pp + i < count ? (double)v[k * pp + i] : 0.;
            sq[i] = x * x;
        }
        r[k] = (ranked_t){-sqrt(pairwise(sq, pp)), k}; /* argsort(-norms) */
    }
    qsort(r, (size_t)np, sizeof *r, by_key);
    const int half = back ? 1 : 0;
    for (int64_t k = 0; k < np; k++) prio[r[k].i] = (uint8_t)((half << 4) + k * MAG_CLASSES / np);
    for (int64_t k = 0; k < np; k++) r[k] = (ranked_t){prio[k], k};
    qsort(r, (size_t)np, sizeof *r, by_key);
    for (int64_t k = 0; k < np; k++) order[k] = r[k].i;
    free(r), free(sq);
    return 0;
}
