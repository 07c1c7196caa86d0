// The Direct batched multiply: the seed's engine for Winograd's batched GEMM when the shape
// fails its tensor-core rule. A plain shared-memory tiled GEMM without tensor cores, for any
// sizes, column-major as cuBLAS (src/gemm/problem.rs):
//   C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b],  b = 0 .. batch-1,
// op(A) m x k, op(B) k x n, element (i, j) of a matrix with leading dimension ld at i + j * ld,
// matrix b at b * stride. f32 accumulation; beta == 0 does not read C.
//
// Block tile 64 x 64 (DG_BM x DG_BN), k step DG_BK = 16, 256 threads; thread (tx, ty) = (tid %
// 16, tid / 16) owns the 4 x 4 outputs (tx + 16 a, ty + 16 b), so a warp's shared-memory reads
// are 16 consecutive floats of A's tile and a broadcast of B's. The next k step's tiles are
// loaded into registers while the current one is multiplied. Blocks: blockIdx.x = m-block +
// mblocks * n-block, blockIdx.y strides over the batch. Out-of-range elements load as 0 and are
// not stored.

#define DG_BM 64
#define DG_BN 64
#define DG_BK 16
#define DG_THREADS 256
#define DG_LOADS (DG_BM * DG_BK / DG_THREADS)  // elements of A (and of B) a thread loads per step

// Element q of this thread's share of A's tile: (row i, k-offset l). Consecutive threads take
// consecutive rows when A is stored m x k (no transpose), consecutive k when it is stored k x m.
template <bool TA>
__device__ __forceinline__ void a_slot(u32 tid, int q, u32& i, u32& l) {
    const u32 e = tid + DG_THREADS * q;
    if (TA) {
        i = e / DG_BK;
        l = e % DG_BK;
    } else {
        i = e % DG_BM;
        l = e / DG_BM;
    }
}

// Element q of this thread's share of B's tile: (k-offset l, column j), likewise coalesced.
template <bool TB>
__device__ __forceinline__ void b_slot(u32 tid, int q, u32& l, u32& j) {
    const u32 e = tid + DG_THREADS * q;
    if (TB) {
        j = e % DG_BN;
        l = e / DG_BN;
    } else {
        l = e % DG_BK;
        j = e / DG_BK;
    }
}

template <typename T, bool TA>
__device__ __forceinline__ void load_a(const T* a, float (&r)[DG_LOADS], u32 tid, u32 i0, u32 l0,
                                       u32 m, u32 k, u64 lda) {
#pragma unroll
    for (int q = 0; q < DG_LOADS; ++q) {
        u32 i, l;
        a_slot<TA>(tid, q, i, l);
        const u32 gi = i0 + i, gl = l0 + l;
        r[q] = 0.f;
        if (gi < m && gl < k) r[q] = to_float(TA ? a[gl + gi * lda] : a[gi + gl * lda]);
    }
}

template <typename T, bool TB>
__device__ __forceinline__ void load_b(const T* b, float (&r)[DG_LOADS], u32 tid, u32 j0, u32 l0,
                                       u32 n, u32 k, u64 ldb) {
#pragma unroll
    for (int q = 0; q < DG_LOADS; ++q) {
        u32 l, j;
        b_slot<TB>(tid, q, l, j);
        const u32 gj = j0 + j, gl = l0 + l;
        r[q] = 0.f;
        if (gj < n && gl < k) r[q] = to_float(TB ? b[gj + gl * ldb] : b[gl + gj * ldb]);
    }
}

template <typename T, bool TA, bool TB>
__device__ __forceinline__ void direct_gemm(const T* __restrict__ A, const T* __restrict__ B,
                                            T* __restrict__ C, u32 m, u32 n, u32 k, u64 lda,
                                            u64 ldb, u64 ldc, u64 sa, u64 sb, u64 sc, u32 batch,
                                            float alpha, float beta, u32 mblocks) {
    // +1 column: the transposed loaders write along k, which would otherwise hit one bank.
    __shared__ float As[DG_BK][DG_BM + 1];
    __shared__ float Bs[DG_BK][DG_BN + 1];
    const u32 tid = threadIdx.x;
    const u32 tx = tid % 16, ty = tid / 16;
    const u32 i0 = (blockIdx.x % mblocks) * DG_BM;
    const u32 j0 = (blockIdx.x / mblocks) * DG_BN;
    for (u32 bt = blockIdx.y; bt < batch; bt += gridDim.y) {  // uniform per block
        const T* a = A + bt * sa;
        const T* b = B + bt * sb;
        T* c = C + bt * sc;
        float acc[4][4];
#pragma unroll
        for (int p = 0; p < 4; ++p)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[p][q] = 0.f;
        float ra[DG_LOADS], rb[DG_LOADS];
        load_a<T, TA>(a, ra, tid, i0, 0, m, k, lda);
        load_b<T, TB>(b, rb, tid, j0, 0, n, k, ldb);
        for (u32 l0 = 0; l0 < k; l0 += DG_BK) {
#pragma unroll
            for (int q = 0; q < DG_LOADS; ++q) {
                u32 i, l, j;
                a_slot<TA>(tid, q, i, l);
                As[l][i] = ra[q];
                b_slot<TB>(tid, q, l, j);
                Bs[l][j] = rb[q];
            }
            __syncthreads();
            if (l0 + DG_BK < k) {
                load_a<T, TA>(a, ra, tid, i0, l0 + DG_BK, m, k, lda);
                load_b<T, TB>(b, rb, tid, j0, l0 + DG_BK, n, k, ldb);
            }
#pragma unroll
            for (int l = 0; l < DG_BK; ++l) {
                float av[4], bv[4];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    av[p] = As[l][tx + 16 * p];
                    bv[p] = Bs[l][ty + 16 * p];
                }
#pragma unroll
                for (int p = 0; p < 4; ++p)
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[p][q] = fmaf(av[p], bv[q], acc[p][q]);
            }
            __syncthreads();
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const u32 gj = j0 + ty + 16 * q;
            if (gj >= n) continue;
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const u32 gi = i0 + tx + 16 * p;
                if (gi >= m) continue;
                T* out = c + gi + gj * ldc;
                float val = alpha * acc[p][q];
                if (beta != 0.f) val = fmaf(beta, to_float(*out), val);
                *out = from_float<T>(val);
            }
        }
    }
}

// The launcher compiles this file once per type it uses, with NNF_DG_DT (1 f32, 2 f16, 3 bf16)
// defined; undefined (0) selects every type.
#ifndef NNF_DG_DT
#define NNF_DG_DT 0
#endif

#define NNF_DG_KERNEL(T, S, TA, TB, NAME)                                                         \
    extern "C" __global__ void __launch_bounds__(DG_THREADS) winograd_gemm_direct_##NAME##_##S(   \
        const T* a, const T* b, T* c, u32 m, u32 n, u32 k, u64 lda, u64 ldb, u64 ldc, u64 sa,     \
        u64 sb, u64 sc, u32 batch, float alpha, float beta, u32 mblocks) {                        \
        direct_gemm<T, TA, TB>(a, b, c, m, n, k, lda, ldb, ldc, sa, sb, sc, batch, alpha, beta,   \
                               mblocks);                                                          \
    }

#define NNF_DG_TYPE(T, S)                                                                         \
    NNF_DG_KERNEL(T, S, false, false, nn)                                                         \
    NNF_DG_KERNEL(T, S, false, true, nt)                                                          \
    NNF_DG_KERNEL(T, S, true, false, tn)                                                          \
    NNF_DG_KERNEL(T, S, true, true, tt)

#if NNF_DG_DT == 0 || NNF_DG_DT == 1
NNF_DG_TYPE(float, f32)
#endif
#if NNF_DG_DT == 0 || NNF_DG_DT == 2
NNF_DG_TYPE(nnf_f16, f16)
#endif
#if NNF_DG_DT == 0 || NNF_DG_DT == 3
NNF_DG_TYPE(nnf_bf16, bf16)
#endif
