/* The op stream every harness here reads (tests/property/test_corpus.py
 * reads the same bytes, and drives the Python reference and the native core
 * with them side by side).
 *
 *     input := config op*
 *     op    := kind:u8 len:u16le payload[len]
 *
 * A harness takes its config from the first bytes (missing bytes read as
 * 0) and then each op in turn; a truncated op ends the input. Every job's
 * token is its id eight times, so the fuzzer's mutations of a valid
 * datagram keep reaching the engines past the token check.
 */
#ifndef GF_FUZZ_OPS_H
#define GF_FUZZ_OPS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const uint8_t *data;
    size_t size, at;
} reader;

static inline uint8_t rd_u8(reader *r) { return r->at < r->size ? r->data[r->at++] : 0; }

/* The next op: its kind, payload and length; 0 at the end. */
static inline int next_op(reader *r, uint8_t *kind, const uint8_t **payload, size_t *len) {
    if (r->at + 3 > r->size) return 0;
    *kind = r->data[r->at];
    size_t n = (size_t)r->data[r->at + 1] | (size_t)r->data[r->at + 2] << 8;
    r->at += 3;
    if (n > r->size - r->at) n = r->size - r->at;
    *payload = r->data + r->at, *len = n;
    r->at += n;
    return 1;
}

static inline uint32_t le32(const uint8_t *p, size_t len) {
    uint32_t v = 0;
    memcpy(&v, p, len < 4 ? len : 4);
    return v;
}

#endif
