// im2col, col2im (gather) and the f32 accumulation of filter-gradient partials, for the
// im2col + GEMM convolution path. Layouts (src/reference/conv.rs): with P = oh*ow output pixels
// and K = c_in*kh*kw taps per image,
//  * NCHW columns: element (b, q, p) at b*col_img + q*col_row + p, q = (c*kh + r)*kw + s.
//    The reference layout [n][K][P] is col_img = K*P, col_row = P; the filter gradient uses
//    [K][chunk][P] (col_img = P, col_row = chunk*P) so that a chunk's images form one matrix.
//  * NHWC columns: element (b, p, q) at b*col_img + p*K + q, q = (r*kw + s)*c_in + c: each
//    pixel's patch is contiguous, and each tap's c_in run is contiguous in x and in the columns.
//
// Work items: one thread takes EPT items of one image, THREADS apart (so that consecutive threads
// own consecutive items: coalesced stores), issuing all loads before any store; gridDim.x covers
// an image's items, blockIdx.y strides over the images of the chunk. The item index of an image
// is 32-bit (the launcher keeps every per-image count below 2^31); image offsets are 64-bit.
// Divisions by the shape's runtime extents use precomputed magic numbers (FastDiv; host side and
// CPU tests in src/conv/im2col/launch.rs), so the index math stays far below the memory time.
//
// im2col only copies, so its kernels are typed by size: b2 (f16/bf16), b4 (f32), and for NHWC
// b8/b16 copy units of several channels when c_in's run is a whole number of units and both
// pointers are aligned to the unit (the launcher passes the geometry in units). Padding writes
// all-zero bits, +0.0 in every type.
//
// col2im is a gather: each input element sums, in f32 and in the fixed tap order (r, s), the
// column entries that read it, then rounds once: deterministic, no atomics.

constexpr u32 THREADS = 256;  // threads per block (src/conv/im2col/launch.rs: THREADS)
constexpr u32 EPT = 4;        // work items per thread (launch.rs: EPT)

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
    u32 count;    // work items per image
    u32 c_in;     // channels (NHWC unit kernels: units per pixel of x)
    u32 h, w;
    u32 kh, kw;
    u32 oh, ow;
    u32 pixels;   // oh*ow
    u32 taps;     // K (NHWC unit kernels: units per pixel of the columns)
    int sh, sw, ph, pw, dh, dw;
    FastDiv d_ow, d_kw, d_khkw, d_cin, d_pixels, d_taps, d_w, d_hw, d_sh, d_sw;
};
static_assert(sizeof(ColGeom) == 208, "ColGeom must match src/conv/im2col/launch.rs");

// --- im2col --------------------------------------------------------------------------------

template <typename E>
__device__ __forceinline__ void im2col_nchw(const E* __restrict__ x, E* __restrict__ cols,
                                            const ColGeom& g, u32 images) {
    const u32 first = blockIdx.x * (THREADS * EPT) + threadIdx.x;
    for (u32 b = blockIdx.y; b < images; b += gridDim.y) {
        const E* xb = x + (u64)b * g.x_img;
        E* cb = cols + (u64)b * g.col_img;
        E v[EPT];
        u64 at[EPT];
#pragma unroll
        for (u32 j = 0; j < EPT; ++j) {
            const u32 e = first + j * THREADS;
            v[j] = E{};
            at[j] = ~0ull;
            if (e < g.count) {
                const u32 q = fdiv(e, g.d_pixels), p = e - q * g.pixels;
                const u32 c = fdiv(q, g.d_khkw), rs = q - c * g.d_khkw.d;
                const u32 r = fdiv(rs, g.d_kw), s = rs - r * g.kw;
                const u32 oy = fdiv(p, g.d_ow), ox = p - oy * g.ow;
                const int iy = (int)oy * g.sh + (int)r * g.dh - g.ph;
                const int ix = (int)ox * g.sw + (int)s * g.dw - g.pw;
                if ((u32)iy < g.h && (u32)ix < g.w)
                    v[j] = xb[((u64)c * g.h + (u32)iy) * g.w + (u32)ix];
                at[j] = (u64)q * g.col_row + p;
            }
        }
#pragma unroll
        for (u32 j = 0; j < EPT; ++j)
            if (at[j] != ~0ull) cb[at[j]] = v[j];
    }
}

template <typename E>
__device__ __forceinline__ void im2col_nhwc(const E* __restrict__ x, E* __restrict__ cols,
                                            const ColGeom& g, u32 images) {
    const u32 first = blockIdx.x * (THREADS * EPT) + threadIdx.x;
    for (u32 b = blockIdx.y; b < images; b += gridDim.y) {
        const E* xb = x + (u64)b * g.x_img;
        E* cb = cols + (u64)b * g.col_img;
        E v[EPT];
#pragma unroll
        for (u32 j = 0; j < EPT; ++j) {
            const u32 e = first + j * THREADS;
            v[j] = E{};
            if (e < g.count) {
                const u32 p = fdiv(e, g.d_taps), q = e - p * g.taps;
                const u32 tap = fdiv(q, g.d_cin), c = q - tap * g.c_in;
                const u32 r = fdiv(tap, g.d_kw), s = tap - r * g.kw;
                const u32 oy = fdiv(p, g.d_ow), ox = p - oy * g.ow;
                const int iy = (int)oy * g.sh + (int)r * g.dh - g.ph;
                const int ix = (int)ox * g.sw + (int)s * g.dw - g.pw;
                if ((u32)iy < g.h && (u32)ix < g.w)
                    v[j] = xb[((u64)(u32)iy * g.w + (u32)ix) * g.c_in + c];
            }
        }
#pragma unroll
        for (u32 j = 0; j < EPT; ++j) {
            const u32 e = first + j * THREADS;
            if (e < g.count) cb[e] = v[j];
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
            w[i] = (u32)from_float<H>(a[2 * i]).bits | ((u32)from_float<H>(a[2 * i + 1]).bits << 16);
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
};
template <> struct Unit16<nnf_f16> : Unit16Half<nnf_f16> {};
template <> struct Unit16<nnf_bf16> : Unit16Half<nnf_bf16> {};

// Output pixel index along one axis whose tap k reads input index i: o*stride + k*dil - pad = i.
// Returns false when there is none (t not a multiple of the stride, or o past the output).
__device__ __forceinline__ bool out_of(int t, int stride, const FastDiv& ds, u32 out, u32& o) {
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
                    acc += to_float(cb[(u64)q * g.col_row + oy * g.ow + ox]);
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
                    const u64 at = (u64)(oy * g.ow + ox) * g.taps + (r * g.kw + s) * g.c_in + c;
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
        im2col_nhwc<E>(x, cols, g, images);                                                       \
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
