/* The quantization job's metadata files: config.json with the
 * quantization_config, report.json, the model card. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bk_config.h"
#include "quantize_job.h"
#include "util.h"

/* ------------------------------------------------------------ metadata files */

bk_status bk__q_write_metadata(job *j)
{
    const bk_quantize_opts *o = j->o;
    char path[4096];
    char *text = NULL;
    bk_status st;
    st = bk_path_join(path, sizeof path, o->model_dir, "config.json");
    if (st != BK_OK)
        return st;
    st = bk_read_file(path, BK_CONFIG_MAX_BYTES, &text, NULL);
    if (st != BK_OK)
        return st;
    cJSON *cfg = cJSON_Parse(text);
    free(text);
    if (!cfg)
        return bk_error(BK_ERR_CONFIG, "%s: cannot parse", path);

    cJSON *qc = bk__quantization_config(o, j->cfg, j->S, j->T, j->layer_begin, j->layer_end);
    if (!qc) {
        cJSON_Delete(cfg);
        return bk_error(BK_ERR_NOMEM, "out of memory building quantization_config");
    }
    if (o->export_format == BK_EXPORT_DEQUANTIZED) {
        /* an ordinary checkpoint: record provenance under another key */
        cJSON_DeleteItemFromObject(cfg, "quantization_config");
        cJSON_AddItemToObject(cfg, "bakron_dequantized_from", qc);
    } else {
        cJSON_DeleteItemFromObject(cfg, "quantization_config");
        cJSON_AddItemToObject(cfg, "quantization_config", qc);
        if (o->export_format == BK_EXPORT_GPTQ) {
            char *q = cJSON_Print(qc);
            if (q) {
                st = bk_path_join(path, sizeof path, j->od.work, "quantize_config.json");
                if (st == BK_OK)
                    st = bk_write_file_atomic(path, q, strlen(q));
                free(q);
                if (st != BK_OK) {
                    cJSON_Delete(cfg);
                    return st;
                }
            }
        }
    }
    char *out = cJSON_Print(cfg);
    st = bk__write_model_card(j->od.work, cfg);
    cJSON_Delete(cfg);
    if (!out)
        return bk_error(BK_ERR_NOMEM, "out of memory writing config.json");
    if (st != BK_OK) {
        free(out);
        return st;
    }
    st = bk_path_join(path, sizeof path, j->od.work, "config.json");
    if (st == BK_OK)
        st = bk_write_file_atomic(path, out, strlen(out));
    free(out);
    if (st != BK_OK)
        return st;

    /* report.json */
    cJSON *rep = cJSON_CreateObject();
    cJSON_AddStringToObject(rep, "bakron_version", BK_VERSION);
    cJSON_AddStringToObject(rep, "model", o->model_dir);
    cJSON_AddStringToObject(rep, "backend", bk_backend_name(j->backend));
    cJSON_AddStringToObject(rep, "device", bk_backend_device(j->backend));
    if (j->own_stages) /* the backend's own stages (its GEMM arithmetic) */
        cJSON_AddStringToObject(rep, "gpu_math", bk_gemm_math_name(j->gemm_math));
    cJSON_AddStringToObject(rep, "stages", j->ops->name);
    if (j->ops->describe(j->ops_ctx)[0])
        cJSON_AddStringToObject(rep, "stages_detail", j->ops->describe(j->ops_ctx));
    cJSON_AddNumberToObject(rep, "batch", (double)j->batch);
    cJSON_AddNumberToObject(rep, "peak_device_bytes", (double)bk_backend_peak_memory(j->backend));
    cJSON_AddItemToObject(rep, "quantization",
                          bk__quantization_config(o, j->cfg, j->S, j->T, j->layer_begin, j->layer_end));
    cJSON *times = cJSON_AddObjectToObject(rep, "times_s");
    cJSON_AddNumberToObject(times, "total", bk_now() - j->t0);
    cJSON_AddNumberToObject(times, "forward", j->t_forward);
    cJSON_AddNumberToObject(times, "hessian", j->t_hessian);
    cJSON_AddNumberToObject(times, "factor", j->t_factor);
    cJSON_AddNumberToObject(times, "solve", j->t_solve);
    /* packing and writing the quantized modules in the writer thread, overlapped
     * with the solves (not part of total - the stages) */
    cJSON_AddNumberToObject(times, "write_overlapped", j->wr.busy_s);
    cJSON_AddNumberToObject(times, "io", j->t_io);
    cJSON_AddNumberToObject(rep, "quantized_parameters", (double)j->quantized_params);
    if (j->dist) {
        cJSON *mp = cJSON_AddObjectToObject(rep, "mpi");
        cJSON_AddNumberToObject(mp, "ranks", j->nranks);
        cJSON_AddStringToObject(mp, "mode", "data parallel");
        cJSON_AddStringToObject(mp, "reduce",
                                o->dist_reduce == BK_DIST_ORDERED ? "ordered" : "sum");
        if (j->coll_desc)
            cJSON_AddStringToObject(mp, "device_collectives", j->coll_desc);
        /* each rank's peak resident set (getrusage ru_maxrss) when the layers
         * were done, before the output files were finished */
        cJSON *pk = j->rank_peak ? cJSON_AddArrayToObject(mp, "peak_host_bytes_per_rank") : NULL;
        for (int r = 0; pk && r < j->nranks; r++)
            cJSON_AddItemToArray(pk, cJSON_CreateNumber((double)j->rank_peak[r]));
    }
    if (j->bp) {
        const bk_bwd_flow_stats *bs = &j->bp_stats;
        cJSON *b = cJSON_AddObjectToObject(rep, "backprop");
        cJSON_AddStringToObject(b, "flow", bk_bwd_flow_name(o->bwd_flow));
        cJSON_AddStringToObject(b, "device", j->bp_gpu ? bk_backend_name(j->backend) : "cpu");
        cJSON_AddStringToObject(b, "input_stages", j->ops->name);
        /* the arithmetic run (the CPU's flow: always fp64), the value of
         * --bwd-precision as resolved for this job, and whether it came from
         * auto (bk_bwd_precision_resolve) */
        cJSON_AddStringToObject(b, "precision",
                                !j->bp_gpu ? "fp64" : bk_bwd_precision_name(o->bwd_precision));
        cJSON_AddStringToObject(b, "precision_option", bk_bwd_precision_name(o->bwd_precision));
        cJSON_AddBoolToObject(b, "precision_auto", j->bwd_auto);
        cJSON_AddNumberToObject(b, "leaf_size", j->bp_leaf);
        cJSON_AddStringToObject(b, "fisher", bk_fisher_name(o->fisher));
        cJSON_AddNumberToObject(b, "seed", (double)o->seed);
        cJSON_AddNumberToObject(b, "passes", bs->passes);
        cJSON_AddNumberToObject(b, "max_depth", bs->max_depth);
        cJSON_AddNumberToObject(b, "layer_forwards", (double)bs->layer_forwards);
        cJSON_AddNumberToObject(b, "layer_backwards", (double)bs->layer_backwards);
        cJSON_AddNumberToObject(b, "peak_boundary_host_bytes", (double)bs->peak_boundary_bytes);
        /* planned before the flow started (bp_host_check, src/bwd_mem.h): the
         * boundary peak, the layers' host copies and their budget (the GPU
         * flow: half of MemAvailable at its start; the CPU's: every layer), the
         * host's available memory then */
        cJSON_AddNumberToObject(b, "planned_peak_boundary_host_bytes",
                                (double)j->bp_host.boundary_bytes);
        cJSON_AddNumberToObject(b, "planned_boundary_matrices", j->bp_host.units);
        /* the boundary budget from the host's memory (0: recursive halving) and
         * the root's children (2: halving; more: a wider split, fewer passes) */
        cJSON_AddNumberToObject(b, "boundary_budget", j->bp_units);
        cJSON_AddNumberToObject(b, "root_children",
                                j->bp_leaf >= (int)j->cfg->n_layers || o->bwd_flow == BK_FLOW_NAIVE
                                    ? 0
                                    : bk_bwd_split(0, (int)j->cfg->n_layers, j->bp_leaf, 1,
                                                   j->bp_units));
        /* their elements: f64 (the CPU flow, the GPU's fp64), f32 (fp32 / tf32),
         * bf16 (the GPU's bf16 mode: h and dh rounded to BF16 at every layer
         * boundary, issue 16) */
        cJSON_AddStringToObject(b, "boundary_dtype",
                                j->bp_host.elem_bytes == 2   ? "bf16"
                                : j->bp_host.elem_bytes == 4 ? "f32"
                                                             : "f64");
        cJSON_AddNumberToObject(b, "planned_host_weight_copies_bytes",
                                (double)j->bp_host.copies_bytes);
        /* what a layer's copy is (issue 16): f32; bf16 (the GPU flow's bf16
         * mode, BF16 matrices); mapped_bf16 (its matrices read from the
         * mapped BF16 checkpoint: only biases and norms copied) */
        {
            static const char *const kinds[] = {"f32", "f32", "bf16", "mapped_bf16"};
            const int k = j->bp_host.copies_kind;
            cJSON_AddStringToObject(b, "host_weight_copies_kind",
                                    k >= 0 && k < 4 ? kinds[k] : "f32");
            cJSON_AddNumberToObject(b, "host_weight_copy_layer_bytes",
                                    (double)j->bp_host.layer_bytes);
        }
        cJSON_AddNumberToObject(b, "host_weight_copies_budget_bytes",
                                j->bp_host.copies_budget == UINT64_MAX
                                    ? -1.0
                                    : (double)j->bp_host.copies_budget);
        cJSON_AddNumberToObject(b, "host_available_bytes_at_plan", (double)j->bp_host.avail);
        /* CPU: the flow's micro-batch buffers in host memory; GPU: its device buffers
         * (micro-batch, LM head), the layer weights aside */
        cJSON_AddNumberToObject(b, j->bp_gpu ? "micro_batch_device_bytes" : "micro_batch_host_bytes",
                                (double)bs->micro_bytes);
        cJSON_AddNumberToObject(b, "peak_boundary_device_bytes", 0);
        if (j->bp_gpu) {
            cJSON_AddNumberToObject(b, "resident_layers", bs->resident_layers);
            cJSON_AddNumberToObject(b, "weight_requests", (double)bs->weight_requests);
            cJSON_AddNumberToObject(b, "weight_uploads", (double)bs->weight_uploads);
        }
        cJSON *bt = cJSON_AddObjectToObject(b, "times_s");
        cJSON_AddNumberToObject(bt, "forward", bs->time_forward_s);
        cJSON_AddNumberToObject(bt, "backward", bs->time_backward_s);
        cJSON_AddNumberToObject(bt, "head", bs->time_head_s);
    }
    cJSON_AddItemToObject(rep, "modules", j->report_modules);
    j->report_modules = NULL;
    out = cJSON_Print(rep);
    cJSON_Delete(rep);
    if (!out)
        return bk_error(BK_ERR_NOMEM, "out of memory writing report.json");
    st = bk_path_join(path, sizeof path, j->od.work, "report.json");
    if (st == BK_OK)
        st = bk_write_file_atomic(path, out, strlen(out));
    free(out);
    return st;
}
