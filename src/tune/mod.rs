//! One tuner for every operation: what GEMM's algorithm search and convolution's first-call
//! measurement share.
//!
//! - [`file`]: the tuning-cache file (JSON, one section per device and library versions): its
//!   format and version, the process-wide lock around every read-merge-write, the merge of one
//!   device's section, and the atomic write. GEMM owns the top-level `"sections"`, convolution the
//!   `"conv"` member; each writer keeps the other's part.
//! - [`store`]: the process-wide choice stores (bounded least-recently-used maps and the set of
//!   files already read per device).
//! - [`rule`]: the pure decision of a measurement: the relative L2 verdict of a check, and the
//!   incumbent rule (the incumbent is kept unless a candidate is faster by at least
//!   [`rule::KEEP_INCUMBENT_MARGIN`] in the median round and in nearly every round).
//! - [`budget`]: the first call's decision budget (`NNFUSE_CONV_TUNE_BUDGET_MS`): a deadline on
//!   the host clock and the pure rules that spend it (checks, timing rounds).
//! - [`race`]: the timing of the candidates that passed their check, interleaved round by round
//!   ([`crate::timing::time_interleaved`]), and the winner by the incumbent rule.
//!
//! Each operation keeps its keys, its candidate lists and its entries' (de)serialisers:
//! `gemm::search`, `gemm::entry`, `conv::choice`.

pub(crate) mod budget;
pub(crate) mod file;
pub(crate) mod race;
pub(crate) mod rule;
pub(crate) mod store;

/// What nnfuse's own tests, benches and CLI reach of the tuner (not a stable API).
#[doc(hidden)]
pub mod internals {
    pub use super::file::{FILE_FORMAT, FILE_VERSION};
    pub use super::rule::{beats_incumbent, KEEP_INCUMBENT_MARGIN};
}
