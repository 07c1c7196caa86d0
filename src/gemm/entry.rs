//! GEMM's part of the tuning-cache file ([`crate::tune::file`]): the top-level `"sections"`, one
//! per device and library versions ([`DeviceTag`]), and the (de)serialisers of its entries.
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

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::algo::{Algo, Choice, CublasAlgo, LtAlgo, LtConfig, Origin};
use super::problem::{Alignment, Compute, Key};
use crate::dtype::DType;
use crate::error::Result;
use crate::tune::file::{self, Section, FILE_FORMAT, FILE_VERSION};

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
    let text = match file::read(path) {
        Ok(Some(t)) => t,
        Ok(None) => return out,
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

fn section_of(tag: &DeviceTag) -> impl Fn(&serde_json::Value) -> Section + '_ {
    move |s| match serde_json::from_value::<SectionDoc>(s.clone()) {
        Ok(sec) if sec.device == *tag => Section::Mine(sec.entries),
        Ok(_) => Section::Other,
        Err(_) => Section::Unreadable,
    }
}

/// The key of a file entry (device 0), if it parses.
fn key_of(v: &serde_json::Value) -> Option<Key> {
    serde_json::from_value::<EntryDoc>(v.clone())
        .map_err(|e| e.to_string())
        .and_then(|e| from_entry_doc(e, 0))
        .ok()
        .map(|kc| kc.0)
}

/// Writes `entries` (all for device `tag`) into `path`, merging with what the file holds now:
/// other devices' sections and the convolution part are kept, this device's entries are
/// replaced key by key (the given ones win). Written atomically under the file lock.
pub fn save_file(path: &Path, tag: &DeviceTag, entries: &[(Key, Choice)]) -> Result<()> {
    let _guard = file::lock();
    // What the file holds now (another process may have added entries).
    let (old_sections, rest) = match file::read(path).ok().flatten().map(|t| parse_doc(&t)) {
        Some(Ok(doc)) => (doc.sections, doc.rest),
        _ => (Vec::new(), serde_json::Map::new()),
    };
    let mut mine = Vec::with_capacity(entries.len());
    for (k, c) in entries {
        let v = file::to_value(path, &entry_doc(k, c))?;
        mine.push((Key { device: 0, ..*k }, v));
    }
    let (mut sections, merged) = file::merge_sections(old_sections, section_of(tag), key_of, mine);
    let section = SectionDoc {
        device: tag.clone(),
        entries: merged,
    };
    sections.push(file::to_value(path, &section)?);
    let doc = FileDoc {
        format: FILE_FORMAT.into(),
        version: FILE_VERSION,
        sections,
        rest,
    };
    file::write_atomic(path, &file::pretty(path, &doc)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::problem::Problem;

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
}
