/* The switch daemon's native datapath for SwitchML: recvmmsg, the daemon's
 * checks, SwitchML's pool, sendmmsg, with no Python per datagram.
 *
 * Theory of operation
 * -------------------
 * The Python reference is three pieces, mirrored here in their order:
 * emu.switchd.accept (the job a datagram names, its token, wire.packet.decode,
 * a job that resynchronises after a restart), proto.switch.engine.SwitchEngine
 * (worker index, bitmap and fan-in against the job) and
 * proto.switch.switchml.SwitchMLPolicy (a job's static slot range, two
 * copies per slot, the sequence each holds, bitmap and count, the result
 * kept to answer retransmissions). Counters have the reference's names
 * (net.switchpath names their indices).
 *
 * Sans-I/O like the engines: gf_s_datagram takes one datagram and the time
 * and queues what it sends in an outbox (a copy of each result, so a later
 * datagram of the same batch cannot change what an earlier one answered);
 * gf_s_drain is the driver the daemon's event loop calls when its socket is
 * readable: it reads up to a few batches with recvmmsg, feeds them through,
 * and sends the outbox with sendmmsg (a full socket buffer is a counted
 * drop, as the reference's non-blocking sendto). The daemon's control plane
 * runs in the same thread between calls and tells this table about jobs,
 * tokens, worker addresses and resynchronisation (gf_s_job, gf_s_addr,
 * gf_s_forget); tests/property/test_switchpath.py holds it equal to the
 * reference datagram for datagram.
 *
 * Root switches only (one level, as the daemon runs it); little-endian hosts.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#ifndef GRADFABRIC_SOURCE
#define GRADFABRIC_SOURCE "unknown"
#endif
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire is little-endian and values are summed from memory as they are"
#endif

#define TOKEN 8
#define HEADER 32
#define MAGIC 0x4647
#define VERSION 1
#define F_ACK 0x1
#define F_ECN 0x8
#define F_FLOAT 0x20
#define F_HELP 0x80
#define F_NACK 0x200
#define NACK_GAP 1 /* proto.switch.switchml.NACK_GAP */
#define KNOWN_FLAGS 0x3ff
#define MAX_FAN_IN 64
#define MAX_WIRE_VALUES 16000
#define DGRAM 65536
#define BATCH 64
#define OUTBOX (2 * BATCH) /* per datagram a loss notice and a result at most */
#define MAX_JOBS 65536

enum { IDLE, AGGREGATING, FORWARDED, COMPLETE };
/* counter indices: net.switchpath.COUNTERS names them */
enum {
    /* the daemon's */
    D_RX, D_UNKNOWN_JOB, D_MALFORMED_SHORT, D_NO_ADDRESS, D_TX, D_TX_FULL, D_SOCKET_ERROR,
    D_SYSCALLS,
    /* the switch engine's */
    E_RX_GRADIENT, E_RX_HELP, E_BAD_WORKER, E_BAD_RESULT, E_BAD_SLOT, E_FLOAT, E_STALE,
    E_DUPLICATE, E_RETX_ANSWERED, E_COUNT_MISMATCH, E_STALE_RESULT, E_NACK_SENT,
    NCOUNTERS
};
/* a job's own: datagrams that named it */
enum { J_RX, J_BAD_TOKEN, J_MALFORMED, J_RESYNCING, NJOB };

typedef struct {
    uint8_t token[TOKEN];
    int64_t id, fan_in, slot_base, slot_count, resync;
    struct sockaddr_storage addr[MAX_FAN_IN];
    socklen_t alen[MAX_FAN_IN];
    int64_t counters[NJOB];
} job_t;

typedef struct {
    int64_t seq, claim_ns;
    int state, count, nvalues, flags, cap;
    uint64_t bitmap;
    int32_t *values;
} copy_t;

typedef struct {
    const job_t *job;
    int64_t to; /* a child's index, or -1: every child */
    int64_t len;
    uint8_t *data;
} out_t;

typedef struct {
    int64_t slots;
    copy_t *copies; /* 2 per slot */
    job_t *jobs[MAX_JOBS];
    int64_t counters[NCOUNTERS];
    int64_t busy_ns, held_ns, claims; /* proto.switch.engine.PoolStats */
    out_t out[OUTBOX];
    int64_t nout;
    uint8_t *arena; /* OUTBOX results */
    uint8_t *rx;    /* BATCH datagrams */
} gf_switch;

const char *gf_source(void) { return GRADFABRIC_SOURCE; }

gf_switch *gf_s_new(int64_t slots) {
    gf_switch *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->slots = slots;
    s->copies = calloc((size_t)(2 * slots), sizeof(copy_t));
    s->arena = malloc((size_t)OUTBOX * (TOKEN + HEADER + 4 * MAX_WIRE_VALUES));
    s->rx = malloc((size_t)BATCH * DGRAM);
    if (!s->copies || !s->arena || !s->rx) {
        free(s->copies), free(s->arena), free(s->rx), free(s);
        return NULL;
    }
    for (int64_t i = 0; i < 2 * slots; i++) s->copies[i].seq = -1;
    return s;
}

static void clear_range(gf_switch *s, int64_t base, int64_t count) {
    for (int64_t i = 2 * base; i < 2 * (base + count) && i < 2 * s->slots; i++) {
        copy_t *c = &s->copies[i];
        int32_t *v = c->values;
        int cap = c->cap;
        memset(c, 0, sizeof *c);
        c->seq = -1;
        c->values = v, c->cap = cap;
    }
}

void gf_s_free(gf_switch *s) {
    for (int64_t i = 0; i < 2 * s->slots; i++) free(s->copies[i].values);
    for (int64_t j = 0; j < MAX_JOBS; j++) free(s->jobs[j]);
    free(s->copies), free(s->arena), free(s->rx), free(s);
}

/* Install or update a job (the control plane's register, restore, resume);
 * a new one's slot range is cleared (SwitchMLPolicy.admit). */
int gf_s_job(gf_switch *s, int64_t id, const uint8_t *token, int64_t fan_in, int64_t slot_base,
             int64_t slot_count, int64_t resync) {
    if (id < 0 || id >= MAX_JOBS || fan_in < 1 || fan_in > MAX_FAN_IN) return -1;
    if (slot_base < 0 || slot_base + slot_count > s->slots) return -1;
    job_t *j = s->jobs[id];
    if (!j) {
        j = s->jobs[id] = calloc(1, sizeof *j);
        if (!j) return -1;
        clear_range(s, slot_base, slot_count);
    }
    memcpy(j->token, token, TOKEN);
    j->id = id, j->fan_in = fan_in, j->slot_base = slot_base, j->slot_count = slot_count, j->resync = resync;
    return 0;
}

/* A worker's address (hello); a zero length forgets it. */
int gf_s_addr(gf_switch *s, int64_t id, int64_t rank, const uint8_t *addr, int64_t alen) {
    job_t *j = (id >= 0 && id < MAX_JOBS) ? s->jobs[id] : NULL;
    if (!j || rank < 0 || rank >= j->fan_in || alen < 0 || alen > (int64_t)sizeof j->addr[0])
        return -1;
    memcpy(&j->addr[rank], addr, (size_t)alen);
    j->alen[rank] = (socklen_t)alen;
    return 0;
}

/* The job left (SwitchMLPolicy.retire): its range is cleared for the next owner. */
void gf_s_forget(gf_switch *s, int64_t id) {
    job_t *j = (id >= 0 && id < MAX_JOBS) ? s->jobs[id] : NULL;
    if (!j) return;
    clear_range(s, j->slot_base, j->slot_count);
    free(j);
    s->jobs[id] = NULL;
}

int64_t *gf_s_counters(gf_switch *s) { return s->counters; }
int64_t *gf_s_job_counters(gf_switch *s, int64_t id) {
    return (id >= 0 && id < MAX_JOBS && s->jobs[id]) ? s->jobs[id]->counters : NULL;
}
int64_t *gf_s_pool(gf_switch *s) { return &s->busy_ns; } /* busy_ns, held_ns, claims */

/* SwitchJob.full: every child's bit. */
static uint64_t full_mask(int64_t fan_in) { return fan_in == 64 ? ~0ULL : (1ULL << fan_in) - 1; }

/* SwitchMLPolicy.missing: children some partly filled copy of the job waits on. */
uint64_t gf_s_missing(gf_switch *s, int64_t id) {
    job_t *j = (id >= 0 && id < MAX_JOBS) ? s->jobs[id] : NULL;
    if (!j) return 0;
    uint64_t full = full_mask(j->fan_in), bits = 0;
    for (int64_t i = 2 * j->slot_base; i < 2 * (j->slot_base + j->slot_count); i++)
        if (s->copies[i].state == AGGREGATING) bits |= full & ~s->copies[i].bitmap;
    return bits;
}

static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static void wr16(uint8_t *p, int64_t v) { uint16_t u = (uint16_t)v; memcpy(p, &u, 2); }

/* Reserve the next outbox datagram, for child ``to`` (-1: every child), and
 * write its token and header; returns where its ``count`` values go (NULL:
 * the outbox is full, which cannot happen: see OUTBOX). */
static uint8_t *put(gf_switch *s, const job_t *j, int64_t to, int64_t flags, int64_t wid,
                    int64_t count, int64_t seq, int64_t agg, uint64_t bitmap) {
    if (s->nout == OUTBOX) return NULL;
    uint8_t *d = s->arena + (size_t)s->nout * (TOKEN + HEADER + 4 * MAX_WIRE_VALUES), *h = d + TOKEN;
    uint32_t sq = (uint32_t)seq, a = (uint32_t)agg;
    memcpy(d, j->token, TOKEN);
    wr16(h, MAGIC);
    h[2] = VERSION, h[3] = 0;
    wr16(h + 4, flags);
    wr16(h + 6, j->id);
    wr16(h + 8, wid);
    wr16(h + 10, j->fan_in);
    wr16(h + 12, 0);
    wr16(h + 14, count);
    memcpy(h + 16, &sq, 4);
    memcpy(h + 20, &a, 4);
    memcpy(h + 24, &bitmap, 8);
    s->out[s->nout++] = (out_t){j, to, TOKEN + HEADER + 4 * count, d};
    return h + HEADER;
}

/* Queue a copy of ``c``'s result for child ``to`` (-1: every child). */
static void send_result(gf_switch *s, const job_t *j, const copy_t *c, int64_t agg, int64_t to) {
    uint8_t *v = put(s, j, to, F_ACK | c->flags, 0, c->nvalues, c->seq, agg, full_mask(j->fan_in));
    if (v && c->nvalues) memcpy(v, c->values, (size_t)(4 * c->nvalues));
}

/* SwitchMLPolicy._notice: the sender's share of seq - NACK_GAP, if its copy
 * still waits on it. */
static void notice(gf_switch *s, const job_t *j, int64_t seq, int64_t wid, uint64_t bit) {
    int64_t lost = seq - NACK_GAP, w = j->slot_count;
    if (lost < 0) return;
    int64_t agg = j->slot_base + lost % w;
    const copy_t *c = &s->copies[2 * agg + ((lost / w) & 1)];
    if (c->seq > lost || (c->seq == lost && (c->state != AGGREGATING || (c->bitmap & bit)))) return;
    s->counters[E_NACK_SENT]++;
    put(s, j, wid, F_NACK, wid, 0, lost, agg, bit); /* the header of ``lost`` alone */
}

/* One datagram, as emu.switchd.accept, SwitchEngine.on_packet and
 * SwitchMLPolicy.on_gradient / on_result take it. */
void gf_s_datagram(gf_switch *s, const uint8_t *data, int64_t len, int64_t now) {
    s->counters[D_RX]++;
    if (len < TOKEN + HEADER) { /* wire.envelope.job_of: no job to charge it to */
        s->counters[D_MALFORMED_SHORT]++;
        return;
    }
    const uint8_t *h = data + TOKEN;
    uint16_t job_id = rd16(h + 6);
    job_t *j = s->jobs[job_id];
    if (!j) {
        s->counters[D_UNKNOWN_JOB]++;
        return;
    }
    if (memcmp(data, j->token, TOKEN) != 0) {
        j->counters[J_BAD_TOKEN]++;
        return;
    }
    len -= TOKEN;
    uint16_t flags = rd16(h + 4), wid = rd16(h + 8), fan_in = rd16(h + 10), count = rd16(h + 14);
    uint32_t seq32, agg32;
    uint64_t bitmap;
    memcpy(&seq32, h + 16, 4);
    memcpy(&agg32, h + 20, 4);
    memcpy(&bitmap, h + 24, 8);
    const uint8_t *payload = h + HEADER;
    int bad = rd16(h) != MAGIC || h[2] != VERSION || (flags & ~KNOWN_FLAGS) || fan_in < 1 ||
              fan_in > MAX_FAN_IN || wid >= MAX_FAN_IN || (fan_in < 64 && (bitmap >> fan_in)) ||
              count > MAX_WIRE_VALUES || len != HEADER + 4 * (int64_t)count;
    for (int64_t k = 0; !bad && (flags & F_FLOAT) && k < count; k++) {
        float f;
        memcpy(&f, payload + 4 * k, 4);
        bad = !isfinite(f);
    }
    if (bad) {
        j->counters[J_MALFORMED]++;
        return;
    }
    j->counters[J_RX]++;
    if (j->resync) {
        j->counters[J_RESYNCING]++;
        return;
    }
    int64_t seq = seq32, agg = agg32, n = j->fan_in;
    if (flags & F_ACK) { /* a result from above: a root has no parent */
        if (fan_in != 1 || bitmap != 1) {
            s->counters[E_BAD_RESULT]++;
            return;
        }
    } else if (fan_in != n || wid >= n || bitmap != (1ULL << wid)) {
        int help = (flags & F_HELP) && fan_in == n && wid < n && bitmap && !(bitmap & (bitmap - 1)) &&
                   (n == 64 || !(bitmap >> n));
        if (!help) {
            s->counters[E_BAD_WORKER]++;
            return;
        }
        s->counters[E_RX_HELP]++;
    }
    if (!(flags & F_ACK)) s->counters[E_RX_GRADIENT]++;
    int64_t w = j->slot_count;
    if (w == 0 || agg != j->slot_base + seq % w || agg >= s->slots) {
        s->counters[E_BAD_SLOT]++;
        return;
    }
    copy_t *c = &s->copies[2 * agg + ((seq / w) & 1)];
    if (flags & F_ACK) { /* SwitchMLPolicy.on_result: never FORWARDED at a root */
        s->counters[E_STALE_RESULT]++;
        return;
    }
    if (flags & F_FLOAT) {
        s->counters[E_FLOAT]++;
        return;
    }
    if (seq != c->seq) {
        if (seq < c->seq) {
            s->counters[E_STALE]++;
            return;
        }
        s->claims++;
        c->seq = seq, c->state = AGGREGATING, c->bitmap = 0, c->count = 0, c->flags = 0;
        c->nvalues = count, c->claim_ns = now;
        if (c->cap < count) {
            int32_t *v = realloc(c->values, (size_t)count * 4);
            if (!v) { /* out of memory: the slot stays unclaimed, the workers retry */
                c->seq = -1, c->state = IDLE;
                return;
            }
            c->values = v, c->cap = count;
        }
        memcpy(c->values, payload, (size_t)count * 4);
    } else if (c->bitmap & bitmap) {
        if (c->state == COMPLETE) {
            s->counters[E_RETX_ANSWERED]++;
            send_result(s, j, c, agg, wid);
        } else {
            s->counters[E_DUPLICATE]++;
        }
        return;
    } else if (count != c->nvalues) {
        s->counters[E_COUNT_MISMATCH]++;
        return;
    } else {
        uint32_t *v = (uint32_t *)c->values; /* int32 sums wrap, as numpy's do */
        for (int64_t k = 0; k < count; k++) {
            uint32_t x;
            memcpy(&x, payload + 4 * k, 4);
            v[k] += x;
        }
    }
    c->bitmap |= bitmap;
    c->count++;
    c->flags |= flags & F_ECN;
    if ((flags & F_NACK) && !(flags & F_HELP)) notice(s, j, seq, wid, bitmap);
    if (c->count < n) return;
    s->busy_ns += now - c->claim_ns;
    s->held_ns += now - c->claim_ns;
    c->state = COMPLETE;
    send_result(s, j, c, agg, -1);
}

/* The outbox, one datagram per destination: a child without an address is
 * the reference's drop_no_address. ``emit`` gets each (out item, rank). */
typedef int (*emit_fn)(void *ctx, const out_t *o, int64_t rank);

static int expand(gf_switch *s, emit_fn emit, void *ctx) {
    for (int64_t i = 0; i < s->nout; i++) {
        const out_t *o = &s->out[i];
        int64_t lo = o->to < 0 ? 0 : o->to, hi = o->to < 0 ? o->job->fan_in : o->to + 1;
        for (int64_t r = lo; r < hi; r++) {
            if (!o->job->alen[r]) {
                s->counters[D_NO_ADDRESS]++;
                continue;
            }
            if (emit(ctx, o, r)) return -1;
        }
    }
    s->nout = 0;
    return 0;
}

typedef struct {
    uint8_t *buf;
    int64_t at, cap;
} take_t;

static int take_one(void *ctx, const out_t *o, int64_t rank) {
    take_t *t = ctx;
    if (t->at + 8 + o->len > t->cap) return -1;
    uint32_t head[2] = {(uint32_t)rank, (uint32_t)o->len};
    memcpy(t->buf + t->at, head, 8);
    memcpy(t->buf + t->at + 8, o->data, (size_t)o->len);
    t->at += 8 + o->len;
    return 0;
}

/* The outbox as bytes (for the differential test): per datagram a u32 rank,
 * a u32 length and its bytes; -1 if ``cap`` is short. */
int64_t gf_s_take(gf_switch *s, uint8_t *buf, int64_t cap) {
    take_t t = {buf, 0, cap};
    return expand(s, take_one, &t) ? -1 : t.at;
}

typedef struct {
    gf_switch *s;
    int fd, n;
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
} send_t;

static void send_now(send_t *t) {
    int at = 0;
    while (at < t->n) {
        int sent = sendmmsg(t->fd, t->msgs + at, (unsigned)(t->n - at), MSG_DONTWAIT);
        t->s->counters[D_SYSCALLS]++;
        if (sent > 0) {
            t->s->counters[D_TX] += sent;
            at += sent;
        } else if (errno == EINTR) {
            continue;
        } else { /* the first message failed: a full buffer is a loss the workers recover */
            int full = errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS;
            t->s->counters[full ? D_TX_FULL : D_SOCKET_ERROR]++;
            at++;
        }
    }
    t->n = 0;
}

static int send_one(void *ctx, const out_t *o, int64_t rank) {
    send_t *t = ctx;
    if (t->n == BATCH) send_now(t);
    struct mmsghdr *m = &t->msgs[t->n];
    t->iov[t->n] = (struct iovec){o->data, (size_t)o->len};
    memset(m, 0, sizeof *m);
    m->msg_hdr.msg_name = (void *)&o->job->addr[rank];
    m->msg_hdr.msg_namelen = o->job->alen[rank];
    m->msg_hdr.msg_iov = &t->iov[t->n];
    m->msg_hdr.msg_iovlen = 1;
    t->n++;
    return 0;
}

/* The event loop's callback for a readable socket: up to ``batches`` reads of
 * BATCH datagrams, each batch's answers sent before the next read. Returns
 * the datagrams read. */
int64_t gf_s_drain(gf_switch *s, int fd, int64_t batches) {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    int64_t total = 0;
    send_t *t = malloc(sizeof *t);
    if (!t) return 0;
    t->s = s, t->fd = fd, t->n = 0;
    for (int64_t b = 0; b < batches; b++) {
        for (int k = 0; k < BATCH; k++) {
            iov[k] = (struct iovec){s->rx + (size_t)k * DGRAM, DGRAM};
            memset(&msgs[k], 0, sizeof msgs[k]);
            msgs[k].msg_hdr.msg_iov = &iov[k];
            msgs[k].msg_hdr.msg_iovlen = 1;
        }
        int got = recvmmsg(fd, msgs, BATCH, MSG_DONTWAIT, NULL);
        s->counters[D_SYSCALLS]++;
        if (got <= 0) {
            if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                s->counters[D_SOCKET_ERROR]++;
            break;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t now = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
        for (int k = 0; k < got; k++) {
            int64_t n = (msgs[k].msg_hdr.msg_flags & MSG_TRUNC) ? DGRAM + 1 : msgs[k].msg_len;
            gf_s_datagram(s, s->rx + (size_t)k * DGRAM, n, now);
        }
        expand(s, send_one, t);
        send_now(t);
        total += got;
        if (got < BATCH) break;
    }
    free(t);
    return total;
}
