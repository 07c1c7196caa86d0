// nnfuse's own BatchNorm: single-pass persistent training kernels (after
// kernels/batchnorm_common.cuh). Launched cooperatively (cuLaunchCooperativeKernel: every block
// co-resident, or the launch is refused) by src/batchnorm/own.rs when the plan chose the
// persistent variant and the tensor fits in the blocks' shared memory.
//
// The tensor is cut into units; block b owns units b, b + G, ... (G = gridDim.x, at most `upb`
// per block) and keeps each unit's data in dynamic shared memory (one slot per unit):
//  * channels-first: unit (ch, p) = vectors [p*ipb, (p+1)*ipb) of channel ch (the vector
//    numbering of the two-pass kernels, V elements each); hw is a multiple of 32*V and ipb a
//    multiple of 32, so every 32-vector chunk of a unit lies in one run and starts on a mask
//    word boundary;
//  * channels-last: unit p = rows [p*ipb, (p+1)*ipb), all C channels (C/V a power of two that
//    divides PTHREADS, V = 16/sizeof(T)); ipb is a multiple of rb = PTHREADS/(C/V), so a unit is
//    a contiguous flat range starting on a mask word boundary, and thread t keeps channel vector
//    t % (C/V) for the whole kernel.
// So no mask word is shared by two blocks, and no block's data is read from memory twice.
//
// Forward:  1. load each unit (x -> shared memory), Welford per unit, one partial per (unit,
//              channel);                                                   grid barrier;
//           2. block b finishes channels b, b + G, ...: combine the P partials (fixed order),
//              saved mean / inverse std, running statistics, coef = (mean, gamma*inv_std);
//                                                                          grid barrier;
//           3. y (and the mask) from shared memory, with the addend read from memory.
// Backward: 1. load x and dy, mask dy (dy' stored instead of dy), write d_addend, Σdy' and
//              Σdy'(x - mean) per unit;                                   grid barrier;
//           2. dgamma, dbeta and the dx coefficients per channel;          grid barrier;
//           3. dx from shared memory.
// Partials are combined in the same fixed order as in the two-pass kernels: deterministic.

struct PGeom {
    FastDiv ipr;   // channels-first: vectors per run, as a divisor
    u64 runs;      // channels-first: n
    u64 hw;        // channels-first: elements per run
    u64 rows;      // channels-last: rows
    u64 ipb;       // channels-first: vectors per unit; channels-last: rows per unit
    u64 units;     // channels-first: C * parts; channels-last: parts
    u64 unit_elems;  // elements of one unit slot (channels-first ipb*V, channels-last ipb*C)
    u32 channels;
    u32 parts;     // P: units per channel (first) / row units (last): partials per channel
    u32 upb;       // unit slots per block
    u32 cvs;       // channels-last: C / V
    u32 rb;        // channels-last: PTHREADS / cvs
    u32 vec;       // V: max_vec, half of it, or 1 (channels-first); max_vec (channels-last)
};

struct PersistArgs {
    const void* x;
    const void* g;  // forward: addend z (Add+ReLU); backward: dy
    void* out;      // forward: y; backward: dx
    u32* mask;      // forward: written (activation); backward: read (activation)
    void* dz;       // backward: d_addend (Add+ReLU)
    const float* gamma;
    const float* beta;
    float* mean;     // forward: saved mean (written); backward: saved mean (read)
    float* mean_lo;  // the saved mean's remainder (as mean)
    float* invstd;   // forward: saved inverse std (written); backward: read
    float* running_mean;
    float* running_var;
    float* dgamma;
    float* dbeta;
    void* part;     // forward: double [3][C][P] (Welford, f64); backward: float [2][C][P]
    float* coef;    // [3][C] forward: mean hi, mean lo, scale; [5][C] backward (finish_bwd)
    u32* barrier;   // two zeroed counters
    PGeom geom;
    u32 act;
    float eps;
    double momentum;  // f64, as StatsArgs'
    float inv_count;
};

// ----- forward ----------------------------------------------------------------------------------

// Phase 3 of the channels-first forward for one unit: warp w takes the unit's 32-vector chunks
// w, w + 16, ...; a chunk lies in one run and starts on a mask word boundary.
template <typename T, int V>
__device__ __forceinline__ void pfwd_cf_apply(const PersistArgs& a, const T* ut, u64 ch, u64 k0, u64 k1,
                                              float m, float lo, float sc, float bb) {
    const PGeom& g = a.geom;
    const u64 C = g.channels, ipr = g.ipr.d;
    const int lane = threadIdx.x & 31;
    const u64 warp = threadIdx.x >> 5, nw = PTHREADS / 32;
    const u64 step = nw * 32, sq = fdiv(g.ipr, step), sr = step - sq * ipr;
    const u64 nchunks = (k1 - k0) / 32;  // k1 - k0 is a multiple of 32
    u64 q = warp;
    if (q >= nchunks) return;  // the same for the whole warp
    const u64 kq = k0 + 32 * q;
    u64 o = fdiv(g.ipr, kq), iv = kq - o * ipr;
    const T* z = (const T*)a.g;
    T* y = (T*)a.out;
    for (; q < nchunks; q += nw) {
        // This lane's vector: item (o, iv + lane) of the channel, element e of the tensor.
        const u64 e = (o * C + ch) * g.hw + (iv + lane) * V;
        u32 w[4], wz[4];
        load_raw<T, V>(ut + (q * 32 + lane) * V, w);
        if (a.act == ACT_ADD_RELU) load_raw<T, V>(z + e, wz);
        u32 bits = 0;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            float v = fmaf((bits_float<T>(elem_bits<T>(w, j)) - m) - lo, sc, bb);
            if (a.act == ACT_ADD_RELU) v += bits_float<T>(elem_bits<T>(wz, j));
            if (a.act != ACT_NONE) v = (v <= 0.0f) ? 0.0f : v;
            const u32 ob = out_bits<T>(v);
            bits |= (u32)bits_gt0<T>(ob) << j;
            set_elem_bits<T>(w, j, ob);
        }
        store_raw<T, V>(y + e, w);
        if (a.act != ACT_NONE) {
            const u32 word = chunk_word<V>(bits);
            if ((lane & (32 / V - 1)) == 0) a.mask[e >> 5] = word;
        }
        cursor_step(o, iv, sq, sr, ipr);
    }
}

template <typename T> constexpr int pmax_vec() { return 16 / (int)sizeof(T); }

// The [k][C] coefficients phase 2 wrote (before the last grid barrier) into the block's shared
// memory `dst` (room for `cap` floats), once per block; false (nothing staged) when they do not
// fit. Channels-last threads each need V channels' coefficients: read from L2 by every thread,
// 132 SMs sent the same few lines ~80k requests and the 64-channel backward spent a third of its
// time there (ncu stall sampling, H100).
__device__ __forceinline__ bool stage_coef(const float* coef, u64 n, float* dst, u64 cap) {
    if (n > cap) return false;
    for (u64 i = threadIdx.x; i < n; i += PTHREADS) dst[i] = __ldcg(coef + i);
    __syncthreads();
    return true;
}

// The channels-first ranges with the persistent block size.
template <typename T, int V>
__device__ __forceinline__ void pstats_range(const T* x, u64 C, u64 hw, const FastDiv& iprd, u64 ch,
                                             u64 k0, u64 k1, float shift, WfV<1>& acc, T* tile) {
    cf_stats_range<T, V, PTHREADS>(x, C, hw, iprd, ch, k0, k1, shift, acc, tile);
}
template <typename T, int V>
__device__ __forceinline__ void preduce_range(const T* x, const T* dy, const u32* mask, T* dz, int act,
                                              u64 C, u64 hw, const FastDiv& iprd, u64 ch, u64 k0,
                                              u64 k1, float mhi, float mlo, float& s1, float& s2,
                                              T* xt, T* gt) {
    cf_reduce_range<T, V, PTHREADS>(x, dy, mask, dz, act, C, hw, iprd, ch, k0, k1, mhi, mlo, s1, s2,
                                    xt, gt, l2_policy(0));
}

// A channel's pivot: its first element.
template <typename T> __device__ __forceinline__ float ppivot(const PersistArgs& a, u64 ch) {
    return to_float(((const T*)a.x)[a.geom.cvs == 0 ? ch * a.geom.hw : ch]);
}

// Phase 2 of the forward: finish channel ch (thread 0) and publish its coefficients.
template <typename T> __device__ __forceinline__ void pfinish_channel(const PersistArgs& a, u64 ch,
                                                                     const Wf& t) {
    const u64 C = a.geom.channels;
    float hi, lo;
    const double inv = finish_stats(ch, t, ppivot<T>(a, ch), a.eps, a.momentum, a.mean,
                                   a.mean_lo, a.invstd, a.running_mean, a.running_var, hi, lo);
    a.coef[ch] = hi;
    a.coef[C + ch] = lo;
    a.coef[2 * C + ch] = (float)((double)a.gamma[ch] * inv);
}

// The vector width geom.vec (geom.ipr = hw / vec) is 16 bytes, 8 bytes or one element.
#define NNF_PVEC_DISPATCH(FN, ...)                                   \
    if (g.vec == (u32)pmax_vec<T>())                                 \
        FN<T, pmax_vec<T>()>(__VA_ARGS__);                           \
    else if (g.vec == (u32)pmax_vec<T>() / 2)                        \
        FN<T, pmax_vec<T>() / 2>(__VA_ARGS__);                       \
    else                                                             \
        FN<T, 1>(__VA_ARGS__);

template <typename T> __device__ __forceinline__ void pfwd_cf(const PersistArgs& a) {
    __shared__ double sh[96];
    T* tile = reinterpret_cast<T*>(nnf_dyn_smem);
    const PGeom& g = a.geom;
    const u64 G = gridDim.x, b = blockIdx.x;
    const u64 C = g.channels, P = g.parts, cp = C * P;
    const u64 items = g.runs * g.ipr.d;
    double* fpart = static_cast<double*>(a.part);
    // 1. statistics of each unit, its data kept in its slot
    for (u32 s = 0; s < g.upb; ++s) {
        const u64 u = b + (u64)s * G;
        if (u >= g.units) break;  // the same for the whole block
        const u64 ch = u / P, p = u - ch * P;
        const u64 k0 = p * g.ipb, k1 = min(k0 + g.ipb, items);
        WfV<1> acc = wfv_zero<1>();
        const float shift = ppivot<T>(a, ch);
        NNF_PVEC_DISPATCH(pstats_range, (const T*)a.x, C, g.hw, g.ipr, ch, k0, k1, shift, acc,
                          tile + (u64)s * g.unit_elems)
        Wf w;
        w.n = acc.n;
        w.m = acc.m[0];
        w.m2 = acc.m2[0];
        w = wf_block<PTHREADS>(w, sh);
        if (threadIdx.x == 0) {
            fpart[ch * P + p] = w.n;
            fpart[cp + ch * P + p] = w.m;
            fpart[2 * cp + ch * P + p] = w.m2;
        }
    }
    grid_sync(a.barrier, (u32)G);
    // 2. finish channels b, b + G, ...
    for (u64 ch = b; ch < C; ch += G) {
        const Wf t = combine_wf<PTHREADS>(fpart, cp, ch * P, P, sh);
        if (threadIdx.x == 0) pfinish_channel<T>(a, ch, t);
    }
    grid_sync(a.barrier, 2u * (u32)G);
    grid_exit(a.barrier);
    // 3. y and the mask from the slots
    for (u32 s = 0; s < g.upb; ++s) {
        const u64 u = b + (u64)s * G;
        if (u >= g.units) break;
        const u64 ch = u / P, p = u - ch * P;
        const u64 k0 = p * g.ipb, k1 = min(k0 + g.ipb, items);
        const float m = __ldcg(a.coef + ch), lo = __ldcg(a.coef + C + ch),
                    sc = __ldcg(a.coef + 2 * C + ch), bb = a.beta[ch];
        NNF_PVEC_DISPATCH(pfwd_cf_apply, a, tile + (u64)s * g.unit_elems, ch, k0, k1, m, lo, sc, bb)
    }
}

template <typename T> __device__ __forceinline__ void pfwd_cl(const PersistArgs& a) {
    constexpr int V = 16 / sizeof(T);
    __shared__ double red[cl_tree_doubles<V, PTHREADS>()];
    T* tile = reinterpret_cast<T*>(nnf_dyn_smem);
    const PGeom& g = a.geom;
    const u64 G = gridDim.x, b = blockIdx.x;
    const u64 C = g.channels, P = g.parts, cp = C * P;
    const u32 cvs = g.cvs, rb = g.rb;  // rb * cvs == PTHREADS
    const u32 ro = threadIdx.x / cvs, cv = threadIdx.x - ro * cvs;
    double* fpart = static_cast<double*>(a.part);
    // 1. statistics
    for (u32 s = 0; s < g.upb; ++s) {
        const u64 u = b + (u64)s * G;
        if (u >= g.units) break;
        const u64 r0 = u * g.ipb, r1 = min(r0 + g.ipb, g.rows);
        WfV<V> acc = wfv_zero<V>();
        float shift[V];
#pragma unroll
        for (int j = 0; j < V; ++j) shift[j] = ppivot<T>(a, (u64)cv * V + j);
        cl_stats_rows<T, V>((const T*)a.x, C, cv, r0 + ro, r1, rb, shift, acc,
                            tile + (u64)s * g.unit_elems, r0);
        cl_tree_wf<V, PTHREADS, V>(acc, ro, rb, cvs, true, red);
        if (ro == 0) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const u64 ch = (u64)cv * V + j;
                fpart[ch * P + u] = acc.n;
                fpart[cp + ch * P + u] = acc.m[j];
                fpart[2 * cp + ch * P + u] = acc.m2[j];
            }
        }
    }
    grid_sync(a.barrier, (u32)G);
    // 2. finish channels b, b + G, ...
    for (u64 ch = b; ch < C; ch += G) {
        const Wf t = combine_wf<PTHREADS>(fpart, cp, ch * P, P, red);
        if (threadIdx.x == 0) pfinish_channel<T>(a, ch, t);
    }
    grid_sync(a.barrier, 2u * (u32)G);
    grid_exit(a.barrier);
    // 3. y and the mask: thread (ro, cv) keeps its V channels' coefficients in registers.
    float* ks = reinterpret_cast<float*>(red);  // free: phase 2's last use is behind the barrier
    const bool staged = stage_coef(a.coef, 3 * C, ks, 2 * (u64)cl_tree_doubles<V, PTHREADS>());
    const float* kc = staged ? ks : a.coef;
    float m[V], lo[V], sc[V], bb[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const u64 ch = (u64)cv * V + j;
        m[j] = staged ? kc[ch] : __ldcg(kc + ch);
        lo[j] = staged ? kc[C + ch] : __ldcg(kc + C + ch);
        sc[j] = staged ? kc[2 * C + ch] : __ldcg(kc + 2 * C + ch);
        bb[j] = a.beta[ch];
    }
    const int lane = threadIdx.x & 31;
    const T* z = (const T*)a.g;
    T* y = (T*)a.out;
    for (u32 s = 0; s < g.upb; ++s) {
        const u64 u = b + (u64)s * G;
        if (u >= g.units) break;
        const u64 r0 = u * g.ipb, r1 = min(r0 + g.ipb, g.rows);
        const T* ut = tile + (u64)s * g.unit_elems;
        const u64 iters = (r1 - r0 + rb - 1) / rb;  // the same for the whole block
        for (u64 it = 0; it < iters; ++it) {
            // A block iteration covers rows r0 + it*rb .. + rb - 1 (the last may stop early):
            // PTHREADS consecutive vectors, so a warp's lanes cover 32 consecutive vectors.
            const u64 r = r0 + it * rb + ro;
            const bool in = r < r1;
            const u64 e = r * C + (u64)cv * V;
            u32 bits = 0;
            if (in) {
                u32 w[4], wz[4];
                load_raw<T, V>(ut + (r - r0) * C + (u64)cv * V, w);
                if (a.act == ACT_ADD_RELU) load_raw<T, V>(z + e, wz);
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    float v = fmaf((bits_float<T>(elem_bits<T>(w, j)) - m[j]) - lo[j], sc[j], bb[j]);
                    if (a.act == ACT_ADD_RELU) v += bits_float<T>(elem_bits<T>(wz, j));
                    if (a.act != ACT_NONE) v = (v <= 0.0f) ? 0.0f : v;
                    const u32 ob = out_bits<T>(v);
                    bits |= (u32)bits_gt0<T>(ob) << j;
                    set_elem_bits<T>(w, j, ob);
                }
                store_raw<T, V>(y + e, w);
            }
            if (a.act != ACT_NONE) {
                const u32 word = chunk_word<V>(bits);
                // A lane group's first lane is in whenever any of the group is (rows only grow).
                if (in && (lane & (32 / V - 1)) == 0) a.mask[e >> 5] = word;
            }
        }
    }
}

// ----- backward ---------------------------------------------------------------------------------

// Phase 3 of the channels-first backward for one unit: the thread-strided vector walk of phase 1.
template <typename T, int V>
__device__ __forceinline__ void pbwd_cf_apply(const PersistArgs& a, const T* ux, const T* ug, u64 ch,
                                              u64 k0, u64 k1, float m, float lo, float ka, float kb,
                                              float kd) {
    const PGeom& g = a.geom;
    const u64 C = g.channels, ipr = g.ipr.d;
    const u64 sq = fdiv(g.ipr, (u64)PTHREADS), sr = (u64)PTHREADS - sq * ipr;
    T* dx = (T*)a.out;
    u64 k = k0 + threadIdx.x;
    if (k >= k1) return;
    u64 o = fdiv(g.ipr, k), iv = k - o * ipr;
    for (; k < k1; k += PTHREADS) {
        u32 wx[4], wg[4], w[4] = {0u, 0u, 0u, 0u};
        load_raw<T, V>(ux + (k - k0) * V, wx);
        load_raw<T, V>(ug + (k - k0) * V, wg);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float xv = bits_float<T>(elem_bits<T>(wx, j));
            const float gv = bits_float<T>(elem_bits<T>(wg, j));
            set_elem_bits<T>(w, j, out_bits<T>(ka * (gv - fmaf((xv - m) - lo, kd, kb))));
        }
        store_raw<T, V>(dx + ((o * C + ch) * g.hw + iv * V), w);
        cursor_step(o, iv, sq, sr, ipr);
    }
}

template <typename T> __device__ __forceinline__ void pbwd_cf(const PersistArgs& a) {
    __shared__ float sh[96];
    const PGeom& g = a.geom;
    T* xt = reinterpret_cast<T*>(nnf_dyn_smem);
    T* gt = xt + (u64)g.upb * g.unit_elems;
    const u64 G = gridDim.x, b = blockIdx.x;
    const u64 C = g.channels, P = g.parts, cp = C * P;
    float* bpart = static_cast<float*>(a.part);
    const u64 items = g.runs * g.ipr.d;
    // 1. sums of each unit, x and dy' kept in the slots
    for (u32 s = 0; s < g.upb; ++s) {
        const u64 u = b + (u64)s * G;
        if (u >= g.units) break;
        const u64 ch = u / P, p = u - ch * P;
        const u64 k0 = p * g.ipb, k1 = min(k0 + g.ipb, items);
        float s1 = 0.0f, s2 = 0.0f;
        NNF_PVEC_DISPATCH(preduce_range, (const T*)a.x, (const T*)a.g, a.mask, (T*)a.dz,
                          (int)a.act, C, g.hw, g.ipr, ch, k0, k1, a.mean[ch], a.mean_lo[ch], s1,
                          s2, xt + (u64)s * g.unit_elems, gt + (u64)s * g.unit_elems)
        sum2_block<PTHREADS>(s1, s2, sh);
        if (threadIdx.x == 0) {
            bpart[ch * P + p] = s1;
            bpart[cp + ch * P + p] = s2;
        }
    }
    grid_sync(a.barrier, (u32)G);
    // 2. dgamma, dbeta, dx coefficients of channels b, b + G, ...
    for (u64 ch = b; ch < C; ch += G) {
        float t1, t2;
        combine_sums<PTHREADS>(bpart, cp, ch * P, P, t1, t2, sh);
        if (threadIdx.x == 0)
            finish_bwd(ch, C, t1, t2, a.inv_count, a.mean, a.mean_lo, a.invstd, a.gamma, a.dgamma,
                       a.dbeta, a.coef);
    }
    grid_sync(a.barrier, 2u * (u32)G);
    grid_exit(a.barrier);
    // 3. dx from the slots
    for (u32 s = 0; s < g.upb; ++s) {
        const u64 u = b + (u64)s * G;
        if (u >= g.units) break;
        const u64 ch = u / P, p = u - ch * P;
        const u64 k0 = p * g.ipb, k1 = min(k0 + g.ipb, items);
        const float m = __ldcg(a.coef + ch), lo = __ldcg(a.coef + C + ch),
                    ka = __ldcg(a.coef + 2 * C + ch), kb = __ldcg(a.coef + 3 * C + ch),
                    kd = __ldcg(a.coef + 4 * C + ch);
        NNF_PVEC_DISPATCH(pbwd_cf_apply, a, xt + (u64)s * g.unit_elems, gt + (u64)s * g.unit_elems,
                          ch, k0, k1, m, lo, ka, kb, kd)
    }
}

template <typename T> __device__ __forceinline__ void pbwd_cl(const PersistArgs& a) {
    constexpr int V = 16 / sizeof(T);
    __shared__ float red[PTHREADS * 2 * V];
    const PGeom& g = a.geom;
    T* xt = reinterpret_cast<T*>(nnf_dyn_smem);
    T* gt = xt + (u64)g.upb * g.unit_elems;
    const u64 G = gridDim.x, b = blockIdx.x;
    const u64 C = g.channels, P = g.parts, cp = C * P;
    float* bpart = static_cast<float*>(a.part);
    const u32 cvs = g.cvs, rb = g.rb;
    const u32 ro = threadIdx.x / cvs, cv = threadIdx.x - ro * cvs;
    float mhi[V], mlo[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        mhi[j] = a.mean[(u64)cv * V + j];
        mlo[j] = a.mean_lo[(u64)cv * V + j];
    }
    // 1. sums
    for (u32 s = 0; s < g.upb; ++s) {
        const u64 u = b + (u64)s * G;
        if (u >= g.units) break;
        const u64 r0 = u * g.ipb, r1 = min(r0 + g.ipb, g.rows);
        float s1[V], s2[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
            s1[j] = 0.0f;
            s2[j] = 0.0f;
        }
        cl_reduce_rows<T, V>((const T*)a.x, (const T*)a.g, a.mask, (T*)a.dz, (int)a.act, C, cv,
                             r0 + ro, r1, rb, mhi, mlo, s1, s2, xt + (u64)s * g.unit_elems,
                             gt + (u64)s * g.unit_elems, r0, l2_policy(0));
        cl_tree_sums<V, PTHREADS>(s1, s2, ro, rb, cvs, true, red);
        if (ro == 0) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const u64 ch = (u64)cv * V + j;
                bpart[ch * P + u] = s1[j];
                bpart[cp + ch * P + u] = s2[j];
            }
        }
    }
    grid_sync(a.barrier, (u32)G);
    // 2. per channel
    for (u64 ch = b; ch < C; ch += G) {
        float t1, t2;
        combine_sums<PTHREADS>(bpart, cp, ch * P, P, t1, t2, red);
        if (threadIdx.x == 0)
            finish_bwd(ch, C, t1, t2, a.inv_count, a.mean, a.mean_lo, a.invstd, a.gamma, a.dgamma,
                       a.dbeta, a.coef);
    }
    grid_sync(a.barrier, 2u * (u32)G);
    grid_exit(a.barrier);
    // 3. dx
    const bool staged = stage_coef(a.coef, 5 * C, red, (u64)PTHREADS * 2 * V);  // red is free
    const float* kc = staged ? red : a.coef;
    float km[V], kl[V], ka[V], kb[V], kd[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const u64 ch = (u64)cv * V + j;
        km[j] = staged ? kc[ch] : __ldcg(kc + ch);
        kl[j] = staged ? kc[C + ch] : __ldcg(kc + C + ch);
        ka[j] = staged ? kc[2 * C + ch] : __ldcg(kc + 2 * C + ch);
        kb[j] = staged ? kc[3 * C + ch] : __ldcg(kc + 3 * C + ch);
        kd[j] = staged ? kc[4 * C + ch] : __ldcg(kc + 4 * C + ch);
    }
    T* dx = (T*)a.out;
    for (u32 s = 0; s < g.upb; ++s) {
        const u64 u = b + (u64)s * G;
        if (u >= g.units) break;
        const u64 r0 = u * g.ipb, r1 = min(r0 + g.ipb, g.rows);
        const T* ux = xt + (u64)s * g.unit_elems;
        const T* ug = gt + (u64)s * g.unit_elems;
        for (u64 r = r0 + ro; r < r1; r += rb) {
            u32 wx[4], wg[4], w[4] = {0u, 0u, 0u, 0u};
            load_raw<T, V>(ux + (r - r0) * C + (u64)cv * V, wx);
            load_raw<T, V>(ug + (r - r0) * C + (u64)cv * V, wg);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float xv = bits_float<T>(elem_bits<T>(wx, j));
                const float gv = bits_float<T>(elem_bits<T>(wg, j));
                set_elem_bits<T>(
                    w, j, out_bits<T>(ka[j] * (gv - fmaf((xv - km[j]) - kl[j], kd[j], kb[j]))));
            }
            store_raw<T, V>(dx + r * C + (u64)cv * V, w);
        }
    }
}

// ----- entry points -----------------------------------------------------------------------------

// Kernel kinds of the compilation units (NNF_BN_KERNEL, batchnorm_common.cuh), numbered after
// kernels/batchnorm.cu's. Keep in sync with src/batchnorm/own_units.rs (a CPU test compares them).
#define NNF_BN_K_PERSIST_FWD_CF 14
#define NNF_BN_K_PERSIST_FWD_CL 15
#define NNF_BN_K_PERSIST_BWD_CF 16
#define NNF_BN_K_PERSIST_BWD_CL 17

#define NNF_BN_PERSIST_FWD_CF(T, S)                                                               \
    extern "C" __global__ void __launch_bounds__(PTHREADS, 1) bn_persist_fwd_cf_##S(PersistArgs a) { \
        pfwd_cf<T>(a);                                                                        \
    }
#define NNF_BN_PERSIST_FWD_CL(T, S)                                                               \
    extern "C" __global__ void __launch_bounds__(PTHREADS, 1) bn_persist_fwd_cl_##S(PersistArgs a) { \
        pfwd_cl<T>(a);                                                                            \
    }
#define NNF_BN_PERSIST_BWD_CF(T, S)                                                               \
    extern "C" __global__ void __launch_bounds__(PTHREADS, 1) bn_persist_bwd_cf_##S(PersistArgs a) { \
        pbwd_cf<T>(a);                                                                        \
    }
#define NNF_BN_PERSIST_BWD_CL(T, S)                                                               \
    extern "C" __global__ void __launch_bounds__(PTHREADS, 1) bn_persist_bwd_cl_##S(PersistArgs a) { \
        pbwd_cl<T>(a);                                                                            \
    }

#if NNF_BN_PICK(NNF_BN_K_PERSIST_FWD_CF)
NNF_BN_FOR_TYPES(NNF_BN_PERSIST_FWD_CF)
#endif
#if NNF_BN_PICK(NNF_BN_K_PERSIST_FWD_CL)
NNF_BN_FOR_TYPES(NNF_BN_PERSIST_FWD_CL)
#endif
#if NNF_BN_PICK(NNF_BN_K_PERSIST_BWD_CF)
NNF_BN_FOR_TYPES(NNF_BN_PERSIST_BWD_CF)
#endif
#if NNF_BN_PICK(NNF_BN_K_PERSIST_BWD_CL)
NNF_BN_FOR_TYPES(NNF_BN_PERSIST_BWD_CL)
#endif
