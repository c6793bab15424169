/* Output folders (internal): safety checks, the run's lock, leftovers of
 * killed runs, the work folder and the atomic commit. docs/formats.md
 * ("Output folders") describes the behaviour.
 *
 *   bk_outdir_open    refuse an unsafe --out (exit 1) before any work, take the
 *                     lock PARENT/.NAME.lock (exit 3 when another run holds it),
 *                     clean leftovers of killed runs (NAME.tmp-PID,
 *                     NAME.old-PID), create the work folder NAME.tmp-PID;
 *   bk_outdir_commit  fsync the work folder and put it in place atomically
 *                     (replacing an old output only with overwrite: swapped in
 *                     one rename, the old one deleted afterwards);
 *   bk_outdir_close   remove the work folder unless committed or kept (resume),
 *                     release the lock.
 */
#ifndef BK_OUTDIR_H
#define BK_OUTDIR_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/status.h"

#define BK_PATH_MAX 4096

/* Where notes go (stale lock cleared, leftover removed, old output restored). */
typedef void (*bk_note_fn)(void *user, const char *message);

typedef struct bk_outdir {
    char final[BK_PATH_MAX]; /* the output folder as given, without trailing '/' */
    char canon[BK_PATH_MAX]; /* its canonical absolute path */
    char work[BK_PATH_MAX];  /* FINAL.tmp-PID: where the run builds the output */
    char lock[BK_PATH_MAX];  /* PARENT/.NAME.lock */
    int lock_fd;             /* -1: not held */
    int overwrite;
    int committed;
    int keep_work;           /* leave the work folder in place on close (resume) */
    bk_note_fn note;
    void *user;
} bk_outdir;

/* Resume hooks: whether a leftover work folder holds a resumable run (and a
 * description for the note), decided by the caller. NULL: none resumable. */
typedef int (*bk_outdir_resumable_fn)(void *user, const char *work_dir);

typedef struct bk_outdir_spec {
    const char *out;                /* --out */
    const char *const *inputs;      /* paths the job reads (files or folders), NULL-terminated */
    int overwrite;                  /* --overwrite */
    const char *what;               /* "quantize", "dump-activations" (messages) */
    bk_note_fn note;
    void *user;
    /* resume: a leftover work folder for which resumable() says 1 is adopted
     * (renamed to this run's work folder) instead of removed */
    int resume;
    bk_outdir_resumable_fn resumable;
    void *resumable_user;
} bk_outdir_spec;

/* Checks, lock, leftovers, work folder (see above). *adopted (when not NULL)
 * is set to 1 when a killed run's work folder was taken over (resume). On
 * failure nothing is held. */
bk_status bk_outdir_open(bk_outdir *d, const bk_outdir_spec *spec, int *adopted);
bk_status bk_outdir_commit(bk_outdir *d);
/* The checks of bk_outdir_open without its side effects (no lock taken, no
 * folder created, nothing removed): an empty, unsafe or existing non-empty
 * --out without overwrite (BK_ERR_USAGE), an output that cannot be created
 * where asked (BK_ERR_WRITE). *free_bytes (when not NULL): free space of the
 * filesystem the output goes to, 0 when unknown. */
bk_status bk_outdir_check(const bk_outdir_spec *s, uint64_t *free_bytes);
void bk_outdir_close(bk_outdir *d);

/* Canonical absolute form of a path that may not exist yet: the existing
 * prefix resolved by realpath (symbolic links followed), the rest normalized
 * lexically ("." and ".." removed). */
bk_status bk_path_canonical(const char *path, char *out, size_t cap);

#endif /* BK_OUTDIR_H */
