/* bakron.h must compile on its own. */
#include "bakron/bakron.h"

int main(void)
{
    return 0;
}
