// im2col, col2im (gather) and the f32 accumulation of filter-gradient partials, for the
// im2col + GEMM convolution path. Layouts (src/reference/conv.rs): with P = oh*ow output pixels
// and K = c_in*kh*kw taps per image,
//  * NCHW columns: element (b, q, p) at b*col_img + q*col_row + p, q = (c*kh + r)*kw + s.
//    The reference layout [n][K][P] is col_img = K*P, col_row = P; the filter gradient uses
//    [K][chunk][P] (col_img = P, col_row = chunk*P) so that a chunk's images form one matrix.
//  * NHWC columns: element (b, p, q) at b*col_img + p*K + q, q = (r*kw + s)*c_in + c: each
//    pixel's patch is contiguous, and each tap's c_in run is contiguous in x and in the columns.
//
// im2col work mapping (the index math costs less than the memory time, so that the copy runs at
// bandwidth):
//  * NCHW, Caffe's scheme: one thread per (c, output pixel) of an image, looping over the kh*kw
//    taps of its channel (EPT taps' loads before their stores). The channel/pixel decomposition
//    is paid once per kh*kw items; for a fixed tap consecutive threads write consecutive pixels
//    of one row (coalesced) and read consecutive input columns.
//  * NHWC: one warp per output pixel (column row) at a time; its lanes cover the K items of the
//    pixel's patch (contiguous in the columns: coalesced), EPT per lane in flight. An item q is
//    (r, j) with j = s*c_in + c: with dilation 1 along the width, j is also the offset in the
//    input row (the s and c of a filter row are one contiguous run in x), so one division per
//    item suffices.
// gridDim.y strides over the images of the chunk. Per-image indices are 32-bit (the launcher
// keeps every per-image count below 2^31); image offsets are 64-bit. Divisions by the shape's
// runtime extents use precomputed magic numbers (FastDiv; host side and CPU tests in
// src/conv/im2col/launch.rs).
//
// im2col only copies, so its kernels are typed by size: b2 (f16/bf16), b4 (f32), and for NHWC
// b8/b16 copy units of several channels when c_in's run is a whole number of units and both
// pointers are aligned to the unit (the launcher passes the geometry in units). Padding writes
// all-zero bits, +0.0 in every type.
//
// col2im is a gather: each input element sums, in f32 and in the fixed tap order (r, s), the
// column entries that read it, then rounds once: deterministic, no atomics. One thread per input
// element (or 16-byte unit of NHWC channels).

constexpr u32 THREADS = 256;  // threads per block (src/conv/im2col/launch.rs: THREADS)
constexpr u32 WARPS = THREADS / 32;
constexpr u32 EPT = 4;        // items per thread in flight (launch.rs: EPT)

// n / d for n < 2^31: (umulhi(n, mul) + n) >> shift, with shift = ceil(log2 d) and
// mul = ceil(2^(32+shift) / d) - 2^32.
struct FastDiv {
    u32 d, mul, shift;
};
__device__ __forceinline__ u32 fdiv(u32 n, const FastDiv& f) {
    return (__umulhi(n, f.mul) + n) >> f.shift;
}

// Mirrors ColGeom in src/conv/im2col/launch.rs field for field (a CPU test checks the size).
struct ColGeom {
    u64 x_img;    // units between images of x (the source of im2col, the output of col2im)
    u64 col_img;  // units between images of the columns
    u64 col_row;  // NCHW: units between consecutive taps q of the columns
    u32 count;    // threads' work items per image (NHWC im2col: unused)
    u32 c_in;     // channels (NHWC unit kernels: units per pixel of x)
    u32 h, w;
    u32 kh, kw;
    u32 oh, ow;
    u32 pixels;   // oh*ow
    u32 taps;     // K = c_in*kh*kw (NHWC unit kernels: units per pixel of the columns)
    u32 khkw;     // kh*kw
    u32 kwc;      // kw*c_in: the units of one filter row (NHWC)
    u32 wc;       // w*c_in: the units of one input row (NHWC)
    u32 unused;
    int sh, sw, ph, pw, dh, dw;
    FastDiv d_ow, d_cin, d_pixels, d_kwc, d_w, d_hw, d_sh, d_sw;
};
static_assert(sizeof(ColGeom) == 200, "ColGeom must match src/conv/im2col/launch.rs");

// --- im2col --------------------------------------------------------------------------------

// The element under a tap, or zero bits in the padding. Branch-free (the address is clamped to
// the plane's first element, which is always valid), so that the compiler keeps the address
// arithmetic hoisted and the EPT loads independent.
template <typename E>
__device__ __forceinline__ E tap_value(const E* plane, bool inside, u32 at) {
    const E v = plane[inside ? at : 0u];
    return inside ? v : E{};
}

template <typename E>
__device__ __forceinline__ void im2col_nchw(const E* __restrict__ x, E* __restrict__ cols,
                                            const ColGeom& g, u32 images) {
    const u32 e = blockIdx.x * THREADS + threadIdx.x;  // (c, p) of an image
    if (e >= g.count) return;
    const u32 c = fdiv(e, g.d_pixels), p = e - c * g.pixels;
    const u32 oy = fdiv(p, g.d_ow), ox = p - oy * g.ow;
    const int iy0 = (int)oy * g.sh - g.ph;
    const int ix0 = (int)ox * g.sw - g.pw;
    for (u32 b = blockIdx.y; b < images; b += gridDim.y) {
        // The channel's plane; offsets inside an image are 32-bit.
        const E* plane = x + (u64)b * g.x_img + c * g.h * g.w;
        E* dst = cols + (u64)b * g.col_img + (u64)(c * g.khkw) * g.col_row + p;
        int iy = iy0, ix = ix0;  // under tap t: (r, s) = (t / kw, t % kw)
        u32 s = 0, t = 0;
        for (; t + EPT <= g.khkw; t += EPT) {
            E v[EPT];
#pragma unroll
            for (u32 j = 0; j < EPT; ++j) {
                const bool inside = (u32)iy < g.h && (u32)ix < g.w;
                v[j] = tap_value(plane, inside, (u32)iy * g.w + (u32)ix);
                ix += g.dw;
                if (++s == g.kw) {
                    s = 0;
                    ix = ix0;
                    iy += g.dh;
                }
            }
#pragma unroll
            for (u32 j = 0; j < EPT; ++j) {
                *dst = v[j];  // tap t + j's row
                dst += g.col_row;
            }
        }
        for (; t < g.khkw; ++t) {
            const bool inside = (u32)iy < g.h && (u32)ix < g.w;
            *dst = tap_value(plane, inside, (u32)iy * g.w + (u32)ix);
            dst += g.col_row;
            ix += g.dw;
            if (++s == g.kw) {
                s = 0;
                ix = ix0;
                iy += g.dh;
            }
        }
    }
}

template <typename E, bool DW1>
__device__ __forceinline__ void im2col_nhwc(const E* __restrict__ x, E* __restrict__ cols,
                                            const ColGeom& g, u32 images) {
    const u32 lane = threadIdx.x & 31;
    const u32 first = blockIdx.x * WARPS + (threadIdx.x >> 5);
    for (u32 b = blockIdx.y; b < images; b += gridDim.y) {
        const E* xb = x + (u64)b * g.x_img;
        E* cb = cols + (u64)b * g.col_img;
        for (u32 p = first; p < g.pixels; p += gridDim.x * WARPS) {
            const u32 oy = fdiv(p, g.d_ow), ox = p - oy * g.ow;
            const int iy0 = (int)oy * g.sh - g.ph;
            const int ix0 = (int)ox * g.sw - g.pw;
            E* row = cb + (u64)p * g.taps;
            for (u32 q0 = 0; q0 < g.taps; q0 += 32 * EPT) {
                E v[EPT];
#pragma unroll
                for (u32 j = 0; j < EPT; ++j) {
                    // Clamped into the row: loaded always, stored below only when in range.
                    const u32 q = min(q0 + j * 32 + lane, g.taps - 1);
                    const u32 r = fdiv(q, g.d_kwc), jj = q - r * g.kwc;
                    const int iy = iy0 + (int)r * g.dh;
                    if constexpr (DW1) {
                        // s and c fused: jj is the offset from input column ix0 in the input row.
                        const int xc = ix0 * (int)g.c_in + (int)jj;
                        v[j] = tap_value(xb, (u32)iy < g.h && (u32)xc < g.wc,
                                         (u32)iy * g.wc + (u32)xc);
                    } else {
                        const u32 s = fdiv(jj, g.d_cin), c = jj - s * g.c_in;
                        const int ix = ix0 + (int)s * g.dw;
                        v[j] = tap_value(xb, (u32)iy < g.h && (u32)ix < g.w,
                                         ((u32)iy * g.w + (u32)ix) * g.c_in + c);
                    }
                }
#pragma unroll
                for (u32 j = 0; j < EPT; ++j) {
                    const u32 q = q0 + j * 32 + lane;
                    if (q < g.taps) row[q] = v[j];
                }
            }
        }
    }
}

// --- col2im (gather) -----------------------------------------------------------------------

// 16 bytes of T as floats (little-endian: element 2i is the low half of word i).
template <typename T> struct Unit16;
template <> struct Unit16<float> {
    static constexpr int N = 4;
    __device__ static void add(float* acc, const uint4& v) {
        acc[0] += __uint_as_float(v.x);
        acc[1] += __uint_as_float(v.y);
        acc[2] += __uint_as_float(v.z);
        acc[3] += __uint_as_float(v.w);
    }
    __device__ static uint4 pack(const float* a) {
        return make_uint4(__float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]),
                          __float_as_uint(a[3]));
    }
};
template <typename H> struct Unit16Half {
    static constexpr int N = 8;
    __device__ static float lo(u32 w) {
        H h;
        h.bits = (unsigned short)(w & 0xffffu);
        return to_float(h);
    }
    __device__ static float hi(u32 w) {
        H h;
        h.bits = (unsigned short)(w >> 16);
        return to_float(h);
    }
    __device__ static void add(float* acc, const uint4& v) {
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc[2 * i] += lo(w[i]);
            acc[2 * i + 1] += hi(w[i]);
        }
    }
    __device__ static uint4 pack(const float* a) {
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            w[i] = (u32)from_float<H>(a[2 * i]).bits |
                   ((u32)from_float<H>(a[2 * i + 1]).bits << 16);
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
};
template <> struct Unit16<nnf_f16> : Unit16Half<nnf_f16> {};
template <> struct Unit16<nnf_bf16> : Unit16Half<nnf_bf16> {};

// Output pixel index along one axis whose tap k reads input index i: o*stride + k*dil - pad = i.
// Returns false when there is none (t not a multiple of the stride, or o past the output).
__device__ __forceinline__ bool out_of(int t, int stride, const FastDiv& ds, u32 out, u32& o) {
    if (stride == 1) {  // uniform across the grid
        o = (u32)t;
        return o < out;
    }
    o = fdiv((u32)t, ds);
    return (int)(o * (u32)stride) == t && o < out;
}

template <typename T>
__device__ __forceinline__ void col2im_nchw(const T* __restrict__ cols, T* __restrict__ x,
                                            const ColGeom& g, u32 images) {
    const u32 first = blockIdx.x * (THREADS * EPT) + threadIdx.x;
    for (u32 b = blockIdx.y; b < images; b += gridDim.y) {
        const T* cb = cols + (u64)b * g.col_img;
        T* xb = x + (u64)b * g.x_img;
        for (u32 j = 0; j < EPT; ++j) {
            const u32 e = first + j * THREADS;
            if (e >= g.count) break;
            const u32 c = fdiv(e, g.d_hw), pix = e - c * g.d_hw.d;
            const u32 iy = fdiv(pix, g.d_w), ix = pix - iy * g.w;
            float acc = 0.0f;
            for (u32 r = 0; r < g.kh; ++r) {
                const int ty = (int)iy + g.ph - (int)r * g.dh;
                if (ty < 0) break;  // ty only decreases with r
                u32 oy;
                if (!out_of(ty, g.sh, g.d_sh, g.oh, oy)) continue;
                for (u32 s = 0; s < g.kw; ++s) {
                    const int tx = (int)ix + g.pw - (int)s * g.dw;
                    if (tx < 0) break;
                    u32 ox;
                    if (!out_of(tx, g.sw, g.d_sw, g.ow, ox)) continue;
                    const u32 q = (c * g.kh + r) * g.kw + s;
                    // The reference layout: col_row = P, and an image's columns are < 2^31.
                    acc += to_float(cb[q * (u32)g.col_row + oy * g.ow + ox]);
                }
            }
            xb[e] = from_float<T>(acc);
        }
    }
}

// NHWC, one channel (scalar) or one 16-byte unit of channels (VEC) per work item.
template <typename T, bool VEC>
__device__ __forceinline__ void col2im_nhwc(const T* __restrict__ cols, T* __restrict__ x,
                                            const ColGeom& g, u32 images) {
    constexpr int N = VEC ? Unit16<T>::N : 1;
    const u32 first = blockIdx.x * (THREADS * EPT) + threadIdx.x;
    for (u32 b = blockIdx.y; b < images; b += gridDim.y) {
        const T* cb = cols + (u64)b * g.col_img * N;
        T* xb = x + (u64)b * g.x_img * N;
        for (u32 j = 0; j < EPT; ++j) {
            const u32 e = first + j * THREADS;
            if (e >= g.count) break;
            const u32 pix = fdiv(e, g.d_cin), c = e - pix * g.c_in;
            const u32 iy = fdiv(pix, g.d_w), ix = pix - iy * g.w;
            float acc[N];
#pragma unroll
            for (int i = 0; i < N; ++i) acc[i] = 0.0f;
            for (u32 r = 0; r < g.kh; ++r) {
                const int ty = (int)iy + g.ph - (int)r * g.dh;
                if (ty < 0) break;
                u32 oy;
                if (!out_of(ty, g.sh, g.d_sh, g.oh, oy)) continue;
                for (u32 s = 0; s < g.kw; ++s) {
                    const int tx = (int)ix + g.pw - (int)s * g.dw;
                    if (tx < 0) break;
                    u32 ox;
                    if (!out_of(tx, g.sw, g.d_sw, g.ow, ox)) continue;
                    const u32 at = (oy * g.ow + ox) * g.taps + (r * g.kw + s) * g.c_in + c;
                    if constexpr (VEC) {
                        Unit16<T>::add(acc, reinterpret_cast<const uint4*>(cb)[at]);
                    } else {
                        acc[0] += to_float(cb[at]);
                    }
                }
            }
            if constexpr (VEC) {
                reinterpret_cast<uint4*>(xb)[e] = Unit16<T>::pack(acc);
            } else {
                xb[e] = from_float<T>(acc[0]);
            }
        }
    }
}

// --- filter-gradient partials --------------------------------------------------------------

// mode bits (src/conv/im2col/steps.rs: AccMode): 1 = add the accumulator (else start it from the
// partial); 2 = write the result to out in T (else to the f32 accumulator); 4 = add out's old
// value first (dw += ...). Sums in f32, in the order acc + part, then old + that; one rounding.
template <typename T>
__device__ __forceinline__ void accumulate(const T* __restrict__ part, float* __restrict__ acc,
                                           T* __restrict__ out, u64 len, u32 mode) {
    for (u64 i = global_thread(); i < len; i += grid_threads()) {
        float s = to_float(part[i]);
        if (mode & 1u) s = acc[i] + s;
        if (mode & 2u) {
            if (mode & 4u) s = to_float(out[i]) + s;
            out[i] = from_float<T>(s);
        } else {
            acc[i] = s;
        }
    }
}

// --- entry points --------------------------------------------------------------------------

#define NNF_IM2COL_UNIT(E, S)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        im2col_nhwc_##S(const E* x, E* cols, ColGeom g, u32 images) {                             \
        if (g.dw == 1)                                                                            \
            im2col_nhwc<E, true>(x, cols, g, images);                                             \
        else                                                                                      \
            im2col_nhwc<E, false>(x, cols, g, images);                                            \
    }

NNF_IM2COL_UNIT(unsigned short, b2)
NNF_IM2COL_UNIT(u32, b4)
NNF_IM2COL_UNIT(uint2, b8)
NNF_IM2COL_UNIT(uint4, b16)

extern "C" __global__ void __launch_bounds__(THREADS)
    im2col_nchw_b2(const unsigned short* x, unsigned short* cols, ColGeom g, u32 images) {
    im2col_nchw<unsigned short>(x, cols, g, images);
}
extern "C" __global__ void __launch_bounds__(THREADS)
    im2col_nchw_b4(const u32* x, u32* cols, ColGeom g, u32 images) {
    im2col_nchw<u32>(x, cols, g, images);
}

#define NNF_COL2IM(T, S)                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        col2im_nchw_##S(const T* cols, T* x, ColGeom g, u32 images) {                             \
        col2im_nchw<T>(cols, x, g, images);                                                       \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        col2im_nhwc_##S(const T* cols, T* x, ColGeom g, u32 images) {                             \
        col2im_nhwc<T, false>(cols, x, g, images);                                                \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        col2im_nhwc_vec_##S(const T* cols, T* x, ColGeom g, u32 images) {                         \
        col2im_nhwc<T, true>(cols, x, g, images);                                                 \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        conv_accumulate_##S(const T* part, float* acc, T* out, u64 len, u32 mode) {               \
        accumulate<T>(part, acc, out, len, mode);                                                 \
    }

NNF_COL2IM(float, f32)
NNF_COL2IM(nnf_f16, f16)
NNF_COL2IM(nnf_bf16, bf16)
