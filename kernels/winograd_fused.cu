// Fused Winograd F(m x m, 3 x 3) forward convolution, NHWC, stride 1, dilation 1, for 16-bit data
// (f16, bf16) with f32 accumulation, m = 2 or 4, on tensor cores through mma.sync (sm_80+). One
// kernel does the input transform, the alpha² per-position products and the output transform, so
// the transformed input U and the product M never leave the SM: the path reads x and the
// transformed filter V and writes y, nothing else.
//
//   y[b][oy][ox][k] = (Aᵀ M A)[oy % m][ox % m],  M[pos][t][k] = sum_c U[pos][t][c] V[pos][c][k],
//   U[pos][t][c] = (Bᵀ d B)[pos] of the alpha x alpha input tile d of tile t (zero padding fused),
//   V[pos][c][k] = (G g Gᵀ)[pos] from the filter transform of kernels/winograd.cu (unchanged:
//   prepared filters serve every engine). pos = i * alpha + j; t = (b * tiles_h + th) * tiles_w + tw.
//   Matrices and layouts: src/reference/winograd.rs.
//
// Block: 256 threads = 8 warps as 2 (tiles) x 4 (output channels); the block owns WF_TT = 32
// tiles and TK output channels (32 for F(4x4), 64 for F(2x2)); each warp owns 16 tiles x 8*NF
// output channels for every transform position: its accumulators are P x NF m16n8 fragments
// (F(4x4): 36 x 1 x 4 = 144 floats a thread; F(2x2): 16 x 2 x 4 = 128), alive across the whole
// loop over the input channels, which runs in chunks of 16 (the MMA's k):
//
//   wait for chunk j's raw input Xs and V stage Vs[j % 2] (cp.async), barrier
//   transform Xs -> U (rounded to T once, as the unfused path rounds U), barrier
//   start cp.async of chunk j+1: raw input into Xs, V into Vs[(j+1) % 2]
//   per position: one m16n8k16 MMA per fragment, accumulating M in f32 registers
//
// and at the end each thread holds, for each of its fragment elements, the product M of all
// positions of one (tile, output channel): the output transform Aᵀ M A runs in registers and
// the thread writes the tile's m x m outputs (two adjacent channels per 4-byte store). M is never
// rounded to T (the unfused path rounds it): the fused error is at most the unfused one.
//
// Requirements (checked by the launcher, src/conv/winograd/fused.rs): c % 8 == 0 and k % 8 ==
// 0 (16-byte cp.async pieces are wholly inside or outside the channel range, zero-filled
// outside), x and v 16-byte aligned, y 4-byte aligned, tiles < 2^31, sm_80+, WF smem bytes of
// dynamic shared memory opted in.
//
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 fragment layouts (PTX ISA,
// "Matrix Fragments for mma.m16n8k16 with floating point type"), with g = laneid >> 2 and
// t = laneid % 4; element order within a .b32 register is low half first:
//   A (16 x 16, row = M index = tile, col = K index = channel), 4 registers:
//     a[0] = (A[g][2t],     A[g][2t+1])       a[1] = (A[g+8][2t],     A[g+8][2t+1])
//     a[2] = (A[g][2t+8],   A[g][2t+9])       a[3] = (A[g+8][2t+8],   A[g+8][2t+9])
//   B (16 x 8, row = K index = channel, col = N index = output channel), 2 registers:
//     b[0] = (B[2t][g],     B[2t+1][g])       b[1] = (B[2t+8][g],     B[2t+9][g])
//   C/D (16 x 8, f32), 4 registers:
//     c[0] = C[g][2t]   c[1] = C[g][2t+1]     c[2] = C[g+8][2t]   c[3] = C[g+8][2t+1]
//
// Shared memory (dynamic, halves of T):
//   Xs  [WF_TT tiles][XROW]: the raw alpha x alpha x 16-channel input of each tile, element
//       (tile, tap, c) at tile * XROW + tap * 16 + c; XROW = P * 16 + 8 (the 16-byte pad puts the
//       four tiles a warp reads on different banks).
//   Us  [P][2 (c / 8)][WF_TT][8]: element (pos, tile, c) at ((pos * 2 + c / 8) * WF_TT + tile) * 8
//       + c % 8; every A-fragment register is one 4-byte load, conflict-free across the warp.
//   Vs  2 x [P][16 channels][VROW]: element (pos, c, n) at (pos * 16 + c) * VROW + n, n the output
//       channel within the block; VROW = TK + 8: rows stay 16-byte aligned for cp.async and
//       ldmatrix, and the 8 rows of one ldmatrix phase fall on 8 disjoint groups of 4 banks.
// Static: the block's tile table (image offset, tile origin), 16 bytes a tile.
//
// Compiled per (type, tile) unit: NNF_WF_DT (2 f16, 3 bf16) and NNF_WF_TILE (2, 4; 1 selects the
// probe); undefined (0) compiles everything (CI). Plus a one-warp probe of the fragment layouts
// (winograd_fused_mma_probe_<dtype>) for the GPU unit test that pins the layouts above.

#define WF_THREADS 256
#define WF_WARPS_T 2
#define WF_WARPS_K 4
#define WF_TT 32
#define WF_KC 16

template <int M> struct WfCfg {
    static constexpr int A = M + 2;
    static constexpr int P = A * A;
    static constexpr int NF = M == 4 ? 1 : 2;
    static constexpr int TK = 8 * NF * WF_WARPS_K;
    static constexpr int XROW = P * WF_KC + 8;
    static constexpr int VROW = TK + 8;
    static constexpr int XS = WF_TT * XROW;
    static constexpr int US = P * 2 * WF_TT * 8;
    static constexpr int VS = P * WF_KC * VROW;
    static constexpr int SMEM_BYTES = (XS + US + 2 * VS) * 2;
    static constexpr int X_PIECES = WF_TT * P * 2;
    static constexpr int V_PIECES = P * WF_KC * (TK / 8);
    static_assert(X_PIECES % WF_THREADS == 0, "x pieces per thread");
    static_assert(V_PIECES % WF_THREADS == 0, "v pieces per thread");
    static_assert((XS * 2) % 16 == 0 && (US * 2) % 16 == 0 && (VS * 2) % 16 == 0, "16-byte regions");
    static_assert((XROW * 2) % 16 == 0 && (VROW * 2) % 16 == 0, "16-byte rows");
};

// ---- PTX wrappers -----------------------------------------------------------------------------

__device__ __forceinline__ u32 wf_smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, asynchronous; src_bytes 0 zero-fills without reading. CA: cached in
// L1 too (neighbouring tiles share input rows); CG: L2 only.
__device__ __forceinline__ void wf_cp16_ca(void* smem, const void* gmem, u32 src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(wf_smem_addr(smem)), "l"(gmem),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void wf_cp16_cg(void* smem, const void* gmem, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(wf_smem_addr(smem)), "l"(gmem),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void wf_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void wf_cp_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// D = A B + D on one m16n8k16 fragment (layouts in the header).
template <typename T> __device__ __forceinline__ void wf_mma(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]);
template <> __device__ __forceinline__ void wf_mma<nnf_f16>(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void wf_mma<nnf_bf16>(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ u32 wf_pack(unsigned short lo, unsigned short hi) { return (u32)lo | ((u32)hi << 16); }


// A fragment of rows r0..r0+15 (r0 = the warp's first row + g is passed as row) from a [2][tt][8]
// layout (element (row, col) at ((col / 8) * tt + row) * 8 + col % 8), base = that layout's start.
template <typename T>
__device__ __forceinline__ void wf_frag_a(const T* base, int tt, int row, int t, u32 (&a)[4]) {
    const u32* w = reinterpret_cast<const u32*>(base);
    a[0] = w[row * 4 + t];             // (row g,   cols 2t, 2t+1)
    a[1] = w[(row + 8) * 4 + t];       // (row g+8, cols 2t, 2t+1)
    a[2] = w[(tt + row) * 4 + t];      // (row g,   cols 2t+8, 2t+9)
    a[3] = w[(tt + row + 8) * 4 + t];  // (row g+8, cols 2t+8, 2t+9)
}

// B fragment of the 8 columns n0 .. n0+7 from a [16][vrow] layout (element (kk, n) at
// kk * vrow + n; rows 16-byte aligned), base = that layout's start, by ldmatrix.x2.trans
// (PTX ISA, "ldmatrix"): lanes 0-7 give the addresses of the rows of matrix 0 (rows 0-7 of B,
// -> b[0]) and lanes 8-15 those of matrix 1 (rows 8-15, -> b[1]); with .trans, lane l receives
// of each 8x8 matrix the elements (row 2 (l % 4), column l / 4) and (row 2 (l % 4) + 1, column
// l / 4), low half first: b[0] = (B[2t][g], B[2t+1][g]), b[1] = (B[2t+8][g], B[2t+9][g]), the
// B fragment of the header. Two shared-memory wavefronts instead of four 2-byte loads each.
// Lanes 16-31 give (unused) valid addresses too.
template <typename T>
__device__ __forceinline__ void wf_frag_b(const T* base, int vrow, int n0, int lane, u32 (&b)[2]) {
    const u32 addr = wf_smem_addr(base + (lane & 15) * vrow + n0);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(b[0]), "=r"(b[1])
                 : "r"(addr));
}

// ---- the 1-D transforms (the matrices of src/reference/winograd.rs, factored) ----------------

// Bᵀ applied to a column of alpha values, in place.
template <int M> __device__ __forceinline__ void wf_bt(float* d, int s);
template <> __device__ __forceinline__ void wf_bt<2>(float* d, int s) {
    // Bᵀ = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]
    const float d0 = d[0], d1 = d[s], d2 = d[2 * s], d3 = d[3 * s];
    d[0] = d0 - d2;
    d[s] = d1 + d2;
    d[2 * s] = d2 - d1;
    d[3 * s] = d1 - d3;
}
template <> __device__ __forceinline__ void wf_bt<4>(float* d, int s) {
    // Bᵀ = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0; 0 4 0 -5 0 1]
    const float d0 = d[0], d1 = d[s], d2 = d[2 * s], d3 = d[3 * s], d4 = d[4 * s], d5 = d[5 * s];
    const float p = fmaf(-4.f, d2, d4);  // d4 - 4 d2
    const float q = fmaf(-4.f, d1, d3);  // d3 - 4 d1
    const float r = d4 - d2;
    const float u = d3 - d1;
    d[0] = fmaf(4.f, d0, fmaf(-5.f, d2, d4));
    d[s] = p + q;
    d[2 * s] = p - q;
    d[3 * s] = fmaf(2.f, u, r);
    d[4 * s] = fmaf(-2.f, u, r);
    d[5 * s] = fmaf(4.f, d1, fmaf(-5.f, d3, d5));
}

// Aᵀ applied to alpha values m[0], m[s], ... giving the m outputs o[0], o[os], ...
template <int M> __device__ __forceinline__ void wf_at(const float* m, int s, float* o, int os);
template <> __device__ __forceinline__ void wf_at<2>(const float* m, int s, float* o, int os) {
    // Aᵀ = [1 1 1 0; 0 1 -1 -1]
    o[0] = m[0] + m[s] + m[2 * s];
    o[os] = m[s] - m[2 * s] - m[3 * s];
}
template <> __device__ __forceinline__ void wf_at<4>(const float* m, int s, float* o, int os) {
    // Aᵀ = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1]
    const float a = m[s] + m[2 * s], b = m[s] - m[2 * s];
    const float c = m[3 * s] + m[4 * s], d = m[3 * s] - m[4 * s];
    o[0] = m[0] + a + c;
    o[os] = fmaf(2.f, d, b);
    o[2 * os] = fmaf(4.f, c, a);
    o[3 * os] = fmaf(8.f, d, b) + m[5 * s];
}

// ---- the kernel ---------------------------------------------------------------------------------

template <typename T, int M>
__device__ __forceinline__ void winograd_fused(const T* __restrict__ x, const T* __restrict__ v,
                                               T* __restrict__ y, u32 h, u32 w, u32 c, u32 k,
                                               u32 pad_h, u32 pad_w, u32 oh, u32 ow, u32 tiles_h,
                                               u32 tiles_w, u32 tiles) {
    using Cfg = WfCfg<M>;
    constexpr int A = Cfg::A, P = Cfg::P, NF = Cfg::NF, TK = Cfg::TK;
    constexpr int XROW = Cfg::XROW, VROW = Cfg::VROW;
    extern __shared__ __align__(16) unsigned char wf_smem[];
    T* xs = reinterpret_cast<T*>(wf_smem);
    T* us = xs + Cfg::XS;
    T* vs = us + Cfg::US;
    __shared__ long long s_base[WF_TT];
    __shared__ int s_y0[WF_TT];
    __shared__ int s_x0[WF_TT];

    const int tid = threadIdx.x;
    const u32 t0 = blockIdx.x * WF_TT;
    const u32 k0 = blockIdx.y * TK;
    const u32 per_image = tiles_h * tiles_w;
    if (tid < WF_TT) {
        const u32 t = t0 + tid;
        if (t < tiles) {
            const u32 b = t / per_image;
            const u32 r = t - b * per_image;
            const u32 th = r / tiles_w;
            const u32 tw = r - th * tiles_w;
            s_base[tid] = (long long)b * h * w * c;
            s_y0[tid] = (int)(th * M) - (int)pad_h;
            s_x0[tid] = (int)(tw * M) - (int)pad_w;
        } else {
            // Every tap of a tile past the end is outside the image: zero-filled, never stored.
            s_base[tid] = 0;
            s_y0[tid] = -(1 << 29);
            s_x0[tid] = -(1 << 29);
        }
    }
    __syncthreads();

    // Queues chunk `cc`'s raw input: pieces of 8 channels (16 bytes) per (tile, tap, half).
    auto stage_x = [&](u32 cc) {
#pragma unroll 1
        for (int q = 0; q < Cfg::X_PIECES / WF_THREADS; ++q) {
            const int e = tid + q * WF_THREADS;
            const int tl = e / (P * 2);
            const int rem = e - tl * (P * 2);
            const int tap = rem >> 1;
            const int half = rem & 1;
            const int i = tap / A;
            const int j = tap - i * A;
            const int iy = s_y0[tl] + i;
            const int ix = s_x0[tl] + j;
            const u32 ch = cc + half * 8;
            const bool ok = iy >= 0 && iy < (int)h && ix >= 0 && ix < (int)w && ch < c;
            const T* src = ok ? x + (u64)s_base[tl] + ((u64)iy * w + (u32)ix) * c + ch : x;
            wf_cp16_ca(xs + tl * XROW + tap * WF_KC + half * 8, src, ok ? 16u : 0u);
        }
    };
    // Queues chunk `cc`'s transformed filter rows V[pos][cc + kk][k0 .. k0 + TK) into stage `buf`.
    auto stage_v = [&](u32 cc, int buf) {
        T* dst = vs + buf * Cfg::VS;
#pragma unroll 1
        for (int q = 0; q < Cfg::V_PIECES / WF_THREADS; ++q) {
            const int e = tid + q * WF_THREADS;
            const int piece = e % (TK / 8);
            const int row = e / (TK / 8);  // pos * 16 + kk
            const int pos = row / WF_KC;
            const int kk = row - pos * WF_KC;
            const u32 cg = cc + kk;
            const u32 kg = k0 + piece * 8;
            const bool ok = cg < c && kg < k;
            const T* src = ok ? v + ((u64)pos * c + cg) * k + kg : v;
            wf_cp16_cg(dst + row * VROW + piece * 8, src, ok ? 16u : 0u);
        }
    };

    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int tq = lane & 3;
    const int wt = warp / WF_WARPS_K;  // which 16 tiles
    const int wk = warp % WF_WARPS_K;  // which 8 * NF output channels

    float acc[P][NF][4];
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[p][f][e] = 0.f;

    const u32 chunks = (c + WF_KC - 1) / WF_KC;
    stage_x(0);
    stage_v(0, 0);
    wf_cp_commit();
    for (u32 j = 0; j < chunks; ++j) {
        wf_cp_wait_all();
        __syncthreads();  // chunk j landed for every thread; the MMAs of chunk j-1 are done
        // Input transform: thread = (tile w * 4 + lane / 8, channel lane % 8 + 8 * half).
        {
            const int tl = warp * 4 + (lane >> 3);
            const int c8 = lane & 7;
#pragma unroll 1
            for (int half = 0; half < 2; ++half) {
                const T* src = xs + tl * XROW + half * 8 + c8;
                float d[A * A];
#pragma unroll
                for (int tap = 0; tap < P; ++tap) d[tap] = to_float(src[tap * WF_KC]);
#pragma unroll
                for (int jj = 0; jj < A; ++jj) wf_bt<M>(d + jj, A);  // columns: Bᵀ d
#pragma unroll
                for (int ii = 0; ii < A; ++ii) wf_bt<M>(d + ii * A, 1);  // rows: (Bᵀ d) B
                T* dst = us + (half * WF_TT + tl) * 8 + c8;
#pragma unroll
                for (int pos = 0; pos < P; ++pos) dst[pos * 2 * WF_TT * 8] = from_float<T>(d[pos]);
            }
        }
        __syncthreads();  // U of chunk j complete; Xs free
        if (j + 1 < chunks) {
            stage_x((j + 1) * WF_KC);
            stage_v((j + 1) * WF_KC, (j + 1) & 1);
        }
        wf_cp_commit();
        // The per-position products of chunk j.
        const T* vb = vs + (j & 1) * Cfg::VS;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            u32 a[4];
            wf_frag_a<T>(us + p * 2 * WF_TT * 8, WF_TT, wt * 16 + g, tq, a);
#pragma unroll
            for (int f = 0; f < NF; ++f) {
                u32 b[2];
                wf_frag_b<T>(vb + p * WF_KC * VROW, VROW, (wk * NF + f) * 8, lane, b);
                wf_mma<T>(acc[p][f], a, b);
            }
        }
    }

    // Output transform in registers: acc[.][f][2 * hr + e] is M of tile (wt * 16 + g + 8 hr) and
    // output channel k0 + (wk * NF + f) * 8 + 2 tq + e.
#pragma unroll
    for (int f = 0; f < NF; ++f) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const u32 t = t0 + wt * 16 + g + 8 * hr;
            const u32 kk = k0 + (wk * NF + f) * 8 + 2 * tq;
            if (t >= tiles || kk >= k) continue;
            const u32 b = t / per_image;
            const u32 r = t - b * per_image;
            const u32 th = r / tiles_w;
            const u32 tw = r - th * tiles_w;
            float out[2][M * M];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float tmp[M * A];  // Aᵀ M: M rows of alpha
#pragma unroll
                for (int jj = 0; jj < A; ++jj) {
                    float col[A];
#pragma unroll
                    for (int ii = 0; ii < A; ++ii) col[ii] = acc[ii * A + jj][f][2 * hr + e];
                    wf_at<M>(col, 1, tmp + jj, A);
                }
#pragma unroll
                for (int u = 0; u < M; ++u) wf_at<M>(tmp + u * A, 1, out[e] + u * M, 1);
            }
            T* yb = y + (u64)b * oh * ow * k + kk;
#pragma unroll
            for (int u = 0; u < M; ++u) {
                const u32 oy = th * M + u;
                if (oy >= oh) continue;
#pragma unroll
                for (int q = 0; q < M; ++q) {
                    const u32 ox = tw * M + q;
                    if (ox >= ow) continue;
                    const u32 pair = wf_pack(from_float<T>(out[0][u * M + q]).bits,
                                             from_float<T>(out[1][u * M + q]).bits);
                    *reinterpret_cast<u32*>(yb + ((u64)oy * ow + ox) * k) = pair;
                }
            }
        }
    }
}

// One warp: D (16 x 8, f32, row-major) = A (16 x 16, row-major) · B (16 x 8, row-major), staged
// through shared memory in the fused kernel's layouts and multiplied by its fragment helpers, so
// that a wrong fragment layout shows in a unit test of its own.
template <typename T>
__device__ __forceinline__ void wf_mma_probe(const T* __restrict__ a, const T* __restrict__ b,
                                             float* __restrict__ d) {
    __shared__ __align__(16) T as[2 * 16 * 8];
    __shared__ __align__(16) T bs[16 * 16];  // vrow 16: columns 8..15 unused
    const int lane = threadIdx.x;
    for (int e = lane; e < 16 * 16; e += 32) {
        const int row = e / 16, col = e % 16;
        as[((col / 8) * 16 + row) * 8 + col % 8] = a[e];
        if (e < 16 * 8) bs[(e / 8) * 16 + e % 8] = b[e];
    }
    __syncwarp();
    const int g = lane >> 2, t = lane & 3;
    u32 fa[4], fb[2];
    wf_frag_a<T>(as, 16, g, t, fa);
    wf_frag_b<T>(bs, 16, 0, lane, fb);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    wf_mma<T>(acc, fa, fb);
    d[g * 8 + 2 * t] = acc[0];
    d[g * 8 + 2 * t + 1] = acc[1];
    d[(g + 8) * 8 + 2 * t] = acc[2];
    d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

// ---- entry points: winograd_fused_<tile>_<dtype>, winograd_fused_mma_probe_<dtype> ------------

#ifndef NNF_WF_DT
#define NNF_WF_DT 0
#endif
#ifndef NNF_WF_TILE
#define NNF_WF_TILE 0
#endif
#define NNF_WF_PICK(dt, tile) ((NNF_WF_DT == 0 || NNF_WF_DT == (dt)) && (NNF_WF_TILE == 0 || NNF_WF_TILE == (tile)))

#define NNF_WF_KERNEL(TILE, M, T, S)                                                               \
    extern "C" __global__ void __launch_bounds__(WF_THREADS, 1) winograd_fused_##TILE##_##S(       \
        const T* x, const T* v, T* y, u32 h, u32 w, u32 c, u32 k, u32 pad_h, u32 pad_w, u32 oh,    \
        u32 ow, u32 tiles_h, u32 tiles_w, u32 tiles) {                                             \
        winograd_fused<T, M>(x, v, y, h, w, c, k, pad_h, pad_w, oh, ow, tiles_h, tiles_w, tiles);  \
    }
#define NNF_WF_PROBE(T, S)                                                                         \
    extern "C" __global__ void __launch_bounds__(32) winograd_fused_mma_probe_##S(                 \
        const T* a, const T* b, float* d) {                                                        \
        wf_mma_probe<T>(a, b, d);                                                                  \
    }

#if NNF_WF_PICK(2, 2)
NNF_WF_KERNEL(f2x3, 2, nnf_f16, f16)
#endif
#if NNF_WF_PICK(2, 4)
NNF_WF_KERNEL(f4x3, 4, nnf_f16, f16)
#endif
#if NNF_WF_PICK(3, 2)
NNF_WF_KERNEL(f2x3, 2, nnf_bf16, bf16)
#endif
#if NNF_WF_PICK(3, 4)
NNF_WF_KERNEL(f4x3, 4, nnf_bf16, bf16)
#endif
#if NNF_WF_PICK(2, 1)
NNF_WF_PROBE(nnf_f16, f16)
#endif
#if NNF_WF_PICK(3, 1)
NNF_WF_PROBE(nnf_bf16, bf16)
#endif
