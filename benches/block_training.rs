//! The training block's first fused piece alone (docs/BLOCK-TRAINING.md, fusion (a')), per unit
//! of the demo's bottleneck block (batch 32, 56x56, NHWC; conv1 1x1 256→64 + bn1 ReLU, conv2 3x3
//! 64→64 + bn2 ReLU, conv3 1x1 64→256 + bn3 Add+ReLU), f16 and bf16:
//!
//! - (a) `Conv2d::forward` alone (nnfuse's decided route);
//! - (b) `ConvStats` forced to `graph_genstats` (conv + GEN_STATS in one cuDNN graph);
//! - (c) `ConvStats` forced to `unfused` (Conv2d + nnfuse's per-channel reduction);
//! - (b') `ConvStats` forced to `own_pointwise` (nnfuse's 1x1 tensor-core kernel with the sums
//!   in its epilogue), where the unit's plan calls it eligible;
//! - (d) `BatchNorm::forward_train` as the demo runs it (default Config: the plan's path);
//! - (e) `BatchNorm::forward_train_from_sums` (own path: finalize + one apply pass).
//!
//! GPU µs per call: median of CUDA-event samples (`support/host_time.rs`' `gpu_us`, warm-up
//! first), next to the floor: the larger of FLOPs over 989.4 TFLOP/s (H100 SXM dense f16/bf16)
//! and bytes over 3.0 TB/s. Per unit, the fused total (b)+(e) against the unfused (a)+(d), and
//! (c)+(e). Prints a Markdown table and one JSON line per measurement (`{"bench":
//! "block_training", ...}`), and `ConvStats`' first-call decision per unit.
//!
//! Run: `cargo bench --bench block_training` (or `.gpu/run --bench-only` after
//! `scripts/gpu-stage`).

#[path = "support/host_time.rs"]
#[allow(dead_code)] // shared with the host-cost benches; this one reports GPU time only
mod host_time;

use half::{bf16, f16};
use nnfuse::batchnorm::{BatchNorm, Fuse, TrainArgs};
use nnfuse::block::{ConvStats, StatsRoute};
use nnfuse::conv::{Conv2d, ConvShape};
use nnfuse::cudarc::driver::CudaSlice;
use nnfuse::{BnImpl, Config, Context, Element, TensorFormat};

use host_time::gpu_us;

const PEAK_FLOPS: f64 = 989.4e12;
const PEAK_BYTES: f64 = 3.0e12;
const BUDGET_MS: f64 = 200.0;
const N: usize = 32;
const HW: usize = 56;

/// One unit: its convolution and the BatchNorm's activation.
struct Unit {
    name: &'static str,
    shape: ConvShape,
    fuse: Fuse,
}

fn units() -> [Unit; 3] {
    let s = |c, k, r| ConvShape::square(N, c, HW, k, r, TensorFormat::Nhwc);
    [
        Unit {
            name: "conv1+bn1",
            shape: s(256, 64, 1),
            fuse: Fuse::Relu,
        },
        Unit {
            name: "conv2+bn2",
            shape: s(64, 64, 3),
            fuse: Fuse::Relu,
        },
        Unit {
            name: "conv3+bn3",
            shape: s(64, 256, 1),
            fuse: Fuse::AddRelu,
        },
    ]
}

/// The floor of `flops` and `bytes`, µs.
fn floor_us(flops: f64, bytes: f64) -> f64 {
    (flops / PEAK_FLOPS).max(bytes / PEAK_BYTES) * 1e6
}

/// One measured row: prints the table line and the JSON line; returns the time.
fn row(dt: &str, unit: &str, case: &str, floor: f64, r: nnfuse::Result<f64>) -> Option<f64> {
    match r {
        Ok(us) => {
            println!(
                "| {dt} | {unit} | {case} | {us:.1} | {floor:.1} | {:.0} % |",
                100.0 * floor / us
            );
            println!(
                "{{\"bench\":\"block_training\",\"dtype\":\"{dt}\",\"unit\":\"{unit}\",\
                 \"case\":\"{case}\",\"gpu_us\":{us:.2},\"floor_us\":{floor:.2}}}"
            );
            Some(us)
        }
        Err(e) => {
            println!("| {dt} | {unit} | {case} | error: {e} | {floor:.1} | - |");
            None
        }
    }
}

fn random<T: Element>(ctx: &Context, n: usize, seed: u64) -> nnfuse::Result<CudaSlice<T>> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let v: Vec<T> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f64((s >> 11) as f64 / (1u64 << 53) as f64 - 0.4)
        })
        .collect();
    Ok(ctx.stream().clone_htod(&v)?)
}

fn bench_unit<T: Element>(ctx: &Context, own: &Context, u: &Unit) -> nnfuse::Result<()> {
    let dt = T::DTYPE.name();
    let s = &u.shape;
    let e = T::DTYPE.size() as f64;
    let (xl, wl, yl, k) = (s.x_len()?, s.w_len()?, s.y_len()?, s.c_out);
    let st = ctx.stream();
    let x = random::<T>(ctx, xl, 1)?;
    let w = random::<T>(ctx, wl, 2)?;
    let z = random::<T>(ctx, yl, 3)?;
    let mut y = st.alloc_zeros::<T>(yl)?;
    let mut out = st.alloc_zeros::<T>(yl)?;
    let (mut sum, mut sq) = (st.alloc_zeros::<f32>(k)?, st.alloc_zeros::<f32>(k)?);
    let g = st.clone_htod(&vec![1.0f32; k])?;
    let b = st.alloc_zeros::<f32>(k)?;
    let (mut rm, mut rv) = (st.alloc_zeros::<f32>(k)?, st.clone_htod(&vec![1.0f32; k])?);
    let flops = 2.0 * (yl * s.c_in * s.kh * s.kw) as f64;
    let conv_floor = floor_us(flops, (xl + wl + yl) as f64 * e);
    let add = u.fuse == Fuse::AddRelu;
    let mask = yl as f64 / 8.0;
    let once = yl as f64 * e * if add { 3.0 } else { 2.0 } + mask;
    let plain_floor = floor_us(0.0, once + yl as f64 * e);
    let sums_floor = floor_us(0.0, once);

    let conv = Conv2d::<T>::new(ctx, s)?;
    let a = row(dt, u.name, "(a) Conv2d::forward", conv_floor, {
        gpu_us(ctx, || conv.forward(&x, &w, &mut y), BUDGET_MS)
    });
    let unit = ConvStats::<T>::new(ctx, s)?;
    // The first call decides (outside the timing).
    unit.forward(
        &x.as_view(),
        &w.as_view(),
        &mut y.as_view_mut(),
        &mut sum.as_view_mut(),
        &mut sq.as_view_mut(),
    )?;
    if let Some(c) = unit.choice() {
        eprintln!(
            "{dt} {}: ConvStats decided {} {:?}",
            u.name, c.route, c.engine
        );
        for n in &c.notes {
            eprintln!("    {n}");
        }
    }
    let mut stats = |r: StatsRoute| {
        gpu_us(
            ctx,
            || {
                unit.forward_with(
                    r,
                    &x.as_view(),
                    &w.as_view(),
                    &mut y.as_view_mut(),
                    &mut sum.as_view_mut(),
                    &mut sq.as_view_mut(),
                )
            },
            BUDGET_MS,
        )
    };
    let bg = row(
        dt,
        u.name,
        "(b) ConvStats graph_genstats",
        conv_floor,
        stats(StatsRoute::GraphGenstats),
    );
    let c = row(
        dt,
        u.name,
        "(c) ConvStats unfused",
        conv_floor,
        stats(StatsRoute::Unfused),
    );
    if unit.plan().eligible(StatsRoute::OwnPointwise) {
        row(
            dt,
            u.name,
            "(b') ConvStats own_pointwise",
            conv_floor,
            stats(StatsRoute::OwnPointwise),
        );
    }
    let bn_shape = [N, HW, HW, k];
    let bn = BatchNorm::<T>::new(ctx, &bn_shape, 3, u.fuse)?;
    let d = row(
        dt,
        u.name,
        &format!("(d) BatchNorm forward_train ({:?} path)", bn.plan().path),
        plain_floor,
        gpu_us(
            ctx,
            || {
                bn.forward_train(TrainArgs {
                    x: y.as_view(),
                    addend: add.then(|| z.as_view()),
                    gamma: g.as_view(),
                    beta: b.as_view(),
                    running_mean: rm.as_view_mut(),
                    running_var: rv.as_view_mut(),
                    y: out.as_view_mut(),
                    momentum: 0.1,
                    eps: 1e-5,
                })
                .map(drop)
            },
            BUDGET_MS,
        ),
    );
    // The own BatchNorm on a Context of its own (BnImpl::Own): its buffers there.
    let ost = own.stream();
    let oy = ost.clone_dtod(&y)?;
    let oz = ost.clone_dtod(&z)?;
    let mut oout = ost.alloc_zeros::<T>(yl)?;
    let (os, oq) = (ost.clone_dtod(&sum)?, ost.clone_dtod(&sq)?);
    let og = ost.clone_htod(&vec![1.0f32; k])?;
    let ob = ost.alloc_zeros::<f32>(k)?;
    let (mut orm, mut orv) = (
        ost.alloc_zeros::<f32>(k)?,
        ost.clone_htod(&vec![1.0f32; k])?,
    );
    let obn = BatchNorm::<T>::new(own, &bn_shape, 3, u.fuse)?;
    let ee = row(
        dt,
        u.name,
        "(e) forward_train_from_sums",
        sums_floor,
        gpu_us(
            own,
            || {
                obn.forward_train_from_sums(
                    TrainArgs {
                        x: oy.as_view(),
                        addend: add.then(|| oz.as_view()),
                        gamma: og.as_view(),
                        beta: ob.as_view(),
                        running_mean: orm.as_view_mut(),
                        running_var: orv.as_view_mut(),
                        y: oout.as_view_mut(),
                        momentum: 0.1,
                        eps: 1e-5,
                    },
                    &os.as_view(),
                    &oq.as_view(),
                )
                .map(drop)
            },
            BUDGET_MS,
        ),
    );
    let pair = |p: Option<f64>, q: Option<f64>| p.zip(q).map(|(p, q)| p + q);
    let unfused = pair(a, d);
    let floor = conv_floor + sums_floor;
    for (case, t) in [
        ("(b)+(e) fused total", pair(bg, ee)),
        ("(c)+(e) unfused stats + BN from sums", pair(c, ee)),
        ("(a)+(d) unfused total", unfused),
    ] {
        if let Some(t) = t {
            row(dt, u.name, case, floor, Ok(t));
        }
    }
    if let (Some(f), Some(un)) = (pair(bg, ee), unfused) {
        println!(
            "| {dt} | {} | fused / unfused | {:.3} | saves {:.1} µs | |",
            u.name,
            f / un,
            un - f
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    if !nnfuse::context::driver_present() {
        println!("block_training: no CUDA driver; nothing measured");
        return Ok(());
    }
    let ctx = Context::with_config(0, Config::default())?;
    let own = Context::with_config(0, Config::default().with_bn_impl(BnImpl::Own))?;
    println!("# ConvStats and BatchNorm from sums (the training block's fusion (a'))\n");
    println!("{}\n", ctx.info());
    println!("| dtype | unit | case | GPU µs | floor µs | % of floor |\n|---|---|---|---|---|---|");
    for u in units() {
        if let Err(e) = bench_unit::<f16>(&ctx, &own, &u) {
            println!("| f16 | {} | error: {e} | | | |", u.name);
        }
    }
    for u in units() {
        if let Err(e) = bench_unit::<bf16>(&ctx, &own, &u) {
            println!("| bf16 | {} | error: {e} | | | |", u.name);
        }
    }
    Ok(())
}
