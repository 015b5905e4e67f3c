/* clock.h -- the project's clocks: monotonic time for intervals, wall time for stamps and deadlines.
 *
 * Stateless and thread-safe. Monotonic readings share one origin (the system's
 * boot, as CLOCK_MONOTONIC) and only their differences mean anything.
 */
#ifndef FU_CLOCK_H
#define FU_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Monotonic time in microseconds. */
int64_t fu_now_us(void);
/* Monotonic time in seconds. */
double fu_now_s(void);
/* Wall-clock time (CLOCK_REALTIME) in seconds since the Unix epoch. */
double fu_wall_s(void);
/* The instant `us` microseconds from now on `clock` (CLOCK_REALTIME, or the
 * clock a condition variable was made with), as pthread_cond_timedwait()
 * wants its deadline (us >= 0). */
struct timespec fu_deadline_us(clockid_t clock, int64_t us);
/* Sleeps for ms milliseconds, resuming after signals. */
void fu_sleep_ms(long ms);

#endif
