//! BatchNorm benchmark (issue 3): fused vs fallback vs plain baseline, forward and backward,
//! on ResNet-50 shapes; the 2-D paths under each mode policy; NCHW mode comparison; dispatch
//! overhead. CUDA events, warm-up, median of many, rotating buffers so that L2 (50 MiB on the
//! H100) does not hold the working set. Prints markdown tables and JSON lines.
//!
//! Floors: bytes the operation must move (each input read once, each output written once; the
//! backward's activation state counted as the 1-bit mask) over the copy bandwidth measured in
//! the same run.

use std::time::Instant;

use anyhow::Result;
use cudarc::driver::CudaSlice;
use half::f16;
use nnfuse::activation;
use nnfuse::batchnorm::{BackwardArgs, BatchNorm, BnPath, BnSaved, Fuse, TrainArgs};
use nnfuse::timing::{copy_bandwidth, time_gpu, TimingOptions};
use nnfuse::{BnModePolicy, Config, Context, Element};

const L2_BYTES: usize = 50 << 20;

fn opts() -> TimingOptions {
    TimingOptions {
        warmup: 3,
        max_iters: 60,
        min_iters: 15,
        budget_ms: 60.0,
    }
}

/// One rotating copy of the per-call buffers.
struct Bufs<T> {
    x: CudaSlice<T>,
    z: CudaSlice<T>,
    y: CudaSlice<T>,
    dy: CudaSlice<T>,
    dx: CudaSlice<T>,
    dz: CudaSlice<T>,
}

struct Params {
    g: CudaSlice<f32>,
    b: CudaSlice<f32>,
    rm: CudaSlice<f32>,
    rv: CudaSlice<f32>,
    dg: CudaSlice<f32>,
    db: CudaSlice<f32>,
}

fn random<T: Element>(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<T> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f64(lo + (hi - lo) * ((s >> 11) as f64 / (1u64 << 53) as f64))
        })
        .collect()
}

#[derive(Default)]
struct Report {
    rows: Vec<String>,
}

impl Report {
    #[allow(clippy::too_many_arguments)]
    fn row(
        &mut self,
        case: &str,
        dir: &str,
        path: &str,
        us: f64,
        floor_us: f64,
        floor_bytes: f64,
        baseline_us: Option<f64>,
    ) {
        let ratio = baseline_us.map_or("-".to_string(), |b| format!("{:.2}x", b / us));
        let line = format!(
            "| {case} | {dir} | {path} | {us:.1} | {:.2} | {floor_us:.1} | {:.0}% | {ratio} |",
            floor_bytes / (us * 1e-6) / 1e12,
            100.0 * floor_us / us
        );
        println!("{line}");
        println!(
            "{{\"bench\":\"batchnorm\",\"case\":\"{case}\",\"dir\":\"{dir}\",\"path\":\"{path}\",\"us\":{us:.2},\"floor_us\":{floor_us:.2},\"speedup_vs_baseline\":{}}}",
            baseline_us.map_or("null".to_string(), |b| format!("{:.3}", b / us))
        );
        self.rows.push(line);
    }
}

const HEADER: &str = "| case | dir | path | median µs | TB/s (floor bytes) | floor µs | % of floor | speedup vs baseline |\n|---|---|---|---|---|---|---|---|";

#[allow(clippy::too_many_arguments)]
fn bench_case<T: Element>(
    ctx: &Context,
    fallback: &Context,
    shape: &[usize],
    axis: usize,
    fuse: Fuse,
    bw: f64,
    label: &str,
    report: &mut Report,
) -> Result<()> {
    let s = ctx.stream();
    let n: usize = shape.iter().product();
    let c = shape[axis];
    let es = std::mem::size_of::<T>();
    let add = fuse == Fuse::AddRelu;
    let per_call = (if add { 5 } else { 4 }) * n * es;
    let copies = (2 * L2_BYTES).div_ceil(per_call).clamp(1, 8);
    let xs = random::<T>(n, 1, -2.0, 3.0);
    let zs = random::<T>(n, 2, -1.0, 1.0);
    let dys = random::<T>(n, 3, -1.0, 1.0);
    let mut bufs: Vec<Bufs<T>> = (0..copies)
        .map(|_| -> Result<Bufs<T>> {
            Ok(Bufs {
                x: s.clone_htod(&xs)?,
                z: s.clone_htod(&zs)?,
                y: s.alloc_zeros(n)?,
                dy: s.clone_htod(&dys)?,
                dx: s.alloc_zeros(n)?,
                dz: s.alloc_zeros(n)?,
            })
        })
        .collect::<Result<_>>()?;
    let mut p = Params {
        g: s.clone_htod(&random::<f32>(c, 4, 0.5, 1.5))?,
        b: s.clone_htod(&random::<f32>(c, 5, -0.5, 0.5))?,
        rm: s.alloc_zeros(c)?,
        rv: s.clone_htod(&vec![1.0f32; c])?,
        dg: s.alloc_zeros(c)?,
        db: s.alloc_zeros(c)?,
    };
    let fwd_bytes = ((if add { 3 } else { 2 }) * n * es) as f64;
    let bwd_bytes = ((if add { 4 } else { 3 }) * n * es) as f64 + n as f64 / 8.0;
    let fwd_floor = fwd_bytes / bw * 1e6;
    let bwd_floor = bwd_bytes / bw * 1e6;
    let case = format!("{label} {shape:?} {}", fuse_name(fuse));

    let fused = BatchNorm::<T>::new(ctx, shape, axis, fuse)?;
    let fb = BatchNorm::<T>::new(fallback, shape, axis, fuse)?;
    let plain = BatchNorm::<T>::new(ctx, shape, axis, Fuse::None)?;

    // --- forward ---------------------------------------------------------------------------
    let forward = |bn: &BatchNorm<T>, b: &mut Bufs<T>, p: &mut Params| -> nnfuse::Result<BnSaved> {
        bn.forward_train(TrainArgs {
            x: b.x.as_view(),
            addend: add.then(|| b.z.as_view()),
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            running_mean: p.rm.as_view_mut(),
            running_var: p.rv.as_view_mut(),
            y: b.y.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        })
    };
    // Baseline: plain cuDNN BN, then a ReLU (Add+ReLU) in place that keeps y, no mask.
    let baseline_fwd = |b: &mut Bufs<T>, p: &mut Params| -> nnfuse::Result<BnSaved> {
        let saved = plain.forward_train(TrainArgs {
            x: b.x.as_view(),
            addend: None,
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            running_mean: p.rm.as_view_mut(),
            running_var: p.rv.as_view_mut(),
            y: b.y.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        })?;
        let none: Option<&mut CudaSlice<u32>> = None;
        if add {
            activation::add_relu_mask_fwd_inplace(ctx, &mut b.y, &b.z, none)?;
        } else {
            activation::relu_mask_fwd_inplace(ctx, &mut b.y, none)?;
        }
        Ok(saved)
    };
    let t_base = time_gpu(ctx, opts(), |i| {
        baseline_fwd(&mut bufs[i % copies], &mut p).map(drop)
    })?;
    report.row(
        &case,
        "fwd",
        "baseline",
        t_base.median_us(),
        fwd_floor,
        fwd_bytes,
        None,
    );
    let t_fb = time_gpu(ctx, opts(), |i| {
        forward(&fb, &mut bufs[i % copies], &mut p).map(drop)
    })?;
    report.row(
        &case,
        "fwd",
        "fallback",
        t_fb.median_us(),
        fwd_floor,
        fwd_bytes,
        Some(t_base.median_us()),
    );
    let has_fused = fused.training_path() == BnPath::CudnnFused;
    let mut t_fused_fwd = None;
    if has_fused {
        let t = time_gpu(ctx, opts(), |i| {
            forward(&fused, &mut bufs[i % copies], &mut p).map(drop)
        })?;
        report.row(
            &case,
            "fwd",
            "cudnn_fused",
            t.median_us(),
            fwd_floor,
            fwd_bytes,
            Some(t_base.median_us()),
        );
        t_fused_fwd = Some(t.median_us());
    }

    // --- backward --------------------------------------------------------------------------
    let backward = |bn: &BatchNorm<T>, b: &mut Bufs<T>, p: &mut Params, saved: &BnSaved| {
        bn.backward(BackwardArgs {
            x: b.x.as_view(),
            y: b.y.as_view(),
            dy: b.dy.as_view(),
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            saved,
            dx: b.dx.as_view_mut(),
            d_addend: add.then(|| b.dz.as_view_mut()),
            dgamma: p.dg.as_view_mut(),
            dbeta: p.db.as_view_mut(),
        })
    };
    // Baseline backward: ReLU backward from y into dz (the addend's gradient, or scratch),
    // then plain BN backward from it.
    let saved: Vec<BnSaved> = (0..copies)
        .map(|k| baseline_fwd(&mut bufs[k], &mut p))
        .collect::<nnfuse::Result<_>>()?;
    let t_base_b = time_gpu(ctx, opts(), |i| {
        let k = i % copies;
        let b = &mut bufs[k];
        activation::baseline::relu_bwd_from_y(ctx, &b.dy, &b.y, &mut b.dz)?;
        plain.backward(BackwardArgs {
            x: b.x.as_view(),
            y: b.y.as_view(),
            dy: b.dz.as_view(),
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            saved: &saved[k],
            dx: b.dx.as_view_mut(),
            d_addend: None,
            dgamma: p.dg.as_view_mut(),
            dbeta: p.db.as_view_mut(),
        })
    })?;
    drop(saved);
    report.row(
        &case,
        "bwd",
        "baseline",
        t_base_b.median_us(),
        bwd_floor,
        bwd_bytes,
        None,
    );
    let saved: Vec<BnSaved> = (0..copies)
        .map(|k| forward(&fb, &mut bufs[k], &mut p))
        .collect::<nnfuse::Result<_>>()?;
    let t_fb_b = time_gpu(ctx, opts(), |i| {
        let k = i % copies;
        backward(&fb, &mut bufs[k], &mut p, &saved[k])
    })?;
    drop(saved);
    report.row(
        &case,
        "bwd",
        "fallback",
        t_fb_b.median_us(),
        bwd_floor,
        bwd_bytes,
        Some(t_base_b.median_us()),
    );
    if let Some(tf) = t_fused_fwd {
        let saved: Vec<BnSaved> = (0..copies)
            .map(|k| forward(&fused, &mut bufs[k], &mut p))
            .collect::<nnfuse::Result<_>>()?;
        let t = time_gpu(ctx, opts(), |i| {
            let k = i % copies;
            backward(&fused, &mut bufs[k], &mut p, &saved[k])
        })?;
        report.row(
            &case,
            "bwd",
            "cudnn_fused",
            t.median_us(),
            bwd_floor,
            bwd_bytes,
            Some(t_base_b.median_us()),
        );
        let both = tf + t.median_us();
        let base = t_base.median_us() + t_base_b.median_us();
        report.row(
            &case,
            "fwd+bwd",
            "cudnn_fused",
            both,
            fwd_floor + bwd_floor,
            fwd_bytes + bwd_bytes,
            Some(base),
        );
    }
    let both = t_fb.median_us() + t_fb_b.median_us();
    let base = t_base.median_us() + t_base_b.median_us();
    report.row(
        &case,
        "fwd+bwd",
        "fallback",
        both,
        fwd_floor + bwd_floor,
        fwd_bytes + bwd_bytes,
        Some(base),
    );
    if !has_fused {
        println!("  ({case}: no fused path: {:?})", fused.plan().refusals);
    }
    Ok(())
}

fn fuse_name(f: Fuse) -> &'static str {
    match f {
        Fuse::None => "bn",
        Fuse::Relu => "bn+relu",
        Fuse::AddRelu => "bn+add+relu",
    }
}

/// Plain BN forward and backward of one shape under `ctx`'s policy.
fn bench_plain<T: Element>(
    ctx: &Context,
    shape: &[usize],
    axis: usize,
    bw: f64,
    label: &str,
    report: &mut Report,
) -> Result<()> {
    let s = ctx.stream();
    let n: usize = shape.iter().product();
    let c = shape[axis];
    let es = std::mem::size_of::<T>();
    let copies = (2 * L2_BYTES).div_ceil(4 * n * es).clamp(1, 8);
    let xs = random::<T>(n, 7, -2.0, 3.0);
    let mut bufs: Vec<Bufs<T>> = (0..copies)
        .map(|_| -> Result<Bufs<T>> {
            Ok(Bufs {
                x: s.clone_htod(&xs)?,
                z: s.alloc_zeros(1)?,
                y: s.alloc_zeros(n)?,
                dy: s.clone_htod(&xs)?,
                dx: s.alloc_zeros(n)?,
                dz: s.alloc_zeros(1)?,
            })
        })
        .collect::<Result<_>>()?;
    let mut p = Params {
        g: s.clone_htod(&vec![1.0f32; c])?,
        b: s.alloc_zeros(c)?,
        rm: s.alloc_zeros(c)?,
        rv: s.clone_htod(&vec![1.0f32; c])?,
        dg: s.alloc_zeros(c)?,
        db: s.alloc_zeros(c)?,
    };
    let bn = BatchNorm::<T>::new(ctx, shape, axis, Fuse::None)?;
    let fwd = |b: &mut Bufs<T>, p: &mut Params| {
        bn.forward_train(TrainArgs {
            x: b.x.as_view(),
            addend: None,
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            running_mean: p.rm.as_view_mut(),
            running_var: p.rv.as_view_mut(),
            y: b.y.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        })
    };
    let t = time_gpu(ctx, opts(), |i| {
        fwd(&mut bufs[i % copies], &mut p).map(drop)
    })?;
    let case = format!("{label} {shape:?} mode={}", bn.plan().mode.name());
    let fb = (2 * n * es) as f64;
    report.row(
        &case,
        "fwd",
        "plain",
        t.median_us(),
        fb / bw * 1e6,
        fb,
        None,
    );
    let saved: Vec<BnSaved> = (0..copies)
        .map(|k| fwd(&mut bufs[k], &mut p))
        .collect::<nnfuse::Result<_>>()?;
    let t = time_gpu(ctx, opts(), |i| {
        let k = i % copies;
        let b = &mut bufs[k];
        bn.backward(BackwardArgs {
            x: b.x.as_view(),
            y: b.y.as_view(),
            dy: b.dy.as_view(),
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            saved: &saved[k],
            dx: b.dx.as_view_mut(),
            d_addend: None,
            dgamma: p.dg.as_view_mut(),
            dbeta: p.db.as_view_mut(),
        })
    })?;
    let bb = (3 * n * es) as f64;
    report.row(
        &case,
        "bwd",
        "plain",
        t.median_us(),
        bb / bw * 1e6,
        bb,
        None,
    );
    Ok(())
}

fn main() -> Result<()> {
    let ctx = Context::with_config(0, Config::default())?;
    let fallback = ctx.with_config_override(Config::default().with_cudnn_fusion_disabled(true));
    println!("# nnfuse BatchNorm benchmark\n{}", ctx.info());
    println!(
        "cuDNN {}",
        nnfuse::context::cudnn_version().map_or("?".into(), |v| v.to_string())
    );
    let bw = copy_bandwidth(&ctx, 1 << 30)?;
    println!(
        "measured device-to-device copy bandwidth: {:.3} TB/s (read + write)\n",
        bw / 1e12
    );
    let mut report = Report::default();
    println!("{HEADER}");
    const SHAPES: [(usize, usize, usize, usize); 5] = [
        (16, 32, 112, 112),
        (64, 64, 112, 112),
        (64, 256, 56, 56),
        (64, 512, 28, 28),
        (64, 1024, 14, 14),
    ];
    for (n, c, h, w) in SHAPES {
        for fuse in [Fuse::Relu, Fuse::AddRelu] {
            bench_case::<f16>(
                &ctx,
                &fallback,
                &[n, h, w, c],
                3,
                fuse,
                bw,
                "f16 NHWC",
                &mut report,
            )?;
            bench_case::<f32>(
                &ctx,
                &fallback,
                &[n, c, h, w],
                1,
                fuse,
                bw,
                "f32 NCHW",
                &mut report,
            )?;
        }
    }

    println!("\n## Plain BatchNorm by mode policy (2-D input, channels-first)\n\n{HEADER}");
    for policy in [
        BnModePolicy::OneFlow,
        BnModePolicy::Auto,
        BnModePolicy::Fast,
    ] {
        let pctx = ctx.with_config_override(Config::default().with_bn_mode_policy(policy));
        let tag = format!("policy={}", policy.name());
        for (rows, cols) in [(65536, 256), (4096, 1024)] {
            bench_plain::<f32>(
                &pctx,
                &[rows, cols],
                1,
                bw,
                &format!("{tag} f32 2-D"),
                &mut report,
            )?;
            bench_plain::<f16>(
                &pctx,
                &[rows, cols],
                1,
                bw,
                &format!("{tag} f16 2-D"),
                &mut report,
            )?;
        }
        if policy != BnModePolicy::OneFlow {
            for shape in [[16, 32, 112, 112], [64, 64, 112, 112]] {
                bench_plain::<f32>(
                    &pctx,
                    &shape,
                    1,
                    bw,
                    &format!("{tag} f32 NCHW"),
                    &mut report,
                )?;
            }
        }
    }

    // Host-side dispatch cost of a repeated shape: the plan and descriptors come from the
    // Context's cache.
    let iters = 100_000;
    let t = Instant::now();
    for _ in 0..iters {
        let bn = BatchNorm::<f16>::new(&ctx, &[64, 56, 56, 256], 3, Fuse::AddRelu)?;
        std::hint::black_box(&bn);
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
    println!(
        "\ndispatch: BatchNorm::new on a repeated shape (plan + descriptors cached): {us:.3} µs"
    );
    println!("{{\"bench\":\"batchnorm\",\"case\":\"dispatch_cached_new\",\"us\":{us:.4}}}");
    Ok(())
}
