//! Pure engine bookkeeping: what cuDNN says about an engine (numerical and behaviour notes,
//! knobs), the policy that decides which engines nnfuse may run, and de-duplication of the
//! heuristics' lists. No cuDNN calls; tested on the CPU.
//!
//! Notes are read from cuDNN as raw integers and kept as bit sets, so a note value this build
//! does not know is data (shown as `note<N>`), never undefined behaviour.

use std::fmt;

use crate::conv::problem::{Direction, GraphEngine};
use crate::dtype::DType;

/// `cudnnBackendNumericalNote_t`: how an engine computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NumericalNote {
    /// Runs on tensor cores (for f32 data: TF32, not true single precision).
    TensorCore = 0,
    /// Converts inputs to a narrower type.
    DownConvertInputs = 1,
    /// Accumulates in a narrower type than the compute type.
    ReducedPrecisionReduction = 2,
    /// FFT-based.
    Fft = 3,
    /// Results may differ between runs (atomics).
    Nondeterministic = 4,
    /// Winograd-based.
    Winograd = 5,
    /// Winograd with 4x4 tiles.
    WinogradTile4x4 = 6,
    /// Winograd with 6x6 tiles.
    WinogradTile6x6 = 7,
    /// Winograd with 13x13 tiles.
    WinogradTile13x13 = 8,
    /// Propagates NaN strictly.
    StrictNanProp = 9,
}

impl NumericalNote {
    /// Every note this build knows.
    pub const ALL: [NumericalNote; 10] = [
        NumericalNote::TensorCore,
        NumericalNote::DownConvertInputs,
        NumericalNote::ReducedPrecisionReduction,
        NumericalNote::Fft,
        NumericalNote::Nondeterministic,
        NumericalNote::Winograd,
        NumericalNote::WinogradTile4x4,
        NumericalNote::WinogradTile6x6,
        NumericalNote::WinogradTile13x13,
        NumericalNote::StrictNanProp,
    ];

    /// Short name (`tensor_core`, `nondeterministic`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            NumericalNote::TensorCore => "tensor_core",
            NumericalNote::DownConvertInputs => "down_convert_inputs",
            NumericalNote::ReducedPrecisionReduction => "reduced_precision_reduction",
            NumericalNote::Fft => "fft",
            NumericalNote::Nondeterministic => "nondeterministic",
            NumericalNote::Winograd => "winograd",
            NumericalNote::WinogradTile4x4 => "winograd_4x4",
            NumericalNote::WinogradTile6x6 => "winograd_6x6",
            NumericalNote::WinogradTile13x13 => "winograd_13x13",
            NumericalNote::StrictNanProp => "strict_nan_prop",
        }
    }
}

/// `cudnnBackendBehaviorNote_t`: how an engine behaves on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BehaviorNote {
    /// Compiles a kernel when its plan is finalized (can take a second or more).
    RuntimeCompilation = 0,
    /// Needs the filter reordered to INT8x32 (nnfuse never reorders).
    RequiresFilterInt8x32Reorder = 1,
    /// Needs the bias reordered to INT8x32.
    RequiresBiasInt8x32Reorder = 2,
    /// Supports cuDNN's native CUDA-graph API.
    SupportsCudaGraphNativeApi = 3,
    /// Depends on cuBLASLt.
    CublasLtDependency = 4,
}

impl BehaviorNote {
    /// Every note this build knows.
    pub const ALL: [BehaviorNote; 5] = [
        BehaviorNote::RuntimeCompilation,
        BehaviorNote::RequiresFilterInt8x32Reorder,
        BehaviorNote::RequiresBiasInt8x32Reorder,
        BehaviorNote::SupportsCudaGraphNativeApi,
        BehaviorNote::CublasLtDependency,
    ];

    /// Short name.
    pub const fn name(self) -> &'static str {
        match self {
            BehaviorNote::RuntimeCompilation => "runtime_compilation",
            BehaviorNote::RequiresFilterInt8x32Reorder => "filter_int8x32_reorder",
            BehaviorNote::RequiresBiasInt8x32Reorder => "bias_int8x32_reorder",
            BehaviorNote::SupportsCudaGraphNativeApi => "cuda_graph_native",
            BehaviorNote::CublasLtDependency => "cublaslt_dependency",
        }
    }
}

/// A set of raw note values (bit `v` = note value `v`; values past 63 are kept as bit 63).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct NoteSet(pub u64);

impl NoteSet {
    /// The set of raw values `raw`.
    pub fn from_raw(raw: &[u32]) -> NoteSet {
        NoteSet(raw.iter().fold(0, |s, &v| s | 1u64 << v.min(63)))
    }

    /// Whether raw value `v` is in the set.
    pub const fn has_raw(self, v: u32) -> bool {
        v < 64 && self.0 & (1u64 << v) != 0
    }

    /// Whether numerical note `n` is in the set.
    pub const fn has(self, n: NumericalNote) -> bool {
        self.has_raw(n as u32)
    }

    /// Whether behaviour note `n` is in the set.
    pub const fn has_behavior(self, n: BehaviorNote) -> bool {
        self.has_raw(n as u32)
    }

    /// Names of the set's values, using `name` for known ones and `note<N>` otherwise.
    fn names(self, name: impl Fn(u32) -> Option<&'static str>) -> Vec<String> {
        (0..64)
            .filter(|&v| self.has_raw(v))
            .map(|v| name(v).map_or_else(|| format!("note{v}"), str::to_string))
            .collect()
    }

    /// Names as numerical notes.
    pub fn numerical_names(self) -> Vec<String> {
        self.names(|v| NumericalNote::ALL.get(v as usize).map(|n| n.name()))
    }

    /// Names as behaviour notes.
    pub fn behavior_names(self) -> Vec<String> {
        self.names(|v| BehaviorNote::ALL.get(v as usize).map(|n| n.name()))
    }
}

/// Which heuristics mode listed an engine config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeurSource {
    /// `CUDNN_HEUR_MODE_INSTANT`.
    Instant,
    /// `CUDNN_HEUR_MODE_FALLBACK`.
    Fallback,
    /// Not listed by a heuristics mode: rebuilt from its engine index and knobs (a forced
    /// route's or the tuning file's [`GraphEngine`]).
    Given,
}

impl HeurSource {
    /// `instant`, `fallback`.
    pub const fn name(self) -> &'static str {
        match self {
            HeurSource::Instant => "instant",
            HeurSource::Fallback => "fallback",
            HeurSource::Given => "given",
        }
    }
}

/// What cuDNN says about one engine config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineInfo {
    /// `CUDNN_ATTR_ENGINE_GLOBAL_INDEX`.
    pub global_index: i64,
    /// The config's knob choices `(cudnnBackendKnobType_t value, value)`, sorted by type.
    pub knobs: Vec<(u32, i64)>,
    /// `CUDNN_ATTR_ENGINE_NUMERICAL_NOTE`.
    pub numerical: NoteSet,
    /// `CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE`.
    pub behavior: NoteSet,
    /// The heuristics mode that listed it.
    pub source: HeurSource,
    /// Position in that mode's list (0 = cuDNN's first choice).
    pub rank: usize,
}

impl EngineInfo {
    /// `eng12{k2=1,k5=0}`: the engine and its knobs, which identify the config.
    pub fn label(&self) -> String {
        let knobs: Vec<String> = self
            .knobs
            .iter()
            .map(|(t, v)| format!("k{t}={v}"))
            .collect();
        format!("eng{}{{{}}}", self.global_index, knobs.join(","))
    }

    /// The config as a plain value (`None` when it has more knobs than a [`GraphEngine`]
    /// holds).
    pub fn engine(&self) -> Option<GraphEngine> {
        GraphEngine::new(self.global_index, &self.knobs)
    }

    /// Whether two infos name the same engine config.
    pub fn same_config(&self, other: &EngineInfo) -> bool {
        self.global_index == other.global_index && self.knobs == other.knobs
    }
}

impl fmt::Display for EngineInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({} #{}; numerical [{}]; behaviour [{}])",
            self.label(),
            self.source.name(),
            self.rank,
            self.numerical.numerical_names().join(","),
            self.behavior.behavior_names().join(",")
        )
    }
}

/// Which engines nnfuse may run. The default is strict: f32 in true single precision, f32
/// accumulation for halves, any determinism, no run-time compilation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct GraphPolicy {
    /// f32 data may run on tensor cores (TF32) and with down-converted inputs.
    pub allow_tf32: bool,
    /// Only engines without the `NONDETERMINISTIC` note.
    pub deterministic: bool,
    /// Engines that compile at plan finalization (can take seconds) are allowed.
    pub allow_runtime_compilation: bool,
    /// Engines that accumulate in a narrower type than f32 are allowed.
    pub allow_reduced_precision_reduction: bool,
}

/// Why the policy refused an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rejection {
    /// Tensor cores or down-converted inputs on f32 data (TF32), not allowed.
    Tf32,
    /// f32 data through a non-fused Winograd (tile notes): not true f32 (docs/CUDNN-FACTS.md).
    WinogradF32,
    /// An f32 filter gradient through Winograd (any Winograd note): cuDNN's only filter-gradient
    /// Winograd is the non-fused one, which measured 4.1e-4 to 7.3e-4 from f64 in f32
    /// (docs/CUDNN-FACTS.md), so a Winograd note without a tile note is no fused Winograd here.
    WinogradFilterGradientF32,
    /// Accumulates below f32.
    ReducedPrecisionReduction,
    /// Nondeterministic where determinism was asked for.
    Nondeterministic,
    /// Compiles at run time, not allowed.
    RuntimeCompilation,
    /// Needs an INT8x32 reordering of its operands.
    NeedsReorder,
}

impl Rejection {
    /// The reason in words.
    pub const fn reason(self) -> &'static str {
        match self {
            Rejection::Tf32 => "tensor cores / down-converted inputs on f32 data (TF32)",
            Rejection::WinogradF32 => "non-fused Winograd on f32 data (not true f32)",
            Rejection::WinogradFilterGradientF32 => {
                "Winograd filter gradient on f32 data (cuDNN's is the non-fused one: not true f32)"
            }
            Rejection::ReducedPrecisionReduction => "accumulates below f32",
            Rejection::Nondeterministic => "nondeterministic",
            Rejection::RuntimeCompilation => "compiles at run time",
            Rejection::NeedsReorder => "needs INT8x32 reordering",
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}

/// Whether `policy` lets an engine with these notes run `dtype` data.
pub fn admit(e: &EngineInfo, dtype: DType, policy: &GraphPolicy) -> Result<(), Rejection> {
    use NumericalNote as N;
    let n = e.numerical;
    if e.behavior
        .has_behavior(BehaviorNote::RequiresFilterInt8x32Reorder)
        || e.behavior
            .has_behavior(BehaviorNote::RequiresBiasInt8x32Reorder)
    {
        return Err(Rejection::NeedsReorder);
    }
    if dtype == DType::F32 && !policy.allow_tf32 {
        if n.has(N::TensorCore) || n.has(N::DownConvertInputs) {
            return Err(Rejection::Tf32);
        }
        if n.has(N::WinogradTile4x4) || n.has(N::WinogradTile6x6) || n.has(N::WinogradTile13x13) {
            return Err(Rejection::WinogradF32);
        }
    }
    if n.has(N::ReducedPrecisionReduction) && !policy.allow_reduced_precision_reduction {
        return Err(Rejection::ReducedPrecisionReduction);
    }
    if n.has(N::Nondeterministic) && policy.deterministic {
        return Err(Rejection::Nondeterministic);
    }
    if e.behavior.has_behavior(BehaviorNote::RuntimeCompilation)
        && !policy.allow_runtime_compilation
    {
        return Err(Rejection::RuntimeCompilation);
    }
    Ok(())
}

/// [`admit`] for a convolution of direction `d`: also refuses an f32 filter gradient with any
/// Winograd note (unless TF32 is allowed, which lifts every f32 refusal). Notes cannot prove true
/// f32 (an engine without any of these notes measured 6.6e-4 from f64: docs/CUDNN-GRAPH.md), so
/// an admitted f32 engine config is still checked against a true-f32 reference before use
/// (`conv::choice`); this refuses the class a note does identify before it is finalized.
pub fn admit_conv(
    e: &EngineInfo,
    dtype: DType,
    d: Direction,
    policy: &GraphPolicy,
) -> Result<(), Rejection> {
    admit(e, dtype, policy)?;
    if dtype == DType::F32
        && !policy.allow_tf32
        && d == Direction::BackwardFilter
        && e.numerical.has(NumericalNote::Winograd)
    {
        return Err(Rejection::WinogradFilterGradientF32);
    }
    Ok(())
}

/// How many engine configs one listing finalizes into plans (finalizing costs host time, up to
/// seconds for an engine that compiles at run time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphLimits {
    /// Most plans in all.
    pub total: usize,
    /// Most plans of configs the INSTANT heuristics listed (cuDNN's own ranking).
    pub instant: usize,
    /// Most plans of configs only the FALLBACK list added.
    pub fallback: usize,
    /// Pass over cuDNN's reference engines (numerical note `STRICT_NAN_PROP`).
    pub skip_reference: bool,
}

impl GraphLimits {
    /// A first call's: the first 10 configs of the heuristics' list and then the fallback
    /// list's, as PyTorch's `cudnn.benchmark` times (its `benchmark_limit` is 10), but not
    /// cuDNN's reference engines. Measured on the H100 (cuDNN 9.19): the fastest config was
    /// 6th to 10th in the heuristics' ranking on 4 of 8 problems timed, and on f32 forward
    /// convolutions it came from the fallback list (`eng70` with other tiles: 1.37 against
    /// 2.19 ms on a VGG 3x3 256-channel layer). The reference engine (`eng0`, the only one with
    /// `STRICT_NAN_PROP`) ran 10x to 100x the fastest in every listing, up to 118 ms per run: a
    /// first call cannot afford one run of it.
    pub const FIRST_CALL: GraphLimits = GraphLimits {
        total: 10,
        instant: 10,
        fallback: 10,
        skip_reference: true,
    };

    /// A budgeted decision's later look (docs/CONV.md, "The first call"): up to 32 from both
    /// lists, those of the first call included (the heuristics list up to 44 on the H100, and
    /// PyTorch's `cudnn.benchmark` times every one); still never the reference engine.
    pub const LATER_CALL: GraphLimits = GraphLimits {
        total: 32,
        instant: 32,
        fallback: 32,
        skip_reference: true,
    };

    /// At most `n`, from either list, reference engines included.
    pub const fn at_most(n: usize) -> GraphLimits {
        GraphLimits {
            total: n,
            instant: n,
            fallback: n,
            skip_reference: false,
        }
    }
}

/// Why the next listed config `e` is not finalized, `built` = (INSTANT, FALLBACK) plans made so
/// far, `out_of_time` when the decision budget is spent; `None`: finalize it. The budget never
/// leaves a listing without a plan. Pure.
pub fn pass_over(
    e: &EngineInfo,
    built: (usize, usize),
    limits: GraphLimits,
    out_of_time: bool,
) -> Option<String> {
    let total = built.0 + built.1;
    if total >= limits.total {
        return Some(format!("beyond the first {} admitted", limits.total));
    }
    if out_of_time && total > 0 {
        return Some("decision budget spent (NNFUSE_CONV_TUNE_BUDGET_MS)".into());
    }
    if limits.skip_reference && e.numerical.has(NumericalNote::StrictNanProp) {
        return Some(
            "cuDNN's reference engine (strict NaN propagation) is not measured at a first call"
                .into(),
        );
    }
    match e.source {
        HeurSource::Fallback if built.1 >= limits.fallback => Some(format!(
            "beyond the fallback list's first {} admitted",
            limits.fallback
        )),
        HeurSource::Instant | HeurSource::Given if built.0 >= limits.instant => Some(format!(
            "beyond the heuristics' first {} admitted",
            limits.instant
        )),
        _ => None,
    }
}

/// Drops every config that an earlier entry already names (same engine and knobs), keeping
/// the first occurrence and the order.
pub fn dedup<T>(list: Vec<T>, info: impl Fn(&T) -> &EngineInfo) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(list.len());
    for item in list {
        if !out.iter().any(|o| info(o).same_config(info(&item))) {
            out.push(item);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(index: i64, numerical: &[NumericalNote], behavior: &[BehaviorNote]) -> EngineInfo {
        EngineInfo {
            global_index: index,
            knobs: vec![(2, 1)],
            numerical: NoteSet::from_raw(&numerical.iter().map(|&n| n as u32).collect::<Vec<_>>()),
            behavior: NoteSet::from_raw(&behavior.iter().map(|&n| n as u32).collect::<Vec<_>>()),
            source: HeurSource::Instant,
            rank: 0,
        }
    }

    #[test]
    fn note_values_match_cudnn() {
        use cudarc::cudnn::sys::{
            cudnnBackendBehaviorNote_t as B, cudnnBackendNumericalNote_t as N,
        };
        assert_eq!(
            NumericalNote::TensorCore as u32,
            N::CUDNN_NUMERICAL_NOTE_TENSOR_CORE as u32
        );
        assert_eq!(
            NumericalNote::Nondeterministic as u32,
            N::CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC as u32
        );
        assert_eq!(
            NumericalNote::StrictNanProp as u32,
            N::CUDNN_NUMERICAL_NOTE_STRICT_NAN_PROP as u32
        );
        assert_eq!(
            NumericalNote::ALL.len(),
            N::CUDNN_NUMERICAL_NOTE_TYPE_COUNT as usize
        );
        assert_eq!(
            BehaviorNote::RuntimeCompilation as u32,
            B::CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION as u32
        );
        assert_eq!(
            BehaviorNote::ALL.len(),
            B::CUDNN_BEHAVIOR_NOTE_TYPE_COUNT as usize
        );
        for (i, n) in NumericalNote::ALL.iter().enumerate() {
            assert_eq!(*n as usize, i);
        }
        for (i, n) in BehaviorNote::ALL.iter().enumerate() {
            assert_eq!(*n as usize, i);
        }
    }

    #[test]
    fn note_sets_keep_unknown_values() {
        let s = NoteSet::from_raw(&[0, 4, 40]);
        assert!(s.has(NumericalNote::TensorCore));
        assert!(s.has(NumericalNote::Nondeterministic));
        assert!(!s.has(NumericalNote::Fft));
        assert_eq!(
            s.numerical_names(),
            vec!["tensor_core", "nondeterministic", "note40"]
        );
        assert!(NoteSet::from_raw(&[1000]).has_raw(63));
        assert!(!NoteSet::default().has_raw(70));
    }

    #[test]
    fn f32_refuses_tf32_and_nonfused_winograd_unless_allowed() {
        let strict = GraphPolicy::default();
        let tc = engine(1, &[NumericalNote::TensorCore], &[]);
        assert_eq!(admit(&tc, DType::F32, &strict), Err(Rejection::Tf32));
        assert_eq!(admit(&tc, DType::F16, &strict), Ok(()));
        assert_eq!(admit(&tc, DType::BF16, &strict), Ok(()));
        let dc = engine(1, &[NumericalNote::DownConvertInputs], &[]);
        assert_eq!(admit(&dc, DType::F32, &strict), Err(Rejection::Tf32));
        let loose = GraphPolicy {
            allow_tf32: true,
            ..strict
        };
        assert_eq!(admit(&tc, DType::F32, &loose), Ok(()));
        let wino = engine(
            2,
            &[NumericalNote::Winograd, NumericalNote::WinogradTile4x4],
            &[],
        );
        assert_eq!(
            admit(&wino, DType::F32, &strict),
            Err(Rejection::WinogradF32)
        );
        assert_eq!(admit(&wino, DType::F16, &strict), Ok(()));
        let fused = engine(3, &[NumericalNote::Winograd], &[]);
        assert_eq!(admit(&fused, DType::F32, &strict), Ok(()));
        assert_eq!(admit(&engine(4, &[], &[]), DType::F32, &strict), Ok(()));
    }

    #[test]
    fn an_f32_filter_gradient_refuses_any_winograd_note() {
        let strict = GraphPolicy::default();
        let plain_winograd = engine(5, &[NumericalNote::Winograd], &[]);
        let wgrad = Direction::BackwardFilter;
        assert_eq!(
            admit_conv(&plain_winograd, DType::F32, wgrad, &strict),
            Err(Rejection::WinogradFilterGradientF32)
        );
        // The forward and the data gradient have a fused Winograd: left to the accuracy check.
        for d in [Direction::Forward, Direction::BackwardData] {
            assert_eq!(admit_conv(&plain_winograd, DType::F32, d, &strict), Ok(()));
        }
        assert_eq!(
            admit_conv(&plain_winograd, DType::F16, wgrad, &strict),
            Ok(())
        );
        let loose = GraphPolicy {
            allow_tf32: true,
            ..strict
        };
        assert_eq!(
            admit_conv(&plain_winograd, DType::F32, wgrad, &loose),
            Ok(())
        );
        // admit's own refusals come first; no note at all is admitted (the check decides).
        let tc = engine(1, &[NumericalNote::TensorCore], &[]);
        assert_eq!(
            admit_conv(&tc, DType::F32, wgrad, &strict),
            Err(Rejection::Tf32)
        );
        for n in [
            &[][..],
            &[NumericalNote::StrictNanProp],
            &[NumericalNote::Fft],
        ] {
            assert_eq!(
                admit_conv(&engine(0, n, &[]), DType::F32, wgrad, &strict),
                Ok(())
            );
        }
    }

    #[test]
    fn determinism_precision_and_compilation_follow_the_policy() {
        let strict = GraphPolicy::default();
        let nd = engine(1, &[NumericalNote::Nondeterministic], &[]);
        assert_eq!(admit(&nd, DType::F16, &strict), Ok(()));
        let det = GraphPolicy {
            deterministic: true,
            ..strict
        };
        assert_eq!(
            admit(&nd, DType::F16, &det),
            Err(Rejection::Nondeterministic)
        );
        let rpr = engine(1, &[NumericalNote::ReducedPrecisionReduction], &[]);
        assert_eq!(
            admit(&rpr, DType::F16, &strict),
            Err(Rejection::ReducedPrecisionReduction)
        );
        let rt = engine(1, &[], &[BehaviorNote::RuntimeCompilation]);
        assert_eq!(
            admit(&rt, DType::F16, &strict),
            Err(Rejection::RuntimeCompilation)
        );
        let rt_ok = GraphPolicy {
            allow_runtime_compilation: true,
            ..strict
        };
        assert_eq!(admit(&rt, DType::F16, &rt_ok), Ok(()));
        let reorder = engine(1, &[], &[BehaviorNote::RequiresFilterInt8x32Reorder]);
        assert_eq!(
            admit(&reorder, DType::F16, &rt_ok),
            Err(Rejection::NeedsReorder)
        );
    }

    #[test]
    fn dedup_keeps_first_occurrence_and_order() {
        let a = engine(1, &[], &[]);
        let mut b = engine(2, &[], &[]);
        let mut a_fallback = a.clone();
        a_fallback.source = HeurSource::Fallback;
        let mut a_other_knob = a.clone();
        a_other_knob.knobs = vec![(2, 0)];
        b.rank = 1;
        let out = dedup(
            vec![a.clone(), b.clone(), a_fallback, a_other_knob.clone()],
            |e| e,
        );
        assert_eq!(out, vec![a, b, a_other_knob]);
    }

    #[test]
    fn a_later_look_admits_more_than_the_first_call_but_no_reference_engine() {
        let (first, later) = (GraphLimits::FIRST_CALL, GraphLimits::LATER_CALL);
        assert!(later.total > first.total && later.skip_reference);
        let i = engine(62, &[], &[]);
        assert_eq!(pass_over(&i, (first.total, 0), later, false), None);
        assert!(pass_over(&i, (later.total, 0), later, false).is_some());
    }

    #[test]
    fn a_first_call_finalizes_ten_from_both_lists_but_no_reference_engine() {
        let l = GraphLimits::FIRST_CALL;
        let i = engine(62, &[], &[]);
        let mut f = engine(70, &[], &[]);
        f.source = HeurSource::Fallback;
        let mut reference = engine(0, &[NumericalNote::StrictNanProp], &[]);
        reference.source = HeurSource::Fallback;
        assert_eq!(pass_over(&i, (0, 0), l, false), None);
        assert_eq!(pass_over(&i, (9, 0), l, false), None);
        assert!(pass_over(&i, (10, 0), l, false).is_some());
        // The fallback list's configs follow the heuristics' up to the total.
        assert_eq!(pass_over(&f, (4, 0), l, false), None);
        assert_eq!(pass_over(&f, (4, 5), l, false), None);
        assert!(pass_over(&f, (4, 6), l, false).is_some());
        // cuDNN's reference engine never, at a first call; an exhaustive decision measures it.
        let why = pass_over(&reference, (1, 0), l, false).unwrap();
        assert!(why.contains("reference"), "{why}");
        assert_eq!(
            pass_over(&reference, (1, 0), GraphLimits::at_most(16), false),
            None
        );
        // The budget stops finalizing, but never before the first plan.
        assert_eq!(pass_over(&i, (0, 0), l, true), None);
        let spent = pass_over(&i, (1, 0), l, true).unwrap();
        assert!(spent.contains("budget"), "{spent}");
        // Without a split, the total alone limits.
        let all = GraphLimits::at_most(8);
        assert_eq!(pass_over(&f, (7, 0), all, false), None);
        assert!(pass_over(&i, (5, 3), all, false).is_some());
    }

    #[test]
    fn labels_name_engine_knobs_and_notes() {
        let mut e = engine(
            12,
            &[NumericalNote::TensorCore],
            &[BehaviorNote::RuntimeCompilation],
        );
        e.knobs = vec![(2, 1), (5, 0)];
        assert_eq!(e.label(), "eng12{k2=1,k5=0}");
        let s = e.to_string();
        assert!(
            s.contains("tensor_core") && s.contains("runtime_compilation"),
            "{s}"
        );
    }
}
