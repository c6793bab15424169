/* solver.h must compile on its own. */
#include "bakron/solver.h"

int main(void)
{
    return 0;
}
