//! Which execution of a graph-API plan runs eagerly (`cudnnBackendExecute`, 5–8 µs of host time
//! on the H100's hosts), which is captured into a CUDA graph, and which replays a captured one
//! (one `cuGraphLaunch`, about 2 µs). Pure: no GPU calls; `replay.rs` does the capturing.
//!
//! A plan's executions are told apart by a [`ReplayKey`]: the variant pack's addresses, the
//! workspace's and the by-value scalars — everything the captured work bakes in. The first
//! call with a key runs eagerly and is remembered; the second is captured (and launched); later
//! ones replay. A key seen once and never again costs nothing but its slot. Each plan keeps
//! [`REPLAY_SLOTS`] keys, the least recently used evicted first, so that layers of one shape
//! (which share one plan) each keep their graph. When captures stop paying back (more than
//! twice the slots captured, fewer than [`PAYBACK`] replays per capture: addresses that change
//! faster than the slots hold them) the plan stops capturing for good and runs eagerly.

/// Keys each plan remembers (captured or seen once).
pub const REPLAY_SLOTS: usize = 32;

/// Most addresses a key holds: the longest BatchNorm variant pack (`bn_key::MAX_PACK_ROLES`)
/// and a convolution's three.
pub const MAX_REPLAY_PTRS: usize = 16;

/// Replays each capture must be followed by, on average, once more than twice the slots have
/// been captured; below it the plan stops capturing.
pub const PAYBACK: u64 = 4;

/// What one execution of a plan bakes into a captured graph: its addresses, the workspace's,
/// and its by-value scalars (as bits: `-0.0` and `0.0` differ, as they do to the kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayKey {
    ptrs: [u64; MAX_REPLAY_PTRS],
    len: u8,
    workspace: u64,
    scalars: [u64; 2],
}

impl ReplayKey {
    /// The key of an execution with pack addresses `ptrs`, workspace `workspace` and by-value
    /// scalars `scalars` (zeros for a call without any; f32 scalars widened exactly); `None` when
    /// `ptrs` holds more than [`MAX_REPLAY_PTRS`] addresses (such a call always runs eagerly).
    pub fn new(ptrs: &[u64], workspace: u64, scalars: [f64; 2]) -> Option<ReplayKey> {
        if ptrs.len() > MAX_REPLAY_PTRS {
            return None;
        }
        let mut all = [0u64; MAX_REPLAY_PTRS];
        all[..ptrs.len()].copy_from_slice(ptrs);
        Some(ReplayKey {
            ptrs: all,
            len: ptrs.len() as u8,
            workspace,
            scalars: scalars.map(f64::to_bits),
        })
    }
}

/// What to do with one execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Run it eagerly (a key seen for the first time, or capturing is off).
    Eager,
    /// Capture it (its key's second call), keep the graph with [`ReplaySlots::keep`], launch it.
    Capture,
    /// Launch the graph in this slot ([`ReplaySlots::graph`]).
    Replay(usize),
}

#[derive(Debug)]
struct Slot<G> {
    key: ReplayKey,
    graph: Option<G>,
    last_use: u64,
}

/// One plan's remembered keys and captured graphs `G` (see the module docs).
#[derive(Debug)]
pub struct ReplaySlots<G> {
    slots: Vec<Slot<G>>,
    clock: u64,
    captures: u64,
    replays: u64,
    off: Option<&'static str>,
}

impl<G> Default for ReplaySlots<G> {
    fn default() -> Self {
        ReplaySlots {
            slots: Vec::new(),
            clock: 0,
            captures: 0,
            replays: 0,
            off: None,
        }
    }
}

impl<G> ReplaySlots<G> {
    /// What to do with the execution of `key` (`None`: a key too long to keep: eager). Counts
    /// the use: a replay decided here is counted as made.
    pub fn next(&mut self, key: Option<&ReplayKey>) -> Next {
        let Some(key) = key else {
            return Next::Eager;
        };
        if self.off.is_some() {
            return Next::Eager;
        }
        self.clock += 1;
        let now = self.clock;
        if let Some(i) = self.slots.iter().position(|s| s.key == *key) {
            self.slots[i].last_use = now;
            if self.slots[i].graph.is_some() {
                self.replays += 1;
                return Next::Replay(i);
            }
            if self.captures > 2 * REPLAY_SLOTS as u64 && self.replays < PAYBACK * self.captures {
                let why = "captures do not pay back: this plan's addresses change faster than \
                           its slots keep them";
                tracing::debug!(
                    captures = self.captures,
                    replays = self.replays,
                    "{why}; \
                    the plan's executions run eagerly from now on"
                );
                self.turn_off(why);
                return Next::Eager;
            }
            return Next::Capture;
        }
        let slot = Slot {
            key: *key,
            graph: None,
            last_use: now,
        };
        if self.slots.len() < REPLAY_SLOTS {
            self.slots.push(slot);
        } else if let Some(oldest) = self.slots.iter_mut().min_by_key(|s| s.last_use) {
            *oldest = slot;
        }
        Next::Eager
    }

    /// The graph captured in slot `i` (as [`Next::Replay`] named it).
    pub fn graph(&self, i: usize) -> Option<&G> {
        self.slots.get(i).and_then(|s| s.graph.as_ref())
    }

    /// Keeps `graph`, captured for `key` after [`Next::Capture`].
    pub fn keep(&mut self, key: &ReplayKey, graph: G) {
        self.captures += 1;
        if let Some(s) = self.slots.iter_mut().find(|s| s.key == *key) {
            s.graph = Some(graph);
        }
    }

    /// Stops capturing for good (`why`: a capture failed, or captures did not pay back);
    /// graphs already kept are dropped.
    pub fn turn_off(&mut self, why: &'static str) {
        self.off = Some(why);
        self.slots.clear();
    }

    /// Graphs kept now.
    pub fn captured(&self) -> usize {
        self.slots.iter().filter(|s| s.graph.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(a: u64) -> Option<ReplayKey> {
        ReplayKey::new(&[a, a + 256, a + 512], 4096, [1e-5, 0.1])
    }

    #[test]
    fn a_key_runs_eagerly_then_is_captured_then_replays() {
        let mut s = ReplaySlots::<u32>::default();
        let k = key(1 << 20);
        assert_eq!(s.next(k.as_ref()), Next::Eager);
        assert_eq!(s.next(k.as_ref()), Next::Capture);
        s.keep(k.as_ref().unwrap(), 7);
        assert_eq!(s.next(k.as_ref()), Next::Replay(0));
        assert_eq!(s.graph(0), Some(&7));
        assert_eq!(s.captured(), 1);
    }

    #[test]
    fn every_baked_in_value_tells_keys_apart() {
        let base = ReplayKey::new(&[1, 2, 3], 4096, [1e-5, 0.1]).unwrap();
        assert_ne!(base, ReplayKey::new(&[1, 2, 4], 4096, [1e-5, 0.1]).unwrap());
        assert_ne!(base, ReplayKey::new(&[1, 2, 3], 8192, [1e-5, 0.1]).unwrap());
        assert_ne!(base, ReplayKey::new(&[1, 2, 3], 4096, [1e-3, 0.1]).unwrap());
        assert_ne!(base, ReplayKey::new(&[1, 2, 3], 4096, [1e-5, 0.2]).unwrap());
        assert_ne!(
            base,
            ReplayKey::new(&[1, 2, 3, 0], 4096, [1e-5, 0.1]).unwrap()
        );
        assert_ne!(
            ReplayKey::new(&[1], 0, [0.0, 0.0]).unwrap(),
            ReplayKey::new(&[1], 0, [-0.0, 0.0]).unwrap()
        );
        assert!(ReplayKey::new(&[0; MAX_REPLAY_PTRS + 1], 0, [0.0; 2]).is_none());
        let mut s = ReplaySlots::<u32>::default();
        assert_eq!(s.next(None), Next::Eager);
        assert_eq!(s.next(None), Next::Eager);
    }

    #[test]
    fn layers_sharing_a_plan_each_keep_their_graph() {
        let mut s = ReplaySlots::<u64>::default();
        let layers: Vec<_> = (0..REPLAY_SLOTS as u64).map(|l| key(l << 24)).collect();
        for k in &layers {
            assert_eq!(s.next(k.as_ref()), Next::Eager);
        }
        for (i, k) in layers.iter().enumerate() {
            assert_eq!(s.next(k.as_ref()), Next::Capture);
            s.keep(k.as_ref().unwrap(), i as u64);
        }
        for _ in 0..3 {
            for (i, k) in layers.iter().enumerate() {
                let Next::Replay(at) = s.next(k.as_ref()) else {
                    panic!("layer {i} is not replayed");
                };
                assert_eq!(s.graph(at), Some(&(i as u64)));
            }
        }
    }

    #[test]
    fn more_layers_than_slots_in_turn_run_eagerly_and_capture_nothing() {
        let mut s = ReplaySlots::<u64>::default();
        let layers: Vec<_> = (0..=REPLAY_SLOTS as u64).map(|l| key(l << 24)).collect();
        for _ in 0..4 {
            for k in &layers {
                assert_eq!(s.next(k.as_ref()), Next::Eager);
            }
        }
        assert_eq!(s.captured(), 0);
    }

    #[test]
    fn captures_that_do_not_pay_back_stop_capturing() {
        let mut s = ReplaySlots::<u64>::default();
        let mut captures = 0u64;
        // Each address pair is used exactly twice: every second call captures, none replays.
        for a in 0..1000u64 {
            let k = key(a << 24);
            assert_eq!(s.next(k.as_ref()), Next::Eager);
            match s.next(k.as_ref()) {
                Next::Capture => {
                    captures += 1;
                    s.keep(k.as_ref().unwrap(), a);
                }
                Next::Eager => break,
                Next::Replay(_) => panic!("nothing was captured for this key"),
            }
        }
        assert_eq!(captures, 2 * REPLAY_SLOTS as u64 + 1);
        assert_eq!(s.captured(), 0);
        assert_eq!(s.next(key(5).as_ref()), Next::Eager);
        assert_eq!(s.next(key(5).as_ref()), Next::Eager);
    }

    #[test]
    fn a_failed_capture_turns_capturing_off_and_drops_the_graphs() {
        let mut s = ReplaySlots::<u64>::default();
        let k = key(1);
        s.next(k.as_ref());
        s.next(k.as_ref());
        s.keep(k.as_ref().unwrap(), 1);
        s.turn_off("cuDNN refused");
        assert_eq!(s.captured(), 0);
        assert_eq!(s.next(k.as_ref()), Next::Eager);
        assert_eq!(s.next(k.as_ref()), Next::Eager);
    }
}
