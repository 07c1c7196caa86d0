// Bitmask ReLU / Add+ReLU, forward and backward, for f32, f16 (nnf_f16) and bf16 (nnf_bf16).
//
// Mask layout (the contract of src/reference/activation.rs): u32 words; bit i of word w is
// element 32*w + i; ceil(n/32) words; bits past n are zero. Every kernel here writes or reads
// exactly that layout, whatever path it takes.
//
// NaN (as PyTorch): relu(NaN) = NaN and its mask bit is 0 (NaN > 0 is false). relu(-0) = +0.
// Add+ReLU computes x + z in f32 and rounds the result once to the element type.
//
// Two paths, chosen per launch inside the kernel from the pointers (the launcher mirrors the
// rule for its launch arithmetic and its log):
//  * vector: every data pointer is 16-byte aligned. Element 0 then starts a 16-byte vector, so
//    vectors, mask words (32 elements) and warp chunks (32 vectors) share one grid of element
//    indices. Lane l of a warp takes vector l of a chunk of 32 consecutive vectors (512 coalesced
//    bytes per load instruction), N = 16/sizeof(T) elements; the chunk's 32*N elements are
//    exactly N mask words. The forward votes once per vector element j (__ballot_sync: bit l =
//    lane l's element j) and interleaves the N ballots bitwise so that lane w < N holds mask word
//    w; lanes 0..N-1 then store N consecutive words (one coalesced 16/32-byte store). The
//    backward has lane l read the one word that holds its N bits. Each warp handles VEC_UNROLL
//    consecutive chunks per iteration (all loads issued before any store), grid-stride over
//    chunks. The elements after the last whole chunk (fewer than 32*N, starting on a word
//    boundary) go through the scalar tile code in the grid's last warp.
//  * scalar: any alignment (e.g. a view starting at an odd element). A warp takes tiles of
//    SCALAR_WORDS words: lane l reads element 32*k + l of the tile for every k (coalesced), one
//    ballot per k is exactly mask word k, and lane k stores word k.
//
// In place: y may be the same memory as x (and/or z), dx the same as dy (and/or dz the same as
// dy): every element is read before it is written and by the thread that writes it, and no
// thread reads an element another thread writes. Partial overlap is not supported (the Rust
// launchers reject it), nor may the mask overlap the data. Hence no __restrict__ on data
// pointers: the compiler must keep each load ahead of the store it feeds, which the code
// orders explicitly.
//
// Every kernel needs whole warps (blockDim.x a multiple of 32: ballots use the full mask) and is
// launched with THREADS threads a block; loop bounds depend only on the warp index, so every
// ballot and shuffle runs with all 32 lanes converged. Indices are 64-bit.

#define NNF_FULL_WARP 0xffffffffu

// Keep these three in sync with src/activation/plan.rs (a CPU test compares them).
constexpr int THREADS = 256;      // threads per block of every launch
constexpr int VEC_UNROLL = 4;     // 32-vector chunks per warp iteration in the vector paths
constexpr int SCALAR_WORDS = 8;   // mask words (32 elements each) per warp tile in the scalar paths

// --- element access ------------------------------------------------------------------------

__device__ __forceinline__ bool aligned16(const void* p) { return (((u64)p) & 15u) == 0; }

// relu keeps the value where it is positive or NaN (i.e. unless v <= 0); the mask bit is v > 0.
__device__ __forceinline__ bool relu_keeps(float v) { return !(v <= 0.0f); }

// The same two predicates decided on an element's raw bits, for values that are only loaded
// and stored (ReLU, the y-based backward). Integer tests, no float conversion: cheaper, and
// immune to a miscompilation seen with NVRTC 13.0 for sm_90, where a bf16 widened by a shift
// and compared as f32 came out NaN whenever the other bf16 of its 32-bit word was NaN.
template <typename T> struct FloatBits;
template <> struct FloatBits<float> { static constexpr u32 SIGN = 0x80000000u, INF = 0x7f800000u; };
template <> struct FloatBits<nnf_f16> { static constexpr u32 SIGN = 0x8000u, INF = 0x7c00u; };
template <> struct FloatBits<nnf_bf16> { static constexpr u32 SIGN = 0x8000u, INF = 0x7f80u; };

// v > 0: sign clear, not zero, not NaN (+inf counts).
template <typename T> __device__ __forceinline__ bool bits_gt0(u32 b) {
    const u32 mag = b & (FloatBits<T>::SIGN - 1u);
    return !(b & FloatBits<T>::SIGN) && mag != 0u && mag <= FloatBits<T>::INF;
}
// !(v <= 0): positive or NaN, i.e. not (±0 or negative non-NaN).
template <typename T> __device__ __forceinline__ bool bits_keeps(u32 b) {
    const u32 mag = b & (FloatBits<T>::SIGN - 1u);
    return mag > FloatBits<T>::INF || (!(b & FloatBits<T>::SIGN) && mag != 0u);
}

// Both 16-bit elements of a 32-bit word at once (SWAR), for f16 and bf16. Each sum below stays
// under 0x10000 per half, so no carry crosses into the other half.
//  - `keep_mask2`: 0xFFFF in each half whose element relu keeps (NaN, or positive non-zero);
//  - `gt0_bits2`: bit 0 = low element > 0, bit 1 = high element > 0.
template <typename T> __device__ __forceinline__ u32 swar_keep_bits(u32 w, u32& gt0_hi) {
    constexpr u32 INF = FloatBits<T>::INF;
    const u32 mag = w & 0x7fff7fffu;
    const u32 nonneg = ~w & 0x80008000u;
    const u32 nonzero = (mag + 0x7fff7fffu) & 0x80008000u;               // mag >= 1
    const u32 nan = (mag + ((0x7fffu - INF) * 0x10001u)) & 0x80008000u;  // mag > INF
    gt0_hi = nonneg & nonzero & ~nan;  // bit 15 / 31: element > 0
    return nan | (nonneg & nonzero);   // bit 15 / 31: element kept
}
template <typename T> __device__ __forceinline__ u32 keep_mask2(u32 w, u32& gt0_bits2) {
    u32 g;
    const u32 k = swar_keep_bits<T>(w, g);
    gt0_bits2 = ((g >> 15) & 1u) | ((g >> 30) & 2u);
    return (k >> 15) * 0xffffu;  // bits 0 and 16 of (k >> 15) -> 0x0000FFFF / 0xFFFF0000
}
// The 16-bit halves of a word selected by two mask bits (bit 0: low, bit 1: high).
__device__ __forceinline__ u32 half_select2(u32 two_bits) {
    return ((two_bits & 1u) * 0xffffu) | (((two_bits >> 1) & 1u) * 0xffff0000u);
}

template <typename T> __device__ __forceinline__ u32 to_bits(T v) { return v.bits; }
template <> __device__ __forceinline__ u32 to_bits<float>(float v) { return __float_as_uint(v); }

template <typename T> __device__ __forceinline__ T from_bits(u32 b) {
    T t;
    t.bits = (unsigned short)b;
    return t;
}
template <> __device__ __forceinline__ float from_bits<float>(u32 b) { return __uint_as_float(b); }

// A 16-byte vector of T held as four 32-bit words; element j of N = 16/sizeof(T).
template <typename T> __device__ __forceinline__ u32 elem_bits(const u32 (&w)[4], int j) {
    if constexpr (sizeof(T) == 4) {
        return w[j];
    } else {
        return (w[j >> 1] >> ((j & 1) * 16)) & 0xffffu;
    }
}
template <typename T> __device__ __forceinline__ void set_elem_bits(u32 (&w)[4], int j, u32 b) {
    if constexpr (sizeof(T) == 4) {
        w[j] = b;
    } else {
        const int s = (j & 1) * 16;
        w[j >> 1] = (w[j >> 1] & ~(0xffffu << s)) | (b << s);
    }
}
template <typename T> __device__ __forceinline__ float elem_float(const u32 (&w)[4], int j) {
    return to_float(from_bits<T>(elem_bits<T>(w, j)));
}

__device__ __forceinline__ void unpack(uint4 v, u32 (&w)[4]) {
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
}
__device__ __forceinline__ uint4 pack(const u32 (&w)[4]) { return make_uint4(w[0], w[1], w[2], w[3]); }

// --- the warp-vote transpose ---------------------------------------------------------------

// `bits`: bit j = predicate of this lane's element j, i.e. element lane*N + j of a 32*N-element
// chunk. Mask word w of the chunk (bit i = element 32*w + i) holds the N bits of each of the
// L = 32/N lanes w*L .. w*L+L-1, lane w*L + k at bit N*k. Each lane shifts its bits into place
// and the L lanes of a group OR-reduce with log2(L) xor-shuffles; every lane of group w ends
// with word w. (Two shuffles for 16-bit types, three for f32: cheaper than N ballots.) Must be
// called by all 32 lanes.
template <int N> __device__ __forceinline__ u32 chunk_word(u32 bits) {
    constexpr int L = 32 / N;
    const int lane = threadIdx.x & 31;
    u32 word = bits << (N * (lane & (L - 1)));
#pragma unroll
    for (int d = 1; d < L; d <<= 1) word |= __shfl_xor_sync(NNF_FULL_WARP, word, d);
    return word;
}

// --- forward -------------------------------------------------------------------------------

// Elements [base, min(base + 32*K, n)) with base a multiple of 32: lane l takes element
// base + 32*k + l, so ballot k is mask word base/32 + k. All loads are issued first.
template <typename T, bool ADD, int K>
__device__ __forceinline__ void fwd_tile(const T* x, const T* z, T* y, u32* mask, u64 base, u64 n,
                                         int lane) {
    T xs[K], zs[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const u64 i = base + 32u * (u64)k + lane;
        xs[k] = T{};
        zs[k] = T{};
        if (i < n) {
            xs[k] = x[i];
            if (ADD) zs[k] = z[i];
        }
    }
    u32 mine = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const u64 i = base + 32u * (u64)k + lane;
        const bool in = i < n;
        bool pos, keep;
        float v = 0.0f;
        if constexpr (ADD) {
            v = to_float(xs[k]) + to_float(zs[k]);
            pos = v > 0.0f;
            keep = relu_keeps(v);
        } else {
            const u32 b = to_bits(xs[k]);
            pos = bits_gt0<T>(b);
            keep = bits_keeps<T>(b);
        }
        const u32 word = __ballot_sync(NNF_FULL_WARP, in && pos);
        if (lane == k) mine = word;
        if (in) y[i] = keep ? (ADD ? from_float<T>(v) : xs[k]) : T{};
    }
    if (mask != nullptr) {
        const u64 w = base / 32 + lane;
        if (lane < K && w < (n + 31) / 32) mask[w] = mine;
    }
}

template <typename T, bool ADD>
__device__ __forceinline__ void fwd_vector(const T* x, const T* z, T* y, u32* mask, u64 n) {
    constexpr int N = 16 / sizeof(T);
    constexpr u64 CHUNK = 32 * N;
    const int lane = threadIdx.x & 31;
    const u64 warp = global_thread() >> 5;
    const u64 nwarps = grid_threads() >> 5;
    const u64 nchunks = n / CHUNK;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* zv = reinterpret_cast<const uint4*>(z);
    uint4* yv = reinterpret_cast<uint4*>(y);
    for (u64 c0 = warp * VEC_UNROLL; c0 < nchunks; c0 += nwarps * VEC_UNROLL) {
        uint4 a[VEC_UNROLL], b[VEC_UNROLL];
#pragma unroll
        for (int u = 0; u < VEC_UNROLL; ++u) {
            const u64 c = c0 + u;
            a[u] = make_uint4(0, 0, 0, 0);
            b[u] = make_uint4(0, 0, 0, 0);
            if (c < nchunks) {
                a[u] = xv[c * 32 + lane];
                if (ADD) b[u] = zv[c * 32 + lane];
            }
        }
#pragma unroll
        for (int u = 0; u < VEC_UNROLL; ++u) {
            const u64 c = c0 + u;
            if (c < nchunks) {  // the same for the whole warp
                u32 w[4], wz[4];
                unpack(a[u], w);
                unpack(b[u], wz);
                u32 bits = 0;
                if constexpr (!ADD && sizeof(T) == 2) {
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        u32 two;
                        w[q] &= keep_mask2<T>(w[q], two);
                        bits |= two << (2 * q);
                    }
                } else
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    if constexpr (ADD) {
                        const float v = elem_float<T>(w, j) + elem_float<T>(wz, j);
                        bits |= (u32)(v > 0.0f) << j;
                        set_elem_bits<T>(w, j, relu_keeps(v) ? to_bits(from_float<T>(v)) : 0u);
                    } else {
                        const u32 b = elem_bits<T>(w, j);
                        bits |= (u32)bits_gt0<T>(b) << j;
                        set_elem_bits<T>(w, j, bits_keeps<T>(b) ? b : 0u);
                    }
                }
                yv[c * 32 + lane] = pack(w);
                if (mask != nullptr) {
                    // The first lane of each group of 32/N stores its group's word.
                    const u32 word = chunk_word<N>(bits);
                    if ((lane & (32 / N - 1)) == 0) mask[c * N + lane / (32 / N)] = word;
                }
            }
        }
    }
    const u64 done = nchunks * CHUNK;
    if (done < n && warp == nwarps - 1) fwd_tile<T, ADD, N>(x, z, y, mask, done, n, lane);
}

template <typename T, bool ADD>
__device__ __forceinline__ void fwd_scalar(const T* x, const T* z, T* y, u32* mask, u64 n) {
    constexpr u64 TILE = 32 * SCALAR_WORDS;
    const int lane = threadIdx.x & 31;
    const u64 tiles = (n + TILE - 1) / TILE;
    for (u64 t = global_thread() >> 5; t < tiles; t += grid_threads() >> 5)
        fwd_tile<T, ADD, SCALAR_WORDS>(x, z, y, mask, t * TILE, n, lane);
}

template <typename T, bool ADD>
__device__ __forceinline__ void fwd(const T* x, const T* z, T* y, u32* mask, u64 n) {
    if (aligned16(x) && aligned16(y) && (!ADD || aligned16(z)))
        fwd_vector<T, ADD>(x, z, y, mask, n);
    else
        fwd_scalar<T, ADD>(x, z, y, mask, n);
}

// --- backward ------------------------------------------------------------------------------

template <typename T, int K>
__device__ __forceinline__ void bwd_tile(const T* dy, const u32* mask, T* dx, T* dz, u64 base,
                                         u64 n, int lane) {
    T g[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const u64 i = base + 32u * (u64)k + lane;
        g[k] = i < n ? dy[i] : T{};
    }
    const u64 w = base / 32 + lane;
    const u32 m = (lane < K && w < (n + 31) / 32) ? mask[w] : 0u;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const u64 i = base + 32u * (u64)k + lane;
        const u32 word = __shfl_sync(NNF_FULL_WARP, m, k);
        if (i < n) {
            const T out = ((word >> lane) & 1u) ? g[k] : T{};
            dx[i] = out;
            if (dz != nullptr) dz[i] = out;
        }
    }
}

template <typename T>
__device__ __forceinline__ void bwd_vector(const T* dy, const u32* mask, T* dx, T* dz, u64 n) {
    constexpr int N = 16 / sizeof(T);
    constexpr u64 CHUNK = 32 * N;
    constexpr int L = 32 / N;  // lanes sharing one mask word
    const int lane = threadIdx.x & 31;
    const u64 warp = global_thread() >> 5;
    const u64 nwarps = grid_threads() >> 5;
    const u64 nchunks = n / CHUNK;
    const uint4* gv = reinterpret_cast<const uint4*>(dy);
    uint4* xv = reinterpret_cast<uint4*>(dx);
    uint4* zv = reinterpret_cast<uint4*>(dz);
    for (u64 c0 = warp * VEC_UNROLL; c0 < nchunks; c0 += nwarps * VEC_UNROLL) {
        uint4 g[VEC_UNROLL];
        u32 m[VEC_UNROLL];
#pragma unroll
        for (int u = 0; u < VEC_UNROLL; ++u) {
            const u64 c = c0 + u;
            g[u] = make_uint4(0, 0, 0, 0);
            m[u] = 0;
            if (c < nchunks) {
                g[u] = gv[c * 32 + lane];
                // This lane's N elements are c*CHUNK + lane*N + j: word c*N + lane/L.
                m[u] = mask[c * N + lane / L];
            }
        }
#pragma unroll
        for (int u = 0; u < VEC_UNROLL; ++u) {
            const u64 c = c0 + u;
            if (c < nchunks) {
                u32 w[4];
                unpack(g[u], w);
                const u32 bits = m[u] >> ((lane * N) & 31);
                if constexpr (sizeof(T) == 2) {
#pragma unroll
                    for (int q = 0; q < 4; ++q) w[q] &= half_select2(bits >> (2 * q));
                } else {
#pragma unroll
                    for (int j = 0; j < N; ++j)
                        if (!((bits >> j) & 1u)) set_elem_bits<T>(w, j, 0u);
                }
                const uint4 out = pack(w);
                xv[c * 32 + lane] = out;
                if (dz != nullptr) zv[c * 32 + lane] = out;
            }
        }
    }
    const u64 done = nchunks * CHUNK;
    if (done < n && warp == nwarps - 1) bwd_tile<T, N>(dy, mask, dx, dz, done, n, lane);
}

template <typename T>
__device__ __forceinline__ void bwd_scalar(const T* dy, const u32* mask, T* dx, T* dz, u64 n) {
    constexpr u64 TILE = 32 * SCALAR_WORDS;
    const int lane = threadIdx.x & 31;
    const u64 tiles = (n + TILE - 1) / TILE;
    for (u64 t = global_thread() >> 5; t < tiles; t += grid_threads() >> 5)
        bwd_tile<T, SCALAR_WORDS>(dy, mask, dx, dz, t * TILE, n, lane);
}

template <typename T>
__device__ __forceinline__ void bwd(const T* dy, const u32* mask, T* dx, T* dz, u64 n) {
    if (aligned16(dy) && aligned16(dx) && aligned16(dz))  // a null dz counts as aligned
        bwd_vector<T>(dy, mask, dx, dz, n);
    else
        bwd_scalar<T>(dy, mask, dx, dz, n);
}

// --- benchmark baselines -------------------------------------------------------------------

// The y-based backward (dx = dy where y > 0) that the mask replaces: reads y instead of 1 bit.
// Same structure as bwd_vector, so that the benchmark compares bytes moved, not code quality.
template <typename T>
__device__ __forceinline__ void bwd_from_y(const T* dy, const T* y, T* dx, u64 n) {
    constexpr int N = 16 / sizeof(T);
    constexpr u64 CHUNK = 32 * N;
    const int lane = threadIdx.x & 31;
    const u64 warp = global_thread() >> 5;
    const u64 nwarps = grid_threads() >> 5;
    u64 done = 0;
    if (aligned16(dy) && aligned16(y) && aligned16(dx)) {
        const u64 nchunks = n / CHUNK;
        const uint4* gv = reinterpret_cast<const uint4*>(dy);
        const uint4* yv = reinterpret_cast<const uint4*>(y);
        uint4* xv = reinterpret_cast<uint4*>(dx);
        for (u64 c0 = warp * VEC_UNROLL; c0 < nchunks; c0 += nwarps * VEC_UNROLL) {
            uint4 g[VEC_UNROLL], h[VEC_UNROLL];
#pragma unroll
            for (int u = 0; u < VEC_UNROLL; ++u) {
                const u64 c = c0 + u;
                g[u] = make_uint4(0, 0, 0, 0);
                h[u] = make_uint4(0, 0, 0, 0);
                if (c < nchunks) {
                    g[u] = gv[c * 32 + lane];
                    h[u] = yv[c * 32 + lane];
                }
            }
#pragma unroll
            for (int u = 0; u < VEC_UNROLL; ++u) {
                const u64 c = c0 + u;
                if (c < nchunks) {
                    u32 w[4], wy[4];
                    unpack(g[u], w);
                    unpack(h[u], wy);
#pragma unroll
                    for (int j = 0; j < N; ++j)
                        if (!bits_gt0<T>(elem_bits<T>(wy, j))) set_elem_bits<T>(w, j, 0u);
                    xv[c * 32 + lane] = pack(w);
                }
            }
        }
        done = nchunks * CHUNK;
        if (warp != nwarps - 1) return;  // the rest (< CHUNK elements) is the last warp's
        for (u64 i = done + lane; i < n; i += 32) dx[i] = bits_gt0<T>(to_bits(y[i])) ? dy[i] : T{};
        return;
    }
    for (u64 i = global_thread(); i < n; i += grid_threads())
        dx[i] = bits_gt0<T>(to_bits(y[i])) ? dy[i] : T{};
}

// The naive mask scheme: one thread reads eight consecutive elements (scalar loads, strided
// across the warp) and writes one byte of mask. Same layout: byte t of the little-endian word
// array is bits 8t..8t+7 of word t/4. Every byte of the ceil(n/32) words is written, so the tail
// bits are zero.
template <typename T>
__device__ __forceinline__ void fwd_naive8(const T* x, T* y, u32* mask, u64 n) {
    unsigned char* m8 = reinterpret_cast<unsigned char*>(mask);
    const u64 nbytes = ((n + 31) / 32) * 4;
    for (u64 t = global_thread(); t < nbytes; t += grid_threads()) {
        u32 byte = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u64 i = t * 8 + j;
            if (i < n) {
                const T v = x[i];
                const u32 b = to_bits(v);
                byte |= (u32)bits_gt0<T>(b) << j;
                y[i] = bits_keeps<T>(b) ? v : T{};
            }
        }
        m8[t] = (unsigned char)byte;
    }
}

// --- entry points --------------------------------------------------------------------------
// mask may be null in the forwards (no mask written); dz may be null in the backward.

#define NNF_BITMASK_KERNELS(T, S)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        relu_mask_fwd_##S(const T* x, T* y, u32* mask, u64 n) {                                   \
        fwd<T, false>(x, nullptr, y, mask, n);                                                    \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        add_relu_mask_fwd_##S(const T* x, const T* z, T* y, u32* mask, u64 n) {                   \
        fwd<T, true>(x, z, y, mask, n);                                                           \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        relu_mask_bwd_##S(const T* dy, const u32* mask, T* dx, T* dz, u64 n) {                    \
        bwd<T>(dy, mask, dx, dz, n);                                                              \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        relu_bwd_from_y_##S(const T* dy, const T* y, T* dx, u64 n) {                              \
        bwd_from_y<T>(dy, y, dx, n);                                                              \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        relu_mask_fwd_naive8_##S(const T* x, T* y, u32* mask, u64 n) {                            \
        fwd_naive8<T>(x, y, mask, n);                                                             \
    }

NNF_BITMASK_KERNELS(float, f32)
NNF_BITMASK_KERNELS(nnf_f16, f16)
NNF_BITMASK_KERNELS(nnf_bf16, bf16)
