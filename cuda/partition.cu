/* CUDA backend — an SM partition for BaKron's overlapped pushes.
 *
 * The far pushes run on a low-priority side stream while the main stream
 * solves one tile anti-diagonal after another. Priorities only order the
 * CTAs waiting for an SM: they do not preempt. When the side stream's push
 * CTAs fill every SM, each solve waits until enough of them finish on some
 * SM for its larger CTA to fit. On the shapes with few tiles per anti-diagonal
 * (8192 x 2048: at most 32) the solves then spend ~2 ms of 14 waiting.
 *
 * A green context (driver API, CUDA 12.5+; the entry points are asked for at the
 * runtime's version) confines a stream to a subset of
 * the SMs. The side stream is moved into one that holds all SMs but about
 * `keep`; those stay free for the main stream (which may still use every SM).
 * The driver entry points are looked up at run time (cudaGetDriverEntryPoint-
 * ByVersion), so nothing links against libcuda. When any step fails (an old
 * driver, a runtime without green contexts) the partition is switched off for
 * the context and the ordinary side stream is used: the results are the same,
 * only the timing differs.
 */
#include <cstdio>
#include <cstring>

#include <cuda.h>

#include "cuda_internal.cuh"

namespace {

struct Drv {
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetDevResource)(CUdevice, CUdevResource *, CUdevResourceType);
    CUresult (*DevSmResourceSplitByCount)(CUdevResource *, unsigned int *, const CUdevResource *,
                                          CUdevResource *, unsigned int, unsigned int);
    CUresult (*DevResourceGenerateDesc)(CUdevResourceDesc *, CUdevResource *, unsigned int);
    CUresult (*GreenCtxCreate)(CUgreenCtx *, CUdevResourceDesc, CUdevice, unsigned int);
    CUresult (*GreenCtxDestroy)(CUgreenCtx);
    CUresult (*GreenCtxStreamCreate)(CUstream *, CUgreenCtx, unsigned int, int);
    CUresult (*CtxFromGreenCtx)(CUcontext *, CUgreenCtx);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext *);
    CUresult (*EventCreate)(CUevent *, unsigned int);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*StreamDestroy)(CUstream);
};

bool load(Drv *d, char *why, size_t cap)
{
    struct E {
        const char *name;
        void **fn;
    } es[] = {{"cuDeviceGet", (void **)&d->DeviceGet},
              {"cuDeviceGetDevResource", (void **)&d->DeviceGetDevResource},
              {"cuDevSmResourceSplitByCount", (void **)&d->DevSmResourceSplitByCount},
              {"cuDevResourceGenerateDesc", (void **)&d->DevResourceGenerateDesc},
              {"cuGreenCtxCreate", (void **)&d->GreenCtxCreate},
              {"cuGreenCtxDestroy", (void **)&d->GreenCtxDestroy},
              {"cuGreenCtxStreamCreate", (void **)&d->GreenCtxStreamCreate},
              {"cuCtxFromGreenCtx", (void **)&d->CtxFromGreenCtx},
              {"cuCtxPushCurrent", (void **)&d->CtxPushCurrent},
              {"cuCtxPopCurrent", (void **)&d->CtxPopCurrent},
              {"cuEventCreate", (void **)&d->EventCreate},
              {"cuEventDestroy", (void **)&d->EventDestroy},
              {"cuStreamDestroy", (void **)&d->StreamDestroy}};
    for (const E &e : es) {
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        cudaError_t r = cudaGetDriverEntryPointByVersion(e.name, e.fn, CUDART_VERSION, cudaEnableDefault, &q);
        if (r != cudaSuccess || q != cudaDriverEntryPointSuccess || !*e.fn) {
            cudaGetLastError();
            snprintf(why, cap, "driver entry point %s not found", e.name);
            return false;
        }
    }
    return true;
}

/* The table, looked up once per process (thread-safe static initialization). */
struct DrvTable {
    Drv d;
    bool ok;
    char why[96];
};

const DrvTable &drv()
{
    static const DrvTable t = [] {
        DrvTable x;
        memset(&x, 0, sizeof x);
        x.ok = load(&x.d, x.why, sizeof x.why);
        return x;
    }();
    return t;
}

__global__ void k_probe(int *p)
{
    if (threadIdx.x == 0)
        *p = 1;
}

} // namespace

/* Make the partition's context current (for per-context settings such as a
 * kernel's shared-memory limit) and back. */
bool bk_cuda_partition_enter(bk_cuda_ctx *c)
{
    const DrvTable &t = drv();
    CUcontext gc = NULL;
    return c->green && t.ok && t.d.CtxFromGreenCtx(&gc, (CUgreenCtx)c->green) == CUDA_SUCCESS &&
           t.d.CtxPushCurrent(gc) == CUDA_SUCCESS;
}

void bk_cuda_partition_leave(bk_cuda_ctx *c)
{
    const DrvTable &t = drv();
    CUcontext gc = NULL;
    if (c->green && t.ok)
        t.d.CtxPopCurrent(&gc);
}

void bk_cuda_partition_release(bk_cuda_ctx *c)
{
    const DrvTable &t = drv();
    const Drv &d = t.d;
    if (!c->green || !t.ok)
        return;
    if (c->part_stream)
        d.StreamDestroy((CUstream)c->part_stream);
    if (c->part_done)
        d.EventDestroy((CUevent)c->part_done);
    d.GreenCtxDestroy((CUgreenCtx)c->green);
    c->part_stream = NULL;
    c->part_done = NULL;
    c->green = NULL;
    c->part_sms = 0;
}

/* The side stream confined to all SMs but `keep`: *stream and *done (an
 * event of the partition's context, recorded on *stream) or NULL when the
 * partition is unavailable (c->part_off says why). Cached per size. */
bk_status bk_cuda_partition_side(bk_cuda_ctx *c, int keep, cudaStream_t *stream,
                                 cudaEvent_t *done)
{
    *stream = NULL;
    *done = NULL;
    if (c->part_off[0])
        return BK_OK;
    int nsm = 0;
    if (cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, c->device) != cudaSuccess) {
        cudaGetLastError();
        snprintf(c->part_off, sizeof c->part_off, "SM count unavailable");
        return BK_OK;
    }
    /* the partition's size: a multiple of 8 SMs (sm_90's granularity) */
    int want = (nsm - keep) / 8 * 8;
    if (want < 8)
        return BK_OK;
    if (c->green && c->part_sms == want) {
        *stream = c->part_stream;
        *done = c->part_done;
        return BK_OK;
    }
    bk_cuda_partition_release(c);
    const DrvTable &t = drv();
    if (!t.ok) {
        snprintf(c->part_off, sizeof c->part_off, "%.90s", t.why);
        return BK_OK;
    }
    const Drv &d = t.d;
    CUdevice dev;
    CUdevResource all, grp, rest;
    CUdevResourceDesc desc;
    CUgreenCtx g = NULL;
    CUcontext gc = NULL, popped = NULL;
    CUstream s = NULL;
    CUevent e = NULL;
    unsigned int ng = 1;
    int lo = 0, hi = 0, *flag = NULL, seen = 0;
    const char *step = "";
    memset(&all, 0, sizeof all);
    memset(&grp, 0, sizeof grp);
    memset(&rest, 0, sizeof rest);
#define PSTEP(call, name)                                                                          \
    do {                                                                                           \
        step = name;                                                                               \
        if ((call) != CUDA_SUCCESS)                                                                \
            goto fail;                                                                             \
    } while (0)
    PSTEP(d.DeviceGet(&dev, c->device), "cuDeviceGet");
    PSTEP(d.DeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource");
    PSTEP(d.DevSmResourceSplitByCount(&grp, &ng, &all, &rest, 0, (unsigned)want),
          "cuDevSmResourceSplitByCount");
    if (ng != 1 || (int)grp.sm.smCount > want + 8 || (int)grp.sm.smCount >= nsm) {
        step = "the split's size";
        goto fail;
    }
    PSTEP(d.DevResourceGenerateDesc(&desc, &grp, 1), "cuDevResourceGenerateDesc");
    PSTEP(d.GreenCtxCreate(&g, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate");
    if (cudaDeviceGetStreamPriorityRange(&lo, &hi) != cudaSuccess) {
        step = "cudaDeviceGetStreamPriorityRange";
        goto fail;
    }
    PSTEP(d.GreenCtxStreamCreate(&s, g, CU_STREAM_NON_BLOCKING, lo), "cuGreenCtxStreamCreate");
    PSTEP(d.CtxFromGreenCtx(&gc, g), "cuCtxFromGreenCtx");
    PSTEP(d.CtxPushCurrent(gc), "cuCtxPushCurrent");
    {
        CUresult r = d.EventCreate(&e, CU_EVENT_DISABLE_TIMING);
        d.CtxPopCurrent(&popped);
        PSTEP(r, "cuEventCreate");
    }
    /* a runtime-API launch on the partition's stream, checked */
    if (cudaMalloc((void **)&flag, sizeof(int)) != cudaSuccess ||
        cudaMemset(flag, 0, sizeof(int)) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) { /* the memset is on the legacy stream, which
                                                     the partition's stream does not wait for */
        step = "probe allocation";
        goto fail;
    }
    k_probe<<<1, 32, 0, (cudaStream_t)s>>>(flag);
    if (cudaGetLastError() != cudaSuccess || cudaStreamSynchronize((cudaStream_t)s) != cudaSuccess ||
        cudaMemcpy(&seen, flag, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess || seen != 1) {
        step = "a kernel launch on the partition's stream";
        goto fail;
    }
    cudaFree(flag);
#undef PSTEP
    c->green = g;
    c->part_stream = (cudaStream_t)s;
    c->part_done = (cudaEvent_t)e;
    c->part_sms = want;
    c->part_actual = (int)grp.sm.smCount;
    *stream = c->part_stream;
    *done = c->part_done;
    return BK_OK;
fail:
    cudaGetLastError();
    if (flag)
        cudaFree(flag);
    if (e)
        d.EventDestroy(e);
    if (s)
        d.StreamDestroy(s);
    if (g)
        d.GreenCtxDestroy(g);
    cudaGetLastError();
    snprintf(c->part_off, sizeof c->part_off, "%s failed", step);
    return BK_OK;
}
