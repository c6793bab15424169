/* hessian.h must compile on its own. */
#include "bakron/hessian.h"

int main(void)
{
    return 0;
}
