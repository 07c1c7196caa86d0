//! The pure decision behind [`super::ConvBnChain`]: whether a chain of training units
//! `conv → BN → ReLU → conv → … → BN (+ add) → ReLU` can run with each inner BatchNorm's apply
//! and ReLU folded into the next convolution (the "prologue" route), and why not. No GPU calls.

use std::fmt;
use std::str::FromStr;

use super::stats_plan::StatsRoute;
use super::train_plan::{plan_train, TrainPlan, TrainPlanRequest, TrainRoute};
use crate::batchnorm::Fuse;
use crate::config::Config;
use crate::conv::ConvShape;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// How a chain's training step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChainRoute {
    /// The first convolution with its output's per-channel sums; then, for each inner
    /// BatchNorm, a finalize of its statistics into a per-channel scale and bias and one cuDNN
    /// graph `relu(z · scale + bias) → conv → GEN_STATS` for the next convolution (the inner
    /// BatchNorms' outputs are never written); the last BatchNorm from its sums on nnfuse's own
    /// kernels. Backward: one cuDNN graph per inner link for the data gradient with the ReLU's
    /// and the BatchNorm's backward weights, one for the filter gradient with the same input
    /// prologue, and nnfuse's pass that applies the BatchNorm's data gradient.
    Prologue,
    /// Each `conv → BatchNorm` a [`super::ConvBnTrain`] with its own decision, the activations
    /// between them written out. Always eligible.
    Units,
}

impl ChainRoute {
    /// Every route, the fused one first.
    pub const ALL: [ChainRoute; 2] = [ChainRoute::Prologue, ChainRoute::Units];

    /// `prologue` / `units`.
    pub const fn name(self) -> &'static str {
        match self {
            ChainRoute::Prologue => "prologue",
            ChainRoute::Units => "units",
        }
    }

    const fn index(self) -> usize {
        match self {
            ChainRoute::Prologue => 0,
            ChainRoute::Units => 1,
        }
    }
}

impl fmt::Display for ChainRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ChainRoute {
    type Err = Error;
    fn from_str(s: &str) -> Result<ChainRoute> {
        ChainRoute::ALL
            .into_iter()
            .find(|r| r.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| Error::invalid("route", format!("{s:?} is not prologue or units")))
    }
}

/// What a chain is planned from (plain values).
#[derive(Debug, Clone, Copy)]
pub struct ChainPlanRequest<'a> {
    /// The convolutions in order; unit i + 1's input is unit i's BatchNorm + ReLU output.
    pub shapes: &'a [ConvShape],
    /// The element type.
    pub dtype: DType,
    /// The last BatchNorm's activation (the inner ones are followed by ReLU).
    pub last: Fuse,
    /// The configuration (BatchNorm implementation, determinism).
    pub config: &'a Config,
    /// The loaded cuDNN's version; `None` without cuDNN.
    pub cudnn: Option<usize>,
}

/// Every route's eligibility for a chain, and its units' plans.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainPlan {
    /// The element type.
    pub dtype: DType,
    /// The last BatchNorm's activation.
    pub last: Fuse,
    /// One entry per route ([`ChainRoute::ALL`]'s order): the route, whether it may run the
    /// chain, and why (not).
    pub routes: Vec<(ChainRoute, bool, String)>,
    /// The units' plans (the units route's parts).
    pub units: Vec<TrainPlan>,
}

impl ChainPlan {
    /// Whether `r` may run this chain.
    pub fn eligible(&self, r: ChainRoute) -> bool {
        self.routes[r.index()].1
    }

    /// Why `r` may (not) run this chain.
    pub fn reason(&self, r: ChainRoute) -> &str {
        &self.routes[r.index()].2
    }

    /// Refuses `r` for `why` (its parts could not be built at run time).
    pub(crate) fn refuse(&mut self, r: ChainRoute, why: String) {
        self.routes[r.index()] = (r, false, why);
    }

    /// The unit's activation: ReLU inside the chain, [`ChainPlan::last`] at its end.
    pub fn fuse_of(&self, unit: usize) -> Fuse {
        unit_fuse(unit, self.units.len(), self.last)
    }
}

impl fmt::Display for ChainPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "conv+BN training chain {}, {} units, last BatchNorm {}",
            self.dtype,
            self.units.len(),
            self.last.name()
        )?;
        for (r, ok, why) in &self.routes {
            let mark = if *ok { "eligible" } else { "refused" };
            writeln!(f, "  {:<8} {mark}: {why}", r.name())?;
        }
        Ok(())
    }
}

fn unit_fuse(unit: usize, units: usize, last: Fuse) -> Fuse {
    if unit + 1 == units {
        last
    } else {
        Fuse::Relu
    }
}

/// Checks that unit `i + 1` takes unit `i`'s output (pure): same batch, channels and spatial
/// size. Errors name `shapes[i + 1]`.
fn check_links(shapes: &[ConvShape]) -> Result<()> {
    if shapes.len() < 2 {
        return Err(Error::invalid(
            "shapes",
            format!(
                "a chain needs at least two convolutions, {} given (one conv → BatchNorm is \
                 a ConvBnTrain)",
                shapes.len()
            ),
        ));
    }
    for (i, pair) in shapes.windows(2).enumerate() {
        let (a, b) = (&pair[0], &pair[1]);
        let (oh, ow) = a.out_hw()?;
        if b.n != a.n || b.c_in != a.c_out || b.h != oh || b.w != ow || b.format != a.format {
            return Err(Error::invalid(
                "shapes",
                format!(
                    "shapes[{}] takes n={} c={} {}x{} {}, but shapes[{i}] gives n={} c={} \
                     {oh}x{ow} {}",
                    i + 1,
                    b.n,
                    b.c_in,
                    b.h,
                    b.w,
                    b.format,
                    a.n,
                    a.c_out,
                    a.format
                ),
            ));
        }
    }
    Ok(())
}

/// Why the prologue route cannot run, or `None` (pure): the inner links need cuDNN's
/// scale·bias·ReLU + conv + GEN_STATS, dgrad + dReLU + BN backward weights and scale·bias·ReLU +
/// wgrad graphs, which cuDNN 9.19 lists for f16 NHWC only (docs/CUDNN-GRAPH.md, "Fusion
/// patterns"); every unit needs its fused parts (ConvStats, the own BatchNorm).
fn prologue_refusal(dtype: DType, units: &[TrainPlan]) -> Option<String> {
    if dtype != DType::F16 {
        return Some(format!(
            "{dtype}: cuDNN 9.19 lists no engine for the scale-bias-ReLU + wgrad and dgrad + \
             dReLU + BN backward-weights graphs in {dtype} (probed: f16 only)"
        ));
    }
    for (i, u) in units.iter().enumerate() {
        if !u.eligible(TrainRoute::Fused) {
            return Some(format!(
                "unit {i}: its fused parts cannot run: {}",
                u.reason(TrainRoute::Fused)
            ));
        }
        let graph = u.stats.as_ref().map(|s| {
            (
                s.eligible(StatsRoute::GraphGenstats),
                s.reason(StatsRoute::GraphGenstats),
            )
        });
        if i > 0 {
            if let Some((false, why)) = graph {
                return Some(format!("unit {i}: the fused-graph prologue needs {why}"));
            }
        }
    }
    None
}

/// Plans a chain without a GPU: each unit's [`plan_train`], and whether the prologue route
/// may run. Errors: fewer than two units, units that do not connect, or a unit's own planning
/// error, naming the argument.
pub fn plan_chain(req: &ChainPlanRequest<'_>) -> Result<ChainPlan> {
    check_links(req.shapes)?;
    let n = req.shapes.len();
    let units = req
        .shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            plan_train(&TrainPlanRequest {
                shape,
                dtype: req.dtype,
                fuse: unit_fuse(i, n, req.last),
                config: req.config,
                cudnn: req.cudnn,
            })
            .map_err(|e| Error::invalid("shapes", format!("shapes[{i}]: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let prologue = match prologue_refusal(req.dtype, &units) {
        Some(why) => (ChainRoute::Prologue, false, why),
        None => (
            ChainRoute::Prologue,
            true,
            "each inner BatchNorm + ReLU folded into the next convolution (cuDNN graphs with \
             the scale-bias-ReLU prologue, GEN_STATS, dgrad + dReLU + BN backward weights): \
             the inner activations are never written; checked and measured against the units \
             route (forward and backward) at the first call"
                .to_string(),
        ),
    };
    Ok(ChainPlan {
        dtype: req.dtype,
        last: req.last,
        routes: vec![
            prologue,
            (
                ChainRoute::Units,
                true,
                "each conv → BatchNorm a ConvBnTrain with its own decision (the incumbent)"
                    .to_string(),
            ),
        ],
        units,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::TensorFormat;

    fn bottleneck(n: usize, format: TensorFormat) -> Vec<ConvShape> {
        let s = |c_in, c_out, k| ConvShape::square(n, c_in, 56, c_out, k, format);
        vec![s(256, 64, 1), s(64, 64, 3), s(64, 256, 1)]
    }

    fn req<'a>(shapes: &'a [ConvShape], dtype: DType, config: &'a Config) -> ChainPlanRequest<'a> {
        ChainPlanRequest {
            shapes,
            dtype,
            last: Fuse::AddRelu,
            config,
            cudnn: Some(91900),
        }
    }

    #[test]
    fn the_bottleneck_takes_the_prologue_in_f16_nhwc_only() {
        let config = Config::default();
        let nhwc = bottleneck(32, TensorFormat::Nhwc);
        let p = plan_chain(&req(&nhwc, DType::F16, &config)).unwrap();
        assert!(p.eligible(ChainRoute::Prologue), "{p}");
        assert!(p.eligible(ChainRoute::Units));
        assert_eq!(p.units.len(), 3);
        assert_eq!(p.fuse_of(0), Fuse::Relu);
        assert_eq!(p.fuse_of(2), Fuse::AddRelu);
        for dt in [DType::BF16, DType::F32] {
            let p = plan_chain(&req(&nhwc, dt, &config)).unwrap();
            assert!(!p.eligible(ChainRoute::Prologue));
            assert!(p.reason(ChainRoute::Prologue).contains("f16 only"), "{p}");
        }
        let nchw = bottleneck(32, TensorFormat::Nchw);
        let p = plan_chain(&req(&nchw, DType::F16, &config)).unwrap();
        assert!(!p.eligible(ChainRoute::Prologue));
        assert!(p.reason(ChainRoute::Prologue).contains("NCHW"), "{p}");
        let mut r = req(&nhwc, DType::F16, &config);
        r.cudnn = None;
        let p = plan_chain(&r).unwrap();
        assert!(!p.eligible(ChainRoute::Prologue), "{p}");
        let det = Config::default().with_deterministic(true);
        let p = plan_chain(&req(&nhwc, DType::F16, &det)).unwrap();
        assert!(
            p.reason(ChainRoute::Prologue).contains("DETERMINISTIC"),
            "{p}"
        );
    }

    #[test]
    fn units_that_do_not_connect_are_named() {
        let config = Config::default();
        let mut s = bottleneck(2, TensorFormat::Nhwc);
        s[1].c_in = 32;
        let e = plan_chain(&req(&s, DType::F16, &config))
            .unwrap_err()
            .to_string();
        assert!(e.contains("shapes") && e.contains("shapes[1]"), "{e}");
        let e = plan_chain(&req(&s[..1], DType::F16, &config))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least two"), "{e}");
        let mut s = bottleneck(2, TensorFormat::Nhwc);
        s[2].h = 28;
        let e = plan_chain(&req(&s, DType::F16, &config))
            .unwrap_err()
            .to_string();
        assert!(e.contains("shapes[2]"), "{e}");
    }

    #[test]
    fn routes_parse_and_print() {
        for r in ChainRoute::ALL {
            assert_eq!(r.name().parse::<ChainRoute>().unwrap(), r);
        }
        assert!("fused".parse::<ChainRoute>().is_err());
    }
}
