//! The training chain `block::ConvBnChain` on the demo's bottleneck (batch 32, 56x56, NHWC;
//! conv1 1x1 256→64 + BN + ReLU, conv2 3x3 64→64 + BN + ReLU, conv3 1x1 64→256 + BN + add +
//! ReLU, the addend the input), f16 and bf16: each eligible route forced, forward alone,
//! backward alone and both, GPU µs (median of CUDA-event samples after warm-up), next to the
//! fused chain's floor — per convolution direction the larger of FLOPs over 989.4 TFLOP/s (H100
//! SXM dense f16/bf16) and its input + output bytes over 3.0 TB/s, plus the last BatchNorm's
//! passes (forward: z, addend, y; backward: z, dy, y, dz, the addend's gradient) — and the
//! prologue route's ratio to the units route; before them, the chain's own first-call decision
//! (its check, the link graphs' engine race — the forced runs use the engines it chose — and
//! the routes' race). One JSON line per measurement (`{"bench": "block_chain", ...}`).
//!
//! Run: `cargo bench --bench block_chain` (or `.gpu/run --bench-only` after
//! `scripts/gpu-stage`).

#[path = "support/chain_bufs.rs"]
mod chain_bufs;
#[path = "support/host_time.rs"]
#[allow(dead_code)] // shared with the host-cost benches; this one reports GPU time only
mod host_time;

use half::{bf16, f16};
use nnfuse::batchnorm::Fuse;
use nnfuse::block::{ChainRoute, ChainSaved, ConvBnChain};
use nnfuse::conv::ConvShape;
use nnfuse::{Config, Context, Element, TensorFormat};

use chain_bufs::Bufs;
use host_time::gpu_us;

const PEAK_FLOPS: f64 = 989.4e12;
const PEAK_BYTES: f64 = 3.0e12;
const BUDGET_MS: f64 = 300.0;
const N: usize = 32;
const HW: usize = 56;

fn shapes() -> Vec<ConvShape> {
    let s = |c, k, r| ConvShape::square(N, c, HW, k, r, TensorFormat::Nhwc);
    vec![s(256, 64, 1), s(64, 64, 3), s(64, 256, 1)]
}

/// The fused chain's floor in µs (see the module docs).
fn floor_us(shapes: &[ConvShape], elem: usize) -> f64 {
    let mut t = 0.0;
    for s in shapes {
        let (x, w, y) = (
            s.x_len().unwrap() as f64,
            s.w_len().unwrap() as f64,
            s.y_len().unwrap() as f64,
        );
        let flops = 2.0 * y * (s.c_in * s.kh * s.kw) as f64;
        let e = elem as f64;
        // forward x,w -> y; dgrad dy,w -> dx; wgrad x,dy -> dw
        for bytes in [(x + w + y) * e, (y + w + x) * e, (x + y + w) * e] {
            t += (flops / PEAK_FLOPS).max(bytes / PEAK_BYTES);
        }
    }
    let y = shapes.last().unwrap().y_len().unwrap() as f64 * elem as f64;
    t += (3.0 * y + 5.0 * y) / PEAK_BYTES;
    t * 1e6
}

fn measure<T: Element>(
    ctx: &Context,
    chain: &ConvBnChain<T>,
    bufs: &mut Bufs<T>,
    saved: &mut ChainSaved<T>,
    route: ChainRoute,
) -> anyhow::Result<[f64; 3]> {
    chain.forward_train_with(route, bufs.fwd(), saved)?;
    let fwd = gpu_us(
        ctx,
        || chain.forward_train_with(route, bufs.fwd(), saved),
        BUDGET_MS,
    )?;
    let bwd = gpu_us(ctx, || chain.backward(bufs.bwd(), saved), BUDGET_MS)?;
    let both = gpu_us(
        ctx,
        || {
            chain.forward_train_with(route, bufs.fwd(), saved)?;
            chain.backward(bufs.bwd(), saved)
        },
        BUDGET_MS,
    )?;
    Ok([fwd, bwd, both])
}

fn bench<T: Element>(ctx: &Context) -> anyhow::Result<()> {
    let dt = T::DTYPE.name();
    let shapes = shapes();
    let chain = ConvBnChain::<T>::new(ctx, &shapes, Fuse::AddRelu)?;
    let floor = floor_us(&shapes, std::mem::size_of::<T>());
    let mut bufs = Bufs::<T>::new(ctx, &shapes)?;
    let mut saved = chain.new_saved()?;
    // The chain's own first call first: its check, the link graphs' engine race (the forced
    // runs below then use the engines it chose) and the routes' race.
    chain.forward_train(bufs.fwd(), &mut saved)?;
    let mut decision = String::new();
    if let Some(c) = chain.choice() {
        decision = format!("\n{dt} first-call decision: {}\n", c.describe());
        for n in &c.notes {
            decision += &format!("  {n}\n");
        }
    }
    let mut units = None;
    for route in [ChainRoute::Units, ChainRoute::Prologue] {
        if !chain.plan().eligible(route) {
            println!(
                "| {dt} | {route} | refused: {} | | | | |",
                chain.plan().reason(route)
            );
            continue;
        }
        let [f, b, both] = measure(ctx, &chain, &mut bufs, &mut saved, route)?;
        let ratio = match (route, units) {
            (ChainRoute::Prologue, Some(u)) => format!("{:.2}x", u / both),
            _ => "-".into(),
        };
        if route == ChainRoute::Units {
            units = Some(both);
        }
        println!(
            "| {dt} | {route} | {f:.1} | {b:.1} | {both:.1} | {floor:.1} | {:.0}% | {ratio} |",
            100.0 * floor / both
        );
        println!(
            "{{\"bench\":\"block_chain\",\"dtype\":\"{dt}\",\"route\":\"{route}\",\"fwd_us\":{f:.2},\"bwd_us\":{b:.2},\"step_us\":{both:.2},\"floor_us\":{floor:.2}}}"
        );
    }
    println!("{decision}");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    if !nnfuse::context::driver_present() {
        println!("block_chain: no CUDA driver; nothing measured");
        return Ok(());
    }
    let ctx = Context::with_config(0, Config::default())?;
    println!("# ConvBnChain: the bottleneck's main path, batch 32, 56x56, NHWC\n");
    println!("{}\n", ctx.info());
    println!(
        "| dtype | route | forward µs | backward µs | forward + backward µs | floor µs | % of floor | units / prologue |\n|---|---|---|---|---|---|---|---|"
    );
    bench::<f16>(&ctx)?;
    bench::<bf16>(&ctx)?;
    Ok(())
}
