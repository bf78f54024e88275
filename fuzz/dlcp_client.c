/* libFuzzer harness: the native DLCP client's entry points
 * (net/native/dlcp_client.c), with AddressSanitizer and
 * UndefinedBehaviorSanitizer. Config: values a packet (1, 3, 256, 2048),
 * the finished sums kept (1..8). Ops: 0 a datagram; 1 take what it sends;
 * 2 time passes (u32 ns) and the timer runs if due; 3 begin tensor
 * payload[0] % 8 of 1 + u16 values (from the payload's bytes), bound
 * payload[1] / 512, the back half if payload[2] is odd; 4 forget tensor
 * payload[0] % 8; 5 ask whether it is ready, and whether the engine is
 * idle. The job's token is 7 eight times. */
#include <stdlib.h>

#include "../src/gradfabric/net/native/wire.h"
#include "ops.h"

typedef struct gf_dc gf_dc;
gf_dc *gf_dc_new(int64_t job, int64_t rank, int64_t pp, int64_t rto, int64_t keep,
                 const uint8_t *token);
void gf_dc_free(gf_dc *e);
int gf_dc_begin(gf_dc *e, int64_t tensor, const float *x, int64_t n, int64_t back, double bound,
                float *out, int64_t now);
int gf_dc_ready(gf_dc *e, int64_t tensor);
void gf_dc_forget(gf_dc *e, int64_t tensor);
int gf_dc_idle(gf_dc *e);
int gf_dc_datagram(gf_dc *e, const uint8_t *d, int64_t len, int64_t now);
int64_t gf_dc_deadline(gf_dc *e);
int gf_dc_timer(gf_dc *e, int64_t now);
int64_t gf_dc_next(gf_dc *e, uint8_t *buf, int64_t cap);

static const int64_t VPP[4] = {1, 3, 256, 2048};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader r = {data, size, 0};
    int64_t vpp = VPP[rd_u8(&r) % 4], keep = 1 + rd_u8(&r) % 8;
    uint8_t token[8];
    memset(token, 7, 8);
    gf_dc *e = gf_dc_new(7, 1, vpp, 10000, keep, token);
    if (!e) return 0;
    static uint8_t buf[DGRAM];
    float *outs[8] = {0}; /* each tensor's sum, alive until it is begun again or forgotten */
    int64_t now = 0;
    uint8_t kind;
    const uint8_t *p;
    size_t n;
    while (next_op(&r, &kind, &p, &n)) {
        switch (kind % 6) {
        case 0: gf_dc_datagram(e, p, (int64_t)n, now); break;
        case 1:
            while (gf_dc_next(e, buf, sizeof buf) > 0) {
            }
            break;
        case 2: {
            now += le32(p, n);
            int64_t d = gf_dc_deadline(e);
            if (d >= 0 && d <= now) gf_dc_timer(e, now);
            break;
        }
        case 3: {
            int64_t t = n ? p[0] % 8 : 0, values = 1 + (int64_t)(le32(p, n) & 0xffff);
            float *x = malloc((size_t)values * 4), *out = malloc((size_t)values * 4);
            if (!x || !out) {
                free(x), free(out);
                break;
            }
            for (int64_t i = 0; i < values; i++) x[i] = n ? (float)(int8_t)p[i % n] : 0.f;
            double bound = (n > 1 ? p[1] : 0) / 512.0;
            int rc = gf_dc_begin(e, t, x, values, n > 2 && (p[2] & 1), bound, out, now);
            free(x); /* (the engine copied it) */
            if (rc == -2) { /* refused: the tensor's entry, if any, keeps its old sum */
                free(out);
                break;
            }
            free(outs[t]), outs[t] = out;
            break;
        }
        case 4: {
            int64_t t = n ? p[0] % 8 : 0;
            gf_dc_forget(e, t);
            free(outs[t]), outs[t] = NULL;
            break;
        }
        case 5: gf_dc_ready(e, n ? p[0] : 0), gf_dc_idle(e); break;
        }
    }
    while (gf_dc_next(e, buf, sizeof buf) > 0) {
    }
    gf_dc_free(e);
    for (int t = 0; t < 8; t++) free(outs[t]);
    return 0;
}
