// Tensor-core and asynchronous-copy helpers shared by nnfuse's mma.sync kernels (sm_80+):
// src/kernels.rs embeds this header after the prelude and before the files that use it (today
// kernels/conv_pointwise.cu, kernels/conv_stem.cu and kernels/bn_fold.cu; build.rs: SHARED_HEADERS).
//
//  * nnf_smem: a generic pointer's 32-bit shared-memory address;
//  * nnf_cp16 / nnf_cp4: cp.async of 16 / 4 bytes global -> shared, zero-filling when `bytes` is
//    0 (the source is then not read but must stay a valid address); nnf_commit / nnf_wait<N>;
//  * nnf_ldsm4 / nnf_ldsm4_trans: four 8x8 matrices of 16-bit values by ldmatrix (each lane gives
//    one row's address), as stored or transposed;
//  * nnf_mma<T>: mma.sync m16n8k16 with f16 or bf16 inputs and f32 accumulators (fragment
//    layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
#pragma once

__device__ __forceinline__ u32 nnf_smem(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void nnf_cp16(void* dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(nnf_smem(dst)), "l"(src),
                 "r"(bytes));
}
__device__ __forceinline__ void nnf_cp4(void* dst, const void* src, u32 bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(nnf_smem(dst)), "l"(src),
                 "r"(bytes));
}
__device__ __forceinline__ void nnf_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void nnf_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void nnf_ldsm4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void nnf_ldsm4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void nnf_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);
template <>
__device__ __forceinline__ void nnf_mma<nnf_f16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void nnf_mma<nnf_bf16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
