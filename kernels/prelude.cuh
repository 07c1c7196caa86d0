// nnfuse kernel prelude, prepended to every kernels/*.cu file before NVRTC compiles it.
// NVRTC ships without cuda_fp16.h / cuda_bf16.h, so the two 16-bit float types are defined here
// as plain 16-bit storage with exact conversions to and from float (all arithmetic in float).
#pragma once

typedef unsigned long long u64;
typedef unsigned int u32;

struct __align__(2) nnf_f16 { unsigned short bits; };
struct __align__(2) nnf_bf16 { unsigned short bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(nnf_f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_float(nnf_bf16 x) {
    return __uint_as_float(((u32)x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ nnf_f16 from_float<nnf_f16>(float f) {
    nnf_f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
    return r;
}
template <> __device__ __forceinline__ nnf_bf16 from_float<nnf_bf16>(float f) {
    // Round to nearest even; NaN stays a (quiet) NaN with its sign.
    u32 u = __float_as_uint(f);
    nnf_bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        r.bits = (unsigned short)(u >> 16);
    }
    return r;
}

// Grid-stride index helpers (64-bit: tensors may exceed 2^31 elements).
__device__ __forceinline__ u64 global_thread() { return blockIdx.x * (u64)blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64 grid_threads() { return (u64)gridDim.x * blockDim.x; }
