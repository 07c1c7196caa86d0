// The per-channel statistics of the fused training block (src/block/conv_stats.rs,
// src/batchnorm/from_sums.rs), after kernels/common.cuh and kernels/batchnorm_common.cuh:
//
//  * channel_sums_<t>: per-channel sum and sum of squares of channels-last data (rows of C
//    contiguous elements): ConvStats' unfused route, the reference its graph route is checked
//    against. Block (slab, part) of blockDim (32, 8): lane x takes channel slab*32 + x (a warp
//    reads 32 consecutive elements of a row), y the rows part*rpp + y, + 8, ...; f64 per thread,
//    then a fixed tree over y and one f64 partial per (channel, part): no atomics, so the result
//    does not depend on timing.
//  * channel_sums_cf_<t>: the same of channels-first data (NCHW), block (channel, part).
//  * channel_sums_finish: one thread per channel adds its partials in order, rounds to f32.
//  * bn_finalize_from_sums: one thread per channel turns (sum, sqsum, count) into the saved mean
//    (hi + lo), the saved inverse std and the running statistics through batchnorm_common.cuh's
//    finish_stats, the very arithmetic of the own BatchNorm's statistics pass (f64, the unbiased
//    variance from the exact count).

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

extern "C" __global__ void __launch_bounds__(256) channel_sums_f32(SumsArgs a) { channel_sums<float>(a); }
extern "C" __global__ void __launch_bounds__(256) channel_sums_f16(SumsArgs a) { channel_sums<nnf_f16>(a); }
extern "C" __global__ void __launch_bounds__(256) channel_sums_bf16(SumsArgs a) { channel_sums<nnf_bf16>(a); }

extern "C" __global__ void channel_sums_finish(const double* __restrict__ part, u32 channels, u32 parts,
                                               float* __restrict__ sum, float* __restrict__ sqsum) {
    const u64 ch = global_thread();
    if (ch >= channels) return;
    const u64 cp = (u64)channels * parts;
    double s = 0.0, q = 0.0;
    for (u64 p = 0; p < parts; ++p) {
        s += part[ch * parts + p];
        q += part[cp + ch * parts + p];
    }
    sum[ch] = (float)s;
    sqsum[ch] = (float)q;
}

struct FromSumsArgs {
    const float* sum;
    const float* sqsum;
    float* saved_mean;
    float* saved_mean_lo;
    float* saved_invstd;
    float* running_mean;
    float* running_var;
    double count;  // values per channel, > 1
    u32 channels;
    float eps;
    float momentum;
};

extern "C" __global__ void bn_finalize_from_sums(FromSumsArgs a) {
    const u64 ch = global_thread();
    if (ch >= a.channels) return;
    const double s = (double)a.sum[ch], q = (double)a.sqsum[ch];
    Wf t;
    t.n = a.count;
    t.m = s / a.count;
    // E[y²] - E[y]² from f32 sums: rounding may leave it a little below zero.
    t.m2 = fmax(q - s * t.m, 0.0);
    float hi, lo;
    finish_stats(ch, t, 0.0f, a.eps, a.momentum, a.saved_mean, a.saved_mean_lo, a.saved_invstd,
                 a.running_mean, a.running_var, hi, lo);
}
