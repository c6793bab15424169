/* Inputs that change while they are read (issue 14, points 4 and 6).
 *
 *  - a mapped safetensors file truncated after it was opened: reading its
 *    lost tail must not kill the process (SIGBUS), and the change is reported
 *    with the file named;
 *  - a file rewritten in place with other finite values (same size) is
 *    reported too (its mtime);
 *  - the same two during a quantize run (the weights are read by the prefetch
 *    thread): the run fails with a bad-input status naming the checkpoint and
 *    leaves no output and no work folder.
 *
 * Deterministic: the file is changed between open and read by the test itself
 * (or, for the runs, from the progress callback, which the driver calls
 * synchronously at the start of layer 1). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bakron/bakron.h"
#include "bakron/pipeline.h"
#include "bakron/safetensors.h"

static char g_dir[256];

static int setup(void **state)
{
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/bk_test_rel_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* mtime far in the past, so any later write gives the file a new one even on
 * filesystems with coarse timestamps */
static void age(const char *path)
{
    struct timespec ts[2] = {{946684800, 0}, {946684800, 0}};
    assert_int_equal(utimensat(AT_FDCWD, path, ts, 0), 0);
}

/* a file holding one F32 tensor "w" of n values i * 0.5 */
static void write_one(const char *path, size_t n)
{
    float *v = malloc(n * sizeof *v);
    assert_non_null(v);
    for (size_t i = 0; i < n; i++)
        v[i] = (float)i * 0.5f;
    bk_st_writer *w = NULL;
    assert_int_equal(bk_st_writer_create(&w), BK_OK);
    int64_t shape[1] = {(int64_t)n};
    assert_int_equal(bk_st_writer_add(w, "w", BK_DT_F32, 1, shape, v, 1), BK_OK);
    assert_int_equal(bk_st_writer_save(w, path), BK_OK);
    bk_st_writer_free(w);
    free(v);
    age(path);
}

static void test_truncated_while_mapped(void **state)
{
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/trunc.safetensors", g_dir);
    const size_t n = 1 << 18; /* 1 MiB of data: 256 pages */
    write_one(path, n);
    bk_st_file *f = NULL;
    assert_int_equal(bk_st_open(path, &f), BK_OK);
    assert_int_equal(bk_st_check_unchanged(f), BK_OK);
    const bk_tensor_info *t = bk_st_find(f, "w");
    assert_non_null(t);
    assert_int_equal(truncate(path, 4096), 0);
    /* without the guard this read dies of SIGBUS */
    const volatile unsigned char *p = t->data;
    unsigned long sum = 0;
    for (size_t i = 0; i < t->nbytes; i += 512)
        sum += p[i];
    (void)sum;
    assert_int_equal(bk_st_check_unchanged(f), BK_ERR_IO);
    assert_non_null(strstr(bk_last_error(), path));
    assert_non_null(strstr(bk_last_error(), "changed while it was being read"));
    assert_int_equal(bk_status_exit_code(BK_ERR_IO), 2);
    bk_st_close(f);
}

static void test_rewritten_in_place(void **state)
{
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/rewrite.safetensors", g_dir);
    write_one(path, 4096);
    bk_st_file *f = NULL;
    assert_int_equal(bk_st_open(path, &f), BK_OK);
    /* same size, other finite values */
    int fd = open(path, O_WRONLY);
    assert_true(fd >= 0);
    const float other[4] = {1.0f, 2.0f, 3.0f, 4.0f};
    assert_int_equal(pwrite(fd, other, sizeof other, (off_t)bk_st_header_size(f) + 8 + 64),
                     (ssize_t)sizeof other);
    close(fd);
    assert_int_equal(bk_st_check_unchanged(f), BK_ERR_IO);
    assert_non_null(strstr(bk_last_error(), path));
    assert_non_null(strstr(bk_last_error(), "modified at"));
    bk_st_close(f);

    /* a set checks every file */
    bk_st_set *s = NULL;
    age(path);
    assert_int_equal(bk_st_set_open(path, &s), BK_OK);
    assert_int_equal(bk_st_set_check_unchanged(s), BK_OK);
    fd = open(path, O_WRONLY);
    assert_true(fd >= 0);
    assert_int_equal(pwrite(fd, other, sizeof other, 200), (ssize_t)sizeof other);
    close(fd);
    assert_int_equal(bk_st_set_check_unchanged(s), BK_ERR_IO);
    bk_st_set_close(s);
}

/* ------------------------------------------------------- during a quantize run */

typedef struct change {
    char path[512];
    int mode; /* 0: truncate to half, 1: rewrite 64 KiB in place with other finite values */
    int done;
} change;

static void on_event(void *user, const bk_event *ev)
{
    change *c = user;
    if (ev->kind != BK_EV_LAYER_BEGIN || ev->layer != 1 || c->done)
        return;
    c->done = 1;
    struct stat sb;
    assert_int_equal(stat(c->path, &sb), 0);
    if (c->mode == 0) {
        assert_int_equal(truncate(c->path, sb.st_size / 2), 0);
        return;
    }
    /* copy 64 KiB from the middle of the data over a later part (BF16 weights:
     * finite values, different ones) */
    int fd = open(c->path, O_RDWR);
    assert_true(fd >= 0);
    static char buf[65536];
    assert_int_equal(pread(fd, buf, sizeof buf, sb.st_size / 2), (ssize_t)sizeof buf);
    assert_int_equal(pwrite(fd, buf, sizeof buf, sb.st_size - (off_t)sizeof buf - 4096),
                     (ssize_t)sizeof buf);
    close(fd);
}

static int exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

static int work_folders_left(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        if (strstr(e->d_name, ".tmp-") || strstr(e->d_name, ".old-"))
            n++;
    if (d)
        closedir(d);
    return n;
}

static void run_changed(int mode)
{
    const char *src = getenv("BK_SOURCE_ROOT");
    assert_non_null(src);
    char model[400], cmd[1400], out[600], calib[600];
    snprintf(model, sizeof model, "%s/model%d", g_dir, mode);
    snprintf(cmd, sizeof cmd, "cp -r '%s/examples/kerneldocs-1.6m' '%s'", src, model);
    assert_int_equal(system(cmd), 0);
    snprintf(calib, sizeof calib, "%s/examples/kerneldocs-1.6m/calib.safetensors", src);
    snprintf(out, sizeof out, "%s/out%d", g_dir, mode);
    change c;
    memset(&c, 0, sizeof c);
    snprintf(c.path, sizeof c.path, "%s/model.safetensors", model);
    c.mode = mode;
    age(c.path);

    bk_quantize_opts o;
    bk_quantize_opts_default(&o);
    o.model_dir = model;
    o.calib_path = calib;
    o.out_dir = out;
    o.samples = 2;
    o.seqlen = 32;
    o.backend = BK_BACKEND_CPU;
    o.on_event = on_event;
    o.user = &c;
    bk_status st = bk_quantize(&o);
    assert_true(c.done);
    assert_int_equal(bk_status_exit_code(st), 2);
    assert_non_null(strstr(bk_last_error(), c.path));
    assert_non_null(strstr(bk_last_error(), "changed while it was being read"));
    assert_false(exists(out));
    assert_int_equal(work_folders_left(g_dir), 0);
}

static void test_quantize_truncated(void **state)
{
    (void)state;
    run_changed(0);
}

static void test_quantize_rewritten(void **state)
{
    (void)state;
    run_changed(1);
}

/* the library's own check of bk_quantize_opts.bwd_boundaries (the CLI
 * refuses these values itself; a library caller reaches bk_quantize and
 * bk_quantize_check directly): out of [-1, 4096], or a budget with the naive
 * flow (which holds no boundaries), is refused at once, nothing written */
static void test_bwd_boundaries_opts(void **state)
{
    (void)state;
    const char *src = getenv("BK_SOURCE_ROOT");
    assert_non_null(src);
    char model[600], calib[700], out[600];
    snprintf(model, sizeof model, "%s/examples/kerneldocs-1.6m", src);
    snprintf(calib, sizeof calib, "%s/calib.safetensors", model);
    snprintf(out, sizeof out, "%s/out_bounds", g_dir);
    const struct {
        int units, naive;
        const char *want;
    } cases[] = {
        {-2, 0, "--bwd-boundaries -2: expected auto (-1) or an integer in [0, 4096]"},
        {4097, 0, "--bwd-boundaries 4097: expected auto (-1) or an integer in [0, 4096]"},
        {3, 1, "--bwd-boundaries 3 and --bwd-flow naive contradict each other"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bk_quantize_opts o;
        bk_quantize_opts_default(&o);
        o.model_dir = model;
        o.calib_path = calib;
        o.out_dir = out;
        o.samples = 2;
        o.seqlen = 32;
        o.backend = BK_BACKEND_CPU;
        o.hessian = BK_HESS_BACKPROP_KFAC;
        o.bwd_boundaries = cases[i].units;
        if (cases[i].naive)
            o.bwd_flow = BK_FLOW_NAIVE;
        bk_status st = bk_quantize_check(&o, NULL, NULL, NULL);
        assert_int_not_equal(st, BK_OK);
        assert_non_null(strstr(bk_last_error(), cases[i].want));
        st = bk_quantize(&o);
        assert_int_equal(bk_status_exit_code(st), 1);
        assert_non_null(strstr(bk_last_error(), cases[i].want));
        assert_false(exists(out));
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_truncated_while_mapped),
        cmocka_unit_test(test_rewritten_in_place),
        cmocka_unit_test(test_quantize_truncated),
        cmocka_unit_test(test_quantize_rewritten),
        cmocka_unit_test(test_bwd_boundaries_opts),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
