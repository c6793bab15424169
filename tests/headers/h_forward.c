/* forward.h must compile on its own. */
#include "bakron/forward.h"

int main(void)
{
    return 0;
}
