/* forward.c — to be implemented (see include/bakron/forward.h). */
#include "bakron/forward.h"
typedef int bk_forward_placeholder;
