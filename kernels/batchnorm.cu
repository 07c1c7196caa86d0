// nnfuse's own BatchNorm: the two-pass training kernels and the one-pass inference kernel (after
// kernels/batchnorm_common.cuh). src/batchnorm/own.rs launches them; src/batchnorm/own_launch.rs
// holds the launch arithmetic and a CPU emulation of the index math below.
//
// Training forward  = statistics (bn_stats_cf_* / bn_stats_cl_* + bn_stats_finalize), then
//                     bn_apply_fwd_* (y, and the mask when an activation is fused).
// Training backward = bn_bwd_reduce_cf_* / bn_bwd_reduce_cl_* (+ bn_bwd_finalize): per channel
//                     Σdy' and Σdy'(x - mean) with the mask read inside the reduction and
//                     d_addend = dy' written in the same pass; then bn_apply_bwd_* (dx).
// Inference         = bn_apply_fwd_* with the running statistics folded into scale and shift
//                     while the block stages them.
//
// Every reduction shifts a channel's values by a pivot (its first element) and finishes the mean
// as hi + lo (batchnorm_common.cuh), so y = ((x - hi) - lo) * scale + shift and the backward's
// x - mean keep their precision under a large common offset.
//
// Statistics, channels-first: block (ch, p) of a 1-D grid of C*P blocks reduces vectors
// [p*ipb, (p+1)*ipb) of channel ch, writes its partial, and the last of the channel's P blocks
// to arrive (integer counter) combines the P partials in a fixed order and finishes the channel:
// no second launch. Channels-last: block (p, s) reduces rows [p*ipb, (p+1)*ipb) of channel slab
// s (threads across the slab's channel vectors, rows across threads and blocks) and writes one
// partial per channel; bn_*_finalize (one block per channel) combines the P partials, because every
// block produces partials for all the slab's channels and one block combining all of them would
// serialise.
//
// Apply kernels (elementwise, like kernels/bitmask.cu): vector path when every data pointer is
// 16-byte aligned: lane l of a warp takes vector l of a chunk of 32 vectors (N = 16/sizeof(T)
// elements each, the chunk is N mask words). `mode`:
//  * MODE_RUN / MODE_SPLIT (channels-first, hw >= N): each lane follows the (position in run,
//    channel) of its vectors with a cursor that adds constants (no division per vector); a
//    vector holds one run (hw % N == 0) or the end of one run and the start of the next
//    (MODE_SPLIT, selected per element without branching). Coefficients staged in shared
//    memory (C <= STAGE_MAX_C) or from bn_fold's buffer.
//  * MODE_LAST (channels-last, any C): a warp takes only chunks whose lanes see the same
//    channels, so each lane keeps its N channels' coefficients in registers.
//  * MODE_ELEMENT (any pointer unaligned, or channels-first runs shorter than a vector): lane l
//    takes element 32k + l of a tile, its channel from two fast divisions, one ballot per mask
//    word.

template <typename T> constexpr int max_vec() { return 16 / (int)sizeof(T); }

constexpr int MODE_RUN = 0;      // channels-first vector path, hw % N == 0: one run per vector
constexpr int MODE_LAST = 1;     // channels-last vector path, any C: coefficients in registers
constexpr int MODE_ELEMENT = 2;  // element path (scalar tiles), whatever the alignment
constexpr int MODE_SPLIT = 3;    // channels-first vector path, hw >= N: up to two runs per vector

// Kernel kinds of the compilation units (NNF_BN_KERNEL, batchnorm_common.cuh): one entry point
// per unit, with the type-free kernel that runs beside it (bn_stats_finalize with bn_stats_cl,
// bn_bwd_finalize with bn_bwd_reduce_cl, bn_fold with the channels-first apply). Keep in sync
// with src/batchnorm/own_units.rs (a CPU test compares them).
#define NNF_BN_K_STATS_CF 1
#define NNF_BN_K_STATS_CL 2
#define NNF_BN_K_REDUCE_CF 3
#define NNF_BN_K_REDUCE_CL 4
#define NNF_BN_K_APPLY_FWD_NONE 5
#define NNF_BN_K_APPLY_FWD_RELU 6
#define NNF_BN_K_APPLY_FWD_ADD_RELU 7
#define NNF_BN_K_APPLY_FWD_NONE_LAST 8
#define NNF_BN_K_APPLY_FWD_RELU_LAST 9
#define NNF_BN_K_APPLY_FWD_ADD_RELU_LAST 10
#define NNF_BN_K_APPLY_BWD 11
#define NNF_BN_K_APPLY_BWD_LAST 12
#define NNF_BN_K_CHANNEL_BWD 13

// ===== statistics ============================================================================

struct Geom {
    FastDiv ipr;  // channels-first: vectors per run (hw / vec), as a divisor
    u64 runs;  // channels-first: n, the runs of a channel
    u64 hw;    // channels-first: elements per run
    u64 rows;  // channels-last: rows (n*h*w)
    u64 ipb;   // channels-first: vectors per part; channels-last: rows per part
    u32 channels;
    u32 parts;  // P
    u32 vec;    // V, elements per vector access
    u32 slabs;  // channels-last: channel slabs
    u32 cvs;    // channels-last: channel vectors per slab
    u32 rb;     // channels-last: rows per block iteration (THREADS / cvs)
};

struct StatsArgs {
    const void* x;
    double* part;     // [3][C][P]: count, mean, M2 (f64: see Welford in batchnorm_common.cuh)
    u32* counters;    // channels-first: one per channel, zero between launches
    float* saved_mean;
    float* saved_mean_lo;  // the mean's remainder: mean = saved_mean + saved_mean_lo
    float* saved_invstd;
    float* running_mean;
    float* running_var;
    Geom g;
    float eps;
    double momentum;  // f64: 0.1 has no f32 (the running statistics' update is in f64)
};

// A channel's pivot: its first element (o = 0, i = 0 channels-first; row 0 channels-last).
template <typename T> __device__ __forceinline__ float pivot(const void* x, const Geom& g, u64 ch) {
    return to_float(((const T*)x)[g.slabs == 0 ? ch * g.hw : ch]);
}

// Block (ch, p): this thread's Welford state over its vectors of [p*ipb, (p+1)*ipb), channel ch.
template <typename T, int V> __device__ __forceinline__ Wf stats_cf(const StatsArgs& a) {
    const u64 P = a.g.parts;
    const u64 ch = blockIdx.x / P, p = blockIdx.x - ch * P;
    const u64 k0 = p * a.g.ipb;
    const u64 k1 = min(k0 + a.g.ipb, a.g.runs * a.g.ipr.d);
    WfV<1> acc = wfv_zero<1>();
    cf_stats_range<T, V, THREADS>((const T*)a.x, a.g.channels, a.g.hw, a.g.ipr, ch, k0, k1,
                                  pivot<T>(a.x, a.g, ch), acc, nullptr);
    Wf w;
    w.n = acc.n;
    w.m = acc.m[0];
    w.m2 = acc.m2[0];
    return w;
}

// Writes the block's partial; the channel's last block combines all P and finishes the channel.
template <typename T>
__device__ __forceinline__ void stats_cf_finish(const StatsArgs& a, const Wf& w, double* sh) {
    const u64 P = a.g.parts, C = a.g.channels;
    const u64 ch = blockIdx.x / P, p = blockIdx.x - ch * P;
    const u64 cp = C * P;
    if (threadIdx.x == 0) {
        a.part[ch * P + p] = w.n;
        a.part[cp + ch * P + p] = w.m;
        a.part[2 * cp + ch * P + p] = w.m2;
    }
    if (arrive_last(a.counters + ch, (u32)P)) {
        const Wf t = combine_wf<THREADS>(a.part, cp, ch * P, P, sh);
        if (threadIdx.x == 0) {
            float hi, lo;
            finish_stats(ch, t, pivot<T>(a.x, a.g, ch), a.eps, a.momentum, a.saved_mean,
                         a.saved_mean_lo, a.saved_invstd, a.running_mean, a.running_var, hi, lo);
        }
    }
}

template <typename T, int V> __device__ __forceinline__ void stats_cl(const StatsArgs& a, double* red) {
    const u32 S = a.g.slabs, cvs = a.g.cvs, rb = a.g.rb;
    const u64 C = a.g.channels, P = a.g.parts;
    const u32 s = blockIdx.x % S;
    const u64 p = blockIdx.x / S;
    const u32 t = threadIdx.x, ro = t / cvs, cvl = t - ro * cvs;
    const u64 cv = (u64)s * cvs + cvl;
    const bool active = ro < rb && cv < C / V;
    const u64 r0 = p * a.g.ipb;
    const u64 r1 = min(r0 + a.g.ipb, a.g.rows);
    WfV<V> acc = wfv_zero<V>();
    if (active) {
        float shift[V];
#pragma unroll
        for (int j = 0; j < V; ++j) shift[j] = pivot<T>(a.x, a.g, cv * V + j);
        cl_stats_rows<T, V>((const T*)a.x, C, cv, r0 + ro, r1, rb, shift, acc, nullptr, 0);
    }
    cl_tree_wf<V, THREADS, max_vec<T>()>(acc, ro, rb, cvs, active, red);
    if (active && ro == 0) {
        const u64 cp = C * P;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const u64 ch = cv * V + j;
            a.part[ch * P + p] = acc.n;
            a.part[cp + ch * P + p] = acc.m[j];
            a.part[2 * cp + ch * P + p] = acc.m2[j];
        }
    }
}

// One block per channel: combine the channel's P partials, finish the channel.
template <typename T> __device__ __forceinline__ void stats_finalize(const StatsArgs& a) {
    __shared__ double sh[96];
    const u64 P = a.g.parts, ch = blockIdx.x;
    const Wf t = combine_wf<THREADS>(a.part, (u64)a.g.channels * P, ch * P, P, sh);
    if (threadIdx.x == 0) {
        float hi, lo;
        finish_stats(ch, t, pivot<T>(a.x, a.g, ch), a.eps, a.momentum, a.saved_mean,
                     a.saved_mean_lo, a.saved_invstd, a.running_mean, a.running_var, hi, lo);
    }
}

// ===== backward reduction ====================================================================

struct ReduceArgs {
    const void* x;
    const void* dy;
    const u32* mask;  // read when act != ACT_NONE
    void* dz;         // d_addend, written when act == ACT_ADD_RELU
    const float* saved_mean;
    const float* saved_mean_lo;
    const float* saved_invstd;
    const float* gamma;
    float* part;  // [2][C][P]: Σdy', Σdy'(x - mean)
    u32* counters;
    float* coef;  // [5][C], see finish_bwd
    float* dgamma;
    float* dbeta;
    Geom g;
    float inv_count;  // 1 / M
    u32 act;
    u32 hint;  // x fits in L2: dy and d_addend pass with evict_first (l2_policy)
    u32 pad;
};

// Block (ch, p): this thread's Σdy' and Σdy'(x - mean) over its vectors of [p*ipb, (p+1)*ipb),
// channel ch.
template <typename T, int V>
__device__ __forceinline__ void reduce_cf(const ReduceArgs& a, float& s1, float& s2) {
    const u64 P = a.g.parts;
    const u64 ch = blockIdx.x / P, p = blockIdx.x - ch * P;
    const u64 k0 = p * a.g.ipb;
    const u64 k1 = min(k0 + a.g.ipb, a.g.runs * a.g.ipr.d);
    s1 = 0.0f;
    s2 = 0.0f;
    cf_reduce_range<T, V, THREADS>((const T*)a.x, (const T*)a.dy, a.mask, (T*)a.dz, (int)a.act,
                                   a.g.channels, a.g.hw, a.g.ipr, ch, k0, k1, a.saved_mean[ch],
                                   a.saved_mean_lo[ch], s1, s2, nullptr, nullptr, l2_policy(a.hint));
}

__device__ __forceinline__ void reduce_cf_finish(const ReduceArgs& a, float s1, float s2, float* sh) {
    const u64 P = a.g.parts, C = a.g.channels;
    const u64 ch = blockIdx.x / P, p = blockIdx.x - ch * P;
    const u64 cp = C * P;
    if (threadIdx.x == 0) {
        a.part[ch * P + p] = s1;
        a.part[cp + ch * P + p] = s2;
    }
    if (arrive_last(a.counters + ch, (u32)P)) {
        float t1, t2;
        combine_sums<THREADS>(a.part, cp, ch * P, P, t1, t2, sh);
        if (threadIdx.x == 0)
            finish_bwd(ch, C, t1, t2, a.inv_count, a.saved_mean, a.saved_mean_lo, a.saved_invstd,
                       a.gamma, a.dgamma, a.dbeta, a.coef);
    }
}

template <typename T, int V> __device__ __forceinline__ void reduce_cl(const ReduceArgs& a, float* red) {
    const u32 S = a.g.slabs, cvs = a.g.cvs, rb = a.g.rb;
    const u64 C = a.g.channels, P = a.g.parts;
    const u32 s = blockIdx.x % S;
    const u64 p = blockIdx.x / S;
    const u32 t = threadIdx.x, ro = t / cvs, cvl = t - ro * cvs;
    const u64 cv = (u64)s * cvs + cvl;
    const bool active = ro < rb && cv < C / V;
    const u64 r0 = p * a.g.ipb;
    const u64 r1 = min(r0 + a.g.ipb, a.g.rows);
    float mhi[V], mlo[V], s1[V], s2[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        mhi[j] = active ? a.saved_mean[cv * V + j] : 0.0f;
        mlo[j] = active ? a.saved_mean_lo[cv * V + j] : 0.0f;
        s1[j] = 0.0f;
        s2[j] = 0.0f;
    }
    if (active)
        cl_reduce_rows<T, V>((const T*)a.x, (const T*)a.dy, a.mask, (T*)a.dz, (int)a.act, C, cv,
                             r0 + ro, r1, rb, mhi, mlo, s1, s2, nullptr, nullptr, 0,
                             l2_policy(a.hint));
    cl_tree_sums<V, THREADS>(s1, s2, ro, rb, cvs, active, red);
    if (active && ro == 0) {
        const u64 cp = C * P;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const u64 ch = cv * V + j;
            a.part[ch * P + p] = s1[j];
            a.part[cp + ch * P + p] = s2[j];
        }
    }
}

#if NNF_BN_PICK(NNF_BN_K_REDUCE_CL)
extern "C" __global__ void __launch_bounds__(THREADS) bn_bwd_finalize(ReduceArgs a) {
    __shared__ float sh[96];
    const u64 P = a.g.parts, C = a.g.channels, ch = blockIdx.x;
    float t1, t2;
    combine_sums<THREADS>(a.part, C * P, ch * P, P, t1, t2, sh);
    if (threadIdx.x == 0)
        finish_bwd(ch, C, t1, t2, a.inv_count, a.saved_mean, a.saved_mean_lo, a.saved_invstd,
                   a.gamma, a.dgamma, a.dbeta, a.coef);
}
#endif

// ===== forward apply (training second pass, inference) =======================================

struct ApplyFwdArgs {
    const void* x;
    const void* z;  // addend (ACT_ADD_RELU)
    void* y;
    u32* mask;  // null: no mask (inference)
    const float* mean;     // saved mean (training) or running mean (inference)
    const float* mean_lo;  // the saved mean's remainder (training); null (inference): 0
    const float* inv;      // saved inverse std (training) or running variance (inference, from_var)
    const float* gamma;
    const float* beta;
    const float* coef;     // [4][C] mean hi, mean lo, scale, shift made by bn_fold when needed
    u64 n;
    FastDiv inner;  // elements per run (channels-first) or 1 (channels-last)
    FastDiv chans;  // C
    u64 res;        // MODE_LAST: residue classes of chunks, C / gcd(C, 32 N)
    u64 wpr;        // MODE_LAST: warps per residue class
    u32 mode;
    u32 staged;    // coefficients staged in shared memory (C <= STAGE_MAX_C), else read from coef
    u32 from_var;  // scale = gamma / sqrt(inv + eps) (inference) instead of gamma * inv
    float eps;
    u32 hint;  // x is in L2 from the statistics pass: z, y and the mask pass with evict_first
    // MODE_LAST: each warp takes its chunks last to first, so that the whole grid sweeps the
    // tensor from its end: x just written by a convolution (BatchNorm from its sums) has its end
    // still in L2.
    u32 reverse;
    // MODE_LAST from sums (sum non-null; the kernel name's `_last`, fwd_sums_stage): every block
    // stages the coefficients of Σx and Σx² (f32, C each, over `count` values) in shared memory,
    // through the statistics' own arithmetic, and block 0 writes the saved statistics (mean,
    // mean_lo, inv, cast writable) and updates the running ones, as bn_finalize_from_sums
    // would have: one launch instead of two.
    const float* sum;
    const float* sqsum;
    const float* sum_lo;    // null, or the sums' low words (hi + lo)
    const float* sqsum_lo;  // null with sum_lo
    float* running_mean;
    float* running_var;
    double count;
    double momentum;
};

struct Coef3 {
    float m, lo, s, b;  // y = ((x - m) - lo) * s + b
};

// The coefficients of channel c from the raw per-channel inputs (one place computes them: the
// staging loop, bn_fold, the channels-last lanes' registers).
__device__ __forceinline__ Coef3 fwd_coef_make(const ApplyFwdArgs& a, u64 c) {
    Coef3 k;
    k.m = a.mean[c];
    k.lo = a.mean_lo != nullptr ? a.mean_lo[c] : 0.0f;
    const float v = a.inv[c];
    const float is = a.from_var ? 1.0f / sqrtf(v + a.eps) : v;
    k.s = a.gamma[c] * is;
    k.b = a.beta[c];
    return k;
}

// The coefficients of channel c from `src` (shared memory or a bn_fold buffer): [4][C].
__device__ __forceinline__ Coef3 fwd_coef(const float* src, u64 C, u64 c) {
    Coef3 k;
    k.m = src[c];
    k.lo = src[C + c];
    k.s = src[2 * C + c];
    k.b = src[3 * C + c];
    return k;
}

// From `src`, or from the raw inputs when there is none (MODE_LAST stages nothing).
__device__ __forceinline__ Coef3 fwd_coef_any(const ApplyFwdArgs& a, const float* src, u64 c) {
    return src != nullptr ? fwd_coef(src, a.chans.d, c) : fwd_coef_make(a, c);
}

__device__ __forceinline__ void fwd_fold(const ApplyFwdArgs& a, float* dst, u64 c0, u64 step) {
    const u64 C = a.chans.d;
    for (u64 c = c0; c < C; c += step) {
        const Coef3 k = fwd_coef_make(a, c);
        dst[c] = k.m;
        dst[C + c] = k.lo;
        dst[2 * C + c] = k.s;
        dst[3 * C + c] = k.b;
    }
}

// From sums (a.sum non-null): the coefficients of channels c0, c0 + step, ... into dst ([4][C])
// from the channels' sums, by finalize_from_sums' arithmetic (wf_from_sums, stats_mean_inv), so
// that y has the bits the finalize-then-apply launches gave; `write` (one block of the grid):
// also the saved and running statistics, as finish_stats writes them.
__device__ __forceinline__ void fwd_sums_stage(const ApplyFwdArgs& a, float* dst, u64 c0, u64 step,
                                               bool write) {
    const u64 C = a.chans.d;
    for (u64 c = c0; c < C; c += step) {
        const Wf t = wf_from_sums(sum_hl(a.sum, a.sum_lo, c), sum_hl(a.sqsum, a.sqsum_lo, c), a.count);
        float hi, lo;
        double inv;
        if (write) {
            inv = finish_stats(c, t, 0.0f, a.eps, a.momentum, const_cast<float*>(a.mean),
                               const_cast<float*>(a.mean_lo), const_cast<float*>(a.inv),
                               a.running_mean, a.running_var, hi, lo);
        } else {
            double mean;
            inv = stats_mean_inv(t, 0.0f, a.eps, mean, hi, lo);
        }
        dst[c] = hi;
        dst[C + c] = a.mean_lo != nullptr ? lo : 0.0f;
        dst[2 * C + c] = a.gamma[c] * (float)inv;
        dst[3 * C + c] = a.beta[c];
    }
}

#if NNF_BN_PICK(NNF_BN_K_APPLY_FWD_NONE) || NNF_BN_PICK(NNF_BN_K_APPLY_FWD_RELU) || \
    NNF_BN_PICK(NNF_BN_K_APPLY_FWD_ADD_RELU)
// Writes the [4][C] coefficients to a.coef, for channels-first launches that cannot stage them.
extern "C" __global__ void __launch_bounds__(THREADS) bn_fold(ApplyFwdArgs a) {
    fwd_fold(a, const_cast<float*>(a.coef), global_thread(), grid_threads());
}
#endif

// The channel of element e.
__device__ __forceinline__ u64 channel_of(const FastDiv& inner, const FastDiv& chans, u64 e) {
    const u64 q = fdiv(inner, e);
    return q - fdiv(chans, q) * chans.d;
}

// One output element before rounding: the affine transform ((x - hi) - lo) * scale + shift in
// f32, the addend, ReLU.
template <int ACT> __device__ __forceinline__ float fwd_val(float xv, float zv, const Coef3& k) {
    float v = fmaf((xv - k.m) - k.lo, k.s, k.b);
    if constexpr (ACT == ACT_ADD_RELU) v += zv;
    if constexpr (ACT != ACT_NONE) v = (v <= 0.0f) ? 0.0f : v;  // NaN stays NaN; -0 becomes +0
    return v;
}

// The same, rounded once to T. Returns the output's bits.
template <typename T, int ACT> __device__ __forceinline__ u32 fwd_elem(float xv, float zv, const Coef3& k) {
    return out_bits<T>(fwd_val<ACT>(xv, zv, k));
}

// Elements [base, min(base + 32*K, n)), base a multiple of 32: lane l takes base + 32k + l, so
// ballot k is mask word base/32 + k. Coefficients from `src`, or the raw inputs (null).
template <typename T, int ACT, int K>
__device__ __forceinline__ void fwd_tile(const ApplyFwdArgs& a, const float* src, u64 base, int lane) {
    const T* x = (const T*)a.x;
    const T* z = (const T*)a.z;
    T* y = (T*)a.y;
    const u64 n = a.n;
    T xs[K], zs[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const u64 i = base + 32u * (u64)k + lane;
        xs[k] = T{};
        zs[k] = T{};
        if (i < n) {
            xs[k] = x[i];
            if constexpr (ACT == ACT_ADD_RELU) zs[k] = z[i];
        }
    }
    u32 mine = 0;
#pragma unroll 1
    for (int k = 0; k < K; ++k) {  // the tail / unaligned path: kept compact
        const u64 i = base + 32u * (u64)k + lane;
        const bool in = i < n;
        u32 ob = 0;
        if (in) {
            const Coef3 c = fwd_coef_any(a, src, channel_of(a.inner, a.chans, i));
            ob = fwd_elem<T, ACT>(to_float(xs[k]), ACT == ACT_ADD_RELU ? to_float(zs[k]) : 0.0f, c);
            y[i] = from_bits<T>(ob);
        }
        if constexpr (ACT != ACT_NONE) {
            const u32 word = __ballot_sync(NNF_FULL_WARP, in && bits_gt0<T>(ob));
            if (lane == k) mine = word;
        }
    }
    if constexpr (ACT != ACT_NONE) {
        if (a.mask != nullptr) {
            const u64 w = base / 32 + lane;
            if (lane < K && w < (n + 31) / 32) a.mask[w] = mine;
        }
    }
}

// --- the vector paths ------------------------------------------------------------------------
// Every data pointer 16-byte aligned: lane l of a warp takes vector l (N = 16/sizeof(T)
// elements) of a chunk of 32 vectors, which is N mask words. Chunk c holds elements
// [c*CHUNK, (c+1)*CHUNK). The elements after the last whole chunk (fewer than CHUNK, from a
// word boundary) go to the element path of the grid's last warp.

// y (into w) of one vector whose element j takes coefficients kj(j); returns the mask bits. In
// 16-bit types each word's two outputs are rounded and packed by one instruction.
template <typename T, int ACT, typename KJ>
__device__ __forceinline__ u32 fwd_vec(u32 (&w)[4], const u32 (&wz)[4], KJ kj) {
    constexpr int N = 16 / sizeof(T);
    u32 bits = 0;
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const float zf = ACT == ACT_ADD_RELU ? __uint_as_float(wz[j]) : 0.0f;
            const u32 ob = fwd_elem<T, ACT>(__uint_as_float(w[j]), zf, kj(j));
            if constexpr (ACT != ACT_NONE) bits |= (u32)bits_gt0<T>(ob) << j;
            w[j] = ob;
        }
    } else {
#pragma unroll
        for (int p = 0; p < N / 2; ++p) {
            const float z0 = ACT == ACT_ADD_RELU ? bits_float<T>(wz[p] & 0xffffu) : 0.0f;
            const float z1 = ACT == ACT_ADD_RELU ? bits_float<T>(wz[p] >> 16) : 0.0f;
            const float y0 = fwd_val<ACT>(bits_float<T>(w[p] & 0xffffu), z0, kj(2 * p));
            const float y1 = fwd_val<ACT>(bits_float<T>(w[p] >> 16), z1, kj(2 * p + 1));
            const u32 o = out_bits2<T>(y0, y1);
            if constexpr (ACT != ACT_NONE)
                bits |= ((u32)bits_gt0<T>(o & 0xffffu) | ((u32)bits_gt0<T>(o >> 16) << 1)) << (2 * p);
            w[p] = o;
        }
    }
    return bits;
}

// Stores chunk c's vector of this lane and (with a mask) the chunk's N mask words (L2 policy
// `pol`). All 32 lanes.
template <typename T, int ACT>
__device__ __forceinline__ void fwd_store(const ApplyFwdArgs& a, u64 c, int lane, const u32 (&w)[4],
                                          u32 bits, u64 pol) {
    constexpr int N = 16 / sizeof(T);
    st16_pol(reinterpret_cast<uint4*>(a.y) + c * 32 + lane, make_uint4(w[0], w[1], w[2], w[3]), pol);
    if constexpr (ACT != ACT_NONE) {
        if (a.mask != nullptr) {
            const u32 word = chunk_word<N>(bits);
            if ((lane & (32 / N - 1)) == 0) st4_pol(a.mask + c * N + lane / (32 / N), word, pol);
        }
    }
}

// Loads this lane's vector of chunk c (and of the addend, with L2 policy `pol`).
template <int ACT>
__device__ __forceinline__ void fwd_load(const ApplyFwdArgs& a, u64 c, int lane, u32 (&w)[4],
                                         u32 (&wz)[4], u64 pol) {
    const uint4 v = reinterpret_cast<const uint4*>(a.x)[c * 32 + lane];
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
    if constexpr (ACT == ACT_ADD_RELU) {
        const uint4 u = ld16_pol(reinterpret_cast<const uint4*>(a.z) + c * 32 + lane, pol);
        wz[0] = u.x;
        wz[1] = u.y;
        wz[2] = u.z;
        wz[3] = u.w;
    } else {
        wz[0] = wz[1] = wz[2] = wz[3] = 0u;
    }
}

// Channels-first: a vector starting at element e sits at position r = e % hw of a run of
// channel ch = (e / hw) % C. Moving e on by a constant K adds (K % hw, (K / hw) % C) with one
// carry each, so a lane follows its vectors without dividing (hw, C < 2^31: the host checks).
struct RunCursor {
    u32 r, ch;
};

__device__ __forceinline__ RunCursor run_at(const FastDiv& inner, const FastDiv& chans, u64 e) {
    const u64 q = fdiv(inner, e);
    RunCursor k;
    k.r = (u32)(e - q * inner.d);
    k.ch = (u32)(q - fdiv(chans, q) * chans.d);
    return k;
}

// The step of a move by K (as a cursor: dr = K % hw, dc = (K / hw) % C).
__device__ __forceinline__ void run_advance(RunCursor& k, const RunCursor& step, u32 hw, u32 C) {
    k.r += step.r;
    k.ch += step.ch;
    if (k.r >= hw) {
        k.r -= hw;
        k.ch += 1;
    }
    if (k.ch >= C) k.ch -= C;
}

// MODE_RUN (SPLIT false: hw % N == 0, a vector lies in one run) and MODE_SPLIT (hw >= N, hw % N
// != 0: the first hw - r elements of a vector are channel ch, the rest the next channel; the
// selection is branch-free so that a warp never diverges on it). Warps take APPLY_UNROLL
// consecutive chunks, grid-stride.
template <typename T, int ACT, bool SPLIT>
__device__ __forceinline__ void fwd_first(const ApplyFwdArgs& a, const float* src) {
    constexpr int N = 16 / sizeof(T);
    constexpr u64 CHUNK = 32 * N;
    const int lane = threadIdx.x & 31;
    const u64 warp = global_thread() >> 5;
    const u64 nwarps = grid_threads() >> 5;
    const u64 n = a.n, nchunks = n / CHUNK;
    const u32 hw = (u32)a.inner.d, C = (u32)a.chans.d;
    const u64 pol = l2_policy(a.hint);
    const RunCursor one = run_at(a.inner, a.chans, CHUNK);
    const RunCursor stride = run_at(a.inner, a.chans, nwarps * APPLY_UNROLL * CHUNK);
    RunCursor cur = run_at(a.inner, a.chans, warp * APPLY_UNROLL * CHUNK + (u64)lane * N);
    for (u64 c0 = warp * APPLY_UNROLL; c0 < nchunks; c0 += nwarps * APPLY_UNROLL) {
        u32 xs[APPLY_UNROLL][4], zs[APPLY_UNROLL][4];
#pragma unroll
        for (int u = 0; u < APPLY_UNROLL; ++u)
            if (c0 + u < nchunks) fwd_load<ACT>(a, c0 + u, lane, xs[u], zs[u], pol);
        RunCursor k = cur;
#pragma unroll
        for (int u = 0; u < APPLY_UNROLL; ++u) {
            const u64 c = c0 + u;
            if (c < nchunks) {  // the same for the whole warp
                const Coef3 k0 = fwd_coef(src, C, k.ch);
                u32 bits;
                if constexpr (SPLIT) {
                    const u32 s = hw - k.r;  // elements of the vector in channel k.ch (>= 1)
                    const Coef3 k1 = fwd_coef(src, C, k.ch + 1 == C ? 0u : k.ch + 1);
                    bits = fwd_vec<T, ACT>(xs[u], zs[u], [&](int j) {
                        const bool first = (u32)j < s;
                        Coef3 q;
                        q.m = first ? k0.m : k1.m;
                        q.lo = first ? k0.lo : k1.lo;
                        q.s = first ? k0.s : k1.s;
                        q.b = first ? k0.b : k1.b;
                        return q;
                    });
                } else {
                    bits = fwd_vec<T, ACT>(xs[u], zs[u], [&](int) { return k0; });
                }
                fwd_store<T, ACT>(a, c, lane, xs[u], bits, pol);
            }
            run_advance(k, one, hw, C);
        }
        run_advance(cur, stride, hw, C);
    }
    const u64 done = nchunks * CHUNK;
    if (done < n && warp == nwarps - 1) fwd_tile<T, ACT, SCALAR_WORDS>(a, src, done, lane);
}

// MODE_LAST (channels-last, any C): chunk c's lane l holds channels (c*CHUNK + l*N + j) % C,
// which depend on c only through c % res (res = C / gcd(C, CHUNK)). Warp w takes the chunks of
// residue class w % res (warps w / res, + wpr, ...), so each lane loads its N channels'
// coefficients once into registers (from the raw inputs, or from `src`: the block's staging of
// them from sums): no per-element channel arithmetic. In
// 16-bit types the mean's remainder is folded into the shift (b - lo*s; the output's rounding
// is 2^-11 or coarser) to keep registers down.
template <typename T, int ACT>
__device__ __forceinline__ void fwd_last(const ApplyFwdArgs& a, const float* src) {
    constexpr int N = 16 / sizeof(T);
    constexpr u64 CHUNK = 32 * N;
    const int lane = threadIdx.x & 31;
    const u64 warp = global_thread() >> 5;
    const u64 n = a.n, nchunks = n / CHUNK, C = a.chans.d;
    const u64 S = a.res, step = a.res * a.wpr;
    const u64 pol = l2_policy(a.hint);
    if (warp < step) {  // the same for the whole warp
        const u64 rho = warp % S;
        u64 ch = (rho * CHUNK + (u64)lane * N) % C;
        Coef3 k[N];
#pragma unroll
        for (int j = 0; j < N; ++j) {
            k[j] = fwd_coef_any(a, src, ch);
            if constexpr (sizeof(T) == 2) {
                k[j].b = fmaf(-k[j].lo, k[j].s, k[j].b);
                k[j].lo = 0.0f;
            }
            ch = ch + 1 == C ? 0 : ch + 1;
        }
        const u64 base = rho + S * (warp / S), stride = step * APPLY_UNROLL;
        const u64 groups = base < nchunks ? (nchunks - base + stride - 1) / stride : 0;
        for (u64 i = 0; i < groups; ++i) {
            const u64 c0 = base + (a.reverse ? groups - 1 - i : i) * stride;
            u32 xs[APPLY_UNROLL][4], zs[APPLY_UNROLL][4];
#pragma unroll
            for (int u = 0; u < APPLY_UNROLL; ++u)
                if (c0 + u * step < nchunks)
                    fwd_load<ACT>(a, c0 + u * step, lane, xs[u], zs[u], pol);
#pragma unroll
            for (int u = 0; u < APPLY_UNROLL; ++u) {
                const u64 c = c0 + u * step;
                if (c < nchunks) {  // the same for the whole warp
                    const u32 bits = fwd_vec<T, ACT>(xs[u], zs[u], [&](int j) { return k[j]; });
                    fwd_store<T, ACT>(a, c, lane, xs[u], bits, pol);
                }
            }
        }
    }
    const u64 done = nchunks * CHUNK;
    if (done < n && warp == (grid_threads() >> 5) - 1)
        fwd_tile<T, ACT, SCALAR_WORDS>(a, src, done, lane);
}

template <typename T, int ACT> __device__ __forceinline__ void fwd_scalar(const ApplyFwdArgs& a, const float* src) {
    constexpr u64 TILE = 32 * SCALAR_WORDS;
    const int lane = threadIdx.x & 31;
    const u64 tiles = (a.n + TILE - 1) / TILE;
    for (u64 t = global_thread() >> 5; t < tiles; t += grid_threads() >> 5)
        fwd_tile<T, ACT, SCALAR_WORDS>(a, src, t * TILE, lane);
}

// Channels-first and element paths (bn_apply_fwd_*): coefficients staged or from bn_fold.
template <typename T, int ACT> __device__ __forceinline__ void apply_fwd(const ApplyFwdArgs& a) {
    const bool vec = aligned16(a.x) && aligned16(a.y) && (ACT != ACT_ADD_RELU || aligned16(a.z));
    float* sm = reinterpret_cast<float*>(nnf_dyn_smem);
    if (a.staged) {
        fwd_fold(a, sm, threadIdx.x, blockDim.x);
        __syncthreads();
    }
    const float* src = a.staged ? sm : a.coef;
    if (vec && a.mode == MODE_RUN)
        fwd_first<T, ACT, false>(a, src);
    else if (vec && a.mode == MODE_SPLIT)
        fwd_first<T, ACT, true>(a, src);
    else
        fwd_scalar<T, ACT>(a, src);
}

// The channels-last vector path (bn_apply_fwd_*_last_*), a kernel of its own so that its
// coefficient registers do not lower the other paths' occupancy. Launched for MODE_LAST only;
// an unaligned pointer still gets the (slow, correct) element path.
template <typename T, int ACT> __device__ __forceinline__ void apply_fwd_last(const ApplyFwdArgs& a) {
    const bool vec = aligned16(a.x) && aligned16(a.y) && (ACT != ACT_ADD_RELU || aligned16(a.z));
    float* sm = reinterpret_cast<float*>(nnf_dyn_smem);
    const float* src = nullptr;
    if (a.sum != nullptr) {  // the same for the whole grid
        fwd_sums_stage(a, sm, threadIdx.x, blockDim.x, blockIdx.x == 0);
        __syncthreads();
        src = sm;
    }
    if (vec && a.mode == MODE_LAST)
        fwd_last<T, ACT>(a, src);
    else
        fwd_scalar<T, ACT>(a, src);
}

// ===== backward apply ========================================================================

struct ApplyBwdArgs {
    const void* x;
    const void* dy;
    const u32* mask;  // null: dy' = dy (no activation)
    void* dx;
    const float* coef;  // [5][C]: mean hi, mean lo, A, B, D (finish_bwd)
    u64 n;
    FastDiv inner;
    FastDiv chans;
    u64 res;  // MODE_LAST: as ApplyFwdArgs
    u64 wpr;
    u32 mode;
    u32 staged;
    u32 hint;  // x is in L2 from the reduction: dy and dx pass with evict_first
    u32 pad;
};

struct Coef4 {
    float m, lo, a, b, d;  // dx = a * (dy' - (b + ((x - m) - lo) * d))
};

// Channel c's coefficients from shared memory (staged) or the coefficient buffer: [5][C].
__device__ __forceinline__ Coef4 bwd_coef(const ApplyBwdArgs& a, const float* sm, u64 c) {
    const u64 C = a.chans.d;
    const float* src = a.staged ? sm : a.coef;
    Coef4 k;
    k.m = src[c];
    k.lo = src[C + c];
    k.a = src[2 * C + c];
    k.b = src[3 * C + c];
    k.d = src[4 * C + c];
    return k;
}

__device__ __forceinline__ float bwd_elem(float xv, float g, const Coef4& k) {
    return k.a * (g - fmaf((xv - k.m) - k.lo, k.d, k.b));
}

template <typename T, int K>
__device__ __forceinline__ void bwd_tile(const ApplyBwdArgs& a, const float* sm, u64 base, int lane) {
    const T* x = (const T*)a.x;
    const T* dy = (const T*)a.dy;
    T* dx = (T*)a.dx;
    const u64 n = a.n;
    T xs[K], gs[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const u64 i = base + 32u * (u64)k + lane;
        xs[k] = T{};
        gs[k] = T{};
        if (i < n) {
            xs[k] = x[i];
            gs[k] = dy[i];
        }
    }
    const u64 w = base / 32 + lane;
    const u32 m = (a.mask != nullptr && lane < K && w < (n + 31) / 32) ? a.mask[w] : 0xffffffffu;
#pragma unroll 1
    for (int k = 0; k < K; ++k) {
        const u64 i = base + 32u * (u64)k + lane;
        const u32 word = __shfl_sync(NNF_FULL_WARP, m, k);
        if (i < n) {
            const bool keep = a.mask == nullptr || ((word >> lane) & 1u);
            const float g = keep ? to_float(gs[k]) : 0.0f;
            const Coef4 c = bwd_coef(a, sm, channel_of(a.inner, a.chans, i));
            dx[i] = from_bits<T>(out_bits<T>(bwd_elem(to_float(xs[k]), g, c)));
        }
    }
}

// This lane's vector of chunk c: x, dy and (shifted so that bit j is element j) its mask bits.
template <typename T>
__device__ __forceinline__ void bwd_load(const ApplyBwdArgs& a, u64 c, int lane, u32 (&wx)[4],
                                         u32 (&wg)[4], u32& ms, u64 pol) {
    constexpr int N = 16 / sizeof(T);
    constexpr int L = 32 / N;  // lanes sharing one mask word
    const uint4 v = reinterpret_cast<const uint4*>(a.x)[c * 32 + lane];
    const uint4 g = ld16_pol(reinterpret_cast<const uint4*>(a.dy) + c * 32 + lane, pol);
    wx[0] = v.x;
    wx[1] = v.y;
    wx[2] = v.z;
    wx[3] = v.w;
    wg[0] = g.x;
    wg[1] = g.y;
    wg[2] = g.z;
    wg[3] = g.w;
    // This lane's N elements are c*CHUNK + lane*N + j: word c*N + lane/L.
    ms = a.mask != nullptr ? a.mask[c * N + lane / L] >> ((lane * N) & 31) : 0xffffffffu;
}

// dx of one vector whose element j takes coefficients kj(j) (16-bit types: one rounding
// instruction per pair).
template <typename T, typename KJ>
__device__ __forceinline__ uint4 bwd_vec(const u32 (&wx)[4], const u32 (&wg)[4], u32 ms, KJ kj) {
    constexpr int N = 16 / sizeof(T);
    u32 w[4];
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const float g = ((ms >> j) & 1u) ? __uint_as_float(wg[j]) : 0.0f;
            w[j] = __float_as_uint(bwd_elem(__uint_as_float(wx[j]), g, kj(j)));
        }
    } else {
#pragma unroll
        for (int p = 0; p < N / 2; ++p) {
            const float g0 = ((ms >> (2 * p)) & 1u) ? bits_float<T>(wg[p] & 0xffffu) : 0.0f;
            const float g1 = ((ms >> (2 * p + 1)) & 1u) ? bits_float<T>(wg[p] >> 16) : 0.0f;
            const float d0 = bwd_elem(bits_float<T>(wx[p] & 0xffffu), g0, kj(2 * p));
            const float d1 = bwd_elem(bits_float<T>(wx[p] >> 16), g1, kj(2 * p + 1));
            w[p] = out_bits2<T>(d0, d1);
        }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// MODE_RUN / MODE_SPLIT, as fwd_first.
template <typename T, bool SPLIT>
__device__ __forceinline__ void bwd_first(const ApplyBwdArgs& a, const float* sm) {
    constexpr int N = 16 / sizeof(T);
    constexpr u64 CHUNK = 32 * N;
    const int lane = threadIdx.x & 31;
    const u64 warp = global_thread() >> 5;
    const u64 nwarps = grid_threads() >> 5;
    const u64 n = a.n, nchunks = n / CHUNK;
    const u32 hw = (u32)a.inner.d, C = (u32)a.chans.d;
    uint4* dv = reinterpret_cast<uint4*>(a.dx);
    const u64 pol = l2_policy(a.hint);
    const RunCursor one = run_at(a.inner, a.chans, CHUNK);
    const RunCursor stride = run_at(a.inner, a.chans, nwarps * APPLY_UNROLL * CHUNK);
    RunCursor cur = run_at(a.inner, a.chans, warp * APPLY_UNROLL * CHUNK + (u64)lane * N);
    for (u64 c0 = warp * APPLY_UNROLL; c0 < nchunks; c0 += nwarps * APPLY_UNROLL) {
        u32 xs[APPLY_UNROLL][4], gs[APPLY_UNROLL][4], ms[APPLY_UNROLL];
#pragma unroll
        for (int u = 0; u < APPLY_UNROLL; ++u)
            if (c0 + u < nchunks) bwd_load<T>(a, c0 + u, lane, xs[u], gs[u], ms[u], pol);
        RunCursor k = cur;
#pragma unroll
        for (int u = 0; u < APPLY_UNROLL; ++u) {
            const u64 c = c0 + u;
            if (c < nchunks) {
                const Coef4 k0 = bwd_coef(a, sm, k.ch);
                if constexpr (SPLIT) {
                    const u32 s = hw - k.r;
                    const Coef4 k1 = bwd_coef(a, sm, k.ch + 1 == C ? 0u : k.ch + 1);
                    st16_pol(dv + c * 32 + lane, bwd_vec<T>(xs[u], gs[u], ms[u], [&](int j) {
                        const bool first = (u32)j < s;
                        Coef4 q;
                        q.m = first ? k0.m : k1.m;
                        q.lo = first ? k0.lo : k1.lo;
                        q.a = first ? k0.a : k1.a;
                        q.b = first ? k0.b : k1.b;
                        q.d = first ? k0.d : k1.d;
                        return q;
                    }), pol);
                } else {
                    st16_pol(dv + c * 32 + lane,
                             bwd_vec<T>(xs[u], gs[u], ms[u], [&](int) { return k0; }), pol);
                }
            }
            run_advance(k, one, hw, C);
        }
        run_advance(cur, stride, hw, C);
    }
    const u64 done = nchunks * CHUNK;
    if (done < n && warp == nwarps - 1) bwd_tile<T, SCALAR_WORDS>(a, sm, done, lane);
}

// MODE_LAST, as fwd_last: each lane's N channels' coefficients in registers (16-bit types fold
// the mean's remainder into B: b - lo*d).
template <typename T> __device__ __forceinline__ void bwd_last(const ApplyBwdArgs& a) {
    constexpr int N = 16 / sizeof(T);
    constexpr u64 CHUNK = 32 * N;
    const int lane = threadIdx.x & 31;
    const u64 warp = global_thread() >> 5;
    const u64 n = a.n, nchunks = n / CHUNK, C = a.chans.d;
    const u64 S = a.res, step = a.res * a.wpr;
    const u64 pol = l2_policy(a.hint);
    uint4* dv = reinterpret_cast<uint4*>(a.dx);
    if (warp < step) {
        const u64 rho = warp % S;
        u64 ch = (rho * CHUNK + (u64)lane * N) % C;
        Coef4 k[N];
#pragma unroll
        for (int j = 0; j < N; ++j) {
            k[j] = bwd_coef(a, nullptr, ch);  // staged is 0 in MODE_LAST
            if constexpr (sizeof(T) == 2) {
                k[j].b = fmaf(-k[j].lo, k[j].d, k[j].b);
                k[j].lo = 0.0f;
            }
            ch = ch + 1 == C ? 0 : ch + 1;
        }
        for (u64 c0 = rho + S * (warp / S); c0 < nchunks; c0 += step * APPLY_UNROLL) {
            u32 xs[APPLY_UNROLL][4], gs[APPLY_UNROLL][4], ms[APPLY_UNROLL];
#pragma unroll
            for (int u = 0; u < APPLY_UNROLL; ++u)
                if (c0 + u * step < nchunks)
                    bwd_load<T>(a, c0 + u * step, lane, xs[u], gs[u], ms[u], pol);
#pragma unroll
            for (int u = 0; u < APPLY_UNROLL; ++u) {
                const u64 c = c0 + u * step;
                if (c < nchunks)
                    st16_pol(dv + c * 32 + lane,
                             bwd_vec<T>(xs[u], gs[u], ms[u], [&](int j) { return k[j]; }), pol);
            }
        }
    }
    const u64 done = nchunks * CHUNK;
    if (done < n && warp == (grid_threads() >> 5) - 1)
        bwd_tile<T, SCALAR_WORDS>(a, nullptr, done, lane);
}

template <typename T> __device__ __forceinline__ void bwd_scalar(const ApplyBwdArgs& a, const float* sm) {
    constexpr u64 TILE = 32 * SCALAR_WORDS;
    const int lane = threadIdx.x & 31;
    const u64 tiles = (a.n + TILE - 1) / TILE;
    for (u64 t = global_thread() >> 5; t < tiles; t += grid_threads() >> 5)
        bwd_tile<T, SCALAR_WORDS>(a, sm, t * TILE, lane);
}

// Channels-first and element paths (bn_apply_bwd_*).
template <typename T> __device__ __forceinline__ void apply_bwd(const ApplyBwdArgs& a) {
    const bool vec = aligned16(a.x) && aligned16(a.dy) && aligned16(a.dx);
    float* sm = reinterpret_cast<float*>(nnf_dyn_smem);
    if (a.staged) {
        const u64 C = a.chans.d;
        for (u64 c = threadIdx.x; c < 5 * C; c += blockDim.x) sm[c] = a.coef[c];
        __syncthreads();
    }
    if (vec && a.mode == MODE_RUN)
        bwd_first<T, false>(a, sm);
    else if (vec && a.mode == MODE_SPLIT)
        bwd_first<T, true>(a, sm);
    else
        bwd_scalar<T>(a, sm);
}

// The channels-last vector path (bn_apply_bwd_last_*), as apply_fwd_last. Nothing is staged.
template <typename T> __device__ __forceinline__ void apply_bwd_last(const ApplyBwdArgs& a) {
    const bool vec = aligned16(a.x) && aligned16(a.dy) && aligned16(a.dx);
    if (vec && a.mode == MODE_LAST)
        bwd_last<T>(a);
    else
        bwd_scalar<T>(a, nullptr);
}

// ===== backward with few values per channel: one block per channel, in f64 ==================
// With M values per channel, dx = A * (dy' - mean(dy') - (x - mean) * D) cancels when dy' lies
// near span{1, x}: always for M = 2, where the exact result is (dy1 - dy2)/2 * eps/(var + eps)
// * A, a fraction eps/var of its three terms. Every f32 rounding in those terms (the variance,
// the inverse std, the two sums, x - mean, the combination: ~6e-8 each) is then amplified by
// var/eps, 1e5 at var = 1. For M <= OWN_PER_CHANNEL_MAX_M (src/batchnorm/plan.rs) this kernel
// runs the whole backward of channel blockIdx.x in f64: Σ(x - m), Σdy', Σdy'(x - m), Σ(x - m)²
// about the saved mean m = hi + lo (the first sum corrects m to the f64 mean, so the f32
// statistics' rounding does not enter), the finish in f64, and dx from the same f64 formula.
// x, dy and the mask are read twice, the second time from cache; d_addend is written in the
// first pass. Element k of the channel is (o, i) = (k / hw, k % hw) at (o*C + ch)*hw + i, which
// is k*C + ch for channels-last (hw = 1).

struct ChannelBwdArgs {
    const void* x;
    const void* dy;
    const u32* mask;  // read when act != ACT_NONE
    void* dx;
    void* dz;  // d_addend, written when act == ACT_ADD_RELU
    const float* saved_mean;
    const float* saved_mean_lo;
    const float* gamma;
    float* dgamma;
    float* dbeta;
    u64 per_channel;  // M
    FastDiv inner;    // hw (channels-first) or 1 (channels-last)
    double eps;
    u32 channels;
    u32 act;
};

// Element k of channel ch (64-bit index).
__device__ __forceinline__ u64 channel_elem(const ChannelBwdArgs& a, u64 ch, u64 k) {
    const u64 hw = a.inner.d;
    const u64 o = fdiv(a.inner, k);
    return (o * a.channels + ch) * hw + (k - o * hw);
}

// dy' of element e as T bits: dy, or +0 where the mask bit is clear.
template <typename T> __device__ __forceinline__ u32 channel_dy(const ChannelBwdArgs& a, u64 e) {
    const u32 b = to_bits<T>(((const T*)a.dy)[e]);
    if (a.act != ACT_NONE && !((a.mask[e >> 5] >> (u32)(e & 31u)) & 1u)) return 0u;
    return b;
}

template <typename T> __device__ __forceinline__ void channel_bwd(const ChannelBwdArgs& a) {
    constexpr int W = CTHREADS / 32;
    __shared__ double red[4][W];
    __shared__ double coef[4];  // mean correction, A, B, D
    const T* x = (const T*)a.x;
    const u64 ch = blockIdx.x, M = a.per_channel;
    const double mu = (double)a.saved_mean[ch] + (double)a.saved_mean_lo[ch];
    double s[4] = {0.0, 0.0, 0.0, 0.0};  // Σ(x - mu), Σdy', Σdy'(x - mu), Σ(x - mu)²
    for (u64 k = threadIdx.x; k < M; k += CTHREADS) {
        const u64 e = channel_elem(a, ch, k);
        const double xd = (double)to_float(x[e]) - mu;
        const u32 gb = channel_dy<T>(a, e);
        if (a.act == ACT_ADD_RELU) ((T*)a.dz)[e] = from_bits<T>(gb);
        const double g = (double)bits_float<T>(gb);
        s[0] += xd;
        s[1] += g;
        s[2] = fma(g, xd, s[2]);
        s[3] = fma(xd, xd, s[3]);
    }
    // Fixed tree: lanes (xor-shuffles), then the warps in order.
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s[j] += __shfl_xor_sync(NNF_FULL_WARP, s[j], o);
        if (lane == 0) red[j][w] = s[j];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double t[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            t[j] = red[j][0];
            for (int q = 1; q < W; ++q) t[j] += red[j][q];
        }
        const double md = (double)M;
        const double dm = t[0] / md;  // the f64 mean is mu + dm
        double sxx = t[3] - dm * t[0];  // Σ(x - mean)²
        if (sxx < 0.0) sxx = 0.0;       // rounding only; NaN stays NaN
        const double sgx = t[2] - dm * t[1];  // Σdy'(x - mean)
        const double inv = 1.0 / sqrt(sxx / md + a.eps);
        a.dbeta[ch] = (float)t[1];
        a.dgamma[ch] = (float)(sgx * inv);
        coef[0] = dm;
        coef[1] = (double)a.gamma[ch] * inv;
        coef[2] = t[1] / md;
        coef[3] = sgx / (sxx + md * a.eps);  // inv² Σdy'(x - mean) / M
    }
    __syncthreads();
    const double dm = coef[0], ka = coef[1], kb = coef[2], kd = coef[3];
    for (u64 k = threadIdx.x; k < M; k += CTHREADS) {
        const u64 e = channel_elem(a, ch, k);
        const double xd = ((double)to_float(x[e]) - mu) - dm;
        const double g = (double)bits_float<T>(channel_dy<T>(a, e));
        ((T*)a.dx)[e] = from_bits<T>(out_bits<T>((float)(ka * (g - fma(xd, kd, kb)))));
    }
}

// ===== entry points ==========================================================================
// The vector width of the reductions (g.vec) is a template parameter chosen at run time among the
// widths the element type allows (V * sizeof(T) <= 16). Shared arrays are declared once per
// kernel, sized for the widest vector.

// Vectors of 16 or 8 bytes, or single elements (src/batchnorm/own_launch.rs picks among these).
#define NNF_VEC_DISPATCH(FN, ...)                                   \
    if (a.g.vec == (u32)max_vec<T>())                               \
        FN<T, max_vec<T>()>(__VA_ARGS__);                           \
    else if (a.g.vec == (u32)max_vec<T>() / 2)                      \
        FN<T, max_vec<T>() / 2>(__VA_ARGS__);                       \
    else                                                            \
        FN<T, 1>(__VA_ARGS__);

template <typename T> __device__ __forceinline__ void stats_cf_any(const StatsArgs& a) {
    __shared__ double sh[96];
    Wf w = wf_zero();
    NNF_VEC_DISPATCH(w = stats_cf, a)
    w = wf_block<THREADS>(w, sh);
    stats_cf_finish<T>(a, w, sh);
}
template <typename T> __device__ __forceinline__ void stats_cl_any(const StatsArgs& a) {
    __shared__ double red[cl_tree_doubles<max_vec<T>(), THREADS>()];
    NNF_VEC_DISPATCH(stats_cl, a, red)
}
template <typename T> __device__ __forceinline__ void reduce_cf_any(const ReduceArgs& a) {
    __shared__ float sh[96];
    float s1 = 0.0f, s2 = 0.0f;
    NNF_VEC_DISPATCH(reduce_cf, a, s1, s2)
    sum2_block<THREADS>(s1, s2, sh);
    reduce_cf_finish(a, s1, s2, sh);
}
template <typename T> __device__ __forceinline__ void reduce_cl_any(const ReduceArgs& a) {
    __shared__ float red[THREADS * 2 * max_vec<T>()];
    NNF_VEC_DISPATCH(reduce_cl, a, red)
}

// One macro per kernel kind, M(T, S) for NNF_BN_FOR_TYPES. Register caps where ptxas would
// otherwise lose a block per SM: the channels-first dx kernel at 64 (4 blocks of 256 threads),
// the backward reductions at 85 / 128 (3 / 2 blocks).
#define NNF_BN_STATS_CF(T, S)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS) bn_stats_cf_##S(StatsArgs a) {          \
        stats_cf_any<T>(a);                                                                       \
    }
#define NNF_BN_STATS_CL(T, S)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS) bn_stats_finalize_##S(StatsArgs a) {    \
        stats_finalize<T>(a);                                                                     \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) bn_stats_cl_##S(StatsArgs a) {          \
        stats_cl_any<T>(a);                                                                       \
    }
#define NNF_BN_REDUCE_CF(T, S)                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, 3) bn_bwd_reduce_cf_##S(ReduceArgs a) { \
        reduce_cf_any<T>(a);                                                                      \
    }
#define NNF_BN_REDUCE_CL(T, S)                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, 2) bn_bwd_reduce_cl_##S(ReduceArgs a) { \
        reduce_cl_any<T>(a);                                                                      \
    }
// The forward apply kernels of one activation: channels-first / element, and channels-last.
#define NNF_BN_APPLY(T, S, A, ACT)                                                                \
    extern "C" __global__ void __launch_bounds__(THREADS) bn_apply_fwd_##A##_##S(ApplyFwdArgs a) {  \
        apply_fwd<T, ACT>(a);                                                                     \
    }
#define NNF_BN_APPLY_LAST(T, S, A, ACT)                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        bn_apply_fwd_##A##_last_##S(ApplyFwdArgs a) {                                             \
        apply_fwd_last<T, ACT>(a);                                                                \
    }
#define NNF_BN_APPLY_NONE(T, S) NNF_BN_APPLY(T, S, none, ACT_NONE)
#define NNF_BN_APPLY_RELU(T, S) NNF_BN_APPLY(T, S, relu, ACT_RELU)
#define NNF_BN_APPLY_ADD_RELU(T, S) NNF_BN_APPLY(T, S, add_relu, ACT_ADD_RELU)
#define NNF_BN_APPLY_NONE_LAST(T, S) NNF_BN_APPLY_LAST(T, S, none, ACT_NONE)
#define NNF_BN_APPLY_RELU_LAST(T, S) NNF_BN_APPLY_LAST(T, S, relu, ACT_RELU)
#define NNF_BN_APPLY_ADD_RELU_LAST(T, S) NNF_BN_APPLY_LAST(T, S, add_relu, ACT_ADD_RELU)
#define NNF_BN_APPLY_BWD(T, S)                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, 4) bn_apply_bwd_##S(ApplyBwdArgs a) {   \
        apply_bwd<T>(a);                                                                          \
    }
#define NNF_BN_APPLY_BWD_LAST(T, S)                                                               \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        bn_apply_bwd_last_##S(ApplyBwdArgs a) {                                                   \
        apply_bwd_last<T>(a);                                                                     \
    }
#define NNF_BN_CHANNEL_BWD(T, S)                                                                  \
    extern "C" __global__ void __launch_bounds__(CTHREADS) bn_bwd_channel_##S(ChannelBwdArgs a) { \
        channel_bwd<T>(a);                                                                        \
    }

#if NNF_BN_PICK(NNF_BN_K_STATS_CF)
NNF_BN_FOR_TYPES(NNF_BN_STATS_CF)
#endif
#if NNF_BN_PICK(NNF_BN_K_STATS_CL)
NNF_BN_FOR_TYPES(NNF_BN_STATS_CL)
#endif
#if NNF_BN_PICK(NNF_BN_K_REDUCE_CF)
NNF_BN_FOR_TYPES(NNF_BN_REDUCE_CF)
#endif
#if NNF_BN_PICK(NNF_BN_K_REDUCE_CL)
NNF_BN_FOR_TYPES(NNF_BN_REDUCE_CL)
#endif
#if NNF_BN_PICK(NNF_BN_K_APPLY_FWD_NONE)
NNF_BN_FOR_TYPES(NNF_BN_APPLY_NONE)
#endif
#if NNF_BN_PICK(NNF_BN_K_APPLY_FWD_RELU)
NNF_BN_FOR_TYPES(NNF_BN_APPLY_RELU)
#endif
#if NNF_BN_PICK(NNF_BN_K_APPLY_FWD_ADD_RELU)
NNF_BN_FOR_TYPES(NNF_BN_APPLY_ADD_RELU)
#endif
#if NNF_BN_PICK(NNF_BN_K_APPLY_FWD_NONE_LAST)
NNF_BN_FOR_TYPES(NNF_BN_APPLY_NONE_LAST)
#endif
#if NNF_BN_PICK(NNF_BN_K_APPLY_FWD_RELU_LAST)
NNF_BN_FOR_TYPES(NNF_BN_APPLY_RELU_LAST)
#endif
#if NNF_BN_PICK(NNF_BN_K_APPLY_FWD_ADD_RELU_LAST)
NNF_BN_FOR_TYPES(NNF_BN_APPLY_ADD_RELU_LAST)
#endif
#if NNF_BN_PICK(NNF_BN_K_APPLY_BWD)
NNF_BN_FOR_TYPES(NNF_BN_APPLY_BWD)
#endif
#if NNF_BN_PICK(NNF_BN_K_APPLY_BWD_LAST)
NNF_BN_FOR_TYPES(NNF_BN_APPLY_BWD_LAST)
#endif
#if NNF_BN_PICK(NNF_BN_K_CHANNEL_BWD)
NNF_BN_FOR_TYPES(NNF_BN_CHANNEL_BWD)
#endif
