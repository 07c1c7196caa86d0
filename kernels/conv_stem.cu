// Channels-last layers with few input channels (ResNet's 7x7/2 stem: c_in = 3) in f16 / bf16 on
// tensor cores: the filter gradient (the `stem_filter` path, src/conv/stem_filter.rs) and the
// forward (`stem_forward`, src/conv/stem_forward.rs; below the filter gradient's kernels).
// Why: cuDNN's f32-accumulating engines ran the stem's filter gradient (batch 32) in 162 us on
// the H100 for a 20 us memory floor; a GEMM of dy with column matrices written to memory
// (im2col_gemm) took 207.
//
// dw[k][r] = sum over pixels p of dy[p][k] * col[p][r], r = (kh, kw, c) — KRSC, dw's NHWC
// order — a GEMM with the pixels as its reduction. A work unit is one output row segment of
// SW_PX pixels (n, oh, ow0 ..); its column matrix is never written: the block stages dy's
// SW_PX x 64 channels (16-byte cp.async) and the kh input rows under the segment (4-byte
// cp.async, zeros outside the image) in shared memory, two units deep, and reads each column
// value where it lies in the staged rows: col[p][r] = xs[kh][shift + p*sw*c + kw*c + c].
// 8 warps as 2 (filters: 32 each) x 4 (columns of r: 8*NT each), mma.sync m16n8k16 with f32
// accumulators: A = dy^T by ldmatrix.trans from [pixel][channel] rows (stride 72 halves: the 8
// rows of a fragment load in 8 bank quads); B one 16-bit load per value (two pixels of a pair
// lie sw*c apart). A block owns 64 filters (gridDim.y) and a contiguous range of units
// (gridDim.x = splits) and writes its partial sums (f32, [split][k][r]); the reduce kernel adds
// the splits in a fixed order (deterministic) and writes or adds into dw, rounding once.

// Compilation units (src/conv/stem_filter.rs: `unit`): NNF_SW_DT 2 (f16) or 3 (bf16) and
// NNF_SW_NT 1 to 5 select one filter-gradient kernel and its type's reduce, 6 the type's forward
// kernel, so that a first call compiles one or two kernels, not fourteen; 0 (the default)
// compiles all.
#ifndef NNF_SW_DT
#define NNF_SW_DT 0
#endif
#ifndef NNF_SW_NT
#define NNF_SW_NT 0
#endif
#define SW_WANT(DT, NT) ((NNF_SW_DT == 0 || NNF_SW_DT == DT) && (NNF_SW_NT == 0 || NNF_SW_NT == NT))

#define SW_PX 128        // pixels per unit (src/conv/problem/stem_filter.rs: PX)
#define SW_KT 64         // filters per block (KT)
#define SW_LDD 72        // staged dy row stride in halves
#define SW_THREADS 256

struct StemGeom {
    u32 n, h, w, c;  // x, NHWC
    u32 k;           // filters (c_out), a multiple of 8
    u32 oh, ow;
    u32 kh, kw;
    u32 sh, sw;
    int ph, pw;
    u32 r;           // kh * kw * c
    u32 segs;        // ceil(ow / SW_PX)
    u32 units;       // n * oh * segs
    u32 splits;      // gridDim.x
    u32 xsw;         // staged x row stride in halves (a multiple of 8)
    u32 pieces;      // 4-byte pieces per staged x row
    u32 ldw;         // forward: the staged filter's row stride in halves (16 * ksteps + 8)
};
static_assert(sizeof(StemGeom) == 80, "StemGeom must match src/conv/stem_filter.rs");

struct SwUnit {
    u32 n, oh, ow0;
    int jstart;  // row-relative element of the segment's first input column (may be < 0)
};

__device__ __forceinline__ SwUnit sw_unit(u32 u, const StemGeom& g) {
    const u32 seg = u % g.segs, row = u / g.segs;
    SwUnit t;
    t.n = row / g.oh;
    t.oh = row % g.oh;
    t.ow0 = seg * SW_PX;
    t.jstart = ((int)(t.ow0 * g.sw) - g.pw) * (int)g.c;
    return t;
}

// Queues the copies of unit u's kh input rows into `xs`, from the even element at or before
// jstart (4-byte pieces; the image's rows hold an even number of elements, so a piece is wholly
// inside or outside; outside: zeros).
__device__ __forceinline__ void sw_stage_x(const unsigned short* __restrict__ x,
                                           const StemGeom& g, const SwUnit& t,
                                           unsigned short* xs) {
    const int a = t.jstart - (t.jstart & 1);
    const int row_len = (int)(g.w * g.c);
    for (u32 e = threadIdx.x; e < g.kh * g.pieces; e += SW_THREADS) {
        const u32 rr = e / g.pieces, q = e % g.pieces;
        const int ih = (int)(t.oh * g.sh + rr) - g.ph;
        const int jj = a + 2 * (int)q;
        const bool ok = ih >= 0 && ih < (int)g.h && jj >= 0 && jj < row_len;
        const unsigned short* src = ok ? x + ((u64)t.n * g.h + ih) * (u64)row_len + jj : x;
        nnf_cp4(xs + rr * g.xsw + 2 * q, src, ok ? 4u : 0u);
    }
}

// Queues unit u's copies: dy's SW_PX pixels x 64 filters from k0 (16-byte pieces), and its
// input rows.
__device__ __forceinline__ void sw_stage(const unsigned short* __restrict__ x,
                                         const unsigned short* __restrict__ dy,
                                         const StemGeom& g, u32 u, u32 k0,
                                         unsigned short* dys, unsigned short* xs) {
    const SwUnit t = sw_unit(u, g);
    const u32 tid = threadIdx.x;
    const u64 dy_row = ((u64)t.n * g.oh + t.oh) * g.ow;
#pragma unroll 4
    for (u32 e = tid; e < SW_PX * 8; e += SW_THREADS) {
        const u32 p = e / 8, j = e % 8;
        const u32 ow = t.ow0 + p, ch = k0 + j * 8;
        const bool ok = ow < g.ow && ch < g.k;
        nnf_cp16(dys + p * SW_LDD + j * 8, ok ? dy + (dy_row + ow) * g.k + ch : dy, ok ? 16u : 0u);
    }
    sw_stage_x(x, g, t, xs);
    nnf_commit();
}

template <typename T, int NT>
__device__ __forceinline__ void stem_wgrad(const unsigned short* __restrict__ x,
                                           const unsigned short* __restrict__ dy,
                                           float* __restrict__ part, const StemGeom g) {
    extern __shared__ __align__(16) unsigned short sw_sm[];
    const u32 stage_halves = SW_PX * SW_LDD + g.kh * g.xsw;
    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const u32 gq = lane >> 2, tq = lane & 3u;
    const u32 wm = warp & 1u, wn = warp >> 1;
    const u32 k0 = blockIdx.y * SW_KT, split = blockIdx.x;
    const u32 u_begin = (u32)(((u64)split * g.units) / g.splits);
    const u32 u_end = (u32)(((u64)(split + 1) * g.units) / g.splits);

    // This thread's columns of r (one per n tile): where their value lies in a staged unit,
    // relative to the pixel's offset. Columns past r read column 0 (their sums are dropped).
    u32 off[NT];
    const u32 kwc = g.kw * g.c;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const u32 col = wn * NT * 8 + nt * 8 + gq;
        off[nt] = col < g.r ? (col / kwc) * g.xsw + col % kwc : 0;
    }
    const u32 xstep = g.sw * g.c;
    // ldmatrix.trans rows of A: lane l reads pixel (l / 16) * 8 + l % 8 of a 16-pixel step,
    // filters wm * 32 + mt * 16 + ((l / 8) % 2) * 8 ..
    const u32 a_lane = (((lane / 16) * 8 + lane % 8) * SW_LDD + wm * 32 + ((lane / 8) % 2) * 8) * 2;

    float acc[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

    if (u_begin < u_end) sw_stage(x, dy, g, u_begin, k0, sw_sm, sw_sm + SW_PX * SW_LDD);
    for (u32 u = u_begin; u < u_end; ++u) {
        unsigned short* const dys = sw_sm + ((u - u_begin) & 1u) * stage_halves;
        const unsigned short* const xs = dys + SW_PX * SW_LDD;
        asm volatile("cp.async.wait_all;" ::: "memory");
        // Unit u has landed for every thread, and every thread is done with unit u - 1's
        // stage, which the next copies overwrite.
        __syncthreads();
        if (u + 1 < u_end) {
            unsigned short* const next = sw_sm + ((u + 1 - u_begin) & 1u) * stage_halves;
            sw_stage(x, dy, g, u + 1, k0, next, next + SW_PX * SW_LDD);
        }
        const SwUnit t = sw_unit(u, g);
        const u32 cols = min((u32)SW_PX, g.ow - t.ow0);
        const u32 shift = (u32)(t.jstart & 1);
        const u32 a_base = nnf_smem(dys) + a_lane;
        for (u32 s = 0; s * 16 < cols; ++s) {
            u32 af[2][4];
            nnf_ldsm4_trans(af[0], a_base + s * 16 * SW_LDD * 2);
            nnf_ldsm4_trans(af[1], a_base + s * 16 * SW_LDD * 2 + 16 * 2);
            // Pixels 16s + 2tq, +1, +8, +9 of the unit (zero dy rows past `cols`).
            const unsigned short* xp = xs + shift + (s * 16 + 2 * tq) * xstep;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const unsigned short* v = xp + off[nt];
                const u32 b0 = (u32)v[0] | ((u32)v[xstep] << 16);
                const u32 b1 = (u32)v[8 * xstep] | ((u32)v[9 * xstep] << 16);
                nnf_mma<T>(acc[0][nt], af[0], b0, b1);
                nnf_mma<T>(acc[1][nt], af[1], b0, b1);
            }
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    // Partial sums: part[split][k][r].
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 k = k0 + wm * 32 + mt * 16 + gq + (i / 2) * 8;
                const u32 col = wn * NT * 8 + nt * 8 + 2 * tq + (i % 2);
                if (k < g.k && col < g.r) part[((u64)split * g.k + k) * g.r + col] = acc[mt][nt][i];
            }
}

#define NNF_SW_KERNEL(T, NAME, NT)                                                          \
    extern "C" __global__ void __launch_bounds__(SW_THREADS, 2)                             \
        conv_stem_wgrad_##NAME##_n##NT(const unsigned short* __restrict__ x,                \
                                       const unsigned short* __restrict__ dy,               \
                                       float* __restrict__ part, StemGeom g) {              \
        stem_wgrad<T, NT>(x, dy, part, g);                                                  \
    }

#if SW_WANT(2, 1)
NNF_SW_KERNEL(nnf_f16, f16, 1)
#endif
#if SW_WANT(2, 2)
NNF_SW_KERNEL(nnf_f16, f16, 2)
#endif
#if SW_WANT(2, 3)
NNF_SW_KERNEL(nnf_f16, f16, 3)
#endif
#if SW_WANT(2, 4)
NNF_SW_KERNEL(nnf_f16, f16, 4)
#endif
#if SW_WANT(2, 5)
NNF_SW_KERNEL(nnf_f16, f16, 5)
#endif
#if SW_WANT(3, 1)
NNF_SW_KERNEL(nnf_bf16, bf16, 1)
#endif
#if SW_WANT(3, 2)
NNF_SW_KERNEL(nnf_bf16, bf16, 2)
#endif
#if SW_WANT(3, 3)
NNF_SW_KERNEL(nnf_bf16, bf16, 3)
#endif
#if SW_WANT(3, 4)
NNF_SW_KERNEL(nnf_bf16, bf16, 4)
#endif
#if SW_WANT(3, 5)
NNF_SW_KERNEL(nnf_bf16, bf16, 5)
#endif

// The forward: y[p][k] = sum over r of col[p][r] * w[k][r], a unit's SW_PX pixels x 64 filters
// per step of a block's unit range (gridDim.x ranges, gridDim.y filter tiles). The block stages
// its 64 filters once ([k][ldw] halves, zero past r and past c_out) with a table of where each
// column r lies in a staged unit (`offs`), then per unit the kh input rows (two units deep) as
// the filter gradient does. 8 warps as 4 (pixels: 32 each) x 2 (filters: 32 each), mma.sync with
// f32 accumulators: A = columns, one 16-bit load per value (a pixel's columns lie kw*c apart per
// kernel row); B = the filter by ldmatrix. Each output is rounded once into a shared tile and
// stored in 16-byte pieces.
template <typename T>
__device__ __forceinline__ void stem_fwd(const unsigned short* __restrict__ x,
                                         const unsigned short* __restrict__ w,
                                         unsigned short* __restrict__ y, const StemGeom g) {
    extern __shared__ __align__(16) unsigned short sw_sm[];
    const u32 ksteps = (g.r + 15) / 16;
    unsigned short* const ws = sw_sm;                                   // [64][ldw]
    unsigned short* const os = ws + SW_KT * g.ldw;                      // [SW_PX][SW_LDD]
    u32* const offs = (u32*)(os + SW_PX * SW_LDD);                      // [16 * ksteps]
    unsigned short* const xs0 = (unsigned short*)(offs + 16 * ksteps);  // 2 x [kh][xsw]
    const u32 xs_halves = g.kh * g.xsw;
    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const u32 gq = lane >> 2, tq = lane & 3u;
    const u32 wm = warp & 3u, wn = warp >> 2;
    const u32 k0 = blockIdx.y * SW_KT, split = blockIdx.x;
    const u32 u_begin = (u32)(((u64)split * g.units) / g.splits);
    const u32 u_end = (u32)(((u64)(split + 1) * g.units) / g.splits);

    // The filter tile (rows of r values: not 16-byte aligned in w, so element by element) and
    // the column table; columns past r read column 0 (their filter values are zero).
    for (u32 e = tid; e < SW_KT * 16 * ksteps; e += SW_THREADS) {
        const u32 n = e / (16 * ksteps), r = e % (16 * ksteps);
        const bool in = r < g.r && k0 + n < g.k;
        ws[n * g.ldw + r] = in ? w[(u64)(k0 + n) * g.r + r] : (unsigned short)0;
    }
    const u32 kwc = g.kw * g.c;
    for (u32 r = tid; r < 16 * ksteps; r += SW_THREADS)
        offs[r] = r < g.r ? (r / kwc) * g.xsw + r % kwc : 0;
    if (u_begin < u_end) {
        sw_stage_x(x, g, sw_unit(u_begin, g), xs0);
        nnf_commit();
    }
    const u32 xstep = g.sw * g.c;
    // ldmatrix rows of B: lane l reads filter wn * 32 + np * 16 + (l / 16) * 8 + l % 8 at column
    // ((l / 8) % 2) * 8 of a 16-column step.
    const u32 b_addr =
        nnf_smem(ws) + ((wn * 32 + (lane / 16) * 8 + lane % 8) * g.ldw + ((lane / 8) % 2) * 8) * 2;

    for (u32 u = u_begin; u < u_end; ++u) {
        const unsigned short* const xs = xs0 + ((u - u_begin) & 1u) * xs_halves;
        asm volatile("cp.async.wait_all;" ::: "memory");
        // Unit u's rows (and, the first time, the filter and table) are in place for every
        // thread; every thread is done with unit u - 1's rows and output tile.
        __syncthreads();
        if (u + 1 < u_end) {
            sw_stage_x(x, g, sw_unit(u + 1, g), xs0 + ((u + 1 - u_begin) & 1u) * xs_halves);
            nnf_commit();
        }
        const SwUnit t = sw_unit(u, g);
        const u32 shift = (u32)(t.jstart & 1);
        float acc[2][4][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
        // This thread's pixels: rows gq and gq + 8 of its warp's two 16-pixel tiles.
        const unsigned short* xp[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) xp[mt][h] = xs + shift + (wm * 32 + mt * 16 + h * 8 + gq) * xstep;
        for (u32 s = 0; s < ksteps; ++s) {
            const u32 r0 = s * 16 + 2 * tq;
            const u32 o0 = offs[r0], o1 = offs[r0 + 1], o8 = offs[r0 + 8], o9 = offs[r0 + 9];
            u32 af[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const unsigned short* pa = xp[mt][0];
                const unsigned short* pb = xp[mt][1];
                af[mt][0] = (u32)pa[o0] | ((u32)pa[o1] << 16);
                af[mt][1] = (u32)pb[o0] | ((u32)pb[o1] << 16);
                af[mt][2] = (u32)pa[o8] | ((u32)pa[o9] << 16);
                af[mt][3] = (u32)pb[o8] | ((u32)pb[o9] << 16);
            }
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                u32 bf[4];
                nnf_ldsm4(bf, b_addr + (np * 16 * g.ldw + s * 16) * 2);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    nnf_mma<T>(acc[mt][2 * np], af[mt], bf[0], bf[1]);
                    nnf_mma<T>(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
                }
            }
        }
        // The unit's outputs, rounded once, into the shared tile ([pixel][filter], stride
        // SW_LDD: the 8 rows a warp writes at once fall in 8 bank quads) ...
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 p = wm * 32 + mt * 16 + h * 8 + gq;
                    const u32 lo = from_float<T>(acc[mt][nt][2 * h]).bits;
                    const u32 hi = from_float<T>(acc[mt][nt][2 * h + 1]).bits;
                    *(u32*)(os + p * SW_LDD + wn * 32 + nt * 8 + 2 * tq) = lo | (hi << 16);
                }
        __syncthreads();
        // ... then to y in 16-byte pieces: pixel p's 64 filters from k0 (c_out is a multiple of
        // 8, so a piece is wholly inside or outside).
        const u32 cols = min((u32)SW_PX, g.ow - t.ow0);
        const u64 y_row = ((u64)t.n * g.oh + t.oh) * g.ow + t.ow0;
        for (u32 e = tid; e < SW_PX * 8; e += SW_THREADS) {
            const u32 p = e / 8, j = e % 8;
            if (p < cols && k0 + j * 8 < g.k)
                *(uint4*)(y + (y_row + p) * g.k + k0 + j * 8) = *(const uint4*)(os + p * SW_LDD + j * 8);
        }
    }
}

#define NNF_SW_FWD_KERNEL(T, NAME)                                                          \
    extern "C" __global__ void __launch_bounds__(SW_THREADS, 2)                             \
        conv_stem_fwd_##NAME(const unsigned short* __restrict__ x,                          \
                             const unsigned short* __restrict__ w,                          \
                             unsigned short* __restrict__ y, StemGeom g) {                  \
        stem_fwd<T>(x, w, y, g);                                                            \
    }

#if SW_WANT(2, 6)
NNF_SW_FWD_KERNEL(nnf_f16, f16)
#endif
#if SW_WANT(3, 6)
NNF_SW_FWD_KERNEL(nnf_bf16, bf16)
#endif

// dw[i] = (accumulate ? dw[i] : 0) + sum over splits of part[s][i], rounded once. A block takes
// 32 consecutive elements; its 8 warps sum splits w, w + 8, ... each in order, then one warp
// adds the 8 sums in order: a fixed order (deterministic) with 8 loads in flight per element.
template <typename T>
__device__ __forceinline__ void stem_reduce(const float* __restrict__ part, T* __restrict__ dw,
                                            u32 elems, u32 splits, u32 accumulate) {
    __shared__ float red[8][33];
    const u32 j = threadIdx.x & 31u, grp = threadIdx.x >> 5;
    const u32 i = blockIdx.x * 32 + j;
    float s = 0.f;
    if (i < elems)
        for (u32 sp = grp; sp < splits; sp += 8) s += part[(u64)sp * elems + i];
    red[grp][j] = s;
    __syncthreads();
    if (grp != 0 || i >= elems) return;
    float grad = 0.f;
#pragma unroll
    for (int q = 0; q < 8; ++q) grad += red[q][j];
    dw[i] = from_float<T>(accumulate ? to_float(dw[i]) + grad : grad);
}

#if NNF_SW_DT == 0 || NNF_SW_DT == 2
extern "C" __global__ void __launch_bounds__(SW_THREADS)
    conv_stem_wgrad_reduce_f16(const float* __restrict__ part, nnf_f16* __restrict__ dw, u32 elems,
                               u32 splits, u32 accumulate) {
    stem_reduce<nnf_f16>(part, dw, elems, splits, accumulate);
}
#endif
#if NNF_SW_DT == 0 || NNF_SW_DT == 3
extern "C" __global__ void __launch_bounds__(SW_THREADS)
    conv_stem_wgrad_reduce_bf16(const float* __restrict__ part, nnf_bf16* __restrict__ dw,
                                u32 elems, u32 splits, u32 accumulate) {
    stem_reduce<nnf_bf16>(part, dw, elems, splits, accumulate);
}
#endif
