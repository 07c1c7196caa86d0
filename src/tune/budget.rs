//! The first call's decision budget: how long (host wall time) one direction of a new
//! convolution problem may spend deciding — finalizing cuDNN engine configs, checking the
//! candidates, timing the survivors — and the pure rules that spend it ([`keep_checking`],
//! [`timing_deadline`]). Candidates are taken in the plan's measuring order (the incumbent
//! first), so what the budget cuts is the tail of that order.
//!
//! NVRTC cannot be interrupted, and a kernel file takes it 0.2 to 3.5 s, so under a budget a
//! candidate whose kernels are not compiled yet is not run at all ([`not_now`]): it is skipped
//! and compiled in the background for later decisions.
//!
//! Pure apart from reading the clock in [`Budget`]; the rules take plain numbers and are tested
//! on the CPU.

use std::time::{Duration, Instant};

use crate::kernels::KernelState;

/// Share of the budget the checks may use before the remaining candidates are skipped; the
/// rest is left for timing the survivors.
pub(crate) const CHECK_SHARE: f64 = 0.6;

/// Milliseconds a candidate listing is charged at most ([`Budget::past_library_start`]).
pub(crate) const LISTING_MS: u64 = 20;

/// Candidates always checked, whatever the budget: the incumbent and one challenger.
pub(crate) const MIN_CHECKED: usize = 2;

/// A check that takes longer than this (ms) is run once more: what its first run took beyond
/// the second is a one-time cost (the first launch of an engine's kernels loads their module:
/// 25 ms for one f32 engine config on the H100, against 0.4 ms for its run), which
/// [`one_time_ms`] does not charge to the budget.
pub(crate) const ONE_TIME_CHECK_MS: f64 = 5.0;

/// Later measurements one decision may make (each under its own budget): the first, once the
/// left-out candidates' kernels are ready, and more while a measurement's budget still cut
/// some (a first module load or run-time compile inside it can spend the whole budget).
pub(crate) const MAX_SETTLES: u8 = 3;

/// Share of the budget that one decision's one-time costs may add to it ([`one_time_ms`]).
pub(crate) const ONE_TIME_SHARE: f64 = 0.5;

/// Of a check that took `check_ms` and whose rerun took `rerun_ms`, what is not charged to the
/// budget: the difference, so that `credited_ms` (already not charged) stays within
/// [`ONE_TIME_SHARE`] of `total_ms` (a first call's wall time grows by at most half). Pure.
pub(crate) fn one_time_ms(check_ms: f64, rerun_ms: f64, credited_ms: f64, total_ms: f64) -> f64 {
    (check_ms - rerun_ms)
        .max(0.0)
        .min((ONE_TIME_SHARE * total_ms - credited_ms).max(0.0))
}

/// A decision's budget: its start and, unless exhaustive, its length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    start: Instant,
    total: Option<Duration>,
}

impl Budget {
    /// A budget of `ms` milliseconds from now; `0` is exhaustive (no limit).
    pub(crate) fn new(ms: usize) -> Budget {
        Budget {
            start: Instant::now(),
            total: (ms > 0).then(|| Duration::from_millis(ms as u64)),
        }
    }

    /// No limit: every candidate is measured.
    pub(crate) fn exhaustive(&self) -> bool {
        self.total.is_none()
    }

    /// The budget in milliseconds (`None`: exhaustive).
    pub(crate) fn total_ms(&self) -> Option<f64> {
        self.total.map(|d| d.as_secs_f64() * 1e3)
    }

    /// Milliseconds spent since the decision began.
    pub(crate) fn spent_ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1e3
    }

    /// This budget with the part of `listing` (the time its candidates took to list: cuDNN's
    /// heuristics, finalizations, workspace queries) beyond [`LISTING_MS`] not charged. A
    /// process's first cuDNN graph listing or legacy algorithm query of a data type loads
    /// cuDNN's engines (91 ms for the first f32 legacy query, 146 ms for the first graph
    /// listing, measured on the H100 with cuDNN 9.19), which left the measurement of that
    /// problem no time for its candidates; a listing takes 2–4 ms otherwise.
    pub(crate) fn past_library_start(self, listing: Duration) -> Budget {
        let start_up = listing.saturating_sub(Duration::from_millis(LISTING_MS));
        Budget {
            start: self.start + start_up,
            total: self.total,
        }
    }

    /// This budget with `ms` milliseconds of one-time costs ([`one_time_ms`]) not charged.
    pub(crate) fn past_one_time(self, ms: f64) -> Budget {
        Budget {
            start: self.start + Duration::from_secs_f64(ms.max(0.0) / 1e3),
            total: self.total,
        }
    }

    /// When the whole budget is spent (`None`: never).
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.total.map(|d| self.start + d)
    }
}

/// Whether the next candidate is checked, `checked` candidates having been checked (run once
/// and compared) with `spent_ms` of a budget of `total_ms` (`None`: exhaustive) gone: always
/// the first [`MIN_CHECKED`], then while the checks have used less than [`CHECK_SHARE`] of it.
pub(crate) fn keep_checking(checked: usize, spent_ms: f64, total_ms: Option<f64>) -> bool {
    match total_ms {
        None => true,
        Some(total) => checked < MIN_CHECKED || spent_ms < CHECK_SHARE * total,
    }
}

/// The deadline of the timing rounds: the budget's end (the timing keeps its minimum rounds
/// past it). Exhaustive budgets have none.
pub(crate) fn timing_deadline(b: &Budget) -> Option<Instant> {
    b.deadline()
}

/// The note of a measurement that skipped `skipped` (labels) for the budget.
pub(crate) fn skipped_note(skipped: &[String], total_ms: f64) -> String {
    format!(
        "decision budget of {total_ms:.0} ms (NNFUSE_CONV_TUNE_BUDGET_MS) spent before {} \
         candidate(s) could be checked, not measured: {}",
        skipped.len(),
        skipped.join(", ")
    )
}

/// The outcome and note of a candidate skipped because its kernels are not compiled yet.
pub(crate) const NOT_COMPILED: &str = "kernels not compiled yet (compiling in the background)";

/// Which of a first call's candidates (in measuring order, each with the state of its least
/// ready kernel file: `Ready` for one that needs none) are not run now ([`NOT_COMPILED`]).
/// Exhaustive budgets run everything (compiling in the foreground). Under a budget a candidate
/// whose kernels are not `Ready` is skipped; if that leaves none, the first candidate runs (its
/// compile is the price of running at all).
pub(crate) fn not_now(states: &[KernelState], exhaustive: bool) -> Vec<bool> {
    let mut out: Vec<bool> = states
        .iter()
        .map(|s| !exhaustive && *s != KernelState::Ready)
        .collect();
    if out.iter().all(|&skip| skip) {
        if let Some(first) = out.first_mut() {
            *first = false;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checks_one_time_cost_is_not_charged() {
        // 25.5 ms against a rerun of 0.4: 25.1 ms credited.
        assert!((one_time_ms(25.5, 0.4, 0.0, 70.0) - 25.1).abs() < 1e-9);
        // Never negative, never past half the budget in all.
        assert_eq!(one_time_ms(3.0, 4.0, 0.0, 70.0), 0.0);
        assert!((one_time_ms(50.0, 1.0, 20.0, 70.0) - 15.0).abs() < 1e-9);
        assert_eq!(one_time_ms(50.0, 1.0, 35.0, 70.0), 0.0);
        // The budget's start moves by the credit.
        let b = Budget::new(70);
        let later = b.past_one_time(25.0);
        let moved = later.deadline().unwrap() - b.deadline().unwrap();
        assert_eq!(moved, Duration::from_millis(25));
        assert_eq!(later.total_ms(), Some(70.0));
        // Nothing spent while the start lies ahead.
        assert_eq!(later.spent_ms(), 0.0);
    }

    #[test]
    fn checks_stop_at_their_share_but_never_before_two() {
        assert!(keep_checking(0, 1e9, Some(70.0)));
        assert!(keep_checking(1, 1e9, Some(70.0)));
        assert!(!keep_checking(2, 42.0, Some(70.0)));
        assert!(keep_checking(2, 41.9, Some(70.0)));
        assert!(keep_checking(50, 1e9, None));
    }

    #[test]
    fn a_listing_is_charged_its_first_20_ms_only() {
        let b = Budget::new(70);
        let d0 = b.deadline().unwrap();
        // A normal listing: charged in full.
        assert_eq!(
            b.past_library_start(Duration::from_millis(3)).deadline(),
            Some(d0)
        );
        // cuDNN's engines loading (91 ms): all but 20 ms moved out of the budget.
        let later = b
            .past_library_start(Duration::from_millis(91))
            .deadline()
            .unwrap();
        assert_eq!(later - d0, Duration::from_millis(71));
        assert!(Budget::new(0)
            .past_library_start(Duration::from_secs(1))
            .exhaustive());
    }

    #[test]
    fn zero_is_exhaustive() {
        let b = Budget::new(0);
        assert!(b.exhaustive());
        assert!(b.deadline().is_none());
        assert_eq!(b.total_ms(), None);
        let b = Budget::new(70);
        assert!(!b.exhaustive());
        assert_eq!(b.total_ms(), Some(70.0));
        assert!(timing_deadline(&b).is_some());
        let spent = Budget {
            start: Instant::now() - Duration::from_millis(100),
            total: Some(Duration::from_millis(1)),
        };
        assert!(spent.deadline().is_some_and(|d| d <= Instant::now()));
        assert!(spent.spent_ms() >= 100.0);
    }

    #[test]
    fn the_note_names_what_was_skipped() {
        let n = skipped_note(&["im2col_gemm".into(), "direct".into()], 70.0);
        assert!(
            n.contains("70 ms") && n.contains("im2col_gemm, direct"),
            "{n}"
        );
    }
    #[test]
    fn candidates_without_compiled_kernels_wait_under_a_budget() {
        use KernelState::*;
        let states = [Ready, Missing, Compiling, Ready, Failed("x".into())];
        assert_eq!(
            not_now(&states, false),
            vec![false, true, true, false, true]
        );
        // Exhaustive: everything runs (compiled in the foreground).
        assert_eq!(not_now(&states, true), vec![false; 5]);
        // Nothing ready: the first runs anyway.
        assert_eq!(not_now(&[Missing, Compiling], false), vec![false, true]);
        // The first ready one need not be the incumbent.
        assert_eq!(
            not_now(&[Compiling, Ready, Ready], false),
            vec![true, false, false]
        );
        assert!(not_now(&[], false).is_empty());
        assert_eq!(not_now(&[Missing], false), vec![false]);
    }
}
