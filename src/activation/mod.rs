//! Bitmask ReLU and Add+ReLU: forwards that also write one bit per element (`x > 0`), and
//! backwards that read `dy` and that bit instead of `dy` and `y` — nnfuse's own kernels
//! (`kernels/bitmask.cu`), used where cuDNN cannot fuse the activation into BatchNorm.
//!
//! # Mask layout
//! `u32` words; bit `i` of word `w` is element `32*w + i`; [`mask_words`]`(n)` = `ceil(n/32)`
//! words; bits past `n` are zero. The same layout as [`crate::reference::activation`], for every
//! data type and every path. A mask buffer may be longer than `mask_words(n)`: only the first
//! `mask_words(n)` words are touched.
//!
//! # Semantics
//! * `y = max(x, 0)`, bit = `x > 0`. NaN propagates (`relu(NaN) = NaN`) with bit 0, so its
//!   gradient is 0 (as PyTorch); `relu(-0.0) = +0.0`.
//! * Add+ReLU computes `x + z` in f32, rounds once to the element type, then as above.
//! * Backward: `dx = dy` where the bit is set, else `+0`; the dual backward writes the same
//!   values to `dz` as well (the gradient of Add+ReLU's addend).
//! * All results are exact (no arithmetic besides Add+ReLU's one rounded addition).
//!
//! # Aliasing and in place
//! The `*_inplace` functions overwrite their first buffer. The other functions also accept an
//! output that is *exactly* the same memory as an input (same start, same length — possible
//! only through raw device pointers, e.g. cudarc's `upgrade_device_ptr`): `y` may be `x` (and, for
//! Add+ReLU, `z`); `dx` and `dz` may be `dy`. Partial overlap of an output with anything, any
//! overlap between the mask and the data, and `dx` overlapping `dz` are rejected with
//! [`Error::InvalidArgument`](crate::Error::InvalidArgument) naming the argument; two inputs may
//! overlap freely. Only the bytes a call touches count.
//!
//! Every buffer must live on the Context's device; one from another device is rejected the same
//! way before anything is launched.
//!
//! # Performance
//! When every data pointer is 16-byte aligned the kernels use 16-byte loads and stores and warp
//! votes (`__ballot_sync`) that produce whole mask words per warp; otherwise (a view starting
//! at an odd element, say) they take a scalar path that is correct for any alignment but
//! slower. `launch_rules.rs` holds the rule and the grid arithmetic; every launch logs its decision as a
//! `tracing` debug event.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use nnfuse::activation::{self, mask_words};
//! let ctx = nnfuse::Context::new(0)?;
//! let s = ctx.stream();
//! let x = s.clone_htod(&[1.0f32, -2.0, 3.0])?;
//! let mut y = s.alloc_zeros::<f32>(3)?;
//! let mut mask = s.alloc_zeros::<u32>(mask_words(3))?;
//! activation::relu_mask_fwd(&ctx, &x, &mut y, Some(&mut mask))?;
//! // Inference: no mask wanted.
//! activation::relu_mask_fwd(&ctx, &x, &mut y, None::<&mut activation::NoMask>)?;
//! # Ok(()) }
//! ```

mod launch_rules;

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DevicePtrMut};

use crate::context::Context;
use crate::dtype::{DType, Element};
use crate::error::Result;
use crate::kernels;
use crate::launch;
use crate::validate::{Binder, Need};
use launch_rules::{choose_path, launch_grid, validate, Path, Scheme};

/// The optional output mask of a forward: its address (0 for none, which the kernels read as
/// "write no mask"), bound for validation.
fn optional_mask<'a, M: DevicePtrMut<u32>>(
    ops: &mut Binder<'a>,
    mask: Option<&'a mut M>,
) -> Result<u64> {
    mask.map_or(Ok(0), |m| ops.output("mask", m, Need::MaskFor))
}

pub use crate::reference::activation::mask_words;

/// A type to name in `None::<&mut NoMask>` when a forward should write no mask (inference).
pub type NoMask = CudaSlice<u32>;

/// The kernels of `kernels/bitmask.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    ReluFwd,
    AddReluFwd,
    Bwd,
    BwdFromY,
    Naive8,
}

impl Kernel {
    fn name(self, dt: DType) -> &'static str {
        use DType::*;
        use Kernel::*;
        match (self, dt) {
            (ReluFwd, F32) => "relu_mask_fwd_f32",
            (ReluFwd, F16) => "relu_mask_fwd_f16",
            (ReluFwd, BF16) => "relu_mask_fwd_bf16",
            (AddReluFwd, F32) => "add_relu_mask_fwd_f32",
            (AddReluFwd, F16) => "add_relu_mask_fwd_f16",
            (AddReluFwd, BF16) => "add_relu_mask_fwd_bf16",
            (Bwd, F32) => "relu_mask_bwd_f32",
            (Bwd, F16) => "relu_mask_bwd_f16",
            (Bwd, BF16) => "relu_mask_bwd_bf16",
            (BwdFromY, F32) => "relu_bwd_from_y_f32",
            (BwdFromY, F16) => "relu_bwd_from_y_f16",
            (BwdFromY, BF16) => "relu_bwd_from_y_bf16",
            (Naive8, F32) => "relu_mask_fwd_naive8_f32",
            (Naive8, F16) => "relu_mask_fwd_naive8_f16",
            (Naive8, BF16) => "relu_mask_fwd_naive8_bf16",
        }
    }

    /// The call name carried by a launch error.
    fn launch_call(self) -> &'static str {
        match self {
            Kernel::ReluFwd => "cuLaunchKernel(relu_mask_fwd)",
            Kernel::AddReluFwd => "cuLaunchKernel(add_relu_mask_fwd)",
            Kernel::Bwd => "cuLaunchKernel(relu_mask_bwd)",
            Kernel::BwdFromY => "cuLaunchKernel(relu_bwd_from_y)",
            Kernel::Naive8 => "cuLaunchKernel(relu_mask_fwd_naive8)",
        }
    }

    fn scheme(self) -> Scheme {
        match self {
            Kernel::Naive8 => Scheme::Naive8,
            _ => Scheme::Warp,
        }
    }
}

/// `kernel`'s function for `dt` (compiled and loaded at first use, cached by the Context) and
/// its occupancy per SM.
fn load(ctx: &Context, kernel: Kernel, dt: DType) -> Result<(CudaFunction, u32)> {
    let name = kernel.name(dt);
    #[cfg(test)]
    if fail_load::armed() {
        return Err(crate::error::Error::NotSupported(format!(
            "kernel {name}: load failure injected by a test"
        )));
    }
    let f = ctx.function(&kernels::BITMASK, name)?;
    let per_sm = launch::blocks_per_sm(ctx, &f, name, launch_rules::THREADS, 0)?.max(1);
    Ok((f, per_sm))
}

/// Loads the forward kernel (ReLU, or Add+ReLU when `add`) for `dt` now, so that a caller with
/// side effects before its activation (BatchNorm's fallback updates the running statistics
/// first) fails before them, not after, when the kernel cannot be compiled or loaded.
pub(crate) fn prepare_forward(ctx: &Context, dt: DType, add: bool) -> Result<()> {
    let kernel = if add {
        Kernel::AddReluFwd
    } else {
        Kernel::ReluFwd
    };
    load(ctx, kernel, dt).map(drop)
}

/// Test hook: makes this thread's bitmask kernel loads fail, as a failed NVRTC compile or
/// module load would.
#[cfg(test)]
pub(crate) mod fail_load {
    use std::cell::Cell;

    thread_local! {
        static ARMED: Cell<bool> = const { Cell::new(false) };
    }

    /// Whether loads fail on this thread.
    pub(crate) fn armed() -> bool {
        ARMED.with(Cell::get)
    }

    /// Makes loads on this thread fail (`true`) or succeed again (`false`).
    pub(crate) fn set(on: bool) {
        ARMED.with(|a| a.set(on));
    }
}

/// Launches `kernel` over `n > 0` elements with the device pointers `args` (in the kernel's
/// parameter order, `n` appended). `path_ptrs` are the data pointers whose alignment decides the
/// path (the kernel applies the same rule itself).
fn launch(
    ctx: &Context,
    kernel: Kernel,
    dt: DType,
    n: usize,
    args: &[u64],
    path_ptrs: &[u64],
) -> Result<()> {
    let name = kernel.name(dt);
    let (f, per_sm) = {
        crate::profile::stage!(Lookup);
        load(ctx, kernel, dt)?
    };
    crate::profile::stage!(Launch);
    let path = match kernel.scheme() {
        Scheme::Naive8 => Path::Scalar,
        Scheme::Warp => choose_path(path_ptrs),
    };
    let sm_count = launch::sm_count(ctx);
    let lp = launch_grid(
        kernel.scheme(),
        path,
        n as u64,
        dt.size() as u64,
        sm_count,
        per_sm,
    );
    tracing::debug!(
        kernel = name,
        n,
        path = lp.path.name(),
        blocks = lp.blocks,
        threads = lp.threads,
        blocks_per_sm = per_sm,
        "bitmask kernel launch"
    );
    // The kernel's parameters by value (device pointers, then u64 n) and their addresses, on
    // the stack: no allocation per launch.
    let k = args.len();
    let mut vals = [0u64; MAX_ARGS + 1];
    let Some(slot) = vals.get_mut(..k) else {
        return Err(crate::error::Error::NotSupported(format!(
            "{name}: {k} pointer arguments, at most {MAX_ARGS}"
        )));
    };
    slot.copy_from_slice(args);
    vals[k] = n as u64;
    let mut params = vals.each_ref().map(launch::arg);
    // SAFETY: `args` + `n` match the kernel's parameters (device pointers then u64 n, see
    // kernels/bitmask.cu), the caller validated that every data buffer holds n elements and
    // every mask at least mask_words(n) words, that optional pointers are null only where the
    // kernel allows it, and that no two buffers overlap in a way the kernel does not support.
    unsafe {
        launch::launch_kernel(
            ctx,
            &f,
            lp.config(),
            &mut params[..=k],
            kernel.launch_call(),
        )
    }
}

/// Most device-pointer arguments of a bitmask kernel.
const MAX_ARGS: usize = 4;

/// `y = max(x, 0)` and, when `mask` is given, its bit of `x > 0` for every element.
///
/// `y` may be exactly the same memory as `x` (see the module docs; [`relu_mask_fwd_inplace`] is
/// the safe way to do that). `mask` needs at least [`mask_words`]`(x.len())` words; pass
/// `None::<&mut NoMask>` for no mask (inference).
pub fn relu_mask_fwd<T, X, Y, M>(
    ctx: &Context,
    x: &X,
    y: &mut Y,
    mask: Option<&mut M>,
) -> Result<()>
where
    T: Element,
    X: DevicePtr<T>,
    Y: DevicePtrMut<T>,
    M: DevicePtrMut<u32>,
{
    crate::profile::stage!(Call);
    let mut ops = Binder::new(ctx);
    let xp = ops.input("x", x, Need::Same)?;
    let yp = ops.output("y", y, Need::Same)?;
    let mp = optional_mask(&mut ops, mask)?;
    let n = validate(ops.operands(), &[("x", "y")])?;
    if n == 0 {
        return Ok(());
    }
    launch(ctx, Kernel::ReluFwd, T::DTYPE, n, &[xp, yp, mp], &[xp, yp])
}

/// [`relu_mask_fwd`] in place: `xy = max(xy, 0)`.
pub fn relu_mask_fwd_inplace<T, Y, M>(ctx: &Context, xy: &mut Y, mask: Option<&mut M>) -> Result<()>
where
    T: Element,
    Y: DevicePtrMut<T>,
    M: DevicePtrMut<u32>,
{
    crate::profile::stage!(Call);
    let mut ops = Binder::new(ctx);
    let p = ops.output("xy", xy, Need::Same)?;
    let mp = optional_mask(&mut ops, mask)?;
    let n = validate(ops.operands(), &[])?;
    if n == 0 {
        return Ok(());
    }
    launch(ctx, Kernel::ReluFwd, T::DTYPE, n, &[p, p, mp], &[p])
}

/// `y = max(x + z, 0)` (the sum in f32, rounded once) and, when `mask` is given, its bit of
/// `x + z > 0` for every element.
///
/// `y` may be exactly the same memory as `x` or `z` (see the module docs;
/// [`add_relu_mask_fwd_inplace`] is the safe way); `x` and `z` may overlap each other freely.
pub fn add_relu_mask_fwd<T, X, Z, Y, M>(
    ctx: &Context,
    x: &X,
    z: &Z,
    y: &mut Y,
    mask: Option<&mut M>,
) -> Result<()>
where
    T: Element,
    X: DevicePtr<T>,
    Z: DevicePtr<T>,
    Y: DevicePtrMut<T>,
    M: DevicePtrMut<u32>,
{
    crate::profile::stage!(Call);
    let mut ops = Binder::new(ctx);
    let xp = ops.input("x", x, Need::Same)?;
    let zp = ops.input("z", z, Need::Same)?;
    let yp = ops.output("y", y, Need::Same)?;
    let mp = optional_mask(&mut ops, mask)?;
    let n = validate(ops.operands(), &[("x", "y"), ("z", "y")])?;
    if n == 0 {
        return Ok(());
    }
    launch(
        ctx,
        Kernel::AddReluFwd,
        T::DTYPE,
        n,
        &[xp, zp, yp, mp],
        &[xp, zp, yp],
    )
}

/// [`add_relu_mask_fwd`] in place: `xy = max(xy + z, 0)`. `z` may be `xy` itself only as exactly
/// the same memory.
pub fn add_relu_mask_fwd_inplace<T, Y, Z, M>(
    ctx: &Context,
    xy: &mut Y,
    z: &Z,
    mask: Option<&mut M>,
) -> Result<()>
where
    T: Element,
    Y: DevicePtrMut<T>,
    Z: DevicePtr<T>,
    M: DevicePtrMut<u32>,
{
    crate::profile::stage!(Call);
    let mut ops = Binder::new(ctx);
    let p = ops.output("xy", xy, Need::Same)?;
    let zp = ops.input("z", z, Need::Same)?;
    let mp = optional_mask(&mut ops, mask)?;
    let n = validate(ops.operands(), &[("xy", "z")])?;
    if n == 0 {
        return Ok(());
    }
    launch(
        ctx,
        Kernel::AddReluFwd,
        T::DTYPE,
        n,
        &[p, zp, p, mp],
        &[p, zp],
    )
}

/// `dx = dy` where the mask bit is set, else 0. `dx` may be exactly the same memory as `dy`
/// ([`relu_mask_bwd_inplace`] is the safe way).
pub fn relu_mask_bwd<T, G, M, DX>(ctx: &Context, dy: &G, mask: &M, dx: &mut DX) -> Result<()>
where
    T: Element,
    G: DevicePtr<T>,
    M: DevicePtr<u32>,
    DX: DevicePtrMut<T>,
{
    crate::profile::stage!(Call);
    let mut ops = Binder::new(ctx);
    let gp = ops.input("dy", dy, Need::Same)?;
    let xp = ops.output("dx", dx, Need::Same)?;
    let mp = ops.input("mask", mask, Need::MaskFor)?;
    let n = validate(ops.operands(), &[("dy", "dx")])?;
    if n == 0 {
        return Ok(());
    }
    launch(ctx, Kernel::Bwd, T::DTYPE, n, &[gp, mp, xp, 0], &[gp, xp])
}

/// [`relu_mask_bwd`] on addresses its caller has bound and checked itself (BatchNorm's
/// fallback backward, whose one validation covers `dy` and `dx`, and whose mask is its own
/// forward's): no second binding of the buffers (cudarc's event wait and record per buffer).
///
/// # Safety
/// `dy` and `dx` hold `n` elements of `dt`, `mask` at least [`mask_words`]`(n)` words, all on
/// the Context's device and valid until the queued work completes; `dx` is exactly `dy` or
/// overlaps neither `dy` nor `mask`.
pub(crate) unsafe fn relu_mask_bwd_raw(
    ctx: &Context,
    dt: DType,
    n: usize,
    dy: u64,
    mask: u64,
    dx: u64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    launch(ctx, Kernel::Bwd, dt, n, &[dy, mask, dx, 0], &[dy, dx])
}

/// The y-based ReLU backward on addresses its caller has bound and checked: `dx = dy` where
/// `y > 0`, else 0. BatchNorm's graph epilogue keeps cuDNN's own mask for its backward graph;
/// when that backward graph cannot be built, this kernel masks dy from y instead.
///
/// # Safety
/// `dy`, `y` and `dx` hold `n` elements of `dt` on the Context's device, valid until the queued
/// work completes; `dx` is exactly `dy` or overlaps neither `dy` nor `y`.
pub(crate) unsafe fn relu_bwd_from_y_raw(
    ctx: &Context,
    dt: DType,
    n: usize,
    dy: u64,
    y: u64,
    dx: u64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    launch(ctx, Kernel::BwdFromY, dt, n, &[dy, y, dx], &[dy, y, dx])
}

/// The backward of Add+ReLU: writes the same gradient to `dx` and to `dz` (the addend's). Either
/// may be exactly the same memory as `dy`; `dx` and `dz` must not overlap.
pub fn relu_mask_bwd_dual<T, G, M, DX, DZ>(
    ctx: &Context,
    dy: &G,
    mask: &M,
    dx: &mut DX,
    dz: &mut DZ,
) -> Result<()>
where
    T: Element,
    G: DevicePtr<T>,
    M: DevicePtr<u32>,
    DX: DevicePtrMut<T>,
    DZ: DevicePtrMut<T>,
{
    crate::profile::stage!(Call);
    let mut ops = Binder::new(ctx);
    let gp = ops.input("dy", dy, Need::Same)?;
    let xp = ops.output("dx", dx, Need::Same)?;
    let zp = ops.output("dz", dz, Need::Same)?;
    let mp = ops.input("mask", mask, Need::MaskFor)?;
    let n = validate(ops.operands(), &[("dy", "dx"), ("dy", "dz")])?;
    if n == 0 {
        return Ok(());
    }
    launch(
        ctx,
        Kernel::Bwd,
        T::DTYPE,
        n,
        &[gp, mp, xp, zp],
        &[gp, xp, zp],
    )
}

/// [`relu_mask_bwd`] in place: `g = dy` on entry, `dx` on return.
pub fn relu_mask_bwd_inplace<T, G, M>(ctx: &Context, g: &mut G, mask: &M) -> Result<()>
where
    T: Element,
    G: DevicePtrMut<T>,
    M: DevicePtr<u32>,
{
    crate::profile::stage!(Call);
    let mut ops = Binder::new(ctx);
    let gp = ops.output("g", g, Need::Same)?;
    let mp = ops.input("mask", mask, Need::MaskFor)?;
    let n = validate(ops.operands(), &[])?;
    if n == 0 {
        return Ok(());
    }
    launch(ctx, Kernel::Bwd, T::DTYPE, n, &[gp, mp, gp, 0], &[gp])
}

/// The schemes the bitmask kernels replace, kept for the benchmark (`benches/activation.rs`).
/// Same validation and results as the real kernels.
pub mod baseline {
    use super::*;

    /// The naive forward: one thread reads eight consecutive elements and writes one byte of
    /// mask (same layout and results as [`relu_mask_fwd`]). `y` may be
    /// exactly `x`.
    pub fn relu_mask_fwd_naive8<T, X, Y, M>(
        ctx: &Context,
        x: &X,
        y: &mut Y,
        mask: &mut M,
    ) -> Result<()>
    where
        T: Element,
        X: DevicePtr<T>,
        Y: DevicePtrMut<T>,
        M: DevicePtrMut<u32>,
    {
        let mut ops = Binder::new(ctx);
        let xp = ops.input("x", x, Need::Same)?;
        let yp = ops.output("y", y, Need::Same)?;
        let mp = ops.output("mask", mask, Need::MaskFor)?;
        let n = validate(ops.operands(), &[("x", "y")])?;
        if n == 0 {
            return Ok(());
        }
        launch(ctx, Kernel::Naive8, T::DTYPE, n, &[xp, yp, mp], &[])
    }

    /// The y-based backward: `dx = dy` where `y > 0`, else 0 (reads `y` instead of the mask).
    /// `dx` may be exactly `dy` or `y`.
    pub fn relu_bwd_from_y<T, G, Y, DX>(ctx: &Context, dy: &G, y: &Y, dx: &mut DX) -> Result<()>
    where
        T: Element,
        G: DevicePtr<T>,
        Y: DevicePtr<T>,
        DX: DevicePtrMut<T>,
    {
        let mut ops = Binder::new(ctx);
        let gp = ops.input("dy", dy, Need::Same)?;
        let yp = ops.input("y", y, Need::Same)?;
        let xp = ops.output("dx", dx, Need::Same)?;
        let n = validate(ops.operands(), &[("dy", "dx"), ("y", "dx")])?;
        if n == 0 {
            return Ok(());
        }
        launch(
            ctx,
            Kernel::BwdFromY,
            T::DTYPE,
            n,
            &[gp, yp, xp],
            &[gp, yp, xp],
        )
    }
}

/// What only nnfuse's own benchmarks and tests use: the launch rules (vector or scalar path,
/// grid arithmetic). Not a stable API.
#[doc(hidden)]
pub mod internals {
    pub use super::launch_rules::{
        choose_path, launch_grid, warps_needed, LaunchGrid, Path, Scheme, MAX_ELEMENTS, THREADS,
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_name_exists_in_the_source() {
        let src = kernels::BITMASK.source;
        for k in [
            Kernel::ReluFwd,
            Kernel::AddReluFwd,
            Kernel::Bwd,
            Kernel::BwdFromY,
            Kernel::Naive8,
        ] {
            for dt in DType::ALL {
                let name = k.name(dt);
                assert!(name.ends_with(dt.name()), "{name}");
                // The macro pastes the suffix: look for the base name followed by `_##S(`.
                let base = name.trim_end_matches(dt.name());
                assert!(
                    src.contains(&format!("{base}##S(")),
                    "{name} not in bitmask.cu"
                );
                assert!(k.launch_call().contains(base.trim_end_matches('_')));
            }
        }
    }
}
