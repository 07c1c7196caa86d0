//! The search's scratch memory: one grow-only device allocation per [`Context`], kept between
//! searches, so that only a search that needs more than any earlier one on the Context pays an
//! allocation (the driver maps new pages: the costly part of a large allocation in a fresh
//! process). Released with the Context, or early with [`release`].
//!
//! The search places its regions in it with [`scratch_layout`] (each at the caller's alignment)
//! and records which regions hold a pseudo-random pattern ([`Fills`]), so that a later search
//! whose A or B has the same pattern at the same place does not write it again.
//!
//! Every size here is computed with checked arithmetic: a problem whose operands are near
//! `usize::MAX` bytes must fail with an error, never wrap into a small allocation that the fill
//! kernels then overrun (release builds do not trap on overflow).
#![deny(clippy::arithmetic_side_effects)]

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaSlice, DevicePtrMut};

use super::problem::MAX_ALIGNMENT;
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{CallExt, Error, Result};

/// Allocation granularity (bytes): the scratch grows to a multiple of this.
pub(crate) const GRANULE: usize = 2 << 20;

/// Byte offsets of regions of `(bytes, alignment)` in one allocation whose base is 256-byte
/// aligned: each region starts at the next multiple of 256 plus its alignment when that is below
/// 256, so that its start has exactly that alignment (the caller's, as cuBLASLt sees it). Returns
/// the offsets and the total size, or an error when the total does not fit in `usize`.
pub(crate) fn scratch_layout(regions: &[(usize, u16)]) -> Result<(Vec<usize>, usize)> {
    let max = MAX_ALIGNMENT as usize;
    let mut offsets = Vec::with_capacity(regions.len());
    let mut cursor = 0usize;
    for &(bytes, align) in regions {
        let base = round_up(cursor, max)?;
        let start = if (align as usize) < max {
            base.checked_add(align as usize).ok_or_else(too_large)?
        } else {
            base
        };
        offsets.push(start);
        cursor = start.checked_add(bytes).ok_or_else(too_large)?;
    }
    Ok((offsets, round_up(cursor, max)?))
}

/// `elems` elements of `elem_size` bytes, or an error when that does not fit in `usize`.
pub(crate) fn region_bytes(elems: usize, elem_size: usize) -> Result<usize> {
    elems.checked_mul(elem_size).ok_or_else(too_large)
}

/// The size a scratch of at least `bytes` bytes is allocated with (whole granules).
pub(crate) fn rounded(bytes: usize) -> Result<usize> {
    round_up(bytes.max(1), GRANULE)
}

/// `n` rounded up to a multiple of `to` (non-zero), or an error when that overflows.
fn round_up(n: usize, to: usize) -> Result<usize> {
    n.checked_next_multiple_of(to).ok_or_else(too_large)
}

fn too_large() -> Error {
    Error::invalid(
        "problem",
        "the GEMM search's operands need more scratch memory than the address space holds",
    )
}

/// One region filled with the pseudo-random pattern of `seed` (a function of the element index
/// and the seed only, see `kernels/gemm_search.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fill {
    /// Byte offset of the first element in the scratch.
    pub offset: usize,
    /// Elements.
    pub elems: usize,
    /// Element type.
    pub dtype: DType,
    /// Pattern seed.
    pub seed: u64,
}

impl Fill {
    /// One past the last byte (saturating: a record that large overlaps everything after it).
    fn end(&self) -> usize {
        self.offset
            .saturating_add(self.elems.saturating_mul(self.dtype.size()))
    }

    /// Whether the memory this fill wrote already holds what `want` would write: the same
    /// pattern from the same start, at least as long (the pattern of element `i` does not depend
    /// on the length).
    pub(crate) fn covers(&self, want: &Fill) -> bool {
        self.offset == want.offset
            && self.dtype == want.dtype
            && self.seed == want.seed
            && self.elems >= want.elems
    }

    fn overlaps(&self, start: usize, end: usize) -> bool {
        self.offset < end && start < self.end()
    }
}

/// Which scratch regions hold which pattern, as far as the search knows: every write to the
/// scratch other than a recorded fill must be declared with [`Fills::overwritten`] before it is
/// queued.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Fills(Vec<Fill>);

impl Fills {
    /// Whether `want` must be written (no valid record covers it).
    pub(crate) fn needed(&self, want: &Fill) -> bool {
        !self.0.iter().any(|f| f.covers(want))
    }

    /// Forgets every record that overlaps bytes `start..start + bytes`.
    pub(crate) fn overwritten(&mut self, start: usize, bytes: usize) {
        let end = start.saturating_add(bytes);
        self.0.retain(|f| !f.overlaps(start, end));
    }

    /// Records a fill (replacing the records it overwrites).
    pub(crate) fn filled(&mut self, f: Fill) {
        self.overwritten(f.offset, f.elems.saturating_mul(f.dtype.size()));
        self.0.push(f);
    }

    /// Forgets everything (new memory, or contents no longer trusted).
    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
}

/// The scratch of one Context.
#[derive(Default)]
pub(crate) struct Scratch {
    buf: Option<CudaSlice<u8>>,
    /// What the buffer holds.
    pub(crate) fills: Fills,
}

impl Scratch {
    /// Bytes currently allocated.
    pub(crate) fn bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }

    /// A 256-byte-aligned base pointer of at least `bytes` bytes, valid while this scratch is
    /// locked and for work queued on the Context's stream meanwhile; and how many bytes were
    /// allocated to provide it (0 when the scratch was large enough). Growing frees the old
    /// buffer in stream order (after the work queued on it) and forgets the fills.
    pub(crate) fn ensure(&mut self, ctx: &Context, bytes: usize) -> Result<(u64, usize)> {
        let mut allocated = 0;
        if self.bytes() < bytes || self.buf.is_none() {
            let size = rounded(bytes)?;
            self.buf = None;
            self.fills.clear();
            // SAFETY: scratch memory; the search initialises every element it reads (see
            // search.rs: fills, copies, or GEMM outputs before comparisons).
            let buf = unsafe { ctx.stream().alloc::<u8>(size) }
                .call("cuMemAllocAsync (GEMM search scratch)")?;
            tracing::debug!(bytes = size, "GEMM search scratch grown");
            self.buf = Some(buf);
            allocated = size;
        }
        match self.buf.as_mut() {
            Some(buf) => {
                let (ptr, _sync) = buf.device_ptr_mut(ctx.stream());
                Ok((ptr, allocated))
            }
            None => Err(crate::error::Error::NotSupported(
                "GEMM search scratch vanished".into(),
            )),
        }
    }

    /// Frees the buffer (in stream order); returns the bytes it held.
    fn release(&mut self) -> usize {
        let n = self.bytes();
        self.buf = None;
        self.fills.clear();
        n
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ScratchKey;

/// The scratch of `ctx` (created empty at first use).
pub(crate) fn of(ctx: &Context) -> Result<Arc<Mutex<Scratch>>> {
    ctx.memo(ScratchKey, || Ok(Arc::new(Mutex::new(Scratch::default()))))
}

/// Locks a scratch (a panic elsewhere leaves plain data behind: go on).
pub(crate) fn lock(s: &Mutex<Scratch>) -> MutexGuard<'_, Scratch> {
    match s.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Bytes of device memory the GEMM search keeps for `ctx` between searches (0 before its first
/// search or after [`release`]).
pub fn held_bytes(ctx: &Context) -> Result<usize> {
    let cell = of(ctx)?;
    let n = lock(&cell).bytes();
    Ok(n)
}

/// Frees the GEMM search's scratch memory of `ctx` (in stream order, after queued work; waits
/// for a search running on another thread to finish). The next search allocates again. Returns
/// the bytes freed.
pub fn release(ctx: &Context) -> Result<usize> {
    let cell = of(ctx)?;
    let n = lock(&cell).release();
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_regions_have_the_callers_alignment() {
        let (off, total) = scratch_layout(&[(1000, 256), (10, 2), (300, 16), (300, 16)]).unwrap();
        assert_eq!(off, vec![0, 1024 + 2, 1280 + 16, 1792 + 16]);
        assert_eq!(total, 2304);
        for (o, a) in off.iter().zip([256usize, 2, 16, 16]) {
            let got = 1usize << (o | 256).trailing_zeros();
            assert_eq!(got, a, "offset {o}");
        }
        // Regions never overlap.
        let sizes = [1000, 10, 300, 300];
        for i in 1..4 {
            assert!(off[i] >= off[i - 1] + sizes[i - 1]);
        }
        assert_eq!(scratch_layout(&[]).unwrap(), (vec![], 0));
    }

    /// `nnfuse tune --gemm 1669142830,1,1,1381453383 --dtype f32`: each operand is below
    /// `usize::MAX` but their sum is not; unchecked, the layout wrapped to 13 GB with an operand
    /// of 2^63 bytes, and the fills wrote past the allocation.
    #[test]
    #[allow(clippy::arithmetic_side_effects)]
    fn layouts_that_overflow_are_errors_not_wrapped_sizes() {
        let a = region_bytes(1669142830 * 1381453383, 4).unwrap();
        let e = scratch_layout(&[(a, 4), (a, 4), (a, 4), (a, 4)]).unwrap_err();
        assert_eq!(e.argument(), Some("problem"), "{e}");
        assert!(region_bytes(usize::MAX / 2 + 1, 2).is_err());
        // The alignment padding or the final rounding alone overflowing.
        assert!(scratch_layout(&[(usize::MAX - 3, 16)]).is_err());
        assert!(scratch_layout(&[(usize::MAX - 100, 256)]).is_err());
        assert!(scratch_layout(&[(1, 256), (usize::MAX - 300, 256)]).is_err());
        // The largest that fits still works.
        let (_, total) = scratch_layout(&[(usize::MAX - 511, 256)]).unwrap();
        assert_eq!(total, usize::MAX - 511);
    }

    #[test]
    fn sizes_round_to_granules() {
        assert_eq!(rounded(0).unwrap(), GRANULE);
        assert_eq!(rounded(1).unwrap(), GRANULE);
        assert_eq!(rounded(GRANULE).unwrap(), GRANULE);
        assert_eq!(rounded(GRANULE + 1).unwrap(), 2 * GRANULE);
        // Rounding the largest requests up would wrap to a small size.
        assert!(rounded(usize::MAX - GRANULE + 2).is_err());
        assert!(rounded(usize::MAX).is_err());
    }

    fn fill(offset: usize, elems: usize, dtype: DType, seed: u64) -> Fill {
        Fill {
            offset,
            elems,
            dtype,
            seed,
        }
    }

    #[test]
    fn fills_are_reused_only_when_identical_or_a_prefix() {
        let mut f = Fills::default();
        let a = fill(0, 1000, DType::F16, 1);
        let b = fill(2048 + 2, 500, DType::F16, 2);
        assert!(f.needed(&a));
        f.filled(a);
        f.filled(b);
        assert!(!f.needed(&a));
        assert!(!f.needed(&b));
        // A shorter region with the same start and pattern: already there.
        assert!(!f.needed(&fill(0, 10, DType::F16, 1)));
        // Longer, elsewhere, another seed or another type: not.
        assert!(f.needed(&fill(0, 1001, DType::F16, 1)));
        assert!(f.needed(&fill(256, 10, DType::F16, 1)));
        assert!(f.needed(&fill(0, 10, DType::F16, 2)));
        assert!(f.needed(&fill(0, 10, DType::BF16, 1)));
        assert!(f.needed(&fill(0, 10, DType::F32, 1)));
        // A write over one byte of B forgets B, not A.
        f.overwritten(2048 + 2 + 999, 1);
        assert!(f.needed(&b));
        assert!(!f.needed(&a));
        // A write that ends where A starts, or starts where it ends, leaves it alone.
        f.overwritten(2000, 0);
        f.overwritten(2000, 48);
        assert!(!f.needed(&a));
        // A new fill over part of A replaces A's record.
        f.filled(fill(1000, 100, DType::F32, 3));
        assert!(f.needed(&a));
        assert!(!f.needed(&fill(1000, 100, DType::F32, 3)));
        f.clear();
        assert!(f.needed(&fill(1000, 100, DType::F32, 3)));
    }
}
