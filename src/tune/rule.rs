//! The pure decisions of a measurement, shared by GEMM's search and convolution's `auto`: the
//! verdict of a check (relative L2 error from sums made on the device) and the incumbent rule.

use crate::timing::Paired;

/// A candidate must beat the incumbent (GEMM: the cuBLAS default; convolution: the first route
/// that passed its check) by this fraction (median of the per-round time ratios), and in nearly
/// every round, to replace it: see [`beats_incumbent`].
pub const KEEP_INCUMBENT_MARGIN: f64 = 0.02;

/// The incumbent rule: whether a candidate whose per-round time ratios to the incumbent are
/// `vs_incumbent` (below 1: faster) may replace it. It must be faster by at least the margin in
/// the median round (`median <= 1 - KEEP_INCUMBENT_MARGIN`) and faster in nearly every round
/// (`p90 < 1`: with the nearest-rank percentile that is every round up to 6 rounds, all but one
/// up to 16). Noise (a few percent between samples on an H100) then never trades the incumbent
/// for an equal kernel, and a kernel that is only faster while the clocks are high does not win.
pub fn beats_incumbent(vs_incumbent: &Paired) -> bool {
    vs_incumbent.rounds > 0
        && vs_incumbent.median <= 1.0 - KEEP_INCUMBENT_MARGIN
        && vs_incumbent.p90 < 1.0
}

/// Among `(index, ratios to the incumbent)`, the one that beats the incumbent with the lowest
/// median ratio (the first of equals), with that median; `None` keeps the incumbent.
pub(crate) fn best_challenger(
    challengers: impl IntoIterator<Item = (usize, Option<Paired>)>,
) -> Option<(usize, f64)> {
    let mut best: Option<(usize, f64)> = None;
    for (i, p) in challengers {
        if let Some(p) = p {
            if beats_incumbent(&p) && best.is_none_or(|(_, m)| p.median < m) {
                best = Some((i, p.median));
            }
        }
    }
    best
}

/// `(relative L2 difference, non-finite mismatches)` from the device sums of a check:
/// `[sum of squared differences, sum of squares of the reference, non-finite count, ..]`.
/// Missing sums read as NaN (a failed check).
pub(crate) fn judge(sums: &[f64]) -> (f64, f64) {
    match sums {
        [num, den, bad, ..] => ((num / den.max(1e-300)).sqrt(), *bad),
        _ => (f64::NAN, f64::NAN),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paired(ratios: &[f64]) -> Paired {
        let base = vec![1.0; ratios.len()];
        Paired::of(&base, ratios).unwrap()
    }

    #[test]
    fn the_incumbent_is_kept_unless_clearly_beaten() {
        // 3 % faster in every round: replaces the incumbent.
        assert!(beats_incumbent(&paired(&[0.97, 0.96, 0.97])));
        // 1 % faster: within the margin.
        assert!(!beats_incumbent(&paired(&[0.99, 0.99, 0.99])));
        // Faster in the median round, slower in one of three: not consistent enough.
        assert!(!beats_incumbent(&paired(&[0.9, 0.95, 1.01])));
        // Eleven rounds: one slower round is tolerated (p90 is the second largest).
        let mut r = vec![0.95; 10];
        r.push(1.05);
        assert!(beats_incumbent(&paired(&r)));
        r[0] = 1.02;
        assert!(!beats_incumbent(&paired(&r)));
        // Exactly at the margin counts.
        assert!(beats_incumbent(&paired(&[0.98, 0.98, 0.98])));
        // No rounds: never.
        let none = Paired {
            median: 0.5,
            p10: 0.5,
            p90: 0.5,
            faster_rounds: 0,
            rounds: 0,
        };
        assert!(!beats_incumbent(&none));
    }

    #[test]
    fn the_lowest_median_that_beats_the_incumbent_wins() {
        let c = [
            (1, Some(paired(&[0.97, 0.97, 0.97]))),
            (2, None),
            (3, Some(paired(&[0.5, 0.5, 1.2]))),
            (4, Some(paired(&[0.9, 0.9, 0.9]))),
            (5, Some(paired(&[0.9, 0.9, 0.9]))),
        ];
        assert_eq!(best_challenger(c).map(|b| b.0), Some(4));
        assert_eq!(best_challenger([(1, Some(paired(&[0.99; 3])))]), None);
    }

    #[test]
    fn judge_sums() {
        let (rel, bad) = judge(&[4.0, 100.0, 0.0]);
        assert!((rel - 0.2).abs() < 1e-12);
        assert_eq!(bad, 0.0);
        assert!(judge(&[1.0]).0.is_nan());
        assert_eq!(judge(&[0.0, 0.0, 0.0]).0, 0.0);
    }
}
