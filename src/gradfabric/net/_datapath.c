/* The worker's native datapath: one collective of an in-network aggregation
 * worker (proto.worker.ResumableWorker, as emu.client.InaClient drives it),
 * with the socket I/O batched (recvmmsg, sendmmsg) and no per-datagram
 * Python work.
 *
 * Theory of operation
 * -------------------
 * The core is sans-I/O like the Python engine it mirrors: gf_w_start (the
 * push of a whole tensor), gf_w_datagram (one received datagram), gf_w_timer
 * and gf_w_deadline take the time as an argument; what they send is queued in
 * an outbox of (sequence, flags). gf_w_run is the driver: it reads the clock,
 * waits in ppoll, reads datagrams in batches and flushes the outbox with
 * sendmmsg, each datagram gathered from a header and the int32 tensor in place
 * (no copy of the values). Python's net.datapath wraps it; the Python engine
 * stays the reference, and tests/property/test_datapath.py feeds both the same
 * seeded datagrams (loss, duplicates, reordering, stale, foreign, forged and
 * malformed ones) and requires the same datagrams out, the same counters and
 * the same sums.
 *
 * The call covers sequences [first, first + npkts); per packet the state is
 * UNSENT -> OUTSTANDING -> DONE, with its deadline and retransmissions in
 * arrays the caller owns, so that Python can take the call over at any point
 * (a switch restart: the reference replays; a timeout: the reference names
 * the missing peer). Deadlines are created in increasing order (one RTO), so
 * a FIFO holds them sorted; stale entries are skipped where they surface,
 * exactly as in proto.worker.
 *
 * Semantics that must match the reference, in its order: the token first
 * (drop_bad_token), then every check of wire.packet.decode (drop_malformed),
 * then the engine (not a result of this job: drop_foreign; a result for a
 * sequence with no packet outstanding: drop_duplicate_result), then the
 * window (ATP's ECN window), new sends, fast retransmit, and the delivery of
 * the values into the int64 result. A result in float (left the integer
 * domain) or with a count other than what was sent marks the call's error.
 *
 * Plain C with the socket API alone, little-endian hosts (the wire is
 * little-endian and the values are gathered from memory as they are).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#ifndef GRADFABRIC_SOURCE
#define GRADFABRIC_SOURCE "unknown"
#endif
#define GF_API __attribute__((visibility("default"))) /* the rest is hidden */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire is little-endian and values are sent from memory as they are"
#endif

#define TOKEN 8
#define HEADER 32
#define MAGIC 0x4647
#define VERSION 1
#define F_ACK 0x1
#define F_RESEND 0x4
#define F_ECN 0x8
#define F_FLOAT 0x20
#define F_NACK 0x200
#define KNOWN_FLAGS 0x3ff
#define MAX_FAN_IN 64
#define MAX_WIRE_VALUES 16000
#define BATCH 32
#define DGRAM 65536
#define ABORT_CHECK_NS 10000000LL /* how often a waiting call looks at its abort flag */
#define A_RESEND (1 << 16)         /* outbox mark of a resend (not a wire flag) */
#define FRAME_BYTES 42             /* Ethernet, IPv4 and UDP headers: what a paced link carries */
#define PACE_BURST_NS 100000LL     /* credit a paced queue keeps after idling */
#define PACE_AHEAD_NS 300000LL     /* how far a paced queue may run ahead of its pace: it
                                      sends in small batches, and the link's queue holds
                                      no more than this much before a resend */
#define RX_EVERY_MAX_NS 200000LL   /* the longest a paced worker leaves its sockets unread */

enum { UNSENT = 0, OUTSTANDING = 1, DONE = 2 };
enum { ROUTE_STATIC = 0, ROUTE_HASHED = 1, ROUTE_ZERO = 2 };
/* counter indices: net.datapath.COUNTERS names them */
enum {
    C_RESULTS, C_RETRANSMITS, C_FAST, C_DUPLICATE, C_FOREIGN, C_HALVINGS, C_MALFORMED,
    C_BAD_TOKEN, C_SOCKET_ERROR, C_REARMED, C_NACK_RESENDS, C_STALE_NACK, C_TX, C_RX, C_SYSCALLS,
    NCOUNTERS
};
enum { RUN_DONE = 0, RUN_ABORTED = 1, RUN_TIMEOUT = 2, RUN_FAILED = 3, RUN_ERROR = 4 };

typedef void (*encode_fn)(const float *, int64_t, int64_t, const double *, int32_t *);
typedef void (*decode_fn)(const int64_t *, int64_t, int64_t, const double *, float *);

typedef struct {
    /* the job (set by the caller) */
    int64_t job, worker, fan_in, bitmap, priority, route, slot_base, slot_count, pool_slots,
        resend_flag, rto_ns, max_retries, fast_k, ecn_window, vpp, nack;
    double max_cwnd;
    uint8_t token[TOKEN];
    /* the call (set by the caller; the arrays are the caller's) */
    int64_t first, npkts, nvalues;
    int32_t *q;
    int64_t *out;
    uint8_t *st;
    int64_t *deadline;
    int64_t *tries;
    /* state, in and out */
    int64_t base, next, highest, fast_seq, fast_from, recover_seq, push_end;
    double cwnd;
    int64_t fail_seq, error_seq, error_kind;
    int64_t counters[NCOUNTERS];
    /* the fused quantiser (optional, x NULL: off): each packet's values are
     * encoded into q when it is first sent, each result decoded into outf on
     * arrival, by wire/_fastquant.c's own functions (enc, dec), one block a packet */
    const float *x;
    const double *enc_scale, *dec_scale;
    float *outf;
    encode_fn enc;
    decode_fn dec;
    /* internal */
    int64_t *fifo; /* pairs (deadline, seq) in a ring */
    int64_t fifo_cap, fifo_head, fifo_len;
    int64_t *outbox; /* pairs (seq, flags) */
    int64_t outbox_cap, outbox_len;
    uint8_t *rx; /* BATCH datagrams */
    /* the driver's send queue, pairs (seq, flags): what the core emitted, in
     * order, but resends ahead of new packets when paced (a resend must not
     * wait behind a window of new data: the loss it repairs blocks the window) */
    int64_t *txq;
    int64_t txq_cap, txq_head, txq_len;
    double pace_ns_per_byte; /* 0: send at once; else each datagram's wire bytes at this pace */
    int64_t next_tx;         /* when the paced queue may send next */
} gf_worker;

GF_API const char *gf_source(void) { return GRADFABRIC_SOURCE; }
GF_API int64_t gf_w_size(void) { return (int64_t)sizeof(gf_worker); }

static int grow(int64_t **buf, int64_t *cap, int64_t need) {
    if (need <= *cap) return 0;
    int64_t c = *cap ? *cap : 256;
    while (c < need) c *= 2;
    int64_t *n = realloc(*buf, (size_t)c * 2 * sizeof(int64_t));
    if (!n) return -1;
    *buf = n;
    *cap = c;
    return 0;
}

/* A full ring of pairs unrolled into one twice as large. */
static int ring_grow(int64_t **buf, int64_t *cap, int64_t *head, int64_t len) {
    int64_t old = *cap, c = old ? old * 2 : 256;
    int64_t *n = malloc((size_t)c * 2 * sizeof(int64_t));
    if (!n) return -1;
    for (int64_t i = 0; i < len; i++) {
        int64_t k = (*head + i) % old;
        n[2 * i] = (*buf)[2 * k];
        n[2 * i + 1] = (*buf)[2 * k + 1];
    }
    free(*buf);
    *buf = n, *cap = c, *head = 0;
    return 0;
}

static int fifo_push(gf_worker *w, int64_t deadline, int64_t seq) {
    if (w->fifo_len == w->fifo_cap && ring_grow(&w->fifo, &w->fifo_cap, &w->fifo_head, w->fifo_len))
        return -1;
    int64_t k = (w->fifo_head + w->fifo_len) % w->fifo_cap;
    w->fifo[2 * k] = deadline;
    w->fifo[2 * k + 1] = seq;
    w->fifo_len++;
    return 0;
}

static void fifo_pop(gf_worker *w) {
    w->fifo_head = (w->fifo_head + 1) % w->fifo_cap;
    w->fifo_len--;
}

static int emit(gf_worker *w, int64_t seq, int64_t flags) {
    if (grow(&w->outbox, &w->outbox_cap, w->outbox_len + 1)) return -1;
    w->outbox[2 * w->outbox_len] = seq;
    w->outbox[2 * w->outbox_len + 1] = flags;
    w->outbox_len++;
    return 0;
}

static int outstanding(const gf_worker *w, int64_t seq) {
    return seq >= w->first && seq < w->first + w->npkts && w->st[seq - w->first] == OUTSTANDING;
}

static int64_t count_of(const gf_worker *w, int64_t seq);

/* proto.worker.WorkerEngine._pump (a packet's values quantised as it first leaves) */
static int pump(gf_worker *w, int64_t now) {
    int64_t limit = w->base + (int64_t)w->cwnd, deadline = now + w->rto_ns;
    while (w->next < w->push_end && w->next < limit) {
        int64_t seq = w->next++, i = seq - w->first;
        if (seq < w->base || w->st[i] == DONE) continue;
        if (w->x) /* the fused quantiser: this packet is one block */
            w->enc(w->x + i * w->vpp, count_of(w, seq), w->vpp, w->enc_scale + i, w->q + i * w->vpp);
        w->st[i] = OUTSTANDING;
        w->deadline[i] = deadline;
        w->tries[i] = 0;
        if (fifo_push(w, deadline, seq) || emit(w, seq, 0)) return -1;
    }
    return 0;
}

/* proto.worker.WorkerEngine._resend */
static int resend(gf_worker *w, int64_t seq, int64_t deadline) {
    if (w->deadline[seq - w->first] != deadline) { /* (two resends in one instant: one entry) */
        w->deadline[seq - w->first] = deadline;
        if (fifo_push(w, deadline, seq)) return -1;
    }
    return emit(w, seq, (w->resend_flag ? F_RESEND : 0) | A_RESEND);
}

/* The values of packet ``seq``: where they start in the tensor, how many. */
static int64_t count_of(const gf_worker *w, int64_t seq) {
    int64_t lo = (seq - w->first) * w->vpp, n = w->nvalues - lo;
    return n < w->vpp ? n : w->vpp;
}

static uint32_t agg_index(const gf_worker *w, int64_t seq) {
    if (w->route == ROUTE_STATIC) return (uint32_t)(w->slot_base + seq % w->slot_count);
    if (w->route == ROUTE_HASHED)
        return (uint32_t)(((uint64_t)seq + (uint64_t)w->job * 2654435761ULL) % (uint64_t)w->pool_slots);
    return 0;
}

static void wr16(uint8_t *p, int64_t v) { uint16_t u = (uint16_t)v; memcpy(p, &u, 2); }

/* The token and header of packet ``seq`` (wire.envelope.seal of proto.worker's
 * packet): magic, version, priority, flags, job, worker, fan_in, layer (0),
 * count, seq, agg_index, bitmap. */
static void header(const gf_worker *w, int64_t seq, int64_t flags, uint8_t *h) {
    memcpy(h, w->token, TOKEN);
    h += TOKEN;
    wr16(h, MAGIC);
    h[2] = VERSION;
    h[3] = (uint8_t)w->priority;
    wr16(h + 4, flags | (w->nack ? F_NACK : 0));
    wr16(h + 6, w->job);
    wr16(h + 8, w->worker);
    wr16(h + 10, w->fan_in);
    wr16(h + 12, 0);
    wr16(h + 14, count_of(w, seq));
    uint32_t s = (uint32_t)seq, a = agg_index(w, seq);
    uint64_t b = (uint64_t)w->bitmap;
    memcpy(h + 16, &s, 4);
    memcpy(h + 20, &a, 4);
    memcpy(h + 24, &b, 8);
}

GF_API int gf_w_init(gf_worker *w) {
    w->fifo = NULL;
    w->outbox = NULL;
    w->txq = NULL;
    w->txq_cap = w->txq_head = w->txq_len = w->next_tx = 0;
    w->fifo_cap = w->fifo_head = w->fifo_len = w->outbox_cap = w->outbox_len = 0;
    w->rx = malloc((size_t)BATCH * DGRAM);
    return w->rx ? 0 : -1;
}

GF_API void gf_w_free(gf_worker *w) {
    free(w->fifo);
    free(w->outbox);
    free(w->txq);
    w->txq = NULL;
    free(w->rx);
    w->fifo = w->outbox = NULL;
    w->rx = NULL;
}

/* A new call: the engine pushes the whole tensor (proto.worker.WorkerEngine.push). */
GF_API int gf_w_start(gf_worker *w, int64_t now) {
    w->fifo_head = w->fifo_len = w->outbox_len = 0;
    w->base = w->next = w->first;
    w->push_end = w->first + w->npkts;
    w->fail_seq = w->error_seq = -1;
    w->error_kind = 0;
    memset(w->st, UNSENT, (size_t)w->npkts);
    return pump(w, now);
}

/* proto.worker.WorkerEngine._adjust_window */
static void adjust_window(gf_worker *w, int64_t seq, int64_t flags) {
    if (flags & F_ECN) {
        if (seq >= w->recover_seq) {
            w->cwnd = w->cwnd / 2 > 1.0 ? w->cwnd / 2 : 1.0;
            w->recover_seq = w->push_end;
            w->counters[C_HALVINGS]++;
        }
    } else {
        double c = w->cwnd + 1.0 / w->cwnd;
        w->cwnd = w->max_cwnd < c ? w->max_cwnd : c;
    }
}

/* proto.worker.WorkerEngine._fast_retransmit */
static int fast_retransmit(gf_worker *w, int64_t seq, int64_t now) {
    if (seq > w->highest) w->highest = seq;
    int64_t base = w->base;
    if (w->fast_seq != base) w->fast_seq = w->fast_from = base;
    if (w->highest - w->fast_from < w->fast_k) return 0;
    if (!outstanding(w, base) || w->tries[base - w->first] >= w->max_retries) return 0;
    w->fast_from = w->highest;
    w->tries[base - w->first]++;
    w->counters[C_FAST]++;
    return resend(w, base, now + w->rto_ns);
}

/* proto.worker.WorkerEngine._on_notice: the switch lacks this worker's share. */
static int on_notice(gf_worker *w, int64_t seq, int64_t now) {
    if (!outstanding(w, seq) || w->tries[seq - w->first] >= w->max_retries) {
        w->counters[C_STALE_NACK]++;
        return 0;
    }
    w->tries[seq - w->first]++;
    w->counters[C_NACK_RESENDS]++;
    return resend(w, seq, now + w->rto_ns);
}

static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* One datagram from the socket: unseal, decode, then the engine and the delivery.
 * Returns -1 only when out of memory. */
GF_API int gf_w_datagram(gf_worker *w, const uint8_t *data, int64_t len, int64_t now) {
    if (len < TOKEN || memcmp(data, w->token, TOKEN) != 0) {
        w->counters[C_BAD_TOKEN]++;
        return 0;
    }
    const uint8_t *h = data + TOKEN;
    len -= TOKEN;
    if (len < HEADER) goto malformed;
    uint16_t flags = rd16(h + 4), job = rd16(h + 6), wid = rd16(h + 8), fan_in = rd16(h + 10),
             count = rd16(h + 14);
    uint32_t seq32;
    uint64_t bitmap;
    memcpy(&seq32, h + 16, 4);
    memcpy(&bitmap, h + 24, 8);
    if (rd16(h) != MAGIC || h[2] != VERSION || (flags & ~KNOWN_FLAGS)) goto malformed;
    if (fan_in < 1 || fan_in > MAX_FAN_IN || wid >= MAX_FAN_IN) goto malformed;
    if (fan_in < 64 && (bitmap >> fan_in)) goto malformed;
    if (count > MAX_WIRE_VALUES || len != HEADER + 4 * (int64_t)count) goto malformed;
    const uint8_t *payload = h + HEADER;
    if (flags & F_FLOAT) {
        for (int64_t j = 0; j < count; j++) {
            float f;
            memcpy(&f, payload + 4 * j, 4);
            if (!isfinite(f)) goto malformed;
        }
    }
    int64_t seq = seq32;
    if (!(flags & F_ACK) || job != w->job) {
        if ((flags & F_NACK) && w->nack && job == w->job && wid == w->worker && !(flags & F_ACK))
            return on_notice(w, seq, now);
        w->counters[C_FOREIGN]++;
        return 0;
    }
    if (!outstanding(w, seq)) { /* no help is taken: nothing ahead of what was sent */
        w->counters[C_DUPLICATE]++;
        return 0;
    }
    w->st[seq - w->first] = DONE;
    w->counters[C_RESULTS]++;
    if (seq == w->base) {
        int64_t b = seq + 1, end = w->first + w->npkts;
        while (b < end && w->st[b - w->first] == DONE) b++;
        w->base = b;
    }
    if (w->ecn_window) adjust_window(w, seq, flags);
    if (pump(w, now)) return -1;
    if (w->fast_k && fast_retransmit(w, seq, now)) return -1;
    /* the delivery (emu.client.InaClient._deliver) */
    if (flags & F_FLOAT || count != count_of(w, seq)) {
        if (w->error_seq < 0) {
            w->error_seq = seq;
            w->error_kind = flags & F_FLOAT ? 1 : 2;
        }
        return 0;
    }
    int64_t i = seq - w->first, *dst = w->out + i * w->vpp;
    for (int64_t j = 0; j < count; j++) {
        int32_t v;
        memcpy(&v, payload + 4 * j, 4);
        dst[j] = v;
    }
    if (w->x) w->dec(dst, count, w->vpp, w->dec_scale + i, w->outf + i * w->vpp);
    return 0;
malformed:
    w->counters[C_MALFORMED]++;
    return 0;
}

/* proto.worker.WorkerEngine.next_deadline: -1 for none. */
GF_API int64_t gf_w_deadline(gf_worker *w) {
    while (w->fifo_len) {
        int64_t k = w->fifo_head, d = w->fifo[2 * k], seq = w->fifo[2 * k + 1];
        if (outstanding(w, seq) && w->deadline[seq - w->first] == d) return d;
        fifo_pop(w);
    }
    return -1;
}

/* proto.worker.WorkerEngine.on_timer: 1 if it gave up (fail_seq), -1 out of memory.
 * With fast retransmit or notices on, only the lowest due sequence is resent,
 * the others re-armed. */
GF_API int gf_w_timer(gf_worker *w, int64_t now) {
    int64_t mark = w->outbox_len, n = 0, later = now + w->rto_ns;
    int64_t *due = malloc(sizeof(int64_t) * (size_t)(w->fifo_len ? w->fifo_len : 1));
    if (!due) return -1;
    while (w->fifo_len && w->fifo[2 * w->fifo_head] <= now) {
        int64_t k = w->fifo_head, d = w->fifo[2 * k], seq = w->fifo[2 * k + 1];
        fifo_pop(w);
        if (outstanding(w, seq) && w->deadline[seq - w->first] == d) due[n++] = seq;
    }
    if ((w->fast_k || w->nack) && n > 1) {
        int64_t low = 0;
        for (int64_t j = 1; j < n; j++)
            if (due[j] < due[low]) low = j;
        for (int64_t j = 0; j < n; j++) {
            if (j == low) continue;
            w->deadline[due[j] - w->first] = later;
            if (fifo_push(w, later, due[j])) goto oom;
        }
        w->counters[C_REARMED] += n - 1;
        due[0] = due[low], n = 1;
    }
    for (int64_t j = 0; j < n; j++) {
        int64_t seq = due[j];
        if (++w->tries[seq - w->first] > w->max_retries) {
            w->outbox_len = mark; /* the reference returns the Fail alone */
            w->fail_seq = seq;
            free(due);
            return 1;
        }
        w->counters[C_RETRANSMITS]++;
        if (resend(w, seq, later)) goto oom;
    }
    free(due);
    return 0;
oom:
    free(due);
    return -1;
}

/* The outbox as bytes (for the differential test): each datagram as a u32
 * length and its bytes; returns the bytes written, or -1 if ``cap`` is short. */
GF_API int64_t gf_w_take(gf_worker *w, uint8_t *buf, int64_t cap) {
    int64_t at = 0;
    for (int64_t i = 0; i < w->outbox_len; i++) {
        int64_t seq = w->outbox[2 * i], n = count_of(w, seq);
        uint32_t size = (uint32_t)(TOKEN + HEADER + 4 * n);
        if (at + 4 + (int64_t)size > cap) return -1;
        memcpy(buf + at, &size, 4);
        header(w, seq, w->outbox[2 * i + 1], buf + at + 4);
        memcpy(buf + at + 4 + TOKEN + HEADER, w->q + (seq - w->first) * w->vpp, (size_t)(4 * n));
        at += 4 + size;
    }
    w->outbox_len = 0;
    return at;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int tx_push(gf_worker *w, int64_t seq, int64_t flags, int front) {
    if (w->txq_len == w->txq_cap && ring_grow(&w->txq, &w->txq_cap, &w->txq_head, w->txq_len))
        return -1;
    int64_t k;
    if (front) {
        w->txq_head = (w->txq_head + w->txq_cap - 1) % w->txq_cap;
        k = w->txq_head;
    } else {
        k = (w->txq_head + w->txq_len) % w->txq_cap;
    }
    w->txq[2 * k] = seq, w->txq[2 * k + 1] = flags;
    w->txq_len++;
    return 0;
}

/* Send what the pace allows of the send queue (all of it, unpaced): sendmmsg
 * in batches, each datagram gathered from its header and the tensor. A full
 * socket buffer waits for room (the kernel's own pacing); another error is
 * counted and the datagram is a loss the protocol recovers. Returns -1 only
 * when out of memory. */
static int flush(gf_worker *w, int fd, const struct sockaddr *addr, socklen_t alen) {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH][2];
    uint8_t heads[BATCH][TOKEN + HEADER];
    for (int64_t i = 0; i < w->outbox_len; i++) {
        int64_t flags = w->outbox[2 * i + 1];
        if (tx_push(w, w->outbox[2 * i], flags, w->pace_ns_per_byte > 0 && (flags & A_RESEND)))
            return -1;
    }
    w->outbox_len = 0;
    int64_t now = now_ns();
    if (w->next_tx < now - PACE_BURST_NS) w->next_tx = now - PACE_BURST_NS;
    while (w->txq_len) {
        int n = 0;
        int64_t due = w->next_tx;
        for (; n < BATCH && n < w->txq_len; n++) {
            if (w->pace_ns_per_byte > 0 && due > now + PACE_AHEAD_NS) break;
            int64_t k = (w->txq_head + n) % w->txq_cap, seq = w->txq[2 * k];
            header(w, seq, w->txq[2 * k + 1], heads[n]);
            iov[n][0].iov_base = heads[n];
            iov[n][0].iov_len = TOKEN + HEADER;
            iov[n][1].iov_base = (void *)(w->q + (seq - w->first) * w->vpp);
            iov[n][1].iov_len = (size_t)(4 * count_of(w, seq));
            memset(&msgs[n], 0, sizeof msgs[n]);
            msgs[n].msg_hdr.msg_name = (void *)addr;
            msgs[n].msg_hdr.msg_namelen = alen;
            msgs[n].msg_hdr.msg_iov = iov[n];
            msgs[n].msg_hdr.msg_iovlen = 2;
            due += (int64_t)(w->pace_ns_per_byte * (double)(TOKEN + HEADER + FRAME_BYTES + iov[n][1].iov_len));
        }
        if (n == 0) break; /* the pace holds the rest back: gf_w_run waits for next_tx */
        int sent = sendmmsg(fd, msgs, (unsigned)n, 0);
        w->counters[C_SYSCALLS]++;
        if (sent <= 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) {
                struct pollfd p = {fd, POLLOUT, 0};
                poll(&p, 1, 1);
                now = now_ns();
                continue;
            }
            if (errno == EINTR) continue;
            w->counters[C_SOCKET_ERROR]++;
            sent = 1; /* that datagram is lost */
        } else {
            w->counters[C_TX] += sent;
        }
        for (int k = 0; k < sent; k++) {
            int64_t seq = w->txq[2 * w->txq_head];
            if (w->pace_ns_per_byte > 0)
                w->next_tx += (int64_t)(w->pace_ns_per_byte * (double)(TOKEN + HEADER + FRAME_BYTES + 4 * count_of(w, seq)));
            w->txq_head = (w->txq_head + 1) % w->txq_cap;
            w->txq_len--;
        }
    }
    return 0;
}

/* One batch of what socket ``fd`` holds through gf_w_datagram: how many
 * datagrams came (0 on a socket error, counted), -1 on memory. */
static int receive(gf_worker *w, int fd) {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    for (int k = 0; k < BATCH; k++) {
        iov[k].iov_base = w->rx + (size_t)k * DGRAM;
        iov[k].iov_len = DGRAM;
        memset(&msgs[k], 0, sizeof msgs[k]);
        msgs[k].msg_hdr.msg_iov = &iov[k];
        msgs[k].msg_hdr.msg_iovlen = 1;
    }
    int got = recvmmsg(fd, msgs, BATCH, MSG_DONTWAIT, NULL);
    w->counters[C_SYSCALLS]++;
    if (got < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            w->counters[C_SOCKET_ERROR]++;
        return 0;
    }
    int64_t now = now_ns();
    w->counters[C_RX] += got;
    for (int k = 0; k < got; k++) {
        int64_t n = (msgs[k].msg_hdr.msg_flags & MSG_TRUNC) ? DGRAM + 1 : msgs[k].msg_len;
        if (gf_w_datagram(w, w->rx + (size_t)k * DGRAM, n, now)) return -1;
    }
    return got;
}

/* How long a paced worker leaves its sockets unread (0: it reads on each
 * arrival). Its results come at most at its link's rate, so a read on a
 * period finds a batch, and the worker wakes once a batch instead of once a
 * datagram: each wake-up is a context switch each way, most of a worker's
 * kernel time on the shaped star (NOTEBOOK: about 10% less worker CPU a sum
 * at 1 Gbit/s, for about 1.6% more time a sum; DDP's steps gained). The
 * period is the link time of half a batch of the largest datagrams, at most
 * RX_EVERY_MAX_NS: a read seldom finds a full batch (then it reads again),
 * and a result waits far less than a window's round trip. Not while a
 * repair is under way (gf_w_run): there each notice's wait delays the
 * resend it asks for (5% loss: 13% slower sums with the period). */
static int64_t rx_every(const gf_worker *w) {
    if (w->pace_ns_per_byte <= 0) return 0;
    double half = (double)(BATCH / 2) * (double)(TOKEN + HEADER + FRAME_BYTES + 4 * w->vpp);
    int64_t t = (int64_t)(half * w->pace_ns_per_byte);
    return t < RX_EVERY_MAX_NS ? t : RX_EVERY_MAX_NS;
}

/* Drive the call on socket ``fd`` until every result is in (RUN_DONE), the
 * caller sets ``*abort`` (RUN_ABORTED), ``wall_deadline`` passes (RUN_TIMEOUT),
 * a packet runs out of retransmissions (RUN_FAILED, fail_seq) or memory does
 * (RUN_ERROR). gf_w_start must have run. ``group_fd`` (-1: none) is the
 * socket that receives the job's multicast results (emu.client.Attached);
 * everything is sent from ``fd``. */
GF_API int gf_w_run(gf_worker *w, int fd, int group_fd, const uint8_t *addr, int64_t alen,
             int64_t wall_deadline, volatile const int32_t *abort) {
    const struct sockaddr *sa = (const struct sockaddr *)addr;
    const int64_t period = rx_every(w);
    const int nfds = group_fd < 0 ? 1 : 2;
    int64_t resends = -1, repairing_until = 0;
    w->txq_head = w->txq_len = 0;
    if (flush(w, fd, sa, (socklen_t)alen)) return RUN_ERROR;
    while (w->base < w->push_end) {
        if (*abort) return RUN_ABORTED;
        int64_t now = now_ns();
        if (now >= wall_deadline) return RUN_TIMEOUT;
        int64_t d = gf_w_deadline(w);
        if (d >= 0 && d <= now) {
            int r = gf_w_timer(w, now);
            if (r) return r > 0 ? RUN_FAILED : RUN_ERROR;
            if (flush(w, fd, sa, (socklen_t)alen)) return RUN_ERROR;
            continue;
        }
        if (w->txq_len && w->next_tx <= now + PACE_AHEAD_NS) {
            if (flush(w, fd, sa, (socklen_t)alen)) return RUN_ERROR;
            continue;
        }
        int64_t wait = wall_deadline - now;
        if (d >= 0 && d - now < wait) wait = d - now;
        if (w->txq_len && w->next_tx - PACE_AHEAD_NS - now < wait) wait = w->next_tx - PACE_AHEAD_NS - now;
        if (wait > ABORT_CHECK_NS) wait = ABORT_CHECK_NS;
        /* a resend (a timeout, a fast retransmit, a loss notice answered) means
         * a repair is under way, whose speed the next notice or result sets:
         * for an RTO after it, read on each arrival again */
        int64_t r = w->counters[C_RETRANSMITS] + w->counters[C_FAST] + w->counters[C_NACK_RESENDS];
        if (r != resends) {
            if (resends >= 0) repairing_until = now + w->rto_ns;
            resends = r;
        }
        const int64_t every = now < repairing_until ? 0 : period;
        if (every && wait > every) wait = every;
        struct timespec ts = {wait / 1000000000LL, wait % 1000000000LL};
        const short events = every ? 0 : POLLIN; /* paced: wake on the period alone */
        struct pollfd p[2] = {{fd, events, 0}, {group_fd, events, 0}};
        int ready = ppoll(p, (nfds_t)nfds, &ts, NULL);
        if (!every && ready <= 0) continue; /* (paced: it reads at each wake-up) */
        for (int i = 0; i < nfds; i++) {
            if (!every && !p[i].revents) continue;
            int got;
            while ((got = receive(w, p[i].fd)) == BATCH && every) {} /* (a full batch: more wait) */
            if (got < 0) return RUN_ERROR;
        }
        if (flush(w, fd, sa, (socklen_t)alen)) return RUN_ERROR;
    }
    return RUN_DONE;
}
