/* The stop flag (internal; src/stop.c): set by bk_request_stop (a signal
 * handler may call it), read between units of work by the drivers, which
 * then end with BK_ERR_INTERRUPTED. */
#ifndef BK_STOP_H
#define BK_STOP_H

int bk__stop_requested(void);
/* A new job starts with the flag clear. */
void bk__stop_clear(void);

#endif
