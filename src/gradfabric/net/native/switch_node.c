/* The native switch node: proto.node.SwitchNode in C, behind the same
 * datagram interface (receive a datagram and the time; datagrams to send as
 * (job, rank, bytes); a timer only for what modelled links hold), for the
 * schemes SwitchML, ATP, ESA, the PS baseline and DLCP's server (unshaped).
 *
 * Theory of operation
 * -------------------
 * The reference is proto.node.SwitchNode, whose module doc this follows:
 * gf_s_datagram is its receive_datagram: accept (the job a datagram names,
 * its token, wire.packet.decode's checks, a job that resynchronises), then
 * the hosted engines: the switch engine (switch_pool.c: SwitchEngine's
 * checks, then SwitchML's copies or ATP's and ESA's pool) and each job's
 * parameter server (switch_ps.c: proto.ps), which hand packets to each other
 * through one first-in first-out queue, in order (msg_t, ``work``), each
 * queued in wire form and taken after the datagram that caused it.
 *
 * What leaves for workers is copied into the outbox at once (a later
 * datagram cannot change what an earlier one answered) as gf_dgram: a job,
 * a rank or GF_ALL, and the sealed datagram (token, header, values). The
 * driver takes it (gf_s_pending, gf_s_sent: udp.c's drain, or gf_s_take for
 * Python) and owns everything the reference's driver owns: the socket, the
 * clock, the workers' addresses, the multicast groups.
 *
 * Counters have the reference's names, in net.switchpath's order: the node's
 * (N_*), the switch engine's (E_*), and per job its datagrams' and its PS's
 * (J_*, S_*). Control (gf_s_job, gf_s_forget) comes from the daemon's control
 * plane, between datagrams, in the same thread. Root switches only (one
 * level, as the daemon runs it); little-endian hosts.
 *
 * DLCP (switch_dlcp.c): each job's server, entered by every datagram of
 * the job; its timers are the node's too (gf_s_timer is the earliest of
 * them and the links'; gf_s_handle_timer fires the due ones, the jobs in
 * the order they were added, as the reference's ports). A background job
 * (gf_s_dlcp's ``background``) has no server: its datagrams are counted.
 * The reference's shaped port is not here: net.switchpath refuses it.
 *
 * ATP's fallback PS behind links of its own (gf_s_links: the reference's
 * ModelledLinks, one shard per worker, each a FIFO each way at the rate): a
 * packet between the switch and a job's PS is held (``held``, a heap on
 * when it has crossed, then the order it left in, as the reference's
 * ``_later``) until the driver's timer (gf_s_timer, gf_s_handle_timer)
 * says its time has come; it then goes on as if just received. A job that
 * leaves takes what its links held with it.
 */
#define _GNU_SOURCE
#include "switch.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

GF_API const char *gf_source(void) { return GRADFABRIC_SOURCE; }

GF_API gf_switch *gf_s_new(int64_t slots, int64_t policy) {
    if (slots < 1 || slots > (1LL << 30) || policy < P_SWITCHML || policy > P_DLCP) return NULL;
    gf_switch *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->slots = slots, s->policy = policy;
    if (policy == P_SWITCHML)
        s->copies = calloc((size_t)(2 * slots), sizeof(copy_t));
    else if (policy != P_PS)
        s->pool = calloc((size_t)slots, sizeof(agg_t));
    if (!(s->copies || s->pool || policy == P_PS || policy == P_DLCP)) {
        free(s);
        return NULL;
    }
    for (int64_t i = 0; s->copies && i < 2 * slots; i++) s->copies[i].seq = -1;
    for (int64_t i = 0; s->pool && i < slots; i++) s->pool[i].job = -1, s->pool[i].seq = -1;
    return s;
}

static void drop_outbox(gf_switch *s, int64_t n) {
    if (n <= 0) return; /* (an empty outbox may be NULL: no pointer arithmetic on it) */
    for (int64_t i = 0; i < n; i++) free((void *)s->out[i].head);
    memmove(s->out, s->out + n, (size_t)(s->nout - n) * sizeof *s->out);
    s->nout -= n;
}

/* ---- the modelled links' heap, on (at, n) ---- */

static int before(const held_t *a, const held_t *b) {
    return a->at < b->at || (a->at == b->at && a->n < b->n);
}

static void sift_down(gf_switch *s, int64_t i) {
    held_t *h = s->held;
    for (;;) {
        int64_t l = 2 * i + 1, m = i;
        if (l < s->nheld && before(&h[l], &h[m])) m = l;
        if (l + 1 < s->nheld && before(&h[l + 1], &h[m])) m = l + 1;
        if (m == i) return;
        held_t t = h[i];
        h[i] = h[m], h[m] = t, i = m;
    }
}

static msg_t *hold(gf_switch *s, int64_t at) {
    if (s->nheld == s->capheld) {
        int64_t cap = s->capheld ? 2 * s->capheld : 64;
        held_t *h = realloc(s->held, (size_t)cap * sizeof *h);
        if (!h) return NULL;
        s->held = h, s->capheld = cap;
    }
    int64_t i = s->nheld++;
    s->held[i] = (held_t){at, ++s->nsent, {0}};
    for (; i > 0 && before(&s->held[i], &s->held[(i - 1) / 2]); i = (i - 1) / 2) {
        held_t t = s->held[i];
        s->held[i] = s->held[(i - 1) / 2], s->held[(i - 1) / 2] = t;
    }
    return &s->held[i].m;
}

/* ModelledLinks.cross: when ``len`` bytes of job ``j``'s sequence ``seq``
 * offered now have crossed its shard's link ``way``. */
static int64_t cross(gf_switch *s, job_t *j, int64_t seq, int way, int64_t len) {
    int64_t *free_at = &j->link_free[2 * (seq % j->fan_in) + way];
    int64_t start = *free_at > s->now ? *free_at : s->now;
    *free_at = start + llrint((double)(IP_UDP + len) * s->link_ns_per_byte);
    return *free_at;
}

GF_API void gf_s_free(gf_switch *s) {
    if (!s) return;
    for (int64_t i = 0; s->copies && i < 2 * s->slots; i++) free(s->copies[i].values);
    for (int64_t i = 0; s->pool && i < s->slots; i++) free(s->pool[i].values);
    for (int64_t j = 0; j < MAX_JOBS; j++)
        if (s->jobs[j])
            ps_clear(&s->jobs[j]->ps), help_free(s->jobs[j]->help), dlcp_free(s->jobs[j]->dlcp),
                free(s->jobs[j]->link_free), free(s->jobs[j]);
    for (int64_t i = 0; i < s->nwork; i++) free(s->work[i].raw);
    for (int64_t i = 0; i < s->nheld; i++) free(s->held[i].m.raw);
    drop_outbox(s, s->nout);
    free(s->copies), free(s->pool), free(s->work), free(s->held), free(s->out), free(s->dlcp_jobs);
    free(s);
}

/* Install or update a job (the control plane's register, restore, resume);
 * a new one's slot range is cleared (SwitchMLPolicy.admit). ATP's: the
 * switch job's ``window``, its PS's (``ps_window``) and integer scale. */
GF_API int gf_s_job(gf_switch *s, int64_t id, const uint8_t *token, int64_t fan_in,
                    int64_t slot_base, int64_t slot_count, int64_t resync, int64_t window,
                    int64_t ps_window, double scale) {
    if (id < 1 || id >= MAX_JOBS || fan_in < 1 || fan_in > MAX_FAN_IN || ps_window < 1) return -1;
    if (slot_base < 0 || slot_count < 0 || slot_base + slot_count > s->slots || window < 0) return -1;
    if (!(scale > 0)) return -1;
    job_t *j = s->jobs[id];
    if (j && (j->link_free || j->help || j->dlcp) && j->fan_in != fan_in) return -1; /* by worker */
    if (!j) {
        j = s->jobs[id] = calloc(1, sizeof *j);
        if (!j) return -1;
        if (s->link_ns_per_byte > 0 && !(j->link_free = calloc((size_t)(2 * fan_in), 8))) {
            free(j);
            s->jobs[id] = NULL;
            return -1;
        }
        j->newest = -1, j->ps.floor = -1, j->largest = -1;
        pool_clear_range(s, slot_base, slot_count);
    }
    memcpy(j->token, token, TOKEN);
    j->id = id, j->fan_in = fan_in, j->slot_base = slot_base, j->slot_count = slot_count;
    j->resync = resync, j->window = window, j->ps.window = ps_window, j->ps.scale = scale;
    return 0;
}

/* The job left (SwitchMLPolicy.retire, ATPPolicy.retire): its range is
 * cleared for the next owner, or its aggregators freed (their remaining hold
 * not counted as use), its PS dropped. */
GF_API void gf_s_forget(gf_switch *s, int64_t id) {
    job_t *j = (id >= 0 && id < MAX_JOBS) ? s->jobs[id] : NULL;
    if (!j) return;
    pool_clear_range(s, j->slot_base, j->slot_count);
    pool_forget(s, id);
    ps_clear(&j->ps);
    int64_t kept = 0; /* what its links held goes with it */
    for (int64_t i = 0; i < s->nheld; i++)
        if (s->held[i].m.job == id)
            free(s->held[i].m.raw);
        else
            s->held[kept++] = s->held[i];
    s->nheld = kept;
    for (int64_t i = kept / 2 - 1; i >= 0; i--) sift_down(s, i);
    help_free(j->help);
    if (j->dlcp) {
        int64_t k = 0;
        for (int64_t i = 0; i < s->ndlcp; i++)
            if (s->dlcp_jobs[i] != id) s->dlcp_jobs[k++] = s->dlcp_jobs[i];
        s->ndlcp = k;
        dlcp_free(j->dlcp);
    }
    free(j->link_free);
    free(j);
    s->jobs[id] = NULL;
}

/* DLCP's server for job ``id`` (DlcpServer: the push ``bound``, the pull's
 * ``per_packet`` values, ``rto``, the most values in a tensor), or none for
 * a ``background`` job. */
GF_API int gf_s_dlcp(gf_switch *s, int64_t id, double bound, int64_t per_packet, int64_t rto,
                     int64_t max_values, int64_t background) {
    job_t *j = (id >= 0 && id < MAX_JOBS) ? s->jobs[id] : NULL;
    if (!j || s->policy != P_DLCP || j->dlcp) return -1;
    if (background) return 0;
    int64_t *order = realloc(s->dlcp_jobs, (size_t)(s->ndlcp + 1) * sizeof *order);
    if (!order) return -1;
    s->dlcp_jobs = order;
    if (!(j->dlcp = dlcp_new(j->fan_in, bound, per_packet, rto, max_values))) return -1;
    s->dlcp_jobs[s->ndlcp++] = id;
    return 0;
}

GF_API int64_t *gf_s_dlcp_counters(gf_switch *s, int64_t id) {
    job_t *j = (id >= 0 && id < MAX_JOBS) ? s->jobs[id] : NULL;
    return j && j->dlcp ? dlcp_counters(j->dlcp) : NULL;
}

/* SA-ATP's straggler help for job ``id`` (SwitchEngine.watch: the monitor
 * starts afresh); ATP's and ESA's pool only. */
GF_API int gf_s_help(gf_switch *s, int64_t id, int64_t lag, int64_t replicas,
                     int64_t max_requests, int64_t it_len, int64_t policy) {
    job_t *j = (id >= 0 && id < MAX_JOBS) ? s->jobs[id] : NULL;
    if (!j || (s->policy != P_ATP && s->policy != P_ESA)) return -1;
    if (lag < 1 || replicas < 1 || it_len < 1 || policy < HELP_MOST_AHEAD ||
        policy > HELP_NEXT_HOLDER)
        return -1;
    help_t *h = help_new(j->fan_in, lag, replicas, max_requests, it_len, policy);
    if (!h) return -1;
    help_free(j->help);
    j->help = h;
    return 0;
}

/* ATP's and ESA's PS behind links of ``mbps`` each (ModelledLinks); set
 * before any job is added. */
GF_API int gf_s_links(gf_switch *s, double mbps) {
    if (!(mbps > 0) || (s->policy != P_ATP && s->policy != P_ESA)) return -1;
    for (int64_t j = 0; j < MAX_JOBS; j++)
        if (s->jobs[j]) return -1;
    s->link_ns_per_byte = 8e3 / mbps;
    return 0;
}

/* SwitchNode.resync's floor: the job's sequences go on from ``floor``. */
GF_API void gf_s_floor(gf_switch *s, int64_t id, int64_t floor) {
    job_t *j = (id >= 0 && id < MAX_JOBS) ? s->jobs[id] : NULL;
    if (j && floor - 1 > j->largest) j->largest = floor - 1;
}

GF_API int64_t *gf_s_counters(gf_switch *s) { return s->counters; }
GF_API int64_t *gf_s_job_counters(gf_switch *s, int64_t id) {
    return (id >= 0 && id < MAX_JOBS && s->jobs[id]) ? s->jobs[id]->counters : NULL;
}
GF_API int64_t *gf_s_pool(gf_switch *s) { return &s->busy_ns; } /* busy_ns, held_ns, claims */

/* SwitchNode.missing: children some partly filled copy, aggregator or merge
 * of the job waits on, as a bitmap. */
GF_API uint64_t gf_s_missing(gf_switch *s, int64_t id) {
    job_t *j = (id >= 0 && id < MAX_JOBS) ? s->jobs[id] : NULL;
    return j ? pool_missing(s, j) | ps_missing(j) | dlcp_missing(j) : 0;
}

/* ATP's and ESA's aggregators now held by some job (SwitchNode.occupancy). */
GF_API int64_t gf_s_occupied(gf_switch *s) {
    int64_t n = 0;
    for (int64_t i = 0; s->pool && i < s->slots; i++) n += s->pool[i].state != FREE;
    return n;
}

/* ---- what the engines send (switch.h) ---- */

/* Room for a datagram to ``rank`` of ``j`` (GF_ALL: every worker): its
 * token is written; returns where ``len`` bytes of header and values go
 * (NULL: out of memory, a loss the workers recover, counted). */
uint8_t *sw_reserve(gf_switch *s, const job_t *j, int64_t rank, int64_t len) {
    if (s->nout >= OUTBOX_CAP) { /* a driver that does not take what waits: refused, counted */
        s->counters[N_OUTBOX_FULL]++;
        return NULL;
    }
    if (s->nout == s->capout) {
        int64_t cap = s->capout ? 2 * s->capout : 64;
        gf_dgram *o = realloc(s->out, (size_t)cap * sizeof *o);
        if (!o) goto oom;
        s->out = o, s->capout = cap;
    }
    uint8_t *d = malloc((size_t)(TOKEN + len));
    if (!d) goto oom;
    memcpy(d, j->token, TOKEN);
    s->out[s->nout++] = (gf_dgram){(int32_t)j->id, (int32_t)rank, d, TOKEN + len, NULL, 0};
    return d + TOKEN;
oom:
    s->oom = 1;
    return NULL;
}

void sw_emit(gf_switch *s, const job_t *j, int64_t rank, const uint8_t *raw, int64_t len) {
    uint8_t *d = sw_reserve(s, j, rank, len);
    if (d) memcpy(d, raw, (size_t)len);
}

/* Queue ``len`` bytes of packet for job ``job``'s PS (``to_ps``) or the
 * switch; returns where to write them (NULL: out of memory, a loss). */
uint8_t *sw_enqueue(gf_switch *s, int64_t job, int to_ps, int64_t len, int64_t seq) {
    job_t *j = s->jobs[job];
    if (j && j->link_free) { /* onto the PS's link: into it (DOWN) or out of it (UP) */
        if (s->nheld >= LINK_HOLD) { /* a flood the links cannot carry: never grown */
            s->counters[N_LINK_FULL]++;
            return NULL;
        }
        uint8_t *raw = malloc((size_t)(len ? len : 1));
        msg_t *m = raw ? hold(s, cross(s, j, seq, to_ps ? DOWN : UP, len)) : NULL;
        if (!m) {
            free(raw);
            goto oom;
        }
        *m = (msg_t){job, to_ps, len, seq, raw};
        return raw;
    }
    if (s->nwork == s->capwork) {
        int64_t cap = s->capwork ? 2 * s->capwork : 16;
        msg_t *w = realloc(s->work, (size_t)cap * sizeof *w);
        if (!w) goto oom;
        s->work = w, s->capwork = cap;
    }
    uint8_t *raw = malloc((size_t)(len ? len : 1));
    if (!raw) goto oom;
    s->work[s->nwork++] = (msg_t){job, to_ps, len, seq, raw};
    return raw;
oom:
    s->oom = 1;
    return NULL;
}

/* One packet between hosted engines, to its engine. */
static void run_msg(gf_switch *s, msg_t m, int64_t now) {
    job_t *j = s->jobs[m.job];
    if (j) {
        gf_pkt p;
        gf_parse(&p, m.raw, m.len);
        p.seq = m.seq;
        if (m.to_ps)
            ps_packet(s, j, &p);
        else
            pool_packet(s, j, &p, now);
    }
    free(m.raw);
}

/* SwitchNode.deliver's loop: every packet between hosted engines, in order. */
static void run_work(gf_switch *s, int64_t now) {
    for (int64_t i = 0; i < s->nwork; i++) run_msg(s, s->work[i], now);
    s->nwork = 0;
}

/* ---- the datagram interface ---- */

/* SwitchNode.receive_datagram: accept, then the job's entry (the switch, or
 * for the PS baseline its PS), then what the hosted engines hand each other.
 * Returns -1 if a datagram was lost to memory since the last call. */
GF_API int gf_s_datagram(gf_switch *s, const uint8_t *data, int64_t len, int64_t now) {
    s->now = now;
    s->counters[N_RX]++;
    if (len < TOKEN + HEADER) { /* wire.envelope.job_of: no job to charge it to */
        s->counters[N_MALFORMED]++;
        return 0;
    }
    const uint8_t *h = data + TOKEN;
    job_t *j = s->jobs[gf_rd16(h + 6)];
    if (!j) {
        s->counters[N_UNKNOWN_JOB]++;
        return 0;
    }
    if (!gf_token_eq(data, j->token)) {
        j->counters[J_BAD_TOKEN]++;
        return 0;
    }
    gf_pkt p;
    gf_parse(&p, h, len - TOKEN);
    if (gf_check(&p)) {
        j->counters[J_MALFORMED]++;
        return 0;
    }
    j->counters[J_RX]++;
    if (j->resync) {
        j->counters[J_RESYNCING]++;
        return 0;
    }
    p.seq = gf_unwrap(p.seq, j->largest < 0 ? p.seq : j->largest + 1); /* SwitchNode.accept */
    if (p.seq > j->largest) j->largest = p.seq;
    if (s->policy == P_DLCP) {
        if (j->dlcp)
            dlcp_packet(s, j, &p, now);
        else
            s->counters[N_BG_DELIVERED]++;
    } else if (s->policy == P_PS) {
        ps_packet(s, j, &p);
    } else {
        pool_packet(s, j, &p, now);
    }
    run_work(s, now);
    int oom = s->oom;
    s->oom = 0;
    return oom ? -1 : 0;
}

static int gf_s_receive(void *e, const uint8_t *data, int64_t len, int64_t now) {
    return gf_s_datagram(e, data, len, now);
}

static int64_t gf_s_pending(void *e, int64_t now, const gf_dgram **out) {
    (void)now; /* the switch sends at once */
    gf_switch *s = e;
    *out = s->out;
    return s->nout;
}

static void gf_s_sent(void *e, int64_t n, int64_t now) {
    (void)now;
    drop_outbox(e, n);
}

/* The next deadline: when the first packet a modelled link holds has
 * crossed, or a DLCP server's timer (-1: none). */
GF_API int64_t gf_s_timer(void *e) {
    gf_switch *s = e;
    int64_t at = s->nheld ? s->held[0].at : -1;
    for (int64_t i = 0; i < s->ndlcp; i++) {
        int64_t d = dlcp_deadline(s->jobs[s->dlcp_jobs[i]]->dlcp);
        if (d >= 0 && (at < 0 || d < at)) at = d;
    }
    return at;
}

/* SwitchNode.handle_timer: every packet that has crossed by ``now``, in
 * order, each with what it causes. Returns -1 if one was lost to memory. */
GF_API int gf_s_handle_timer(void *e, int64_t now) {
    gf_switch *s = e;
    s->now = now;
    while (s->nheld && s->held[0].at <= now) {
        msg_t m = s->held[0].m;
        s->held[0] = s->held[--s->nheld];
        sift_down(s, 0);
        run_msg(s, m, now);
        run_work(s, now);
    }
    for (int64_t i = 0; i < s->ndlcp; i++) { /* (a server's timer adds no job) */
        job_t *j = s->jobs[s->dlcp_jobs[i]];
        int64_t d = dlcp_deadline(j->dlcp);
        if (d >= 0 && d <= now) dlcp_timer(s, j, now);
    }
    int oom = s->oom;
    s->oom = 0;
    return oom ? -1 : 0;
}

static int gf_s_done(void *e, int quiet) {
    (void)e, (void)quiet;
    return 0; /* a switch serves until it is stopped */
}

static int64_t gf_s_read_wait(void *e, int64_t now) {
    (void)e, (void)now;
    return 0;
}

static const gf_ops OPS = {gf_s_receive,      gf_s_pending, gf_s_sent,     gf_s_timer,
                           gf_s_handle_timer, gf_s_done,    gf_s_read_wait};

/* The datagram interface as function pointers, for the native driver (udp.c). */
GF_API const gf_ops *gf_s_ops(void) { return &OPS; }

/* The outbox as bytes (for a driver in Python, and the differential harness):
 * per datagram an i32 job, an i32 rank (-1: every worker), a u32 length and
 * its bytes; what fits in ``cap`` is taken. Returns the bytes written. */
GF_API int64_t gf_s_take(gf_switch *s, uint8_t *buf, int64_t cap) {
    int64_t at = 0, n = 0;
    for (; n < s->nout; n++) {
        const gf_dgram *o = &s->out[n];
        if (at + 12 + o->head_len > cap) break;
        int32_t head[3] = {o->job, o->rank, (int32_t)o->head_len};
        memcpy(buf + at, head, 12);
        memcpy(buf + at + 12, o->head, (size_t)o->head_len);
        at += 12 + o->head_len;
    }
    drop_outbox(s, n);
    return at;
}
