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
//    It also writes a w and the right operand of MM and bias (fold_dw makes
//    [MM | bias] = w^T [C w | the constant of dz] from it): a kernel of one block per input
//    channel summing over k took 13-33 us, bound by its loads' latency. With G and H made in
//    the sums pass (fold_gram, below) fold_gram_finish does this work per chunk of the reduction.
//  * fold_dw_<t>: block k (one per output channel) stages w's row k; thread c adds w[k,:] H[:,c]
//    and writes dw[k,c] from G, H and s. Blocks K .. K + Cin make column j = block - K of
//    [MM | bias] = w^T wc (a cuBLASLt product of its own took a launch and 3.7-3.9 us).
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
    const void* wc;     // T, column-major K x (Cin + 1): [C w | the constant of dz]
    void* mm;           // T, column-major Cin x (Cin + 1): [MM | bias] = w^T wc
    u32 k;
    u32 cin;
};

#define FOLD_THREADS 256
#define FOLD_MAX_K 2048
#define FOLD_MAX_CIN 256
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

// The sum of v over aligned groups of W lanes, in every lane of the group (a fixed tree).
// Only the group's lanes take part: groups of one warp may finish different kinds of channel.
template <int W> __device__ __forceinline__ double group_sum(double v) {
    static_assert(W >= 1 && W <= 32 && (W & (W - 1)) == 0, "a power of two within a warp");
    const u32 mask = W == 32 ? 0xffffffffu : ((1u << (W % 32)) - 1u) << ((threadIdx.x & 31u) & ~(u32)(W - 1));
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
    return v;
}

// Channel ch's finish, by an aligned group of W lanes (lane: the lane's place in it; every lane
// of the group calls it): x's sum for ch >= K; for a BatchNorm channel dgamma, dbeta, the
// coefficients and the rows of a w and of the product's right operand [C w | B] (column-major
// K x (Cin + 1)). G's row k is grow[c * gstride] (global G is column-major; fold_gram_finish
// passes its chunk's row in shared memory).
template <typename T, int W>
__device__ __forceinline__ void finalize_channel(const FoldFinalizeArgs& a, u64 ch, u32 lane, const float* grow,
                                                 u64 gstride) {
    const u64 K = a.k, N = a.cin;
    double total = 0.0;
#pragma unroll 8
    for (u32 b = lane; b < a.blocks; b += W) total += a.part[(u64)b * (K + N) + ch];
    total = group_sum<W>(total);
    if (ch >= K) {
        if (lane == 0) a.s[ch - K] = (float)total;
        return;
    }
    const u64 k = ch;
    const double mk = (double)a.mean[k] + (double)a.mean_lo[k];
    const T* w = (const T*)a.w;
    // w's row k in registers: loaded once, all in flight (a load after each store of the rows
    // below would wait for it: the pointers may alias).
    constexpr u32 WN = FOLD_MAX_CIN / W;
    float wv[WN];
#pragma unroll
    for (u32 u = 0; u < WN; ++u) {
        const u64 c = lane + (u64)u * W;
        wv[u] = c < N ? to_float(w[k * N + c]) : 0.0f;
    }
    double wg = 0.0;
#pragma unroll
    for (u32 u = 0; u < WN; ++u) {
        const u64 c = lane + (u64)u * W;
        if (c < N) wg += (double)wv[u] * (double)grow[c * gstride];
    }
    wg = group_sum<W>(wg);
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
#pragma unroll
    for (u32 u = 0; u < WN; ++u) {
        const u64 c = lane + (u64)u * W;
        if (c < N) {
            ((T*)a.wa)[k * N + c] = from_float<T>(ak * wv[u]);
            ((T*)a.wc)[c * K + k] = from_float<T>(ck * wv[u]);
        }
    }
}

// A warp per channel: K BatchNorm ones, then Cin of x.
template <typename T> __device__ __forceinline__ void fold_finalize(const FoldFinalizeArgs& a) {
    const u64 ch = global_thread() / 32;
    if (ch >= (u64)a.k + a.cin) return;  // the whole warp
    finalize_channel<T, 32>(a, ch, threadIdx.x & 31u, a.gmat + (ch < a.k ? ch : 0), a.k);
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

#define FOLD_MM_BYTES 16384

// Column j of [MM | bias] = w^T wc (thread c: row c): w staged in chunks of whole rows (16-byte
// copies), wc's column j in f32; the sum over k in order, in f32. Each stage's loads are all
// issued before its stores to shared memory (a store between them would make the next load
// wait: the pointers may alias; staged one after another this took 12 us with dw).
template <typename T> __device__ __forceinline__ void fold_mm_column(const FoldDwArgs& a, u32 j) {
    constexpr u32 U = 16;  // loads in flight a thread
    __shared__ float wcol[FOLD_MAX_K];
    __shared__ __align__(16) unsigned char raw[FOLD_MM_BYTES];
    const u32 N = a.cin, K = a.k, c = threadIdx.x, nt = blockDim.x;
    const T* w = (const T*)a.w;
    const T* wc = (const T*)a.wc + (u64)j * K;
    T* ws = (T*)raw;
    for (u32 k0 = 0; k0 < K; k0 += U * nt) {
        float v[U];
#pragma unroll
        for (u32 u = 0; u < U; ++u) {
            const u32 k = k0 + u * nt + c;
            v[u] = k < K ? to_float(wc[k]) : 0.0f;
        }
#pragma unroll
        for (u32 u = 0; u < U; ++u) {
            const u32 k = k0 + u * nt + c;
            if (k < K) wcol[k] = v[u];
        }
    }
    const u32 chunk = FOLD_MM_BYTES / (N * (u32)sizeof(T));  // rows; N sizeof(T) is a multiple of 16
    float acc = 0.0f;
    for (u32 k0 = 0; k0 < K; k0 += chunk) {
        const u32 rows = min(chunk, K - k0);
        const u32 vecs = rows * N * (u32)sizeof(T) / 16;
        const uint4* src = (const uint4*)(w + (u64)k0 * N);
        for (u32 v0 = 0; v0 < vecs; v0 += U * nt) {
            uint4 r[U];
#pragma unroll
            for (u32 u = 0; u < U; ++u) {
                const u32 v = v0 + u * nt + c;
                if (v < vecs) r[u] = src[v];
            }
#pragma unroll
            for (u32 u = 0; u < U; ++u) {
                const u32 v = v0 + u * nt + c;
                if (v < vecs) ((uint4*)raw)[v] = r[u];
            }
        }
        __syncthreads();
        if (c < N) {
#pragma unroll 8
            for (u32 r = 0; r < rows; ++r) acc = fmaf(to_float(ws[r * N + c]), wcol[k0 + r], acc);
        }
        __syncthreads();
    }
    if (c < N) ((T*)a.mm)[(u64)j * N + c] = from_float<T>(acc);
}

template <typename T> __device__ __forceinline__ void fold_dw(const FoldDwArgs& a) {
    if (blockIdx.x >= a.k) {  // the block-uniform [MM | bias] part
        fold_mm_column<T>(a, blockIdx.x - a.k);
        return;
    }
    __shared__ float wk[256];
    const u32 N = a.cin, k = blockIdx.x, c = threadIdx.x;
    const u64 K = a.k;
    const T* w = (const T*)a.w;
    if (c < N) wk[c] = to_float(w[(u64)k * N + c]);
    __syncthreads();
    if (c >= N) return;
    // Q[k,c] = sum_c2 w[k,c2] H[c,c2] - M_k s_c: H is symmetric, so thread c reads its row in
    // 16-byte loads, all in flight (N is a multiple of 4; reading column c took 6.5 us, bound
    // by 64 dependent-latency loads a thread).
    const float4* hr = (const float4*)(a.h + (u64)c * N);
    float q4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
    for (u32 c2 = 0; c2 < N / 4; ++c2) {
        const float4 v = hr[c2];
        q4[0] = fmaf(wk[4 * c2], v.x, q4[0]);
        q4[1] = fmaf(wk[4 * c2 + 1], v.y, q4[1]);
        q4[2] = fmaf(wk[4 * c2 + 2], v.z, q4[2]);
        q4[3] = fmaf(wk[4 * c2 + 3], v.w, q4[3]);
    }
    float q = (q4[0] + q4[1]) + (q4[2] + q4[3]);
    const Terms t = terms(a.coef, K, k);
    const float sc = a.s[c];
    q -= t.m * sc;
    T* dw = (T*)a.dw;
    const u64 i = (u64)k * N + c;
    dw[i] = from_float<T>(t.a * a.gmat[(u64)c * K + k] + t.c * q - t.ab * sc);
}

// ===== fold_gram: fold_sums with G and H on tensor cores (f16, bf16) =========================
// For Cin = GRAM_CIN and K a multiple of GRAM_KS, the sums pass also makes G = g^T x and
// H = x^T x, so that neither product reads g or x again (cuBLAS's two products took 43 us of
// the demo's 148 us unit). Block (b, s): rows [b rpb, (b+1) rpb), output channels
// [s GRAM_KS, (s+1) GRAM_KS). Per tile of GRAM_R rows: g (masked dy, written out) and x staged
// in shared memory, then mma.sync m16n8k16 with f32 accumulators: warp w owns G's channels
// 16w .. 16w+15 of the slab against all 64 input channels, and the slabs share H's 32 tiles of
// 16 x 8 (32 / slabs each, at most two a warp: K a multiple of 256); slab 0 makes x's sums.
// dy, the mask words and x arrive by cp.async GRAM_STAGES - 1 tiles ahead of the products (with
// the loads in registers one tile ahead, the pass ran at 1.7-2.0 TB/s: 2 blocks of 8 warps an
// SM, 0.7 warps eligible a cycle, ncu on the H100). Each block writes its partial G and H
// ([K][Cin] row-major, then [Cin][Cin]); fold_gram_finish adds them in a fixed order (no
// atomics on the data: the result does not depend on timing).

#define GRAM_THREADS 256
#define GRAM_R 64
#define GRAM_KS 128
#define GRAM_CIN 64
#define GRAM_SEG 16
#define GRAM_REDUCE_THREADS 256
#define GRAM_STAGES 3
#define GRAM_SMEM_BYTES 106496

struct FoldGramArgs {
    const void* dy;   // T [rows][K]
    const u32* mask;  // bits of y, element order
    void* g;          // T [rows][K]
    const void* x;    // T [rows][GRAM_CIN]
    float* part;      // [blocks][K + Cin]: sums of g and x, as fold_sums
    float* gram;      // [blocks][K Cin + Cin Cin]: partial G (row-major k, c), then H
    u64 rows;
    u64 rpb;          // rows per block, a multiple of GRAM_R
    u32 k;
};

struct FoldGramReduceArgs {
    const float* gram;  // [blocks][total]
    float* seg;         // [GRAM_SEG][total]
    u32* counters;      // one per chunk of 4 GRAM_REDUCE_THREADS outputs, zero between launches
    float* gmat;        // G, column-major K x Cin
    float* h;           // H, [Cin][Cin]
    u32 blocks;
    u32 k;
    u32 cin;
};

// fold_gram_finish's two parts: the reduction's, then fold_finalize's (its gmat unused).
struct FoldGramFinishArgs {
    FoldGramReduceArgs r;
    FoldFinalizeArgs f;
};

// ldmatrix .x4 .trans (mma.cuh's nnf_ldsm4_trans): lanes 8i .. 8i+7 give the row addresses of
// matrix i; lane l receives of matrix i the elements (row 2 (l % 4) and 2 (l % 4) + 1, column
// l / 4). The products are mma.cuh's nnf_mma.

// The A fragment of S^T for the 16 columns m0 .. of S (a [row][column] tile of pitch P) and
// rows p0 .. p0+15: A[m][kk] = S[p0 + kk][m0 + m]. Matrix 0: rows p0.., columns m0 (a0);
// 1: rows p0.., columns m0+8 (a1); 2: rows p0+8.., columns m0 (a2); 3: both +8 (a3).
template <typename T, int P>
__device__ __forceinline__ void gram_frag_a(u32 (&a)[4], const T* S, u32 p0, u32 m0, u32 lane) {
    const u32 mat = lane >> 3, r = lane & 7;
    nnf_ldsm4_trans(a, nnf_smem(S + (p0 + r + ((mat & 2u) ? 8u : 0u)) * P + m0 + ((mat & 1u) ? 8u : 0u)));
}

// The B fragments of two n-tiles (columns n0 .. n0+15 of S, rows p0 .. p0+15):
// B[kk][n] = S[p0 + kk][n0 + n]; b[0], b[1] the first tile's, b[2], b[3] the second's.
template <typename T, int P>
__device__ __forceinline__ void gram_frag_b(u32 (&b)[4], const T* S, u32 p0, u32 n0, u32 lane) {
    const u32 mat = lane >> 3, r = lane & 7;
    nnf_ldsm4_trans(b, nnf_smem(S + (p0 + r + ((mat & 1u) ? 8u : 0u)) * P + n0 + ((mat & 2u) ? 8u : 0u)));
}

// 1.0 in both halves of a b16x2 register: the B fragment of a column of ones, so that an mma
// adds a tile's rows (the channels' sums; products by 1 are exact, the sums f32).
template <typename T> struct GramOnes;
template <> struct GramOnes<nnf_f16> { static constexpr u32 value = 0x3c003c00u; };
template <> struct GramOnes<nnf_bf16> { static constexpr u32 value = 0x3f803f80u; };

template <typename T> __device__ __forceinline__ void fold_gram(const FoldGramArgs& a) {
    constexpr u32 ONES = GramOnes<T>::value;
    constexpr int V = 16 / sizeof(T);
    constexpr int GP = GRAM_KS + 8, XP = GRAM_CIN + 8;  // +16 bytes: ldmatrix rows on distinct banks
    constexpr u32 GL = GRAM_KS / V, GSTEP = GRAM_THREADS / GL;    // g: lanes per row, rows per pass
    constexpr u32 XL = GRAM_CIN / V, XSTEP = GRAM_THREADS / XL;   // x: the same
    constexpr int GU = GRAM_R / GSTEP, XU = GRAM_R / XSTEP;       // passes per tile
    // Dynamic shared memory (GRAM_SMEM_BYTES): GRAM_STAGES stages of [dy tile | x tile (padded,
    // as the products read it) | this thread's mask words], then the masked g tile.
    constexpr u32 DY_BYTES = GRAM_R * GRAM_KS * sizeof(T), X_BYTES = GRAM_R * XP * sizeof(T);
    constexpr u32 MK_BYTES = GU * GRAM_THREADS * 4, STAGE = DY_BYTES + X_BYTES + MK_BYTES;
    static_assert(GRAM_STAGES * STAGE + GRAM_R * GP * sizeof(T) == GRAM_SMEM_BYTES, "layout");
    extern __shared__ __align__(16) unsigned char gram_dyn[];
    T* gs = (T*)(gram_dyn + GRAM_STAGES * STAGE);
    const u32 t = threadIdx.x, lane = t & 31u, warp = t >> 5;
    const u32 gq = lane >> 2, gt = lane & 3u;  // the mma fragments' group and thread
    const u64 K = a.k, N = GRAM_CIN;
    const u32 slab = blockIdx.y, slabs = gridDim.y;
    static_assert(GRAM_THREADS / 32 * 16 == GRAM_KS && GRAM_CIN % 16 == 0, "a warp's 16 channels");
    const u64 k0 = (u64)slab * GRAM_KS;
    const bool first = slab == 0;  // x's sums
    // H's 32 tiles of 16 x 8 shared by the slabs: this slab's tiles hs .. hs + hn - 1, two per
    // warp at most (slabs >= 2).
    const u32 hn = 32u / slabs, hs = slab * hn;
    const u64 r0 = (u64)blockIdx.x * a.rpb;
    const u64 r1 = min(r0 + a.rpb, a.rows);
    const u32 gl = t % GL, gro = t / GL, xl = t % XL, xro = t / XL;
    // The channels' sums as products with ones on the tensor cores: warp w's 16 channels of g,
    // and in slab 0 warps 0 .. 3 also x's 16 w .. 16 w + 15 (every column of the result the
    // same). Summed V values a thread as they loaded, or from the staged tiles, the kernel took
    // 59-60 us (f16) and 69-71 (bf16) on the H100 for the demo's unit; with ones 56-58 / 59-62.
    float accs[4] = {0.0f, 0.0f, 0.0f, 0.0f}, accx[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float accg[8][4], acch[2][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) accg[i][j] = 0.0f;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acch[i][j] = 0.0f;
    // Tile i's copies into stage i % GRAM_STAGES (cp.async, zeros past r1: the masked g and x
    // are then 0 there), GRAM_STAGES - 1 tiles ahead of the products: no registers hold them.
    // Each thread copies the dy vectors and mask words it masks itself, and its share of x.
    const u64 tiles = r1 > r0 ? (r1 - r0 + GRAM_R - 1) / GRAM_R : 0;
    auto issue = [&](u64 i) {
        if (i < tiles) {
            unsigned char* st = gram_dyn + (i % GRAM_STAGES) * STAGE;
            const u64 rt = r0 + i * GRAM_R;
#pragma unroll
            for (int u = 0; u < GU; ++u) {
                const u32 row = gro + u * GSTEP;
                const u64 r = rt + row, e = min(r, r1 - 1) * K + k0 + (u64)gl * V;
                const u32 n = r < r1 ? 16u : 0u;
                nnf_cp16(st + (row * GRAM_KS + gl * V) * sizeof(T), (const T*)a.dy + e, n);
                nnf_cp4(st + DY_BYTES + X_BYTES + (u * GRAM_THREADS + t) * 4, a.mask + e / 32, n / 4);
            }
#pragma unroll
            for (int u = 0; u < XU; ++u) {
                const u32 row = xro + u * XSTEP;
                const u64 r = rt + row;
                nnf_cp16(st + DY_BYTES + (row * XP + xl * V) * sizeof(T),
                         (const T*)a.x + min(r, r1 - 1) * N + (u64)xl * V, r < r1 ? 16u : 0u);
            }
        }
        nnf_commit();  // empty past the last tile: the groups stay counted alike
    };
#pragma unroll
    for (int i = 0; i < GRAM_STAGES - 1; ++i) issue(i);
    for (u64 i = 0; i < tiles; ++i) {
        const u64 rt = r0 + i * GRAM_R;
        const unsigned char* st = gram_dyn + (i % GRAM_STAGES) * STAGE;
        const T* xs = (const T*)(st + DY_BYTES);
        nnf_wait<GRAM_STAGES - 2>();  // this thread's copies of tile i
        __syncthreads();  // everyone's; and tile i - 1's products are done with gs and its stage
        issue(i + GRAM_STAGES - 1);
#pragma unroll
        for (int u = 0; u < GU; ++u) {
            const u32 row = gro + u * GSTEP;
            const Vec16<T> d = *(const Vec16<T>*)(st + (row * GRAM_KS + gl * V) * sizeof(T));
            const u64 e = (rt + row) * K + k0 + (u64)gl * V;
            const u32 bits = ((const u32*)(st + DY_BYTES + X_BYTES))[u * GRAM_THREADS + t] >> (e % 32);
            Vec16<T> o;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const bool keep = (bits >> j) & 1u;  // 0 past r1
                o.v[j] = keep ? d.v[j] : from_float<T>(0.0f);
            }
            if (rt + row < r1) *(Vec16<T>*)((T*)a.g + e) = o;
            *(Vec16<T>*)(gs + row * GP + gl * V) = o;
        }
        __syncthreads();  // gs complete
#pragma unroll
        for (u32 p0 = 0; p0 < GRAM_R; p0 += 16) {
            u32 fa[4];
            gram_frag_a<T, GP>(fa, gs, p0, warp * 16, lane);
            nnf_mma<T>(accs, fa, ONES, ONES);
            if (first && warp < GRAM_CIN / 16) {  // warp-uniform
                u32 xa[4];
                gram_frag_a<T, XP>(xa, xs, p0, warp * 16, lane);
                nnf_mma<T>(accx, xa, ONES, ONES);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                u32 fb[4];
                gram_frag_b<T, XP>(fb, xs, p0, 16 * j, lane);
                nnf_mma<T>(accg[2 * j], fa, fb[0], fb[1]);
                nnf_mma<T>(accg[2 * j + 1], fa, fb[2], fb[3]);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const u32 q = warp * 2 + i;  // warp-uniform
                if (q < hn) {
                    const u32 tile = hs + q, mt = tile / 8, nt = tile % 8;
                    u32 ha[4], fb[4];
                    gram_frag_a<T, XP>(ha, xs, p0, mt * 16, lane);
                    gram_frag_b<T, XP>(fb, xs, p0, 16 * (nt / 2), lane);
                    const bool hi = nt & 1u;
                    nnf_mma<T>(acch[i], ha, hi ? fb[2] : fb[0], hi ? fb[3] : fb[1]);
                }
            }
        }
    }
    nnf_wait<0>();  // nothing in flight at exit (the groups past the last tile are empty)
    // The block's partials: C fragment elements (row gq, columns 2 gt, 2 gt + 1) and (row gq + 8).
    const u64 total = K * N + N * N;
    float* gp = a.gram + (u64)blockIdx.x * total;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u64 k = k0 + warp * 16 + gq, c = 8 * i + 2 * gt;
        *(float2*)(gp + k * N + c) = make_float2(accg[i][0], accg[i][1]);
        *(float2*)(gp + (k + 8) * N + c) = make_float2(accg[i][2], accg[i][3]);
    }
    float* hp = gp + K * N;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 q = warp * 2 + i;
        if (q < hn) {
            const u32 tile = hs + q;
            const u64 m = (tile / 8) * 16 + gq, c = (tile % 8) * 8 + 2 * gt;
            *(float2*)(hp + m * N + c) = make_float2(acch[i][0], acch[i][1]);
            *(float2*)(hp + (m + 8) * N + c) = make_float2(acch[i][2], acch[i][3]);
        }
    }
    // The sums: rows gq and gq + 8 of the C fragment (column 2 gt; every column holds them).
    float* part = a.part + (u64)blockIdx.x * (K + N);
    if (gt == 0) {
        part[k0 + warp * 16 + gq] = accs[0];
        part[k0 + warp * 16 + gq + 8] = accs[2];
        if (first && warp < GRAM_CIN / 16) {
            part[K + warp * 16 + gq] = accx[0];
            part[K + warp * 16 + gq + 8] = accx[2];
        }
    }
}

// Adds the blocks' partial G and H in a fixed order, then finishes the channels: block
// (chunk, s) sums partials [s blocks / SEG, (s+1) blocks / SEG) of 4 GRAM_REDUCE_THREADS outputs
// into seg[s]; the last of a chunk's GRAM_SEG blocks to arrive adds the segments in order,
// writes G (column-major) and H, and, holding the chunk's 16 whole rows (of G: BatchNorm
// channels; of H: x's channels), runs fold_finalize's work for those channels. One launch
// fewer than a separate finalize, which also read G back.
template <typename T> __device__ __forceinline__ void fold_gram_finish(const FoldGramFinishArgs& args) {
    const FoldGramReduceArgs& a = args.r;
    constexpr u32 CHUNK = 4 * GRAM_REDUCE_THREADS, ROWS = CHUNK / GRAM_CIN;
    static_assert(CHUNK % GRAM_CIN == 0 && (2 * GRAM_KS * GRAM_CIN) % CHUNK == 0,
                  "a chunk is whole rows of G or of H (K a multiple of 256, Cin = GRAM_CIN)");
    __shared__ __align__(16) float rows[CHUNK];
    const u64 K = a.k, N = GRAM_CIN, total = K * N + N * N;
    const u64 i = ((u64)blockIdx.x * GRAM_REDUCE_THREADS + threadIdx.x) * 4;
    const u32 s = blockIdx.y;
    const u32 b0 = (u32)((u64)a.blocks * s / GRAM_SEG), b1 = (u32)((u64)a.blocks * (s + 1) / GRAM_SEG);
    if (i < total) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
        for (u32 b = b0; b < b1; ++b) {
            const float4 v = __ldcs((const float4*)(a.gram + (u64)b * total + i));
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
        *(float4*)(a.seg + (u64)s * total + i) = acc;
    }
    __shared__ u32 last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 prev = atomicAdd(a.counters + blockIdx.x, 1u);
        last = prev == GRAM_SEG - 1u;
        if (last) atomicExch(a.counters + blockIdx.x, 0u);  // every block has arrived
    }
    __syncthreads();
    if (!last) return;  // the whole block
    __threadfence();
    if (i < total) {
        float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (u32 q = 0; q < GRAM_SEG; ++q) {
            const float4 v = __ldcg((const float4*)(a.seg + (u64)q * total + i));
            sum.x += v.x;
            sum.y += v.y;
            sum.z += v.z;
            sum.w += v.w;
        }
        *(float4*)(rows + threadIdx.x * 4) = sum;
        const float out[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u64 e = i + j;
            if (e < K * N) {
                a.gmat[(e % N) * K + e / N] = out[j];  // (k, c) = (e / N, e % N)
            } else {
                a.h[e - K * N] = out[j];
            }
        }
    }
    __syncthreads();
    // The chunk's channels: BatchNorm channel e0 / N .. of G's rows, or x's channel
    // (e0 - K N) / N .. of H's (their finish needs only their sums).
    const u64 e0 = (u64)blockIdx.x * CHUNK;
    const u64 ch0 = e0 < K * N ? e0 / N : K + (e0 - K * N) / N;
    // All at once, GROUP lanes a channel (a warp a channel, two after another, took 6-8 us).
    constexpr u32 GROUP = GRAM_REDUCE_THREADS / ROWS;
    static_assert(GROUP <= 32 && 32 % GROUP == 0, "a channel's lanes within one warp");
    const u32 q = threadIdx.x / GROUP;
    if (ch0 + q < K + N) finalize_channel<T, GROUP>(args.f, ch0 + q, threadIdx.x % GROUP, rows + q * N, 1);
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
extern "C" __global__ void __launch_bounds__(GRAM_THREADS, 2) fold_gram_f16(FoldGramArgs a) { fold_gram<nnf_f16>(a); }
extern "C" __global__ void __launch_bounds__(GRAM_THREADS, 2) fold_gram_bf16(FoldGramArgs a) { fold_gram<nnf_bf16>(a); }
extern "C" __global__ void __launch_bounds__(GRAM_REDUCE_THREADS) fold_gram_finish_f16(FoldGramFinishArgs a) {
    fold_gram_finish<nnf_f16>(a);
}
extern "C" __global__ void __launch_bounds__(GRAM_REDUCE_THREADS) fold_gram_finish_bf16(FoldGramFinishArgs a) {
    fold_gram_finish<nnf_bf16>(a);
}
