/* libFuzzer harness: the native worker node's entry points
 * (net/native/worker.c), with AddressSanitizer and UndefinedBehaviorSanitizer.
 * Config: route (static slots, hashed pool, one server), window (1..8),
 * values a packet (1, 3, 300, 16000), fast retransmit, loss notices, pace,
 * the fused quantiser, and where the job's sequences start (0, or 64 short
 * of the wire's 2**32). Ops: 0 a datagram; 1 take what it sends; 2 time
 * passes (u32 ns) and the timer runs if due; 3 a collective of u16 values
 * (when the last one is done); 4 a replay from base less payload[0] %
 * (3 window + 1); 5 the read period. The job's token is 7 eight times. */
#include <stdlib.h>

#include "../src/gradfabric/net/native/worker.h"
#include "ops.h"

gf_worker *gf_w_new(int64_t job, int64_t worker, int64_t fan_in, int64_t route, int64_t slot_base,
                    int64_t slot_count, int64_t pool_slots, int64_t resend_flag, int64_t rto_ns,
                    int64_t max_retries, int64_t fast_k, int64_t ecn_window, int64_t vpp,
                    int64_t nack, int64_t window, double max_cwnd, double pace_gbps,
                    const uint8_t *token, int64_t first_seq);
void gf_w_free(gf_worker *w);
void gf_w_state(const gf_worker *w, int64_t *s);
int gf_w_push(gf_worker *w, int32_t *q, int64_t *out, int64_t n, int64_t now, const float *x,
              const double *enc_scale, const double *dec_scale, float *outf, encode_fn enc,
              decode_fn dec);
int gf_w_replay(gf_worker *w, int64_t floor, int64_t now);
int gf_w_datagram(gf_worker *w, const uint8_t *data, int64_t len, int64_t now);
int64_t gf_w_deadline(gf_worker *w);
int gf_w_timer(gf_worker *w, int64_t now);
int64_t gf_w_take(gf_worker *w, uint8_t *buf, int64_t cap, int64_t now);
int64_t gf_w_read_wait(gf_worker *w, int64_t now);
void gf_encode(const float *x, int64_t n, int64_t block, const double *scale, int32_t *out);
void gf_decode(const int64_t *r, int64_t n, int64_t block, const double *scale, float *out);

static const int64_t VPP[4] = {1, 3, 300, 16000};

typedef struct { /* a collective's arrays, alive until the next one */
    int32_t *q;
    int64_t *out;
    float *x, *outf;
    double *scale;
} call_t;

static void drop(call_t *c) {
    free(c->q), free(c->out), free(c->x), free(c->outf), free(c->scale);
    memset(c, 0, sizeof *c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader r = {data, size, 0};
    int64_t route = rd_u8(&r) % 3, window = 1 + rd_u8(&r) % 8, vpp = VPP[rd_u8(&r) % 4];
    uint8_t f = rd_u8(&r);
    int64_t fast = (f & 1) ? 3 : 0, nack = (f >> 1) & 1, fused = (f >> 3) & 1;
    double pace = (f & 4) ? 1.0 : 0.0;
    int64_t first = (f & 16) ? (1LL << 32) - 64 : 0;
    uint8_t token[8];
    memset(token, 7, 8);
    gf_worker *w = gf_w_new(7, 1, 3, route, 5, window, 64, route == 1, 10000, 5, fast, route == 1,
                            vpp, nack, window, (double)window, pace, token, first);
    if (!w) return 0;
    static uint8_t buf[1 << 22];
    call_t call = {0};
    int64_t now = 0, st[7];
    uint8_t kind;
    const uint8_t *p;
    size_t n;
    while (next_op(&r, &kind, &p, &n)) {
        switch (kind % 6) {
        case 0: gf_w_datagram(w, p, (int64_t)n, now); break;
        case 1: gf_w_take(w, buf, sizeof buf, now); break;
        case 2: {
            now += le32(p, n);
            int64_t d = gf_w_deadline(w);
            if (d >= 0 && d <= now) gf_w_timer(w, now);
            break;
        }
        case 3: {
            int64_t values = 1 + (int64_t)(le32(p, n) & 0xffff), blocks = (values + vpp - 1) / vpp;
            gf_w_state(w, st);
            if (!st[2]) break;
            drop(&call);
            call.q = calloc((size_t)values, 4), call.out = calloc((size_t)values, 8);
            call.x = calloc((size_t)values, 4), call.outf = calloc((size_t)values, 4);
            call.scale = malloc((size_t)blocks * 8);
            if (!call.q || !call.out || !call.x || !call.outf || !call.scale) break;
            for (int64_t b = 0; b < blocks; b++) call.scale[b] = 1048576.0;
            for (int64_t i = 0; i < values; i++) call.q[i] = (int32_t)(i * 2654435761u), call.x[i] = (float)i;
            gf_w_push(w, call.q, call.out, values, now, fused ? call.x : NULL, call.scale,
                      call.scale, call.outf, gf_encode, gf_decode);
            break;
        }
        case 4:
            gf_w_state(w, st);
            gf_w_replay(w, st[0] - (n ? p[0] : 0) % (3 * window + 1), now);
            break;
        case 5: gf_w_read_wait(w, now); break;
        }
    }
    gf_w_take(w, buf, sizeof buf, now);
    gf_w_free(w);
    drop(&call);
    return 0;
}
