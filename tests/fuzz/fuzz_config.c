/* fuzz_config.c -- libFuzzer target: arbitrary bytes as a fusion-gateway --config file, through the
 * JSON config reader and every option's value parser (base/options.c, gateway/gw-config.c), then
 * the whole configuration's check; a configuration that loads and passes is freed and loaded
 * again from nothing, to find state that leaks between loads. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <fcntl.h>
#include <unistd.h>

#include "gw.h"
#include "log.h"

static char path[64];
static int fd = -1;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fu_log_set_level(FU_LOG_LEVEL_OFF);
    snprintf(path, sizeof path, "/tmp/fuzz-config-%ld.json", (long)getpid());
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) abort();
    return 0;
}

/* Loads the config file as fusion-gateway --config would, then checks it. */
static int load(void) {
    gw_config c;
    gw_config_init(&c);
    int rc = gw_config_load(&c, path);
    if (!rc) rc = gw_config_check(&c);
    gw_config_free(&c);
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (ftruncate(fd, 0) || pwrite(fd, data, size, 0) != (ssize_t)size) abort();
    int first = load();
    if (load() != first) abort(); /* the same file loads the same way every time */
    return 0;
}
