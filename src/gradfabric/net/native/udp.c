/* The native UDP driver: any native engine (wire.h's gf_ops) on a real
 * socket, with batched reads and writes (recvmmsg, sendmmsg) and no Python
 * per datagram. It owns what a driver owns and nothing of a protocol: the
 * socket, the clock, and where each destination is (the book).
 *
 * gf_udp_run is a worker's: the calling thread serves its engine's
 * collective until it is done (or, ``quiet``, until nothing is outstanding),
 * the caller raises ``*abort`` (a switch restart), ``wall_deadline`` passes,
 * the engine gives up on its peer, or memory runs out; it waits in ppoll
 * for the next datagram, the engine's deadline or its read period, and
 * sends what the engine lets leave; a write to ``wake_fd`` (an eventfd; -1:
 * none) says another thread gave the engine more to send (DLCP's next
 * bucket). net.driver's ``run`` is the same loop in Python, for the
 * reference engine.
 *
 * gf_udp_drain is the switch daemon's: the daemon's event loop calls it when
 * its socket is readable or the engine's timer is due; it first lets the
 * engine handle a due timer (what its modelled links carried), then reads up
 * to a few batches, hands each datagram
 * to the engine, and after each batch sends what the engine has to send,
 * each to its job's rank (GF_ALL: the job's multicast group if it has one,
 * else every worker with an address). The Python daemon (runtime.switchd) does
 * the same with one datagram at a time, so the engine cannot tell them
 * apart. A rank without an address is drop_no_address; a full socket
 * buffer is a loss the workers recover (drop_tx_full), as the reference's
 * non-blocking sendto.
 *
 * Offloads (Linux's UDP GSO and GRO), where the kernel has them: datagrams
 * of one length to one destination leave as one message the kernel cuts
 * into datagrams (UDP_SEGMENT), and a socket with UDP_GRO reads a train of
 * datagrams that crossed the network whole as one message and its segment
 * size, which is cut here into the datagrams it carried. What reaches the
 * wire and the engine is the same datagrams either way (each with its own
 * IP and UDP header, never an IP fragment); only the system calls and the
 * kernel's per-packet passes are fewer, as TCP's segmentation offload gives
 * gloo. A kernel that refuses a segmented send turns the offload off for
 * the process and the message goes datagram by datagram; gf_udp_offload
 * says what a socket got.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "wire.h"

#define BATCH 64
#define BOOK_JOBS 65536
#define OUTBOX_MAX 64 /* the most an engine hands over at a time (worker.h's OUTBOX) */
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#define SEGS_MAX 64         /* datagrams in one segmented message (the kernel takes 64 or more) */
#define GSO_BYTES 65000     /* and their bytes, under an IP packet's 65,535 with headers */
#define IOVS (BATCH * 2 * 8) /* iovecs for one batch of messages */
#define WBATCH_TAKE 8        /* messages gf_udp_take reads at a time */

/* the driver's counters, in net.switchpath's order */
enum { U_TX, U_TX_FULL, U_SOCKET_ERROR, U_NO_ADDRESS, U_SYSCALLS, U_NO_MEMORY, U_GSO, U_GRO, NU };

/* Segmented sends, for the process (the kernel has them or not, for every
 * socket alike; GRADFABRIC_OFFLOAD=0 is the process's): on once
 * gf_udp_offload found the kernel has them, off again if it refuses one as
 * unsupported. Runs of datagrams of ``gso_refused`` bytes or more are not
 * segmented: the route refused that size (its MTU is smaller). */
static int gso_on;
static size_t gso_refused = SIZE_MAX;

/* The offloads for socket ``fd`` (``want`` 0: none, for this process's
 * sends too). Bit 0 of the answer: receive coalescing is on (the kernel has
 * UDP_GRO); bit 1: segmented sends are on (none refused so far). */
GF_API int gf_udp_offload(int fd, int want) {
    int on = want ? 1 : 0, size;
    socklen_t len = sizeof size; /* a kernel that knows UDP_SEGMENT answers for it */
    gso_on = want && getsockopt(fd, IPPROTO_UDP, UDP_SEGMENT, &size, &len) == 0;
    gso_refused = SIZE_MAX; /* (a new socket may have another route) */
    int gro = setsockopt(fd, IPPROTO_UDP, UDP_GRO, &on, sizeof on) == 0 && want;
    return gro | (gso_on ? 2 : 0);
}

/* ---- sending: datagrams batched into messages, a run of one length to one
 * place segmented ---- */

typedef struct {
    int fd, n, niov, blocking;
    int64_t *tx, *full, *error, *syscalls, *gso; /* where to count */
    struct mmsghdr msgs[BATCH];
    int segs[BATCH];
    size_t seglen[BATCH];
    const void *to[BATCH];
    struct iovec iov[IOVS];
    union {
        char buf[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } ctl[BATCH];
} tx_t;

static void segment(tx_t *t, int i) {
    struct msghdr *h = &t->msgs[i].msg_hdr;
    if (t->segs[i] < 2) return;
    h->msg_control = t->ctl[i].buf;
    h->msg_controllen = sizeof t->ctl[i].buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(h);
    c->cmsg_level = IPPROTO_UDP, c->cmsg_type = UDP_SEGMENT;
    c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
    uint16_t size = (uint16_t)t->seglen[i];
    memcpy(CMSG_DATA(c), &size, sizeof size);
}

/* Message ``i`` again, one datagram at a time (the kernel refused it segmented). */
static void unsegment(tx_t *t, int i) {
    struct msghdr h = t->msgs[i].msg_hdr;
    int per = (int)h.msg_iovlen / t->segs[i]; /* 1 or 2 iovecs a datagram, alike in a run */
    h.msg_control = NULL, h.msg_controllen = 0, h.msg_iovlen = (size_t)per;
    for (int k = 0; k < t->segs[i];) {
        h.msg_iov = t->msgs[i].msg_hdr.msg_iov + k * per;
        (*t->syscalls)++;
        if (sendmsg(t->fd, &h, t->blocking ? 0 : MSG_DONTWAIT) >= 0) {
            (*t->tx)++, k++;
            continue;
        }
        int full = errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS;
        if (full && t->blocking) { /* a worker waits for room, as tx_flush does */
            struct pollfd p = {t->fd, POLLOUT, 0};
            poll(&p, 1, 1);
        } else if (errno != EINTR) {
            (*(full ? t->full : t->error))++, k++;
        }
    }
}

static void tx_flush(tx_t *t) {
    int at = 0;
    for (int i = 0; i < t->n; i++) segment(t, i);
    while (at < t->n) {
        int sent = sendmmsg(t->fd, t->msgs + at, (unsigned)(t->n - at), t->blocking ? 0 : MSG_DONTWAIT);
        (*t->syscalls)++;
        if (sent > 0) {
            for (int i = at; i < at + sent; i++) {
                *t->tx += t->segs[i];
                if (t->segs[i] > 1) (*t->gso)++;
            }
            at += sent;
        } else if (errno == EINTR) {
            continue;
        } else if (t->segs[at] > 1 && (errno == EIO || errno == EINVAL || errno == EMSGSIZE ||
                                       errno == EOPNOTSUPP)) {
            /* EINVAL, EMSGSIZE: this message cannot be cut (datagrams over the
             * route's MTU); else the path cannot cut any (no checksum offload):
             * none is again */
            if (errno != EINVAL && errno != EMSGSIZE)
                gso_on = 0;
            else if (t->seglen[at] < gso_refused)
                gso_refused = t->seglen[at];
            unsegment(t, at++);
        } else if (t->blocking && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS)) {
            struct pollfd p = {t->fd, POLLOUT, 0}; /* a worker waits for room: the kernel's pacing */
            poll(&p, 1, 1);
        } else { /* the first message failed: a full buffer is a loss the protocol recovers */
            int full = errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS;
            *(full ? t->full : t->error) += t->segs[at];
            at++;
        }
    }
    t->n = 0, t->niov = 0;
}

/* Queue datagram ``o`` to ``to`` (the caller keeps ``to`` alive until the
 * flush): it joins the last message where that goes to the same place with
 * datagrams of the same length, else it starts one. */
static void tx_add(tx_t *t, const gf_dgram *o, const void *to, socklen_t len) {
    size_t bytes = (size_t)(o->head_len + o->body_len);
    int per = o->body_len ? 2 : 1, last = t->n - 1;
    if (last >= 0 && gso_on && bytes && bytes < gso_refused && t->to[last] == to &&
        t->seglen[last] == bytes &&
        t->segs[last] < SEGS_MAX && (size_t)(t->segs[last] + 1) * bytes <= GSO_BYTES &&
        (int)t->msgs[last].msg_hdr.msg_iovlen / t->segs[last] == per && t->niov + per <= IOVS) {
        t->iov[t->niov++] = (struct iovec){(void *)o->head, (size_t)o->head_len};
        if (per == 2) t->iov[t->niov++] = (struct iovec){(void *)o->body, (size_t)o->body_len};
        t->msgs[last].msg_hdr.msg_iovlen += (size_t)per;
        t->segs[last]++;
        return;
    }
    if (t->n == BATCH || t->niov + per > IOVS) tx_flush(t);
    struct mmsghdr *m = &t->msgs[t->n];
    memset(m, 0, sizeof *m);
    m->msg_hdr.msg_name = (void *)to;
    m->msg_hdr.msg_namelen = len;
    m->msg_hdr.msg_iov = &t->iov[t->niov];
    m->msg_hdr.msg_iovlen = (size_t)per;
    t->iov[t->niov++] = (struct iovec){(void *)o->head, (size_t)o->head_len};
    if (per == 2) t->iov[t->niov++] = (struct iovec){(void *)o->body, (size_t)o->body_len};
    t->to[t->n] = to, t->seglen[t->n] = bytes, t->segs[t->n] = 1;
    t->n++;
}

/* ---- reading: a batch of messages, each cut into the datagrams it carries ---- */

typedef struct {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl[BATCH];
} rx_t;

/* Up to ``n`` messages from ``fd`` into ``rx`` (``n`` buffers of DGRAM);
 * the messages read (<= 0: none; errno says why). */
static int rx_read(rx_t *r, int fd, uint8_t *rx, int n) {
    for (int i = 0; i < n; i++) {
        r->iov[i] = (struct iovec){rx + (size_t)i * DGRAM, DGRAM};
        memset(&r->msgs[i], 0, sizeof r->msgs[i]);
        r->msgs[i].msg_hdr.msg_iov = &r->iov[i];
        r->msgs[i].msg_hdr.msg_iovlen = 1;
        r->msgs[i].msg_hdr.msg_control = r->ctl[i].buf;
        r->msgs[i].msg_hdr.msg_controllen = sizeof r->ctl[i].buf;
    }
    return recvmmsg(fd, r->msgs, (unsigned)n, MSG_DONTWAIT, NULL);
}

/* Message ``i``'s datagrams into the engine: how many (-1: out of memory,
 * after the rest were handed over). A message cut short is one datagram
 * too long for the engine, which counts it malformed. */
static int64_t rx_deliver(const rx_t *r, int i, const uint8_t *rx, const gf_ops *ops, void *e,
                          int64_t now, int64_t *gro) {
    const struct msghdr *h = &r->msgs[i].msg_hdr;
    const uint8_t *data = rx + (size_t)i * DGRAM;
    int64_t len = r->msgs[i].msg_len, seg = len, n = 0;
    int oom = 0;
    if (h->msg_flags & MSG_TRUNC) return ops->receive(e, data, DGRAM + 1, now) ? -1 : 1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c; c = CMSG_NXTHDR((struct msghdr *)h, c)) {
        if (c->cmsg_level == IPPROTO_UDP && c->cmsg_type == UDP_GRO) {
            int size;
            memcpy(&size, CMSG_DATA(c), sizeof size);
            if (size > 0) seg = size;
        }
    }
    if (len == 0) return ops->receive(e, data, 0, now) ? -1 : 1;
    if (seg < len) (*gro)++;
    for (int64_t at = 0; at < len; at += seg, n++)
        if (ops->receive(e, data + at, len - at < seg ? len - at : seg, now)) oom = 1;
    return oom ? -1 : n;
}

typedef struct {
    int64_t workers;
    struct sockaddr_storage addr[MAX_FAN_IN], group;
    socklen_t alen[MAX_FAN_IN], glen; /* 0: none */
} entry_t;

typedef struct {
    entry_t *jobs[BOOK_JOBS];
    int64_t counters[NU];
    uint8_t *rx; /* BATCH datagrams */
    tx_t tx;     /* the drain's batches, made once (gf_book_new), not per wake-up */
    rx_t rxh;
} gf_book;

GF_API const char *gf_source(void) { return GRADFABRIC_SOURCE; }

GF_API gf_book *gf_book_new(void) {
    gf_book *b = calloc(1, sizeof *b);
    if (b && !(b->rx = malloc((size_t)BATCH * DGRAM))) {
        free(b);
        return NULL;
    }
    if (b) {
        int64_t *c = b->counters;
        b->tx = (tx_t){.tx = &c[U_TX], .full = &c[U_TX_FULL], .error = &c[U_SOCKET_ERROR],
                       .syscalls = &c[U_SYSCALLS], .gso = &c[U_GSO]};
    }
    return b;
}

GF_API void gf_book_free(gf_book *b) {
    if (!b) return;
    for (int64_t j = 0; j < BOOK_JOBS; j++) free(b->jobs[j]);
    free(b->rx), free(b);
}

GF_API int64_t *gf_book_counters(gf_book *b) { return b->counters; }

static entry_t *entry(gf_book *b, int64_t job) {
    if (job < 0 || job >= BOOK_JOBS) return NULL;
    return b->jobs[job] ? b->jobs[job] : (b->jobs[job] = calloc(1, sizeof(entry_t)));
}

/* Job ``job`` has ``workers`` ranks (a datagram for all of them goes to each). */
GF_API int gf_book_job(gf_book *b, int64_t job, int64_t workers) {
    entry_t *e = entry(b, job);
    if (!e || workers < 1 || workers > MAX_FAN_IN) return -1;
    e->workers = workers;
    return 0;
}

/* Rank ``rank`` of job ``job`` is at ``addr`` (a raw sockaddr of ``alen``
 * bytes; rank -1: the job's multicast group; alen 0 forgets it). */
GF_API int gf_book_set(gf_book *b, int64_t job, int64_t rank, const uint8_t *addr, int64_t alen) {
    entry_t *e = entry(b, job);
    if (!e || rank < -1 || rank >= MAX_FAN_IN || alen < 0 ||
        alen > (int64_t)sizeof(struct sockaddr_storage))
        return -1;
    memcpy(rank < 0 ? &e->group : &e->addr[rank], addr, (size_t)alen);
    *(rank < 0 ? &e->glen : &e->alen[rank]) = (socklen_t)alen;
    return 0;
}

GF_API void gf_book_forget(gf_book *b, int64_t job) {
    if (job < 0 || job >= BOOK_JOBS) return;
    free(b->jobs[job]);
    b->jobs[job] = NULL;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Everything the engine has to send, each to where the book says. */
static void flush(const gf_ops *ops, void *engine, gf_book *b, tx_t *t, int64_t now) {
    const gf_dgram *out;
    int64_t n = ops->pending(engine, now, &out);
    for (int64_t i = 0, run; i < n; i += run) {
        const gf_dgram *o = &out[i];
        const entry_t *e = o->job >= 0 && o->job < BOOK_JOBS ? b->jobs[o->job] : NULL;
        run = 1;
        if (e && o->rank == GF_ALL && e->glen) {
            tx_add(t, o, &e->group, e->glen);
            continue;
        }
        if (!e || o->rank >= MAX_FAN_IN || o->rank < GF_ALL) {
            b->counters[U_NO_ADDRESS]++;
            continue;
        }
        /* a run of results for all of one job goes rank by rank, so each
         * rank's share of it is one run to one place (segmented) */
        while (o->rank == GF_ALL && i + run < n && out[i + run].rank == GF_ALL &&
               out[i + run].job == o->job)
            run++;
        int64_t lo = o->rank < 0 ? 0 : o->rank, hi = o->rank < 0 ? e->workers : o->rank + 1;
        for (int64_t r = lo; r < hi; r++) {
            if (!e->alen[r]) {
                b->counters[U_NO_ADDRESS] += run;
                continue;
            }
            for (int64_t k = i; k < i + run; k++) tx_add(t, &out[k], &e->addr[r], e->alen[r]);
        }
    }
    tx_flush(t); /* (the datagrams point into the engine's outbox until ``sent``) */
    ops->sent(engine, n, now);
}

/* The event loop's callback for a readable socket: up to ``batches`` reads of
 * BATCH datagrams, each batch's answers sent before the next read. Returns
 * the datagrams read. Each rank a datagram should reach and that has no
 * address is counted (drop_no_address). */
GF_API int64_t gf_udp_drain(const gf_ops *ops, void *engine, gf_book *b, int fd, int64_t batches) {
    int64_t total = 0, *c = b->counters;
    tx_t *t = &b->tx;
    rx_t *r = &b->rxh;
    t->fd = fd; /* (empty between calls: each flush leaves it so) */
    int64_t now = now_ns(), due = ops->timer(engine);
    if (due >= 0 && due <= now) { /* what the engine's modelled links carried by now */
        if (ops->handle_timer(engine, now) < 0) c[U_NO_MEMORY]++;
        flush(ops, engine, b, t, now);
    }
    for (int64_t k = 0; k < batches; k++) {
        int got = rx_read(r, fd, b->rx, BATCH);
        c[U_SYSCALLS]++;
        if (got <= 0) {
            if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                c[U_SOCKET_ERROR]++;
            break;
        }
        now = now_ns();
        for (int i = 0; i < got; i++) {
            int64_t n = rx_deliver(r, i, b->rx, ops, engine, now, &c[U_GRO]);
            if (n < 0) c[U_NO_MEMORY]++;
            total += n < 0 ? 1 : n;
        }
        flush(ops, engine, b, t, now);
        if (got < BATCH) break;
    }
    return total;
}

/* Send what the engine has queued, as the drain does after each batch: for
 * an engine given work outside the drain (a helped host's push, its timer). */
GF_API void gf_udp_flush(const gf_ops *ops, void *engine, gf_book *b, int fd) {
    b->tx.fd = fd;
    flush(ops, engine, b, &b->tx, now_ns());
}

/* ---- datagrams in and out without an engine: what the offloads do, seen
 * from outside (the differential tests) ---- */

/* Send ``n`` datagrams, ``lens[i]`` bytes each, laid end to end in ``data``,
 * to ``addr`` as the drivers send (runs of one length segmented); counters:
 * datagrams sent, sends refused, system calls, segmented messages. */
GF_API void gf_udp_send(int fd, const uint8_t *addr, int64_t alen, const uint8_t *data,
                        const int64_t *lens, int64_t n, int64_t *counters) {
    tx_t *t = malloc(sizeof *t);
    if (!t) return;
    *t = (tx_t){.fd = fd, .blocking = 1, .tx = &counters[0], .full = &counters[1],
                .error = &counters[1], .syscalls = &counters[2], .gso = &counters[3]};
    for (int64_t i = 0, at = 0; i < n; at += lens[i++]) {
        gf_dgram o = {0, GF_PEER, data + at, lens[i], NULL, 0};
        tx_add(t, &o, addr, (socklen_t)alen); /* (it flushes a full batch itself) */
    }
    tx_flush(t);
    free(t);
}

typedef struct {
    uint8_t *out;
    int64_t cap, used, *lens, n, max;
} taken_t;

static int take(void *e, const uint8_t *data, int64_t len, int64_t now) {
    taken_t *k = e;
    (void)now;
    if (k->n == k->max || k->used + len > k->cap) return 0; /* full: dropped */
    memcpy(k->out + k->used, data, (size_t)len);
    k->used += len, k->lens[k->n++] = len;
    return 0;
}

/* One batch of what ``fd`` holds, cut into datagrams as the drivers cut it
 * (the engine's receive, recording): the datagrams, laid end to end in
 * ``out`` with their lengths in ``lens``; ``*coalesced``: messages that
 * carried more than one. */
GF_API int64_t gf_udp_take(int fd, uint8_t *out, int64_t cap, int64_t *lens, int64_t max,
                           int64_t *coalesced) {
    static const gf_ops OPS = {take, NULL, NULL, NULL, NULL, NULL, NULL};
    taken_t k = {out, cap, 0, lens, 0, max};
    rx_t *r = malloc(sizeof *r);
    uint8_t *rx = malloc((size_t)WBATCH_TAKE * DGRAM);
    if (r && rx) {
        int got = rx_read(r, fd, rx, WBATCH_TAKE);
        for (int i = 0; i < got; i++) rx_deliver(r, i, rx, &OPS, &k, 0, coalesced);
    }
    free(r), free(rx);
    return k.n;
}

/* ---- a worker's run (gf_udp_run) ---- */

enum { RUN_DONE = 0, RUN_ABORTED = 1, RUN_TIMEOUT = 2, RUN_FAILED = 3, RUN_ERROR = 4 };
enum { W_TX, W_RX, W_SYSCALLS, W_SOCKET_ERROR, W_GSO, W_GRO, NW }; /* net.datapath.DRIVER_COUNTERS */
#define ABORT_CHECK_NS 10000000LL /* how often a waiting run looks at its abort flag */
#define WBATCH 32

/* What the engine lets leave now, to its one peer; a full socket buffer
 * waits for room (the kernel's own pacing). */
static void send_all(const gf_ops *ops, void *e, tx_t *t, const struct sockaddr *sa,
                     socklen_t alen) {
    for (;;) {
        int64_t now = now_ns();
        const gf_dgram *out;
        int64_t n = ops->pending(e, now, &out);
        if (n > OUTBOX_MAX) n = OUTBOX_MAX;
        for (int64_t i = 0; i < n; i++) tx_add(t, &out[i], sa, alen);
        tx_flush(t);
        ops->sent(e, n, now);
        if (n < OUTBOX_MAX) return;
    }
}

/* One batch of what socket ``fd`` holds, into the engine: how many
 * messages came (0 on a socket error, counted), -1 on memory. */
static int read_batch(const gf_ops *ops, void *e, rx_t *r, int fd, uint8_t *rx, int64_t *c) {
    int got = rx_read(r, fd, rx, WBATCH);
    c[W_SYSCALLS]++;
    if (got < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) c[W_SOCKET_ERROR]++;
        return 0;
    }
    int64_t now = now_ns();
    for (int k = 0; k < got; k++) {
        int64_t n = rx_deliver(r, k, rx, ops, e, now, &c[W_GRO]);
        if (n < 0) return -1;
        c[W_RX] += n;
    }
    return got;
}

GF_API int gf_udp_run(const gf_ops *ops, void *e, int fd, int group_fd, int wake_fd,
                      const uint8_t *addr, int64_t alen, int64_t wall_deadline,
                      volatile const int32_t *abort, int quiet, int64_t *counters) {
    const struct sockaddr *sa = (const struct sockaddr *)addr;
    const socklen_t sl = (socklen_t)alen;
    const int nfds = group_fd < 0 ? 1 : 2; /* the sockets read */
    uint8_t *rx = malloc((size_t)WBATCH * DGRAM);
    tx_t *t = malloc(sizeof *t);
    rx_t *r = malloc(sizeof *r);
    int rc = RUN_DONE;
    if (!rx || !t || !r) {
        free(rx), free(t), free(r);
        return RUN_ERROR;
    }
    int64_t *c = counters;
    *t = (tx_t){.fd = fd, .blocking = 1, .tx = &c[W_TX], .full = &c[W_SOCKET_ERROR],
                .error = &c[W_SOCKET_ERROR], .syscalls = &c[W_SYSCALLS], .gso = &c[W_GSO]};
    send_all(ops, e, t, sa, sl);
    while (!ops->done(e, quiet)) {
        if (*abort) {
            rc = RUN_ABORTED;
            break;
        }
        int64_t now = now_ns();
        if (now >= wall_deadline) {
            rc = RUN_TIMEOUT;
            break;
        }
        int64_t d = ops->timer(e);
        if (d >= 0 && d <= now) {
            int r = ops->handle_timer(e, now);
            if (r) {
                rc = r > 0 ? RUN_FAILED : RUN_ERROR;
                break;
            }
            send_all(ops, e, t, sa, sl);
            continue;
        }
        int64_t wait = wall_deadline - now;
        if (d >= 0 && d - now < wait) wait = d - now;
        if (wait > ABORT_CHECK_NS) wait = ABORT_CHECK_NS;
        const int64_t every = ops->read_wait(e, now);
        if (every && wait > every) wait = every;
        struct timespec ts = {wait / 1000000000LL, wait % 1000000000LL};
        const short events = every ? 0 : POLLIN; /* on a read period: wake on it alone */
        struct pollfd p[3] = {{fd, events, 0}, {group_fd, events, 0}, {wake_fd, POLLIN, 0}};
        int ready = ppoll(p, 3, &ts, NULL); /* (a negative fd is not polled) */
        if (p[2].revents & POLLIN) {        /* the engine was given work: send it */
            uint64_t v;
            if (read(wake_fd, &v, sizeof v) < 0) c[W_SOCKET_ERROR]++;
            send_all(ops, e, t, sa, sl);
        }
        if (!every && ready <= 0) continue;
        for (int i = 0; i < nfds; i++) {
            if (!every && !p[i].revents) continue;
            int got;
            while ((got = read_batch(ops, e, r, p[i].fd, rx, counters)) == WBATCH && every) {
            } /* (a full batch on a period: more may wait) */
            if (got < 0) {
                rc = RUN_ERROR;
                goto out;
            }
        }
        send_all(ops, e, t, sa, sl);
    }
out:
    free(rx), free(t), free(r);
    return rc;
}
