// nnfuse's own tensor-core GEMM (src/gemm/own.rs): any configuration runs when asked for
// (`Algo::Own`); the GEMM search times configuration 2 (128 x 128) for products with a short K,
// such as a classifier's weight gradient (K = the batch), where it measured faster than cuBLAS.
//
// Column-major as cuBLAS: C[m x n] = alpha * op(A) * op(B) + beta * C, batch z at offsets z * s*.
// f16 / bf16 data, f32 accumulation (mma.sync m16n8k16), each output rounded once.
//
// A block computes a BM x BN tile of C with WM x WN x WK warps: warp (wm, wn, wk) owns the
// TM x TN sub-tile (TM = BM / WM, TN = BN / WN) and the k slice wk * 32 .. +32 of every stage of
// BK = 32 * WK values. With WK > 1 (meant for few output tiles and a long K) the warps of one
// sub-tile split K and add their sums in shared memory, warp 1 first, then 2, ...:
// a fixed order, so results do not depend on timing, and no second kernel or workspace.
//
// Operands are staged by cp.async in STAGES stages (all queued at the start), each in the layout
// it has in memory: op(A) K-contiguous (transa = T) as [BM][BK + 8], M-contiguous (N) as
// [BK][BM + 8]; op(B) K-contiguous (transb = N) as [BN][BK + 8], N-contiguous (T) as
// [BK][BN + 8]. ldmatrix reads
// fragments as stored or transposed; the +8 pads make every row stride an odd number of 16-byte
// chunks, so the 8 rows of one ldmatrix matrix fall in 8 different bank groups. Pieces of 8
// elements past m, n or k are zero-filled: the launcher requires m, n, k, the leading dimensions
// and the batch strides to be multiples of 8 and the pointers 16-byte aligned. With beta = 0 and
// C's columns 16-byte aligned the rounded tile leaves through shared memory in 16-byte stores.

#ifndef NNF_GT_DT
#define NNF_GT_DT 2
#endif
#ifndef NNF_GT_CFG
#define NNF_GT_CFG 0
#endif

struct GtArgs {
    const void* a;
    const void* b;
    void* c;
    u64 lda, ldb, ldc;
    u64 sa, sb, sc;  // batch strides (elements)
    u32 m, n, k;
    u32 tiles_m;     // ceil(m / BM); blockIdx.x = tile_n * tiles_m + tile_m
    float alpha, beta;
    u32 vec;         // beta == 0 and C, ldc and its batch stride 16-byte aligned: vector stores
    u32 pad;
};

template <int BM_, int BN_, int WM_, int WN_, int WK_, int STAGES_> struct GtCfg {
    static constexpr int BM = BM_, BN = BN_, WM = WM_, WN = WN_, WK = WK_, STAGES = STAGES_;
    static constexpr int THREADS = 32 * WM * WN * WK;
    static constexpr int BK = 32 * WK;
    static constexpr int TM = BM / WM, TN = BN / WN;
    static constexpr int MT = TM / 16, NT = TN / 8;
    static constexpr int ACC = MT * NT * 4;
    static_assert(TM % 16 == 0 && TN % 16 == 0, "warp tiles of whole m16 x n16 blocks");
};

// The shared-memory halves of one operand tile: `rows` stored rows of `cols` + 8.
__host__ __device__ constexpr int gt_tile(int rows, int cols) { return rows * (cols + 8); }

template <class C, bool AK> __host__ __device__ constexpr int gt_a_halves() {
    return AK ? gt_tile(C::BM, C::BK) : gt_tile(C::BK, C::BM);
}
template <class C, bool BKC> __host__ __device__ constexpr int gt_b_halves() {
    return BKC ? gt_tile(C::BN, C::BK) : gt_tile(C::BK, C::BN);
}

// Stages `rows` x `cols` elements (cols contiguous in memory, row stride ld) from (row0, col0)
// of `src` into `dst` (row stride cols + 8); pieces at rows >= rlim or cols >= clim are zeros.
template <int THREADS, int ROWS, int COLS>
__device__ __forceinline__ void gt_stage(unsigned short* dst, const unsigned short* src, u64 ld,
                                         u32 row0, u32 col0, u32 rlim, u32 clim, u32 tid) {
    constexpr int PIECES = ROWS * COLS / 8;
    constexpr int PER_ROW = COLS / 8;
#pragma unroll
    for (int e = tid; e < PIECES; e += THREADS) {
        const u32 r = e / PER_ROW, j = e % PER_ROW;
        const u32 row = row0 + r, col = col0 + 8 * j;
        const bool in = row < rlim && col < clim;
        const unsigned short* s = in ? src + (u64)row * ld + col : src;
        nnf_cp16(dst + r * (COLS + 8) + 8 * j, s, in ? 16u : 0u);
    }
}

template <class C, bool AK, bool BKC>
__device__ __forceinline__ void gt_load(const GtArgs& g, const unsigned short* a,
                                        const unsigned short* b, unsigned short* as,
                                        unsigned short* bs, u32 m0, u32 n0, u32 k0, u32 tid) {
    if (AK) {
        gt_stage<C::THREADS, C::BM, C::BK>(as, a, g.lda, m0, k0, g.m, g.k, tid);
    } else {
        gt_stage<C::THREADS, C::BK, C::BM>(as, a, g.lda, k0, m0, g.k, g.m, tid);
    }
    if (BKC) {
        gt_stage<C::THREADS, C::BN, C::BK>(bs, b, g.ldb, n0, k0, g.n, g.k, tid);
    } else {
        gt_stage<C::THREADS, C::BK, C::BN>(bs, b, g.ldb, k0, n0, g.k, g.n, tid);
    }
}

// One stage's 32-value k slice of this warp: two k16 steps over its MT x NT blocks.
template <class T, class C, bool AK, bool BKC>
__device__ __forceinline__ void gt_compute(const unsigned short* as, const unsigned short* bs,
                                           float (&acc)[C::MT][C::NT][4], u32 wm, u32 wn, u32 wk,
                                           u32 lane) {
    constexpr int LDA = AK ? C::BK + 8 : C::BM + 8;
    constexpr int LDB = BKC ? C::BK + 8 : C::BN + 8;
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
        const u32 kk = wk * 32 + ks * 16;
        u32 af[C::MT][4];
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) {
            const u32 rb = wm * C::TM + mt * 16;
            if (AK) {
                nnf_ldsm4(af[mt], nnf_smem(as + (rb + lane % 16) * LDA + kk + (lane / 16) * 8));
            } else {
                const u32 kr = kk + lane % 8 + (lane / 16) * 8;
                nnf_ldsm4_trans(af[mt], nnf_smem(as + kr * LDA + rb + ((lane / 8) % 2) * 8));
            }
        }
#pragma unroll
        for (int np = 0; np < C::NT / 2; ++np) {
            const u32 cb = wn * C::TN + np * 16;
            u32 bf[4];
            if (BKC) {
                const u32 nr = cb + lane % 8 + (lane / 16) * 8;
                nnf_ldsm4(bf, nnf_smem(bs + nr * LDB + kk + ((lane / 8) % 2) * 8));
            } else {
                const u32 kr = kk + lane % 8 + ((lane / 8) % 2) * 8;
                nnf_ldsm4_trans(bf, nnf_smem(bs + kr * LDB + cb + (lane / 16) * 8));
            }
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt) {
                nnf_mma<T>(acc[mt][2 * np], af[mt], bf[0], bf[1]);
                nnf_mma<T>(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
            }
        }
    }
}

template <class T, class C, bool AK, bool BKC>
__device__ __forceinline__ void gt_main(const GtArgs& g) {
    extern __shared__ __align__(16) unsigned short gt_sm[];
    constexpr int AH = gt_a_halves<C, AK>(), BH = gt_b_halves<C, BKC>();
    const u32 tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const u32 wm = warp % C::WM, wn = (warp / C::WM) % C::WN, wk = warp / (C::WM * C::WN);
    const u32 m0 = (blockIdx.x % g.tiles_m) * C::BM, n0 = (blockIdx.x / g.tiles_m) * C::BN;
    const u64 z = blockIdx.z;
    const unsigned short* a = (const unsigned short*)g.a + z * g.sa;
    const unsigned short* b = (const unsigned short*)g.b + z * g.sb;
    T* c = (T*)g.c + z * g.sc;

    float acc[C::MT][C::NT][4];
#pragma unroll
    for (int i = 0; i < C::MT; ++i)
#pragma unroll
        for (int j = 0; j < C::NT; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

    // Every stage's loads are queued before the first is waited for (the products this kernel
    // is for are latency-bound: K in one or two rounds of DRAM latency, not one per stage); a
    // slot is refilled after the stage in it was computed.
    const u32 steps = (g.k + C::BK - 1) / C::BK;
#pragma unroll
    for (int s = 0; s < C::STAGES; ++s) {
        if (s < (int)steps) {
            gt_load<C, AK, BKC>(g, a, b, gt_sm + s * (AH + BH), gt_sm + s * (AH + BH) + AH, m0,
                                n0, s * C::BK, tid);
        }
        nnf_commit();
    }
    for (u32 t = 0; t < steps; ++t) {
        nnf_wait<C::STAGES - 1>();
        __syncthreads();
        unsigned short* cur = gt_sm + (t % C::STAGES) * (AH + BH);
        gt_compute<T, C, AK, BKC>(cur, cur + AH, acc, wm, wn, wk, lane);
        const u32 next = t + C::STAGES;
        if (next < steps) {
            __syncthreads();
            gt_load<C, AK, BKC>(g, a, b, cur, cur + AH, m0, n0, next * C::BK, tid);
        }
        nnf_commit();
    }
    nnf_wait<0>();
    __syncthreads();

    // The k-slice warps' sums, added into warp wk = 0's in the order wk = 1, 2, ...
    const u32 sub = warp % (C::WM * C::WN);
    if (C::WK > 1) {
        float* red = (float*)gt_sm;
        if (wk > 0) {
            float* dst = red + ((wk - 1) * (C::WM * C::WN) + sub) * (C::ACC * 32);
#pragma unroll
            for (int i = 0; i < C::MT; ++i)
#pragma unroll
                for (int j = 0; j < C::NT; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) dst[((i * C::NT + j) * 4 + q) * 32 + lane] = acc[i][j][q];
        }
        __syncthreads();
        if (wk == 0) {
            for (int w = 1; w < C::WK; ++w) {
                const float* srcp = red + ((w - 1) * (C::WM * C::WN) + sub) * (C::ACC * 32);
#pragma unroll
                for (int i = 0; i < C::MT; ++i)
#pragma unroll
                    for (int j = 0; j < C::NT; ++j)
#pragma unroll
                        for (int q = 0; q < 4; ++q) acc[i][j][q] += srcp[((i * C::NT + j) * 4 + q) * 32 + lane];
            }
        }
        __syncthreads();
    }

    // Accumulator (i, j, q): row g + 8 * (q / 2), column 2 * (lane % 4) + q % 2 of block (i, j).
    if (g.vec) {
        // beta == 0, C's columns 16-byte aligned: the rounded tile goes through shared memory
        // (column-major, BM + 8 halves a column) and out in 16-byte pieces of 8 rows.
        constexpr int LDT = C::BM + 8;
        T* tile = (T*)gt_sm;
        if (wk == 0) {
#pragma unroll
            for (int i = 0; i < C::MT; ++i)
#pragma unroll
                for (int j = 0; j < C::NT; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const u32 r = wm * C::TM + i * 16 + lane / 4 + 8 * (q / 2);
                        const u32 cl = wn * C::TN + j * 8 + 2 * (lane % 4) + q % 2;
                        tile[cl * LDT + r] = from_float<T>(g.alpha * acc[i][j][q]);
                    }
        }
        __syncthreads();
        constexpr int PIECES = C::BM / 8 * C::BN;
        for (int e = tid; e < PIECES; e += C::THREADS) {
            const u32 cl = e / (C::BM / 8), r = 8 * (e % (C::BM / 8));
            if (m0 + r < g.m && n0 + cl < g.n) {
                *(uint4*)(c + (u64)(n0 + cl) * g.ldc + m0 + r) = *(const uint4*)(tile + cl * LDT + r);
            }
        }
        return;
    }
    if (wk > 0) return;
#pragma unroll
    for (int i = 0; i < C::MT; ++i) {
#pragma unroll
        for (int j = 0; j < C::NT; ++j) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const u32 row = m0 + wm * C::TM + i * 16 + lane / 4 + 8 * (q / 2);
                const u32 col = n0 + wn * C::TN + j * 8 + 2 * (lane % 4) + q % 2;
                if (row < g.m && col < g.n) {
                    const u64 at = (u64)col * g.ldc + row;
                    float v = g.alpha * acc[i][j][q];
                    if (g.beta != 0.f) v += g.beta * to_float(c[at]);
                    c[at] = from_float<T>(v);
                }
            }
        }
    }
}

// The configurations (NNF_GT_CFG): 0 = a 32 x 32 tile with 8 warps splitting K (BK = 256);
// 1 = 64 x 64, 2 x 2 x 2 warps (BK = 64); 2 = 128 x 128, 2 x 4 warps (BK = 32); 3 = 16 x 32 with
// 8 warps splitting K; 4 = 64 x 32, 2 x 1 x 4 warps (BK = 128). The launcher's
// table (src/gemm/own.rs) mirrors these numbers.
#if NNF_GT_CFG == 0
typedef GtCfg<32, 32, 1, 1, 8, 5> GtC;
#define GT_NAME(dt, l) gemm_tiles_##dt##_c0_##l
#elif NNF_GT_CFG == 1
typedef GtCfg<64, 64, 2, 2, 2, 4> GtC;
#define GT_NAME(dt, l) gemm_tiles_##dt##_c1_##l
#elif NNF_GT_CFG == 2
typedef GtCfg<128, 128, 2, 4, 1, 3> GtC;
#define GT_NAME(dt, l) gemm_tiles_##dt##_c2_##l
#elif NNF_GT_CFG == 3
typedef GtCfg<16, 32, 1, 1, 8, 7> GtC;
#define GT_NAME(dt, l) gemm_tiles_##dt##_c3_##l
#else
typedef GtCfg<64, 32, 2, 1, 4, 5> GtC;
#define GT_NAME(dt, l) gemm_tiles_##dt##_c4_##l
#endif

// Kernel names: gemm_tiles_<dt>_c<cfg>_<transa><transb> (n = not transposed, t = transposed);
// a compilation unit holds one (NNF_GT_L = 2 * transa + transb), so a first call compiles the
// one it runs.
#ifndef NNF_GT_L
#define NNF_GT_L 0
#endif
#if NNF_GT_DT == 2
typedef nnf_f16 GtT;
#define GT_DT f16
#else
typedef nnf_bf16 GtT;
#define GT_DT bf16
#endif
#define GT_CAT(a, b) a##b
#define GT_KERNEL(dt, l) GT_CAT(GT_NAME_, dt)(l)
#define GT_NAME_f16(l) GT_NAME(f16, l)
#define GT_NAME_bf16(l) GT_NAME(bf16, l)

#if NNF_GT_L == 0
extern "C" __global__ void __launch_bounds__(GtC::THREADS) GT_KERNEL(GT_DT, nn)(GtArgs g) {
    gt_main<GtT, GtC, false, true>(g);
}
#elif NNF_GT_L == 1
extern "C" __global__ void __launch_bounds__(GtC::THREADS) GT_KERNEL(GT_DT, nt)(GtArgs g) {
    gt_main<GtT, GtC, false, false>(g);
}
#elif NNF_GT_L == 2
extern "C" __global__ void __launch_bounds__(GtC::THREADS) GT_KERNEL(GT_DT, tn)(GtArgs g) {
    gt_main<GtT, GtC, true, true>(g);
}
#else
extern "C" __global__ void __launch_bounds__(GtC::THREADS) GT_KERNEL(GT_DT, tt)(GtArgs g) {
    gt_main<GtT, GtC, true, false>(g);
}
#endif
