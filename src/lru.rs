//! A bounded map that evicts the least recently used entry: the one shape of every nnfuse cache
//! (plans, descriptors, GEMM and convolution choices), so that a framework with dynamic shapes
//! that runs for days keeps a bounded amount of host (and descriptor) memory.
//!
//! Values are usually `Arc`s: evicting an entry drops the cache's reference only, so a plan that
//! a caller still holds stays valid and is freed when the caller lets go.
//!
//! Pure data structure, no GPU. A hit (`get`) is one hash lookup and a counter update: the use
//! order is repaired lazily, when an eviction finds that the oldest recorded use of an entry is
//! stale, so that the hot path of every cached plan lookup stays in the tens of nanoseconds.
//! `insert` is `O(log n)` amortised.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// A map of at most [`Lru::capacity`] entries; inserting past it evicts the entry used least
/// recently (a `get` hit counts as a use).
#[derive(Debug, Clone)]
pub struct Lru<K, V> {
    /// Value and the tick of its latest use.
    map: HashMap<K, (V, u64)>,
    /// Tick → key, oldest first: one entry per key, at a tick <= its latest use (stale after a
    /// `get`, repaired when the entry reaches the front).
    order: BTreeMap<u64, K>,
    tick: u64,
    capacity: usize,
    evictions: u64,
}

impl<K: Clone + Hash + Eq, V> Lru<K, V> {
    /// An empty map holding at most `capacity` entries (at least 1).
    pub fn new(capacity: usize) -> Self {
        Lru {
            map: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
            capacity: capacity.max(1),
            evictions: 0,
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// The value under `key`, marking it as the most recently used.
    pub fn get(&mut self, key: &K) -> Option<&V> {
        self.tick += 1;
        let t = self.tick;
        let (v, used) = self.map.get_mut(key)?;
        *used = t;
        Some(v)
    }

    /// The value under `key` without marking it used.
    pub fn peek(&self, key: &K) -> Option<&V> {
        self.map.get(key).map(|(v, _)| v)
    }

    /// Mutable access without marking it used.
    pub fn peek_mut(&mut self, key: &K) -> Option<&mut V> {
        self.map.get_mut(key).map(|(v, _)| v)
    }

    /// Whether `key` is present (not a use).
    pub fn contains(&self, key: &K) -> bool {
        self.map.contains_key(key)
    }

    /// Inserts or replaces `key` as the most recently used entry; returns the entries evicted to
    /// stay within the capacity (never the one just inserted).
    pub fn insert(&mut self, key: K, value: V) -> Vec<(K, V)> {
        let t = self.next_tick();
        if let Some((v, used)) = self.map.get_mut(&key) {
            // Its order entry stays where it is (a tick <= t): repaired lazily like a `get`.
            *v = value;
            *used = t;
            return Vec::new();
        }
        self.order.insert(t, key.clone());
        self.map.insert(key, (value, t));
        self.shrink_to(self.capacity)
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let (v, _) = self.map.remove(key)?;
        // Its order entry sits at some tick <= its latest use; find it by key (rare operation).
        if let Some(t) = self.order.iter().find(|(_, k)| *k == key).map(|(t, _)| *t) {
            self.order.remove(&t);
        }
        Some(v)
    }

    /// Pops the least recently used entry, repairing stale order entries on the way.
    fn pop_oldest(&mut self) -> Option<(K, V)> {
        loop {
            let (t, k) = self.order.pop_first()?;
            match self.map.get(&k) {
                Some((_, used)) if *used == t => {
                    let (v, _) = self.map.remove(&k)?;
                    return Some((k, v));
                }
                // Used since this entry was recorded: move it to its latest use and go on.
                Some((_, used)) => {
                    let used = *used;
                    self.order.insert(used, k);
                }
                None => {}
            }
        }
    }

    fn shrink_to(&mut self, cap: usize) -> Vec<(K, V)> {
        let mut out = Vec::new();
        while self.map.len() > cap {
            let Some(kv) = self.pop_oldest() else {
                break;
            };
            self.evictions += 1;
            out.push(kv);
        }
        out
    }

    /// Changes the capacity (at least 1), evicting the oldest entries beyond it.
    pub fn set_capacity(&mut self, capacity: usize) -> Vec<(K, V)> {
        self.capacity = capacity.max(1);
        self.shrink_to(self.capacity)
    }

    /// The most entries kept.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Entries now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the map is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Entries evicted for capacity since creation.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Drops every entry.
    pub fn clear(&mut self) {
        self.map.clear();
        self.order.clear();
    }

    /// Every entry, least recently used first (not a use).
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        let mut all: Vec<_> = self.map.iter().map(|(k, (v, t))| (*t, k, v)).collect();
        all.sort_unstable_by_key(|(t, _, _)| *t);
        all.into_iter().map(|(_, k, v)| (k, v))
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
            assert_eq!(l.order.len(), l.map.len(), "one order entry per key");
        }
    }
}
