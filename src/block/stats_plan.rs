//! The pure decision behind [`super::ConvStats`]: which routes can run a problem and why the
//! others cannot, and the tolerances of the first call's check. No GPU calls: cuDNN's presence
//! and version come in as plain values.

use std::fmt;
use std::str::FromStr;

use super::pointwise;
use crate::conv::ConvShape;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;

/// The cuDNN version from which the graph route is offered (the backend API of cuDNN 9; the
/// pattern was probed with 9.19).
pub(crate) const MIN_CUDNN_GRAPH: usize = 90000;

/// How `y = conv(x, w)` and its per-channel `sum`, `sqsum` run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatsRoute {
    /// One cuDNN graph: `conv_fprop → y → GEN_STATS(SUM_SQSUM) → sum, sqsum` (the statistics
    /// in the convolution's epilogue). NHWC only.
    GraphGenstats,
    /// nnfuse's `Conv2d` forward, then nnfuse's own per-channel reduction of y (f64
    /// accumulation). Always eligible.
    Unfused,
    /// nnfuse's own tensor-core kernel for a 1x1 stride-1 unpadded convolution (NHWC, f16 or
    /// bf16, c_out 32, 64, 128 or 256), the sums of its rounded output in its epilogue.
    OwnPointwise,
}

impl StatsRoute {
    /// Every route, the fused ones first.
    pub const ALL: [StatsRoute; 3] = [
        StatsRoute::GraphGenstats,
        StatsRoute::Unfused,
        StatsRoute::OwnPointwise,
    ];

    /// `graph_genstats` / `unfused` / `own_pointwise`.
    pub const fn name(self) -> &'static str {
        match self {
            StatsRoute::GraphGenstats => "graph_genstats",
            StatsRoute::Unfused => "unfused",
            StatsRoute::OwnPointwise => "own_pointwise",
        }
    }

    const fn index(self) -> usize {
        match self {
            StatsRoute::GraphGenstats => 0,
            StatsRoute::Unfused => 1,
            StatsRoute::OwnPointwise => 2,
        }
    }
}

impl fmt::Display for StatsRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for StatsRoute {
    type Err = Error;
    fn from_str(s: &str) -> Result<StatsRoute> {
        StatsRoute::ALL
            .into_iter()
            .find(|r| r.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| {
                Error::invalid(
                    "route",
                    format!("{s:?} is not graph_genstats, unfused or own_pointwise"),
                )
            })
    }
}

/// Every route's eligibility for one ConvStats problem: `(route, eligible, reason)` in
/// [`StatsRoute::ALL`]'s order.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsPlan {
    /// The convolution.
    pub shape: ConvShape,
    /// The element type.
    pub dtype: DType,
    /// One entry per route: the route, whether it may run the problem, and why (not).
    pub routes: Vec<(StatsRoute, bool, String)>,
}

impl StatsPlan {
    /// Whether `r` may run this problem.
    pub fn eligible(&self, r: StatsRoute) -> bool {
        self.routes[r.index()].1
    }

    /// Why `r` may (not) run this problem.
    pub fn reason(&self, r: StatsRoute) -> &str {
        &self.routes[r.index()].2
    }

    /// Refuses the routes that cannot write the sums' low words (the fused training unit's f32
    /// statistics, held to 1e-6 of f64: E[x²] − E[x]² from f32 sums loses about E[x²]/var of
    /// f32's precision where the mean is large against the spread). Pure.
    pub(crate) fn with_low_words(mut self) -> StatsPlan {
        for r in [StatsRoute::GraphGenstats, StatsRoute::OwnPointwise] {
            let i = r.index();
            if self.routes[i].1 {
                self.routes[i] = (
                    r,
                    false,
                    "the sums must carry low words (f32 statistics within 1e-6 of f64 where the \
                     mean is large against the spread); only the unfused route's f64 reduction \
                     writes them"
                        .into(),
                );
            }
        }
        self
    }

    /// Refuses the own route on a GPU of compute capability `cc` that cannot run it (the plan
    /// is made without a GPU; the constructor knows the device).
    pub(crate) fn for_device(mut self, cc: (i32, i32)) -> StatsPlan {
        let own = StatsRoute::OwnPointwise.index();
        if self.routes[own].1 {
            if let Some(why) = pointwise::refusal(&self.shape, self.dtype, Some(cc)) {
                self.routes[own] = (StatsRoute::OwnPointwise, false, why);
            }
        }
        self
    }
}

impl fmt::Display for StatsPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.shape;
        writeln!(
            f,
            "conv+stats {} {}: n={} c_in={} {}x{} -> c_out={} kernel {}x{} stride {:?} pad {:?} dilation {:?}",
            self.dtype, s.format, s.n, s.c_in, s.h, s.w, s.c_out, s.kh, s.kw, s.stride, s.pad,
            s.dilation
        )?;
        for (r, ok, why) in &self.routes {
            let mark = if *ok { "eligible" } else { "refused" };
            writeln!(f, "  {:<15} {mark}: {why}", r.name())?;
        }
        Ok(())
    }
}

/// Whether a fused training unit's sums carry low words ([`StatsPlan::with_low_words`]): for
/// f32, whose statistics are held within 1e-6 of f64 (the 16-bit types' tolerance is 1e-2).
pub(crate) fn unit_low_words(dtype: DType) -> bool {
    dtype == DType::F32
}

/// f32s in each of a fused training unit's two sum buffers (c_out, doubled by low words).
pub(crate) fn unit_sums_len(dtype: DType, c_out: usize) -> usize {
    if unit_low_words(dtype) {
        2 * c_out
    } else {
        c_out
    }
}

/// Why the graph route cannot run `shape`, or `None` when it may (pure). `cudnn`: the loaded
/// cuDNN's version, `None` without cuDNN; `deterministic`: results must repeat bit for bit.
fn graph_refusal(shape: &ConvShape, cudnn: Option<usize>, deterministic: bool) -> Option<String> {
    if deterministic {
        // No engine note says so, but the sums are not reduced in a fixed order: on the H100
        // (cuDNN 9.19) two eager steps of `nnfuse demo` with this route agreed bit for bit in
        // 9 of 31 outputs, against 31 of 31 without it.
        return Some(
            "NNFUSE_DETERMINISTIC: cuDNN's GEN_STATS sums do not repeat bit for bit (measured); \
             the unfused route's reduction has a fixed order"
                .into(),
        );
    }
    if shape.format != TensorFormat::Nhwc {
        return Some(
            "NCHW: the conv+GEN_STATS graph is built and was probed for NHWC data only".into(),
        );
    }
    match cudnn {
        None => Some("cuDNN (libcudnn) was not found".into()),
        Some(v) if v < MIN_CUDNN_GRAPH => Some(format!(
            "cuDNN {v} is older than 9.0 (the backend graph with GEN_STATS)"
        )),
        Some(_) => None,
    }
}

/// Plans `shape` in `dtype` given the loaded cuDNN's version (`None`: not found): every
/// route's eligibility and reason. Pure. Errors: an invalid shape, naming the field.
#[doc(hidden)] // reached through `internals`
pub fn stats_plan(
    shape: &ConvShape,
    dtype: DType,
    cudnn: Option<usize>,
    deterministic: bool,
) -> Result<StatsPlan> {
    shape.y_len()?;
    shape.w_len()?;
    let graph = match graph_refusal(shape, cudnn, deterministic) {
        Some(why) => (StatsRoute::GraphGenstats, false, why),
        None => (
            StatsRoute::GraphGenstats,
            true,
            "one cuDNN graph conv_fprop -> y -> GEN_STATS(SUM_SQSUM): the statistics in the \
             convolution's epilogue (the first call finalizes the heuristics' first configs, \
             checks them against unfused and times them)"
                .into(),
        ),
    };
    let unfused = (
        StatsRoute::Unfused,
        true,
        "Conv2d forward, then nnfuse's per-channel sum / sum of squares of y (always available)"
            .into(),
    );
    let own = match pointwise::refusal(shape, dtype, None) {
        Some(why) => (StatsRoute::OwnPointwise, false, why),
        None => (
            StatsRoute::OwnPointwise,
            true,
            "nnfuse's tensor-core 1x1 convolution with the sums of its rounded output in its \
             epilogue (fixed-order f64 partials; sm_80 or newer; checked against unfused and \
             timed at the first call)"
                .into(),
        ),
    };
    Ok(StatsPlan {
        shape: *shape,
        dtype,
        routes: vec![graph, unfused, own],
    })
}

/// The unit roundoff of `dtype`.
const fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 5.96e-8,
        DType::F16 => 4.88e-4,
        DType::BF16 => 3.91e-3,
    }
}

/// The largest difference of a route's statistics from the reference's the check accepts, for
/// `count` values per channel (pure): `sqsum` as relative L2 over the channels, `sum` as
/// `||Δsum|| / sqrt(count · Σ sqsum)` (the mean's error in units of the channels' RMS, which
/// stays meaningful where a channel's sum cancels). Two routes may round y differently (or sum
/// it before rounding), which moves a sum by about `u·sqrt(3/count)` relative: the bound is
/// 8·u/sqrt(count), at least 1e-5 (f32) / 1e-4 (f16, bf16).
#[doc(hidden)] // reached through `internals`
pub fn stats_tolerance(dtype: DType, count: usize) -> f64 {
    let floor = match dtype {
        DType::F32 => 1e-5,
        DType::F16 | DType::BF16 => 1e-4,
    };
    (8.0 * unit_roundoff(dtype) / (count.max(1) as f64).sqrt()).max(floor)
}

/// The two errors [`stats_tolerance`] bounds: `(sum error, sqsum error)` of `got` against
/// `want` (`(sum, sqsum)` per channel) over `count` values per channel. Non-finite values give
/// infinity.
#[doc(hidden)] // reached through `internals`
pub fn stats_error(want: (&[f64], &[f64]), got: (&[f64], &[f64]), count: usize) -> (f64, f64) {
    let l2 = |v: &mut dyn Iterator<Item = f64>| v.map(|d| d * d).sum::<f64>().sqrt();
    if got.0.iter().chain(got.1).any(|v| !v.is_finite()) || want.0.len() != got.0.len() {
        return (f64::INFINITY, f64::INFINITY);
    }
    let dsum = l2(&mut want.0.iter().zip(got.0).map(|(a, b)| a - b));
    let dsq = l2(&mut want.1.iter().zip(got.1).map(|(a, b)| a - b));
    let sq_norm = l2(&mut want.1.iter().copied());
    let energy: f64 = want.1.iter().sum::<f64>() * count.max(1) as f64;
    let rel = |d: f64, n: f64| {
        if n > 0.0 {
            d / n
        } else if d == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    };
    (rel(dsum, energy.sqrt()), rel(dsq, sq_norm))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(format: TensorFormat) -> ConvShape {
        ConvShape::square(2, 64, 8, 64, 3, format)
    }

    #[test]
    fn low_words_leave_only_the_unfused_route_and_say_why() {
        let pw = ConvShape::square(2, 64, 8, 64, 1, TensorFormat::Nhwc);
        let p = stats_plan(&pw, DType::F16, Some(91900), false).unwrap();
        assert!(p.eligible(StatsRoute::GraphGenstats) && p.eligible(StatsRoute::OwnPointwise));
        let p = p.with_low_words();
        assert!(p.eligible(StatsRoute::Unfused), "{p}");
        for r in [StatsRoute::GraphGenstats, StatsRoute::OwnPointwise] {
            assert!(!p.eligible(r), "{p}");
            assert!(p.reason(r).contains("low words"), "{p}");
        }
        // A route refused for another reason keeps that reason.
        let p = stats_plan(&shape(TensorFormat::Nchw), DType::F32, Some(91900), false)
            .unwrap()
            .with_low_words();
        assert!(p.reason(StatsRoute::GraphGenstats).contains("NCHW"), "{p}");
    }

    #[test]
    fn the_graph_route_needs_nhwc_and_cudnn_9() {
        let p = stats_plan(&shape(TensorFormat::Nhwc), DType::F16, Some(91900), false).unwrap();
        assert!(p.eligible(StatsRoute::GraphGenstats), "{p}");
        assert!(p.eligible(StatsRoute::Unfused));
        let p = stats_plan(&shape(TensorFormat::Nchw), DType::F16, Some(91900), false).unwrap();
        assert!(!p.eligible(StatsRoute::GraphGenstats));
        assert!(p.reason(StatsRoute::GraphGenstats).contains("NCHW"), "{p}");
        let p = stats_plan(&shape(TensorFormat::Nhwc), DType::F32, None, false).unwrap();
        assert!(p.reason(StatsRoute::GraphGenstats).contains("not found"));
        let p = stats_plan(&shape(TensorFormat::Nhwc), DType::BF16, Some(8907), false).unwrap();
        assert!(!p.eligible(StatsRoute::GraphGenstats));
        assert!(p.to_string().contains("refused"), "{p}");
        assert!(!p.eligible(StatsRoute::OwnPointwise), "3x3: {p}");
        let mut bad = shape(TensorFormat::Nhwc);
        bad.stride = (0, 1);
        assert!(stats_plan(&bad, DType::F16, Some(91900), false).is_err());
        let det = stats_plan(&shape(TensorFormat::Nhwc), DType::F16, Some(91900), true).unwrap();
        assert!(det.to_string().contains("NNFUSE_DETERMINISTIC"), "{det}");
    }

    #[test]
    fn the_own_route_takes_1x1_halves_on_sm80_or_newer() {
        let s = ConvShape::square(32, 256, 56, 64, 1, TensorFormat::Nhwc);
        let p = stats_plan(&s, DType::BF16, None, true).unwrap();
        assert!(p.eligible(StatsRoute::OwnPointwise), "{p}");
        assert!(p
            .clone()
            .for_device((9, 0))
            .eligible(StatsRoute::OwnPointwise));
        let old = p.for_device((7, 5));
        assert!(!old.eligible(StatsRoute::OwnPointwise));
        assert!(
            old.reason(StatsRoute::OwnPointwise).contains("7.5"),
            "{old}"
        );
        let p = stats_plan(&s, DType::F32, Some(91900), false).unwrap();
        assert!(p.reason(StatsRoute::OwnPointwise).contains("f32"), "{p}");
    }

    #[test]
    fn routes_parse_and_print() {
        for r in StatsRoute::ALL {
            assert_eq!(r.name().parse::<StatsRoute>().unwrap(), r);
        }
        let e = "gemm".parse::<StatsRoute>().unwrap_err();
        assert_eq!(e.argument(), Some("route"));
    }

    #[test]
    fn tolerances_scale_with_the_count_and_have_floors() {
        assert_eq!(stats_tolerance(DType::F32, 128), 1e-5);
        assert!(stats_tolerance(DType::F16, 128) > 3e-4);
        assert_eq!(stats_tolerance(DType::F16, 1 << 24), 1e-4);
        assert!(stats_tolerance(DType::BF16, 392) > stats_tolerance(DType::F16, 392));
    }

    #[test]
    fn stats_errors_are_relative_and_catch_nan() {
        let (s, q) = (vec![1.0, -1.0], vec![4.0, 4.0]);
        assert_eq!(stats_error((&s, &q), (&s, &q), 4), (0.0, 0.0));
        let s2 = vec![1.0 + 1e-3, -1.0];
        let (es, eq) = stats_error((&s, &q), (&s2, &q), 4);
        // ||Δsum|| = 1e-3 over sqrt(4 · 8).
        assert!((es - 1e-3 / 32f64.sqrt()).abs() < 1e-12 && eq == 0.0);
        let nan = vec![f64::NAN, 4.0];
        assert_eq!(stats_error((&s, &q), (&s, &nan), 4).1, f64::INFINITY);
    }
}
