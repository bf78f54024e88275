/* SwitchML's block-exponent quantiser, one pass per step, for the clients.
 *
 * The reference is numpy (`wire.quant.block_exponents`, `block_scales` and
 * the client's encode and decode in `runtime.client`): several passes over the
 * tensor and a float64 copy of it, which on a worker costs more CPU than
 * every datagram of the sum together (a 64 MB sum: ~0.23 CPU-s of numpy
 * against ~0.08 of packets). These loops compute the same IEEE operations
 * in the same order per value, so their results are bit for bit the
 * reference's (checked by tests/property/test_fastquant.py):
 *
 *   exponent  e_b = frexp(max_i |x_i|) over block b (as float64), -126 if 0
 *   encode    q_i = (int32) rint((double) x_i * scale_b)
 *   decode    y_i = (float) ((double) r_i / scale_b)
 *
 * (the reference's float64 product of a float32 value and a scale is the
 * same IEEE multiply here; its rint and int64-to-double are exact below).
 *
 * `scale_b` comes from Python (`block_scales`), so both paths share it. Built
 * with -ffp-contract=off and without -ffast-math: no fused or reassociated
 * arithmetic. The non-finite case (a NaN or inf anywhere) is reported, not
 * handled: the caller runs the reference for it.
 */
#include <math.h>
#include <stdint.h>

#ifndef GRADFABRIC_SOURCE
#define GRADFABRIC_SOURCE "unknown"
#endif
#define GF_API __attribute__((visibility("default"))) /* the rest is hidden */

GF_API const char *gf_source(void) { return GRADFABRIC_SOURCE; }

/* Two exact tricks keep the loops free of libm calls and int64 conversions,
 * so the compiler vectorises them with plain SSE2:
 * - A float's magnitude orders like its bit pattern with the sign cleared
 *   (NaN and inf above every finite value), so one unsigned max over those
 *   bits gives the block's peak and says whether anything was non-finite.
 * - For |v| < 2**51 in round-to-nearest, (v + 1.5 * 2**52) - 1.5 * 2**52 is
 *   rint(v) (ties to even), and the low 32 bits of v + 1.5 * 2**52 are
 *   rint(v) as a two's-complement int32; conversely an integer i is the
 *   double whose bits are bits(1.5 * 2**52) + i, less 1.5 * 2**52. Encoded
 *   values are below 2**31 and sums of 64 of them below 2**37. */
#define MAGIC 6755399441055744.0 /* 1.5 * 2**52 */
#define EXP_MASK 0x7f800000u

static inline uint32_t magnitude_bits(float f) {
  union { float f; uint32_t u; } v = {f};
  return v.u & 0x7fffffffu;
}

/* The exponent of every `block`-value slice of x (the last may be short).
 * Returns 0, 1 if x holds a NaN or an infinity (out is then unspecified),
 * or -1 for a block of no values (the callers check it first). */
GF_API int gf_exponents(const float *x, int64_t n, int64_t block, int32_t *out) {
  if (block < 1) return -1;
  uint32_t worst = 0;
  for (int64_t lo = 0, b = 0; lo < n; lo += block, ++b) {
    int64_t hi = lo + block < n ? lo + block : n;
    uint32_t peak = 0;
    for (int64_t i = lo; i < hi; ++i) {
      uint32_t u = magnitude_bits(x[i]);
      peak = u > peak ? u : peak;
    }
    worst = peak > worst ? peak : worst;
    union { uint32_t u; float f; } p = {peak};
    int e = -126;
    if (peak != 0) frexp((double)p.f, &e);
    out[b] = e;
  }
  return worst >= EXP_MASK;
}

GF_API void gf_encode(const float *x, int64_t n, int64_t block, const double *scale, int32_t *out) {
  if (block < 1) return;
  for (int64_t lo = 0, b = 0; lo < n; lo += block, ++b) {
    int64_t hi = lo + block < n ? lo + block : n;
    const double s = scale[b];
    for (int64_t i = lo; i < hi; ++i) { /* the low 32 bits of v + MAGIC are rint(v) */
      union { double d; uint64_t u; } v = {(double)x[i] * s + MAGIC};
      out[i] = (int32_t)(uint32_t)v.u;
    }
  }
}

GF_API void gf_decode(const int64_t *r, int64_t n, int64_t block, const double *scale, float *out) {
  if (block < 1) return;
  union { double d; uint64_t u; } magic = {MAGIC};
  for (int64_t lo = 0, b = 0; lo < n; lo += block, ++b) {
    int64_t hi = lo + block < n ? lo + block : n;
    const double s = scale[b];
    for (int64_t i = lo; i < hi; ++i) {
      /* (unsigned: a sum past 2**62 wraps, defined, where a signed add would
       * overflow; sums are below 2**37, where both agree) */
      union { uint64_t u; double d; } v = {(uint64_t)r[i] + magic.u};
      out[i] = (float)((v.d - MAGIC) / s);
    }
  }
}
