/* clock.c -- monotonic and wall clocks, condition-variable deadlines, sleeping. */
#include "clock.h"

#include <errno.h>

int64_t fu_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

double fu_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double fu_wall_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct timespec fu_deadline_us(clockid_t clock, int64_t us) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    int64_t ns = (int64_t)ts.tv_nsec + (us % 1000000) * 1000;
    ts.tv_sec += (time_t)(us / 1000000 + ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    return ts;
}

void fu_sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}
