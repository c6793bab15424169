/* Calibration / evaluation windows from plain text (--calib-text, eval --text),
 * tokenized with the model's own tokenizer.json. The same windows as
 * scripts/tokenize.py --model MODEL_DIR --seqlen T [--samples N] makes:
 *
 *   - the inputs: one file, or every file under a folder (recursively; a
 *     symbolic link to a folder is not followed), sorted by path;
 *   - each file is read as Python's open(f, encoding="utf-8",
 *     errors="replace") reads it: invalid UTF-8 becomes U+FFFD (one per
 *     maximal invalid subsequence), "\r\n" and lone "\r" become "\n";
 *   - each document is tokenized on its own (added/special tokens written in
 *     the text are recognized; no post-processor BOS) and followed by the
 *     tokens of a blank line ("\n\n"); the documents are concatenated;
 *   - the stream is cut into consecutive windows of T - 1 tokens, each
 *     preceded by BOS (config.json's bos_token_id; windows of T tokens when
 *     the model has none); the remainder is dropped; the first N windows are
 *     used (all by default).
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bakron/pipeline.h"
#include "bakron/tokenizer.h"
#include "util.h"

#define MAX_TEXT_FILE ((size_t)1 << 32)

typedef struct pathlist {
    char **p;
    size_t n, cap;
} pathlist;

static void pathlist_free(pathlist *l)
{
    for (size_t i = 0; i < l->n; i++)
        free(l->p[i]);
    free(l->p);
}

static bk_status pathlist_add(pathlist *l, const char *dir, const char *name)
{
    if (l->n == l->cap) {
        size_t c = l->cap ? l->cap * 2 : 64;
        char **q = realloc(l->p, c * sizeof *q);
        if (!q)
            return bk_error(BK_ERR_NOMEM, "out of memory");
        l->p = q;
        l->cap = c;
    }
    size_t ld = dir ? strlen(dir) : 0, ln = strlen(name);
    char *s = malloc(ld + ln + 2);
    if (!s)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    size_t o = 0;
    if (ld) {
        memcpy(s, dir, ld);
        o = ld;
        if (dir[ld - 1] != '/')
            s[o++] = '/';
    }
    memcpy(s + o, name, ln + 1);
    l->p[l->n++] = s;
    return BK_OK;
}

static bk_status walk(const char *dir, pathlist *out, int depth)
{
    if (depth > 64)
        return bk_error(BK_ERR_CALIB, "%s: folders nested more than 64 deep", dir);
    DIR *d = opendir(dir);
    if (!d)
        return bk_error(BK_ERR_IO, "%s: cannot open the folder: %s", dir, strerror(errno));
    pathlist sub = {0};
    bk_status st = BK_OK;
    struct dirent *e;
    while (st == BK_OK && (e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        if ((st = pathlist_add(&sub, dir, e->d_name)) != BK_OK)
            break;
        const char *p = sub.p[sub.n - 1];
        struct stat sb, lsb;
        if (stat(p, &sb) == 0 && S_ISDIR(sb.st_mode)) {
            if (lstat(p, &lsb) == 0 && !S_ISLNK(lsb.st_mode))
                st = walk(p, out, depth + 1);
        } else {
            st = pathlist_add(out, NULL, p);
        }
    }
    closedir(d);
    pathlist_free(&sub);
    return st;
}

static int cmp_path(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Python's UTF-8 decoding with errors="replace" followed by universal
 * newlines, into a new buffer (U+FFFD takes 3 bytes where one invalid byte
 * stood: at most 3n bytes). */
static bk_status py_text(const char *in, size_t n, char **out, size_t *outn)
{
    /* worst case: every byte invalid -> 3 bytes each */
    char *o = bk_alloc(3 * n + 1, 1);
    if (!o)
        return bk_error(BK_ERR_NOMEM, "out of memory for %zu bytes of text", n);
    const unsigned char *u = (const unsigned char *)in;
    size_t i = 0, k = 0;
    while (i < n) {
        unsigned char c = u[i];
        if (c < 0x80) {
            if (c == '\r') {
                o[k++] = '\n';
                i += (i + 1 < n && u[i + 1] == '\n') ? 2 : 1;
            } else {
                o[k++] = (char)c;
                i++;
            }
            continue;
        }
        unsigned char lo, hi;
        const size_t l = bk_utf8_lead(c, &lo, &hi); /* (c >= 0x80 here: 0 or 2..4) */
        /* length of the valid prefix of the sequence starting here */
        size_t v = 0;
        if (l) {
            v = 1;
            if (i + 1 < n && u[i + 1] >= lo && u[i + 1] <= hi) {
                v = 2;
                while (v < l && i + v < n && (u[i + v] & 0xC0) == 0x80)
                    v++;
            }
        }
        if (l && v == l) {
            memcpy(o + k, in + i, l);
            k += l;
            i += l;
        } else {
            /* one U+FFFD for the maximal invalid subpart */
            memcpy(o + k, "\xEF\xBF\xBD", 3);
            k += 3;
            i += v ? v : 1;
        }
    }
    o[k] = '\0';
    *out = o;
    *outn = k;
    return BK_OK;
}

int64_t bk_text_default_seqlen(int64_t max_positions)
{
    return (max_positions > 0 && max_positions < 2048) ? max_positions : 2048;
}

bk_status bk_load_text_tokens(const char *model_dir, const char *text_path, int64_t vocab,
                              int64_t bos_id, int64_t samples, int64_t seqlen, int32_t **tokens,
                              int64_t *S, int64_t *T)
{
    *tokens = NULL;
    *S = *T = 0;
    char tj[4096];
    bk_status st = bk_path_join(tj, sizeof tj, model_dir, "tokenizer.json");
    if (st != BK_OK)
        return st;
    struct stat sb;
    if (stat(tj, &sb) != 0)
        return bk_error(BK_ERR_CALIB,
                        "%s: not found: plain-text calibration needs the model's tokenizer.json "
                        "(or give token ids with --calib, made by scripts/tokenize.py)",
                        tj);
    if (seqlen < 2)
        return bk_error(BK_ERR_CALIB, "%s: the window length %lld must be at least 2", text_path,
                        (long long)seqlen);
    pathlist files = {0};
    bk_tokenizer *tk = NULL;
    bk_token_ids ids = {0}, sep = {0};
    char *raw = NULL, *txt = NULL;
    int32_t *out = NULL;

    if (stat(text_path, &sb) != 0) {
        st = bk_error(BK_ERR_CALIB, "%s: no such file or folder", text_path);
        goto done;
    }
    if (S_ISDIR(sb.st_mode))
        st = walk(text_path, &files, 0);
    else
        st = pathlist_add(&files, NULL, text_path);
    if (st != BK_OK)
        goto done;
    if (files.n == 0) {
        st = bk_error(BK_ERR_CALIB, "%s: no files in the folder", text_path);
        goto done;
    }
    qsort(files.p, files.n, sizeof *files.p, cmp_path);

    if ((st = bk_tokenizer_load(tj, &tk)) != BK_OK)
        goto done;
    if ((st = bk_tokenizer_encode(tk, "\n\n", 2, 0, &sep)) != BK_OK)
        goto done;
    for (size_t f = 0; f < files.n; f++) {
        size_t rn = 0, tn = 0;
        if ((st = bk_read_file(files.p[f], MAX_TEXT_FILE, &raw, &rn)) != BK_OK)
            goto done;
        if ((st = py_text(raw, rn, &txt, &tn)) != BK_OK)
            goto done;
        free(raw);
        raw = NULL;
        if ((st = bk_tokenizer_encode(tk, txt, tn, 0, &ids)) != BK_OK) {
            bk_error_prefix(st, files.p[f]);
            goto done;
        }
        free(txt);
        txt = NULL;
        /* the blank line between documents */
        size_t need = ids.n + sep.n;
        if (need > ids.cap) {
            int32_t *q = realloc(ids.ids, need * sizeof *q);
            if (!q) {
                st = bk_error(BK_ERR_NOMEM, "out of memory");
                goto done;
            }
            ids.ids = q;
            ids.cap = need;
        }
        memcpy(ids.ids + ids.n, sep.ids, sep.n * sizeof *sep.ids);
        ids.n = need;
    }
    {
        int use_bos = bos_id >= 0;
        int64_t body = seqlen - use_bos;
        int64_t nwin = (int64_t)ids.n / body;
        if (nwin == 0) {
            st = bk_error(BK_ERR_CALIB,
                          "%s: %zu file(s) give %zu tokens: not enough for one window of %lld "
                          "(use a smaller --seqlen or more text)",
                          text_path, files.n, ids.n, (long long)seqlen);
            goto done;
        }
        int64_t take = samples > 0 ? samples : nwin;
        if (take > nwin) {
            st = bk_error(BK_ERR_CALIB,
                          "%s: asked for %lld windows of %lld tokens, the text gives %lld "
                          "(%zu tokens)",
                          text_path, (long long)take, (long long)seqlen, (long long)nwin, ids.n);
            goto done;
        }
        out = bk_alloc((size_t)(take * seqlen), sizeof *out);
        if (!out) {
            st = bk_error(BK_ERR_NOMEM, "out of memory for %lld x %lld tokens", (long long)take,
                          (long long)seqlen);
            goto done;
        }
        for (int64_t w = 0; w < take; w++) {
            int32_t *row = out + w * seqlen;
            if (use_bos)
                row[0] = (int32_t)bos_id;
            memcpy(row + use_bos, ids.ids + w * body, (size_t)body * sizeof *row);
        }
        for (int64_t i = 0; i < take * seqlen; i++) {
            if (out[i] < 0 || (vocab > 0 && out[i] >= vocab)) {
                st = bk_error(BK_ERR_CALIB,
                              "%s: token id %d (window %lld) is outside the model's vocabulary "
                              "[0, %lld): tokenizer.json and config.json disagree",
                              tj, out[i], (long long)(i / seqlen), (long long)vocab);
                goto done;
            }
        }
        *tokens = out;
        out = NULL;
        *S = take;
        *T = seqlen;
    }
done:
    free(out);
    free(raw);
    free(txt);
    bk_token_ids_free(&ids);
    bk_token_ids_free(&sep);
    bk_tokenizer_free(tk);
    pathlist_free(&files);
    return st;
}
