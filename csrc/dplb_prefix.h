/* dplb_prefix.h: the per-byte work of prefix matching, on a Python str's own buffer (no copy).
 *
 * - dplb_chunk_hash: the hash of one chunk of code points chained on its parent's hash. Four
 *   FNV-1a lanes (64-bit prime 0x100000001b3, Fowler/Noll/Vo, http://www.isthe.com/chongo/tech/comp/fnv/)
 *   take the code points at positions 0, 1, 2, 3 mod 4, each lane seeded with the parent xor its
 *   own constant; the lanes are folded and finished with MurmurHash3's fmix64 (Appleby,
 *   https://github.com/aappleby/smhasher). It hashes code points, not the str's storage, so a
 *   chunk hashes alike whatever the width (1, 2 or 4 bytes) its string is stored in.
 * - dplb_count_words: the number of whitespace-separated words, len(s.split()) in Python (the same
 *   whitespace test, Py_UNICODE_ISSPACE).
 *
 * The bit-identical pure-Python reference is dplb_prefix/reference.py; the equivalence
 * test tests/csrc/test_prefix_equiv.py.
 */
#ifndef DPLB_PREFIX_H
#define DPLB_PREFIX_H

#include <Python.h>
#include <stdint.h>

#define DPLB_FNV_PRIME 0x100000001b3ULL
/* the seed of a model name's hash (FNV-1a's 64-bit offset basis) */
#define DPLB_MODEL_SEED 0xcbf29ce484222325ULL
#define DPLB_LANE0 0x9e3779b97f4a7c15ULL
#define DPLB_LANE1 0xc2b2ae3d27d4eb4fULL
#define DPLB_LANE2 0x165667b19e3779f9ULL
#define DPLB_LANE3 0x27d4eb2f165667c5ULL

static inline uint64_t dplb_fmix64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static inline void dplb_prefetch(const void *p) { __builtin_prefetch(p); }

static inline uint64_t dplb_rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

#define DPLB_LANES_LOOP(T)                                                   \
    do {                                                                     \
        const T *p = (const T *)data + start;                                \
        for (; i + 4 <= n; i += 4) {                                         \
            l0 = (l0 ^ (uint64_t)p[i]) * DPLB_FNV_PRIME;                     \
            l1 = (l1 ^ (uint64_t)p[i + 1]) * DPLB_FNV_PRIME;                 \
            l2 = (l2 ^ (uint64_t)p[i + 2]) * DPLB_FNV_PRIME;                 \
            l3 = (l3 ^ (uint64_t)p[i + 3]) * DPLB_FNV_PRIME;                 \
        }                                                                    \
        for (; i < n; i++) {                                                 \
            uint64_t c = (uint64_t)p[i];                                     \
            switch (i & 3) {                                                 \
            case 0: l0 = (l0 ^ c) * DPLB_FNV_PRIME; break;                   \
            case 1: l1 = (l1 ^ c) * DPLB_FNV_PRIME; break;                   \
            case 2: l2 = (l2 ^ c) * DPLB_FNV_PRIME; break;                   \
            default: l3 = (l3 ^ c) * DPLB_FNV_PRIME; break;                  \
            }                                                                \
        }                                                                    \
    } while (0)

/* Hash of the n code points at [start, start + n) of a str's data (PyUnicode_KIND ``kind``,
 * PyUnicode_DATA ``data``), chained on ``parent``. */
static inline uint64_t dplb_chunk_hash(uint64_t parent, int kind, const void *data, Py_ssize_t start,
                                       Py_ssize_t n)
{
    uint64_t l0 = parent ^ DPLB_LANE0, l1 = parent ^ DPLB_LANE1, l2 = parent ^ DPLB_LANE2,
             l3 = parent ^ DPLB_LANE3;
    Py_ssize_t i = 0;
    if (kind == PyUnicode_1BYTE_KIND)
        DPLB_LANES_LOOP(uint8_t);
    else if (kind == PyUnicode_2BYTE_KIND)
        DPLB_LANES_LOOP(uint16_t);
    else
        DPLB_LANES_LOOP(uint32_t);
    return dplb_fmix64(l0 ^ dplb_rotl64(l1, 16) ^ dplb_rotl64(l2, 32) ^ dplb_rotl64(l3, 48));
}

#define DPLB_WORDS_LOOP(T)                                                   \
    do {                                                                     \
        const T *p = (const T *)data;                                        \
        for (Py_ssize_t i = 0; i < n; i++) {                                 \
            int sp = Py_UNICODE_ISSPACE((Py_UCS4)p[i]) ? 1 : 0;              \
            words += (inword == 0) & (sp == 0);                              \
            inword = !sp;                                                    \
        }                                                                    \
    } while (0)

/* Py_UNICODE_ISSPACE of a Latin-1 code point, branch-free and in byte lanes (the loop below
 * vectorises 16 code points a step): 0x09-0x0D, 0x1C-0x20, 0x85, 0xA0, the code points below 256
 * for which str.isspace() is true */
static inline uint8_t dplb_latin1_space(uint8_t c)
{
    return (uint8_t)(((uint8_t)(c - 0x09u) <= 4u) | ((uint8_t)(c - 0x1cu) <= 4u) | (c == 0x85u) | (c == 0xa0u));
}

/* len(s.split()) of a str's n code points (PyUnicode_KIND ``kind``, PyUnicode_DATA ``data``): the
 * number of non-space code points that follow a space or the start. */
static inline Py_ssize_t dplb_count_words(int kind, const void *data, Py_ssize_t n)
{
    Py_ssize_t words = 0;
    int inword = 0;
    if (n == 0)
        return 0;
    if (kind == PyUnicode_1BYTE_KIND) {
        const uint8_t *p = (const uint8_t *)data;
        Py_ssize_t starts = !dplb_latin1_space(p[0]);
        for (Py_ssize_t i = 1; i < n; i += 255) {   /* blocks of 255: a byte counter cannot wrap */
            Py_ssize_t end = n - i < 255 ? n : i + 255;
            uint8_t block = 0;
            for (Py_ssize_t j = i; j < end; j++)
                block += (uint8_t)(dplb_latin1_space(p[j - 1]) & (uint8_t)!dplb_latin1_space(p[j]));
            starts += block;
        }
        return starts;
    }
    if (kind == PyUnicode_2BYTE_KIND)
        DPLB_WORDS_LOOP(uint16_t);
    else
        DPLB_WORDS_LOOP(uint32_t);
    return words;
}

#endif
