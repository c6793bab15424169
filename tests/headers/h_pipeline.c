/* pipeline.h must compile on its own. */
#include "bakron/pipeline.h"

int main(void)
{
    return 0;
}
