//! What a search decides ([`Choice`]: a concrete algorithm, never a heuristic rank), the
//! in-memory cache of choices (one per process, keyed by [`Key`]) and the tuning-cache file.
//!
//! The file is JSON, human-readable, one section per device/library combination:
//!
//! ```json
//! {
//!   "format": "nnfuse-gemm-tuning",
//!   "version": 1,
//!   "sections": [
//!     {
//!       "device": { "name": "NVIDIA H100 80GB HBM3", "compute_capability": [9, 0],
//!                   "cublas": [13, 1, 0], "cublaslt": 130100 },
//!       "entries": [
//!         { "problem": { "dtype": "f16", "compute": "f32", "trans_a": false, "trans_b": false,
//!                        "m": 1024, "n": 1024, "k": 1024, "batch": 16,
//!                        "lda": 1024, "ldb": 1024, "ldc": 1024,
//!                        "stride_a": 1048576, "stride_b": 1048576, "stride_c": 1048576,
//!                        "align_a": 256, "align_b": 256, "align_c": 256, "beta_zero": true },
//!           "choice": { "backend": "cublaslt", "algo_hex": "<128 hex digits>",
//!                       "config": { "algo_id": 66, "tile": 23, "tile_name": "128x256", ... },
//!                       "workspace_bytes": 0 },
//!           "median_us": 56.1, "default_us": 57.0, "candidates": 9 }
//!       ]
//!     }
//!   ]
//! }
//! ```
//!
//! A cuBLAS choice is `{ "backend": "cublas", "algo": -1, "name": "CUBLAS_GEMM_DEFAULT" }`.
//! Sections of other devices or library versions are kept when the file is rewritten but never
//! used. A file that does not parse, or an entry that does not, is ignored with a
//! `tracing::warn!`; entries that parse are still not trusted: a cuBLASLt algorithm from the
//! file is checked with `cublasLtMatmulAlgoCheck` for the problem before its first use.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use once_cell::sync::Lazy;
use serde::{Deserialize, Serialize};

use super::lt::Plan;
use super::names;
use super::problem::{Alignment, Compute, Key};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A `cublasGemmAlgo_t` value (`CUBLAS_GEMM_DEFAULT` = -1, `ALGO0..23` = 0..23,
/// `DEFAULT_TENSOR_OP` = 99, `ALGO0..15_TENSOR_OP` = 100..115).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CublasAlgo(pub i32);

impl CublasAlgo {
    /// `CUBLAS_GEMM_DEFAULT`: cuBLAS's own heuristic (the only meaningful value on sm_80+).
    pub const DEFAULT: CublasAlgo = CublasAlgo(-1);
    /// `CUBLAS_GEMM_DEFAULT_TENSOR_OP` (deprecated alias of the default on recent cuBLAS).
    pub const DEFAULT_TENSOR_OP: CublasAlgo = CublasAlgo(99);

    /// `CUBLAS_GEMM_ALGO<i>` for `i` in `0..=23`.
    pub fn algo(i: i32) -> Option<CublasAlgo> {
        (0..=23).contains(&i).then_some(CublasAlgo(i))
    }

    /// `CUBLAS_GEMM_ALGO<i>_TENSOR_OP` for `i` in `0..=15`.
    pub fn algo_tensor_op(i: i32) -> Option<CublasAlgo> {
        (0..=15).contains(&i).then_some(CublasAlgo(100 + i))
    }

    /// Whether cuBLAS defines this value (AUTOTUNE = 999 is not accepted: nnfuse does its own
    /// search).
    pub fn is_known(self) -> bool {
        matches!(self.0, -1..=23 | 99..=115)
    }

    /// The C name (`CUBLAS_GEMM_ALGO5`).
    pub fn name(self) -> String {
        match self.0 {
            -1 => "CUBLAS_GEMM_DEFAULT".into(),
            99 => "CUBLAS_GEMM_DEFAULT_TENSOR_OP".into(),
            i @ 0..=23 => format!("CUBLAS_GEMM_ALGO{i}"),
            i @ 100..=115 => format!("CUBLAS_GEMM_ALGO{}_TENSOR_OP", i - 100),
            i => format!("cublasGemmAlgo_t({i})"),
        }
    }
}

/// The bytes of a `cublasLtMatmulAlgo_t` (a plain struct of eight `u64`): a concrete,
/// fully-configured cuBLASLt kernel choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LtAlgo(pub [u64; 8]);

impl LtAlgo {
    /// 128 lower-case hex digits, 16 per word, most significant digit first.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|w| format!("{w:016x}")).collect()
    }

    /// Parses [`LtAlgo::to_hex`]'s format.
    pub fn from_hex(s: &str) -> Option<LtAlgo> {
        if s.len() != 128 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        let mut w = [0u64; 8];
        for (i, word) in w.iter_mut().enumerate() {
            *word = u64::from_str_radix(s.get(16 * i..16 * (i + 1))?, 16).ok()?;
        }
        Some(LtAlgo(w))
    }
}

/// A concrete algorithm: what nnfuse runs for a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algo {
    /// `cublasGemmStridedBatchedEx` with this `cublasGemmAlgo_t`.
    Cublas(CublasAlgo),
    /// `cublasLtMatmul` with this algorithm.
    Lt(LtAlgo),
}

impl Algo {
    /// The cuBLAS default.
    pub const CUBLAS_DEFAULT: Algo = Algo::Cublas(CublasAlgo::DEFAULT);
}

/// The readable attributes of a cuBLASLt algorithm (`cublasLtMatmulAlgoConfigGetAttribute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct LtConfig {
    /// `CUBLASLT_ALGO_CONFIG_ID`.
    pub algo_id: i32,
    /// `CUBLASLT_ALGO_CONFIG_TILE_ID` (`cublasLtMatmulTile_t`).
    pub tile: u32,
    /// `CUBLASLT_ALGO_CONFIG_STAGES_ID` (`cublasLtMatmulStages_t`).
    pub stages: u32,
    /// `CUBLASLT_ALGO_CONFIG_SPLITK_NUM` (1: no split).
    pub splitk: u32,
    /// `CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME` (`cublasLtReductionScheme_t`).
    pub reduction: u32,
    /// `CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING`.
    pub swizzle: u32,
    /// `CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION`.
    pub custom: u32,
    /// `CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID`.
    pub inner_shape: u32,
    /// `CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID` (`cublasLtClusterShape_t`).
    pub cluster_shape: u32,
}

impl LtConfig {
    /// The tile's name (`128x256`), when known.
    pub fn tile_name(&self) -> Option<&'static str> {
        names::tile(self.tile)
    }
    /// The stages' name (`64x4`), when known.
    pub fn stages_name(&self) -> Option<&'static str> {
        names::stages(self.stages)
    }
    /// The cluster shape's name (`2x1x1`), when known.
    pub fn cluster_name(&self) -> Option<&'static str> {
        names::cluster(self.cluster_shape)
    }
}

impl fmt::Display for LtConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let or = |n: Option<&'static str>, v: u32| n.map_or_else(|| v.to_string(), String::from);
        write!(
            f,
            "id {} tile {} stages {} splitK {} reduction {} swizzle {} custom {} inner {} cluster {}",
            self.algo_id,
            or(self.tile_name(), self.tile),
            or(self.stages_name(), self.stages),
            self.splitk,
            self.reduction,
            self.swizzle,
            self.custom,
            self.inner_shape,
            or(self.cluster_name(), self.cluster_shape)
        )
    }
}

/// Where a [`Choice`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Timed by a search in this process.
    Searched,
    /// Read from the tuning-cache file.
    File,
    /// No search happened (it failed, or was not possible): the cuBLAS default. Kept in memory
    /// only, so that a failing search is not repeated on every call.
    Fallback,
}

/// The algorithm chosen for a [`Key`], with what the search measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// The algorithm.
    pub algo: Algo,
    /// Its readable attributes (cuBLASLt only).
    pub config: Option<LtConfig>,
    /// Workspace bytes it needs (cuBLASLt only; 0 otherwise).
    pub workspace: usize,
    /// Its median time per GEMM when searched (µs; NaN if unknown).
    pub median_us: f64,
    /// The cuBLAS default's median time in the same search (µs; NaN if unknown).
    pub default_us: f64,
    /// Candidates that were timed or rejected in the search (0 if unknown).
    pub candidates: u32,
    /// Where it came from.
    pub origin: Origin,
}

impl Choice {
    /// The cuBLAS default without measurements.
    pub fn fallback() -> Choice {
        Choice {
            algo: Algo::CUBLAS_DEFAULT,
            config: None,
            workspace: 0,
            median_us: f64::NAN,
            default_us: f64::NAN,
            candidates: 0,
            origin: Origin::Fallback,
        }
    }

    /// A short description (`cuBLAS CUBLAS_GEMM_DEFAULT`, `cuBLASLt id 66 tile 128x256 ...`).
    pub fn label(&self) -> String {
        match (&self.algo, &self.config) {
            (Algo::Cublas(a), _) => format!("cuBLAS {}", a.name()),
            (Algo::Lt(_), Some(c)) => format!("cuBLASLt {c}"),
            (Algo::Lt(_), None) => "cuBLASLt (attributes unknown)".into(),
        }
    }
}

/// The device and library versions a tuning result is valid for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceTag {
    /// Device name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Compute capability.
    pub compute_capability: (i32, i32),
    /// cuBLAS version (major, minor, patch).
    pub cublas: (i32, i32, i32),
    /// cuBLASLt version number (`cublasLtGetVersion`).
    pub cublaslt: usize,
}

impl fmt::Display for DeviceTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (sm_{}{}), cuBLAS {}.{}.{}, cuBLASLt {}",
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.cublas.0,
            self.cublas.1,
            self.cublas.2,
            self.cublaslt
        )
    }
}

// ---------------------------------------------------------------------------------------------
// In-memory cache.

/// FxHash (rustc's): a multiply-rotate per word. The key is a few integers, so this hashes it in
/// nanoseconds where SipHash would take ten times longer; no untrusted input reaches it.
#[derive(Default, Clone, Copy)]
pub struct FxHasher(u64);

impl FxHasher {
    #[inline]
    fn add(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(w));
        }
    }
    #[inline]
    fn write_u8(&mut self, v: u8) {
        self.add(v as u64)
    }
    #[inline]
    fn write_u16(&mut self, v: u16) {
        self.add(v as u64)
    }
    #[inline]
    fn write_u32(&mut self, v: u32) {
        self.add(v as u64)
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.add(v)
    }
    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.add(v as u64)
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

#[derive(Clone)]
struct Slot {
    choice: Choice,
    /// Whether it may run without a check (false for entries read from a file).
    verified: bool,
    /// The cuBLASLt descriptors of the key's problem, built once (by the search, the check of a
    /// file entry, or the first call), so that a call of a cached cuBLASLt choice only extracts
    /// pointers and launches. `None` for cuBLAS choices and until first built.
    plan: Option<Arc<Plan>>,
}

/// What the hot path needs from a slot: the choice, whether it was checked, its cuBLASLt plan.
pub(crate) type SlotView = (Choice, bool, Option<Arc<Plan>>);

/// The in-memory choices: a least-recently-used map of at most `capacity` entries, shaped for
/// the hot path. A hit costs one FxHash lookup and a store of the use tick (~40 ns), where
/// [`crate::lru::Lru`]'s ordered index costs ~10x that per hit; the price is paid on eviction
/// instead, which scans for the oldest tick. Evictions only follow an insert past the capacity,
/// i.e. a search (milliseconds), so the scan (microseconds at 4096 entries) never shows.
struct Choices {
    map: FxMap<Key, (Slot, u64)>,
    tick: u64,
    capacity: usize,
    evictions: u64,
}

impl Choices {
    fn new(capacity: usize) -> Self {
        Choices {
            map: FxMap::default(),
            tick: 0,
            capacity: capacity.max(1),
            evictions: 0,
        }
    }

    /// The slot of `key`, marked as the most recently used.
    fn get(&mut self, key: &Key) -> Option<&Slot> {
        self.tick += 1;
        let (slot, used) = self.map.get_mut(key)?;
        *used = self.tick;
        Some(slot)
    }

    /// Mutable access without marking a use.
    fn peek_mut(&mut self, key: &Key) -> Option<&mut Slot> {
        self.map.get_mut(key).map(|(s, _)| s)
    }

    /// Inserts or replaces `key` as the most recently used; evicts the least recently used
    /// entries beyond the capacity (never the one inserted) and returns how many.
    fn insert(&mut self, key: Key, slot: Slot) -> usize {
        self.tick += 1;
        self.map.insert(key, (slot, self.tick));
        self.shrink()
    }

    /// Inserts `key` only if it is absent and there is room (entries read from a file never
    /// push out choices of this process). Returns whether it was inserted.
    fn insert_if_room(&mut self, key: Key, slot: Slot) -> bool {
        if self.map.len() >= self.capacity || self.map.contains_key(&key) {
            return false;
        }
        self.tick += 1;
        self.map.insert(key, (slot, self.tick));
        true
    }

    fn shrink(&mut self) -> usize {
        let mut n = 0;
        while self.map.len() > self.capacity {
            let Some(oldest) = self
                .map
                .iter()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(k, _)| *k)
            else {
                break;
            };
            self.map.remove(&oldest);
            self.evictions += 1;
            n += 1;
        }
        n
    }

    /// Raises the capacity to `capacity` (never lowers it: the map is shared by every Context
    /// of the process, and the largest capacity any of them asked for wins).
    fn raise_capacity(&mut self, capacity: usize) {
        self.capacity = self.capacity.max(capacity);
    }
}

struct State {
    choices: Choices,
    /// Files already read, per device ordinal.
    loaded: HashSet<(PathBuf, u32)>,
}

static STATE: Lazy<Mutex<State>> = Lazy::new(|| {
    Mutex::new(State {
        // Contexts raise it to their `Config::plan_cache_capacity` when they store a choice.
        choices: Choices::new(1),
        loaded: HashSet::new(),
    })
});
/// Serialises file writes within the process (other processes are handled by rename).
static SAVE_LOCK: Lazy<Mutex<()>> = Lazy::new(|| Mutex::new(()));

fn state() -> MutexGuard<'static, State> {
    match STATE.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The cached choice for `key`, if any (verified or not). This is the cost of a cached lookup:
/// one uncontended mutex and one hash of a few integers (the hot path also clones the `Arc` of
/// the cached cuBLASLt plan: one more atomic increment).
pub fn lookup(key: &Key) -> Option<Choice> {
    state().choices.get(key).map(|s| s.choice)
}

/// `(choice, verified, plan)` for `key` (the plan's `Arc` is cloned: one atomic increment).
pub(crate) fn lookup_slot(key: &Key) -> Option<SlotView> {
    state()
        .choices
        .get(key)
        .map(|s| (s.choice, s.verified, s.plan.clone()))
}

/// Stores a choice (replacing any other for the key), with its cuBLASLt plan if built. The map
/// keeps at most `capacity` choices (the largest [`crate::Config::plan_cache_capacity`] of the
/// Contexts that stored one), evicting the least recently used; an evicted choice is searched
/// again (or read from the tuning file) at its key's next call.
pub(crate) fn insert(
    key: Key,
    choice: Choice,
    verified: bool,
    plan: Option<Arc<Plan>>,
    capacity: usize,
) {
    let evicted = {
        let mut s = state();
        s.choices.raise_capacity(capacity);
        s.choices.insert(
            key,
            Slot {
                choice,
                verified,
                plan,
            },
        )
    };
    if evicted > 0 {
        tracing::debug!(
            evicted,
            "GEMM choice cache full: least recently used choices evicted"
        );
    }
}

/// Marks a choice as checked and keeps the plan its check built, if the slot still holds the
/// same algorithm.
pub(crate) fn mark_verified(key: &Key, algo: &Algo, plan: Option<Arc<Plan>>) {
    if let Some(s) = state().choices.peek_mut(key) {
        if s.choice.algo == *algo {
            s.verified = true;
            if s.plan.is_none() {
                s.plan = plan;
            }
        }
    }
}

/// Keeps a plan built on first use, if the slot still holds the same algorithm and has none.
pub(crate) fn set_plan(key: &Key, algo: &Algo, plan: Arc<Plan>) {
    if let Some(s) = state().choices.peek_mut(key) {
        if s.choice.algo == *algo && s.plan.is_none() {
            s.plan = Some(plan);
        }
    }
}

/// Forgets one choice.
pub(crate) fn remove(key: &Key) {
    state().choices.map.remove(key);
}

/// Forgets every in-memory choice and which files were read (files are untouched), so that the
/// next call searches again or re-reads its file. For tests and benchmarks.
pub fn clear() {
    let mut s = state();
    s.choices.map.clear();
    s.loaded.clear();
}

/// What the in-memory choice map holds ([`memory_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryStats {
    /// Choices in memory now (every device).
    pub entries: usize,
    /// Most choices kept: the largest [`crate::Config::plan_cache_capacity`] of the Contexts
    /// that stored one (1 before any did).
    pub capacity: usize,
    /// Choices evicted (least recently used first) since the process started.
    pub evictions: u64,
}

/// The size, bound and evictions of the process's in-memory choice map.
pub fn memory_stats() -> MemoryStats {
    let s = state();
    MemoryStats {
        entries: s.choices.map.len(),
        capacity: s.choices.capacity,
        evictions: s.choices.evictions,
    }
}

/// Every searched or file-loaded choice for device `ordinal` (what a save writes).
pub fn entries(ordinal: u32) -> Vec<(Key, Choice)> {
    let mut v: Vec<(Key, Choice)> = state()
        .choices
        .map
        .iter()
        .filter(|(k, (s, _))| k.device == ordinal && s.choice.origin != Origin::Fallback)
        .map(|(k, (s, _))| (*k, s.choice))
        .collect();
    v.sort_by_key(|e| e.0);
    v
}

/// Reads `path` into memory once per process and device (later calls return at once). Entries
/// already in memory win over the file's, and the file's fill only the room left under the
/// capacity (the rest stay in the file; a call of their key searches again).
pub(crate) fn ensure_loaded(path: &Path, ordinal: u32, tag: &DeviceTag, capacity: usize) {
    {
        let s = state();
        if s.loaded.contains(&(path.to_path_buf(), ordinal)) {
            return;
        }
    }
    let loaded = load_file(path, tag, ordinal);
    let mut s = state();
    s.loaded.insert((path.to_path_buf(), ordinal));
    s.choices.raise_capacity(capacity);
    let mut added = 0;
    for (k, c) in loaded.entries {
        let slot = Slot {
            choice: c,
            verified: false,
            plan: None,
        };
        if s.choices.insert_if_room(k, slot) {
            added += 1;
        }
    }
    if added > 0 {
        tracing::info!(
            path = %path.display(),
            entries = added,
            "GEMM tuning cache read"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The file.

/// `format` field of the file.
pub const FILE_FORMAT: &str = "nnfuse-gemm-tuning";
/// `version` field of the file.
pub const FILE_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct FileDoc {
    format: String,
    version: u32,
    sections: Vec<serde_json::Value>,
    /// Other members (the convolution choices' `"conv"`): kept as they are when GEMM entries
    /// are written.
    #[serde(flatten)]
    rest: serde_json::Map<String, serde_json::Value>,
}

#[derive(Serialize, Deserialize)]
struct SectionDoc {
    device: DeviceTag,
    entries: Vec<serde_json::Value>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProblemDoc {
    dtype: String,
    compute: String,
    trans_a: bool,
    trans_b: bool,
    m: u32,
    n: u32,
    k: u32,
    batch: u32,
    lda: u32,
    ldb: u32,
    ldc: u32,
    stride_a: u64,
    stride_b: u64,
    stride_c: u64,
    align_a: u16,
    align_b: u16,
    align_c: u16,
    beta_zero: bool,
}

#[derive(Serialize, Deserialize)]
struct ConfigDoc {
    #[serde(flatten)]
    config: LtConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tile_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stages_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cluster_name: Option<String>,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "backend")]
enum ChoiceDoc {
    #[serde(rename = "cublas")]
    Cublas { algo: i32, name: String },
    #[serde(rename = "cublaslt")]
    Lt {
        algo_hex: String,
        #[serde(default)]
        config: Option<ConfigDoc>,
        workspace_bytes: usize,
    },
}

#[derive(Serialize, Deserialize)]
struct EntryDoc {
    problem: ProblemDoc,
    choice: ChoiceDoc,
    median_us: Option<f64>,
    default_us: Option<f64>,
    #[serde(default)]
    candidates: u32,
}

fn entry_doc(key: &Key, c: &Choice) -> EntryDoc {
    let problem = ProblemDoc {
        dtype: key.dtype.name().into(),
        compute: key.compute.name().into(),
        trans_a: key.trans_a,
        trans_b: key.trans_b,
        m: key.m,
        n: key.n,
        k: key.k,
        batch: key.batch,
        lda: key.lda,
        ldb: key.ldb,
        ldc: key.ldc,
        stride_a: key.stride_a,
        stride_b: key.stride_b,
        stride_c: key.stride_c,
        align_a: key.align.a,
        align_b: key.align.b,
        align_c: key.align.c,
        beta_zero: key.beta_zero,
    };
    let choice = match c.algo {
        Algo::Cublas(a) => ChoiceDoc::Cublas {
            algo: a.0,
            name: a.name(),
        },
        Algo::Lt(a) => ChoiceDoc::Lt {
            algo_hex: a.to_hex(),
            config: c.config.map(|config| ConfigDoc {
                config,
                tile_name: config.tile_name().map(String::from),
                stages_name: config.stages_name().map(String::from),
                cluster_name: config.cluster_name().map(String::from),
            }),
            workspace_bytes: c.workspace,
        },
    };
    let finite = |v: f64| v.is_finite().then_some(v);
    EntryDoc {
        problem,
        choice,
        median_us: finite(c.median_us),
        default_us: finite(c.default_us),
        candidates: c.candidates,
    }
}

/// Checks a parsed entry and turns it into a key (for device `ordinal`) and a choice.
fn from_entry_doc(e: EntryDoc, ordinal: u32) -> std::result::Result<(Key, Choice), String> {
    let p = &e.problem;
    let dtype: DType = p
        .dtype
        .parse()
        .map_err(|_| format!("dtype {:?}", p.dtype))?;
    let compute: Compute = p
        .compute
        .parse()
        .map_err(|_| format!("compute {:?}", p.compute))?;
    if compute == Compute::F16 && dtype != DType::F16 {
        return Err("f16 compute with non-f16 data".into());
    }
    let align = Alignment {
        a: p.align_a,
        b: p.align_b,
        c: p.align_c,
    };
    align.check(dtype.size()).map_err(|e| e.to_string())?;
    let key = Key {
        device: ordinal,
        dtype,
        compute,
        trans_a: p.trans_a,
        trans_b: p.trans_b,
        beta_zero: p.beta_zero,
        m: p.m,
        n: p.n,
        k: p.k,
        batch: p.batch,
        lda: p.lda,
        ldb: p.ldb,
        ldc: p.ldc,
        stride_a: p.stride_a,
        stride_b: p.stride_b,
        stride_c: p.stride_c,
        align,
    };
    // The key must describe a valid problem (and be in normal form) to be usable at all.
    let problem = key.problem();
    let normal = Key::new(ordinal, &problem, dtype, align).map_err(|e| e.to_string())?;
    if normal != key {
        return Err("strides of a single-matrix batch must be 0".into());
    }
    let (algo, config, workspace) = match e.choice {
        ChoiceDoc::Cublas { algo, .. } => {
            let a = CublasAlgo(algo);
            if !a.is_known() {
                return Err(format!("unknown cublasGemmAlgo_t {algo}"));
            }
            (Algo::Cublas(a), None, 0)
        }
        ChoiceDoc::Lt {
            algo_hex,
            config,
            workspace_bytes,
        } => {
            let a = LtAlgo::from_hex(&algo_hex).ok_or("algo_hex is not 128 hex digits")?;
            (Algo::Lt(a), config.map(|c| c.config), workspace_bytes)
        }
    };
    let choice = Choice {
        algo,
        config,
        workspace,
        median_us: e.median_us.unwrap_or(f64::NAN),
        default_us: e.default_us.unwrap_or(f64::NAN),
        candidates: e.candidates,
        origin: Origin::File,
    };
    Ok((key, choice))
}

/// What [`load_file`] found.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Usable entries for this device (keys carry the given ordinal).
    pub entries: Vec<(Key, Choice)>,
    /// Why the file (or part of it) was ignored; each was also logged with `tracing::warn!`.
    pub warnings: Vec<String>,
}

fn parse_doc(text: &str) -> std::result::Result<FileDoc, String> {
    let doc: FileDoc = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    if doc.format != FILE_FORMAT {
        return Err(format!("format {:?} is not {FILE_FORMAT:?}", doc.format));
    }
    if doc.version != FILE_VERSION {
        return Err(format!("version {} is not {FILE_VERSION}", doc.version));
    }
    Ok(doc)
}

/// Reads the entries for `tag` from `path`. Never fails: a missing file is empty; an unreadable
/// or corrupted file, a file without a section for this device and library versions, and
/// malformed entries are ignored with a warning (returned and logged).
pub fn load_file(path: &Path, tag: &DeviceTag, ordinal: u32) -> Loaded {
    let mut out = Loaded::default();
    let mut warn = |msg: String| {
        tracing::warn!(path = %path.display(), "GEMM tuning cache ignored: {msg}");
        out.warnings.push(msg);
    };
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return out,
        Err(e) => {
            warn(format!("cannot be read: {e}"));
            return out;
        }
    };
    let doc = match parse_doc(&text) {
        Ok(d) => d,
        Err(e) => {
            warn(format!("{e}; it will be replaced at the next save"));
            return out;
        }
    };
    let mut others = Vec::new();
    let mut mine = None;
    for s in doc.sections {
        match serde_json::from_value::<SectionDoc>(s) {
            Ok(sec) if sec.device == *tag => mine = Some(sec),
            Ok(sec) => others.push(sec.device.to_string()),
            Err(e) => warn(format!("a section does not parse ({e})")),
        }
    }
    let Some(sec) = mine else {
        if !others.is_empty() {
            warn(format!(
                "no section for this device and library versions ({tag}); it holds results for: \
                 {}",
                others.join("; ")
            ));
        }
        return out;
    };
    let mut entries = Vec::new();
    for (i, v) in sec.entries.into_iter().enumerate() {
        match serde_json::from_value::<EntryDoc>(v)
            .map_err(|e| e.to_string())
            .and_then(|e| from_entry_doc(e, ordinal))
        {
            Ok(kc) => entries.push(kc),
            Err(e) => warn(format!("entry {i} ignored: {e}")),
        }
    }
    out.entries = entries;
    out
}

/// Writes `entries` (all for device `tag`) into `path`, merging with what the file holds now:
/// other devices' sections are kept, this device's entries are replaced key by key (the given
/// ones win). Written atomically: a temporary file in the same folder, flushed, then renamed
/// over `path`.
pub fn save_file(path: &Path, tag: &DeviceTag, entries: &[(Key, Choice)]) -> Result<()> {
    let _guard = file_lock();
    let io = |source: std::io::Error| Error::Io {
        path: path.display().to_string(),
        source,
    };
    // What the file holds now (another process may have added entries).
    let mut sections: Vec<serde_json::Value> = Vec::new();
    let mut mine: Vec<(Key, serde_json::Value)> = Vec::new();
    let mut rest = serde_json::Map::new();
    if let Ok(text) = std::fs::read_to_string(path) {
        if let Ok(doc) = parse_doc(&text) {
            rest = doc.rest;
            for s in doc.sections {
                match serde_json::from_value::<SectionDoc>(s.clone()) {
                    Ok(sec) if sec.device == *tag => {
                        for v in sec.entries {
                            if let Ok(kc) = serde_json::from_value::<EntryDoc>(v.clone())
                                .map_err(|e| e.to_string())
                                .and_then(|e| from_entry_doc(e, 0))
                            {
                                mine.push((kc.0, v));
                            }
                        }
                    }
                    Ok(_) => sections.push(s),
                    Err(_) => {} // unparseable sections are dropped
                }
            }
        }
    }
    let norm = |k: &Key| Key { device: 0, ..*k };
    let mut merged: std::collections::BTreeMap<Key, serde_json::Value> = mine.into_iter().collect();
    for (k, c) in entries {
        let v = serde_json::to_value(entry_doc(k, c)).map_err(|e| Error::Io {
            path: path.display().to_string(),
            source: std::io::Error::other(e),
        })?;
        merged.insert(norm(k), v);
    }
    let section = SectionDoc {
        device: tag.clone(),
        entries: merged.into_values().collect(),
    };
    let section = serde_json::to_value(section).map_err(|e| io(std::io::Error::other(e)))?;
    sections.push(section);
    let doc = FileDoc {
        format: FILE_FORMAT.into(),
        version: FILE_VERSION,
        sections,
        rest,
    };
    let mut text = serde_json::to_string_pretty(&doc).map_err(|e| io(std::io::Error::other(e)))?;
    text.push('\n');
    write_unlocked(path, &text)
}

/// The process-wide lock around every read-merge-write of the tuning-cache file (GEMM and
/// convolution choices share the file; other processes are handled by the atomic rename).
pub(crate) fn file_lock() -> std::sync::MutexGuard<'static, ()> {
    match SAVE_LOCK.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Writes `text` to `path` atomically (a temporary file in the same folder, flushed, renamed
/// over `path`). Call it holding [`file_lock`].
pub(crate) fn write_atomic(path: &Path, text: &str) -> Result<()> {
    write_unlocked(path, text)
}

fn write_unlocked(path: &Path, text: &str) -> Result<()> {
    let io = |source: std::io::Error| Error::Io {
        path: path.display().to_string(),
        source,
    };
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "tuning.json".into());
    let tmp = dir.join(format!(
        ".{file_name}.tmp.{}.{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::problem::Problem;

    #[test]
    fn hex_round_trip_and_rejects() {
        let a = LtAlgo([0, 1, u64::MAX, 0x0123_4567_89ab_cdef, 5, 6, 7, 8]);
        let h = a.to_hex();
        assert_eq!(h.len(), 128);
        assert_eq!(LtAlgo::from_hex(&h), Some(a));
        assert_eq!(LtAlgo::from_hex(&h[1..]), None);
        assert_eq!(LtAlgo::from_hex(&h.replace('f', "g")), None);
        assert_eq!(LtAlgo::from_hex(&format!("+{}", &h[1..])), None);
    }

    #[test]
    fn cublas_algo_names() {
        assert_eq!(CublasAlgo::DEFAULT.name(), "CUBLAS_GEMM_DEFAULT");
        assert_eq!(
            CublasAlgo::algo(5).map(|a| a.name()).as_deref(),
            Some("CUBLAS_GEMM_ALGO5")
        );
        assert_eq!(
            CublasAlgo::algo_tensor_op(15).map(|a| a.name()).as_deref(),
            Some("CUBLAS_GEMM_ALGO15_TENSOR_OP")
        );
        assert!(CublasAlgo::algo(24).is_none());
        assert!(!CublasAlgo(999).is_known());
    }

    #[test]
    fn gemm_save_keeps_other_members() {
        // The convolution choices live under "conv" in the same file: a GEMM save keeps them.
        let dir = std::env::temp_dir().join(format!("nnfuse-gemm-rest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.json");
        let conv = serde_json::json!({ "version": 1, "sections": [ { "x": 1 } ] });
        let start = serde_json::json!({
            "format": FILE_FORMAT, "version": FILE_VERSION, "sections": [], "conv": conv,
        });
        std::fs::write(&path, start.to_string()).unwrap();
        let tag = DeviceTag {
            name: "T".into(),
            compute_capability: (9, 0),
            cublas: (13, 1, 0),
            cublaslt: 130100,
        };
        let key = Key::new(0, &Problem::packed(2, 8, 8, 8), DType::F16, Alignment::MAX).unwrap();
        save_file(&path, &tag, &[(key, Choice::fallback())]).unwrap();
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(doc["conv"], conv);
        assert_eq!(doc["sections"].as_array().unwrap().len(), 1);
        assert_eq!(load_file(&path, &tag, 0).entries.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn fx_hasher_distinguishes_keys() {
        use std::hash::BuildHasher;
        let b = BuildHasherDefault::<FxHasher>::default();
        let p = Problem::packed(2, 3, 4, 5);
        let k1 = Key::new(0, &p, DType::F16, Alignment::MAX).unwrap();
        let mut k2 = k1;
        k2.n = 5;
        let h = |k: &Key| b.hash_one(k);
        assert_ne!(h(&k1), h(&k2));
        assert_eq!(h(&k1), h(&k1.clone()));
    }

    fn slot() -> Slot {
        Slot {
            choice: Choice::fallback(),
            verified: true,
            plan: None,
        }
    }

    fn key(i: usize) -> Key {
        Key::new(
            0,
            &Problem::packed(1, 8 + i, 8, 8),
            DType::F32,
            Alignment::MAX,
        )
        .unwrap()
    }

    #[test]
    fn choice_map_is_a_bounded_lru() {
        let mut c = Choices::new(64);
        for i in 0..20_000 {
            c.insert(key(i), slot());
            // Key 0 is used between inserts: it must survive every eviction.
            assert!(c.get(&key(0)).is_some(), "key 0 evicted at insert {i}");
            assert!(c.map.len() <= 64);
        }
        assert_eq!(c.map.len(), 64);
        assert_eq!(c.evictions, 20_000 - 64);
        // The survivors: key 0 and the 63 newest.
        for i in (20_000 - 63)..20_000 {
            assert!(c.get(&key(i)).is_some(), "key {i}");
        }
        assert!(c.get(&key(1)).is_none());
        // Raising never lowers; file entries only fill free room and never replace.
        c.raise_capacity(8);
        assert_eq!(c.capacity, 64);
        assert!(!c.insert_if_room(key(1), slot()));
        c.raise_capacity(65);
        assert!(
            !c.insert_if_room(key(0), slot()),
            "present keys are not replaced"
        );
        assert!(c.insert_if_room(key(1), slot()));
        assert!(!c.insert_if_room(key(2), slot()));
        assert_eq!(c.map.len(), 65);
        // Replacing a key evicts nothing.
        assert_eq!(c.insert(key(1), slot()), 0);
    }
}
