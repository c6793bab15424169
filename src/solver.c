/* solver.c — validation and dispatch of the CPU solvers (stub). */
#include "bakron/solver.h"

bk_status bk_solve(const bk_solve_problem *p, const bk_solve_opts *o, bk_solve_result *r)
{
    (void)p;
    (void)o;
    (void)r;
    return bk_error(BK_ERR_UNSUPPORTED, "solve: not implemented yet");
}
