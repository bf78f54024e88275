/* libFuzzer harness: the clients' quantiser (wire/_fastquant.c) on caller-
 * sized buffers, with AddressSanitizer and UndefinedBehaviorSanitizer:
 * exponents, encode and decode of the input's floats, at a block size and
 * scale the input chooses (a block of no values included). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int gf_exponents(const float *x, int64_t n, int64_t block, int32_t *out);
void gf_encode(const float *x, int64_t n, int64_t block, const double *scale, int32_t *out);
void gf_decode(const int64_t *r, int64_t n, int64_t block, const double *scale, float *out);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 3) return 0;
    int64_t block = (int64_t)data[0] - 8, e = (int8_t)data[1], n = (int64_t)(size - 2) / 4;
    float *x = malloc((size_t)(n ? n : 1) * 4);
    int64_t blocks = block > 0 ? (n + block - 1) / block : 1;
    int32_t *exps = malloc((size_t)blocks * 4), *q = malloc((size_t)(n ? n : 1) * 4);
    double *scale = malloc((size_t)blocks * 8);
    int64_t *r = malloc((size_t)(n ? n : 1) * 8);
    float *y = malloc((size_t)(n ? n : 1) * 4);
    if (x && exps && q && scale && r && y) {
        memcpy(x, data + 2, (size_t)n * 4);
        int bad = gf_exponents(x, n, block, exps);
        for (int64_t b = 0; b < blocks; b++) scale[b] = __builtin_ldexp(1.0, (int)(e % 40));
        if (!bad) gf_encode(x, n, block, scale, q); /* finite values: what callers encode */
        for (int64_t i = 0; i < n; i++) r[i] = (int64_t)q[i] * 64 * (i & 1 ? -1 : 1);
        memcpy(r, data + 2, (size_t)(n < 2 ? n : 2) * 4); /* and any int64 at all */
        gf_decode(r, n, block, scale, y);
    }
    free(x), free(exps), free(q), free(scale), free(r), free(y);
    return 0;
}
