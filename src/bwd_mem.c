/* Device-memory model of the GPU backward flow (src/bwd_mem.h). */
#include <stdio.h>

#include "bwd_mem.h"

#include "bakron/backward.h"
#include "bakron/pipeline.h"

/* ------------------------------------------------ the halving tree
 *
 * A split of [lo, hi) (more than leaf layers) has k >= 2 children at the
 * cuts c_i = lo + i (hi - lo) / k; k = 2 is recursive halving (the paper's;
 * the fewest boundary matrices), a larger k takes fewer passes. The split
 * holds X_{c_i} and G_{c_i} (i = 1 .. k-1), and the root G_L too; during
 * child j: X_{c_i} for i >= max(j, 1), G_{c_i} for i > j, and G_L. */
int bk_bwd_cut(int lo, int hi, int k, int i)
{
    return lo + (int)((int64_t)i * (int64_t)(hi - lo) / (int64_t)k);
}

int bk_bwd_held(int k, int j, int root)
{
    return (k - (j > 1 ? j : 1)) + (k - 1 - j) + (root ? 1 : 0);
}

static int tree_units(int lo, int hi, int leaf, int root, int budget);

/* the most matrices a split into k holds at once, its children's included
 * (each child split with what is left of the budget) */
static int split_peak(int lo, int hi, int leaf, int root, int k, int budget)
{
    int p = 0;
    for (int j = 0; j < k; j++) {
        const int h = bk_bwd_held(k, j, root);
        const int u = h + tree_units(bk_bwd_cut(lo, hi, k, j), bk_bwd_cut(lo, hi, k, j + 1), leaf,
                                     0, budget - h);
        if (u > p)
            p = u;
    }
    return p;
}

/* the work of one sweep over n layers going back through `back` of them, in
 * layer forwards (a backward recomputes its layer's forward) + 2 per layer
 * backward: the root's runs every layer forward (the head follows), a
 * child's not its last (its output gradient is given) */
static int64_t sweep_work(int n, int back, int root)
{
    const int64_t fw = n - (root ? 0 : 1);
    return fw + back + 2 * (int64_t)back;
}

/* recursive halving's work over n layers */
static int64_t halving_work(int n, int leaf, int root)
{
    if (n <= leaf)
        return sweep_work(n, n, root);
    const int mid = n / 2;
    return sweep_work(n, n - mid, root) + halving_work(mid, leaf, 0) +
           halving_work(n - mid, leaf, 0);
}

int bk_bwd_split(int lo, int hi, int leaf, int root, int budget)
{
    const int n = hi - lo, kmax = leaf > 0 ? (n + leaf - 1) / leaf : n;
    /* of the splits whose peak, with halving below them, fits the budget, the
     * one of least work with halving below it (the children then widen with
     * what is left of the budget, which never adds work: by induction no
     * node does more than halving would); halving on a tie */
    int best = 2;
    if (budget <= 0)
        return best;
    int64_t wbest = -1;
    for (int k = 2; k <= kmax; k++) {
        if (k > 2 && split_peak(lo, hi, leaf, root, k, 0) > budget)
            continue;
        int64_t w = sweep_work(n, hi - bk_bwd_cut(lo, hi, k, 1), root);
        for (int j = 0; j < k; j++)
            w += halving_work(bk_bwd_cut(lo, hi, k, j + 1) - bk_bwd_cut(lo, hi, k, j), leaf, 0);
        if (wbest < 0 || w < wbest) {
            wbest = w;
            best = k;
        }
    }
    return best;
}

static int tree_units(int lo, int hi, int leaf, int root, int budget)
{
    if (hi - lo <= leaf)
        return 0;
    return split_peak(lo, hi, leaf, root, bk_bwd_split(lo, hi, leaf, root, budget), budget);
}

/* the most layers a sweep goes back through (the inputs it keeps) */
static int tree_acts(int lo, int hi, int leaf, int root, int budget)
{
    if (hi - lo <= leaf)
        return hi - lo;
    const int k = bk_bwd_split(lo, hi, leaf, root, budget);
    int a = hi - bk_bwd_cut(lo, hi, k, 1);
    for (int j = 0; j < k; j++) {
        const int c = tree_acts(bk_bwd_cut(lo, hi, k, j), bk_bwd_cut(lo, hi, k, j + 1), leaf, 0,
                                budget - bk_bwd_held(k, j, root));
        if (c > a)
            a = c;
    }
    return a;
}

int64_t bk_bwd_acts_layers_b(int64_t L, int flow, int leaf, int budget)
{
    int64_t a = flow == BK_FLOW_NAIVE ? L : (L + 1) / 2;
    if (leaf > a)
        a = leaf < L ? leaf : L;
    /* (a wider split goes back through more layers; halving's bound above
     * is kept where it is larger) */
    if (flow != BK_FLOW_NAIVE && budget > 0 && leaf >= 1 && L >= 1) {
        const int64_t w = tree_acts(0, (int)L, leaf, 1, budget);
        if (w > a)
            a = w;
    }
    return a;
}

int64_t bk_bwd_acts_layers(int64_t L, int flow, int leaf)
{
    return bk_bwd_acts_layers_b(L, flow, leaf, 0);
}

static int64_t max3(int64_t a, int64_t b, int64_t c)
{
    int64_t m = a > b ? a : b;
    return m > c ? m : c;
}

uint64_t bk_bwd_dev_bytes(const bk_model_config *c, int64_t B, int64_t T, int64_t S,
                          const bk_bwd_mem_params *p, int logits_all)
{
    const int fp64 = p->precision == BK_BWD_FP64;
    const uint64_t es = fp64 ? 8 : 4;
    const int wbf = !fp64 && p->precision == BK_BWD_BF16;
    const int g32 = !fp64 && (p->precision == BK_BWD_TF32 || p->precision == BK_BWD_BF16);
    const int64_t hd = c->head_dim, nh = c->n_heads, nkv = c->n_kv_heads;
    const int flash = wbf && (hd == 64 || hd == 128);
    const uint64_t R = (uint64_t)(B * T), d = (uint64_t)c->hidden, qd = (uint64_t)(nh * hd),
                   kvd = (uint64_t)(nkv * hd), NI = (uint64_t)c->intermediate,
                   V = (uint64_t)c->vocab, TT = (uint64_t)(B * T * T);
    const uint64_t wmax = qd > kvd ? qd : kvd;
    uint64_t n = 0;
    /* create: one layer's forward and backward buffers; P / dP (the unfused
     * attention backward only) */
    n += R * (6 * d + 5 * qd + 5 * kvd + 6 * NI + wmax) * es;
    if (!flash)
        n += 2 * TT * es;
    n += R * 8 * (uint64_t)(2 + nh + nkv);         /* r1, r2, rq, rk */
    n += V * d * es + d * es + 2 * R * d * es;     /* LM head, final norm, xf, dxf */
    n += 8 * R * 8 + 3 * R * 4 + 8 * 8;             /* head rows, lab, last, dtok, flags */
    n += 2 * (uint64_t)(T * (hd / 2)) * 4;          /* RoPE tables */
    {                                               /* logits: one block or all */
        int64_t vc = ((int64_t)1 << 22) / (int64_t)R;
        if (vc > ((int64_t)1 << 21) / (int64_t)d)
            vc = ((int64_t)1 << 21) / (int64_t)d;
        if (vc < 16)
            vc = 16;
        if (vc > (int64_t)V)
            vc = (int64_t)V;
        n += R * (logits_all || vc >= (int64_t)V ? V : (uint64_t)vc) * es;
    }
    if (wbf) {
        n += R * (uint64_t)max3((int64_t)d, (int64_t)NI, (int64_t)qd) * 2; /* xb */
        if (flash)
            n += R * qd * 2; /* adob (the fused backward's dO) */
        else
            n += (2 * R * qd + 2 * R * kvd + 2 * TT) * 2; /* aqb akb avb adob Pb dSb */
    }
    if (flash) /* qb kb vb; the fused backward's row sums lse and D */
        n += R * (qd + 2 * kvd) * 2 + 2 * R * (uint64_t)nh * 4;
    int64_t wbig = 0, mo = 0;
    uint64_t sq = 0;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o, in;
        bk_module_shape(c, (bk_module)i, &o, &in);
        wbig = o * in > wbig ? o * in : wbig;
        mo = o > mo ? o : mo;
        sq += (uint64_t)(o * o);
    }
    if (fp64) /* (bf16 uploads BF16 weights directly since issue 16) */
        n += (uint64_t)wbig * 4; /* weight staging */
    /* the flow: h, dh, the embedding copy (untied), boundary scratch
     * (halving; BF16 in bf16 mode, as its boundaries), the kept layer inputs */
    n += 2 * R * d * es;
    if (!c->tie_embeddings)
        n += V * d * es;
    if (p->flow != BK_FLOW_NAIVE)
        n += 2 * R * d * (wbf ? 2 : es);
    n += R * d * es * (uint64_t)bk_bwd_acts_layers_b((int64_t)c->n_layers, p->flow, p->leaf, p->units);
    if (p->grams) {
        const int64_t gleaf = p->leaf < (int)c->n_layers ? p->leaf : (int)c->n_layers;
        /* scaled gradients in the Gram's input type; F32 panel [mo, 1024 or 512] */
        n += R * (uint64_t)mo * (g32 ? (wbf ? 2 : 4) : 8);
        if (g32)
            n += (uint64_t)mo * (uint64_t)(mo >= 8192 ? 1024 : 512) * 4;
        n += 2 * R * 8;                             /* rn_g, rn_a */
        n += (uint64_t)gleaf * sq * 8;              /* the Grams */
        if (p->grams_dev && p->shampoo)
            n += (uint64_t)gleaf * BK_MOD_COUNT * (uint64_t)(S * T) * 8;
    }
    return n;
}

uint64_t bk_bwd_dev_layer_bytes(const bk_model_config *c, int precision)
{
    const int fp64 = precision == BK_BWD_FP64;
    const uint64_t es = fp64 ? 8 : 4, ew = !fp64 && precision == BK_BWD_BF16 ? 2 : es;
    uint64_t n = 0;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o, in;
        bk_module_shape(c, (bk_module)i, &o, &in);
        n += (uint64_t)(o * in) * ew + (uint64_t)o * es;
    }
    return n + (uint64_t)(2 * c->hidden + 2 * c->head_dim) * es;
}

uint64_t bk_gpu_stage_reserve(const bk_model_config *c, int squares, int gib)
{
    uint64_t layer = 0;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o, in;
        bk_module_shape(c, (bk_module)i, &o, &in);
        layer += (uint64_t)(o * in) * 4u;
    }
    const uint64_t big = (uint64_t)(c->intermediate > c->hidden ? c->intermediate : c->hidden);
    return 2 * layer + (uint64_t)squares * big * big * 4u + ((uint64_t)gib << 30);
}

int bk_bwd_cache_layers(const bk_model_config *c, int precision, uint64_t avail,
                        uint64_t reserve)
{
    const uint64_t per = bk_bwd_dev_layer_bytes(c, precision);
    uint64_t budget = avail / 2;
    const uint64_t beside = avail > reserve ? avail - reserve : 0;
    if (beside < budget)
        budget = beside;
    uint64_t n = per ? budget / per : 0;
    if (n > (uint64_t)c->n_layers)
        n = (uint64_t)c->n_layers;
    return n < 1 ? 1 : (int)n;
}

int64_t bk_bwd_fit_batch(const bk_model_config *c, int64_t T, int64_t S,
                         const bk_bwd_mem_params *p, int64_t want, uint64_t avail,
                         uint64_t stage_per_seq, uint64_t reserve, int cache_min)
{
    if (want > S)
        want = S;
    const uint64_t fixed = reserve + (uint64_t)(cache_min > 0 ? cache_min : 0) *
                                         bk_bwd_dev_layer_bytes(c, p->precision);
    for (int64_t B = want; B >= 1; B--) {
        const uint64_t need = fixed + stage_per_seq * (uint64_t)B +
                              bk_bwd_dev_bytes(c, B, T, S, p, 0);
        if (need <= avail)
            return B;
    }
    return 0;
}

int bk_bwd_max_leaf(const bk_model_config *c, int64_t T, int64_t S, const bk_bwd_mem_params *p,
                    int64_t B, uint64_t avail, uint64_t stage_bytes, uint64_t reserve)
{
    const int64_t L = c->n_layers;
    const uint64_t cache = (uint64_t)L * bk_bwd_dev_layer_bytes(c, p->precision);
    /* (the bytes grow with the leaf: its Grams, the kept inputs, the token weights) */
    for (int64_t s = L; s >= 1; s--) {
        bk_bwd_mem_params q = *p;
        q.leaf = (int)s;
        const uint64_t need = stage_bytes + reserve + cache + bk_bwd_dev_bytes(c, B, T, S, &q, 0);
        if (need <= avail - avail / 8)
            return (int)s;
    }
    return 0;
}

int bk_bwd_auto_leaf(const bk_model_config *c, int64_t T, int64_t S, const bk_bwd_mem_params *p,
                     int64_t B, uint64_t avail, uint64_t stage_bytes, uint64_t reserve)
{
    const int m = bk_bwd_max_leaf(c, T, S, p, B, avail, stage_bytes, reserve);
    for (int s = 8; s > 1; s /= 2)
        if (2 * s <= c->n_layers && s <= m)
            return s;
    return 1;
}

/* ------------------------------------------------ host memory of the flows */

int bk_bwd_boundary_units_b(int64_t L, int flow, int leaf, int budget)
{
    if (flow == BK_FLOW_NAIVE || leaf < 1 || L < 1)
        return 0;
    return tree_units(0, (int)L, leaf, 1, budget);
}

int bk_bwd_boundary_units(int64_t L, int flow, int leaf)
{
    return bk_bwd_boundary_units_b(L, flow, leaf, 0);
}

uint64_t bk_bwd_boundary_peak_bytes_b(int64_t L, int flow, int leaf, int budget, int64_t N,
                                      int64_t hidden, int elem_bytes)
{
    return (uint64_t)bk_bwd_boundary_units_b(L, flow, leaf, budget) * (uint64_t)N *
           (uint64_t)hidden * (uint64_t)elem_bytes;
}

uint64_t bk_bwd_boundary_peak_bytes(int64_t L, int flow, int leaf, int64_t N, int64_t hidden,
                                    int elem_bytes)
{
    return bk_bwd_boundary_peak_bytes_b(L, flow, leaf, 0, N, hidden, elem_bytes);
}

bk_status bk_bwd_host_kinds(int gpu_flow, int precision, int mapped_bf16, int *elem_bytes,
                            int *copies)
{
    *elem_bytes = 0;
    *copies = BK_BWD_HOST_CPU;
    if (precision < BK_BWD_FP32 || precision > BK_BWD_BF16)
        return bk_error(BK_ERR_INTERNAL,
                        "backward flow: the host plan got precision %d, not a resolved one "
                        "(--bwd-precision auto is resolved before any plan)",
                        precision);
    if (!gpu_flow) {
        *elem_bytes = 8;
        return BK_OK;
    }
    *elem_bytes = precision == BK_BWD_FP64 ? 8 : precision == BK_BWD_BF16 ? 2 : 4;
    *copies = precision != BK_BWD_BF16 ? BK_BWD_HOST_GPU_F32
              : mapped_bf16            ? BK_BWD_HOST_GPU_MAPPED
                                       : BK_BWD_HOST_GPU_BF16;
    return BK_OK;
}

uint64_t bk_bwd_host_layer_bytes(const bk_model_config *c, int gpu)
{
    /* F32: the device cache's layer at fp32; BF16 copy: at bf16 (matrices
     * in BF16, the rest F32) */
    const uint64_t f32 = bk_bwd_dev_layer_bytes(c, BK_BWD_FP32);
    if (gpu != BK_BWD_HOST_GPU_BF16 && gpu != BK_BWD_HOST_GPU_MAPPED)
        return f32;
    const uint64_t bf = bk_bwd_dev_layer_bytes(c, BK_BWD_BF16);
    if (gpu == BK_BWD_HOST_GPU_BF16)
        return bf;
    return bf - (f32 - bf); /* (f32 - bf: the matrices' elements x 2 bytes) */
}

void bk_bwd_host_plan_make(const bk_model_config *c, int flow, int leaf, int64_t N,
                           int elem_bytes, int gpu, uint64_t avail, bk_bwd_host_plan *p)
{
    const int64_t L = c->n_layers;
    /* one layer's copy (bk_layer_weights_load, bk_layer_weights_bf16_load;
     * cuda/backward.cu host_layer_bytes) */
    const uint64_t lb = bk_bwd_host_layer_bytes(c, gpu);
    p->layer_bytes = lb;
    p->copies_kind = gpu;
    p->units = bk_bwd_boundary_units(L, flow, leaf);
    p->budget = 0;
    p->elem_bytes = elem_bytes;
    p->boundary_bytes = bk_bwd_boundary_peak_bytes(L, flow, leaf, N, c->hidden, elem_bytes);
    p->copies_budget = gpu ? (avail ? avail / 2 : UINT64_MAX) : (uint64_t)L * lb;
    uint64_t n = lb ? p->copies_budget / lb : 0;
    if (n > (uint64_t)L)
        n = (uint64_t)L;
    p->copies_bytes = n * lb;
    p->margin = avail / 8;
    p->need = p->boundary_bytes + p->copies_bytes + p->margin;
    p->avail = avail;
}

int bk_bwd_units_budget(const bk_bwd_host_plan *p, int64_t N, int64_t hidden, uint64_t reserve)
{
    const uint64_t one = (uint64_t)N * (uint64_t)hidden * (uint64_t)p->elem_bytes;
    const uint64_t used = p->copies_bytes + 2 * p->margin + reserve;
    if (!p->avail || !one || p->avail <= used)
        return 0;
    const uint64_t u = (p->avail - used) / one;
    return u > 4096 ? 4096 : (int)u;
}

void bk_bwd_host_plan_widen(bk_bwd_host_plan *p, const bk_model_config *c, int flow, int leaf,
                            int64_t N, int budget)
{
    p->budget = budget;
    p->units = bk_bwd_boundary_units_b(c->n_layers, flow, leaf, budget);
    p->boundary_bytes = bk_bwd_boundary_peak_bytes_b(c->n_layers, flow, leaf, budget, N,
                                                     c->hidden, p->elem_bytes);
    p->need = p->boundary_bytes + p->copies_bytes + p->margin;
}

bk_status bk_bwd_host_check(const bk_model_config *c, int flow, int leaf, int64_t S, int64_t T,
                            int elem_bytes, int gpu, int ranks, int leaf_max, uint64_t avail,
                            bk_bwd_host_plan *out)
{
    bk_bwd_host_plan p;
    bk_bwd_host_plan_make(c, flow, leaf, S * T, elem_bytes, gpu, avail, &p);
    if (out)
        *out = p;
    if (!avail || p.need <= avail)
        return BK_OK;
    const double G = 1e9;
    const int64_t L = c->n_layers;
    const uint64_t room = avail > p.copies_bytes + p.margin ? avail - p.copies_bytes - p.margin : 0;
    char fix[256] = "";
    int k = 0;
    if (p.units > 0) {
        const uint64_t per_seq = (uint64_t)p.units * (uint64_t)T * (uint64_t)c->hidden *
                                 (uint64_t)elem_bytes;
        const int64_t smax = per_seq ? (int64_t)(room / per_seq) : 0;
        if (smax >= 1)
            k += snprintf(fix + k, sizeof fix - (size_t)k, "--samples %lld or fewer, ",
                          (long long)smax * (ranks > 1 ? ranks : 1));
        /* (a larger leaf only up to what the device holds: s layers' Grams) */
        const int64_t smax_leaf = leaf_max > 0 && leaf_max < L ? leaf_max : L;
        for (int s = leaf + 1; s <= smax_leaf; s++)
            if (bk_bwd_boundary_peak_bytes(L, flow, s, S * T, c->hidden, elem_bytes) <= room) {
                const int u = bk_bwd_boundary_units(L, flow, s);
                if (u)
                    k += snprintf(fix + k, sizeof fix - (size_t)k,
                                  "--leaf-size %d (%d matrices, %.1f GB), ", s, u,
                                  (double)bk_bwd_boundary_peak_bytes(L, flow, s, S * T,
                                                                     c->hidden, elem_bytes) / G);
                else
                    k += snprintf(fix + k, sizeof fix - (size_t)k,
                                  "--leaf-size %d (no boundary matrices), ", s);
                break;
            }
        snprintf(fix + k, sizeof fix - (size_t)k,
                 "or --bwd-flow naive (no boundary matrices, more passes)");
    } else {
        snprintf(fix, sizeof fix, "a host with more memory (the layers' copies alone do not fit)");
    }
    return bk_error(BK_ERR_NOMEM,
                    "quantize: the backprop flow (%s, --leaf-size %d) needs %.1f GB of host "
                    "memory: %.1f GB of boundary matrices (%d x [%lld tokens x %lld] %s) + "
                    "%.1f GB of the layers' host copies + %.1f GB margin, more than the %.1f GB "
                    "available (MemAvailable, or what a cgroup memory limit leaves): use %s",
                    flow == BK_FLOW_NAIVE ? "naive" : "halving", leaf, (double)p.need / G,
                    (double)p.boundary_bytes / G, p.units, (long long)(S * T),
                    (long long)c->hidden,
                    elem_bytes == 8   ? "F64"
                    : elem_bytes == 2 ? "BF16"
                                      : "F32",
                    (double)p.copies_bytes / G, (double)p.margin / G, (double)avail / G, fix);
}
