/* hessian.c — to be implemented (see include/bakron/hessian.h). */
#include "bakron/hessian.h"
typedef int bk_hessian_placeholder;
