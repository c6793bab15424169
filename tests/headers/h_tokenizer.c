/* tokenizer.h must compile on its own. */
#include "bakron/tokenizer.h"

int main(void)
{
    return 0;
}
