// Kernels of the convolution dispatcher's numerical check (`auto`'s first call): compare a
// candidate's output (T) with the f32 reference, summarise the reference, widen a T result to
// f32. Sums in double, one atomic per block and sum. Block size must be 256.

__device__ __forceinline__ bool nnf_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

// Sums three doubles over the block (256 threads = 8 warps) and adds them to acc[0..3].
__device__ __forceinline__ void block_add3(double a, double b, double c, double* acc) {
    for (int off = 16; off > 0; off >>= 1) {
        a += __shfl_down_sync(0xffffffffu, a, off);
        b += __shfl_down_sync(0xffffffffu, b, off);
        c += __shfl_down_sync(0xffffffffu, c, off);
    }
    __shared__ double s[3][8];
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { s[0][warp] = a; s[1][warp] = b; s[2][warp] = c; }
    __syncthreads();
    if (threadIdx.x == 0) {
        double x = 0.0, y = 0.0, z = 0.0;
        for (unsigned w = 0; w < blockDim.x / 32; ++w) { x += s[0][w]; y += s[1][w]; z += s[2][w]; }
        atomicAdd(&acc[0], x);
        atomicAdd(&acc[1], y);
        atomicAdd(&acc[2], z);
    }
}

// acc[0] += sum (got - want)^2 and acc[1] += sum want^2 over positions where both are finite;
// acc[2] += number of positions where either is not finite (the reference is checked finite
// beforehand, so these are the candidate's NaN/Inf).
template <typename T>
__device__ void diff_impl(const T* __restrict__ got, const float* __restrict__ want, u64 n, double* acc) {
    double num = 0.0, den = 0.0, bad = 0.0;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const float g = to_float(got[i]);
        const float w = want[i];
        if (nnf_finite(g) && nnf_finite(w)) {
            const double d = (double)g - (double)w;
            num += d * d;
            den += (double)w * (double)w;
        } else {
            bad += 1.0;
        }
    }
    block_add3(num, den, bad, acc);
}

// acc[0] += non-finite elements, acc[1] += finite nonzero elements, acc[2] += sum r^2 (finite).
extern "C" __global__ void conv_check_stats(const float* __restrict__ r, u64 n, double* acc) {
    double nonfinite = 0.0, nonzero = 0.0, sq = 0.0;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const float x = r[i];
        if (!nnf_finite(x)) {
            nonfinite += 1.0;
        } else {
            // Integer test: +0 and -0 both count as zero.
            if ((__float_as_uint(x) & 0x7fffffffu) != 0u) nonzero += 1.0;
            sq += (double)x * (double)x;
        }
    }
    block_add3(nonfinite, nonzero, sq, acc);
}

template <typename T>
__device__ void widen_impl(const T* __restrict__ in, float* __restrict__ out, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) out[i] = to_float(in[i]);
}

extern "C" __global__ void conv_check_diff_f32(const float* g, const float* w, u64 n, double* acc) { diff_impl(g, w, n, acc); }
extern "C" __global__ void conv_check_diff_f16(const nnf_f16* g, const float* w, u64 n, double* acc) { diff_impl(g, w, n, acc); }
extern "C" __global__ void conv_check_diff_bf16(const nnf_bf16* g, const float* w, u64 n, double* acc) { diff_impl(g, w, n, acc); }

extern "C" __global__ void conv_check_widen_f32(const float* in, float* out, u64 n) { widen_impl(in, out, n); }
extern "C" __global__ void conv_check_widen_f16(const nnf_f16* in, float* out, u64 n) { widen_impl(in, out, n); }
extern "C" __global__ void conv_check_widen_bf16(const nnf_bf16* in, float* out, u64 n) { widen_impl(in, out, n); }
