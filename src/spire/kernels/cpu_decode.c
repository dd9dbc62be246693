/* CPU decoding kernels for x86-64 with AVX2 + FMA (spire.kernels): the skinny matmul (spire_skinny_gemm[_bf16]),
 * RMSNorm (spire_rms_norm), decode attention (spire_attn_scores, spire_attn_pv), and the whole decoder block
 * of a decode step (spire_decode_block) with its memory-key/value variant (spire_block_kv), each described
 * where it is defined.
 *
 * Skinny matmul: float32 activations times
 * float32 weights (spire_skinny_gemm) or bf16 weights (spire_skinny_gemm_bf16: half the weight bytes to
 * stream, widened to float32 in registers, float32 arithmetic). The panel matmul also takes group-quantized
 * int8 weights (spire_panel_gemm_i8: a quarter of float32's bytes).
 *
 *   y[m, off_i + n] = sum_k x[m, k] * W_i[n, k]      for every weight W_i (N_i x K, row-major: nn.Linear's
 *                                                     own layout, no copy), m < M, n < N_i
 *
 * Decoding multiplies a few activation rows (M = batch x new tokens, 1..64) by large weight matrices. BLAS
 * libraries pack the weight for every call, extra memory traffic that small M cannot amortize; here every
 * weight row is read from memory once. Up to STREAM_MAX_M = 8 rows, one pass per weight row multiplies it
 * with every activation row as it streams in (one accumulator per activation row), so memory and arithmetic
 * overlap; this made M = 5 (a verify pass at B = 1) 15-25 % faster than the blocked scheme on an AVX2 core.
 * Beyond, rows are taken four at a time and multiplied with all M rows while they sit in L1, activation rows
 * two at a time (8 ymm accumulators). k goes in steps of 8 floats with fused multiply-adds, then a
 * horizontal sum. Rows are split over OpenMP threads (torch's own
 * libgomp, loaded first, so the thread pool and omp_set_num_threads are shared with torch).
 *
 * Summation order differs from BLAS: results agree to float32 rounding (about 1e-6 relative); with bf16
 * weights, to float32 rounding of the product with the bf16 values (the widening is exact).
 */
#include <math.h>
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

/* Software prefetch distance in weight rows (two blocks of four): while the first activation rows are
 * multiplied with a block, the block after next streams in, so memory and arithmetic overlap. Prefetches
 * past the end of a matrix are harmless (they never fault). */
#define PF_ROWS 8

/* Up to this many activation rows, one pass per weight row (stream_*); beyond, 4-row blocks reused from L1. */
#ifndef STREAM_MAX_M
#define STREAM_MAX_M 8
#endif

/* Weight loads: eight consecutive weights as floats. bf16 is the top half of a float32, so widening is a
 * zero-extension and a shift (exact). */
static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load_bf16(const uint16_t *p) {
    __m256i i32 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(i32, 16));
}
static inline float scalar_f32(const float *p) { return *p; }
static inline float scalar_bf16(const uint16_t *p) {
    union { uint32_t u; float f; } v = {(uint32_t)*p << 16};
    return v.f;
}

/* ------------------------------------------------------------------------------------------------------
 * AVX-512 few-row path (M <= STREAM_MAX_M), chosen at run time on CPUs with AVX-512F/BW (the file is
 * compiled with -mavx2 -mfma; these functions carry their own target attribute, so the library still builds
 * and runs on AVX2-only CPUs). A tile is R consecutive weight rows times all MB <= 8 activation rows, R x MB
 * zmm accumulators (R = 8, 8, 6, 6, 4, 4, 3, 3 for MB = 1..8: at most 24 of the 32 registers, plus R weight
 * vectors and one activation vector), so every weight row is read from memory once and each 16-float weight
 * load and activation load feeds R or MB fused multiply-adds (the AVX2 stream path loads every activation
 * vector once per weight row: at MB = 5 it issued six loads per five FMAs and ran at 8 GB/s of weights where
 * M = 1 streams 20). K tails use masked loads; the R x MB sums reduce four rows at a time with hadd.
 * spire_set_avx512(0) switches back to the AVX2 path (A/B timing, tests).
 */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define T512_INLINE static inline __attribute__((always_inline)) T512

static int g_avx512 = -1;  /* -1: not decided yet; 0: AVX2 paths; 1: AVX-512 few-row path */

static int avx512_cpu(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

static inline int use_avx512(void) {
    if (g_avx512 < 0) g_avx512 = avx512_cpu();
    return g_avx512;
}

/* on = 1: use the AVX-512 path when the CPU has it; 0: the AVX2 paths. Returns whether AVX-512 is now used. */
int spire_set_avx512(int on) {
    g_avx512 = on ? avx512_cpu() : 0;
    return g_avx512;
}

T512_INLINE __m512 ld512_f32(const float *p) { return _mm512_loadu_ps(p); }
T512_INLINE __m512 ld512_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
T512_INLINE __m512 ldm512_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
T512_INLINE __m512 ldm512_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* lanes of a zmm folded to a ymm (sum of the two halves) */
T512_INLINE __m256 fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* Prefetch distance of the AVX-512 tiles, in tiles ahead (0: hardware prefetch only). */
#ifndef PF512_TILES
#define PF512_TILES 2
#endif

#define DEFINE_SKINNY512(SUF, WT)                                                                             \
/* R weight rows (w, w + K, ...) times MB activation rows: y[j * ldy + r] for r < R, j < MB. */               \
T512_INLINE void tile512_##SUF(const float *restrict x, int64_t ldx, const WT *restrict w, int64_t K,          \
                               float *restrict y, int64_t ldy, const int R, const int MB, const WT *pf) {     \
    __m512 acc[8][8];                                                                                         \
    for (int r = 0; r < R; r++)                                                                               \
        for (int j = 0; j < MB; j++) acc[r][j] = _mm512_setzero_ps();                                         \
    int64_t K16 = K & ~(int64_t)15, k = 0;                                                                    \
    for (; k < K16; k += 16) {                                                                                \
        if (pf && (k & (64 / (int64_t)sizeof(WT) - 1)) == 0)                                                  \
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(pf + r * K + k), _MM_HINT_T0);           \
        __m512 wv[8];                                                                                         \
        for (int r = 0; r < R; r++) wv[r] = ld512_##SUF(w + r * K + k);                                       \
        for (int j = 0; j < MB; j++) {                                                                        \
            __m512 xv = _mm512_loadu_ps(x + j * ldx + k);                                                     \
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(wv[r], xv, acc[r][j]);                    \
        }                                                                                                     \
    }                                                                                                         \
    if (k < K) {                                                                                              \
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);                                                       \
        __m512 wv[8];                                                                                         \
        for (int r = 0; r < R; r++) wv[r] = ldm512_##SUF(w + r * K + k, m);                                   \
        for (int j = 0; j < MB; j++) {                                                                        \
            __m512 xv = _mm512_maskz_loadu_ps(m, x + j * ldx + k);                                            \
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(wv[r], xv, acc[r][j]);                    \
        }                                                                                                     \
    }                                                                                                         \
    for (int j = 0; j < MB; j++)                                                                              \
        for (int r0 = 0; r0 < R; r0 += 4) {                                                                   \
            __m256 h[4];                                                                                      \
            for (int c = 0; c < 4; c++) h[c] = r0 + c < R ? fold512(acc[r0 + c][j]) : _mm256_setzero_ps();   \
            __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));               \
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));                   \
            if (R - r0 >= 4) {                                                                                \
                _mm_storeu_ps(y + j * ldy + r0, s);                                                           \
            } else {                                                                                          \
                float t[4];                                                                                   \
                _mm_storeu_ps(t, s);                                                                          \
                for (int c = 0; r0 + c < R; c++) y[j * ldy + r0 + c] = t[c];                                  \
            }                                                                                                 \
        }                                                                                                     \
}                                                                                                             \
                                                                                                              \
/* n_rows <= R weight rows against MB activation rows (MB, R compile-time in every case). */                \
static T512 void tile512_any_##SUF(const float *x, int64_t ldx, const WT *w, int64_t K, float *y, int64_t ldy, \
                                   int MB, int n_rows, const WT *pf) {                                        \
    switch (MB * 16 + n_rows) {                                                                               \
        SK512_CASES(SUF)                                                                                      \
        default: break;                                                                                       \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* the few-row product: blocks of R512(M) weight rows over OpenMP threads */                                  \
static T512 void gemm512_##SUF(const float *x, int64_t ldx, int64_t M, int64_t K, int n_w,                    \
                               const WT *const *weights, const int64_t *ns, const int64_t *offs, float *y,    \
                               int64_t ldy) {                                                                 \
    int R = r512(M);                                                                                          \
    int64_t blocks[17];                                                                                       \
    blocks[0] = 0;                                                                                            \
    for (int i = 0; i < n_w; i++) blocks[i + 1] = blocks[i] + (ns[i] + R - 1) / R;                            \
    int64_t total = blocks[n_w];                                                                              \
    _Pragma("omp parallel for schedule(static)")                                                              \
    for (int64_t b = 0; b < total; b++) {                                                                     \
        int i = 0;                                                                                            \
        while (b >= blocks[i + 1]) i++;                                                                       \
        int64_t n = (b - blocks[i]) * R;                                                                      \
        int nr = (int)(ns[i] - n < R ? ns[i] - n : R);                                                        \
        const WT *wb = weights[i] + n * K;                                                                    \
        const WT *pf = PF512_TILES && n + (int64_t)(PF512_TILES + 1) * R <= ns[i]                             \
                           ? wb + (int64_t)PF512_TILES * R * K : 0;                                           \
        tile512_any_##SUF(x, ldx, wb, K, y + offs[i] + n, ldy, (int)M, nr, pf);                               \
    }                                                                                                         \
}

/* weight rows per tile for MB activation rows: R x MB <= 24 accumulators */
static inline int r512(int64_t M) { return M <= 2 ? 8 : M <= 4 ? 6 : M <= 6 ? 4 : 3; }

#define SK512_C(SUF, MB, R) case MB * 16 + R: tile512_##SUF(x, ldx, w, K, y, ldy, R, MB, pf); break;
#define SK512_R8(SUF, MB) SK512_C(SUF, MB, 1) SK512_C(SUF, MB, 2) SK512_C(SUF, MB, 3) SK512_C(SUF, MB, 4) \
    SK512_C(SUF, MB, 5) SK512_C(SUF, MB, 6) SK512_C(SUF, MB, 7) SK512_C(SUF, MB, 8)
#define SK512_R6(SUF, MB) SK512_C(SUF, MB, 1) SK512_C(SUF, MB, 2) SK512_C(SUF, MB, 3) SK512_C(SUF, MB, 4) \
    SK512_C(SUF, MB, 5) SK512_C(SUF, MB, 6)
#define SK512_R4(SUF, MB) SK512_C(SUF, MB, 1) SK512_C(SUF, MB, 2) SK512_C(SUF, MB, 3) SK512_C(SUF, MB, 4)
#define SK512_R3(SUF, MB) SK512_C(SUF, MB, 1) SK512_C(SUF, MB, 2) SK512_C(SUF, MB, 3)
#define SK512_CASES(SUF) SK512_R8(SUF, 1) SK512_R8(SUF, 2) SK512_R6(SUF, 3) SK512_R6(SUF, 4) SK512_R4(SUF, 5) \
    SK512_R4(SUF, 6) SK512_R3(SUF, 7) SK512_R3(SUF, 8)

DEFINE_SKINNY512(f32, float)
DEFINE_SKINNY512(bf16, uint16_t)

/* Smallest M that takes the AVX-512 path (below, the AVX2 stream path: at M = 1, 2 it streamed 20 GB/s of
 * float32 weights where the 8- and 6-row tiles reached 12-16 on a Zen 4 EPYC core). */
#ifndef AVX512_MIN_M
#define AVX512_MIN_M 3
#endif

/* DEFINE_SKINNY(SUF, WT): tile_SUF, rows_block_SUF and spire_skinny_gemm[_SUF] for weights of type WT
 * (float32, or bf16 stored as uint16_t; activations and results are float32 either way). */
#define DEFINE_SKINNY(SUF, WT, GEMM_NAME)                                                                      \
/* R weight rows (R <= 4) times MB activation rows (MB <= 2); K8 = K rounded down to a multiple of 8. */      \
static inline __attribute__((always_inline)) void tile_##SUF(const float *restrict x, int64_t ldx,           \
                                                             const WT *const *w, int64_t K,                   \
                                                             float *restrict y, int64_t ldy, int R, int MB,   \
                                                             int pf) {                                        \
    __m256 acc[4][2];                                                                                         \
    for (int r = 0; r < 4; r++) {                                                                             \
        acc[r][0] = _mm256_setzero_ps();                                                                      \
        acc[r][1] = _mm256_setzero_ps();                                                                      \
    }                                                                                                         \
    int64_t K8 = K & ~(int64_t)7;                                                                             \
    for (int64_t k = 0; k < K8; k += 8) {                                                                     \
        /* first pass over these rows: fetch the rows PF_ROWS further on meanwhile (one line per 64 bytes) */ \
        if (pf && (k & (64 / (int64_t)sizeof(WT) - 1)) == 0)                                                  \
            for (int r = 0; r < 4; r++) _mm_prefetch((const char *)(w[0] + (PF_ROWS + r) * K + k), _MM_HINT_T0); \
        __m256 x0 = _mm256_loadu_ps(x + k);                                                                   \
        __m256 x1 = MB > 1 ? _mm256_loadu_ps(x + ldx + k) : x0;                                               \
        for (int r = 0; r < R; r++) {                                                                         \
            __m256 wv = load_##SUF(w[r] + k);                                                                 \
            acc[r][0] = _mm256_fmadd_ps(wv, x0, acc[r][0]);                                                   \
            if (MB > 1) acc[r][1] = _mm256_fmadd_ps(wv, x1, acc[r][1]);                                       \
        }                                                                                                     \
    }                                                                                                         \
    if (R == 4 && MB == 2 && K8 == K) {                                                                       \
        /* the eight horizontal sums at once: sums[j * 4 + r] = sum of the lanes of acc[r][j] */             \
        __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][0], acc[1][0]), _mm256_hadd_ps(acc[2][0], acc[3][0])); \
        __m256 v = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][1], acc[1][1]), _mm256_hadd_ps(acc[2][1], acc[3][1])); \
        __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u, v, 0x20), _mm256_permute2f128_ps(u, v, 0x31)); \
        _mm_storeu_ps(y, _mm256_castps256_ps128(sums));                                                       \
        _mm_storeu_ps(y + ldy, _mm256_extractf128_ps(sums, 1));                                               \
        return;                                                                                               \
    }                                                                                                         \
    if (R == 4 && MB == 1 && K8 == K) {                                                                       \
        __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][0], acc[1][0]), _mm256_hadd_ps(acc[2][0], acc[3][0])); \
        _mm_storeu_ps(y, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));                \
        return;                                                                                               \
    }                                                                                                         \
    for (int r = 0; r < R; r++) {                                                                             \
        for (int j = 0; j < MB; j++) {                                                                        \
            float s = hsum8(acc[r][j]);                                                                       \
            for (int64_t k = K8; k < K; k++) s += scalar_##SUF(w[r] + k) * x[j * ldx + k];                    \
            y[j * ldy + r] = s;                                                                               \
        }                                                                                                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* One weight row against MB <= 8 activation rows in a single pass over k: the row is read once, straight  \
 * from the memory stream, so loading weights and multiplying overlap (no L1 re-reads, one stream). */       \
static inline __attribute__((always_inline)) void stream_##SUF(const float *restrict x, int64_t ldx,         \
                                                               const WT *restrict w, int64_t K,              \
                                                               float *restrict y, int64_t ldy, int MB) {     \
    __m256 acc[8];                                                                                            \
    for (int j = 0; j < MB; j++) acc[j] = _mm256_setzero_ps();                                                \
    int64_t K8 = K & ~(int64_t)7;                                                                             \
    for (int64_t k = 0; k < K8; k += 8) {                                                                     \
        __m256 wv = load_##SUF(w + k);                                                                        \
        for (int j = 0; j < MB; j++) acc[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * ldx + k), acc[j]);  \
    }                                                                                                         \
    for (int j = 0; j < MB; j++) {                                                                            \
        float s = hsum8(acc[j]);                                                                              \
        for (int64_t k = K8; k < K; k++) s += scalar_##SUF(w + k) * x[j * ldx + k];                           \
        y[j * ldy] = s;                                                                                       \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* M <= 2: one activation row leaves a single FMA dependency chain per weight row (latency-bound, not     \
 * memory-bound), so k is split over four (M = 1) or two (M = 2) accumulators per activation row. */          \
static inline __attribute__((always_inline)) void stream_few_##SUF(const float *restrict x, int64_t ldx,     \
                                                                   const WT *restrict w, int64_t K,          \
                                                                   float *restrict y, int64_t ldy, int MB) { \
    __m256 a[2][4];                                                                                           \
    for (int j = 0; j < 2; j++)                                                                               \
        for (int c = 0; c < 4; c++) a[j][c] = _mm256_setzero_ps();                                            \
    int64_t K8 = K & ~(int64_t)7, k = 0;                                                                      \
    if (MB == 1) {                                                                                            \
        for (; k + 32 <= K8; k += 32)                                                                         \
            for (int c = 0; c < 4; c++)                                                                       \
                a[0][c] = _mm256_fmadd_ps(load_##SUF(w + k + 8 * c), _mm256_loadu_ps(x + k + 8 * c), a[0][c]); \
    } else {                                                                                                  \
        for (; k + 16 <= K8; k += 16)                                                                         \
            for (int c = 0; c < 2; c++) {                                                                     \
                __m256 wv = load_##SUF(w + k + 8 * c);                                                        \
                a[0][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + k + 8 * c), a[0][c]);                       \
                a[1][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + ldx + k + 8 * c), a[1][c]);                 \
            }                                                                                                 \
    }                                                                                                         \
    for (; k < K8; k += 8) {                                                                                  \
        __m256 wv = load_##SUF(w + k);                                                                        \
        for (int j = 0; j < MB; j++) a[j][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * ldx + k), a[j][0]); \
    }                                                                                                         \
    for (int j = 0; j < MB; j++) {                                                                            \
        float s = hsum8(_mm256_add_ps(_mm256_add_ps(a[j][0], a[j][1]), _mm256_add_ps(a[j][2], a[j][3])));     \
        for (int64_t kk = K8; kk < K; kk++) s += scalar_##SUF(w + kk) * x[j * ldx + kk];                      \
        y[j * ldy] = s;                                                                                       \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
static void stream_rows_##SUF(const float *x, int64_t ldx, int64_t M, const WT *w, int64_t n_rows, int64_t K, \
                              float *y, int64_t ldy) {                                                       \
    if (M <= 2) {                                                                                             \
        for (int64_t n = 0; n < n_rows; n++) {                                                                \
            if (M == 1) stream_few_##SUF(x, ldx, w + n * K, K, y + n, ldy, 1);                                \
            else stream_few_##SUF(x, ldx, w + n * K, K, y + n, ldy, 2);                                       \
        }                                                                                                     \
        return;                                                                                               \
    }                                                                                                         \
    for (int64_t n = 0; n < n_rows; n++) {                                                                    \
        const WT *wr = w + n * K;                                                                             \
        for (int64_t m = 0; m < M; m += 8) { /* past 8 rows: the weight row is re-read from L1 */             \
            const float *xm = x + m * ldx;                                                                    \
            float *ym = y + m * ldy + n;                                                                      \
            switch (M - m < 8 ? M - m : 8) {                                                                  \
                case 1: stream_##SUF(xm, ldx, wr, K, ym, ldy, 1); break;                                      \
                case 2: stream_##SUF(xm, ldx, wr, K, ym, ldy, 2); break;                                      \
                case 3: stream_##SUF(xm, ldx, wr, K, ym, ldy, 3); break;                                      \
                case 4: stream_##SUF(xm, ldx, wr, K, ym, ldy, 4); break;                                      \
                case 5: stream_##SUF(xm, ldx, wr, K, ym, ldy, 5); break;                                      \
                case 6: stream_##SUF(xm, ldx, wr, K, ym, ldy, 6); break;                                      \
                case 7: stream_##SUF(xm, ldx, wr, K, ym, ldy, 7); break;                                      \
                default: stream_##SUF(xm, ldx, wr, K, ym, ldy, 8); break;                                     \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* One block of up to four consecutive output columns (weight rows) against all M activation rows. */         \
static void rows_block_##SUF(const float *x, int64_t ldx, int64_t M, const WT *const *w, int R, int64_t K,    \
                             float *y, int64_t ldy) {                                                         \
    int64_t m = 0;                                                                                            \
    for (; m + 2 <= M; m += 2) {                                                                              \
        const float *xm = x + m * ldx;                                                                        \
        float *ym = y + m * ldy;                                                                              \
        switch (R) {                                                                                          \
            case 4: tile_##SUF(xm, ldx, w, K, ym, ldy, 4, 2, m == 0); break;                                  \
            case 3: tile_##SUF(xm, ldx, w, K, ym, ldy, 3, 2, m == 0); break;                                  \
            case 2: tile_##SUF(xm, ldx, w, K, ym, ldy, 2, 2, m == 0); break;                                  \
            default: tile_##SUF(xm, ldx, w, K, ym, ldy, 1, 2, m == 0); break;                                 \
        }                                                                                                     \
    }                                                                                                         \
    if (m < M) {                                                                                              \
        const float *xm = x + m * ldx;                                                                        \
        float *ym = y + m * ldy;                                                                              \
        switch (R) {                                                                                          \
            case 4: tile_##SUF(xm, ldx, w, K, ym, ldy, 4, 1, m == 0); break;                                  \
            case 3: tile_##SUF(xm, ldx, w, K, ym, ldy, 3, 1, m == 0); break;                                  \
            case 2: tile_##SUF(xm, ldx, w, K, ym, ldy, 2, 1, m == 0); break;                                  \
            default: tile_##SUF(xm, ldx, w, K, ym, ldy, 1, 1, m == 0); break;                                 \
        }                                                                                                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* y (M x ldy, row-major) columns [off_i, off_i + N_i) = x (M x K, row stride ldx) @ W_i^T, i < n_w.          \
 * weights: n_w pointers to row-major (N_i x K) matrices; ns: their N_i. Returns 0 (-1: n_w > 16). */        \
int GEMM_NAME(const float *x, int64_t ldx, int64_t M, int64_t K, int n_w, const WT *const *weights,           \
              const int64_t *ns, float *y, int64_t ldy) {                                                     \
    int64_t offs[16], blocks[17];                                                                             \
    if (n_w > 16) return -1;                                                                                  \
    blocks[0] = 0;                                                                                            \
    int64_t off = 0;                                                                                          \
    for (int i = 0; i < n_w; i++) {                                                                           \
        offs[i] = off;                                                                                        \
        off += ns[i];                                                                                         \
        blocks[i + 1] = blocks[i] + (ns[i] + 3) / 4;                                                          \
    }                                                                                                         \
    int64_t total = blocks[n_w];                                                                              \
    if (M <= STREAM_MAX_M && M >= AVX512_MIN_M && use_avx512()) {                                             \
        gemm512_##SUF(x, ldx, M, K, n_w, weights, ns, offs, y, ldy);                                          \
        return 0;                                                                                             \
    }                                                                                                         \
    if (M <= STREAM_MAX_M) {                                                                                  \
        _Pragma("omp parallel for schedule(static)")                                                          \
        for (int64_t b = 0; b < total; b++) {                                                                 \
            int i = 0;                                                                                        \
            while (b >= blocks[i + 1]) i++;                                                                   \
            int64_t n = (b - blocks[i]) * 4;                                                                  \
            int64_t R = ns[i] - n < 4 ? ns[i] - n : 4;                                                        \
            stream_rows_##SUF(x, ldx, M, weights[i] + n * K, R, K, y + offs[i] + n, ldy);                     \
        }                                                                                                     \
        return 0;                                                                                             \
    }                                                                                                         \
    _Pragma("omp parallel for schedule(static)")                                                              \
    for (int64_t b = 0; b < total; b++) {                                                                     \
        int i = 0;                                                                                            \
        while (b >= blocks[i + 1]) i++;                                                                       \
        int64_t n = (b - blocks[i]) * 4;                                                                      \
        int R = (int)(ns[i] - n < 4 ? ns[i] - n : 4);                                                         \
        const WT *w[4];                                                                                       \
        for (int r = 0; r < 4; r++) w[r] = weights[i] + (n + (r < R ? r : 0)) * K;                            \
        rows_block_##SUF(x, ldx, M, w, R, K, y + offs[i] + n, ldy);                                           \
    }                                                                                                         \
    return 0;                                                                                                 \
}

DEFINE_SKINNY(f32, float, spire_skinny_gemm)
DEFINE_SKINNY(bf16, uint16_t, spire_skinny_gemm_bf16)

/* ------------------------------------------------------------------------------------------------------
 * Panel matmul (spire_panel_gemm[_bf16]): the same product as spire_skinny_gemm over a weight packed once
 * (spire.kernels.pack_panels) into tiles of PANEL_TILE = 32 output columns, each tile four panels of eight
 * columns stored k-major:
 *
 *   P[((q * 4 + s) * K + k) * 8 + c] = W[q * 32 + s * 8 + c, k]      (zero rows pad N to a multiple of 32)
 *
 * A tile of up to three activation rows times 32 columns keeps 12 ymm accumulators; each k step loads four
 * weight vectors (one from each panel: four sequential memory streams at once) and broadcasts one activation
 * value per row, so every weight byte is read from memory once for all M rows and each load feeds up to three
 * FMAs. k goes in blocks of PANEL_KB steps: rows in chunks of three multiply each block while its weights
 * sit in L1, and each block's sums are added to the output (blocked summation: float32 rounding grows with
 * PANEL_KB + K / PANEL_KB terms, not K); above PANEL_WIDEN_M rows a bf16 block is widened to float32 once for
 * all chunks.
 * On one Zen 2 core this streamed SmolLM2's decoder matmuls at M = 1..3 rows in about the time of a single
 * row (the row-major paths above take 1.3x longer at M = 1 and 1.7x at M = 3) and stayed 1.3-1.5x faster up
 * to M = 40 (measurements/bench-cpu/panel-kernel/).
 *
 * Every output is the same float32 sum in the same order whatever M and however the rows are chunked (an FMA
 * chain over each block of k, the blocks' sums added in order): a row's result does not depend on which other
 * rows share the call, bit for bit. */
#define PANEL_TILE 32
#define PANEL_WIDTH 8
#ifndef PANEL_KB
#define PANEL_KB 64
#endif
#ifndef PANEL_WIDEN_M
#define PANEL_WIDEN_M 9
#endif
/* 1: a single activation row takes full tiles two at a time (ptile2); 0: one at a time (A/B timing). */
#ifndef PANEL_PAIRS
#define PANEL_PAIRS 1
#endif

#define DEFINE_PANEL(SUF, WT)                                                                                  \
/* MB <= 3 rows x one 32-column tile over nk k steps; w: the tile's first panel, panels `ps` elements apart, \
 * k steps PANEL_WIDTH apart; the block's sums are stored (first block) or added to y. */                    \
static inline __attribute__((always_inline)) void ptile_##SUF(const float *restrict x, int64_t ldx,           \
        const WT *restrict w, int64_t ps, int64_t nk, float *restrict y, int64_t ldy, const int MB, int first) { \
    __m256 a[3][4];                                                                                           \
    for (int j = 0; j < MB; j++)                                                                              \
        for (int c = 0; c < 4; c++) a[j][c] = _mm256_setzero_ps();                                            \
    const WT *w0 = w, *w1 = w + ps, *w2 = w + 2 * ps, *w3 = w + 3 * ps;                                      \
    for (int64_t k = 0; k < nk; k++) {                                                                        \
        __m256 v0 = load_##SUF(w0 + k * PANEL_WIDTH), v1 = load_##SUF(w1 + k * PANEL_WIDTH);                  \
        __m256 v2 = load_##SUF(w2 + k * PANEL_WIDTH), v3 = load_##SUF(w3 + k * PANEL_WIDTH);                  \
        for (int j = 0; j < MB; j++) {                                                                        \
            __m256 b = _mm256_broadcast_ss(x + j * ldx + k);                                                  \
            a[j][0] = _mm256_fmadd_ps(b, v0, a[j][0]);                                                        \
            a[j][1] = _mm256_fmadd_ps(b, v1, a[j][1]);                                                        \
            a[j][2] = _mm256_fmadd_ps(b, v2, a[j][2]);                                                        \
            a[j][3] = _mm256_fmadd_ps(b, v3, a[j][3]);                                                        \
        }                                                                                                     \
    }                                                                                                         \
    for (int j = 0; j < MB; j++)                                                                              \
        for (int c = 0; c < 4; c++) {                                                                         \
            float *yc = y + j * ldy + 8 * c;                                                                  \
            _mm256_storeu_ps(yc, first ? a[j][c] : _mm256_add_ps(_mm256_loadu_ps(yc), a[j][c]));              \
        }                                                                                                     \
}                                                                                                             \
                                                                                                              \
static void prows_##SUF(const float *x, int64_t ldx, int64_t M, const WT *w, int64_t ps, int64_t nk, float *y, \
                        int64_t ldy, int first) {                                                             \
    for (int64_t m = 0; m < M; m += 3) {                                                                      \
        int64_t r = M - m < 3 ? M - m : 3;                                                                    \
        if (r == 3) ptile_##SUF(x + m * ldx, ldx, w, ps, nk, y + m * ldy, ldy, 3, first);                  \
        else if (r == 2) ptile_##SUF(x + m * ldx, ldx, w, ps, nk, y + m * ldy, ldy, 2, first);             \
        else ptile_##SUF(x + m * ldx, ldx, w, ps, nk, y + m * ldy, ldy, 1, first);                         \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* One activation row times two 32-column tiles (wa, wb) at once: eight independent FMA chains where one tile  \
 * has four, whose latency bounds a single row's product (Zen 2: four chains of 5-cycle FMAs ~ 13 G values   \
 * per second, below what memory delivers in bf16). Each output is the same FMA chain over the block as       \
 * ptile's and is stored the same way: bit-identical to two ptile calls. */                                    \
static inline __attribute__((always_inline)) void ptile2_##SUF(const float *restrict x, const WT *restrict wa, \
        const WT *restrict wb, int64_t ps, int64_t nk, float *restrict ya, float *restrict yb, int first) {    \
    __m256 a[8];                                                                                              \
    const WT *w[8];                                                                                           \
    for (int c = 0; c < 4; c++) { a[c] = a[c + 4] = _mm256_setzero_ps(); w[c] = wa + c * ps; w[c + 4] = wb + c * ps; } \
    for (int64_t k = 0; k < nk; k++) {                                                                        \
        __m256 b = _mm256_broadcast_ss(x + k);                                                                \
        for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(b, load_##SUF(w[c] + k * PANEL_WIDTH), a[c]);      \
    }                                                                                                         \
    for (int c = 0; c < 8; c++) {                                                                             \
        float *yc = (c < 4 ? ya : yb) + 8 * (c & 3);                                                          \
        _mm256_storeu_ps(yc, first ? a[c] : _mm256_add_ps(_mm256_loadu_ps(yc), a[c]));                        \
    }                                                                                                         \
}

DEFINE_PANEL(f32, float)
DEFINE_PANEL(bf16, uint16_t)

/* k steps [k0, k0 + nk) of a bf16 tile (panels K * 8 apart) -> float32, panels PANEL_KB * 8 apart. */
static void panel_widen(const uint16_t *w, int64_t K, int64_t k0, int64_t nk, float *o) {
    for (int s = 0; s < PANEL_TILE / PANEL_WIDTH; s++)
        for (int64_t k = 0; k < nk; k++)
            _mm256_storeu_ps(o + (s * PANEL_KB + k) * PANEL_WIDTH, load_bf16(w + (s * K + k0 + k) * PANEL_WIDTH));
}

/* y (M x ldy, row-major) columns [0, N) = x (M x K, row stride ldx) @ W^T with W packed as above (float32:
 * bf16 = 0, or bf16 stored as uint16_t: bf16 = 1). M <= 64. Returns 0, or -1 for M outside 1..64. */
static int panel_gemm(int bf16, const float *x, int64_t ldx, int64_t M, int64_t K, const void *p, int64_t N,
                      float *y, int64_t ldy) {
    if (M < 1 || M > 64) return -1;
    int64_t nt = (N + PANEL_TILE - 1) / PANEL_TILE, ps = K * PANEL_WIDTH;
    /* one row: full tiles in pairs (ptile2), the rest one by one */
    int64_t np = M == 1 && PANEL_PAIRS ? N / PANEL_TILE / 2 : 0, nu = nt - np;
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < nu; u++) {
        if (u < np) {
            int64_t n = 2 * u * PANEL_TILE;
            const float *pf = (const float *)p + n * K;
            const uint16_t *pb = (const uint16_t *)p + n * K;
            for (int64_t k0 = 0; k0 < K; k0 += PANEL_KB) {
                int64_t nk = K - k0 < PANEL_KB ? K - k0 : PANEL_KB, o = k0 * PANEL_WIDTH;
                if (bf16) ptile2_bf16(x + k0, pb + o, pb + PANEL_TILE * K + o, ps, nk, y + n, y + n + PANEL_TILE, k0 == 0);
                else ptile2_f32(x + k0, pf + o, pf + PANEL_TILE * K + o, ps, nk, y + n, y + n + PANEL_TILE, k0 == 0);
            }
            continue;
        }
        int64_t q = 2 * np + (u - np);
        int64_t n = q * PANEL_TILE, nc = N - n < PANEL_TILE ? N - n : PANEL_TILE;
        const float *pf = (const float *)p + n * K;
        const uint16_t *pb = (const uint16_t *)p + n * K;
        float tmp[64 * PANEL_TILE], wbuf[PANEL_KB * PANEL_TILE];
        float *yq = nc < PANEL_TILE ? tmp : y + n;  /* a ragged last tile goes through tmp */
        int64_t ly = nc < PANEL_TILE ? PANEL_TILE : ldy;
        for (int64_t k0 = 0; k0 < K; k0 += PANEL_KB) {
            int64_t nk = K - k0 < PANEL_KB ? K - k0 : PANEL_KB;
            if (bf16 && M > PANEL_WIDEN_M) {
                panel_widen(pb, K, k0, nk, wbuf);
                prows_f32(x + k0, ldx, M, wbuf, PANEL_KB * PANEL_WIDTH, nk, yq, ly, k0 == 0);
            } else if (bf16) {
                prows_bf16(x + k0, ldx, M, pb + k0 * PANEL_WIDTH, ps, nk, yq, ly, k0 == 0);
            } else {
                prows_f32(x + k0, ldx, M, pf + k0 * PANEL_WIDTH, ps, nk, yq, ly, k0 == 0);
            }
        }
        if (nc < PANEL_TILE)
            for (int64_t m = 0; m < M; m++)
                for (int64_t c = 0; c < nc; c++) y[m * ldy + n + c] = tmp[m * PANEL_TILE + c];
    }
    return 0;
}

int spire_panel_gemm(const float *x, int64_t ldx, int64_t M, int64_t K, const float *p, int64_t N, float *y,
                     int64_t ldy) {
    return panel_gemm(0, x, ldx, M, K, p, N, y, ldy);
}

int spire_panel_gemm_bf16(const float *x, int64_t ldx, int64_t M, int64_t K, const uint16_t *p, int64_t N,
                          float *y, int64_t ldy) {
    return panel_gemm(1, x, ldx, M, K, p, N, y, ldy);
}

/* ------------------------------------------------------------------------------------------------------
 * int8 panel matmul (spire_panel_gemm_i8): weights quantized per output column and group of PANEL_KB = 64
 * inputs (spire.kernels.quantize_int8: W[n, k] = v[n, k] s[n, k / 64], v in [-127, 127]), activations
 * quantized per row and group to int16 on the fly (x[m, k] = u[m, k] t[m, k / 64], t = max |x| over the group /
 * 32767, u = round(x / t): relative error below 2^-16 of the group's largest value), and each group's product
 * summed exactly in int32 with vpmaddwd (|sum| <= 64 * 127 * 32767 < 2^31), then y += float(sum) * (s t), one
 * FMA per group in order. Integer multiply-adds take 16 weights per instruction pair where the float path
 * needs a widening and a conversion per 8, which made the float-converting int8 kernel no faster than bf16 per
 * value (~13 G values per second on a Zen 2 core).
 *
 * Packed layout, per tile q of 32 columns (spire.kernels.pack_panels_int8), K even:
 *
 *   values  P[(s * K / 2 + j) * 16 + 2 c + e] = v[32 q + 8 s + c, 2 j + e]   (four panels s of 8 columns, each
 *           the K / 2 input pairs j in order, each column's two inputs e side by side as vpmaddwd multiplies
 *           them; one 64-byte-line-per-pair stream per tile was measured 6 % slower than the four streams)
 *   scales  float32 [ceil(K / 64)][32] after the 32 K values (4-byte aligned: 32 K is a multiple of 32)
 *
 * A row's result depends only on that row (its own activation scales, the same sums whatever M). */
static inline int64_t panel_i8_tile_bytes(int64_t K) {
    return PANEL_TILE * K + (int64_t)sizeof(float) * PANEL_TILE * ((K + PANEL_KB - 1) / PANEL_KB);
}

/* MB <= 3 int16 activation rows (xq, row stride ldq; their group scales xs, stride ldxs) x one tile's npair
 * input pairs of one group (w: the group's first pair); sw: the group's 32 weight scales. */
static inline __attribute__((always_inline)) void qtile(const int16_t *restrict xq, int64_t ldq,
        const float *restrict xs, int64_t ldxs, const int8_t *restrict w, int64_t ps, int64_t npair,
        const float *restrict sw, float *restrict y, int64_t ldy, const int MB, int first) {
    __m256i a[3][4];
    for (int j = 0; j < MB; j++)
        for (int c = 0; c < 4; c++) a[j][c] = _mm256_setzero_si256();
    for (int64_t kp = 0; kp < npair; kp++) {
        __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + kp * 16)));
        __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + ps + kp * 16)));
        __m256i v2 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 2 * ps + kp * 16)));
        __m256i v3 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 3 * ps + kp * 16)));
        for (int j = 0; j < MB; j++) {
            int32_t pair;
            memcpy(&pair, xq + j * ldq + 2 * kp, sizeof pair);
            __m256i b = _mm256_set1_epi32(pair);
            a[j][0] = _mm256_add_epi32(a[j][0], _mm256_madd_epi16(b, v0));
            a[j][1] = _mm256_add_epi32(a[j][1], _mm256_madd_epi16(b, v1));
            a[j][2] = _mm256_add_epi32(a[j][2], _mm256_madd_epi16(b, v2));
            a[j][3] = _mm256_add_epi32(a[j][3], _mm256_madd_epi16(b, v3));
        }
    }
    for (int j = 0; j < MB; j++) {
        __m256 t = _mm256_set1_ps(xs[j * ldxs]);
        for (int c = 0; c < 4; c++) {
            float *yc = y + j * ldy + 8 * c;
            __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(sw + 8 * c), t), f = _mm256_cvtepi32_ps(a[j][c]);
            _mm256_storeu_ps(yc, first ? _mm256_mul_ps(f, sc) : _mm256_fmadd_ps(f, sc, _mm256_loadu_ps(yc)));
        }
    }
}

/* One int16 activation row x two tiles (wa, wb: the group's first pair in each) at once: eight memory
 * streams where one tile has four (from memory, one tile at a time streamed int8 at half of bf16's bytes per
 * second). Each output's sum and store are qtile's: bit-identical to two qtile calls. */
static inline __attribute__((always_inline)) void qtile2(const int16_t *restrict xq, float xs,
        const int8_t *restrict wa, const int8_t *restrict wb, int64_t ps, int64_t npair, const float *restrict swa,
        const float *restrict swb, float *restrict ya, float *restrict yb, int first) {
    __m256i a[8];
    const int8_t *w[8];
    for (int c = 0; c < 4; c++) {
        a[c] = a[c + 4] = _mm256_setzero_si256();
        w[c] = wa + c * ps;
        w[c + 4] = wb + c * ps;
    }
    for (int64_t kp = 0; kp < npair; kp++) {
        int32_t pair;
        memcpy(&pair, xq + 2 * kp, sizeof pair);
        __m256i b = _mm256_set1_epi32(pair);
        for (int c = 0; c < 8; c++)
            a[c] = _mm256_add_epi32(a[c], _mm256_madd_epi16(b, _mm256_cvtepi8_epi16(
                       _mm_loadu_si128((const __m128i *)(w[c] + kp * 16)))));
    }
    __m256 t = _mm256_set1_ps(xs);
    for (int c = 0; c < 8; c++) {
        float *yc = (c < 4 ? ya : yb) + 8 * (c & 3);
        __m256 sc = _mm256_mul_ps(_mm256_loadu_ps((c < 4 ? swa : swb) + 8 * (c & 3)), t);
        __m256 f = _mm256_cvtepi32_ps(a[c]);
        _mm256_storeu_ps(yc, first ? _mm256_mul_ps(f, sc) : _mm256_fmadd_ps(f, sc, _mm256_loadu_ps(yc)));
    }
}

/* x rows -> int16 values (M x K) and per-group scales (M x ng); 0 scale for a zero group. */
static void quantize_rows_i16(const float *x, int64_t ldx, int64_t M, int64_t K, int16_t *xq, float *xs) {
    int64_t ng = (K + PANEL_KB - 1) / PANEL_KB;
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        int16_t *qr = xq + m * K;
        for (int64_t g = 0; g < ng; g++) {
            int64_t lo = g * PANEL_KB, hi = lo + PANEL_KB < K ? lo + PANEL_KB : K;
            float amax = 0.0f;
            int bad = 0;
            for (int64_t k = lo; k < hi; k++) {
                amax = fmaxf(amax, fabsf(xr[k]));
                bad |= !isfinite(xr[k]);
            }
            /* a NaN or inf input makes its group's scale NaN, so every output it reaches is NaN (not a finite
             * value computed from a clamped integer); a group below ~1e-33 rounds to 0 (its scale underflows) */
            float t = bad ? __builtin_nanf("") : amax / 32767.0f, inv = !bad && amax > 0.0f ? 32767.0f / amax : 0.0f;
            xs[m * ng + g] = t;
            for (int64_t k = lo; k < hi; k++) {
                float v = nearbyintf(xr[k] * inv);
                qr[k] = (int16_t)(v > 32767.0f ? 32767.0f : v < -32767.0f ? -32767.0f : v);
            }
        }
    }
}

int spire_panel_gemm_i8(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *p, int64_t N, float *y,
                        int64_t ldy) {
    if (M < 1 || M > 64 || K % 2) return -1;
    int64_t ng = (K + PANEL_KB - 1) / PANEL_KB, tb = panel_i8_tile_bytes(K);
    int64_t nt = (N + PANEL_TILE - 1) / PANEL_TILE, ps = PANEL_WIDTH * K;
    int16_t *xq = (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
    float *xs = (float *)malloc((size_t)(M * ng) * sizeof(float));
    if (!xq || !xs) { free(xq); free(xs); return -2; }
    quantize_rows_i16(x, ldx, M, K, xq, xs);
    /* one row: full tiles in pairs (qtile2), the rest one by one */
    int64_t np = M == 1 && PANEL_PAIRS ? N / PANEL_TILE / 2 : 0, nu = nt - np;
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < nu; u++) {
        if (u < np) {
            int64_t n = 2 * u * PANEL_TILE;
            const int8_t *pa = p + 2 * u * tb, *pb = pa + tb;
            const float *sa = (const float *)(pa + PANEL_TILE * K), *sb = (const float *)(pb + PANEL_TILE * K);
            for (int64_t g = 0; g < ng; g++) {
                int64_t k0 = g * PANEL_KB, nk = K - k0 < PANEL_KB ? K - k0 : PANEL_KB;
                qtile2(xq + k0, xs[g], pa + k0 * PANEL_WIDTH, pb + k0 * PANEL_WIDTH, ps, nk / 2,
                       sa + g * PANEL_TILE, sb + g * PANEL_TILE, y + n, y + n + PANEL_TILE, g == 0);
            }
            continue;
        }
        int64_t q = 2 * np + (u - np);
        int64_t n = q * PANEL_TILE, nc = N - n < PANEL_TILE ? N - n : PANEL_TILE;
        const int8_t *pq = p + q * tb;
        const float *sq = (const float *)(pq + PANEL_TILE * K);
        float tmp[64 * PANEL_TILE];
        float *yq = nc < PANEL_TILE ? tmp : y + n;  /* a ragged last tile goes through tmp */
        int64_t ly = nc < PANEL_TILE ? PANEL_TILE : ldy;
        for (int64_t g = 0; g < ng; g++) {
            int64_t k0 = g * PANEL_KB, nk = K - k0 < PANEL_KB ? K - k0 : PANEL_KB, npair = nk / 2;
            const int8_t *w = pq + k0 * PANEL_WIDTH;  /* k0 even: pair k0 / 2, 16 bytes a pair */
            for (int64_t m = 0; m < M; m += 3) {
                int64_t r = M - m < 3 ? M - m : 3;
                const int16_t *xm = xq + m * K + k0;
                const float *sm = xs + m * ng + g;
                float *ym = yq + m * ly;
                if (r == 3) qtile(xm, K, sm, ng, w, ps, npair, sq + g * PANEL_TILE, ym, ly, 3, g == 0);
                else if (r == 2) qtile(xm, K, sm, ng, w, ps, npair, sq + g * PANEL_TILE, ym, ly, 2, g == 0);
                else qtile(xm, K, sm, ng, w, ps, npair, sq + g * PANEL_TILE, ym, ly, 1, g == 0);
            }
        }
        if (nc < PANEL_TILE)
            for (int64_t m = 0; m < M; m++)
                for (int64_t c = 0; c < nc; c++) y[m * ldy + n + c] = tmp[m * PANEL_TILE + c];
    }
    free(xq);
    free(xs);
    return 0;
}


/* Rows at arbitrary addresses (key rows of a cache): no prefetch (rows need not follow one another). */
static void rows_block_strided(const float *x, int64_t ldx, int64_t M, const float *const *w, int R, int64_t K,
                               float *y, int64_t ldy) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        switch (R) {
            case 4: tile_f32(xm, ldx, w, K, ym, ldy, 4, 2, 0); break;
            case 3: tile_f32(xm, ldx, w, K, ym, ldy, 3, 2, 0); break;
            case 2: tile_f32(xm, ldx, w, K, ym, ldy, 2, 2, 0); break;
            default: tile_f32(xm, ldx, w, K, ym, ldy, 1, 2, 0); break;
        }
    }
    if (m < M) {
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        switch (R) {
            case 4: tile_f32(xm, ldx, w, K, ym, ldy, 4, 1, 0); break;
            case 3: tile_f32(xm, ldx, w, K, ym, ldy, 3, 1, 0); break;
            case 2: tile_f32(xm, ldx, w, K, ym, ldy, 2, 1, 0); break;
            default: tile_f32(xm, ldx, w, K, ym, ldy, 1, 1, 0); break;
        }
    }
}

/* ------------------------------------------------------------------------------------------------------
 * Decode attention, in two passes around a softmax done by the caller (torch):
 *
 *   spire_attn_scores: s[bh, g, j] = scale * <q[b, h, g, :], k[b, h, j, :]>, or -inf where mask[b, g, j] == 0
 *   spire_attn_pv:     o[b, h, g, :] = sum_j p[bh, g, j] * v[b, h, j, :]
 *
 * for G query rows per key/value head (grouped-query attention: the query heads sharing a KV head, times
 * the new tokens) and S keys. Every key and value row is read from memory once for all G query rows (BLAS
 * batched matmuls re-pack K and V per call). q, o: (B, H, G, D) contiguous; k, v: rows of D contiguous
 * floats at strides (sb, sh, ss); mask: NULL or uint8 at strides (mb, mg, ms) (mb = 0 broadcasts over B);
 * s, p: (B * H, G, S) contiguous. D must be a multiple of 8. Parallel over (b, h).
 */
int spire_attn_scores(const float *q, const float *k, int64_t ksb, int64_t ksh, int64_t kss,
                      const uint8_t *mask, int64_t mb, int64_t mg, int64_t ms, float *s,
                      int64_t B, int64_t H, int64_t G, int64_t S, int64_t D, float scale) {
    if (D % 8) return -1;
    int64_t nblk = (S + 3) / 4;  /* key rows four at a time, as weight rows in spire_skinny_gemm */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < B * H * nblk; t++) {
        int64_t bh = t / nblk, j = (t % nblk) * 4;
        int64_t b = bh / H, h = bh % H;
        int R = (int)(S - j < 4 ? S - j : 4);
        const float *kb = k + b * ksb + h * ksh;
        const float *w[4];
        for (int r = 0; r < 4; r++) w[r] = kb + (j + (r < R ? r : 0)) * kss;
        float *sb = s + bh * G * S;
        rows_block_strided(q + bh * G * D, D, G, w, R, D, sb + j, S);
        const uint8_t *mbase = mask ? mask + b * mb : 0;
        for (int64_t g = 0; g < G; g++)
            for (int r = 0; r < R; r++) {
                float *x = sb + g * S + j + r;
                *x = (mbase && !mbase[g * mg + (j + r) * ms]) ? -__builtin_inff() : *x * scale;
            }
    }
    return 0;
}

#define PV_BLOCK 64  /* value rows per block: 64 x D floats stay in L1 while every query row uses them */

int spire_attn_pv(const float *p, const float *v, int64_t vsb, int64_t vsh, int64_t vss, float *o,
                  int64_t B, int64_t H, int64_t G, int64_t S, int64_t D) {
    if (D % 8 || D > 256) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        const float *pb = p + bh * G * S;
        const float *vb = v + b * vsb + h * vsh;
        float *ob = o + bh * G * D;
        for (int64_t i = 0; i < G * D; i++) ob[i] = 0.0f;
        for (int64_t j0 = 0; j0 < S; j0 += PV_BLOCK) {
            int64_t j1 = j0 + PV_BLOCK < S ? j0 + PV_BLOCK : S;
            for (int64_t g = 0; g < G; g++) {
                const float *pr = pb + g * S;
                float *orow = ob + g * D;
                for (int64_t d0 = 0; d0 < D; d0 += 32) {  /* 4 accumulators of 8 floats */
                    int64_t nd = D - d0 < 32 ? (D - d0) / 8 : 4;
                    __m256 acc[4];
                    for (int c = 0; c < 4; c++) acc[c] = c < nd ? _mm256_loadu_ps(orow + d0 + 8 * c) : _mm256_setzero_ps();
                    for (int64_t j = j0; j < j1; j++) {
                        float pj = pr[j];
                        if (pj == 0.0f) continue;  /* masked keys (and underflow) contribute nothing */
                        __m256 pv = _mm256_set1_ps(pj);
                        const float *vr = vb + j * vss + d0;
                        for (int c = 0; c < 4; c++)
                            if (c < nd) acc[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * c), acc[c]);
                    }
                    for (int c = 0; c < nd; c++) _mm256_storeu_ps(orow + d0 + 8 * c, acc[c]);
                }
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------------
 * RMSNorm for inference: y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w, float32, rows of d contiguous
 * floats at row stride ldx (y contiguous). One call instead of the ~7 small torch ops of the reference. The
 * sum of squares is accumulated in 8 float lanes (order differs from torch's: ~1e-7 relative). */
int spire_rms_norm(const float *x, int64_t ldx, const float *w, float *y, int64_t rows, int64_t d, float eps) {
#pragma omp parallel for schedule(static) if (rows > 64)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * d;
        __m256 acc = _mm256_setzero_ps();
        int64_t d8 = d & ~(int64_t)7;
        for (int64_t i = 0; i < d8; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (int64_t i = d8; i < d; i++) ss += xr[i] * xr[i];
        float scale = 1.0f / __builtin_sqrtf(ss / (float)d + eps);
        __m256 sv = _mm256_set1_ps(scale);
        for (int64_t i = 0; i < d8; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), sv)));
        for (int64_t i = d8; i < d; i++) yr[i] = w[i] * (xr[i] * scale);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------------
 * Fused decoder block for decoding (spire_decode_block): one call per layer of a Llama-family block
 *
 *   h = rms_norm(x) * ln1;  q, k, v = h Wqkv^T;  RoPE(q, k);  cache[b, :, pos[b, t]] = k, v;
 *   a = softmax(scale q K^T, masked) V;  x1 = x + a Wo^T;  h = rms_norm(x1) * ln2;
 *   g, u = h Wgu^T;  y = x1 + (silu(g) * u) Wdown^T
 *
 * for M = B x T rows (a decode step T = 1, a verify pass T = k + 1), instead of the ~40 small torch ops
 * (and their Python dispatch) the same block costs on the torch path. The arithmetic is spire.model's:
 * the same matmuls (spire_skinny_gemm[_bf16]), RoPE in the half-split layout with cos / sin tables computed
 * by torch, grouped-query attention (query head h reads key/value head h / (H / KV)), float32 throughout.
 *
 * Attention reads the dense cache in place. Query (b, t) at position p = pos[b, t] attends to keys j with
 * j <= p and, with a sink + window view (window > 0), j < sink or j > p - window (StreamingLLM;
 * spire.kv_cache.attention_mask). Only the key ranges some query of the group needs are visited, so a
 * sink + window step costs O(sink + window + T) whatever the context length. With an explicit mask over
 * the cache entries (the SPIRe draft's ring cache, whose slots carry positions) the rule is replaced by the
 * mask and the new keys/values go to given slots. Keys go in blocks of
 * ATT_BLOCK with an online softmax (Milakov & Gimelshein 2018, as FlashAttention): each key row is read once
 * for all g x T query rows sharing its key/value head; exp is a Cephes-style AVX2 polynomial (~1 ulp).
 *
 * Results agree with the torch path to float32 rounding (summation order and exp differ).
 * Returns 0, or -1 when a size is outside what the kernel handles (the caller checks first).
 */
#define ATT_BLOCK 64
#define ATT_MAX_ROWS 32

static inline __m256 exp256(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, one);
    __m256i n = _mm256_cvttps_epi32(fx);
    n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

static inline float exp1(float x) {
    float in[8] = {x, 0, 0, 0, 0, 0, 0, 0}, out[8];
    _mm256_storeu_ps(out, exp256(_mm256_loadu_ps(in)));
    return out[0];
}

/* Keys [j0, j1) of one (b, kv head) group against its R query rows (row r: q + r_off[r], position qpos[r]),
 * folded into the running softmax state (m, l) and the unnormalized outputs o + o_off[r]. */
static void attend_block(const float *q, const int64_t *q_off, const int64_t *qpos, const uint8_t *const *mrow, int R,
                         int64_t sink, int64_t window, const float *kb, const float *vb, int64_t kss,
                         int64_t j0, int64_t j1, int64_t D, float scale, float *m, float *l, float *o,
                         const int64_t *o_off) {
    float s[ATT_MAX_ROWS][ATT_BLOCK];
    float qbuf[ATT_MAX_ROWS * 256];
    int64_t n = j1 - j0;
    /* scores: the query rows (gathered) times four key rows at a time, as a skinny matmul tile */
    for (int r = 0; r < R; r++)
        for (int64_t i = 0; i < D; i++) qbuf[r * D + i] = q[q_off[r] + i];
    for (int64_t jj = 0; jj < n; jj += 4) {
        int RK = n - jj < 4 ? (int)(n - jj) : 4;
        const float *w[4];
        for (int c = 0; c < 4; c++) w[c] = kb + (j0 + jj + (c < RK ? c : 0)) * kss;
        rows_block_strided(qbuf, D, R, w, RK, D, &s[0][jj], ATT_BLOCK);
    }
    /* mask, scale, and the online-softmax update of each row: s becomes the block's probabilities (0 where
     * masked), the row's output so far is rescaled */
    for (int r = 0; r < R; r++) {
        int64_t p = qpos[r];
        float bm = -__builtin_inff();
        for (int64_t jj = 0; jj < n; jj++) {
            int64_t j = j0 + jj;
            int ok = mrow ? mrow[r][j] != 0 : (j <= p && (window <= 0 || j < sink || j > p - window));
            float x = ok ? s[r][jj] * scale : -__builtin_inff();
            s[r][jj] = x;
            bm = x > bm ? x : bm;
        }
        if (bm == -__builtin_inff()) {  /* no key of this block is visible to row r */
            for (int64_t jj = 0; jj < n; jj++) s[r][jj] = 0.0f;
            continue;
        }
        float mn = bm > m[r] ? bm : m[r];
        float corr = m[r] == -__builtin_inff() ? 0.0f : exp1(m[r] - mn);
        float *orow = o + o_off[r];
        if (corr != 1.0f) {
            __m256 c = _mm256_set1_ps(corr);
            for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(orow + d, _mm256_mul_ps(c, _mm256_loadu_ps(orow + d)));
        }
        m[r] = mn;
        float sum = 0.0f;
        __m256 mv = _mm256_set1_ps(mn), ninf = _mm256_set1_ps(-__builtin_inff());
        int64_t jj = 0;
        for (; jj + 8 <= n; jj += 8) {
            __m256 sv = _mm256_loadu_ps(&s[r][jj]);
            __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(sv, ninf, _CMP_EQ_OQ), exp256(_mm256_sub_ps(sv, mv)));
            _mm256_storeu_ps(&s[r][jj], e);
            sum += hsum8(e);
        }
        for (; jj < n; jj++) {
            float e = s[r][jj] == -__builtin_inff() ? 0.0f : exp1(s[r][jj] - mn);
            s[r][jj] = e;
            sum += e;
        }
        l[r] = l[r] * corr + sum;
    }
    /* o += p V, two query rows at a time (each value vector loaded once for both) */
    for (int r = 0; r < R; r += 2) {
        int r2 = r + 1 < R ? r + 1 : r;
        float *o1 = o + o_off[r], *o2 = o + o_off[r2];
        const float *p1 = s[r], *p2 = s[r2];
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            int nd = D - d0 < 32 ? (int)((D - d0) / 8) : 4;
            __m256 a1[4], a2[4];
            for (int c = 0; c < 4; c++) {  /* the block's p V summed apart, then added to the running output: */
                a1[c] = _mm256_setzero_ps(); /* two-level sums (64 keys, then blocks), not one over every key */
                a2[c] = _mm256_setzero_ps();
            }
            for (int64_t j = 0; j < n; j++) {
                if (p1[j] == 0.0f && p2[j] == 0.0f) continue;  /* masked keys (and underflow) contribute nothing */
                __m256 b1 = _mm256_set1_ps(p1[j]), b2 = _mm256_set1_ps(p2[j]);
                const float *vr = vb + (j0 + j) * kss + d0;
                for (int c = 0; c < 4; c++)
                    if (c < nd) {
                        __m256 vv = _mm256_loadu_ps(vr + 8 * c);
                        a1[c] = _mm256_fmadd_ps(b1, vv, a1[c]);
                        a2[c] = _mm256_fmadd_ps(b2, vv, a2[c]);
                    }
            }
            for (int c = 0; c < nd; c++)
                _mm256_storeu_ps(o1 + d0 + 8 * c, _mm256_add_ps(_mm256_loadu_ps(o1 + d0 + 8 * c), a1[c]));
            if (r2 != r)
                for (int c = 0; c < nd; c++)
                    _mm256_storeu_ps(o2 + d0 + 8 * c, _mm256_add_ps(_mm256_loadu_ps(o2 + d0 + 8 * c), a2[c]));
        }
    }
}

static void attend_range(const float *q, const int64_t *q_off, const int64_t *qpos, const uint8_t *const *mrow, int R,
                         int64_t sink, int64_t window, const float *kb, const float *vb, int64_t kss,
                         int64_t lo, int64_t hi, int64_t D, float scale, float *m, float *l, float *o,
                         const int64_t *o_off) {
    for (int64_t j0 = lo; j0 < hi; j0 += ATT_BLOCK)
        attend_block(q, q_off, qpos, mrow, R, sink, window, kb, vb, kss, j0,
                     j0 + ATT_BLOCK < hi ? j0 + ATT_BLOCK : hi, D, scale, m, l, o, o_off);
}

/* silu(g) * u for M rows of gu = [g | u] (row stride 2F), written over g. silu(g) = g / (1 + exp(-g)). */
static void silu_mul(float *gu, int64_t M, int64_t F) {
    for (int64_t m = 0; m < M; m++) {
        float *g = gu + m * 2 * F, *u = g + F;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= F; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(g + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
        }
        for (; i < F; i++) g[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
}

/* wfmt: bit 0 = bf16 weights, bit 1 = packed panels (spire_panel_gemm) instead of row-major (N x K), bit 2 =
 * int8 packed panels (with bit 1). */
static int gemm_any(int wfmt, const float *x, int64_t ldx, int64_t M, int64_t K, const void *w, int64_t N, float *y,
                    int64_t ldy) {
    int bf16 = wfmt & 1;
    if (wfmt & 4) return spire_panel_gemm_i8(x, ldx, M, K, (const int8_t *)w, N, y, ldy);
    if (wfmt & 2) return panel_gemm(bf16, x, ldx, M, K, w, N, y, ldy);
    const void *ws[1] = {w};
    int64_t ns[1] = {N};
    return bf16 ? spire_skinny_gemm_bf16(x, ldx, M, K, 1, (const uint16_t *const *)ws, ns, y, ldy)
                : spire_skinny_gemm(x, ldx, M, K, 1, (const float *const *)ws, ns, y, ldy);
}

/* RoPE (y = x cos + rotate_half(x) sin, half-split layout) on heads [head_lo, H + KV) of the M rows of qkv
 * ((H + 2 KV) D floats each: q heads, k heads, v heads), then each row's k and v heads into the cache at entry
 * slot[m] (or pos[m] when slot is NULL) of its batch row m / T. */
static void rope_write(float *qkv, int64_t M, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t head_lo,
                       const float *cos, const float *sin, const int64_t *pos, const int64_t *slot, float *kc,
                       float *vc, int64_t csb, int64_t csh, int64_t css) {
    int64_t NQ = (H + 2 * KV) * D, half = D / 2;
    for (int64_t m = 0; m < M; m++) {
        const float *c = cos + m * D, *sn = sin + m * D;
        float tmpd[256];
        for (int64_t hd = head_lo; hd < H + KV; hd++) {
            float *v = qkv + m * NQ + hd * D;
            for (int64_t i = 0; i < half; i++) tmpd[i] = v[i] * c[i] + (-v[i + half]) * sn[i];
            for (int64_t i = half; i < D; i++) tmpd[i] = v[i] * c[i] + v[i - half] * sn[i];
            for (int64_t i = 0; i < D; i++) v[i] = tmpd[i];
        }
        int64_t b = m / T, p = slot ? slot[m] : pos[m];
        for (int64_t hk = 0; hk < KV; hk++) {
            const float *kr = qkv + m * NQ + (H + hk) * D, *vr = qkv + m * NQ + (H + KV + hk) * D;
            float *kd = kc + b * csb + hk * csh + p * css, *vd = vc + b * csb + hk * csh + p * css;
            for (int64_t i = 0; i < D; i++) { kd[i] = kr[i]; vd[i] = vr[i]; }
        }
    }
}

/* x, xo: (M, d) with M = B * T (xo may not alias x); pos: (B, T); window <= 0: no view;
 * slot: NULL (new keys/values go to cache entry pos[b, t]) or (B, T) cache entries to write instead (a ring
 * cache); mask: NULL (the position rule above over a dense cache) or (B, T, n_slots) uint8, nonzero where query
 * (b, t) may read cache entry j < n_slots (the rule is then not applied);
 * cos, sin: (M, D); ln1, ln2: (d,); wqkv ((H + 2 KV) D, d), wo (d, H D), wgu (2 F, d), wdown (d, F): wfmt bit 0
 * = bf16 weights (else float32), bit 1 = packed by spire.kernels.pack_panels (else row-major), bit 2 (with bit 1)
 * = int8 packed by spire.kernels.pack_panels_int8;
 * kc, vc: the layer's cache, element [b, h, s, :] at b csb + h csh + s css;
 * work: M (d + (H + 2 KV) D + H D + 2 F + d) floats of scratch. */
int spire_decode_block(const float *x, float *xo, int64_t B, int64_t T, const int64_t *pos, int64_t sink,
                       int64_t window, const int64_t *slot, const uint8_t *mask, int64_t n_slots,
                       const float *cos, const float *sin, const float *ln1,
                       const float *ln2, float eps, const void *wqkv, const void *wo, const void *wgu,
                       const void *wdown, int wfmt, int64_t d, int64_t H, int64_t KV, int64_t D, int64_t F,
                       float *kc, float *vc, int64_t csb, int64_t csh, int64_t css, float scale, float *work) {
    int64_t M = B * T, G = H / KV, NQ = (H + 2 * KV) * D;
    if (D % 8 || D > 256 || H % KV || G * T > ATT_MAX_ROWS) return -1;
    float *h = work, *qkv = h + M * d, *att = qkv + M * NQ, *gu = att + M * H * D, *tmp = gu + M * 2 * F;
    spire_rms_norm(x, d, ln1, h, M, d, eps);
    if (gemm_any(wfmt, h, d, M, d, wqkv, NQ, qkv, NQ)) return -1;  /* before any cache write */
    rope_write(qkv, M, T, H, KV, D, 0, cos, sin, pos, slot, kc, vc, csb, csh, css);
    /* attention: one task per (b, kv head) with its G x T query rows */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < B * KV; t++) {
        int64_t b = t / KV, hk = t % KV;
        int64_t q_off[ATT_MAX_ROWS], o_off[ATT_MAX_ROWS], qpos[ATT_MAX_ROWS];
        const uint8_t *mrow[ATT_MAX_ROWS];
        float m_run[ATT_MAX_ROWS], l_run[ATT_MAX_ROWS];
        int R = 0;
        int64_t pmin = INT64_MAX, pmax = -1;
        for (int64_t tt = 0; tt < T; tt++)
            for (int64_t gi = 0; gi < G; gi++, R++) {
                int64_t row = b * T + tt, head = hk * G + gi;
                q_off[R] = row * NQ + head * D;
                o_off[R] = row * H * D + head * D;
                qpos[R] = pos[row];
                mrow[R] = mask ? mask + row * n_slots : 0;
                pmin = qpos[R] < pmin ? qpos[R] : pmin;
                pmax = qpos[R] > pmax ? qpos[R] : pmax;
                m_run[R] = -__builtin_inff();
                l_run[R] = 0.0f;
                for (int64_t i = 0; i < D; i++) att[o_off[R] + i] = 0.0f;
            }
        const float *kb = kc + b * csb + hk * csh, *vb = vc + b * csb + hk * csh;
        const uint8_t *const *mr = mask ? mrow : 0;
        if (mask) {
            attend_range(qkv, q_off, qpos, mr, R, sink, window, kb, vb, css, 0, n_slots, D, scale, m_run, l_run,
                         att, o_off);
        } else if (window > 0) {
            int64_t s1 = sink < pmax + 1 ? sink : pmax + 1;
            attend_range(qkv, q_off, qpos, mr, R, sink, window, kb, vb, css, 0, s1, D, scale, m_run, l_run, att,
                         o_off);
            int64_t lo = pmin - window + 1;
            lo = lo > s1 ? lo : s1;
            attend_range(qkv, q_off, qpos, mr, R, sink, window, kb, vb, css, lo, pmax + 1, D, scale, m_run, l_run,
                         att, o_off);
        } else {
            attend_range(qkv, q_off, qpos, mr, R, sink, window, kb, vb, css, 0, pmax + 1, D, scale, m_run, l_run,
                         att, o_off);
        }
        for (int r = 0; r < R; r++) {
            float inv = 1.0f / l_run[r];  /* no visible key: 1 / 0 -> inf, 0 * inf -> NaN, as SDPA */
            for (int64_t i = 0; i < D; i++) att[o_off[r] + i] *= inv;
        }
    }
    if (gemm_any(wfmt, att, H * D, M, H * D, wo, d, xo, d)) return -1;
    for (int64_t i = 0; i < M * d; i++) xo[i] += x[i];
    spire_rms_norm(xo, d, ln2, h, M, d, eps);
    if (gemm_any(wfmt, h, d, M, d, wgu, 2 * F, gu, 2 * F)) return -1;
    silu_mul(gu, M, F);
    if (gemm_any(wfmt, gu, 2 * F, M, F, wdown, d, tmp, d)) return -1;
    for (int64_t i = 0; i < M * d; i++) xo[i] += tmp[i];
    return 0;
}

/* The keys and values a block derives from M = B x T residual-stream vectors x (SPIRe's memory: rms_norm(x) *
 * ln1, the k and v rows of wqkv, RoPE on k), written into the cache at slot[m] (or pos[m]); arguments as
 * spire_decode_block's (work: M (d + (H + 2 KV) D) floats at least). Returns 0, or -1 for unsupported sizes. */
int spire_block_kv(const float *x, int64_t B, int64_t T, const int64_t *pos, const int64_t *slot, const float *cos,
                   const float *sin, const float *ln1, float eps, const void *wqkv, int wfmt, int64_t d, int64_t H,
                   int64_t KV, int64_t D, float *kc, float *vc, int64_t csb, int64_t csh, int64_t css, float *work) {
    int64_t M = B * T, NQ = (H + 2 * KV) * D;
    if (D % 8 || D > 256 || H % KV) return -1;
    float *h = work, *qkv = h + M * d;
    spire_rms_norm(x, d, ln1, h, M, d, eps);
    /* the k and v rows start H D rows in: H D * d elements into a row-major weight, and as many into a packed
     * one when H D is a multiple of its 32-column tiles (else the whole q/k/v product is computed) */
    int64_t lo = (wfmt & 2) && (H * D) % PANEL_TILE ? 0 : H * D;
    const void *wkv = (wfmt & 4) ? (const void *)((const int8_t *)wqkv + lo / PANEL_TILE * panel_i8_tile_bytes(d))
                      : (wfmt & 1) ? (const void *)((const uint16_t *)wqkv + lo * d) : (const void *)((const float *)wqkv + lo * d);
    if (gemm_any(wfmt, h, d, M, d, wkv, NQ - lo, qkv + lo, NQ)) return -1;
    rope_write(qkv, M, T, H, KV, D, H, cos, sin, pos, slot, kc, vc, csb, csh, css);
    return 0;
}

/* out (M x V) = -inf, then out[m, ids[i]] = src[m, i] for i < N (a draft vocabulary's logits back in the
 * target's vocabulary: q = 0 outside it). ids must lie in [0, V) (checked by the caller). */
int spire_scatter_columns(const float *src, int64_t M, int64_t N, const int64_t *ids, int64_t V, float *out) {
    const float ninf = -__builtin_inff();
    for (int64_t m = 0; m < M; m++) {
        float *o = out + m * V;
        const float *r = src + m * N;
        for (int64_t v = 0; v < V; v++) o[v] = ninf;
        for (int64_t i = 0; i < N; i++) o[ids[i]] = r[i];
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------------
 * The SPIRe draft's ring cache bookkeeping for one step (spire.kv_cache.RingKVCache.claim_mask): claim the slots
 * of the B x T new positions (tags[b, slot] = pos; slot = pos below the sink, else sink + (pos - sink) % ring)
 * and build the attention mask over every slot from the tags, as spire.kv_cache.attention_mask with a sink +
 * window view (and spire.kv_cache.self_mask when self_attend is 0): key position kp visible from query qp when
 * kp <= qp and (kp < sink or kp > qp - window), and, without self-attention, kp != qp unless qp = 0. Positions of
 * one row must map to distinct slots (at most ring new positions a row). slots: (B, T) out; mask: (B, T, S). */
int spire_ring_claim_mask(int64_t *tags, int64_t B, int64_t S, const int64_t *pos, int64_t T, int64_t sink,
                          int64_t ring, int64_t window, int self_attend, int64_t *slots, uint8_t *mask) {
    if (sink + ring != S || T > ring || ring < 1) return -1;
    for (int64_t i = 0; i < B * T; i++) {  /* every slot first: a bad position changes nothing */
        int64_t p = pos[i];
        if (p < 0) return -1;
        slots[i] = p < sink ? p : sink + (p - sink) % ring;
    }
    for (int64_t i = 0; i < B * T; i++) tags[(i / T) * S + slots[i]] = pos[i];
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            int64_t qp = pos[b * T + t];
            const int64_t *tg = tags + b * S;
            uint8_t *mr = mask + (b * T + t) * S;
            for (int64_t j = 0; j < S; j++) {
                int64_t kp = tg[j];
                int ok = kp <= qp && (kp < sink || kp > qp - window);
                if (!self_attend) ok = ok && (kp != qp || qp == 0);
                mr[j] = (uint8_t)ok;
            }
        }
    return 0;
}

/* ------------------------------------------------------------------------------------------------------
 * MixedLoss rows (spire.training.losses._MixedLoss, SPIRe paper §3.6) in one pass per row: with z a row of N
 * draft logits, q = softmax(z), log p a row of the target's log-probabilities over the same N tokens, omega w,
 * S_p = sum p and m_i = 1[q_i < p_i] (1/2 at q_i = p_i, torch.minimum's gradient):
 *
 *   distill[r] = -sum_i p_i log q_i        alpha[r] = sum_i min(p_i, q_i)
 *   grad[r, j] = q_j (w S_p + (1 - w) sum_i m_i q_i) - w p_j - (1 - w) m_j q_j
 *
 * grad is d(w distill - (1 - w) alpha)/dz of the row (the caller scales it by the upstream gradient / rows).
 * Three passes over the row (max; the sum of exp; q = exp(log q), p and the sums), a fourth writes grad; exp
 * is decode attention's exp256 (Cephes' polynomial, ~1 ulp), flushed to 0 below float range; log q = (z - max) -
 * log(sum), as log_softmax; each row's sums are kept in float lanes flushed into doubles every 1,024 columns
 * (float32 sums over a 49 K-150 K vocabulary would lose digits torch's do not). z, logp: (n, N) contiguous;
 * grad: (n, N), or NULL for the loss only; distill, alpha: n doubles. Parallel over rows. */
static inline __m256 exp256_flush(__m256 x) {  /* exp256 (decode attention's), 0 below exp's float range */
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.3365447505531f), _CMP_LT_OQ), exp256(x));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

static inline float exp1_flush(float x) {  /* exp256_flush of one value (row tails) */
    float v[8];
    _mm256_storeu_ps(v, exp256_flush(_mm256_set1_ps(x)));
    return v[0];
}

static double row_sum_exp(const float *zr, int64_t N, float mx) {  /* sum_i exp(z_i - mx) of one row, float lanes
                                                                      flushed into a double every 1,024 columns */
    int64_t N8 = N - N % 8;
    __m256 vmx = _mm256_set1_ps(mx), vs = _mm256_setzero_ps();
    double S = 0;
    for (int64_t i = 0; i < N8; i += 8) {
        if (i && !(i & 1023)) {
            S += hsum256(vs);
            vs = _mm256_setzero_ps();
        }
        vs = _mm256_add_ps(vs, exp256_flush(_mm256_sub_ps(_mm256_loadu_ps(zr + i), vmx)));
    }
    S += hsum256(vs);
    for (int64_t i = N8; i < N; i++) S += exp1_flush(zr[i] - mx);
    return S;
}

int spire_mixed_loss(const float *z, const float *logp, int64_t n, int64_t N, float w, float *grad,
                     double *distill, double *alpha) {
    if (N < 1) return -1;
    int64_t N8 = N - N % 8;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const float *zr = z + r * N, *lr = logp + r * N;
        float *g = grad ? grad + r * N : 0;
        __m256 vm = _mm256_set1_ps(-__builtin_inff());
        float mx = -__builtin_inff();
        for (int64_t i = 0; i < N8; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(zr + i));
        float t[8];
        _mm256_storeu_ps(t, vm);
        for (int c = 0; c < 8; c++) mx = t[c] > mx ? t[c] : mx;
        for (int64_t i = N8; i < N; i++) mx = zr[i] > mx ? zr[i] : mx;
        __m256 vmx = _mm256_set1_ps(mx);
        double S = row_sum_exp(zr, N, mx);
        float ls = (float)log(S);  /* log q = (z - max) - log S, in that order (log_softmax's rounding) */
        __m256 vls = _mm256_set1_ps(ls), half = _mm256_set1_ps(0.5f);
        __m256 ad = _mm256_setzero_ps(), asp = ad, amn = ad, amq = ad;
        double D = 0, SP = 0, MN = 0, MQ = 0;  /* float lanes flushed into doubles every 1024 columns */
        for (int64_t i = 0; i < N8; i += 8) {  /* q = exp(log q), p and the row's sums */
            if (i && !(i & 1023)) {
                D += hsum256(ad); SP += hsum256(asp); MN += hsum256(amn); MQ += hsum256(amq);
                ad = asp = amn = amq = _mm256_setzero_ps();
            }
            __m256 lq = _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(zr + i), vmx), vls);
            __m256 q = exp256_flush(lq);
            __m256 p = exp256_flush(_mm256_loadu_ps(lr + i));
            ad = _mm256_fmadd_ps(p, lq, ad);
            asp = _mm256_add_ps(asp, p);
            amn = _mm256_add_ps(amn, _mm256_min_ps(p, q));
            __m256 m = _mm256_add_ps(_mm256_and_ps(_mm256_cmp_ps(q, p, _CMP_LT_OQ), _mm256_set1_ps(1.0f)),
                                     _mm256_and_ps(_mm256_cmp_ps(q, p, _CMP_EQ_OQ), half));
            amq = _mm256_fmadd_ps(m, q, amq);
            if (g) _mm256_storeu_ps(g + i, q);
        }
        double d = D + hsum256(ad), sp = SP + hsum256(asp), mn = MN + hsum256(amn), mq = MQ + hsum256(amq);
        for (int64_t i = N8; i < N; i++) {
            float lq = (zr[i] - mx) - ls;
            float q = exp1_flush(lq), p = exp1_flush(lr[i]), m = q < p ? 1.0f : (q == p ? 0.5f : 0.0f);
            d += p * lq;
            sp += p;
            mn += p < q ? p : q;
            mq += m * q;
            if (g) g[i] = q;
        }
        distill[r] = -d;
        alpha[r] = mn;
        if (!g) continue;  /* the loss only (evaluation) */
        float c = (float)(w * sp + (1.0 - w) * mq);
        __m256 vc = _mm256_set1_ps(c), vw = _mm256_set1_ps(w), vw1 = _mm256_set1_ps(1.0f - w);
        for (int64_t i = 0; i < N8; i += 8) {  /* grad = q c - w p - (1 - w) m q */
            __m256 q = _mm256_loadu_ps(g + i), p = exp256_flush(_mm256_loadu_ps(lr + i));
            __m256 m = _mm256_add_ps(_mm256_and_ps(_mm256_cmp_ps(q, p, _CMP_LT_OQ), _mm256_set1_ps(1.0f)),
                                     _mm256_and_ps(_mm256_cmp_ps(q, p, _CMP_EQ_OQ), half));
            __m256 o = _mm256_fnmadd_ps(vw, p, _mm256_mul_ps(q, vc));
            _mm256_storeu_ps(g + i, _mm256_fnmadd_ps(_mm256_mul_ps(vw1, m), q, o));
        }
        for (int64_t i = N8; i < N; i++) {
            float q = g[i], p = exp1_flush(lr[i]), m = q < p ? 1.0f : (q == p ? 0.5f : 0.0f);
            g[i] = q * c - w * p - (1.0f - w) * m * q;
        }
    }
    return 0;
}

/* Cross-entropy rows (HardTargetLoss, spire.training.losses.hard_target_loss): with z a row of N logits and y its
 * target column (y < 0: ignored, loss 0 and gradient 0), q = softmax(z):
 *
 *   loss[r] = log sum_i exp(z_i) - z_y        grad[r, j] = q_j - 1[j = y]
 *
 * Three passes over the row (max; the sum of exp; grad = q written, then 1 taken off at y), exp and the sums as in
 * MixedLoss rows above (exp256, float lanes flushed into doubles every 1,024 columns). z: (n, N) contiguous; y: n
 * int64; grad: (n, N) or NULL for the loss only; loss: n doubles. Parallel over rows. */
int spire_cross_entropy(const float *z, const int64_t *y, int64_t n, int64_t N, float *grad, double *loss) {
    if (N < 1) return -1;
    for (int64_t r = 0; r < n; r++)
        if (y[r] >= N) return -2;
    int64_t N8 = N - N % 8;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const float *zr = z + r * N;
        float *g = grad ? grad + r * N : 0;
        if (y[r] < 0) {  /* ignored row */
            loss[r] = 0.0;
            if (g) memset(g, 0, (size_t)N * sizeof(float));
            continue;
        }
        __m256 vm = _mm256_set1_ps(-__builtin_inff()), vnan = _mm256_setzero_ps();
        float mx = -__builtin_inff();
        int has_nan = 0;
        for (int64_t i = 0; i < N8; i += 8) {
            __m256 v = _mm256_loadu_ps(zr + i);
            vm = _mm256_max_ps(vm, v);
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float t[8];
        _mm256_storeu_ps(t, vm);
        for (int c = 0; c < 8; c++) mx = t[c] > mx ? t[c] : mx;
        for (int64_t i = N8; i < N; i++) {
            mx = zr[i] > mx ? zr[i] : mx;
            has_nan |= zr[i] != zr[i];
        }
        if (has_nan || _mm256_movemask_ps(vnan)) {  /* a NaN logit: the row's loss and gradient are NaN, as torch's */
            loss[r] = NAN;
            if (g) for (int64_t i = 0; i < N; i++) g[i] = NAN;
            continue;
        }
        __m256 vmx = _mm256_set1_ps(mx);
        double S = row_sum_exp(zr, N, mx);
        float ls = (float)log(S);
        loss[r] = (double)ls - ((double)zr[y[r]] - (double)mx);
        if (!g) continue;
        __m256 vls = _mm256_set1_ps(ls);
        for (int64_t i = 0; i < N8; i += 8)
            _mm256_storeu_ps(g + i, exp256_flush(_mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(zr + i), vmx), vls)));
        for (int64_t i = N8; i < N; i++) g[i] = exp1_flush((zr[i] - mx) - ls);
        g[y[r]] -= 1.0f;
    }
    return 0;
}
