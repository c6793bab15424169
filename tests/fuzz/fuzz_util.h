/* Shared by the fuzz targets that read files from disk: a per-process
 * temporary folder (removed at exit) and whole-file writes. */
#ifndef BK_FUZZ_UTIL_H
#define BK_FUZZ_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bakron/status.h"

static char fz_dir[256];
static char fz_files[8][600];
static int fz_nfiles;

static inline void fz_cleanup(void)
{
    for (int i = 0; i < fz_nfiles; i++)
        unlink(fz_files[i]);
    if (fz_dir[0])
        rmdir(fz_dir);
}

/* The folder (created on first use). */
static inline const char *fz_tmpdir(void)
{
    if (!fz_dir[0]) {
        const char *t = getenv("TMPDIR");
        snprintf(fz_dir, sizeof fz_dir, "%s/bk-fuzz-XXXXXX", t && t[0] ? t : "/tmp");
        if (!mkdtemp(fz_dir)) {
            perror("mkdtemp");
            abort();
        }
        atexit(fz_cleanup);
    }
    return fz_dir;
}

/* Write data as fz_tmpdir()/name (registered for removal); the full path in out. */
static inline void fz_write(const char *name, const void *data, size_t n, char *out, size_t cap)
{
    snprintf(out, cap, "%s/%s", fz_tmpdir(), name);
    int known = 0;
    for (int i = 0; i < fz_nfiles; i++)
        known |= !strcmp(fz_files[i], out);
    if (!known && fz_nfiles < 8)
        snprintf(fz_files[fz_nfiles++], sizeof fz_files[0], "%s", out);
    FILE *f = fopen(out, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n)) {
        perror(out);
        abort();
    }
    fclose(f);
}

/* A rejection must leave exactly one non-empty line. */
static inline void fz_check_message(void)
{
    const char *m = bk_last_error();
    if (!m[0] || strchr(m, '\n'))
        abort();
}

#endif
