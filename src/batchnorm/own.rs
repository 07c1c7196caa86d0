//! Launchers of nnfuse's own BatchNorm kernels (`kernels/batchnorm.cu`,
//! `kernels/batchnorm_persistent.cu`). The dispatcher (`ops.rs`) has validated every
//! buffer (lengths, device, overlap) before it calls these functions with raw device pointers;
//! here only the launch decisions happen (vector widths, grids, the persistent tiling, scratch),
//! from the pure arithmetic of [`super::own_launch`], each logged as a `tracing` debug event.
//!
//! Scratch: partial results and per-channel coefficients live in the Context's scratch arena
//! ([`Context::scratch`]), held for the queuing of one operation. The channels-first reductions
//! and the persistent kernels count arrivals in a small zeroed buffer per BatchNorm
//! ([`Counters`]) that every launch leaves at zero again; the same per-BatchNorm state remembers
//! whether (and how) the persistent kernels fit the device.

use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use cudarc::driver::sys::CUresult;
use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtrMut, DeviceRepr, DriverError, LaunchConfig,
};

use crate::batchnorm::own_launch::{
    apply_launch, apply_mode, config, keep_x_in_l2, persistent_geom, reduce_geom, scratch_floats,
    staged_bytes, vec_width, ApplyMode, Arrangement, FastDiv, Geom, OwnShape, PGeom, CTHREADS,
    PTHREADS, REDUCE_PART_FLOATS, STATS_PART_FLOATS, THREADS,
};
use crate::batchnorm::own_units::{self, name, planned_kernels, K};
use crate::batchnorm::types::{Fuse, OwnVariant};
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{CallExt, Error, Result};
use crate::kernels;
use crate::launch;

// ----- kernel arguments (the C structs of kernels/batchnorm*.cu, field for field) -------------

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct StatsArgs {
    x: u64,
    part: u64,
    counters: u64,
    saved_mean: u64,
    saved_mean_lo: u64,
    saved_invstd: u64,
    running_mean: u64,
    running_var: u64,
    g: Geom,
    eps: f32,
    momentum: f64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ReduceArgs {
    x: u64,
    dy: u64,
    mask: u64,
    dz: u64,
    saved_mean: u64,
    saved_mean_lo: u64,
    saved_invstd: u64,
    gamma: u64,
    part: u64,
    counters: u64,
    coef: u64,
    dgamma: u64,
    dbeta: u64,
    g: Geom,
    inv_count: f32,
    act: u32,
    hint: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ApplyFwdArgs {
    x: u64,
    z: u64,
    y: u64,
    mask: u64,
    mean: u64,
    mean_lo: u64,
    inv: u64,
    gamma: u64,
    beta: u64,
    coef: u64,
    n: u64,
    inner: FastDiv,
    chans: FastDiv,
    res: u64,
    wpr: u64,
    mode: u32,
    staged: u32,
    from_var: u32,
    eps: f32,
    hint: u32,
    /// Channels-last vector path: sweep the tensor from its end (see the kernel's comment).
    reverse: u32,
    /// Channels-last from sums (`apply_train_from_sums`; 0: the saved statistics are read).
    sum: u64,
    sqsum: u64,
    /// The sums' low words (0: none).
    sum_lo: u64,
    sqsum_lo: u64,
    running_mean: u64,
    running_var: u64,
    count: f64,
    momentum: f64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ApplyBwdArgs {
    x: u64,
    dy: u64,
    mask: u64,
    dx: u64,
    coef: u64,
    n: u64,
    inner: FastDiv,
    chans: FastDiv,
    res: u64,
    wpr: u64,
    mode: u32,
    staged: u32,
    hint: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct PersistArgs {
    x: u64,
    g: u64,
    out: u64,
    mask: u64,
    dz: u64,
    gamma: u64,
    beta: u64,
    mean: u64,
    mean_lo: u64,
    invstd: u64,
    running_mean: u64,
    running_var: u64,
    dgamma: u64,
    dbeta: u64,
    part: u64,
    coef: u64,
    barrier: u64,
    geom: PGeom,
    act: u32,
    eps: f32,
    momentum: f64,
    inv_count: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ChannelBwdArgs {
    x: u64,
    dy: u64,
    mask: u64,
    dx: u64,
    dz: u64,
    saved_mean: u64,
    saved_mean_lo: u64,
    gamma: u64,
    dgamma: u64,
    dbeta: u64,
    per_channel: u64,
    inner: FastDiv,
    eps: f64,
    channels: u32,
    act: u32,
}

// SAFETY: plain old data whose C layout matches the kernels' structs (checked by the tests below
// against the sizes and the field order in the CUDA source).
unsafe impl DeviceRepr for StatsArgs {}
unsafe impl DeviceRepr for ReduceArgs {}
unsafe impl DeviceRepr for ApplyFwdArgs {}
unsafe impl DeviceRepr for ApplyBwdArgs {}
unsafe impl DeviceRepr for PersistArgs {}
unsafe impl DeviceRepr for ChannelBwdArgs {}

/// The activation code of the kernels (`ACT_*`).
fn act(fuse: Fuse) -> u32 {
    match fuse {
        Fuse::None => 0,
        Fuse::Relu => 1,
        Fuse::AddRelu => 2,
    }
}

/// A poisoned lock still guards valid state (every write is whole).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// One wave of `f`'s blocks at [`THREADS`] threads (SMs x resident blocks), at least 1.
fn wave(ctx: &Context, f: &CudaFunction, name: &'static str, smem: u32) -> Result<u64> {
    launch::one_wave(ctx, f, name, THREADS, smem)
}

fn launch<A: DeviceRepr>(
    ctx: &Context,
    f: &CudaFunction,
    args: &A,
    cfg: LaunchConfig,
    call: &'static str,
) -> Result<()> {
    // SAFETY: `args` is the kernel's argument struct (layout checked by the tests), and every
    // pointer in it was validated by the dispatcher against the plan's shape; scratch and
    // counters are sized by own_launch for this launch.
    unsafe { launch::launch_kernel(ctx, f, cfg, &mut [launch::arg(args)], call) }
}

// ----- counters ---------------------------------------------------------------------------------

/// The own kernels' device state of one BatchNorm: zeroed arrival counters — `C` per-channel
/// counters (the channels-first reductions' last-block-done) then two for the persistent
/// kernels' grid barrier; every launch leaves them at zero, and work on the Context's one stream
/// never overlaps — and, per direction, the persistent launch that fits the device (decided on
/// first use).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    words: Mutex<Option<CudaSlice<u32>>>,
    /// Index `tiles - 1`: `None` undecided, `Some(None)` does not fit, `Some(Some(fit))`.
    persistent: Mutex<[Option<Option<Fit>>; 2]>,
}

impl Counters {
    /// Runs `f` with the counters' device address (at least `words` zeroed words).
    fn with<R>(&self, ctx: &Context, words: usize, f: impl FnOnce(u64) -> Result<R>) -> Result<R> {
        let mut g = lock(&self.words);
        if g.as_ref().is_none_or(|b| b.len() < words) {
            ctx.refuse_under_capture("a BatchNorm's first own-kernel call", "allocate counters")?;
            ctx.cuda().bind_to_thread().call("cuCtxSetCurrent")?;
            *g = Some(
                ctx.stream()
                    .alloc_zeros::<u32>(words.max(1))
                    .call("cuMemAllocAsync")?,
            );
        }
        match g.as_mut() {
            Some(buf) => {
                let (p, _sync) = buf.device_ptr_mut(ctx.stream());
                f(p)
            }
            None => Err(Error::NotSupported("counter allocation vanished".into())),
        }
    }
}

// ----- the operations ---------------------------------------------------------------------------

/// Device pointers of a training forward (0 for an absent addend or mask).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FwdBufs {
    pub x: u64,
    pub z: u64,
    pub y: u64,
    pub mask: u64,
    pub gamma: u64,
    pub beta: u64,
    pub running_mean: u64,
    pub running_var: u64,
    pub saved_mean: u64,
    /// The mean's remainder (`mean = saved_mean + saved_mean_lo`), C floats the state keeps.
    pub saved_mean_lo: u64,
    pub saved_invstd: u64,
}

/// Device pointers of a training backward (0 for an absent mask or d_addend).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BwdBufs {
    pub x: u64,
    pub dy: u64,
    pub mask: u64,
    pub dx: u64,
    pub dz: u64,
    pub gamma: u64,
    pub saved_mean: u64,
    pub saved_mean_lo: u64,
    pub saved_invstd: u64,
    pub dgamma: u64,
    pub dbeta: u64,
}

/// Device pointers of an inference forward.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InferBufs {
    pub x: u64,
    pub z: u64,
    pub y: u64,
    pub gamma: u64,
    pub beta: u64,
    pub running_mean: u64,
    pub running_var: u64,
}

/// The tensor and the operation's fixed facts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Op<'a> {
    pub ctx: &'a Context,
    pub shape: OwnShape,
    pub dtype: DType,
    pub fuse: Fuse,
    pub counters: &'a Counters,
}

impl Op<'_> {
    fn eb(&self) -> u64 {
        self.dtype.size() as u64
    }

    fn c(&self) -> u64 {
        self.shape.c
    }

    /// Kernel `k` for this type, from its compilation unit (`own_units`). Its first use on the
    /// Context waits for the unit's compile if it is not ready (started in the background when
    /// the BatchNorm was planned, [`prepare`]), and says so: the call never switches to
    /// another implementation meanwhile (docs/BATCHNORM.md, "First call").
    fn function(&self, k: K) -> Result<(CudaFunction, &'static str)> {
        let n = name(k, self.dtype);
        let unit = own_units::unit(k, self.dtype);
        if let Some(f) = self.ctx.loaded_function(unit, n) {
            return Ok((f, n));
        }
        let state = self.ctx.kernel_state(unit);
        let t = Instant::now();
        let f = self.ctx.function(unit, n)?;
        if state != kernels::KernelState::Ready {
            tracing::info!(
                kernel = n,
                unit = unit.name,
                state = ?state,
                waited_ms = t.elapsed().as_secs_f64() * 1e3,
                "own BatchNorm: the first call waited for its kernel's compile"
            );
        }
        Ok((f, n))
    }

    /// The lengths whose multiples a reduction's vector width must divide.
    fn vector_lens(&self) -> [u64; 1] {
        match self.shape.arr {
            Arrangement::First { hw, .. } => [hw],
            Arrangement::Last { .. } => [self.shape.c],
        }
    }

    fn counter_words(&self) -> usize {
        self.c() as usize + 2
    }

    /// Whether x fits in L2 beside the rest of a two-pass operation's traffic: then the data each
    /// pass reads or writes once goes with evict_first, so that the second pass finds x in L2.
    fn x_fits_l2(&self) -> bool {
        keep_x_in_l2(
            self.shape.numel() * self.eb(),
            self.ctx.info().l2_bytes.max(0) as u64,
        )
    }
}

/// Starts compiling, in the background, the kernel units the own path will launch (on aligned
/// data) for a plan whose training takes the own path with `train`'s (forward, backward)
/// variants and whose inference does when `inference`: a BatchNorm's plan calls it, so that the
/// compiles overlap whatever the caller does before the first call (other layers' planning, the
/// first convolutions). Returns how many compiles it started (0 without the own path or NVRTC,
/// or when every unit is ready or compiling already).
pub(crate) fn prepare(
    ctx: &Context,
    shape: &OwnShape,
    dtype: DType,
    fuse: Fuse,
    train: Option<(OwnVariant, OwnVariant)>,
    inference: bool,
) -> usize {
    let ks = planned_kernels(shape.arr, fuse, train, inference);
    if ks.is_empty() || !kernels::nvrtc_present() {
        return 0;
    }
    let units = own_units::units_of(&ks, dtype);
    let started = ctx.prepare_kernels(&units);
    tracing::debug!(
        units = ?units.iter().map(|u| u.name).collect::<Vec<_>>(),
        started,
        "own BatchNorm: kernel units prepared"
    );
    started
}

/// Training forward: statistics, running statistics, saved mean and inverse std, y and (with an
/// activation) the mask. Runs the persistent kernel when `want` says so and the device holds the
/// tensor; returns the variant that ran.
pub(crate) fn forward_train(
    op: &Op<'_>,
    b: &FwdBufs,
    want: OwnVariant,
    momentum: f64,
    eps: f64,
) -> Result<OwnVariant> {
    // The kernels take the unbiased variance from the count itself (M2 / (M - 1) in f64).
    if want == OwnVariant::Persistent && forward_persistent(op, b, momentum, eps)? {
        return Ok(OwnVariant::Persistent);
    }
    forward_two_pass(op, b, momentum, eps)?;
    Ok(OwnVariant::TwoPass)
}

/// The persistent training forward; `false` when the device cannot hold the tensor (nothing
/// was written: the caller runs the two-pass kernels).
fn forward_persistent(op: &Op<'_>, b: &FwdBufs, momentum: f64, eps: f64) -> Result<bool> {
    let aligned = [b.x, b.z, b.y].iter().all(|p| p % 16 == 0);
    let Some(p) = prepare_persistent(op, 1, aligned)? else {
        return Ok(false);
    };
    let (coef_at, total) = scratch_floats(op.c(), p.geom.parts.into(), STATS_PART_FLOATS, 3);
    let scratch = op.ctx.scratch(total as usize * 4)?;
    op.counters.with(op.ctx, op.counter_words(), |cnt| {
        let args = PersistArgs {
            x: b.x,
            g: b.z,
            out: b.y,
            mask: b.mask,
            gamma: b.gamma,
            beta: b.beta,
            mean: b.saved_mean,
            mean_lo: b.saved_mean_lo,
            invstd: b.saved_invstd,
            running_mean: b.running_mean,
            running_var: b.running_var,
            part: scratch.ptr(),
            coef: scratch.ptr() + coef_at * 4,
            barrier: cnt + op.c() * 4,
            geom: p.geom,
            act: act(op.fuse),
            eps: eps as f32,
            momentum,
            ..PersistArgs::default()
        };
        launch_persistent(op, &p, &args, 1)
    })
}

/// The two-pass training forward: statistics, then the elementwise pass.
fn forward_two_pass(op: &Op<'_>, b: &FwdBufs, momentum: f64, eps: f64) -> Result<()> {
    let eb = op.eb();
    let c = op.c();
    let first = matches!(op.shape.arr, Arrangement::First { .. });
    let (stats_f, stats_name) = op.function(if first { K::StatsCf } else { K::StatsCl })?;
    let vec = vec_width(eb, &op.vector_lens(), &[b.x]);
    let g = reduce_geom(&op.shape, vec, wave(op.ctx, &stats_f, stats_name, 0)?);
    let mode = apply_mode(&op.shape, eb, &[b.x, b.y, b.z]);
    let staged = staged_bytes(c, 4);
    let (coef_at, total) = scratch_floats(
        c,
        g.parts.into(),
        STATS_PART_FLOATS,
        if staged > 0 { 0 } else { 4 },
    );
    tracing::debug!(
        kernel = stats_name,
        blocks = g.blocks(),
        parts = g.parts,
        vec = g.vec,
        apply = mode.name(),
        staged = staged > 0,
        "own BatchNorm forward (two-pass)"
    );
    let scratch = op.ctx.scratch(total as usize * 4)?;
    op.counters.with(op.ctx, op.counter_words(), |cnt| {
        let args = StatsArgs {
            x: b.x,
            part: scratch.ptr(),
            counters: cnt,
            saved_mean: b.saved_mean,
            saved_mean_lo: b.saved_mean_lo,
            saved_invstd: b.saved_invstd,
            running_mean: b.running_mean,
            running_var: b.running_var,
            g,
            eps: eps as f32,
            momentum,
        };
        launch(
            op.ctx,
            &stats_f,
            &args,
            config(g.blocks(), THREADS, 0),
            "cuLaunchKernel(bn_stats)",
        )?;
        if !g.channels_first() {
            let (f, _) = op.function(K::StatsFinalize)?;
            launch(
                op.ctx,
                &f,
                &args,
                config(c as u32, THREADS, 0),
                "cuLaunchKernel(bn_stats_finalize)",
            )?;
        }
        Ok(())
    })?;
    apply_forward(
        op,
        ApplyFwdArgs {
            hint: u32::from(op.x_fits_l2()),
            ..train_apply_args(b, scratch.ptr() + coef_at * 4, eps)
        },
        staged,
    )
}

/// The training forward's elementwise pass on the saved statistics in `b`, its per-channel
/// coefficients staged at `coef` (the two-pass forward's second pass and [`apply_train`]).
fn train_apply_args(b: &FwdBufs, coef: u64, eps: f64) -> ApplyFwdArgs {
    ApplyFwdArgs {
        x: b.x,
        z: b.z,
        y: b.y,
        mask: b.mask,
        mean: b.saved_mean,
        mean_lo: b.saved_mean_lo,
        inv: b.saved_invstd,
        gamma: b.gamma,
        beta: b.beta,
        coef,
        from_var: 0,
        eps: eps as f32,
        ..ApplyFwdArgs::default()
    }
}

/// The training forward's elementwise pass alone (y and, with an activation, the mask), on
/// saved statistics a finalize already wrote to `b.saved_mean`, `b.saved_mean_lo` and
/// `b.saved_invstd`: the same launch as the two-pass forward's second pass.
pub(crate) fn apply_train(op: &Op<'_>, b: &FwdBufs, eps: f64) -> Result<()> {
    let staged = staged_bytes(op.c(), 4);
    let coef_floats = if staged > 0 { 0 } else { 4 * op.c() };
    let scratch = op.ctx.scratch(coef_floats as usize * 4)?;
    // x was just written by the convolution that made its sums: its end is the part still in
    // L2, so the apply starts there (measured on the H100: 68.1 -> 63.8 us for the demo's
    // 256-channel BN+Add+ReLU from sums).
    let a = ApplyFwdArgs {
        reverse: 1,
        ..train_apply_args(b, scratch.ptr(), eps)
    };
    apply_forward(op, a, staged)
}

/// Per-channel sums for [`apply_train_from_sums`]: device addresses of `C` f32 each (and their
/// low words, or 0), the count of values they add up, the running statistics' momentum.
pub(crate) struct SumsIn {
    pub(crate) sum: u64,
    pub(crate) sqsum: u64,
    pub(crate) sum_lo: u64,
    pub(crate) sqsum_lo: u64,
    pub(crate) count: f64,
    pub(crate) momentum: f64,
}

/// [`apply_train`] with the statistics made from per-channel sums in the same launch: each block
/// of the channels-last vector kernel stages the coefficients from the sums, block 0 writes the
/// saved statistics and moves the running ones (`fwd_sums_stage` in `kernels/batchnorm.cu`,
/// `bn_finalize_from_sums`' arithmetic: the same bits), so that the finalize's launch and its
/// gap are gone. `Ok(false)` when this launch cannot take them — not the channels-last vector
/// path, or more channels than it stages — and nothing was queued: the caller finalizes first.
pub(crate) fn apply_train_from_sums(
    op: &Op<'_>,
    b: &FwdBufs,
    eps: f64,
    sums: &SumsIn,
) -> Result<bool> {
    let smem = staged_bytes(op.c(), 4);
    if smem == 0 || apply_mode(&op.shape, op.eb(), &data_ptrs(op, b.x, b.y, b.z)) != ApplyMode::Last
    {
        return Ok(false);
    }
    let a = ApplyFwdArgs {
        reverse: 1,
        sum: sums.sum,
        sqsum: sums.sqsum,
        sum_lo: sums.sum_lo,
        sqsum_lo: sums.sqsum_lo,
        running_mean: b.running_mean,
        running_var: b.running_var,
        count: sums.count,
        momentum: sums.momentum,
        ..train_apply_args(b, 0, eps)
    };
    apply_forward(op, a, smem)?;
    Ok(true)
}

/// The data pointers whose alignment picks the apply's mode: x, y (and the addend).
fn data_ptrs(op: &Op<'_>, x: u64, y: u64, z: u64) -> Vec<u64> {
    if op.fuse == Fuse::AddRelu {
        vec![x, y, z]
    } else {
        vec![x, y]
    }
}

/// Inference forward: one elementwise pass with the running statistics.
pub(crate) fn forward_inference(op: &Op<'_>, b: &InferBufs, eps: f64) -> Result<()> {
    let staged = staged_bytes(op.c(), 4);
    let coef_floats = if staged > 0 { 0 } else { 4 * op.c() };
    let scratch = op.ctx.scratch(coef_floats as usize * 4)?;
    apply_forward(
        op,
        ApplyFwdArgs {
            x: b.x,
            z: b.z,
            y: b.y,
            mask: 0,
            mean: b.running_mean,
            mean_lo: 0,
            inv: b.running_var,
            gamma: b.gamma,
            beta: b.beta,
            coef: scratch.ptr(),
            from_var: 1,
            eps: eps as f32,
            ..ApplyFwdArgs::default()
        },
        staged,
    )
}

/// The elementwise forward (`a` with its pointers, coefficients source and eps filled in).
fn apply_forward(op: &Op<'_>, mut a: ApplyFwdArgs, staged: u32) -> Result<()> {
    let eb = op.eb();
    let c = op.c();
    let n = op.shape.numel();
    let mode = apply_mode(&op.shape, eb, &data_ptrs(op, a.x, a.y, a.z));
    // The channels-last vector path keeps coefficients in registers: no staging, no bn_fold —
    // but from sums, where its blocks stage them first (`staged` bytes of shared memory).
    let last = mode == ApplyMode::Last;
    let staged = if last && a.sum == 0 { 0 } else { staged };
    a.n = n;
    a.inner = FastDiv::new(op.shape.inner());
    a.chans = FastDiv::new(c);
    a.mode = mode as u32;
    a.staged = u32::from(staged > 0);
    if staged == 0 && !last {
        // Too many channels to stage: fold the coefficients once into the scratch buffer.
        let (f, _) = op.function(K::Fold(op.fuse))?;
        let blocks = c.div_ceil(u64::from(THREADS)).clamp(1, 65535) as u32;
        launch(
            op.ctx,
            &f,
            &a,
            config(blocks, THREADS, 0),
            "cuLaunchKernel(bn_fold)",
        )?;
    }
    let k = if last {
        K::ApplyFwdLast(op.fuse)
    } else {
        K::ApplyFwd(op.fuse)
    };
    let (f, fname) = op.function(k)?;
    let l = apply_launch(mode, &op.shape, eb, wave(op.ctx, &f, fname, staged)?);
    a.res = l.res;
    a.wpr = l.wpr;
    tracing::debug!(
        kernel = fname,
        blocks = l.blocks,
        mode = mode.name(),
        residues = l.res,
        staged = staged > 0,
        mask = a.mask != 0,
        "own BatchNorm apply"
    );
    launch(
        op.ctx,
        &f,
        &a,
        config(l.blocks, THREADS, staged),
        "cuLaunchKernel(bn_apply_fwd)",
    )
}

/// Training backward: dgamma, dbeta, dx and (Add+ReLU) d_addend. Returns the variant that ran.
/// `eps` is the forward's (the per-channel variant recomputes the variance in f64).
pub(crate) fn backward(op: &Op<'_>, b: &BwdBufs, want: OwnVariant, eps: f64) -> Result<OwnVariant> {
    let m = op.shape.per_channel();
    if want == OwnVariant::PerChannel {
        backward_per_channel(op, b, eps)?;
        return Ok(OwnVariant::PerChannel);
    }
    let inv_count = (1.0 / m as f64) as f32;
    if want == OwnVariant::Persistent && backward_persistent(op, b, inv_count)? {
        return Ok(OwnVariant::Persistent);
    }
    backward_two_pass(op, b, inv_count)?;
    Ok(OwnVariant::TwoPass)
}

/// The per-channel backward: one block per channel sums and writes dx in f64.
fn backward_per_channel(op: &Op<'_>, b: &BwdBufs, eps: f64) -> Result<()> {
    let c = op.c();
    let m = op.shape.per_channel();
    let (f, fname) = op.function(K::ChannelBwd)?;
    tracing::debug!(
        kernel = fname,
        blocks = c,
        per_channel = m,
        "own BatchNorm backward (per channel, f64)"
    );
    let args = ChannelBwdArgs {
        x: b.x,
        dy: b.dy,
        mask: b.mask,
        dx: b.dx,
        dz: b.dz,
        saved_mean: b.saved_mean,
        saved_mean_lo: b.saved_mean_lo,
        gamma: b.gamma,
        dgamma: b.dgamma,
        dbeta: b.dbeta,
        per_channel: m,
        inner: FastDiv::new(op.shape.inner()),
        eps,
        channels: c as u32,
        act: act(op.fuse),
    };
    launch(
        op.ctx,
        &f,
        &args,
        config(c as u32, CTHREADS, 0),
        "cuLaunchKernel(bn_bwd_channel)",
    )
}

/// The persistent backward; `false` when the device cannot hold the tensor (nothing was
/// written: the caller runs the two-pass kernels).
fn backward_persistent(op: &Op<'_>, b: &BwdBufs, inv_count: f32) -> Result<bool> {
    let c = op.c();
    let aligned = [b.x, b.dy, b.dx, b.dz].iter().all(|p| p % 16 == 0);
    let Some(p) = prepare_persistent(op, 2, aligned)? else {
        return Ok(false);
    };
    let (coef_at, total) = scratch_floats(c, p.geom.parts.into(), REDUCE_PART_FLOATS, 5);
    let scratch = op.ctx.scratch(total as usize * 4)?;
    op.counters.with(op.ctx, op.counter_words(), |cnt| {
        let args = PersistArgs {
            x: b.x,
            g: b.dy,
            out: b.dx,
            mask: b.mask,
            dz: b.dz,
            gamma: b.gamma,
            mean: b.saved_mean,
            mean_lo: b.saved_mean_lo,
            invstd: b.saved_invstd,
            dgamma: b.dgamma,
            dbeta: b.dbeta,
            part: scratch.ptr(),
            coef: scratch.ptr() + coef_at * 4,
            barrier: cnt + c * 4,
            geom: p.geom,
            act: act(op.fuse),
            inv_count,
            ..PersistArgs::default()
        };
        launch_persistent(op, &p, &args, 2)
    })
}

/// The two-pass backward: the sums (mask read inside, d_addend written), then dx.
fn backward_two_pass(op: &Op<'_>, b: &BwdBufs, inv_count: f32) -> Result<()> {
    let c = op.c();
    let eb = op.eb();
    let first = matches!(op.shape.arr, Arrangement::First { .. });
    let (rf, rname) = op.function(if first { K::ReduceCf } else { K::ReduceCl })?;
    let vec = vec_width(eb, &op.vector_lens(), &[b.x, b.dy, b.dz]);
    let g = reduce_geom(&op.shape, vec, wave(op.ctx, &rf, rname, 0)?);
    let (coef_at, total) = scratch_floats(c, g.parts.into(), REDUCE_PART_FLOATS, 5);
    let mode = apply_mode(&op.shape, eb, &[b.x, b.dy, b.dx]);
    let last = mode == ApplyMode::Last;
    // The channels-last vector path reads its coefficients into registers: nothing staged.
    let staged = if last { 0 } else { staged_bytes(c, 5) };
    tracing::debug!(
        kernel = rname,
        blocks = g.blocks(),
        parts = g.parts,
        vec = g.vec,
        apply = mode.name(),
        staged = staged > 0,
        "own BatchNorm backward (two-pass)"
    );
    let scratch = op.ctx.scratch(total as usize * 4)?;
    let coef = scratch.ptr() + coef_at * 4;
    op.counters.with(op.ctx, op.counter_words(), |cnt| {
        let args = ReduceArgs {
            x: b.x,
            dy: b.dy,
            mask: b.mask,
            dz: b.dz,
            saved_mean: b.saved_mean,
            saved_mean_lo: b.saved_mean_lo,
            saved_invstd: b.saved_invstd,
            gamma: b.gamma,
            part: scratch.ptr(),
            counters: cnt,
            coef,
            dgamma: b.dgamma,
            dbeta: b.dbeta,
            g,
            inv_count,
            act: act(op.fuse),
            hint: u32::from(op.x_fits_l2()),
            pad: 0,
        };
        launch(
            op.ctx,
            &rf,
            &args,
            config(g.blocks(), THREADS, 0),
            "cuLaunchKernel(bn_bwd_reduce)",
        )?;
        if !g.channels_first() {
            let (f, _) = op.function(K::BwdFinalize)?;
            launch(
                op.ctx,
                &f,
                &args,
                config(c as u32, THREADS, 0),
                "cuLaunchKernel(bn_bwd_finalize)",
            )?;
        }
        Ok(())
    })?;
    let (af, aname) = op.function(if last { K::ApplyBwdLast } else { K::ApplyBwd })?;
    let n = op.shape.numel();
    let l = apply_launch(mode, &op.shape, eb, wave(op.ctx, &af, aname, staged)?);
    let args = ApplyBwdArgs {
        x: b.x,
        dy: b.dy,
        mask: b.mask,
        dx: b.dx,
        coef,
        n,
        inner: FastDiv::new(op.shape.inner()),
        chans: FastDiv::new(c),
        res: l.res,
        wpr: l.wpr,
        mode: mode as u32,
        staged: u32::from(staged > 0),
        hint: u32::from(op.x_fits_l2()),
        pad: 0,
    };
    launch(
        op.ctx,
        &af,
        &args,
        config(l.blocks, THREADS, staged),
        "cuLaunchKernel(bn_apply_bwd)",
    )
}

// ----- the persistent variant ---------------------------------------------------------------------

/// How a persistent kernel fits the device (the function's shared-memory attribute is set).
#[derive(Debug, Clone, Copy)]
struct Fit {
    geom: PGeom,
    smem: u32,
    grid: u32,
}

/// A persistent launch that fits the device.
struct Persistent {
    f: CudaFunction,
    name: &'static str,
    geom: PGeom,
    smem: u32,
    grid: u32,
}

/// The persistent kernel and its tiling when the device can run it co-resident; `None` (with a
/// debug event saying why) sends the caller to the two-pass kernels. `tiles`: 1 forward, 2
/// backward. The fit is decided once per BatchNorm and direction; alignment per call.
fn prepare_persistent(op: &Op<'_>, tiles: u64, aligned: bool) -> Result<Option<Persistent>> {
    if !aligned {
        tracing::debug!(
            "own BatchNorm: a data pointer is not 16-byte aligned; two-pass, not persistent"
        );
        return Ok(None);
    }
    let first = matches!(op.shape.arr, Arrangement::First { .. });
    let k = match (tiles, first) {
        (1, true) => K::PersistFwdCf,
        (1, false) => K::PersistFwdCl,
        (_, true) => K::PersistBwdCf,
        (_, false) => K::PersistBwdCl,
    };
    let slot = (tiles.clamp(1, 2) - 1) as usize;
    let cached = lock(&op.counters.persistent)[slot];
    let fit = match cached {
        Some(fit) => fit,
        None => {
            let fit = fit_persistent(op, tiles, k)?;
            lock(&op.counters.persistent)[slot] = Some(fit);
            fit
        }
    };
    match fit {
        Some(fit) => {
            let (f, name) = op.function(k)?;
            Ok(Some(Persistent {
                f,
                name,
                geom: fit.geom,
                smem: fit.smem,
                grid: fit.grid,
            }))
        }
        None => Ok(None),
    }
}

/// Whether and how the persistent kernel `k` fits the device: cooperative launch, the
/// shared-memory opt-in, one or two resident blocks of PTHREADS threads per SM.
fn fit_persistent(op: &Op<'_>, tiles: u64, k: K) -> Result<Option<Fit>> {
    let why_not = |why: &str| {
        tracing::debug!(
            why,
            "own BatchNorm: persistent variant not possible here; two-pass"
        );
    };
    let facts = launch::device_facts(op.ctx)?;
    if !facts.cooperative {
        why_not("the device has no cooperative launch");
        return Ok(None);
    }
    let (f, fname) = op.function(k)?;
    let static_smem = f.shared_size_bytes().call("cuFuncGetAttribute")?.max(0) as u32;
    let limit = facts.smem_optin.saturating_sub(static_smem);
    launch::allow_dynamic_smem(&f, limit as usize)?;
    let sm = u64::from(launch::sm_count(op.ctx));
    for bps in [2u32, 1] {
        // Per block: the opt-in limit, or an even share of the SM (1 KiB reserved per block).
        let per_block = if bps == 1 {
            u64::from(limit)
        } else {
            (u64::from(facts.smem_per_sm) / u64::from(bps))
                .saturating_sub(u64::from(static_smem) + 1024)
                .min(u64::from(limit))
        };
        let grid = sm * u64::from(bps);
        let Some((geom, smem)) = persistent_geom(&op.shape, op.eb(), tiles, grid, per_block) else {
            continue;
        };
        let occ = launch::blocks_per_sm(op.ctx, &f, fname, PTHREADS, smem as u32)?;
        if occ >= bps {
            tracing::debug!(
                kernel = fname,
                grid,
                smem,
                units = geom.units,
                upb = geom.upb,
                parts = geom.parts,
                vec = geom.vec,
                "own BatchNorm persistent launch fits"
            );
            return Ok(Some(Fit {
                geom,
                smem: smem as u32,
                grid: grid as u32,
            }));
        }
    }
    why_not("the tensor does not fit in the device's shared memory");
    Ok(None)
}

/// Launches cooperatively; `false` when the driver refuses the grid as too large (then the
/// caller runs the two-pass kernels: nothing was written, and later calls do not try again).
fn launch_persistent(op: &Op<'_>, p: &Persistent, args: &PersistArgs, tiles: u64) -> Result<bool> {
    let cfg = config(p.grid, PTHREADS, p.smem);
    // SAFETY: as `launch`; the grid was sized from the occupancy query so that every block is
    // co-resident (the kernel's grid barrier needs it; the driver refuses the launch otherwise),
    // and the dynamic shared memory is within the attribute set in prepare_persistent.
    let r = unsafe { launch::launch_cooperative(op.ctx, &p.f, cfg, &mut [launch::arg(args)]) };
    match r {
        Ok(()) => Ok(true),
        Err(DriverError(CUresult::CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE)) => {
            tracing::warn!(
                kernel = p.name,
                grid = p.grid,
                "cooperative launch refused as too large; two-pass kernels instead"
            );
            lock(&op.counters.persistent)[(tiles.clamp(1, 2) - 1) as usize] = Some(None);
            Ok(false)
        }
        Err(e) => Err(e).call("cuLaunchCooperativeKernel(bn_persist)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The field names of `struct NAME { ... };` in a CUDA source, in order.
    fn cuda_fields(src: &str, name: &str) -> Vec<String> {
        let start = src
            .find(&format!("struct {name} {{"))
            .unwrap_or_else(|| panic!("struct {name} not in the kernel source"));
        let body = &src[start..];
        let end = body.find("};").unwrap();
        body[..end]
            .lines()
            .skip(1)
            .filter_map(|l| {
                let l = l.split("//").next().unwrap().trim();
                let decl = l.strip_suffix(';')?;
                // "const float* a, b" style is not used: one field per line.
                decl.split_whitespace()
                    .last()
                    .map(|s| s.trim_start_matches('*').to_string())
            })
            .collect()
    }

    #[test]
    fn argument_structs_match_the_kernels() {
        let bn = crate::kernels::BATCHNORM.source;
        let pbn = crate::kernels::BATCHNORM_PERSISTENT.source;
        let cases: [(&str, &str, &[&str], usize); 9] = [
            (
                bn,
                "FastDiv",
                &["d", "magic", "shift", "is_one"],
                std::mem::size_of::<FastDiv>(),
            ),
            (
                bn,
                "Geom",
                &[
                    "ipr", "runs", "hw", "rows", "ipb", "channels", "parts", "vec", "slabs", "cvs",
                    "rb",
                ],
                std::mem::size_of::<Geom>(),
            ),
            (
                bn,
                "StatsArgs",
                &[
                    "x",
                    "part",
                    "counters",
                    "saved_mean",
                    "saved_mean_lo",
                    "saved_invstd",
                    "running_mean",
                    "running_var",
                    "g",
                    "eps",
                    "momentum",
                ],
                std::mem::size_of::<StatsArgs>(),
            ),
            (
                bn,
                "ReduceArgs",
                &[
                    "x",
                    "dy",
                    "mask",
                    "dz",
                    "saved_mean",
                    "saved_mean_lo",
                    "saved_invstd",
                    "gamma",
                    "part",
                    "counters",
                    "coef",
                    "dgamma",
                    "dbeta",
                    "g",
                    "inv_count",
                    "act",
                    "hint",
                    "pad",
                ],
                std::mem::size_of::<ReduceArgs>(),
            ),
            (
                bn,
                "ApplyFwdArgs",
                &[
                    "x",
                    "z",
                    "y",
                    "mask",
                    "mean",
                    "mean_lo",
                    "inv",
                    "gamma",
                    "beta",
                    "coef",
                    "n",
                    "inner",
                    "chans",
                    "res",
                    "wpr",
                    "mode",
                    "staged",
                    "from_var",
                    "eps",
                    "hint",
                    "reverse",
                    "sum",
                    "sqsum",
                    "sum_lo",
                    "sqsum_lo",
                    "running_mean",
                    "running_var",
                    "count",
                    "momentum",
                ],
                std::mem::size_of::<ApplyFwdArgs>(),
            ),
            (
                bn,
                "ApplyBwdArgs",
                &[
                    "x", "dy", "mask", "dx", "coef", "n", "inner", "chans", "res", "wpr", "mode",
                    "staged", "hint", "pad",
                ],
                std::mem::size_of::<ApplyBwdArgs>(),
            ),
            (
                bn,
                "ChannelBwdArgs",
                &[
                    "x",
                    "dy",
                    "mask",
                    "dx",
                    "dz",
                    "saved_mean",
                    "saved_mean_lo",
                    "gamma",
                    "dgamma",
                    "dbeta",
                    "per_channel",
                    "inner",
                    "eps",
                    "channels",
                    "act",
                ],
                std::mem::size_of::<ChannelBwdArgs>(),
            ),
            (
                pbn,
                "PGeom",
                &[
                    "ipr",
                    "runs",
                    "hw",
                    "rows",
                    "ipb",
                    "units",
                    "unit_elems",
                    "channels",
                    "parts",
                    "upb",
                    "cvs",
                    "rb",
                    "vec",
                ],
                std::mem::size_of::<PGeom>(),
            ),
            (
                pbn,
                "PersistArgs",
                &[
                    "x",
                    "g",
                    "out",
                    "mask",
                    "dz",
                    "gamma",
                    "beta",
                    "mean",
                    "mean_lo",
                    "invstd",
                    "running_mean",
                    "running_var",
                    "dgamma",
                    "dbeta",
                    "part",
                    "coef",
                    "barrier",
                    "geom",
                    "act",
                    "eps",
                    "momentum",
                    "inv_count",
                ],
                std::mem::size_of::<PersistArgs>(),
            ),
        ];
        for (src, name, fields, size) in cases {
            assert_eq!(cuda_fields(src, name), fields, "field order of {name}");
            // Fields are 8 bytes (pointers, u64, f64, nested 8-aligned structs) or 4 bytes, laid
            // out by the same C rules on both sides (#[repr(C)]; an f64 after a lone 4-byte
            // field is padded alike); pin the sizes.
            let want = match name {
                "FastDiv" => 24,
                "Geom" => 80,
                "StatsArgs" => 160,
                "ReduceArgs" => 200,
                "ApplyFwdArgs" => 240,
                "ApplyBwdArgs" => 128,
                "ChannelBwdArgs" => 128,
                "PGeom" => 96,
                "PersistArgs" => 256,
                _ => unreachable!(),
            };
            assert_eq!(size, want, "size of {name}");
        }
    }

    #[test]
    fn activation_codes() {
        assert_eq!(act(Fuse::AddRelu), 2);
    }
}
