//! nnfuse's fused forward units: conv `i` and BatchNorm `i` as one `nnfuse::block::ConvStats`
//! call (the convolution and its output's per-channel sum and sum of squares) followed by
//! `BatchNorm::forward_train_from_sums` on nnfuse's own BatchNorm kernels (the statistics
//! finalized from those sums, then normalisation, activation and bitmask in one pass: no
//! statistics pass over the convolution's output). Which units run fused is decided once, on
//! the first step, by timing both compositions on the real buffers (`gpu::decide_unit`); this
//! file holds the units, the decision's record and its pure rule and text.

use nnfuse::batchnorm::{BatchNorm, BnPath};
use nnfuse::block::{ConvStats, StatsChoice};
use nnfuse::{BnImpl, Context, Element};

use super::block::BlockDef;
use super::variants::Variant;

/// Timed runs of each composition when a unit is decided (after one untimed run each).
pub const ROUNDS: usize = 7;

/// One fused unit: the convolution with statistics, and a BatchNorm planned on nnfuse's own
/// kernels (the only path `forward_train_from_sums` runs, and whose backward takes its state).
pub struct FusedUnit<T: Element> {
    /// Convolution `i` with its output's per-channel sums.
    pub stats: ConvStats<T>,
    /// BatchNorm `i` (the block's activation fused), on the own path.
    pub bn: BatchNorm<T>,
}

/// A unit as a Layers holds it: built, or why not.
pub type Unit<T> = std::result::Result<FusedUnit<T>, String>;

/// The Context the units' BatchNorms are planned on: `ctx` (same device and stream) with
/// `BnImpl::Own`.
pub fn own_bn_context(ctx: &Context) -> Context {
    ctx.with_config_override(ctx.config().clone().with_bn_impl(BnImpl::Own))
}

impl<T: Element> FusedUnit<T> {
    /// Unit `i` of `def`: ConvStats on `ctx` (the convolution decides as conv `i` does, same
    /// configuration), the BatchNorm on `own_ctx` (from [`own_bn_context`]). Err: why the unit
    /// cannot be built (its BatchNorm does not take the own path, or a plan refused).
    fn new(ctx: &Context, own_ctx: &Context, def: &BlockDef, i: usize) -> Unit<T> {
        let stats =
            ConvStats::<T>::new(ctx, &def.conv(i)).map_err(|e| format!("ConvStats: {e}"))?;
        let (shape, axis) = def.bn_shape(i);
        let bn = BatchNorm::<T>::new(own_ctx, &shape, axis, BlockDef::bn_fuse(i))
            .map_err(|e| format!("BatchNorm on the own path: {e}"))?;
        let path = bn.training_path();
        if path != BnPath::Own {
            return Err(format!(
                "BatchNorm planned with BnImpl::Own takes the {path} path: {}",
                bn.plan().reasons.join("; ")
            ));
        }
        Ok(FusedUnit { stats, bn })
    }
}

/// The three units of `variant`'s layers: built for nnfuse, refused for the plain
/// compositions (which run no fusion at all).
pub fn build<T: Element>(ctx: &Context, def: &BlockDef, variant: Variant) -> [Unit<T>; 3] {
    if variant != Variant::Nnfuse {
        return [0, 1, 2].map(|_| Err("a plain composition: no fused units".to_string()));
    }
    let own_ctx = own_bn_context(ctx);
    [0, 1, 2].map(|i| FusedUnit::new(ctx, &own_ctx, def, i))
}

/// How unit `i` was decided on the first step.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitChoice {
    /// The fused unit runs (else conv `i` then BatchNorm `i` as before).
    pub fused: bool,
    /// Median GPU time of the fused unit (µs).
    pub fused_us: f64,
    /// Median GPU time of the conv then BatchNorm (µs).
    pub current_us: f64,
    /// ConvStats' own decision (graph or unfused route), when made.
    pub stats: Option<StatsChoice>,
    /// Why the fused unit could not run (its first runs failed): not taken, not timed.
    pub failed: Option<String>,
}

impl UnitChoice {
    /// The decision from both compositions' timings: the fused unit where it is faster
    /// (ties keep the current composition, the incumbent).
    pub fn from_times(fused: &[f64], current: &[f64], stats: Option<StatsChoice>) -> UnitChoice {
        let (f, c) = (median(fused), median(current));
        UnitChoice {
            fused: f < c,
            fused_us: f,
            current_us: c,
            stats,
            failed: None,
        }
    }

    /// The fused unit failed on its first runs (`why`): the current composition runs.
    pub fn failed(why: String) -> UnitChoice {
        UnitChoice {
            fused: false,
            fused_us: f64::NAN,
            current_us: f64::NAN,
            stats: None,
            failed: Some(why),
        }
    }

    /// One sentence for the report's "why": which composition runs and both times.
    pub fn describe(&self, i: usize) -> String {
        let n = i + 1;
        if let Some(why) = &self.failed {
            return format!("fused unit not taken: it failed on its first run ({why})");
        }
        let verdict = if self.fused {
            format!("fused unit taken (conv{n}+stats, then bn{n} from the sums)")
        } else {
            format!("fused unit not taken (conv{n} then bn{n} as decided)")
        };
        let mut s = format!(
            "{verdict}: {:.1} us fused against {:.1} us conv then BN (first step, GPU time, \
             median of {ROUNDS} each)",
            self.fused_us, self.current_us
        );
        if let Some(c) = &self.stats {
            s.push_str(&format!("; ConvStats route {}", c.route));
            if let Some(e) = &c.engine {
                s.push_str(&format!(" ({e})"));
            }
        }
        s
    }
}

/// The median of `v` (NaN when empty; NaNs sort last).
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        0.5 * (s[m - 1] + s[m])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nnfuse::block::StatsRoute;

    #[test]
    fn the_faster_composition_wins_and_ties_keep_the_current_one() {
        let c = UnitChoice::from_times(&[100.0, 101.0, 99.0], &[144.0, 150.0, 140.0], None);
        assert!(c.fused);
        assert_eq!((c.fused_us, c.current_us), (100.0, 144.0));
        assert!(!UnitChoice::from_times(&[73.0], &[52.0], None).fused);
        assert!(!UnitChoice::from_times(&[50.0, 60.0], &[55.0], None).fused);
        assert!(!UnitChoice::from_times(&[], &[55.0], None).fused);
        assert!(c.stats.is_none());
    }

    #[test]
    fn the_text_names_both_times_and_the_route() {
        let c = UnitChoice::from_times(
            &[100.7],
            &[144.2],
            Some(StatsChoice {
                route: StatsRoute::GraphGenstats,
                engine: Some("eng7".into()),
                times_us: Vec::new(),
                notes: Vec::new(),
            }),
        );
        let t = c.describe(2);
        assert!(t.starts_with("fused unit taken (conv3+stats"), "{t}");
        assert!(t.contains("100.7 us fused against 144.2 us"), "{t}");
        assert!(t.contains("ConvStats route graph_genstats (eng7)"), "{t}");
        let n = UnitChoice::from_times(&[73.0], &[52.0], None).describe(0);
        assert!(n.starts_with("fused unit not taken (conv1 then bn1"), "{n}");
        let f = UnitChoice::failed("no engine".into());
        assert!(!f.fused);
        assert!(f
            .describe(1)
            .contains("failed on its first run (no engine)"));
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
