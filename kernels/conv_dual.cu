// The dual filter of the `cudnn_dual` path (src/conv/conv_dual.rs): the forward convolution at
// stride 1 runs as the data gradient of its dual problem, whose filter is the forward's rotated
// by 180 degrees with its channel axes swapped: W[c][k][r][s] = w[k][c][kh-1-r][kw-1-s] (KCRS)
// or W[c][r][s][k] = w[k][kh-1-r][kw-1-s][c] (KRSC). One thread per element of W, which is
// written in order (coalesced); the index rule is `dual_filter_index` in
// src/conv/problem/dual.rs, whose CPU tests check it. The filter is small (c_out*c_in*kh*kw).

struct DualFilterArgs {
    const float* w;  // the forward's filter
    float* out;      // the dual filter
    u64 n;           // k * c * kh * kw
    u32 k, c, kh, kw;
    u32 nhwc;        // 1: KRSC, 0: KCRS
    u32 pad;
};

extern "C" __global__ void conv_dual_filter_f32(DualFilterArgs a) {
    for (u64 i = global_thread(); i < a.n; i += grid_threads()) {
        u64 src;
        if (a.nhwc) {
            const u64 kk = i % a.k, ss = (i / a.k) % a.kw, rr = (i / ((u64)a.k * a.kw)) % a.kh;
            const u64 cc = i / ((u64)a.k * a.kw * a.kh);
            src = ((kk * a.kh + (a.kh - 1 - rr)) * a.kw + (a.kw - 1 - ss)) * a.c + cc;
        } else {
            const u64 ss = i % a.kw, rr = (i / a.kw) % a.kh, kk = (i / ((u64)a.kw * a.kh)) % a.k;
            const u64 cc = i / ((u64)a.kw * a.kh * a.k);
            src = ((kk * a.c + cc) * a.kh + (a.kh - 1 - rr)) * a.kw + (a.kw - 1 - ss);
        }
        a.out[i] = a.w[src];
    }
}
