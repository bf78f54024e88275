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
 * sends what the engine lets leave. net.driver's ``run`` is the same loop in
 * Python, for the reference engine.
 *
 * gf_udp_drain is the switch daemon's: the daemon's event loop calls it when
 * its socket is readable; it reads up to a few batches, hands each datagram
 * to the engine, and after each batch sends what the engine has to send,
 * each to its job's rank (GF_ALL: the job's multicast group if it has one,
 * else every worker with an address). The Python daemon (emu.switchd) does
 * the same with one datagram at a time, so the engine cannot tell them
 * apart. A rank without an address is drop_no_address; a full socket
 * buffer is a loss the workers recover (drop_tx_full), as the reference's
 * non-blocking sendto.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "wire.h"

#define BATCH 64
#define BOOK_JOBS 65536
#define OUTBOX_MAX 64 /* the most an engine hands over at a time (worker.h's OUTBOX) */

/* the driver's counters, in net.udpdriver's order */
enum { U_TX, U_TX_FULL, U_SOCKET_ERROR, U_NO_ADDRESS, U_SYSCALLS, U_NO_MEMORY, NU };

typedef struct {
    int64_t workers;
    struct sockaddr_storage addr[MAX_FAN_IN], group;
    socklen_t alen[MAX_FAN_IN], glen; /* 0: none */
} entry_t;

typedef struct {
    entry_t *jobs[BOOK_JOBS];
    int64_t counters[NU];
    uint8_t *rx; /* BATCH datagrams */
} gf_book;

GF_API const char *gf_source(void) { return GRADFABRIC_SOURCE; }

GF_API gf_book *gf_book_new(void) {
    gf_book *b = calloc(1, sizeof *b);
    if (b && !(b->rx = malloc((size_t)BATCH * DGRAM))) {
        free(b);
        return NULL;
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

typedef struct {
    gf_book *b;
    int fd, n;
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH][2];
} send_t;

static void send_now(send_t *t) {
    int at = 0;
    while (at < t->n) {
        int sent = sendmmsg(t->fd, t->msgs + at, (unsigned)(t->n - at), MSG_DONTWAIT);
        t->b->counters[U_SYSCALLS]++;
        if (sent > 0) {
            t->b->counters[U_TX] += sent;
            at += sent;
        } else if (errno == EINTR) {
            continue;
        } else { /* the first message failed: a full buffer is a loss the workers recover */
            int full = errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS;
            t->b->counters[full ? U_TX_FULL : U_SOCKET_ERROR]++;
            at++;
        }
    }
    t->n = 0;
}

static void send_to(send_t *t, const gf_dgram *o, const struct sockaddr_storage *to, socklen_t len) {
    if (t->n == BATCH) send_now(t);
    struct mmsghdr *m = &t->msgs[t->n];
    t->iov[t->n][0] = (struct iovec){(void *)o->head, (size_t)o->head_len};
    t->iov[t->n][1] = (struct iovec){(void *)o->body, (size_t)o->body_len};
    memset(m, 0, sizeof *m);
    m->msg_hdr.msg_name = (void *)to;
    m->msg_hdr.msg_namelen = len;
    m->msg_hdr.msg_iov = t->iov[t->n];
    m->msg_hdr.msg_iovlen = o->body_len ? 2 : 1;
    t->n++;
}

/* Everything the engine has to send, each to where the book says. */
static void flush(const gf_ops *ops, void *engine, send_t *t, int64_t now) {
    const gf_dgram *out;
    int64_t n = ops->pending(engine, now, &out);
    for (int64_t i = 0; i < n; i++) {
        const gf_dgram *o = &out[i];
        const entry_t *e = o->job >= 0 && o->job < BOOK_JOBS ? t->b->jobs[o->job] : NULL;
        if (e && o->rank == GF_ALL && e->glen) {
            send_to(t, o, &e->group, e->glen);
            continue;
        }
        if (!e || o->rank >= MAX_FAN_IN || o->rank < GF_ALL) {
            t->b->counters[U_NO_ADDRESS]++;
            continue;
        }
        int64_t lo = o->rank < 0 ? 0 : o->rank, hi = o->rank < 0 ? e->workers : o->rank + 1;
        for (int64_t r = lo; r < hi; r++) {
            if (e->alen[r])
                send_to(t, o, &e->addr[r], e->alen[r]);
            else
                t->b->counters[U_NO_ADDRESS]++;
        }
    }
    send_now(t); /* (the datagrams point into the engine's outbox until ``sent``) */
    ops->sent(engine, n, now);
}

/* The event loop's callback for a readable socket: up to ``batches`` reads of
 * BATCH datagrams, each batch's answers sent before the next read. Returns
 * the datagrams read. Each rank a datagram should reach and that has no
 * address is counted (drop_no_address). */
GF_API int64_t gf_udp_drain(const gf_ops *ops, void *engine, gf_book *b, int fd, int64_t batches) {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    int64_t total = 0;
    send_t *t = malloc(sizeof *t);
    if (!t) return 0;
    t->b = b, t->fd = fd, t->n = 0;
    for (int64_t k = 0; k < batches; k++) {
        for (int i = 0; i < BATCH; i++) {
            iov[i] = (struct iovec){b->rx + (size_t)i * DGRAM, DGRAM};
            memset(&msgs[i], 0, sizeof msgs[i]);
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
        }
        int got = recvmmsg(fd, msgs, BATCH, MSG_DONTWAIT, NULL);
        b->counters[U_SYSCALLS]++;
        if (got <= 0) {
            if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                b->counters[U_SOCKET_ERROR]++;
            break;
        }
        int64_t now = now_ns();
        for (int i = 0; i < got; i++) {
            int64_t n = (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) ? DGRAM + 1 : msgs[i].msg_len;
            if (ops->receive(engine, b->rx + (size_t)i * DGRAM, n, now)) b->counters[U_NO_MEMORY]++;
        }
        flush(ops, engine, t, now);
        total += got;
        if (got < BATCH) break;
    }
    free(t);
    return total;
}

/* ---- a worker's run (gf_udp_run) ---- */

enum { RUN_DONE = 0, RUN_ABORTED = 1, RUN_TIMEOUT = 2, RUN_FAILED = 3, RUN_ERROR = 4 };
enum { W_TX, W_RX, W_SYSCALLS, W_SOCKET_ERROR, NW }; /* net.driver.DRIVER_COUNTERS */
#define ABORT_CHECK_NS 10000000LL /* how often a waiting run looks at its abort flag */
#define WBATCH 32

/* What the engine lets leave now, to its one peer; a full socket buffer
 * waits for room (the kernel's own pacing). */
static void send_all(const gf_ops *ops, void *e, int fd, const struct sockaddr *sa, socklen_t alen,
                     int64_t *c) {
    struct mmsghdr msgs[OUTBOX_MAX];
    struct iovec iov[OUTBOX_MAX][2];
    for (;;) {
        int64_t now = now_ns();
        const gf_dgram *out;
        int64_t n = ops->pending(e, now, &out), at = 0;
        if (n > OUTBOX_MAX) n = OUTBOX_MAX;
        for (int64_t i = 0; i < n; i++) {
            iov[i][0] = (struct iovec){(void *)out[i].head, (size_t)out[i].head_len};
            iov[i][1] = (struct iovec){(void *)out[i].body, (size_t)out[i].body_len};
            memset(&msgs[i], 0, sizeof msgs[i]);
            msgs[i].msg_hdr.msg_name = (void *)sa;
            msgs[i].msg_hdr.msg_namelen = alen;
            msgs[i].msg_hdr.msg_iov = iov[i];
            msgs[i].msg_hdr.msg_iovlen = out[i].body_len ? 2 : 1;
        }
        while (at < n) {
            int sent = sendmmsg(fd, msgs + at, (unsigned)(n - at), 0);
            c[W_SYSCALLS]++;
            if (sent > 0) {
                c[W_TX] += sent;
                at += sent;
            } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) {
                struct pollfd p = {fd, POLLOUT, 0};
                poll(&p, 1, 1);
            } else if (errno != EINTR) {
                c[W_SOCKET_ERROR]++; /* that datagram is lost: the protocol repairs it */
                at++;
            }
        }
        ops->sent(e, n, now);
        if (n < OUTBOX_MAX) return;
    }
}

/* One batch of what socket ``fd`` holds, into the engine: how many came (0
 * on a socket error, counted), -1 on memory. */
static int read_batch(const gf_ops *ops, void *e, int fd, uint8_t *rx, int64_t *c) {
    struct mmsghdr msgs[WBATCH];
    struct iovec iov[WBATCH];
    for (int k = 0; k < WBATCH; k++) {
        iov[k] = (struct iovec){rx + (size_t)k * DGRAM, DGRAM};
        memset(&msgs[k], 0, sizeof msgs[k]);
        msgs[k].msg_hdr.msg_iov = &iov[k];
        msgs[k].msg_hdr.msg_iovlen = 1;
    }
    int got = recvmmsg(fd, msgs, WBATCH, MSG_DONTWAIT, NULL);
    c[W_SYSCALLS]++;
    if (got < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) c[W_SOCKET_ERROR]++;
        return 0;
    }
    int64_t now = now_ns();
    c[W_RX] += got;
    for (int k = 0; k < got; k++) {
        int64_t n = (msgs[k].msg_hdr.msg_flags & MSG_TRUNC) ? DGRAM + 1 : msgs[k].msg_len;
        if (ops->receive(e, rx + (size_t)k * DGRAM, n, now)) return -1;
    }
    return got;
}

GF_API int gf_udp_run(const gf_ops *ops, void *e, int fd, int group_fd, const uint8_t *addr,
                      int64_t alen, int64_t wall_deadline, volatile const int32_t *abort,
                      int quiet, int64_t *counters) {
    const struct sockaddr *sa = (const struct sockaddr *)addr;
    const int nfds = group_fd < 0 ? 1 : 2;
    uint8_t *rx = malloc((size_t)WBATCH * DGRAM);
    int rc = RUN_DONE;
    if (!rx) return RUN_ERROR;
    send_all(ops, e, fd, sa, (socklen_t)alen, counters);
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
            send_all(ops, e, fd, sa, (socklen_t)alen, counters);
            continue;
        }
        int64_t wait = wall_deadline - now;
        if (d >= 0 && d - now < wait) wait = d - now;
        if (wait > ABORT_CHECK_NS) wait = ABORT_CHECK_NS;
        const int64_t every = ops->read_wait(e, now);
        if (every && wait > every) wait = every;
        struct timespec ts = {wait / 1000000000LL, wait % 1000000000LL};
        const short events = every ? 0 : POLLIN; /* on a read period: wake on it alone */
        struct pollfd p[2] = {{fd, events, 0}, {group_fd, events, 0}};
        int ready = ppoll(p, (nfds_t)nfds, &ts, NULL);
        if (!every && ready <= 0) continue;
        for (int i = 0; i < nfds; i++) {
            if (!every && !p[i].revents) continue;
            int got;
            while ((got = read_batch(ops, e, p[i].fd, rx, counters)) == WBATCH && every) {
            } /* (a full batch on a period: more may wait) */
            if (got < 0) {
                rc = RUN_ERROR;
                goto out;
            }
        }
        send_all(ops, e, fd, sa, (socklen_t)alen, counters);
    }
out:
    free(rx);
    return rc;
}
