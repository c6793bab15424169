/* Byte-level BPE tokenizer from a tokenizer.json (bakron/tokenizer.h).
 *
 * Encoding follows the `tokenizers` pipeline step by step:
 *   1. added tokens that are not "normalized" are split out of the raw text
 *      (leftmost-longest match; single_word / lstrip / rstrip);
 *   2. each remaining piece is normalized (NFC etc., utf8proc), and the
 *      "normalized" added tokens are split out of it;
 *   3. the pre-tokenizers cut each piece into words (regexes through PCRE2
 *      with UTF + UCP; ByteLevel maps every byte to a printable character);
 *   4. each word goes through BPE: its characters' ids are merged pair by
 *      pair, lowest merge rank first (leftmost on ties), with a binary heap
 *      over a linked list of symbols: O(w log w) for a word of w characters;
 *   5. the post-processor adds the template's special tokens (BOS) when asked.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <pcre2.h>
#include <utf8proc.h>

#include "bakron/tokenizer.h"
#include "util.h"

#define MAX_STEPS 16    /* pre-tokenizers in a Sequence (nested ones flattened) */
#define MAX_NORM 8      /* normalizers in a Sequence */
#define MAX_TOKENIZER_JSON ((size_t)1 << 30)

/* ------------------------------------------------------------ small helpers */

typedef struct buf {
    char *p;
    size_t n, cap;
} buf;

static int buf_reserve(buf *b, size_t need)
{
    if (need <= b->cap)
        return 0;
    size_t c = b->cap ? b->cap : 64;
    while (c < need)
        c *= 2;
    char *q = realloc(b->p, c);
    if (!q)
        return -1;
    b->p = q;
    b->cap = c;
    return 0;
}

static int buf_add(buf *b, const void *s, size_t n)
{
    if (buf_reserve(b, b->n + n + 1))
        return -1;
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
    return 0;
}

static int ids_push(bk_token_ids *v, int32_t id)
{
    if (v->n == v->cap) {
        size_t c = v->cap ? v->cap * 2 : 256;
        int32_t *q = realloc(v->ids, c * sizeof *q);
        if (!q)
            return -1;
        v->ids = q;
        v->cap = c;
    }
    v->ids[v->n++] = id;
    return 0;
}

void bk_token_ids_free(bk_token_ids *v)
{
    if (!v)
        return;
    free(v->ids);
    v->ids = NULL;
    v->n = v->cap = 0;
}

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}


static size_t utf8_put(char *o, uint32_t c)
{
    if (c < 0x80) {
        o[0] = (char)c;
        return 1;
    }
    if (c < 0x800) {
        o[0] = (char)(0xC0 | (c >> 6));
        o[1] = (char)(0x80 | (c & 0x3F));
        return 2;
    }
    if (c < 0x10000) {
        o[0] = (char)(0xE0 | (c >> 12));
        o[1] = (char)(0x80 | ((c >> 6) & 0x3F));
        o[2] = (char)(0x80 | (c & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (c >> 18));
    o[1] = (char)(0x80 | ((c >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((c >> 6) & 0x3F));
    o[3] = (char)(0x80 | (c & 0x3F));
    return 4;
}

/* Length of the UTF-8 character starting with byte b (valid text). */
static size_t utf8_len(unsigned char b)
{
    return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

/* Decode one character of valid UTF-8. */
static uint32_t utf8_get(const char *s, size_t *len)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t l = utf8_len(u[0]);
    *len = l;
    switch (l) {
    case 1: return u[0];
    case 2: return ((uint32_t)(u[0] & 0x1F) << 6) | (u[1] & 0x3F);
    case 3: return ((uint32_t)(u[0] & 0x0F) << 12) | ((uint32_t)(u[1] & 0x3F) << 6) | (u[2] & 0x3F);
    default:
        return ((uint32_t)(u[0] & 0x07) << 18) | ((uint32_t)(u[1] & 0x3F) << 12) |
               ((uint32_t)(u[2] & 0x3F) << 6) | (u[3] & 0x3F);
    }
}

/* Offset of the first byte that breaks UTF-8 (as Rust's str accepts it:
 * no overlongs, no surrogates, <= U+10FFFF), or n when the text is valid. */
/* Unicode White_Space (what the Rust regex crate and Oniguruma call \s). */
static int is_white_space(uint32_t c)
{
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}
#define WS_CLASS "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"

/* ------------------------------------------------------------ string -> id map */

typedef struct strmap {
    uint32_t *slot;   /* entry index + 1, 0 = empty */
    size_t cap;       /* power of two */
    uint32_t *off, *len;
    int32_t *id;
    size_t n, ecap;
    buf arena;
} strmap;

static void strmap_free(strmap *m)
{
    free(m->slot);
    free(m->off);
    free(m->len);
    free(m->id);
    free(m->arena.p);
    memset(m, 0, sizeof *m);
}

static int strmap_init(strmap *m, size_t expect)
{
    memset(m, 0, sizeof *m);
    size_t cap = 16;
    while (cap < expect * 2 + 16)
        cap *= 2;
    m->slot = calloc(cap, sizeof *m->slot);
    m->cap = cap;
    return m->slot ? 0 : -1;
}

static const char *strmap_key(const strmap *m, size_t e)
{
    return m->arena.p + m->off[e];
}

/* Index of the entry, or -1. */
static long strmap_find(const strmap *m, const char *s, size_t n)
{
    if (!m->cap)
        return -1;
    size_t mask = m->cap - 1, h = (size_t)hash_bytes(s, n) & mask;
    for (;;) {
        uint32_t e = m->slot[h];
        if (!e)
            return -1;
        e--;
        if (m->len[e] == n && !memcmp(strmap_key(m, e), s, n))
            return (long)e;
        h = (h + 1) & mask;
    }
}

static int32_t strmap_get(const strmap *m, const char *s, size_t n)
{
    long e = strmap_find(m, s, n);
    return e < 0 ? -1 : m->id[e];
}

static int strmap_grow(strmap *m)
{
    size_t cap = m->cap * 2, mask = cap - 1;
    uint32_t *slot = calloc(cap, sizeof *slot);
    if (!slot)
        return -1;
    for (size_t e = 0; e < m->n; e++) {
        size_t h = (size_t)hash_bytes(strmap_key(m, e), m->len[e]) & mask;
        while (slot[h])
            h = (h + 1) & mask;
        slot[h] = (uint32_t)e + 1;
    }
    free(m->slot);
    m->slot = slot;
    m->cap = cap;
    return 0;
}

/* Insert or overwrite (the last value wins, as in a Rust HashMap built from
 * the file's entries). */
static int strmap_put(strmap *m, const char *s, size_t n, int32_t id)
{
    long e = strmap_find(m, s, n);
    if (e >= 0) {
        m->id[e] = id;
        return 0;
    }
    if ((m->n + 1) * 2 > m->cap && strmap_grow(m))
        return -1;
    if (m->n == m->ecap) {
        size_t c = m->ecap ? m->ecap * 2 : 1024;
        uint32_t *o = realloc(m->off, c * sizeof *o);
        if (!o)
            return -1;
        m->off = o;
        uint32_t *l = realloc(m->len, c * sizeof *l);
        if (!l)
            return -1;
        m->len = l;
        int32_t *d = realloc(m->id, c * sizeof *d);
        if (!d)
            return -1;
        m->id = d;
        m->ecap = c;
    }
    if (m->arena.n + n + 1 > UINT32_MAX)
        return -1;
    size_t off = m->arena.n;
    if (buf_add(&m->arena, s, n) || buf_add(&m->arena, "", 1))
        return -1;
    m->off[m->n] = (uint32_t)off;
    m->len[m->n] = (uint32_t)n;
    m->id[m->n] = id;
    size_t mask = m->cap - 1, h = (size_t)hash_bytes(s, n) & mask;
    while (m->slot[h])
        h = (h + 1) & mask;
    m->slot[h] = (uint32_t)m->n + 1;
    m->n++;
    return 0;
}

/* ------------------------------------------------------------ merge map */

typedef struct merge_ent {
    uint64_t key; /* (left id << 32 | right id) + 1; 0 = empty */
    uint32_t rank;
    int32_t new_id;
} merge_ent;

typedef struct mergemap {
    merge_ent *e;
    size_t cap, n;
} mergemap;

static int mergemap_init(mergemap *m, size_t expect)
{
    size_t cap = 16;
    while (cap < expect * 2 + 16)
        cap *= 2;
    m->e = calloc(cap, sizeof *m->e);
    m->cap = cap;
    m->n = 0;
    return m->e ? 0 : -1;
}

static uint64_t pair_key(int32_t a, int32_t b)
{
    return (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
}

static const merge_ent *mergemap_get(const mergemap *m, int32_t a, int32_t b)
{
    uint64_t k = pair_key(a, b);
    size_t mask = m->cap - 1, h = (size_t)bk_mix64(k) & mask;
    for (;;) {
        const merge_ent *e = &m->e[h];
        if (e->key == k)
            return e;
        if (!e->key)
            return NULL;
        h = (h + 1) & mask;
    }
}

static void mergemap_put(mergemap *m, int32_t a, int32_t b, uint32_t rank, int32_t new_id)
{
    uint64_t k = pair_key(a, b);
    size_t mask = m->cap - 1, h = (size_t)bk_mix64(k) & mask;
    while (m->e[h].key && m->e[h].key != k)
        h = (h + 1) & mask;
    if (!m->e[h].key)
        m->n++;
    m->e[h].key = k;
    m->e[h].rank = rank;
    m->e[h].new_id = new_id;
}

/* ------------------------------------------------------------ regexes */

typedef struct rx {
    pcre2_code *code;
    pcre2_match_data *md;
} rx;

static void rx_free(rx *r)
{
    pcre2_match_data_free(r->md);
    pcre2_code_free(r->code);
    r->md = NULL;
    r->code = NULL;
}

/* Rewrite \s and \S to Unicode White_Space classes: PCRE2's \s under UCP is
 * \p{Z} plus \h and \v, which differs from Oniguruma's (used by `tokenizers`)
 * on U+180E. \S inside a character class has no such rewrite: refused. */
static bk_status rewrite_ws(const char *pat, buf *out, const char *path)
{
    int in_class = 0;
    size_t n = strlen(pat);
    for (size_t i = 0; i < n; i++) {
        char c = pat[i];
        if (c == '\\' && i + 1 < n) {
            char d = pat[i + 1];
            if (d == 's' || d == 'S') {
                const char *rep;
                if (in_class) {
                    if (d == 'S')
                        return bk_error(BK_ERR_UNSUPPORTED,
                                        "%s: pre-tokenizer regex uses \\S inside a character class (not supported)",
                                        path);
                    rep = WS_CLASS;
                } else {
                    rep = d == 's' ? "[" WS_CLASS "]" : "[^" WS_CLASS "]";
                }
                if (buf_add(out, rep, strlen(rep)))
                    return bk_error(BK_ERR_NOMEM, "out of memory");
            } else if (buf_add(out, pat + i, 2)) {
                return bk_error(BK_ERR_NOMEM, "out of memory");
            }
            i++;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = 1;
            if (buf_add(out, &c, 1))
                return bk_error(BK_ERR_NOMEM, "out of memory");
            /* a ']' right after '[' or '[^' is a literal */
            if (i + 1 < n && pat[i + 1] == '^') {
                if (buf_add(out, "^", 1))
                    return bk_error(BK_ERR_NOMEM, "out of memory");
                i++;
            }
            if (i + 1 < n && pat[i + 1] == ']') {
                if (buf_add(out, "]", 1))
                    return bk_error(BK_ERR_NOMEM, "out of memory");
                i++;
            }
            continue;
        }
        if (in_class && c == '[' && i + 1 < n && pat[i + 1] == ':') {
            /* POSIX class [:name:] inside a class */
            const char *end = strstr(pat + i + 2, ":]");
            if (end) {
                size_t l = (size_t)(end + 2 - (pat + i));
                if (buf_add(out, pat + i, l))
                    return bk_error(BK_ERR_NOMEM, "out of memory");
                i += l - 1;
                continue;
            }
        }
        if (in_class && c == ']')
            in_class = 0;
        if (buf_add(out, &c, 1))
            return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    if (!out->p && buf_add(out, "", 0))
        return bk_error(BK_ERR_NOMEM, "out of memory");
    return BK_OK;
}

static bk_status rx_compile(rx *r, const char *pattern, int literal, const char *path)
{
    buf p = {0};
    bk_status st;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP;
    if (literal) {
        opts = PCRE2_UTF | PCRE2_LITERAL;
        if (buf_add(&p, pattern, strlen(pattern)))
            return bk_error(BK_ERR_NOMEM, "out of memory");
    } else if ((st = rewrite_ws(pattern, &p, path)) != BK_OK) {
        free(p.p);
        return st;
    }
    int err = 0;
    PCRE2_SIZE erroff = 0;
    r->code = pcre2_compile((PCRE2_SPTR)p.p, p.n, opts, &err, &erroff, NULL);
    free(p.p);
    if (!r->code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return bk_error(BK_ERR_UNSUPPORTED, "%s: pre-tokenizer regex '%s' does not compile with PCRE2 (%s at %zu)",
                        path, pattern, (const char *)msg, (size_t)erroff);
    }
    pcre2_jit_compile(r->code, PCRE2_JIT_COMPLETE); /* optional: falls back to the interpreter */
    r->md = pcre2_match_data_create_from_pattern(r->code, NULL);
    if (!r->md)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    return BK_OK;
}

/* A span of a piece: [a, b), is_match. */
typedef struct span {
    size_t a, b;
    int m;
} span;

typedef struct spans {
    span *s;
    size_t n, cap;
} spans;

static int spans_push(spans *v, size_t a, size_t b, int m)
{
    if (v->n == v->cap) {
        size_t c = v->cap ? v->cap * 2 : 64;
        span *q = realloc(v->s, c * sizeof *q);
        if (!q)
            return -1;
        v->s = q;
        v->cap = c;
    }
    v->s[v->n++] = (span){a, b, m};
    return 0;
}

/* Matches and gaps covering s[0, n), as the Pattern trait of `tokenizers`
 * gives them (empty matches are skipped). */
static bk_status rx_find(rx *r, const char *s, size_t n, spans *out)
{
    out->n = 0;
    size_t prev = 0, off = 0;
    uint32_t mopt = 0;
    while (off <= n) {
        int rc = pcre2_match(r->code, (PCRE2_SPTR)s, n, off, mopt, r->md, NULL);
        mopt = PCRE2_NO_UTF_CHECK;
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return bk_error(BK_ERR_INTERNAL, "tokenizer: PCRE2 match failed: %s", (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(r->md);
        size_t a = ov[0], b = ov[1];
        if (b == a) { /* empty match: step over one character */
            if (a >= n)
                break;
            off = a + utf8_len((unsigned char)s[a]);
            continue;
        }
        if (a > prev && spans_push(out, prev, a, 0))
            return bk_error(BK_ERR_NOMEM, "out of memory");
        if (spans_push(out, a, b, 1))
            return bk_error(BK_ERR_NOMEM, "out of memory");
        prev = off = b;
    }
    if (prev < n && spans_push(out, prev, n, 0))
        return bk_error(BK_ERR_NOMEM, "out of memory");
    return BK_OK;
}

/* ------------------------------------------------------------ the tokenizer */

enum { SPLIT_REMOVED, SPLIT_ISOLATED, SPLIT_MERGED_PREV, SPLIT_MERGED_NEXT, SPLIT_CONTIGUOUS };
enum { PT_SPLIT, PT_BYTELEVEL, PT_DIGITS };
enum { NORM_NFC, NORM_NFD, NORM_NFKC, NORM_NFKD };

typedef struct pt_step {
    int kind;
    rx re;           /* Split's pattern, ByteLevel's GPT-2 regex, Digits' \p{N} */
    int behavior;
    int invert;
    int add_prefix_space, use_regex;
} pt_step;

typedef struct added_tok {
    char *content;
    size_t len;
    int32_t id;
    int single_word, lstrip, rstrip, normalized;
} added_tok;

/* Added tokens of one kind (normalized or not), by first byte. */
typedef struct added_set {
    added_tok **t;    /* sorted by first byte */
    size_t n;
    size_t first[257];
} added_set;

typedef struct level {
    spans sp, sp2;
    buf a, b;
} level;

struct bk_tokenizer {
    char *path;
    strmap vocab;
    mergemap merges;
    int32_t unk_id;          /* -1: none */
    int fuse_unk, ignore_merges;
    char *cs_prefix, *eow_suffix; /* NULL when absent or empty */
    int32_t char_id[512];    /* vocab id of code point c (no prefix/suffix), -1 absent */
    uint32_t byte_cp[256];   /* ByteLevel: byte -> code point */

    int norm[MAX_NORM];
    int n_norm;
    pt_step steps[MAX_STEPS];
    int n_steps;
    rx word_rx;              /* \w as the Rust regex crate has it, for single_word */
    int have_word_rx;

    added_tok *added;
    size_t n_added;
    added_set raw, normd;
    strmap added_map;

    int32_t *post_pre, *post_suf;
    size_t n_pre, n_suf;

    int64_t vocab_size;

    /* encode scratch */
    level lv[MAX_STEPS + 1];
    spans seg_raw, seg_norm;
    buf norm_buf, word;
    struct sym { int32_t c, prev, next; uint32_t len; } *sym;
    size_t sym_cap;
    struct hent { uint32_t rank, pos; int32_t new_id; } *heap;
    size_t heap_n, heap_cap;
    bk_token_ids *out;
};

static void bytes_to_unicode(uint32_t *cp)
{
    uint32_t extra = 0;
    for (int b = 0; b < 256; b++) {
        if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))
            cp[b] = (uint32_t)b;
        else
            cp[b] = 256 + extra++;
    }
}

void bk_tokenizer_free(bk_tokenizer *t)
{
    if (!t)
        return;
    free(t->path);
    strmap_free(&t->vocab);
    free(t->merges.e);
    free(t->cs_prefix);
    free(t->eow_suffix);
    for (int i = 0; i < t->n_steps; i++)
        rx_free(&t->steps[i].re);
    if (t->have_word_rx)
        rx_free(&t->word_rx);
    for (size_t i = 0; i < t->n_added; i++)
        free(t->added[i].content);
    free(t->added);
    free(t->raw.t);
    free(t->normd.t);
    strmap_free(&t->added_map);
    free(t->post_pre);
    free(t->post_suf);
    for (int i = 0; i <= MAX_STEPS; i++) {
        free(t->lv[i].sp.s);
        free(t->lv[i].sp2.s);
        free(t->lv[i].a.p);
        free(t->lv[i].b.p);
    }
    free(t->seg_raw.s);
    free(t->seg_norm.s);
    free(t->norm_buf.p);
    free(t->word.p);
    free(t->sym);
    free(t->heap);
    free(t);
}

int64_t bk_tokenizer_vocab_size(const bk_tokenizer *t)
{
    return t->vocab_size;
}

int32_t bk_tokenizer_token_id(const bk_tokenizer *t, const char *token)
{
    size_t n = strlen(token);
    int32_t id = strmap_get(&t->added_map, token, n);
    return id >= 0 ? id : strmap_get(&t->vocab, token, n);
}

/* ------------------------------------------------------------ loading */

static const char *jstr(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static int jbool(const cJSON *o, const char *key, int dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (cJSON_IsBool(v))
        return cJSON_IsTrue(v) ? 1 : 0;
    return dflt;
}

static bk_status load_normalizer(bk_tokenizer *t, const cJSON *n)
{
    if (!n || cJSON_IsNull(n))
        return BK_OK;
    const char *type = jstr(n, "type");
    if (!type)
        return bk_error(BK_ERR_CONFIG, "%s: normalizer without a \"type\"", t->path);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, "normalizers"), *it;
        if (!cJSON_IsArray(list))
            return bk_error(BK_ERR_CONFIG, "%s: normalizer Sequence without \"normalizers\"", t->path);
        cJSON_ArrayForEach(it, list)
        {
            bk_status st = load_normalizer(t, it);
            if (st != BK_OK)
                return st;
        }
        return BK_OK;
    }
    int k;
    if (!strcmp(type, "NFC"))
        k = NORM_NFC;
    else if (!strcmp(type, "NFD"))
        k = NORM_NFD;
    else if (!strcmp(type, "NFKC"))
        k = NORM_NFKC;
    else if (!strcmp(type, "NFKD"))
        k = NORM_NFKD;
    else
        return bk_error(BK_ERR_UNSUPPORTED,
                        "%s: normalizer '%s' is not supported (bakron's tokenizer implements NFC, NFD, NFKC, NFKD: byte-level BPE as in Llama-3, Qwen2/3, GPT-2)",
                        t->path, type);
    if (t->n_norm >= MAX_NORM)
        return bk_error(BK_ERR_UNSUPPORTED, "%s: more than %d normalizers", t->path, MAX_NORM);
    t->norm[t->n_norm++] = k;
    return BK_OK;
}

static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static bk_status add_step(bk_tokenizer *t, pt_step **out)
{
    if (t->n_steps >= MAX_STEPS)
        return bk_error(BK_ERR_UNSUPPORTED, "%s: more than %d pre-tokenizers", t->path, MAX_STEPS);
    *out = &t->steps[t->n_steps++];
    memset(*out, 0, sizeof **out);
    return BK_OK;
}

static bk_status load_pretok(bk_tokenizer *t, const cJSON *p)
{
    if (!p || cJSON_IsNull(p))
        return BK_OK;
    const char *type = jstr(p, "type");
    if (!type)
        return bk_error(BK_ERR_CONFIG, "%s: pre_tokenizer without a \"type\"", t->path);
    bk_status st;
    pt_step *s = NULL;
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(p, "pretokenizers"), *it;
        if (!cJSON_IsArray(list))
            return bk_error(BK_ERR_CONFIG, "%s: pre_tokenizer Sequence without \"pretokenizers\"", t->path);
        cJSON_ArrayForEach(it, list)
        {
            if ((st = load_pretok(t, it)) != BK_OK)
                return st;
        }
        return BK_OK;
    }
    if (!strcmp(type, "ByteLevel")) {
        if ((st = add_step(t, &s)) != BK_OK)
            return st;
        s->kind = PT_BYTELEVEL;
        s->add_prefix_space = jbool(p, "add_prefix_space", 1);
        s->use_regex = jbool(p, "use_regex", 1);
        if (s->use_regex)
            return rx_compile(&s->re, GPT2_PATTERN, 0, t->path);
        return BK_OK;
    }
    if (!strcmp(type, "Digits")) {
        if ((st = add_step(t, &s)) != BK_OK)
            return st;
        s->kind = PT_DIGITS;
        s->behavior = SPLIT_ISOLATED;
        return rx_compile(&s->re, jbool(p, "individual_digits", 0) ? "\\p{N}" : "\\p{N}+", 0, t->path);
    }
    if (!strcmp(type, "Split")) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(p, "pattern");
        const char *re = jstr(pat, "Regex"), *lit = jstr(pat, "String");
        const char *beh = jstr(p, "behavior");
        if ((!re && !lit) || !beh)
            return bk_error(BK_ERR_CONFIG, "%s: Split pre-tokenizer needs \"pattern\" {\"Regex\"|\"String\"} and \"behavior\"",
                            t->path);
        if ((st = add_step(t, &s)) != BK_OK)
            return st;
        s->kind = PT_SPLIT;
        if (!strcmp(beh, "Removed"))
            s->behavior = SPLIT_REMOVED;
        else if (!strcmp(beh, "Isolated"))
            s->behavior = SPLIT_ISOLATED;
        else if (!strcmp(beh, "MergedWithPrevious"))
            s->behavior = SPLIT_MERGED_PREV;
        else if (!strcmp(beh, "MergedWithNext"))
            s->behavior = SPLIT_MERGED_NEXT;
        else if (!strcmp(beh, "Contiguous"))
            s->behavior = SPLIT_CONTIGUOUS;
        else
            return bk_error(BK_ERR_CONFIG, "%s: Split behavior '%s' is unknown", t->path, beh);
        s->invert = jbool(p, "invert", 0);
        if (lit && !lit[0])
            return bk_error(BK_ERR_UNSUPPORTED, "%s: Split on an empty string", t->path);
        return rx_compile(&s->re, re ? re : lit, !re, t->path);
    }
    return bk_error(BK_ERR_UNSUPPORTED,
                    "%s: pre-tokenizer '%s' is not supported (bakron's tokenizer implements Split, ByteLevel, Digits, Sequence: byte-level BPE as in Llama-3, Qwen2/3, GPT-2)",
                    t->path, type);
}

static int append_ids(int32_t **v, size_t *n, const int32_t *ids, size_t k)
{
    int32_t *q = realloc(*v, (*n + k + 1) * sizeof *q);
    if (!q)
        return -1;
    if (k)
        memcpy(q + *n, ids, k * sizeof *q);
    *v = q;
    *n += k;
    return 0;
}

/* ids of a special token given as ["<s>", 0] (Roberta / Bert). */
static bk_status pair_token(bk_tokenizer *t, const cJSON *pp, const char *what, int32_t *id)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(pp, what);
    const cJSON *num = cJSON_GetArrayItem(v, 1);
    if (!cJSON_IsArray(v) || !cJSON_IsNumber(num) || num->valuedouble < 0 || num->valuedouble > INT32_MAX)
        return bk_error(BK_ERR_CONFIG, "%s: post_processor \"%s\" must be [token, id]", t->path, what);
    *id = (int32_t)num->valuedouble;
    return BK_OK;
}

static bk_status load_post(bk_tokenizer *t, const cJSON *p)
{
    if (!p || cJSON_IsNull(p))
        return BK_OK;
    const char *type = jstr(p, "type");
    if (!type)
        return bk_error(BK_ERR_CONFIG, "%s: post_processor without a \"type\"", t->path);
    bk_status st;
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(p, "processors"), *it;
        if (!cJSON_IsArray(list))
            return bk_error(BK_ERR_CONFIG, "%s: post_processor Sequence without \"processors\"", t->path);
        cJSON_ArrayForEach(it, list)
        {
            if ((st = load_post(t, it)) != BK_OK)
                return st;
        }
        return BK_OK;
    }
    if (!strcmp(type, "ByteLevel"))
        return BK_OK; /* offsets only */
    int32_t pre[64], suf[64];
    size_t npre = 0, nsuf = 0;
    if (!strcmp(type, "RobertaProcessing") || !strcmp(type, "BertProcessing")) {
        if ((st = pair_token(t, p, "cls", &pre[0])) != BK_OK ||
            (st = pair_token(t, p, "sep", &suf[0])) != BK_OK)
            return st;
        npre = nsuf = 1;
    } else if (!strcmp(type, "TemplateProcessing")) {
        const cJSON *single = cJSON_GetObjectItemCaseSensitive(p, "single"), *it;
        const cJSON *special = cJSON_GetObjectItemCaseSensitive(p, "special_tokens");
        if (!cJSON_IsArray(single))
            return bk_error(BK_ERR_CONFIG, "%s: TemplateProcessing without a \"single\" template", t->path);
        int seen_a = 0;
        cJSON_ArrayForEach(it, single)
        {
            const cJSON *sp = cJSON_GetObjectItemCaseSensitive(it, "SpecialToken");
            if (cJSON_GetObjectItemCaseSensitive(it, "Sequence")) {
                seen_a = 1;
                continue;
            }
            const char *name = jstr(sp, "id");
            if (!name)
                return bk_error(BK_ERR_CONFIG, "%s: TemplateProcessing item is neither Sequence nor SpecialToken", t->path);
            const cJSON *ent = cJSON_GetObjectItemCaseSensitive(special, name);
            const cJSON *ids = cJSON_GetObjectItemCaseSensitive(ent, "ids"), *x;
            if (!cJSON_IsArray(ids))
                return bk_error(BK_ERR_CONFIG, "%s: TemplateProcessing special token '%s' has no \"ids\"",
                                t->path, name);
            cJSON_ArrayForEach(x, ids)
            {
                if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble > INT32_MAX)
                    return bk_error(BK_ERR_CONFIG, "%s: TemplateProcessing special token '%s': bad id", t->path, name);
                if ((seen_a ? nsuf : npre) >= 64)
                    return bk_error(BK_ERR_UNSUPPORTED, "%s: TemplateProcessing: too many special tokens", t->path);
                if (seen_a)
                    suf[nsuf++] = (int32_t)x->valuedouble;
                else
                    pre[npre++] = (int32_t)x->valuedouble;
            }
        }
    } else {
        return bk_error(BK_ERR_UNSUPPORTED,
                        "%s: post_processor '%s' is not supported (bakron's tokenizer implements TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing, Sequence)",
                        t->path, type);
    }
    /* a later processor wraps the result of the earlier ones */
    int32_t *np = NULL;
    size_t nn = 0;
    if (append_ids(&np, &nn, pre, npre) || append_ids(&np, &nn, t->post_pre, t->n_pre)) {
        free(np);
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    free(t->post_pre);
    t->post_pre = np;
    t->n_pre = nn;
    if (append_ids(&t->post_suf, &t->n_suf, suf, nsuf))
        return bk_error(BK_ERR_NOMEM, "out of memory");
    return BK_OK;
}

static bk_status normalize(bk_tokenizer *t, const char *s, size_t n, buf *out);

static int cmp_first_byte(const void *a, const void *b)
{
    const added_tok *x = *(added_tok *const *)a, *y = *(added_tok *const *)b;
    unsigned char cx = (unsigned char)x->content[0], cy = (unsigned char)y->content[0];
    if (cx != cy)
        return cx < cy ? -1 : 1;
    return x < y ? -1 : x > y;
}

static bk_status build_set(bk_tokenizer *t, added_set *set, int normalized)
{
    set->t = calloc(t->n_added + 1, sizeof *set->t);
    if (!set->t)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].normalized == normalized && t->added[i].len > 0)
            set->t[set->n++] = &t->added[i];
    qsort(set->t, set->n, sizeof *set->t, cmp_first_byte);
    size_t k = 0;
    for (int b = 0; b <= 256; b++) {
        while (k < set->n && (unsigned char)set->t[k]->content[0] < b)
            k++;
        set->first[b] = k;
    }
    return BK_OK;
}

static bk_status load_added(bk_tokenizer *t, const cJSON *list)
{
    if (!list || cJSON_IsNull(list))
        return BK_OK;
    if (!cJSON_IsArray(list))
        return bk_error(BK_ERR_CONFIG, "%s: \"added_tokens\" is not a list", t->path);
    int n = cJSON_GetArraySize(list);
    t->added = calloc((size_t)n + 1, sizeof *t->added);
    if (!t->added || strmap_init(&t->added_map, (size_t)n))
        return bk_error(BK_ERR_NOMEM, "out of memory");
    const cJSON *it;
    int64_t max_added = -1;
    cJSON_ArrayForEach(it, list)
    {
        const char *content = jstr(it, "content");
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "id");
        if (!content || !cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble > INT32_MAX)
            return bk_error(BK_ERR_CONFIG, "%s: added token %zu needs \"content\" and a non-negative \"id\"",
                            t->path, t->n_added);
        if (!content[0])
            continue; /* ignored by `tokenizers` too */
        added_tok *a = &t->added[t->n_added];
        int special = jbool(it, "special", 0);
        a->content = strdup(content);
        if (!a->content)
            return bk_error(BK_ERR_NOMEM, "out of memory");
        a->len = strlen(content);
        /* The id is assigned as `tokenizers` does when it loads the file (the
         * "id" field only feeds a warning there): a token of the model's
         * vocabulary keeps its id, a repeated one its first id, and a new one
         * gets the vocabulary's entry count, or the largest added id + 1 once
         * that is past it. Real files agree with their "id" fields. */
        int32_t vid = strmap_get(&t->vocab, content, a->len);
        if (vid < 0)
            vid = strmap_get(&t->added_map, content, a->len);
        if (vid < 0) {
            int64_t nv = (int64_t)t->vocab.n;
            vid = (int32_t)(max_added < 0 ? nv : (max_added >= nv || nv == 0) ? max_added + 1 : nv);
        }
        (void)id;
        a->id = vid;
        if (a->id > max_added)
            max_added = a->id;
        t->n_added++;
        a->single_word = jbool(it, "single_word", 0);
        a->lstrip = jbool(it, "lstrip", 0);
        a->rstrip = jbool(it, "rstrip", 0);
        a->normalized = jbool(it, "normalized", !special);
        if (strmap_put(&t->added_map, content, a->len, a->id))
            return bk_error(BK_ERR_NOMEM, "out of memory");
        if (a->id >= t->vocab_size)
            t->vocab_size = (int64_t)a->id + 1;
        if (a->single_word && !t->have_word_rx) {
            /* the Rust regex crate's \w: Alphabetic, marks, decimal digits, connector punctuation, joiners */
            bk_status st = rx_compile(&t->word_rx, "[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]", 0,
                                      t->path);
            if (st != BK_OK) {
                bk_clear_error();
                st = rx_compile(&t->word_rx, "[\\p{L}\\p{Nl}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]", 0, t->path);
            }
            if (st != BK_OK)
                return st;
            t->have_word_rx = 1;
        }
    }
    /* normalized tokens are matched in their normalized form */
    for (size_t i = 0; i < t->n_added; i++) {
        added_tok *a = &t->added[i];
        if (!a->normalized || !t->n_norm)
            continue;
        buf nb = {0};
        bk_status st = normalize(t, a->content, a->len, &nb);
        if (st != BK_OK) {
            free(nb.p);
            return st;
        }
        free(a->content);
        a->content = nb.p ? nb.p : strdup("");
        a->len = nb.n;
        if (!a->content)
            return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    bk_status st = build_set(t, &t->raw, 0);
    if (st == BK_OK)
        st = build_set(t, &t->normd, 1);
    return st;
}

static bk_status load_model(bk_tokenizer *t, const cJSON *m)
{
    if (!cJSON_IsObject(m))
        return bk_error(BK_ERR_CONFIG, "%s: no \"model\" object", t->path);
    const char *type = jstr(m, "type");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(m, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(m, "merges");
    if (type ? strcmp(type, "BPE") != 0 : !cJSON_IsArray(merges))
        return bk_error(BK_ERR_UNSUPPORTED,
                        "%s: model type '%s' is not supported (bakron's tokenizer implements byte-level BPE: Llama-3, Qwen2/3, GPT-2 style; not SentencePiece/Unigram, WordPiece or WordLevel)",
                        t->path, type ? type : "(none)");
    if (jbool(m, "byte_fallback", 0))
        return bk_error(BK_ERR_UNSUPPORTED,
                        "%s: BPE with byte_fallback (SentencePiece-style, e.g. Llama-2) is not supported", t->path);
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(m, "dropout");
    if (cJSON_IsNumber(dropout) && dropout->valuedouble > 0.0)
        return bk_error(BK_ERR_UNSUPPORTED, "%s: BPE dropout %g is random: not supported", t->path,
                        dropout->valuedouble);
    if (!cJSON_IsObject(vocab) || !cJSON_IsArray(merges))
        return bk_error(BK_ERR_CONFIG, "%s: BPE model needs \"vocab\" (object) and \"merges\" (list)", t->path);
    t->ignore_merges = jbool(m, "ignore_merges", 0);
    t->fuse_unk = jbool(m, "fuse_unk", 0);
    const char *pre = jstr(m, "continuing_subword_prefix"), *suf = jstr(m, "end_of_word_suffix");
    if (pre && pre[0] && !(t->cs_prefix = strdup(pre)))
        return bk_error(BK_ERR_NOMEM, "out of memory");
    if (suf && suf[0] && !(t->eow_suffix = strdup(suf)))
        return bk_error(BK_ERR_NOMEM, "out of memory");

    if (strmap_init(&t->vocab, (size_t)cJSON_GetArraySize(vocab)))
        return bk_error(BK_ERR_NOMEM, "out of memory");
    const cJSON *it;
    cJSON_ArrayForEach(it, vocab)
    {
        if (!cJSON_IsNumber(it) || it->valuedouble < 0 || it->valuedouble > INT32_MAX ||
            it->valuedouble != (double)(int32_t)it->valuedouble)
            return bk_error(BK_ERR_CONFIG, "%s: vocab entry '%s' has no valid id", t->path, it->string);
        int32_t id = (int32_t)it->valuedouble;
        if (strmap_put(&t->vocab, it->string, strlen(it->string), id))
            return bk_error(BK_ERR_NOMEM, "out of memory");
        if (id >= t->vocab_size)
            t->vocab_size = (int64_t)id + 1;
    }
    const char *unk = jstr(m, "unk_token");
    t->unk_id = -1;
    if (unk) {
        t->unk_id = strmap_get(&t->vocab, unk, strlen(unk));
        if (t->unk_id < 0)
            return bk_error(BK_ERR_CONFIG, "%s: unk_token '%s' is not in the vocabulary", t->path, unk);
    }
    if (mergemap_init(&t->merges, (size_t)cJSON_GetArraySize(merges)))
        return bk_error(BK_ERR_NOMEM, "out of memory");
    size_t pl = t->cs_prefix ? strlen(t->cs_prefix) : 0;
    buf nt = {0};
    uint32_t rank = 0;
    bk_status st = BK_OK;
    cJSON_ArrayForEach(it, merges)
    {
        const char *a, *b;
        size_t la, lb;
        char *sp = NULL;
        if (cJSON_IsString(it)) {
            a = it->valuestring;
            sp = strchr(a, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                st = bk_error(BK_ERR_CONFIG, "%s: merge %u '%s' is not two tokens separated by one space",
                              t->path, rank, a);
                break;
            }
            la = (size_t)(sp - a);
            b = sp + 1;
            lb = strlen(b);
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 &&
                   cJSON_IsString(cJSON_GetArrayItem(it, 0)) && cJSON_IsString(cJSON_GetArrayItem(it, 1))) {
            a = cJSON_GetArrayItem(it, 0)->valuestring;
            b = cJSON_GetArrayItem(it, 1)->valuestring;
            la = strlen(a);
            lb = strlen(b);
        } else {
            st = bk_error(BK_ERR_CONFIG, "%s: merge %u is neither \"a b\" nor [\"a\", \"b\"]", t->path, rank);
            break;
        }
        int32_t ia = strmap_get(&t->vocab, a, la), ib = strmap_get(&t->vocab, b, lb);
        /* the merged token: a + b without b's continuing-subword prefix */
        size_t skip = (pl && lb >= pl && !memcmp(b, t->cs_prefix, pl)) ? pl : 0;
        nt.n = 0;
        if (buf_add(&nt, a, la) || buf_add(&nt, b + skip, lb - skip)) {
            st = bk_error(BK_ERR_NOMEM, "out of memory");
            break;
        }
        int32_t in = strmap_get(&t->vocab, nt.p, nt.n);
        if (ia < 0 || ib < 0 || in < 0) {
            st = bk_error(BK_ERR_CONFIG, "%s: merge %u ('%.*s' + '%.*s'): '%s' is not in the vocabulary",
                          t->path, rank, (int)la, a, (int)lb, b, ia < 0 ? "left part" : ib < 0 ? "right part" : "result");
            break;
        }
        mergemap_put(&t->merges, ia, ib, rank, in);
        rank++;
    }
    free(nt.p);
    if (st != BK_OK)
        return st;
    /* ids of single characters, for the first step of BPE */
    for (uint32_t c = 0; c < 512; c++) {
        char u[4];
        size_t l = utf8_put(u, c);
        t->char_id[c] = strmap_get(&t->vocab, u, l);
    }
    return BK_OK;
}

bk_status bk_tokenizer_load(const char *path, bk_tokenizer **out)
{
    *out = NULL;
    cJSON *j;
    bk_status st = bk_read_json(path, MAX_TOKENIZER_JSON, &j);
    if (st != BK_OK)
        return st;
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return bk_error(BK_ERR_CONFIG, "%s: not a JSON object (a Hugging Face tokenizer.json was expected)", path);
    }
    bk_tokenizer *t = calloc(1, sizeof *t);
    if (!t || !(t->path = strdup(path))) {
        free(t);
        cJSON_Delete(j);
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    bytes_to_unicode(t->byte_cp);
    st = load_model(t, cJSON_GetObjectItemCaseSensitive(j, "model"));
    if (st == BK_OK)
        st = load_normalizer(t, cJSON_GetObjectItemCaseSensitive(j, "normalizer"));
    if (st == BK_OK)
        st = load_pretok(t, cJSON_GetObjectItemCaseSensitive(j, "pre_tokenizer"));
    if (st == BK_OK)
        st = load_added(t, cJSON_GetObjectItemCaseSensitive(j, "added_tokens"));
    if (st == BK_OK)
        st = load_post(t, cJSON_GetObjectItemCaseSensitive(j, "post_processor"));
    cJSON_Delete(j);
    if (st != BK_OK) {
        bk_tokenizer_free(t);
        return st;
    }
    *out = t;
    return BK_OK;
}

/* ------------------------------------------------------------ encoding */

static bk_status normalize(bk_tokenizer *t, const char *s, size_t n, buf *out)
{
    out->n = 0;
    if (buf_add(out, s, n))
        return bk_error(BK_ERR_NOMEM, "out of memory");
    for (int i = 0; i < t->n_norm; i++) {
        /* ASCII is its own normal form in all four */
        size_t k = 0;
        while (k < out->n && !((unsigned char)out->p[k] & 0x80))
            k++;
        if (k == out->n)
            return BK_OK;
        utf8proc_option_t o = UTF8PROC_STABLE;
        switch (t->norm[i]) {
        case NORM_NFC: o |= UTF8PROC_COMPOSE; break;
        case NORM_NFD: o |= UTF8PROC_DECOMPOSE; break;
        case NORM_NFKC: o |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
        default: o |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
        }
        utf8proc_uint8_t *dst = NULL;
        utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)out->p, (utf8proc_ssize_t)out->n, &dst, o);
        if (r < 0) {
            free(dst);
            return bk_error(r == UTF8PROC_ERROR_NOMEM ? BK_ERR_NOMEM : BK_ERR_INVALID_ARG,
                            "%s: normalization failed: %s", t->path, utf8proc_errmsg(r));
        }
        out->n = 0;
        int e = buf_add(out, dst, (size_t)r);
        free(dst);
        if (e)
            return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    return BK_OK;
}

/* -- BPE of one word */

static int heap_less(const struct hent *x, const struct hent *y)
{
    return x->rank != y->rank ? x->rank < y->rank : x->pos < y->pos;
}

static void heap_push(bk_tokenizer *t, uint32_t rank, uint32_t pos, int32_t new_id)
{
    struct hent *h = t->heap;
    size_t i = t->heap_n++;
    h[i] = (struct hent){rank, pos, new_id};
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&h[i], &h[p]))
            break;
        struct hent tmp = h[i];
        h[i] = h[p];
        h[p] = tmp;
        i = p;
    }
}

static struct hent heap_pop(bk_tokenizer *t)
{
    struct hent *h = t->heap, top = h[0];
    h[0] = h[--t->heap_n];
    size_t i = 0, n = t->heap_n;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && heap_less(&h[l], &h[m]))
            m = l;
        if (r < n && heap_less(&h[r], &h[m]))
            m = r;
        if (m == i)
            break;
        struct hent tmp = h[i];
        h[i] = h[m];
        h[m] = tmp;
        i = m;
    }
    return top;
}

static int32_t char_lookup(bk_tokenizer *t, const char *s, size_t l, uint32_t c, int first, int last)
{
    if (!(t->cs_prefix && !first) && !(t->eow_suffix && last))
        return c < 512 ? t->char_id[c] : strmap_get(&t->vocab, s, l);
    buf *w = &t->word;
    w->n = 0;
    if ((t->cs_prefix && !first && buf_add(w, t->cs_prefix, strlen(t->cs_prefix))) || buf_add(w, s, l) ||
        (t->eow_suffix && last && buf_add(w, t->eow_suffix, strlen(t->eow_suffix))))
        return -2;
    return strmap_get(&t->vocab, w->p, w->n);
}

static bk_status bpe(bk_tokenizer *t, const char *s, size_t n)
{
    if (n == 0)
        return BK_OK;
    if (t->ignore_merges) {
        int32_t id = strmap_get(&t->vocab, s, n);
        if (id >= 0)
            return ids_push(t->out, id) ? bk_error(BK_ERR_NOMEM, "out of memory") : BK_OK;
    }
    if (n + 1 > t->sym_cap) {
        size_t c = t->sym_cap ? t->sym_cap : 64;
        while (c < n + 1)
            c *= 2;
        void *a = realloc(t->sym, c * sizeof *t->sym), *b = NULL;
        if (a)
            t->sym = a;
        b = realloc(t->heap, 2 * c * sizeof *t->heap);
        if (!a || !b)
            return bk_error(BK_ERR_NOMEM, "out of memory");
        t->heap = b;
        t->sym_cap = c;
        t->heap_cap = 2 * c;
    }
    struct sym *sy = t->sym;
    int32_t ns = 0;
    int last_unk = 0;
    for (size_t i = 0; i < n;) {
        size_t l;
        uint32_t c = utf8_get(s + i, &l);
        int32_t id = char_lookup(t, s + i, l, c, i == 0, i + l == n);
        if (id == -2)
            return bk_error(BK_ERR_NOMEM, "out of memory");
        if (id < 0 && t->unk_id >= 0) {
            if (t->fuse_unk && last_unk) {
                sy[ns - 1].len += (uint32_t)l;
                i += l;
                continue;
            }
            id = t->unk_id;
            last_unk = 1;
        } else {
            last_unk = 0;
        }
        if (id >= 0) {
            sy[ns] = (struct sym){id, ns - 1, -1, (uint32_t)l};
            if (ns > 0)
                sy[ns - 1].next = ns;
            ns++;
        }
        i += l;
    }
    t->heap_n = 0;
    for (int32_t i = 0; i + 1 < ns; i++) {
        const merge_ent *m = mergemap_get(&t->merges, sy[i].c, sy[i + 1].c);
        if (m)
            heap_push(t, m->rank, (uint32_t)i, m->new_id);
    }
    while (t->heap_n > 0) {
        struct hent top = heap_pop(t);
        struct sym *cur = &sy[top.pos];
        if (cur->len == 0 || cur->next < 0)
            continue;
        int32_t nx = cur->next;
        const merge_ent *m = mergemap_get(&t->merges, cur->c, sy[nx].c);
        if (!m || m->new_id != top.new_id)
            continue; /* stale entry */
        cur->c = top.new_id;
        cur->len += sy[nx].len;
        cur->next = sy[nx].next;
        sy[nx].len = 0;
        if (cur->next >= 0)
            sy[cur->next].prev = (int32_t)top.pos;
        if (t->heap_n + 2 > t->heap_cap) {
            size_t c = t->heap_cap * 2;
            void *b = realloc(t->heap, c * sizeof *t->heap);
            if (!b)
                return bk_error(BK_ERR_NOMEM, "out of memory");
            t->heap = b;
            t->heap_cap = c;
        }
        if (cur->prev >= 0) {
            const merge_ent *pm = mergemap_get(&t->merges, sy[cur->prev].c, cur->c);
            if (pm)
                heap_push(t, pm->rank, (uint32_t)cur->prev, pm->new_id);
        }
        if (cur->next >= 0) {
            const merge_ent *nm = mergemap_get(&t->merges, cur->c, sy[cur->next].c);
            if (nm)
                heap_push(t, nm->rank, top.pos, nm->new_id);
        }
    }
    for (int32_t i = 0; i < ns; i++)
        if (sy[i].len && ids_push(t->out, sy[i].c))
            return bk_error(BK_ERR_NOMEM, "out of memory");
    return BK_OK;
}

/* -- pre-tokenization: step k applied to one piece, then the next steps */

static bk_status split_spans(int behavior, int invert, spans *in, spans *out)
{
    out->n = 0;
    for (size_t i = 0; i < in->n; i++)
        if (invert)
            in->s[i].m = !in->s[i].m;
    int prev_match = 0;
    if (behavior == SPLIT_MERGED_NEXT) {
        /* walk backwards, then reverse */
        for (size_t r = in->n; r-- > 0;) {
            span sp = in->s[r];
            if (sp.m && !prev_match && out->n > 0)
                out->s[out->n - 1].a = sp.a;
            else if (spans_push(out, sp.a, sp.b, 0))
                return BK_ERR_NOMEM;
            prev_match = sp.m;
        }
        for (size_t i = 0, k = out->n; i < k / 2; i++) {
            span tmp = out->s[i];
            out->s[i] = out->s[k - 1 - i];
            out->s[k - 1 - i] = tmp;
        }
        return BK_OK;
    }
    for (size_t i = 0; i < in->n; i++) {
        span sp = in->s[i];
        int push = 1;
        switch (behavior) {
        case SPLIT_REMOVED: push = !sp.m; break;
        case SPLIT_ISOLATED: break;
        case SPLIT_CONTIGUOUS:
            if (out->n > 0 && sp.m == prev_match) {
                out->s[out->n - 1].b = sp.b;
                push = 0;
            }
            break;
        case SPLIT_MERGED_PREV:
            if (sp.m && !prev_match && out->n > 0) {
                out->s[out->n - 1].b = sp.b;
                push = 0;
            }
            break;
        }
        /* Contiguous / MergedWithPrevious: the first span is pushed whatever it is */
        if (push && spans_push(out, sp.a, sp.b, 0))
            return BK_ERR_NOMEM;
        prev_match = sp.m;
    }
    return BK_OK;
}

static bk_status pretok(bk_tokenizer *t, int k, const char *s, size_t n)
{
    if (n == 0)
        return BK_OK;
    if (k == t->n_steps)
        return bpe(t, s, n);
    pt_step *st = &t->steps[k];
    level *L = &t->lv[k];
    bk_status r;
    if (st->kind == PT_SPLIT || st->kind == PT_DIGITS) {
        if ((r = rx_find(&st->re, s, n, &L->sp)) != BK_OK)
            return r;
        if (split_spans(st->behavior, st->invert, &L->sp, &L->sp2) != BK_OK)
            return bk_error(BK_ERR_NOMEM, "out of memory");
        for (size_t i = 0; i < L->sp2.n; i++)
            if ((r = pretok(t, k + 1, s + L->sp2.s[i].a, L->sp2.s[i].b - L->sp2.s[i].a)) != BK_OK)
                return r;
        return BK_OK;
    }
    /* ByteLevel */
    const char *src = s;
    size_t sn = n;
    if (st->add_prefix_space && s[0] != ' ') {
        L->a.n = 0;
        if (buf_add(&L->a, " ", 1) || buf_add(&L->a, s, n))
            return bk_error(BK_ERR_NOMEM, "out of memory");
        src = L->a.p;
        sn = L->a.n;
    }
    L->sp2.n = 0;
    if (st->use_regex) {
        if ((r = rx_find(&st->re, src, sn, &L->sp)) != BK_OK)
            return r;
        if (split_spans(SPLIT_ISOLATED, 0, &L->sp, &L->sp2) != BK_OK)
            return bk_error(BK_ERR_NOMEM, "out of memory");
    } else if (spans_push(&L->sp2, 0, sn, 0)) {
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < L->sp2.n; i++) {
        size_t a = L->sp2.s[i].a, b = L->sp2.s[i].b;
        if (buf_reserve(&L->b, 2 * (b - a) + 1))
            return bk_error(BK_ERR_NOMEM, "out of memory");
        size_t o = 0;
        for (size_t j = a; j < b; j++)
            o += utf8_put(L->b.p + o, t->byte_cp[(unsigned char)src[j]]);
        L->b.n = o;
        if ((r = pretok(t, k + 1, L->b.p, o)) != BK_OK)
            return r;
    }
    return BK_OK;
}

/* -- added tokens */

static int word_char_before(bk_tokenizer *t, const char *s, size_t end)
{
    if (end == 0)
        return 0;
    size_t i = end - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80)
        i--;
    int rc = pcre2_match(t->word_rx.code, (PCRE2_SPTR)(s + i), end - i, 0, PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK,
                         t->word_rx.md, NULL);
    return rc > 0;
}

static int word_char_at(bk_tokenizer *t, const char *s, size_t n, size_t at)
{
    if (at >= n)
        return 0;
    size_t l = utf8_len((unsigned char)s[at]);
    int rc = pcre2_match(t->word_rx.code, (PCRE2_SPTR)(s + at), l, 0, PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK,
                         t->word_rx.md, NULL);
    return rc > 0;
}

/* Spans of s covering it all: added tokens (m = 1 + index into set->t) and
 * the text between them (m = 0). */
static bk_status find_added(bk_tokenizer *t, const added_set *set, const char *s, size_t n, spans *out)
{
    out->n = 0;
    size_t start_off = 0, i = 0;
    while (set->n && i < n) {
        unsigned char c = (unsigned char)s[i];
        const added_tok *best = NULL;
        size_t best_k = 0;
        for (size_t k = set->first[c]; k < set->first[c + 1]; k++) {
            const added_tok *a = set->t[k];
            if (a->len <= n - i && (!best || a->len > best->len) && !memcmp(s + i, a->content, a->len)) {
                best = a;
                best_k = k;
            }
        }
        if (!best) {
            i++;
            continue;
        }
        size_t start = i, stop = i + best->len;
        i = stop; /* the next match starts after this one, kept or not */
        if (best->single_word &&
            (word_char_before(t, s, start) || word_char_at(t, s, n, stop)))
            continue;
        if (best->lstrip) {
            size_t ns = start;
            while (ns > 0) {
                size_t p = ns - 1, l;
                while (p > 0 && ((unsigned char)s[p] & 0xC0) == 0x80)
                    p--;
                if (!is_white_space(utf8_get(s + p, &l)))
                    break;
                ns = p;
            }
            start = ns > start_off ? ns : start_off;
        }
        if (best->rstrip) {
            size_t l;
            while (stop < n && is_white_space(utf8_get(s + stop, &l)))
                stop += l;
            /* the search goes on from the match's end, not past the stripped spaces */
        }
        if (start_off < start && spans_push(out, start_off, start, 0))
            return bk_error(BK_ERR_NOMEM, "out of memory");
        if (spans_push(out, start, stop, (int)best_k + 1))
            return bk_error(BK_ERR_NOMEM, "out of memory");
        start_off = stop;
    }
    if (start_off < n && spans_push(out, start_off, n, 0))
        return bk_error(BK_ERR_NOMEM, "out of memory");
    return BK_OK;
}

bk_status bk_tokenizer_encode(bk_tokenizer *t, const char *text, size_t len, int add_special,
                              bk_token_ids *out)
{
    size_t bad = bk_utf8_invalid_at((const unsigned char *)text, len);
    if (bad < len)
        return bk_error(BK_ERR_INVALID_ARG, "tokenizer: text is not valid UTF-8 at byte %zu", bad);
    t->out = out;
    bk_status st = BK_OK;
    if (add_special)
        for (size_t i = 0; i < t->n_pre; i++)
            if (ids_push(out, t->post_pre[i]))
                return bk_error(BK_ERR_NOMEM, "out of memory");
    if ((st = find_added(t, &t->raw, text, len, &t->seg_raw)) != BK_OK)
        return st;
    for (size_t i = 0; i < t->seg_raw.n && st == BK_OK; i++) {
        span a = t->seg_raw.s[i];
        if (a.m) {
            if (ids_push(out, t->raw.t[a.m - 1]->id))
                return bk_error(BK_ERR_NOMEM, "out of memory");
            continue;
        }
        const char *p = text + a.a;
        size_t pn = a.b - a.a;
        if (t->n_norm) {
            if ((st = normalize(t, p, pn, &t->norm_buf)) != BK_OK)
                return st;
            p = t->norm_buf.p;
            pn = t->norm_buf.n;
        }
        if ((st = find_added(t, &t->normd, p, pn, &t->seg_norm)) != BK_OK)
            return st;
        for (size_t j = 0; j < t->seg_norm.n && st == BK_OK; j++) {
            span b = t->seg_norm.s[j];
            if (b.m) {
                if (ids_push(out, t->normd.t[b.m - 1]->id))
                    return bk_error(BK_ERR_NOMEM, "out of memory");
            } else {
                st = pretok(t, 0, p + b.a, b.b - b.a);
            }
        }
    }
    if (st == BK_OK && add_special)
        for (size_t i = 0; i < t->n_suf; i++)
            if (ids_push(out, t->post_suf[i]))
                return bk_error(BK_ERR_NOMEM, "out of memory");
    return st;
}
