/* format.h -- human-readable quantities for logs and progress lines.
 *
 * Stateless and thread-safe; callers own the output buffers.
 */
#ifndef FU_FORMAT_H
#define FU_FORMAT_H

#include <stddef.h>

/* Writes n bytes as "512 B", "1.5 KiB", "3.2 GiB" (binary units up to TiB)
 * into buf (cap bytes, truncated as snprintf does) and returns buf. */
const char *fu_format_bytes(double n, char *buf, size_t cap);

#endif
