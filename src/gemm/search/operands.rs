//! Where a search's GEMMs read and write: the caller's operands (A and B read in place, C in
//! scratch as needed) or pseudo-random operands in the Context's scratch, and how a C region is
//! initialised before a GEMM writes it.

use std::time::Instant;

use cudarc::driver::CudaFunction;

use super::kernels::uniform_raw;
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{CallExt, Result};
use crate::gemm::lt::Ptrs;
use crate::gemm::problem::{Alignment, Spans};
use crate::gemm::scratch::{region_bytes, scratch_layout, Fill, Scratch};
use crate::tune::race::ms_since;

/// Seeds of the pseudo-random scratch operands.
pub(crate) const SEED_A: u64 = 0x5eed_0001;
pub(crate) const SEED_B: u64 = 0x5eed_0002;
pub(crate) const SEED_C: u64 = 0x5eed_0003;

/// What a C region must hold before a GEMM of the search writes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum CInit {
    /// Nothing: beta is 0 and the GEMM writes every element that is compared.
    Nothing,
    /// Zeros: beta is 0 and C has gaps (compared, never written), which must compare equal.
    Zeros,
    /// The pseudo-random pattern of this seed (scratch operands, beta != 0).
    Uniform(u64),
    /// A copy of the caller's C at this pointer (its values when beta != 0, its gaps otherwise).
    Copy(u64),
}

/// How a C region every element of which the GEMM writes is prepared: not at all, except
/// under compute-sanitizer (`NNFUSE_UNDER_SANITIZER=1`), where it is zeroed first. initcheck
/// does not see cuBLASLt's writes on the H100 (its tensor-memory stores, presumably), so every
/// comparison of a result then reads "uninitialized" memory: 1.57 million reports per search
/// test, which slowed eight initcheck runs past 540 s (docs/RELIABILITY.md).
fn unwritten() -> CInit {
    if crate::config::under_sanitizer() {
        CInit::Zeros
    } else {
        CInit::Nothing
    }
}

/// Where a search's GEMMs read and write.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operands {
    pub a: u64,
    pub b: u64,
    /// Receives the cuBLAS default's result (the caller's own C when the search runs on the
    /// caller's operands with beta == 0).
    pub reference: u64,
    /// Receives each candidate's result, and every timed launch's.
    pub candidate: u64,
    /// How `reference` and `candidate` are initialised before a GEMM writes them.
    pub init: CInit,
    /// The old C (`beta * C` is the part of the result that is not the product), when it is the
    /// caller's; 0 otherwise.
    pub old_c: u64,
}

/// What decides where a search's operands go.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub dtype: DType,
    pub spans: Spans,
    /// The key's alignment (the caller's), which scratch regions reproduce.
    pub align: Alignment,
    pub beta_zero: bool,
    /// C's span has elements that no matrix covers (ldc > m, or gaps between matrices).
    pub c_has_gaps: bool,
}

/// Operands placed in the scratch: the operands, the scratch bytes they use, and the bytes
/// allocated (0: the Context's scratch was large enough) in how long.
pub(crate) struct Placed {
    pub ops: Operands,
    pub bytes: usize,
    pub allocated: usize,
    pub alloc_ms: f64,
}

/// Places `regions` in the scratch (growing it when needed) and forgets the recorded fills they
/// will overwrite (every region placed here is written by the search). Returns the regions'
/// pointers, the scratch bytes they use, the bytes allocated and how long that took (ms).
fn place(
    ctx: &Context,
    scratch: &mut Scratch,
    regions: &[(usize, u16)],
) -> Result<(Vec<u64>, usize, usize, f64)> {
    let (offsets, total) = scratch_layout(regions)?;
    let t = Instant::now();
    let (base, allocated) = scratch.ensure(ctx, total)?;
    let alloc_ms = ms_since(t);
    for (&(bytes, _), &off) in regions.iter().zip(&offsets) {
        scratch.fills.overwritten(off, bytes);
    }
    let ptrs = offsets.iter().map(|&o| base + o as u64).collect();
    Ok((ptrs, total, allocated, alloc_ms))
}

/// Pseudo-random operands in the scratch: A, B, the reference C and the candidates' C, each at
/// the key's alignment. A and B are filled with the patterns of [`SEED_A`] and [`SEED_B`] unless
/// the scratch already holds them there (an earlier search of the Context with the same layout
/// prefix); C is initialised per run (see [`CInit`]).
pub(crate) fn scratch_operands(
    ctx: &Context,
    scratch: &mut Scratch,
    uniform_fn: &CudaFunction,
    shape: &Shape,
) -> Result<Placed> {
    let Shape {
        dtype,
        spans,
        align,
        beta_zero,
        c_has_gaps,
    } = *shape;
    let elem = dtype.size();
    let c_bytes = region_bytes(spans.c, elem)?;
    let (offsets, total) = scratch_layout(&[
        (region_bytes(spans.a, elem)?, align.a),
        (region_bytes(spans.b, elem)?, align.b),
        (c_bytes, align.c),
        (c_bytes, align.c),
    ])?;
    let t = Instant::now();
    let (base, allocated) = scratch.ensure(ctx, total)?;
    let alloc_ms = ms_since(t);
    // The two C regions are written by GEMMs and initialisations: their old records go first,
    // so that a record that runs into them is not trusted for A or B.
    scratch.fills.overwritten(offsets[2], c_bytes);
    scratch.fills.overwritten(offsets[3], c_bytes);
    for (i, elems, seed) in [(0, spans.a, SEED_A), (1, spans.b, SEED_B)] {
        let want = Fill {
            offset: offsets[i],
            elems,
            dtype,
            seed,
        };
        if scratch.fills.needed(&want) {
            uniform_raw(ctx, uniform_fn, base + offsets[i] as u64, elems, seed)?;
            scratch.fills.filled(want);
        }
    }
    let init = if !beta_zero {
        CInit::Uniform(SEED_C)
    } else if c_has_gaps {
        CInit::Zeros
    } else {
        unwritten()
    };
    Ok(Placed {
        ops: Operands {
            a: base + offsets[0] as u64,
            b: base + offsets[1] as u64,
            reference: base + offsets[2] as u64,
            candidate: base + offsets[3] as u64,
            init,
            old_c: 0,
        },
        bytes: total,
        allocated,
        alloc_ms,
    })
}

/// The caller's operands: A and B are read where they are; with beta == 0 the default writes
/// its result into the caller's C (which the tuned call overwrites afterwards) and only the
/// candidates' C is scratch; with beta != 0 C is an input, so both results go to scratch copies
/// of the caller's C.
pub(crate) fn caller_operands(
    ctx: &Context,
    scratch: &mut Scratch,
    caller: Ptrs,
    shape: &Shape,
) -> Result<Placed> {
    let Shape {
        dtype,
        spans,
        align,
        beta_zero,
        c_has_gaps,
    } = *shape;
    let c_bytes = region_bytes(spans.c, dtype.size())?;
    if beta_zero {
        let (ptrs, bytes, allocated, alloc_ms) = place(ctx, scratch, &[(c_bytes, align.c)])?;
        Ok(Placed {
            ops: Operands {
                a: caller.a,
                b: caller.b,
                reference: caller.c,
                candidate: ptrs[0],
                // The candidates' C gets the caller's gaps once, so that they compare equal.
                init: if c_has_gaps {
                    CInit::Copy(caller.c)
                } else {
                    unwritten()
                },
                old_c: 0,
            },
            bytes,
            allocated,
            alloc_ms,
        })
    } else {
        let (ptrs, bytes, allocated, alloc_ms) =
            place(ctx, scratch, &[(c_bytes, align.c), (c_bytes, align.c)])?;
        Ok(Placed {
            ops: Operands {
                a: caller.a,
                b: caller.b,
                reference: ptrs[0],
                candidate: ptrs[1],
                init: CInit::Copy(caller.c),
                old_c: caller.c,
            },
            bytes,
            allocated,
            alloc_ms,
        })
    }
}

/// Initialises the C region at `ptr` (`elems` elements of `elem` bytes) as `init` says.
pub(crate) fn init_c(
    ctx: &Context,
    uniform_fn: &CudaFunction,
    init: CInit,
    ptr: u64,
    elems: usize,
    elem: usize,
) -> Result<()> {
    let stream = ctx.stream().cu_stream();
    match init {
        CInit::Nothing => Ok(()),
        CInit::Uniform(seed) => uniform_raw(ctx, uniform_fn, ptr, elems, seed),
        // SAFETY: `ptr` holds `elems` elements of the scratch.
        CInit::Zeros => {
            unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, elems * elem, stream) }
                .call("cuMemsetD8Async")
        }
        CInit::Copy(src) if src == ptr => Ok(()),
        // SAFETY: `src` is the caller's C, validated to hold `elems` elements (its span), and
        // does not overlap the scratch region `ptr`, which holds as many.
        CInit::Copy(src) => {
            unsafe { cudarc::driver::result::memcpy_dtod_async(ptr, src, elems * elem, stream) }
                .call("cuMemcpyDtoDAsync")
        }
    }
}
