/* CPU kernels of the quantized linear layers and of decode attention (issue #20).
 *
 * Python side: flowengine/model/layers/quant_linear.py (weights) and
 * flowengine/model/attention/cpu_backend.py (attention). Every function takes raw
 * pointers the Python wrapper has checked (dtype, contiguity, shapes) and releases the
 * GIL while it runs. Threads come from OpenMP; built with -fopenmp the module links
 * libgomp.so.1, which is the very runtime torch loaded (same soname), so torch's
 * operators and these kernels share one thread pool and one wait policy
 * (OMP_WAIT_POLICY, set by the executor before the pool starts).
 *
 * Weight layouts (planar; one weight row n of K inputs, K a multiple of 32; GGUF's
 * blocks of 32 weights, ggml-common.h):
 *   Q4_0  qs uint8 [N, K/2]: block b's 16 bytes at qs[n, 16b..]; byte j holds weight j
 *         in its low nibble and weight j+16 in its high one; d fp16 [N, K/32];
 *         w = d * (q - 8).
 *   Q4_1  qs as Q4_0; (d, m) fp16 [N, K/32, 2]; w = d * q + m.
 *   Q8_0  qs int8 [N, K]; d fp16 [N, K/32]; w = d * q.
 * The dequantized weights are exactly the float32 values gguf.quants.dequantize
 * gives (d * q is exact in float32, and d * q + m is one rounding, done here by one
 * fused multiply-add), so a matmul differs from float32 over the dequantized matrix
 * only by the order of the sums, except where a body rounds the activations to
 * integers per 32-value block (AVX512-VNNI: 24 bits; AMX-INT8 with --dtype bfloat16
 * and the AVX2 int16 panel body: 16 bits). Activations and outputs are float32.
 *
 * Each function has an AVX-512 body (selected at run time with
 * __builtin_cpu_supports) and a portable C body, so the module builds with gcc on any
 * machine; only x86-64 gets the intrinsics. The quantized matmul, the decode attention
 * and SiLU-and-mul also have AVX2 + FMA bodies for x86-64 CPUs without AVX-512.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#define HAVE_POOL 1
#else
#define HAVE_POOL 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

enum { FMT_Q4_0 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2 };
#define QK 32 /* weights per block */
#define MR 8  /* activation rows per pass over a weight row */

/* The number in environment variable `name`, or `dflt` when it is unset or empty (the
 * switches of this file read theirs once and keep it). */
static double env_number(const char *name, double dflt)
{
    const char *v = getenv(name);
    return v != NULL && *v ? atof(v) : dflt;
}

static inline float fp16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Round to nearest even, as torch's float -> float16 conversion: values from 65520 up
 * become infinity, those below 2^-14 subnormals (IEEE 754 binary16). */
static inline uint16_t f32_to_fp16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u)
        return sign | 0x7e00u; /* NaN */
    if (u >= 0x477ff000u)
        return sign | 0x7c00u;
    if (u < 0x38800000u) { /* |f| < 2^-14: a multiple of 2^-24, rounded to nearest even */
        float a;
        memcpy(&a, &u, 4);
        return sign | (uint16_t)lrintf(a * 16777216.f);
    }
    const uint32_t r = u - (112u << 23); /* exponent bias 127 -> 15 */
    return sign | (uint16_t)((r + 0xfffu + ((r >> 13) & 1u)) >> 13);
}

/* Bytes of one weight row's quants, and halves of one row's scales. */
static inline int64_t qs_row_bytes(int fmt, int64_t K) { return fmt == FMT_Q8_0 ? K : K / 2; }
static inline int64_t sc_row_halves(int fmt, int64_t K) { return fmt == FMT_Q4_1 ? K / 16 : K / 32; }

/* ------------------------------------------------------------------ portable bodies */

/* Dequantize block b of one row into w[32]. */
static inline void dequant_block_c(int fmt, const uint8_t *qs, const uint16_t *sc, int64_t b,
                                   float *w)
{
    if (fmt == FMT_Q8_0) {
        const int8_t *q = (const int8_t *)qs + b * QK;
        float d = fp16_to_f32(sc[b]);
        for (int j = 0; j < QK; j++)
            w[j] = d * (float)q[j];
        return;
    }
    const uint8_t *q = qs + b * (QK / 2);
    float d, m;
    if (fmt == FMT_Q4_1) {
        d = fp16_to_f32(sc[2 * b]);
        m = fp16_to_f32(sc[2 * b + 1]);
        for (int j = 0; j < QK / 2; j++) {
            w[j] = fmaf(d, (float)(q[j] & 0x0f), m);
            w[j + QK / 2] = fmaf(d, (float)(q[j] >> 4), m);
        }
    } else {
        d = fp16_to_f32(sc[b]);
        for (int j = 0; j < QK / 2; j++) {
            w[j] = d * (float)((int)(q[j] & 0x0f) - 8);
            w[j + QK / 2] = d * (float)((int)(q[j] >> 4) - 8);
        }
    }
}

static void linear_rows_c(int fmt, const float *x, int64_t M, int64_t K, const uint8_t *qs,
                          const uint16_t *sc, int64_t n0, int64_t n1, float *out, int64_t N)
{
    float w[QK];
    const int64_t nb = K / QK, qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *rq = qs + n * qrow;
        const uint16_t *rs = sc + n * srow;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int64_t mr = M - m0 < MR ? M - m0 : MR;
            float acc[MR] = {0};
            for (int64_t b = 0; b < nb; b++) {
                dequant_block_c(fmt, rq, rs, b, w);
                for (int64_t r = 0; r < mr; r++) {
                    const float *xr = x + (m0 + r) * K + b * QK;
                    float s = 0.f;
                    for (int j = 0; j < QK; j++)
                        s += w[j] * xr[j];
                    acc[r] += s;
                }
            }
            for (int64_t r = 0; r < mr; r++)
                out[(m0 + r) * N + n] = acc[r];
        }
    }
}

/* ------------------------------------------------------------------ AVX-512 bodies */
#if HAVE_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

/* Row n's scales as float32 into scf (16 at a time with vcvtph2ps): a block's
 * scale is then one broadcast load. */
AVX512 static inline void row_scales_avx512(const uint16_t *rs, int64_t count, float *scf)
{
    int64_t i = 0;
    for (; i + 16 <= count; i += 16)
        _mm512_storeu_ps(scf + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rs + i))));
    for (; i < count; i++)
        scf[i] = _cvtsh_ss(rs[i]);
}

/* Block b of a row: weights 0..15 into *lo, 16..31 into *hi (scf: the row's float
 * scales). */
AVX512 static inline void dequant_block_avx512(int fmt, const uint8_t *qs, const float *scf,
                                               int64_t b, __m512 *lo, __m512 *hi)
{
    if (fmt == FMT_Q8_0) {
        const int8_t *q = (const int8_t *)qs + b * QK;
        __m512 d = _mm512_set1_ps(scf[b]);
        __m128i a = _mm_loadu_si128((const __m128i *)q);
        __m128i c = _mm_loadu_si128((const __m128i *)(q + 16));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)));
        return;
    }
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m128i raw = _mm_loadu_si128((const __m128i *)(qs + b * (QK / 2)));
    __m512 ql = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)));
    __m512 qh = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)));
    if (fmt == FMT_Q4_1) {
        __m512 d = _mm512_set1_ps(scf[2 * b]);
        __m512 m = _mm512_set1_ps(scf[2 * b + 1]);
        *lo = _mm512_fmadd_ps(d, ql, m);
        *hi = _mm512_fmadd_ps(d, qh, m);
    } else {
        __m512 d = _mm512_set1_ps(scf[b]);
        __m512 eight = _mm512_set1_ps(8.f);
        *lo = _mm512_mul_ps(d, _mm512_sub_ps(ql, eight));
        *hi = _mm512_mul_ps(d, _mm512_sub_ps(qh, eight));
    }
}

/* One activation row: four independent accumulators (two blocks per iteration), so
 * the loop is not bound by the latency of one chain of FMAs. */
AVX512 static inline float dot_row1_avx512(int fmt, const uint8_t *rq, const float *scf,
                                           const float *x, int64_t nb)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512 lo0, hi0, lo1, hi1;
        dequant_block_avx512(fmt, rq, scf, b, &lo0, &hi0);
        dequant_block_avx512(fmt, rq, scf, b + 1, &lo1, &hi1);
        const float *xb = x + b * QK;
        a0 = _mm512_fmadd_ps(lo0, _mm512_loadu_ps(xb), a0);
        a1 = _mm512_fmadd_ps(hi0, _mm512_loadu_ps(xb + 16), a1);
        a2 = _mm512_fmadd_ps(lo1, _mm512_loadu_ps(xb + 32), a2);
        a3 = _mm512_fmadd_ps(hi1, _mm512_loadu_ps(xb + 48), a3);
    }
    if (b < nb) {
        __m512 lo0, hi0;
        dequant_block_avx512(fmt, rq, scf, b, &lo0, &hi0);
        a0 = _mm512_fmadd_ps(lo0, _mm512_loadu_ps(x + b * QK), a0);
        a1 = _mm512_fmadd_ps(hi0, _mm512_loadu_ps(x + b * QK + 16), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

AVX512 static void linear_rows_avx512(int fmt, const float *x, int64_t M, int64_t K,
                                      const uint8_t *qs, const uint16_t *sc, int64_t n0,
                                      int64_t n1, float *out, int64_t N)
{
    const int64_t nb = K / QK, qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
    float scf[srow];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *rq = qs + n * qrow;
        row_scales_avx512(sc + n * srow, srow, scf);
        if (M == 1) {
            out[n] = dot_row1_avx512(fmt, rq, scf, x, nb);
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int64_t mr = M - m0 < MR ? M - m0 : MR;
            /* lo and hi halves in separate accumulators: 2 * mr independent chains */
            __m512 al[MR], ah[MR];
            for (int r = 0; r < MR; r++)
                al[r] = ah[r] = _mm512_setzero_ps();
            const float *xb = x + m0 * K;
            for (int64_t b = 0; b < nb; b++, xb += QK) {
                __m512 lo, hi;
                dequant_block_avx512(fmt, rq, scf, b, &lo, &hi);
                switch (mr) { /* unrolled so that the accumulators stay in registers */
#define ROW(r)                                                                          \
    al[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb + (r) * K), al[r]);                   \
    ah[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + (r) * K + 16), ah[r]);
                case 8: ROW(7) /* fallthrough */
                case 7: ROW(6) /* fallthrough */
                case 6: ROW(5) /* fallthrough */
                case 5: ROW(4) /* fallthrough */
                case 4: ROW(3) /* fallthrough */
                case 3: ROW(2) /* fallthrough */
                case 2: ROW(1) /* fallthrough */
                default: ROW(0)
#undef ROW
                }
            }
            for (int64_t r = 0; r < mr; r++)
                out[(m0 + r) * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(al[r], ah[r]));
        }
    }
}

/* ---- AVX2 bodies (CPUs without AVX-512: AMD Zen 1-3, most Intel laptop and desktop
 * parts): the float32 bodies above at 8 lanes. Each block dequantizes to the same
 * values as dequant_block_c (d q + m by one FMA, d (q - 8), d q), so results differ
 * from the portable body only by the order of the sums. */
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline void row_scales_avx2(const uint16_t *rs, int64_t count, float *scf)
{
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(scf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rs + i))));
    for (; i < count; i++)
        scf[i] = _cvtsh_ss(rs[i]);
}

/* Block b of a row: weights 8 i .. 8 i + 7 into w[i] (scf: the row's float scales). */
AVX2 static inline void dequant_block_avx2(int fmt, const uint8_t *qs, const float *scf,
                                           int64_t b, __m256 w[4])
{
    if (fmt == FMT_Q8_0) {
        const int8_t *q = (const int8_t *)qs + b * QK;
        const __m256 d = _mm256_set1_ps(scf[b]);
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                        _mm_loadl_epi64((const __m128i *)(q + 8 * i)))));
        return;
    }
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i raw = _mm_loadu_si128((const __m128i *)(qs + b * (QK / 2)));
    const __m128i lo = _mm_and_si128(raw, mask); /* weights 0..15 */
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask); /* 16..31 */
    __m256 q[4];
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    if (fmt == FMT_Q4_1) {
        const __m256 d = _mm256_set1_ps(scf[2 * b]), m = _mm256_set1_ps(scf[2 * b + 1]);
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_fmadd_ps(d, q[i], m);
    } else {
        const __m256 d = _mm256_set1_ps(scf[b]), eight = _mm256_set1_ps(8.f);
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_mul_ps(d, _mm256_sub_ps(q[i], eight));
    }
}

AVX2 static inline float hsum_avx2(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp_avx512 (below) at 8 lanes: the same polynomial, 2^n built in the exponent bits
 * for x clamped to [-87, 88], and +inf above 88.72 (where e^x overflows float32), as
 * vscalefps gives there. */
AVX2 static inline __m256 exp_avx2(__m256 x)
{
    const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.7228394f), _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)),
                            _mm256_set1_ps(INFINITY), over);
}

/* 8 bf16 widened exactly; 8 floats rounded to bf16 as f32_to_bf16 rounds (NaN stays
 * NaN). */
AVX2 static inline __m256 bf16_load8_avx2(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

AVX2 static inline __m128i bf16_round_avx2(__m256 f)
{
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)),
                           nan);
    /* the 8 values (< 2^16) into the low 128 bits: pack within lanes, then gather */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

/* One activation row, factored per block: sum_j w_j x_j = d (q . x) + m sum(x) for
 * Q4_1 (d (q . x) - 8 d sum(x) for Q4_0, d (q . x) for Q8_0), the codes q converted
 * to float straight from the packed bytes (8 bytes zero- or sign-extended to 8 int32
 * lanes: a Q4 block's low nibbles are weights 0-15, its high ones 16-31), so the
 * dequantization's 4 FMAs and 2 byte shuffles per block are gone. sx: the block sums of
 * x. The same products as d q x to float32 rounding, summed in another order. */
AVX2 static inline __m256 codes_dot_avx2(int fmt, const uint8_t *rq, int64_t b, const float *xb)
{
    __m256 q0, q1, q2, q3;
    if (fmt == FMT_Q8_0) {
        const int8_t *q = (const int8_t *)rq + b * QK;
        q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
        q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8))));
        q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16))));
        q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 24))));
    } else {
        const uint8_t *q = rq + b * (QK / 2);
        const __m256i mask = _mm256_set1_epi32(0x0f);
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
        q0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
        q1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
        q2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
        q3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
    }
    __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xb));
    t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + 8), t);
    t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb + 16), t);
    return _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb + 24), t);
}

AVX2 static inline float dot_row1_avx2(int fmt, const uint8_t *rq, const float *scf,
                                       const float *x, const float *sxs, int64_t ns, int64_t nb)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    const int64_t ds = fmt == FMT_Q4_1 ? 2 : 1; /* scf stride: (d, m) pairs for Q4_1 */
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) { /* two accumulators: the FMA chains of two blocks */
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(scf[ds * b]), codes_dot_avx2(fmt, rq, b, x + b * QK), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(scf[ds * (b + 1)]),
                             codes_dot_avx2(fmt, rq, b + 1, x + (b + 1) * QK), a1);
    }
    if (b < nb)
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(scf[ds * b]), codes_dot_avx2(fmt, rq, b, x + b * QK), a0);
    /* the offsets m sum(x) (Q4_1) or -8 d sum(x) (Q4_0): scf against sxs, 8 at a time */
    __m256 o = _mm256_setzero_ps();
    for (int64_t i = 0; i < ns; i += 8)
        o = _mm256_fmadd_ps(_mm256_loadu_ps(scf + i), _mm256_loadu_ps(sxs + i), o);
    return hsum_avx2(_mm256_add_ps(_mm256_add_ps(a0, a1), o));
}

#define I16_TOP 32767.f /* the int16 bodies' largest |A| */

/* Block xb[32] rounded: A = round(x / s), s = max|x| / I16_TOP (NaN when the block has a
 * NaN: A = 0), xs = the float32 sum of the block. */
AVX2 static inline void round_block_i16(const float *xb, int32_t A[32], float *s, float *xs)
{
    __m256 v[4];
    for (int i = 0; i < 4; i++)
        v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]),
                                            _mm256_andnot_ps(sign, v[1])),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v[2]),
                                            _mm256_andnot_ps(sign, v[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    float amax = _mm_cvtss_f32(h);
    int nan = 0;
    for (int i = 0; i < 4; i++)
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    /* a block below 2^-100 is scaled by 2^100 first (exact), or TOP / amax would
     * overflow */
    const float pre = amax < 0x1p-100f ? 0x1p100f : 1.f;
    amax *= pre;
    float inv = amax > 0.f ? I16_TOP / amax : 0.f, sb = amax / I16_TOP / pre;
    if (nan) {
        inv = 0.f;
        sb = NAN;
    }
    const __m256 vp = _mm256_set1_ps(pre), vi = _mm256_set1_ps(inv);
    for (int i = 0; i < 4; i++)
        _mm256_storeu_si256((__m256i *)(A + 8 * i),
                            _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v[i], vp), vi)));
    *s = sb;
    *xs = hsum_avx2(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
}

/* One activation row with int16 products: x rounded per block as the int16 panel body
 * rounds it (xa = A in k order, xsc = the blocks' s), then per block
 *     sum_j w_j x_j ~= d s (q . A) + m sum(x)     (Q4_0: - 8 d sum(x); Q8_0: no offset)
 * with q . A by vpmaddwd on the codes zero- or sign-extended to int16 straight from the
 * packed bytes (16 products per instruction; the float32 body converts every code to
 * float and multiplies 8 at a time), exact in int32, then one FMA per block by d s. The
 * offsets are dot_row1_avx2's (scf against sxs). */
/* q . A of block b as 8 int32 partial sums, converted to float (exact below 2^24). */
AVX2 static inline __m256 codes_dot_i16(int fmt, const uint8_t *rq, int64_t b, const int16_t *xa)
{
    __m256i lo, hi;
    if (fmt == FMT_Q8_0) {
        const __m128i *q = (const __m128i *)(rq + b * QK);
        lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(q));
        hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(q + 1));
    } else {
        const __m256i c =
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(rq + b * (QK / 2))));
        lo = _mm256_and_si256(c, _mm256_set1_epi16(0x0f));
        hi = _mm256_srli_epi16(c, 4);
    }
    return _mm256_cvtepi32_ps(_mm256_add_epi32(
        _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)(xa + b * QK))),
        _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xa + b * QK + 16)))));
}

AVX2 static inline float dot_row1_i16(int fmt, const uint8_t *rq, const float *scf,
                                      const int16_t *xa, const float *xsc, const float *sxs,
                                      int64_t ns, int64_t nb)
{
    const int64_t ds = fmt == FMT_Q4_1 ? 2 : 1;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) { /* two accumulators: the FMA chains of two blocks */
        a0 = _mm256_fmadd_ps(codes_dot_i16(fmt, rq, b, xa), _mm256_set1_ps(scf[ds * b] * xsc[b]),
                             a0);
        a1 = _mm256_fmadd_ps(codes_dot_i16(fmt, rq, b + 1, xa),
                             _mm256_set1_ps(scf[ds * (b + 1)] * xsc[b + 1]), a1);
    }
    if (b < nb)
        a0 = _mm256_fmadd_ps(codes_dot_i16(fmt, rq, b, xa), _mm256_set1_ps(scf[ds * b] * xsc[b]),
                             a0);
    __m256 o = _mm256_setzero_ps();
    for (int64_t i = 0; i < ns; i += 8)
        o = _mm256_fmadd_ps(_mm256_loadu_ps(scf + i), _mm256_loadu_ps(sxs + i), o);
    return hsum_avx2(_mm256_add_ps(_mm256_add_ps(a0, a1), o));
}

/* Up to 4 activation rows per pass over a weight row (two accumulators each: 8
 * independent chains in 16 ymm registers with the block's 4 weight vectors). */
#define MR_AVX2 4
AVX2 static void linear_rows_avx2(int fmt, const float *x, int64_t M, int64_t K,
                                  const uint8_t *qs, const uint16_t *sc, int64_t n0,
                                  int64_t n1, float *out, int64_t N, int i16)
{
    const int64_t nb = K / QK, qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
    /* 1 row: sxs[i] multiplies scf[i] in the offset term: m_b sum(x_b) for Q4_1 (scf
     * holds (d, m) pairs, so sxs = 0, sum(x_0), 0, sum(x_1), ...), -8 d_b sum(x_b) for
     * Q4_0, nothing for Q8_0 (ns = 0); both padded with zeros to ns, a multiple of 8. */
    const int64_t ns = M == 1 && fmt != FMT_Q8_0 ? (srow + 7) / 8 * 8 : 0;
    float scf[(srow + 7) / 8 * 8], sxs[ns > 0 ? ns : 1];
    for (int64_t i = srow; i < (srow + 7) / 8 * 8; i++)
        scf[i] = 0.f;
    if (ns > 0) {
        memset(sxs, 0, (size_t)ns * sizeof(float));
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + b * QK;
            const float s = hsum_avx2(_mm256_add_ps(
                _mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24))));
            if (fmt == FMT_Q4_1)
                sxs[2 * b + 1] = s;
            else
                sxs[b] = -8.f * s;
        }
    }
    i16 = i16 && M == 1;
    int16_t xa[i16 ? K : 1];
    float xsc[i16 ? nb : 1];
    for (int64_t b = 0; i16 && b < nb; b++) {
        int32_t A[32];
        float xs;
        round_block_i16(x + b * QK, A, xsc + b, &xs);
        for (int k = 0; k < 32; k++)
            xa[b * QK + k] = (int16_t)A[k];
    }
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *rq = qs + n * qrow;
        row_scales_avx2(sc + n * srow, srow, scf);
        if (i16) {
            out[n] = dot_row1_i16(fmt, rq, scf, xa, xsc, sxs, ns, nb);
            continue;
        }
        if (M == 1) {
            out[n] = dot_row1_avx2(fmt, rq, scf, x, sxs, ns, nb);
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += MR_AVX2) {
            const int64_t mr = M - m0 < MR_AVX2 ? M - m0 : MR_AVX2;
            __m256 ae[MR_AVX2], ao[MR_AVX2];
            for (int r = 0; r < MR_AVX2; r++)
                ae[r] = ao[r] = _mm256_setzero_ps();
            const float *xb = x + m0 * K;
            for (int64_t b = 0; b < nb; b++, xb += QK) {
                __m256 w[4];
                dequant_block_avx2(fmt, rq, scf, b, w);
                switch (mr) { /* unrolled so that the accumulators stay in registers */
#define ROW(r)                                                                          \
    ae[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb + (r) * K), ae[r]);                 \
    ao[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + (r) * K + 8), ao[r]);             \
    ae[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + (r) * K + 16), ae[r]);            \
    ao[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + (r) * K + 24), ao[r]);
                case 4: ROW(3) /* fallthrough */
                case 3: ROW(2) /* fallthrough */
                case 2: ROW(1) /* fallthrough */
                default: ROW(0)
#undef ROW
                }
            }
            for (int64_t r = 0; r < mr; r++)
                out[(m0 + r) * N + n] = hsum_avx2(_mm256_add_ps(ae[r], ao[r]));
        }
    }
}

/* ---- the panel body (PANEL_MIN_ROWS or more activation rows)
 *
 * 16 weight rows at a time are dequantized into a float32 panel stored transposed,
 * wt[k][16], so that one vector holds the 16 rows' weights at column k; then
 *     acc[m] += x[m][k] * wt[k]     (x[m][k] broadcast from memory inside the FMA)
 * for up to PANEL_MB activation rows at once gives 16 outputs of row m per vector: no
 * horizontal sums, one weight load per PANEL_MB FMAs, and the panel (16 x K floats, in
 * L1/L2) is reused by every tile of activation rows. The dequantization (the same
 * values as dequant_block_avx512) and a 16 x 16 transpose cost ~10 instructions per
 * 16 weights, paid once per panel whatever the number of rows. Each output is one
 * float32 chain over k in order. */
#define PANEL_MB 16

/* dst[c * 16 + r] = src[r * stride + c] for r < 16, c < 16. */
AVX512 static inline void transpose16_ps(const float *src, int64_t stride, float *dst)
{
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_loadu_ps(src + i * stride);
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    /* r[4i + j]: rows 4i..4i+3, column j of each 128-bit lane (lane l: column 4l + j) */
    for (int j = 0; j < 4; j++) {
        __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);      /* lanes 0, 2 | 0, 2 */
        __m512 b = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);      /* lanes 1, 3 | 1, 3 */
        __m512 c = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        __m512 e = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
        /* columns j (lane 0), 8 + j (lane 2) and 4 + j (1), 12 + j (3) */
        _mm512_storeu_ps(dst + j * 16, _mm512_shuffle_f32x4(a, c, 0x88));
        _mm512_storeu_ps(dst + (8 + j) * 16, _mm512_shuffle_f32x4(a, c, 0xDD));
        _mm512_storeu_ps(dst + (4 + j) * 16, _mm512_shuffle_f32x4(b, e, 0x88));
        _mm512_storeu_ps(dst + (12 + j) * 16, _mm512_shuffle_f32x4(b, e, 0xDD));
    }
}

/* wt[k * 16 + r] = weight (n0 + r, k) for r < np (<= 16), 0 for the rows past np. */
AVX512 static void dequant_panel_avx512(int fmt, const uint8_t *qs, const uint16_t *sc,
                                        int64_t K, int64_t n0, int64_t np, float *wt)
{
    const int64_t nb = K / QK, qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
    float scf[16][srow];
    float blk[16 * 32];
    for (int64_t r = 0; r < np; r++)
        row_scales_avx512(sc + (n0 + r) * srow, srow, scf[r]);
    if (np < 16)
        memset(blk + np * 32, 0, (size_t)(16 - np) * 32 * sizeof(float));
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t r = 0; r < np; r++) {
            __m512 lo, hi;
            dequant_block_avx512(fmt, qs + (n0 + r) * qrow, scf[r], b, &lo, &hi);
            _mm512_storeu_ps(blk + r * 32, lo);
            _mm512_storeu_ps(blk + r * 32 + 16, hi);
        }
        transpose16_ps(blk, 32, wt + b * QK * 16);
        transpose16_ps(blk + 16, 32, wt + (b * QK + 16) * 16);
    }
}

/* out[m0 + r][n0 .. n0 + np) for r < TR (a constant after inlining, <= PANEL_MB):
 * xt = the activation tile packed [K][16] (column k of its rows at xt + 16 k), so every
 * broadcast operand is one pointer plus a constant. */
AVX512 static inline __attribute__((always_inline)) void
panel_tile(const float *xt, int64_t K, const float *wt, int64_t m0, const int TR, int64_t n0,
           int64_t np, float *out, int64_t N)
{
    __m512 acc[PANEL_MB];
    for (int r = 0; r < TR; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m512 w = _mm512_loadu_ps(wt + k * 16);
        for (int r = 0; r < TR; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xt[k * 16 + r]), w, acc[r]);
    }
    const __mmask16 live = (__mmask16)((1u << np) - 1);
    for (int r = 0; r < TR; r++)
        _mm512_mask_storeu_ps(out + (m0 + r) * N + n0, live, acc[r]);
}

/* xp[t][k][r] = x[(16 t + r) K + k] (0 past row M): the activations in tiles of 16 rows,
 * transposed (floats: ceil(M / 16) * 16 * K). */
AVX512 static void pack_activations_avx512(const float *x, int64_t M, int64_t K, float *xp)
{
    float tmp[16 * 16];
    for (int64_t t = 0; t * 16 < M; t++) {
        const int64_t rows = M - t * 16 < 16 ? M - t * 16 : 16;
        float *dst = xp + t * 16 * K;
        for (int64_t k0 = 0; k0 < K; k0 += 16) {
            if (rows == 16) {
                transpose16_ps(x + t * 16 * K + k0, K, dst + k0 * 16);
                continue;
            }
            memset(tmp, 0, sizeof(tmp));
            for (int64_t r = 0; r < rows; r++)
                memcpy(tmp + r * 16, x + (t * 16 + r) * K + k0, 16 * sizeof(float));
            transpose16_ps(tmp, 16, dst + k0 * 16);
        }
    }
}

/* Activation rows per block of the panel body: every panel of a thread's weight rows
 * streams the block's packed activations, and a panel is dequantized once per block.
 * Without blocks a 2048-row prefill chunk of the 3072 x 576 gate/up matmul streamed
 * 4.7 MB from L3 per panel, 19% slower per row than 512 rows; blocks sized by bytes
 * (512 KB) made K = 1536 slower by as much (its panels dequantized 26 times instead
 * of once). FLOWENGINE_CPU_PANEL_BLOCK_ROWS overrides (0: one block); benchmarks/
 * cpu_quant_rows.py measures it. Sums are formed in the same order either way. */
#define PANEL_BLOCK_ROWS 512
static int64_t panel_block_rows(void)
{
    static int64_t rows = -1;
    if (rows < 0) {
        rows = (int64_t)env_number("FLOWENGINE_CPU_PANEL_BLOCK_ROWS", PANEL_BLOCK_ROWS);
        rows = rows <= 0 ? INT64_MAX : (rows + PANEL_MB - 1) / PANEL_MB * PANEL_MB;
    }
    return rows;
}

/* panel_block_rows() rounded up to a multiple of `tile` rows. */
static int64_t panel_block_rows_of(int64_t tile)
{
    const int64_t mb = panel_block_rows();
    return mb < INT64_MAX ? (mb + tile - 1) / tile * tile : mb;
}

/* Weight rows n0..n1 against all M activation rows (packed by pack_activations_avx512
 * into xp) through 16-row weight panels (wt: 16 x K floats of scratch), the
 * activation rows in blocks of panel_block_rows(). */
AVX512 static void linear_panels_avx512(int fmt, const float *xp, int64_t M, int64_t K,
                                        const uint8_t *qs, const uint16_t *sc, int64_t n0,
                                        int64_t n1, float *out, int64_t N, float *wt)
{
    const int64_t mb = panel_block_rows();
    for (int64_t b0 = 0; b0 < M; b0 += mb) {
        const int64_t b1 = M - b0 < mb ? M : b0 + mb;
        for (int64_t n = n0; n < n1; n += 16) {
            const int64_t np = n1 - n < 16 ? n1 - n : 16;
            dequant_panel_avx512(fmt, qs, sc, K, n, np, wt);
            for (int64_t m0 = b0; m0 < b1; m0 += PANEL_MB) {
                const float *xt = xp + m0 * K;
                switch (b1 - m0 < PANEL_MB ? b1 - m0 : PANEL_MB) {
#define TILE(mr) case mr: panel_tile(xt, K, wt, m0, mr, n, np, out, N); break;
                TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
                TILE(9) TILE(10) TILE(11) TILE(12) TILE(13) TILE(14) TILE(15) TILE(16)
#undef TILE
                }
            }
        }
    }
}

/* ---- the AVX2 panel body (CPUs without AVX-512; panel_min_rows_avx2() or more rows)
 *
 * The panel scheme above at 8 lanes: 16 weight rows dequantized (dequant_block_avx2's
 * values) into wt[k][16] (dequant_panel_avx2); then per k two weight vectors and, for
 * each of up to PANEL2_MB activation rows, one broadcast x[m][k] and two FMAs. 6 rows x
 * 16 outputs are 12 accumulators, with the 2 weight vectors and the broadcast 15 of the
 * 16 ymm registers, so the loop is FMA-bound (two broadcast loads per 4 FMAs). The
 * dequantization is paid once per panel per block of activation rows. Each output is
 * one float32 chain over k in order, whatever tile its row falls in. */
#define PANEL2_MB 6

/* The codes of 8 weight rows, transposed: t[p] = byte 2p of rows 0..7, then byte 2p + 1
 * of rows 0..7, from v[i] = bytes 0..15 of row i (3 rounds of 8 unpacks). */
AVX2 static inline void transpose8x16_epi8(const __m128i v[8], __m128i t[8])
{
    __m128i a[8], b[8];
    for (int i = 0; i < 4; i++) { /* a[2i]: bytes 0..7 of rows 2i, 2i+1 interleaved */
        a[2 * i] = _mm_unpacklo_epi8(v[2 * i], v[2 * i + 1]);
        a[2 * i + 1] = _mm_unpackhi_epi8(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) /* b: 4 bytes x 4 rows (rows 4i..4i+3) */
        for (int h = 0; h < 2; h++) {
            b[4 * i + 2 * h] = _mm_unpacklo_epi16(a[4 * i + h], a[4 * i + 2 + h]);
            b[4 * i + 2 * h + 1] = _mm_unpackhi_epi16(a[4 * i + h], a[4 * i + 2 + h]);
        }
    /* b[q] (q < 4): bytes 4q..4q+3 of rows 0..3; b[4 + q]: of rows 4..7 */
    for (int q = 0; q < 4; q++) {
        t[2 * q] = _mm_unpacklo_epi32(b[q], b[4 + q]);
        t[2 * q + 1] = _mm_unpackhi_epi32(b[q], b[4 + q]);
    }
}

/* A 16-row panel's code rows (rows past np: row n0's) and, per block b and row r, its
 * scale d in dT[b][16] and Q4_1's offset m in mT[b][16] (0 past np). */
AVX2 static inline void panel_rows_scales_avx2(int fmt, const uint8_t *qs, const uint16_t *sc,
                                               int64_t K, int64_t n0, int64_t np,
                                               const uint8_t *rows[16], float *dT, float *mT)
{
    const int64_t nb = K / QK, qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
    const int64_t ds = fmt == FMT_Q4_1 ? 2 : 1; /* scf stride: (d, m) pairs for Q4_1 */
    float scf[srow];
    for (int r = 0; r < 16; r++) {
        rows[r] = qs + (n0 + (r < np ? r : 0)) * qrow;
        if (r < np)
            row_scales_avx2(sc + (n0 + r) * srow, srow, scf);
        for (int64_t b = 0; b < nb; b++) {
            dT[b * 16 + r] = r < np ? scf[ds * b] : 0.f;
            if (fmt == FMT_Q4_1)
                mT[b * 16 + r] = r < np ? scf[2 * b + 1] : 0.f;
        }
    }
}

/* wt[k * 16 + r] = weight (n0 + r, k) for r < np (<= 16); the rows past np hold zeros
 * (their scales are 0). Each weight is dequant_block_avx2's value (the same operation
 * on the same code and scales), but the codes are transposed first, as bytes (8 rows x
 * 16 bytes in 24 unpacks), so that 8 rows at one k take one zero-extension, a mask or
 * a shift, a conversion and an FMA with the rows' scales, and one store. Transposing
 * the dequantized floats instead (8x8 per 64 weights, through a row buffer) took 8 ymm
 * stores and ~18 shuffles per 32 weights against one store port and two shuffle pipes
 * on Zen 3: 0.87 of its time here, 0.91 of a 16-row decode step's matmuls (session 48,
 * paired rounds). The bytes stay in registers: read back from a buffer as 8-byte
 * halves of 16-byte stores (a failed store-to-load forwarding each) they were slower
 * than the floats. Prefetches the next panel's codes and scales. */
AVX2 static void dequant_panel_avx2(int fmt, const uint8_t *qs, const uint16_t *sc, int64_t K,
                                    int64_t n0, int64_t np, float *wt)
{
    const int64_t nb = K / QK, qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
    const int q41 = fmt == FMT_Q4_1;
    /* [b][r]: block b's scale d (and Q4_1's offset m) of row r */
    float dT[nb * 16], mT[q41 ? nb * 16 : 1];
    const uint8_t *rows[16];
    panel_rows_scales_avx2(fmt, qs, sc, K, n0, np, rows, dT, mT);
    const __m256i mask = _mm256_set1_epi32(0x0f);
    const __m256 eight = _mm256_set1_ps(8.f);
    /* the next panel's scales now, its codes a few lines per block */
    const char *next = (const char *)(qs + (n0 + 16) * qrow);
    const int64_t lines = 16 * qrow / 64;
    for (int64_t i = 0; i < 16 * srow * 2; i += 64)
        _mm_prefetch((const char *)(sc + (n0 + 16) * srow) + i, _MM_HINT_T0);
    for (int64_t b = 0; b < nb; b++) {
        float *dst = wt + b * QK * 16;
        for (int64_t l = b * lines / nb; l < (b + 1) * lines / nb; l++)
            _mm_prefetch(next + 64 * l, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 */
            const __m256 d = _mm256_loadu_ps(dT + b * 16 + 8 * h);
            if (fmt == FMT_Q8_0) {
                for (int half = 0; half < 2; half++) { /* bytes (weights) 16 half + 0..15 */
                    __m128i v[8], t[8];
                    for (int i = 0; i < 8; i++)
                        v[i] = _mm_loadu_si128(
                            (const __m128i *)(rows[8 * h + i] + b * QK + 16 * half));
                    transpose8x16_epi8(v, t);
                    float *dh = dst + 16 * half * 16 + 8 * h;
                    for (int j = 0; j < 16; j++) {
                        const __m128i tj = j % 2 ? _mm_srli_si128(t[j / 2], 8) : t[j / 2];
                        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(tj));
                        _mm256_storeu_ps(dh + j * 16, _mm256_mul_ps(d, q));
                    }
                }
                continue;
            }
            __m128i v[8], t[8];
            for (int i = 0; i < 8; i++)
                v[i] = _mm_loadu_si128((const __m128i *)(rows[8 * h + i] + b * (QK / 2)));
            transpose8x16_epi8(v, t);
            const __m256 m = q41 ? _mm256_loadu_ps(mT + b * 16 + 8 * h) : _mm256_setzero_ps();
            for (int j = 0; j < 16; j++) { /* byte j: weight j (low nibble), j + 16 (high) */
                const __m128i tj = j % 2 ? _mm_srli_si128(t[j / 2], 8) : t[j / 2];
                const __m256i c = _mm256_cvtepu8_epi32(tj);
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(c, mask));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
                __m256 wl, wh;
                if (q41) {
                    wl = _mm256_fmadd_ps(d, lo, m);
                    wh = _mm256_fmadd_ps(d, hi, m);
                } else {
                    wl = _mm256_mul_ps(d, _mm256_sub_ps(lo, eight));
                    wh = _mm256_mul_ps(d, _mm256_sub_ps(hi, eight));
                }
                _mm256_storeu_ps(dst + j * 16 + 8 * h, wl);
                _mm256_storeu_ps(dst + (j + 16) * 16 + 8 * h, wh);
            }
        }
    }
}

/* out[m0 + r][n0 .. n0 + np) = (lo[r], hi[r]) for r < TR: a tile's 16 outputs per row,
 * the last np < 16 under a mask. */
AVX2 static inline __attribute__((always_inline)) void
store_tile16_avx2(float *out, int64_t N, int64_t m0, const int TR, int64_t n0, int64_t np,
                  const __m256 *lo, const __m256 *hi)
{
    if (np == 16) {
        for (int r = 0; r < TR; r++) {
            _mm256_storeu_ps(out + (m0 + r) * N + n0, lo[r]);
            _mm256_storeu_ps(out + (m0 + r) * N + n0 + 8, hi[r]);
        }
        return;
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mlo = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)np), lane);
    const __m256i mhi = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)np - 8), lane);
    for (int r = 0; r < TR; r++) {
        _mm256_maskstore_ps(out + (m0 + r) * N + n0, mlo, lo[r]);
        _mm256_maskstore_ps(out + (m0 + r) * N + n0 + 8, mhi, hi[r]);
    }
}

/* out[m0 + r][n0 .. n0 + np) for r < TR (a constant after inlining, <= PANEL2_MB):
 * xt = the activation tile packed [K][PANEL2_MB]. */
AVX2 static inline __attribute__((always_inline)) void
panel_tile_avx2(const float *xt, int64_t K, const float *wt, int64_t m0, const int TR,
                int64_t n0, int64_t np, float *out, int64_t N)
{
    __m256 lo[PANEL2_MB], hi[PANEL2_MB];
    for (int r = 0; r < TR; r++)
        lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = _mm256_loadu_ps(wt + k * 16), w1 = _mm256_loadu_ps(wt + k * 16 + 8);
        for (int r = 0; r < TR; r++) {
            const __m256 xb = _mm256_broadcast_ss(xt + k * PANEL2_MB + r);
            lo[r] = _mm256_fmadd_ps(xb, w0, lo[r]);
            hi[r] = _mm256_fmadd_ps(xb, w1, hi[r]);
        }
    }
    store_tile16_avx2(out, N, m0, TR, n0, np, lo, hi);
}

/* xp[t][k][r] = x[(PANEL2_MB t + r) K + k] (0 past row M): floats
 * ceil(M / PANEL2_MB) * PANEL2_MB * K. */
static void pack_activations_avx2(const float *x, int64_t M, int64_t K, float *xp)
{
    for (int64_t t = 0; t * PANEL2_MB < M; t++) {
        float *dst = xp + t * PANEL2_MB * K;
        for (int64_t r = 0; r < PANEL2_MB; r++) {
            const int64_t m = t * PANEL2_MB + r;
            if (m < M) {
                const float *src = x + m * K;
                for (int64_t k = 0; k < K; k++)
                    dst[k * PANEL2_MB + r] = src[k];
            } else {
                for (int64_t k = 0; k < K; k++)
                    dst[k * PANEL2_MB + r] = 0.f;
            }
        }
    }
}

/* Weight rows n0..n1 against all M activation rows (packed by pack_activations_avx2
 * into xp) through 16-row weight panels (wt: 16 x K floats of scratch), the activation
 * rows in blocks of panel_block_rows(). */
AVX2 static void linear_panels_avx2(int fmt, const float *xp, int64_t M, int64_t K,
                                    const uint8_t *qs, const uint16_t *sc, int64_t n0,
                                    int64_t n1, float *out, int64_t N, float *wt)
{
    const int64_t mb = panel_block_rows_of(PANEL2_MB); /* xp is tile by tile */
    for (int64_t b0 = 0; b0 < M; b0 += mb) {
        const int64_t b1 = M - b0 < mb ? M : b0 + mb;
        for (int64_t n = n0; n < n1; n += 16) {
            const int64_t np = n1 - n < 16 ? n1 - n : 16;
            dequant_panel_avx2(fmt, qs, sc, K, n, np, wt);
            for (int64_t m0 = b0; m0 < b1; m0 += PANEL2_MB) {
                const float *xt = xp + m0 * K;
                switch (b1 - m0 < PANEL2_MB ? b1 - m0 : PANEL2_MB) {
#define TILE(mr) case mr: panel_tile_avx2(xt, K, wt, m0, mr, n, np, out, N); break;
                TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#undef TILE
                }
            }
        }
    }
}

/* ---- the AVX2 int16 panel body (CPUs without AVX-512; panel_min_rows_avx2() or more
 * rows, unless the caller asks for float32 activations)
 *
 * The panel scheme of linear_panels_avx2 with integer products. Each 32-value block b of
 * an activation row is rounded to int16 A = round(x / s_b), s_b = max|x_b| / I16_TOP, so
 * |x - s_b A| <= s_b / 2 (1.5e-5 of the block's largest value); the weights keep their
 * integer codes q (Q4_1: 0..15, Q4_0: q - 8, Q8_0: the int8). vpmaddwd multiplies 16
 * int16 pairs and adds each pair into an int32 lane, so with a weight vector holding, for
 * 8 weight rows, the codes at k and k + 1 side by side, and x's pair (A_k, A_k+1)
 * broadcast, one instruction does 16 multiply-adds into 8 outputs, where an FMA does 8.
 * Zen 3 issues two vpmaddwd and two vpaddd per cycle beside each other (measured: 108
 * G multiply-adds/s per core against 51 for FMAs), so the products cost half the time.
 * Per block the int32 sums I (exact: |I| <= 32 * 32767 * 128 < 2^31) are folded into
 * float32 accumulators:
 *     sum_b w x = d s_b I + m sum x_b   (Q4_1; Q4_0 and Q8_0: d s_b I)
 * with sum x_b the float32 sum of the block. Accuracy: the default model's greedy run
 * (16 prompts x 24 tokens) chose transformers' tokens at every step, logprobs within
 * 1.7e-3 (float32 activations: 2.6e-5). Layouts:
 *   activations, per tile t of I16_MB rows, block b, pair p, row r:
 *       a[((t nb + b) 16 + p) I16_MB + r] = A_2p | A_2p+1 << 16 (int32)
 *       s, xs[(t nb + b) I16_MB + r]
 *   weight panel (16 rows), per block b, pair p, half h (rows 8h..8h+7):
 *       wq[((b 16 + p) 2 + h) 16 + 2 i + j] = code (row 8h + i, k = 32 b + 2p + j)
 * A NaN in a block makes s_b NaN (its outputs NaN, as the float32 body's are). */
#define I16_MB 4 /* activation rows per tile: 8 int32 accumulators in registers */

typedef struct {
    int64_t nb, tiles;
    int32_t *a; /* [tiles][nb][16][I16_MB] */
    float *s;   /* [tiles][nb][I16_MB] */
    float *xs;  /* [tiles][nb][I16_MB] */
} i16_act;

/* Round x[M, K] into `a` (its buffers sized for ceil(M / I16_MB) tiles; rows past M
 * zero). */
AVX2 static void pack_activations_i16(const float *x, int64_t M, int64_t K, i16_act *a)
{
    const int64_t nb = K / QK;
    for (int64_t m = 0; m < a->tiles * I16_MB; m++) {
        const int64_t t = m / I16_MB, r = m % I16_MB;
        for (int64_t b = 0; b < nb; b++) {
            int32_t *dst = a->a + (t * nb + b) * 16 * I16_MB + r;
            float *s = a->s + (t * nb + b) * I16_MB + r;
            float *xs = a->xs + (t * nb + b) * I16_MB + r;
            if (m >= M) {
                for (int p = 0; p < 16; p++)
                    dst[p * I16_MB] = 0;
                *s = *xs = 0.f;
                continue;
            }
            int32_t A[32];
            round_block_i16(x + m * K + b * QK, A, s, xs);
            for (int p = 0; p < 16; p++)
                dst[p * I16_MB] = (int32_t)(((uint32_t)A[2 * p] & 0xffffu)
                                            | ((uint32_t)A[2 * p + 1] << 16));
        }
    }
}

/* The codes of weight rows n0..n0 + np (<= 16) into the panel wq (layout above; rows
 * past np zero), their scales d into dT[b][16] and Q4_1's offsets m into mT[b][16]. */
AVX2 static void dequant_panel_i16(int fmt, const uint8_t *qs, const uint16_t *sc, int64_t K,
                                   int64_t n0, int64_t np, int16_t *wq, float *dT, float *mT)
{
    const int64_t nb = K / QK, qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
    const int q41 = fmt == FMT_Q4_1;
    const uint8_t *rows[16];
    panel_rows_scales_avx2(fmt, qs, sc, K, n0, np, rows, dT, mT);
    const __m256i mask = _mm256_set1_epi16(0x0f), eight = _mm256_set1_epi16(8);
    const char *next = (const char *)(qs + (n0 + 16) * qrow);
    const int64_t lines = 16 * qrow / 64;
    for (int64_t i = 0; i < 16 * srow * 2; i += 64)
        _mm_prefetch((const char *)(sc + (n0 + 16) * srow) + i, _MM_HINT_T0);
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t l = b * lines / nb; l < (b + 1) * lines / nb; l++)
            _mm_prefetch(next + 64 * l, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 */
            /* rows past np: their codes are row n0's, masked to 0 */
            const __m256i live = _mm256_cmpgt_epi32(
                _mm256_set1_epi32((int)(np - 8 * h)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            int16_t *dst = wq + b * 16 * 32 + 16 * h;
            if (fmt == FMT_Q8_0) {
                for (int half = 0; half < 2; half++) { /* weights 16 half + 0..15 */
                    __m128i v[8], t[8];
                    for (int i = 0; i < 8; i++)
                        v[i] = _mm_loadu_si128(
                            (const __m128i *)(rows[8 * h + i] + b * QK + 16 * half));
                    transpose8x16_epi8(v, t);
                    for (int j = 0; j < 8; j++) { /* pair 8 half + j: bytes 2j, 2j + 1 */
                        const __m128i pr = _mm_unpacklo_epi8(t[j], _mm_srli_si128(t[j], 8));
                        const __m256i c = _mm256_and_si256(_mm256_cvtepi8_epi16(pr), live);
                        _mm256_storeu_si256((__m256i *)(dst + (8 * half + j) * 32), c);
                    }
                }
                continue;
            }
            __m128i v[8], t[8];
            for (int i = 0; i < 8; i++)
                v[i] = _mm_loadu_si128((const __m128i *)(rows[8 * h + i] + b * (QK / 2)));
            transpose8x16_epi8(v, t);
            for (int j = 0; j < 8; j++) { /* bytes 2j, 2j + 1: pairs j (low), j + 8 (high) */
                const __m256i c = _mm256_cvtepu8_epi16(
                    _mm_unpacklo_epi8(t[j], _mm_srli_si128(t[j], 8)));
                __m256i lo = _mm256_and_si256(c, mask), hi = _mm256_srli_epi16(c, 4);
                if (!q41) {
                    lo = _mm256_sub_epi16(lo, eight);
                    hi = _mm256_sub_epi16(hi, eight);
                }
                _mm256_storeu_si256((__m256i *)(dst + j * 32), _mm256_and_si256(lo, live));
                _mm256_storeu_si256((__m256i *)(dst + (j + 8) * 32), _mm256_and_si256(hi, live));
            }
        }
    }
}

/* out[m0 + r][n0 .. n0 + np) for r < TR (a constant after inlining, <= I16_MB), the
 * activation tile t of `a`. */
AVX2 static inline __attribute__((always_inline)) void
panel_tile_i16(const i16_act *a, int64_t t, const int16_t *wq, const float *dT,
               const float *mT, int q41, int64_t m0, const int TR, int64_t n0, int64_t np,
               float *out, int64_t N)
{
    const int64_t nb = a->nb;
    __m256 lo[I16_MB], hi[I16_MB];
    for (int r = 0; r < TR; r++)
        lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int32_t *ab = a->a + (t * nb + b) * 16 * I16_MB;
        const int16_t *wb = wq + b * 16 * 32;
        __m256i il[I16_MB], ih[I16_MB];
        for (int r = 0; r < TR; r++)
            il[r] = ih[r] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + p * 32));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + p * 32 + 16));
            for (int r = 0; r < TR; r++) {
                /* vbroadcastss: a load alone on Zen 3 (vpbroadcastd: ~2% slower) */
                const __m256i xa = _mm256_castps_si256(
                    _mm256_broadcast_ss((const float *)(ab + p * I16_MB + r)));
                /* in asm: GCC otherwise adds into a new register and copies it back
                 * (8 moves per pair of 8 products, past Zen 3's 6 per cycle) */
                __m256i t0, t1;
                __asm__("vpmaddwd %[w0], %[xa], %[t0]\n\t"
                        "vpmaddwd %[w1], %[xa], %[t1]\n\t"
                        "vpaddd %[t0], %[lo], %[lo]\n\t"
                        "vpaddd %[t1], %[hi], %[hi]"
                        : [lo] "+x"(il[r]), [hi] "+x"(ih[r]), [t0] "=&x"(t0), [t1] "=&x"(t1)
                        : [xa] "x"(xa), [w0] "x"(w0), [w1] "x"(w1));
            }
        }
        const float *sb = a->s + (t * nb + b) * I16_MB, *xs = a->xs + (t * nb + b) * I16_MB;
        const __m256 d0 = _mm256_loadu_ps(dT + b * 16), d1 = _mm256_loadu_ps(dT + b * 16 + 8);
        for (int r = 0; r < TR; r++) {
            const __m256 s = _mm256_set1_ps(sb[r]);
            __m256 l = lo[r], h = hi[r];
            if (q41) { /* m sum x_b first: one pass over the accumulators */
                const __m256 xv = _mm256_set1_ps(xs[r]);
                l = _mm256_fmadd_ps(_mm256_loadu_ps(mT + b * 16), xv, l);
                h = _mm256_fmadd_ps(_mm256_loadu_ps(mT + b * 16 + 8), xv, h);
            }
            lo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(il[r]), _mm256_mul_ps(d0, s), l);
            hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih[r]), _mm256_mul_ps(d1, s), h);
        }
    }
    store_tile16_avx2(out, N, m0, TR, n0, np, lo, hi);
}

/* Floats of panel scratch linear_panels_i16 needs for K: the codes, then dT and mT. */
static inline int64_t i16_panel_floats(int64_t K) { return 16 * K / 2 + 2 * (K / QK) * 16; }

/* Weight rows n0..n1 against all M activation rows (rounded into `a`) through 16-row
 * integer panels (scratch: i16_panel_floats(K) floats), the rows in blocks of
 * panel_block_rows(). */
AVX2 static void linear_panels_i16(int fmt, const i16_act *a, int64_t M, int64_t K,
                                   const uint8_t *qs, const uint16_t *sc, int64_t n0,
                                   int64_t n1, float *out, int64_t N, float *scratch)
{
    const int64_t nb = K / QK;
    int16_t *wq = (int16_t *)scratch;
    float *dT = scratch + 16 * K / 2, *mT = dT + nb * 16;
    const int q41 = fmt == FMT_Q4_1;
    const int64_t mb = panel_block_rows_of(I16_MB);
    for (int64_t b0 = 0; b0 < M; b0 += mb) {
        const int64_t b1 = M - b0 < mb ? M : b0 + mb;
        for (int64_t n = n0; n < n1; n += 16) {
            const int64_t np = n1 - n < 16 ? n1 - n : 16;
            dequant_panel_i16(fmt, qs, sc, K, n, np, wq, dT, mT);
            for (int64_t m0 = b0; m0 < b1; m0 += I16_MB) {
                const int64_t t = m0 / I16_MB;
                switch (b1 - m0 < I16_MB ? b1 - m0 : I16_MB) {
#define TILE(mr) case mr: panel_tile_i16(a, t, wq, dT, mT, q41, m0, mr, n, np, out, N); break;
                TILE(1) TILE(2) TILE(3) TILE(4)
#undef TILE
                }
            }
        }
    }
}

/* 16 bf16 values widened to float32 (exact). */
AVX512 static inline __m512 bf16_load16_avx512(const uint16_t *p)
{
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 float32 values rounded to bf16 as f32_to_bf16 rounds them (nearest even, NaN kept
 * a quiet NaN), with AVX-512F integer ops: no AVX512-BF16 needed. */
AVX512 static inline __m256i bf16_round_avx512(__m512 v)
{
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                      _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* Rows n0..n1 dequantized and rounded to bf16 into out [N, K] (one pass: no float32
 * matrix in between). */
AVX512 static void dequant_rows_bf16_avx512(int fmt, const uint8_t *qs, const uint16_t *sc,
                                            int64_t K, int64_t n0, int64_t n1, uint16_t *out)
{
    const int64_t nb = K / QK, qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
    float scf[srow];
    for (int64_t n = n0; n < n1; n++) {
        row_scales_avx512(sc + n * srow, srow, scf);
        for (int64_t b = 0; b < nb; b++) {
            __m512 lo, hi;
            dequant_block_avx512(fmt, qs + n * qrow, scf, b, &lo, &hi);
            _mm256_storeu_si256((__m256i *)(out + n * K + b * QK), bf16_round_avx512(lo));
            _mm256_storeu_si256((__m256i *)(out + n * K + b * QK + 16), bf16_round_avx512(hi));
        }
    }
}

AVX512 static void dequant_rows_avx512(int fmt, const uint8_t *qs, const uint16_t *sc,
                                       int64_t K, int64_t n0, int64_t n1, float *out)
{
    const int64_t nb = K / QK, qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
    float scf[srow];
    for (int64_t n = n0; n < n1; n++)
        for (int64_t b = 0; b < nb; b++) {
            __m512 lo, hi;
            if (b == 0)
                row_scales_avx512(sc + n * srow, srow, scf);
            dequant_block_avx512(fmt, qs + n * qrow, scf, b, &lo, &hi);
            _mm512_storeu_ps(out + n * K + b * QK, lo);
            _mm512_storeu_ps(out + n * K + b * QK + 16, hi);
        }
}
#endif


/* ------------------------------------------------------------------ AMX-BF16 body
 *
 * With `--dtype bfloat16` (the caller passes amx_min > 0) and a CPU with AMX-BF16, a
 * matmul of amx_min or more activation rows runs on the tile unit: 32 weight rows at a
 * time are dequantized (the same float32 values as dequant_block_avx512) and rounded to
 * bf16 into a panel wa[32][K], and for each tile of 16 activation rows (rounded to bf16
 * and packed once per call in the pair layout TDPBF16PS reads)
 *     C[r][m] += sum_k wa[r][k] x[m][k]     (tiles of 32 k, float32 accumulation)
 * with the weights as the A operand (a plain row-major panel, no transpose) and the
 * activations as B. Two panels of 16 weight rows times two tiles of 16 activation
 * rows are four independent accumulator chains: each tile loaded is used twice. So the
 * weights stay quantized in memory and the products are a bf16 model's (bf16 operands,
 * float32 sums), as the bf16 GEMM of larger matmuls (quant_linear.py). Intel 64 and
 * IA-32 Architectures Optimization Reference Manual, ch. 20 (AMX): tile configuration,
 * TDPBF16PS and its operand layouts; Linux needs the process to ask for the tile state
 * (arch_prctl ARCH_REQ_XCOMP_PERM). */
#if HAVE_X86 && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define HAVE_AMX 1
#include <cpuid.h>
static int use_avx512(void);
#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c,avx512bf16,amx-tile,amx-bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles 0..ntiles - 1 configured as 16 rows of 64 bytes, the shape every tile of both
 * AMX bodies has. AMX-BF16 (8 tiles): 0, 3, 5 and 6 the accumulators (16 weight rows x
 * 16 activation rows, float32), 1 and 4 the two weight panels' 16 x 32 bf16, 2 and 7
 * two tiles of 16 pairs x 16 activation rows of bf16. AMX-INT8 (8 tiles): 0-3 C (16
 * weight rows x 16 int32), 4 and 5 A (16 x 64 bytes), 6 and 7 B (16 x 64 bytes). */
__attribute__((target("amx-tile"))) static void amx_tiles_on(int ntiles)
{
    amx_config c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < ntiles; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* xb[t][c][j][m][2] = bf16(x[16 t + m][32 c + 2 j + (0, 1)]), 0 past row M, for the
 * tiles t0 <= t < t1: the activations as B tiles (per tile of 16 rows, per 32 columns,
 * 1 KB each). */
AMX static void pack_activations_amx(const float *x, int64_t M, int64_t K, uint16_t *xb,
                                     int64_t t0, int64_t t1)
{
    const int64_t nc = K / QK;
    float tmp[16 * 16];
    for (int64_t t = t0; t < t1 && t * 16 < M; t++) {
        const int64_t rows = M - t * 16 < 16 ? M - t * 16 : 16;
        if (rows < 16)
            memset(tmp + rows * 16, 0, (size_t)(16 - rows) * 16 * sizeof(float));
        for (int64_t c = 0; c < nc; c++) {
            for (int64_t m = 0; m < rows; m++) { /* row m's 32 values as 16 bf16 pairs */
                const float *src = x + (t * 16 + m) * K + c * QK;
                __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
                _mm512_storeu_si512((void *)(tmp + m * 16), (__m512i)v);
            }
            /* pairs as rows: one 16 x 16 transpose of 32-bit values */
            transpose16_ps(tmp, 16, (float *)(xb + (t * nc + c) * 512));
        }
    }
}

/* wa[r][k] = bf16(weight (n0 + r, k)) for r < np (<= 32), 0 for the rows past np.
 * A 4-bit block has 16 possible weights: they are computed and rounded once per block
 * (the same float32 operations as dequant_block_avx512, so the same bits) and each code
 * picks its bf16 from them (VPERMW), instead of converting and scaling all 32 codes. */
AMX static void dequant_panel_bf16(int fmt, const uint8_t *qs, const uint16_t *sc, int64_t K,
                                   int64_t n0, int64_t np, uint16_t *wa)
{
    const int64_t nb = K / QK, qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
    float scf[srow];
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 eight = _mm512_set1_ps(8.f);
    const __m512i nib = _mm512_set1_epi16(0x0f);
    for (int64_t r = 0; r < np; r++) {
        row_scales_avx512(sc + (n0 + r) * srow, srow, scf);
        const uint8_t *rq = qs + (n0 + r) * qrow;
        if (fmt == FMT_Q8_0) {
            for (int64_t b = 0; b < nb; b++) {
                __m512 lo, hi;
                dequant_block_avx512(fmt, rq, scf, b, &lo, &hi);
                _mm512_storeu_si512((void *)(wa + r * K + b * QK),
                                    (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            const __m512 w16 = fmt == FMT_Q4_1
                ? _mm512_fmadd_ps(_mm512_set1_ps(scf[2 * b]), codes, _mm512_set1_ps(scf[2 * b + 1]))
                : _mm512_mul_ps(_mm512_set1_ps(scf[b]), _mm512_sub_ps(codes, eight));
            const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(w16));
            /* lanes 0..15: byte j's low nibble (weight j), 16..31: its high one (j + 16) */
            const __m512i q = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(
                _mm_loadu_si128((const __m128i *)(rq + b * (QK / 2)))));
            const __m512i idx = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xffff0000u, q, 4), nib);
            _mm512_storeu_si512((void *)(wa + r * K + b * QK),
                                _mm512_permutexvar_epi16(idx, table));
        }
    }
    if (np < 32)
        memset(wa + np * K, 0, (size_t)(32 - np) * K * sizeof(uint16_t));
}

/* out[m][n] for m < 16 live rows of tile ct (ct[r][m]: weight row n0 + r), np columns. */
AMX static inline void amx_store(const float *ct, int64_t mr, int64_t n0, int64_t np,
                                 float *out, int64_t N)
{
    float tt[16 * 16];
    transpose16_ps(ct, 16, tt);
    const __mmask16 live = (__mmask16)((1u << np) - 1);
    for (int64_t m = 0; m < mr; m++)
        _mm512_mask_storeu_ps(out + m * N + n0, live, _mm512_loadu_ps(tt + m * 16));
}

/* Weight rows n0..n1 against all M activation rows (xb: pack_activations_amx's),
 * wa: 32 x K bf16 of scratch. The activation rows go in blocks of AMX_BLOCK_TILES
 * tiles of 16, each block's packed rows (256 x K bf16: 288 KB at K = 576) staying in
 * L2 while every panel of the thread's weight rows passes over it (a panel is
 * dequantized once per block): without blocks a 2,048-row matmul streamed all its
 * packed activations from L3 once per 32 weight rows. */
#define AMX_BLOCK_TILES 16
AMX static void linear_amx(int fmt, const uint16_t *xb, int64_t M, int64_t K,
                           const uint8_t *qs, const uint16_t *sc, int64_t n0, int64_t n1,
                           float *out, int64_t N, uint16_t *wa)
{
    const int64_t nc = K / QK, stride = K * (int64_t)sizeof(uint16_t);
    float c0[256] __attribute__((aligned(64))), c1[256] __attribute__((aligned(64)));
    amx_tiles_on(8);
    for (int64_t t0 = 0; t0 * 16 < M; t0 += AMX_BLOCK_TILES)
    for (int64_t n = n0; n < n1; n += 32) {
        const int64_t np = n1 - n < 32 ? n1 - n : 32;
        dequant_panel_bf16(fmt, qs, sc, K, n, np, wa);
        for (int64_t t = t0; t * 16 < M && t < t0 + AMX_BLOCK_TILES; t += 2) {
            const uint16_t *xt = xb + t * nc * 512, *xu = xt + nc * 512;
            /* two activation tiles when there are (AMX_BLOCK_TILES is even) */
            const int two = (t + 1) * 16 < M;
            _tile_zero(0);
            _tile_zero(3);
            if (two) {
                _tile_zero(5);
                _tile_zero(6);
                for (int64_t c = 0; c < nc; c++) {
                    _tile_loadd(1, wa + c * QK, stride);
                    _tile_loadd(4, wa + 16 * K + c * QK, stride);
                    _tile_loadd(2, xt + c * 512, 64);
                    _tile_loadd(7, xu + c * 512, 64);
                    _tile_dpbf16ps(0, 1, 2);
                    _tile_dpbf16ps(3, 4, 2);
                    _tile_dpbf16ps(5, 1, 7);
                    _tile_dpbf16ps(6, 4, 7);
                }
            } else {
                for (int64_t c = 0; c < nc; c++) {
                    _tile_loadd(2, xt + c * 512, 64);
                    _tile_loadd(1, wa + c * QK, stride);
                    _tile_loadd(4, wa + 16 * K + c * QK, stride);
                    _tile_dpbf16ps(0, 1, 2);
                    _tile_dpbf16ps(3, 4, 2);
                }
            }
            for (int u = 0; u <= two; u++) {
                if (u == 0) {
                    _tile_stored(0, c0, 64);
                    _tile_stored(3, c1, 64);
                } else {
                    _tile_stored(5, c0, 64);
                    _tile_stored(6, c1, 64);
                }
                const int64_t tu = t + u, mr = M - tu * 16 < 16 ? M - tu * 16 : 16;
                float *ot = out + tu * 16 * N;
                amx_store(c0, mr, n, np < 16 ? np : 16, ot, N);
                if (np > 16)
                    amx_store(c1, mr, n + 16, np - 16, ot, N);
            }
        }
    }
    _tile_release();
}

/* Whether the AMX body runs here: AMX-TILE, AMX-BF16 and AVX512-BF16 in cpuid, the
 * AVX-512 bodies on, the kernel granted this process the tile state, and
 * FLOWENGINE_CPU_NO_AMX unset. */
static int use_amx(void)
{
    static int cached = -1;
    if (cached < 0) {
        unsigned a, b, c, d, a1, b1, c1, d1;
        cached = 0;
        if (use_avx512() && !getenv("FLOWENGINE_CPU_NO_AMX")
            && __get_cpuid_count(7, 0, &a, &b, &c, &d) && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)
            && (d >> 22 & 1) && (d >> 24 & 1) && (a1 >> 5 & 1))
            cached = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return cached;
}

/* ------------------------------------------------------------------ AMX-INT8 body
 *
 * With `--dtype bfloat16` and a CPU with AMX-INT8, a matmul of amx_min to
 * AMXI8_MAX_ROWS activation rows (batched decode) multiplies integers on the tile
 * unit. Each 32-value block b of activation row m is rounded to a 16-bit integer
 * A = rint(x TOP / max|x|), s = max|x| / TOP (TOP = 127 * 256: error <= 1/65024 of the
 * block's largest value, where bf16 rounds each value to 2^-9 of itself; one int8
 * level, llama.cpp's Q8_0 activations, measured 0.196 of worst greedy logprob
 * difference on the default model against 0.048 for bf16 products), split into signed
 * bytes A = 256 h + l. The weights' 4-bit codes q (0..15, unpacked into a 16-row panel
 * of bytes) or Q8_0's int8 codes (read in place for a full 16-row panel with an even
 * number of blocks, else copied into the panel) are the A operand of TDPBUSD /
 * TDPBSSD, the bytes h and l the B operand, and per block
 *     C[r][m] = sum_k q[r][k] A[m][k] = 256 sum q h + sum q l          (exact)
 *     out[m][r] += d[r][b] s[m][b] C[r][m] + e[r][b] s[m][b] sum_k A[m][k]
 * with e = m (Q4_1), d (Q4_0, whose activation sums carry the -8) or 0 (Q8_0): the
 * dequantized weights times the rounded activations, up to the float32 order of the
 * sums. The scales differ per weight row and block, so C must leave the tile unit once
 * per block. One product covers two blocks (K = 64) and both bytes: B's 16 columns are
 * (block of the pair p, byte, activation row m of a group of 4), each column zero
 * outside its block's 32 k, and the bytes are weighted 256 s and s as C is folded into
 * float32. The AMX-BF16 body above instead rounds every weight to bf16 and stores it,
 * which is most of its time. Intel's Optimization Reference Manual, ch. 20 (TDPBUSD /
 * TDPBSSD: B holds groups of 4 consecutive k per column). */
#define AMXI8 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,amx-tile,amx-int8")))
#define AMXI8_MAX_ROWS 8
#define I8_TOP 32512.f /* 127 * 256 */

typedef struct {
    int64_t M, nb, npair, groups; /* groups of 4 activation rows */
    int8_t *b;  /* [groups][npair][16][64]: B tiles (k / 4 rows x 16 columns x 4 bytes) */
    float *s;   /* [groups][npair][16]: lane l -> 256 s (h) or s (l) of its column */
    float *xs;  /* [groups][npair][16]: lane l -> s sum A (Q4_0: -8 s sum A); 0 for l */
} i8_act;       /* lane / column l: p = l / 8, byte (0: h, 1: l) = l / 4 % 2, m = l % 4 */

/* Round x[M, K] into a (buffers zeroed by the caller). */
AMXI8 static void pack_activations_i8(int fmt, const float *x, int64_t M, int64_t K, i8_act *a)
{
    const int64_t nb = K / QK;
    const float e = fmt == FMT_Q4_0 ? -8.f : 1.f;
    for (int64_t m = 0; m < M; m++) {
        const int64_t g = m / 4, c = m % 4;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t pair = b / 2, p = b % 2;
            const float *xb = x + m * K + b * QK;
            __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            /* A block below 2^-100 is scaled by 2^100 first (exact), or TOP / amax would
             * overflow; a NaN in the block makes s NaN (the max skips NaN lanes), so the
             * outputs are NaN as the float32 kernel's are. */
            const float pre = amax < 0x1p-100f ? 0x1p100f : 1.f;
            x0 = _mm512_mul_ps(x0, _mm512_set1_ps(pre));
            x1 = _mm512_mul_ps(x1, _mm512_set1_ps(pre));
            amax *= pre;
            float inv = amax > 0.f ? I8_TOP / amax : 0.f, s = amax / I8_TOP / pre;
            if (_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q)
                | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) {
                inv = 0.f;
                s = NAN;
            }
            __m512i A0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
            __m512i A1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
            int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(A0, A1));
            int8_t hl[2][32]; /* h, then l (the low byte as int8; h = (A - l) / 256) */
            for (int part = 0; part < 2; part++) {
                __m512i A = part ? A1 : A0;
                __m512i l = _mm512_srai_epi32(_mm512_slli_epi32(A, 24), 24);
                __m512i h = _mm512_srai_epi32(_mm512_sub_epi32(A, l), 8);
                _mm_storeu_si128((__m128i *)(hl[0] + 16 * part), _mm512_cvtepi32_epi8(h));
                _mm_storeu_si128((__m128i *)(hl[1] + 16 * part), _mm512_cvtepi32_epi8(l));
            }
            const int64_t tile = g * a->npair + pair;
            int8_t *bt = a->b + tile * 1024;
            for (int byte = 0; byte < 2; byte++) /* rows 8 p + k4, column 8 p + 4 byte + c */
                for (int k4 = 0; k4 < 8; k4++)
                    memcpy(bt + (8 * p + k4) * 64 + (8 * p + 4 * byte + c) * 4,
                           hl[byte] + 4 * k4, 4);
            float *sl = a->s + tile * 16, *xl = a->xs + tile * 16;
            sl[8 * p + c] = 256.f * s;
            sl[8 * p + 4 + c] = s;
            xl[8 * p + c] = e * s * (float)sum;
        }
    }
}

/* panel[pair][r][64] = the 4-bit codes of weight row n0 + r, blocks 2 pair and
 * 2 pair + 1, in k order (rows past np and a missing last block zero). */
AMXI8 static void unpack_panel_q4(const uint8_t *qs, int64_t qrow, int64_t nb, int64_t n0,
                                  int64_t np, uint8_t *panel)
{
    const int64_t npair = (nb + 1) / 2;
    const __m512i nib = _mm512_set1_epi8(0x0f);
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int64_t r = 0; r < 16; r++) {
        uint8_t *dst = panel + r * 64;
        if (r >= np) {
            for (int64_t pr = 0; pr < npair; pr++)
                memset(dst + pr * 1024, 0, 64);
            continue;
        }
        const uint8_t *rq = qs + (n0 + r) * qrow;
        for (int64_t b = 0; b < nb; b += 4) { /* 64 bytes: blocks b..b + 3 */
            const int64_t have = nb - b < 4 ? nb - b : 4;
            __m512i v = _mm512_maskz_loadu_epi8(have == 4 ? ~0ULL : (1ULL << (16 * have)) - 1,
                                                rq + 16 * b);
            __m512i lo = _mm512_and_si512(v, nib);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            _mm512_storeu_si512((void *)(dst + (b / 2) * 1024),
                                _mm512_permutex2var_epi64(lo, first, hi));
            if (have > 2)
                _mm512_storeu_si512((void *)(dst + (b / 2 + 1) * 1024),
                                    _mm512_permutex2var_epi64(lo, second, hi));
        }
    }
}

/* The float scales of weight rows n0..n0 + 15 transposed: t[h][r] = half h of row r's
 * scales (Q4_1: h = 2 b is d, 2 b + 1 is m; else h = b is d), rows past np zero. */
AMXI8 static void scales_transposed(const uint16_t *sc, int64_t srow, int64_t n0, int64_t np,
                                    float *t)
{
    float tmp[256] __attribute__((aligned(64)));
    for (int64_t h0 = 0; h0 < srow; h0 += 16) {
        const int64_t w = srow - h0 < 16 ? srow - h0 : 16;
        const __mmask16 live = (__mmask16)((1u << w) - 1);
        for (int64_t r = 0; r < 16; r++) {
            __m512 v = _mm512_setzero_ps();
            if (r < np)
                v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, sc + (n0 + r) * srow + h0));
            _mm512_store_ps(tmp + 16 * r, v);
        }
        transpose16_ps(tmp, 16, t + h0 * 16);
    }
}

/* Weight rows n0..n1 through 16-row panels against every group of activation rows;
 * scratch: panel (npair x 1 KB) and t ((srow + 16) rounded to 16 x 16 floats). */
AMXI8 static void linear_amx_i8(int fmt, const i8_act *a, int64_t K, const uint8_t *qs,
                                const uint16_t *sc, int64_t n0, int64_t n1, float *out,
                                int64_t N, uint8_t *panel, float *t)
{
    const int64_t nb = K / QK, npair = a->npair, qrow = qs_row_bytes(fmt, K);
    const int64_t srow = sc_row_halves(fmt, K);
    const int has_e = fmt != FMT_Q8_0;
    /* scale rows of block b in t: d at t + dh * b * 16, e at that + eo */
    const int64_t dh = fmt == FMT_Q4_1 ? 2 : 1, eo = fmt == FMT_Q4_1 ? 16 : 0;
    int32_t cbuf[2048] __attribute__((aligned(64))); /* two sets of four C tiles */
    /* acc[r] lane l (weight row r): from (block 2 pair + l / 8)'s scales */
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i half = _mm512_slli_epi32(_mm512_srli_epi32(lane, 3), 4);
    amx_tiles_on(8);
    for (int64_t n = n0; n < n1; n += 16) {
        const int64_t np = n1 - n < 16 ? n1 - n : 16;
        scales_transposed(sc, srow, n, np, t);
        if (nb % 2) /* the missing block of the last pair: zero scales */
            memset(t + srow * 16, 0, 16 * 16 * sizeof(float));
        const uint8_t *abase = panel;
        int64_t astride = 64, pstep = 1024;
        if (fmt == FMT_Q8_0 && np == 16 && nb % 2 == 0) { /* the int8 codes in place */
            abase = qs + n * qrow;
            astride = K;
            pstep = 2 * QK;
        } else if (fmt == FMT_Q8_0) {
            for (int64_t r = 0; r < 16; r++)
                for (int64_t b = 0; b < 2 * npair; b++) {
                    uint8_t *dst = panel + (b / 2) * 1024 + r * 64 + (b % 2) * 32;
                    if (r < np && b < nb)
                        memcpy(dst, qs + (n + r) * qrow + b * QK, 32);
                    else
                        memset(dst, 0, 32);
                }
        } else {
            unpack_panel_q4(qs, qrow, nb, n, np, panel);
        }
        /* The next panel's bytes and scales are fetched into L2 while this one
         * multiplies, a few lines per pair (below): its 16 rows are 16 streams that
         * the hardware prefetcher does not keep ahead of. Measured (all matmuls of a
         * decode step, weights in L3, 4 rows, ms): none 10.6-11.0; the whole panel at
         * once, one panel ahead, into L1 9.3, into L2 8.3; spread over the pairs into L2
         * one panel ahead 8.1-8.2 (three runs), two 8.0-9.3 (four), three 9.8; into L1
         * or L3 instead of L2 within that noise. */
        const int64_t pf0 = n + 16, pf1 = n + 32 < n1 ? n + 32 : n1;
        const int64_t pair_bytes = fmt == FMT_Q8_0 ? 2 * QK : QK;
        for (int64_t r = pf0; r < pf1; r++) {
            const char *rs = (const char *)(sc + r * srow);
            for (int64_t o = 0; o < srow * 2; o += 64)
                _mm_prefetch(rs + o, _MM_HINT_T1);
        }
        for (int64_t g = 0; g < a->groups; g++) {
            const int8_t *bt = a->b + g * npair * 1024;
            const float *sg = a->s + g * npair * 16, *xg = a->xs + g * npair * 16;
            __m512 acc[16], acce[4]; /* acce[m] lane r: sum over b of e[r][b] xs[m][b] */
            for (int r = 0; r < 16; r++)
                acc[r] = _mm512_setzero_ps();
            for (int m = 0; m < 4; m++)
                acce[m] = _mm512_setzero_ps();
            /* Pairs in fours, software-pipelined: the tile unit multiplies four pairs
             * while the vector unit folds in the four before. */
            int64_t prev = -1, pcnt = 0;
            for (int64_t q0 = 0; q0 < npair + 4; q0 += 4) {
                const int64_t cnt = q0 >= npair ? 0 : npair - q0 < 4 ? npair - q0 : 4;
                int32_t *cur = cbuf + ((q0 / 4) & 1) * 1024;
#define I8_ISSUE(C, A, B, qq)                                                              \
    do {                                                                                   \
        _tile_loadd(A, abase + (qq) * pstep, astride);                                    \
        _tile_loadd(B, bt + (qq) * 1024, 64);                                             \
        _tile_zero(C);                                                                     \
        if (fmt == FMT_Q8_0)                                                               \
            _tile_dpbssd(C, A, B);                                                         \
        else                                                                               \
            _tile_dpbusd(C, A, B);                                                         \
    } while (0)
                if (cnt > 0) I8_ISSUE(0, 4, 6, q0);
                if (cnt > 1) I8_ISSUE(1, 5, 7, q0 + 1);
                if (cnt > 2) I8_ISSUE(2, 4, 6, q0 + 2);
                if (cnt > 3) I8_ISSUE(3, 5, 7, q0 + 3);
#undef I8_ISSUE
                if (cnt > 0) _tile_stored(0, cur, 64);
                if (cnt > 1) _tile_stored(1, cur + 256, 64);
                if (cnt > 2) _tile_stored(2, cur + 512, 64);
                if (cnt > 3) _tile_stored(3, cur + 768, 64);
                for (int64_t i = 0; prev >= 0 && i < pcnt; i++) {
                    const int64_t qq = prev + i;
                    if (g == 0 && (qq * pair_bytes) % 64 == 0)
                        for (int64_t r = pf0; r < pf1; r++)
                            _mm_prefetch((const char *)(qs + r * qrow + qq * pair_bytes),
                                         _MM_HINT_T1);
                    const int32_t *cb = cbuf + ((prev / 4) & 1) * 1024 + 256 * i;
                    const float *d0 = t + dh * (2 * qq) * 16, *d1 = d0 + dh * 16;
                    const __m512 D0 = _mm512_load_ps(d0), D1 = _mm512_load_ps(d1);
                    const __m512 S = _mm512_loadu_ps(sg + qq * 16);
                    for (int r = 0; r < 16; r++) {
                        const __m512i sel = _mm512_add_epi32(half, _mm512_set1_epi32(r));
                        __m512 c = _mm512_cvtepi32_ps(
                            _mm512_load_si512((const void *)(cb + 16 * r)));
                        __m512 ds = _mm512_mul_ps(S, _mm512_permutex2var_ps(D0, sel, D1));
                        acc[r] = _mm512_fmadd_ps(c, ds, acc[r]);
                    }
                    if (has_e) { /* lanes are weight rows here: 8 products per pair */
                        const __m512 E0 = _mm512_load_ps(d0 + eo), E1 = _mm512_load_ps(d1 + eo);
                        const float *x0 = xg + qq * 16;
                        for (int m = 0; m < 4; m++) {
                            acce[m] = _mm512_fmadd_ps(E0, _mm512_set1_ps(x0[m]), acce[m]);
                            acce[m] = _mm512_fmadd_ps(E1, _mm512_set1_ps(x0[8 + m]), acce[m]);
                        }
                    }
                }
                prev = cnt > 0 ? q0 : -1;
                pcnt = cnt;
            }
            float tt[256] __attribute__((aligned(64))), te[64] __attribute__((aligned(64)));
            for (int r = 0; r < 16; r++) /* tt[16 r + l] */
                _mm512_store_ps(tt + 16 * r, acc[r]);
            for (int m = 0; m < 4; m++) /* te[16 m + r] */
                _mm512_store_ps(te + 16 * m, acce[m]);
            const int64_t rows = a->M - g * 4 < 4 ? a->M - g * 4 : 4;
            float *og = out + g * 4 * N + n;
            for (int64_t m = 0; m < rows; m++)
                for (int64_t r = 0; r < np; r++) {
                    const float *v = tt + 16 * r + m;
                    og[m * N + r] = ((v[0] + v[4]) + (v[8] + v[12])) + te[16 * m + r];
                }
        }
    }
    _tile_release();
}

/* Whether the AMX-INT8 body runs here: the AMX body's conditions, AMX-INT8 and
 * AVX512-DQ in cpuid, and FLOWENGINE_CPU_NO_AMX_INT8 unset, empty or 0. */
static int use_amx_int8(void)
{
    static int cached = -1;
    if (cached < 0) {
        unsigned a, b, c, d;
        const char *off = getenv("FLOWENGINE_CPU_NO_AMX_INT8");
        cached = use_amx() && !(off != NULL && *off && strcmp(off, "0") != 0)
            && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 25 & 1) && (b >> 17 & 1);
    }
    return cached;
}
#else
#define HAVE_AMX 0
static int use_amx(void) { return 0; }
static int use_amx_int8(void) { return 0; }
#endif


/* ------------------------------------------------------------------ AVX512-VNNI bodies
 *
 * Integer dot products as llama.cpp computes them, at float32's accuracy. Each 32-value
 * block b of an activation row is quantized to integers A = round(x / s_b) with
 * s_b = max|x| / TOP, so |x - s_b A| <= s_b / 2: relative to the block's largest value
 * 1 / (2 TOP), 6e-8 for Q4 (TOP = 127 * 2^16) and 2.4e-7 for Q8_0 (TOP = 2^21), close
 * to float32's own 6e-8 (two int8 levels, TOP = 127 * 2^8, were measured at 1e-3 on
 * the greedy test's logprobs; three levels at 1.8e-5, float32's order-of-sums noise).
 * A is split into three signed bytes, A = 2^16 h + 2^8 m + l, and vpdpbusd (unsigned
 * byte x signed byte, four products summed into each int32 lane) gives
 *     I = ((dot(q, h) << 8) + dot(q, m)) << 8) + dot(q, l) = sum q A   exactly
 * (no lane overflows: |I| <= 4 * 15 * TOP for Q4, 4 * 255 * 2^21 < 2^31 for Q8_0).
 * Then per block   sum w x = d s_b I + m sum x   (Q4_1; Q4_0: d (s_b I - 8 sum x);
 * Q8_0: d s_b (I - 128 sum A), its int8 weights offset by 128 to be unsigned), where
 * the float sum of x is exact float32 and I is converted once per lane.
 *
 * Layouts, per activation row and pair p of blocks (2p, 2p + 1), 64 values:
 *   Q4: [x_2p[0..15], x_2p+1[0..15], x_2p[16..31], x_2p+1[16..31]] (the order of a
 *       pair's 32 weight bytes' low nibbles, then their high nibbles);
 *   Q8: [x_2p[0..31], x_2p+1[0..31]] (the weight bytes' order).
 * An odd last block pairs with a zero block (its weights loaded under a mask).
 *
 * Per pair and activation row: 3 vpdpbusd, 2 shifts, 1 convert, 2 FMA/mul, where the
 * float32 kernel needs 12 instructions per block to dequantize and multiply. The
 * unpacking of the weights is shared by the rows, the products are not, so the float
 * kernel's cost per extra row is lower: VNNI runs batches of up to VNNI_MAX_ROWS.
 */
#define VNNI_MAX_ROWS 3
#if HAVE_X86
#define TOP_Q4 8323072.f /* 127 * 2^16 */
#define TOP_Q8 2097000.f /* < 2^21: 4 * 255 * |A| fits an int32 lane */

typedef struct {
    int64_t npair, nxs; /* pairs per row; floats of xs per row (multiple of 16) */
    int8_t *bytes;      /* [M][npair][3][64]: h, m, l */
    float *s;           /* [M][npair][16]: the activation scale of each int32 lane */
    int32_t *corr;      /* Q8_0: [M][npair][16]: 128 * sum of A over each lane's 4 values */
    float *xs;          /* [M][nxs]: multiplied with the weight row's float scales */
} vnni_act;

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

/* Quantize activation row x[K] into row r of `a` (buffers zeroed by the caller). */
VNNI static void vnni_prepare_row(int fmt, const float *x, int64_t K, vnni_act *a, int64_t r)
{
    const int64_t nb = K / QK;
    const float top = fmt == FMT_Q8_0 ? TOP_Q8 : TOP_Q4;
    int8_t *bytes = a->bytes + r * a->npair * 192;
    float *s = a->s + r * a->npair * 16, *xs = a->xs + r * a->nxs;
        for (int64_t b = 0; b < nb; b++) {
        const int64_t p = b / 2, half = b % 2;
        __m512 x0 = _mm512_loadu_ps(x + b * QK), x1 = _mm512_loadu_ps(x + b * QK + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        float inv = amax > 0.f ? top / amax : 0.f, scale = amax / top;
        float xsum = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
        __m512 vinv = _mm512_set1_ps(inv);
        for (int part = 0; part < 2; part++) {
            __m512i A = _mm512_cvtps_epi32(_mm512_mul_ps(part ? x1 : x0, vinv));
            /* balanced bytes: l = low byte as int8, then m, then h */
            __m512i A1 = _mm512_srai_epi32(
                _mm512_sub_epi32(A, _mm512_srai_epi32(_mm512_slli_epi32(A, 24), 24)), 8);
            __m512i H = _mm512_srai_epi32(
                _mm512_sub_epi32(A1, _mm512_srai_epi32(_mm512_slli_epi32(A1, 24), 24)), 8);
            int64_t pos = fmt == FMT_Q8_0 ? half * 32 + part * 16 : part * 32 + half * 16;
            int8_t *dst = bytes + p * 192 + pos;
            _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(H));
            _mm_storeu_si128((__m128i *)(dst + 64), _mm512_cvtepi32_epi8(A1));
            _mm_storeu_si128((__m128i *)(dst + 128), _mm512_cvtepi32_epi8(A));
        }
        __mmask16 lanes = fmt == FMT_Q8_0 ? (__mmask16)(0x00ff << (8 * half))
                                          : (__mmask16)(0x0f0f << (4 * half));
        _mm512_mask_storeu_ps(s + p * 16, lanes, _mm512_set1_ps(scale));
        if (fmt == FMT_Q4_1) { /* scales interleaved (d, m): m's term */
            xs[2 * b + 1] = xsum;
        } else if (fmt == FMT_Q4_0) {
            xs[b] = -8.f * xsum;
        }
    }
    if (fmt == FMT_Q8_0) { /* corr = 128 * (2^16 sum h + 2^8 sum m + sum l) per lane */
        const __m512i ones = _mm512_set1_epi8(1);
        int32_t *corr = a->corr + r * a->npair * 16;
        for (int64_t p = 0; p < a->npair; p++) {
            const int8_t *bp = bytes + p * 192;
            __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones,
                                            _mm512_loadu_si512(bp));
            c = _mm512_dpbusd_epi32(_mm512_slli_epi32(c, 8), ones, _mm512_loadu_si512(bp + 64));
            c = _mm512_dpbusd_epi32(_mm512_slli_epi32(c, 8), ones, _mm512_loadu_si512(bp + 128));
            _mm512_storeu_si512(corr + p * 16, _mm512_slli_epi32(c, 7));
        }
    }
}

/* I = sum q A per lane for weights w (unsigned bytes) and one activation pair. */
#define VNNI_DOT(w, bp)                                                                   \
    _mm512_dpbusd_epi32(                                                                  \
        _mm512_slli_epi32(_mm512_dpbusd_epi32(                                            \
                              _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), \
                                                                    (w),                   \
                                                                    _mm512_loadu_si512(bp)), \
                                                8),                                       \
                              (w), _mm512_loadu_si512((bp) + 64)),                        \
                          8),                                                             \
        (w), _mm512_loadu_si512((bp) + 128))

/* FLOWENGINE_CPU_VNNI_ONE_ROW=1: the one-weight-row body below instead of
 * vnni_rows_nr (for comparisons). */
static int vnni_multi_rows(void)
{
    static int cached = -1;
    if (cached < 0) {
        const char *v = getenv("FLOWENGINE_CPU_VNNI_ONE_ROW");
        cached = !(v != NULL && *v && strcmp(v, "0") != 0);
    }
    return cached;
}

/* Weight rows n0..n1 against R activation rows (R a constant after inlining). */
VNNI static inline __attribute__((always_inline)) void
vnni_rows(int fmt, const vnni_act *a, int R, int64_t K, const uint8_t *qs, const uint16_t *sc,
          int64_t n0, int64_t n1, float *out, int64_t N)
{
    const int64_t nb = K / QK, qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
    const int64_t npair = a->npair, full = nb / 2;
    /* the row's float scales, zero-padded: one 16-float load per pair and for xs */
    float scf[a->nxs + 32];
    memset(scf, 0, sizeof(scf));
    /* lane -> scale index within the 16 floats loaded at the pair's first scale */
    const __m512i idx = fmt == FMT_Q8_0
        ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
        : fmt == FMT_Q4_1 ? _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2)
                          : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    const int64_t sstep = fmt == FMT_Q4_1 ? 4 : 2; /* scale floats per pair */
    const __m512i nib = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *rq = qs + n * qrow;
        row_scales_avx512(sc + n * srow, srow, scf);
        __m512 acc[VNNI_MAX_ROWS];
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_setzero_ps();
        for (int64_t p = 0; p < npair; p++) {
            __m512i w;
            if (fmt == FMT_Q8_0) {
                w = p < full ? _mm512_loadu_si512(rq + 64 * p)
                             : _mm512_maskz_loadu_epi8(0xffffffffull, rq + 64 * p);
                w = _mm512_xor_si512(w, flip); /* q + 128: unsigned */
            } else {
                __m256i raw = p < full ? _mm256_loadu_si256((const __m256i *)(rq + 32 * p))
                                       : _mm256_maskz_loadu_epi8(0xffff, rq + 32 * p);
                w = _mm512_broadcast_i64x4(raw);
                /* upper 256 bits: the high nibbles */
                w = _mm512_and_si512(_mm512_mask_srli_epi16(w, 0xffff0000u, w, 4), nib);
            }
            __m512 d = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(scf + sstep * p));
            for (int r = 0; r < R; r++) {
                const int8_t *bp = a->bytes + (r * npair + p) * 192;
                __m512i i = VNNI_DOT(w, bp);
                if (fmt == FMT_Q8_0)
                    i = _mm512_sub_epi32(i, _mm512_loadu_si512(a->corr + (r * npair + p) * 16));
                __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(i),
                                         _mm512_loadu_ps(a->s + (r * npair + p) * 16));
                acc[r] = _mm512_fmadd_ps(f, d, acc[r]);
            }
        }
        if (fmt != FMT_Q8_0) /* the m (Q4_1) or -8 d (Q4_0) terms: xs . scales */
            for (int64_t j = 0; j < a->nxs; j += 16)
                for (int r = 0; r < R; r++)
                    acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(scf + j),
                                             _mm512_loadu_ps(a->xs + r * a->nxs + j), acc[r]);
        for (int r = 0; r < R; r++)
            out[r * N + n] = _mm512_reduce_add_ps(acc[r]);
    }
}

/* The upper eight floats of v (AVX512F only). */
VNNI static inline __attribute__((always_inline)) __m256 hi256_ps(__m512 v)
{
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* Sums of four vectors: lane j of the result is the sum of v[j]'s lanes. */
VNNI static inline __attribute__((always_inline)) __m128 sum4_ps(__m512 v0, __m512 v1,
                                                                  __m512 v2, __m512 v3)
{
    __m256 a0 = _mm256_add_ps(_mm512_castps512_ps256(v0), hi256_ps(v0));
    __m256 a1 = _mm256_add_ps(_mm512_castps512_ps256(v1), hi256_ps(v1));
    __m256 a2 = _mm256_add_ps(_mm512_castps512_ps256(v2), hi256_ps(v2));
    __m256 a3 = _mm256_add_ps(_mm512_castps512_ps256(v3), hi256_ps(v3));
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* The same products as vnni_rows for NR weight rows at a time (R activation rows, both
 * constants after inlining): each pair's activation bytes are loaded once for the NR
 * rows, the NR x R dot-product chains are independent, a row's float16 scales are
 * converted where they are used, and the NR sums of an activation row end in one
 * reduction. Per output the products and their order are vnni_rows' up to the final
 * horizontal sum. */
/* Prefetch distance in groups of NR weight rows. Measured (session 31, one thread, 100
 * MB of weights cycled, median of 7, us per call; groups 1 / 2 / 4 / 6 / 8):
 * q4_1 1536x576 29-33 / 29-31 / 24-26 / 26-27 / 25-26; 576x1536 23-25 / 23-25 /
 * 24-25 / 26 / 28; q8_0 49152x576 1257-1355 / 1210-1247 / 906-1056 / 1004-1211 /
 * 1098-1270; without prefetching the 4-row body took 54-56 / 82-95 / 1992-2164. */
#ifndef VNNI_PREFETCH_GROUPS
#define VNNI_PREFETCH_GROUPS 4
#endif
VNNI static inline __attribute__((always_inline)) void
vnni_rows_nr(int fmt, const vnni_act *a, int R, int NR, int64_t K, const uint8_t *qs,
             const uint16_t *sc, int64_t n, float *out, int64_t N)
{
    const int64_t nb = K / QK, qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
    const int64_t npair = a->npair, full = nb / 2;
    const int64_t sstep = fmt == FMT_Q4_1 ? 4 : 2; /* scale halves per pair */
    const __m512i idx = fmt == FMT_Q8_0
        ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
        : fmt == FMT_Q4_1 ? _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2)
                          : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    const __m512i nib = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[4][VNNI_MAX_ROWS];
    __m128 macc[4][VNNI_MAX_ROWS]; /* the m (Q4_1) or -8 d (Q4_0) terms */
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++) {
            acc[j][r] = _mm512_setzero_ps();
            macc[j][r] = _mm_setzero_ps();
        }
    for (int64_t p = 0; p < npair; p++) {
        const __mmask8 smask = p < full ? (__mmask8)((1u << sstep) - 1)
                                        : (__mmask8)((1u << (sstep / 2)) - 1);
        __m512i w[4];
        __m512 d[4];
        __m128 s4[4];
        if (NR > 1) { /* rows read side by side defeat the hardware prefetcher: the
                       * group VNNI_PREFETCH_GROUPS ahead, spread over the pairs */
            const int64_t pb = fmt == FMT_Q8_0 ? 64 : 32; /* weight bytes per pair */
            const char *next = (const char *)(qs + (n + NR * VNNI_PREFETCH_GROUPS) * qrow);
            for (int64_t o = 0; o < NR * pb; o += 64)
                _mm_prefetch(next + p * NR * pb + o, _MM_HINT_T0);
            _mm_prefetch((const char *)(sc + (n + NR * VNNI_PREFETCH_GROUPS) * srow) + p * NR * sstep * 2,
                         _MM_HINT_T0);
        }
        for (int j = 0; j < NR; j++) {
            const uint8_t *rq = qs + (n + j) * qrow;
            if (fmt == FMT_Q8_0) {
                w[j] = p < full ? _mm512_loadu_si512(rq + 64 * p)
                                : _mm512_maskz_loadu_epi8(0xffffffffull, rq + 64 * p);
                w[j] = _mm512_xor_si512(w[j], flip);
            } else {
                __m256i raw = p < full ? _mm256_loadu_si256((const __m256i *)(rq + 32 * p))
                                       : _mm256_maskz_loadu_epi8(0xffff, rq + 32 * p);
                w[j] = _mm512_broadcast_i64x4(raw);
                w[j] = _mm512_and_si512(_mm512_mask_srli_epi16(w[j], 0xffff0000u, w[j], 4), nib);
            }
            s4[j] = _mm_cvtph_ps(_mm_maskz_loadu_epi16(smask, sc + (n + j) * srow + sstep * p));
            d[j] = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(s4[j]));
        }
        for (int r = 0; r < R; r++) {
            const int8_t *bp = a->bytes + (r * npair + p) * 192;
            const __m512 sa = _mm512_loadu_ps(a->s + (r * npair + p) * 16);
            __m512i corr = _mm512_setzero_si512();
            if (fmt == FMT_Q8_0)
                corr = _mm512_loadu_si512(a->corr + (r * npair + p) * 16);
            __m128 xs4 = _mm_setzero_ps();
            if (fmt == FMT_Q4_1)
                xs4 = _mm_loadu_ps(a->xs + r * a->nxs + 4 * p);
            else if (fmt == FMT_Q4_0)
                xs4 = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(a->xs + r * a->nxs + 2 * p)));
            for (int j = 0; j < NR; j++) {
                __m512i i = VNNI_DOT(w[j], bp);
                if (fmt == FMT_Q8_0)
                    i = _mm512_sub_epi32(i, corr);
                acc[j][r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i), sa), d[j],
                                            acc[j][r]);
                if (fmt != FMT_Q8_0)
                    macc[j][r] = _mm_fmadd_ps(s4[j], xs4, macc[j][r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        if (NR == 4) {
            __m128 m = _mm_hadd_ps(_mm_hadd_ps(macc[0][r], macc[1][r]),
                                   _mm_hadd_ps(macc[2][r], macc[3][r]));
            _mm_storeu_ps(out + r * N + n,
                          _mm_add_ps(sum4_ps(acc[0][r], acc[1][r], acc[2][r], acc[3][r]), m));
        } else {
            for (int j = 0; j < NR; j++) {
                __m128 m = _mm_hadd_ps(macc[j][r], macc[j][r]);
                out[r * N + n + j] = _mm512_reduce_add_ps(acc[j][r])
                                     + _mm_cvtss_f32(_mm_hadd_ps(m, m));
            }
        }
    }
}

VNNI static void vnni_rows_any(int fmt, const vnni_act *a, int64_t M, int64_t K,
                               const uint8_t *qs, const uint16_t *sc, int64_t n0, int64_t n1,
                               float *out, int64_t N)
{
    if (vnni_multi_rows()) {
        int64_t n = n0;
        switch (M) { /* R and NR constants in each copy: the accumulators stay in registers */
        case 1:
            for (; n + 4 <= n1; n += 4)
                vnni_rows_nr(fmt, a, 1, 4, K, qs, sc, n, out, N);
            for (; n < n1; n++)
                vnni_rows_nr(fmt, a, 1, 1, K, qs, sc, n, out, N);
            break;
        case 2:
            for (; n + 2 <= n1; n += 2)
                vnni_rows_nr(fmt, a, 2, 2, K, qs, sc, n, out, N);
            for (; n < n1; n++)
                vnni_rows_nr(fmt, a, 2, 1, K, qs, sc, n, out, N);
            break;
        default:
            for (; n + 2 <= n1; n += 2)
                vnni_rows_nr(fmt, a, 3, 2, K, qs, sc, n, out, N);
            for (; n < n1; n++)
                vnni_rows_nr(fmt, a, 3, 1, K, qs, sc, n, out, N);
            break;
        }
        return;
    }
    switch (M) { /* R constant in each copy: the accumulators stay in registers */
    case 1: vnni_rows(fmt, a, 1, K, qs, sc, n0, n1, out, N); break;
    case 2: vnni_rows(fmt, a, 2, K, qs, sc, n0, n1, out, N); break;
    default: vnni_rows(fmt, a, 3, K, qs, sc, n0, n1, out, N); break;
    }
}
#endif

static int use_avx512(void)
{
#if HAVE_X86
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
                 __builtin_cpu_supports("f16c") && !getenv("FLOWENGINE_CPU_NO_AVX512");
    }
    return cached;
#else
    return 0;
#endif
}

/* Whether the AVX2 bodies run where the AVX-512 ones do not: AVX2, FMA and F16C in
 * cpuid, and FLOWENGINE_CPU_NO_AVX2 unset. */
static int use_avx2(void)
{
#if HAVE_X86
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                 __builtin_cpu_supports("f16c") && !getenv("FLOWENGINE_CPU_NO_AVX2");
    }
    return cached;
#else
    return 0;
#endif
}

/* Activation rows from which the AVX2 int16 panel body (linear_panels_i16) runs on CPUs
 * without AVX-512; FLOWENGINE_CPU_INT16_MIN_ROWS overrides (0: never, float32 bodies
 * only). Measured (session 50, 2-core AMD EPYC Zen 3, benchmarks/cpu_matmul_step.py,
 * ms per step, float32 bodies / int16): 1 row 6.8-7.0 / 9.6-9.8, 2 10.4 / 10.2-11.1,
 * 3 12.3-12.7 / 11.5-12.4, 4 13.5-14.5 / 13.0, 6 23 / 15, 8 26 / 17, 10 34 / 19,
 * 16 33.5-34.7 / 25.6-26.4, 128 200-208 / 156-166. */
#define I16_MIN_ROWS 4
static int64_t i16_min_rows(void)
{
    static int64_t cached = -1;
    if (cached < 0) {
        cached = (int64_t)env_number("FLOWENGINE_CPU_INT16_MIN_ROWS", I16_MIN_ROWS);
        if (cached <= 0 || !use_avx2())
            cached = INT64_MAX;
    }
    return cached;
}

/* One activation row with int16 products (dot_row1_i16) on CPUs without AVX-512, unless
 * FLOWENGINE_CPU_INT16_ONE_ROW=0 or the int16 bodies are off. Measured (session 50, Zen
 * 3, benchmarks/cpu_matmul_step.py --rows 1, 15 alternated rounds, ms per step, float32
 * / int16): 2 threads 5.75 / 4.74, 1 thread 11.09 / 9.03. 2-3 rows stay float32 (the
 * int16 panel body measured level with the float32 row body there). */
static int i16_one_row(void)
{
    static int cached = -1;
    if (cached < 0)
        cached = i16_min_rows() != INT64_MAX && env_number("FLOWENGINE_CPU_INT16_ONE_ROW", 1) != 0;
    return cached;
}

static int use_vnni(void)
{
#if HAVE_X86
    static int cached = -1;
    if (cached < 0)
        cached = use_avx512() && __builtin_cpu_supports("avx512vnni") &&
                 !getenv("FLOWENGINE_CPU_NO_VNNI");
    return cached;
#else
    return 0;
#endif
}

/* Split [0, N) into one contiguous range per thread, in multiples of 16 rows so
 * that no two threads write the same cache line of a one-row output. */
static inline void thread_range(int64_t N, int tid, int nth, int64_t *n0, int64_t *n1)
{
    int64_t units = (N + 15) / 16, per = units / nth, extra = units % nth;
    int64_t u0 = tid * per + (tid < extra ? tid : extra);
    int64_t u1 = u0 + per + (tid < extra ? 1 : 0);
    *n0 = u0 * 16 < N ? u0 * 16 : N;
    *n1 = u1 * 16 < N ? u1 * 16 : N;
}


/* ------------------------------------------------------------------ decode thread pool
 *
 * A small-matmul parallel region whose threads must all start and meet again costs a
 * wake-up and a join per call; under OpenMP's passive wait each is a futex round trip,
 * and the caller waits for the slowest thread to be scheduled, whatever share of the
 * work it got. A batch-1 decode step makes ~150 such calls. Here instead a job is a
 * list of chunks (64 weight rows, or a request's KV heads of attention) claimed one at
 * a time from an atomic counter: the calling thread starts on them at once, the pool's
 * sleeping workers are woken (one futex call) and take what is left when they get a
 * core, and the caller waits only for chunks a worker has actually claimed. A worker
 * that wakes late finds nothing and sleeps again; a worker descheduled by a neighbour
 * costs at most its one chunk, not the step. Every chunk is computed by the same code
 * whichever thread runs it, so the results do not depend on the threads.
 *
 * Job state: one 64-bit word, (generation << 32) | next chunk; a chunk is claimed by a
 * compare-and-swap of that word, so a worker can never run a chunk of a job other than
 * the one whose description it read (the caller invalidates the word before writing the
 * next description). Linux only (futex); elsewhere the caller runs every chunk itself.
 */
typedef void (*pool_fn)(const void *ctx, int64_t chunk);

#define POOL_MAX 63
#define POOL_IDLE 0xffffffffu
#if HAVE_POOL
static struct {
    pthread_mutex_t lock;
    int nworkers;
    _Atomic uint64_t state;          /* (gen << 32) | next chunk, POOL_IDLE: no job */
    _Atomic(pool_fn) fn;
    _Atomic(const void *) ctx;
    _Atomic int64_t nchunks;
    _Atomic int job_workers;         /* workers with index below this take part */
    _Atomic uint32_t wake_seq;       /* futex word the workers sleep on */
    _Atomic int sleepers;
    _Atomic uint32_t done;           /* chunks finished (futex word of the caller) */
    _Atomic int caller_waiting;
    uint32_t gen;
    _Atomic double quiet_until;      /* pool_now_us() before which workers do not poll */
} pool = {PTHREAD_MUTEX_INITIALIZER, 0, (uint64_t)POOL_IDLE, NULL, NULL, 0, 0, 0, 0, 0, 0, 0, 0};

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts)
{
    return syscall(SYS_futex, (uint32_t *)addr, op | FUTEX_PRIVATE_FLAG, val, ts, NULL, 0);
}

/* Claim and run chunks of the current job; returns how many this thread ran. */
static int64_t pool_run_chunks(void)
{
    int64_t ran = 0;
    for (;;) {
        uint64_t st = atomic_load(&pool.state);
        uint32_t idx = (uint32_t)st;
        if (idx == POOL_IDLE)
            return ran;
        pool_fn fn = atomic_load(&pool.fn);
        const void *ctx = atomic_load(&pool.ctx);
        int64_t n = atomic_load(&pool.nchunks);
        if ((int64_t)idx >= n)
            return ran;
        if (!atomic_compare_exchange_weak(&pool.state, &st, st + 1))
            continue;
        fn(ctx, idx);
        ran++;
        atomic_fetch_add(&pool.done, 1);
        if (atomic_load(&pool.caller_waiting))
            futex(&pool.done, FUTEX_WAKE, 1, NULL);
    }
}

static double pool_now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* A gap this long between two clock reads of a polling worker means it was
 * descheduled (another process or thread wants its core); then no worker polls for
 * POOL_QUIET_US, they sleep at once, which is what gets a sleeping thread the core
 * promptly when it is woken for work (a thread that polled has used its share).
 * 200 ms at first: then the structured-outputs worker thread of the in-process
 * AsyncEngine (a third thread on 2 cores) stopped the polling for most of a
 * constrained batch-32 run (JSON/free 0.913 against 0.973 without polling); 20 ms:
 * 0.955-0.970, and the single stream with a CPU-bound neighbour on core 0 5.7-6.3
 * ms/token against 3.7-4.2 idle (200 ms: 7.4-8.4). */
#define POOL_PREEMPTED_US 50
#define POOL_QUIET_US 20000

/* How long a worker polls for the next job before it sleeps, microseconds:
 * FLOWENGINE_CPU_POOL_SPIN_US, default POOL_SPIN_US. A futex wake-up of a sleeping
 * worker took 7-22 us (median; mean 30-70 us) on the 2-vCPU machine of session 31, as
 * long as a whole batch-1 matmul, so a sleeping pool barely helped: a 1536 x 576 Q4_1
 * matmul took 34 us on 2 threads and on 1. Polling 100 us (the gap between a decode
 * step's calls is far shorter; between steps the Python work is longer, so the workers
 * sleep there): 128-token greedy decode 4.7-5.4 ms/token against 6.5-7.6 (spin 0), 4
 * alternated pairs; with a CPU-bound process on core 0 and the quiet rule below
 * (200 ms then) 7.4-8.4 against 7.5-8.0 (without the quiet rule polling made it
 * 10.9-15.8). */
#define POOL_SPIN_US 100
static double pool_spin_us(void)
{
    static double cached = -1;
    if (cached < 0) {
        cached = env_number("FLOWENGINE_CPU_POOL_SPIN_US", POOL_SPIN_US);
        if (cached < 0)
            cached = 0;
    }
    return cached;
}

static void *pool_worker(void *arg)
{
    const int index = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&pool.wake_seq);
    const double spin = pool_spin_us();
    for (;;) {
        if (spin > 0 && atomic_load(&pool.wake_seq) == seen
            && pool_now_us() >= atomic_load(&pool.quiet_until)) {
            double t0 = pool_now_us(), last = t0;
            for (int i = 0; atomic_load(&pool.wake_seq) == seen; i++) {
#if HAVE_X86
                _mm_pause();
#endif
                if ((i & 63) == 63) {
                    const double t = pool_now_us();
                    if (t - last > POOL_PREEMPTED_US) { /* descheduled: the core is shared */
                        atomic_store(&pool.quiet_until, t + POOL_QUIET_US);
                        break;
                    }
                    if (t - t0 > spin)
                        break;
                    last = t;
                }
            }
        }
        if (atomic_load(&pool.wake_seq) != seen) {
            seen = atomic_load(&pool.wake_seq);
            if (index < atomic_load(&pool.job_workers))
                pool_run_chunks();
            continue;
        }
        atomic_fetch_add(&pool.sleepers, 1);
        while (atomic_load(&pool.wake_seq) == seen)
            futex(&pool.wake_seq, FUTEX_WAIT, seen, NULL);
        atomic_fetch_sub(&pool.sleepers, 1);
        seen = atomic_load(&pool.wake_seq);
        if (index < atomic_load(&pool.job_workers))
            pool_run_chunks();
    }
    return NULL;
}

static void pool_after_fork(void)
{
    /* the child has none of the workers: start again */
    pthread_mutex_init(&pool.lock, NULL);
    pool.nworkers = 0;
    atomic_store(&pool.state, (uint64_t)POOL_IDLE);
    atomic_store(&pool.sleepers, 0);
}

/* Make sure `want` workers exist; returns how many do (fewer if threads fail). */
static int pool_ensure(int want)
{
    if (want > POOL_MAX)
        want = POOL_MAX;
    if (pool.nworkers >= want)
        return pool.nworkers;
    pthread_mutex_lock(&pool.lock);
    static int atfork = 0;
    if (!atfork) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        atfork = 1;
    }
    while (pool.nworkers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 1 << 20);
        int rc = pthread_create(&t, &attr, pool_worker, (void *)(intptr_t)pool.nworkers);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        pthread_detach(t);
        pool.nworkers++;
    }
    int n = pool.nworkers;
    pthread_mutex_unlock(&pool.lock);
    return n;
}
#endif

static int pool_disabled(void)
{
    /* FLOWENGINE_CPU_NO_POOL=1: OpenMP regions instead (for comparisons) */
    static int cached = -1;
    if (cached < 0) {
        const char *v = getenv("FLOWENGINE_CPU_NO_POOL");
        cached = v != NULL && *v && strcmp(v, "0") != 0;
    }
    return cached;
}

/* Run fn(ctx, c) for c in [0, nchunks) on the caller and up to nth - 1 pool workers
 * (with FLOWENGINE_CPU_NO_POOL, in an OpenMP region of nth threads). Call without the
 * GIL, from one thread at a time (the executor's); a concurrent second caller runs its
 * chunks alone. */
static void pool_run(pool_fn fn, const void *ctx, int64_t nchunks, int nth)
{
    if (pool_disabled() && nth > 1 && nchunks > 1) { /* OpenMP, as the bodies' own regions */
#pragma omp parallel for schedule(dynamic, 1) num_threads(nth)
        for (int64_t c = 0; c < nchunks; c++)
            fn(ctx, c);
        return;
    }
#if HAVE_POOL
    static _Atomic int busy = 0;
    int expected = 0;
    if (nth > 1 && nchunks > 1 && nchunks < POOL_IDLE
        && atomic_compare_exchange_strong(&busy, &expected, 1)) {
        int workers = pool_ensure(nth - 1);
        if (workers > 0) {
            uint32_t gen = ++pool.gen;
            atomic_store(&pool.state, ((uint64_t)gen << 32) | POOL_IDLE); /* invalidate */
            atomic_store(&pool.fn, fn);
            atomic_store(&pool.ctx, ctx);
            atomic_store(&pool.nchunks, nchunks);
            atomic_store(&pool.job_workers, nth - 1 < workers ? nth - 1 : workers);
            atomic_store(&pool.done, 0);
            atomic_store(&pool.state, (uint64_t)gen << 32);
            atomic_fetch_add(&pool.wake_seq, 1);
            if (atomic_load(&pool.sleepers) > 0)
                futex(&pool.wake_seq, FUTEX_WAKE, nth - 1, NULL);
            pool_run_chunks();
            /* wait for chunks the workers claimed: spin briefly, then sleep */
            for (int spin = 0; atomic_load(&pool.done) < (uint32_t)nchunks; spin++) {
                if (spin < 4000) {
#if HAVE_X86
                    _mm_pause();
#endif
                    continue;
                }
                atomic_store(&pool.caller_waiting, 1);
                uint32_t d = atomic_load(&pool.done);
                if (d < (uint32_t)nchunks) {
                    struct timespec ts = {0, 200000};
                    futex(&pool.done, FUTEX_WAIT, d, &ts);
                }
            }
            atomic_store(&pool.caller_waiting, 0);
            atomic_store(&pool.state, ((uint64_t)gen << 32) | POOL_IDLE);
            atomic_store(&busy, 0);
            return;
        }
        atomic_store(&busy, 0);
    }
#endif
    (void)nth;
    for (int64_t c = 0; c < nchunks; c++)
        fn(ctx, c);
}

/* Rows per chunk of a row-wise operation of T rows x `width` values on nth threads:
 * all T (one chunk, the caller alone) below ROWWISE_MIN_ELEMS values (a decode step's
 * few rows: waking a worker costs more than the work), else about four chunks a
 * thread. A row's result never depends on the split. */
#define ROWWISE_MIN_ELEMS 65536
static int64_t rowwise_chunk(int64_t T, int64_t width, int nth)
{
    if (nth <= 1 || T <= 1 || T * width < ROWWISE_MIN_ELEMS)
        return T > 0 ? T : 1;
    return (T + 4 * (int64_t)nth - 1) / (4 * (int64_t)nth);
}

/* fn over T rows in chunks of `rows` (rowwise_chunk's): one chunk (a decode step's
 * rows) runs here with the GIL held, not worth its round trip; more go to the pool
 * without it. Call with the GIL. */
static void run_rowwise(pool_fn fn, const void *ctx, int64_t T, int64_t rows, int nth)
{
    if (rows >= T) {
        fn(ctx, 0);
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    pool_run(fn, ctx, (T + rows - 1) / rows, nth);
    Py_END_ALLOW_THREADS
}

static int check_fmt(int fmt)
{
    if (fmt != FMT_Q4_0 && fmt != FMT_Q4_1 && fmt != FMT_Q8_0) {
        PyErr_Format(PyExc_ValueError, "unknown quantized format %d", fmt);
        return -1;
    }
    return 0;
}

/* A matmul as a pool job: chunk c is weight rows [64 c, 64 c + 64). */
#define LINEAR_CHUNK 64
typedef struct {
    int fmt, vnni, avx, avx2;
    const float *x;
    int64_t M, K;
    const uint8_t *qs;
    const uint16_t *sc;
    int64_t N;
    float *out;
    const void *act; /* vnni_act */
    int64_t chunk;   /* weight rows per pool chunk */
    const float *xp; /* the panel body's packed activations, or NULL */
    const uint16_t *xb; /* the AMX body's packed bf16 activations, or NULL */
    const void *i8;     /* the AMX-INT8 body's packed activations (i8_act), or NULL */
    const void *i16;    /* the AVX2 int16 body's rounded activations (i16_act), or NULL */
    int i16_row;        /* one row: dot_row1_i16 instead of dot_row1_avx2 */
} linear_job;

/* Cache blocking of the float32 bodies (more than VNNI_MAX_ROWS rows): each weight row
 * is multiplied with every activation row of a tile, so the tile (rows x K floats) is
 * read once per weight row and must stay in L1 (48 KB per core here). Without it the
 * time per row doubled above 16 rows at K = 576 (16 x 576 x 4 = 36 KB; 24 rows: 54 KB)
 * and above 8 at K = 1536. Tiles are ROW_TILE_BYTES of activations (at least MR rows),
 * run over blocks of ROW_TILE_N weight rows (re-read from L1/L2 once per tile). The
 * sums of each output are formed in the same order, so results are unchanged.
 * FLOWENGINE_CPU_ROW_TILE_KB (read once) overrides the budget for measurements
 * (benchmarks/cpu_quant_rows.py): 0 = tiles of MR rows, a huge value = no tiling. */
#define ROW_TILE_BYTES (40 * 1024)
#define ROW_TILE_N 64

static int64_t row_tile(int64_t K)
{
    static int64_t budget = -1;
    if (budget < 0) {
        const char *e = getenv("FLOWENGINE_CPU_ROW_TILE_KB");
        budget = e && *e ? atol(e) * 1024 : ROW_TILE_BYTES;
    }
    int64_t t = budget / (K * 4) / MR * MR;
    return t < MR ? MR : t;
}

/* From how many activation rows the float32 matmul runs the panel body
 * (linear_panels_avx512); FLOWENGINE_CPU_PANEL_MIN_ROWS overrides (0: never). */
#define PANEL_MIN_ROWS 14
static int64_t panel_min_rows(void)
{
    static int64_t cached = -1;
    if (cached < 0) {
        cached = (int64_t)env_number("FLOWENGINE_CPU_PANEL_MIN_ROWS", PANEL_MIN_ROWS);
        if (cached <= 0)
            cached = INT64_MAX;
    }
    return cached;
}

/* The same for the AVX2 panel body (linear_panels_avx2); FLOWENGINE_CPU_PANEL_MIN_ROWS
 * overrides it too. Measured (session 47, 2-core AMD EPYC Zen 3, all matmuls of a
 * decode step with the weights from memory, benchmarks/cpu_matmul_step.py, ms, 2
 * alternated rounds, panels / linear_rows_avx2): 6 rows 28-29 / 21-23, 8 33-36 / 25-26,
 * 10 30-36 / 34, 12 33-43 / 36-37, 16 39 / 59, 32 67 / 138, 128 217 / 432. */
#define PANEL_MIN_ROWS_AVX2 12
static int64_t panel_min_rows_avx2(void)
{
    static int64_t cached = -1;
    if (cached < 0) {
        cached = (int64_t)env_number("FLOWENGINE_CPU_PANEL_MIN_ROWS", PANEL_MIN_ROWS_AVX2);
        if (cached <= 0)
            cached = INT64_MAX;
    }
    return cached;
}

/* This thread's panel scratch of at least `floats` floats (kept for the thread's life;
 * NULL when it cannot be allocated). */
static float *panel_buffer(int64_t floats)
{
    static __thread float *buf = NULL;
    static __thread int64_t cap = 0;
    if (cap < floats) {
        free(buf);
        buf = (float *)aligned_alloc(64, (size_t)(floats + 15) / 16 * 64);
        cap = buf != NULL ? floats : 0;
    }
    return buf;
}

static void linear_rows_any(const linear_job *j, int64_t n0, int64_t n1)
{
    if (n0 >= n1)
        return;
#if HAVE_AMX
    if (j->i8 != NULL) {
        const i8_act *a = (const i8_act *)j->i8;
        const int64_t tfl = (sc_row_halves(j->fmt, j->K) + 16 + 15) / 16 * 256;
        float *t = panel_buffer(tfl + a->npair * 256); /* scales, then the panel */
        if (t != NULL) {
            linear_amx_i8(j->fmt, a, j->K, j->qs, j->sc, n0, n1, j->out, j->N,
                          (uint8_t *)(t + tfl), t);
            return;
        }
    }
    if (j->xb != NULL) {
        uint16_t *wa = (uint16_t *)panel_buffer(16 * j->K); /* 32 x K bf16 */
        if (wa != NULL) {
            linear_amx(j->fmt, j->xb, j->M, j->K, j->qs, j->sc, n0, n1, j->out, j->N, wa);
            return;
        }
    }
#endif
#if HAVE_X86
    if (j->vnni) {
        vnni_rows_any(j->fmt, (const vnni_act *)j->act, j->M, j->K, j->qs, j->sc, n0, n1, j->out,
                      j->N);
        return;
    }
#endif
    const int64_t M = j->M, K = j->K, N = j->N, tile = row_tile(K);
#if HAVE_X86
    if (j->i16 != NULL) {
        float *t = panel_buffer(i16_panel_floats(K));
        if (t != NULL) {
            linear_panels_i16(j->fmt, (const i16_act *)j->i16, M, K, j->qs, j->sc, n0, n1,
                              j->out, N, t);
            return;
        }
    }
    if (j->xp != NULL) {
        float *wt = panel_buffer(16 * K);
        if (wt != NULL) {
            if (j->avx)
                linear_panels_avx512(j->fmt, j->xp, M, K, j->qs, j->sc, n0, n1, j->out, N, wt);
            else
                linear_panels_avx2(j->fmt, j->xp, M, K, j->qs, j->sc, n0, n1, j->out, N, wt);
            return;
        }
    }
#endif
    if (M <= tile) {
#if HAVE_X86
        if (j->avx)
            linear_rows_avx512(j->fmt, j->x, M, K, j->qs, j->sc, n0, n1, j->out, N);
        else if (j->avx2)
            linear_rows_avx2(j->fmt, j->x, M, K, j->qs, j->sc, n0, n1, j->out, N, j->i16_row);
        else
#endif
            linear_rows_c(j->fmt, j->x, M, K, j->qs, j->sc, n0, n1, j->out, N);
        return;
    }
    for (int64_t b0 = n0; b0 < n1; b0 += ROW_TILE_N) {
        const int64_t b1 = b0 + ROW_TILE_N < n1 ? b0 + ROW_TILE_N : n1;
        for (int64_t t0 = 0; t0 < M; t0 += tile) {
            const int64_t mt = M - t0 < tile ? M - t0 : tile;
            const float *xt = j->x + t0 * K;
            float *ot = j->out + t0 * N;
#if HAVE_X86
            if (j->avx)
                linear_rows_avx512(j->fmt, xt, mt, K, j->qs, j->sc, b0, b1, ot, N);
            else if (j->avx2)
                linear_rows_avx2(j->fmt, xt, mt, K, j->qs, j->sc, b0, b1, ot, N, 0);
            else
#endif
                linear_rows_c(j->fmt, xt, mt, K, j->qs, j->sc, b0, b1, ot, N);
        }
    }
}

/* Weight rows per chunk: about LINEAR_CHUNKS_PER_THREAD chunks per thread (each claim
 * is an atomic on a line the threads share), at least LINEAR_CHUNK rows, a multiple of
 * 16 (no two threads write one cache line of a one-row output). */
#define LINEAR_CHUNKS_PER_THREAD 4
static int64_t linear_chunk_rows(int64_t N, int nth)
{
    int64_t want = (N + (int64_t)nth * LINEAR_CHUNKS_PER_THREAD - 1) / ((int64_t)nth * LINEAR_CHUNKS_PER_THREAD);
    want = (want + 15) / 16 * 16;
    return want < LINEAR_CHUNK ? LINEAR_CHUNK : want;
}

static void linear_chunk(const void *ctx, int64_t c)
{
    const linear_job *j = (const linear_job *)ctx;
    int64_t n0 = c * j->chunk, n1 = n0 + j->chunk;
    linear_rows_any(j, n0, n1 < j->N ? n1 : j->N);
}

#if HAVE_AMX
/* pack_activations_amx as a pool job: chunk c is tiles [c tiles, (c + 1) tiles). */
typedef struct {
    const float *x;
    int64_t M, K;
    uint16_t *xb;
    int64_t tiles;
} amx_pack_job;

static void amx_pack_chunk(const void *ctx, int64_t c)
{
    const amx_pack_job *j = (const amx_pack_job *)ctx;
    pack_activations_amx(j->x, j->M, j->K, j->xb, c * j->tiles, (c + 1) * j->tiles);
}
#endif

/* out[M, N] = x[M, K] W^T with up to nth threads; call without the GIL. From amx_min
 * rows (0: never) the AMX bodies run where the CPU has them: up to AMXI8_MAX_ROWS rows
 * the AMX-INT8 body (unless no_i8; activations rounded to 16 bits per block), more rows
 * the AMX-BF16 body (bf16 products); float32 sums either way. On CPUs with AVX2 and no
 * AVX-512, from i16_min_rows() rows the int16 panel body and for one row dot_row1_i16
 * (unless no_i8; activations rounded to 16 bits per block). Returns -1 when the AMX activation buffer cannot be
 * allocated (nothing written), else 0 (an int16 buffer that cannot be allocated falls
 * back to the float32 bodies). */
static int linear_impl(int fmt, const float *x, int64_t M, int64_t K, const uint8_t *qs,
                       const uint16_t *sc, int64_t N, float *out, int nth, int64_t amx_min,
                       int no_i8)
{
    int avx = use_avx512();
    int64_t units = (N + 15) / 16;
    if (nth > units)
        nth = (int)(units > 0 ? units : 1);
    uint16_t *xb = NULL;
    int i8_on = 0;
#if HAVE_AMX
    i8_act i8;
    void *i8buf = NULL;
    if (amx_min > 0 && M >= amx_min && M <= AMXI8_MAX_ROWS && !no_i8 && use_amx_int8()) {
        i8.M = M;
        i8.nb = K / QK;
        i8.npair = (i8.nb + 1) / 2;
        i8.groups = (M + 3) / 4;
        const size_t tiles = (size_t)(i8.groups * i8.npair);
        i8buf = calloc(tiles, 1024 + 2 * 16 * sizeof(float));
        if (i8buf == NULL)
            return -1;
        i8.s = (float *)i8buf;
        i8.xs = i8.s + tiles * 16;
        i8.b = (int8_t *)(i8.xs + tiles * 16);
        pack_activations_i8(fmt, x, M, K, &i8);
        i8_on = 1;
    } else if (amx_min > 0 && M >= amx_min && use_amx()) {
        xb = (uint16_t *)aligned_alloc(64, (size_t)((M + 15) / 16 * 16 * K) * sizeof(uint16_t));
        if (xb == NULL)
            return -1;
        amx_pack_job pj = {x, M, K, xb, (M + 15) / 16};
        pj.tiles = rowwise_chunk(pj.tiles, 16 * K, nth); /* tiles per chunk */
        pool_run(amx_pack_chunk, &pj, ((M + 15) / 16 + pj.tiles - 1) / pj.tiles, nth);
    }
#endif
    int vnni = xb == NULL && !i8_on && M >= 1 && M <= VNNI_MAX_ROWS && use_vnni();
#if HAVE_X86
    vnni_act act;
    void *buf = NULL;
    if (vnni) {
        const int64_t nb = K / QK, srow = sc_row_halves(fmt, K);
        act.npair = (nb + 1) / 2;
        act.nxs = (srow + 15) / 16 * 16;
        size_t per_row = (size_t)act.npair * (192 + 64 + 64) + (size_t)act.nxs * 4;
        buf = calloc((size_t)M, per_row);
        if (buf == NULL)
            return -1;
        act.s = (float *)buf;
        act.corr = (int32_t *)(act.s + M * act.npair * 16);
        act.xs = (float *)(act.corr + M * act.npair * 16);
        act.bytes = (int8_t *)(act.xs + M * act.nxs);
        for (int64_t r = 0; r < M; r++)
            vnni_prepare_row(fmt, x + r * K, K, &act, r);
    }
#endif
    linear_job job = {fmt, vnni, avx, !avx && use_avx2(), x, M, K, qs, sc, N, out, NULL,
                      linear_chunk_rows(N, nth),
                      NULL, xb, NULL, NULL, 0};
    job.i16_row = job.avx2 && M == 1 && !no_i8 && i16_one_row();
#if HAVE_AMX
    if (i8buf != NULL)
        job.i8 = &i8;
#endif
    float *xp = NULL;
#if HAVE_X86
    i16_act a16;
    void *i16buf = NULL;
    if (xb == NULL && !vnni && job.avx2 && M >= i16_min_rows() && !no_i8) {
        a16.nb = K / QK;
        a16.tiles = (M + I16_MB - 1) / I16_MB;
        const size_t n = (size_t)(a16.tiles * a16.nb * I16_MB);
        i16buf = malloc(n * (16 * sizeof(int32_t) + 2 * sizeof(float)));
        if (i16buf != NULL) {
            a16.a = (int32_t *)i16buf;
            a16.s = (float *)(a16.a + 16 * n);
            a16.xs = a16.s + n;
            pack_activations_i16(x, M, K, &a16);
            job.i16 = &a16;
        }
    }
    if (xb == NULL && !vnni && avx && M >= panel_min_rows() && K % 16 == 0) {
        xp = (float *)aligned_alloc(64, (size_t)((M + 15) / 16 * 16 * K) * sizeof(float));
        if (xp != NULL)
            pack_activations_avx512(x, M, K, xp);
        job.xp = xp;
    } else if (xb == NULL && !vnni && job.i16 == NULL && job.avx2
               && M >= panel_min_rows_avx2()) {
        xp = (float *)aligned_alloc(
            64, (size_t)(((M + PANEL2_MB - 1) / PANEL2_MB * PANEL2_MB * K * 4 + 63) / 64 * 64));
        if (xp != NULL)
            pack_activations_avx2(x, M, K, xp);
        job.xp = xp;
    }
#endif
#if HAVE_X86
    job.act = vnni ? &act : NULL;
#endif
    if (pool_disabled()) {
#pragma omp parallel num_threads(nth)
        {
            int tid = 0, t = 1;
#ifdef _OPENMP
            tid = omp_get_thread_num();
            t = omp_get_num_threads();
#endif
            int64_t n0, n1;
            thread_range(N, tid, t, &n0, &n1);
            linear_rows_any(&job, n0, n1);
        }
    } else {
        pool_run(linear_chunk, &job, (N + job.chunk - 1) / job.chunk, nth);
    }
#if HAVE_X86
    free(buf);
    free(i16buf);
#endif
    free(xp);
    free(xb);
#if HAVE_AMX
    free(i8buf);
#endif
    (void)avx;
    return 0;
}

/* linear(fmt, x, M, K, qs, sc, N, out, num_threads[, amx_min[, no_int8]]): out[M, N] =
 * x[M, K] W^T. */
static PyObject *py_linear(PyObject *self, PyObject *args)
{
    int fmt, nth;
    unsigned long long xp, qp, sp, op;
    long long M, K, N, amx_min = 0;
    int no_i8 = 0;
    if (!PyArg_ParseTuple(args, "iKLLKKLKi|Lp", &fmt, &xp, &M, &K, &qp, &sp, &N, &op, &nth,
                          &amx_min, &no_i8))
        return NULL;
    if (check_fmt(fmt) < 0)
        return NULL;
    if (K % QK != 0 || M < 0 || N < 0 || nth < 1) {
        PyErr_Format(PyExc_ValueError, "bad shapes M=%lld K=%lld N=%lld threads=%d", M, K, N, nth);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = linear_impl(fmt, (const float *)(uintptr_t)xp, M, K, (const uint8_t *)(uintptr_t)qp,
                     (const uint16_t *)(uintptr_t)sp, N, (float *)(uintptr_t)op, nth, amx_min,
                     no_i8);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* dequantize(fmt, qs, sc, N, K, out, num_threads[, bf16]): out[N, K] float32, or with
 * bf16 those values rounded to bfloat16 as f32_to_bf16 rounds them (torch's rounding for
 * numbers; a NaN, from an inf or NaN scale, stays a quiet NaN whose bits may differ
 * from torch's). */
static PyObject *py_dequantize(PyObject *self, PyObject *args)
{
    int fmt, nth, bf16 = 0;
    unsigned long long qp, sp, op;
    long long N, K;
    if (!PyArg_ParseTuple(args, "iKKLLKi|p", &fmt, &qp, &sp, &N, &K, &op, &nth, &bf16))
        return NULL;
    if (check_fmt(fmt) < 0)
        return NULL;
    if (K % QK != 0 || N < 0 || nth < 1) {
        PyErr_Format(PyExc_ValueError, "bad shapes N=%lld K=%lld", N, K);
        return NULL;
    }
    const uint8_t *qs = (const uint8_t *)(uintptr_t)qp;
    const uint16_t *sc = (const uint16_t *)(uintptr_t)sp;
    float *out = (float *)(uintptr_t)op;
    int avx = use_avx512();
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(nth)
    {
        int tid = 0, t = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        t = omp_get_num_threads();
#endif
        int64_t n0, n1;
        thread_range(N, tid, t, &n0, &n1);
#if HAVE_X86
        if (avx && bf16)
            dequant_rows_bf16_avx512(fmt, qs, sc, K, n0, n1, (uint16_t *)out);
        else if (avx)
            dequant_rows_avx512(fmt, qs, sc, K, n0, n1, out);
        else
#endif
        {
            const int64_t qrow = qs_row_bytes(fmt, K), srow = sc_row_halves(fmt, K);
            float blk[QK];
            for (int64_t n = n0; n < n1; n++)
                for (int64_t b = 0; b < K / QK; b++) {
                    if (!bf16) {
                        dequant_block_c(fmt, qs + n * qrow, sc + n * srow, b, out + n * K + b * QK);
                        continue;
                    }
                    dequant_block_c(fmt, qs + n * qrow, sc + n * srow, b, blk);
                    for (int i = 0; i < QK; i++)
                        ((uint16_t *)out)[n * K + b * QK + i] = f32_to_bf16(blk[i]);
                }
        }
    }
    Py_END_ALLOW_THREADS
    (void)avx;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ decode attention
 *
 * One new token per request over its paged context, straight from the cache: for
 * each (request, KV head) the G = Hq / Hkv query heads of that KV head pass over the
 * context's blocks together, each K/V row read once per pass (the portable body: all G
 * heads in one pass; the AVX-512 body: groups of up to 4 heads at head_dim 64, 2 at
 * 128, else one head a pass), with an online softmax (Milakov & Gimelshein 2018) in
 * float32.
 *
 * q     [T, Hq, D] (f32 or bf16), rows tok_idx[i] are request i's decode token
 * cache [2, num_blocks, block_size, Hkv, D] (f32 or bf16; 0 = K, 1 = V)
 * block_tables [*, bt_stride] int32, row req_idx[i]; seq_lens int32 per request row
 * out   [T, Hq, D] (q's dtype), rows tok_idx[i] written
 * soft_cap > 0: scores become cap * tanh(s / cap); window > 0: only the last `window`
 * positions are attended.
 */
#define MAX_D 256
#define MAX_G 32

/* A KV cache's element type (the `kv_fmt` arguments). Float16 and bf16 values are
 * widened to float32 exactly as attention reads them. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

typedef struct {
    const void *q, *cache;
    void *out;
    const int64_t *tok_idx, *req_idx;
    const int32_t *block_tables, *seq_lens;
    int64_t num_reqs, hq, hkv, d, block_size, num_blocks, bt_stride;
    int q_bf16, kv_fmt; /* kv_fmt: KV_F32, KV_BF16 or KV_F16, the cache's dtype */
    float scale, soft_cap;
    int64_t window;
    int64_t wchunk; /* (request, KV head) items per pool chunk (attention_impl sets it) */
    /* split pass (attention_impl): request i's items (KV head, part) are part_off[i] ..
     * part_off[i + 1] - 1, item c's sums, max and denominator partial[c][G][d + 2] */
    const int64_t *part_off; /* NULL: no split */
    float *partial;
} attn_args;

/* The first position a query at context length len attends: len - window with a
 * sliding window shorter than the context, else 0. */
static inline int64_t attn_start(const attn_args *a, int64_t len)
{
    return a->window > 0 && len > a->window ? len - a->window : 0;
}

static inline float load_elem(const void *p, int64_t i, int bf16)
{
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Row of D values of a cache of format fmt (KV_*) as float32 into dst (a no-copy
 * pointer for float32 rows). */
static inline const float *row_f32(const void *base, int64_t off, int64_t d, int fmt, float *dst)
{
    if (fmt == KV_F32)
        return (const float *)base + off;
    const uint16_t *s = (const uint16_t *)base + off;
    for (int64_t i = 0; i < d; i++)
        dst[i] = fmt == KV_BF16 ? bf16_to_f32(s[i]) : fp16_to_f32(s[i]);
    return dst;
}

static inline __attribute__((always_inline)) void attend_one(const attn_args *a, int64_t i,
                                                             int64_t h)
{
    const int64_t g_count = a->hq / a->hkv, d = a->d, bs = a->block_size;
    const int64_t len = a->seq_lens[i];
    const int32_t *bt = a->block_tables + a->req_idx[i] * a->bt_stride;
    const int64_t tok = a->tok_idx[i];
    float q[MAX_G][MAX_D], acc[MAX_G][MAX_D], mx[MAX_G], den[MAX_G], kbuf[MAX_D], vbuf[MAX_D];
    for (int64_t g = 0; g < g_count; g++) {
        int64_t base = (tok * a->hq + h * g_count + g) * d;
        for (int64_t e = 0; e < d; e++) {
            q[g][e] = load_elem(a->q, base + e, a->q_bf16);
            acc[g][e] = 0.f;
        }
        mx[g] = -INFINITY;
        den[g] = 0.f;
    }
    const int64_t plane = a->num_blocks * bs * a->hkv * d; /* elements of K (or V) */
    int64_t start = attn_start(a, len);
    for (int64_t j = start; j < len; j++) {
        int64_t off = (((int64_t)bt[j / bs] * bs + j % bs) * a->hkv + h) * d;
        const float *k = row_f32(a->cache, off, d, a->kv_fmt, kbuf);
        const float *v = row_f32(a->cache, plane + off, d, a->kv_fmt, vbuf);
        for (int64_t g = 0; g < g_count; g++) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t e = 0; e < d; e++)
                s += q[g][e] * k[e];
            s *= a->scale;
            if (a->soft_cap > 0.f)
                s = a->soft_cap * tanhf(s / a->soft_cap);
            float p;
            if (s > mx[g]) { /* rescale what was summed under the old maximum */
                float c = expf(mx[g] - s);
                den[g] *= c;
#pragma omp simd
                for (int64_t e = 0; e < d; e++)
                    acc[g][e] *= c;
                mx[g] = s;
                p = 1.f;
            } else {
                p = expf(s - mx[g]);
            }
            den[g] += p;
#pragma omp simd
            for (int64_t e = 0; e < d; e++)
                acc[g][e] += p * v[e];
        }
    }
    for (int64_t g = 0; g < g_count; g++) {
        int64_t base = (tok * a->hq + h * g_count + g) * d;
        float inv = den[g] > 0.f ? 1.f / den[g] : 0.f;
        for (int64_t e = 0; e < d; e++) {
            float o = acc[g][e] * inv;
            if (a->q_bf16)
                ((uint16_t *)a->out)[base + e] = f32_to_bf16(o);
            else
                ((float *)a->out)[base + e] = o;
        }
    }
}

static void attend_range_c(const attn_args *a, int64_t w0, int64_t w1)
{
    for (int64_t w = w0; w < w1; w++)
        attend_one(a, w / a->hkv, w % a->hkv);
}

#if HAVE_X86
/* Lane j of the result: the sum of the 8 lanes of t[j] (an 8 x 8 transpose-add). */
AVX2 static inline __m256 sum8_ps(const __m256 *t)
{
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(t[4], t[5]), _mm256_hadd_ps(t[6], t[7]));
    /* a: t[0..3]'s sums of lanes 0-3, then of lanes 4-7; b: t[4..7]'s */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

AVX2 static inline float hmax_avx2(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* s[j] = e^(s[j] - m) for the lanes of s[0 .. n rounded up to 8) that are not -inf, 0
 * for those that are (masked positions); returns their sum. s 32-byte aligned. */
AVX2 static inline __attribute__((always_inline)) float softmax_weights_avx2(float *s,
                                                                             int64_t n, float m)
{
    const __m256 mv = _mm256_set1_ps(m);
    __m256 psum = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const __m256 v = _mm256_load_ps(s + j0);
        const __m256 live = _mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m256 p = _mm256_and_ps(live, exp_avx2(_mm256_sub_ps(v, mv)));
        psum = _mm256_add_ps(psum, p);
        _mm256_store_ps(s + j0, p);
    }
    return hsum_avx2(psum);
}

/* 8 cache values at p as float32: float32, or bf16 / float16 (KB: KV_BF16, KV_F16)
 * widened exactly. */
AVX2 static inline __attribute__((always_inline)) __m256 load_kv8(const char *p, const int KB)
{
    if (KB == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (KB == KV_BF16)
        return bf16_load8_avx2((const uint16_t *)p);
    return _mm256_loadu_ps((const float *)p);
}

/* The AVX2 decode attention over KV head h of request i, for float32 queries with
 * head_dim a multiple of 8 (KB: the cache's KV_* format). Per group of up to ATT2_GH query heads
 * and per segment of up to ATT2_SEG positions, three passes instead of one online
 * softmax per 8 positions:
 *   1. the scores of every head of the group (scores_avx2): each K row loaded once
 *      for the group's heads, two FMA chains per head and position, 8 positions'
 *      dot products summed by sum8_ps, into a buffer; then per head the soft cap,
 *      the mask past the context and the max. One head at a time (each K row loaded
 *      again from L1 per head) took ~1.35x as long with the cache in L3 (session 48,
 *      cpu_decode_attention.py --layers 1 --threads 1 --context 1000);
 *   2. per head the segment's max, one rescale of the running sum and output by
 *      e^(old max - new max), and p = e^(s - max) 8 lanes at a time;
 *   3. acc[g] += p[g][j] V_j, a slice of up to 4 vectors (32 dims) of every head of
 *      the group in 12 registers, so each V row is read once per group and the FMAs
 *      of a position are independent.
 * The previous body ran the softmax state (a max, a scalar exp, a rescale of the
 * accumulators) after every 8 positions and read each V row once per query head; this
 * one was 1.3-1.5x faster at 912-position contexts on a 2-core Zen 3 and level at 228
 * (benchmarks/cpu_decode_attention.py, docs/benchmarks.md session 47), where reading
 * the cache (its blocks scattered over it) takes about half the time. The sums are
 * float32 as before, in another order (the segment rescaling of flash-decoding, Dao et
 * al. 2023).
 * The rows a pass reads next are prefetched ATT2_AHEAD positions ahead: K rows in pass 1,
 * V rows in pass 3's first slice, and the next segment's first K rows before pass 3. A
 * block's rows of one KV head are 256-byte pieces 768 bytes apart (the other heads' rows
 * between them) and blocks lie anywhere in the cache, which the hardware prefetchers
 * do not follow: 30 layers' caches from memory (benchmarks/cpu_decode_attention.py,
 * context 200, 2 threads, Zen 3, paired rounds in one process, session 49) took 0.82-0.89
 * of the time at 16 requests, 0.73 at 4, 0.70 with bf16 caches at 16; 1 request level.
 * Prefetching all heads' rows of a position from the group's first head was 1.05-1.10x
 * slower. */
#define ATT2_GH 3
#define ATT2_SEG 64
#define ATT2_AHEAD 8

/* acc[g][c0 .. c0 + 8 W) += sum_j p[g][j] V_j over n positions, for gh heads (W and
 * GH constants after inlining: GH * W <= 12 accumulators). */
AVX2 static inline __attribute__((always_inline)) void
pv_slice_avx2(const char *const *vrows, int64_t n, const float *p, int64_t c0, const int W,
              const int GH, float *acc, int64_t d, const int KB)
{
    const int64_t esz = KB ? 2 : 4;
    __m256 r[ATT2_GH][4];
    for (int g = 0; g < GH; g++)
        for (int w = 0; w < W; w++)
            r[g][w] = _mm256_loadu_ps(acc + g * d + c0 + 8 * w);
    for (int64_t j = 0; j < n; j++) {
        if (c0 == 0 && j + ATT2_AHEAD < n)
            for (int64_t l = 0; l < d * esz; l += 64)
                _mm_prefetch(vrows[j + ATT2_AHEAD] + l, _MM_HINT_T0);
        __m256 v[4];
        for (int w = 0; w < W; w++)
            v[w] = load_kv8(vrows[j] + (c0 + 8 * w) * esz, KB);
        for (int g = 0; g < GH; g++) {
            const __m256 pb = _mm256_broadcast_ss(p + g * ATT2_SEG + j);
            for (int w = 0; w < W; w++)
                r[g][w] = _mm256_fmadd_ps(pb, v[w], r[g][w]);
        }
    }
    for (int g = 0; g < GH; g++)
        for (int w = 0; w < W; w++)
            _mm256_storeu_ps(acc + g * d + c0 + 8 * w, r[g][w]);
}

AVX2 static inline __attribute__((always_inline)) void
pv_avx2(const char *const *vrows, int64_t n, const float *p, const int GH, float *acc,
        int64_t d, const int KB)
{
    int64_t c0 = 0;
    for (; c0 + 32 <= d; c0 += 32)
        pv_slice_avx2(vrows, n, p, c0, 4, GH, acc, d, KB);
    switch ((d - c0) / 8) {
    case 3: pv_slice_avx2(vrows, n, p, c0, 3, GH, acc, d, KB); break;
    case 2: pv_slice_avx2(vrows, n, p, c0, 2, GH, acc, d, KB); break;
    case 1: pv_slice_avx2(vrows, n, p, c0, 1, GH, acc, d, KB); break;
    default: break;
    }
}

/* sc[g * ATT2_SEG + j] = q[g] . K_j for j < n (<= ATT2_SEG; the lanes past n of the
 * last 8 are 0) and g < GH (a constant after inlining): each K row is loaded once for
 * the GH heads, two FMA chains per head (even and odd 8-value slices, as before). */
AVX2 static inline __attribute__((always_inline)) void
scores_avx2(const char *const *krows, int64_t n, float q[][MAX_D], const int GH, int64_t d,
            const int KB, float *sc)
{
    const int64_t esz = KB ? 2 : 4, nv = d / 8;
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const int64_t m = n - j0 < 8 ? n - j0 : 8;
        __m256 t[ATT2_GH][8];
        for (int64_t j = 0; j < 8; j++) {
            if (j >= m) {
                for (int g = 0; g < GH; g++)
                    t[g][j] = _mm256_setzero_ps();
                continue;
            }
            const char *kr = krows[j0 + j];
            if (j0 + j + ATT2_AHEAD < n)
                for (int64_t l = 0; l < d * esz; l += 64)
                    _mm_prefetch(krows[j0 + j + ATT2_AHEAD] + l, _MM_HINT_T0);
            __m256 e[ATT2_GH], o[ATT2_GH];
            for (int g = 0; g < GH; g++)
                e[g] = o[g] = _mm256_setzero_ps();
            int64_t c = 0;
            for (; c + 2 <= nv; c += 2) {
                const __m256 k0 = load_kv8(kr + 8 * esz * c, KB);
                const __m256 k1 = load_kv8(kr + 8 * esz * (c + 1), KB);
                for (int g = 0; g < GH; g++) {
                    e[g] = _mm256_fmadd_ps(_mm256_load_ps(q[g] + 8 * c), k0, e[g]);
                    o[g] = _mm256_fmadd_ps(_mm256_load_ps(q[g] + 8 * c + 8), k1, o[g]);
                }
            }
            if (c < nv) {
                const __m256 k0 = load_kv8(kr + 8 * esz * c, KB);
                for (int g = 0; g < GH; g++)
                    e[g] = _mm256_fmadd_ps(_mm256_load_ps(q[g] + 8 * c), k0, e[g]);
            }
            for (int g = 0; g < GH; g++)
                t[g][j] = _mm256_add_ps(e[g], o[g]);
        }
        for (int g = 0; g < GH; g++)
            _mm256_store_ps(sc + g * ATT2_SEG + j0, sum8_ps(t[g]));
    }
}

AVX2 static inline __attribute__((always_inline)) void
attend_group_avx2(const attn_args *a, int64_t i, int64_t h, int64_t start, int64_t len,
                  float *part, const int KB)
{
    const int64_t G = a->hq / a->hkv, d = a->d, nv = d / 8, bs = a->block_size;
    const int64_t tok = a->tok_idx[i];
    const int32_t *bt = a->block_tables + a->req_idx[i] * a->bt_stride;
    const int64_t esz = KB ? 2 : 4;
    const char *cache = (const char *)a->cache;
    const int64_t plane = a->num_blocks * bs * a->hkv * d * esz; /* bytes */
    const __m256 lane = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    float q[ATT2_GH][MAX_D] __attribute__((aligned(32)));
    float acc[ATT2_GH * MAX_D], sc[ATT2_GH * ATT2_SEG] __attribute__((aligned(32)));
    const char *krows[ATT2_SEG], *vrows[ATT2_SEG];
    for (int64_t g0 = 0; g0 < G; g0 += ATT2_GH) {
        const int gh = G - g0 < ATT2_GH ? (int)(G - g0) : ATT2_GH;
        float mx[ATT2_GH], den[ATT2_GH];
        for (int g = 0; g < gh; g++) {
            const float *qg = (const float *)a->q + (tok * a->hq + h * G + g0 + g) * d;
            for (int64_t e = 0; e < d; e++)
                q[g][e] = qg[e] * a->scale;
            mx[g] = -INFINITY;
            den[g] = 0.f;
        }
        memset(acc, 0, (size_t)gh * d * sizeof(float));
        int64_t blk = start / bs, off = start % bs;
        for (int64_t s0 = start; s0 < len; s0 += ATT2_SEG) {
            const int64_t n = len - s0 < ATT2_SEG ? len - s0 : ATT2_SEG;
            for (int64_t j = 0; j < n; j++) { /* walk the block table, no division per row */
                krows[j] = cache + (((int64_t)bt[blk] * bs + off) * a->hkv + h) * d * esz;
                vrows[j] = krows[j] + plane;
                if (++off == bs) {
                    off = 0;
                    blk++;
                }
            }
            switch (gh) { /* pass 1: the scores of every head of the group */
            case 3: scores_avx2(krows, n, q, 3, d, KB, sc); break;
            case 2: scores_avx2(krows, n, q, 2, d, KB, sc); break;
            default: scores_avx2(krows, n, q, 1, d, KB, sc); break;
            }
            for (int g = 0; g < gh; g++) {
                float *sg = sc + g * ATT2_SEG;
                __m256 smax = _mm256_set1_ps(-INFINITY);
                for (int64_t j0 = 0; j0 < n; j0 += 8) { /* the scores' cap, mask and max */
                    const int64_t m = n - j0 < 8 ? n - j0 : 8;
                    __m256 s = _mm256_load_ps(sg + j0);
                    if (a->soft_cap > 0.f) {
                        float tmp[8];
                        _mm256_storeu_ps(tmp, s);
                        for (int64_t j = 0; j < m; j++)
                            tmp[j] = a->soft_cap * tanhf(tmp[j] / a->soft_cap);
                        s = _mm256_loadu_ps(tmp);
                    }
                    const __m256 live = _mm256_cmp_ps(lane, _mm256_set1_ps((float)m), _CMP_LT_OQ);
                    s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, live);
                    smax = _mm256_max_ps(smax, s);
                    _mm256_store_ps(sg + j0, s);
                }
                /* pass 2: the new max, the rescale, the probabilities */
                const float cmax = hmax_avx2(smax), m_new = cmax > mx[g] ? cmax : mx[g];
                const float corr = mx[g] == -INFINITY ? 0.f : expf(mx[g] - m_new);
                den[g] = den[g] * corr + softmax_weights_avx2(sg, n, m_new);
                mx[g] = m_new;
                if (corr != 1.f) {
                    const __m256 cv = _mm256_set1_ps(corr);
                    for (int64_t c = 0; c < nv; c++)
                        _mm256_storeu_ps(acc + g * d + 8 * c,
                                         _mm256_mul_ps(_mm256_loadu_ps(acc + g * d + 8 * c), cv));
                }
            }
            /* the next segment's first K rows, while this one's V rows are read */
            for (int64_t j = 0, b2 = blk, o2 = off; j < ATT2_AHEAD && s0 + n + j < len; j++) {
                const char *kp = cache + (((int64_t)bt[b2] * bs + o2) * a->hkv + h) * d * esz;
                for (int64_t l = 0; l < d * esz; l += 64)
                    _mm_prefetch(kp + l, _MM_HINT_T0);
                if (++o2 == bs) {
                    o2 = 0;
                    b2++;
                }
            }
            switch (gh) { /* pass 3: acc += p V */
            case 3: pv_avx2(vrows, n, sc, 3, acc, d, KB); break;
            case 2: pv_avx2(vrows, n, sc, 2, acc, d, KB); break;
            default: pv_avx2(vrows, n, sc, 1, acc, d, KB); break;
            }
        }
        for (int g = 0; g < gh; g++) {
            if (part != NULL) { /* a part of the context: its sums, max and denominator */
                float *pg = part + (g0 + g) * (d + 2);
                memcpy(pg, acc + g * d, (size_t)d * sizeof(float));
                pg[d] = mx[g];
                pg[d + 1] = den[g];
                continue;
            }
            float *o = (float *)a->out + (tok * a->hq + h * G + g0 + g) * d;
            const __m256 inv = _mm256_set1_ps(den[g] > 0.f ? 1.f / den[g] : 0.f);
            for (int64_t c = 0; c < nv; c++)
                _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + g * d + 8 * c), inv));
        }
    }
}

/* KV head h of request i by attend_group_avx2 for float32 queries with head_dim a
 * multiple of 8; the portable code, vectorised by the compiler for AVX2 + FMA,
 * otherwise (bf16 queries). */
AVX2 static void attend_range_avx2(const attn_args *a, int64_t w0, int64_t w1)
{
    const int chunked = !a->q_bf16 && a->d % 8 == 0;
    for (int64_t w = w0; w < w1; w++) {
        const int64_t i = w / a->hkv, h = w % a->hkv;
        const int64_t len = a->seq_lens[i];
        const int64_t start = attn_start(a, len);
        if (!chunked)
            attend_one(a, i, h);
        else if (a->kv_fmt == KV_F16)
            attend_group_avx2(a, i, h, start, len, NULL, KV_F16);
        else if (a->kv_fmt == KV_BF16)
            attend_group_avx2(a, i, h, start, len, NULL, KV_BF16);
        else
            attend_group_avx2(a, i, h, start, len, NULL, KV_F32);
    }
}

/* Context positions per part of a long context (attend_part_avx2). Paired rounds
 * (30 layers' caches from memory, 2 threads, Zen 3, session 49): one request of 1000
 * positions took 0.86 / 0.88 / 0.91 of the unsplit time with parts of 128 / 256 / 512;
 * at 200 positions parts of 128 took 1.05-1.09 of it; at 4 or 16 requests no gain. */
#define ATT2_PART 256

/* The number of parts of request i's context: it depends on the request's own context
 * alone, so that a request's output does not depend on the batch or the threads. */
static inline int64_t att2_parts(const attn_args *a, int64_t i)
{
    const int64_t len = a->seq_lens[i];
    const int64_t start = attn_start(a, len);
    return len - start > ATT2_PART ? (len - start + ATT2_PART - 1) / ATT2_PART : 1;
}

/* Item c of a split pass: request i with part_off[i] <= c < part_off[i + 1], its KV
 * head and part. A request of one part is written as the unsplit body writes it; a
 * part of a longer one leaves its unnormalised sums, max and denominator in
 * a->partial for attend_merge. Splitting a long context keeps both cores busy at one or
 * two requests (3 KV heads on 2 threads left one idle a third of the time). */
AVX2 static void attend_part_avx2(const attn_args *a, int64_t c)
{
    int64_t lo = 0, hi = a->num_reqs; /* the last i with part_off[i] <= c */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (a->part_off[mid] <= c)
            lo = mid;
        else
            hi = mid;
    }
    const int64_t i = lo, np = att2_parts(a, i), len = a->seq_lens[i];
    const int64_t h = (c - a->part_off[i]) / np, p = (c - a->part_off[i]) % np;
    const int64_t start = attn_start(a, len);
    const int64_t first = start + p * ATT2_PART;
    const int64_t last = np == 1 ? len : (first + ATT2_PART < len ? first + ATT2_PART : len);
    float *part = np == 1 ? NULL : a->partial + c * (a->hq / a->hkv) * (a->d + 2);
    if (a->kv_fmt == KV_F16)
        attend_group_avx2(a, i, h, first, last, part, KV_F16);
    else if (a->kv_fmt == KV_BF16)
        attend_group_avx2(a, i, h, first, last, part, KV_BF16);
    else
        attend_group_avx2(a, i, h, first, last, part, KV_F32);
}

/* The outputs of the split requests from their parts' sums (flash-decoding's
 * reduction: Dao et al. 2023): max M over the parts, den = sum den_p e^(m_p - M),
 * out = sum acc_p e^(m_p - M) / den, the parts in order. */
static void attend_merge(const attn_args *a)
{
    const int64_t G = a->hq / a->hkv, d = a->d;
    for (int64_t w = 0; w < a->num_reqs * a->hkv; w++) {
        const int64_t i = w / a->hkv, h = w % a->hkv, np = att2_parts(a, i);
        if (np == 1)
            continue;
        const float *parts = a->partial + (a->part_off[i] + h * np) * G * (d + 2);
        for (int64_t g = 0; g < G; g++) {
            float m = -INFINITY, den = 0.f;
            for (int64_t p = 0; p < np; p++) {
                const float mp = parts[(p * G + g) * (d + 2) + d];
                m = mp > m ? mp : m;
            }
            float *o = (float *)a->out + (a->tok_idx[i] * a->hq + h * G + g) * d;
            for (int64_t c = 0; c < d; c++)
                o[c] = 0.f;
            for (int64_t p = 0; p < np; p++) {
                const float *pg = parts + (p * G + g) * (d + 2);
                if (pg[d] == -INFINITY)
                    continue;
                const float f = expf(pg[d] - m);
                den += pg[d + 1] * f;
                for (int64_t c = 0; c < d; c++)
                    o[c] += pg[c] * f;
            }
            const float inv = den > 0.f ? 1.f / den : 0.f;
            for (int64_t c = 0; c < d; c++)
                o[c] *= inv;
        }
    }
}

/* e^x for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r
 * (relative error ~2e-7), times 2^n by vscalefps; x is clamped below at -87 (e^-87 ~
 * 1.6e-38 there, not 0). */
AVX512 static inline __m512 exp_avx512(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* Lane j of the result: the sum of the 16 lanes of t[j] (a 16 x 16 transpose-add in 4
 * levels, ~3 instructions per sum where a horizontal reduction of each takes ~8 and a
 * long dependency chain). */
AVX512 static inline __m512 sum16_ps(const __m512 *t)
{
    __m512 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: t[2i]'s partial sums, 8-15: t[2i+1]'s */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit block k: 4 partial sums of t[4i + k] */
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* block k: 2 sums of t[8i + k], then 2 of t[8i + 4 + k] */
        z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
    /* block k: t[k], t[4 + k], t[8 + k], t[12 + k] */
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),
                             _mm512_shuffle_ps(z[0], z[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, r);
}

/* 16 cache values at p as float32: float32, or bf16 / float16 (KB) widened exactly. */
AVX512 static inline __attribute__((always_inline)) __m512 load_kv16(const char *p, const int KB)
{
    if (KB == KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (KB == KV_BF16)
        return bf16_load16_avx512((const uint16_t *)p);
    return _mm512_loadu_ps((const float *)p);
}

/* Float32 queries, a float32 or (KB) bf16 / float16 cache, head_dim a multiple of 16: query
 * heads g0..g0 + HG - 1 of KV head h over request i's context, 16 positions at a time.
 * Each K and V row is loaded (and a bf16 one widened, exactly) once for the HG heads:
 * the scores of the 16 positions for every head (summed by sum16_ps), one vector exp
 * per head and chunk (the online softmax by chunks), then the weighted V rows; the next
 * 16 positions' K and V rows are prefetched (a context's blocks lie anywhere in the
 * cache, out of the hardware prefetcher's reach). HG * NV accumulators stay in
 * registers (HG * NV <= 16), HG and NV constants after inlining. */
AVX512 static inline __attribute__((always_inline)) void
attend_heads_nv(const attn_args *a, int64_t i, int64_t h, int64_t g0, const int HG,
                const int64_t nv, const int KB)
{
    const int64_t G = a->hq / a->hkv, d = a->d, bs = a->block_size;
    const int64_t len = a->seq_lens[i], tok = a->tok_idx[i];
    const int32_t *bt = a->block_tables + a->req_idx[i] * a->bt_stride;
    const int64_t esz = KB ? 2 : 4, vs = 16 * esz;
    const char *cache = (const char *)a->cache;
    const int64_t plane = a->num_blocks * bs * a->hkv * d * esz; /* bytes */
    __m512 acc[HG][MAX_D / 16];
    float q[HG][MAX_D] __attribute__((aligned(64))), mx[HG], den[HG];
    for (int g = 0; g < HG; g++) {
        const float *qg = (const float *)a->q + (tok * a->hq + h * G + g0 + g) * d;
        for (int64_t e = 0; e < d; e++)
            q[g][e] = qg[e] * a->scale;
        for (int64_t c = 0; c < nv; c++)
            acc[g][c] = _mm512_setzero_ps();
        mx[g] = -INFINITY;
        den[g] = 0.f;
    }
    const int64_t start = attn_start(a, len);
    /* positions walk the block table: (blk, off) of the next row, no division per row */
    int64_t blk = start / bs, off = start % bs;
#define KV_NEXT(dst)                                                                    \
    do {                                                                                \
        (dst) = cache + (((int64_t)bt[blk] * bs + off) * a->hkv + h) * d * esz;          \
        if (++off == bs) {                                                              \
            off = 0;                                                                    \
            blk++;                                                                      \
        }                                                                               \
    } while (0)
    const char *rows[32]; /* this chunk's 16 rows, then the next chunk's */
    const int64_t first = len - start < 16 ? len - start : 16;
    for (int64_t j = 0; j < first; j++)
        KV_NEXT(rows[16 + j]);
    for (int64_t j0 = start; j0 < len; j0 += 16) {
        const int64_t n = len - j0 < 16 ? len - j0 : 16;
        for (int64_t j = 0; j < n; j++)
            rows[j] = rows[16 + j];
        const int64_t nn = len - j0 - 16 < 16 ? len - j0 - 16 : 16;
        for (int64_t j = 0; j < nn; j++) { /* the next chunk's rows, prefetched */
            KV_NEXT(rows[16 + j]);
            const char *k = rows[16 + j];
            for (int64_t o = 0; o < d * esz; o += 64) {
                _mm_prefetch(k + o, _MM_HINT_T0);
                _mm_prefetch(k + plane + o, _MM_HINT_T0);
            }
        }
        const __mmask16 live = (__mmask16)((1u << n) - 1);
        __m512 t[HG][16]; /* t[g][j]: lanes summing to head g's score of position j */
        for (int64_t j = 0; j < 16; j++) {
            if (j >= n) {
                for (int g = 0; g < HG; g++)
                    t[g][j] = _mm512_setzero_ps();
                continue;
            }
            __m512 kv[MAX_D / 16];
            for (int64_t c = 0; c < nv; c++)
                kv[c] = load_kv16(rows[j] + vs * c, KB);
            for (int g = 0; g < HG; g++) {
                __m512 v = _mm512_mul_ps(_mm512_load_ps(q[g]), kv[0]);
                __m512 u = _mm512_setzero_ps(); /* two chains: half the latency */
                for (int64_t c = 1; c < nv; c++) {
                    if (c % 2)
                        u = _mm512_fmadd_ps(_mm512_load_ps(q[g] + 16 * c), kv[c], u);
                    else
                        v = _mm512_fmadd_ps(_mm512_load_ps(q[g] + 16 * c), kv[c], v);
                }
                t[g][j] = _mm512_add_ps(v, u);
            }
        }
        float pj[HG][16] __attribute__((aligned(64)));
        for (int g = 0; g < HG; g++) {
            __m512 s = sum16_ps(t[g]);
            if (a->soft_cap > 0.f) {
                float sc[16];
                _mm512_storeu_ps(sc, s);
                for (int64_t j = 0; j < n; j++)
                    sc[j] = a->soft_cap * tanhf(sc[j] / a->soft_cap);
                s = _mm512_loadu_ps(sc);
            }
            s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s);
            float cmax = _mm512_reduce_max_ps(s);
            float m_new = cmax > mx[g] ? cmax : mx[g];
            float corr = mx[g] == -INFINITY ? 0.f : expf(mx[g] - m_new);
            __m512 pv = _mm512_maskz_mov_ps(live,
                                            exp_avx512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
            den[g] = den[g] * corr + _mm512_reduce_add_ps(pv);
            mx[g] = m_new;
            _mm512_store_ps(pj[g], pv);
            const __m512 vc = _mm512_set1_ps(corr);
            for (int64_t c = 0; c < nv; c++)
                acc[g][c] = _mm512_mul_ps(acc[g][c], vc);
        }
        for (int64_t j = 0; j < n; j++) { /* acc[g] += p[g][j] V row j */
            __m512 vv[MAX_D / 16];
            for (int64_t c = 0; c < nv; c++)
                vv[c] = load_kv16(rows[j] + plane + vs * c, KB);
            for (int g = 0; g < HG; g++) {
                const __m512 p = _mm512_set1_ps(pj[g][j]);
                for (int64_t c = 0; c < nv; c++)
                    acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
            }
        }
    }
#undef KV_NEXT
    for (int g = 0; g < HG; g++) {
        float *o = (float *)a->out + (tok * a->hq + h * G + g0 + g) * d;
        __m512 inv = _mm512_set1_ps(den[g] > 0.f ? 1.f / den[g] : 0.f);
        for (int64_t c = 0; c < nv; c++)
            _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[g][c], inv));
    }
}

/* The query heads of KV head h in groups of HG = 16 / NV (NV = head_dim / 16 a constant
 * for the common head sizes, 64 and 128: loops unrolled, accumulators in registers),
 * one at a time for other sizes; KB a constant too. */
AVX512 static inline __attribute__((always_inline)) void
attend_one_f32_kb(const attn_args *a, int64_t i, int64_t h, const int KB)
{
    const int64_t G = a->hq / a->hkv;
    for (int64_t g0 = 0; g0 < G;) {
        const int64_t left = G - g0;
        if (a->d == 64) {
            switch (left >= 4 ? 4 : left) {
            case 4: attend_heads_nv(a, i, h, g0, 4, 4, KB); g0 += 4; break;
            case 3: attend_heads_nv(a, i, h, g0, 3, 4, KB); g0 += 3; break;
            case 2: attend_heads_nv(a, i, h, g0, 2, 4, KB); g0 += 2; break;
            default: attend_heads_nv(a, i, h, g0, 1, 4, KB); g0 += 1; break;
            }
        } else if (a->d == 128) {
            if (left >= 2) {
                attend_heads_nv(a, i, h, g0, 2, 8, KB);
                g0 += 2;
            } else {
                attend_heads_nv(a, i, h, g0, 1, 8, KB);
                g0 += 1;
            }
        } else {
            attend_heads_nv(a, i, h, g0, 1, a->d / 16, KB);
            g0 += 1;
        }
    }
}

/* One copy of the body per cache dtype. */
AVX512 static void attend_one_f32_avx512(const attn_args *a, int64_t i, int64_t h)
{
    if (a->kv_fmt == KV_F16)
        attend_one_f32_kb(a, i, h, KV_F16);
    else if (a->kv_fmt == KV_BF16)
        attend_one_f32_kb(a, i, h, KV_BF16);
    else
        attend_one_f32_kb(a, i, h, KV_F32);
}

/* The same code as attend_one, vectorised by the compiler for AVX-512, or the chunked
 * body above for float32 queries (float32 or bf16 caches). */
AVX512 static void attend_range_avx512(const attn_args *a, int64_t w0, int64_t w1)
{
    const int chunked = !a->q_bf16 && a->d % 16 == 0;
    for (int64_t w = w0; w < w1; w++) {
        if (chunked)
            attend_one_f32_avx512(a, w / a->hkv, w % a->hkv);
        else
            attend_one(a, w / a->hkv, w % a->hkv);
    }
}
#endif

static void attention_chunk(const void *ctx, int64_t c)
{
    const attn_args *a = (const attn_args *)ctx;
#if HAVE_X86
    if (a->part_off != NULL) {
        attend_part_avx2(a, c);
        return;
    }
#endif
    const int64_t w0 = c * a->wchunk, work = a->num_reqs * a->hkv;
    const int64_t w1 = w0 + a->wchunk < work ? w0 + a->wchunk : work;
#if HAVE_X86
    if (use_avx512()) {
        attend_range_avx512(a, w0, w1);
        return;
    }
    if (use_avx2()) {
        attend_range_avx2(a, w0, w1);
        return;
    }
#endif
    attend_range_c(a, w0, w1);
}

/* The attention of `a` with up to nth threads; call without the GIL. A pool chunk is
 * one request's KV heads (one core reads the request's blocks) where there are at least
 * two requests per thread and no request's context is more than a thread's share of
 * all of them (a long one would leave the other threads idle), else one (request, KV
 * head). The AVX2 body on a CPU without AVX-512 runs a batch with a context of more
 * than ATT2_PART positions as one chunk per (request, KV head, part) instead, then
 * merges the parts (attend_part_avx2, attend_merge). */
static void attention_impl(const attn_args *a0, int nth)
{
    attn_args a = *a0;
    int64_t work = a.num_reqs * a.hkv, total = 0, longest = 0;
    for (int64_t i = 0; i < a.num_reqs; i++) {
        total += a.seq_lens[i];
        longest = a.seq_lens[i] > longest ? a.seq_lens[i] : longest;
    }
    a.wchunk = a.num_reqs >= 2 * (int64_t)nth && longest * nth <= total ? a.hkv : 1;
    a.part_off = NULL;
    a.partial = NULL;
#if HAVE_X86
    /* The AVX2 body (float32 queries, head_dim a multiple of 8) splits long contexts:
     * the items' offsets, then their partial sums (~G / 512 of the KV cache's bytes) */
    int split = 0;
    if (use_avx2() && !use_avx512() && !a.q_bf16 && a.d % 8 == 0 && a.d <= MAX_D)
        for (int64_t i = 0; i < a.num_reqs && !split; i++)
            split = att2_parts(&a, i) > 1;
    if (split) {
        static __thread int64_t *off = NULL, off_cap = 0;
        static __thread float *buf = NULL;
        static __thread int64_t cap = 0;
        if (off_cap < a.num_reqs + 1) {
            free(off);
            off = (int64_t *)malloc((size_t)(a.num_reqs + 1) * sizeof(int64_t));
            off_cap = off != NULL ? a.num_reqs + 1 : 0;
        }
        int64_t items = 0;
        if (off != NULL) {
            off[0] = 0;
            for (int64_t i = 0; i < a.num_reqs; i++)
                off[i + 1] = off[i] + a.hkv * att2_parts(&a, i);
            items = off[a.num_reqs];
            const int64_t need = items * (a.hq / a.hkv) * (a.d + 2);
            if (cap < need) {
                free(buf);
                buf = (float *)malloc((size_t)need * sizeof(float));
                cap = buf != NULL ? need : 0;
            }
        }
        if (off != NULL && buf != NULL) { /* else the unsplit pass */
            a.part_off = off;
            a.partial = buf;
            pool_run(attention_chunk, &a, items, nth < items ? nth : (int)items);
            attend_merge(&a);
            return;
        }
    }
#endif
    const int64_t chunks = (work + a.wchunk - 1) / a.wchunk;
    if (nth > chunks)
        nth = (int)(chunks > 0 ? chunks : 1);
    pool_run(attention_chunk, &a, chunks, nth);
}

/* paged_decode_attention(q, q_bf16, tok_idx, req_idx, num_reqs, hq, hkv, d, cache,
 *     kv_fmt, num_blocks, block_size, block_tables, bt_stride, seq_lens, scale,
 *     soft_cap, window, out, num_threads); kv_fmt: KV_F32, KV_BF16 or KV_F16 */
static PyObject *py_paged_decode_attention(PyObject *self, PyObject *args)
{
    attn_args a;
    unsigned long long qp, tp, rp, cp, bp, sp, op;
    long long nr, hq, hkv, d, nblocks, bs, bts, window;
    int qbf, kvbf, nth;
    double scale, cap;
    if (!PyArg_ParseTuple(args, "KiKKLLLLKiLLKLKddLKi", &qp, &qbf, &tp, &rp, &nr, &hq, &hkv, &d,
                          &cp, &kvbf, &nblocks, &bs, &bp, &bts, &sp, &scale, &cap, &window,
                          &op, &nth))
        return NULL;
    if (d > MAX_D || hkv < 1 || hq % hkv != 0 || hq / hkv > MAX_G || nth < 1) {
        PyErr_Format(PyExc_ValueError,
                     "paged_decode_attention: head_dim %lld (max %d), heads %lld/%lld (group "
                     "max %d) not supported", d, MAX_D, hq, hkv, MAX_G);
        return NULL;
    }
    if (kvbf < KV_F32 || kvbf > KV_F16) {
        PyErr_Format(PyExc_ValueError, "paged_decode_attention: KV format %d", kvbf);
        return NULL;
    }
    a.q = (const void *)(uintptr_t)qp;
    a.cache = (const void *)(uintptr_t)cp;
    a.out = (void *)(uintptr_t)op;
    a.tok_idx = (const int64_t *)(uintptr_t)tp;
    a.req_idx = (const int64_t *)(uintptr_t)rp;
    a.block_tables = (const int32_t *)(uintptr_t)bp;
    a.seq_lens = (const int32_t *)(uintptr_t)sp;
    a.num_reqs = nr;
    a.hq = hq;
    a.hkv = hkv;
    a.d = d;
    a.block_size = bs;
    a.num_blocks = nblocks;
    a.bt_stride = bts;
    a.q_bf16 = qbf;
    a.kv_fmt = kvbf;
    a.scale = (float)scale;
    a.soft_cap = (float)cap;
    a.window = window;
    Py_BEGIN_ALLOW_THREADS
    attention_impl(&a, nth);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ prefill attention
 *
 * Causal attention of prompt chunks over the paged KV cache (the chunk's own K/V
 * written there first), float32 queries and outputs, float32 or bf16 caches, for CPUs
 * with AVX2 + FMA. PyTorch's CPU flash-attention kernel took 0.56 ms for one 128-token
 * prompt of the default model's attention (9 query heads, 3 KV heads, head_dim 64),
 * ~6x its multiply-adds at this CPU's FMA rate, and one request per query token through
 * the decode kernel about as long. Here a work item is (request, KV head, a block of
 * qb query tokens): its M = qb x group query vectors (one per token and query head of
 * the KV head) pass over the keys up to the block's last position in segments of
 * PF_SEG positions, flash-attention style (Dao et al. 2022: per segment the scores,
 * an online softmax with one rescale of the running sums, then the weighted values):
 *   1. the segment's K rows transposed into kt[d][PF_SEG] (8 x 8 float transposes);
 *   2. S[M][PF_SEG] = Q kt by a register tile of up to 6 query vectors x 16 positions
 *      (12 accumulators: per dimension two loads of kt, six broadcasts, 12 FMAs);
 *   3. per query vector the mask (position > its own, or before its sliding window),
 *      the new max, e^(old max - new max) on its running sum and output, p = e^(s - max);
 *   4. O[M][d] += P V by a tile of up to 6 query vectors x 16 dimensions, V rows read
 *      from the cache.
 * Sums are float32 throughout; e^x is exp_avx2 (relative error ~2e-7). */
#if HAVE_X86
#define PF_SEG 64
#define PF_M 48 /* query vectors per work item, about: qb = max(1, PF_M / group) */

typedef struct {
    const float *q; /* [T, hq, d] */
    float *out;     /* [T, hq, d]: the rows of the listed requests' tokens */
    const char *cache;
    int kv_fmt; /* KV_F32, KV_BF16 or KV_F16 */
    int64_t hq, hkv, d, block_size, num_blocks, bt_stride;
    const int32_t *block_tables; /* row r: request r */
    const int64_t *query_start;  /* [R + 1] */
    const int32_t *seq_lens;     /* [R]: context length with this step's tokens */
    const int64_t *reqs;         /* the requests to attend */
    const int64_t *item_start;   /* [len(reqs) + 1]: first work item of each */
    int64_t nreqs, qb;
    float scale;
    int64_t window; /* 0: the whole context */
    volatile int failed; /* a worker could not allocate its scratch */
} pf_args;

AVX2 static inline void transpose8x8_ps(__m256 r[8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* S[m0 + r][j0 .. j0 + 16) = Q[m0 + r] . kt[.][j0 .. j0 + 16) for r < TR (constant). */
AVX2 static inline __attribute__((always_inline)) void
pf_scores_tile(const float *Q, const float *kt, int64_t d, int64_t m0, const int TR,
               int64_t j0, float *S)
{
    __m256 lo[6], hi[6];
    for (int r = 0; r < TR; r++)
        lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c++) {
        const __m256 k0 = _mm256_load_ps(kt + c * PF_SEG + j0);
        const __m256 k1 = _mm256_load_ps(kt + c * PF_SEG + j0 + 8);
        for (int r = 0; r < TR; r++) {
            const __m256 qb = _mm256_broadcast_ss(Q + (m0 + r) * d + c);
            lo[r] = _mm256_fmadd_ps(qb, k0, lo[r]);
            hi[r] = _mm256_fmadd_ps(qb, k1, hi[r]);
        }
    }
    for (int r = 0; r < TR; r++) {
        _mm256_store_ps(S + (m0 + r) * PF_SEG + j0, lo[r]);
        _mm256_store_ps(S + (m0 + r) * PF_SEG + j0 + 8, hi[r]);
    }
}

/* O[m0 + r][c0 .. c0 + 8 W) = O * corr[m0 + r] + sum_j P[m0 + r][j] V_j[c0 ..] over the
 * n positions, r < TR and W <= 2 (constants). */
AVX2 static inline __attribute__((always_inline)) void
pf_pv_tile(const char *const *vrows, int64_t n, const float *P, const float *corr,
           int64_t m0, const int TR, int64_t c0, const int W, float *O, int64_t d,
           const int KB)
{
    const int64_t esz = KB ? 2 : 4;
    __m256 acc[6][2];
    for (int r = 0; r < TR; r++) {
        const __m256 cr = _mm256_broadcast_ss(corr + m0 + r);
        for (int w = 0; w < W; w++)
            acc[r][w] = _mm256_mul_ps(_mm256_loadu_ps(O + (m0 + r) * d + c0 + 8 * w), cr);
    }
    for (int64_t j = 0; j < n; j++) {
        __m256 v[2];
        for (int w = 0; w < W; w++)
            v[w] = load_kv8(vrows[j] + (c0 + 8 * w) * esz, KB);
        for (int r = 0; r < TR; r++) {
            const __m256 pb = _mm256_broadcast_ss(P + (m0 + r) * PF_SEG + j);
            for (int w = 0; w < W; w++)
                acc[r][w] = _mm256_fmadd_ps(pb, v[w], acc[r][w]);
        }
    }
    for (int r = 0; r < TR; r++)
        for (int w = 0; w < W; w++)
            _mm256_storeu_ps(O + (m0 + r) * d + c0 + 8 * w, acc[r][w]);
}

/* Floats of a work item's scratch for M query vectors of head_dim d (pf_item's
 * layout: Q, O, kt, S, max, denominator, rescale factor, positions). */
static inline int64_t pf_scratch_floats(int64_t M, int64_t d)
{
    return 2 * M * d + d * PF_SEG + M * PF_SEG + 6 * M + 8;
}

AVX2 static inline __attribute__((always_inline)) void
pf_item(const pf_args *a, int64_t i, int64_t h, int64_t r0, int64_t r1, float *mem,
        const int KB)
{
    const int64_t G = a->hq / a->hkv, d = a->d, bs = a->block_size, esz = KB ? 2 : 4;
    const int64_t qs = a->query_start[i], n_new = a->query_start[i + 1] - qs;
    const int64_t ctx = a->seq_lens[i], p0 = ctx - n_new; /* position of the first token */
    const int64_t M = (r1 - r0) * G;
    const int32_t *bt = a->block_tables + i * a->bt_stride;
    const int64_t plane = a->num_blocks * bs * a->hkv * d * esz;
    float *Q = mem, *O = Q + M * d, *kt = O + M * d, *S = kt + d * PF_SEG;
    float *mx = S + M * PF_SEG, *den = mx + M, *corr = den + M;
    int64_t *pos = (int64_t *)(corr + M + (M & 1)); /* per query vector: position */
    const char *krows[PF_SEG], *vrows[PF_SEG];
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t m = (r - r0) * G + g;
            const float *src = a->q + ((qs + r) * a->hq + h * G + g) * d;
            for (int64_t c = 0; c < d; c++)
                Q[m * d + c] = src[c] * a->scale;
            memset(O + m * d, 0, (size_t)d * sizeof(float));
            mx[m] = -INFINITY;
            den[m] = 0.f;
            pos[m] = p0 + r;
        }
    const int64_t first = p0 + r0, last = p0 + r1 - 1;
    const int64_t lo = a->window > 0 && first + 1 > a->window ? first + 1 - a->window : 0;
    const __m256 lane = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    for (int64_t s0 = lo; s0 <= last; s0 += PF_SEG) {
        const int64_t n = last + 1 - s0 < PF_SEG ? last + 1 - s0 : PF_SEG;
        const int64_t n16 = (n + 15) / 16 * 16;
        for (int64_t j = 0; j < n; j++) {
            const int64_t p = s0 + j;
            krows[j] = a->cache + (((int64_t)bt[p / bs] * bs + p % bs) * a->hkv + h) * d * esz;
            vrows[j] = krows[j] + plane;
        }
        /* 1. kt[c][j] = K_j[c], zero past n */
        for (int64_t j0 = 0; j0 < n16; j0 += 8)
            for (int64_t c0 = 0; c0 < d; c0 += 8) {
                __m256 r8[8];
                for (int64_t j = 0; j < 8; j++)
                    r8[j] = j0 + j < n ? load_kv8(krows[j0 + j] + c0 * esz, KB)
                                       : _mm256_setzero_ps();
                transpose8x8_ps(r8);
                for (int64_t c = 0; c < 8; c++)
                    _mm256_store_ps(kt + (c0 + c) * PF_SEG + j0, r8[c]);
            }
        /* 2. scores */
        for (int64_t m0 = 0; m0 < M; m0 += 6)
            for (int64_t j0 = 0; j0 < n16; j0 += 16)
                switch (M - m0 < 6 ? M - m0 : 6) {
#define PFS(tr) case tr: pf_scores_tile(Q, kt, d, m0, tr, j0, S); break;
                PFS(1) PFS(2) PFS(3) PFS(4) PFS(5) PFS(6)
#undef PFS
                }
        /* 3. mask, max, rescale, probabilities */
        for (int64_t m = 0; m < M; m++) {
            float *sm = S + m * PF_SEG;
            const int64_t hi_j = pos[m] - s0; /* last key index this query sees */
            const int64_t lo_j = a->window > 0 ? pos[m] + 1 - a->window - s0 : INT64_MIN / 2;
            const __m256 vhi = _mm256_set1_ps((float)(hi_j < n - 1 ? hi_j : n - 1));
            const __m256 vlo = _mm256_set1_ps((float)(lo_j > -1 ? lo_j : -1));
            __m256 smax = _mm256_set1_ps(-INFINITY);
            for (int64_t j0 = 0; j0 < n16; j0 += 8) {
                const __m256 jj = _mm256_add_ps(lane, _mm256_set1_ps((float)j0));
                const __m256 live = _mm256_and_ps(_mm256_cmp_ps(jj, vhi, _CMP_LE_OQ),
                                                  _mm256_cmp_ps(jj, vlo, _CMP_GE_OQ));
                const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                                  _mm256_load_ps(sm + j0), live);
                smax = _mm256_max_ps(smax, s);
                _mm256_store_ps(sm + j0, s);
            }
            const float cmax = hmax_avx2(smax), m_new = cmax > mx[m] ? cmax : mx[m];
            if (m_new == -INFINITY) { /* nothing visible yet */
                corr[m] = 1.f;
                memset(sm, 0, (size_t)n16 * sizeof(float));
                continue;
            }
            corr[m] = mx[m] == -INFINITY ? 0.f : expf(mx[m] - m_new);
            den[m] = den[m] * corr[m] + softmax_weights_avx2(sm, n16, m_new);
            mx[m] = m_new;
        }
        /* 4. O = O corr + P V */
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
            const int tr = M - m0 < 6 ? (int)(M - m0) : 6;
            for (int64_t c0 = 0; c0 < d; c0 += 16) {
                const int w = d - c0 >= 16 ? 2 : 1;
#define PFV(t, ww) case 10 * (t) + (ww): \
                pf_pv_tile(vrows, n, S, corr, m0, t, c0, ww, O, d, KB); break;
                switch (10 * tr + w) {
                PFV(1, 1) PFV(2, 1) PFV(3, 1) PFV(4, 1) PFV(5, 1) PFV(6, 1)
                PFV(1, 2) PFV(2, 2) PFV(3, 2) PFV(4, 2) PFV(5, 2) PFV(6, 2)
                }
#undef PFV
            }
        }
    }
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t m = (r - r0) * G + g;
            const float inv = den[m] > 0.f ? 1.f / den[m] : 0.f;
            float *dst = a->out + ((qs + r) * a->hq + h * G + g) * d;
            for (int64_t c = 0; c < d; c++)
                dst[c] = O[m * d + c] * inv;
        }
}

/* Work item c: the request of reqs[] whose items contain it, then within the request
 * the query blocks from the last (the longest contexts, claimed first) and the KV
 * heads. */
AVX2 static void pf_chunk(const void *ctx, int64_t c)
{
    const pf_args *a = (const pf_args *)ctx;
    int64_t k = 0;
    while (a->item_start[k + 1] <= c)
        k++;
    const int64_t i = a->reqs[k], local = c - a->item_start[k];
    const int64_t n_new = a->query_start[i + 1] - a->query_start[i];
    const int64_t nblk = (n_new + a->qb - 1) / a->qb, blk = nblk - 1 - local / a->hkv;
    const int64_t h = local % a->hkv, r0 = blk * a->qb;
    const int64_t r1 = r0 + a->qb < n_new ? r0 + a->qb : n_new;
    const int64_t G = a->hq / a->hkv, M = a->qb * G, d = a->d;
    /* the thread's matmul panel scratch: no matmul runs in this thread meanwhile */
    float *mem = panel_buffer(pf_scratch_floats(M, d));
    if (mem == NULL) {
        ((pf_args *)ctx)->failed = 1;
        return;
    }
    if (a->kv_fmt == KV_F16)
        pf_item(a, i, h, r0, r1, mem, KV_F16);
    else if (a->kv_fmt == KV_BF16)
        pf_item(a, i, h, r0, r1, mem, KV_BF16);
    else
        pf_item(a, i, h, r0, r1, mem, KV_F32);
}

#endif

/* paged_prefill_attention(q, out, cache, kv_fmt, hq, hkv, d, num_blocks, block_size,
 *     block_tables, bt_stride, query_start, seq_lens, reqs, num_listed, scale, window,
 *     num_threads) */
static PyObject *py_paged_prefill_attention(PyObject *self, PyObject *args)
{
    unsigned long long qp, op, cp, btp, qsp, slp, rp;
    long long hq, hkv, d, nblocks, bs, bts, nlisted, window;
    int kvbf, nth;
    double scale;
    if (!PyArg_ParseTuple(args, "KKKiLLLLLKLKKKLdLi", &qp, &op, &cp, &kvbf, &hq, &hkv, &d,
                          &nblocks, &bs, &btp, &bts, &qsp, &slp, &rp, &nlisted, &scale,
                          &window, &nth))
        return NULL;
#if !HAVE_X86
    PyErr_SetString(PyExc_ValueError, "paged_prefill_attention needs an x86 CPU with AVX2");
    return NULL;
#else
    if (!use_avx2()) {
        PyErr_SetString(PyExc_ValueError, "paged_prefill_attention needs AVX2 and FMA");
        return NULL;
    }
    if (d % 8 || d > MAX_D || hkv < 1 || hq % hkv || hq / hkv > MAX_G || nth < 1
        || nlisted < 0 || bs < 1 || kvbf < KV_F32 || kvbf > KV_F16) {
        PyErr_Format(PyExc_ValueError, "paged_prefill_attention: head_dim %lld (a multiple "
                     "of 8 up to %d), heads %lld/%lld, KV format %d not supported", d, MAX_D,
                     hq, hkv, kvbf);
        return NULL;
    }
    const int64_t G = hq / hkv;
    pf_args a = {
        .q = (const float *)(uintptr_t)qp, .out = (float *)(uintptr_t)op,
        .cache = (const char *)(uintptr_t)cp, .kv_fmt = kvbf, .hq = hq, .hkv = hkv, .d = d,
        .block_size = bs, .num_blocks = nblocks, .bt_stride = bts,
        .block_tables = (const int32_t *)(uintptr_t)btp,
        .query_start = (const int64_t *)(uintptr_t)qsp,
        .seq_lens = (const int32_t *)(uintptr_t)slp, .reqs = (const int64_t *)(uintptr_t)rp,
        .nreqs = nlisted, .qb = PF_M / G > 1 ? PF_M / G : 1, .scale = (float)scale,
        .window = window > 0 ? window : 0, .failed = 0,
    };
    int64_t *starts = (int64_t *)malloc((size_t)(nlisted + 1) * sizeof(int64_t));
    if (starts == NULL)
        return PyErr_NoMemory();
    starts[0] = 0;
    for (int64_t k = 0; k < nlisted; k++) {
        const int64_t i = a.reqs[k];
        const int64_t n_new = a.query_start[i + 1] - a.query_start[i];
        const int64_t ctx = a.seq_lens[i];
        if (n_new < 1 || ctx < n_new) {
            free(starts);
            PyErr_Format(PyExc_ValueError, "paged_prefill_attention: request %lld has %lld "
                         "new tokens and context %lld", (long long)i, (long long)n_new,
                         (long long)ctx);
            return NULL;
        }
        if ((ctx + bs - 1) / bs > bts) {
            free(starts);
            PyErr_Format(PyExc_IndexError, "paged_prefill_attention: context %lld needs "
                         "more blocks than the table's %lld", (long long)ctx, bts);
            return NULL;
        }
        starts[k + 1] = starts[k] + (n_new + a.qb - 1) / a.qb * hkv;
    }
    a.item_start = starts;
    if (panel_buffer(pf_scratch_floats(a.qb * G, d)) == NULL) {
        free(starts);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    pool_run(pf_chunk, &a, starts[nlisted], nth);
    Py_END_ALLOW_THREADS
    free(starts);
    if (a.failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
#endif
}

/* ------------------------------------------------------------------ small per-layer ops
 *
 * The host work between a decode step's matmuls, one C call each instead of 5-10 torch
 * operators (each a few microseconds of dispatch at these sizes: [1, 576]). float32
 * only; the Python side (flowengine/model/layers/cpu_kernels.py) checks the inputs.
 */

/* rms_norm(x, res, w, eps, T, H, out, res_out): rows of x [T, H] (plus res when res is
 * not 0; the sum goes to res_out) -> out = w * (y / sqrt(mean(y^2) + eps)), as
 * transformers' LlamaRMSNorm in float32 (sum of squares in another order). */
static void rms_norm_impl(const float *x, const float *res, const float *w, float eps,
                          int64_t T, int64_t H, float *out, float *res_out)
{
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float *orow = out + t * H;
        if (res != NULL) {
            float *rr = res_out + t * H;
            const float *ri = res + t * H;
            for (int64_t i = 0; i < H; i++)
                rr[i] = xr[i] + ri[i];
            xr = rr;
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++)
            ss += xr[i] * xr[i];
        float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++)
            orow[i] = w[i] * (xr[i] * inv);
    }
}

typedef struct {
    const float *x, *res, *w;
    float eps;
    int64_t T, H, rows;
    float *out, *res_out;
} rms_job;

static void rms_chunk(const void *ctx, int64_t c)
{
    const rms_job *j = (const rms_job *)ctx;
    const int64_t t0 = c * j->rows, n = t0 + j->rows < j->T ? j->rows : j->T - t0;
    const int64_t o = t0 * j->H;
    rms_norm_impl(j->x + o, j->res != NULL ? j->res + o : NULL, j->w, j->eps, n, j->H,
                  j->out + o, j->res_out != NULL ? j->res_out + o : NULL);
}

/* rms_norm(x, res, w, eps, T, H, out, res_out[, num_threads]): rms_norm_impl, rows
 * split among the pool's threads from ROWWISE_MIN_ELEMS values on (a prefill). */
static PyObject *py_rms_norm(PyObject *self, PyObject *args)
{
    unsigned long long xp, rp, wp, op, rop;
    double eps;
    long long T, H;
    int nth = 1;
    if (!PyArg_ParseTuple(args, "KKKdLLKK|i", &xp, &rp, &wp, &eps, &T, &H, &op, &rop, &nth))
        return NULL;
    if (T < 0 || H < 0 || nth < 1) {
        PyErr_Format(PyExc_ValueError, "bad shapes T=%lld H=%lld threads=%d", T, H, nth);
        return NULL;
    }
    if (T == 0)
        Py_RETURN_NONE;
    rms_job j = {(const float *)(uintptr_t)xp, (const float *)(uintptr_t)rp,
                 (const float *)(uintptr_t)wp, (float)eps, T, H, rowwise_chunk(T, H, nth),
                 (float *)(uintptr_t)op, (float *)(uintptr_t)rop};
    run_rowwise(rms_chunk, &j, T, j.rows, nth);
    Py_RETURN_NONE;
}

/* rope_neox(pos, T, x, x_tok_stride, heads, D, table, table_rows, out): out [T, heads, D]
 * (contiguous) = x * cos + rotate_half(x) * sin, table [*, 2, D] (cos, sin rows),
 * x's rows at x + t * x_tok_stride + h * D (a view of the fused qkv output). */
static void rope_impl(const int64_t *pos, int64_t T, const float *x, int64_t xs,
                      int64_t heads, int64_t D, const float *table, float *out)
{
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = table + pos[t] * 2 * D, *sn = c + D;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + t * xs + h * D;
            float *o = out + (t * heads + h) * D;
            for (int64_t i = 0; i < half; i++) {
                o[i] = xr[i] * c[i] + (-xr[i + half]) * sn[i];
                o[i + half] = xr[i + half] * c[i + half] + xr[i] * sn[i + half];
            }
        }
    }
}

typedef struct {
    const int64_t *pos;
    int64_t T;
    const float *x;
    int64_t xs, heads, D;
    const float *table;
    float *out;
    int64_t rows;
} rope_job;

static void rope_chunk(const void *ctx, int64_t c)
{
    const rope_job *j = (const rope_job *)ctx;
    const int64_t t0 = c * j->rows, n = t0 + j->rows < j->T ? j->rows : j->T - t0;
    rope_impl(j->pos + t0, n, j->x + t0 * j->xs, j->xs, j->heads, j->D, j->table,
              j->out + t0 * j->heads * j->D);
}

/* rope_neox(pos, T, x, x_tok_stride, heads, D, table, table_rows, out[, num_threads]):
 * rope_impl, rows split among the pool's threads from ROWWISE_MIN_ELEMS values on. */
static PyObject *py_rope_neox(PyObject *self, PyObject *args)
{
    unsigned long long pp, xp, tp, op;
    long long T, xs, heads, D, rows;
    int nth = 1;
    if (!PyArg_ParseTuple(args, "KLKLLLKLK|i", &pp, &T, &xp, &xs, &heads, &D, &tp, &rows, &op,
                          &nth))
        return NULL;
    if (T < 0 || heads < 0 || D < 0 || nth < 1) {
        PyErr_Format(PyExc_ValueError, "bad shapes T=%lld heads=%lld D=%lld threads=%d", T,
                     heads, D, nth);
        return NULL;
    }
    const int64_t *pos = (const int64_t *)(uintptr_t)pp;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= rows) {
            PyErr_Format(PyExc_IndexError, "rotary position %lld outside the table's %lld rows",
                         (long long)pos[t], rows);
            return NULL;
        }
    if (T == 0)
        Py_RETURN_NONE;
    rope_job j = {pos, T, (const float *)(uintptr_t)xp, xs, heads, D,
                  (const float *)(uintptr_t)tp, (float *)(uintptr_t)op,
                  rowwise_chunk(T, heads * D, nth)};
    run_rowwise(rope_chunk, &j, T, j.rows, nth);
    Py_RETURN_NONE;
}

/* write_kv(k, k_tok_stride, v, v_tok_stride, T, row_elems, elem_size, slots, cache,
 * plane_elems[, kv_fmt]): K/V rows of T tokens ([Hkv * D] values each, `elem_size`
 * bytes per value, the cache's dtype) into cache slots (slot -1: padding, skipped); V's
 * plane starts plane_elems values after K's. With kv_fmt KV_BF16 or KV_F16, float32
 * rows (elem_size 4) into a bf16 / float16 cache, rounded (write_kv_half_impl). */
static void write_kv_impl(const char *k, int64_t ks, const char *v, int64_t vs, int64_t T,
                          int64_t row, int64_t esz, const int64_t *slots, char *cache,
                          int64_t plane)
{
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0)
            continue;
        memcpy(cache + slots[t] * row * esz, k + t * ks * esz, (size_t)(row * esz));
        memcpy(cache + (plane + slots[t] * row) * esz, v + t * vs * esz, (size_t)(row * esz));
    }
}

/* write_kv_impl from float32 rows into a bf16 (fmt KV_BF16) or float16 (KV_F16) cache,
 * each value rounded to nearest even as torch's conversions round; strides and plane in
 * values. */
#if HAVE_X86
/* n float32 values into float16 by vcvtps2ph, 8 at a time (round to nearest even: the
 * bits f32_to_fp16 gives), the tail by f32_to_fp16. */
AVX2 static void f32_to_fp16_row_avx2(const float *src, uint16_t *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++)
        dst[i] = f32_to_fp16(src[i]);
}
#endif

/* n float32 values into a row of a bf16 (KV_BF16) or float16 (KV_F16) cache. */
static void half_row(const float *src, uint16_t *dst, int64_t n, int fmt)
{
#if HAVE_X86
    if (fmt == KV_F16 && use_avx2()) {
        f32_to_fp16_row_avx2(src, dst, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        dst[i] = fmt == KV_BF16 ? f32_to_bf16(src[i]) : f32_to_fp16(src[i]);
}

static void write_kv_half_impl(const float *k, int64_t ks, const float *v, int64_t vs,
                               int64_t T, int64_t row, const int64_t *slots, uint16_t *cache,
                               int64_t plane, int fmt)
{
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0)
            continue;
        half_row(k + t * ks, cache + slots[t] * row, row, fmt);
        half_row(v + t * vs, cache + plane + slots[t] * row, row, fmt);
    }
}

static PyObject *py_write_kv(PyObject *self, PyObject *args)
{
    unsigned long long kp, vp, sp, cp;
    long long ks, vs, T, row, esz, plane;
    int fmt = KV_F32;
    if (!PyArg_ParseTuple(args, "KLKLLLLKKL|i", &kp, &ks, &vp, &vs, &T, &row, &esz, &sp, &cp,
                          &plane, &fmt))
        return NULL;
    if (fmt < KV_F32 || fmt > KV_F16 || (fmt != KV_F32 && esz != 4)) {
        PyErr_Format(PyExc_ValueError, "write_kv: KV format %d from %lld-byte values", fmt,
                     esz);
        return NULL;
    }
    const int64_t *slots = (const int64_t *)(uintptr_t)sp;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= plane / row) {
            PyErr_Format(PyExc_IndexError, "KV slot %lld outside the cache's %lld",
                         (long long)slots[t], plane / row);
            return NULL;
        }
    if (fmt != KV_F32)
        write_kv_half_impl((const float *)(uintptr_t)kp, ks, (const float *)(uintptr_t)vp, vs,
                           T, row, slots, (uint16_t *)(uintptr_t)cp, plane, fmt);
    else
        write_kv_impl((const char *)(uintptr_t)kp, ks, (const char *)(uintptr_t)vp, vs, T, row,
                      esz, slots, (char *)(uintptr_t)cp, plane);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ whole decode stack
 *
 * decode_layers: every decoder layer of a Llama-style model for a decode step (T rows,
 * one new token per request) in one call, so that a layer costs no Python at all:
 *     residual stream r, x = norm1(r)          (layer 0: r = the embeddings)
 *     qkv = x Wqkv^T; q, k = rope(q, k); K/V -> cache slots
 *     a = paged decode attention(q);  h = a Wo^T
 *     r = r + h, x = norm2(r);  g = x Wgu^T;  m = silu(g[:I]) * g[I:];  h = m Wd^T
 * and after the last layer out = norm_final(r + h). The same bodies as the separate
 * calls (linear_impl, attention_impl, rms_norm_impl, rope_impl, write_kv_impl), so the
 * result is the one the per-operator path computes, up to silu: exp by exp_avx512 or
 * exp_avx2 (relative error ~2e-7) instead of torch's Sleef exp.
 *
 * Per layer l, row l of the int64 table [L, 15]: ln1_w, qkv (fmt, qs, sc), o (fmt, qs,
 * sc), ln2_w, gate_up (fmt, qs, sc), down (fmt, qs, sc), kv_cache ([2, nb, bs, Hkv, D],
 * of format kv_fmt: float32, or bf16 / float16, K/V rounded as they are written and
 * widened exactly as attention reads them). */
#define DL_COLS 15

#if HAVE_X86
/* p[i] = -inf for the set bits i of `banned` (32 floats). */
AVX512 static inline void mask_store_ninf_avx512(float *p, uint32_t banned)
{
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    _mm512_mask_storeu_ps(p, (__mmask16)(banned & 0xffff), ninf);
    _mm512_mask_storeu_ps(p + 16, (__mmask16)(banned >> 16), ninf);
}

/* silu(x) * u for 16 lanes: the one body of the float32 and bf16 versions. */
AVX512 static inline __m512 silu_mul16_avx512(__m512 x, __m512 u)
{
    __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), x));
    return _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}

AVX512 static void silu_mul_avx512(const float *g, const float *u, int64_t n, float *out)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, silu_mul16_avx512(_mm512_loadu_ps(g + i),
                                                    _mm512_loadu_ps(u + i)));
    for (; i < n; i++)
        out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* SiLU-and-mul at 8 lanes with exp_avx2, for CPUs without AVX-512: silu(x) * u, the
 * one body of the float32 and bf16 versions. */
AVX2 static inline __m256 silu_mul8_avx2(__m256 x, __m256 u)
{
    __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x));
    return _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

AVX2 static void silu_mul_avx2(const float *g, const float *u, int64_t n, float *out)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, silu_mul8_avx2(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    for (; i < n; i++)
        out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

AVX2 static void silu_mul_bf16_avx2(const uint16_t *g, const uint16_t *u, int64_t n,
                                    uint16_t *out)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 r = silu_mul8_avx2(bf16_load8_avx2(g + i), bf16_load8_avx2(u + i));
        _mm_storeu_si128((__m128i *)(out + i), bf16_round_avx2(r));
    }
    for (; i < n; i++) {
        float x = bf16_to_f32(g[i]);
        out[i] = f32_to_bf16(x / (1.f + expf(-x)) * bf16_to_f32(u[i]));
    }
}

AVX512 static void silu_mul_bf16_avx512(const uint16_t *g, const uint16_t *u, int64_t n,
                                        uint16_t *out)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 r = silu_mul16_avx512(bf16_load16_avx512(g + i), bf16_load16_avx512(u + i));
        _mm256_storeu_si256((__m256i *)(out + i), bf16_round_avx512(r));
    }
    for (; i < n; i++) {
        float x = bf16_to_f32(g[i]);
        out[i] = f32_to_bf16(x / (1.f + expf(-x)) * bf16_to_f32(u[i]));
    }
}
#endif

/* One row of I values: out = silu(g) * u, float32, or bf16 in and out (each value
 * widened to float32 exactly, the float32 operations, one rounding to bf16 as
 * f32_to_bf16 (torch) rounds). */
static void silu_mul_row(const void *g, const void *u, int64_t I, void *out, int bf16)
{
#if HAVE_X86
    if (use_avx512()) {
        if (bf16)
            silu_mul_bf16_avx512(g, u, I, out);
        else
            silu_mul_avx512(g, u, I, out);
        return;
    }
    if (use_avx2()) {
        if (bf16)
            silu_mul_bf16_avx2(g, u, I, out);
        else
            silu_mul_avx2(g, u, I, out);
        return;
    }
#endif
    for (int64_t i = 0; i < I; i++) {
        if (bf16) {
            float x = bf16_to_f32(((const uint16_t *)g)[i]);
            ((uint16_t *)out)[i] = f32_to_bf16(x / (1.f + expf(-x))
                                               * bf16_to_f32(((const uint16_t *)u)[i]));
        } else {
            float x = ((const float *)g)[i];
            ((float *)out)[i] = x / (1.f + expf(-x)) * ((const float *)u)[i];
        }
    }
}

/* T rows of gate_up [T, 2 I] (gate first) -> out [T, I], as silu_mul_row. */
static void silu_mul_rows(const void *gu, int64_t T, int64_t I, void *out, int bf16)
{
    const int64_t esz = bf16 ? 2 : 4;
    for (int64_t t = 0; t < T; t++) {
        const char *g = (const char *)gu + t * 2 * I * esz;
        silu_mul_row(g, g + I * esz, I, (char *)out + t * I * esz, bf16);
    }
}

/* silu_mul(gate_up, T, I, out, num_threads[, bf16]): out[T, I] = silu(gate) * up for
 * gate_up [T, 2 I] (gate first), float32, or with bf16 set bf16 in and out; rows split
 * among the pool's threads as rowwise_chunk says (the per-operator path's prefill; the
 * fused decode layers call silu_mul_rows). */
typedef struct {
    const void *gu;
    int64_t T, I, rows;
    void *out;
    int bf16;
} silu_job;

static void silu_chunk(const void *ctx, int64_t c)
{
    const silu_job *j = (const silu_job *)ctx;
    const int64_t t0 = c * j->rows, t1 = t0 + j->rows < j->T ? t0 + j->rows : j->T;
    const int64_t esz = j->bf16 ? 2 : 4;
    silu_mul_rows((const char *)j->gu + t0 * 2 * j->I * esz, t1 - t0, j->I,
                  (char *)j->out + t0 * j->I * esz, j->bf16);
}

static PyObject *py_silu_mul(PyObject *self, PyObject *args)
{
    unsigned long long gp, op;
    long long T, I;
    int nth, bf16 = 0;
    if (!PyArg_ParseTuple(args, "KLLKi|p", &gp, &T, &I, &op, &nth, &bf16))
        return NULL;
    if (T < 0 || I < 0 || nth < 1) {
        PyErr_Format(PyExc_ValueError, "bad shapes T=%lld I=%lld threads=%d", T, I, nth);
        return NULL;
    }
    if (T == 0 || I == 0)
        Py_RETURN_NONE;
    silu_job j = {(const void *)(uintptr_t)gp, T, I, rowwise_chunk(T, I, nth),
                  (void *)(uintptr_t)op, bf16};
    run_rowwise(silu_chunk, &j, T, j.rows, nth);
    Py_RETURN_NONE;
}

static PyObject *py_decode_layers(PyObject *self, PyObject *args)
{
    unsigned long long tblp, hp, fnp, op, pp, rtp, smp, tip, rip, btp, slp, amxp = 0;
    long long L, T, H, hq, hkv, d, I, rows, nblocks, bs, bts;
    double eps, scale;
    int nth, kv_fmt = KV_F32;
    if (!PyArg_ParseTuple(args, "KLLLLLLLdKKKKKLKLLKKKLKdi|Ki", &tblp, &L, &T, &H, &hq, &hkv,
                          &d, &I, &eps, &hp, &fnp, &op, &pp, &rtp, &rows, &smp, &nblocks, &bs,
                          &tip, &rip, &btp, &bts, &slp, &scale, &nth, &amxp, &kv_fmt))
        return NULL;
    /* int64 [3] or NULL: per format, the rows from which a matmul takes the AMX body */
    const int64_t *amx_min = (const int64_t *)(uintptr_t)amxp;
    const int64_t *tbl = (const int64_t *)(uintptr_t)tblp;
    const int64_t *pos = (const int64_t *)(uintptr_t)pp, *slots = (const int64_t *)(uintptr_t)smp;
    if (T < 1 || L < 1 || H % QK || (hq * d) % QK || I % QK || d > MAX_D || d % 2 || hkv < 1
        || hq % hkv || hq / hkv > MAX_G || nth < 1 || kv_fmt < KV_F32 || kv_fmt > KV_F16) {
        PyErr_Format(PyExc_ValueError, "decode_layers: unsupported shapes T=%lld H=%lld "
                     "heads %lld/%lld D=%lld I=%lld (KV format %d)", T, H, hq, hkv, d, I,
                     kv_fmt);
        return NULL;
    }
    static const int fmt_cols[4] = {1, 4, 8, 11};
    for (int64_t l = 0; l < L; l++)
        for (int c = 0; c < 4; c++)
            if (check_fmt((int)tbl[l * DL_COLS + fmt_cols[c]]) < 0)
                return NULL;
    for (int64_t t = 0; t < T; t++) {
        if (pos[t] < 0 || pos[t] >= rows) {
            PyErr_Format(PyExc_IndexError, "rotary position %lld outside the table's %lld rows",
                         (long long)pos[t], rows);
            return NULL;
        }
        if (slots[t] >= nblocks * bs) {
            PyErr_Format(PyExc_IndexError, "KV slot %lld outside the cache's %lld",
                         (long long)slots[t], nblocks * bs);
            return NULL;
        }
    }
    const int64_t qkv_n = (hq + 2 * hkv) * d, kvrow = hkv * d;
    const int64_t sizes[8] = {T * H, T * H, T * H, T * qkv_n, T * hq * d, T * kvrow,
                              T * hq * d, T * 2 * I};
    int64_t total = 0;
    for (int i = 0; i < 8; i++)
        total += (sizes[i] + 15) / 16 * 16;
    total += (T * I + 15) / 16 * 16;
    float *mem = (float *)malloc((size_t)total * sizeof(float));
    if (mem == NULL)
        return PyErr_NoMemory();
    float *bufs[9], *cur = mem;
    for (int i = 0; i < 8; i++) {
        bufs[i] = cur;
        cur += (sizes[i] + 15) / 16 * 16;
    }
    bufs[8] = cur;
    float *res = bufs[0], *x = bufs[1], *h = bufs[2], *qkv = bufs[3], *qr = bufs[4],
          *kr = bufs[5], *att = bufs[6], *gu = bufs[7], *act = bufs[8];
    attn_args a;
    a.q = qr;
    a.out = att;
    a.tok_idx = (const int64_t *)(uintptr_t)tip;
    a.req_idx = (const int64_t *)(uintptr_t)rip;
    a.block_tables = (const int32_t *)(uintptr_t)btp;
    a.seq_lens = (const int32_t *)(uintptr_t)slp;
    a.num_reqs = T;
    a.hq = hq;
    a.hkv = hkv;
    a.d = d;
    a.block_size = bs;
    a.num_blocks = nblocks;
    a.bt_stride = bts;
    a.q_bf16 = 0;
    a.kv_fmt = kv_fmt;
    a.scale = (float)scale;
    a.soft_cap = 0.f;
    a.window = 0;
    const float *table = (const float *)(uintptr_t)rtp;
    const int64_t plane = nblocks * bs * kvrow;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    memcpy(res, (const float *)(uintptr_t)hp, (size_t)(T * H) * sizeof(float));
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const int64_t *e = tbl + l * DL_COLS;
        const float *ln1 = (const float *)(uintptr_t)e[0], *ln2 = (const float *)(uintptr_t)e[7];
#define QW(c) (int)e[c]
#define QQ(c) (const uint8_t *)(uintptr_t)e[(c) + 1]
#define QS(c) (const uint16_t *)(uintptr_t)e[(c) + 2]
#define AMX_MIN(c) (amx_min != NULL ? amx_min[e[c]] : 0)
        void *cache = (void *)(uintptr_t)e[14];
        if (l == 0)
            rms_norm_impl(res, NULL, ln1, (float)eps, T, H, x, NULL);
        else /* h holds the previous layer's MLP output */
            rms_norm_impl(h, res, ln1, (float)eps, T, H, x, res);
        rc |= linear_impl(QW(1), x, T, H, QQ(1), QS(1), qkv_n, qkv, nth, AMX_MIN(1), 0);
        rope_impl(pos, T, qkv, qkv_n, hq, d, table, qr);
        rope_impl(pos, T, qkv + hq * d, qkv_n, hkv, d, table, kr);
        if (kv_fmt != KV_F32)
            write_kv_half_impl(kr, kvrow, qkv + (hq + hkv) * d, qkv_n, T, kvrow, slots,
                               (uint16_t *)cache, plane, kv_fmt);
        else
            write_kv_impl((const char *)kr, kvrow, (const char *)(qkv + (hq + hkv) * d), qkv_n,
                          T, kvrow, sizeof(float), slots, (char *)cache, plane);
        a.cache = cache;
        attention_impl(&a, nth);
        rc |= linear_impl(QW(4), att, T, hq * d, QQ(4), QS(4), H, h, nth, AMX_MIN(4), 0);
        rms_norm_impl(h, res, ln2, (float)eps, T, H, x, res);
        rc |= linear_impl(QW(8), x, T, H, QQ(8), QS(8), 2 * I, gu, nth, AMX_MIN(8), 0);
        silu_mul_rows(gu, T, I, act, 0);
        rc |= linear_impl(QW(11), act, T, I, QQ(11), QS(11), H, h, nth, AMX_MIN(11), 0);
#undef QW
#undef QQ
#undef QS
#undef AMX_MIN
    }
    if (rc == 0) { /* the final norm over r + h */
        if (fnp)
            rms_norm_impl(h, res, (const float *)(uintptr_t)fnp, (float)eps, T, H,
                          (float *)(uintptr_t)op, res);
        else
            for (int64_t i = 0; i < T * H; i++)
                ((float *)(uintptr_t)op)[i] = h[i] + res[i];
    }
    Py_END_ALLOW_THREADS
    free(mem);
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* apply_token_bitmask(logits, logit_rows, num_rows, vocab, row_stride, words, num_words,
 *     pairs, num_pairs): for each pair (k, r) of the int64 [num_pairs, 2] table (k <
 * num_rows, r < logit_rows, else IndexError and nothing written), logits[r * row_stride
 * + t] = -inf (float32) for every token t < vocab whose bit t of bitmask row k
 * (int32 words [num_rows, num_words], bit t % 32 of word t / 32) is 0; tokens past the
 * words are disallowed. A structured-output step's mask at batch 1 took ~0.1 ms in
 * numpy (unpack every bit, then a masked copy); here a 49k-token row is ~1.5k word
 * tests and masked stores. */
static PyObject *py_apply_token_bitmask(PyObject *self, PyObject *args)
{
    unsigned long long lp, wp, pp;
    long long logit_rows, num_rows, vocab, stride, num_words, num_pairs;
    if (!PyArg_ParseTuple(args, "KLLLLKLKL", &lp, &logit_rows, &num_rows, &vocab, &stride, &wp,
                          &num_words, &pp, &num_pairs))
        return NULL;
    const int64_t *pairs = (const int64_t *)(uintptr_t)pp;
    if (vocab < 0 || num_words < 0 || stride < vocab || num_pairs < 0) {
        PyErr_SetString(PyExc_ValueError, "apply_token_bitmask: bad shapes");
        return NULL;
    }
    for (int64_t i = 0; i < num_pairs; i++)
        if (pairs[2 * i] < 0 || pairs[2 * i] >= num_rows || pairs[2 * i + 1] < 0
            || pairs[2 * i + 1] >= logit_rows) {
            PyErr_SetString(PyExc_IndexError, "apply_token_bitmask: row out of range");
            return NULL;
        }
    float *logits = (float *)(uintptr_t)lp;
    const uint32_t *words = (const uint32_t *)(uintptr_t)wp;
    const float ninf = -INFINITY;
    for (int64_t i = 0; i < num_pairs; i++) {
        const uint32_t *w = words + pairs[2 * i] * num_words;
        float *row = logits + pairs[2 * i + 1] * stride;
        const int64_t full = vocab / 32 < num_words ? vocab / 32 : num_words;
        int64_t t = 0;
        for (int64_t j = 0; j < full; j++, t += 32) {
            uint32_t banned = ~w[j];
            if (banned == 0)
                continue;
#if HAVE_X86
            if (use_avx512()) {
                mask_store_ninf_avx512(row + t, banned);
                continue;
            }
#endif
            while (banned) {
                row[t + __builtin_ctz(banned)] = ninf;
                banned &= banned - 1;
            }
        }
        for (; t < vocab; t++) /* a partial last word, and tokens past the words */
            if (t / 32 >= num_words || !((w[t / 32] >> (t % 32)) & 1u))
                row[t] = ninf;
    }
    Py_RETURN_NONE;
}

static PyObject *py_has_avx2(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(use_avx2());
}

static PyObject *py_has_avx512(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(use_avx512());
}

static PyObject *py_has_amx(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(use_amx());
}

static PyObject *py_has_amx_int8(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(use_amx_int8());
}

/* The body a matmul of `rows` activation rows runs: "avx512-vnni" (integer dot
 * products over three int8 levels of the activations), "avx512-panels" or "avx512"
 * (float32), "avx2-int16-panels" or "avx2-int16" (int16 products, no AVX-512: the panel
 * body, the one-row body), "avx2-panels" or "avx2"
 * (float32, no AVX-512) or "c". Matmuls called with no_int8 run float32 bodies. */
static PyObject *py_linear_path(PyObject *self, PyObject *args)
{
    long long rows;
    if (!PyArg_ParseTuple(args, "L", &rows))
        return NULL;
    if (rows >= 1 && rows <= VNNI_MAX_ROWS && use_vnni())
        return PyUnicode_FromString("avx512-vnni");
    if (use_avx512() && rows >= panel_min_rows())
        return PyUnicode_FromString("avx512-panels");
    if (!use_avx512() && rows >= i16_min_rows())
        return PyUnicode_FromString("avx2-int16-panels");
    if (!use_avx512() && rows == 1 && i16_one_row())
        return PyUnicode_FromString("avx2-int16");
    if (!use_avx512() && use_avx2() && rows >= panel_min_rows_avx2())
        return PyUnicode_FromString("avx2-panels");
    return PyUnicode_FromString(use_avx512() ? "avx512" : use_avx2() ? "avx2" : "c");
}

/* ------------------------------------------------------------------ sampling
 * sample_rows: one token per row of float32 logits [R, V] by the sampler's pipeline
 * after its masks and penalties (flowengine/sample/sampler.py): temperature, top-k,
 * top-p, min-p, then the exponential race in Gumbel form,
 *     argmax_t  s_t - log(-log U(key, t)),   s_t = logits[t] / T,
 * over the tokens the filters keep (greedy rows: argmax_t logits[t]). U is the
 * counter-based generator of `seeded_exponential`: splitmix64's output function of
 * key + (t + 1) * gamma, its top 24 bits as [0, 1) (Steele, Lea and Flood, OOPSLA
 * 2014); so a row drawn with key = its step seed takes the token the torch path takes
 * with the same q. Scores are relative to the row's maximum. Ties go to the lowest index
 * (torch.argmax's rule); a row whose logits are all -inf gives token 0; a kept token
 * whose U is 0 (q = inf) is drawn only when every other kept token's U is 0 too.
 *
 * Filters, in s (all ties at a threshold kept): top-k keeps s >= the k-th largest;
 * top-p walks the kept tokens from the most likely, keeping each while the mass before
 * it is < p of the total (vLLM's semantics: the smallest set whose mass reaches p),
 * found by bucketing s by its distance to the maximum (1/16 nat per bucket), then
 * sorting only the bucket where the mass crosses p; min-p keeps s - max >= log(min_p).
 * One pass per row over V when no filter applies; the torch ops it replaces took
 * 0.5-1 ms per 49k-token row on this project's 2-core CPU and ~2 ms inside a step,
 * where every op woke torch's intra-op threads (docs/benchmarks.md, session 33). */
#define SM_GAMMA 0x9E3779B97F4A7C15ULL
#define SM_MIX1 0xBF58476D1CE4E5B9ULL
#define SM_MIX2 0x94D049BB133111EBULL
#define TOPP_BINS 1024 /* 1/16 nat each: 64 nats, the last bin takes the rest */

static inline float sm_uniform(uint64_t key, int64_t t)
{
    uint64_t z = key + (uint64_t)(t + 1) * SM_GAMMA;
    z = (z ^ (z >> 30)) * SM_MIX1;
    z = (z ^ (z >> 27)) * SM_MIX2;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

typedef struct {
    const float *logits;
    int64_t vocab, stride;
    const float *inv_t;    /* [R] or NULL (1) */
    const int64_t *top_k;  /* [R] or NULL; k <= 0 or k >= V: no top-k */
    const float *top_p;    /* [R] or NULL; p >= 1: no top-p */
    const float *min_p;    /* [R] or NULL; min_p <= 0: no min-p */
    const uint64_t *keys;  /* [R] */
    const uint8_t *greedy; /* [R] or NULL */
    int64_t *out;          /* [R] */
    int all_greedy;        /* every row takes its argmax (the other arrays unread) */
    int failed;            /* set when a row's scratch could not be allocated */
} sample_ctx;

#if HAVE_X86
/* The first index of the maximum of l[0, V), 16 lanes a pass: the maximum, then the
 * first lane equal to it. */
AVX512 static int64_t argmax_first_avx512(const float *l, int64_t V)
{
    const int64_t n16 = V / 16 * 16;
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n16; t += 16)
        vmax = _mm512_max_ps(_mm512_loadu_ps(l + t), vmax); /* a NaN lane keeps vmax */
    float mx = _mm512_reduce_max_ps(vmax);
    for (int64_t t = n16; t < V; t++)
        mx = l[t] > mx ? l[t] : mx;
    const __m512 vm = _mm512_set1_ps(mx);
    for (int64_t t = 0; t < n16; t += 16) {
        __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(l + t), vm, _CMP_EQ_OQ);
        if (eq)
            return t + __builtin_ctz(eq);
    }
    for (int64_t t = n16; t < V; t++)
        if (l[t] == mx)
            return t;
    return 0; /* every logit NaN */
}
#endif

#if HAVE_X86
/* argmax_first_avx512 at 8 lanes, two maxima in flight. */
AVX2 static int64_t argmax_first_avx2(const float *l, int64_t V)
{
    const int64_t n16 = V / 16 * 16;
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    for (int64_t t = 0; t < n16; t += 16) { /* a NaN lane keeps the maximum */
        m0 = _mm256_max_ps(_mm256_loadu_ps(l + t), m0);
        m1 = _mm256_max_ps(_mm256_loadu_ps(l + t + 8), m1);
    }
    float mx = hmax_avx2(_mm256_max_ps(m0, m1));
    for (int64_t t = n16; t < V; t++)
        mx = l[t] > mx ? l[t] : mx;
    const __m256 vm = _mm256_set1_ps(mx);
    for (int64_t t = 0; t < n16; t += 8) {
        const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(l + t), vm, _CMP_EQ_OQ));
        if (eq)
            return t + __builtin_ctz((unsigned)eq);
    }
    for (int64_t t = n16; t < V; t++)
        if (l[t] == mx)
            return t;
    return 0; /* every logit NaN */
}
#endif

/* The first index of the maximum (torch.argmax's tie rule); NaN logits are skipped. */
static int64_t argmax_first(const float *l, int64_t V)
{
#if HAVE_X86
    if (use_avx512())
        return argmax_first_avx512(l, V);
    if (use_avx2())
        return argmax_first_avx2(l, V);
#endif
    int64_t best = 0;
    for (int64_t t = 1; t < V; t++)
        if (l[t] > l[best] || l[best] != l[best])
            best = t;
    return best;
}

static float kth_largest(float *a, int64_t n, int64_t k) /* a is scrambled */
{
    int64_t lo = 0, hi = n - 1, want = k - 1; /* index in descending order */
    while (lo < hi) {
        float pivot = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                float tmp = a[i]; a[i] = a[j]; a[j] = tmp;
                i++; j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

static int desc_float(const void *x, const void *y)
{
    float a = *(const float *)x, b = *(const float *)y;
    return (a < b) - (a > b);
}

/* The top-p bucket of s (1/16 nat of distance to the maximum mx, the last bucket taking
 * the rest), or -1 when a filter before top-p (s < thr) or a mask (-inf) dropped it. */
static inline int top_p_bucket(float s, float thr, float mx)
{
    if (!(s >= thr) || s == -INFINITY)
        return -1;
    double d = (double)(mx - s) * 16.0;
    return d < TOPP_BINS - 1 ? (int)d : TOPP_BINS - 1;
}

#if HAVE_X86
/* The first pass of top_p_threshold over [0, n8) (a multiple of 8) at 8 lanes: each
 * kept token's e^(s - mx) by exp_avx2 (relative error ~2e-7 against expf's ~1 ulp),
 * added to its bucket's mass in double, token by token in order as the scalar loop
 * does; the buckets are top_p_bucket's. */
AVX2 static void top_p_masses_avx2(const float *l, float it, int64_t n8, float thr, float mx,
                                   double *mass, double *total)
{
    const __m256 vit = _mm256_set1_ps(it), vthr = _mm256_set1_ps(thr), vmx = _mm256_set1_ps(mx);
    const __m256 ninf = _mm256_set1_ps(-INFINITY), last = _mm256_set1_ps((float)(TOPP_BINS - 1));
    for (int64_t t = 0; t < n8; t += 8) {
        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(l + t), vit);
        const int keep = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(s, vthr, _CMP_GE_OQ),
                                                          _mm256_cmp_ps(s, ninf, _CMP_NEQ_OQ)));
        if (!keep)
            continue;
        /* (mx - s) 16 is exact in float as in double; clamped before the conversion */
        const __m256 d = _mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(vmx, s), _mm256_set1_ps(16.f)),
                                       last);
        float w[8];
        int32_t b[8];
        _mm256_storeu_ps(w, exp_avx2(_mm256_sub_ps(s, vmx)));
        _mm256_storeu_si256((__m256i *)b, _mm256_cvttps_epi32(d));
        for (int j = 0; j < 8; j++)
            if (keep >> j & 1) {
                mass[b[j]] += w[j];
                *total += w[j];
            }
    }
}
#endif

/* The top-p threshold in s over the tokens with s >= thr; -inf keeps them all. */
static float top_p_threshold(const float *l, float it, int64_t V, float thr, float mx, float p,
                             float *scratch)
{
    double mass[TOPP_BINS] = {0};
    double total = 0;
    int64_t t0 = 0;
#if HAVE_X86
    if (!use_avx512() && use_avx2()) {
        t0 = V / 8 * 8;
        top_p_masses_avx2(l, it, t0, thr, mx, mass, &total);
    }
#endif
    for (int64_t t = t0; t < V; t++) {
        float s = l[t] * it;
        int b = top_p_bucket(s, thr, mx);
        if (b < 0)
            continue;
        float w = expf(s - mx);
        mass[b] += w;
        total += w;
    }
    double target = (double)p * total, before = 0;
    int cross = -1;
    for (int b = 0; b < TOPP_BINS; b++) {
        if (before + mass[b] >= target) { cross = b; break; }
        before += mass[b];
    }
    if (cross < 0)
        return -INFINITY;
    int64_t n = 0;
    for (int64_t t = 0; t < V; t++) {
        float s = l[t] * it;
        if (top_p_bucket(s, thr, mx) == cross)
            scratch[n++] = s;
    }
    qsort(scratch, (size_t)n, sizeof(float), desc_float);
    float last = scratch[0];
    for (int64_t i = 0; i < n && before < target; i++) {
        last = scratch[i];
        before += expf(scratch[i] - mx); /* as the buckets' masses */
    }
    return last;
}

#if HAVE_X86
/* The vector races' lanes into the running best: a higher score wins, an equal one at a
 * lower token index (the scalar loop's order). */
static void race_merge_lanes(const float *bs, const int32_t *bt, int n, float *best_score,
                             int64_t *best_index)
{
    for (int i = 0; i < n; i++)
        if (bs[i] > *best_score || (bs[i] == *best_score && bs[i] != -INFINITY
                                     && bt[i] < *best_index)) {
            *best_score = bs[i];
            *best_index = bt[i];
        }
}

/* Cephes' logf polynomial in f = m - 1, highest degree first (log_ps, log_avx2). */
static const float LOGF_POLY[9] = {7.0376836292E-2f, -1.1514610310E-1f, 1.1676998740E-1f,
                                   -1.2420140846E-1f, 1.4249322787E-1f, -1.6668057665E-1f,
                                   2.0000714765E-1f, -2.4999993993E-1f, 3.3333331174E-1f};
#endif

#if HAVE_X86
#define AVX512DQ __attribute__((target("avx512f,avx512dq,fma")))
/* log(x) for x > 0 (finite), 16 lanes: Cephes' logf (x = m 2^e, m in [sqrt(1/2),
 * sqrt(2)), a degree-9 polynomial in m - 1), ~1 ulp; the race needs no more. */
AVX512DQ static inline __m512 log_ps(__m512 x)
{
    __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_p5_1, _MM_MANT_SIGN_zero); /* [0.5, 1) */
    __m512 e = _mm512_add_ps(_mm512_getexp_ps(x), _mm512_set1_ps(1.0f));
    __mmask16 small = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
    e = _mm512_mask_sub_ps(e, small, e, _mm512_set1_ps(1.0f));
    m = _mm512_mask_add_ps(m, small, m, m);
    __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
    __m512 z = _mm512_mul_ps(f, f);
    __m512 y = _mm512_set1_ps(LOGF_POLY[0]);
    for (int i = 1; i < 9; i++)
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(LOGF_POLY[i]));
    y = _mm512_mul_ps(_mm512_mul_ps(y, f), z);
    y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
    y = _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), z, y);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(f, y));
}

AVX512DQ static inline __m512i splitmix_epi64(__m512i z)
{
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)),
                           _mm512_set1_epi64((long long)SM_MIX1));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)),
                           _mm512_set1_epi64((long long)SM_MIX2));
    return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

/* The race over [0, n16) (a multiple of 16): the best score and its index. */
AVX512DQ static void race_avx512(const float *l, float it, int64_t n16, float thr, float mx,
                                 float thr_d, uint64_t key, float *best_score,
                                 int64_t *best_index)
{
    const __m512i step = _mm512_set1_epi64((long long)(16 * SM_GAMMA));
    __m512i za = _mm512_set_epi64(8, 7, 6, 5, 4, 3, 2, 1), zb;
    za = _mm512_add_epi64(_mm512_set1_epi64((long long)key),
                          _mm512_mullo_epi64(za, _mm512_set1_epi64((long long)SM_GAMMA)));
    zb = _mm512_add_epi64(za, _mm512_set1_epi64((long long)(8 * SM_GAMMA)));
    const __m512 vit = _mm512_set1_ps(it), vthr = _mm512_set1_ps(thr);
    const __m512 vmx = _mm512_set1_ps(mx), vthr_d = _mm512_set1_ps(thr_d);
    const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
    const __m512 ninf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(1.0f / 16777216.0f);
    __m512 best = ninf;
    __m512i best_t = _mm512_setzero_si512();
    __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t t = 0; t < n16; t += 16) {
        __m512 s = _mm512_mul_ps(_mm512_loadu_ps(l + t), vit);
        __m512 d = _mm512_sub_ps(s, vmx);
        __mmask16 keep = _mm512_cmp_ps_mask(s, vthr, _CMP_GE_OQ)
                         & _mm512_cmp_ps_mask(d, vthr_d, _CMP_GE_OQ)
                         & _mm512_cmp_ps_mask(s, ninf, _CMP_NEQ_OQ);
        __m512i ha = _mm512_srli_epi64(splitmix_epi64(za), 40);
        __m512i hb = _mm512_srli_epi64(splitmix_epi64(zb), 40);
        za = _mm512_add_epi64(za, step);
        zb = _mm512_add_epi64(zb, step);
        if (!keep)
            continue;
        __m512 u = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtepi64_ps(ha)),
                                      _mm512_cvtepi64_ps(hb), 1);
        u = _mm512_mul_ps(u, scale);
        __mmask16 drawn = _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_GT_OQ);
        __m512 q = _mm512_sub_ps(_mm512_setzero_ps(), log_ps(_mm512_mask_blend_ps(
                                      keep & drawn, _mm512_set1_ps(0.5f), u)));
        /* U = 0 (q = inf, probability 2^-24): the lowest finite score, so the token
         * loses to every other kept token but still beats the filtered ones. */
        __m512 score = _mm512_mask_blend_ps(drawn, lowest, _mm512_sub_ps(d, log_ps(q)));
        __mmask16 better = _mm512_mask_cmp_ps_mask(keep, score, best, _CMP_GT_OQ);
        best = _mm512_mask_blend_ps(better, best, score);
        best_t = _mm512_mask_blend_epi32(better, best_t,
                                         _mm512_add_epi32(lanes, _mm512_set1_epi32((int)t)));
    }
    float bs[16];
    int32_t bt[16];
    _mm512_storeu_ps(bs, best);
    _mm512_storeu_si512((void *)bt, best_t);
    race_merge_lanes(bs, bt, 16, best_score, best_index);
}

static int use_avx512dq(void)
{
    static int cached = -1;
    if (cached < 0)
        cached = use_avx512() && __builtin_cpu_supports("avx512dq");
    return cached;
}
#endif

#if HAVE_X86
/* The AVX2 race (CPUs without AVX512-DQ): race_avx512 at 8 lanes. AVX2 has no 64-bit
 * multiply, so splitmix64's is built from three 32 x 32 -> 64-bit products (the low 64
 * bits of a b: alo blo + ((ahi blo + alo bhi) << 32)); the hash bits are the same,
 * so the uniforms are. log_avx2 is log_ps with the mantissa and exponent taken from
 * the bits (x normal and positive here: u >= 2^-24, q = -log u >= 6e-8), so the scores
 * are log_ps's too. */
AVX2 static inline __m256i mullo64_avx2(__m256i a, __m256i blo, __m256i bhi)
{
    const __m256i lo = _mm256_mul_epu32(a, blo);
    const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), blo),
                                           _mm256_mul_epu32(a, bhi));
    return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

AVX2 static inline __m256i splitmix_avx2(__m256i z)
{
    const __m256i m1lo = _mm256_set1_epi64x((long long)(SM_MIX1 & 0xffffffffu));
    const __m256i m1hi = _mm256_set1_epi64x((long long)(SM_MIX1 >> 32));
    const __m256i m2lo = _mm256_set1_epi64x((long long)(SM_MIX2 & 0xffffffffu));
    const __m256i m2hi = _mm256_set1_epi64x((long long)(SM_MIX2 >> 32));
    z = mullo64_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), m1lo, m1hi);
    z = mullo64_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), m2lo, m2hi);
    return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

AVX2 static inline __m256 log_avx2(__m256 x)
{
    const __m256i bits = _mm256_castps_si256(x);
    __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23),
                                                   _mm256_set1_epi32(126)));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
        _mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f000000)));
    const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
    e = _mm256_sub_ps(e, _mm256_and_ps(small, _mm256_set1_ps(1.0f)));
    m = _mm256_add_ps(m, _mm256_and_ps(small, m));
    const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.0f));
    const __m256 z = _mm256_mul_ps(f, f);
    __m256 y = _mm256_set1_ps(LOGF_POLY[0]);
    for (int i = 1; i < 9; i++)
        y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(LOGF_POLY[i]));
    y = _mm256_mul_ps(_mm256_mul_ps(y, f), z);
    y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
    y = _mm256_fnmadd_ps(_mm256_set1_ps(0.5f), z, y);
    return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(f, y));
}

/* The race over [0, n8) (a multiple of 8): the best score and its index. */
AVX2 static void race_avx2(const float *l, float it, int64_t n8, float thr, float mx,
                           float thr_d, uint64_t key, float *best_score, int64_t *best_index)
{
    const __m256i step = _mm256_set1_epi64x((long long)(8 * SM_GAMMA));
    __m256i za = _mm256_set_epi64x((long long)(key + 4 * SM_GAMMA), (long long)(key + 3 * SM_GAMMA),
                                   (long long)(key + 2 * SM_GAMMA), (long long)(key + SM_GAMMA));
    __m256i zb = _mm256_add_epi64(za, _mm256_set1_epi64x((long long)(4 * SM_GAMMA)));
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256 vit = _mm256_set1_ps(it), vthr = _mm256_set1_ps(thr);
    const __m256 vmx = _mm256_set1_ps(mx), vthr_d = _mm256_set1_ps(thr_d);
    const __m256 lowest = _mm256_set1_ps(-FLT_MAX), half = _mm256_set1_ps(0.5f);
    const __m256 ninf = _mm256_set1_ps(-INFINITY), scale = _mm256_set1_ps(1.0f / 16777216.0f);
    __m256 best = ninf;
    __m256i best_t = _mm256_setzero_si256();
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t t = 0; t < n8; t += 8) {
        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(l + t), vit);
        const __m256 d = _mm256_sub_ps(s, vmx);
        const __m256 keep = _mm256_and_ps(
            _mm256_and_ps(_mm256_cmp_ps(s, vthr, _CMP_GE_OQ), _mm256_cmp_ps(d, vthr_d, _CMP_GE_OQ)),
            _mm256_cmp_ps(s, ninf, _CMP_NEQ_OQ));
        const __m256i ha = _mm256_srli_epi64(splitmix_avx2(za), 40);
        const __m256i hb = _mm256_srli_epi64(splitmix_avx2(zb), 40);
        za = _mm256_add_epi64(za, step);
        zb = _mm256_add_epi64(zb, step);
        if (!_mm256_movemask_ps(keep))
            continue;
        /* tokens t..t+3 in the low dwords of ha, t+4..t+7 of hb (each < 2^24) */
        const __m256i h = _mm256_permutevar8x32_epi32(
            _mm256_or_si256(ha, _mm256_slli_epi64(hb, 32)), order);
        const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(h), scale);
        const __m256 drawn = _mm256_cmp_ps(u, _mm256_setzero_ps(), _CMP_GT_OQ);
        const __m256 q = _mm256_sub_ps(_mm256_setzero_ps(),
                                       log_avx2(_mm256_blendv_ps(half, u, _mm256_and_ps(keep, drawn))));
        /* U = 0: the lowest finite score, as race_avx512 */
        const __m256 score = _mm256_blendv_ps(lowest, _mm256_sub_ps(d, log_avx2(q)), drawn);
        const __m256 better = _mm256_and_ps(keep, _mm256_cmp_ps(score, best, _CMP_GT_OQ));
        best = _mm256_blendv_ps(best, score, better);
        best_t = _mm256_castps_si256(_mm256_blendv_ps(
            _mm256_castsi256_ps(best_t),
            _mm256_castsi256_ps(_mm256_add_epi32(lanes, _mm256_set1_epi32((int)t))), better));
    }
    float bs[8];
    int32_t bt[8];
    _mm256_storeu_ps(bs, best);
    _mm256_storeu_si256((__m256i *)bt, best_t);
    race_merge_lanes(bs, bt, 8, best_score, best_index);
}
#endif

/* The race over the tokens with s >= thr (s-domain filters) and s - mx >= thr_d (min-p);
 * scores are taken relative to the maximum mx, where float32 keeps the precision of the
 * logits at any temperature (l / T of 1e6 would round a score to 1/16 nat). */
static int64_t race_row(const float *l, float it, int64_t V, float thr, float mx, float thr_d,
                        uint64_t key)
{
    float best = -INFINITY;
    int64_t best_t = 0, t = 0;
#if HAVE_X86
    if (use_avx512dq() && V < ((int64_t)1 << 31)) {
        t = V / 16 * 16;
        race_avx512(l, it, t, thr, mx, thr_d, key, &best, &best_t);
    } else if (!use_avx512() && use_avx2() && V < ((int64_t)1 << 31)) {
        t = V / 8 * 8;
        race_avx2(l, it, t, thr, mx, thr_d, key, &best, &best_t);
    }
#endif
    for (; t < V; t++) {
        float s = l[t] * it, d = s - mx;
        if (!(s >= thr) || !(d >= thr_d) || s == -INFINITY)
            continue;
        float u = sm_uniform(key, t);
        float score = u > 0.0f ? d - logf(-logf(u)) : -FLT_MAX; /* as race_avx512 */
        if (score > best) {
            best = score;
            best_t = t;
        }
    }
    return best_t;
}

static void sample_row(const void *vctx, int64_t r)
{
    sample_ctx *c = (sample_ctx *)vctx;
    const float *l = c->logits + r * c->stride;
    const int64_t V = c->vocab;
    if (c->all_greedy || (c->greedy && c->greedy[r])) {
        c->out[r] = argmax_first(l, V);
        return;
    }
    const float it = c->inv_t ? c->inv_t[r] : 1.0f;
    float mx = -INFINITY;
    for (int64_t t = 0; t < V; t++) {
        float s = l[t] * it;
        mx = s > mx ? s : mx;
    }
    if (mx == -INFINITY) {
        c->out[r] = 0;
        return;
    }
    float thr = -INFINITY;
    const int64_t k = c->top_k ? c->top_k[r] : 0;
    const float p = c->top_p ? c->top_p[r] : 1.0f, mp = c->min_p ? c->min_p[r] : 0.0f;
    if ((k > 0 && k < V) || p < 1.0f) {
        float *scratch = malloc((size_t)V * sizeof(float));
        if (!scratch) {
            c->failed = 1;
            c->out[r] = 0;
            return;
        }
        if (k > 0 && k < V) {
            for (int64_t t = 0; t < V; t++)
                scratch[t] = l[t] * it;
            thr = kth_largest(scratch, V, k);
        }
        if (p < 1.0f) {
            float tp = top_p_threshold(l, it, V, thr, mx, p, scratch);
            thr = tp > thr ? tp : thr;
        }
        free(scratch);
    }
    /* min-p: p / p_max >= min_p, i.e. s - mx >= log(min_p) */
    const float thr_d = mp > 0.0f ? logf(mp) : -INFINITY;
    c->out[r] = race_row(l, it, V, thr, mx, thr_d, c->keys[r]);
}

/* sample_rows(logits, rows, vocab, row_stride, inv_t, top_k, top_p, min_p, keys, greedy,
 * out, num_threads): pointers (0 for an absent optional array), see above; greedy = 1
 * (not a pointer) takes every row's argmax, and keys may then be 0. */
static PyObject *py_sample_rows(PyObject *self, PyObject *args)
{
    unsigned long long lp, itp, kp, pp, mpp, keyp, gp, op;
    long long R, V, stride;
    int nth;
    if (!PyArg_ParseTuple(args, "KLLLKKKKKKKi", &lp, &R, &V, &stride, &itp, &kp, &pp, &mpp,
                          &keyp, &gp, &op, &nth))
        return NULL;
    if (R < 0 || V < 1 || stride < V || nth < 1 || !lp || !op || (!keyp && gp != 1)) {
        PyErr_SetString(PyExc_ValueError, "sample_rows: bad shapes or pointers");
        return NULL;
    }
    sample_ctx c = {(const float *)(uintptr_t)lp, V, stride, (const float *)(uintptr_t)itp,
                    (const int64_t *)(uintptr_t)kp, (const float *)(uintptr_t)pp,
                    (const float *)(uintptr_t)mpp, (const uint64_t *)(uintptr_t)keyp,
                    gp == 1 ? NULL : (const uint8_t *)(uintptr_t)gp, (int64_t *)(uintptr_t)op,
                    gp == 1, 0};
    Py_BEGIN_ALLOW_THREADS
    pool_run(sample_row, &c, R, nth < R ? nth : (int)R);
    Py_END_ALLOW_THREADS
    if (c.failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"linear", py_linear, METH_VARARGS,
     "linear(fmt, x_ptr, M, K, qs_ptr, scales_ptr, N, out_ptr, num_threads[, amx_min_rows"
     "[, no_int8]]): out[M, N] float32 = x[M, K] float32 @ dequant(W[N, K])^T; from "
     "amx_min_rows rows (0 = never) on AMX where the CPU has it: up to 8 rows int8 "
     "products of the activations rounded per 32-value block (AMX-INT8; not with "
     "no_int8), more rows bf16 products (AMX-BF16). Without AVX-512, from "
     "FLOWENGINE_CPU_INT16_MIN_ROWS (4) rows, and for 1 row, int16 products of the "
     "activations rounded per 32-value block (not with no_int8)."},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(fmt, qs_ptr, scales_ptr, N, K, out_ptr, num_threads[, bf16]): out[N, K] "
     "float32, or with bf16 those values rounded to bfloat16 (nearest even)."},
    {"paged_decode_attention", py_paged_decode_attention, METH_VARARGS,
     "Decode attention over the paged KV cache (see _cpu_ops.c)."},
    {"paged_prefill_attention", py_paged_prefill_attention, METH_VARARGS,
     "Causal prefill attention over the paged KV cache, AVX2 (see _cpu_ops.c)."},
    {"has_avx2", py_has_avx2, METH_NOARGS,
     "True when the CPU has AVX2, FMA and F16C (and FLOWENGINE_CPU_NO_AVX2 is unset)."},
    {"has_avx512", py_has_avx512, METH_NOARGS, "True when the AVX-512 bodies run."},
    {"has_amx", py_has_amx, METH_NOARGS,
     "True when the AMX-BF16 body runs (asks Linux for the tile state on first call)."},
    {"has_amx_int8", py_has_amx_int8, METH_NOARGS,
     "True when the AMX-INT8 body runs (AMX-INT8 and AVX512-DQ in cpuid, has_amx(), "
     "FLOWENGINE_CPU_NO_AMX_INT8 unset or 0)."},
    {"silu_mul", py_silu_mul, METH_VARARGS,
     "silu_mul(gate_up, T, I, out, num_threads[, bf16]): out[T, I] = silu(gate) * up,\n"
     "float32 (bf16 in and out with bf16 set)."},
    {"rms_norm", py_rms_norm, METH_VARARGS,
     "rms_norm(x, res, w, eps, T, H, out, res_out[, num_threads]): (residual add and) "
     "RMSNorm, float32."},
    {"rope_neox", py_rope_neox, METH_VARARGS,
     "rope_neox(pos, T, x, x_tok_stride, heads, D, table, table_rows, out[, num_threads]): "
     "rotary."},
    {"write_kv", py_write_kv, METH_VARARGS,
     "write_kv(k, ks, v, vs, T, row, elem_size, slots, cache, plane[, kv_fmt]): K/V rows to "
     "slots (kv_fmt 1 / 2: float32 rows rounded into a bf16 / float16 cache)."},
    {"decode_layers", py_decode_layers, METH_VARARGS,
     "decode_layers(table, L, T, H, hq, hkv, D, I, eps, hidden, final_norm_w, out, positions, "
     "rope_table, rope_rows, slots, num_blocks, block_size, tok_idx, req_idx, block_tables, "
     "bt_stride, seq_lens, scale, num_threads[, amx_min_rows, kv_fmt]): all decoder layers "
     "of a decode step (amx_min_rows: int64 [3] per format, 0 = never, as linear's; "
     "kv_fmt: the caches' dtype, 0 float32, 1 bf16, 2 float16)."},
    {"sample_rows", py_sample_rows, METH_VARARGS,
     "sample_rows(logits_ptr, rows, vocab, row_stride, inv_t_ptr, top_k_ptr, top_p_ptr, "
     "min_p_ptr, keys_ptr, greedy_ptr, out_ptr, num_threads): one token per row (temperature, "
     "top-k, top-p, min-p, the exponential race on splitmix64 keys); 0 for an absent array, "
     "greedy_ptr 1 for an all-greedy batch"},
    {"apply_token_bitmask", py_apply_token_bitmask, METH_VARARGS,
     "apply_token_bitmask(logits_ptr, logit_rows, num_rows, vocab, row_stride, words_ptr, "
     "num_words, "
     "pairs_ptr, num_pairs): -inf where a grammar bitmask row disallows a token."},
    {"linear_path", py_linear_path, METH_VARARGS,
     "linear_path(rows): the body a matmul of that many activation rows runs "
     "('avx512-vnni', 'avx512-panels', 'avx512', 'avx2' or 'c'; K a multiple of 16 for "
     "panels)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "flowengine._cpu_ops",
                                    "CPU kernels: quantized linear, paged decode attention.",
                                    -1, methods};

#ifndef AMXI8_MAX_ROWS
#define AMXI8_MAX_ROWS 0
#endif
PyMODINIT_FUNC PyInit__cpu_ops(void)
{
    PyObject *m = PyModule_Create(&module);
    /* the most activation rows the AMX-INT8 body takes (more: the AMX-BF16 body) */
    if (m != NULL && PyModule_AddIntConstant(m, "AMX_INT8_MAX_ROWS", AMXI8_MAX_ROWS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
