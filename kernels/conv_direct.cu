// Direct 2-D convolution (cross-correlation, src/reference/conv.rs): any shape, stride, padding,
// dilation, NCHW/KCRS or NHWC/KRSC, f32 accumulation, no workspace. The fallback when nothing
// else runs, and (its f32-output variant) the reference of the dispatcher's numerical check:
// correctness and determinism first.
//
// A block takes THREADS consecutive output pixels (flattened over the batch: one per thread)
// and KT consecutive output channels; each thread keeps KT f32 sums. The filter taps of the
// block's KT channels are staged in shared memory TT at a time (f32, tap-major so that one
// tap's KT weights are two float4 broadcasts), and every thread walks them in the filter's
// memory order — (c, r, s) for KCRS, (r, s, c) for KRSC — reading the input value under each
// tap once for all KT channels. The order is fixed, so results are deterministic. Output writes
// are coalesced for NCHW (consecutive threads, consecutive pixels of a channel plane).
// Indices of pixels and elements are 64-bit; per-image extents stay below 2^31 (checked by the
// launcher, src/conv/direct.rs).

constexpr u32 THREADS = 256;  // pixels per block (src/conv/direct.rs: THREADS)
constexpr u32 KT = 8;         // output channels per block (direct.rs: KT)
constexpr u32 TT = THREADS;   // taps staged per round: one per thread and channel

// Mirrors DirectGeom in src/conv/direct.rs (a CPU test checks the size).
struct DirectGeom {
    u64 pixels;  // n * oh * ow
    u64 x_img;   // c_in * h * w
    u32 c_in, h, w, c_out, kh, kw, oh, ow;
    int sh, sw, ph, pw, dh, dw;
    u32 P;       // oh * ow
    u32 K;       // c_in * kh * kw
    u32 groups;  // ceil(c_out / KT)
    u32 unused;
};
static_assert(sizeof(DirectGeom) == 88, "DirectGeom must match src/conv/direct.rs");
static_assert(KT == 8, "the inner loop reads KT weights as two float4");

template <typename T, typename O, bool NHWC>
__device__ __forceinline__ void direct(const T* __restrict__ x, const T* __restrict__ wt,
                                       O* __restrict__ y, const DirectGeom& g) {
    __shared__ __align__(16) float ws[TT][KT];
    const u64 pixel_blocks = (g.pixels + THREADS - 1) / THREADS;
    for (u32 grp = blockIdx.y; grp < g.groups; grp += gridDim.y) {
        const u32 k0 = grp * KT;
        for (u64 pb = blockIdx.x; pb < pixel_blocks; pb += gridDim.x) {
            const u64 pix = pb * THREADS + threadIdx.x;
            const bool active = pix < g.pixels;
            const u64 b = active ? pix / g.P : 0;
            const u32 p = active ? (u32)(pix - b * g.P) : 0;
            const u32 oy = p / g.ow, ox = p - oy * g.ow;
            const int iy0 = (int)oy * g.sh - g.ph;
            const int ix0 = (int)ox * g.sw - g.pw;
            const T* xb = x + b * g.x_img;
            float acc[KT];
#pragma unroll
            for (u32 kk = 0; kk < KT; ++kk) acc[kk] = 0.0f;
            for (u32 t0 = 0; t0 < g.K; t0 += TT) {
                __syncthreads();  // the previous round's taps have been read
                const u32 t = t0 + threadIdx.x;
#pragma unroll
                for (u32 kk = 0; kk < KT; ++kk)
                    ws[threadIdx.x][kk] = (t < g.K && k0 + kk < g.c_out)
                                              ? to_float(wt[(u64)(k0 + kk) * g.K + t])
                                              : 0.0f;
                __syncthreads();
                const u32 nt = min(TT, g.K - t0);
                // Tap t0 in the filter's memory order.
                u32 c, r, s;
                if (NHWC) {
                    const u32 rs = t0 / g.c_in;
                    c = t0 - rs * g.c_in;
                    r = rs / g.kw;
                    s = rs - r * g.kw;
                } else {
                    const u32 khkw = g.kh * g.kw;
                    c = t0 / khkw;
                    const u32 rs = t0 - c * khkw;
                    r = rs / g.kw;
                    s = rs - r * g.kw;
                }
                for (u32 tt = 0; tt < nt; ++tt) {
                    const int iy = iy0 + (int)r * g.dh;
                    const int ix = ix0 + (int)s * g.dw;
                    float xv = 0.0f;
                    if (active && (u32)iy < g.h && (u32)ix < g.w) {
                        const u64 at = NHWC ? ((u64)(u32)iy * g.w + (u32)ix) * g.c_in + c
                                            : ((u64)c * g.h + (u32)iy) * g.w + (u32)ix;
                        xv = to_float(xb[at]);
                    }
                    const float4 w0 = *reinterpret_cast<const float4*>(&ws[tt][0]);
                    const float4 w1 = *reinterpret_cast<const float4*>(&ws[tt][4]);
                    acc[0] = fmaf(xv, w0.x, acc[0]);
                    acc[1] = fmaf(xv, w0.y, acc[1]);
                    acc[2] = fmaf(xv, w0.z, acc[2]);
                    acc[3] = fmaf(xv, w0.w, acc[3]);
                    acc[4] = fmaf(xv, w1.x, acc[4]);
                    acc[5] = fmaf(xv, w1.y, acc[5]);
                    acc[6] = fmaf(xv, w1.z, acc[6]);
                    acc[7] = fmaf(xv, w1.w, acc[7]);
                    // The next tap in memory order.
                    if (NHWC) {
                        if (++c == g.c_in) {
                            c = 0;
                            if (++s == g.kw) {
                                s = 0;
                                ++r;
                            }
                        }
                    } else {
                        if (++s == g.kw) {
                            s = 0;
                            if (++r == g.kh) {
                                r = 0;
                                ++c;
                            }
                        }
                    }
                }
            }
            if (active) {
#pragma unroll
                for (u32 kk = 0; kk < KT; ++kk) {
                    const u32 k = k0 + kk;
                    if (k < g.c_out) {
                        const u64 at = NHWC ? (b * g.P + p) * g.c_out + k
                                            : (b * g.c_out + k) * g.P + p;
                        y[at] = from_float<O>(acc[kk]);
                    }
                }
            }
        }
    }
}

#define NNF_DIRECT(T, S)                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        conv_direct_nchw_##S(const T* x, const T* w, T* y, DirectGeom g) {                        \
        direct<T, T, false>(x, w, y, g);                                                          \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        conv_direct_nhwc_##S(const T* x, const T* w, T* y, DirectGeom g) {                        \
        direct<T, T, true>(x, w, y, g);                                                           \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        conv_direct_nchw_##S##_f32out(const T* x, const T* w, float* y, DirectGeom g) {           \
        direct<T, float, false>(x, w, y, g);                                                      \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        conv_direct_nhwc_##S##_f32out(const T* x, const T* w, float* y, DirectGeom g) {           \
        direct<T, float, true>(x, w, y, g);                                                       \
    }

NNF_DIRECT(float, f32)
NNF_DIRECT(nnf_f16, f16)
NNF_DIRECT(nnf_bf16, bf16)
