// Elementwise helpers: fill (tests poison outputs with it), a scaled copy (the smoke test of
// the NVRTC path) and an in-place add. Grid-stride loops, any length.

template <typename T>
__device__ void fill_impl(T* __restrict__ out, T value, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) out[i] = value;
}

template <typename T>
__device__ void scale_impl(const T* __restrict__ x, T* __restrict__ y, float alpha, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) y[i] = from_float<T>(alpha * to_float(x[i]));
}

extern "C" __global__ void fill_f32(float* out, float v, u64 n) { fill_impl(out, v, n); }
extern "C" __global__ void fill_f16(nnf_f16* out, nnf_f16 v, u64 n) { fill_impl(out, v, n); }
extern "C" __global__ void fill_bf16(nnf_bf16* out, nnf_bf16 v, u64 n) { fill_impl(out, v, n); }
extern "C" __global__ void fill_u32(u32* out, u32 v, u64 n) { fill_impl(out, v, n); }

extern "C" __global__ void scale_f32(const float* x, float* y, float a, u64 n) { scale_impl(x, y, a, n); }
extern "C" __global__ void scale_f16(const nnf_f16* x, nnf_f16* y, float a, u64 n) { scale_impl(x, y, a, n); }
extern "C" __global__ void scale_bf16(const nnf_bf16* x, nnf_bf16* y, float a, u64 n) { scale_impl(x, y, a, n); }

// y += x (the sum in f32, rounded once to T): the demo's sum of the two gradient paths of a
// residual block's input. Each element is read and written by one thread.
template <typename T>
__device__ void add_assign_impl(T* __restrict__ y, const T* __restrict__ x, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) y[i] = from_float<T>(to_float(y[i]) + to_float(x[i]));
}

extern "C" __global__ void add_assign_f32(float* y, const float* x, u64 n) { add_assign_impl(y, x, n); }
extern "C" __global__ void add_assign_f16(nnf_f16* y, const nnf_f16* x, u64 n) { add_assign_impl(y, x, n); }
extern "C" __global__ void add_assign_bf16(nnf_bf16* y, const nnf_bf16* x, u64 n) { add_assign_impl(y, x, n); }

// inv_std[i] = 1 / sqrt(var[i] + eps), IEEE-rounded (no rsqrtf): the inverse standard
// deviation cuDNN's graph BatchNorm inference (NORM_FORWARD, phase INFERENCE) reads in place of
// the running variance. One value per channel.
extern "C" __global__ void inv_std_f32(const float* __restrict__ var, float* __restrict__ out, float eps, u64 n) {
    for (u64 i = global_thread(); i < n; i += grid_threads()) out[i] = 1.0f / sqrtf(var[i] + eps);
}
