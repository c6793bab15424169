#include "bakron/bakron.h"
#include "bk_config.h"

const char *bk_version(void)
{
    return BK_VERSION;
}
