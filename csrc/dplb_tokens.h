/* dplb_tokens.h: a prompt's token blocks and their chained keys, native (the engines' KV-cache
 * events path: router/kv_events.py, epp/events.py).
 *
 * - The word tokenizer of the simulated engine (sim_engine/tokenizer.py) over the router's prompt
 *   text: one token per whitespace-separated word (Python's whitespace, Py_UNICODE_ISSPACE), id
 *   crc32(UTF-8 of the word) mod vocab_size (zlib's CRC-32, polynomial 0xEDB88320, computed
 *   slice-by-8: Kounavis and Berry, "A Systematic Approach to Building High Performance,
 *   Software-based, CRC Generators", ISCC 2005); in chat mode the router's text (``role:content``
 *   per message, one per line) is rendered as the engine's chat template: ``<|role|> words
 *   <|eot|>`` per message, then ``<|assistant|>``.
 * - The chained key of a block of token ids: CPython's hash of the tuple ``(parent key, *ids)``
 *   (the xxHash-derived tuple hash of Objects/tupleobject.c, CPython 3.8 and later, over the
 *   hashes of ints: Python/pyhash.c's reduction modulo 2**61 - 1), so a key computed here equals
 *   ``hash((parent, *ids))`` in Python bit for bit, in every process (ints hash without a seed).
 *
 * The bit-identical pure-Python reference is dplb_prefix/reference.py (words, token_ids,
 * token_keys); the equivalence test tests/csrc/test_tokens_equiv.py.
 */
#ifndef DPLB_TOKENS_H
#define DPLB_TOKENS_H

#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* CPython's tuple hash constants (Objects/tupleobject.c, 64-bit Py_uhash_t) */
#define DPLB_XXPRIME_1 11400714785074694791ULL
#define DPLB_XXPRIME_2 14029467366897019727ULL
#define DPLB_XXPRIME_5 2870177450012600261ULL
/* hash of ints: modulo 2**61 - 1 (Python/pyhash.c, _PyHASH_MODULUS) */
#define DPLB_HASH_MODULUS ((1ULL << 61) - 1)

/* hash() of a Python int in [-2**63, 2**63) */
static inline uint64_t dplb_int_hash(int64_t v)
{
    uint64_t a = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    int64_t h;
    if (a >= DPLB_HASH_MODULUS)
        a %= DPLB_HASH_MODULUS;
    h = v < 0 ? -(int64_t)a : (int64_t)a;
    if (h == -1)
        h = -2;
    return (uint64_t)h;
}

static inline uint64_t dplb_tuple_lane(uint64_t acc, uint64_t lane)
{
    acc += lane * DPLB_XXPRIME_2;
    acc = (acc << 31) | (acc >> 33);
    return acc * DPLB_XXPRIME_1;
}

static inline int64_t dplb_tuple_finish(uint64_t acc, Py_ssize_t len)
{
    acc += (uint64_t)len ^ (DPLB_XXPRIME_5 ^ 3527539ULL);
    if (acc == (uint64_t)-1)
        return 1546275796;
    return (int64_t)acc;
}

/* CRC-32 (zlib's) tables, slice-by-8; filled once by dplb_crc_init */
static uint32_t dplb_crc_table[8][256];
/* dplb_crc_pad[h]: the register that 8 - h zero bytes turn into the initial 0xFFFFFFFF, so a word
 * of h <= 8 bytes is one slice-by-8 step: its bytes after 8 - h zero bytes, from dplb_crc_pad[h]
 * (no loop whose length depends on the word, so no mispredicted branch per word) */
static uint32_t dplb_crc_pad[9];
/* the same for 16-byte blocks (the carry-less multiply path): 16 - h zero bytes to 0xFFFFFFFF */
static uint32_t dplb_crc_pad16[17];
/* whether this CPU has POPCNT, BMI1, PCLMULQDQ and SSE4.1 (set by dplb_crc_init) */
static int dplb_has_fast;
/* 1: the portable path even where the CPU has those (tests compare both) */
static int dplb_fast_off;

static void dplb_crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        dplb_crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            dplb_crc_table[t][i] = (dplb_crc_table[t - 1][i] >> 8) ^ dplb_crc_table[0][dplb_crc_table[t - 1][i] & 0xff];
    /* a zero byte maps the register S to T0[S & 0xff] ^ (S >> 8); the top bytes of T0's entries
     * are distinct, so the step inverts: the entry is found by the new register's top byte */
    uint8_t rev[256];
    for (uint32_t i = 0; i < 256; i++)
        rev[dplb_crc_table[0][i] >> 24] = (uint8_t)i;
    dplb_crc_pad16[16] = 0xFFFFFFFFu;
    for (int h = 15; h >= 0; h--) {
        uint32_t s = dplb_crc_pad16[h + 1];
        uint8_t i = rev[s >> 24];
        dplb_crc_pad16[h] = ((s ^ dplb_crc_table[0][i]) << 8) | i;
    }
    memcpy(dplb_crc_pad, dplb_crc_pad16 + 8, sizeof dplb_crc_pad);
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    dplb_has_fast = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1") &&
                    __builtin_cpu_supports("popcnt") && __builtin_cpu_supports("bmi");
#endif
}

/* the running CRC ``c`` (pre-inverted) over n bytes */
static inline uint32_t dplb_crc_bytes(uint32_t c, const uint8_t *p, Py_ssize_t n)
{
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        lo = __builtin_bswap32(lo);
        hi = __builtin_bswap32(hi);
#endif
        lo ^= c;
        c = dplb_crc_table[7][lo & 0xff] ^ dplb_crc_table[6][(lo >> 8) & 0xff] ^
            dplb_crc_table[5][(lo >> 16) & 0xff] ^ dplb_crc_table[4][lo >> 24] ^
            dplb_crc_table[3][hi & 0xff] ^ dplb_crc_table[2][(hi >> 8) & 0xff] ^
            dplb_crc_table[1][(hi >> 16) & 0xff] ^ dplb_crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n-- > 0)
        c = dplb_crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

/* the running CRC over the UTF-8 encoding of one code point; -1 in *bad for a surrogate (which
 * str.encode() refuses) */
static inline uint32_t dplb_crc_cp(uint32_t c, Py_UCS4 cp, int *bad)
{
    uint8_t b[4];
    Py_ssize_t n;
    if (cp < 0x80) {
        return dplb_crc_table[0][(c ^ cp) & 0xff] ^ (c >> 8);
    } else if (cp < 0x800) {
        b[0] = (uint8_t)(0xC0 | (cp >> 6));
        b[1] = (uint8_t)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        if (cp >= 0xD800 && cp <= 0xDFFF)
            *bad = 1;
        b[0] = (uint8_t)(0xE0 | (cp >> 12));
        b[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        b[2] = (uint8_t)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        b[0] = (uint8_t)(0xF0 | (cp >> 18));
        b[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
        b[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        b[3] = (uint8_t)(0x80 | (cp & 0x3F));
        n = 4;
    }
    return dplb_crc_bytes(c, b, n);
}

/* The tokens of a prompt as they are produced: ids kept (optional) and full blocks' keys chained.
 * ``x % vocab`` for 32-bit x is computed as Lemire's fastmod (``m = 2**64 / vocab`` rounded up:
 * Lemire, Kaser and Kurz, "Faster Remainder by Direct Computation", 2019), exact for 32-bit x. */
typedef struct {
    uint32_t vocab;
    uint64_t fastmod;
    Py_ssize_t block_size;   /* 0: no keys */
    uint64_t acc;            /* the current block's tuple-hash accumulator */
    Py_ssize_t in_block;
    int64_t parent;
    Py_ssize_t n;            /* tokens so far */
    int keep_ids;            /* 0: ids not kept (counted only) */
    uint32_t *ids;
    Py_ssize_t ids_cap;
    int64_t *keys;
    Py_ssize_t keys_n, keys_cap;
    int oom;
    int open_end;            /* 1: a prefix of the prompt (resumed later): no closing literals */
} dplb_tok;

static inline uint32_t dplb_mod(const dplb_tok *t, uint32_t x)
{
    uint64_t low = t->fastmod * x;
    return (uint32_t)(((__uint128_t)low * t->vocab) >> 64);
}

static int dplb_grow(void **p, Py_ssize_t *cap, Py_ssize_t need, size_t item)
{
    Py_ssize_t c = *cap ? *cap : 1024;
    void *q;
    while (c < need)
        c *= 2;
    q = realloc(*p, (size_t)c * item);
    if (q == NULL)
        return -1;
    *p = q;
    *cap = c;
    return 0;
}

/* one token id: kept, and chained into the current block's key */
static inline void dplb_tok_id(dplb_tok *t, uint32_t id)
{
    if (t->keep_ids) {
        if (t->n >= t->ids_cap && dplb_grow((void **)&t->ids, &t->ids_cap, t->n + 1, sizeof(uint32_t)) < 0) {
            t->oom = 1;
            return;
        }
        t->ids[t->n] = id;
    }
    t->n++;
    if (t->block_size > 0) {
        if (t->in_block == 0)
            t->acc = dplb_tuple_lane(DPLB_XXPRIME_5, dplb_int_hash(t->parent));
        t->acc = dplb_tuple_lane(t->acc, id);   /* hash(id) == id: id < 2**32 */
        if (++t->in_block == t->block_size) {
            int64_t k = dplb_tuple_finish(t->acc, t->block_size + 1);
            if (t->keys_n >= t->keys_cap &&
                dplb_grow((void **)&t->keys, &t->keys_cap, t->keys_n + 1, sizeof(int64_t)) < 0) {
                t->oom = 1;
                return;
            }
            t->keys[t->keys_n++] = k;
            t->parent = k;
            t->in_block = 0;
        }
    }
}

/* m token ids at once (dplb_tok_id's work with the running state in registers) */
static void dplb_tok_ids(dplb_tok *t, const uint32_t *ids, Py_ssize_t m)
{
    Py_ssize_t bs = t->block_size, in_block = t->in_block, kn;
    uint64_t acc = t->acc;
    int64_t parent = t->parent, *keys;
    if (t->keep_ids) {
        if (t->n + m > t->ids_cap && dplb_grow((void **)&t->ids, &t->ids_cap, t->n + m, sizeof(uint32_t)) < 0) {
            t->oom = 1;
            return;
        }
        memcpy(t->ids + t->n, ids, (size_t)m * sizeof(uint32_t));
    }
    t->n += m;
    if (bs <= 0)
        return;
    if (t->keys_n + m / bs + 1 > t->keys_cap &&
        dplb_grow((void **)&t->keys, &t->keys_cap, t->keys_n + m / bs + 1, sizeof(int64_t)) < 0) {
        t->oom = 1;
        return;
    }
    keys = t->keys;
    kn = t->keys_n;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (in_block == 0)
            acc = dplb_tuple_lane(DPLB_XXPRIME_5, dplb_int_hash(parent));
        acc = dplb_tuple_lane(acc, ids[i]);   /* hash(id) == id: id < 2**32 */
        if (++in_block == bs) {
            parent = dplb_tuple_finish(acc, bs + 1);
            keys[kn++] = parent;
            in_block = 0;
        }
    }
    t->keys_n = kn;
    t->acc = acc;
    t->in_block = in_block;
    t->parent = parent;
}

static inline void dplb_tok_word(dplb_tok *t, uint32_t crc_inverted)
{
    dplb_tok_id(t, dplb_mod(t, crc_inverted ^ 0xFFFFFFFFu));
}

/* a literal ASCII word (the template's tokens) */
static inline void dplb_tok_literal(dplb_tok *t, const char *s, Py_ssize_t n)
{
    dplb_tok_word(t, dplb_crc_bytes(0xFFFFFFFFu, (const uint8_t *)s, n));
}

/* the ASCII whitespace of str.split(): 0x09-0x0D, 0x1C-0x20 */
static inline int dplb_ascii_space(uint8_t c)
{
    return ((uint8_t)(c - 0x09u) <= 4u) | ((uint8_t)(c - 0x1cu) <= 4u);
}

static inline Py_UCS4 dplb_cp(int kind, const void *data, Py_ssize_t i)
{
    return kind == PyUnicode_1BYTE_KIND ? ((const uint8_t *)data)[i]
         : kind == PyUnicode_2BYTE_KIND ? ((const uint16_t *)data)[i] : ((const uint32_t *)data)[i];
}

/* the words of code points [i, end) (split on Python's whitespace) as tokens; returns -1 on a
 * surrogate in a word */
static int dplb_tok_split(dplb_tok *t, int ascii, int kind, const void *data, Py_ssize_t i, Py_ssize_t end)
{
    if (ascii) {
        const uint8_t *p = (const uint8_t *)data;
        while (i < end) {
            Py_ssize_t s;
            while (i < end && dplb_ascii_space(p[i]))
                i++;
            if (i >= end)
                break;
            s = i;
            while (i < end && !dplb_ascii_space(p[i]))
                i++;
            dplb_tok_word(t, dplb_crc_bytes(0xFFFFFFFFu, p + s, i - s));
        }
        return 0;
    }
    while (i < end) {
        uint32_t c = 0xFFFFFFFFu;
        int bad = 0;
        while (i < end && Py_UNICODE_ISSPACE(dplb_cp(kind, data, i)))
            i++;
        if (i >= end)
            break;
        while (i < end) {
            Py_UCS4 cp = dplb_cp(kind, data, i);
            if (Py_UNICODE_ISSPACE(cp))
                break;
            c = dplb_crc_cp(c, cp, &bad);
            i++;
        }
        if (bad)
            return -1;
        dplb_tok_word(t, c);
    }
    return 0;
}

/* the chat roles that start a message in the router's text (epp/events.py ROLES) */
static const char *const dplb_roles[] = {"system", "developer", "user", "assistant", "tool", "function"};
#define DPLB_ROLES 6
#define DPLB_ROLE_MAX 9

/* the role that the line at [i, end) starts with (``role:``; the first colon of the line), or -1 */
static int dplb_line_role(int kind, const void *data, Py_ssize_t i, Py_ssize_t end, Py_ssize_t *colon)
{
    char buf[DPLB_ROLE_MAX];
    Py_ssize_t j;
    for (j = 0; j <= DPLB_ROLE_MAX && i + j < end; j++) {
        Py_UCS4 cp = dplb_cp(kind, data, i + j);
        if (cp == ':')
            break;
        if (j == DPLB_ROLE_MAX || cp > 0x7f)
            return -1;
        buf[j] = (char)cp;
    }
    if (j > DPLB_ROLE_MAX || i + j >= end)
        return -1;
    for (int r = 0; r < DPLB_ROLES; r++)
        if ((Py_ssize_t)strlen(dplb_roles[r]) == j && memcmp(dplb_roles[r], buf, (size_t)j) == 0) {
            *colon = i + j;
            return r;
        }
    return -1;
}

/* a message's start in the token stream: the previous message's end (``<|eot|>``, unless it is the
 * first) and the role's literal ``<|role|>`` (dplb_roles[r]) */
static void dplb_tok_turn(dplb_tok *t, int r)
{
    char lit[DPLB_ROLE_MAX + 4];
    size_t rl = strlen(dplb_roles[r]);
    if (t->n > 0)
        dplb_tok_literal(t, "<|eot|>", 7);
    lit[0] = '<';
    lit[1] = '|';
    memcpy(lit + 2, dplb_roles[r], rl);
    lit[rl + 2] = '|';
    lit[rl + 3] = '>';
    dplb_tok_literal(t, lit, (Py_ssize_t)rl + 4);
}

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define DPLB_ASCII_FAST 1
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* one slice-by-8 step: 8 bytes (``v``, little-endian) into the register ``c`` */
static inline uint32_t dplb_crc_step8(uint32_t c, uint64_t v)
{
    uint32_t lo = (uint32_t)v ^ c, hi = (uint32_t)(v >> 32);
    return dplb_crc_table[7][lo & 0xff] ^ dplb_crc_table[6][(lo >> 8) & 0xff] ^
           dplb_crc_table[5][(lo >> 16) & 0xff] ^ dplb_crc_table[4][lo >> 24] ^
           dplb_crc_table[3][hi & 0xff] ^ dplb_crc_table[2][(hi >> 8) & 0xff] ^
           dplb_crc_table[1][(hi >> 16) & 0xff] ^ dplb_crc_table[0][hi >> 24];
}

/* CRC-32 (pre-inverted register, as dplb_crc_bytes leaves it) of the bytes p[s, e), e > s: the
 * first ((len - 1) mod 8) + 1 bytes as one padded step (dplb_crc_pad), then 8 at a time */
static inline uint32_t dplb_crc_word(const uint8_t *p, Py_ssize_t s, Py_ssize_t e)
{
    Py_ssize_t h = ((e - s - 1) & 7) + 1;
    uint64_t v;
    uint32_t c;
    if (s + h >= 8) {
        memcpy(&v, p + s + h - 8, 8);
        v &= ~0ULL << (8 * (8 - h));
    } else {   /* the text's first bytes: nothing to read before them */
        uint8_t b[8] = {0};
        memcpy(b + 8 - h, p + s, (size_t)h);
        memcpy(&v, b, 8);
    }
    c = dplb_crc_step8(dplb_crc_pad[h], v);
    for (s += h; s < e; s += 8) {
        memcpy(&v, p + s, 8);
        c = dplb_crc_step8(c, v);
    }
    return c;
}

/* the ids of words k in [0, m) (bytes p[st[k], en[k])) into ids, table-driven */
static void dplb_word_ids_table(const dplb_tok *t, const uint8_t *p, const Py_ssize_t *st, const Py_ssize_t *en,
                                Py_ssize_t m, uint32_t *ids)
{
    for (Py_ssize_t k = 0; k < m; k++)
        ids[k] = dplb_mod(t, dplb_crc_word(p, st[k], en[k]) ^ 0xFFFFFFFFu);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define DPLB_CLMUL 1
#include <wmmintrin.h>
#include <smmintrin.h>

/* the register after a 16-byte block x (the register already xored into its first 4 bytes):
 * folded 128 -> 64 -> 32 bits by carry-less multiplication and Barrett-reduced (Gopal et al.,
 * "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction", Intel 2009; the
 * constants for zlib's bit-reflected polynomial as in Linux's arch/x86/crypto/crc32-pclmul_asm.S:
 * x^(4*128+32) mod P and x^(4*128-32) mod P (0x1751997d0, 0xccaa009e), x^64 mod P (0x163cd6124),
 * P' = 0x1db710641 and mu = 0x1f7011641) */
__attribute__((target("pclmul,sse4.1")))
static inline uint32_t dplb_crc_fold16(__m128i x)
{
    const __m128i mask = _mm_set_epi32(0, 0, 0, -1);
    const __m128i r4r3 = _mm_set_epi64x(0x00000000ccaa009eLL, 0x00000001751997d0LL);
    const __m128i r5 = _mm_set_epi64x(0, 0x163cd6124LL);
    const __m128i ru = _mm_set_epi64x(0x1F7011641LL, 0x1DB710641LL);
    __m128i t1, t2;
    x = _mm_xor_si128(_mm_clmulepi64_si128(x, r4r3, 0x10), _mm_srli_si128(x, 8));
    x = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x, mask), r5, 0x00), _mm_srli_si128(x, 4));
    t1 = _mm_clmulepi64_si128(_mm_and_si128(x, mask), ru, 0x10);
    t2 = _mm_clmulepi64_si128(_mm_and_si128(t1, mask), ru, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x, t2), 1);
}

/* 16 zero bytes then 16 0xff: loaded at offset h, keeps the last h bytes of a 16-byte block */
static const uint8_t dplb_keep_tail[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255};

/* dplb_crc_word 16 bytes a step: the first ((len - 1) mod 16) + 1 bytes after zero bytes from
 * dplb_crc_pad16, then 16 at a time */
__attribute__((target("pclmul,sse4.1")))
static inline uint32_t dplb_crc_word_clmul(const uint8_t *p, Py_ssize_t s, Py_ssize_t e)
{
    Py_ssize_t h = ((e - s - 1) & 15) + 1;
    __m128i x;
    uint32_t c;
    if (s + h >= 16) {
        x = _mm_loadu_si128((const __m128i *)(p + s + h - 16));
        x = _mm_and_si128(x, _mm_loadu_si128((const __m128i *)(dplb_keep_tail + h)));
    } else {   /* the text's first bytes: nothing to read before them */
        uint8_t b[16] = {0};
        memcpy(b + 16 - h, p + s, (size_t)h);
        x = _mm_loadu_si128((const __m128i *)b);
    }
    c = dplb_crc_fold16(_mm_xor_si128(x, _mm_cvtsi32_si128((int)dplb_crc_pad16[h])));
    for (s += h; s < e; s += 16)
        c = dplb_crc_fold16(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(p + s)), _mm_cvtsi32_si128((int)c)));
    return c;
}

__attribute__((target("pclmul,sse4.1")))
static void dplb_word_ids_clmul(const dplb_tok *t, const uint8_t *p, const Py_ssize_t *st, const Py_ssize_t *en,
                                Py_ssize_t m, uint32_t *ids)
{
    for (Py_ssize_t k = 0; k < m; k++)
        ids[k] = dplb_mod(t, dplb_crc_word_clmul(p, st[k], en[k]) ^ 0xFFFFFFFFu);
}
#endif

/* bit k set: byte q[k] is ASCII whitespace (dplb_ascii_space), for the 64 bytes at q */
static inline uint64_t dplb_space_mask64(const uint8_t *q)
{
    uint64_t m = 0;
#ifdef __SSE2__
    const __m128i nine = _mm_set1_epi8(0x09), fs = _mm_set1_epi8(0x1c), four = _mm_set1_epi8(4),
                  zero = _mm_setzero_si128();
    for (int k = 0; k < 4; k++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(q + 16 * k));
        __m128i a = _mm_cmpeq_epi8(_mm_subs_epu8(_mm_sub_epi8(x, nine), four), zero);
        __m128i b = _mm_cmpeq_epi8(_mm_subs_epu8(_mm_sub_epi8(x, fs), four), zero);
        m |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_or_si128(a, b)) << (16 * k);
    }
#else
    for (int k = 0; k < 64; k++)
        m |= (uint64_t)dplb_ascii_space(q[k]) << k;
#endif
    return m;
}

/* the positions (base + bit index) of the set bits of m, ascending, into out (which has room for
 * 64 + DPLB_PUT_UNROLL); returns how many. The first DPLB_PUT_UNROLL are written whether set or
 * not (the surplus is garbage past the count), so a block with up to that many words takes no
 * branch that depends on its count (simdjson's flatten_bits: Langdale and Lemire, "Parsing
 * gigabytes of JSON per second", VLDB Journal 2019) */
#define DPLB_PUT_UNROLL 12
static inline Py_ssize_t dplb_put_bits(Py_ssize_t *out, Py_ssize_t base, uint64_t m)
{
    Py_ssize_t cnt = __builtin_popcountll(m);
    for (int k = 0; k < DPLB_PUT_UNROLL; k++) {
        out[k] = base + __builtin_ctzll(m | (1ULL << 63));
        m &= m - 1;
    }
    if (cnt > DPLB_PUT_UNROLL)
        for (Py_ssize_t k = DPLB_PUT_UNROLL; m; k++) {
            out[k] = base + __builtin_ctzll(m);
            m &= m - 1;
        }
    return cnt;
}

/* words found and not yet turned into tokens */
#define DPLB_WORDS_BUF 2048

/* the words of ASCII bytes p[i, end) as tokens: a first pass finds the words' bounds 64 bytes at
 * a time from whitespace bit masks, a second turns each word into its id (dplb_crc_word) */
#define DPLB_ASCII_WORDS_BODY(WORD_IDS)                                                               \
    Py_ssize_t st[DPLB_WORDS_BUF + 64 + DPLB_PUT_UNROLL], en[DPLB_WORDS_BUF + 64 + DPLB_PUT_UNROLL];  \
    uint32_t ids[DPLB_WORDS_BUF + 64 + DPLB_PUT_UNROLL];                                              \
    Py_ssize_t ns = 0, ne = 0;                                                                        \
    uint64_t carry = 1;   /* the byte before i counts as whitespace */                                \
    for (Py_ssize_t base = i; base < end; base += 64) {                                               \
        uint64_t sp, sh, s, e;                                                                        \
        if (end - base >= 64) {                                                                       \
            sp = dplb_space_mask64(p + base);                                                         \
        } else {   /* the last bytes: past the end counts as whitespace */                            \
            uint8_t b[64];                                                                            \
            memset(b, ' ', sizeof b);                                                                 \
            memcpy(b, p + base, (size_t)(end - base));                                                \
            sp = dplb_space_mask64(b);                                                                \
        }                                                                                             \
        sh = (sp << 1) | carry;                                                                       \
        s = ~sp & sh;                                                                                 \
        e = sp & ~sh;                                                                                 \
        carry = sp >> 63;                                                                             \
        ns += dplb_put_bits(st + ns, base, s);                                                        \
        ne += dplb_put_bits(en + ne, base, e);                                                        \
        if (ne >= DPLB_WORDS_BUF) {                                                                   \
            WORD_IDS(t, p, st, en, ne, ids);                                                          \
            dplb_tok_ids(t, ids, ne);                                                                 \
            for (Py_ssize_t k = ne; k < ns; k++)                                                      \
                st[k - ne] = st[k];                                                                   \
            ns -= ne;                                                                                 \
            ne = 0;                                                                                   \
        }                                                                                             \
    }                                                                                                 \
    if (!carry && ne < ns)                                                                            \
        en[ne++] = end;                                                                               \
    WORD_IDS(t, p, st, en, ne, ids);                                                                  \
    dplb_tok_ids(t, ids, ne);

static void dplb_tok_ascii_words_table(dplb_tok *t, const uint8_t *p, Py_ssize_t i, Py_ssize_t end)
{
    DPLB_ASCII_WORDS_BODY(dplb_word_ids_table);
}

#ifdef DPLB_CLMUL
/* the same compiled for CPUs with POPCNT, BMI1 (tzcnt), PCLMULQDQ and SSE4.1, the CRCs by
 * carry-less multiplication */
__attribute__((target("popcnt,bmi,pclmul,sse4.1")))
static void dplb_tok_ascii_words_fast(dplb_tok *t, const uint8_t *p, Py_ssize_t i, Py_ssize_t end)
{
    DPLB_ASCII_WORDS_BODY(dplb_word_ids_clmul);
}
#endif

static void dplb_tok_ascii_words(dplb_tok *t, const uint8_t *p, Py_ssize_t i, Py_ssize_t end)
{
#ifdef DPLB_CLMUL
    if (dplb_has_fast && !dplb_fast_off) {
        dplb_tok_ascii_words_fast(t, p, i, end);
        return;
    }
#endif
    dplb_tok_ascii_words_table(t, p, i, end);
}

/* dplb_tokenize for an ASCII text: the words between the role prefixes (``role:`` at a line's
 * start) in one dplb_tok_ascii_words each */
static int dplb_tokenize_ascii(dplb_tok *t, int chat, const uint8_t *p, Py_ssize_t n)
{
    Py_ssize_t seg = 0, line = 0;
    if (chat) {
        for (;;) {
            Py_ssize_t colon = 0;
            const uint8_t *nl;
            int r = dplb_line_role(PyUnicode_1BYTE_KIND, p, line, n, &colon);
            if (r >= 0) {
                dplb_tok_ascii_words(t, p, seg, line);
                dplb_tok_turn(t, r);
                seg = colon + 1;
            }
            nl = memchr(p + line, '\n', (size_t)(n - line));
            if (nl == NULL)
                break;
            line = nl - p + 1;
        }
    }
    dplb_tok_ascii_words(t, p, seg, n);
    if (chat && !t->open_end) {
        if (t->n > 0)
            dplb_tok_literal(t, "<|eot|>", 7);
        dplb_tok_literal(t, "<|assistant|>", 13);
    }
    return t->oom ? -1 : 0;
}
#endif

/* The tokens of the router's prompt text (n code points, PyUnicode_KIND ``kind``, PyUnicode_DATA
 * ``data``, ``ascii``: PyUnicode_IS_ASCII), rendered as chat when ``chat`` (see the top). Returns
 * 0, or -1 on a surrogate in a word (the caller falls back to Python, which raises) or when memory
 * ran out (t->oom). A prompt can be tokenized in pieces that each start at a line's start (just
 * after a '\n'): the first with ``open_end`` set (no closing literals), the next from the state
 * (n, acc, in_block, parent) the first left, gives the same tokens and keys as one pass: a line
 * start is a word boundary and where a role is looked for in both. */
static int dplb_tokenize(dplb_tok *t, int chat, int ascii, int kind, const void *data, Py_ssize_t n)
{
    Py_ssize_t i = 0;
#ifdef DPLB_ASCII_FAST
    if (ascii)
        return dplb_tokenize_ascii(t, chat, (const uint8_t *)data, n);
#endif
    if (!chat)
        return dplb_tok_split(t, ascii, kind, data, 0, n) < 0 || t->oom ? -1 : 0;
    while (i <= n) {
        Py_ssize_t end = i, colon = 0;
        int r;
        if (ascii) {
            const void *nl = memchr((const uint8_t *)data + i, '\n', (size_t)(n - i));
            end = nl ? (const uint8_t *)nl - (const uint8_t *)data : n;
        } else {
            while (end < n && dplb_cp(kind, data, end) != '\n')
                end++;
        }
        r = dplb_line_role(kind, data, i, end, &colon);
        if (r >= 0) {
            dplb_tok_turn(t, r);
            i = colon + 1;
        }
        if (dplb_tok_split(t, ascii, kind, data, i, end) < 0)
            return -1;
        i = end + 1;
    }
    if (!t->open_end) {
        if (t->n > 0)
            dplb_tok_literal(t, "<|eot|>", 7);
        dplb_tok_literal(t, "<|assistant|>", 13);
    }
    return t->oom ? -1 : 0;
}

#endif
