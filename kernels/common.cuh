// Device helpers shared by nnfuse's own kernels, none of them specific to one operation:
// src/kernels.rs embeds this header after the prelude and before the files that use it (today
// kernels/batchnorm.cu and kernels/batchnorm_persistent.cu, through kernels/batchnorm_common.cuh,
// and kernels/conv_pointwise.cu).
//
//  * FastDiv: 64-bit division by a runtime constant (magic and shift from the host);
//  * element access: the bits of f32 / f16 / bf16 values, sign tests, rounding, raw vector loads
//    and stores of 2 to 16 bytes, mask bits of a vector;
//  * L2 eviction policies and the loads / stores that carry them;
//  * the warp-vote transpose (mask words from per-lane predicates);
//  * Welford / Chan reductions (f32 groups, f64 merges; warp and block trees) and block sums.
//
// Indices are 64-bit; blocks are whole warps (ballots and shuffles use the full mask and are
// reached by all 32 lanes).

#define NNF_FULL_WARP 0xffffffffu

// --- fast division (Granlund–Montgomery, 64-bit): the host computes magic and shift ----------

struct FastDiv {
    u64 d;       // divisor, >= 1
    u64 magic;   // floor(2^64 * (2^l - d) / d) + 1 with l = ceil(log2 d); unused for d == 1
    u32 shift;   // l - 1
    u32 is_one;  // d == 1
};

// floor(n / d) for every 64-bit n (src/batchnorm/own_launch.rs emulates and tests this formula).
__device__ __forceinline__ u64 fdiv(const FastDiv& f, u64 n) {
    if (f.is_one) return n;
    const u64 t = __umul64hi(n, f.magic);
    return (t + ((n - t) >> 1)) >> f.shift;
}

// --- element access --------------------------------------------------------------------------

template <typename T> struct FloatBits;
template <> struct FloatBits<float> { static constexpr u32 SIGN = 0x80000000u, INF = 0x7f800000u; };
template <> struct FloatBits<nnf_f16> { static constexpr u32 SIGN = 0x8000u, INF = 0x7c00u; };
template <> struct FloatBits<nnf_bf16> { static constexpr u32 SIGN = 0x8000u, INF = 0x7f80u; };

// v > 0 decided on the element's bits b (in the low bits, the rest zero): sign clear, not zero,
// not NaN, i.e. 1 <= b <= INF. An integer test, immune to the NVRTC 13.0 / sm_90 miscompilation
// of 16-bit compares recorded in CHANGELOG.md; b - 1 wraps for +0, and -0, negatives and NaNs
// are all above INF.
template <typename T> __device__ __forceinline__ bool bits_gt0(u32 b) {
    return b - 1u < FloatBits<T>::INF;
}

template <typename T> __device__ __forceinline__ u32 to_bits(T v) { return v.bits; }
template <> __device__ __forceinline__ u32 to_bits<float>(float v) { return __float_as_uint(v); }

template <typename T> __device__ __forceinline__ T from_bits(u32 b) {
    T t;
    t.bits = (unsigned short)b;
    return t;
}
template <> __device__ __forceinline__ float from_bits<float>(u32 b) { return __uint_as_float(b); }

template <typename T> __device__ __forceinline__ float bits_float(u32 b) {
    return to_float(from_bits<T>(b));
}

// The bits of v rounded to T (nearest even): one conversion instruction for every type (the
// bf16 one, cvt.rn.bf16.f32, exists from sm_80; NaN becomes a quiet NaN).
template <typename T> __device__ __forceinline__ u32 out_bits(float v);
template <> __device__ __forceinline__ u32 out_bits<float>(float v) { return __float_as_uint(v); }
template <> __device__ __forceinline__ u32 out_bits<nnf_f16>(float v) {
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}
template <> __device__ __forceinline__ u32 out_bits<nnf_bf16>(float v) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}

// Two floats rounded to a 16-bit T, packed: lo in bits 0-15, hi in bits 16-31 (one cvt for the
// pair, sm_80+; the same rounding as out_bits).
template <typename T> __device__ __forceinline__ u32 out_bits2(float lo, float hi);
template <> __device__ __forceinline__ u32 out_bits2<nnf_f16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ u32 out_bits2<nnf_bf16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// A vector of V elements of T held in (up to) four 32-bit words; element j of the vector.
template <typename T> __device__ __forceinline__ u32 elem_bits(const u32 (&w)[4], int j) {
    if constexpr (sizeof(T) == 4) {
        return w[j];
    } else {
        return (w[j >> 1] >> ((j & 1) * 16)) & 0xffffu;
    }
}
template <typename T> __device__ __forceinline__ void set_elem_bits(u32 (&w)[4], int j, u32 b) {
    if constexpr (sizeof(T) == 4) {
        w[j] = b;
    } else {
        const int s = (j & 1) * 16;
        w[j >> 1] = (w[j >> 1] & ~(0xffffu << s)) | (b << s);
    }
}

// Loads / stores V elements (V * sizeof(T) bytes: 2, 4, 8 or 16, aligned to that size) as raw
// words; global or shared memory.
template <typename T, int V> __device__ __forceinline__ void load_raw(const T* p, u32 (&w)[4]) {
    constexpr int B = V * (int)sizeof(T);
    static_assert(B == 2 || B == 4 || B == 8 || B == 16, "vector of 2, 4, 8 or 16 bytes");
    if constexpr (B == 16) {
        const uint4 r = *reinterpret_cast<const uint4*>(p);
        w[0] = r.x;
        w[1] = r.y;
        w[2] = r.z;
        w[3] = r.w;
    } else if constexpr (B == 8) {
        const uint2 r = *reinterpret_cast<const uint2*>(p);
        w[0] = r.x;
        w[1] = r.y;
        w[2] = 0u;
        w[3] = 0u;
    } else if constexpr (B == 4) {
        w[0] = *reinterpret_cast<const u32*>(p);
        w[1] = 0u;
        w[2] = 0u;
        w[3] = 0u;
    } else {
        w[0] = *reinterpret_cast<const unsigned short*>(p);
        w[1] = 0u;
        w[2] = 0u;
        w[3] = 0u;
    }
}
template <typename T, int V> __device__ __forceinline__ void store_raw(T* p, const u32 (&w)[4]) {
    constexpr int B = V * (int)sizeof(T);
    static_assert(B == 2 || B == 4 || B == 8 || B == 16, "vector of 2, 4, 8 or 16 bytes");
    if constexpr (B == 16) {
        *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else if constexpr (B == 8) {
        *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    } else if constexpr (B == 4) {
        *reinterpret_cast<u32*>(p) = w[0];
    } else {
        *reinterpret_cast<unsigned short*>(p) = (unsigned short)w[0];
    }
}

// Zeroes the elements of a raw vector whose bit in `bits` (bit j = element j) is clear: dy' of
// the masked backward (a zeroed element is +0, as the bitmask kernels write).
template <typename T, int V> __device__ __forceinline__ void mask_raw(u32 (&w)[4], u32 bits) {
#pragma unroll
    for (int j = 0; j < V; ++j)
        if (!((bits >> j) & 1u)) set_elem_bits<T>(w, j, 0u);
}

// The V mask bits of the V-element vector starting at element e (e a multiple of V, V | 32).
template <int V> __device__ __forceinline__ u32 vec_bits(const u32* mask, u64 e) {
    return (mask[e >> 5] >> (u32)(e & 31u)) & ((V == 32) ? 0xffffffffu : ((1u << V) - 1u));
}

__device__ __forceinline__ bool aligned16(const void* p) { return (((u64)p) & 15u) == 0; }

// --- L2 eviction priority ---------------------------------------------------------------------
// When x fits in L2 (the host decides: `hint`), the data that one operation reads or writes only
// once (dy, the addend, y, dx, d_addend) goes in and out with evict_first, so that x, read by the
// first pass, is still in L2 when the second pass reads it again. Without the hint the policy is
// evict_normal, i.e. what a plain access does.

__device__ __forceinline__ u64 l2_policy(u32 hint) {
    u64 first, normal;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(first));
    asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(normal));
    return hint ? first : normal;
}

__device__ __forceinline__ uint4 ld16_pol(const void* p, u64 pol) {
    uint4 r;
    asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "l"(pol));
    return r;
}

__device__ __forceinline__ void st16_pol(void* p, uint4 v, u64 pol) {
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol)
                 : "memory");
}

__device__ __forceinline__ void st4_pol(void* p, u32 v, u64 pol) {
    asm volatile("st.global.L2::cache_hint.u32 [%0], %1, %2;" ::"l"(p), "r"(v), "l"(pol) : "memory");
}

// load_raw / store_raw with an L2 policy (global memory only).
template <typename T, int V> __device__ __forceinline__ void load_raw_pol(const T* p, u32 (&w)[4], u64 pol) {
    constexpr int B = V * (int)sizeof(T);
    static_assert(B == 2 || B == 4 || B == 8 || B == 16, "vector of 2, 4, 8 or 16 bytes");
    w[1] = w[2] = w[3] = 0u;
    if constexpr (B == 16) {
        asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
            : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
            : "l"(p), "l"(pol));
    } else if constexpr (B == 8) {
        asm("ld.global.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
            : "=r"(w[0]), "=r"(w[1])
            : "l"(p), "l"(pol));
    } else if constexpr (B == 4) {
        asm("ld.global.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(w[0]) : "l"(p), "l"(pol));
    } else {
        unsigned short h;
        asm("ld.global.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(h) : "l"(p), "l"(pol));
        w[0] = h;
    }
}
template <typename T, int V> __device__ __forceinline__ void store_raw_pol(T* p, const u32 (&w)[4], u64 pol) {
    constexpr int B = V * (int)sizeof(T);
    static_assert(B == 2 || B == 4 || B == 8 || B == 16, "vector of 2, 4, 8 or 16 bytes");
    if constexpr (B == 16) {
        st16_pol(p, make_uint4(w[0], w[1], w[2], w[3]), pol);
    } else if constexpr (B == 8) {
        asm volatile("st.global.L2::cache_hint.v2.u32 [%0], {%1, %2}, %3;" ::"l"(p), "r"(w[0]),
                     "r"(w[1]), "l"(pol)
                     : "memory");
    } else if constexpr (B == 4) {
        st4_pol(p, w[0], pol);
    } else {
        asm volatile("st.global.L2::cache_hint.u16 [%0], %1, %2;" ::"l"(p),
                     "h"((unsigned short)w[0]), "l"(pol)
                     : "memory");
    }
}

// --- the warp-vote transpose (as kernels/bitmask.cu) ------------------------------------------

// `bits`: bit j = predicate of this lane's element j, element lane*N + j of a 32*N-element chunk.
// Returns mask word w of the chunk (in every lane of lane group w = lane / (32/N)): the L = 32/N
// lanes of a group shift their bits into place and OR-reduce with xor-shuffles. All 32 lanes call.
template <int N> __device__ __forceinline__ u32 chunk_word(u32 bits) {
    constexpr int L = 32 / N;
    const int lane = threadIdx.x & 31;
    u32 word = bits << (N * (lane & (L - 1)));
#pragma unroll
    for (int d = 1; d < L; d <<= 1) word |= __shfl_xor_sync(NNF_FULL_WARP, word, d);
    return word;
}

// --- Welford / Chan --------------------------------------------------------------------------
// A group of K values (a thread's loads of one iteration) is reduced in f32 (its own mean and
// M2, two passes over registers: few terms, little rounding); every combination of states, from
// the first group merge to the last partial, runs in f64. In f32 those combinations were the
// error: each of the hundreds of merges and tree levels rounded M2 again, leaving the variance
// ~1.5e-7 off on inputs spanning 1e-3..1e3 (the H100 measured y up to 1.9x cuDNN's error).

struct Wf {
    double n, m, m2;  // count, mean, sum of squared deviations
};

__device__ __forceinline__ Wf wf_zero() {
    Wf w;
    w.n = 0.0;
    w.m = 0.0;
    w.m2 = 0.0;
    return w;
}

// Chan's combination of (nb, mb, m2b) into a. An empty side leaves the other unchanged.
__device__ __forceinline__ void wf_merge(Wf& a, double nb, double mb, double m2b) {
    if (nb == 0.0) return;
    if (a.n == 0.0) {
        a.n = nb;
        a.m = mb;
        a.m2 = m2b;
        return;
    }
    const double n = a.n + nb;
    const double r = nb / n;
    const double d = mb - a.m;
    a.m = fma(d, r, a.m);
    a.m2 = a.m2 + m2b + d * d * a.n * r;
    a.n = n;
}

// V channels that always see the same number of values (one count).
template <int V> struct WfV {
    double n;
    double m[V];
    double m2[V];
};

template <int V> __device__ __forceinline__ WfV<V> wfv_zero() {
    WfV<V> a;
    a.n = 0.0;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        a.m[j] = 0.0;
        a.m2[j] = 0.0;
    }
    return a;
}

// Merges K new values of each channel, v[k*V + j] = value k of channel j: the group's own mean
// and M2 in A (two passes over registers), then Chan's combination in f64. With A = float
// (16-bit data) the weight K/n is an f32 quotient (one per group, shared by the V channels): its
// rounding moves the mean by ~6e-8 of one group's deviation, which averages out over the groups.
// With A = double (f32 data: the values x - shift are exact in f64) the group and its weight are
// f64 too: f32 arithmetic there left ~1e-8 absolute in a mean of a few dozen values, 3e-6 of one
// near zero (H100, own_grid_f32).
template <int V, int K, typename A = float>
__device__ __forceinline__ void wfv_group(WfV<V>& a, const A* v) {
    A lm[V], q[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        A s = (A)0;
#pragma unroll
        for (int k = 0; k < K; ++k) s += v[k * V + j];
        lm[j] = s * ((A)1 / (A)K);  // K is a power of two: exact
        A qq = (A)0;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const A d = v[k * V + j] - lm[j];
            qq = fma(d, d, qq);
        }
        q[j] = qq;
    }
    if (a.n == 0.0) {
        a.n = (double)K;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            a.m[j] = (double)lm[j];
            a.m2[j] = (double)q[j];
        }
        return;
    }
    const double n = a.n + (double)K;
    const double r = sizeof(A) == sizeof(double) ? (double)K / n : (double)((float)K / (float)n);
    const double na_r = a.n * r;  // a.n * K / n
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const double d = (double)lm[j] - a.m[j];
        a.m[j] = fma(d, r, a.m[j]);
        a.m2[j] = fma(d * d, na_r, a.m2[j] + (double)q[j]);
    }
    a.n = n;
}

// Chan's combination of another V-channel state (count nb) into a.
template <int V>
__device__ __forceinline__ void wfv_merge(WfV<V>& a, double nb, const double* mb,
                                          const double* m2b) {
    if (nb == 0.0) return;
    if (a.n == 0.0) {
        a.n = nb;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            a.m[j] = mb[j];
            a.m2[j] = m2b[j];
        }
        return;
    }
    const double n = a.n + nb;
    const double r = nb / n;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const double d = mb[j] - a.m[j];
        a.m[j] = fma(d, r, a.m[j]);
        a.m2[j] = a.m2[j] + m2b[j] + d * d * a.n * r;
    }
    a.n = n;
}

__device__ __forceinline__ void wf_warp(Wf& a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const double nb = __shfl_xor_sync(NNF_FULL_WARP, a.n, o);
        const double mb = __shfl_xor_sync(NNF_FULL_WARP, a.m, o);
        const double qb = __shfl_xor_sync(NNF_FULL_WARP, a.m2, o);
        wf_merge(a, nb, mb, qb);
    }
}

// Block-wide combination in a fixed tree (lanes, then warps); the result is valid in thread 0.
// `sh`: 96 doubles of shared memory. Every thread of the block calls; ends synchronised.
template <int NT> __device__ __forceinline__ Wf wf_block(Wf a, double* sh) {
    static_assert(NT % 32 == 0 && NT <= 1024, "whole warps");
    wf_warp(a);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) {
        sh[w] = a.n;
        sh[32 + w] = a.m;
        sh[64 + w] = a.m2;
    }
    __syncthreads();
    Wf r = wf_zero();
    if (w == 0) {
        if (lane < NT / 32) {
            r.n = sh[lane];
            r.m = sh[32 + lane];
            r.m2 = sh[64 + lane];
        }
        wf_warp(r);
    }
    __syncthreads();
    return r;
}

// Sums of two values, block-wide in a fixed tree; valid in thread 0. `sh`: 64 floats.
template <int NT> __device__ __forceinline__ void sum2_block(float& a, float& b, float* sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(NNF_FULL_WARP, a, o);
        b += __shfl_xor_sync(NNF_FULL_WARP, b, o);
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) {
        sh[w] = a;
        sh[32 + w] = b;
    }
    __syncthreads();
    if (w == 0) {
        a = lane < NT / 32 ? sh[lane] : 0.0f;
        b = lane < NT / 32 ? sh[32 + lane] : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            a += __shfl_xor_sync(NNF_FULL_WARP, a, o);
            b += __shfl_xor_sync(NNF_FULL_WARP, b, o);
        }
    }
    __syncthreads();
}
