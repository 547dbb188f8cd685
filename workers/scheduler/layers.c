/* Every decoder layer of one step in one call (layers.py), for a bf16 or fp32
   model whose kernels are all ours at the step's row count: a decode step of a few
   rows otherwise spends about a third of its time in Python between its ~300
   kernel calls. The kernels come as pointers into their own libraries and are
   called in the order, and on the buffers, that model.LlamaModel._layers uses,
   so the hidden states come out bit for bit the same. */

#include <stdint.h>
#include <stdlib.h>

typedef void (*gemm_fn)(const void *x, int rows, int in, const void *w, void *y, int bf16_out,
                        int out);
typedef void (*norm_fn)(void *h, const void *delta, const void *weight, void *out, int rows,
                        int n, float eps, int bf16);
typedef void (*rope_fn)(void *x, int64_t stride, int rows, int heads, int dim,
                        const int64_t *positions, const void *cos, const void *sin, int bf16);
typedef void (*silu_fn)(const void *gate_up, void *out, int rows, int n, int bf16);
typedef void (*attend_fn)(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                          const void *v, int64_t v_stride, int bf16, int rows,
                          const int64_t *slots, int batch, int heads, int kv_heads, int dim,
                          void *k_cache, void *v_cache, int64_t cache_slots,
                          const int32_t *tables, int table_width, const int32_t *lengths,
                          int block_size, float scale, void *out);

typedef struct { gemm_fn fn; const void *w; } Proj;
typedef struct {
    Proj qkv, o, gate_up, down;
    const void *input_norm, *post_norm;
    void *k_cache, *v_cache;
} Layer;
typedef struct {
    norm_fn norm; rope_fn rope; silu_fn silu; attend_fn attend;
    int hidden, inter, heads, kv_heads, dim;
    float eps, scale;
    int64_t cache_slots;
    int bf16;  /* activations, weights of the norms, rope tables and KV cache: else fp32 */
} Model;
typedef struct {  /* the attention kernel's per-step arguments (paged.InPlace.prepare) */
    const int64_t *slots; int batch; const int32_t *tables; int width;
    const int32_t *lengths; int block_size;
} Step;

/* h [rows, hidden], the residual stream after the embedding, updated in place. */
void decode_layers(const Model *m, const Layer *layers, int num_layers, const Step *s,
                   int rows, const int64_t *positions, const void *cos, const void *sin,
                   void *h) {
    const int nq = m->heads * m->dim, nkv = m->kv_heads * m->dim, width = nq + 2 * nkv;
    const int bf16 = m->bf16;
    const size_t r = (size_t)rows, size = bf16 ? 2 : 4;
    char *x = malloc(size * r * m->hidden), *qkv = malloc(size * r * width);
    char *att = malloc(size * r * nq), *delta = malloc(size * r * m->hidden);
    char *gate_up = malloc(2 * size * r * m->inter), *act = malloc(size * r * m->inter);
    m->norm(h, NULL, layers[0].input_norm, x, rows, m->hidden, m->eps, bf16);
    for (int l = 0; l < num_layers; l++) {
        const Layer *L = layers + l;
        L->qkv.fn(x, rows, m->hidden, L->qkv.w, qkv, bf16, width);
        m->rope(qkv, width, rows, m->heads + m->kv_heads, m->dim, positions, cos, sin, bf16);
        m->attend(qkv, width, qkv + size * nq, width, qkv + size * (nq + nkv), width, bf16,
                  rows, s->slots, s->batch, m->heads, m->kv_heads, m->dim, L->k_cache,
                  L->v_cache, m->cache_slots, s->tables, s->width, s->lengths, s->block_size,
                  m->scale, att);
        L->o.fn(att, rows, nq, L->o.w, delta, bf16, m->hidden);
        m->norm(h, delta, L->post_norm, x, rows, m->hidden, m->eps, bf16);
        L->gate_up.fn(x, rows, m->hidden, L->gate_up.w, gate_up, bf16, 2 * m->inter);
        m->silu(gate_up, act, rows, m->inter, bf16);
        L->down.fn(act, rows, m->inter, L->down.w, delta, bf16, m->hidden);
        /* the next layer's norm; after the last, only h += delta (x is not used) */
        const void *next = l + 1 < num_layers ? layers[l + 1].input_norm : L->post_norm;
        m->norm(h, delta, next, x, rows, m->hidden, m->eps, bf16);
    }
    free(x); free(qkv); free(att); free(delta); free(gate_up); free(act);
}
