/* solver_ref.c — to be implemented (see include/bakron/). */
#include "bakron/status.h"
typedef int bk_solver_ref_placeholder;
