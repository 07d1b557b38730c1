/* hi_replay_run: a recorded decode step (hybridinfer/backends/cpu/replay.py records it from the backend's first step of a
 * sequence) run as one native call. Each hi_step names an entry point of hi_simd.h and holds the arguments
 * that entry point was bound with, checked once by the Python wrappers when they were recorded; the token's
 * position is the one argument that changes from step to step (pos_arg). No arithmetic here: the entry
 * points do exactly what they do when Python calls them one by one, so the results are the same bits.
 */
#include "hi_pool.h"
#include "hi_simd.h"

_Static_assert(HI_STEP_ARGS == sizeof(((hi_step *)0)->a) / sizeof(hi_arg), "hi_step.a holds HI_STEP_ARGS");

#define P(j) (a[j].p)
#define I(j) (a[j].i)
#define F(j) (a[j].f)

static int hi_step_run(hi_ctx *c, const hi_step *s, int64_t pos) {
    hi_arg a[HI_STEP_ARGS];
    for (int j = 0; j < HI_STEP_ARGS; j++) a[j] = s->a[j];
    if (s->pos_arg >= 0) {
        if (s->pos_arg >= HI_STEP_ARGS) return -2;
        a[s->pos_arg].i += pos;
    }
    switch (s->op) {
    case HI_OP_QUANTIZE:
        return hi_quantize(c, (int)I(0), P(1), I(2), I(3), I(4), P(5), I(6));
    case HI_OP_MATMUL:
        return hi_matmul(c, (int)I(0), P(1), I(2), I(3), P(4), I(5), I(6), P(7), I(8), (int)I(9));
    case HI_OP_MATMUL_MANY:
        return hi_matmul_many(c, (int)I(0), P(1), P(2), P(3), I(4), P(5), P(6), I(7), P(8), P(9), (int)I(10));
    case HI_OP_MOE_GATE_UP:
        return hi_moe_gate_up(c, (int)I(0), P(1), (int)I(2), P(3), I(4), I(5), I(6), P(7), P(8), (int)I(9), P(10),
                              I(11), P(12), I(13), (int)I(14), (int)I(15), P(16), (int)I(17), P(18), I(19), P(20),
                              P(21));
    case HI_OP_MOE_DOWN:
        return hi_moe_down(c, (int)I(0), P(1), I(2), I(3), I(4), P(5), I(6), P(7), (int)I(8), P(9), I(10),
                           (int)I(11), (int)I(12), P(13), I(14), P(15), P(16));
    case HI_OP_SWIGLU:
        return hi_swiglu(c, P(0), I(1), P(2), I(3), P(4), I(5), I(6), I(7));
    case HI_OP_GDN_LAYER:
        return hi_gdn_layer(c, P(0), I(1), P(2), I(3), P(4), I(5), P(6), I(7), P(8), P(9), P(10), P(11), P(12),
                            P(13), I(14), I(15), I(16), I(17), I(18), I(19), I(20), (int)I(21), F(22), P(23), I(24),
                            P(25), I(26), P(27), P(28));
    case HI_OP_RMS_NORM:
        return hi_rms_norm(c, P(0), I(1), P(2), I(3), I(4), I(5), I(6), P(7), F(8), P(9), I(10));
    case HI_OP_SPLIT_QGATE:
        return hi_split_qgate(c, P(0), I(1), I(2), I(3), I(4), P(5), P(6), I(7));
    case HI_OP_SIGMOID_GATE:
        return hi_sigmoid_gate(c, P(0), I(1), P(2), I(3), I(4), I(5));
    case HI_OP_MOE_ROUTE:
        return hi_moe_route(c, P(0), I(1), I(2), I(3), (int)I(4), P(5), P(6));
    case HI_OP_MOE_COMBINE:
        return hi_moe_combine(c, P(0), P(1), I(2), (int)I(3), I(4), P(5), P(6), P(7), P(8));
    case HI_OP_ATTN_STEP:
        return hi_attn_step(c, P(0), I(1), I(2), I(3), P(4), P(5), I(6), P(7), P(8), (int)I(9), (int)I(10), I(11),
                            I(12), I(13), I(14), (float)F(15), (int)I(16), P(17), (float)F(18), P(19), I(20), P(21),
                            I(22), (int)I(23), I(24), I(25), I(26), P(27));
    case HI_OP_MOE_ROWS:
        return hi_moe_rows(c, (int)I(0), P(1), (int)I(2), P(3), (int)I(4), P(5), I(6), I(7), I(8), P(9), I(10), I(11),
                           P(12), (int)I(13), P(14), P(15), I(16), P(17), I(18), P(19), I(20), P(21), I(22), (int)I(23),
                           P(24), P(25), P(26), P(27), I(28));
    case HI_OP_GDN_ROWS:
        return hi_gdn_rows(c, I(0), P(1), I(2), P(3), I(4), P(5), I(6), P(7), I(8), P(9), P(10), P(11), P(12), P(13),
                           P(14), I(15), I(16), I(17), I(18), I(19), I(20), (int)I(21), F(22), P(23), I(24), P(25),
                           I(26));
    case HI_OP_ATTN_ROWS:
        return hi_attn_rows(c, I(0), P(1), I(2), I(3), I(4), P(5), P(6), I(7), P(8), P(9), (int)I(10), (int)I(11),
                            I(12), I(13), P(14), I(15), I(16), (float)F(17), (int)I(18), P(19), (float)F(20), P(21),
                            I(22), P(23), I(24), I(25), I(26), P(27));
    case HI_OP_COPY_MANY:
        return hi_copy_many(c, I(0), P(1), P(2), P(3), P(4), P(5), P(6));
    default:
        return -2;
    }
}

int hi_replay_run(hi_ctx *c, const hi_step *steps, int64_t n, int64_t pos, int64_t *failed, int64_t *ns) {
    if (!c || (!steps && n) || n < 0) return -2;
    for (int64_t i = 0; i < n; i++) {
        const int64_t t0 = ns ? hi_now_ns() : 0;
        const int rc = hi_step_run(c, &steps[i], pos);
        if (ns) ns[i] += hi_now_ns() - t0;
        if (rc) {
            if (failed) *failed = i;
            return rc;
        }
    }
    return 0;
}
