/* SIGBUS guard for mapped input files: see mapguard.h. */
#include "mapguard.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SLOTS 4096

static struct {
    _Atomic uintptr_t base; /* 0: free */
    _Atomic size_t len;
    _Atomic int faulted;
} g_slot[SLOTS];

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction g_prev;
static uintptr_t g_page = 4096;

static void on_sigbus(int sig, siginfo_t *si, void *uc)
{
    const int saved = errno;
    const uintptr_t a = (uintptr_t)si->si_addr;
    for (int i = 0; i < SLOTS; i++) {
        const uintptr_t b = atomic_load(&g_slot[i].base);
        const size_t n = atomic_load(&g_slot[i].len);
        if (!b || a < b || a - b >= n)
            continue;
        /* the rest of the range from the faulting page on: zero pages (the
         * file lost them; one signal per shrink, not one per page) */
        const uintptr_t page = a & ~(g_page - 1);
        void *r = mmap((void *)page, (size_t)(b + n - page), PROT_READ,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        if (r != MAP_FAILED) {
            atomic_store(&g_slot[i].faulted, 1);
            errno = saved;
            return; /* the read is retried and now sees zeros */
        }
        break;
    }
    /* not a guarded range: what would have happened without the guard */
    if ((g_prev.sa_flags & SA_SIGINFO) && g_prev.sa_sigaction) {
        g_prev.sa_sigaction(sig, si, uc);
    } else if (!(g_prev.sa_flags & SA_SIGINFO) && g_prev.sa_handler != SIG_DFL &&
               g_prev.sa_handler != SIG_IGN) {
        g_prev.sa_handler(sig);
    } else {
        signal(SIGBUS, SIG_DFL); /* the access faults again and ends the process */
    }
    errno = saved;
}

/* (under g_mu) Our handler in place; installed again when someone replaced it
 * since (a test harness, a library restoring what it found). */
static void install(void)
{
    long p = sysconf(_SC_PAGESIZE);
    if (p > 0)
        g_page = (uintptr_t)p;
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) == 0 && (cur.sa_flags & SA_SIGINFO) &&
        cur.sa_sigaction == on_sigbus)
        return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_prev);
}

int bk_mapguard_add(const void *base, size_t len)
{
    if (!base || !len)
        return -1;
    int slot = -1;
    pthread_mutex_lock(&g_mu);
    install();
    for (int i = 0; i < SLOTS; i++) {
        if (atomic_load(&g_slot[i].base) == 0) {
            atomic_store(&g_slot[i].faulted, 0);
            atomic_store(&g_slot[i].len, len);
            atomic_store(&g_slot[i].base, (uintptr_t)base);
            slot = i;
            break;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return slot;
}

void bk_mapguard_remove(int slot)
{
    if (slot < 0 || slot >= SLOTS)
        return;
    pthread_mutex_lock(&g_mu);
    atomic_store(&g_slot[slot].base, 0);
    atomic_store(&g_slot[slot].len, 0);
    pthread_mutex_unlock(&g_mu);
}

int bk_mapguard_faulted(int slot)
{
    if (slot < 0 || slot >= SLOTS)
        return 0;
    return atomic_load(&g_slot[slot].faulted);
}
