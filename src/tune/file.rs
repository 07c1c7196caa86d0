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
//! file is rewritten but never used.
//!
//! # Saving
//! A save is `let _guard = lock();`, then [`read`], merge, [`write_atomic`] of the same path.
//! The guard serialises the process's threads; under it, the first [`read`] (or
//! [`write_atomic`]) of a path also takes the advisory lock of that path
//! ([`crate::cache_fs::FileLock`] on `<file>.lock`), held until the guard drops, so that
//! processes do not lose each other's entries either. Under the guard, a file nnfuse cannot use
//! is never dropped: one that cannot be parsed (not UTF-8, not JSON, not an nnfuse tuning file,
//! over 64 MiB) is moved aside as `<file>.unreadable.<unix seconds>`, one of another `version`
//! as `<file>.version-<N>.<unix seconds>`, each with a `tracing` warning, and the save starts
//! from an empty document; one that is not a regular file (a FIFO, a device, a folder), or
//! that cannot be read or locked, makes the save an error rather than replacing it.
//!
//! Reads never block on a FIFO nor read more than 64 MiB ([`crate::cache_fs`]).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use serde::Serialize;
use serde_json::Value;

use crate::cache_fs::{self, FileLock};
use crate::error::{Error, Result};

/// `format` field of the file.
pub const FILE_FORMAT: &str = "nnfuse-gemm-tuning";
/// `version` field of the file.
pub const FILE_VERSION: u32 = 1;

/// Serialises file writes within the process (other processes: the file lock).
static SAVE_LOCK: Mutex<()> = Mutex::new(());

/// What this thread's save holds: the file locks taken so far, and the paths whose current
/// content could not be established (their write is refused).
#[derive(Default)]
struct Saving {
    locks: Vec<(PathBuf, FileLock)>,
    refused: Vec<(PathBuf, String)>,
}

thread_local! {
    /// `Some` while this thread holds a [`SaveGuard`].
    static SAVING: RefCell<Option<Saving>> = const { RefCell::new(None) };
}

/// A save in progress (see the module's documentation): the process-wide lock, and the file
/// locks [`read`] and [`write_atomic`] take under it, released on drop.
pub(crate) struct SaveGuard {
    _process: MutexGuard<'static, ()>,
}

impl Drop for SaveGuard {
    fn drop(&mut self) {
        // Releases the file locks before the process-wide lock (a field, dropped after this).
        SAVING.with(|s| s.borrow_mut().take());
    }
}

/// Starts a read-merge-write of the file (GEMM and convolution choices share it).
pub(crate) fn lock() -> SaveGuard {
    let g = super::store::lock(&SAVE_LOCK);
    SAVING.with(|s| *s.borrow_mut() = Some(Saving::default()));
    SaveGuard { _process: g }
}

/// Whether this thread is saving.
fn saving() -> bool {
    SAVING.with(|s| s.borrow().is_some())
}

/// Under a [`SaveGuard`]: takes `path`'s file lock unless this save already holds it.
fn hold_file_lock(path: &Path) -> std::io::Result<()> {
    let held = SAVING.with(|s| {
        s.borrow()
            .as_ref()
            .is_some_and(|s| s.locks.iter().any(|(p, _)| p == path))
    });
    if held {
        return Ok(());
    }
    let lock = FileLock::acquire(path, cache_fs::LOCK_TIMEOUT)?;
    SAVING.with(|s| {
        if let Some(s) = s.borrow_mut().as_mut() {
            s.locks.push((path.to_path_buf(), lock));
        }
    });
    Ok(())
}

fn refuse(path: &Path, why: String) {
    SAVING.with(|s| {
        if let Some(s) = s.borrow_mut().as_mut() {
            s.refused.push((path.to_path_buf(), why));
        }
    });
}

fn refusal(path: &Path) -> Option<String> {
    SAVING.with(|s| {
        s.borrow().as_ref().and_then(|s| {
            s.refused
                .iter()
                .find(|(p, _)| p == path)
                .map(|(_, w)| w.clone())
        })
    })
}

/// The file's text; `None` when it does not exist. Never blocks on a FIFO and never reads more
/// than 64 MiB; a file that is not valid UTF-8 is an error. Under a [`SaveGuard`], see the
/// module's documentation: what cannot be used is moved aside and reads as `None`.
pub(crate) fn read(path: &Path) -> std::io::Result<Option<String>> {
    if !saving() {
        return match cache_fs::read_regular(path)? {
            Some(bytes) => String::from_utf8(bytes)
                .map(Some)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error())),
            None => Ok(None),
        };
    }
    let r = hold_file_lock(path).and_then(|()| read_for_save(path));
    if let Err(e) = &r {
        refuse(path, e.to_string());
    }
    r
}

/// Why the file's text cannot be merged into: `Some((label, reason))` to move it aside.
fn unusable(bytes: &[u8]) -> Option<(String, String)> {
    let unreadable = |why: String| Some(("unreadable".to_string(), why));
    let Ok(text) = std::str::from_utf8(bytes) else {
        return unreadable("it is not UTF-8 text".into());
    };
    let doc: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return unreadable(format!("it is not valid JSON ({e})")),
    };
    if doc.get("format").and_then(Value::as_str) != Some(FILE_FORMAT) {
        return unreadable(format!("it is not an {FILE_FORMAT:?} file"));
    }
    match doc.get("version").and_then(Value::as_u64) {
        Some(v) if v == u64::from(FILE_VERSION) => None,
        Some(v) => Some((
            format!("version-{v}"),
            format!("it is version {v}, not {FILE_VERSION}"),
        )),
        None => unreadable("it has no version".into()),
    }
}

/// [`read`] under a [`SaveGuard`], holding the file lock.
fn read_for_save(path: &Path) -> std::io::Result<Option<String>> {
    let bytes = match cache_fs::open_regular(path, false) {
        Ok(Some((file, _))) => cache_fs::read_capped(file)?,
        Ok(None) => return Ok(None),
        // Too large: a regular file, kept aside like any other unreadable one.
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData && is_regular(path) => {
            move_aside(path, "unreadable", &e.to_string())?;
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    match unusable(&bytes) {
        None => Ok(String::from_utf8(bytes).ok()),
        Some((label, why)) => {
            move_aside(path, &label, &why)?;
            Ok(None)
        }
    }
}

fn is_regular(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file())
}

fn move_aside(path: &Path, label: &str, why: &str) -> std::io::Result<()> {
    let to = cache_fs::move_aside(path, label)?;
    tracing::warn!(
        path = %path.display(),
        kept_as = %to.display(),
        "tuning cache cannot be merged into ({why}); it is kept aside and a new file started"
    );
    Ok(())
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

/// Writes `text` to `path` atomically (a new, randomly named file created with `O_EXCL` in
/// the same folder, flushed, renamed over `path`). Call it holding [`lock`]: it takes the
/// file's lock if [`read`] has not, and refuses to write when [`read`] could not establish what
/// the file holds.
pub(crate) fn write_atomic(path: &Path, text: &str) -> Result<()> {
    if saving() {
        hold_file_lock(path).map_err(|e| io_error(path, e))?;
        if let Some(why) = refusal(path) {
            return Err(io_error(
                path,
                std::io::Error::other(format!(
                    "not replaced: its content could not be read ({why})"
                )),
            ));
        }
    }
    cache_fs::write_atomic(path, text.as_bytes(), 0o644).map_err(|e| io_error(path, e))
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
