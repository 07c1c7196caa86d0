// The per-channel statistics of the fused training block (src/block/conv_stats.rs,
// src/batchnorm/from_sums.rs), after kernels/common.cuh and kernels/batchnorm_common.cuh:
//
//  * channel_sums_<t>: per-channel sum and sum of squares of channels-last data (rows of C
//    contiguous elements): ConvStats' unfused route, the reference its graph route is checked
//    against. Block (slab, part) of blockDim (32, 8): lane x takes channel slab*32 + x (a warp
//    reads 32 consecutive elements of a row), y the rows part*rpp + y, + 8, ...; f64 per thread,
//    then a fixed tree over y and one f64 partial per (channel, part): no atomics, so the result
//    does not depend on timing.
//  * channel_sums_vec_<t>: the same with 16-byte vectors (C a multiple of the vector, y 16-byte
//    aligned): thread t of a 256-thread block is (ro, cvl) = (t / cvs, t % cvs), cvs = min(C/V,
//    256) vectors of a row side by side and rb = 256 / cvs rows at a time; RED_UNROLL rows in
//    flight per thread, f32 (16-bit data) or f64 (f32 data) per thread, then a fixed f64 sum
//    over ro (by shuffles within a warp and the warps in order when a warp holds whole rows).
//    The scalar kernel read the
//    demo's 51 MB output of a 1x1 64->256 convolution at about 1.1 TB/s (2-byte loads).
//  * channel_sums_cf_<t>: the same of channels-first data (NCHW), block (channel, part).
//  * channel_sums_finish: a warp per channel adds its partials in a fixed order, rounds to f32
//    (and, where asked, writes the low words the rounding dropped).
//  * bn_finalize_from_sums: one thread per channel turns (sum, sqsum [+ low words], count) into the saved mean
//    (hi + lo), the saved inverse std and the running statistics through batchnorm_common.cuh's
//    finish_stats, the very arithmetic of the own BatchNorm's statistics pass (f64, the unbiased
//    variance from the exact count).
//  * bn_finalize_affine_<t>: the same finalize (the same code), plus the BatchNorm as an affine
//    map of its input in T, eq_scale = gamma * inv_std and eq_bias = beta - mean * eq_scale (f64,
//    rounded once), for the conv chain (src/block/chain_kernel.rs): the next convolution's cuDNN
//    graph applies relu(z * eq_scale + eq_bias) to its input, so z's normalized copy is never
//    written.
//  * bn_apply_eq_<t>: dz = a * dy + b * x + c per channel (f32, fmaf(a, dy, fmaf(b, x, c)),
//    rounded to T once), the chain's BatchNorm backward from the coefficients its cuDNN graph
//    outputs. Bandwidth-bound: 16-byte vectors where the host found every data pointer aligned
//    and C a multiple of the vector (ApplyEqArgs.vec), one element per step otherwise.

struct SumsArgs {
    const void* y;
    double* part;  // [2][C][P]: sum, sum of squares
    u64 rows;      // channels-last: rows; channels-first: values per channel (n * hw)
    u64 rpp;       // rows (channels-first: values) per part
    u64 hw;        // channels-first: elements per run; 0: channels-last
    u32 channels;
    u32 parts;
};

template <typename T> __device__ __forceinline__ void channel_sums(const SumsArgs& a) {
    __shared__ double s1[8][33];
    __shared__ double s2[8][33];
    const u32 tx = threadIdx.x, ty = threadIdx.y;
    const u64 ch = (u64)blockIdx.x * 32 + tx;
    const u64 p = blockIdx.y;
    const u64 r0 = p * a.rpp;
    const u64 r1 = min(r0 + a.rpp, a.rows);
    double sum = 0.0, sq = 0.0;
    if (ch < a.channels) {
        const T* y = (const T*)a.y;
        for (u64 r = r0 + ty; r < r1; r += 8) {
            const double v = (double)to_float(y[r * a.channels + ch]);
            sum += v;
            sq += v * v;
        }
    }
    s1[ty][tx] = sum;
    s2[ty][tx] = sq;
    __syncthreads();
    if (ty == 0 && ch < a.channels) {
#pragma unroll
        for (int k = 1; k < 8; ++k) {
            sum += s1[k][tx];
            sq += s2[k][tx];
        }
        const u64 cp = (u64)a.channels * a.parts;
        a.part[ch * a.parts + p] = sum;
        a.part[cp + ch * a.parts + p] = sq;
    }
}

// A thread's own sums over its rows: f32 for 16-bit data (a value has at most 11 significant bits, its
// square 22, and a thread adds a few dozen rows: f32's 24 bits keep them to about 1e-6, far
// inside the 16-bit tolerance, and spare the f64 pipe), f64 for f32 data (the statistics'
// 1e-6 bound). The block's and the finish's sums are f64 for every type.
template <typename T> struct VecAcc { using type = float; };
template <> struct VecAcc<float> { using type = double; };

template <typename T> __device__ __forceinline__ void channel_sums_vec(const SumsArgs& a) {
    using Acc = typename VecAcc<T>::type;
    constexpr int V = 16 / (int)sizeof(T);
    constexpr int U = RED_UNROLL;
    __shared__ double s1[256 * V];
    __shared__ double s2[256 * V];
    const u64 t = threadIdx.y * 32 + threadIdx.x;
    const u64 C = a.channels, cv = C / V;
    const u64 cvs = cv < 256 ? cv : 256;
    const u64 rb = 256 / cvs;
    const u64 ro = t / cvs, cvl = t - ro * cvs;
    const u64 vec = (u64)blockIdx.x * cvs + cvl;
    const bool active = ro < rb && vec < cv;
    const u64 p = blockIdx.y;
    const u64 r0 = p * a.rpp;
    const u64 r1 = min(r0 + a.rpp, a.rows);
    Acc sum[V], sq[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        sum[j] = 0;
        sq[j] = 0;
    }
    if (active) {
        const T* y = (const T*)a.y + vec * V;
        u64 r = r0 + ro;
        for (; r + (U - 1) * rb < r1; r += U * rb) {
            u32 w[U][4];
#pragma unroll
            for (int u = 0; u < U; ++u) load_raw<T, V>(y + (r + u * rb) * C, w[u]);
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const Acc v = (Acc)bits_float<T>(elem_bits<T>(w[u], j));
                    sum[j] += v;
                    sq[j] = fma(v, v, sq[j]);
                }
        }
        for (; r < r1; r += rb) {
            u32 w[4];
            load_raw<T, V>(y + r * C, w);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const Acc v = (Acc)bits_float<T>(elem_bits<T>(w, j));
                sum[j] += v;
                sq[j] = fma(v, v, sq[j]);
            }
        }
    }
    // The block's sums of vector `vec` into thread ro == 0, in a fixed order.
    double bs[V], bq[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        bs[j] = 0.0;
        bq[j] = 0.0;
    }
    if (cvs <= 32 && (cvs & (cvs - 1)) == 0) {
        // A warp holds whole rows: lanes of one vector add by shuffles (f64), then thread ro == 0
        // adds the 8 warps' sums in warp order. Adding rb rows one thread at a time made the
        // 64-channel sums run at 1.3 TB/s (9.7 us for 12.8 MB on the H100).
        const u32 lane = (u32)(t & 31), warp = (u32)(t >> 5);
        double ds[V], dq[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
            ds[j] = (double)sum[j];
            dq[j] = (double)sq[j];
        }
        for (u32 o = (u32)cvs; o < 32; o <<= 1)
#pragma unroll
            for (int j = 0; j < V; ++j) {
                ds[j] += __shfl_xor_sync(0xffffffffu, ds[j], o);
                dq[j] += __shfl_xor_sync(0xffffffffu, dq[j], o);
            }
        if (lane < cvs) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
                s1[(warp * cvs + lane) * V + j] = ds[j];
                s2[(warp * cvs + lane) * V + j] = dq[j];
            }
        }
        __syncthreads();
        if (active && ro == 0)
            for (u32 w = 0; w < 8; ++w)
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    bs[j] += s1[(w * cvs + t) * V + j];
                    bq[j] += s2[(w * cvs + t) * V + j];
                }
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            s1[t * V + j] = (double)sum[j];
            s2[t * V + j] = (double)sq[j];
        }
        __syncthreads();
        if (active && ro == 0)
            for (u64 k = 0; k < rb; ++k)
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    bs[j] += s1[(t + k * cvs) * V + j];
                    bq[j] += s2[(t + k * cvs) * V + j];
                }
    }
    if (active && ro == 0) {
        const u64 cp = C * a.parts;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const u64 ch = vec * V + j;
            a.part[ch * a.parts + p] = bs[j];
            a.part[cp + ch * a.parts + p] = bq[j];
        }
    }
}

// Channels-first (NCHW): block (channel, part) of 256 threads over the part's values of the
// channel (n runs of hw: value e is element (e / hw * C + ch) * hw + e % hw).
template <typename T> __device__ __forceinline__ void channel_sums_cf(const SumsArgs& a) {
    __shared__ double s1[256];
    __shared__ double s2[256];
    const u32 t = threadIdx.y * 32 + threadIdx.x;
    const u64 ch = blockIdx.x, p = blockIdx.y;
    const u64 e0 = p * a.rpp;
    const u64 e1 = min(e0 + a.rpp, a.rows);
    const T* y = (const T*)a.y;
    double sum = 0.0, sq = 0.0;
    for (u64 e = e0 + t; e < e1; e += 256) {
        const u64 o = e / a.hw;
        const double v = (double)to_float(y[(o * a.channels + ch) * a.hw + (e - o * a.hw)]);
        sum += v;
        sq += v * v;
    }
    s1[t] = sum;
    s2[t] = sq;
    __syncthreads();
    for (u32 k = 128; k > 0; k >>= 1) {
        if (t < k) {
            s1[t] += s1[t + k];
            s2[t] += s2[t + k];
        }
        __syncthreads();
    }
    if (t == 0) {
        const u64 cp = (u64)a.channels * a.parts;
        a.part[ch * a.parts + p] = s1[0];
        a.part[cp + ch * a.parts + p] = s2[0];
    }
}

extern "C" __global__ void __launch_bounds__(256) channel_sums_cf_f32(SumsArgs a) { channel_sums_cf<float>(a); }
extern "C" __global__ void __launch_bounds__(256) channel_sums_cf_f16(SumsArgs a) { channel_sums_cf<nnf_f16>(a); }
extern "C" __global__ void __launch_bounds__(256) channel_sums_cf_bf16(SumsArgs a) { channel_sums_cf<nnf_bf16>(a); }

extern "C" __global__ void __launch_bounds__(256) channel_sums_vec_f32(SumsArgs a) { channel_sums_vec<float>(a); }
extern "C" __global__ void __launch_bounds__(256) channel_sums_vec_f16(SumsArgs a) { channel_sums_vec<nnf_f16>(a); }
extern "C" __global__ void __launch_bounds__(256) channel_sums_vec_bf16(SumsArgs a) { channel_sums_vec<nnf_bf16>(a); }

extern "C" __global__ void __launch_bounds__(256) channel_sums_f32(SumsArgs a) { channel_sums<float>(a); }
extern "C" __global__ void __launch_bounds__(256) channel_sums_f16(SumsArgs a) { channel_sums<nnf_f16>(a); }
extern "C" __global__ void __launch_bounds__(256) channel_sums_bf16(SumsArgs a) { channel_sums<nnf_bf16>(a); }

// One warp per channel: lane l adds partials l, l + 32, ... in order, then a fixed butterfly;
// lane 0 rounds to f32. The same order on every run (no atomics).
// With sum_lo and sqsum_lo non-null, also the low words (the f64 sum minus its f32 rounding, in
// f32): hi + lo keeps about 48 bits, enough for E[x²] − E[x]² of f32 data whose mean is large
// against its spread (the fused unit's 1e-6 statistics).
extern "C" __global__ void channel_sums_finish(const double* __restrict__ part, u32 channels, u32 parts,
                                               float* __restrict__ sum, float* __restrict__ sqsum,
                                               float* __restrict__ sum_lo,
                                               float* __restrict__ sqsum_lo) {
    const u64 ch = global_thread() >> 5;
    const u32 lane = threadIdx.x & 31u;
    if (ch >= channels) return;  // the whole warp: its lanes share the channel
    const u64 cp = (u64)channels * parts;
    double s = 0.0, q = 0.0;
    for (u64 p = lane; p < parts; p += 32) {
        s += part[ch * parts + p];
        q += part[cp + ch * parts + p];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, o);
        q += __shfl_xor_sync(0xffffffffu, q, o);
    }
    if (lane == 0) {
        const float sh = (float)s, qh = (float)q;
        sum[ch] = sh;
        sqsum[ch] = qh;
        if (sum_lo != nullptr) {
            sum_lo[ch] = (float)(s - (double)sh);
            sqsum_lo[ch] = (float)(q - (double)qh);
        }
    }
}

struct FromSumsArgs {
    const float* sum;
    const float* sqsum;
    const float* sum_lo;    // null, or the sums' low words (channel_sums_finish)
    const float* sqsum_lo;  // null with sum_lo
    float* saved_mean;
    float* saved_mean_lo;
    float* saved_invstd;
    float* running_mean;
    float* running_var;
    double count;  // values per channel, > 1
    u32 channels;
    float eps;
    double momentum;  // f64, as StatsArgs'
};

// Channel ch's finalize from its sums, shared by both finalize kernels (A: FromSumsArgs or
// FinalizeAffineArgs, whose common fields have the same names). Returns the inverse std and sets
// `mean` to the f64 mean finish_stats saved (its shift is 0, so its mean is t.m).
// `slo`, `qlo`: the sums' low words, or null.
template <typename A>
__device__ __forceinline__ double finalize_from_sums(u64 ch, const A& a, const float* slo,
                                                     const float* qlo, double& mean) {
    const Wf t = wf_from_sums(sum_hl(a.sum, slo, ch), sum_hl(a.sqsum, qlo, ch), a.count);
    float hi, lo;
    mean = t.m;
    return finish_stats(ch, t, 0.0f, a.eps, a.momentum, a.saved_mean, a.saved_mean_lo,
                        a.saved_invstd, a.running_mean, a.running_var, hi, lo);
}

extern "C" __global__ void bn_finalize_from_sums(FromSumsArgs a) {
    const u64 ch = global_thread();
    if (ch >= a.channels) return;
    double mean;
    finalize_from_sums(ch, a, a.sum_lo, a.sqsum_lo, mean);
}

// --- the conv chain (src/block/chain_kernel.rs) ----------------------------------------------

struct FinalizeAffineArgs {
    const float* sum;
    const float* sqsum;
    const float* gamma;
    const float* beta;
    float* saved_mean;
    float* saved_mean_lo;  // required: finish_stats writes it
    float* saved_invstd;
    float* running_mean;  // updated in place
    float* running_var;   // updated in place
    void* eq_scale;       // T
    void* eq_bias;        // T
    double count;         // values per channel, > 1
    u32 channels;
    float eps;
    double momentum;      // f64, as StatsArgs'
};

// d rounded to T once (nearest even). f64 -> f32 -> 16 bits would round twice; rounding to f32
// toward zero and setting the last bit when inexact (round to odd) keeps the information the
// second rounding needs, as f32 has at least 2 more significand bits than f16 or bf16.
template <typename T> __device__ __forceinline__ T round_once(double d) {
    if constexpr (sizeof(T) == 4) {
        return (float)d;
    } else {
        float f = __double2float_rz(d);
        if ((double)f != d) f = __uint_as_float(__float_as_uint(f) | 1u);
        return from_float<T>(f);
    }
}

template <typename T> __device__ __forceinline__ void finalize_affine(const FinalizeAffineArgs& a) {
    const u64 ch = global_thread();
    if (ch >= a.channels) return;
    double mean;
    const double inv = finalize_from_sums(ch, a, nullptr, nullptr, mean);
    const double scale = (double)a.gamma[ch] * inv;
    ((T*)a.eq_scale)[ch] = round_once<T>(scale);
    ((T*)a.eq_bias)[ch] = round_once<T>((double)a.beta[ch] - mean * scale);
}

extern "C" __global__ void bn_finalize_affine_f32(FinalizeAffineArgs a) { finalize_affine<float>(a); }
extern "C" __global__ void bn_finalize_affine_f16(FinalizeAffineArgs a) { finalize_affine<nnf_f16>(a); }
extern "C" __global__ void bn_finalize_affine_bf16(FinalizeAffineArgs a) { finalize_affine<nnf_bf16>(a); }

struct ApplyEqArgs {
    const void* dy;  // T
    const void* x;   // T
    const float* a;
    const float* b;
    const float* c;
    void* dz;  // T, distinct from dy and x
    u64 len;   // elements, a multiple of channels
    u32 channels;
    u32 vec;  // 1: dy, x, dz 16-byte aligned and channels a multiple of 16 / sizeof(T)
};

// V elements per step (V = 16 / sizeof(T) or 1), consecutive channels ch .. ch + V - 1 (C is a
// multiple of V). A thread's channel moves by the same step (stride * V) % C every iteration, so
// it is updated by an add and a compare instead of a 64-bit modulo; where the host made that
// step 0 (the grid's threads a multiple of C / V), the per-channel values stay in registers.
template <typename T, int V> __device__ __forceinline__ void apply_eq(const ApplyEqArgs& p) {
    const u64 nv = p.len / V;
    const u64 stride = grid_threads();
    const u64 C = p.channels;
    u64 v = global_thread();
    u64 ch = (v * V) % C;
    const u64 step = (stride * V) % C;
    const T* dy = (const T*)p.dy;
    const T* x = (const T*)p.x;
    T* dz = (T*)p.dz;
    float ca[V], cb[V], cc[V];
    bool loaded = false;
    for (; v < nv; v += stride) {
        if (!loaded || step != 0) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
                ca[j] = p.a[ch + j];
                cb[j] = p.b[ch + j];
                cc[j] = p.c[ch + j];
            }
            loaded = true;
        }
        u32 wd[4], wx[4], wz[4] = {0u, 0u, 0u, 0u};
        load_raw<T, V>(dy + v * V, wd);
        load_raw<T, V>(x + v * V, wx);
        float r[V];
#pragma unroll
        for (int j = 0; j < V; ++j)
            r[j] = fmaf(ca[j], bits_float<T>(elem_bits<T>(wd, j)),
                        fmaf(cb[j], bits_float<T>(elem_bits<T>(wx, j)), cc[j]));
        if constexpr (sizeof(T) == 2 && V >= 2) {
#pragma unroll
            for (int j = 0; j < V; j += 2) wz[j >> 1] = out_bits2<T>(r[j], r[j + 1]);
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) set_elem_bits<T>(wz, j, out_bits<T>(r[j]));
        }
        store_raw<T, V>(dz + v * V, wz);
        ch += step;
        if (ch >= C) ch -= C;
    }
}

extern "C" __global__ void __launch_bounds__(256) bn_apply_eq_f32(ApplyEqArgs a) {
    if (a.vec) apply_eq<float, 4>(a); else apply_eq<float, 1>(a);
}
extern "C" __global__ void __launch_bounds__(256) bn_apply_eq_f16(ApplyEqArgs a) {
    if (a.vec) apply_eq<nnf_f16, 8>(a); else apply_eq<nnf_f16, 1>(a);
}
extern "C" __global__ void __launch_bounds__(256) bn_apply_eq_bf16(ApplyEqArgs a) {
    if (a.vec) apply_eq<nnf_bf16, 8>(a); else apply_eq<nnf_bf16, 1>(a);
}
