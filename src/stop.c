/* The stop flag (src/stop.h). */
#include <signal.h>

#include "bakron/pipeline.h"
#include "stop.h"

static volatile sig_atomic_t g_stop;

void bk_request_stop(void)
{
    g_stop = 1;
}

int bk__stop_requested(void)
{
    return g_stop != 0;
}

void bk__stop_clear(void)
{
    g_stop = 0;
}
