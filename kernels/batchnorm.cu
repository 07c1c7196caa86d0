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
// elements each, the chunk is N mask words); the per-channel coefficients come from shared
// memory (staged by the block when C <= STAGE_MAX_C) or global memory. The channel of a vector
// comes from fast divisions of its element index: `mode` says whether the vector lies in one run
// of one channel (MODE_RUN: channels-first, hw % N == 0), spans N consecutive channels
// (MODE_CONTIG: channels-last, C % N == 0); otherwise (or with any pointer unaligned) the
// element path: lane l takes element 32k + l of a tile, its channel from two fast divisions,
// one ballot per mask word.

template <typename T> constexpr int max_vec() { return 16 / (int)sizeof(T); }

constexpr int MODE_RUN = 0;     // vector path: a vector lies in one run of one channel
constexpr int MODE_CONTIG = 1;  // vector path: a vector holds N consecutive channels
constexpr int MODE_ELEMENT = 2; // element path (scalar tiles), whatever the alignment

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
    float* part;      // [3][C][P]: count, mean, M2
    u32* counters;    // channels-first: one per channel, zero between launches
    float* saved_mean;
    float* saved_mean_lo;  // the mean's remainder: mean = saved_mean + saved_mean_lo
    float* saved_invstd;
    float* running_mean;
    float* running_var;
    Geom g;
    float eps;
    float momentum;
    float unbias;  // M / (M - 1)
    float pad;
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
__device__ __forceinline__ void stats_cf_finish(const StatsArgs& a, const Wf& w, float* sh) {
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
            finish_stats(ch, t, pivot<T>(a.x, a.g, ch), a.eps, a.momentum, a.unbias, a.saved_mean,
                         a.saved_mean_lo, a.saved_invstd, a.running_mean, a.running_var, hi, lo);
        }
    }
}

template <typename T, int V> __device__ __forceinline__ void stats_cl(const StatsArgs& a, float* red) {
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
    cl_tree_wf<V, THREADS>(acc, ro, rb, cvs, active, red);
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
    __shared__ float sh[96];
    const u64 P = a.g.parts, ch = blockIdx.x;
    const Wf t = combine_wf<THREADS>(a.part, (u64)a.g.channels * P, ch * P, P, sh);
    if (threadIdx.x == 0) {
        float hi, lo;
        finish_stats(ch, t, pivot<T>(a.x, a.g, ch), a.eps, a.momentum, a.unbias, a.saved_mean,
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
                                   a.saved_mean_lo[ch], s1, s2, nullptr, nullptr);
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
                             r0 + ro, r1, rb, mhi, mlo, s1, s2, nullptr, nullptr, 0);
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

extern "C" __global__ void __launch_bounds__(THREADS) bn_bwd_finalize(ReduceArgs a) {
    __shared__ float sh[96];
    const u64 P = a.g.parts, C = a.g.channels, ch = blockIdx.x;
    float t1, t2;
    combine_sums<THREADS>(a.part, C * P, ch * P, P, t1, t2, sh);
    if (threadIdx.x == 0)
        finish_bwd(ch, C, t1, t2, a.inv_count, a.saved_mean, a.saved_mean_lo, a.saved_invstd,
                   a.gamma, a.dgamma, a.dbeta, a.coef);
}

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
    const float* coef;     // [4][C] mean hi, mean lo, scale, shift made by bn_fold when not staged
    u64 n;
    FastDiv inner;  // elements per run (channels-first) or 1 (channels-last)
    FastDiv chans;  // C
    u32 mode;
    u32 staged;    // coefficients staged in shared memory (C <= STAGE_MAX_C), else read from coef
    u32 from_var;  // scale = gamma / sqrt(inv + eps) (inference) instead of gamma * inv
    float eps;
};

struct Coef3 {
    float m, lo, s, b;  // y = ((x - m) - lo) * s + b
};

// The coefficients of channel c from the raw per-channel inputs (one place computes them: the
// staging loop or bn_fold).
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

// Writes the [4][C] coefficients to a.coef, for apply launches that cannot stage them.
extern "C" __global__ void __launch_bounds__(THREADS) bn_fold(ApplyFwdArgs a) {
    fwd_fold(a, const_cast<float*>(a.coef), global_thread(), grid_threads());
}

// The channel of element e.
__device__ __forceinline__ u64 channel_of(const FastDiv& inner, const FastDiv& chans, u64 e) {
    const u64 q = fdiv(inner, e);
    return q - fdiv(chans, q) * chans.d;
}

// One output element: the affine transform ((x - hi) - lo) * scale + shift in f32, the addend,
// ReLU, one rounding to T. Returns the output's bits.
template <typename T, int ACT> __device__ __forceinline__ u32 fwd_elem(float xv, float zv, const Coef3& k) {
    float v = fmaf((xv - k.m) - k.lo, k.s, k.b);
    if constexpr (ACT == ACT_ADD_RELU) v += zv;
    if constexpr (ACT != ACT_NONE) v = (v <= 0.0f) ? 0.0f : v;  // NaN stays NaN; -0 becomes +0
    return out_bits<T>(v);
}

// Elements [base, min(base + 32*K, n)), base a multiple of 32: lane l takes base + 32k + l, so
// ballot k is mask word base/32 + k.
template <typename T, int ACT, int K>
__device__ __noinline__ void fwd_tile(const ApplyFwdArgs& a, const float* src, u64 base, int lane) {
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
            const Coef3 c = fwd_coef(src, a.chans.d, channel_of(a.inner, a.chans, i));
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

template <typename T, int ACT, int MODE>
__device__ __forceinline__ void fwd_vector(const ApplyFwdArgs& a, const float* src) {
    constexpr int N = 16 / sizeof(T);
    constexpr u64 CHUNK = 32 * N;
    const int lane = threadIdx.x & 31;
    const u64 warp = global_thread() >> 5;
    const u64 nwarps = grid_threads() >> 5;
    const u64 n = a.n, nchunks = n / CHUNK;
    const u64 C = a.chans.d;
    const uint4* xv = reinterpret_cast<const uint4*>(a.x);
    const uint4* zv = reinterpret_cast<const uint4*>(a.z);
    uint4* yv = reinterpret_cast<uint4*>(a.y);
    for (u64 c0 = warp * APPLY_UNROLL; c0 < nchunks; c0 += nwarps * APPLY_UNROLL) {
        uint4 xs[APPLY_UNROLL], zs[APPLY_UNROLL];
#pragma unroll
        for (int u = 0; u < APPLY_UNROLL; ++u) {
            const u64 c = c0 + u;
            xs[u] = make_uint4(0, 0, 0, 0);
            zs[u] = make_uint4(0, 0, 0, 0);
            if (c < nchunks) {
                xs[u] = xv[c * 32 + lane];
                if constexpr (ACT == ACT_ADD_RELU) zs[u] = zv[c * 32 + lane];
            }
        }
#pragma unroll
        for (int u = 0; u < APPLY_UNROLL; ++u) {
            const u64 c = c0 + u;
            if (c < nchunks) {  // the same for the whole warp
                const u64 e = c * CHUNK + (u64)lane * N;
                u32 w[4] = {xs[u].x, xs[u].y, xs[u].z, xs[u].w};
                const u32 wz[4] = {zs[u].x, zs[u].y, zs[u].z, zs[u].w};
                const u64 q = fdiv(a.inner, e);
                u64 ch = q - fdiv(a.chans, q) * C;
                Coef3 k;
                if constexpr (MODE == MODE_RUN) k = fwd_coef(src, C, ch);
                u32 bits = 0;
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    if constexpr (MODE == MODE_CONTIG) k = fwd_coef(src, C, ch + j);
                    const float zf = ACT == ACT_ADD_RELU ? bits_float<T>(elem_bits<T>(wz, j)) : 0.0f;
                    const u32 ob = fwd_elem<T, ACT>(bits_float<T>(elem_bits<T>(w, j)), zf, k);
                    if constexpr (ACT != ACT_NONE) bits |= (u32)bits_gt0<T>(ob) << j;
                    set_elem_bits<T>(w, j, ob);
                }
                yv[c * 32 + lane] = make_uint4(w[0], w[1], w[2], w[3]);
                if constexpr (ACT != ACT_NONE) {
                    if (a.mask != nullptr) {
                        const u32 word = chunk_word<N>(bits);
                        if ((lane & (32 / N - 1)) == 0) a.mask[c * N + lane / (32 / N)] = word;
                    }
                }
            }
        }
    }
    // The rest (fewer than CHUNK elements, from a word boundary) is the grid's last warp's.
    const u64 done = nchunks * CHUNK;
    if (done < n && warp == nwarps - 1) fwd_tile<T, ACT, SCALAR_WORDS>(a, src, done, lane);
}

template <typename T, int ACT> __device__ __forceinline__ void fwd_scalar(const ApplyFwdArgs& a, const float* src) {
    constexpr u64 TILE = 32 * SCALAR_WORDS;
    const int lane = threadIdx.x & 31;
    const u64 tiles = (a.n + TILE - 1) / TILE;
    for (u64 t = global_thread() >> 5; t < tiles; t += grid_threads() >> 5)
        fwd_tile<T, ACT, SCALAR_WORDS>(a, src, t * TILE, lane);
}

template <typename T, int ACT> __device__ __forceinline__ void apply_fwd(const ApplyFwdArgs& a) {
    float* sm = reinterpret_cast<float*>(nnf_dyn_smem);
    if (a.staged) {
        fwd_fold(a, sm, threadIdx.x, blockDim.x);
        __syncthreads();
    }
    const float* src = a.staged ? sm : a.coef;
    const bool vec = aligned16(a.x) && aligned16(a.y) && (ACT != ACT_ADD_RELU || aligned16(a.z));
    if (vec && a.mode == MODE_RUN)
        fwd_vector<T, ACT, MODE_RUN>(a, src);
    else if (vec && a.mode == MODE_CONTIG)
        fwd_vector<T, ACT, MODE_CONTIG>(a, src);
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
    u32 mode;
    u32 staged;
};

struct Coef4 {
    float m, lo, a, b, d;  // dx = a * (dy' - (b + ((x - m) - lo) * d))
};

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
__device__ __noinline__ void bwd_tile(const ApplyBwdArgs& a, const float* sm, u64 base, int lane) {
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

template <typename T, int MODE>
__device__ __forceinline__ void bwd_vector(const ApplyBwdArgs& a, const float* sm) {
    constexpr int N = 16 / sizeof(T);
    constexpr u64 CHUNK = 32 * N;
    constexpr int L = 32 / N;  // lanes sharing one mask word
    const int lane = threadIdx.x & 31;
    const u64 warp = global_thread() >> 5;
    const u64 nwarps = grid_threads() >> 5;
    const u64 n = a.n, nchunks = n / CHUNK;
    const u64 C = a.chans.d;
    const uint4* xv = reinterpret_cast<const uint4*>(a.x);
    const uint4* gv = reinterpret_cast<const uint4*>(a.dy);
    uint4* dv = reinterpret_cast<uint4*>(a.dx);
    for (u64 c0 = warp * APPLY_UNROLL; c0 < nchunks; c0 += nwarps * APPLY_UNROLL) {
        uint4 xs[APPLY_UNROLL], gs[APPLY_UNROLL];
        u32 ms[APPLY_UNROLL];
#pragma unroll
        for (int u = 0; u < APPLY_UNROLL; ++u) {
            const u64 c = c0 + u;
            xs[u] = make_uint4(0, 0, 0, 0);
            gs[u] = make_uint4(0, 0, 0, 0);
            ms[u] = 0xffffffffu;
            if (c < nchunks) {
                xs[u] = xv[c * 32 + lane];
                gs[u] = gv[c * 32 + lane];
                // This lane's N elements are c*CHUNK + lane*N + j: word c*N + lane/L.
                if (a.mask != nullptr) ms[u] = a.mask[c * N + lane / L] >> ((lane * N) & 31);
            }
        }
#pragma unroll
        for (int u = 0; u < APPLY_UNROLL; ++u) {
            const u64 c = c0 + u;
            if (c < nchunks) {
                const u64 e = c * CHUNK + (u64)lane * N;
                const u32 wx[4] = {xs[u].x, xs[u].y, xs[u].z, xs[u].w};
                const u32 wg[4] = {gs[u].x, gs[u].y, gs[u].z, gs[u].w};
                u32 w[4] = {0u, 0u, 0u, 0u};
                const u64 q = fdiv(a.inner, e);
                u64 ch = q - fdiv(a.chans, q) * C;
                Coef4 k;
                if constexpr (MODE == MODE_RUN) k = bwd_coef(a, sm, ch);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    if constexpr (MODE == MODE_CONTIG) k = bwd_coef(a, sm, ch + j);
                    const float g = ((ms[u] >> j) & 1u) ? bits_float<T>(elem_bits<T>(wg, j)) : 0.0f;
                    const float d = bwd_elem(bits_float<T>(elem_bits<T>(wx, j)), g, k);
                    set_elem_bits<T>(w, j, out_bits<T>(d));
                }
                dv[c * 32 + lane] = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
    }
    const u64 done = nchunks * CHUNK;
    if (done < n && warp == nwarps - 1) bwd_tile<T, SCALAR_WORDS>(a, sm, done, lane);
}

template <typename T> __device__ __forceinline__ void apply_bwd(const ApplyBwdArgs& a) {
    float* sm = reinterpret_cast<float*>(nnf_dyn_smem);
    if (a.staged) {
        const u64 C = a.chans.d;
        for (u64 c = threadIdx.x; c < 5 * C; c += blockDim.x) sm[c] = a.coef[c];
        __syncthreads();
    }
    const bool vec = aligned16(a.x) && aligned16(a.dy) && aligned16(a.dx);
    if (vec && a.mode == MODE_RUN) {
        bwd_vector<T, MODE_RUN>(a, sm);
    } else if (vec && a.mode == MODE_CONTIG) {
        bwd_vector<T, MODE_CONTIG>(a, sm);
    } else {
        constexpr u64 TILE = 32 * SCALAR_WORDS;
        const int lane = threadIdx.x & 31;
        const u64 tiles = (a.n + TILE - 1) / TILE;
        for (u64 t = global_thread() >> 5; t < tiles; t += grid_threads() >> 5)
            bwd_tile<T, SCALAR_WORDS>(a, sm, t * TILE, lane);
    }
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
    __shared__ float sh[96];
    Wf w = wf_zero();
    NNF_VEC_DISPATCH(w = stats_cf, a)
    w = wf_block<THREADS>(w, sh);
    stats_cf_finish<T>(a, w, sh);
}
template <typename T> __device__ __forceinline__ void stats_cl_any(const StatsArgs& a) {
    __shared__ float red[THREADS * (1 + 2 * max_vec<T>())];
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

#define NNF_BN_KERNELS(T, S)                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) bn_stats_cf_##S(StatsArgs a) {          \
        stats_cf_any<T>(a);                                                                       \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) bn_stats_finalize_##S(StatsArgs a) {    \
        stats_finalize<T>(a);                                                                     \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) bn_stats_cl_##S(StatsArgs a) {          \
        stats_cl_any<T>(a);                                                                       \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) bn_bwd_reduce_cf_##S(ReduceArgs a) {    \
        reduce_cf_any<T>(a);                                                                      \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) bn_bwd_reduce_cl_##S(ReduceArgs a) {    \
        reduce_cl_any<T>(a);                                                                      \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) bn_apply_fwd_none_##S(ApplyFwdArgs a) { \
        apply_fwd<T, ACT_NONE>(a);                                                                \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) bn_apply_fwd_relu_##S(ApplyFwdArgs a) { \
        apply_fwd<T, ACT_RELU>(a);                                                                \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        bn_apply_fwd_add_relu_##S(ApplyFwdArgs a) {                                               \
        apply_fwd<T, ACT_ADD_RELU>(a);                                                            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) bn_apply_bwd_##S(ApplyBwdArgs a) {      \
        apply_bwd<T>(a);                                                                          \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(CTHREADS) bn_bwd_channel_##S(ChannelBwdArgs a) { \
        channel_bwd<T>(a);                                                                        \
    }

NNF_BN_KERNELS(float, f32)
NNF_BN_KERNELS(nnf_f16, f16)
NNF_BN_KERNELS(nnf_bf16, bf16)
