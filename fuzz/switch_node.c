/* libFuzzer harness: the native switch node's datagram and control entry
 * points (net/native/switch_node.c), with AddressSanitizer and
 * UndefinedBehaviorSanitizer. Config: scheme (switchml, atp, esa, ps, dlcp),
 * window (0..8: a range of no slots is refused by the reference's config,
 * and here reaches the C's guard), pool size, jobs (1..4: ids 1.., workers 3, 2, 64, 1, tokens their
 * id eight times). Ops: 0 a datagram; 1 take what the node sends; 2 a job
 * resynchronises (or resumes); 3 time passes (u32 ns); 4 a job leaves and
 * comes back. The first config byte's high bit puts ATP's and ESA's PS behind
 * modelled links (gf_s_links), the next one SA-ATP's straggler monitor on
 * every job (gf_s_help); after every op the node handles its timer if it is
 * due. DLCP: every job a server (gf_s_dlcp; the fourth a background job),
 * its push bound, values a packet and timeout from the window (``dlcp_*``,
 * as tests/property/test_corpus.py reads them). */
#include <stdlib.h>

#include "../src/gradfabric/net/native/switch.h"
#include "ops.h"

gf_switch *gf_s_new(int64_t slots, int64_t policy);
void gf_s_free(gf_switch *s);
int gf_s_job(gf_switch *s, int64_t id, const uint8_t *token, int64_t fan_in, int64_t slot_base,
             int64_t slot_count, int64_t resync, int64_t window, int64_t ps_window, double scale);
void gf_s_forget(gf_switch *s, int64_t id);
uint64_t gf_s_missing(gf_switch *s, int64_t id);
int gf_s_datagram(gf_switch *s, const uint8_t *data, int64_t len, int64_t now);
int64_t gf_s_take(gf_switch *s, uint8_t *buf, int64_t cap);
int64_t gf_s_occupied(gf_switch *s);
int gf_s_links(gf_switch *s, double mbps);
int gf_s_help(gf_switch *s, int64_t id, int64_t lag, int64_t replicas, int64_t max_requests,
              int64_t it_len, int64_t policy);
int64_t gf_s_timer(void *e);
int gf_s_dlcp(gf_switch *s, int64_t id, double bound, int64_t per_packet, int64_t rto,
              int64_t max_values, int64_t background);
int gf_s_handle_timer(void *e, int64_t now);

static const int64_t WORKERS[4] = {3, 2, 64, 1};
static const double DLCP_BOUND[3] = {0.0, 0.1, 0.5};

static int64_t dlcp_values(int64_t window) { return window == 8 ? 256 : 1 + window; }

static void install(gf_switch *s, int policy, int64_t k, int64_t window, int resync, int help) {
    uint8_t token[8];
    memset(token, (int)(k + 1), 8);
    int statics = policy == P_SWITCHML;
    gf_s_job(s, k + 1, token, WORKERS[k], statics ? k * window : 0, statics ? window : 0, resync,
             statics ? 0 : window, 4 * window, 1e6);
    if (help) gf_s_help(s, k + 1, 1 + k, 2, 3, 1 + window, k % 2); /* refused but for ATP, ESA */
    if (policy == P_DLCP) /* (again for a job that resynchronises: refused, it has one) */
        gf_s_dlcp(s, k + 1, DLCP_BOUND[window % 3], dlcp_values(window), 1000 * (1 + window),
                  1 << 16, k == 3); /* (tensors of 2**16 values at most: a run's time stays short) */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader r = {data, size, 0};
    uint8_t first = rd_u8(&r);
    int policy = first % 5;
    int64_t window = rd_u8(&r) % 9, njobs = 1 + rd_u8(&r) % 4;
    int64_t slots = njobs * window + rd_u8(&r) % 16;
    gf_switch *s = gf_s_new(slots, policy);
    if (!s) return 0;
    if (first & 0x80) gf_s_links(s, first & 0x40 ? 1000.0 : 10.0); /* refused but for ATP, ESA */
    int resync[4] = {0};
    const int help = first & 0x20;
    for (int64_t k = 0; k < njobs; k++) install(s, policy, k, window, 0, help);
    static uint8_t buf[1 << 20];
    int64_t now = 0;
    uint8_t kind;
    const uint8_t *p;
    size_t n;
    while (next_op(&r, &kind, &p, &n)) {
        int64_t k = n ? p[0] % njobs : 0;
        switch (kind % 5) {
        case 0: gf_s_datagram(s, p, (int64_t)n, now); break;
        case 1: gf_s_take(s, buf, sizeof buf); break;
        case 2: resync[k] ^= 1, install(s, policy, k, window, resync[k], 0); break;
        case 3: now += le32(p, n); break;
        case 4: gf_s_forget(s, k + 1), install(s, policy, k, window, resync[k], help); break;
        }
        int64_t due = gf_s_timer(s);
        if (due >= 0 && due <= now) gf_s_handle_timer(s, now);
        for (int64_t j = 0; j < njobs; j++) gf_s_missing(s, j + 1);
        gf_s_occupied(s);
    }
    gf_s_take(s, buf, sizeof buf);
    gf_s_free(s);
    return 0;
}
