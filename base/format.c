/* format.c -- human-readable quantities. */
#include "format.h"

#include <stdio.h>

const char *fu_format_bytes(double n, char *buf, size_t cap) {
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (n >= 1024.0 && u < 4) {
        n /= 1024.0;
        u++;
    }
    snprintf(buf, cap, u == 0 ? "%.0f %s" : "%.1f %s", n, units[u]);
    return buf;
}
