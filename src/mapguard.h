/* Guard for memory-mapped input files (internal).
 *
 * A file that shrinks while it is mapped makes every read of its lost tail a
 * SIGBUS, on whatever thread reads it (the weight prefetch thread, the
 * writer thread, a CUDA copy). The guard registers each mapped range; its
 * SIGBUS handler replaces the lost pages of a registered range with zero
 * pages, marks the range as faulted and returns, so the read completes (with
 * zeros) instead of killing the process. The reader then notices the change
 * (bk_mapguard_faulted, and the size/mtime check of bk_st_check_unchanged)
 * before it uses or commits anything, and fails with the file named.
 *
 * Cost: nothing on the read path (no copies, no per-read checks); one
 * sigaction per process and a few atomic stores per mapped file. A SIGBUS at
 * an address outside every registered range is passed to the previous
 * handler (or ends the process as before). */
#ifndef BK_MAPGUARD_H
#define BK_MAPGUARD_H

#include <stddef.h>

/* Register [base, base + len) (a mapping of a file). Returns a slot id >= 0,
 * or -1 when the table is full (the range is then unguarded). */
int bk_mapguard_add(const void *base, size_t len);
/* Unregister (before munmap). slot < 0 is ignored. */
void bk_mapguard_remove(int slot);
/* 1 if a SIGBUS was absorbed in that range (some of it now reads as zeros). */
int bk_mapguard_faulted(int slot);

#endif /* BK_MAPGUARD_H */
