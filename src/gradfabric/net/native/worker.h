/* The native worker node's state (worker.c). Not a public interface:
 * net/datapath.py calls only what worker.c exports, and reads nothing of
 * this but through those functions. */
#ifndef GF_WORKER_H
#define GF_WORKER_H

#include <stdint.h>

#include "wire.h"

enum { ROUTE_STATIC = 0, ROUTE_HASHED = 1, ROUTE_ONE = 2 };
/* a sequence's state: not sent yet, sent and waiting, answered or given up */
enum { UNSENT = 0, OUTSTANDING = 1, SETTLED = 2 };
/* counter indices (net.datapath.COUNTERS names them): proto.worker's and
 * the envelope's, as WorkerNode counts them */
enum {
    C_RESULTS, C_RETRANSMITS, C_FAST, C_DUPLICATE, C_FOREIGN, C_HALVINGS, C_MALFORMED,
    C_BAD_TOKEN, C_REARMED, C_NACK_RESENDS, C_STALE_NACK, C_REPLAYS, C_REPLAY_ANSWERED,
    C_REPLAYS_RETIRED,
    NCOUNTERS
};
#define OUTBOX 64 /* datagrams handed to the driver at a time */

typedef void (*encode_fn)(const float *, int64_t, int64_t, const double *, int32_t *);
typedef void (*decode_fn)(const int64_t *, int64_t, int64_t, const double *, float *);

typedef struct {
    /* the job (gf_w_new), as proto.worker.WorkerConfig and the route say */
    int64_t job, worker, fan_in, route, slot_base, slot_count, pool_slots, resend_flag, rto_ns,
        max_retries, fast_k, ecn_window, vpp, nack, keep;
    uint64_t bitmap;
    double max_cwnd, ns_per_byte;
    uint8_t token[TOKEN];
    int64_t priority;
    /* the protocol's state (proto.worker.WorkerEngine, ResumableWorker) */
    int64_t base, next, end, highest, fast_seq, fast_from, recover_seq, sent_high;
    double cwnd;
    int64_t replaying;   /* sequences being replayed */
    int64_t outstanding; /* sequences OUTSTANDING (kept with every change of state) */
    /* the sequences tracked, [lo, end): the last ``keep`` of the previous call
     * (their values copied into ``prev``), then the call's */
    int64_t lo, first, cap;
    uint8_t *st, *dlv, *rep; /* state; delivered (below base or done above); replaying */
    int64_t *deadline, *tries;
    int32_t *prev;          /* keep packets' values */
    int64_t *prev_count;    /* and their counts */
    int64_t prev_priority;  /* the priority they were sent with */
    /* the call (gf_w_push): the caller's arrays */
    int64_t nvalues, call_priority;
    int32_t *q;
    int64_t *out;
    const float *x; /* the fused quantiser (NULL: off) */
    const double *enc_scale, *dec_scale;
    float *outf;
    encode_fn enc;
    decode_fn dec;
    int64_t fail_seq, error_seq, error_kind;
    int64_t counters[NCOUNTERS];
    /* retransmission deadlines, pairs (deadline, seq), a FIFO (one RTO: sorted) */
    int64_t *fifo, fifo_cap, fifo_head, fifo_len;
    /* what waits to leave, pairs (seq, flags): a FIFO, resends at its front when paced */
    int64_t *txq, txq_cap, txq_head, txq_len;
    int64_t next_tx; /* when the paced queue may send next */
    int64_t repairs, repairing_until;
    gf_dgram out_dgrams[OUTBOX];
    uint8_t heads[OUTBOX][TOKEN + HEADER];
    int oom;
} gf_worker;

#endif
