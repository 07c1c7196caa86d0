// The tiled operands of the `cudnn_tiled` path (src/conv/conv_tiled.rs): the filter gradient at
// stride 1 runs over 2x2 spatial tiles stacked as the batch (image 4n + 2ty + tx is quarter
// (ty, tx) of image n). Run on x it writes x's windows: element (i, j) of quarter (ty, tx) holds
// x[ty*qh + i - ph][tx*qw + j - pw], zero outside the image (the padding, materialized); run on
// dy (no padding, tile = quarter) dy's quarters: element (i, j) holds dy[ty*qh + i][tx*qw + j],
// zero past the output. Writes follow the written tensor's order (coalesced): blockIdx.y
// strides over planes — an image's channel (NCHW: th x tw elements) or an image's tile row
// (NHWC: tw x ch elements) — and blockIdx.x over a plane's elements, so that the per-element
// index math is 32-bit (a plane holds fewer than 2^31 elements: checked by the launcher); each
// thread moves PER elements a pass, loads first. The index rule is `window_source` in
// src/conv/problem/tiled.rs, whose CPU test checks that the quarters hold
// every product of the filter gradient once.

struct TileArgs {
    const float* src;  // x or dy
    float* out;        // the tiled tensor
    u64 planes;        // 4n * ch (NCHW) or 4n * th (NHWC)
    u32 ch;            // channels (c_in or c_out)
    u32 sh, sw;        // the source's spatial extent (h x w, or oh x ow)
    u32 th, tw;        // a tile's extent (the window, or the quarter)
    u32 qh, qw;        // a quarter's output extent (the tiles' stride in the source)
    int ph, pw;        // the padding (0 for dy)
    u32 nhwc;          // 1: NHWC, 0: NCHW
    u32 plane;         // elements per plane: th * tw (NCHW) or tw * ch (NHWC)
};

// Elements per thread and pass: their loads are issued together (one load in flight per thread
// left the H100 at 1.3 TB/s on these short rows; ncu, perf/2026-11-26-late3-h100-*).
constexpr u32 PER = 4;

extern "C" __global__ void conv_tile_f32(TileArgs a) {
    const float* __restrict__ src = a.src;
    float* __restrict__ dst = a.out;
    for (u64 pl = blockIdx.y; pl < a.planes; pl += gridDim.y) {
        u64 img;
        u32 cc = 0, i = 0;
        if (a.nhwc) {
            img = pl / a.th;
            i = (u32)(pl % a.th);
        } else {
            img = pl / a.ch;
            cc = (u32)(pl % a.ch);
        }
        const u64 n = img / 4;
        const u32 t = (u32)(img % 4);
        float* out = dst + pl * a.plane;
        for (u32 base = blockIdx.x * blockDim.x * PER; base < a.plane;
             base += gridDim.x * blockDim.x * PER) {
            float v[PER];
#pragma unroll
            for (u32 k = 0; k < PER; ++k) {
                const u32 e = base + k * blockDim.x + threadIdx.x;
                u32 j, c = cc, row = i;
                if (a.nhwc) {
                    j = e / a.ch;
                    c = e - j * a.ch;
                } else {
                    row = e / a.tw;
                    j = e - row * a.tw;
                }
                const int r = (int)((t / 2) * a.qh + row) - a.ph;
                const int col = (int)((t % 2) * a.qw + j) - a.pw;
                v[k] = 0.0f;
                if (e < a.plane && r >= 0 && col >= 0 && r < (int)a.sh && col < (int)a.sw) {
                    const u64 s = a.nhwc ? ((n * a.sh + r) * a.sw + col) * a.ch + c
                                         : ((n * a.ch + c) * a.sh + r) * a.sw + col;
                    v[k] = src[s];
                }
            }
#pragma unroll
            for (u32 k = 0; k < PER; ++k) {
                const u32 e = base + k * blockDim.x + threadIdx.x;
                if (e < a.plane) out[e] = v[k];
            }
        }
    }
}
