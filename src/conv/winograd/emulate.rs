//! CPU emulations of the Winograd kernels' index arithmetic (`kernels/winograd.cu`,
//! `kernels/winograd_gemm.cu`), statement by statement: every block and thread of the grid the
//! launchers compute, the same decomposition of the thread index, the same offsets, the same
//! row groups and skipped coefficients. Checked against the f64 reference, so that an index
//! error in the design shows on a machine without a GPU (a transcription error between this file
//! and the CUDA source does not: the GPU tests cover that).

// The loops mirror the kernels' index loops on purpose.
#![allow(clippy::needless_range_loop)]

use super::launch::{self, row_groups, transform_blocks, Stage, THREADS};
use crate::conv::problem::winograd_dims;
use crate::conv::{ConvShape, WinogradTile};
use crate::reference::gemm::{gemm_strided_batched, GemmProblem};
use crate::reference::winograd as rw;

fn mats(tile: WinogradTile) -> rw::Matrices {
    rw::matrices(tile)
}

/// `input_transform<T, M, V, RG>` over the whole grid.
fn input_kernel(s: &ConvShape, tile: WinogradTile, vec: usize, x: &[f64], u: &mut [f64]) {
    let mt = mats(tile);
    let (mm, a) = (mt.m, mt.alpha);
    let bt = |r: usize, c: usize| mt.bt[r * a + c];
    let d = winograd_dims(s, tile).unwrap();
    let tiles = (s.n * d.tiles_per_image) as u64;
    let rg = row_groups(Stage::Input, tile, vec);
    let groups = a / rg;
    let blocks = transform_blocks(Stage::Input, tile, vec, tiles as usize, s.c_in).unwrap();
    let (h, w, c) = (s.h as u64, s.w as u64, s.c_in as u64);
    for block in 0..blocks as u64 {
        let g = (block % groups as u64) as usize;
        for thread in 0..THREADS as u64 {
            let item = (block / groups as u64) * THREADS as u64 + thread;
            let nvec = c / vec as u64;
            if item >= tiles * nvec {
                continue;
            }
            let t = item / nvec;
            let cv = item - t * nvec;
            let per_image = (d.tiles_h * d.tiles_w) as u64;
            let b = t / per_image;
            let r = t - b * per_image;
            let th = r / d.tiles_w as u64;
            let tw = r - th * d.tiles_w as u64;
            let y0 = (th * mm as u64) as i64 - s.pad.0 as i64;
            let x0 = (tw * mm as u64) as i64 - s.pad.1 as i64;
            let xb = b * (h * w * c) + cv * vec as u64;
            let ub = t * c + cv * vec as u64;
            let pos_stride = tiles * c;
            // input_group<..., G = g>
            let mut tmp = vec![vec![vec![0.0; vec]; a]; rg];
            for i in 0..a {
                if !(0..rg).any(|rr| bt(g * rg + rr, i) != 0.0) {
                    continue;
                }
                let iy = y0 + i as i64;
                let row_in = iy >= 0 && iy < h as i64;
                for j in 0..a {
                    let ix = x0 + j as i64;
                    let mut dv = vec![0.0; vec];
                    if row_in && ix >= 0 && ix < w as i64 {
                        let off = xb + (iy as u64 * w + ix as u64) * c;
                        for (v, dvv) in dv.iter_mut().enumerate() {
                            *dvv = x[off as usize + v];
                        }
                    }
                    for (rr, trr) in tmp.iter_mut().enumerate() {
                        let k = bt(g * rg + rr, i);
                        if k != 0.0 {
                            for v in 0..vec {
                                trr[j][v] += k * dv[v];
                            }
                        }
                    }
                }
            }
            for (rr, trr) in tmp.iter().enumerate() {
                for q in 0..a {
                    let pos = ((g * rg + rr) * a + q) as u64;
                    for v in 0..vec {
                        let o: f64 = (0..a).map(|j| bt(q, j) * trr[j][v]).sum();
                        let at = (ub + pos * pos_stride) as usize + v;
                        assert!(u[at].is_nan(), "input element {at} written twice");
                        u[at] = o;
                    }
                }
            }
        }
    }
}

/// `output_transform<T, M, V, RG>` over the whole grid.
fn output_kernel(s: &ConvShape, tile: WinogradTile, vec: usize, m: &[f64], y: &mut [f64]) {
    let mt = mats(tile);
    let (mm, a) = (mt.m, mt.alpha);
    let at = |r: usize, c: usize| mt.at[r * a + c];
    let d = winograd_dims(s, tile).unwrap();
    let (oh, ow) = s.out_hw().unwrap();
    let (oh, ow, k) = (oh as u64, ow as u64, s.c_out as u64);
    let tiles = (s.n * d.tiles_per_image) as u64;
    let rg = row_groups(Stage::Output, tile, vec);
    let groups = mm / rg;
    let blocks = transform_blocks(Stage::Output, tile, vec, tiles as usize, s.c_out).unwrap();
    for block in 0..blocks as u64 {
        let g = (block % groups as u64) as usize;
        for thread in 0..THREADS as u64 {
            let item = (block / groups as u64) * THREADS as u64 + thread;
            let nvec = k / vec as u64;
            if item >= tiles * nvec {
                continue;
            }
            let t = item / nvec;
            let kv = item - t * nvec;
            let per_image = (d.tiles_h * d.tiles_w) as u64;
            let b = t / per_image;
            let r = t - b * per_image;
            let th = r / d.tiles_w as u64;
            let tw = r - th * d.tiles_w as u64;
            let mb = t * k + kv * vec as u64;
            let yb = b * (oh * ow * k) + kv * vec as u64;
            let pos_stride = tiles * k;
            let (oy0, ox0) = (th * mm as u64, tw * mm as u64);
            let mut tmp = vec![vec![vec![0.0; vec]; a]; rg];
            for i in 0..a {
                if !(0..rg).any(|rr| at(g * rg + rr, i) != 0.0) {
                    continue;
                }
                for j in 0..a {
                    let off = (mb + (i * a + j) as u64 * pos_stride) as usize;
                    for (rr, trr) in tmp.iter_mut().enumerate() {
                        let kc = at(g * rg + rr, i);
                        if kc != 0.0 {
                            for v in 0..vec {
                                trr[j][v] += kc * m[off + v];
                            }
                        }
                    }
                }
            }
            for (rr, trr) in tmp.iter().enumerate() {
                let oy = oy0 + (g * rg + rr) as u64;
                if oy >= oh {
                    continue;
                }
                for q in 0..mm {
                    let ox = ox0 + q as u64;
                    if ox >= ow {
                        continue;
                    }
                    for v in 0..vec {
                        let o: f64 = (0..a).map(|j| at(q, j) * trr[j][v]).sum();
                        let idx = (yb + (oy * ow + ox) * k) as usize + v;
                        assert!(y[idx].is_nan(), "output element {idx} written twice");
                        y[idx] = o;
                    }
                }
            }
        }
    }
}

/// `filter_transform<T, M, ROT>` over the whole grid.
fn filter_kernel(tile: WinogradTile, kout: usize, cin: usize, rot: bool, w: &[f64], v: &mut [f64]) {
    let mt = mats(tile);
    let a = mt.alpha;
    let gm = |r: usize, c: usize| mt.g[r * 3 + c];
    let (gx, gy, gz) = launch::filter_grid(cin, kout, tile, rot).unwrap();
    for bx in 0..gx {
        for by in 0..gy {
            for bz in 0..gz {
                for tid in 0..THREADS {
                    let fast = bx * 32 + (tid & 31);
                    let slow = by * 8 + (tid >> 5);
                    let (kg, cg) = if rot { (slow, fast) } else { (fast, slow) };
                    let (kg, cg) = (kg as usize, cg as usize);
                    if kg >= kout || cg >= cin {
                        continue;
                    }
                    let rows = (a as u32).div_ceil(gz);
                    let lo = bz * rows;
                    let hi = (lo + rows).min(a as u32);
                    let src = kg * 9 * cin + cg;
                    let mut g = [[0.0; 3]; 3];
                    for (r, gr) in g.iter_mut().enumerate() {
                        for (q, gv) in gr.iter_mut().enumerate() {
                            let rs = if rot { 8 - (r * 3 + q) } else { r * 3 + q };
                            *gv = w[src + rs * cin];
                        }
                    }
                    let pos_stride = kout * cin;
                    let out = if rot { kg * cin + cg } else { cg * kout + kg };
                    for i in 0..a {
                        if (i as u32) < lo || (i as u32) >= hi {
                            continue;
                        }
                        let tmp: Vec<f64> = (0..3)
                            .map(|q| gm(i, 0) * g[0][q] + gm(i, 1) * g[1][q] + gm(i, 2) * g[2][q])
                            .collect();
                        for j in 0..a {
                            let val = tmp[0] * gm(j, 0) + tmp[1] * gm(j, 1) + tmp[2] * gm(j, 2);
                            let idx = out + (i * a + j) * pos_stride;
                            assert!(v[idx].is_nan(), "filter element {idx} written twice");
                            v[idx] = val;
                        }
                    }
                }
            }
        }
    }
}

/// `direct_gemm<T, TA, TB>` over the whole grid: slots, tiles, k steps, epilogue.
fn direct_kernel(p: &GemmProblem, a: &[f64], b: &[f64], c: &mut [f64]) {
    const BM: u32 = 64;
    const BN: u32 = 64;
    const BK: u32 = 16;
    let ((gx, gy), mblocks) = launch::direct_grid(p.m, p.n, p.batch).unwrap();
    let (m, n, k) = (p.m as u32, p.n as u32, p.k as u32);
    let a_slot = |tid: u32, q: u32| {
        let e = tid + 256 * q;
        if p.trans_a {
            (e / BK, e % BK)
        } else {
            (e % BM, e / BM)
        }
    };
    let b_slot = |tid: u32, q: u32| {
        let e = tid + 256 * q;
        if p.trans_b {
            (e / BN, e % BN)
        } else {
            (e % BK, e / BK)
        }
    };
    for bx in 0..gx {
        for by in 0..gy {
            let i0 = (bx % mblocks) * BM;
            let j0 = (bx / mblocks) * BN;
            let mut bt = by;
            while bt < p.batch as u32 {
                let (oa, ob, oc) = (
                    bt as usize * p.stride_a,
                    bt as usize * p.stride_b,
                    bt as usize * p.stride_c,
                );
                let mut acc = vec![[[0.0f64; 4]; 4]; 256];
                let mut l0 = 0;
                while l0 < k {
                    let mut as_ = [[0.0f64; 65]; 16];
                    let mut bs = [[0.0f64; 65]; 16];
                    for tid in 0..256 {
                        for q in 0..4 {
                            let (i, l) = a_slot(tid, q);
                            let (gi, gl) = (i0 + i, l0 + l);
                            if gi < m && gl < k {
                                let at = if p.trans_a {
                                    gl as usize + gi as usize * p.lda
                                } else {
                                    gi as usize + gl as usize * p.lda
                                };
                                as_[l as usize][i as usize] = a[oa + at];
                            }
                            let (l, j) = b_slot(tid, q);
                            let (gj, gl) = (j0 + j, l0 + l);
                            if gj < n && gl < k {
                                let at = if p.trans_b {
                                    gj as usize + gl as usize * p.ldb
                                } else {
                                    gl as usize + gj as usize * p.ldb
                                };
                                bs[l as usize][j as usize] = b[ob + at];
                            }
                        }
                    }
                    for tid in 0..256u32 {
                        let (tx, ty) = (tid % 16, tid / 16);
                        for l in 0..16 {
                            for pp in 0..4 {
                                for qq in 0..4 {
                                    acc[tid as usize][pp][qq] += as_[l]
                                        [(tx + 16 * pp as u32) as usize]
                                        * bs[l][(ty + 16 * qq as u32) as usize];
                                }
                            }
                        }
                    }
                    l0 += BK;
                }
                for tid in 0..256u32 {
                    let (tx, ty) = (tid % 16, tid / 16);
                    for qq in 0..4u32 {
                        let gj = j0 + ty + 16 * qq;
                        if gj >= n {
                            continue;
                        }
                        for pp in 0..4u32 {
                            let gi = i0 + tx + 16 * pp;
                            if gi >= m {
                                continue;
                            }
                            let idx = oc + gi as usize + gj as usize * p.ldc;
                            let mut val = p.alpha * acc[tid as usize][pp as usize][qq as usize];
                            if p.beta != 0.0 {
                                val += p.beta * c[idx];
                            }
                            c[idx] = val;
                        }
                    }
                }
                bt += gy;
            }
        }
    }
}

fn values(seed: u64, n: usize) -> Vec<f64> {
    crate::testutil::xorshift_star_unit(seed, n)
        .map(|u| u - 0.5)
        .collect()
}

fn close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (e, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-12 * (1.0 + w.abs()),
            "{what}: element {e}: {g} vs {w}"
        );
    }
}

use crate::testutil::winograd_shape as shape;

#[test]
fn transform_kernels_index_like_the_reference() {
    let shapes = [
        shape(2, 8, 8, 5, 7, (1, 1)),
        shape(1, 16, 4, 9, 6, (0, 2)),
        shape(3, 4, 2, 1, 1, (1, 1)),
        shape(1, 2, 40, 7, 7, (2, 0)),
        shape(2, 1, 33, 6, 11, (1, 2)),
    ];
    for (i, s) in shapes.iter().enumerate() {
        let x = values(i as u64 + 1, s.x_len().unwrap());
        let w = values(i as u64 + 100, s.w_len().unwrap());
        for tile in WinogradTile::ALL {
            let d = winograd_dims(s, tile).unwrap();
            for vec in [8, 4, 2, 1] {
                if s.c_in % vec == 0 {
                    let mut u = vec![f64::NAN; s.n * d.u_per_image];
                    input_kernel(s, tile, vec, &x, &mut u);
                    close(
                        &format!("input {tile:?} v{vec} {s:?}"),
                        &u,
                        &rw::transform_input(s, tile, &x).unwrap(),
                    );
                }
                if s.c_out % vec == 0 {
                    let m = values(i as u64 + 7, s.n * d.m_per_image);
                    let mut y = vec![f64::NAN; s.y_len().unwrap()];
                    output_kernel(s, tile, vec, &m, &mut y);
                    close(
                        &format!("output {tile:?} v{vec} {s:?}"),
                        &y,
                        &rw::transform_output(s, tile, &m).unwrap(),
                    );
                }
            }
            let mut v = vec![f64::NAN; d.v];
            filter_kernel(tile, s.c_out, s.c_in, false, &w, &mut v);
            close(
                &format!("filter {tile:?} {s:?}"),
                &v,
                &rw::transform_filter(s, tile, &w).unwrap(),
            );
            let mut v = vec![f64::NAN; d.v];
            filter_kernel(tile, s.c_out, s.c_in, true, &w, &mut v);
            close(
                &format!("rotated filter {tile:?} {s:?}"),
                &v,
                &rw::transform_filter_rotated(s, tile, &w).unwrap(),
            );
        }
    }
}

#[test]
fn direct_multiply_indexes_like_the_reference() {
    let mut seed = 1;
    for (m, n, k, batch) in [
        (7, 5, 3, 2),
        (65, 63, 17, 3),
        (64, 130, 32, 1),
        (1, 1, 1, 1),
    ] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            for (alpha, beta, pad) in [(1.0, 0.0, 0), (0.5, -1.5, 3)] {
                let mut p = GemmProblem::packed(batch, m, n, k);
                p.trans_a = ta;
                p.trans_b = tb;
                p.alpha = alpha;
                p.beta = beta;
                p.lda = if ta { k } else { m } + pad;
                p.ldb = if tb { n } else { k } + pad;
                p.ldc = m + pad;
                let (ac, bc) = (if ta { m } else { k }, if tb { k } else { n });
                p.stride_a = p.lda * ac + pad;
                p.stride_b = p.ldb * bc + pad;
                p.stride_c = p.ldc * n + pad;
                seed += 1;
                let a = values(seed, batch * p.stride_a);
                let b = values(seed + 50, batch * p.stride_b);
                let c0 = values(seed + 90, batch * p.stride_c);
                let mut want = c0.clone();
                gemm_strided_batched(&p, &a, &b, &mut want).unwrap();
                let mut got = c0.clone();
                direct_kernel(&p, &a, &b, &mut got);
                close(&format!("direct {p:?}"), &got, &want);
            }
        }
    }
}
