//! The process-wide choice stores: what a measurement decided, kept per process so that another
//! Context does not measure again, bounded so that a process with dynamic shapes keeps a bounded
//! amount of host memory.
//!
//! - [`LruStore`]: a [`crate::lru::Lru`] of choices plus the files already read (convolution).
//! - [`HotLru`]: a least-recently-used map shaped for a hot path that looks up on every call
//!   (GEMM): a hit is one FxHash lookup and a store of the use tick, paid back on eviction.
//! - [`LoadedFiles`]: which tuning files were read into a store, per device.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::lru::Lru;

/// Locks a store, ignoring poison (a store holds plain values that a panic cannot leave half
/// written).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The tuning files already read into a store, per (file, device ordinal).
#[derive(Debug, Default)]
pub(crate) struct LoadedFiles(HashSet<(PathBuf, u32)>);

impl LoadedFiles {
    /// Whether `path` was read for device `ordinal`.
    pub(crate) fn contains(&self, path: &Path, ordinal: u32) -> bool {
        self.0.contains(&(path.to_path_buf(), ordinal))
    }

    /// Records that `path` was read for device `ordinal`.
    pub(crate) fn insert(&mut self, path: &Path, ordinal: u32) {
        self.0.insert((path.to_path_buf(), ordinal));
    }

    /// Forgets every file (the next lookup reads its file again).
    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
}

/// A bounded LRU of choices and the files read into it.
pub(crate) struct LruStore<K, V> {
    pub lru: Lru<K, V>,
    pub loaded: LoadedFiles,
}

impl<K: Clone + Hash + Eq, V> LruStore<K, V> {
    /// An empty store of `capacity` entries.
    pub(crate) fn new(capacity: usize) -> Self {
        LruStore {
            lru: Lru::new(capacity),
            loaded: LoadedFiles::default(),
        }
    }

    /// Sets the bound to `capacity` (at least 1) when it differs.
    pub(crate) fn bound(&mut self, capacity: usize) {
        if self.lru.capacity() != capacity.max(1) {
            self.lru.set_capacity(capacity);
        }
    }

    /// Stores a choice under the bound `capacity` (least recently used evicted).
    pub(crate) fn insert(&mut self, key: K, value: V, capacity: usize) {
        self.bound(capacity);
        self.lru.insert(key, value);
    }

    /// Adds the entries read from a file that are not in memory yet (memory wins); returns how
    /// many were added.
    pub(crate) fn fill(&mut self, entries: Vec<(K, V)>, capacity: usize) -> usize {
        self.bound(capacity);
        let mut added = 0;
        for (k, v) in entries {
            if !self.lru.contains(&k) {
                self.lru.insert(k, v);
                added += 1;
            }
        }
        added
    }

    /// Forgets every choice and which files were read.
    pub(crate) fn clear(&mut self) {
        self.lru.clear();
        self.loaded.clear();
    }
}

/// FxHash (rustc's): a multiply-rotate per word. A key is a few integers, so this hashes it in
/// nanoseconds where SipHash would take ten times longer; no untrusted input reaches it.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

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

/// A least-recently-used map of at most `capacity` entries, shaped for a hot path. A hit costs
/// one FxHash lookup and a store of the use tick (~40 ns), where [`crate::lru::Lru`]'s ordered
/// index costs ~10x that per hit; the price is paid on eviction instead, which scans for the
/// oldest tick. Evictions only follow an insert past the capacity, i.e. a measurement
/// (milliseconds), so the scan (microseconds at 4096 entries) never shows.
pub(crate) struct HotLru<K, V> {
    map: FxMap<K, (V, u64)>,
    tick: u64,
    capacity: usize,
    evictions: u64,
}

impl<K: Copy + Hash + Eq, V> HotLru<K, V> {
    /// An empty map of at most `capacity` entries (at least 1).
    pub(crate) fn new(capacity: usize) -> Self {
        HotLru {
            map: FxMap::default(),
            tick: 0,
            capacity: capacity.max(1),
            evictions: 0,
        }
    }

    /// The value of `key`, marked as the most recently used.
    pub(crate) fn get(&mut self, key: &K) -> Option<&V> {
        self.tick += 1;
        let (v, used) = self.map.get_mut(key)?;
        *used = self.tick;
        Some(v)
    }

    /// Mutable access without marking a use.
    pub(crate) fn peek_mut(&mut self, key: &K) -> Option<&mut V> {
        self.map.get_mut(key).map(|(v, _)| v)
    }

    /// Inserts or replaces `key` as the most recently used; evicts the least recently used
    /// entries beyond the capacity (never the one inserted) and returns how many.
    pub(crate) fn insert(&mut self, key: K, value: V) -> usize {
        self.tick += 1;
        self.map.insert(key, (value, self.tick));
        self.shrink()
    }

    /// Inserts `key` only if it is absent and there is room (entries read from a file never
    /// push out choices of this process). Returns whether it was inserted.
    pub(crate) fn insert_if_room(&mut self, key: K, value: V) -> bool {
        if self.map.len() >= self.capacity || self.map.contains_key(&key) {
            return false;
        }
        self.tick += 1;
        self.map.insert(key, (value, self.tick));
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
    pub(crate) fn raise_capacity(&mut self, capacity: usize) {
        self.capacity = self.capacity.max(capacity);
    }

    /// Forgets `key`.
    pub(crate) fn remove(&mut self, key: &K) {
        self.map.remove(key);
    }

    /// Forgets everything (the eviction count stays).
    pub(crate) fn clear(&mut self) {
        self.map.clear();
    }

    /// Entries now.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The bound.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Entries evicted since the map was made.
    pub(crate) fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Every entry, in no order, without marking uses.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.map.iter().map(|(k, (v, _))| (k, v))
    }
}
