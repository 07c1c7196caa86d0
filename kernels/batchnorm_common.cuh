// Shared by kernels/batchnorm.cu and kernels/batchnorm_persistent.cu: src/kernels.rs embeds this
// header after the prelude and kernels/common.cuh (fast division, element access, L2 policies,
// Welford / Chan reductions) and before each of the two files.
//
// Conventions of every BatchNorm kernel:
//  * Data (x, z, y, dy, dx, d_addend) is T = float, nnf_f16 or nnf_bf16; parameters, statistics
//    and every accumulation are f32.
//  * The tensor is viewed as channels-first (n runs of hw contiguous elements per channel:
//    element (o, ch, i) at (o*C + ch)*hw + i) or channels-last (rows of C contiguous elements:
//    element (r, ch) at r*C + ch), as src/batchnorm/own_launch.rs decides from the layout.
//  * Statistics: Welford per thread (values merged in groups: a group's own mean and M2, then
//    Chan's combination into the running state), then Chan's combination of the partial results
//    in a fixed tree, so that the result does not depend on timing (no float atomics). Integer
//    atomics only count arrivals. Every value is first shifted by a pivot of its channel (the
//    channel's first element), so that a large common offset costs no precision; the channel's
//    mean is finished in f64 as a pair hi + lo of floats (hi = the saved mean), and every
//    consumer forms x - mean as (x - hi) - lo.
//  * Mask layout (src/reference/activation.rs): u32 words, bit i of word w is element 32w + i,
//    ceil(n/32) words, bits past n zero; bit = (the rounded output y > 0), so that the mask and y
//    always agree. NaN: relu(NaN) = NaN with bit 0 (as PyTorch and kernels/bitmask.cu).
//  * Indices are 64-bit; blocks are whole warps (ballots and shuffles use the full mask and are
//    reached by all 32 lanes: loop bounds around them depend on the warp or block only).


// Compilation units: src/batchnorm/own_units.rs compiles kernels/batchnorm.cu and
// kernels/batchnorm_persistent.cu once per (kernel, type), with NNF_BN_KERNEL (one of the files'
// NNF_BN_K_* values) and NNF_BN_DT (1 f32, 2 f16, 3 bf16) defined before the prelude, so that
// NVRTC compiles only the kernels a call launches: the whole batchnorm.cu takes it seconds, one
// unit a few hundred milliseconds. Undefined (0) selects everything (CI compiles whole files).
// Only which entry points are defined changes: each kernel's code is the same in every unit.
#ifndef NNF_BN_KERNEL
#define NNF_BN_KERNEL 0
#endif
#ifndef NNF_BN_DT
#define NNF_BN_DT 0
#endif
// Whether the unit holds kernel kind k.
#define NNF_BN_PICK(k) (NNF_BN_KERNEL == 0 || NNF_BN_KERNEL == (k))
// M(T, S) for each selected type T with its name suffix S.
#if NNF_BN_DT == 0
#define NNF_BN_FOR_TYPES(M) M(float, f32) M(nnf_f16, f16) M(nnf_bf16, bf16)
#elif NNF_BN_DT == 1
#define NNF_BN_FOR_TYPES(M) M(float, f32)
#elif NNF_BN_DT == 2
#define NNF_BN_FOR_TYPES(M) M(nnf_f16, f16)
#elif NNF_BN_DT == 3
#define NNF_BN_FOR_TYPES(M) M(nnf_bf16, bf16)
#else
#error "NNF_BN_DT must be 0 (every type), 1 (f32), 2 (f16) or 3 (bf16)"
#endif

// Keep these in sync with src/batchnorm/own_launch.rs (a CPU test compares them).
constexpr int THREADS = 256;       // block of the two-pass and inference kernels
constexpr int PTHREADS = 512;      // block of the persistent kernels
constexpr int RED_UNROLL = 4;      // vectors of 16 bytes a thread loads before it reduces them
constexpr int RED_BYTES = 64;      // bytes a thread loads before it reduces them (narrower vectors)
constexpr int RED_UNROLL_MAX = 16; // most loads a thread has in flight in a reduction
constexpr int APPLY_UNROLL = 2;    // 32-vector chunks per warp iteration in the apply kernels
constexpr int SCALAR_WORDS = 8;    // mask words per warp tile in the scalar apply path
constexpr int STAGE_MAX_C = 2048;  // most channels an apply kernel stages (<= 40 KB: no opt-in)
constexpr int CTHREADS = 64;       // block of the per-channel (few values per channel) backward

// Activation (forward) / what the backward applies to dy.
constexpr int ACT_NONE = 0;      // y = bn(x); dy' = dy
constexpr int ACT_RELU = 1;      // y = relu(bn(x)); dy' = dy where the mask bit is set
constexpr int ACT_ADD_RELU = 2;  // y = relu(bn(x) + z); dy' as ReLU, and d_addend = dy'

extern __shared__ __align__(16) unsigned char nnf_dyn_smem[];

// Vectors of V elements a reduction thread loads before it reduces them: RED_BYTES in flight
// whatever the width (4 of 16 bytes, 8 of 8 bytes, 16 narrower ones). U*V stays a power of two.
template <typename T, int V> constexpr int red_unroll() {
    return RED_BYTES / (V * (int)sizeof(T)) < RED_UNROLL
               ? RED_UNROLL
               : (RED_BYTES / (V * (int)sizeof(T)) > RED_UNROLL_MAX
                      ? RED_UNROLL_MAX
                      : RED_BYTES / (V * (int)sizeof(T)));
}

// --- partial results -------------------------------------------------------------------------
// Partials of channel ch, part p live at part[k*C*P + ch*P + p] for field k (statistics: count,
// mean, M2 as doubles; backward: Σdy', Σdy'(x - mean) as floats): a channel's partials are
// contiguous, so the combine reads them coalesced.

// Combines the P Welford partials of one channel (base = ch*P) with the whole block: thread t
// takes p = t, t + NT, ... in order, then the block tree. Valid in thread 0. The partials may have
// been written by other blocks of this launch (read through L2, never a stale L1 line).
template <int NT>
__device__ __forceinline__ Wf combine_wf(const double* part, u64 cp, u64 base, u64 P, double* sh) {
    Wf acc = wf_zero();
    for (u64 q = threadIdx.x; q < P; q += NT)
        wf_merge(acc, __ldcg(part + base + q), __ldcg(part + cp + base + q),
                 __ldcg(part + 2 * cp + base + q));
    return wf_block<NT>(acc, sh);
}

// The same for the backward's two sums.
template <int NT>
__device__ __forceinline__ void combine_sums(const float* part, u64 cp, u64 base, u64 P, float& s1,
                                             float& s2, float* sh) {
    s1 = 0.0f;
    s2 = 0.0f;
    for (u64 q = threadIdx.x; q < P; q += NT) {
        s1 += __ldcg(part + base + q);
        s2 += __ldcg(part + cp + base + q);
    }
    sum2_block<NT>(s1, s2, sh);
}

// --- channels-first traversal ----------------------------------------------------------------
// A channel's vectors are numbered k = o*ipr + iv (run o, vector iv of the run, ipr = hw/V
// vectors per run); vector k of channel ch starts at element (o*C + ch)*hw + iv*V. A thread
// takes k = k0 + t, k0 + t + NT, ... and steps its (o, iv) cursor without dividing.

__device__ __forceinline__ void cursor_step(u64& o, u64& iv, u64 sq, u64 sr, u64 ipr) {
    iv += sr;
    o += sq;
    if (iv >= ipr) {
        iv -= ipr;
        ++o;
    }
}

// The type of a statistics pass's shifted values x - shift: f64 for f32 data (exact: x and the
// shift are f32), f32 for 16-bit data (exact as well).
template <typename T> struct StatValOf { using type = float; };
template <> struct StatValOf<float> { using type = double; };
template <typename T> using StatVal = typename StatValOf<T>::type;

// Welford over vectors [k0, k1) of channel ch (thread-strided by NT). With `tile`, every vector
// is also stored there at (k - k0)*V (the persistent kernels keep x on chip).
template <typename T, int V, int NT>
__device__ __forceinline__ void cf_stats_range(const T* __restrict__ x, u64 C, u64 hw,
                                               const FastDiv& iprd, u64 ch, u64 k0, u64 k1,
                                               float shift, WfV<1>& acc, T* tile) {
    u64 k = k0 + threadIdx.x;
    if (k >= k1) return;
    const u64 ipr = iprd.d;
    u64 o = fdiv(iprd, k), iv = k - o * ipr;
    const u64 sq = fdiv(iprd, (u64)NT), sr = (u64)NT - sq * ipr;
    constexpr int U = red_unroll<T, V>();
    for (; k + (u64)(U - 1) * NT < k1; k += (u64)U * NT) {
        u32 w[U][4];
#pragma unroll
        for (int u = 0; u < U; ++u) {  // all loads first
            load_raw<T, V>(x + ((o * C + ch) * hw + iv * V), w[u]);
            cursor_step(o, iv, sq, sr, ipr);
        }
        if (tile != nullptr) {
#pragma unroll
            for (int u = 0; u < U; ++u)
                store_raw<T, V>(tile + (k - k0 + (u64)u * NT) * V, w[u]);
        }
        StatVal<T> v[U * V];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < V; ++j)
                v[u * V + j] = (StatVal<T>)bits_float<T>(elem_bits<T>(w[u], j)) - (StatVal<T>)shift;
        wfv_group<1, U * V, StatVal<T>>(acc, v);
    }
    for (; k < k1; k += NT) {
        u32 w[4];
        load_raw<T, V>(x + ((o * C + ch) * hw + iv * V), w);
        if (tile != nullptr) store_raw<T, V>(tile + (k - k0) * V, w);
        StatVal<T> v[V];
#pragma unroll
        for (int j = 0; j < V; ++j)
            v[j] = (StatVal<T>)bits_float<T>(elem_bits<T>(w, j)) - (StatVal<T>)shift;
        wfv_group<1, V, StatVal<T>>(acc, v);
        cursor_step(o, iv, sq, sr, ipr);
    }
}

// Σdy' and Σdy'(x - mean) over vectors [k0, k1) of channel ch, with dy' = dy masked (act >= 1)
// and written to dz (act == ACT_ADD_RELU). With tiles, x and dy' are also stored at (k - k0)*V.
template <typename T, int V, int NT>
__device__ __forceinline__ void cf_reduce_range(const T* __restrict__ x, const T* __restrict__ dy,
                                                const u32* __restrict__ mask, T* dz, int act, u64 C,
                                                u64 hw, const FastDiv& iprd, u64 ch, u64 k0, u64 k1,
                                                float mhi, float mlo, float& s1, float& s2, T* xt,
                                                T* gt, u64 pol) {
    u64 k = k0 + threadIdx.x;
    if (k >= k1) return;
    const u64 ipr = iprd.d;
    u64 o = fdiv(iprd, k), iv = k - o * ipr;
    const u64 sq = fdiv(iprd, (u64)NT), sr = (u64)NT - sq * ipr;
    constexpr int U = red_unroll<T, V>();
    for (; k + (u64)(U - 1) * NT < k1; k += (u64)U * NT) {
        u32 wx[U][4], wg[U][4], mb[U];
        const u64 o0 = o, iv0 = iv;  // the group's cursor again for d_addend (no index array)
#pragma unroll
        for (int u = 0; u < U; ++u) {  // all loads first
            const u64 e = (o * C + ch) * hw + iv * V;
            load_raw<T, V>(x + e, wx[u]);
            load_raw_pol<T, V>(dy + e, wg[u], pol);
            mb[u] = act != ACT_NONE ? vec_bits<V>(mask, e) : 0xffffffffu;
            cursor_step(o, iv, sq, sr, ipr);
        }
        u64 o2 = o0, iv2 = iv0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (act != ACT_NONE) mask_raw<T, V>(wg[u], mb[u]);
            if (act == ACT_ADD_RELU) {
                store_raw_pol<T, V>(dz + ((o2 * C + ch) * hw + iv2 * V), wg[u], pol);
                cursor_step(o2, iv2, sq, sr, ipr);
            }
            if (xt != nullptr) {
                store_raw<T, V>(xt + (k - k0 + (u64)u * NT) * V, wx[u]);
                store_raw<T, V>(gt + (k - k0 + (u64)u * NT) * V, wg[u]);
            }
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float g = bits_float<T>(elem_bits<T>(wg[u], j));
                s1 += g;
                s2 = fmaf(g, (bits_float<T>(elem_bits<T>(wx[u], j)) - mhi) - mlo, s2);
            }
        }
    }
    for (; k < k1; k += NT) {
        const u64 e = (o * C + ch) * hw + iv * V;
        u32 wx[4], wg[4];
        load_raw<T, V>(x + e, wx);
        load_raw_pol<T, V>(dy + e, wg, pol);
        if (act != ACT_NONE) mask_raw<T, V>(wg, vec_bits<V>(mask, e));
        if (act == ACT_ADD_RELU) store_raw_pol<T, V>(dz + e, wg, pol);
        if (xt != nullptr) {
            store_raw<T, V>(xt + (k - k0) * V, wx);
            store_raw<T, V>(gt + (k - k0) * V, wg);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float g = bits_float<T>(elem_bits<T>(wg, j));
            s1 += g;
            s2 = fmaf(g, (bits_float<T>(elem_bits<T>(wx, j)) - mhi) - mlo, s2);
        }
        cursor_step(o, iv, sq, sr, ipr);
    }
}

// --- channels-last traversal -----------------------------------------------------------------
// Thread t of a block is (ro, cvl) = (t / cvs, t % cvs): channel vector cv = slab*cvs + cvl (its V
// channels cv*V .. cv*V + V-1 never change) and rows r = r_begin + ro, + rb, ... (rb = rows per
// block iteration). Consecutive threads read consecutive vectors of a row, then the next row.

template <typename T, int V>
__device__ __forceinline__ void cl_stats_rows(const T* __restrict__ x, u64 C, u64 cv, u64 r, u64 r1,
                                              u64 rb, const float (&shift)[V], WfV<V>& acc,
                                              T* tile, u64 tile_r0) {
    constexpr int U = red_unroll<T, V>();
    for (; r + (u64)(U - 1) * rb < r1; r += (u64)U * rb) {
        u32 w[U][4];
#pragma unroll
        for (int u = 0; u < U; ++u) load_raw<T, V>(x + (r + u * rb) * C + cv * V, w[u]);
        if (tile != nullptr) {
#pragma unroll
            for (int u = 0; u < U; ++u)
                store_raw<T, V>(tile + (r + u * rb - tile_r0) * C + cv * V, w[u]);
        }
        StatVal<T> v[U * V];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < V; ++j)
                v[u * V + j] =
                    (StatVal<T>)bits_float<T>(elem_bits<T>(w[u], j)) - (StatVal<T>)shift[j];
        wfv_group<V, U, StatVal<T>>(acc, v);
    }
    for (; r < r1; r += rb) {
        u32 w[4];
        load_raw<T, V>(x + r * C + cv * V, w);
        if (tile != nullptr) store_raw<T, V>(tile + (r - tile_r0) * C + cv * V, w);
        StatVal<T> v[V];
#pragma unroll
        for (int j = 0; j < V; ++j)
            v[j] = (StatVal<T>)bits_float<T>(elem_bits<T>(w, j)) - (StatVal<T>)shift[j];
        wfv_group<V, 1, StatVal<T>>(acc, v);
    }
}

template <typename T, int V>
__device__ __forceinline__ void cl_reduce_rows(const T* __restrict__ x, const T* __restrict__ dy,
                                               const u32* __restrict__ mask, T* dz, int act, u64 C,
                                               u64 cv, u64 r, u64 r1, u64 rb, const float (&mhi)[V],
                                               const float (&mlo)[V], float (&s1)[V],
                                               float (&s2)[V], T* xt, T* gt, u64 tile_r0,
                                               u64 pol) {
    constexpr int U = red_unroll<T, V>();
    for (; r + (u64)(U - 1) * rb < r1; r += (u64)U * rb) {
        u32 wx[U][4], wg[U][4], mb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u64 e = (r + u * rb) * C + cv * V;
            load_raw<T, V>(x + e, wx[u]);
            load_raw_pol<T, V>(dy + e, wg[u], pol);
            mb[u] = act != ACT_NONE ? vec_bits<V>(mask, e) : 0xffffffffu;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u64 rr = r + u * rb;
            if (act != ACT_NONE) mask_raw<T, V>(wg[u], mb[u]);
            if (act == ACT_ADD_RELU) store_raw_pol<T, V>(dz + rr * C + cv * V, wg[u], pol);
            if (xt != nullptr) {
                store_raw<T, V>(xt + (rr - tile_r0) * C + cv * V, wx[u]);
                store_raw<T, V>(gt + (rr - tile_r0) * C + cv * V, wg[u]);
            }
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float g = bits_float<T>(elem_bits<T>(wg[u], j));
                s1[j] += g;
                s2[j] = fmaf(g, (bits_float<T>(elem_bits<T>(wx[u], j)) - mhi[j]) - mlo[j], s2[j]);
            }
        }
    }
    for (; r < r1; r += rb) {
        const u64 e = r * C + cv * V;
        u32 wx[4], wg[4];
        load_raw<T, V>(x + e, wx);
        load_raw_pol<T, V>(dy + e, wg, pol);
        if (act != ACT_NONE) mask_raw<T, V>(wg, vec_bits<V>(mask, e));
        if (act == ACT_ADD_RELU) store_raw_pol<T, V>(dz + e, wg, pol);
        if (xt != nullptr) {
            store_raw<T, V>(xt + (r - tile_r0) * C + cv * V, wx);
            store_raw<T, V>(gt + (r - tile_r0) * C + cv * V, wg);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float g = bits_float<T>(elem_bits<T>(wg, j));
            s1[j] += g;
            s2[j] = fmaf(g, (bits_float<T>(elem_bits<T>(wx, j)) - mhi[j]) - mlo[j], s2[j]);
        }
    }
}

// Doubles of the channels-last tree buffer (`red`) for at most VMAX channels per thread: the
// float buffer of an f32 tree (NT*(1 + 2*VMAX) floats), so the f64 tree costs no shared memory
// (the persistent kernels' tiles keep theirs).
template <int VMAX, int NT> constexpr int cl_tree_doubles() { return NT * (1 + 2 * VMAX) / 2; }

// The threads of a block that share a channel vector (same cvl, ro = 0 .. rb-1) combine their
// states in a fixed tree over ro; the result ends in the thread with ro == 0. `red` holds
// cl_tree_doubles<VMAX, NT>(): the counts (as u32) and CH = min(V, VMAX/2) channels' means and
// M2 at a time, so V channels take V/CH rounds. Every thread of the block calls (inactive ones
// contribute nothing).
template <int V, int NT, int VMAX>
__device__ __forceinline__ void cl_tree_wf(WfV<V>& acc, u32 ro, u32 rb, u32 cvs, bool active,
                                           double* red) {
    constexpr int CH = V < VMAX / 2 ? V : VMAX / 2;
    static_assert(CH >= 1 && V % CH == 0, "whole rounds");
    static_assert(NT / 2 + 2 * CH * NT <= cl_tree_doubles<VMAX, NT>(), "fits the buffer");
    const u32 t = threadIdx.x;
    u32* rn = reinterpret_cast<u32*>(red);  // NT counts (a thread's count fits u32)
    double* rm = red + NT / 2;
    double* rq = rm + NT * CH;
    u32 hmax = 1;
    while (hmax < rb) hmax <<= 1;
    const double n0 = acc.n;
#pragma unroll
    for (int c0 = 0; c0 < V; c0 += CH) {
        WfV<CH> s;
        s.n = n0;
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            s.m[j] = acc.m[c0 + j];
            s.m2[j] = acc.m2[c0 + j];
        }
        if (active) {
            rn[t] = (u32)n0;
#pragma unroll
            for (int j = 0; j < CH; ++j) {
                rm[t * CH + j] = s.m[j];
                rq[t * CH + j] = s.m2[j];
            }
        }
        __syncthreads();
        for (u32 h = hmax >> 1; h >= 1; h >>= 1) {  // pairs (ro, ro + h): a partner never writes in its step
            if (active && ro < h && ro + h < rb) {
                const u32 o = t + h * cvs;
                wfv_merge<CH>(s, (double)rn[o], rm + o * CH, rq + o * CH);
                rn[t] = (u32)s.n;
#pragma unroll
                for (int j = 0; j < CH; ++j) {
                    rm[t * CH + j] = s.m[j];
                    rq[t * CH + j] = s.m2[j];
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            acc.m[c0 + j] = s.m[j];
            acc.m2[c0 + j] = s.m2[j];
        }
        if (c0 + CH >= V) acc.n = s.n;
    }
}

// The same for the backward's sums (NT*2V floats of `red`). When a warp holds whole rows (cvs a
// power of two up to 32): lanes of one channel vector add by shuffles, then the warps' sums in
// warp order — two block barriers instead of one per tree level (the 64-channel persistent
// backward spent 17% of its stall samples in the tree's barriers, ncu, H100).
template <int V, int NT>
__device__ __forceinline__ void cl_tree_sums(float (&s1)[V], float (&s2)[V], u32 ro, u32 rb, u32 cvs,
                                             bool active, float* red) {
    const u32 t = threadIdx.x;
    if (cvs <= 32 && (cvs & (cvs - 1)) == 0 && NT % 32 == 0) {
        if (!active) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
                s1[j] = 0.0f;
                s2[j] = 0.0f;
            }
        }
        for (u32 o = cvs; o < 32; o <<= 1) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
                s1[j] += __shfl_xor_sync(0xffffffffu, s1[j], o);
                s2[j] += __shfl_xor_sync(0xffffffffu, s2[j], o);
            }
        }
        const u32 lane = t & 31, warp = t >> 5;
        if (lane < cvs) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
                red[(warp * cvs + lane) * 2 * V + j] = s1[j];
                red[(warp * cvs + lane) * 2 * V + V + j] = s2[j];
            }
        }
        __syncthreads();
        if (ro == 0) {  // t < cvs: channel vector t, the warps' sums in warp order
#pragma unroll
            for (int j = 0; j < V; ++j) {
                float a1 = 0.0f, a2 = 0.0f;
                for (u32 w = 0; w < (u32)NT / 32; ++w) {
                    a1 += red[(w * cvs + t) * 2 * V + j];
                    a2 += red[(w * cvs + t) * 2 * V + V + j];
                }
                s1[j] = a1;
                s2[j] = a2;
            }
        }
        __syncthreads();  // `red` is reused by the caller's next unit
        return;
    }
    float* r1 = red;
    float* r2 = red + NT * V;
    if (active) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            r1[t * V + j] = s1[j];
            r2[t * V + j] = s2[j];
        }
    }
    __syncthreads();
    u32 h = 1;
    while (h < rb) h <<= 1;
    for (h >>= 1; h >= 1; h >>= 1) {
        if (active && ro < h && ro + h < rb) {
            const u32 o = t + h * cvs;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                s1[j] += r1[o * V + j];
                s2[j] += r2[o * V + j];
                r1[t * V + j] = s1[j];
                r2[t * V + j] = s2[j];
            }
        }
        __syncthreads();
    }
}

// --- finishing a channel ---------------------------------------------------------------------

// The statistics of channel ch from its combined state `t` of values shifted by `shift`
// (stats_mean_inv: the mean and the inverse std alone, the same arithmetic): the
// mean as hi + lo (hi = the f32 mean, lo the rest, from an f64 sum), the saved mean (hi), its lo
// part, the inverse std, the running statistics (PyTorch's momentum convention, the unbiased
// variance in running_var). One thread per channel; returns the inverse std.
// Everything in f64 from the exact count (M2 / (M - 1), not an f32 M / (M - 1) factor whose
// rounding alone moved running_var by up to 6e-8): once per channel, and each f32 rounding here
// would move every y of the channel (the accuracy test compares with cuDNN's).
__device__ __forceinline__ double stats_mean_inv(const Wf& t, float shift, float eps, double& mean,
                                                float& hi, float& lo) {
    mean = (double)shift + t.m;
    hi = (float)mean;
    lo = (float)(mean - (double)hi);
    const double var = t.m2 / t.n;  // biased (shift-invariant)
    return 1.0 / sqrt(var + (double)eps);
}

__device__ __forceinline__ double finish_stats(u64 ch, const Wf& t, float shift, float eps,
                                              double momentum, float* saved_mean,
                                              float* saved_mean_lo, float* saved_invstd,
                                              float* running_mean, float* running_var, float& hi,
                                              float& lo) {
    double mean;
    const double inv = stats_mean_inv(t, shift, eps, mean, hi, lo);
    // Training refuses M = 1 (src/batchnorm/ops.rs), so t.n > 1 here.
    const double unbiased = t.m2 / (t.n - 1.0);
    saved_mean[ch] = hi;
    saved_mean_lo[ch] = lo;
    saved_invstd[ch] = (float)inv;
    const double mo = momentum;
    running_mean[ch] = (float)((1.0 - mo) * (double)running_mean[ch] + mo * mean);
    running_var[ch] = (float)((1.0 - mo) * (double)running_var[ch] + mo * unbiased);
    return inv;
}

// A per-channel f32 sum, plus its low word where `lo` is non-null (hi + lo: ~48 bits).
__device__ __forceinline__ double sum_hl(const float* hi, const float* lo, u64 c) {
    return lo != nullptr ? (double)hi[c] + (double)lo[c] : (double)hi[c];
}

// A channel's combined state from its sum s and sum of squares q over `count` values (from f32
// sums computed elsewhere: ConvStats' epilogue or its reduction). E[y^2] - E[y]^2 from f32 sums
// may round a little below zero: clamped; it loses about E[y²]/var of f32's precision, which the
// sums' low words (sum_hl) give back.
__device__ __forceinline__ Wf wf_from_sums(double s, double q, double count) {
    Wf t;
    t.n = count;
    t.m = s / count;
    t.m2 = fmax(q - s * t.m, 0.0);
    return t;
}

// dbeta, dgamma and the coefficients of dx = A * (dy' - (B + ((x - hi) - lo) * D)):
// coef[0][ch] = hi, [1] lo (the mean), [2] A = gamma * inv_std, [3] B = Σdy'/M,
// [4] D = inv_std² Σdy'(x - mean)/M.
__device__ __forceinline__ void finish_bwd(u64 ch, u64 C, float s1, float s2, float inv_count,
                                           const float* saved_mean, const float* saved_mean_lo,
                                           const float* saved_invstd, const float* gamma,
                                           float* dgamma, float* dbeta, float* coef) {
    const float inv = saved_invstd[ch];
    const float dg = s2 * inv;
    dbeta[ch] = s1;
    dgamma[ch] = dg;
    coef[ch] = saved_mean[ch];
    coef[C + ch] = saved_mean_lo[ch];
    coef[2 * C + ch] = gamma[ch] * inv;
    coef[3 * C + ch] = s1 * inv_count;
    coef[4 * C + ch] = dg * inv * inv_count;
}

// --- arrival counting (integer atomics only) -------------------------------------------------

// The last of `expected` blocks to arrive on `counter` returns true (in every thread) and finds
// the others' partials visible; it resets the counter for the next launch. Thread 0 must have
// written this block's partial before the call.
__device__ __forceinline__ bool arrive_last(u32* counter, u32 expected) {
    __shared__ u32 last;
    if (threadIdx.x == 0) {
        __threadfence();
        const u32 prev = atomicAdd(counter, 1u);
        last = prev == expected - 1u;
        if (last) {
            __threadfence();
            atomicExch(counter, 0u);  // every block has arrived: nobody reads it again
        }
    }
    __syncthreads();
    return last != 0u;
}

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Grid-wide barrier of a cooperative launch (all blocks co-resident, which
// cuLaunchCooperativeKernel guarantees or refuses): bar[0] counts arrivals, monotonic within
// the launch; the k-th barrier waits for k * gridDim.x arrivals.
__device__ __forceinline__ void grid_sync(u32* bar, u32 target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(bar, 1u);
        while (ld_acquire(bar) < target) __nanosleep(40);
        __threadfence();
    }
    __syncthreads();
}

// After the last grid_sync: the last block to get here has seen every block leave the barrier,
// so it resets both counters (bar[0], bar[1]) to zero for the next launch.
__device__ __forceinline__ void grid_exit(u32* bar) {
    if (threadIdx.x == 0) {
        if (atomicAdd(bar + 1, 1u) == gridDim.x - 1u) {
            atomicExch(bar, 0u);
            atomicExch(bar + 1, 0u);
        }
    }
}
