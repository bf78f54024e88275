/* The switch daemon's native datapath: recvmmsg, the daemon's checks, the
 * switch's pool (SwitchML, ATP or ESA) and ATP's fallback parameter server,
 * sendmmsg, with no Python per datagram.
 *
 * Theory of operation
 * -------------------
 * The Python reference is, in order: emu.switchd.accept (the job a datagram
 * names, its token, wire.packet.decode, a job that resynchronises after a
 * restart), proto.switch.engine.SwitchEngine (worker index, bitmap and
 * fan-in against the job), then the allocation policy:
 *
 * - SwitchML (proto.switch.switchml): a job's static slot range, two copies
 *   per slot, the sequence each holds, the result kept to answer
 *   retransmissions, loss notices.
 * - ATP (proto.switch.atp): one pool shared by every job, an aggregator per
 *   (job, seq) key; what the switch cannot aggregate (a collision, a float
 *   payload, a retransmission, a partial flushed on a resend) goes to the
 *   job's parameter server (proto.ps), which merges by bitmap and sends each
 *   result back through the switch, freeing the aggregator as it passes.
 * - ESA (proto.switch.esa): ATP whose packets may take an occupied
 *   aggregator, a complete one at once, a partly filled one by a strictly
 *   higher priority (its partial goes to its owner's PS).
 * - PS (proto.schemes.PS, the parameter-server baseline): no switch; each
 *   job's datagrams go straight to its PS, which answers the workers itself.
 *
 * The daemon hosts each job's PS (emu.control; ATP's at the switch,
 * ps_link_mbps 0): the engines hand packets to each other by call, queued
 * first in first out (SwitchDaemon.deliver), and so do these: a packet
 * between the switch and a PS is queued in wire form (header and values)
 * and taken in order after the datagram that caused it. Counters have the
 * reference's names (net.switchpath names their indices).
 *
 * Sans-I/O like the engines: gf_s_datagram takes one datagram and the time
 * and queues what it sends in an outbox (a copy of each datagram, so a later
 * datagram of the same batch cannot change what an earlier one answered);
 * gf_s_drain is the driver the daemon's event loop calls when its socket is
 * readable: it reads up to a few batches with recvmmsg, feeds them through,
 * and sends the outbox with sendmmsg (a full socket buffer is a counted
 * drop, as the reference's non-blocking sendto). The daemon's control plane
 * runs in the same thread between calls and tells this table about jobs,
 * tokens, worker addresses and resynchronisation (gf_s_job, gf_s_addr,
 * gf_s_forget); tests/property/test_switchpath.py holds it equal to the
 * reference datagram for datagram, for each policy.
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
#define GF_API __attribute__((visibility("default"))) /* the rest is hidden */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire is little-endian and values are summed from memory as they are"
#endif

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
#define F_NACK 0x200
#define NACK_GAP 1 /* proto.switch.switchml.NACK_GAP */
#define KNOWN_FLAGS 0x3ff
#define MAX_FAN_IN 64
#define MAX_WIRE_VALUES 16000
#define DGRAM 65536
#define BATCH 64
#define OUTBOX (4 * BATCH) /* per datagram two datagrams out at most (a notice and a result;
                              ATP: two results of the PS), twice over for margin */
#define MAX_JOBS 65536
#define INT32_MAX_ 2147483647LL

enum { P_SWITCHML, P_ATP, P_ESA, P_PS }; /* the policy, as gf_s_new takes it */
enum { IDLE, AGGREGATING, FORWARDED, COMPLETE }; /* SwitchML's copies */
enum { FREE, HELD, DONE };                       /* ATP's aggregators: FREE, AGGREGATING, COMPLETE */
/* counter indices: net.switchpath names them */
enum {
    /* the daemon's */
    D_RX, D_UNKNOWN_JOB, D_MALFORMED_SHORT, D_NO_ADDRESS, D_TX, D_TX_FULL, D_SOCKET_ERROR,
    D_SYSCALLS,
    /* the switch engine's */
    E_RX_GRADIENT, E_RX_HELP, E_BAD_WORKER, E_BAD_RESULT, E_BAD_SLOT, E_FLOAT, E_STALE,
    E_DUPLICATE, E_RETX_ANSWERED, E_COUNT_MISMATCH, E_STALE_RESULT, E_NACK_SENT,
    /* ATP's and ESA's */
    E_PS_OVERFLOW, E_PS_RESEND, E_FLUSH_PARTIAL, E_PS_COLLISION, E_LATE, E_STALE_RECLAIMED,
    E_RECLAIMED_COMPLETE, E_PREEMPTIONS,
    NCOUNTERS
};
/* a job's own: datagrams that named it, then its parameter server's */
enum {
    J_RX, J_BAD_TOKEN, J_MALFORMED, J_RESYNCING,
    S_MERGED, S_RESEND_ANSWERED, S_BAD_PACKET, S_STALE, S_LATE_PARTIAL, S_DUPLICATE, S_OVERLAP,
    S_COUNT_MISMATCH,
    NJOB
};

/* A packet's header, read (wire.packet.HEADER); ``raw`` is the header and
 * its values as they arrived, ``len`` their bytes. */
typedef struct {
    int64_t flags, prio, layer, wid, fan_in, count, seq, agg;
    uint64_t bitmap;
    const uint8_t *raw;
    int64_t len;
} pkt_t;

/* proto.ps: a sequence being merged (_Acc) */
typedef struct {
    int64_t seq, agg, nvalues, flags;
    uint64_t bitmap;
    int has_i, has_f;
    int64_t *iv;
    double *fv;
} acc_t;

/* proto.ps: a kept result, its header and values as sent */
typedef struct {
    int64_t seq, len;
    uint8_t *raw;
} res_t;

typedef struct {
    acc_t **accs; /* sorted by seq */
    int64_t naccs, capaccs;
    res_t *res; /* sorted by seq: the PS's results and its done heap at once */
    int64_t nres, capres;
    int64_t floor, window;
    double scale;
} ps_t;

typedef struct {
    uint8_t token[TOKEN];
    int64_t id, fan_in, slot_base, slot_count, resync;
    int64_t window, newest; /* ATP: the switch job's window; the newest result's seq (-1) */
    ps_t ps;
    struct sockaddr_storage addr[MAX_FAN_IN];
    socklen_t alen[MAX_FAN_IN];
    struct sockaddr_storage group; /* where a packet for every child goes once (glen 0: none) */
    socklen_t glen;
    int64_t counters[NJOB];
} job_t;

typedef struct {
    int64_t seq, claim_ns;
    int state, count, nvalues, flags, cap;
    uint64_t bitmap;
    int32_t *values;
} copy_t;

/* ATP's aggregator (proto.switch.atp._Agg) */
typedef struct {
    int64_t job, seq, claim_ns;
    int state, count, nvalues, flags, prio, cap;
    uint64_t bitmap;
    int32_t *values;
} agg_t;

typedef struct {
    const job_t *job;
    int64_t to; /* a child's index, or -1: every child */
    int64_t len;
    uint8_t *data;
} out_t;

/* a packet between hosted engines: to job ``job``'s PS, or to the switch */
typedef struct {
    int64_t job, to_ps, len;
    uint8_t *raw;
} msg_t;

typedef struct {
    int64_t slots, policy;
    copy_t *copies; /* SwitchML: 2 per slot */
    agg_t *pool;    /* ATP, ESA */
    job_t *jobs[MAX_JOBS];
    int64_t counters[NCOUNTERS];
    int64_t busy_ns, held_ns, claims; /* proto.switch.engine.PoolStats */
    out_t out[OUTBOX];
    int64_t nout;
    uint8_t *arena; /* OUTBOX datagrams */
    uint8_t *rx;    /* BATCH datagrams */
    msg_t *work;    /* SwitchDaemon.work */
    int64_t nwork, capwork;
} gf_switch;

GF_API const char *gf_source(void) { return GRADFABRIC_SOURCE; }

GF_API gf_switch *gf_s_new(int64_t slots, int64_t policy) {
    if (slots < 1 || policy < P_SWITCHML || policy > P_PS) return NULL;
    gf_switch *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->slots = slots, s->policy = policy;
    if (policy == P_SWITCHML)
        s->copies = calloc((size_t)(2 * slots), sizeof(copy_t));
    else if (policy != P_PS)
        s->pool = calloc((size_t)slots, sizeof(agg_t));
    s->arena = malloc((size_t)OUTBOX * (TOKEN + HEADER + 4 * MAX_WIRE_VALUES));
    s->rx = malloc((size_t)BATCH * DGRAM);
    if (!(s->copies || s->pool || policy == P_PS) || !s->arena || !s->rx) {
        free(s->copies), free(s->pool), free(s->arena), free(s->rx), free(s);
        return NULL;
    }
    for (int64_t i = 0; s->copies && i < 2 * slots; i++) s->copies[i].seq = -1;
    for (int64_t i = 0; s->pool && i < slots; i++) s->pool[i].job = -1, s->pool[i].seq = -1;
    return s;
}

static void clear_range(gf_switch *s, int64_t base, int64_t count) {
    for (int64_t i = 2 * base; s->copies && i < 2 * (base + count) && i < 2 * s->slots; i++) {
        copy_t *c = &s->copies[i];
        int32_t *v = c->values;
        int cap = c->cap;
        memset(c, 0, sizeof *c);
        c->seq = -1;
        c->values = v, c->cap = cap;
    }
}

static void acc_free(acc_t *a) {
    free(a->iv), free(a->fv), free(a);
}

static void ps_clear(ps_t *ps) {
    for (int64_t i = 0; i < ps->naccs; i++) acc_free(ps->accs[i]);
    for (int64_t i = 0; i < ps->nres; i++) free(ps->res[i].raw);
    free(ps->accs), free(ps->res);
    memset(ps, 0, sizeof *ps);
}

GF_API void gf_s_free(gf_switch *s) {
    for (int64_t i = 0; s->copies && i < 2 * s->slots; i++) free(s->copies[i].values);
    for (int64_t i = 0; s->pool && i < s->slots; i++) free(s->pool[i].values);
    for (int64_t j = 0; j < MAX_JOBS; j++)
        if (s->jobs[j]) ps_clear(&s->jobs[j]->ps), free(s->jobs[j]);
    for (int64_t i = 0; i < s->nwork; i++) free(s->work[i].raw);
    free(s->copies), free(s->pool), free(s->arena), free(s->rx), free(s->work), free(s);
}

/* Install or update a job (the control plane's register, restore, resume);
 * a new one's slot range is cleared (SwitchMLPolicy.admit). ATP's: the
 * switch job's ``window``, its PS's (``ps_window``) and integer scale. */
GF_API int gf_s_job(gf_switch *s, int64_t id, const uint8_t *token, int64_t fan_in, int64_t slot_base,
             int64_t slot_count, int64_t resync, int64_t window, int64_t ps_window, double scale) {
    if (id < 0 || id >= MAX_JOBS || fan_in < 1 || fan_in > MAX_FAN_IN || ps_window < 1) return -1;
    if (slot_base < 0 || slot_count < 0 || slot_base + slot_count > s->slots) return -1;
    job_t *j = s->jobs[id];
    if (!j) {
        j = s->jobs[id] = calloc(1, sizeof *j);
        if (!j) return -1;
        j->newest = -1, j->ps.floor = -1;
        clear_range(s, slot_base, slot_count);
    }
    memcpy(j->token, token, TOKEN);
    j->id = id, j->fan_in = fan_in, j->slot_base = slot_base, j->slot_count = slot_count, j->resync = resync;
    j->window = window, j->ps.window = ps_window, j->ps.scale = scale;
    return 0;
}

/* A worker's address (hello), or for rank -1 the job's multicast group
 * (emu.switchd's --multicast); a zero length forgets it. */
GF_API int gf_s_addr(gf_switch *s, int64_t id, int64_t rank, const uint8_t *addr, int64_t alen) {
    job_t *j = (id >= 0 && id < MAX_JOBS) ? s->jobs[id] : NULL;
    if (!j || rank < -1 || rank >= j->fan_in || alen < 0 || alen > (int64_t)sizeof j->group)
        return -1;
    memcpy(rank < 0 ? &j->group : &j->addr[rank], addr, (size_t)alen);
    *(rank < 0 ? &j->glen : &j->alen[rank]) = (socklen_t)alen;
    return 0;
}

/* The job left (SwitchMLPolicy.retire, ATPPolicy.retire): its range is
 * cleared for the next owner, or its aggregators freed (their remaining hold
 * not counted as use), its PS dropped. */
GF_API void gf_s_forget(gf_switch *s, int64_t id) {
    job_t *j = (id >= 0 && id < MAX_JOBS) ? s->jobs[id] : NULL;
    if (!j) return;
    clear_range(s, j->slot_base, j->slot_count);
    for (int64_t i = 0; s->pool && i < s->slots; i++)
        if (s->pool[i].state != FREE && s->pool[i].job == id) s->pool[i].state = FREE;
    ps_clear(&j->ps);
    free(j);
    s->jobs[id] = NULL;
}

GF_API int64_t *gf_s_counters(gf_switch *s) { return s->counters; }
GF_API int64_t *gf_s_job_counters(gf_switch *s, int64_t id) {
    return (id >= 0 && id < MAX_JOBS && s->jobs[id]) ? s->jobs[id]->counters : NULL;
}
GF_API int64_t *gf_s_pool(gf_switch *s) { return &s->busy_ns; } /* busy_ns, held_ns, claims */

/* SwitchJob.full: every child's bit. */
static uint64_t full_mask(int64_t fan_in) { return fan_in == 64 ? ~0ULL : (1ULL << fan_in) - 1; }

/* The policy's ``missing`` and the PS's ``missing_workers``: children some
 * partly filled aggregator, copy or merge of the job waits on. */
GF_API uint64_t gf_s_missing(gf_switch *s, int64_t id) {
    job_t *j = (id >= 0 && id < MAX_JOBS) ? s->jobs[id] : NULL;
    if (!j) return 0;
    uint64_t full = full_mask(j->fan_in), bits = 0;
    for (int64_t i = 2 * j->slot_base; s->copies && i < 2 * (j->slot_base + j->slot_count); i++)
        if (s->copies[i].state == AGGREGATING) bits |= full & ~s->copies[i].bitmap;
    for (int64_t i = 0; s->pool && i < s->slots; i++)
        if (s->pool[i].state == HELD && s->pool[i].job == id) bits |= full & ~s->pool[i].bitmap;
    for (int64_t i = 0; i < j->ps.naccs; i++) bits |= full & ~j->ps.accs[i]->bitmap;
    return bits;
}

/* ATP's and ESA's aggregators now held by some job (SwitchDaemon.occupancy). */
GF_API int64_t gf_s_occupied(gf_switch *s) {
    int64_t n = 0;
    for (int64_t i = 0; s->pool && i < s->slots; i++) n += s->pool[i].state != FREE;
    return n;
}

static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static void wr16(uint8_t *p, int64_t v) { uint16_t u = (uint16_t)v; memcpy(p, &u, 2); }

/* wire.packet.HEADER, written: returns where the ``count`` values go. */
static uint8_t *header(uint8_t *h, int64_t job, int64_t flags, int64_t wid, int64_t fan_in,
                       int64_t count, int64_t seq, int64_t agg, uint64_t bitmap) {
    uint32_t sq = (uint32_t)seq, a = (uint32_t)agg;
    wr16(h, MAGIC);
    h[2] = VERSION, h[3] = 0; /* priority */
    wr16(h + 4, flags);
    wr16(h + 6, job);
    wr16(h + 8, wid);
    wr16(h + 10, fan_in);
    wr16(h + 12, 0); /* layer */
    wr16(h + 14, count);
    memcpy(h + 16, &sq, 4);
    memcpy(h + 20, &a, 4);
    memcpy(h + 24, &bitmap, 8);
    return h + HEADER;
}

static void parse(pkt_t *p, const uint8_t *h, int64_t len) {
    uint32_t seq32, agg32;
    p->flags = rd16(h + 4), p->prio = h[3], p->wid = rd16(h + 8), p->fan_in = rd16(h + 10);
    p->layer = rd16(h + 12), p->count = rd16(h + 14);
    memcpy(&seq32, h + 16, 4);
    memcpy(&agg32, h + 20, 4);
    memcpy(&p->bitmap, h + 24, 8);
    p->seq = seq32, p->agg = agg32, p->raw = h, p->len = len;
}

/* Reserve the next outbox datagram, for child ``to`` (-1: every child): its
 * token, then ``len`` bytes of header and values (NULL: the outbox is full,
 * which cannot happen: see OUTBOX). */
static uint8_t *reserve(gf_switch *s, const job_t *j, int64_t to, int64_t len) {
    if (s->nout == OUTBOX) return NULL;
    uint8_t *d = s->arena + (size_t)s->nout * (TOKEN + HEADER + 4 * MAX_WIRE_VALUES);
    memcpy(d, j->token, TOKEN);
    s->out[s->nout++] = (out_t){j, to, TOKEN + len, d};
    return d + TOKEN;
}

/* Queue a packet (header and values) for child ``to`` (-1: every child). */
static void emit(gf_switch *s, const job_t *j, int64_t to, const uint8_t *raw, int64_t len) {
    uint8_t *d = reserve(s, j, to, len);
    if (d) memcpy(d, raw, (size_t)len);
}

/* Queue a copy of ``c``'s result for child ``to`` (-1: every child). */
static void send_result(gf_switch *s, const job_t *j, const copy_t *c, int64_t agg, int64_t to) {
    uint8_t *h = reserve(s, j, to, HEADER + 4 * (int64_t)c->nvalues);
    if (!h) return;
    uint8_t *v = header(h, j->id, F_ACK | c->flags, 0, j->fan_in, c->nvalues, c->seq, agg,
                        full_mask(j->fan_in));
    if (c->nvalues) memcpy(v, c->values, (size_t)(4 * c->nvalues));
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
    uint8_t *h = reserve(s, j, wid, HEADER); /* the header of ``lost`` alone */
    if (h) header(h, j->id, F_NACK, wid, j->fan_in, 0, lost, agg, bit);
}

/* ``count`` int32 values from the wire added into ``values``: int32 sums
 * wrap, as numpy's do. */
static void add_wrapping(int32_t *values, const uint8_t *payload, int64_t count) {
    uint32_t *v = (uint32_t *)values;
    for (int64_t k = 0; k < count; k++) {
        uint32_t x;
        memcpy(&x, payload + 4 * k, 4);
        v[k] += x;
    }
}

/* SwitchMLPolicy.on_gradient (a root's: results are never from above). */
static void switchml_gradient(gf_switch *s, job_t *j, const pkt_t *p, int64_t now) {
    int64_t w = j->slot_count, seq = p->seq, agg = p->agg, count = p->count;
    if (w == 0 || agg != j->slot_base + seq % w || agg >= s->slots) {
        s->counters[E_BAD_SLOT]++;
        return;
    }
    copy_t *c = &s->copies[2 * agg + ((seq / w) & 1)];
    if (p->flags & F_ACK) { /* SwitchMLPolicy.on_result: never FORWARDED at a root */
        s->counters[E_STALE_RESULT]++;
        return;
    }
    if (p->flags & F_FLOAT) {
        s->counters[E_FLOAT]++;
        return;
    }
    const uint8_t *payload = p->raw + HEADER;
    if (seq != c->seq) {
        if (seq < c->seq) {
            s->counters[E_STALE]++;
            return;
        }
        s->claims++;
        c->seq = seq, c->state = AGGREGATING, c->bitmap = 0, c->count = 0, c->flags = 0;
        c->nvalues = (int)count, c->claim_ns = now;
        if (c->cap < count) {
            int32_t *v = realloc(c->values, (size_t)count * 4);
            if (!v) { /* out of memory: the slot stays unclaimed, the workers retry */
                c->seq = -1, c->state = IDLE;
                return;
            }
            c->values = v, c->cap = (int)count;
        }
        memcpy(c->values, payload, (size_t)count * 4);
    } else if (c->bitmap & p->bitmap) {
        if (c->state == COMPLETE) {
            s->counters[E_RETX_ANSWERED]++;
            send_result(s, j, c, agg, p->wid);
        } else {
            s->counters[E_DUPLICATE]++;
        }
        return;
    } else if (count != c->nvalues) {
        s->counters[E_COUNT_MISMATCH]++;
        return;
    } else {
        add_wrapping(c->values, payload, count);
    }
    c->bitmap |= p->bitmap;
    c->count++;
    c->flags |= p->flags & F_ECN;
    if ((p->flags & F_NACK) && !(p->flags & F_HELP)) notice(s, j, seq, p->wid, p->bitmap);
    if (c->count < j->fan_in) return;
    s->busy_ns += now - c->claim_ns;
    s->held_ns += now - c->claim_ns;
    c->state = COMPLETE;
    send_result(s, j, c, agg, -1);
}

/* ---- between hosted engines (SwitchDaemon.deliver's queue) ---- */

/* Queue ``len`` bytes of packet for job ``job``'s PS (``to_ps``) or the
 * switch; returns where to write them (NULL: out of memory, a loss). */
static uint8_t *enqueue(gf_switch *s, int64_t job, int to_ps, int64_t len) {
    if (s->nwork == s->capwork) {
        int64_t cap = s->capwork ? 2 * s->capwork : 16;
        msg_t *w = realloc(s->work, (size_t)cap * sizeof *w);
        if (!w) return NULL;
        s->work = w, s->capwork = cap;
    }
    uint8_t *raw = malloc((size_t)len);
    if (!raw) return NULL;
    s->work[s->nwork++] = (msg_t){job, to_ps, len, raw};
    return raw;
}

static void to_ps(gf_switch *s, const job_t *j, const uint8_t *raw, int64_t len, int64_t or_flags) {
    uint8_t *d = enqueue(s, j->id, 1, len);
    if (!d) return;
    memcpy(d, raw, (size_t)len);
    if (or_flags) wr16(d + 4, rd16(d + 4) | or_flags);
}

/* ATPPolicy._aggregate, to the aggregator's owner's PS. */
static void aggregate(gf_switch *s, const job_t *j, const agg_t *a, int64_t index, int64_t flag) {
    uint8_t *h = enqueue(s, j->id, 1, HEADER + 4 * (int64_t)a->nvalues);
    if (!h) return;
    uint8_t *v = header(h, j->id, a->flags | flag, 0, j->fan_in, a->nvalues, a->seq, index,
                        a->bitmap);
    if (a->nvalues) memcpy(v, a->values, (size_t)(4 * a->nvalues));
}

/* ---- ATP and ESA (proto.switch.atp, proto.switch.esa) ---- */

static void atp_free(gf_switch *s, agg_t *a, int64_t now) {
    s->held_ns += now - a->claim_ns;
    a->state = FREE;
}

static int atp_stale(const agg_t *a, const job_t *j) {
    return a->job == j->id && j->window > 0 && a->seq <= j->newest - j->window;
}

/* ATPPolicy._make_room and ESAPolicy's: may ``p`` take ``a``? (0: yes,
 * the occupant evicted; -1: a collision) */
static int make_room(gf_switch *s, agg_t *a, const job_t *j, const pkt_t *p, int64_t index,
                     int64_t now) {
    if (atp_stale(a, j)) {
        s->counters[E_STALE_RECLAIMED]++;
        atp_free(s, a, now);
        return 0;
    }
    if (s->policy != P_ESA) return -1;
    if (a->state == DONE) {
        s->counters[E_RECLAIMED_COMPLETE]++;
        atp_free(s, a, now);
        return 0;
    }
    const job_t *owner = (a->job >= 0 && a->job < MAX_JOBS) ? s->jobs[a->job] : NULL;
    if (a->state == HELD && p->prio > a->prio && owner) {
        s->counters[E_PREEMPTIONS]++;
        aggregate(s, owner, a, index, F_PARTIAL);
        atp_free(s, a, now);
        return 0;
    }
    return -1;
}

/* ATPPolicy.on_gradient */
static void atp_gradient(gf_switch *s, job_t *j, const pkt_t *p, int64_t now) {
    if (p->agg >= s->slots) {
        s->counters[E_BAD_SLOT]++;
        return;
    }
    if (p->flags & (F_OVERFLOW | F_FLOAT)) {
        s->counters[E_PS_OVERFLOW]++;
        to_ps(s, j, p->raw, p->len, 0);
        return;
    }
    agg_t *a = &s->pool[p->agg];
    int mine = a->state != FREE && a->job == j->id && a->seq == p->seq;
    if (p->flags & F_RESEND) {
        s->counters[E_PS_RESEND]++;
        if (mine && a->state == HELD) {
            s->counters[E_FLUSH_PARTIAL]++;
            aggregate(s, j, a, p->agg, F_PARTIAL);
            atp_free(s, a, now);
        } else if (mine) { /* COMPLETE: the aggregate may have been lost on its way */
            aggregate(s, j, a, p->agg, 0);
        }
        to_ps(s, j, p->raw, p->len, 0);
        return;
    }
    const uint8_t *payload = p->raw + HEADER;
    int64_t count = p->count;
    if (!mine) {
        if (a->state != FREE && make_room(s, a, j, p, p->agg, now)) {
            s->counters[E_PS_COLLISION]++;
            to_ps(s, j, p->raw, p->len, F_COLLISION);
            return;
        }
        if (a->cap < count) {
            int32_t *v = realloc(a->values, (size_t)count * 4);
            if (!v) return; /* out of memory: a loss the workers recover */
            a->values = v, a->cap = (int)count;
        }
        s->claims++;
        a->state = HELD, a->prio = (int)p->prio, a->job = j->id, a->seq = p->seq;
        a->bitmap = 0, a->count = 0, a->flags = 0, a->nvalues = (int)count, a->claim_ns = now;
    } else if (a->bitmap & p->bitmap) {
        s->counters[E_DUPLICATE]++;
        return;
    } else if (count != a->nvalues || a->state != HELD) {
        s->counters[a->state == HELD ? E_COUNT_MISMATCH : E_LATE]++;
        return;
    }
    a->bitmap |= p->bitmap;
    if (a->count++ == 0) { /* the first share since the claim */
        memcpy(a->values, payload, (size_t)count * 4);
    } else {
        add_wrapping(a->values, payload, count);
    }
    a->flags |= (int)(p->flags & F_ECN);
    if (a->count < j->fan_in) return;
    a->state = DONE;
    s->busy_ns += now - a->claim_ns;
    aggregate(s, j, a, p->agg, 0);
}

/* ATPPolicy.on_result: free the aggregator the result names, then on to the
 * workers (a PS's answer to one worker's retransmission: to that one). */
static void atp_result(gf_switch *s, job_t *j, const pkt_t *p, int64_t now) {
    if (p->agg < s->slots) {
        agg_t *a = &s->pool[p->agg];
        if (a->state != FREE && a->job == j->id && (a->seq == p->seq || atp_stale(a, j)))
            atp_free(s, a, now);
    }
    if (p->seq > j->newest) j->newest = p->seq;
    if (p->flags & F_RESEND) {
        if (p->wid >= j->fan_in) {
            s->counters[E_BAD_RESULT]++;
            return;
        }
        emit(s, j, p->wid, p->raw, p->len);
        return;
    }
    emit(s, j, -1, p->raw, p->len);
}

/* SwitchEngine.on_packet after the daemon's checks: worker index, bitmap
 * and fan-in against the job, then the policy. */
static void switch_packet(gf_switch *s, job_t *j, const pkt_t *p, int64_t now) {
    int64_t n = j->fan_in;
    if (p->flags & F_ACK) { /* a result: from above (SwitchML, none at a root), or the PS */
        int64_t fan_in = s->policy == P_SWITCHML ? 1 : n;
        if (p->fan_in != fan_in || p->bitmap != full_mask(p->fan_in)) {
            s->counters[E_BAD_RESULT]++;
            return;
        }
        if (s->policy == P_SWITCHML)
            switchml_gradient(s, j, p, now);
        else
            atp_result(s, j, p, now);
        return;
    }
    if (p->fan_in != n || p->wid >= n || p->bitmap != (1ULL << p->wid)) {
        uint64_t b = p->bitmap;
        int help = (p->flags & F_HELP) && p->fan_in == n && p->wid < n && b && !(b & (b - 1)) &&
                   (n == 64 || !(b >> n));
        if (!help) {
            s->counters[E_BAD_WORKER]++;
            return;
        }
        s->counters[E_RX_HELP]++;
    }
    s->counters[E_RX_GRADIENT]++;
    if (s->policy == P_SWITCHML)
        switchml_gradient(s, j, p, now);
    else
        atp_gradient(s, j, p, now);
}

/* ---- the parameter server (proto.ps), ATP's fallback, one per job ---- */

/* where ``seq`` is or would go in a sorted array of ``n`` (binary search) */
#define LOWER_BOUND(arr, n, key, field, out)                                                    \
    do {                                                                                        \
        int64_t lo_ = 0, hi_ = (n);                                                             \
        while (lo_ < hi_) {                                                                     \
            int64_t mid_ = (lo_ + hi_) / 2;                                                     \
            if ((arr)[mid_] field < (key)) lo_ = mid_ + 1; else hi_ = mid_;                     \
        }                                                                                       \
        (out) = lo_;                                                                            \
    } while (0)

/* ParameterServer._unicast: a kept result for worker ``wid`` alone, through
 * the switch flagged RESEND (ATP's fallback), or straight to it (PS). */
static void ps_unicast(gf_switch *s, const job_t *j, const res_t *r, int64_t wid) {
    uint8_t *d = s->policy == P_PS ? reserve(s, j, wid, r->len) : enqueue(s, j->id, 0, r->len);
    if (!d) return;
    memcpy(d, r->raw, (size_t)r->len);
    wr16(d + 8, wid);
    if (s->policy != P_PS) wr16(d + 4, rd16(d + 4) | F_RESEND);
}

/* A result's bytes, to be kept (NULL: out of memory, a loss the workers recover). */
static uint8_t *ps_room(ps_t *ps, int64_t len) {
    if (ps->nres == ps->capres) {
        int64_t cap = ps->capres ? 2 * ps->capres : 16;
        res_t *r = realloc(ps->res, (size_t)cap * sizeof *r);
        if (!r) return NULL;
        ps->res = r, ps->capres = cap;
    }
    return malloc((size_t)len);
}

/* Keep the result of ``seq`` (``raw``, ``len`` bytes, from ps_room) and send it
 * back through the switch (ATP's fallback) or to every worker (PS); results
 * ``window`` sequences behind it are forgotten (ParameterServer.on_packet's
 * done heap, here the sorted results). */
static void ps_keep(gf_switch *s, job_t *j, int64_t seq, uint8_t *raw, int64_t len) {
    ps_t *ps = &j->ps;
    int64_t at;
    LOWER_BOUND(ps->res, ps->nres, seq, .seq, at);
    memmove(ps->res + at + 1, ps->res + at, (size_t)(ps->nres - at) * sizeof *ps->res);
    ps->res[at] = (res_t){seq, len, raw};
    ps->nres++;
    int64_t gone = 0;
    while (gone < ps->nres && ps->res[gone].seq <= seq - ps->window) {
        if (ps->res[gone].seq > ps->floor) ps->floor = ps->res[gone].seq;
        free(ps->res[gone++].raw);
    }
    memmove(ps->res, ps->res + gone, (size_t)(ps->nres - gone) * sizeof *ps->res);
    ps->nres -= gone;
    if (s->policy == P_PS) {
        emit(s, j, -1, raw, len);
        return;
    }
    uint8_t *d = enqueue(s, j->id, 0, len); /* via the switch */
    if (d) memcpy(d, raw, (size_t)len);
}

/* ParameterServer._result: the merged sequence's result. */
static void ps_complete(gf_switch *s, job_t *j, acc_t *acc) {
    ps_t *ps = &j->ps;
    int64_t n = acc->nvalues, flags = F_ACK | acc->flags, over = 0;
    for (int64_t k = 0; acc->has_i && !acc->has_f && k < n; k++)
        over |= acc->iv[k] > INT32_MAX_ || -acc->iv[k] > INT32_MAX_;
    if (acc->has_f || over) flags |= F_FLOAT | F_OVERFLOW;
    int64_t len = HEADER + 4 * n;
    uint8_t *raw = ps_room(ps, len);
    if (!raw) return;
    uint8_t *v = header(raw, j->id, flags, 0, j->fan_in, n, acc->seq, acc->agg, full_mask(j->fan_in));
    for (int64_t k = 0; k < n; k++) {
        if (acc->has_f || over) {
            double x = acc->has_f ? acc->fv[k] + (acc->has_i ? (double)acc->iv[k] / ps->scale : 0.0)
                                  : (double)acc->iv[k] / ps->scale;
            float f = (float)x;
            memcpy(v + 4 * k, &f, 4);
        } else {
            int32_t x = (int32_t)acc->iv[k];
            memcpy(v + 4 * k, &x, 4);
        }
    }
    ps_keep(s, j, acc->seq, raw, len);
}

/* ParameterServer.on_packet: merge by bitmap. */
static void ps_packet(gf_switch *s, job_t *j, const pkt_t *p) {
    ps_t *ps = &j->ps;
    int64_t n = j->fan_in, seq = p->seq, at;
    uint64_t full = full_mask(n);
    if ((p->flags & F_ACK) || p->fan_in != n || !p->bitmap || (p->bitmap & ~full) || p->wid >= n) {
        j->counters[S_BAD_PACKET]++;
        return;
    }
    if (seq <= ps->floor) {
        j->counters[S_STALE]++;
        return;
    }
    LOWER_BOUND(ps->res, ps->nres, seq, .seq, at);
    if (at < ps->nres && ps->res[at].seq == seq) {
        if (!(p->bitmap & (p->bitmap - 1))) { /* one worker (or its helper) asking again */
            j->counters[S_RESEND_ANSWERED]++;
            ps_unicast(s, j, &ps->res[at], p->wid);
        } else {
            j->counters[S_LATE_PARTIAL]++;
        }
        return;
    }
    LOWER_BOUND(ps->accs, ps->naccs, seq, ->seq, at);
    acc_t *acc = at < ps->naccs && ps->accs[at]->seq == seq ? ps->accs[at] : NULL;
    if (!acc && p->bitmap == full && !(p->flags & F_FLOAT)) {
        /* every contribution at once (a complete aggregate, the common case):
         * the int32 values are their own int64 sum and fit, so the result is
         * them under a result's header (what the merge below would give) */
        uint8_t *raw = ps_room(ps, p->len);
        if (!raw) return;
        j->counters[S_MERGED]++;
        uint8_t *v = header(raw, j->id, F_ACK | (p->flags & F_ECN), 0, n, p->count, seq, p->agg, full);
        memcpy(v, p->raw + HEADER, (size_t)(4 * p->count));
        ps_keep(s, j, seq, raw, p->len);
        return;
    }
    if (!acc) {
        if (ps->naccs == ps->capaccs) {
            int64_t cap = ps->capaccs ? 2 * ps->capaccs : 16;
            acc_t **a = realloc(ps->accs, (size_t)cap * sizeof *a);
            if (!a) return;
            ps->accs = a, ps->capaccs = cap;
        }
        acc = calloc(1, sizeof *acc);
        if (!acc) return;
        acc->seq = seq, acc->nvalues = p->count, acc->agg = p->agg;
        memmove(ps->accs + at + 1, ps->accs + at, (size_t)(ps->naccs - at) * sizeof *ps->accs);
        ps->accs[at] = acc;
        ps->naccs++;
    }
    if (acc->bitmap & p->bitmap) {
        j->counters[(acc->bitmap & p->bitmap) == p->bitmap ? S_DUPLICATE : S_OVERLAP]++;
        return;
    }
    if (p->count != acc->nvalues) {
        j->counters[S_COUNT_MISMATCH]++;
        return;
    }
    int64_t count = p->count;
    const uint8_t *payload = p->raw + HEADER;
    if (p->flags & F_FLOAT) {
        if (!acc->fv && !(acc->fv = malloc((size_t)(count ? count : 1) * sizeof(double)))) return;
        for (int64_t k = 0; k < count; k++) {
            float f;
            memcpy(&f, payload + 4 * k, 4);
            acc->fv[k] = (double)f + (acc->has_f ? acc->fv[k] : 0.0); /* + 0: -0.0 becomes 0.0 */
        }
        acc->has_f = 1;
    } else {
        if (!acc->iv && !(acc->iv = malloc((size_t)(count ? count : 1) * sizeof(int64_t)))) return;
        for (int64_t k = 0; k < count; k++) {
            int32_t x;
            memcpy(&x, payload + 4 * k, 4);
            acc->iv[k] = acc->has_i ? acc->iv[k] + x : x;
        }
        acc->has_i = 1;
    }
    j->counters[S_MERGED]++;
    acc->bitmap |= p->bitmap;
    acc->flags |= p->flags & F_ECN;
    if (!(p->flags & (F_COLLISION | F_RESEND | F_OVERFLOW))) acc->agg = p->agg;
    if (acc->bitmap != full) return;
    memmove(ps->accs + at, ps->accs + at + 1, (size_t)(ps->naccs - at - 1) * sizeof *ps->accs);
    ps->naccs--;
    ps_complete(s, j, acc);
    acc_free(acc);
}

/* SwitchDaemon.deliver's loop: every packet between hosted engines, in order. */
static void run_work(gf_switch *s, int64_t now) {
    for (int64_t i = 0; i < s->nwork; i++) {
        msg_t m = s->work[i];
        job_t *j = s->jobs[m.job];
        if (j) {
            pkt_t p;
            parse(&p, m.raw, m.len);
            if (m.to_ps)
                ps_packet(s, j, &p);
            else
                switch_packet(s, j, &p, now);
        }
        free(m.raw);
    }
    s->nwork = 0;
}

/* One datagram, as emu.switchd.accept, then SwitchEngine.on_packet and the
 * policy take it, then what the hosted engines hand each other. */
GF_API void gf_s_datagram(gf_switch *s, const uint8_t *data, int64_t len, int64_t now) {
    s->counters[D_RX]++;
    if (len < TOKEN + HEADER) { /* wire.envelope.job_of: no job to charge it to */
        s->counters[D_MALFORMED_SHORT]++;
        return;
    }
    const uint8_t *h = data + TOKEN;
    job_t *j = s->jobs[rd16(h + 6)];
    if (!j) {
        s->counters[D_UNKNOWN_JOB]++;
        return;
    }
    if (memcmp(data, j->token, TOKEN) != 0) {
        j->counters[J_BAD_TOKEN]++;
        return;
    }
    len -= TOKEN;
    pkt_t p;
    parse(&p, h, len);
    int bad = rd16(h) != MAGIC || h[2] != VERSION || (p.flags & ~KNOWN_FLAGS) || p.fan_in < 1 ||
              p.fan_in > MAX_FAN_IN || p.wid >= MAX_FAN_IN || (p.fan_in < 64 && (p.bitmap >> p.fan_in)) ||
              p.count > MAX_WIRE_VALUES || len != HEADER + 4 * p.count;
    for (int64_t k = 0; !bad && (p.flags & F_FLOAT) && k < p.count; k++) {
        float f;
        memcpy(&f, h + HEADER + 4 * k, 4);
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
    if (s->policy == P_PS)
        ps_packet(s, j, &p); /* the job's entry: its PS */
    else
        switch_packet(s, j, &p, now);
    run_work(s, now);
}

/* The outbox, one datagram per destination: a child without an address is
 * the reference's drop_no_address. ``emit`` gets each (out item, rank). With
 * ``groups``, a packet for every child of a job that has a multicast group
 * leaves once, to the group (rank -1), as SwitchDaemon.forward_group sends
 * it: the network replicates it, as a switch's packet replication engine
 * does (the differential test compares the destinations, ``groups`` 0). */
typedef int (*emit_fn)(void *ctx, const out_t *o, int64_t rank);

static int expand(gf_switch *s, emit_fn emit, void *ctx, int groups) {
    for (int64_t i = 0; i < s->nout; i++) {
        const out_t *o = &s->out[i];
        if (groups && o->to < 0 && o->job->glen) {
            if (emit(ctx, o, -1)) return -1;
            continue;
        }
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
GF_API int64_t gf_s_take(gf_switch *s, uint8_t *buf, int64_t cap) {
    take_t t = {buf, 0, cap};
    return expand(s, take_one, &t, 0) ? -1 : t.at;
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
    m->msg_hdr.msg_name = (void *)(rank < 0 ? &o->job->group : &o->job->addr[rank]);
    m->msg_hdr.msg_namelen = rank < 0 ? o->job->glen : o->job->alen[rank];
    m->msg_hdr.msg_iov = &t->iov[t->n];
    m->msg_hdr.msg_iovlen = 1;
    t->n++;
    return 0;
}

/* The event loop's callback for a readable socket: up to ``batches`` reads of
 * BATCH datagrams, each batch's answers sent before the next read. Returns
 * the datagrams read. */
GF_API int64_t gf_s_drain(gf_switch *s, int fd, int64_t batches) {
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
        expand(s, send_one, t, 1);
        send_now(t);
        total += got;
        if (got < BATCH) break;
    }
    free(t);
    return total;
}
