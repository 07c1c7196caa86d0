//! CPU emulation of the fused Winograd kernel (`kernels/winograd_fused.cu`), statement by
//! statement: every block and thread of the grid [`fused::grid`] computes, the tile table, the
//! staging of raw input and transformed filter (16-byte pieces, zero-filled outside the image
//! and the channel ranges), the transform's thread mapping and factored 1-D transforms, the
//! shared-memory layouts, the fragment loads of `wf_frag_a` / `wf_frag_b` (`ldmatrix.trans`
//! from the PTX ISA's definition, on the addresses the kernel forms), and the epilogue's
//! output transform and stores. The MMA itself is emulated from the PTX ISA's documented
//! fragment layouts of `mma.m16n8k16` (written out independently of the kernel's helpers), so a
//! helper that loads a register with the wrong elements shows here, on a machine without a GPU.
//! Shared memory starts as NaN and each stage is reset to NaN before it is refilled, so a read of
//! a slot not written for the current chunk (a padding slot, a stale chunk) poisons the result.
//! Checked against the f64 Winograd reference (no rounding in between).

// The loops mirror the kernel's index loops on purpose.
#![allow(clippy::needless_range_loop)]

use super::fused::{self, cfg, CHANNEL_CHUNK as KC, TILES_PER_BLOCK as TT, WARPS};
use crate::conv::problem::winograd_dims;
use crate::conv::{ConvShape, WinogradTile};
use crate::reference::winograd as rw;

/// `wf_bt<M>(d + base, s)`: Bᵀ on `alpha` values at stride `s`, in place (the kernel's factored
/// form, transcribed).
fn wf_bt(m: usize, d: &mut [f64], base: usize, s: usize) {
    let at = |i: usize| base + i * s;
    if m == 2 {
        let (d0, d1, d2, d3) = (d[at(0)], d[at(1)], d[at(2)], d[at(3)]);
        d[at(0)] = d0 - d2;
        d[at(1)] = d1 + d2;
        d[at(2)] = d2 - d1;
        d[at(3)] = d1 - d3;
    } else {
        let (d0, d1, d2, d3, d4, d5) = (d[at(0)], d[at(1)], d[at(2)], d[at(3)], d[at(4)], d[at(5)]);
        let p = -4.0 * d2 + d4;
        let q = -4.0 * d1 + d3;
        let r = d4 - d2;
        let u = d3 - d1;
        d[at(0)] = 4.0 * d0 + (-5.0 * d2 + d4);
        d[at(1)] = p + q;
        d[at(2)] = p - q;
        d[at(3)] = 2.0 * u + r;
        d[at(4)] = -2.0 * u + r;
        d[at(5)] = 4.0 * d1 + (-5.0 * d3 + d5);
    }
}

/// `wf_at<M>(m + base, s, o + obase, os)`: Aᵀ on `alpha` values, `m` outputs (factored form).
fn wf_at(mm: usize, src: &[f64], base: usize, s: usize, o: &mut [f64], obase: usize, os: usize) {
    let m = |i: usize| src[base + i * s];
    if mm == 2 {
        o[obase] = m(0) + m(1) + m(2);
        o[obase + os] = m(1) - m(2) - m(3);
    } else {
        let (a, b) = (m(1) + m(2), m(1) - m(2));
        let (c, d) = (m(3) + m(4), m(3) - m(4));
        o[obase] = m(0) + a + c;
        o[obase + os] = 2.0 * d + b;
        o[obase + 2 * os] = 4.0 * c + a;
        o[obase + 3 * os] = 8.0 * d + b + m(5);
    }
}

/// Registers of a warp: A (4 x two halves), B (2 x two halves), C/D (4 floats) per lane.
type RegA = [[[f64; 2]; 4]; 32];
type RegB = [[[f64; 2]; 2]; 32];
type RegC = [[f64; 4]; 32];

/// `mma.sync.aligned.m16n8k16.row.col` from the PTX ISA's fragment layouts ("Matrix Fragments
/// for mma.m16n8k16 with floating point type"): groupID = lane >> 2, threadID_in_group =
/// lane % 4; A element a_i (register i / 2, low half first) at row groupID for i < 2 or
/// 4 <= i < 6, else groupID + 8, column 2 threadID_in_group + (i & 1), + 8 for i >= 4; B element
/// b_i at row 2 threadID_in_group + (i & 1), + 8 for i >= 2, column groupID; C element c_i at row
/// groupID, + 8 for i >= 2, column 2 threadID_in_group + (i & 1).
fn mma_spec(a: &RegA, b: &RegB, d: &mut RegC) {
    let mut am = [[None::<f64>; 16]; 16];
    let mut bm = [[None::<f64>; 8]; 16];
    for lane in 0..32 {
        let (g, t) = (lane >> 2, lane % 4);
        for i in 0..8 {
            let row = if i < 2 || (4..6).contains(&i) {
                g
            } else {
                g + 8
            };
            let col = t * 2 + (i & 1) + if i >= 4 { 8 } else { 0 };
            assert!(am[row][col].is_none(), "A[{row}][{col}] held twice");
            am[row][col] = Some(a[lane][i / 2][i % 2]);
        }
        for i in 0..4 {
            let row = t * 2 + (i & 1) + if i >= 2 { 8 } else { 0 };
            assert!(bm[row][g].is_none(), "B[{row}][{g}] held twice");
            bm[row][g] = Some(b[lane][i / 2][i % 2]);
        }
    }
    let am: Vec<Vec<f64>> = am.iter().map(|r| r.map(Option::unwrap).to_vec()).collect();
    let bm: Vec<Vec<f64>> = bm.iter().map(|r| r.map(Option::unwrap).to_vec()).collect();
    for lane in 0..32 {
        let (g, t) = (lane >> 2, lane % 4);
        for i in 0..4 {
            let row = g + if i >= 2 { 8 } else { 0 };
            let col = t * 2 + (i & 1);
            d[lane][i] += (0..16).map(|kk| am[row][kk] * bm[kk][col]).sum::<f64>();
        }
    }
}

/// `wf_frag_a(base, tt, row, t, a)`: the u32 word `i` of shared memory is halves 2i (low) and
/// 2i + 1 (high).
fn frag_a(sm: &[f64], base: usize, tt: usize, row: usize, t: usize) -> [[f64; 2]; 4] {
    let word = |i: usize| [sm[base + 2 * i], sm[base + 2 * i + 1]];
    [
        word(row * 4 + t),
        word((row + 8) * 4 + t),
        word((tt + row) * 4 + t),
        word((tt + row + 8) * 4 + t),
    ]
}

/// `wf_frag_b(base, vrow, n0, lane, b)` for the whole warp: each lane's address as the kernel
/// forms it, then `ldmatrix.sync.aligned.m8n8.x2.trans.b16` as the PTX ISA defines it: lanes
/// 0-7 address the 8 rows (8 consecutive halves each) of matrix 0, lanes 8-15 those of matrix 1;
/// with .trans, lane l receives of matrix i the elements (row 2 (l % 4), column l / 4) and
/// (row 2 (l % 4) + 1, column l / 4), low half first, as register i.
fn frag_b(sm: &[f64], base: usize, vrow: usize, n0: usize) -> RegB {
    let addr: Vec<usize> = (0..32).map(|lane| base + (lane & 15) * vrow + n0).collect();
    let mut b: RegB = [[[0.0; 2]; 2]; 32];
    for lane in 0..32 {
        for (i, reg) in b[lane].iter_mut().enumerate() {
            let row = |r: usize| addr[8 * i + r];
            *reg = [
                sm[row(2 * (lane % 4)) + lane / 4],
                sm[row(2 * (lane % 4) + 1) + lane / 4],
            ];
        }
    }
    b
}

/// One launch of `winograd_fused<T, M>` over the whole batch: x (NHWC), V[pos][c][k] → y.
fn fused_kernel(s: &ConvShape, tile: WinogradTile, x: &[f64], v: &[f64], y: &mut [f64]) {
    let cf = cfg(tile);
    let (m, a, p, nf, tk) = (tile.m(), cf.alpha, cf.positions, cf.nf, cf.tk);
    let (xrow, vrow) = (cf.xrow, cf.vrow);
    let d = winograd_dims(s, tile).unwrap();
    let (oh, ow) = s.out_hw().unwrap();
    let (h, w, c, k) = (s.h as i64, s.w as i64, s.c_in, s.c_out);
    assert_eq!(fused::launches(s.n, d.tiles_per_image).unwrap(), vec![s.n]);
    let tiles = s.n * d.tiles_per_image;
    let (gx, gy) = fused::grid(tiles, k, tile).unwrap();
    let per_image = d.tiles_h * d.tiles_w;
    let threads = fused::THREADS as usize;
    for bx in 0..gx as usize {
        for by in 0..gy as usize {
            let t0 = bx * TT;
            let k0 = by * tk;
            let mut xs = vec![f64::NAN; cf.xs];
            let mut us = vec![f64::NAN; cf.us];
            let mut vs = vec![f64::NAN; 2 * cf.vs];
            // Tile table.
            let mut s_base = [0usize; TT];
            let mut s_y0 = [0i64; TT];
            let mut s_x0 = [0i64; TT];
            for tid in 0..TT {
                let t = t0 + tid;
                if t < tiles {
                    let b = t / per_image;
                    let r = t - b * per_image;
                    let th = r / d.tiles_w;
                    let tw = r - th * d.tiles_w;
                    s_base[tid] = b * s.h * s.w * c;
                    s_y0[tid] = (th * m) as i64 - s.pad.0 as i64;
                    s_x0[tid] = (tw * m) as i64 - s.pad.1 as i64;
                } else {
                    s_base[tid] = 0;
                    s_y0[tid] = -(1 << 29);
                    s_x0[tid] = -(1 << 29);
                }
            }
            let stage_x = |xs: &mut Vec<f64>, cc: usize| {
                // The kernel overwrites every non-pad slot; NaN marks what this chunk did not.
                xs.iter_mut().for_each(|e| *e = f64::NAN);
                let mut written = vec![false; cf.xs];
                for tid in 0..threads {
                    for q in 0..(TT * p * 2) / threads {
                        let e = tid + q * threads;
                        let tl = e / (p * 2);
                        let rem = e - tl * (p * 2);
                        let tap = rem >> 1;
                        let half = rem & 1;
                        let i = tap / a;
                        let j = tap - i * a;
                        let iy = s_y0[tl] + i as i64;
                        let ix = s_x0[tl] + j as i64;
                        let ch = cc + half * 8;
                        let ok = iy >= 0 && iy < h && ix >= 0 && ix < w && ch < c;
                        let dst = tl * xrow + tap * KC + half * 8;
                        for z in 0..8 {
                            assert!(!written[dst + z], "x slot {} staged twice", dst + z);
                            written[dst + z] = true;
                            xs[dst + z] = if ok {
                                assert!(ch + 8 <= c, "a piece straddles the channel end");
                                x[s_base[tl] + (iy as usize * s.w + ix as usize) * c + ch + z]
                            } else {
                                0.0
                            };
                        }
                    }
                }
            };
            let stage_v = |vs: &mut Vec<f64>, cc: usize, buf: usize| {
                let dst0 = buf * cf.vs;
                vs[dst0..dst0 + cf.vs]
                    .iter_mut()
                    .for_each(|e| *e = f64::NAN);
                for tid in 0..threads {
                    for q in 0..(p * KC * (tk / 8)) / threads {
                        let e = tid + q * threads;
                        let piece = e % (tk / 8);
                        let row = e / (tk / 8);
                        let pos = row / KC;
                        let kk = row - pos * KC;
                        let cg = cc + kk;
                        let kg = k0 + piece * 8;
                        let ok = cg < c && kg < k;
                        let dst = dst0 + row * vrow + piece * 8;
                        for z in 0..8 {
                            assert!(vs[dst + z].is_nan(), "v slot staged twice");
                            vs[dst + z] = if ok {
                                assert!(kg + 8 <= k, "a piece straddles the channel end");
                                v[(pos * c + cg) * k + kg + z]
                            } else {
                                0.0
                            };
                        }
                    }
                }
            };
            let mut acc = vec![vec![[0.0f64; 4]; p * nf]; threads];
            let chunks = c.div_ceil(KC);
            stage_x(&mut xs, 0);
            stage_v(&mut vs, 0, 0);
            for jc in 0..chunks {
                // Input transform.
                us.iter_mut().for_each(|e| *e = f64::NAN);
                for tid in 0..threads {
                    let (warp, lane) = (tid >> 5, tid & 31);
                    let tl = warp * 4 + (lane >> 3);
                    let c8 = lane & 7;
                    for half in 0..2 {
                        let src = tl * xrow + half * 8 + c8;
                        let mut dd: Vec<f64> = (0..p).map(|tap| xs[src + tap * KC]).collect();
                        for jj in 0..a {
                            wf_bt(m, &mut dd, jj, a);
                        }
                        for ii in 0..a {
                            wf_bt(m, &mut dd, ii * a, 1);
                        }
                        let dst = (half * TT + tl) * 8 + c8;
                        for pos in 0..p {
                            let at = dst + pos * 2 * TT * 8;
                            assert!(us[at].is_nan(), "U slot {at} written twice");
                            us[at] = dd[pos];
                        }
                    }
                }
                if jc + 1 < chunks {
                    stage_x(&mut xs, (jc + 1) * KC);
                    stage_v(&mut vs, (jc + 1) * KC, (jc + 1) & 1);
                } else {
                    // Nothing staged: the next read of Xs would be stale.
                    xs.iter_mut().for_each(|e| *e = f64::NAN);
                }
                // Products of this chunk.
                let vb = (jc & 1) * cf.vs;
                for warp in 0..WARPS.0 * WARPS.1 {
                    let wt = warp / WARPS.1;
                    let wk = warp % WARPS.1;
                    for pos in 0..p {
                        let mut ra: RegA = [[[0.0; 2]; 4]; 32];
                        for lane in 0..32 {
                            let (g, tq) = (lane >> 2, lane & 3);
                            ra[lane] = frag_a(&us, pos * 2 * TT * 8, TT, wt * 16 + g, tq);
                        }
                        for f in 0..nf {
                            let rb = frag_b(&vs, vb + pos * KC * vrow, vrow, (wk * nf + f) * 8);
                            let mut rc: RegC = [[0.0; 4]; 32];
                            for lane in 0..32 {
                                rc[lane] = acc[warp * 32 + lane][pos * nf + f];
                            }
                            mma_spec(&ra, &rb, &mut rc);
                            for lane in 0..32 {
                                acc[warp * 32 + lane][pos * nf + f] = rc[lane];
                            }
                        }
                    }
                }
            }
            // Epilogue.
            for tid in 0..threads {
                let (warp, lane) = (tid >> 5, tid & 31);
                let (g, tq) = (lane >> 2, lane & 3);
                let (wt, wk) = (warp / WARPS.1, warp % WARPS.1);
                for f in 0..nf {
                    for hr in 0..2 {
                        let t = t0 + wt * 16 + g + 8 * hr;
                        let kk = k0 + (wk * nf + f) * 8 + 2 * tq;
                        if t >= tiles || kk >= k {
                            continue;
                        }
                        let b = t / per_image;
                        let r = t - b * per_image;
                        let th = r / d.tiles_w;
                        let tw = r - th * d.tiles_w;
                        let mut out = [vec![0.0; m * m], vec![0.0; m * m]];
                        for e in 0..2 {
                            let mut tmp = vec![0.0; m * a];
                            for jj in 0..a {
                                let col: Vec<f64> = (0..a)
                                    .map(|ii| acc[tid][(ii * a + jj) * nf + f][2 * hr + e])
                                    .collect();
                                wf_at(m, &col, 0, 1, &mut tmp, jj, a);
                            }
                            for u in 0..m {
                                let row = tmp.clone();
                                wf_at(m, &row, u * a, 1, &mut out[e], u * m, 1);
                            }
                        }
                        let yb = b * oh * ow * k + kk;
                        for u in 0..m {
                            let oy = th * m + u;
                            if oy >= oh {
                                continue;
                            }
                            for q in 0..m {
                                let ox = tw * m + q;
                                if ox >= ow {
                                    continue;
                                }
                                let at = yb + (oy * ow + ox) * k;
                                assert!(kk + 1 < k, "the pair store leaves the channel range");
                                for e in 0..2 {
                                    assert!(
                                        y[at + e].is_nan(),
                                        "y element {} written twice",
                                        at + e
                                    );
                                    y[at + e] = out[e][u * m + q];
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn values(seed: u64, n: usize) -> Vec<f64> {
    crate::testutil::xorshift_star_unit(seed, n)
        .map(|u| u - 0.5)
        .collect()
}

use crate::testutil::winograd_shape as shape;

/// The emulated fused kernel equals the f64 Winograd convolution (and so the direct one) on
/// shapes that exercise a partial last channel chunk, output channels beyond one block and not
/// a multiple of it, several tile blocks with a partial last one, images smaller than a tile,
/// and paddings 0/1/2 per axis.
#[test]
fn fused_kernel_indexes_like_the_reference() {
    let shapes = [
        shape(1, 8, 8, 1, 1, (1, 1)),
        shape(2, 24, 40, 9, 11, (1, 1)),
        shape(3, 16, 8, 14, 6, (0, 2)),
        shape(1, 40, 72, 7, 7, (2, 0)),
        shape(2, 8, 16, 5, 13, (2, 2)),
    ];
    for (i, s) in shapes.iter().enumerate() {
        let x = values(i as u64 + 1, s.x_len().unwrap());
        let w = values(i as u64 + 50, s.w_len().unwrap());
        let direct = crate::reference::conv::conv2d(s, &x, &w).unwrap();
        for tile in WinogradTile::ALL {
            let v = rw::transform_filter(s, tile, &w).unwrap();
            let mut y = vec![f64::NAN; s.y_len().unwrap()];
            fused_kernel(s, tile, &x, &v, &mut y);
            let want = rw::conv2d_winograd(s, tile, &x, &w).unwrap();
            for (e, (g, wv)) in y.iter().zip(&want).enumerate() {
                assert!(
                    (g - wv).abs() <= 1e-10 * (1.0 + wv.abs()),
                    "{tile:?} {s:?}: element {e}: {g} vs {wv}"
                );
                assert!((g - direct[e]).abs() <= 1e-9 * (1.0 + direct[e].abs()));
            }
        }
    }
}

/// The factored 1-D transforms equal the reference's matrices on unit vectors.
#[test]
fn factored_transforms_equal_the_matrices() {
    for tile in WinogradTile::ALL {
        let mt = rw::matrices(tile);
        let (m, a) = (mt.m, mt.alpha);
        for unit in 0..a {
            let mut d = vec![0.0; a];
            d[unit] = 1.0;
            wf_bt(m, &mut d, 0, 1);
            for r in 0..a {
                assert_eq!(d[r], mt.bt[r * a + unit], "{tile:?} Bᵀ[{r}][{unit}]");
            }
            let mut src = vec![0.0; a];
            src[unit] = 1.0;
            let mut o = vec![0.0; m];
            wf_at(m, &src, 0, 1, &mut o, 0, 1);
            for r in 0..m {
                assert_eq!(o[r], mt.at[r * a + unit], "{tile:?} Aᵀ[{r}][{unit}]");
            }
        }
    }
}
