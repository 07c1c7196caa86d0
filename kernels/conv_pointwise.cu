// A 1x1, stride-1, unpadded channels-last convolution (a GEMM y[P][N] = x[P][K] · w[N][K]ᵀ,
// P = n·h·w rows, K = c_in, N = c_out) on tensor cores, with the per-channel sum and sum of
// squares of its rounded output in its epilogue: ConvStats' `own_pointwise` route
// (src/block/pointwise.rs), so that the statistics need no second pass over y.
//
// Persistent: block b takes row tiles b, b + G, ... (G = gridDim.x) of BM = 64 rows. The whole
// filter sits in shared memory (N rows of KP = 64·kchunks halves, zero past K, +8 halves of pad);
// x streams through as many stages of 64 rows x 64 k as fit (2 to PW_MAX_STAGES; cp.async,
// zero-filled past P and K), one stage per (tile, k chunk). 8 warps as 2 (rows) x 4 (columns): warp (wm, wn) computes rows
// wm·32 .. +32 and columns wn·8·NT .. +8·NT (NT = N / 32) with mma.sync m16n8k16 (f32
// accumulators). Row strides of 72 halves (36 words) put the 8 rows a fragment load touches
// in 8 different bank quads: no bank conflicts.
//
// Epilogue of a tile: each accumulator is rounded to T once (common.cuh's out_bits2) into a
// shared output tile; the tile
// (64 whole rows: contiguous in y) then goes out in 16-byte stores, each thread always the same
// 8 channels, whose rounded values (what a BatchNorm reads back) it adds into its f32 sums and
// sums of squares (at most 64 / GROUPS rows a tile). At the end the threads of one channel add
// in f64 in a fixed order, and block b writes part[ch·G + b] (sums) and part[N·G + ch·G + b]
// (squares): the layout channel_sums_finish (block_stats.cu) reduces. No atomics: the result
// does not depend on timing.

#ifndef NNF_PW_DT
#define NNF_PW_DT 0
#endif

#define PW_BM 64
#define PW_BK 64
#define PW_LDA (PW_BK + 8)
#define PW_THREADS 256
#define PW_MAX_STAGES 6

struct PwArgs {
    const void* x;  // [P][K]
    const void* w;  // [N][K]
    void* y;        // [P][N]
    double* part;   // [2][N][G], or null: no statistics
    u64 rows;       // P
    u32 k;          // K, a multiple of 8
    u32 kchunks;    // ceil(K / 64)
    u32 tiles;      // ceil(P / 64)
    u32 ldw;        // the filter's shared row stride in halves: 64 * kchunks + 8
    u32 stages;     // stages of x in flight, 2 .. PW_MAX_STAGES (as many as fit)
};

// Waits until at most n groups are pending (n < PW_MAX_STAGES - 1; uniform across the block).
__device__ __forceinline__ void pw_wait_n(u32 n) {
    switch (n) {
        case 0: nnf_wait<0>(); break;
        case 1: nnf_wait<1>(); break;
        case 2: nnf_wait<2>(); break;
        case 3: nnf_wait<3>(); break;
        default: nnf_wait<4>(); break;
    }
}

// Stage k chunk `kc` (in elements) of row tile `tile` of x into `as`: this thread's two 16-byte
// pieces (row e / 8, piece e % 8 for e = tid, tid + 256).
__device__ __forceinline__ void pw_load_x(const PwArgs& a, unsigned short* as, u32 tile, u32 kc,
                                          u32 tid) {
    const unsigned short* x = (const unsigned short*)a.x;
#pragma unroll
    for (int q = 0; q < (PW_BM * PW_BK / 8) / PW_THREADS; ++q) {
        const u32 e = tid + PW_THREADS * q;
        const u32 r = e / 8, j = e % 8;
        const u64 row = (u64)tile * PW_BM + r;
        const u32 col = kc + j * 8;
        const bool in = row < a.rows && col < a.k;
        const unsigned short* src = in ? x + row * a.k + col : x;
        nnf_cp16(as + r * PW_LDA + j * 8, src, in ? 16u : 0u);
    }
}

template <int NT> struct PwCfg {
    static constexpr int N = NT * 32;
    static constexpr int LDO = N + 8;           // the output tile's row stride in halves
    static constexpr int PIECES = N / 8;        // 16-byte pieces of an output row
    static constexpr int GROUPS = PW_THREADS / PIECES;  // rows a pass of the block stores
};

template <typename T, int NT>
__device__ __forceinline__ void pointwise(const PwArgs& a) {
    using C = PwCfg<NT>;
    constexpr int N = C::N;
    extern __shared__ __align__(16) unsigned short pw_sm[];
    unsigned short* ws = pw_sm;                                  // [N][ldw]
    unsigned short* xs = pw_sm + (u64)N * a.ldw;                 // [STAGES][PW_BM][PW_LDA]
    unsigned short* os = xs + a.stages * PW_BM * PW_LDA;         // [PW_BM][LDO]
    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const u32 g = lane >> 2, t = lane & 3u;
    const u32 wm = warp & 1u, wn = warp >> 1;
    // This thread's 16-byte piece of an output row (8 channels from pc * 8) and its first row.
    const u32 pc = tid % C::PIECES, pr = tid / C::PIECES;

    // The filter, once: row n, 16-byte piece j of kchunks * 8.
    {
        const unsigned short* w = (const unsigned short*)a.w;
        const u32 per_row = a.kchunks * 8;
        for (u32 e = tid; e < (u32)N * per_row; e += PW_THREADS) {
            const u32 n = e / per_row, j = e % per_row;
            const bool in = j * 8 < a.k;
            nnf_cp16(ws + n * a.ldw + j * 8, in ? w + (u64)n * a.k + j * 8 : w, in ? 16u : 0u);
        }
        nnf_commit();
    }
    const u32 my_tiles = blockIdx.x < a.tiles ? (a.tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    const u32 items = my_tiles * a.kchunks;
    // The next item to stage: its tile and k chunk, advanced item by item (no divisions).
    u32 ld_tile = blockIdx.x, ld_kc = 0;
    const auto advance = [&](u32& tile, u32& kc) {
        kc += PW_BK;
        if (kc >= a.kchunks * PW_BK) {
            kc = 0;
            tile += gridDim.x;
        }
    };
    for (u32 s = 0; s + 1 < a.stages; ++s) {
        if (s < items) pw_load_x(a, xs + s * PW_BM * PW_LDA, ld_tile, ld_kc, tid);
        nnf_commit();
        advance(ld_tile, ld_kc);
    }

    // ldmatrix rows: A (x) lane l reads row l % 16 at k offset (l / 16) * 8 of its warp's 16-row
    // block; B (w) lane l reads filter row (l / 16) * 8 + l % 8 at k offset ((l / 8) % 2) * 8 of
    // a pair of 8-column tiles.
    const u32 xs_addr = nnf_smem(xs);
    const u32 a_off = ((wm * 32 + (lane % 16)) * PW_LDA + (lane / 16) * 8) * 2;
    const u32 b_addr = nnf_smem(ws) + ((wn * NT * 8 + (lane / 16) * 8 + lane % 8) * a.ldw + ((lane / 8) % 2) * 8) * 2;

    float acc[2][NT][4];
    float ssum[8], ssq[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) ssum[j] = ssq[j] = 0.f;

    u32 tile = blockIdx.x, kc = 0, stage = 0, ld_stage = a.stages - 1;
    for (u32 it = 0; it < items; ++it) {
        pw_wait_n(a.stages - 2);
        __syncthreads();  // also: the last tile's output reads are done
        if (it + a.stages - 1 < items) pw_load_x(a, xs + ld_stage * PW_BM * PW_LDA, ld_tile, ld_kc, tid);
        nnf_commit();
        advance(ld_tile, ld_kc);
        ld_stage = ld_stage + 1 == a.stages ? 0 : ld_stage + 1;
        if (kc == 0) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
        }
        const u32 as_addr = xs_addr + stage * (PW_BM * PW_LDA * 2) + a_off;
#pragma unroll
        for (int ks = 0; ks < PW_BK / 16; ++ks) {
            u32 af[2][4];
            nnf_ldsm4(af[0], as_addr + ks * 32);
            nnf_ldsm4(af[1], as_addr + 16 * PW_LDA * 2 + ks * 32);
#pragma unroll
            for (int np = 0; np < NT / 2 + NT % 2; ++np) {
                u32 bf[4];
                nnf_ldsm4(bf, b_addr + (np * 16 * a.ldw + kc + ks * 16) * 2);
                nnf_mma<T>(acc[0][2 * np], af[0], bf[0], bf[1]);
                nnf_mma<T>(acc[1][2 * np], af[1], bf[0], bf[1]);
                if (2 * np + 1 < NT) {
                    nnf_mma<T>(acc[0][2 * np + 1], af[0], bf[2], bf[3]);
                    nnf_mma<T>(acc[1][2 * np + 1], af[1], bf[2], bf[3]);
                }
            }
        }
        stage = stage + 1 == a.stages ? 0 : stage + 1;
        const u32 this_tile = tile;
        advance(tile, kc);
        if (kc != 0) continue;  // more k chunks of this tile
        // The tile's output, rounded once, into shared memory (a row stride of N + 8 halves:
        // the 8 rows of a fragment in 8 bank quads) ...
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 r = wm * 32 + mt * 16 + h * 8 + g;
                    *(u32*)(os + r * C::LDO + wn * NT * 8 + nt * 8 + 2 * t) =
                        out_bits2<T>(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
                }
        __syncthreads();
        // ... then to y in whole 16-byte pieces (the tile is PW_BM full rows: contiguous in y),
        // each thread always the same 8 channels, whose sums it keeps.
        const u64 row0 = (u64)this_tile * PW_BM;
        uint4* y = (uint4*)((T*)a.y + row0 * N);
#pragma unroll
        for (u32 r = pr; r < PW_BM; r += C::GROUPS) {
            if (row0 + r < a.rows) {
                const uint4 v = *(const uint4*)(os + r * C::LDO + pc * 8);
                y[r * C::PIECES + pc] = v;
                const u32 w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    T lo, hi;
                    lo.bits = (unsigned short)(w4[j] & 0xffffu);
                    hi.bits = (unsigned short)(w4[j] >> 16);
                    const float f0 = to_float(lo), f1 = to_float(hi);
                    ssum[2 * j] += f0;
                    ssum[2 * j + 1] += f1;
                    ssq[2 * j] = fmaf(f0, f0, ssq[2 * j]);
                    ssq[2 * j + 1] = fmaf(f1, f1, ssq[2 * j + 1]);
                }
            }
        }
    }
    nnf_wait<0>();
    if (a.part == nullptr) return;  // uniform: every thread returns

    // Channel pc * 8 + j's sums are spread over the GROUPS threads of piece pc: each writes
    // them in f64, then one thread per channel adds the groups in order.
    __syncthreads();  // the stages and the output tile are free
    double* red = (double*)xs;  // [2][GROUPS][N]
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        red[pr * N + pc * 8 + j] = (double)ssum[j];
        red[(C::GROUPS + pr) * N + pc * 8 + j] = (double)ssq[j];
    }
    __syncthreads();
    const u64 G = gridDim.x;
    for (u32 ch = tid; ch < (u32)N; ch += PW_THREADS) {
        double s = 0.0, q = 0.0;
        for (u32 r = 0; r < (u32)C::GROUPS; ++r) {
            s += red[r * N + ch];
            q += red[(C::GROUPS + r) * N + ch];
        }
        a.part[ch * G + blockIdx.x] = s;
        a.part[(u64)N * G + ch * G + blockIdx.x] = q;
    }
}

#define NNF_PW_KERNEL(T, NAME, NT)                                                                \
    extern "C" __global__ void __launch_bounds__(PW_THREADS) conv_pointwise_##NAME##_n##NT(PwArgs a) { \
        pointwise<T, NT>(a);                                                                      \
    }

#if NNF_PW_DT == 0 || NNF_PW_DT == 2
NNF_PW_KERNEL(nnf_f16, f16, 1)
NNF_PW_KERNEL(nnf_f16, f16, 2)
NNF_PW_KERNEL(nnf_f16, f16, 4)
NNF_PW_KERNEL(nnf_f16, f16, 8)
#endif
#if NNF_PW_DT == 0 || NNF_PW_DT == 3
NNF_PW_KERNEL(nnf_bf16, bf16, 1)
NNF_PW_KERNEL(nnf_bf16, bf16, 2)
NNF_PW_KERNEL(nnf_bf16, bf16, 4)
NNF_PW_KERNEL(nnf_bf16, bf16, 8)
#endif
