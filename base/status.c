/* status.c -- status strings and per-thread error details. */
#include "status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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
    /* formatted aside first: the arguments may quote the previous message */
    char msg[sizeof fu_error_buf];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(fu_error_buf, msg, sizeof msg);
    return status;
}

const char *fu_last_error(void) { return fu_error_buf; }

void fu_error_clear(void) { fu_error_buf[0] = '\0'; }
