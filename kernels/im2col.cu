// im2col, col2im (gather) and the f32 accumulation of filter-gradient partials, for the
// im2col + GEMM convolution path. Layouts (src/reference/conv.rs): with P = oh*ow output pixels
// and K = c_in*kh*kw taps per image,
//  * NCHW columns: element (b, q, p) at b*col_img + q*col_row + p, q = (c*kh + r)*kw + s.
//    The reference layout [n][K][P] is col_img = K*P, col_row = P; the filter gradient uses
//    [K][chunk][P] (col_img = P, col_row = chunk*P) so that a chunk's images form one matrix.
//  * NHWC columns: element (b, p, q) at b*col_img + p*K + q, q = (r*kw + s)*c_in + c: each
//    pixel's patch is contiguous, an image's columns are one contiguous run of P*K elements,
//    and with dilation 1 along the width the kw*c_in items of one filter row r are one
//    contiguous run of the input row as well.
//
// im2col only copies, so its kernels are typed by size. The work mappings keep the index math
// far below the memory time (a flat one-thread-per-2-byte-element mapping with ~4 divisions
// per element was issue-bound at 30% of copy bandwidth on the 7x7/2 stem):
//  * NCHW (im2col_nchw_b2/b4), Caffe's scheme widened: a thread takes one output pixel of
//    ITEMS consecutive channels (consecutive threads: consecutive pixels, so that loads and
//    stores are coalesced) and walks the kh*kw taps for all of them at once, two taps per round:
//    the tap offsets (r*dh, s*dw) are uniform across the grid and the channels share the
//    pixel's bounds test, so the per-element work is the copy itself, and 2*ITEMS loads are in
//    flight before their stores. gridDim.z splits the taps into groups of TGROUP (4), so that
//    a thread makes at most two rounds and small layers still spread over several short waves
//    of blocks (a whole-patch thread made 5 rounds for 3x3, so that the last, partial wave of
//    a 512@7² layer cost as much as a full one).
//  * NHWC with a copy unit of 8 or 16 bytes (im2col_nhwc_b8/b16: the tap's channel run is a
//    whole number of units and both pointers are aligned; b2/b4 are the fallback), flat: a
//    thread takes EPT units of the image's contiguous column matrix (2 of 16 bytes, else 4),
//    THREADS apart, so that every load and store of a warp is contiguous; three magic-number
//    divisions per unit (pixel, filter row, output row), done once before the image loop; the
//    EPT loads are in flight before the stores. A block covers THREADS*EPT units and makes one
//    round, so that small layers (512@7²: 56 blocks an image) spread over short blocks.
//  * NHWC with 2- or 4-byte elements whose channel runs allow no wider unit (the c_in = 3
//    stem) and dilation 1 along the width (im2col_nhwc_rows_b2/b4): a block takes TW
//    consecutive output pixels of one output row, stages the kh input row segments they read
//    (all channels, zeros in the padding) in shared memory in aligned 16-byte vectors (each
//    tile row offset by its segment's alignment in x; element-wise only at the image's edges),
//    then writes its P*K output range (contiguous) in aligned 16-byte stores, each composed
//    from at most two contiguous runs of the staged rows (kw*c_in >= 16/elem: the launcher's
//    condition). One division pair per 16 bytes staged or written, no per-element bounds tests
//    away from the edges.
// gridDim.y strides over the images of the chunk. Per-image indices are 32-bit (the launcher
// keeps every per-image count below 2^31); image offsets are 64-bit. Divisions by the shape's
// runtime extents use precomputed magic numbers (FastDiv; host side and CPU tests in
// src/conv/im2col/launch.rs, which also emulates every kernel thread by thread).
// Padding writes all-zero bits, +0.0 in every type.
//
// col2im is a gather: each input element (or NHWC unit of 4/8/16 bytes of channels) sums, in
// f32 and in the fixed tap order (r, s), the column entries that read it, then rounds once:
// deterministic, no atomics. One work item per thread. The taps that reach an item are ranges
// of two progressions (rows r0 + a*rstep, columns s0 + m*sstep: a quarter of the filter for a
// 2x2 stride), found once per thread, and the column offset is linear in a and m, so a tap
// costs an add, its load and its sum; a filter row's taps are read four at a time (predicated
// loads issued before their adds) so that a thread waits for memory once per four taps.

constexpr u32 THREADS = 256;  // threads per block (src/conv/im2col/launch.rs: THREADS)
constexpr u32 ITEMS = 4;      // NCHW im2col: channels per thread (launch.rs: ITEMS)
constexpr u32 SGROUP = 4;     // col2im: taps of a filter row loaded together

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
    u32 count;    // work items per image (NCHW im2col: ceil(c_in/ITEMS)*P; NHWC flat im2col:
                  // P*taps units; col2im: x's units per image; rows kernel: unused)
    u32 c_in;     // channels (NHWC unit kernels: units per pixel of x)
    u32 h, w;
    u32 kh, kw;
    u32 oh, ow;
    u32 pixels;   // oh*ow
    u32 taps;     // K = c_in*kh*kw (NHWC unit kernels: units per pixel of the columns)
    u32 khkw;     // kh*kw
    u32 kwc;      // kw*c_in: the units of one filter row (NHWC)
    u32 wc;       // w*c_in: the units of one input row (NHWC)
    u32 tw;       // rows kernel: output pixels per block
    u32 tiles;    // rows kernel: blocks per output row, ceil(ow / tw)
    u32 rowlen;   // rows kernel: staged elements per filter row, ((tw-1)*sw + kw) * c_in
    u32 rstride;  // rows kernel: tile row stride (elements), >= rowlen + 2V - 1, = dh*wc mod V
    u32 tgroup;   // NCHW im2col: taps per gridDim.z group (even)
    u32 rstep;    // col2im: sh / gcd(sh, dh), the step between filter rows that reach an input row
    u32 sstep;    // col2im: sw / gcd(sw, dw), likewise along the width
    u32 flags;    // bit 0, NCHW im2col: every column offset within an image fits 32 bits;
                  // bit 1, col2im: add to x's old value (dx +=)
    u32 unused;   // no implicit padding in the layout
    int sh, sw, ph, pw, dh, dw;
    FastDiv d_ow, d_cin, d_pixels, d_kwc, d_w, d_hw, d_sh, d_sw, d_taps, d_tiles, d_kw;
    FastDiv d_rowvec;  // rows kernel: by ceil((rowlen + V - 1) / V), the vectors staged a row
    // col2im: by rstep, sstep, and by doy = dh / gcd(sh, dh), dox = dw / gcd(sw, dw), the output
    // rows (columns) between consecutive taps of a progression.
    FastDiv d_rstep, d_sstep, d_doy, d_dox;
};
static_assert(sizeof(ColGeom) == 328, "ColGeom must match src/conv/im2col/launch.rs");

// --- im2col --------------------------------------------------------------------------------

// The element under a tap, or zero bits in the padding. Branch-free (the address is clamped to
// the base, which is always valid), so that the compiler keeps the loads independent.
template <typename E>
__device__ __forceinline__ E tap_value(const E* base, bool inside, u32 at) {
    const E v = base[inside ? at : 0u];
    return inside ? v : E{};
}

// p, hidden from the optimiser: it then keeps p in a register pair and addresses p[i] with
// one wide multiply-add, instead of re-adding a 64-bit offset to the kernel argument for every
// access (4 instructions). The pointer loses its known address space, so accesses through it
// use __ldg / __stwb to stay global loads and stores.
template <typename P> __device__ __forceinline__ P* opaque(P* p) {
    asm("" : "+l"(p));
    return p;
}

template <typename E, typename Off>
__device__ __forceinline__ void im2col_nchw(const E* __restrict__ x, E* __restrict__ cols,
                                            const ColGeom& g, u32 images) {
    // Work item e = cg*P + p: pixel p of channels c0 .. c0 + ITEMS - 1, c0 = cg*ITEMS (those
    // below c_in are live). The channels of a thread share the pixel's coordinates, so one
    // bounds test and one in-plane offset serve all of them; their planes are h*w apart and
    // their column rows kh*kw*col_row apart. A dead channel (past c_in) reads channel c0's
    // element and stores it to channel c0's place: the same value, so no test per store.
    // Off: the type of column offsets within an image (u32 when the launcher found they fit).
    const u32 e = blockIdx.x * THREADS + threadIdx.x;
    if (e >= g.count) return;  // no barrier below
    const u32 cg = fdiv(e, g.d_pixels), p = e - cg * g.pixels;
    const u32 oy = fdiv(p, g.d_ow), ox = p - oy * g.ow;
    const int iy0 = (int)oy * g.sh - g.ph;
    const int ix0 = (int)ox * g.sw - g.pw;
    const u32 c0 = cg * ITEMS;
    const u32 live = min(g.c_in - c0, ITEMS);  // >= 1
    const u32 plane_len = g.h * g.w;
    const Off col_row = (Off)g.col_row;
    const Off chan_rows = (Off)g.khkw * col_row;
    u32 plane_off[ITEMS];
    Off chan_off[ITEMS];
#pragma unroll
    for (u32 i = 0; i < ITEMS; ++i) {
        plane_off[i] = i < live ? i * plane_len : 0u;
        chan_off[i] = i < live ? (Off)i * chan_rows : (Off)0;
    }
    // This block's taps: [t0, t1), a group of g.tgroup (even) on gridDim.z.
    const u32 t0 = blockIdx.z * g.tgroup, t1 = min(t0 + g.tgroup, g.khkw);
    const u32 r0 = fdiv(t0, g.d_kw), s0 = t0 - r0 * g.kw;
    for (u32 b = blockIdx.y; b < images; b += gridDim.y) {
        const E* xb = opaque(x + (u64)b * g.x_img + c0 * plane_len);  // c0*h*w < 2^31
        // Column offset of channel c0's tap t0 at pixel p.
        E* cb = opaque(cols + (u64)b * g.col_img);
        Off row = (Off)c0 * chan_rows + (Off)t0 * col_row + (Off)p;
        // Tap t = r*kw + s: offsets (dy, dx) = (r*dh, s*dw), uniform across the block.
        int dy = (int)r0 * g.dh, dx = (int)s0 * g.dw;
        u32 s = s0;
        // One tap's ITEMS values, then the odometer to the next tap.
        const auto load = [&](E* v) {
            const int iy = iy0 + dy, ix = ix0 + dx;
            const bool inside = (u32)iy < g.h && (u32)ix < g.w;
            const u32 at = inside ? (u32)iy * g.w + (u32)ix : 0u;
#pragma unroll
            for (u32 i = 0; i < ITEMS; ++i) {
                const E val = __ldg(xb + at + plane_off[i]);
                v[i] = inside ? val : E{};
            }
            dx += g.dw;
            if (++s == g.kw) {
                s = 0;
                dx = 0;
                dy += g.dh;
            }
        };
        u32 t = t0;
        for (; t + 2 <= t1; t += 2) {
            E v0[ITEMS], v1[ITEMS];
            load(v0);
            load(v1);
#pragma unroll
            for (u32 i = 0; i < ITEMS; ++i) {
                __stwb(cb + row + chan_off[i], v0[i]);
                __stwb(cb + row + chan_off[i] + col_row, v1[i]);
            }
            row += 2 * col_row;
        }
        if (t < t1) {  // an odd group's last tap
            E v0[ITEMS];
            load(v0);
#pragma unroll
            for (u32 i = 0; i < ITEMS; ++i) __stwb(cb + row + chan_off[i], v0[i]);
        }
    }
}

// NHWC, flat over the image's column units (see the header).
template <typename E, u32 EPT, bool DW1>
__device__ __forceinline__ void im2col_nhwc(const E* __restrict__ x, E* __restrict__ cols,
                                            const ColGeom& g, u32 images) {
    const u32 first = blockIdx.x * (THREADS * EPT) + threadIdx.x;
    if (first >= g.count) return;  // no barrier below
    u32 src[EPT];  // the unit's offset in the image's input
    bool inside[EPT], live[EPT];
#pragma unroll
    for (u32 j = 0; j < EPT; ++j) {
        const u32 e0 = first + j * THREADS;
        live[j] = e0 < g.count;
        const u32 e = live[j] ? e0 : first;
        const u32 p = fdiv(e, g.d_taps), q = e - p * g.taps;
        const u32 oy = fdiv(p, g.d_ow), ox = p - oy * g.ow;
        const u32 r = fdiv(q, g.d_kwc), jj = q - r * g.kwc;
        const int iy = (int)oy * g.sh - g.ph + (int)r * g.dh;
        const int ix0 = (int)ox * g.sw - g.pw;
        if constexpr (DW1) {
            // s and c fused: jj is the offset from input column ix0 within the input row.
            const int xc = ix0 * (int)g.c_in + (int)jj;
            inside[j] = (u32)iy < g.h && (u32)xc < g.wc;
            src[j] = (u32)iy * g.wc + (u32)xc;
        } else {
            const u32 s = fdiv(jj, g.d_cin), c = jj - s * g.c_in;
            const int ix = ix0 + (int)s * g.dw;
            inside[j] = (u32)iy < g.h && (u32)ix < g.w;
            src[j] = ((u32)iy * g.w + (u32)ix) * g.c_in + c;
        }
    }
    for (u32 b = blockIdx.y; b < images; b += gridDim.y) {
        const E* xb = x + (u64)b * g.x_img;
        E* cb = cols + (u64)b * g.col_img;
        E v[EPT];
#pragma unroll
        for (u32 j = 0; j < EPT; ++j) v[j] = tap_value(xb, inside[j], src[j]);
#pragma unroll
        for (u32 j = 0; j < EPT; ++j)
            if (live[j]) cb[first + j * THREADS] = v[j];
    }
}

// Rows kernel tile. Element k of filter row r's staged segment (input row iy = iys + r*dh, fused
// offsets xcs + k) sits at tile[r*rstride + off + k], off = (x's image address in elements +
// iys*wc + xcs) mod V. The launcher makes rstride = dh*wc (mod V), so every staged element keeps
// its position within a 16-byte vector of x: staging copies aligned vectors. Consecutive rows
// are at least 2V - 1 elements apart, so a row's vectors never touch another row's.
__device__ __forceinline__ u32 staged_at(u32 i, u32 off, const ColGeom& g) {
    const u32 pl = fdiv(i, g.d_taps), q = i - pl * g.taps;  // pixel of the block, tap
    const u32 r = fdiv(q, g.d_kwc), j = q - r * g.kwc;
    return r * g.rstride + off + pl * (u32)g.sw * g.c_in + j;
}

// The 16-byte vector of x at fused offsets [xc0, xc0 + V) of input row iy (aligned by the
// caller's choice of xc0), zeros outside the image: one vector load inside, element by element
// at the image's edges.
template <typename E>
__device__ __forceinline__ uint4 stage_vector(const E* __restrict__ xb, bool row_in, int iy,
                                              int xc0, const ColGeom& g) {
    constexpr int V = 16 / sizeof(E);
    const u32 row = row_in ? (u32)iy * g.wc : 0u;
    if (row_in && xc0 >= 0 && xc0 + V <= (int)g.wc)
        return *reinterpret_cast<const uint4*>(xb + row + (u32)xc0);
    E e[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int xc = xc0 + j;
        e[j] = tap_value(xb + row, row_in && (u32)xc < g.wc, (u32)xc);
    }
    if constexpr (sizeof(E) == 2) {
        return make_uint4((u32)e[0] | ((u32)e[1] << 16), (u32)e[2] | ((u32)e[3] << 16),
                          (u32)e[4] | ((u32)e[5] << 16), (u32)e[6] | ((u32)e[7] << 16));
    } else {
        return make_uint4(e[0], e[1], e[2], e[3]);
    }
}

// Element K of a 16-byte chunk composed from two runs of the tile: the element at shared-window
// byte address s1 + K*sizeof(E) when K < n1, else at s2 + K*sizeof(E). One compare and two
// complementary predicated loads with K folded into their immediates (a select of the addresses
// would be turned back into a select of indices, a multiply and an add per element). volatile:
// the loads read what other threads staged, so they must stay after the __syncthreads() that
// follows the staging and before the one that lets the next image restage.
template <typename E> struct ChunkGather;
template <> struct ChunkGather<unsigned short> {
    // Zero-extended into a 32-bit register, so that two halves pack with one instruction.
    template <u32 K> __device__ __forceinline__ static u32 at(u32 s1, u32 s2, u32 n1) {
        u32 v;
        asm volatile("{\n\t.reg .pred p;\n\tsetp.gt.u32 p, %3, %4;\n\t@p ld.shared.u16 %0, [%1+%5];"
            "\n\t@!p ld.shared.u16 %0, [%2+%5];\n\t}"
            : "=r"(v)
            : "r"(s1), "r"(s2), "r"(n1), "n"(K), "n"(K * 2));
        return v;
    }
};
template <> struct ChunkGather<u32> {
    template <u32 K> __device__ __forceinline__ static u32 at(u32 s1, u32 s2, u32 n1) {
        u32 v;
        asm volatile("{\n\t.reg .pred p;\n\tsetp.gt.u32 p, %3, %4;\n\t@p ld.shared.u32 %0, [%1+%5];"
            "\n\t@!p ld.shared.u32 %0, [%2+%5];\n\t}"
            : "=r"(v)
            : "r"(s1), "r"(s2), "r"(n1), "n"(K), "n"(K * 4));
        return v;
    }
};

// The 16 bytes of a chunk (V = 8 halves or 4 words) as one vector.
__device__ __forceinline__ uint4 gather16(unsigned short*, u32 s1, u32 s2, u32 n1) {
    using G = ChunkGather<unsigned short>;
    const auto w = [](u32 lo, u32 hi) { return lo | (hi << 16); };
    return make_uint4(w(G::at<0>(s1, s2, n1), G::at<1>(s1, s2, n1)),
                      w(G::at<2>(s1, s2, n1), G::at<3>(s1, s2, n1)),
                      w(G::at<4>(s1, s2, n1), G::at<5>(s1, s2, n1)),
                      w(G::at<6>(s1, s2, n1), G::at<7>(s1, s2, n1)));
}
__device__ __forceinline__ uint4 gather16(u32*, u32 s1, u32 s2, u32 n1) {
    using G = ChunkGather<u32>;
    return make_uint4(G::at<0>(s1, s2, n1), G::at<1>(s1, s2, n1), G::at<2>(s1, s2, n1),
                      G::at<3>(s1, s2, n1));
}

// NHWC rows kernel (see the header); E is the element (2 or 4 bytes); dilation 1 along the
// width and kwc >= 16 / sizeof(E) (the launcher's conditions).
template <typename E>
__device__ __forceinline__ void im2col_nhwc_rows(const E* __restrict__ x, E* __restrict__ cols,
                                                 const ColGeom& g, u32 images) {
    constexpr u32 V = 16 / sizeof(E);  // elements per 16-byte vector
    extern __shared__ __align__(16) unsigned char smem_raw[];
    E* tile = reinterpret_cast<E*>(smem_raw);  // [kh][rstride]
    const u32 tile_addr = (u32)__cvta_generic_to_shared(smem_raw);
    const u32 oy = fdiv(blockIdx.x, g.d_tiles), ox0 = (blockIdx.x - oy * g.tiles) * g.tw;
    const u32 npix = min(g.tw, g.ow - ox0);
    const int iys = (int)oy * g.sh - g.ph;
    // The staged segment's first element in the fused (column, channel) offset of a row.
    const int xcs = ((int)ox0 * g.sw - g.pw) * (int)g.c_in;
    const u32 len = npix * g.taps;                 // the block's output elements
    const u32 start = (oy * g.ow + ox0) * g.taps;  // ... from here in the image's columns
    const u32 step = (u32)g.sw * g.c_in;           // staged elements from a pixel to the next
    // Vectors staged per row: enough for rowlen elements at any alignment (ceil((rowlen + V - 1)
    // / V); d_rowvec divides by it).
    const u32 rowvecs = g.d_rowvec.d, nvec = g.kh * rowvecs;
    for (u32 b = blockIdx.y; b < images; b += gridDim.y) {
        const E* xb = x + (u64)b * g.x_img;
        const u32 off =
            ((u32)(reinterpret_cast<size_t>(xb) / sizeof(E)) + (u32)iys * g.wc + (u32)xcs) & (V - 1);
        // Stage every vector of the tile, two per thread in flight. Vector vi of row r is tile
        // vector (r*rstride + off) / V + vi; it holds segment elements vi*V - a .. + V, with
        // a = (r*rstride + off) mod V (a few before or after the segment: unused).
        for (u32 n0 = threadIdx.x; n0 < nvec; n0 += 2 * THREADS) {
            uint4 v[2];
            u32 at[2];
#pragma unroll
            for (u32 u = 0; u < 2; ++u) {
                const u32 n = min(n0 + u * THREADS, nvec - 1);  // past the end: never stored
                const u32 r = fdiv(n, g.d_rowvec), vi = n - r * rowvecs;
                const int iy = iys + (int)r * g.dh;
                const u32 first = r * g.rstride + off;
                at[u] = first / V + vi;
                v[u] = stage_vector(xb, (u32)iy < g.h, iy, xcs + (int)(vi * V - (first & (V - 1))),
                                    g);
            }
#pragma unroll
            for (u32 u = 0; u < 2; ++u)
                if (n0 + u * THREADS < nvec) reinterpret_cast<uint4*>(tile)[at[u]] = v[u];
        }
        __syncthreads();
        // Write [start, start + len) of the image's columns: the unaligned head and tail element
        // by element, the rest in aligned 16-byte stores.
        E* out = cols + (u64)b * g.col_img + start;
        const u32 mis = (u32)(reinterpret_cast<size_t>(out) / sizeof(E)) & (V - 1);
        const u32 head = min((V - mis) & (V - 1), len);
        const u32 chunks = (len - head) / V;
        const u32 tail = head + chunks * V;
        if (threadIdx.x < head) out[threadIdx.x] = tile[staged_at(threadIdx.x, off, g)];
        if (tail + threadIdx.x < len) {  // len - tail < V <= THREADS
            const u32 i = tail + threadIdx.x;
            out[i] = tile[staged_at(i, off, g)];
        }
        // Not unrolled: one chunk's ~60 instructions hide no latency worth the registers.
#pragma unroll 1
        for (u32 m = threadIdx.x; m < chunks; m += THREADS) {
            const u32 i = head + m * V;
            const u32 pl = fdiv(i, g.d_taps), q = i - pl * g.taps;
            const u32 r = fdiv(q, g.d_kwc), j = q - r * g.kwc;
            // Elements k < n1 continue the run of (pl, r) at a1; the rest start the next run,
            // (pl, r + 1) or (pl + 1, 0), at a2 (kwc >= V: at most two runs).
            const u32 a1 = r * g.rstride + off + pl * step + j;
            const u32 n1 = g.kwc - j;
            const u32 a2 = r + 1 < g.kh ? a1 - j + g.rstride : off + (pl + 1) * step;
            // Shared-window byte addresses of the two runs (u32 modular: s2 + k*elem is element
            // a2 + k - n1 for k >= n1).
            const u32 s1 = tile_addr + a1 * (u32)sizeof(E);
            const u32 s2 = tile_addr + (a2 - n1) * (u32)sizeof(E);
            *reinterpret_cast<uint4*>(out + i) = gather16(out, s1, s2, n1);
        }
        __syncthreads();  // the next image restages the tile
    }
}

// --- col2im (gather) -----------------------------------------------------------------------

// One 32-bit word of T as floats (little-endian: element 2i is the low half of word i).
template <typename T> struct Word;
template <> struct Word<float> {
    static constexpr u32 N = 1;
    __device__ static void add(float* acc, u32 w) { acc[0] += __uint_as_float(w); }
    __device__ static u32 pack(const float* a) { return __float_as_uint(a[0]); }
};
template <typename H> struct WordHalf {
    static constexpr u32 N = 2;
    __device__ static float half(u32 bits) {
        H h;
        h.bits = (unsigned short)bits;
        return to_float(h);
    }
    __device__ static void add(float* acc, u32 w) {
        acc[0] += half(w & 0xffffu);
        acc[1] += half(w >> 16);
    }
    __device__ static u32 pack(const float* a) {
        return (u32)from_float<H>(a[0]).bits | ((u32)from_float<H>(a[1]).bits << 16);
    }
};
template <> struct Word<nnf_f16> : WordHalf<nnf_f16> {};
template <> struct Word<nnf_bf16> : WordHalf<nnf_bf16> {};

// W 32-bit words (1, 2 or 4: a 4-, 8- or 16-byte unit); stored at unit index `at` of `base`.
template <u32 W> struct Words {
    u32 w[W];
};
template <u32 W> __device__ __forceinline__ void store_words(void* base, u32 at, const Words<W>& r) {
    if constexpr (W == 4) {
        reinterpret_cast<uint4*>(base)[at] = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
    } else if constexpr (W == 2) {
        reinterpret_cast<uint2*>(base)[at] = make_uint2(r.w[0], r.w[1]);
    } else {
        reinterpret_cast<u32*>(base)[at] = r.w[0];
    }
}

// W 32-bit words loaded from unit index `at` of `base` (col2im's old dx when it adds).
template <u32 W> __device__ __forceinline__ Words<W> load_words(const void* base, u32 at) {
    if constexpr (W == 4) {
        const uint4 v = reinterpret_cast<const uint4*>(base)[at];
        return Words<W>{{v.x, v.y, v.z, v.w}};
    } else if constexpr (W == 2) {
        const uint2 v = reinterpret_cast<const uint2*>(base)[at];
        return Words<W>{{v.x, v.y}};
    } else {
        return Words<W>{{reinterpret_cast<const u32*>(base)[at]}};
    }
}

// A work item's value as stored (Raw: one element of T for W = 0, else W words) and the number
// of f32 sums it needs (N). NVRTC has no <type_traits>, hence the specialisation.
template <typename T, u32 W> struct Acc {
    static constexpr u32 N = W * Word<T>::N;
    using Raw = Words<W>;
};
template <typename T> struct Acc<T, 0> {
    static constexpr u32 N = 1;
    using Raw = T;
};

// A work item's stored value through a pointer whose address space the optimiser no longer
// knows (opaque): a global load, read-only path.
__device__ __forceinline__ float ldg_raw(const float* p) { return __ldg(p); }
__device__ __forceinline__ nnf_f16 ldg_raw(const nnf_f16* p) {
    nnf_f16 h;
    h.bits = __ldg(reinterpret_cast<const unsigned short*>(p));
    return h;
}
__device__ __forceinline__ nnf_bf16 ldg_raw(const nnf_bf16* p) {
    nnf_bf16 h;
    h.bits = __ldg(reinterpret_cast<const unsigned short*>(p));
    return h;
}
__device__ __forceinline__ Words<1> ldg_raw(const Words<1>* p) {
    return Words<1>{{__ldg(reinterpret_cast<const u32*>(p))}};
}
__device__ __forceinline__ Words<2> ldg_raw(const Words<2>* p) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    return Words<2>{{v.x, v.y}};
}
__device__ __forceinline__ Words<4> ldg_raw(const Words<4>* p) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    return Words<4>{{v.x, v.y, v.z, v.w}};
}

// Along one axis, tap k reads input index i from output o when t = i + pad - k*dil = o*stride
// with 0 <= o < out. The k whose t is a multiple of the stride are first_tap(...) + m*step,
// step = stride / gcd(stride, dil); t decreases as k grows.

// The smallest k in [0, step) with t = ipad - k*dil >= 0 a multiple of the stride, or ~0u when
// there is none (then no tap of the axis reads index i: larger k only lower t).
__device__ __forceinline__ u32 first_tap(int ipad, int dil, int stride, const FastDiv& ds,
                                         u32 step) {
    if (stride == 1) return 0;  // uniform across the grid
    for (u32 k = 0; k < step; ++k) {
        const int t = ipad - (int)k * dil;
        if (t < 0) break;
        if ((int)(fdiv((u32)t, ds) * (u32)stride) == t) return k;
    }
    return ~0u;
}

// o = t / stride for t >= 0 a multiple of the stride.
__device__ __forceinline__ u32 exact_div(int t, int stride, const FastDiv& ds) {
    return stride == 1 ? (u32)t : fdiv((u32)t, ds);
}

// The taps of one progression (rows or columns) that read input index i: k = k0 + n*kstep for
// n in [lo, lo + count), reading output index o0 - n*dout; count = 0 when none does. k0 = first
// tap, o0 = its output index; constraints: k < kext, o >= 0, o < out.
struct TapRange {
    u32 lo, count, k, o;  // the first valid tap k and its output index o
};
__device__ __forceinline__ TapRange tap_range(int ipad, int dil, int stride, const FastDiv& ds,
                                              u32 kstep, const FastDiv& dk, const FastDiv& dout,
                                              u32 kext, u32 out) {
    TapRange t{0, 0, 0, 0};
    const u32 k0 = first_tap(ipad, dil, stride, ds, kstep);
    if (k0 >= kext) return t;
    const u32 o0 = exact_div(ipad - (int)k0 * dil, stride, ds);
    const u32 hi = min(fdiv(kext - 1 - k0, dk), fdiv(o0, dout));        // k < kext, o >= 0
    const u32 lo = o0 >= out ? fdiv(o0 - out + dout.d, dout) : 0u;     // o < out
    if (lo > hi) return t;
    t.lo = lo;
    t.count = hi - lo + 1;
    t.k = k0 + lo * kstep;
    t.o = o0 - lo * dout.d;
    return t;
}

// One item per thread. NCHW (NCHW = true): an element (c, iy, ix), columns at q*col_row + pixel
// with q = (c*kh + r)*kw + s; NHWC: a unit (pixel, c) of W words (or an element, W = 0), columns
// at pixel*taps + (r*kw + s)*c_in + c, in units. The taps that reach the item are the rows
// r0 + a*rstep (a < na) times the columns s0 + m*sstep (m < nm), found once per thread; the
// column offset is linear in a and in m, so each tap costs an add, its load and its sum.
template <typename T, u32 W, bool NCHW>
__device__ __forceinline__ void col2im(const T* __restrict__ cols, T* __restrict__ x,
                                       const ColGeom& g, u32 images) {
    constexpr u32 N = Acc<T, W>::N;
    using Raw = typename Acc<T, W>::Raw;
    const u32 e = blockIdx.x * THREADS + threadIdx.x;
    if (e >= g.count) return;
    u32 c, iy, ix;
    if constexpr (NCHW) {
        c = fdiv(e, g.d_hw);
        const u32 pix = e - c * g.d_hw.d;
        iy = fdiv(pix, g.d_w), ix = pix - iy * g.w;
    } else {
        const u32 pix = fdiv(e, g.d_cin);
        c = e - pix * g.c_in;
        iy = fdiv(pix, g.d_w), ix = pix - iy * g.w;
    }
    const TapRange rr = tap_range((int)iy + g.ph, g.dh, g.sh, g.d_sh, g.rstep, g.d_rstep, g.d_doy,
                                  g.kh, g.oh);
    const TapRange sr = tap_range((int)ix + g.pw, g.dw, g.sw, g.d_sw, g.sstep, g.d_sstep, g.d_dox,
                                  g.kw, g.ow);
    const u32 na = sr.count == 0 ? 0u : rr.count, nm = sr.count;
    // The first tap's offset and the steps along a and m (u32 modular arithmetic: the steps
    // may be negative; every offset actually used is a valid one).
    u32 at0, da, dm;
    if constexpr (NCHW) {
        const u32 P = (u32)g.col_row;  // the reference layout
        at0 = ((c * g.kh + rr.k) * g.kw + sr.k) * P + rr.o * g.ow + sr.o;
        da = g.rstep * g.kw * P - g.d_doy.d * g.ow;
        dm = g.sstep * P - g.d_dox.d;
    } else {
        at0 = (rr.o * g.ow + sr.o) * g.taps + (rr.k * g.kw + sr.k) * g.c_in + c;
        da = g.rstep * g.kw * g.c_in - g.d_doy.d * g.ow * g.taps;
        dm = g.sstep * g.c_in - g.d_dox.d * g.taps;
    }
    const Raw* cr = reinterpret_cast<const Raw*>(cols);
    for (u32 b = blockIdx.y; b < images; b += gridDim.y) {
        const Raw* cb = opaque(cr + (u64)b * g.col_img);
        float acc[N];
#pragma unroll
        for (u32 i = 0; i < N; ++i) acc[i] = 0.0f;
        u32 row = at0;
        for (u32 a = 0; a < na; ++a, row += da) {
            for (u32 m0 = 0; m0 < nm; m0 += SGROUP) {
                Raw v[SGROUP];
#pragma unroll
                for (u32 k = 0; k < SGROUP; ++k)
                    if (m0 + k < nm) v[k] = ldg_raw(cb + (row + (m0 + k) * dm));
#pragma unroll
                for (u32 k = 0; k < SGROUP; ++k) {
                    if (m0 + k >= nm) continue;
                    if constexpr (W == 0) {
                        acc[0] += to_float(v[k]);
                    } else {
#pragma unroll
                        for (u32 i = 0; i < W; ++i) Word<T>::add(acc + i * Word<T>::N, v[k].w[i]);
                    }
                }
            }
        }
        T* xb = x + (u64)b * g.x_img * (W == 0 ? 1 : W * 4 / sizeof(T));
        // flags bit 1 (launch.rs: COL2IM_ADD): dx += the sum, added in f32, rounded once.
        const bool add = (g.flags & 2u) != 0u;
        if constexpr (W == 0) {
            if (add) acc[0] += to_float(xb[e]);
            xb[e] = from_float<T>(acc[0]);
        } else {
            if (add) {
                const Words<W> old = load_words<W>(xb, e);
#pragma unroll
                for (u32 i = 0; i < W; ++i) Word<T>::add(acc + i * Word<T>::N, old.w[i]);
            }
            Words<W> out;
#pragma unroll
            for (u32 i = 0; i < W; ++i) out.w[i] = Word<T>::pack(acc + i * Word<T>::N);
            store_words<W>(xb, e, out);
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

// --- pieces of the NCHW pointwise filter gradient (src/conv/im2col/steps.rs: Step::PieceGemm) ---

// The pointer arrays of cublasGemmBatchedEx: piece q = i * split + j (image i, piece j of its
// pixels) reads A at a + i * a_img + j * a_step and B likewise (bytes), and writes C at
// c + q * c_step. Written on the device so that the call stays capturable (no host copy).
extern "C" __global__ void __launch_bounds__(THREADS)
    conv_piece_ptrs(u64 a, u64 a_img, u64 a_step, u64 b, u64 b_img, u64 b_step, u64 c, u64 c_step,
                    u64 split, u64 count, u64* __restrict__ out) {
    for (u64 q = global_thread(); q < count; q += grid_threads()) {
        const u64 i = q / split, j = q - i * split;
        out[q] = a + i * a_img + j * a_step;
        out[count + q] = b + i * b_img + j * b_step;
        out[2 * count + q] = c + q * c_step;
    }
}

// out = (add ? out : 0) + part[0] + part[1] + ... + part[count - 1], element by element, in f32
// and in that order (deterministic): the pieces' partial filter gradients summed.
extern "C" __global__ void __launch_bounds__(THREADS)
    conv_sum_parts_f32(const float* __restrict__ part, float* __restrict__ out, u64 len, u32 count,
                       u32 add) {
    for (u64 i = global_thread(); i < len; i += grid_threads()) {
        float s = add ? out[i] : 0.0f;
        for (u32 q = 0; q < count; ++q) s += part[(u64)q * len + i];
        out[i] = s;
    }
}

// --- entry points --------------------------------------------------------------------------

#define NNF_IM2COL_UNIT(E, EPT, S)                                                                \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        im2col_nhwc_##S(const E* x, E* cols, ColGeom g, u32 images) {                             \
        if (g.dw == 1)                                                                            \
            im2col_nhwc<E, EPT, true>(x, cols, g, images);                                        \
        else                                                                                      \
            im2col_nhwc<E, EPT, false>(x, cols, g, images);                                       \
    }

// Units per thread: 32 bytes in flight for 16- and 8-byte units (launch.rs: nhwc_ept).
NNF_IM2COL_UNIT(unsigned short, 4, b2)
NNF_IM2COL_UNIT(u32, 4, b4)
NNF_IM2COL_UNIT(uint2, 4, b8)
NNF_IM2COL_UNIT(uint4, 2, b16)

extern "C" __global__ void __launch_bounds__(THREADS)
    im2col_nhwc_rows_b2(const unsigned short* x, unsigned short* cols, ColGeom g, u32 images) {
    im2col_nhwc_rows<unsigned short>(x, cols, g, images);
}
extern "C" __global__ void __launch_bounds__(THREADS)
    im2col_nhwc_rows_b4(const u32* x, u32* cols, ColGeom g, u32 images) {
    im2col_nhwc_rows<u32>(x, cols, g, images);
}

// NCHW: column offsets within an image in 32 bits when they fit (flag bit 0: launch.rs).
#define NNF_IM2COL_NCHW(E, S)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, 6)                                      \
        im2col_nchw_##S(const E* x, E* cols, ColGeom g, u32 images) {                             \
        if (g.flags & 1u)                                                                         \
            im2col_nchw<E, u32>(x, cols, g, images);                                              \
        else                                                                                      \
            im2col_nchw<E, u64>(x, cols, g, images);                                              \
    }

NNF_IM2COL_NCHW(unsigned short, b2)
NNF_IM2COL_NCHW(u32, b4)

// col2im's minimum resident blocks per SM (a register cap): 8 for elements and 4-byte units
// (their loads are small, so occupancy carries the bytes in flight), 6 for 8-byte units, 5 for
// 16-byte units (80 KB in flight per SM; a tighter cap spills).
#define NNF_COL2IM_ENTRY(T, W, NCHW, MINB, NAME)                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS, MINB)                                   \
        NAME(const T* cols, T* x, ColGeom g, u32 images) {                                        \
        col2im<T, W, NCHW>(cols, x, g, images);                                                   \
    }

#define NNF_COL2IM(T, S)                                                                          \
    NNF_COL2IM_ENTRY(T, 0, true, 8, col2im_nchw_##S)                                              \
    NNF_COL2IM_ENTRY(T, 0, false, 8, col2im_nhwc_##S)                                             \
    NNF_COL2IM_ENTRY(T, 2, false, 6, col2im_nhwc_v8_##S)                                          \
    NNF_COL2IM_ENTRY(T, 4, false, 5, col2im_nhwc_v16_##S)                                         \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        conv_accumulate_##S(const T* part, float* acc, T* out, u64 len, u32 mode) {               \
        accumulate<T>(part, acc, out, len, mode);                                                 \
    }

NNF_COL2IM(float, f32)
NNF_COL2IM(nnf_f16, f16)
NNF_COL2IM(nnf_bf16, bf16)
// 4-byte units: two channels of a 16-bit type (for f32 that is the scalar kernel).
NNF_COL2IM_ENTRY(nnf_f16, 1, false, 8, col2im_nhwc_v4_f16)
NNF_COL2IM_ENTRY(nnf_bf16, 1, false, 8, col2im_nhwc_v4_bf16)
