/* The checks of the backend-table tests (test_backend_ops, test_backend_dispatch):
 * CHECK records a failure with its message and goes on (the file's verdict is
 * g_fail); OK stops the test at a bakron call that did not return BK_OK. */
#ifndef BK_TEST_CHECK_H
#define BK_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "bakron/status.h"

static int g_fail;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            printf("FAIL (line %d): ", __LINE__);                                                  \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
            g_fail = 1;                                                                            \
        }                                                                                          \
    } while (0)

#define OK(call)                                                                                   \
    do {                                                                                           \
        bk_status s_ = (call);                                                                     \
        if (s_ != BK_OK) {                                                                         \
            printf("FAIL: %s: %s\n", #call, bk_last_error());                                      \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#endif
