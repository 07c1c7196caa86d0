// The folded backward of a pointwise convolution followed by BatchNorm + add + ReLU
// (src/block/fold_backward.rs). With g = dy through the ReLU's mask (the shortcut's gradient),
// the BatchNorm's input gradient is
//     dz[p,k] = a_k g[p,k] + C_k (z[p,k] - M_k) - a_k b_k,
//     a = gamma * inv_std, b = s1 / count, d = dgamma * inv_std / count, C = -a d,
//     s1 = sum_p g, s2 = sum_p g (z - M), dgamma = s2 * inv_std, dbeta = s1
// (batchnorm.cu's bwd_elem; M = m + lo the saved mean). It is never written: with
// z[p,k] = sum_c x[p,c] w[k,c] and G = g^T x,
//     s2_k = sum_c w[k,c] G[k,c] - M_k s1_k                  (no pass over z)
//     dx   = g (a w) + x MM + bias,  MM[c,c'] = sum_k w[k,c] C_k w[k,c'],
//                                     bias[c] = sum_k (-a_k b_k - C_k M_k) w[k,c]
//     dw[k,c] = a_k G[k,c] + C_k Q[k,c] - a_k b_k s_c,
//                                     Q = w H - M s^T, H = x^T x, s_c = sum_p x[p,c].
//
//  * fold_sums_<t>: one pass over the rows: g = dy masked, written (16-byte vectors), and
//    per-block partial sums of g (K channels) and of x (Cin channels), f32 per thread over its
//    rows, then a fixed tree in shared memory: no atomics, the result does not depend on timing.
//  * fold_finalize_<t>: a warp per channel adds the blocks' partials in a fixed order; for the
//    BatchNorm's channels also s2 from G, then dgamma, dbeta and the coefficients [5][K]
//    (m, lo, a, b, d, as finish_bwd writes them).
//    It also writes a w and the right operand of MM and bias (cuBLAS makes
//    [MM | bias] = w^T [C w | the constant of dz] from it): a kernel of one block per input
//    channel summing over k took 13-33 us, bound by its loads' latency.
//  * fold_dw_<t>: block k (one per output channel) stages w's row k; thread c adds w[k,:] H[:,c]
//    and writes dw[k,c] from G, H and s.
//
// Limits (the host refuses the fold beyond them): Cin <= 256 and K <= FOLD_MAX_K, both
// multiples of the 16-byte vector (8 halves, 4 floats); the data 16-byte aligned.

struct FoldSumsArgs {
    const void* dy;     // T [rows][K]
    const u32* mask;    // bits of y, element order
    void* g;            // T [rows][K]
    const void* x;      // T [rows][Cin]
    float* part;        // [blocks][K + Cin]
    u64 rows;
    u64 rpb;            // rows per block
    u32 k;
    u32 cin;
};

struct FoldFinalizeArgs {
    const float* part;     // [blocks][K + Cin]
    const float* gmat;     // G, column-major K x Cin (f32)
    const void* w;         // T [K][Cin]
    const float* mean;
    const float* mean_lo;
    const float* inv_std;
    const float* gamma;
    float* dgamma;
    float* dbeta;
    float* coef;           // [5][K]
    float* s;              // [Cin]
    void* wa;              // T [K][Cin]: a w
    void* wc;              // T, column-major K x (Cin + 1): [C w | the constant of dz]
    u32 blocks;
    u32 k;
    u32 cin;
    float inv_count;
};

struct FoldDwArgs {
    const float* coef;  // [5][K]
    const void* w;      // T [K][Cin]
    const float* h;     // [Cin][Cin], symmetric
    const float* s;     // [Cin]
    const float* gmat;  // G, column-major K x Cin
    void* dw;           // T [K][Cin]
    u32 k;
    u32 cin;
};

#define FOLD_THREADS 256
#define FOLD_MAX_K 2048
#define FOLD_ROWS 4

// V elements of 16 bytes, aligned so that one access is one 16-byte load or store (the 2-byte
// alignment of the 16-bit types would otherwise split it into V accesses).
template <typename T> struct __align__(16) Vec16 {
    static constexpr int V = 16 / sizeof(T);
    T v[V];
};

template <typename T> __device__ __forceinline__ void fold_sums(const FoldSumsArgs& a) {
    constexpr int V = 16 / sizeof(T);
    __shared__ float red[FOLD_THREADS * V];
    const u32 t = threadIdx.x;
    const u64 K = a.k, N = a.cin;
    const u64 r0 = (u64)blockIdx.x * a.rpb;
    const u64 r1 = min(r0 + a.rpb, a.rows);
    float* part = a.part + (u64)blockIdx.x * (K + N);
    // Pass 1: g = dy masked, and its sums. Lanes take vectors of a row, the block several rows.
    {
        const u32 lanes = (u32)(K / V), step = FOLD_THREADS / lanes;
        const u32 cv = t % lanes, ro = t / lanes;
        float acc[V];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = 0.0f;
        if (ro < step) {
            // FOLD_ROWS rows' loads in flight before any store (g may not alias dy, but the
            // compiler cannot know).
            for (u64 r = r0 + ro; r < r1; r += FOLD_ROWS * step) {
                Vec16<T> d[FOLD_ROWS];
                u32 bits[FOLD_ROWS];
#pragma unroll
                for (int u = 0; u < FOLD_ROWS; ++u) {
                    const u64 ru = r + (u64)u * step;
                    const u64 e = ru * K + (u64)cv * V;
                    bits[u] = 0u;
                    if (ru < r1) {
                        d[u] = *(const Vec16<T>*)((const T*)a.dy + e);
                        bits[u] = a.mask[e / 32] >> (e % 32);
                    }
                }
#pragma unroll
                for (int u = 0; u < FOLD_ROWS; ++u) {
                    const u64 ru = r + (u64)u * step;
                    if (ru < r1) {
                        Vec16<T> o;
#pragma unroll
                        for (int j = 0; j < V; ++j) {
                            const bool keep = (bits[u] >> j) & 1u;
                            o.v[j] = keep ? d[u].v[j] : from_float<T>(0.0f);
                            acc[j] += keep ? to_float(d[u].v[j]) : 0.0f;
                        }
                        *(Vec16<T>*)((T*)a.g + ru * K + (u64)cv * V) = o;
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < V; ++j) red[t * V + j] = ro < step ? acc[j] : 0.0f;
        __syncthreads();
        for (u32 c = t; c < K; c += FOLD_THREADS) {
            const u32 l = c / V, j = c % V;
            float sum = 0.0f;
            for (u32 q = 0; q < step; ++q) sum += red[(q * lanes + l) * V + j];
            part[c] = sum;
        }
        __syncthreads();
    }
    // Pass 2: the sums of x over the same rows.
    {
        const u32 lanes = (u32)(N / V), step = FOLD_THREADS / lanes;
        const u32 cv = t % lanes, ro = t / lanes;
        float acc[V];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = 0.0f;
        if (ro < step) {
#pragma unroll 4
            for (u64 r = r0 + ro; r < r1; r += step) {
                const Vec16<T> d = *(const Vec16<T>*)((const T*)a.x + r * N + (u64)cv * V);
#pragma unroll
                for (int j = 0; j < V; ++j) acc[j] += to_float(d.v[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < V; ++j) red[t * V + j] = ro < step ? acc[j] : 0.0f;
        __syncthreads();
        for (u32 c = t; c < N; c += FOLD_THREADS) {
            const u32 l = c / V, j = c % V;
            float sum = 0.0f;
            for (u32 q = 0; q < step; ++q) sum += red[(q * lanes + l) * V + j];
            part[K + c] = sum;
        }
    }
}

// The sum of v over the warp, in every lane (a fixed tree).
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <typename T> __device__ __forceinline__ void fold_finalize(const FoldFinalizeArgs& a) {
    const u64 ch = global_thread() / 32;  // the warp's channel: K BatchNorm ones, then Cin of x
    const u32 lane = threadIdx.x & 31u;
    const u64 K = a.k, N = a.cin;
    if (ch >= K + N) return;  // the whole warp
    double total = 0.0;
    for (u32 b = lane; b < a.blocks; b += 32) total += a.part[(u64)b * (K + N) + ch];
    total = warp_sum(total);
    if (ch >= K) {
        if (lane == 0) a.s[ch - K] = (float)total;
        return;
    }
    const u64 k = ch;
    const double mk = (double)a.mean[k] + (double)a.mean_lo[k];
    const T* w = (const T*)a.w;
    double wg = 0.0;
    for (u64 c = lane; c < N; c += 32) wg += (double)to_float(w[k * N + c]) * (double)a.gmat[c * K + k];
    wg = warp_sum(wg);
    // Every lane holds the sums: the coefficients, then the rows of a w and of the product's
    // right operand [C w | B] (column-major K x (Cin + 1)).
    const double s1 = total, s2 = wg - mk * s1;
    const float inv = a.inv_std[k];
    const float dg = (float)(s2 * inv);
    const float ak = a.gamma[k] * inv, bk = (float)s1 * a.inv_count, dk = dg * inv * a.inv_count;
    const float ck = -ak * dk;
    const float constant = (float)(-(double)ak * bk - (double)ck * mk);
    if (lane == 0) {
        a.dbeta[k] = (float)s1;
        a.dgamma[k] = dg;
        a.coef[k] = a.mean[k];
        a.coef[K + k] = a.mean_lo[k];
        a.coef[2 * K + k] = ak;
        a.coef[3 * K + k] = bk;
        a.coef[4 * K + k] = dk;
        ((T*)a.wc)[N * K + k] = from_float<T>(constant);
    }
    for (u64 c = lane; c < N; c += 32) {
        const float wv = to_float(w[k * N + c]);
        ((T*)a.wa)[k * N + c] = from_float<T>(ak * wv);
        ((T*)a.wc)[c * K + k] = from_float<T>(ck * wv);
    }
}

// The per-channel terms of dz = a g + C (z - M) - a b: a, C = -a d, M = m + lo, a b.
struct Terms {
    float a, c, m, ab;
};

__device__ __forceinline__ Terms terms(const float* cf, u64 K, u64 k) {
    Terms t;
    t.a = cf[2 * K + k];
    t.c = -t.a * cf[4 * K + k];
    t.m = cf[k] + cf[K + k];
    t.ab = t.a * cf[3 * K + k];
    return t;
}

template <typename T> __device__ __forceinline__ void fold_dw(const FoldDwArgs& a) {
    __shared__ float wk[256];
    const u32 N = a.cin, k = blockIdx.x, c = threadIdx.x;
    const u64 K = a.k;
    const T* w = (const T*)a.w;
    if (c < N) wk[c] = to_float(w[(u64)k * N + c]);
    __syncthreads();
    if (c >= N) return;
    // Q[k,c] = sum_c2 w[k,c2] H[c2,c] - M_k s_c (H symmetric, coalesced over c).
    float q = 0.0f;
#pragma unroll 8
    for (u32 c2 = 0; c2 < N; ++c2) q += wk[c2] * a.h[(u64)c2 * N + c];
    const Terms t = terms(a.coef, K, k);
    const float sc = a.s[c];
    q -= t.m * sc;
    T* dw = (T*)a.dw;
    const u64 i = (u64)k * N + c;
    dw[i] = from_float<T>(t.a * a.gmat[(u64)c * K + k] + t.c * q - t.ab * sc);
}

extern "C" __global__ void __launch_bounds__(FOLD_THREADS) fold_sums_f32(FoldSumsArgs a) { fold_sums<float>(a); }
extern "C" __global__ void __launch_bounds__(FOLD_THREADS) fold_sums_f16(FoldSumsArgs a) { fold_sums<nnf_f16>(a); }
extern "C" __global__ void __launch_bounds__(FOLD_THREADS) fold_sums_bf16(FoldSumsArgs a) { fold_sums<nnf_bf16>(a); }
extern "C" __global__ void __launch_bounds__(128) fold_finalize_f32(FoldFinalizeArgs a) { fold_finalize<float>(a); }
extern "C" __global__ void __launch_bounds__(128) fold_finalize_f16(FoldFinalizeArgs a) { fold_finalize<nnf_f16>(a); }
extern "C" __global__ void __launch_bounds__(128) fold_finalize_bf16(FoldFinalizeArgs a) { fold_finalize<nnf_bf16>(a); }
extern "C" __global__ void __launch_bounds__(256) fold_dw_f32(FoldDwArgs a) { fold_dw<float>(a); }
extern "C" __global__ void __launch_bounds__(256) fold_dw_f16(FoldDwArgs a) { fold_dw<nnf_f16>(a); }
extern "C" __global__ void __launch_bounds__(256) fold_dw_bf16(FoldDwArgs a) { fold_dw<nnf_bf16>(a); }
