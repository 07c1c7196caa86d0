//! What a GEMM search reports: every candidate and how it fared, where the time went, which
//! operands it ran on, and its progress.

use std::fmt;

use super::caller_data::Unsuitable;
use crate::gemm::algo::{Algo, Choice, LtConfig};
use crate::gemm::problem::{Key, Problem};
use crate::timing::{Paired, Timing};

/// How one candidate fared.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Agreed with the default and was timed; times are per GEMM.
    Timed {
        /// Per-GEMM statistics over the timed rounds.
        timing: Timing,
        /// Relative L2 difference from the cuBLAS default's result (0 for the default).
        rel_diff: f64,
        /// GEMMs launched back to back per sample.
        burst: usize,
        /// Per-round time ratios to the cuBLAS default (1 for the default itself).
        vs_default: Option<Paired>,
    },
    /// Not timed, and why.
    Rejected(String),
}

/// One algorithm the search considered.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The concrete algorithm.
    pub algo: Algo,
    /// Readable attributes (cuBLASLt).
    pub config: Option<LtConfig>,
    /// Workspace bytes (cuBLASLt).
    pub workspace: usize,
    /// Position in cuBLASLt's heuristic list (informational; the choice never stores it).
    pub heuristic_rank: Option<usize>,
    /// Result.
    pub outcome: Outcome,
}

impl Candidate {
    /// Median per-GEMM time in ms, when timed.
    pub fn median_ms(&self) -> Option<f64> {
        match &self.outcome {
            Outcome::Timed { timing, .. } => Some(timing.median_ms),
            Outcome::Rejected(_) => None,
        }
    }

    /// Per-round time ratios to the cuBLAS default, when timed.
    pub fn vs_default(&self) -> Option<Paired> {
        match &self.outcome {
            Outcome::Timed { vs_default, .. } => *vs_default,
            Outcome::Rejected(_) => None,
        }
    }

    /// A short description.
    pub fn label(&self) -> String {
        label(&self.algo, &self.config, self.heuristic_rank)
    }
}

pub(crate) fn label(algo: &Algo, config: &Option<LtConfig>, rank: Option<usize>) -> String {
    let rank = || rank.map_or_else(|| "?".into(), |r| r.to_string());
    match (algo, config) {
        (Algo::Cublas(a), _) => format!("cuBLAS {}", a.name()),
        (Algo::Lt(_), Some(c)) => format!("cuBLASLt #{} {c}", rank()),
        (Algo::Lt(_), None) => format!("cuBLASLt #{} (attributes unreadable)", rank()),
    }
}

/// Where a search's host time went (ms).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SearchPhases {
    /// Everything before the reference run, plus the scratch preparation of a fallback to
    /// scratch operands (which happens after it): `candidates_ms`, `alloc_ms`, fills and copies
    /// queued.
    pub prepare_ms: f64,
    /// Part of `prepare_ms`: heuristic query, descriptors, `cublasLtMatmulAlgoCheck`s.
    pub candidates_ms: f64,
    /// Part of `prepare_ms`: growing the Context's scratch ([`SearchReport::allocated_bytes`];
    /// near 0 when the scratch of an earlier search sufficed).
    pub alloc_ms: f64,
    /// Reference run, one checking run per candidate, comparisons (one synchronisation; one
    /// more on the caller's operands, to look at the default's result first).
    pub check_ms: f64,
    /// Interleaved timing.
    pub timing_ms: f64,
}

/// Which operands a search ran its candidates on.
#[derive(Debug, Clone, PartialEq)]
pub enum SearchOperands {
    /// The caller's A and B (only read) and C: the first [`crate::gemm::strided_batched`] call of a
    /// key, or [`crate::gemm::search_on`].
    Caller,
    /// Pseudo-random operands in the Context's scratch: the search had no caller buffers
    /// ([`crate::gemm::search`], `nnfuse tune`).
    Scratch,
    /// Pseudo-random scratch operands, because the caller's data could not check the candidates
    /// (see [`super::caller_data::caller_data_unsuitable`]).
    Fallback(Unsuitable),
}

impl fmt::Display for SearchOperands {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SearchOperands::Caller => f.write_str("the caller's operands"),
            SearchOperands::Scratch => f.write_str("pseudo-random scratch operands"),
            SearchOperands::Fallback(why) => write!(
                f,
                "pseudo-random scratch operands (the caller's data was not used: {why})"
            ),
        }
    }
}

/// Everything one search did.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchReport {
    /// What was tuned.
    pub key: Key,
    /// The problem as searched (its alpha and beta).
    pub problem: Problem,
    /// Every candidate, the cuBLAS default first.
    pub candidates: Vec<Candidate>,
    /// Index of the winner in `candidates`.
    pub winner: usize,
    /// What was stored for the key.
    pub choice: Choice,
    /// Whether the explicit `cublasGemmAlgo_t` values were searched (GPUs older than sm_80).
    pub explicit_cublas: bool,
    /// Why cuBLASLt contributed no candidates, if it did not.
    pub lt_note: Option<String>,
    /// The tolerance results were compared with.
    pub tolerance: f64,
    /// Timed rounds (every timed candidate has one sample per round).
    pub rounds: usize,
    /// Host wall time of the search itself (ms): everything from the heuristic query to the
    /// decision (scratch allocation included), what the "under 200 ms per shape" target
    /// measures. One-off setup excluded.
    pub wall_ms: f64,
    /// Host wall time (ms) of the one-off setup this search paid before starting: NVRTC compile
    /// and module load of the search kernels, cuBLAS/cuBLASLt handle creation, workspace
    /// allocation, and cuBLASLt's first heuristic query (`setup_first_query_ms`). Near 0 once a
    /// search has run on the Context.
    pub setup_ms: f64,
    /// Part of `setup_ms`: a heuristic query for a tiny problem of the same kind (types,
    /// transposes), the first of the Context's cuBLASLt handle for that kind, made before the
    /// search so that one-off library costs it pays are not counted as the search's (0 when an
    /// earlier search made it).
    pub setup_first_query_ms: f64,
    /// Where `wall_ms` went.
    pub phases: SearchPhases,
    /// Which operands the candidates were checked and timed on.
    pub operands: SearchOperands,
    /// Bytes of the Context's scratch the search used (C only on the caller's operands).
    pub scratch_bytes: usize,
    /// Bytes this search allocated to grow the Context's scratch (0: an earlier search's
    /// sufficed); the time is in [`SearchPhases::alloc_ms`].
    pub allocated_bytes: usize,
}

impl SearchReport {
    /// The cuBLAS default's median (ms).
    pub fn default_ms(&self) -> Option<f64> {
        self.candidates.first().and_then(Candidate::median_ms)
    }

    /// The winner's median (ms).
    pub fn winner_ms(&self) -> Option<f64> {
        self.candidates
            .get(self.winner)
            .and_then(Candidate::median_ms)
    }
}

/// Progress of a running search (for progress bars).
#[derive(Debug, Clone, Copy)]
pub struct SearchProgress<'a> {
    /// Steps finished (one per candidate checked, one for the timing).
    pub done: usize,
    /// Steps in all.
    pub total: usize,
    /// What is being worked on (empty at the end).
    pub label: &'a str,
}
