/* Every decoder layer of one step in one call (layers.py), for a bf16 or fp32
   model whose kernels are all ours at the step's row count: a decode step of a few
   rows otherwise spends about a third of its time in Python between its ~300
   kernel calls. The kernels come as pointers into their own libraries and are
   called in the order, and on the buffers, that model.LlamaModel._layers uses,
   so the hidden states come out bit for bit the same; grouped (layers.row_groups),
   each row's work is the same, so they come out the same again. */

#include <immintrin.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
    int gate_up_silu;  /* gate_up.fn writes silu(gate) * up [rows, inter] itself */
} Layer;
typedef struct {
    norm_fn norm; rope_fn rope; silu_fn silu; attend_fn attend;
    const void *embed;  /* the token embeddings [vocab, hidden] */
    const void *final_norm;  /* the model's last norm's weight */
    int hidden, inter, heads, kv_heads, dim;
    float eps, scale;
    int64_t cache_slots;
    int bf16;  /* activations, weights of the norms and rope tables: else fp32 */
    int attend_mode;  /* the attention kernel's `bf16` argument: its KV cache's dtype too */
} Model;
typedef struct {  /* the attention kernel's per-step arguments (paged.InPlace.prepare);
                    every row is a query row of its own, so their count is the step's rows */
    const int64_t *slots; const int32_t *tables; int width;
    const int32_t *lengths; int block_size;
} Step;

/* A step's scratch buffers, [rows, ...] each; a group uses its own rows of them. */
typedef struct { char *x, *qkv, *att, *delta, *gate_up, *act; } Buffers;

/* Cache-line aligned: a tile or vector row of 64 bytes read from or written to
   an address malloc leaves 16 bytes past a line spans two lines (the dense AMX
   matmul's prefill steps took 1.3x the time on malloc's buffers) */
static char *line_alloc(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

static Buffers buffers(const Model *m, size_t rows) {
    const size_t size = m->bf16 ? 2 : 4, nq = (size_t)m->heads * m->dim;
    const size_t width = nq + 2 * (size_t)m->kv_heads * m->dim;
    Buffers b = {line_alloc(size * rows * m->hidden), line_alloc(size * rows * width),
                 line_alloc(size * rows * nq), line_alloc(size * rows * m->hidden),
                 line_alloc(2 * size * rows * m->inter), line_alloc(size * rows * m->inter)};
    return b;
}

static void free_buffers(Buffers b) {
    free(b.x); free(b.qkv); free(b.att); free(b.delta); free(b.gate_up); free(b.act);
}

/* Rows [a, a + rows) of h: the embeddings of their tokens, ids[a..]; and
   their first layer's normalized input, into x. */
static void input_norm_rows(const Model *m, const Layer *layers, const int64_t *ids, int a,
                            int rows, void *h, Buffers b) {
    const size_t row = (size_t)m->hidden * (m->bf16 ? 2 : 4), at = (size_t)a * row;
    for (int r = 0; r < rows; r++)
        memcpy((char *)h + at + r * row, (const char *)m->embed + ids[a + r] * row, row);
    m->norm((char *)h + at, NULL, layers[0].input_norm, b.x + at, rows, m->hidden, m->eps,
            m->bf16);
}

/* Layer l on rows [a, a + rows) of h, whose x holds the layer's normalized
   input; leaves the next layer's there, and after the last the model's final
   norm of h in `out`. */
static void layer_rows(const Model *m, const Layer *layers, int num_layers, int l,
                       const Step *s, int a, int rows, const int64_t *positions,
                       const void *cos, const void *sin, void *h, void *out, Buffers b) {
    const int nq = m->heads * m->dim, nkv = m->kv_heads * m->dim, width = nq + 2 * nkv;
    const int bf16 = m->bf16;
    const size_t size = bf16 ? 2 : 4, at = (size_t)a;
    const Layer *L = layers + l;
    char *x = b.x + size * at * m->hidden, *qkv = b.qkv + size * at * width;
    char *att = b.att + size * at * nq, *delta = b.delta + size * at * m->hidden;
    char *gate_up = b.gate_up + 2 * size * at * m->inter, *act = b.act + size * at * m->inter;
    char *hr = (char *)h + size * at * m->hidden;
    L->qkv.fn(x, rows, m->hidden, L->qkv.w, qkv, bf16, width);
    m->rope(qkv, width, rows, m->heads + m->kv_heads, m->dim, positions + a, cos, sin, bf16);
    /* each row its own query (a token sees its sequence up to itself) */
    m->attend(qkv, width, qkv + size * nq, width, qkv + size * (nq + nkv), width,
              m->attend_mode, rows, s->slots + a, rows, m->heads, m->kv_heads, m->dim, L->k_cache,
              L->v_cache, m->cache_slots, s->tables + at * s->width, s->width,
              s->lengths + a, s->block_size, m->scale, att);
    L->o.fn(att, rows, nq, L->o.w, delta, bf16, m->hidden);
    m->norm(hr, delta, L->post_norm, x, rows, m->hidden, m->eps, bf16);
    if (L->gate_up_silu) {
        L->gate_up.fn(x, rows, m->hidden, L->gate_up.w, act, bf16, 2 * m->inter);
    } else {
        L->gate_up.fn(x, rows, m->hidden, L->gate_up.w, gate_up, bf16, 2 * m->inter);
        m->silu(gate_up, act, rows, m->inter, bf16);
    }
    L->down.fn(act, rows, m->inter, L->down.w, delta, bf16, m->hidden);
    if (l + 1 < num_layers)
        m->norm(hr, delta, layers[l + 1].input_norm, x, rows, m->hidden, m->eps, bf16);
    else
        m->norm(hr, delta, m->final_norm, (char *)out + size * at * m->hidden, rows, m->hidden,
                m->eps, bf16);
}

/* The step's tokens ids [rows] through every layer: out [rows, hidden] is the
   model's final norm of the residual stream (h [rows, hidden], scratch), as
   LlamaModel.head_input gives it; each kernel spreads its own work over the
   threads. */
void decode_layers(const Model *m, const Layer *layers, int num_layers, const Step *s,
                   int rows, const int64_t *ids, const int64_t *positions, const void *cos,
                   const void *sin, void *h, void *out) {
    Buffers b = buffers(m, rows);
    input_norm_rows(m, layers, ids, 0, rows, h, b);
    for (int l = 0; l < num_layers; l++)
        layer_rows(m, layers, num_layers, l, s, 0, rows, positions, cos, sin, h, out, b);
    free_buffers(b);
}

/* A group's progress: the next layer it needs, and whether a thread holds it. */
typedef struct { _Atomic int next, busy; char pad[56]; } Progress;

/* As decode_layers, on groups of rows that attend apart (whole sequences:
   starts[g] to starts[g + 1]), each its own chain of layers: a thread takes
   the free group furthest behind, runs one layer on it with every kernel on
   this thread alone, and lets it go. No thread waits for another between
   layers, so one the OS preempts holds up one group, not the step. */
void decode_layers_grouped(const Model *m, const Layer *layers, int num_layers,
                           const Step *s, int rows, const int64_t *ids,
                           const int64_t *positions, const void *cos, const void *sin, void *h,
                           void *out, const int32_t *starts, int groups) {
    Buffers b = buffers(m, rows);
    Progress *progress = aligned_alloc(64, sizeof(Progress) * groups);
    for (int g = 0; g < groups; g++) {
        atomic_init(&progress[g].next, -1);  /* -1: its embeddings and first norm */
        atomic_init(&progress[g].busy, 0);
    }
    const int levels = omp_get_max_active_levels();
    omp_set_max_active_levels(1);  /* the kernels' own regions: this thread alone */
    #pragma omp parallel
    for (;;) {
        int pick = -1, behind = num_layers, left = 0;
        for (int g = 0; g < groups; g++) {
            const int next = atomic_load(&progress[g].next);
            left += next < num_layers;
            if (next < behind && !atomic_load(&progress[g].busy)) {
                pick = g;
                behind = next;
            }
        }
        if (!left)
            break;
        int free_ = 0;
        if (pick < 0 || !atomic_compare_exchange_strong(&progress[pick].busy, &free_, 1)) {
            _mm_pause();
            continue;
        }
        const int l = atomic_load(&progress[pick].next);  /* another may have run it since */
        const int a = starts[pick], n = starts[pick + 1] - a;
        if (l < num_layers) {
            if (l < 0)
                input_norm_rows(m, layers, ids, a, n, h, b);
            else
                layer_rows(m, layers, num_layers, l, s, a, n, positions, cos, sin, h, out, b);
            atomic_store(&progress[pick].next, l + 1);
        }
        atomic_store(&progress[pick].busy, 0);
    }
    omp_set_max_active_levels(levels);
    free(progress);
    free_buffers(b);
}
