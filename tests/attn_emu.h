/* The host emulation of the fused attention kernels' warp operations and
 * CTA scheduling (see tests/test_attn_flash_emu.cu for what is emulated and
 * checked), shared by test_attn_flash_emu.cu and test_attn_bwd_emu.cu. Include
 * before the kernel source (cuda/attn_flash_kernel.cuh, and
 * cuda/attn_flash_bwd_kernel.cuh). One translation unit per test. */
#ifndef BK_TEST_ATTN_EMU_H
#define BK_TEST_ATTN_EMU_H

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda_bf16.h>

#define FA_EMU
#define FA_DEV static inline
#define FA_KERNEL(threads) void
#define FB_KERNEL(threads, minb) void
#define FA_TID ((unsigned)emu_cur)
#define FA_BID ((int64_t)emu_bid)
#define FA_SHARED(name) unsigned char *name = emu_smem

static int emu_cur;
static int64_t emu_bid;
static unsigned char *emu_smem;
static size_t emu_smem_size;
static int emu_failures;
static int emu_immediate; /* cp.async completes at issue */

#define EMU_FAIL(...)                                                                              \
    do {                                                                                           \
        fprintf(stderr, "emulation: " __VA_ARGS__);                                                \
        fprintf(stderr, "\n");                                                                     \
        exit(1);                                                                                   \
    } while (0)

/* --------------------------------------------------------- coroutines */

enum { RUNNABLE = 0, WAIT_WARP = 1, WAIT_CTA = 2 };
struct lane_t {
    ucontext_t ctx;
    std::vector<char> stack;
    int state, done, tag;
    /* cp.async */
    struct pend {
        uint32_t dst;
        const void *src;
        bool valid;
        int group;
    };
    std::vector<pend> pending;
    int group;
};
static lane_t emu_lanes[256];
static ucontext_t emu_sched;
static uint64_t emu_x[8][32][8]; /* per warp, per lane: deposited operands */

static void emu_wait(int state, int tag)
{
    lane_t &l = emu_lanes[emu_cur];
    l.state = state;
    l.tag = tag;
    swapcontext(&l.ctx, &emu_sched);
}

/* one warp operation: deposit, all arrive, compute, all leave */
static void warp_arrive(int tag)
{
    emu_wait(WAIT_WARP, tag);
}

/* ----------------------------------------------------- global memory map */

struct region {
    const void *p;
    size_t bytes;
};
static std::vector<region> emu_inputs;

static void check_global(const void *src)
{
    const char *s = static_cast<const char *>(src);
    if ((uintptr_t)s % 16)
        EMU_FAIL("cp.async source %p not 16-byte aligned", src);
    for (const region &r : emu_inputs) {
        const char *b = static_cast<const char *>(r.p);
        if (s >= b && s + 16 <= b + r.bytes)
            return;
    }
    EMU_FAIL("cp.async source %p outside the inputs (CTA %lld, thread %d)", src, (long long)emu_bid,
             emu_cur);
}

static void check_shared(uint32_t a, const char *what)
{
    if (a % 16 || (size_t)a + 16 > emu_smem_size)
        EMU_FAIL("%s shared address %u (size %zu) misaligned or out of bounds (CTA %lld, "
                 "thread %d)",
                 what, a, emu_smem_size, (long long)emu_bid, emu_cur);
}

/* ------------------------------------------------------ the operations */

static inline uint32_t smem_addr(const void *p)
{
    const unsigned char *c = static_cast<const unsigned char *>(p);
    if (c < emu_smem || c > emu_smem + emu_smem_size)
        EMU_FAIL("smem_addr of a pointer outside shared memory");
    return (uint32_t)(c - emu_smem);
}

static void complete(const lane_t::pend &q)
{
    if (q.valid)
        memcpy(emu_smem + q.dst, q.src, 16);
    else
        memset(emu_smem + q.dst, 0, 16);
}

static inline void cp_async16(uint32_t dst, const void *src, bool valid)
{
    check_shared(dst, "cp.async");
    if (valid)
        check_global(src);
    lane_t &l = emu_lanes[emu_cur];
    lane_t::pend q = {dst, src, valid, l.group};
    if (emu_immediate)
        complete(q);
    else
        l.pending.push_back(q);
}
static inline void cp_async_commit()
{
    emu_lanes[emu_cur].group++;
}
template <int N> static inline void cp_async_wait()
{
    lane_t &l = emu_lanes[emu_cur];
    std::vector<lane_t::pend> keep;
    for (const lane_t::pend &q : l.pending) {
        if (q.group < l.group - N)
            complete(q);
        else
            keep.push_back(q);
    }
    l.pending.swap(keep);
}

static inline uint32_t ld32(uint32_t a)
{
    uint32_t v;
    memcpy(&v, emu_smem + a, 4);
    return v;
}
static inline uint16_t ld16(uint32_t a)
{
    uint16_t v;
    memcpy(&v, emu_smem + a, 2);
    return v;
}

static void ldsm(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, bool trans,
                 int tag)
{
    const int w = emu_cur >> 5, ln = emu_cur & 31;
    check_shared(addr, "ldmatrix");
    emu_x[w][ln][0] = addr;
    warp_arrive(tag);
    uint32_t r[4];
    for (int m = 0; m < 4; m++) {
        if (!trans) {
            const uint32_t a = (uint32_t)emu_x[w][m * 8 + ln / 4][0];
            r[m] = ld32(a + 4 * (ln % 4));
        } else {
            const uint32_t a0 = (uint32_t)emu_x[w][m * 8 + 2 * (ln % 4)][0];
            const uint32_t a1 = (uint32_t)emu_x[w][m * 8 + 2 * (ln % 4) + 1][0];
            r[m] = (uint32_t)ld16(a0 + 2 * (ln / 4)) | ((uint32_t)ld16(a1 + 2 * (ln / 4)) << 16);
        }
    }
    warp_arrive(tag);
    r0 = r[0];
    r1 = r[1];
    r2 = r[2];
    r3 = r[3];
}
static inline void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3)
{
    ldsm(addr, r0, r1, r2, r3, false, 10);
}
static inline void ldsm_x4_t(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3)
{
    ldsm(addr, r0, r1, r2, r3, true, 11);
}

static float bf_lo(uint32_t v)
{
    uint32_t b = (v & 0xffffu) << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static float bf_hi(uint32_t v)
{
    uint32_t b = v & 0xffff0000u;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline void mma_bf16(float *d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                            uint32_t b0, uint32_t b1)
{
    const int w = emu_cur >> 5, ln = emu_cur & 31;
    uint64_t *x = emu_x[w][ln];
    x[0] = a0;
    x[1] = a1;
    x[2] = a2;
    x[3] = a3;
    x[4] = b0;
    x[5] = b1;
    warp_arrive(12);
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; L++) {
        const int g = L >> 2, t = L & 3;
        const uint64_t *y = emu_x[w][L];
        A[g][2 * t] = bf_lo((uint32_t)y[0]);
        A[g][2 * t + 1] = bf_hi((uint32_t)y[0]);
        A[g + 8][2 * t] = bf_lo((uint32_t)y[1]);
        A[g + 8][2 * t + 1] = bf_hi((uint32_t)y[1]);
        A[g][2 * t + 8] = bf_lo((uint32_t)y[2]);
        A[g][2 * t + 9] = bf_hi((uint32_t)y[2]);
        A[g + 8][2 * t + 8] = bf_lo((uint32_t)y[3]);
        A[g + 8][2 * t + 9] = bf_hi((uint32_t)y[3]);
        B[2 * t][g] = bf_lo((uint32_t)y[4]);
        B[2 * t + 1][g] = bf_hi((uint32_t)y[4]);
        B[2 * t + 8][g] = bf_lo((uint32_t)y[5]);
        B[2 * t + 9][g] = bf_hi((uint32_t)y[5]);
    }
    warp_arrive(12);
    const int g = ln >> 2, t = ln & 3;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; i++) {
        double s = 0;
        for (int k = 0; k < 16; k++)
            s += (double)A[rows[i]][k] * (double)B[k][cols[i]];
        d[i] = (float)((double)d[i] + s);
    }
}

static inline float fa_shfl_xor(float v, int m)
{
    const int w = emu_cur >> 5, ln = emu_cur & 31;
    float f;
    memcpy(&emu_x[w][ln][0], &v, 4);
    warp_arrive(13);
    memcpy(&f, &emu_x[w][ln ^ m][0], 4);
    warp_arrive(13);
    return f;
}

static inline void fa_sync()
{
    emu_wait(WAIT_CTA, 20);
}

static int64_t emu_nonfinite;
static inline void bk_nf_note(unsigned long long *flag, float v, int64_t i)
{
    (void)flag;
    (void)i;
    if (!std::isfinite(v))
        emu_nonfinite++;
}


/* ------------------------------------------------------------ scheduler */

static void (*emu_body)();
static void trampoline()
{
    emu_body();
    emu_lanes[emu_cur].done = 1;
}

static int emu_nt = 256; /* threads of the CTA */

static void run_cta(void (*body)(), int nt)
{
    emu_body = body;
    emu_nt = nt;
    for (int t = 0; t < nt; t++) {
        lane_t &l = emu_lanes[t];
        l.stack.resize(256 * 1024);
        l.state = RUNNABLE;
        l.done = 0;
        l.group = 0;
        l.pending.clear();
        getcontext(&l.ctx);
        l.ctx.uc_stack.ss_sp = l.stack.data();
        l.ctx.uc_stack.ss_size = l.stack.size();
        l.ctx.uc_link = &emu_sched;
        makecontext(&l.ctx, trampoline, 0);
    }
    for (;;) {
        int ran = 0;
        for (int t = 0; t < nt; t++) {
            lane_t &l = emu_lanes[t];
            if (l.done || l.state != RUNNABLE)
                continue;
            emu_cur = t;
            swapcontext(&emu_sched, &l.ctx);
            ran = 1;
        }
        int alive = 0, at_cta = 0;
        for (int t = 0; t < nt; t++) {
            alive += !emu_lanes[t].done;
            at_cta += !emu_lanes[t].done && emu_lanes[t].state == WAIT_CTA;
        }
        if (!alive)
            break;
        int released = 0;
        for (int w = 0; w < nt / 32; w++) {
            int wait = 0, done = 0, tag = -1, mixed = 0;
            for (int i = 0; i < 32; i++) {
                const lane_t &l = emu_lanes[w * 32 + i];
                if (l.done) {
                    done++;
                } else if (l.state == WAIT_WARP) {
                    wait++;
                    mixed |= tag >= 0 && l.tag != tag;
                    tag = l.tag;
                }
            }
            if (wait && (done || mixed))
                EMU_FAIL("warp %d: a warp operation not reached by all its lanes (CTA %lld)", w,
                         (long long)emu_bid);
            if (wait == 32) {
                for (int i = 0; i < 32; i++)
                    emu_lanes[w * 32 + i].state = RUNNABLE;
                released = 1;
            }
        }
        if (!released && at_cta) {
            if (at_cta != nt)
                EMU_FAIL("a barrier reached by %d of %d threads (%d alive, CTA %lld)", at_cta, nt,
                         alive, (long long)emu_bid);
            for (int t = 0; t < nt; t++)
                emu_lanes[t].state = RUNNABLE;
            released = 1;
        }
        if (!ran && !released)
            EMU_FAIL("deadlock (CTA %lld)", (long long)emu_bid);
    }
    for (int t = 0; t < nt; t++)
        if (!emu_lanes[t].pending.empty())
            EMU_FAIL("thread %d ended with cp.async copies pending", t);
}

/* Gaussian test inputs: xorshift64 + Box-Muller (the tests seed emu_rng) */
static uint64_t emu_rng = 88172645463325252ull;
static double emu_gauss()
{
    emu_rng ^= emu_rng << 13;
    emu_rng ^= emu_rng >> 7;
    emu_rng ^= emu_rng << 17;
    const double u1 = ((emu_rng >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    emu_rng ^= emu_rng << 13;
    emu_rng ^= emu_rng >> 7;
    emu_rng ^= emu_rng << 17;
    const double u2 = (emu_rng >> 11) * (1.0 / 9007199254740992.0);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* run every CTA of a kernel of nt threads (shared memory of smem bytes,
 * NaN-filled before each CTA: BF16 NaNs, F32 NaNs as their pairs) */
static void emu_run_grid(void (*body)(), int64_t ctas, int nt, size_t smem_bytes)
{
    std::vector<unsigned char> smem(smem_bytes ? smem_bytes : 16);
    emu_smem = smem.data();
    emu_smem_size = smem_bytes;
    for (int64_t b = 0; b < ctas; b++) {
        for (size_t i = 0; i + 1 < smem.size(); i += 2) {
            smem[i] = 0xc0;
            smem[i + 1] = 0x7f;
        }
        emu_bid = b;
        run_cta(body, nt);
    }
}

#endif /* BK_TEST_ATTN_EMU_H */
