/* CUDA backend — BaKron tile wavefront, float instantiation (bakron_impl.cuh). */
#include "bakron_impl.cuh"

bk_status bk_cuda_bakron_f32(bk_cuda_ctx *c, const bk_core_args *a)
{
    return bakron<float>(c, a);
}
