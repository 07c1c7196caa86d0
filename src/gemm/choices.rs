//! The process's GEMM choices in memory (one map per process, keyed by [`Key`], shared by every
//! Context on the same device ordinal): the choice, whether it was checked, and its cuBLASLt
//! descriptors, behind one lock. The map is a [`crate::tune::store::HotLru`]: a cached call
//! costs one FxHash lookup.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use once_cell::sync::Lazy;

use super::algo::{Algo, Choice, Origin};
use super::entry::{load_file, DeviceTag};
use super::lt::LtDescriptors;
use super::problem::Key;
use crate::tune::store::{self, HotLru, LoadedFiles};

#[derive(Clone)]
struct Slot {
    choice: Choice,
    /// Whether it may run without a check (false for entries read from a file).
    verified: bool,
    /// The cuBLASLt descriptors of the key's problem, built once (by the search, the check of a
    /// file entry, or the first call), so that a call of a cached cuBLASLt choice only extracts
    /// pointers and launches. `None` for cuBLAS choices and until first built.
    descriptors: Option<Arc<LtDescriptors>>,
}

/// What the hot path needs from a slot: the choice, whether it was checked, its cuBLASLt
/// descriptors.
pub(crate) type SlotView = (Choice, bool, Option<Arc<LtDescriptors>>);

struct State {
    choices: HotLru<Key, Slot>,
    /// Files already read, per device ordinal.
    loaded: LoadedFiles,
}

static STATE: Lazy<Mutex<State>> = Lazy::new(|| {
    Mutex::new(State {
        // Contexts raise it to their `Config::plan_cache_capacity` when they store a choice.
        choices: HotLru::new(1),
        loaded: LoadedFiles::default(),
    })
});

fn state() -> MutexGuard<'static, State> {
    store::lock(&STATE)
}

/// The cached choice for `key`, if any (verified or not). This is the cost of a cached lookup:
/// one uncontended mutex and one hash of a few integers (the hot path also clones the `Arc` of
/// the cached cuBLASLt descriptors: one more atomic increment).
pub fn lookup(key: &Key) -> Option<Choice> {
    state().choices.get(key).map(|s| s.choice)
}

/// `(choice, verified, descriptors)` for `key` (the descriptors' `Arc` is cloned: one atomic
/// increment).
pub(crate) fn lookup_slot(key: &Key) -> Option<SlotView> {
    state()
        .choices
        .get(key)
        .map(|s| (s.choice, s.verified, s.descriptors.clone()))
}

/// Stores a choice (replacing any other for the key), with its cuBLASLt descriptors if built.
/// The map keeps at most `capacity` choices (the largest [`crate::Config::plan_cache_capacity`]
/// of the Contexts that stored one), evicting the least recently used; an evicted choice is
/// searched again (or read from the tuning file) at its key's next call.
pub(crate) fn insert(
    key: Key,
    choice: Choice,
    verified: bool,
    descriptors: Option<Arc<LtDescriptors>>,
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
                descriptors,
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

/// Marks a choice as checked and keeps the descriptors its check built, if the slot still holds
/// the same algorithm.
pub(crate) fn mark_verified(key: &Key, algo: &Algo, descriptors: Option<Arc<LtDescriptors>>) {
    if let Some(s) = state().choices.peek_mut(key) {
        if s.choice.algo == *algo {
            s.verified = true;
            if s.descriptors.is_none() {
                s.descriptors = descriptors;
            }
        }
    }
}

/// Keeps descriptors built on first use, if the slot still holds the same algorithm and has
/// none.
pub(crate) fn set_descriptors(key: &Key, algo: &Algo, descriptors: Arc<LtDescriptors>) {
    if let Some(s) = state().choices.peek_mut(key) {
        if s.choice.algo == *algo && s.descriptors.is_none() {
            s.descriptors = Some(descriptors);
        }
    }
}

/// Forgets one choice.
pub(crate) fn remove(key: &Key) {
    state().choices.remove(key);
}

/// Forgets every in-memory choice and which files were read (files are untouched), so that the
/// next call searches again or re-reads its file. For tests and benchmarks.
pub fn clear() {
    let mut s = state();
    s.choices.clear();
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
        entries: s.choices.len(),
        capacity: s.choices.capacity(),
        evictions: s.choices.evictions(),
    }
}

/// Every searched or file-loaded choice for device `ordinal` (what a save writes).
pub fn entries(ordinal: u32) -> Vec<(Key, Choice)> {
    let mut v: Vec<(Key, Choice)> = state()
        .choices
        .iter()
        .filter(|(k, s)| k.device == ordinal && s.choice.origin != Origin::Fallback)
        .map(|(k, s)| (*k, s.choice))
        .collect();
    v.sort_by_key(|e| e.0);
    v
}

/// Reads `path` into memory once per process and device (later calls return at once). Entries
/// already in memory win over the file's, and the file's fill only the room left under the
/// capacity (the rest stay in the file; a call of their key searches again).
pub(crate) fn ensure_loaded(path: &Path, ordinal: u32, tag: &DeviceTag, capacity: usize) {
    if state().loaded.contains(path, ordinal) {
        return;
    }
    let loaded = load_file(path, tag, ordinal);
    let mut s = state();
    s.loaded.insert(path, ordinal);
    s.choices.raise_capacity(capacity);
    let mut added = 0;
    for (k, c) in loaded.entries {
        let slot = Slot {
            choice: c,
            verified: false,
            descriptors: None,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::gemm::problem::{Alignment, Problem};
    use crate::tune::store::FxHasher;
    use std::hash::BuildHasherDefault;

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
            descriptors: None,
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
        let mut c = HotLru::new(64);
        for i in 0..20_000 {
            c.insert(key(i), slot());
            // Key 0 is used between inserts: it must survive every eviction.
            assert!(c.get(&key(0)).is_some(), "key 0 evicted at insert {i}");
            assert!(c.len() <= 64);
        }
        assert_eq!(c.len(), 64);
        assert_eq!(c.evictions(), 20_000 - 64);
        // The survivors: key 0 and the 63 newest.
        for i in (20_000 - 63)..20_000 {
            assert!(c.get(&key(i)).is_some(), "key {i}");
        }
        assert!(c.get(&key(1)).is_none());
        // Raising never lowers; file entries only fill free room and never replace.
        c.raise_capacity(8);
        assert_eq!(c.capacity(), 64);
        assert!(!c.insert_if_room(key(1), slot()));
        c.raise_capacity(65);
        assert!(
            !c.insert_if_room(key(0), slot()),
            "present keys are not replaced"
        );
        assert!(c.insert_if_room(key(1), slot()));
        assert!(!c.insert_if_room(key(2), slot()));
        assert_eq!(c.len(), 65);
        // Replacing a key evicts nothing.
        assert_eq!(c.insert(key(1), slot()), 0);
    }
}
