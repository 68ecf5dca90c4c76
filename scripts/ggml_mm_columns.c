// Does one column of a ggml matrix product depend on how many columns are computed with it? Products of a random
// 64 x K matrix in each weight type with 1..16 random columns on ggml's CPU backend; prints, per type and per
// column count n >= 2, "0" where the first column equals the one-column product and "X" where it does not.
// docs/results.md, "Which kernels make an answer depend on its ubatch". Build against our tree and run:
//   SRC=$(ls -d ~/.cache/polykv-cpp/src/*/ | head -1); LIB=build/cp311-cp311-linux_x86_64/bin
//   gcc -O2 scripts/ggml_mm_columns.c -I$SRC/ggml/include -L$LIB -lggml -lggml-base -lggml-cpu -lm -Wl,-rpath,$LIB -o /tmp/mm
//   /tmp/mm 4864                     # and GGML_CPU_TILED_MM=0 /tmp/mm 4864
#include "ggml.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char ** argv) {
    const int k = argc > 1 ? atoi(argv[1]) : 4864; // K-quants need a multiple of 256
    const int m = 64;
    const int max_cols = 16;
    const enum ggml_type types[] = { GGML_TYPE_Q8_0, GGML_TYPE_Q5_0, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_F16, GGML_TYPE_F32 };
    if (k <= 0 || k % 256 != 0) {
        fprintf(stderr, "usage: %s K (a positive multiple of 256)\n", argv[0]);
        return 1;
    }
    srand(1);
    float * w = malloc(sizeof(float) * k * m);
    float * x = malloc(sizeof(float) * k * max_cols);
    for (int i = 0; i < k * m; i++) {
        w[i] = rand() / (float) RAND_MAX - 0.5f;
    }
    for (int i = 0; i < k * max_cols; i++) {
        x[i] = rand() / (float) RAND_MAX - 0.5f;
    }
    for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++) {
        float first[64];
        printf("%s:", ggml_type_name(types[t]));
        for (int n = 1; n <= max_cols; n++) {
            struct ggml_init_params params = { 256u << 20, NULL, false };
            struct ggml_context * ctx = ggml_init(params);
            struct ggml_tensor * a = ggml_new_tensor_2d(ctx, types[t], k, m);
            ggml_quantize_chunk(types[t], w, a->data, 0, m, k, NULL);
            struct ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
            memcpy(b->data, x, sizeof(float) * k * n);
            struct ggml_tensor * c = ggml_mul_mat(ctx, a, b);
            struct ggml_cgraph * gf = ggml_new_graph(ctx);
            ggml_build_forward_expand(gf, c);
            ggml_graph_compute_with_ctx(ctx, gf, 1);
            float diff = 0.0f;
            for (int i = 0; i < m; i++) {
                const float v = ((const float *) c->data)[i];
                if (n == 1) {
                    first[i] = v;
                } else {
                    diff = fmaxf(diff, fabsf(v - first[i]));
                }
            }
            if (n > 1) {
                printf(" %d:%s", n, diff == 0.0f ? "0" : "X");
            }
            ggml_free(ctx);
        }
        printf("\n");
    }
    free(w);
    free(x);
    return 0;
}
