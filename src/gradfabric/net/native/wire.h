/* The wire as the native engines read and write it (wire.packet, wire.envelope).
 *
 * A datagram is an 8-byte job token, then a 32-byte little-endian header,
 * then ``count`` 4-byte values:
 *
 *     magic u16 | version u8 | priority u8 | flags u16 | job_id u16 |
 *     worker_id u16 | fan_in u16 | layer u16 | count u16 |
 *     seq u32 | agg_index u32 | bitmap u64
 *
 * gf_check is wire.packet.decode's checks, in its order; anything it refuses
 * is a counted drop (drop_malformed) wherever it is called.
 */
#ifndef GF_WIRE_H
#define GF_WIRE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire is little-endian and values are summed from memory as they are"
#endif
#ifndef GRADFABRIC_SOURCE
#define GRADFABRIC_SOURCE "unknown"
#endif
#define GF_API __attribute__((visibility("default"))) /* the rest is hidden */

#define TOKEN 8
#define HEADER 32
#define MAGIC 0x4647
#define VERSION 1
#define F_ACK 0x1
#define F_COLLISION 0x2
#define F_RESEND 0x4
#define F_ECN 0x8
#define F_OVERFLOW 0x10
#define F_FLOAT 0x20
#define F_PARTIAL 0x40
#define F_HELP 0x80
#define F_NOTIFY 0x100
#define F_NACK 0x200
#define KNOWN_FLAGS 0x3ff
#define MAX_FAN_IN 64
#define MAX_WIRE_VALUES 16000
#define DGRAM 65536 /* the largest datagram read */

/* A packet's header, read; ``raw`` is the header and its values as they
 * arrived, ``len`` their bytes. */
typedef struct {
    int64_t flags, prio, job, layer, wid, fan_in, count, seq, agg;
    uint64_t bitmap;
    const uint8_t *raw;
    int64_t len;
} gf_pkt;

/* What an engine queues for its driver to send: to ``rank`` of ``job`` (a
 * switch's worker; GF_ALL: every worker of the job, GF_PEER: a worker
 * engine's one peer), the bytes of ``head`` then of ``body`` (a worker's
 * values, sent from the caller's tensor where they are; none for the switch,
 * whose values are in ``head``). */
#define GF_ALL (-1)
#define GF_PEER (-2)
typedef struct {
    int32_t job, rank;
    const uint8_t *head;
    int64_t head_len;
    const uint8_t *body;
    int64_t body_len;
} gf_dgram;

/* A native engine as the native driver (udp.c) sees it: the datagram
 * interface of DESIGN.md, as C functions. */
typedef struct {
    /* one datagram and the time; -1 only when out of memory */
    int (*receive)(void *engine, const uint8_t *data, int64_t len, int64_t now);
    /* what may leave now, in order (a paced engine holds some back) */
    int64_t (*pending)(void *engine, int64_t now, const gf_dgram **out);
    /* the first ``n`` of them are gone (sent, or dropped and counted) */
    void (*sent)(void *engine, int64_t n, int64_t now);
    /* the next deadline (-1: none), and its call (1: it gave up on a peer;
     * -1: out of memory) */
    int64_t (*timer)(void *engine);
    int (*handle_timer)(void *engine, int64_t now);
    /* a worker's: its collective is done (``quiet``: and nothing is
     * outstanding at all), and how long its sockets may stay unread */
    int (*done)(void *engine, int quiet);
    int64_t (*read_wait)(void *engine, int64_t now);
} gf_ops;

static inline uint16_t gf_rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline void gf_wr16(uint8_t *p, int64_t v) {
    uint16_t u = (uint16_t)v;
    memcpy(p, &u, 2);
}

/* wire.packet.unwrap: the sequence whose low 32 bits are ``wire`` nearest
 * to ``expected`` (RFC 9000's packet-number decoding), never below 0. */
static inline int64_t gf_unwrap(int64_t wire, int64_t expected) {
    const int64_t win = 1LL << 32, half = win / 2;
    int64_t candidate = (expected & ~(win - 1)) | wire;
    if (candidate <= expected - half)
        candidate += win;
    else if (candidate > expected + half && candidate >= win)
        candidate -= win;
    return candidate;
}

/* Two tokens equal, in time that does not depend on where they differ
 * (hmac.compare_digest in the reference). */
static inline int gf_token_eq(const uint8_t *a, const uint8_t *b) {
    uint8_t d = 0;
    for (int i = 0; i < TOKEN; i++) d |= (uint8_t)(a[i] ^ b[i]);
    return d == 0;
}

static inline uint64_t gf_full(int64_t fan_in) {
    return fan_in >= 64 ? ~0ULL : (1ULL << fan_in) - 1;
}

/* Read a header (no checks). */
static inline void gf_parse(gf_pkt *p, const uint8_t *h, int64_t len) {
    uint32_t seq32, agg32;
    p->prio = h[3], p->flags = gf_rd16(h + 4), p->job = gf_rd16(h + 6);
    p->wid = gf_rd16(h + 8), p->fan_in = gf_rd16(h + 10), p->layer = gf_rd16(h + 12);
    p->count = gf_rd16(h + 14);
    memcpy(&seq32, h + 16, 4);
    memcpy(&agg32, h + 20, 4);
    memcpy(&p->bitmap, h + 24, 8);
    p->seq = seq32, p->agg = agg32, p->raw = h, p->len = len;
}

/* wire.packet.decode's checks of a parsed packet of ``len`` bytes: 0 if it
 * may be used, else it is malformed. */
static inline int gf_check(const gf_pkt *p) {
    const uint8_t *h = p->raw;
    if (p->len < HEADER) return -1;
    if (gf_rd16(h) != MAGIC || h[2] != VERSION || (p->flags & ~KNOWN_FLAGS)) return -1;
    if (p->fan_in < 1 || p->fan_in > MAX_FAN_IN) return -1; /* any sender: the engines check */
    if (p->fan_in < 64 && (p->bitmap >> p->fan_in)) return -1;
    if (p->count > MAX_WIRE_VALUES || p->len != HEADER + 4 * p->count) return -1;
    for (int64_t k = 0; (p->flags & F_FLOAT) && k < p->count; k++) {
        float f;
        memcpy(&f, h + HEADER + 4 * k, 4);
        if (!isfinite(f)) return -1;
    }
    return 0;
}

/* wire.envelope.unseal where a datagram reaches one job's endpoint (a
 * worker, a helped host, DLCP's client): the token, then the wire's checks.
 * 0 and ``p`` read, or the drop to count: GF_BAD_TOKEN, GF_MALFORMED. */
enum { GF_BAD_TOKEN = 1, GF_MALFORMED = 2 };
static inline int gf_unseal(gf_pkt *p, const uint8_t *data, int64_t len, const uint8_t *token) {
    if (len < TOKEN || !gf_token_eq(data, token)) return GF_BAD_TOKEN;
    if (len - TOKEN < HEADER) return GF_MALFORMED;
    gf_parse(p, data + TOKEN, len - TOKEN);
    return gf_check(p) ? GF_MALFORMED : 0;
}

/* Write a header; returns where its ``count`` values go. */
static inline uint8_t *gf_header(uint8_t *h, int64_t prio, int64_t flags, int64_t job,
                                 int64_t wid, int64_t fan_in, int64_t count, int64_t seq,
                                 int64_t agg, uint64_t bitmap) {
    uint32_t sq = (uint32_t)seq, a = (uint32_t)agg;
    gf_wr16(h, MAGIC);
    h[2] = VERSION, h[3] = (uint8_t)prio;
    gf_wr16(h + 4, flags);
    gf_wr16(h + 6, job);
    gf_wr16(h + 8, wid);
    gf_wr16(h + 10, fan_in);
    gf_wr16(h + 12, 0); /* layer */
    gf_wr16(h + 14, count);
    memcpy(h + 16, &sq, 4);
    memcpy(h + 20, &a, 4);
    memcpy(h + 24, &bitmap, 8);
    return h + HEADER;
}

#endif
