// llama.cpp's logits at every position of a fixed token sequence (teacher forcing), for bench/faithful_depth.py.
//
//   llama-teacher-forced MODEL TOKENS.i32 OUT.f32 UBATCH THREADS
//
// TOKENS.i32 holds n int32 token ids; OUT.f32 receives n rows of n_vocab float32 logits, row i being the logits
// after token i. UBATCH 0 evaluates all n tokens in one batch (one prefill); UBATCH 1 one token per llama_decode
// (token-by-token decode), any other value that many per call. K/V are F32 and flash attention is off, as the
// project compares engines (only the arithmetic of the two paths differs, not the cache's rounding).
//
// Build statically against a llama.cpp CMake tree (BUILD_SHARED_LIBS=OFF), e.g.
//   g++ -O2 -std=c++17 -static bench/llama_teacher_forced.cpp -I$LCP/include -I$LCP/ggml/include \
//       $B/src/libllama.a $B/ggml/src/libggml.a $B/ggml/src/libggml-cpu.a $B/ggml/src/libggml-base.a \
//       -fopenmp -lpthread -o llama-teacher-forced
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char ** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s MODEL TOKENS.i32 OUT.f32 UBATCH THREADS\n", argv[0]);
        return 2;
    }
    FILE * tf = fopen(argv[2], "rb");
    if (!tf) { fprintf(stderr, "cannot read %s\n", argv[2]); return 2; }
    std::vector<llama_token> ids;
    for (int32_t t; fread(&t, sizeof t, 1, tf) == 1;) ids.push_back(t);
    fclose(tf);
    const int n = (int) ids.size();
    int ub = atoi(argv[4]);
    const int threads = atoi(argv[5]);
    if (n == 0 || ub < 0 || threads < 1) { fprintf(stderr, "no tokens, or a bad UBATCH / THREADS\n"); return 2; }
    if (ub == 0 || ub > n) ub = n;

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const int V = llama_vocab_n_tokens(llama_model_get_vocab(model));

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n + 16;
    cp.n_batch = ub;
    cp.n_ubatch = ub;
    cp.n_seq_max = 1;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot make a context\n"); return 1; }

    FILE * of = fopen(argv[3], "wb");
    if (!of) { fprintf(stderr, "cannot write %s\n", argv[3]); return 2; }
    llama_batch b = llama_batch_init(ub, 0, 1);
    for (int s = 0; s < n; s += ub) {
        const int m = n - s < ub ? n - s : ub;
        b.n_tokens = m;
        for (int i = 0; i < m; i++) {
            b.token[i] = ids[s + i];
            b.pos[i] = s + i;
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = 0;
            b.logits[i] = 1;
        }
        if (llama_decode(ctx, b) != 0) { fprintf(stderr, "llama_decode failed at %d\n", s); return 1; }
        for (int i = 0; i < m; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), V, of);
    }
    fclose(of);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
