// nnfuse's filter gradient for 3x3 filters at stride 1 in f32 (the `direct_filter` path,
// src/conv/direct_filter.rs): dw[k][c][r][s] = sum over n, ho, wo of
// dy[n][k][ho][wo] * x[n][c][ho + r - ph][wo + s - pw], in true f32 (FMA), deterministic. Why:
// cuDNN's true-f32 filter-gradient engines ran the 3x3 64-channel layer at 56x56 (batch 32) in
// 311-320 us on the H100, a third of the FMA units' rate. This kernel reaches 37% of that rate
// there (298 us alone; H100, benches/pytorch/wgrad_kernel_probe.py): a measured candidate, not
// a rule.
//
// Work unit: one output row segment (n, ho, SEG output columns). A block owns KT filters x CT
// input channels and a contiguous range of units (the batch and rows split over gridDim.x). Per
// unit it stages dy's KT rows and x's 3 input rows under the segment (halo and padding as zeros)
// in shared memory by cp.async, two stages deep, so one unit's copies land while the previous
// unit is computed. A warp's 32 threads take 32 channels of the same KPT filters; each thread
// accumulates KPT filters x 9 taps over strips of 8 columns (10 x values per filter row, 8 dy
// values per filter). The block writes its partial sums (f32) to `part[split]`; a second kernel
// adds the splits in order and writes or adds into dw.
//
// WG_* are tuning knobs for benches/pytorch/wgrad_kernel_probe.py (the defaults are the kernel
// nnfuse runs): WG_KPT filters per thread, WG_DY_ONCE dy held per strip instead of re-read per
// filter row, WG_MINB blocks per SM, WG_NOSTAGE / WG_NOCOMPUTE (wrong results: where the time
// goes).

#ifndef WG_KPT
#define WG_KPT 8
#endif
#ifndef WG_DY_ONCE
#define WG_DY_ONCE 0
#endif
#ifndef WG_NOSTAGE
#define WG_NOSTAGE 0
#endif
#ifndef WG_NOCOMPUTE
#define WG_NOCOMPUTE 0
#endif
#ifndef WG_MINB
#define WG_MINB 2
#endif
constexpr u32 THREADS = 256;
constexpr u32 CT = 32;       // input channels per block (direct_filter.rs: CT): a warp's 32
                             // threads take 32 channels of the same filters, so its dy reads
                             // are broadcasts and its x reads hit 32 distinct banks
constexpr u32 KPT = WG_KPT;  // filters per thread
constexpr u32 KT = KPT * (THREADS / CT);  // filters per block (problem/direct_filter.rs: KT)
constexpr u32 SEG = 64;      // output columns per unit (direct_filter.rs: SEG)
constexpr u32 STRIP = 8;     // output columns per inner step
constexpr u32 XW = SEG + 3;  // staged x row: SEG + 2 halo columns, +1 so that 3*XW is odd (banks)
constexpr u32 DYW = SEG + 4; // staged dy row: 16-byte aligned, and NHWC's k-major stores spread
static_assert(THREADS * KPT == CT * KT, "one thread per channel and KPT filters");
static_assert(SEG % STRIP == 0, "strips tile a segment");

// Mirrors WgradGeom in src/conv/direct_filter.rs (a CPU test checks the size).
struct WgradGeom {
    u32 n, c, h, w, k;
    u32 oh, ow;
    int ph, pw;
    u32 segs;    // ceil(ow / SEG)
    u32 units;   // n * oh * segs
    u32 splits;  // gridDim.x: unit ranges
};
static_assert(sizeof(WgradGeom) == 48, "WgradGeom must match src/conv/direct_filter.rs");

// Per-thread share of one unit's stage: dy's KT x SEG values, and x's CT x 3 rows of SEG
// columns (4 rows a step) plus their 2 halo columns (one extra step) — or, for NHWC, the
// CT x 3 x (SEG + 2) values channel-fastest (8 positions a step).
constexpr u32 DPT = KT * SEG / THREADS;                                  // 8
constexpr u32 XPT = (CT * 3 * (SEG + 2) + THREADS - 1) / THREADS;        // 25
static_assert(THREADS % SEG == 0 && THREADS % KT == 0 && KT * SEG % THREADS == 0,
              "dy's stage: one column (or filter) per thread and step");
static_assert(CT * 3 % (THREADS / SEG) == 0 && CT * 3 / (THREADS / SEG) == XPT - 1,
              "x's stage: 4 rows a step, then the halo columns");
static_assert(CT * 3 * 2 <= THREADS, "one step stages the halo columns");

struct Unit {
    u32 n, ho, wo0;
};

__device__ __forceinline__ Unit unit_of(u32 u, const WgradGeom& g) {
    const u32 seg = u % g.segs, row = u / g.segs;  // row = n * oh + ho
    return Unit{row / g.oh, row % g.oh, seg * SEG};
}

// Where value q of this thread's share sits in the stage: dy (filter kk, column j) and x
// (channel cc, filter row r, column j; `ok` false past the stage). Independent of the unit.
template <bool NHWC>
__device__ __forceinline__ void dy_slot(u32 q, u32& kk, u32& j) {
    if (NHWC) { kk = threadIdx.x % KT; j = threadIdx.x / KT + q * (THREADS / KT); }
    else { j = threadIdx.x % SEG; kk = threadIdx.x / SEG + q * (THREADS / SEG); }
}
template <bool NHWC>
__device__ __forceinline__ bool x_slot(u32 q, u32& cc, u32& r, u32& j) {
    if (NHWC) {
        cc = threadIdx.x % CT;
        const u32 pos = threadIdx.x / CT + q * (THREADS / CT);
        r = pos / (SEG + 2);
        j = pos % (SEG + 2);
        return pos < 3 * (SEG + 2);
    }
    u32 row;
    if (q + 1 < XPT) {
        row = threadIdx.x / SEG + q * (THREADS / SEG);
        j = threadIdx.x % SEG;
    } else {
        row = threadIdx.x / 2;
        j = SEG + threadIdx.x % 2;
    }
    cc = row / 3;
    r = row % 3;
    return row < CT * 3;
}

// 4 bytes global -> shared, asynchronous; `ok` false zero-fills without reading (`src` must
// still be a valid address).
__device__ __forceinline__ void cp4(float* smem, const float* src, bool ok) {
    u32 dst;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(dst) : "l"(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(ok ? 4u : 0u)
                 : "memory");
}

// One unit's stage in shared memory: dy's KT rows of SEG columns, x's CT x 3 rows of SEG + 2.
constexpr u32 STAGE = KT * DYW + CT * 3 * XW;  // floats (src/conv/direct_filter.rs: SMEM_BYTES)
static_assert(KT * DYW % 4 == 0 && STAGE % 4 == 0, "stages and x rows start 16-byte aligned");

// Queues the copies of unit u's stage into `dys` / `xs` (zero outside the tensors): they land
// while the previous unit is computed.
template <bool NHWC>
__device__ __forceinline__ void stage_unit(const float* __restrict__ x,
                                           const float* __restrict__ dy, const WgradGeom& g,
                                           u32 u, u32 c0, u32 k0, float* dys, float* xs) {
    const Unit t = unit_of(u, g);
#pragma unroll 2
    for (u32 q = 0; q < DPT; ++q) {
        u32 kk, j;
        dy_slot<NHWC>(q, kk, j);
        const u32 k = k0 + kk, wo = t.wo0 + j;
        const bool ok = k < g.k && wo < g.ow;
        const u64 idx = !ok ? 0
                        : NHWC ? (((u64)t.n * g.oh + t.ho) * g.ow + wo) * g.k + k
                               : (((u64)t.n * g.k + k) * g.oh + t.ho) * g.ow + wo;
        cp4(dys + kk * DYW + j, dy + idx, ok);
    }
#pragma unroll 2
    for (u32 q = 0; q < XPT; ++q) {
        u32 cc, r, j;
        if (!x_slot<NHWC>(q, cc, r, j)) continue;
        const u32 c = c0 + cc;
        const int hi = (int)(t.ho + r) - g.ph;
        const int wi = (int)(t.wo0 + j) - g.pw;
        const bool ok = c < g.c && hi >= 0 && hi < (int)g.h && wi >= 0 && wi < (int)g.w;
        const u64 idx = !ok ? 0
                        : NHWC ? (((u64)t.n * g.h + hi) * g.w + wi) * g.c + c
                               : (((u64)t.n * g.c + c) * g.h + hi) * g.w + wi;
        cp4(xs + (cc * 3 + r) * XW + j, x + idx, ok);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <bool NHWC>
__device__ __forceinline__ void wgrad3x3(const float* __restrict__ x, const float* __restrict__ dy,
                                         float* __restrict__ part, const WgradGeom g) {
    extern __shared__ __align__(16) float smem[];  // two stages: unit i in stage i % 2
    const u32 tid = threadIdx.x;
    const u32 ci = tid % CT, kg = tid / CT;
    const u32 c0 = blockIdx.y * CT, k0 = blockIdx.z * KT;
    const u32 split = blockIdx.x;
    const u32 u_begin = (u32)(((u64)split * g.units) / g.splits);
    const u32 u_end = (u32)(((u64)(split + 1) * g.units) / g.splits);
    float acc[KPT][9];
#pragma unroll
    for (u32 a = 0; a < KPT; ++a)
#pragma unroll
        for (u32 t = 0; t < 9; ++t) acc[a][t] = 0.0f;
    if (u_begin < u_end) stage_unit<NHWC>(x, dy, g, u_begin, c0, k0, smem, smem + KT * DYW);

    for (u32 u = u_begin; u < u_end; ++u) {
        const u32 wo0 = unit_of(u, g).wo0;
        const float* const dys = smem + ((u - u_begin) % 2) * STAGE;
        const float* const xs = dys + KT * DYW;
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        // Unit u's stage has landed for every thread, and every thread is done with the stage
        // the next copies overwrite (unit u - 1's).
        __syncthreads();
        if (!WG_NOSTAGE && u + 1 < u_end) {
            float* const next = smem + ((u + 1 - u_begin) % 2) * STAGE;
            stage_unit<NHWC>(x, dy, g, u + 1, c0, k0, next, next + KT * DYW);
        }
        const u32 cols = WG_NOCOMPUTE ? 0 : min(SEG, g.ow - wo0);
        for (u32 w0 = 0; w0 < cols; w0 += STRIP) {
#if WG_DY_ONCE
            float dd[KPT][STRIP];
#pragma unroll
            for (u32 a = 0; a < KPT; ++a) {
                const float4 lo = *reinterpret_cast<const float4*>(&dys[(kg * KPT + a) * DYW + w0]);
                const float4 hi =
                    *reinterpret_cast<const float4*>(&dys[(kg * KPT + a) * DYW + w0 + 4]);
                dd[a][0] = lo.x; dd[a][1] = lo.y; dd[a][2] = lo.z; dd[a][3] = lo.w;
                dd[a][4] = hi.x; dd[a][5] = hi.y; dd[a][6] = hi.z; dd[a][7] = hi.w;
            }
#endif
#pragma unroll
            for (u32 r = 0; r < 3; ++r) {
                float xv[STRIP + 2];
#pragma unroll
                for (u32 j = 0; j < STRIP + 2; ++j) xv[j] = xs[(ci * 3 + r) * XW + w0 + j];
#pragma unroll
                for (u32 a = 0; a < KPT; ++a) {
#if WG_DY_ONCE
                    const float* d = dd[a];
#else
                    // dy is re-read per filter row (two 16-byte loads): fewer registers.
                    const float4 lo = *reinterpret_cast<const float4*>(&dys[(kg * KPT + a) * DYW + w0]);
                    const float4 hi =
                        *reinterpret_cast<const float4*>(&dys[(kg * KPT + a) * DYW + w0 + 4]);
                    const float d[STRIP] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#endif
#pragma unroll
                    for (u32 s = 0; s < 3; ++s)
#pragma unroll
                        for (u32 j = 0; j < STRIP; ++j)
                            acc[a][r * 3 + s] = fmaf(d[j], xv[j + s], acc[a][r * 3 + s]);
                }
            }
        }
    }
    // Partial sums of this split, KCRS over the whole filter.
    const u32 c = c0 + ci;
    if (c >= g.c) return;
#pragma unroll
    for (u32 a = 0; a < KPT; ++a) {
        const u32 k = k0 + kg * KPT + a;
        if (k >= g.k) continue;
        float* p = part + (((u64)split * g.k + k) * g.c + c) * 9;
#pragma unroll
        for (u32 t = 0; t < 9; ++t) p[t] = acc[a][t];
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, WG_MINB)
    conv_wgrad3x3_nchw_f32(const float* __restrict__ x, const float* __restrict__ dy,
                           float* __restrict__ part, WgradGeom g) {
    wgrad3x3<false>(x, dy, part, g);
}

extern "C" __global__ void __launch_bounds__(THREADS, WG_MINB)
    conv_wgrad3x3_nhwc_f32(const float* __restrict__ x, const float* __restrict__ dy,
                           float* __restrict__ part, WgradGeom g) {
    wgrad3x3<true>(x, dy, part, g);
}

// dw = (accumulate ? dw : 0) + the splits' partial sums, added in split order. One thread per
// element of dw, in dw's order (KCRS, or KRSC for NHWC); the partials are KCRS.
extern "C" __global__ void conv_wgrad_reduce_f32(const float* __restrict__ part,
                                                 float* __restrict__ dw, u32 k, u32 c,
                                                 u32 splits, u32 nhwc, u32 accumulate) {
    const u64 elems = (u64)k * c * 9;
    for (u64 i = global_thread(); i < elems; i += grid_threads()) {
        u64 src = i;  // KCRS index of dw's element i
        if (nhwc) {
            const u64 cc = i % c, rs = (i / c) % 9, kk = i / ((u64)c * 9);
            src = (kk * c + cc) * 9 + rs;
        }
        float sum = accumulate ? dw[i] : 0.0f;
        for (u32 s = 0; s < splits; ++s) sum += part[(u64)s * elems + src];
        dw[i] = sum;
    }
}

