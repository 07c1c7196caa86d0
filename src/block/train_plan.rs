//! The pure decision behind [`super::ConvBnTrain`]: which compositions of `conv → BatchNorm`
//! can train a problem and why the other cannot, from facts its constructor gathered (the
//! BatchNorm's own-path plan, ConvStats' plan). No GPU calls.

use std::fmt;
use std::str::FromStr;

use super::fold_backward::{FOLD_MAX_CIN, FOLD_MAX_K};
use super::stats_plan::{stats_plan, StatsPlan};
use crate::batchnorm::{self, BnPath, Fuse, OwnVariantChoice, Phase, PlanRequest};
use crate::config::{BnImpl, Config};
use crate::conv::ConvShape;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;

/// How one training step of `conv → BatchNorm(+ReLU | +Add+ReLU)` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrainRoute {
    /// [`super::ConvStats`] (the convolution and its output's per-channel sums, in one cuDNN
    /// graph or followed by nnfuse's reduction), then
    /// [`BatchNorm::forward_train_from_sums`](crate::batchnorm::BatchNorm::forward_train_from_sums)
    /// on nnfuse's own BatchNorm kernels (no statistics pass over the convolution's output);
    /// the backward is the own path's.
    Fused,
    /// `Conv2d` forward, then `BatchNorm::forward_train` as its plan decides (cuDNN's fused
    /// BN+ReLU / BN+Add+ReLU, the graph API, or the own kernels). Always eligible.
    Unfused,
}

impl TrainRoute {
    /// Every route, the fused one first.
    pub const ALL: [TrainRoute; 2] = [TrainRoute::Fused, TrainRoute::Unfused];

    /// `fused` / `unfused`.
    pub const fn name(self) -> &'static str {
        match self {
            TrainRoute::Fused => "fused",
            TrainRoute::Unfused => "unfused",
        }
    }

    const fn index(self) -> usize {
        match self {
            TrainRoute::Fused => 0,
            TrainRoute::Unfused => 1,
        }
    }
}

impl fmt::Display for TrainRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TrainRoute {
    type Err = Error;
    fn from_str(s: &str) -> Result<TrainRoute> {
        TrainRoute::ALL
            .into_iter()
            .find(|r| r.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| Error::invalid("route", format!("{s:?} is not fused or unfused")))
    }
}

/// Every route's eligibility for one training unit, and the plans of its parts.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainPlan {
    /// The convolution.
    pub shape: ConvShape,
    /// The element type.
    pub dtype: DType,
    /// The BatchNorm's activation.
    pub fuse: Fuse,
    /// One entry per route ([`TrainRoute::ALL`]'s order): the route, whether it may run the
    /// problem, and why (not).
    pub routes: Vec<(TrainRoute, bool, String)>,
    /// The fused route's convolution with statistics (its own routes and reasons).
    pub stats: Option<StatsPlan>,
    /// The unfused route's BatchNorm: its path and reasons, as its plan prints them.
    pub bn: Vec<String>,
}

impl TrainPlan {
    /// Whether `r` may run this problem.
    pub fn eligible(&self, r: TrainRoute) -> bool {
        self.routes[r.index()].1
    }

    /// Why `r` may (not) run this problem.
    pub fn reason(&self, r: TrainRoute) -> &str {
        &self.routes[r.index()].2
    }

    /// Refuses `r` for `why` (its parts could not be built at run time).
    pub(crate) fn refuse(&mut self, r: TrainRoute, why: String) {
        self.routes[r.index()] = (r, false, why);
    }
}

impl fmt::Display for TrainPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.shape;
        writeln!(
            f,
            "conv+BN training unit {} {}: n={} c_in={} {}x{} -> c_out={} kernel {}x{} stride {:?} \
             pad {:?}, BatchNorm {}",
            self.dtype,
            s.format,
            s.n,
            s.c_in,
            s.h,
            s.w,
            s.c_out,
            s.kh,
            s.kw,
            s.stride,
            s.pad,
            self.fuse.name()
        )?;
        for (r, ok, why) in &self.routes {
            let mark = if *ok { "eligible" } else { "refused" };
            writeln!(f, "  {:<8} {mark}: {why}", r.name())?;
        }
        Ok(())
    }
}

/// What a unit is planned from (plain values, as `nnfuse plan` takes them).
#[derive(Debug, Clone, Copy)]
pub struct TrainPlanRequest<'a> {
    /// The convolution.
    pub shape: &'a ConvShape,
    /// The element type.
    pub dtype: DType,
    /// The BatchNorm's activation.
    pub fuse: Fuse,
    /// The configuration (the unfused BatchNorm's policy; the fused route's BatchNorm is
    /// planned with it and `BnImpl::Own`).
    pub config: &'a Config,
    /// The loaded cuDNN's version; `None` without cuDNN.
    pub cudnn: Option<usize>,
}

/// The BatchNorm's shape and channel axis for the convolution's output (pure).
pub(crate) fn bn_shape(s: &ConvShape) -> Result<(Vec<usize>, usize)> {
    let (oh, ow) = s.out_hw()?;
    Ok(match s.format {
        TensorFormat::Nhwc => (vec![s.n, oh, ow, s.c_out], 3),
        TensorFormat::Nchw => (vec![s.n, s.c_out, oh, ow], 1),
    })
}

/// Plans a training unit without a GPU: ConvStats' plan, the BatchNorm's plan under the
/// configuration (the unfused route) and under `BnImpl::Own` (the fused route needs the own
/// path), and so every route's eligibility and reason. Errors: a shape neither the
/// convolution nor the BatchNorm can plan, naming the field.
pub fn plan_train(req: &TrainPlanRequest<'_>) -> Result<TrainPlan> {
    let (dims, axis) = bn_shape(req.shape)?;
    let bn = |config: &Config| {
        batchnorm::plan(&PlanRequest {
            shape: &dims,
            axis,
            dtype: req.dtype,
            fuse: req.fuse,
            phase: Phase::Training,
            config,
            cudnn_version: req.cudnn.unwrap_or(0),
            cudnn_available: req.cudnn.is_some(),
            own_variant: OwnVariantChoice::Auto,
        })
    };
    let unfused = bn(req.config)?;
    let own = bn(&req.config.clone().with_bn_impl(BnImpl::Own))?;
    let stats = stats_plan(req.shape, req.dtype, req.cudnn, req.config.deterministic);
    let parts = match (&stats, own.path) {
        (Err(e), _) => FusedParts::Refused(format!("ConvStats: {e}")),
        (Ok(_), BnPath::Own) => FusedParts::Ready,
        (Ok(_), path) => FusedParts::Refused(format!(
            "a BatchNorm planned with BnImpl::Own takes the {path} path here: {}",
            own.reasons.join("; ")
        )),
    };
    Ok(train_plan(
        req.shape,
        req.dtype,
        req.fuse,
        parts,
        stats.ok(),
        unfused.reasons,
    ))
}

/// What the constructor learned about the fused route's parts.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum FusedParts {
    /// ConvStats planned and a BatchNorm planned with `BnImpl::Own` takes the own path.
    Ready,
    /// Why not (a plan refused, or the own BatchNorm took another path).
    Refused(String),
}

/// Plans a unit from its parts' facts (pure).
pub(crate) fn train_plan(
    shape: &ConvShape,
    dtype: DType,
    fuse: Fuse,
    fused: FusedParts,
    stats: Option<StatsPlan>,
    bn: Vec<String>,
) -> TrainPlan {
    let fused_entry = match fused {
        FusedParts::Ready => (
            TrainRoute::Fused,
            true,
            "conv with per-channel sums (ConvStats), then BatchNorm from the sums on nnfuse's \
             own kernels: no statistics pass over the convolution's output; measured against \
             the unfused route (forward and BatchNorm backward) at the first call"
                .to_string(),
        ),
        FusedParts::Refused(why) => (TrainRoute::Fused, false, why),
    };
    TrainPlan {
        shape: *shape,
        dtype,
        fuse,
        routes: vec![
            fused_entry,
            (
                TrainRoute::Unfused,
                true,
                "Conv2d, then BatchNorm as its plan decides (the incumbent)".to_string(),
            ),
        ],
        stats,
        bn,
    }
}

/// How the first backward of a unit the fold can run decided, or a forced route.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FoldChoice {
    /// Later backwards fold.
    pub folded: bool,
    /// GPU time (median, µs) of the whole backward per route timed: composed, folded.
    pub times_us: Vec<(&'static str, f64)>,
    /// The check, the timing, or why the fold was not measured.
    pub notes: Vec<String>,
}

impl FoldChoice {
    /// One sentence: the route and both times, or why.
    pub fn describe(&self) -> String {
        let route = if self.folded { "folded" } else { "composed" };
        let times: Vec<String> = self
            .times_us
            .iter()
            .map(|(r, t)| format!("{r} {t:.1} us"))
            .collect();
        let mut s = format!("backward {route}");
        if !times.is_empty() {
            s.push_str(&format!(
                " ({}: the whole backward, GPU time, median)",
                times.join(", ")
            ));
        }
        if !self.notes.is_empty() {
            s.push_str(&format!("; {}", self.notes.join("; ")));
        }
        s
    }
}

/// Why the folded backward (`fold_backward.rs`) cannot run a unit, or `None` when it can: a
/// 1x1 convolution of stride 1 without padding (z is then a matrix product of x, on which the
/// fold rests), NHWC, BN + add + ReLU (whose masked gradient the sums pass writes anyway), and
/// the fused route eligible (its BatchNorm is the own path's, whose sums pass the fold uses).
pub(crate) fn fold_refusal(plan: &TrainPlan) -> Option<String> {
    let s = &plan.shape;
    if !plan.eligible(TrainRoute::Fused) {
        return Some("it needs the fused route's own BatchNorm, refused here".into());
    }
    if plan.fuse != Fuse::AddRelu {
        return Some(format!(
            "made for BN + add + ReLU (this unit's activation is {:?})",
            plan.fuse
        ));
    }
    if (s.kh, s.kw, s.stride, s.pad) != (1, 1, (1, 1), (0, 0)) {
        return Some(format!(
            "made for 1x1 convolutions of stride 1 without padding (this one is {}x{}, stride \
             {:?}, padding {:?})",
            s.kh, s.kw, s.stride, s.pad
        ));
    }
    if s.format != TensorFormat::Nhwc {
        return Some("made for NHWC (channels-last) data".into());
    }
    if s.c_in > FOLD_MAX_CIN || s.c_out > FOLD_MAX_K {
        return Some(format!(
            "its kernels take at most {FOLD_MAX_CIN} input and {FOLD_MAX_K} output channels \
             ({} and {} here)",
            s.c_in, s.c_out
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::TensorFormat;

    #[test]
    fn routes_parse_print_and_refuse_unknown_names() {
        for r in TrainRoute::ALL {
            assert_eq!(r.name().parse::<TrainRoute>().unwrap(), r);
            assert_eq!(r.to_string(), r.name());
        }
        assert_eq!(" Fused ".parse::<TrainRoute>().unwrap(), TrainRoute::Fused);
        let e = "graph".parse::<TrainRoute>().unwrap_err().to_string();
        assert!(e.contains("route") && e.contains("graph"), "{e}");
    }

    #[test]
    fn the_demo_units_plan_without_a_gpu() {
        let config = Config::default();
        for (c_in, c_out, k, fuse) in [
            (256, 64, 1, Fuse::Relu),
            (64, 64, 3, Fuse::Relu),
            (64, 256, 1, Fuse::AddRelu),
        ] {
            let s = ConvShape::square(32, c_in, 56, c_out, k, TensorFormat::Nhwc);
            for cudnn in [Some(91900), None] {
                let p = plan_train(&TrainPlanRequest {
                    shape: &s,
                    dtype: DType::F16,
                    fuse,
                    config: &config,
                    cudnn,
                })
                .unwrap();
                assert!(p.eligible(TrainRoute::Fused), "{p}");
                assert!(p.eligible(TrainRoute::Unfused));
                assert!(!p.bn.is_empty());
                let stats = p.stats.as_ref().expect("ConvStats plans");
                assert_eq!(stats.shape, s);
            }
        }
        // BatchNorm's shape follows the layout; a shape the convolution cannot take is an
        // error naming it.
        let nchw = ConvShape::square(2, 8, 6, 4, 3, TensorFormat::Nchw);
        assert_eq!(bn_shape(&nchw).unwrap(), (vec![2, 4, 6, 6], 1));
        let mut bad = nchw;
        bad.stride = (0, 1);
        let req = TrainPlanRequest {
            shape: &bad,
            dtype: DType::F32,
            fuse: Fuse::Relu,
            config: &config,
            cudnn: None,
        };
        assert!(plan_train(&req).unwrap_err().argument().is_some());
    }

    #[test]
    fn a_fold_choice_reads_as_its_route_times_and_notes() {
        let c = FoldChoice {
            folded: true,
            times_us: vec![("composed", 181.5), ("folded", 144.5)],
            notes: vec!["folded: beats composed".into()],
        };
        let t = c.describe();
        assert!(
            t.starts_with("backward folded (composed 181.5 us, folded 144.5 us"),
            "{t}"
        );
        assert!(t.ends_with("; folded: beats composed"), "{t}");
        let n = FoldChoice {
            folded: false,
            times_us: Vec::new(),
            notes: vec!["folded: not taken: it failed".into()],
        };
        assert_eq!(
            n.describe(),
            "backward composed; folded: not taken: it failed"
        );
    }

    #[test]
    fn the_fold_takes_pointwise_nhwc_add_relu_units_only() {
        let config = Config::default();
        let plan = |s: &ConvShape, fuse: Fuse| {
            plan_train(&TrainPlanRequest {
                shape: s,
                dtype: DType::F16,
                fuse,
                config: &config,
                cudnn: Some(91900),
            })
            .unwrap()
        };
        let last = ConvShape::square(32, 64, 56, 256, 1, TensorFormat::Nhwc);
        assert_eq!(fold_refusal(&plan(&last, Fuse::AddRelu)), None);
        let why = fold_refusal(&plan(&last, Fuse::Relu)).unwrap();
        assert!(why.contains("add + ReLU"), "{why}");
        let three = ConvShape::square(32, 64, 56, 64, 3, TensorFormat::Nhwc);
        let why = fold_refusal(&plan(&three, Fuse::AddRelu)).unwrap();
        assert!(why.contains("3x3"), "{why}");
        let mut strided = last;
        strided.stride = (2, 2);
        let why = fold_refusal(&plan(&strided, Fuse::AddRelu)).unwrap();
        assert!(why.contains("stride"), "{why}");
        let nchw = ConvShape::square(32, 64, 56, 256, 1, TensorFormat::Nchw);
        assert!(fold_refusal(&plan(&nchw, Fuse::AddRelu)).is_some());
        let wide = ConvShape::square(2, 512, 7, 2048, 1, TensorFormat::Nhwc);
        let why = fold_refusal(&plan(&wide, Fuse::AddRelu)).unwrap();
        assert!(why.contains("at most 256 input"), "{why}");
    }

    #[test]
    fn a_refused_fused_route_keeps_its_reason_and_unfused_stays_eligible() {
        let s = ConvShape::square(2, 8, 8, 8, 3, TensorFormat::Nhwc);
        let p = train_plan(
            &s,
            DType::F16,
            Fuse::Relu,
            FusedParts::Refused("BatchNorm on the own path: no".into()),
            None,
            vec!["path cudnn_fused".into()],
        );
        assert!(!p.eligible(TrainRoute::Fused));
        assert_eq!(p.reason(TrainRoute::Fused), "BatchNorm on the own path: no");
        assert!(p.eligible(TrainRoute::Unfused));
        let text = p.to_string();
        assert!(
            text.contains("fused    refused: BatchNorm on the own path"),
            "{text}"
        );
        assert!(text.contains("unfused  eligible"), "{text}");
        let ok = train_plan(
            &s,
            DType::F16,
            Fuse::Relu,
            FusedParts::Ready,
            None,
            Vec::new(),
        );
        assert!(ok.eligible(TrainRoute::Fused) && ok.eligible(TrainRoute::Unfused));
        assert!(ok.reason(TrainRoute::Fused).contains("ConvStats"));
    }
}
