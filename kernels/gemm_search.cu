// Kernels of the GEMM search: deterministic pseudo-random inputs, the comparison of a candidate's
// result with the cuBLAS default's, and statistics of the default's result (sums in double, one
// atomic per block and sum).

// SplitMix64 of (index, seed) -> uniform in [-1, 1) with 24 random bits.
__device__ __forceinline__ float nnf_uniform(u64 i, u64 seed) {
    u64 z = i * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

template <typename T>
__device__ void uniform_impl(T* __restrict__ out, u64 n, u64 seed) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) out[i] = from_float<T>(nnf_uniform(i, seed));
}

__device__ __forceinline__ bool nnf_isnan(float x) { return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u; }
__device__ __forceinline__ bool nnf_isfinite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

// acc[0] += sum (got - want)^2, acc[1] += sum want^2 over finite pairs; acc[2] += number of
// positions where exactly one side, or both with different values, are not finite. Equal values
// (NaN with NaN included) count as equal. Block size must be 256.
template <typename T>
__device__ void diff_impl(const T* __restrict__ got, const T* __restrict__ want, u64 n, double* acc) {
    double num = 0.0, den = 0.0, bad = 0.0;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        float g = to_float(got[i]);
        float w = to_float(want[i]);
        if (g == w || (nnf_isnan(g) && nnf_isnan(w))) {
            if (nnf_isfinite(w)) den += (double)w * (double)w;
        } else if (!nnf_isfinite(g) || !nnf_isfinite(w)) {
            bad += 1.0;
        } else {
            double d = (double)g - (double)w;
            num += d * d;
            den += (double)w * (double)w;
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        num += __shfl_down_sync(0xffffffffu, num, off);
        den += __shfl_down_sync(0xffffffffu, den, off);
        bad += __shfl_down_sync(0xffffffffu, bad, off);
    }
    __shared__ double s[3][8];
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { s[0][warp] = num; s[1][warp] = den; s[2][warp] = bad; }
    __syncthreads();
    if (threadIdx.x == 0) {
        double a = 0.0, b = 0.0, c = 0.0;
        for (unsigned w = 0; w < blockDim.x / 32; ++w) { a += s[0][w]; b += s[1][w]; c += s[2][w]; }
        atomicAdd(&acc[0], a);
        atomicAdd(&acc[1], b);
        atomicAdd(&acc[2], c);
    }
}

// Statistics of a GEMM result R over C's matrix elements only (batch x n columns of m elements,
// leading dimension ld, batch stride `stride`; the gaps between them are never read), which the
// search reads before it trusts the caller's data for its comparisons:
//   acc[0] += sum R^2 over finite R,
//   acc[1] += number of non-finite R,
//   acc[2] += number of finite, nonzero R,
//   acc[3] += sum (R - beta * C0)^2 over finite R: the product's part alpha * op(A) op(B), with
//             C0 the old C at the same offsets (when c0 is null, C0 is taken as 0).
// Blocks take columns in turn (grid-stride over batch * n columns), threads the rows of a column.
// Block size must be 256.
template <typename T>
__device__ void stats_impl(const T* __restrict__ r, const T* __restrict__ c0, float beta, u64 m, u64 n,
                           u64 ld, u64 stride, u64 batch, double* acc) {
    double v[4] = {0.0, 0.0, 0.0, 0.0};
    const u64 cols = batch * n;
    for (u64 col = blockIdx.x; col < cols; col += gridDim.x) {
        const u64 b = col / n;
        const u64 j = col - b * n;
        const u64 base = b * stride + j * ld;
        for (u64 i = threadIdx.x; i < m; i += blockDim.x) {
            const float x = to_float(r[base + i]);
            if (!nnf_isfinite(x)) {
                v[1] += 1.0;
                continue;
            }
            const double dx = (double)x;
            v[0] += dx * dx;
            if (x != 0.0f) v[2] += 1.0;
            const double p = c0 ? dx - (double)beta * (double)to_float(c0[base + i]) : dx;
            v[3] += p * p;
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        for (int q = 0; q < 4; ++q) v[q] += __shfl_down_sync(0xffffffffu, v[q], off);
    }
    __shared__ double s[4][8];
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        for (int q = 0; q < 4; ++q) s[q][warp] = v[q];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int q = 0; q < 4; ++q) {
            double t = 0.0;
            for (unsigned w = 0; w < blockDim.x / 32; ++w) t += s[q][w];
            atomicAdd(&acc[q], t);
        }
    }
}

extern "C" __global__ void gemm_uniform_f32(float* out, u64 n, u64 seed) { uniform_impl(out, n, seed); }
extern "C" __global__ void gemm_uniform_f16(nnf_f16* out, u64 n, u64 seed) { uniform_impl(out, n, seed); }
extern "C" __global__ void gemm_uniform_bf16(nnf_bf16* out, u64 n, u64 seed) { uniform_impl(out, n, seed); }

extern "C" __global__ void gemm_diff_f32(const float* g, const float* w, u64 n, double* acc) { diff_impl(g, w, n, acc); }
extern "C" __global__ void gemm_diff_f16(const nnf_f16* g, const nnf_f16* w, u64 n, double* acc) { diff_impl(g, w, n, acc); }
extern "C" __global__ void gemm_diff_bf16(const nnf_bf16* g, const nnf_bf16* w, u64 n, double* acc) { diff_impl(g, w, n, acc); }

extern "C" __global__ void gemm_stats_f32(const float* r, const float* c0, float beta, u64 m, u64 n, u64 ld, u64 stride, u64 batch, double* acc) { stats_impl(r, c0, beta, m, n, ld, stride, batch, acc); }
extern "C" __global__ void gemm_stats_f16(const nnf_f16* r, const nnf_f16* c0, float beta, u64 m, u64 n, u64 ld, u64 stride, u64 batch, double* acc) { stats_impl(r, c0, beta, m, n, ld, stride, batch, acc); }
extern "C" __global__ void gemm_stats_bf16(const nnf_bf16* r, const nnf_bf16* c0, float beta, u64 m, u64 n, u64 ld, u64 stride, u64 batch, double* acc) { stats_impl(r, c0, beta, m, n, ld, stride, batch, acc); }
