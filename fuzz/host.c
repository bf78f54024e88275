/* libFuzzer harness: the native helped host's entry points
 * (net/native/host.c), with AddressSanitizer and UndefinedBehaviorSanitizer.
 * Config: route (SwitchML's static slots; ATP's hashed pool, its ECN window
 * and resend flag), window (1..8), values a packet (1, 3, 300, 16000), fast
 * retransmit, loss notices, workers (3, 4, 64), how far ahead results are
 * taken (2**24, or 4). Ops: 0 a
 * datagram; 1 take what it sends; 2 time passes (u32 ns) and the timer runs
 * if due; 3 the own stream's share of 12-bit values, from the next sequence
 * plus payload[4] % 3 (a skip); 4 a shadow's share: the stream of worker
 * payload[0], skipped to its next sequence plus payload[1] % 4, 12-bit values
 * from payload[2..3]; 5 the events; 6 the driver's pending and sent, half of
 * what waits; 7 a stream's state (made on first use). The job's token is 9
 * eight times. */
#include <stdlib.h>

#include "../src/gradfabric/net/native/wire.h"
#include "ops.h"

typedef struct gf_host gf_host;
gf_host *gf_h_new(int64_t job, int64_t worker, int64_t fan_in, int64_t route, int64_t slot_base,
                  int64_t slot_count, int64_t pool_slots, int64_t resend_flag, int64_t rto_ns,
                  int64_t max_retries, int64_t fast_k, int64_t ecn_window, int64_t nack,
                  int64_t max_ahead, int64_t window, double max_cwnd, int64_t vpp,
                  const uint8_t *token, int64_t first_seq);
void gf_h_free(gf_host *h);
void gf_h_sink(gf_host *h, int64_t *sink, int64_t seqs);
int gf_h_state(gf_host *h, int64_t which, int64_t *st);
int gf_h_skip_to(gf_host *h, int64_t which, int64_t seq);
int gf_h_push(gf_host *h, int64_t which, const int32_t *vals, int64_t n, int64_t now,
              int64_t prio, int64_t at_seq);
int gf_h_datagram(gf_host *h, const uint8_t *data, int64_t len, int64_t now);
int64_t gf_h_deadline(gf_host *h);
int gf_h_timer(gf_host *h, int64_t now);
int64_t gf_h_events(gf_host *h, int64_t *buf, int64_t cap);
int64_t gf_h_take(gf_host *h, uint8_t *buf, int64_t cap);
int64_t gf_h_pending(gf_host *h, int64_t now, const gf_dgram **out);
void gf_h_sent(gf_host *h, int64_t n, int64_t now);

static const int64_t VPP[4] = {1, 3, 300, 16000};
static const int64_t WORKERS[3] = {3, 4, 64};
#define SINK_SEQS 256

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader r = {data, size, 0};
    int64_t route = rd_u8(&r) % 2, window = 1 + rd_u8(&r) % 8, vpp = VPP[rd_u8(&r) % 4];
    uint8_t f = rd_u8(&r);
    int64_t fast = (f & 1) ? 3 : 0, nack = (f >> 1) & 1;
    int64_t workers = WORKERS[(f >> 3) % 3], ahead = (f & 32) ? 4 : 1LL << 24;
    uint8_t token[8];
    memset(token, 9, 8);
    gf_host *h = gf_h_new(9, 1, workers, route, 5, window, 64, route == 1, 10000, 5, fast,
                          route == 1, nack, ahead, window, (double)window, vpp, token, 0);
    if (!h) return 0;
    int64_t *sink = calloc((size_t)(SINK_SEQS * vpp), 8), st[4], ev[3 * 16];
    static uint8_t buf[1 << 22];
    static int32_t vals[1 << 16];
    for (int64_t i = 0; i < (1 << 16); i++) vals[i] = (int32_t)(i * 2654435761u);
    if (sink) gf_h_sink(h, sink, SINK_SEQS);
    int64_t now = 0;
    uint8_t kind;
    const uint8_t *p;
    size_t n;
    while (next_op(&r, &kind, &p, &n)) {
        switch (kind % 8) {
        case 0: gf_h_datagram(h, p, (int64_t)n, now); break;
        case 1: gf_h_take(h, buf, sizeof buf); break;
        case 2: {
            now += le32(p, n);
            int64_t d = gf_h_deadline(h);
            if (d >= 0 && d <= now) gf_h_timer(h, now);
            break;
        }
        case 3: {
            int64_t values = 1 + (int64_t)(le32(p, n) & 0xfff);
            gf_h_state(h, -1, st);
            gf_h_push(h, -1, vals, values, now, 0, st[1] + (n > 4 ? p[4] % 3 : 0));
            break;
        }
        case 4: {
            int64_t s = n ? p[0] % workers : 0, values = 1 + (n > 3 ? (p[2] | (p[3] & 15) << 8) : 0);
            if (gf_h_state(h, s, st)) break;
            if (!gf_h_skip_to(h, s, st[1] + (n > 1 ? p[1] % 4 : 0)))
                gf_h_push(h, s, vals, values, now, 0, -1);
            break;
        }
        case 5: while (gf_h_events(h, ev, 16) == 16) {} break;
        case 6: {
            const gf_dgram *out;
            int64_t k = gf_h_pending(h, now, &out);
            for (int64_t i = 0; i < k; i++) /* what a driver reads of each */
                if (out[i].head_len) buf[i % sizeof buf] ^= out[i].head[out[i].head_len - 1];
            gf_h_sent(h, k / 2, now);
            break;
        }
        case 7: gf_h_state(h, n ? (int64_t)p[0] % (workers + 2) - 1 : -1, st); break;
        }
    }
    gf_h_take(h, buf, sizeof buf);
    gf_h_free(h);
    free(sink);
    return 0;
}
