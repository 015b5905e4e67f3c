/* fuzz_safetensors.c -- libFuzzer target: arbitrary bytes as a safetensors file, parsed from
 * memory by the same header parser as mapped files; every tensor is then looked up and described. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "log.h"
#include "safetensors.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fu_log_set_level(FU_LOG_LEVEL_OFF);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    st_model *m = NULL;
    if (st_model_open_mem(data, size, "fuzz.safetensors", &m)) return 0;
    for (int64_t i = 0; i < st_model_n_tensors(m); i++) {
        const char *name = st_model_tensor_name(m, i);
        if (!name || st_model_find_index(m, name) != i) abort();
        st_tensor_info info;
        if (st_model_tensor_info(m, i, &info)) abort();
        if (info.nbytes) {
            const uint8_t *p = info.data;
            volatile uint8_t sink = p[0] ^ p[info.nbytes - 1];
            (void)sink;
        }
        op_tensor t;
        (void)st_model_find(m, name, &t);
    }
    st_model_close(m);
    return 0;
}
