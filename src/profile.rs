//! Host-time profile of nnfuse's cached calls, stage by stage: where the microseconds of a call
//! go before the GPU can start (validation, cache lookups, cudarc's stream events, the library
//! workspace, the vendor call, kernel launches).
//!
//! Off unless `NNFUSE_PROFILE_HOST=1` (read once per process) or [`set_enabled`]: then every
//! [`enter`] guard is one relaxed atomic load and a branch. On, each thread keeps its own
//! accumulators (no locks); a guard credits the time since the last stage change to the stage
//! that was running, so nested stages are counted exclusively (a `Call` around a `Vendor` gets
//! only its own time) and the stages of one call add up to the call's time inside guards.
//!
//! Use: `crate::profile::stage!(Validate);` at the top of a block times the rest of the block.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

/// One stage of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The public entry point's own code not inside another stage (argument structs, dispatch).
    Call,
    /// Argument checks: devices, lengths, overlaps, scalars.
    Validate,
    /// cudarc's per-buffer stream events (`device_ptr` waits, `SyncOnDrop` records).
    Events,
    /// Plan, choice and kernel-cache lookups.
    Lookup,
    /// The Context's lock, the library handle and the workspace.
    Workspace,
    /// Descriptors and cuDNN variant packs made or checked for this call.
    Pack,
    /// Device memory allocated or recycled for this call (saved state, masks, temporaries).
    Alloc,
    /// The vendor library call itself (cuDNN, cuBLAS, cuBLASLt).
    Vendor,
    /// nnfuse's own kernel launches (grid sizing, arguments, `cuLaunchKernel`).
    Launch,
}

/// Number of stages.
pub const STAGES: usize = 9;

impl Stage {
    /// Every stage, in report order.
    pub const ALL: [Stage; STAGES] = [
        Stage::Call,
        Stage::Validate,
        Stage::Events,
        Stage::Lookup,
        Stage::Workspace,
        Stage::Pack,
        Stage::Alloc,
        Stage::Vendor,
        Stage::Launch,
    ];

    /// Short name (reports, JSON keys).
    pub const fn name(self) -> &'static str {
        match self {
            Stage::Call => "call",
            Stage::Validate => "validate",
            Stage::Events => "events",
            Stage::Lookup => "lookup",
            Stage::Workspace => "workspace",
            Stage::Pack => "pack",
            Stage::Alloc => "alloc",
            Stage::Vendor => "vendor",
            Stage::Launch => "launch",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

const UNREAD: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(UNREAD);

/// Whether profiling is on (the environment is read at the first call).
#[inline]
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        OFF => false,
        ON => true,
        _ => read_env(),
    }
}

#[cold]
fn read_env() -> bool {
    let on = std::env::var_os("NNFUSE_PROFILE_HOST").is_some_and(|v| v == "1");
    // A concurrent `set_enabled` wins over the environment.
    let _ = STATE.compare_exchange(
        UNREAD,
        if on { ON } else { OFF },
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    STATE.load(Ordering::Relaxed) == ON
}

/// Turns profiling on or off for the whole process (benchmarks), overriding the environment.
pub fn set_enabled(on: bool) {
    STATE.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

/// Per-stage totals: nanoseconds and how many times the stage was entered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Nanoseconds credited to each stage (index: position in [`Stage::ALL`]).
    pub ns: [u64; STAGES],
    /// Times each stage was entered.
    pub entries: [u64; STAGES],
}

impl Totals {
    /// Nanoseconds of `s`.
    pub fn ns_of(&self, s: Stage) -> u64 {
        self.ns[s.index()]
    }

    /// Entries of `s`.
    pub fn entries_of(&self, s: Stage) -> u64 {
        self.entries[s.index()]
    }

    /// Nanoseconds over every stage.
    pub fn total_ns(&self) -> u64 {
        self.ns.iter().sum()
    }
}

/// The accounting, on a clock the caller passes (pure: tested without timers).
#[derive(Debug, Default)]
struct Acc {
    totals: Totals,
    /// The stage running now (`None`: outside every guard, time not credited).
    current: Option<Stage>,
    /// When `current` started, ns on the thread's clock.
    since: u64,
}

impl Acc {
    /// Credits the time since the last change to the running stage and makes `to` the running
    /// one (counting an entry when `enter`); returns the stage that was running.
    fn switch(&mut self, to: Option<Stage>, now: u64, enter: bool) -> Option<Stage> {
        if let Some(s) = self.current {
            self.totals.ns[s.index()] += now.saturating_sub(self.since);
        }
        if let (Some(s), true) = (to, enter) {
            self.totals.entries[s.index()] += 1;
        }
        let prev = self.current;
        self.current = to;
        self.since = now;
        prev
    }
}

thread_local! {
    static ACC: RefCell<(Option<Instant>, Acc)> = RefCell::new((None, Acc::default()));
}

fn with_acc<R>(f: impl FnOnce(u64, &mut Acc) -> R) -> R {
    ACC.with(|cell| {
        let mut g = cell.borrow_mut();
        let (base, acc) = &mut *g;
        let base = *base.get_or_insert_with(Instant::now);
        let now = base.elapsed().as_nanos() as u64;
        f(now, acc)
    })
}

/// While alive, the thread's time is credited to one stage (see the module docs).
#[must_use = "the stage ends when the guard drops"]
pub struct Guard {
    prev: Option<Stage>,
    active: bool,
}

/// Starts `stage` on this thread; the guard ends it (returning to the enclosing stage).
#[inline]
pub fn enter(stage: Stage) -> Guard {
    if !enabled() {
        return Guard {
            prev: None,
            active: false,
        };
    }
    let prev = with_acc(|now, acc| acc.switch(Some(stage), now, true));
    Guard { prev, active: true }
}

impl Drop for Guard {
    #[inline]
    fn drop(&mut self) {
        if self.active {
            let prev = self.prev;
            with_acc(|now, acc| acc.switch(prev, now, false));
        }
    }
}

/// This thread's totals since the last [`take`], reset to zero.
pub fn take() -> Totals {
    with_acc(|now, acc| {
        let cur = acc.current;
        acc.switch(cur, now, false);
        std::mem::take(&mut acc.totals)
    })
}

/// Times the rest of the enclosing block as `Stage::$s` (no cost beyond a flag read when off).
macro_rules! stage {
    ($s:ident) => {
        let _profile_guard = $crate::profile::enter($crate::profile::Stage::$s);
    };
}
pub(crate) use stage;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_stages_are_counted_exclusively() {
        let mut a = Acc::default();
        // Outside any stage: nothing is credited.
        let p0 = a.switch(Some(Stage::Call), 100, true);
        assert_eq!(p0, None);
        let p1 = a.switch(Some(Stage::Vendor), 130, true); // Call ran 30
        a.switch(p1, 180, false); // Vendor ran 50, back to Call
        a.switch(p0, 190, false); // Call ran 10 more
        a.switch(None, 500, false); // outside: not credited
        assert_eq!(a.totals.ns_of(Stage::Call), 40);
        assert_eq!(a.totals.ns_of(Stage::Vendor), 50);
        assert_eq!(a.totals.total_ns(), 90);
        assert_eq!(a.totals.entries_of(Stage::Call), 1);
        assert_eq!(a.totals.entries_of(Stage::Vendor), 1);
        assert_eq!(a.totals.entries_of(Stage::Validate), 0);
    }

    #[test]
    fn a_clock_going_backwards_credits_nothing() {
        let mut a = Acc::default();
        a.switch(Some(Stage::Lookup), 100, true);
        a.switch(None, 90, false);
        assert_eq!(a.totals.ns_of(Stage::Lookup), 0);
    }

    #[test]
    fn names_are_distinct_and_indices_follow_all() {
        for (i, s) in Stage::ALL.iter().enumerate() {
            assert_eq!(s.index(), i);
            for t in &Stage::ALL[..i] {
                assert_ne!(s.name(), t.name());
            }
        }
    }

    #[test]
    fn guards_nest_and_take_resets() {
        set_enabled(true);
        let _ = take();
        {
            stage!(Call);
            {
                stage!(Validate);
            }
        }
        let t = take();
        assert_eq!(t.entries_of(Stage::Call), 1);
        assert_eq!(t.entries_of(Stage::Validate), 1);
        assert_eq!(take(), Totals::default());
    }
}
