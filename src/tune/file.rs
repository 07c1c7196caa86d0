//! The tuning-cache file: one JSON document that GEMM and convolution share (`docs/CONV.md`
//! and the `gemm` module's documentation give each part's entries).
//!
//! ```json
//! { "format": "nnfuse-gemm-tuning", "version": 1,
//!   "sections": [ { "device": { .. }, "entries": [ .. ] } ],            // GEMM
//!   "conv": { "version": 1, "sections": [ { "device": { .. }, "entries": [ .. ] } ] } }
//! ```
//!
//! One section per device and library versions; sections of other devices are kept when the
//! file is rewritten but never used. Every read-merge-write holds the process's [`lock`]; other
//! processes are handled by the atomic rename of [`write_atomic`].

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use serde::Serialize;
use serde_json::Value;

use crate::error::{Error, Result};

/// `format` field of the file.
pub const FILE_FORMAT: &str = "nnfuse-gemm-tuning";
/// `version` field of the file.
pub const FILE_VERSION: u32 = 1;

/// Serialises file writes within the process (other processes are handled by rename).
static SAVE_LOCK: Mutex<()> = Mutex::new(());

/// The process-wide lock around every read-merge-write of the file (GEMM and convolution
/// choices share it).
pub(crate) fn lock() -> MutexGuard<'static, ()> {
    super::store::lock(&SAVE_LOCK)
}

/// The file's text; `None` when it does not exist.
pub(crate) fn read(path: &Path) -> std::io::Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// `v` as the file's text: pretty-printed JSON and a final newline.
pub(crate) fn pretty(path: &Path, v: &impl Serialize) -> Result<String> {
    let mut text =
        serde_json::to_string_pretty(v).map_err(|e| io_error(path, std::io::Error::other(e)))?;
    text.push('\n');
    Ok(text)
}

/// `v` as a JSON value (an error names `path`, the file it was meant for).
pub(crate) fn to_value(path: &Path, v: &impl Serialize) -> Result<Value> {
    serde_json::to_value(v).map_err(|e| io_error(path, std::io::Error::other(e)))
}

/// How a section of the file relates to the device being written.
pub(crate) enum Section {
    /// This device's section, with its entries.
    Mine(Vec<Value>),
    /// Another device's or library version's: kept as it is.
    Other,
    /// Unreadable: dropped.
    Unreadable,
}

/// Merges one device's entries into a part's sections: other devices' sections are kept in
/// their order, unreadable ones dropped; this device's entries are keyed by `key_of` (those it
/// cannot key are dropped) and replaced key by key by `mine`. Returns the kept sections and
/// this device's merged entries in key order (its section goes last).
pub(crate) fn merge_sections<K: Ord>(
    sections: impl IntoIterator<Item = Value>,
    classify: impl Fn(&Value) -> Section,
    key_of: impl Fn(&Value) -> Option<K>,
    mine: impl IntoIterator<Item = (K, Value)>,
) -> (Vec<Value>, Vec<Value>) {
    let mut others = Vec::new();
    let mut merged: BTreeMap<K, Value> = BTreeMap::new();
    for s in sections {
        match classify(&s) {
            Section::Mine(entries) => {
                for e in entries {
                    if let Some(k) = key_of(&e) {
                        merged.insert(k, e);
                    }
                }
            }
            Section::Other => others.push(s),
            Section::Unreadable => {}
        }
    }
    merged.extend(mine);
    (others, merged.into_values().collect())
}

/// Writes `text` to `path` atomically (a temporary file in the same folder, flushed, renamed
/// over `path`). Call it holding [`lock`].
pub(crate) fn write_atomic(path: &Path, text: &str) -> Result<()> {
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
        return Err(io_error(path, e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_keeps_others_and_replaces_mine_key_by_key() {
        let sections = vec![
            json!({ "device": "a", "entries": [ { "k": 1, "v": "old" }, { "k": 2, "v": "old" } ] }),
            json!({ "device": "b", "entries": [] }),
            json!({ "no device": true }),
        ];
        let classify = |s: &Value| match s.get("device").and_then(Value::as_str) {
            Some("a") => Section::Mine(s["entries"].as_array().cloned().unwrap_or_default()),
            Some(_) => Section::Other,
            None => Section::Unreadable,
        };
        let key_of = |e: &Value| e.get("k").and_then(Value::as_u64);
        let (others, mine) = merge_sections(
            sections,
            classify,
            key_of,
            [(2, json!({ "k": 2, "v": "new" })), (0, json!({ "k": 0 }))],
        );
        assert_eq!(others, vec![json!({ "device": "b", "entries": [] })]);
        assert_eq!(
            mine,
            vec![
                json!({ "k": 0 }),
                json!({ "k": 1, "v": "old" }),
                json!({ "k": 2, "v": "new" })
            ]
        );
    }
}
