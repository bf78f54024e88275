/* SA-ATP at the native switch: proto.switch.straggler's StragglerMonitor in C
 * (its module doc is the theory of operation), with its registered detector
 * (progress-gap) and helper policies (most-ahead, next-holder).
 *
 * The reference keeps every (straggler, iteration) it asked about or saw help
 * for; only those of the leaders' iteration and later are ever looked at
 * again (the leaders' progress never falls), so here the older ones are
 * dropped as the leaders move on, and at most HELP_KEYS of each are kept (a
 * token holder's HELP packets naming ever new iterations cannot grow the
 * switch's memory; the reference would keep them all). */
#define _GNU_SOURCE
#include "switch.h"

#include <string.h>

#define HELP_KEYS 4096

struct help_t {
    int64_t lag, replicas, max_requests, it_len, policy;
    int64_t *progress; /* per worker: the highest sequence it sent (-1) */
    int64_t *helping;  /* per worker: the iteration it last helped in (-1) */
    ask_t *asked;      /* (straggler, iteration): requests, the leader then, the helper */
    int64_t nasked;
    hkey_t *seen; /* (straggler, iteration) some HELP packet arrived for */
    int64_t nseen;
};

help_t *help_new(int64_t fan_in, int64_t lag, int64_t replicas, int64_t max_requests,
                 int64_t it_len, int64_t policy) {
    help_t *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    *h = (help_t){lag, replicas, max_requests, it_len, policy, NULL, NULL, NULL, 0, NULL, 0};
    h->progress = malloc((size_t)fan_in * sizeof(int64_t));
    h->helping = malloc((size_t)fan_in * sizeof(int64_t));
    h->asked = malloc(HELP_KEYS * sizeof(ask_t));
    h->seen = malloc(HELP_KEYS * sizeof(hkey_t));
    if (!h->progress || !h->helping || !h->asked || !h->seen) {
        help_free(h);
        return NULL;
    }
    for (int64_t i = 0; i < fan_in; i++) h->progress[i] = h->helping[i] = -1;
    return h;
}

void help_free(help_t *h) {
    if (!h) return;
    free(h->progress), free(h->helping), free(h->asked), free(h->seen), free(h);
}

static int seen(const help_t *h, int64_t s, int64_t it) {
    for (int64_t i = 0; i < h->nseen; i++)
        if (h->seen[i].s == s && h->seen[i].it == it) return 1;
    return 0;
}

static ask_t *asked(help_t *h, int64_t s, int64_t it) {
    for (int64_t i = 0; i < h->nasked; i++)
        if (h->asked[i].s == s && h->asked[i].it == it) return &h->asked[i];
    return NULL;
}

/* Forget what concerns iterations before ``it`` (never looked at again). */
static void forget_before(help_t *h, int64_t it) {
    int64_t k = 0;
    for (int64_t i = 0; i < h->nasked; i++)
        if (h->asked[i].it >= it) h->asked[k++] = h->asked[i];
    h->nasked = k, k = 0;
    for (int64_t i = 0; i < h->nseen; i++)
        if (h->seen[i].it >= it) h->seen[k++] = h->seen[i];
    h->nseen = k;
}

/* holders(): worker ``s``'s shard is replicated on s+1 .. s+replicas, mod n
 * (in that order, repeats included, ``s`` itself left out); the helper
 * policies over ``cand`` (progress, -1 for a worker busy helping). */
static int64_t choose(const help_t *h, int64_t s, const int64_t *cand, int64_t n) {
    int64_t best = -1;
    for (int64_t k = 1; k <= h->replicas && k <= n; k++) { /* (past n: the same holders again) */
        int64_t w = (s + k) % n;
        if (w == s) continue;
        if (h->policy == HELP_NEXT_HOLDER) {
            if (cand[w] > cand[s]) return w;
        } else if (best < 0 || cand[w] > cand[best] || (cand[w] == cand[best] && w < best)) {
            best = w; /* most-ahead: max by (progress, -w) */
        }
    }
    return best >= 0 && cand[best] > cand[s] ? best : -1;
}

static void notify(gf_switch *s, const job_t *j, int64_t helper, int64_t straggler, int64_t start) {
    uint8_t *d = sw_reserve(s, j, helper, HEADER);
    if (d) gf_header(d, 0, F_NOTIFY, j->id, straggler, j->fan_in, 0, start, 0, 1ULL << straggler);
}

/* StragglerMonitor.observe: after the policy took the gradient packet ``p``. */
void help_observe(gf_switch *s, const job_t *j, const gf_pkt *p) {
    help_t *h = j->help;
    const int64_t n = j->fan_in, L = h->it_len;
    if (p->flags & F_HELP) {
        int64_t st = 63 - __builtin_clzll(p->bitmap); /* (one bit: checked before) */
        if (!seen(h, st, p->seq / L) && h->nseen < HELP_KEYS)
            h->seen[h->nseen++] = (hkey_t){st, p->seq / L};
        h->helping[p->wid] = p->seq / L;
        return;
    }
    if (p->seq > h->progress[p->wid]) h->progress[p->wid] = p->seq;
    int64_t lead = -1;
    for (int64_t i = 0; i < n; i++)
        if (h->progress[i] > lead) lead = h->progress[i];
    const int64_t lead_it = lead / L; /* (lead >= 0: this packet's worker sent one) */
    forget_before(h, lead_it);
    /* progress-gap on the view where a helper of the leaders' iteration is
     * level with the leader (it lags because it sends two shares) */
    int64_t slow = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = h->helping[i] == lead_it ? lead : h->progress[i];
        int64_t vs = h->helping[slow] == lead_it ? lead : h->progress[slow];
        if (v < vs) slow = i;
    }
    int64_t vs = h->helping[slow] == lead_it ? lead : h->progress[slow];
    if (lead - vs < h->lag) return;
    int64_t start = h->progress[slow] + 1;
    if (start < lead_it * L) start = lead_it * L;
    const int64_t it = start / L;
    if (seen(h, slow, it)) return;
    ask_t *prev = asked(h, slow, it);
    int64_t helper;
    if (!prev) {
        int64_t cand[MAX_FAN_IN];
        memcpy(cand, h->progress, (size_t)n * sizeof *cand);
        for (int64_t i = 0; i < h->nasked; i++) /* busy: asked to help in this iteration */
            if (h->asked[i].it == it) cand[h->asked[i].helper] = -1;
        helper = choose(h, slow, cand, n);
        if (helper < 0 || h->nasked >= HELP_KEYS) return;
        h->asked[h->nasked++] = (ask_t){slow, it, 1, lead, helper};
    } else { /* a retry (the NOTIFY may be lost) goes to the same helper */
        if (prev->count >= h->max_requests || lead - prev->lead < h->lag) return;
        prev->count++, prev->lead = lead;
        helper = prev->helper;
    }
    s->counters[E_HELP_REQUESTS]++;
    notify(s, j, helper, slow, start);
}
