//! A bounded map that evicts the least recently used entry: the one shape of every nnfuse cache
//! (plans, descriptors, GEMM and convolution choices), so that a framework with dynamic shapes
//! that runs for days keeps a bounded amount of host (and descriptor) memory.
//!
//! Values are usually `Arc`s: evicting an entry drops the cache's reference only, so a plan that
//! a caller still holds stays valid and is freed when the caller lets go.
//!
//! A thin layer over the `lru` crate's `LruCache` (O(1) hit: one hash lookup and a list splice):
//! it adds what nnfuse's caches report — the entries an insert or a smaller capacity evicts
//! (so that callers can log them) and the count of evictions. Pure data structure, no GPU.

use std::hash::Hash;
use std::num::NonZeroUsize;

/// A map of at most [`Lru::capacity`] entries; inserting past it evicts the entry used least
/// recently (a `get` hit counts as a use).
pub struct Lru<K, V> {
    inner: lru::LruCache<K, V>,
    evictions: u64,
}

impl<K: Hash + Eq + std::fmt::Debug, V: std::fmt::Debug> std::fmt::Debug for Lru<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lru")
            .field("len", &self.inner.len())
            .field("capacity", &self.inner.cap())
            .field("evictions", &self.evictions)
            .finish()
    }
}

impl<K: Hash + Eq + Clone, V: Clone> Clone for Lru<K, V> {
    fn clone(&self) -> Self {
        Lru {
            inner: self.inner.clone(),
            evictions: self.evictions,
        }
    }
}

/// `capacity` as the crate wants it: at least 1.
fn non_zero(capacity: usize) -> NonZeroUsize {
    NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN)
}

impl<K: Clone + Hash + Eq, V> Lru<K, V> {
    /// An empty map holding at most `capacity` entries (at least 1).
    pub fn new(capacity: usize) -> Self {
        Lru {
            inner: lru::LruCache::new(non_zero(capacity)),
            evictions: 0,
        }
    }

    /// The value under `key`, marking it as the most recently used.
    pub fn get(&mut self, key: &K) -> Option<&V> {
        self.inner.get(key)
    }

    /// The value under `key` without marking it used.
    pub fn peek(&self, key: &K) -> Option<&V> {
        self.inner.peek(key)
    }

    /// Mutable access without marking it used.
    pub fn peek_mut(&mut self, key: &K) -> Option<&mut V> {
        self.inner.peek_mut(key)
    }

    /// Whether `key` is present (not a use).
    pub fn contains(&self, key: &K) -> bool {
        self.inner.contains(key)
    }

    /// Inserts or replaces `key` as the most recently used entry; returns the entries evicted to
    /// stay within the capacity (never the one just inserted).
    pub fn insert(&mut self, key: K, value: V) -> Vec<(K, V)> {
        if self.inner.contains(&key) {
            // A replacement: `put` refreshes its use and evicts nothing.
            self.inner.put(key, value);
            return Vec::new();
        }
        match self.inner.push(key, value) {
            Some(evicted) => {
                self.evictions += 1;
                vec![evicted]
            }
            None => Vec::new(),
        }
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        self.inner.pop(key)
    }

    /// Changes the capacity (at least 1), evicting the oldest entries beyond it.
    pub fn set_capacity(&mut self, capacity: usize) -> Vec<(K, V)> {
        let cap = non_zero(capacity);
        let mut out = Vec::new();
        while self.inner.len() > cap.get() {
            let Some(kv) = self.inner.pop_lru() else {
                break;
            };
            self.evictions += 1;
            out.push(kv);
        }
        self.inner.resize(cap);
        out
    }

    /// The most entries kept.
    pub fn capacity(&self) -> usize {
        self.inner.cap().get()
    }

    /// Entries now.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Whether the map is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// Entries evicted for capacity since creation.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Drops every entry.
    pub fn clear(&mut self) {
        self.inner.clear();
    }

    /// Every entry, least recently used first (not a use).
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.inner.iter().rev()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut l = Lru::new(2);
        assert!(l.insert(1, "a").is_empty());
        assert!(l.insert(2, "b").is_empty());
        assert_eq!(l.get(&1), Some(&"a")); // 1 is now newer than 2
        assert_eq!(l.insert(3, "c"), vec![(2, "b")]);
        assert!(l.contains(&1) && l.contains(&3) && !l.contains(&2));
        assert_eq!(l.evictions(), 1);
        // peek does not refresh: 1 stays older than 3.
        assert_eq!(l.peek(&1), Some(&"a"));
        assert_eq!(l.insert(4, "d"), vec![(1, "a")]);
        let keys: Vec<_> = l.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, vec![3, 4]);
    }

    #[test]
    fn replace_refreshes_and_never_evicts_itself() {
        let mut l = Lru::new(1);
        l.insert("k", 1);
        assert!(l.insert("k", 2).is_empty());
        assert_eq!(l.peek(&"k"), Some(&2));
        assert_eq!(l.insert("j", 3), vec![("k", 2)]);
        assert_eq!(l.len(), 1);
        assert_eq!(l.remove(&"j"), Some(3));
        assert!(l.is_empty());
        assert_eq!(Lru::<u8, u8>::new(0).capacity(), 1);
    }

    #[test]
    fn shrinking_capacity_evicts_oldest() {
        let mut l = Lru::new(10);
        for i in 0..10 {
            l.insert(i, i * 10);
        }
        l.get(&0);
        let gone: Vec<_> = l.set_capacity(3).into_iter().map(|(k, _)| k).collect();
        assert_eq!(gone, vec![1, 2, 3, 4, 5, 6, 7]);
        let keys: Vec<_> = l.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, vec![8, 9, 0]);
    }

    /// Against a naive model (a Vec in use order) under random inserts, gets and removes.
    #[test]
    fn matches_a_naive_model() {
        let mut l = Lru::new(5);
        let mut model: Vec<(u64, u64)> = Vec::new(); // least recent first
        let mut x = 99u64;
        for step in 0..20_000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let k = (x >> 33) % 11;
            match (x >> 17) % 4 {
                0 | 1 => {
                    let evicted = l.insert(k, step);
                    let mut want = Vec::new();
                    if let Some(i) = model.iter().position(|(mk, _)| *mk == k) {
                        model.remove(i);
                    }
                    model.push((k, step));
                    while model.len() > 5 {
                        want.push(model.remove(0));
                    }
                    assert_eq!(evicted, want, "step {step}");
                }
                2 => {
                    let got = l.get(&k).copied();
                    let want = model.iter().position(|(mk, _)| *mk == k).map(|i| {
                        let e = model.remove(i);
                        model.push(e);
                        e.1
                    });
                    assert_eq!(got, want, "step {step}");
                }
                _ => {
                    let got = l.remove(&k);
                    let want = model
                        .iter()
                        .position(|(mk, _)| *mk == k)
                        .map(|i| model.remove(i).1);
                    assert_eq!(got, want, "step {step}");
                }
            }
            let order: Vec<_> = l.iter().map(|(k, v)| (*k, *v)).collect();
            assert_eq!(order, model, "step {step}");
        }
    }

    #[test]
    fn order_and_map_stay_consistent_under_churn() {
        let mut l = Lru::new(7);
        let mut x = 12345u64;
        for _ in 0..10_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let k = (x >> 33) % 23;
            match (x >> 20) % 3 {
                0 => {
                    l.insert(k, k);
                }
                1 => {
                    l.get(&k);
                }
                _ => {
                    l.remove(&k);
                }
            }
            assert!(l.len() <= 7);
            assert_eq!(l.iter().count(), l.len());
        }
    }
}
