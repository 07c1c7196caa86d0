// Winograd F(m x m, 3 x 3) transforms of NHWC convolutions (stride 1, dilation 1), m = 2 or 4:
//  - input transform  U[pos][t][c]  = (Bᵀ d B)[pos] of the alpha x alpha tile d of tile t, with
//    the zero padding fused in (taps outside the image read 0);
//  - filter transform V[pos][c][k]  = (G g Gᵀ)[pos] of the 3x3 block g = w[k][.][.][c] (KRSC),
//    and its rotated variant V'[pos][k][c] of g'[r][s] = w[k][2-r][2-s][c] (the data gradient's
//    filter: rotated by 180 degrees, channel axes swapped);
//  - output transform y[b][oy][ox][k] = (Aᵀ M A) of the alpha x alpha block M[.][t][k], clipped
//    at the image edge.
// pos = i * alpha + j; t = (b * tiles_h + th) * tiles_w + tw, counted from the first image the
// launcher hands in. Layouts and matrices: src/reference/winograd.rs. Arithmetic is f32; each
// stage rounds its outputs to the data type once.
//
// Memory: the transforms are memory-bound. A thread handles one (tile, vector of V channels):
// consecutive threads take consecutive channel vectors of one tile, then the next tile, so every
// load of a tap and every store of a position is one contiguous run across the warp (U and M keep
// a tile's channels contiguous and consecutive tiles adjacent). V * sizeof(T) is up to 16 bytes.
// To keep the f32 intermediate in registers, a thread computes RG rows of the transformed tile
// (alpha / RG groups of threads per tile, the group fixed per block): it reads only the input
// rows those rows need (zero coefficients are skipped at compile time) and accumulates
// tmp[RG][alpha][V]. Groups of one tile run in neighbouring blocks, so their shared reads of the
// tile hit in L2.

#define WG_THREADS 256

// ---- the matrices (cross-correlation forms; points 0, ±1, ∞ and 0, ±1, ±2, ∞) ----------------

template <int M> __device__ __forceinline__ constexpr float bt(int r, int c);
template <> __device__ __forceinline__ constexpr float bt<2>(int r, int c) {
    constexpr float k[4][4] = {{1.f, 0.f, -1.f, 0.f},
                               {0.f, 1.f, 1.f, 0.f},
                               {0.f, -1.f, 1.f, 0.f},
                               {0.f, 1.f, 0.f, -1.f}};
    return k[r][c];
}
template <> __device__ __forceinline__ constexpr float bt<4>(int r, int c) {
    constexpr float k[6][6] = {{4.f, 0.f, -5.f, 0.f, 1.f, 0.f},
                               {0.f, -4.f, -4.f, 1.f, 1.f, 0.f},
                               {0.f, 4.f, -4.f, -1.f, 1.f, 0.f},
                               {0.f, -2.f, -1.f, 2.f, 1.f, 0.f},
                               {0.f, 2.f, -1.f, -2.f, 1.f, 0.f},
                               {0.f, 4.f, 0.f, -5.f, 0.f, 1.f}};
    return k[r][c];
}

template <int M> __device__ __forceinline__ constexpr float gm(int r, int c);
template <> __device__ __forceinline__ constexpr float gm<2>(int r, int c) {
    constexpr float k[4][3] = {{1.f, 0.f, 0.f}, {0.5f, 0.5f, 0.5f}, {0.5f, -0.5f, 0.5f}, {0.f, 0.f, 1.f}};
    return k[r][c];
}
template <> __device__ __forceinline__ constexpr float gm<4>(int r, int c) {
    constexpr float k[6][3] = {{1.f / 4.f, 0.f, 0.f},
                               {-1.f / 6.f, -1.f / 6.f, -1.f / 6.f},
                               {-1.f / 6.f, 1.f / 6.f, -1.f / 6.f},
                               {1.f / 24.f, 1.f / 12.f, 1.f / 6.f},
                               {1.f / 24.f, -1.f / 12.f, 1.f / 6.f},
                               {0.f, 0.f, 1.f}};
    return k[r][c];
}

template <int M> __device__ __forceinline__ constexpr float at(int r, int c);
template <> __device__ __forceinline__ constexpr float at<2>(int r, int c) {
    constexpr float k[2][4] = {{1.f, 1.f, 1.f, 0.f}, {0.f, 1.f, -1.f, -1.f}};
    return k[r][c];
}
template <> __device__ __forceinline__ constexpr float at<4>(int r, int c) {
    constexpr float k[4][6] = {{1.f, 1.f, 1.f, 1.f, 1.f, 0.f},
                               {0.f, 1.f, -1.f, 2.f, -2.f, 0.f},
                               {0.f, 1.f, 1.f, 4.f, 4.f, 0.f},
                               {0.f, 1.f, -1.f, 8.f, -8.f, 1.f}};
    return k[r][c];
}

// Whether any of the rows G*RG .. G*RG+RG-1 of Bᵀ (ROWS_OF_AT: of Aᵀ) has a nonzero in column i.
template <int M, int RG, int G, bool ROWS_OF_AT>
__device__ __forceinline__ constexpr bool rows_use(int i) {
    bool any = false;
    for (int rr = 0; rr < RG; ++rr) {
        const float k = ROWS_OF_AT ? at<M>(G * RG + rr, i) : bt<M>(G * RG + rr, i);
        any = any || k != 0.f;
    }
    return any;
}

// ---- vectors of V channels ------------------------------------------------------------------

template <typename T> __device__ __forceinline__ float word_elem(const u32* w, int v);
template <> __device__ __forceinline__ float word_elem<float>(const u32* w, int v) {
    return __uint_as_float(w[v]);
}
template <> __device__ __forceinline__ float word_elem<nnf_f16>(const u32* w, int v) {
    nnf_f16 h;
    h.bits = (unsigned short)(w[v >> 1] >> ((v & 1) * 16));
    return to_float(h);
}
template <> __device__ __forceinline__ float word_elem<nnf_bf16>(const u32* w, int v) {
    nnf_bf16 h;
    h.bits = (unsigned short)(w[v >> 1] >> ((v & 1) * 16));
    return to_float(h);
}

template <typename T> __device__ __forceinline__ u32 elem_word(float f);
template <> __device__ __forceinline__ u32 elem_word<float>(float f) { return __float_as_uint(f); }
template <> __device__ __forceinline__ u32 elem_word<nnf_f16>(float f) {
    return from_float<nnf_f16>(f).bits;
}
template <> __device__ __forceinline__ u32 elem_word<nnf_bf16>(float f) {
    return from_float<nnf_bf16>(f).bits;
}

// Loads V consecutive elements (V * sizeof(T) bytes, aligned to that size) as floats.
template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* p, float (&f)[V]) {
    constexpr int B = V * (int)sizeof(T);
    if constexpr (B == 2) {
        f[0] = to_float(*p);
    } else {
        constexpr int W = B / 4;
        u32 w[W];
        if constexpr (W == 4) {
            const uint4 q = *reinterpret_cast<const uint4*>(p);
            w[0] = q.x;
            w[1] = q.y;
            w[2] = q.z;
            w[3] = q.w;
        } else if constexpr (W == 2) {
            const uint2 q = *reinterpret_cast<const uint2*>(p);
            w[0] = q.x;
            w[1] = q.y;
        } else {
            w[0] = *reinterpret_cast<const u32*>(p);
        }
#pragma unroll
        for (int v = 0; v < V; ++v) f[v] = word_elem<T>(w, v);
    }
}

// Stores V floats rounded to T as V consecutive elements (aligned to V * sizeof(T) bytes).
template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const float (&f)[V]) {
    constexpr int B = V * (int)sizeof(T);
    if constexpr (B == 2) {
        *p = from_float<T>(f[0]);
    } else {
        constexpr int W = B / 4;
        u32 w[W];
        if constexpr (sizeof(T) == 4) {
#pragma unroll
            for (int v = 0; v < V; ++v) w[v] = elem_word<T>(f[v]);
        } else {
#pragma unroll
            for (int q = 0; q < W; ++q)
                w[q] = elem_word<T>(f[2 * q]) | (elem_word<T>(f[2 * q + 1]) << 16);
        }
        if constexpr (W == 4) {
            *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
        } else if constexpr (W == 2) {
            *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
        } else {
            *reinterpret_cast<u32*>(p) = w[0];
        }
    }
}

// ---- input transform ------------------------------------------------------------------------

// Rows G*RG .. G*RG+RG-1 of Bᵀ d B for one tile and V channels. xb: the image's first element of
// this channel vector; ub: U at position 0 of this tile and channel vector.
template <typename T, int M, int V, int RG, int G>
__device__ __forceinline__ void input_group(const T* __restrict__ xb, T* __restrict__ ub,
                                            u64 pos_stride, u32 h, u32 w, u32 c, int y0, int x0) {
    constexpr int A = M + 2;
    float t[RG][A][V];
#pragma unroll
    for (int rr = 0; rr < RG; ++rr)
#pragma unroll
        for (int j = 0; j < A; ++j)
#pragma unroll
            for (int v = 0; v < V; ++v) t[rr][j][v] = 0.f;
    // Column pass: t[rr][j] = sum_i Bᵀ[G*RG+rr][i] * d[i][j], reading only the rows it needs.
#pragma unroll
    for (int i = 0; i < A; ++i) {
        if (!rows_use<M, RG, G, false>(i)) continue;
        const int iy = y0 + i;
        const bool row_in = iy >= 0 && iy < (int)h;
#pragma unroll
        for (int j = 0; j < A; ++j) {
            const int ix = x0 + j;
            float d[V];
            if (row_in && ix >= 0 && ix < (int)w) {
                load_vec<T, V>(xb + ((u64)iy * w + (u32)ix) * c, d);
            } else {
#pragma unroll
                for (int v = 0; v < V; ++v) d[v] = 0.f;
            }
#pragma unroll
            for (int rr = 0; rr < RG; ++rr) {
                const float k = bt<M>(G * RG + rr, i);
                if (k != 0.f) {
#pragma unroll
                    for (int v = 0; v < V; ++v) t[rr][j][v] = fmaf(k, d[v], t[rr][j][v]);
                }
            }
        }
    }
    // Row pass: out[r][q] = sum_j t[r][j] * Bᵀ[q][j].
#pragma unroll
    for (int rr = 0; rr < RG; ++rr) {
#pragma unroll
        for (int q = 0; q < A; ++q) {
            float o[V];
#pragma unroll
            for (int v = 0; v < V; ++v) o[v] = 0.f;
#pragma unroll
            for (int j = 0; j < A; ++j) {
                const float k = bt<M>(q, j);
                if (k != 0.f) {
#pragma unroll
                    for (int v = 0; v < V; ++v) o[v] = fmaf(k, t[rr][j][v], o[v]);
                }
            }
            const int pos = (G * RG + rr) * A + q;
            store_vec<T, V>(ub + (u64)pos * pos_stride, o);
        }
    }
}

template <typename T, int M, int V, int RG, int G>
__device__ __forceinline__ void input_dispatch(u32 g, const T* xb, T* ub, u64 pos_stride, u32 h,
                                               u32 w, u32 c, int y0, int x0) {
    if constexpr (G < (M + 2) / RG) {
        if (g == G)
            input_group<T, M, V, RG, G>(xb, ub, pos_stride, h, w, c, y0, x0);
        else
            input_dispatch<T, M, V, RG, G + 1>(g, xb, ub, pos_stride, h, w, c, y0, x0);
    }
}

// Grid: (alpha / RG) * ceil(tiles * c / V / WG_THREADS) blocks of WG_THREADS threads; block b
// handles row group b % groups of items (b / groups) * WG_THREADS + threadIdx.x, item =
// tile * (c / V) + channel vector. Requires c % V == 0 and x, u aligned to V * sizeof(T).
template <typename T, int M, int V, int RG>
__device__ __forceinline__ void input_transform(const T* __restrict__ x, T* __restrict__ u, u32 h,
                                                u32 w, u32 c, u32 pad_h, u32 pad_w, u32 tiles_h,
                                                u32 tiles_w, u64 tiles) {
    constexpr int GROUPS = (M + 2) / RG;
    static_assert((M + 2) % RG == 0, "row groups must divide alpha");
    const u32 g = blockIdx.x % GROUPS;
    const u64 item = (u64)(blockIdx.x / GROUPS) * WG_THREADS + threadIdx.x;
    const u32 nvec = c / V;
    if (item >= tiles * nvec) return;
    const u64 t = item / nvec;
    const u32 cv = (u32)(item - t * nvec);
    const u32 per_image = tiles_h * tiles_w;
    const u64 b = t / per_image;
    const u32 r = (u32)(t - b * per_image);
    const u32 th = r / tiles_w;
    const u32 tw = r - th * tiles_w;
    const int y0 = (int)(th * M) - (int)pad_h;
    const int x0 = (int)(tw * M) - (int)pad_w;
    const T* xb = x + b * ((u64)h * w * c) + (u64)cv * V;
    T* ub = u + t * c + (u64)cv * V;
    input_dispatch<T, M, V, RG, 0>(g, xb, ub, tiles * c, h, w, c, y0, x0);
}

// ---- output transform -----------------------------------------------------------------------

// Output rows G*RG .. G*RG+RG-1 of Aᵀ M A for one tile and V channels, clipped at the edge.
template <typename T, int M, int V, int RG, int G>
__device__ __forceinline__ void output_group(const T* __restrict__ mb, T* __restrict__ yb,
                                             u64 pos_stride, u32 oh, u32 ow, u32 k, u32 oy0,
                                             u32 ox0) {
    constexpr int A = M + 2;
    float t[RG][A][V];
#pragma unroll
    for (int rr = 0; rr < RG; ++rr)
#pragma unroll
        for (int j = 0; j < A; ++j)
#pragma unroll
            for (int v = 0; v < V; ++v) t[rr][j][v] = 0.f;
#pragma unroll
    for (int i = 0; i < A; ++i) {
        if (!rows_use<M, RG, G, true>(i)) continue;
#pragma unroll
        for (int j = 0; j < A; ++j) {
            float d[V];
            load_vec<T, V>(mb + (u64)(i * A + j) * pos_stride, d);
#pragma unroll
            for (int rr = 0; rr < RG; ++rr) {
                const float kc = at<M>(G * RG + rr, i);
                if (kc != 0.f) {
#pragma unroll
                    for (int v = 0; v < V; ++v) t[rr][j][v] = fmaf(kc, d[v], t[rr][j][v]);
                }
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < RG; ++rr) {
        const u32 oy = oy0 + G * RG + rr;
        if (oy >= oh) continue;
#pragma unroll
        for (int q = 0; q < M; ++q) {
            const u32 ox = ox0 + q;
            if (ox >= ow) continue;
            float o[V];
#pragma unroll
            for (int v = 0; v < V; ++v) o[v] = 0.f;
#pragma unroll
            for (int j = 0; j < A; ++j) {
                const float kc = at<M>(q, j);
                if (kc != 0.f) {
#pragma unroll
                    for (int v = 0; v < V; ++v) o[v] = fmaf(kc, t[rr][j][v], o[v]);
                }
            }
            store_vec<T, V>(yb + ((u64)oy * ow + ox) * k, o);
        }
    }
}

template <typename T, int M, int V, int RG, int G>
__device__ __forceinline__ void output_dispatch(u32 g, const T* mb, T* yb, u64 pos_stride, u32 oh,
                                                u32 ow, u32 k, u32 oy0, u32 ox0) {
    if constexpr (G < M / RG) {
        if (g == G)
            output_group<T, M, V, RG, G>(mb, yb, pos_stride, oh, ow, k, oy0, ox0);
        else
            output_dispatch<T, M, V, RG, G + 1>(g, mb, yb, pos_stride, oh, ow, k, oy0, ox0);
    }
}

// Grid as input_transform, with m / RG row groups and items tile * (k / V) + channel vector.
template <typename T, int M, int V, int RG>
__device__ __forceinline__ void output_transform(const T* __restrict__ m, T* __restrict__ y,
                                                 u32 oh, u32 ow, u32 k, u32 tiles_h, u32 tiles_w,
                                                 u64 tiles) {
    constexpr int GROUPS = M / RG;
    static_assert(M % RG == 0, "row groups must divide m");
    const u32 g = blockIdx.x % GROUPS;
    const u64 item = (u64)(blockIdx.x / GROUPS) * WG_THREADS + threadIdx.x;
    const u32 nvec = k / V;
    if (item >= tiles * nvec) return;
    const u64 t = item / nvec;
    const u32 kv = (u32)(item - t * nvec);
    const u32 per_image = tiles_h * tiles_w;
    const u64 b = t / per_image;
    const u32 r = (u32)(t - b * per_image);
    const u32 th = r / tiles_w;
    const u32 tw = r - th * tiles_w;
    const T* mb = m + t * k + (u64)kv * V;
    T* yb = y + b * ((u64)oh * ow * k) + (u64)kv * V;
    output_dispatch<T, M, V, RG, 0>(g, mb, yb, tiles * k, oh, ow, k, th * M, tw * M);
}

// ---- filter transform -----------------------------------------------------------------------

// One thread per (output channel k, input channel c) and group of rows of the alpha x alpha
// result. Block: 32 lanes along the channel the output is contiguous in (k for V[pos][c][k], c
// for the rotated V'[pos][k][c]), so every store of a position is one contiguous run per warp,
// and 8 warps along the other channel. Grid: (ceil(fast / 32), ceil(slow / 8), groups): small
// filters (64x64 has 4096 pairs: 16 blocks) split the alpha rows over blockIdx.z so that enough
// blocks run; each thread then reads its 9 taps (L1/L2 hits for all but the first group) and
// writes rows lo..hi-1. The old 32x32-pair blocks with a staging loop ran 4 blocks on a 64x64
// filter and took 7-8 µs for a 0.1 µs floor on the H100.
template <typename T, int M, bool ROT>
__device__ __forceinline__ void filter_transform(const T* __restrict__ w, T* __restrict__ v,
                                                 u32 kout, u32 cin) {
    constexpr int A = M + 2;
    const u32 fast = blockIdx.x * 32 + (threadIdx.x & 31);
    const u32 slow = blockIdx.y * 8 + (threadIdx.x >> 5);
    const u32 kg = ROT ? slow : fast;
    const u32 cg = ROT ? fast : slow;
    if (kg >= kout || cg >= cin) return;
    const u32 rows = (A + gridDim.z - 1) / gridDim.z;
    const u32 lo = blockIdx.z * rows;
    const u32 hi = min(lo + rows, (u32)A);
    const T* src = w + (u64)kg * 9 * cin + cg;
    float g[3][3];
#pragma unroll
    for (int r = 0; r < 3; ++r)
#pragma unroll
        for (int q = 0; q < 3; ++q) g[r][q] = to_float(src[(u64)(ROT ? 8 - (r * 3 + q) : r * 3 + q) * cin]);
    const u64 pos_stride = (u64)kout * cin;
    T* out = ROT ? v + (u64)kg * cin + cg : v + (u64)cg * kout + kg;
#pragma unroll
    for (int i = 0; i < A; ++i) {
        if ((u32)i < lo || (u32)i >= hi) continue;
        float tmp[3];
#pragma unroll
        for (int q = 0; q < 3; ++q)
            tmp[q] = gm<M>(i, 0) * g[0][q] + gm<M>(i, 1) * g[1][q] + gm<M>(i, 2) * g[2][q];
#pragma unroll
        for (int j = 0; j < A; ++j) {
            const float val = tmp[0] * gm<M>(j, 0) + tmp[1] * gm<M>(j, 1) + tmp[2] * gm<M>(j, 2);
            out[(u64)(i * A + j) * pos_stride] = from_float<T>(val);
        }
    }
}

// ---- entry points ---------------------------------------------------------------------------
// winograd_input_<tile>_<dtype>_v<V> and winograd_output_<tile>_<dtype>_v<V>: V channels per
// thread, RG rows per thread (the table in src/conv/winograd/launch.rs: row_groups); and
// winograd_filter_<tile>_<dtype>, winograd_filter_rot_<tile>_<dtype>.
//
// Compiling every kernel takes NVRTC tens of seconds (the unrolled transforms are large), so the
// launcher compiles this file once per (stage, type, tile, width) it actually uses, with
// NNF_WG_STAGE (1 input, 2 output, 3 filter), NNF_WG_DT (1 f32, 2 f16, 3 bf16), NNF_WG_TILE (2,
// 4) and NNF_WG_VEC defined; undefined (0) selects everything (CI compiles the whole file).

#ifndef NNF_WG_STAGE
#define NNF_WG_STAGE 0
#endif
#ifndef NNF_WG_DT
#define NNF_WG_DT 0
#endif
#ifndef NNF_WG_TILE
#define NNF_WG_TILE 0
#endif
#ifndef NNF_WG_VEC
#define NNF_WG_VEC 0
#endif
#define NNF_WG_PICK(stage, dt, tile, vec)                                                          \
    ((NNF_WG_STAGE == 0 || NNF_WG_STAGE == (stage)) && (NNF_WG_DT == 0 || NNF_WG_DT == (dt)) &&   \
     (NNF_WG_TILE == 0 || NNF_WG_TILE == (tile)) && (NNF_WG_VEC == 0 || NNF_WG_VEC == (vec)))

#define NNF_WG_INPUT(TILE, M, T, S, V, RG)                                                        \
    extern "C" __global__ void __launch_bounds__(WG_THREADS) winograd_input_##TILE##_##S##_v##V(  \
        const T* x, T* u, u32 h, u32 w, u32 c, u32 pad_h, u32 pad_w, u32 tiles_h, u32 tiles_w,    \
        u64 tiles) {                                                                              \
        input_transform<T, M, V, RG>(x, u, h, w, c, pad_h, pad_w, tiles_h, tiles_w, tiles);       \
    }

#define NNF_WG_OUTPUT(TILE, M, T, S, V, RG)                                                       \
    extern "C" __global__ void __launch_bounds__(WG_THREADS) winograd_output_##TILE##_##S##_v##V( \
        const T* m, T* y, u32 oh, u32 ow, u32 k, u32 tiles_h, u32 tiles_w, u64 tiles) {           \
        output_transform<T, M, V, RG>(m, y, oh, ow, k, tiles_h, tiles_w, tiles);                  \
    }

#define NNF_WG_FILTER(TILE, M, T, S)                                                              \
    extern "C" __global__ void __launch_bounds__(WG_THREADS) winograd_filter_##TILE##_##S(        \
        const T* w, T* v, u32 kout, u32 cin) {                                                    \
        filter_transform<T, M, false>(w, v, kout, cin);                                           \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(WG_THREADS) winograd_filter_rot_##TILE##_##S(    \
        const T* w, T* v, u32 kout, u32 cin) {                                                    \
        filter_transform<T, M, true>(w, v, kout, cin);                                            \
    }

// Row groups (RG) keep tmp[RG][alpha][V] at most 72 floats. f32: V = 4 (16 bytes), 1; 16-bit
// types: V = 8 (16 bytes), 2 (4 bytes), 1.
#if NNF_WG_PICK(1, 1, 2, 4)
NNF_WG_INPUT(f2x3, 2, float, f32, 4, 2)
#endif
#if NNF_WG_PICK(1, 1, 2, 1)
NNF_WG_INPUT(f2x3, 2, float, f32, 1, 4)
#endif
#if NNF_WG_PICK(2, 1, 2, 4)
NNF_WG_OUTPUT(f2x3, 2, float, f32, 4, 2)
#endif
#if NNF_WG_PICK(2, 1, 2, 1)
NNF_WG_OUTPUT(f2x3, 2, float, f32, 1, 2)
#endif
#if NNF_WG_PICK(3, 1, 2, 0)
NNF_WG_FILTER(f2x3, 2, float, f32)
#endif
#if NNF_WG_PICK(1, 1, 4, 4)
NNF_WG_INPUT(f4x3, 4, float, f32, 4, 2)
#endif
#if NNF_WG_PICK(1, 1, 4, 1)
NNF_WG_INPUT(f4x3, 4, float, f32, 1, 6)
#endif
#if NNF_WG_PICK(2, 1, 4, 4)
NNF_WG_OUTPUT(f4x3, 4, float, f32, 4, 2)
#endif
#if NNF_WG_PICK(2, 1, 4, 1)
NNF_WG_OUTPUT(f4x3, 4, float, f32, 1, 4)
#endif
#if NNF_WG_PICK(3, 1, 4, 0)
NNF_WG_FILTER(f4x3, 4, float, f32)
#endif
#if NNF_WG_PICK(1, 2, 2, 8)
NNF_WG_INPUT(f2x3, 2, nnf_f16, f16, 8, 2)
#endif
#if NNF_WG_PICK(1, 2, 2, 2)
NNF_WG_INPUT(f2x3, 2, nnf_f16, f16, 2, 4)
#endif
#if NNF_WG_PICK(1, 2, 2, 1)
NNF_WG_INPUT(f2x3, 2, nnf_f16, f16, 1, 4)
#endif
#if NNF_WG_PICK(2, 2, 2, 8)
NNF_WG_OUTPUT(f2x3, 2, nnf_f16, f16, 8, 1)
#endif
#if NNF_WG_PICK(2, 2, 2, 2)
NNF_WG_OUTPUT(f2x3, 2, nnf_f16, f16, 2, 2)
#endif
#if NNF_WG_PICK(2, 2, 2, 1)
NNF_WG_OUTPUT(f2x3, 2, nnf_f16, f16, 1, 2)
#endif
#if NNF_WG_PICK(3, 2, 2, 0)
NNF_WG_FILTER(f2x3, 2, nnf_f16, f16)
#endif
#if NNF_WG_PICK(1, 2, 4, 8)
NNF_WG_INPUT(f4x3, 4, nnf_f16, f16, 8, 1)
#endif
#if NNF_WG_PICK(1, 2, 4, 2)
NNF_WG_INPUT(f4x3, 4, nnf_f16, f16, 2, 6)
#endif
#if NNF_WG_PICK(1, 2, 4, 1)
NNF_WG_INPUT(f4x3, 4, nnf_f16, f16, 1, 6)
#endif
#if NNF_WG_PICK(2, 2, 4, 8)
NNF_WG_OUTPUT(f4x3, 4, nnf_f16, f16, 8, 1)
#endif
#if NNF_WG_PICK(2, 2, 4, 2)
NNF_WG_OUTPUT(f4x3, 4, nnf_f16, f16, 2, 4)
#endif
#if NNF_WG_PICK(2, 2, 4, 1)
NNF_WG_OUTPUT(f4x3, 4, nnf_f16, f16, 1, 4)
#endif
#if NNF_WG_PICK(3, 2, 4, 0)
NNF_WG_FILTER(f4x3, 4, nnf_f16, f16)
#endif
#if NNF_WG_PICK(1, 3, 2, 8)
NNF_WG_INPUT(f2x3, 2, nnf_bf16, bf16, 8, 2)
#endif
#if NNF_WG_PICK(1, 3, 2, 2)
NNF_WG_INPUT(f2x3, 2, nnf_bf16, bf16, 2, 4)
#endif
#if NNF_WG_PICK(1, 3, 2, 1)
NNF_WG_INPUT(f2x3, 2, nnf_bf16, bf16, 1, 4)
#endif
#if NNF_WG_PICK(2, 3, 2, 8)
NNF_WG_OUTPUT(f2x3, 2, nnf_bf16, bf16, 8, 1)
#endif
#if NNF_WG_PICK(2, 3, 2, 2)
NNF_WG_OUTPUT(f2x3, 2, nnf_bf16, bf16, 2, 2)
#endif
#if NNF_WG_PICK(2, 3, 2, 1)
NNF_WG_OUTPUT(f2x3, 2, nnf_bf16, bf16, 1, 2)
#endif
#if NNF_WG_PICK(3, 3, 2, 0)
NNF_WG_FILTER(f2x3, 2, nnf_bf16, bf16)
#endif
#if NNF_WG_PICK(1, 3, 4, 8)
NNF_WG_INPUT(f4x3, 4, nnf_bf16, bf16, 8, 1)
#endif
#if NNF_WG_PICK(1, 3, 4, 2)
NNF_WG_INPUT(f4x3, 4, nnf_bf16, bf16, 2, 6)
#endif
#if NNF_WG_PICK(1, 3, 4, 1)
NNF_WG_INPUT(f4x3, 4, nnf_bf16, bf16, 1, 6)
#endif
#if NNF_WG_PICK(2, 3, 4, 8)
NNF_WG_OUTPUT(f4x3, 4, nnf_bf16, bf16, 8, 1)
#endif
#if NNF_WG_PICK(2, 3, 4, 2)
NNF_WG_OUTPUT(f4x3, 4, nnf_bf16, bf16, 2, 4)
#endif
#if NNF_WG_PICK(2, 3, 4, 1)
NNF_WG_OUTPUT(f4x3, 4, nnf_bf16, bf16, 1, 4)
#endif
#if NNF_WG_PICK(3, 3, 4, 0)
NNF_WG_FILTER(f4x3, 4, nnf_bf16, bf16)
#endif
