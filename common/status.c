/* status.c -- status strings and per-thread error details. */
#include "status.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char fu_error_buf[1024];

const char *fu_status_str(int status) {
    switch (status) {
#define FU_STATUS_CASE_(name, value, desc) \
    case value:                            \
        return desc;
        FU_STATUS_LIST(FU_STATUS_CASE_)
#undef FU_STATUS_CASE_
    }
    return "unknown status";
}

int fu_errorf(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fu_error_buf, sizeof fu_error_buf, fmt, ap);
    va_end(ap);
    return status;
}

const char *fu_last_error(void) { return fu_error_buf; }

void fu_error_clear(void) { fu_error_buf[0] = '\0'; }
