//! The folded backward of the demo's last unit (conv3 1x1 64→256 + bn3 BN+Add+ReLU, batch 32,
//! 56x56, NHWC; docs/BLOCK-TRAINING.md, "Built: the folded backward of a pointwise unit") against the composed one
//! (the own BatchNorm backward into dz, then the convolution's two gradients of dz), f16 and
//! bf16, each forced through `ConvBnTrain::backward_with` on the fused route's forward state.
//!
//! GPU µs per call: median of CUDA-event samples (`support/host_time.rs`' `gpu_us`, warm-up
//! first), next to each route's floor: the bytes it must move at least over 3.0 TB/s —
//! composed: the BatchNorm backward in one pass (dy, z read; dz, d_addend written; the mask)
//! plus each gradient reading dz; folded: the sums pass (dy, z, mask read; d_addend written),
//! both gradients of d_addend, the projection (x read, dx read and written) and x read for its
//! Gram matrix and sums. One JSON line per measurement (`{"bench": "block_fold", ...}`).
//!
//! `NNFUSE_BENCH_FOLD_ONCE=1`: each route runs twice, untimed (for a profiler).
//!
//! Run: `cargo bench --bench block_fold` (or `.gpu/run --exec .gpu/bin/bench/block_fold --bench`
//! after `scripts/gpu-stage`).

#[path = "support/host_time.rs"]
#[allow(dead_code)] // shared with the host-cost benches; this one reports GPU time only
mod host_time;

use half::{bf16, f16};
use nnfuse::batchnorm::Fuse;
use nnfuse::block::{ConvBnArgs, ConvBnBackwardArgs, ConvBnTrain, TrainRoute};
use nnfuse::conv::ConvShape;
use nnfuse::cudarc::driver::CudaSlice;
use nnfuse::{Config, Context, Element, TensorFormat};

use host_time::gpu_us;

const PEAK_BYTES: f64 = 3.0e12;
const BUDGET_MS: f64 = 300.0;

fn random<T: Element>(
    ctx: &Context,
    n: usize,
    seed: u64,
    lo: f64,
    hi: f64,
) -> nnfuse::Result<CudaSlice<T>> {
    let mut s = seed | 1;
    let v: Vec<T> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f64(lo + (hi - lo) * ((s >> 11) as f64 / (1u64 << 53) as f64))
        })
        .collect();
    Ok(ctx.stream().clone_htod(&v)?)
}

fn bench<T: Element>(ctx: &Context, once: bool) -> anyhow::Result<()> {
    let s = ConvShape::square(32, 64, 56, 256, 1, TensorFormat::Nhwc);
    let dt = T::DTYPE.name();
    let unit = ConvBnTrain::<T>::new(ctx, &s, Fuse::AddRelu)?;
    if let Some(why) = unit.fold_refusal() {
        println!("| {dt} | fold refused: {why} | | | |");
        return Ok(());
    }
    let (xn, wn, yn, c) = (s.x_len()?, s.w_len()?, s.y_len()?, s.c_out);
    let x = random::<T>(ctx, xn, 1, 0.0, 1.5)?;
    let w = random::<T>(ctx, wn, 2, -0.2, 0.2)?;
    let addend = random::<T>(ctx, yn, 3, -1.0, 1.0)?;
    let dy = random::<T>(ctx, yn, 4, -1.0, 1.0)?;
    let g = random::<f32>(ctx, c, 5, 0.5, 1.5)?;
    let b = random::<f32>(ctx, c, 6, -0.5, 0.5)?;
    let (mut rm, mut rv) = (
        random::<f32>(ctx, c, 7, -0.1, 0.1)?,
        random::<f32>(ctx, c, 8, 0.5, 1.5)?,
    );
    let st = ctx.stream();
    let mut z = st.alloc_zeros::<T>(yn)?;
    let mut y = st.alloc_zeros::<T>(yn)?;
    let saved = unit.forward_train_with(
        TrainRoute::Fused,
        ConvBnArgs {
            x: x.as_view(),
            w: w.as_view(),
            z: z.as_view_mut(),
            addend: Some(addend.as_view()),
            gamma: g.as_view(),
            beta: b.as_view(),
            running_mean: rm.as_view_mut(),
            running_var: rv.as_view_mut(),
            y: y.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        },
    )?;
    let mut dz = st.alloc_zeros::<T>(yn)?;
    let mut dx = st.alloc_zeros::<T>(xn)?;
    let mut dw = st.alloc_zeros::<T>(wn)?;
    let (mut dg, mut db) = (st.alloc_zeros::<f32>(c)?, st.alloc_zeros::<f32>(c)?);
    let mut da = st.alloc_zeros::<T>(yn)?;
    let mut call = |folded: bool| {
        unit.backward_with(
            folded,
            ConvBnBackwardArgs {
                x: x.as_view(),
                w: w.as_view(),
                z: z.as_view(),
                y: y.as_view(),
                dy: dy.as_view(),
                gamma: g.as_view(),
                beta: b.as_view(),
                saved: &saved,
                dz: dz.as_view_mut(),
                dx: Some(dx.as_view_mut()),
                accumulate_dx: false,
                dw: dw.as_view_mut(),
                dgamma: dg.as_view_mut(),
                dbeta: db.as_view_mut(),
                d_addend: Some(da.as_view_mut()),
            },
        )
    };
    let e = T::DTYPE.size() as f64;
    let (xb, yb, mask) = (xn as f64 * e, yn as f64 * e, yn as f64 / 8.0);
    let floors = [
        ("composed", 4.0 * yb + mask + 2.0 * yb + 2.0 * xb),
        ("folded", 3.0 * yb + mask + 2.0 * (yb + xb) + 3.0 * xb + xb),
    ];
    let mut times = [0.0f64; 2];
    for (i, (name, bytes)) in floors.iter().enumerate() {
        let folded = i == 1;
        if once {
            call(folded)?;
            call(folded)?;
            ctx.synchronize()?;
            println!("{dt} {name}: ran twice");
            continue;
        }
        let t = gpu_us(ctx, || call(folded), BUDGET_MS)?;
        let floor = bytes / PEAK_BYTES * 1e6;
        times[i] = t;
        println!(
            "| {dt} | {name} | {t:.1} | {floor:.1} | {:.0}% |",
            100.0 * floor / t
        );
        println!(
            "{{\"bench\":\"block_fold\",\"dtype\":\"{dt}\",\"route\":\"{name}\",\"gpu_us\":{t:.2},\"floor_us\":{floor:.2}}}"
        );
    }
    if !once {
        println!(
            "| {dt} | folded / composed | {:.3} | saves {:.1} µs | |",
            times[1] / times[0],
            times[0] - times[1]
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    if !nnfuse::context::driver_present() {
        println!("block_fold: no CUDA driver; nothing measured");
        return Ok(());
    }
    let once = std::env::var_os("NNFUSE_BENCH_FOLD_ONCE").is_some();
    let ctx = Context::with_config(0, Config::default())?;
    println!("# The folded backward of conv3 + bn3 (batch 32, 56x56, NHWC)\n");
    println!("{}\n", ctx.info());
    println!("| dtype | route | GPU µs | floor µs | % of floor |\n|---|---|---|---|---|");
    bench::<f16>(&ctx, once)?;
    bench::<bf16>(&ctx, once)?;
    Ok(())
}
