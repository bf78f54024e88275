/* The native switch node's parts (switch_node.c, switch_pool.c, switch_ps.c):
 * the types they share and what each offers the others. Not a public
 * interface: net/switchpath.py calls only what switch_node.c exports. */
#ifndef GF_SWITCH_H
#define GF_SWITCH_H

#include <stdint.h>
#include <stdlib.h>

#include "wire.h"

#define NACK_GAP 1  /* proto.switch.switchml.NACK_GAP */
#define OUTBOX_CAP 4096 /* proto.node.OUTBOX_CAP: datagrams waiting for the driver */
#define LINK_HOLD 16384 /* proto.node.LINK_HOLD: packets the modelled links hold */
#define PENDING_WINDOWS 4 /* proto.ps.PENDING_WINDOWS: merges under way, in windows */
#define MAX_JOBS 65536
#define INT32_MAX_ 2147483647LL
#define IP_UDP 28 /* proto.node.IP_UDP_BYTES: what a modelled link carries besides the datagram */
enum { UP, DOWN }; /* proto.node's: a modelled link's ways, out of its server and into it */

enum { P_SWITCHML, P_ATP, P_ESA, P_PS, P_DLCP }; /* the scheme, as gf_s_new takes it */
enum { IDLE, AGGREGATING, FORWARDED, COMPLETE }; /* SwitchML's copies */
enum { FREE, HELD, DONE };                       /* ATP's aggregators: FREE, AGGREGATING, COMPLETE */
/* counter indices (net.switchpath names them): the node's, the switch
 * engine's, then ATP's and ESA's */
enum {
    N_RX, N_UNKNOWN_JOB, N_MALFORMED,
    E_RX_GRADIENT, E_RX_HELP, E_BAD_WORKER, E_BAD_RESULT, E_BAD_SLOT, E_FLOAT, E_STALE,
    E_DUPLICATE, E_RETX_ANSWERED, E_COUNT_MISMATCH, E_STALE_RESULT, E_NACK_SENT,
    E_PS_OVERFLOW, E_PS_RESEND, E_FLUSH_PARTIAL, E_PS_COLLISION, E_LATE, E_STALE_RECLAIMED,
    E_RECLAIMED_COMPLETE, E_PREEMPTIONS, E_HELP_REQUESTS, N_OUTBOX_FULL, N_LINK_FULL,
    N_BG_DELIVERED, NCOUNTERS
};
/* a job's own: the datagrams that named it, then its parameter server's */
enum {
    J_RX, J_BAD_TOKEN, J_MALFORMED, J_RESYNCING,
    S_MERGED, S_RESEND_ANSWERED, S_BAD_PACKET, S_STALE, S_LATE_PARTIAL, S_DUPLICATE, S_OVERLAP,
    S_COUNT_MISMATCH, S_PENDING_FULL, S_SUPERSEDED,
    NJOB
};

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

/* SA-ATP's straggler monitor (switch_help.c) */
enum { HELP_MOST_AHEAD, HELP_NEXT_HOLDER }; /* the helper policy, as gf_s_help takes it */
typedef struct {
    int64_t s, it, count, lead, helper;
} ask_t;
typedef struct {
    int64_t s, it;
} hkey_t;
typedef struct help_t help_t;

/* DLCP's server (switch_dlcp.c); its counters, in net.switchpath's order
 * (D_LATE: late_values_p0 to p15, by drop precedence) */
typedef struct dlcp_t dlcp_t;
enum {
    D_FOREIGN, D_MALFORMED, D_DUPLICATE, D_PROBES_ANSWERED, D_COMPLETED, D_VALUES_LOST, D_NACKS,
    D_PACKETS, D_RESENT_RANGES, D_PROBES, D_MISMATCH, D_INCOMPLETE, D_SUMS, D_TOO_LONG, D_LATE,
    ND = D_LATE + 16
};

typedef struct {
    uint8_t token[TOKEN];
    int64_t id, fan_in, slot_base, slot_count, resync;
    int64_t window, newest; /* ATP: the switch job's window; the newest result's seq (-1) */
    int64_t largest;        /* the largest sequence a datagram of the job named (-1: none) */
    int64_t *link_free;     /* ATP's PS behind modelled links: when each shard's way is free */
    help_t *help;           /* SA-ATP's straggler monitor (NULL: the job asked for none) */
    dlcp_t *dlcp;           /* DLCP's server (NULL: none, or a background job's datagrams) */
    ps_t ps;
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
    int64_t resends; /* of its key since it completed, mod fan_in */
    uint64_t bitmap;
    int32_t *values;
} agg_t;

/* a packet between hosted engines: to job ``job``'s PS, or to the switch */
typedef struct {
    int64_t job, to_ps, len, seq; /* (the wire carries 32 bits of ``seq``) */
    uint8_t *raw;
} msg_t;

/* a packet on a modelled link: it arrives at ``at`` (``n``: the order it left in) */
typedef struct {
    int64_t at, n;
    msg_t m;
} held_t;

typedef struct {
    int64_t slots, policy;
    copy_t *copies; /* SwitchML: 2 per slot */
    agg_t *pool;    /* ATP, ESA */
    job_t *jobs[MAX_JOBS];
    int64_t counters[NCOUNTERS];
    int64_t busy_ns, held_ns, claims; /* proto.switch.engine.PoolStats */
    gf_dgram *out;                    /* the outbox: datagrams for the driver */
    int64_t nout, capout;
    msg_t *work; /* SwitchNode's queue between hosted engines */
    int64_t nwork, capwork;
    double link_ns_per_byte; /* ATP's and ESA's PS behind modelled links (0: none) */
    held_t *held;            /* what the links hold, a heap on (at, n) */
    int64_t nheld, capheld, nsent;
    int64_t *dlcp_jobs; /* DLCP: the jobs with a server, in the order they were added */
    int64_t ndlcp;
    int64_t now; /* the time of the datagram or timer being handled */
    int oom; /* a datagram was lost to memory: the driver reports it */
} gf_switch;

/* switch_node.c: what the engines send */
uint8_t *sw_reserve(gf_switch *s, const job_t *j, int64_t rank, int64_t len);
void sw_emit(gf_switch *s, const job_t *j, int64_t rank, const uint8_t *raw, int64_t len);
uint8_t *sw_enqueue(gf_switch *s, int64_t job, int to_ps, int64_t len, int64_t seq);

/* switch_pool.c: the switch engine (SwitchEngine's checks, then the policy) */
void pool_packet(gf_switch *s, job_t *j, const gf_pkt *p, int64_t now);
void pool_clear_range(gf_switch *s, int64_t base, int64_t count);
void pool_forget(gf_switch *s, int64_t job);
uint64_t pool_missing(const gf_switch *s, const job_t *j);

/* switch_help.c: SA-ATP's straggler monitor (proto.switch.straggler) */
help_t *help_new(int64_t fan_in, int64_t lag, int64_t replicas, int64_t max_requests,
                 int64_t it_len, int64_t policy);
void help_free(help_t *h);
void help_observe(gf_switch *s, const job_t *j, const gf_pkt *p);

/* switch_ps.c: a job's parameter server (proto.ps) */
void ps_packet(gf_switch *s, job_t *j, const gf_pkt *p);
void ps_clear(ps_t *ps);
uint64_t ps_missing(const job_t *j);

/* switch_dlcp.c: a DLCP job's server (proto.dlcp.DlcpServer) */
dlcp_t *dlcp_new(int64_t workers, double bound, int64_t per_packet, int64_t rto,
                 int64_t max_values);
void dlcp_free(dlcp_t *d);
int64_t *dlcp_counters(dlcp_t *d);
void dlcp_packet(gf_switch *s, job_t *j, const gf_pkt *p, int64_t now);
int64_t dlcp_deadline(const dlcp_t *d);
void dlcp_timer(gf_switch *s, job_t *j, int64_t now);
uint64_t dlcp_missing(const job_t *j);


#endif
