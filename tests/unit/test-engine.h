/* test-engine.h -- the engine tests' fixture: a random model of a config, a
 * two-thread CPU backend and an engine over them. Include after cmocka.h. */
#ifndef FU_TEST_ENGINE_H
#define FU_TEST_ENGINE_H

#include "engine.h"
#include "status.h"
#include "test-model.h"

typedef struct fixture {
    mdl_model *m;
    op_backend *be;
    eng_engine *e;
} fixture;

/* Opens model c with weights of type wt (seed 42, whole model with embeddings
 * and head) and an engine of max_batch tokens per chunk. */
static inline void fixture_open_config(fixture *f, const mdl_config *c, op_type wt, int max_batch) {
    mdl_open_options o = mdl_open_options_all();
    assert_int_equal(mdl_random(c, wt, 42, &o, &f->m), FU_OK);
    op_cpu_options co = {.n_threads = 2, .isa = OP_CPU_ISA_AUTO};
    f->be = op_backend_cpu_new(&co);
    assert_non_null(f->be);
    eng_options eo = {max_batch, OP_TYPE_F32};
    assert_int_equal(eng_new(f->m, f->be, &eo, &f->e), FU_OK);
}

static inline void fixture_close(fixture *f) {
    eng_free(f->e);
    op_backend_free(f->be);
    mdl_free(f->m);
}

#endif
