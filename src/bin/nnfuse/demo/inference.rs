//! `nnfuse demo --inference`: the bottleneck block forward-only, each `conv → BN → (+x) → ReLU`
//! unit folded (`nnfuse::block::ConvBnInference`, its decided route) against the same units
//! unfused (`BlockRoute::Unfused`: `Conv2d` then `BatchNorm` inference), both checked against
//! f64 unit by unit at the check batch, then timed against each other (GPU time, interleaved
//! rounds behind a head start, medians) at the timing batch: the whole block and every unit.

use std::time::Instant;

use anyhow::Context as _;
use cudarc::driver::CudaSlice;
use nnfuse::block::{reference_forward, BlockRoute, BnHost, ConvBnInference, ConvBnParams};
use nnfuse::internals::block::tolerance;
use nnfuse::internals::timing::{time_interleaved_gpu, InterleavedOptions};
use nnfuse::{Context, Element};
use serde_json::{json, Value};

use super::block::{BlockDef, EPS};

/// xorshift64 values uniform in `[lo, hi)`.
fn values(seed: u64, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * ((s >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

/// One unit's parameters on the host (rounded as the device holds them) and the device.
struct Params<T: Element> {
    w: Vec<f64>,
    bn: [Vec<f64>; 4],
    dw: CudaSlice<T>,
    dbn: [CudaSlice<f32>; 4],
}

impl<T: Element> Params<T> {
    fn new(ctx: &Context, def: &BlockDef, i: usize, seed: u64) -> anyhow::Result<Params<T>> {
        let s = def.conv(i);
        let k = (s.c_in * s.kh * s.kw) as f64;
        let bound = (2.0 / k).sqrt();
        let wt: Vec<T> = values(seed, s.w_len()?, -bound, bound)
            .into_iter()
            .map(T::from_f64)
            .collect();
        let ranges = [(0.5, 1.5), (-0.3, 0.3), (-0.2, 0.2), (0.5, 2.0)];
        let bn32: Vec<Vec<f32>> = ranges
            .iter()
            .enumerate()
            .map(|(j, &(lo, hi))| {
                values(seed + 1 + j as u64, s.c_out, lo, hi)
                    .into_iter()
                    .map(|v| v as f32)
                    .collect()
            })
            .collect();
        let up = |v: &[f32]| ctx.stream().clone_htod(v);
        Ok(Params {
            w: wt.iter().map(|v| v.to_f64()).collect(),
            bn: [0, 1, 2, 3].map(|j| bn32[j].iter().map(|&v| f64::from(v)).collect()),
            dw: ctx.stream().clone_htod(&wt)?,
            dbn: [up(&bn32[0])?, up(&bn32[1])?, up(&bn32[2])?, up(&bn32[3])?],
        })
    }

    fn host(&self) -> BnHost<'_> {
        BnHost {
            gamma: &self.bn[0],
            beta: &self.bn[1],
            running_mean: &self.bn[2],
            running_var: &self.bn[3],
            eps: EPS,
        }
    }

    fn unit(&self, ctx: &Context, def: &BlockDef, i: usize) -> nnfuse::Result<ConvBnInference<T>> {
        ConvBnInference::new(
            ctx,
            &def.conv(i),
            ConvBnParams {
                w: self.dw.as_view(),
                gamma: self.dbn[0].as_view(),
                beta: self.dbn[1].as_view(),
                running_mean: self.dbn[2].as_view(),
                running_var: self.dbn[3].as_view(),
                eps: EPS,
            },
        )
    }
}

/// The block's three units at one batch, with its activations.
struct Block<T: Element> {
    units: Vec<ConvBnInference<T>>,
    x: CudaSlice<T>,
    a1: CudaSlice<T>,
    a2: CudaSlice<T>,
    y: CudaSlice<T>,
}

impl<T: Element> Block<T> {
    fn new(ctx: &Context, def: &BlockDef, params: &[Params<T>], seed: u64) -> anyhow::Result<Self> {
        let units = (0..3)
            .map(|i| params[i].unit(ctx, def, i))
            .collect::<nnfuse::Result<Vec<_>>>()?;
        let xt: Vec<T> = values(seed, def.act_len(def.c), -1.0, 1.0)
            .into_iter()
            .map(T::from_f64)
            .collect();
        let s = ctx.stream();
        Ok(Block {
            units,
            x: s.clone_htod(&xt)?,
            a1: s.alloc_zeros(def.act_len(def.mid))?,
            a2: s.alloc_zeros(def.act_len(def.mid))?,
            y: s.alloc_zeros(def.act_len(def.c))?,
        })
    }

    /// Unit `i` on `route` (None: the decided one).
    fn unit(&mut self, i: usize, route: Option<BlockRoute>) -> nnfuse::Result<()> {
        let u = &self.units[i];
        let (x, out, shortcut) = match i {
            0 => (self.x.as_view(), self.a1.as_view_mut(), None),
            1 => (self.a1.as_view(), self.a2.as_view_mut(), None),
            _ => (
                self.a2.as_view(),
                self.y.as_view_mut(),
                Some(self.x.as_view()),
            ),
        };
        let mut out = out;
        match route {
            Some(r) => u.forward_with(r, &x, shortcut.as_ref(), true, &mut out),
            None => u.forward(&x, shortcut.as_ref(), true, &mut out),
        }
    }

    fn forward(&mut self, route: Option<BlockRoute>) -> nnfuse::Result<()> {
        (0..3).try_for_each(|i| self.unit(i, route))
    }
}

/// Each unit's output against f64 from the unit's own device input: relative L2 per unit.
fn check_units<T: Element>(
    ctx: &Context,
    def: &BlockDef,
    params: &[Params<T>],
    b: &Block<T>,
) -> anyhow::Result<[f64; 3]> {
    let get = |v: &CudaSlice<T>| -> anyhow::Result<Vec<f64>> {
        Ok(ctx
            .stream()
            .clone_dtoh(v)?
            .iter()
            .map(|x| x.to_f64())
            .collect())
    };
    let (x, a1, a2, y) = (get(&b.x)?, get(&b.a1)?, get(&b.a2)?, get(&b.y)?);
    let mut errs = [0.0; 3];
    for (i, (input, out)) in [(&x, &a1), (&a1, &a2), (&a2, &y)].into_iter().enumerate() {
        let shortcut = (i == 2).then_some(&x[..]);
        let want = reference_forward(
            &def.conv(i),
            input,
            &params[i].w,
            &params[i].host(),
            shortcut,
            true,
        )?;
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (g, w) in out.iter().zip(&want) {
            num += (g - w) * (g - w);
            den += w * w;
        }
        errs[i] = if out.iter().all(|v| v.is_finite()) {
            (num / den.max(1e-300)).sqrt()
        } else {
            f64::INFINITY
        };
    }
    Ok(errs)
}

/// What `--inference` measured.
pub struct InferenceRun {
    /// Text lines (the report).
    pub lines: Vec<String>,
    /// The JSON object.
    pub json: Value,
    /// Every check passed.
    pub passed: bool,
}

/// Runs the inference demo at `def` (the timing batch) with `check_batch` (None: no check).
pub fn run<T: Element>(
    ctx: &Context,
    def: &BlockDef,
    check_batch: Option<usize>,
    seed: u64,
    rounds: usize,
) -> anyhow::Result<InferenceRun> {
    let params = (0..3)
        .map(|i| Params::<T>::new(ctx, def, i, seed.wrapping_add(100 * i as u64 + 1)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut lines = vec![format!(
        "inference: bottleneck {}→{}→{} at {}x{}, {} {}, batch {}, seed {seed}",
        def.c, def.mid, def.c, def.hw, def.hw, def.dtype, def.format, def.n
    )];
    let tol = tolerance(def.dtype);
    let mut passed = true;
    let mut check_json = Value::Null;
    if let Some(cb) = check_batch {
        let cdef = def.with_batch(cb);
        let mut b = Block::<T>::new(ctx, &cdef, &params, seed)?;
        let t = Instant::now();
        b.forward(None).context("fused block (check batch)")?;
        let fused = check_units(ctx, &cdef, &params, &b)?;
        b.forward(Some(BlockRoute::Unfused))
            .context("unfused block (check batch)")?;
        let unfused = check_units(ctx, &cdef, &params, &b)?;
        let ok = fused.iter().chain(&unfused).all(|e| *e <= tol);
        passed &= ok;
        lines.push(format!(
            "check at batch {cb} against f64 (relative L2, tolerance {tol:.0e}): fused {:.2e} {:.2e} {:.2e}, unfused {:.2e} {:.2e} {:.2e} — {} ({:.1} s)",
            fused[0], fused[1], fused[2], unfused[0], unfused[1], unfused[2],
            if ok { "passed" } else { "FAILED" },
            t.elapsed().as_secs_f64()
        ));
        check_json = json!({ "batch": cb, "tolerance": tol, "fused": fused, "unfused": unfused, "passed": ok });
    }
    let mut b = Block::<T>::new(ctx, def, &params, seed)?;
    // The first fused call of each unit decides its route (outside the timing).
    b.forward(None).context("fused block (first call)")?;
    b.forward(Some(BlockRoute::Unfused))
        .context("unfused block")?;
    let mut units_json = Vec::new();
    for (i, u) in b.units.iter().enumerate() {
        let c = u.choice(i == 2, true);
        let route = c
            .as_ref()
            .map_or("undecided".to_string(), |c| c.route.to_string());
        lines.push(format!(
            "  unit {} ({}x{} {}→{}): route {route}",
            i + 1,
            def.conv(i).kh,
            def.conv(i).kw,
            def.conv(i).c_in,
            def.conv(i).c_out
        ));
        if let Some(c) = &c {
            for n in &c.notes {
                lines.push(format!("    {n}"));
            }
        }
        units_json.push(json!({ "unit": i + 1, "route": route,
            "notes": c.as_ref().map(|c| c.notes.clone()).unwrap_or_default() }));
    }
    // Variants: 0 fused block, 1 unfused block, then (fused, unfused) per unit.
    let opts = InterleavedOptions {
        max_rounds: rounds.max(10),
        min_rounds: rounds.clamp(1, 10),
        ..InterleavedOptions::default()
    };
    let timed = time_interleaved_gpu(ctx, opts, 8, |v, _| match v {
        0 => b.forward(None),
        1 => b.forward(Some(BlockRoute::Unfused)),
        v => b.unit(
            (v - 2) / 2,
            if v % 2 == 0 {
                None
            } else {
                Some(BlockRoute::Unfused)
            },
        ),
    })?;
    let us = |v: usize| timed.timing(v).map_or(f64::NAN, |t| t.median_us());
    for (v, e) in timed.errors.iter().enumerate() {
        if let Some(e) = e {
            anyhow::bail!("variant {v} failed while timed: {e}");
        }
    }
    let (fused, unfused) = (us(0), us(1));
    for (i, u) in units_json.iter_mut().enumerate() {
        let (f, n) = (us(2 + 2 * i), us(3 + 2 * i));
        lines.push(format!(
            "  unit {}: fused {f:.1} us, unfused {n:.1} us ({:.2}x)",
            i + 1,
            n / f
        ));
        u["fused_us"] = json!(f);
        u["unfused_us"] = json!(n);
    }
    lines.push(format!(
        "nnfuse inference block: fused {fused:.1} us, unfused {unfused:.1} us: {:.2}x (GPU time per block, median of {} interleaved rounds)",
        unfused / fused,
        timed.rounds
    ));
    let json = json!({
        "mode": "inference",
        "dtype": def.dtype.to_string(),
        "format": def.format.to_string(),
        "batch": def.n,
        "seed": seed,
        "check": check_json,
        "units": units_json,
        "fused_us": fused,
        "unfused_us": unfused,
        "speedup": unfused / fused,
        "rounds": timed.rounds,
        "passed": passed,
    });
    Ok(InferenceRun {
        lines,
        json,
        passed,
    })
}
