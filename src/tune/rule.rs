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

/// Challengers whose median ratio to the incumbent is within this fraction of the best
/// challenger's go to a runoff ([`runoff`]): on the H100 the split-K variants of one cuDNN
/// engine measured 3-6 % apart in a first call's few rounds, and which of them won changed from
/// run to run (VGG 3x3 512-channel filter gradient: 168 to 184 µs for the chosen config).
pub(crate) const RUNOFF_SPREAD: f64 = 0.06;

/// Most contenders in a runoff (the best challenger's closest).
pub(crate) const RUNOFF_MAX: usize = 3;

/// The contenders of a runoff among `(index, ratios to the incumbent)`: every challenger that
/// beats the incumbent ([`beats_incumbent`]) with a median ratio within [`RUNOFF_SPREAD`] of the
/// best one's, fastest first (the first of equals), at most [`RUNOFF_MAX`]. Fewer than two:
/// empty (no runoff: the best challenger wins as it is).
pub(crate) fn runoff(challengers: impl IntoIterator<Item = (usize, Option<Paired>)>) -> Vec<usize> {
    let mut beating: Vec<(usize, f64)> = challengers
        .into_iter()
        .filter_map(|(i, p)| p.filter(beats_incumbent).map(|p| (i, p.median)))
        .collect();
    beating.sort_by(|a, b| a.1.total_cmp(&b.1));
    let Some(&(_, best)) = beating.first() else {
        return Vec::new();
    };
    let close: Vec<usize> = beating
        .iter()
        .filter(|&&(_, m)| m <= best * (1.0 + RUNOFF_SPREAD))
        .take(RUNOFF_MAX)
        .map(|&(i, _)| i)
        .collect();
    if close.len() < 2 {
        Vec::new()
    } else {
        close
    }
}

/// The winner of a runoff: the contender (index into the runoff) with the lowest median time,
/// the first of equals; contenders without a time (failed while timed) never win. `None` when
/// none has one.
pub(crate) fn runoff_winner(medians: &[Option<f64>]) -> Option<usize> {
    medians
        .iter()
        .enumerate()
        .filter_map(|(v, m)| m.filter(|t| t.is_finite()).map(|t| (v, t)))
        .fold(None, |acc: Option<(usize, f64)>, (v, t)| match acc {
            Some((_, bt)) if bt <= t => acc,
            _ => Some((v, t)),
        })
        .map(|(v, _)| v)
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
    fn close_challengers_go_to_a_runoff() {
        let c = || {
            [
                (1, Some(paired(&[0.70, 0.70, 0.70]))),
                (2, Some(paired(&[0.72, 0.72, 0.72]))),
                (3, Some(paired(&[0.74, 0.74, 0.74]))),
                (4, Some(paired(&[0.73, 0.73, 0.73]))),
                (5, Some(paired(&[0.80, 0.80, 0.80]))), // 14 % behind the best: out
                (6, Some(paired(&[0.71, 0.71, 1.20]))), // does not beat the incumbent: out
                (7, None),
            ]
        };
        // Fastest first, at most RUNOFF_MAX.
        assert_eq!(runoff(c()), vec![1, 2, 4]);
        // One close challenger: no runoff.
        let alone = [(1, Some(paired(&[0.70; 3]))), (2, Some(paired(&[0.90; 3])))];
        assert!(runoff(alone).is_empty());
        assert!(runoff([(1, Some(paired(&[0.99; 3])))]).is_empty());
        // Exactly at the spread counts.
        let edge = [
            (1, Some(paired(&[0.5; 3]))),
            (2, Some(paired(&[0.5 * (1.0 + RUNOFF_SPREAD); 3]))),
        ];
        assert_eq!(runoff(edge), vec![1, 2]);
    }

    #[test]
    fn the_runoff_goes_to_the_lowest_median() {
        assert_eq!(
            runoff_winner(&[Some(0.171), Some(0.168), Some(0.175)]),
            Some(1)
        );
        // Equals: the first (the first race's best).
        assert_eq!(runoff_winner(&[Some(0.17), Some(0.17)]), Some(0));
        // Failed while timed, or no finite time: never.
        assert_eq!(runoff_winner(&[None, Some(f64::NAN), Some(0.2)]), Some(2));
        assert_eq!(runoff_winner(&[None, None]), None);
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
