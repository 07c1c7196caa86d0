//! What every launcher of nnfuse's own kernels asks the device before it sizes a grid: device
//! facts (SM count, shared memory, cooperative launch), the occupancy of a kernel at a block size
//! and dynamic shared memory, and one wave of resident blocks. Answers are cached per device for
//! the life of the process (they never change), so a cached launch asks the driver nothing.
//! The grid rules themselves stay pure in the launchers' own files. Also the launch itself
//! ([`launch_kernel`], [`launch_cooperative`]): `cuLaunchKernel` with the arguments' addresses
//! in an array on the caller's stack, where cudarc's launch builder collects them in a `Vec`
//! allocated per launch.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{result as drv, CudaFunction, DeviceRepr, DriverError, LaunchConfig};
use once_cell::sync::Lazy;

use crate::context::Context;
use crate::error::{CallExt, Result};

/// The device's launch limits that the persistent kernels size themselves by.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceFacts {
    /// Largest dynamic + static shared memory one block may opt in to.
    pub smem_optin: u32,
    /// Shared memory of one SM.
    pub smem_per_sm: u32,
    /// Cooperative launches supported.
    pub cooperative: bool,
}

/// (device ordinal, kernel, threads per block, dynamic shared memory bytes).
type OccupancyKey = (usize, &'static str, u32, u32);

static FACTS: Lazy<Mutex<HashMap<usize, DeviceFacts>>> = Lazy::new(|| Mutex::new(HashMap::new()));
static OCCUPANCY: Lazy<Mutex<HashMap<OccupancyKey, u32>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

/// A poisoned cache is still a valid cache (entries are written whole).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The Context device's facts (queried once per device).
pub(crate) fn device_facts(ctx: &Context) -> Result<DeviceFacts> {
    let ordinal = ctx.info().ordinal;
    if let Some(f) = lock(&FACTS).get(&ordinal) {
        return Ok(*f);
    }
    let attr = |a| ctx.cuda().attribute(a).call("cuDeviceGetAttribute");
    use CUdevice_attribute as A;
    let f = DeviceFacts {
        smem_optin: attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0) as u32,
        smem_per_sm: attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?.max(0)
            as u32,
        cooperative: attr(A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)? != 0,
    };
    lock(&FACTS).insert(ordinal, f);
    Ok(f)
}

/// The Context device's SM count, at least 1.
pub(crate) fn sm_count(ctx: &Context) -> u32 {
    ctx.info().sm_count.max(1) as u32
}

/// Resident blocks per SM of `f` (named `name`) at `threads` threads and `smem` bytes of dynamic
/// shared memory, as the driver reports it (0 when the block does not fit at all).
pub(crate) fn blocks_per_sm(
    ctx: &Context,
    f: &CudaFunction,
    name: &'static str,
    threads: u32,
    smem: u32,
) -> Result<u32> {
    let key = (ctx.info().ordinal, name, threads, smem);
    if let Some(v) = lock(&OCCUPANCY).get(&key) {
        return Ok(*v);
    }
    ctx.cuda().bind_to_thread().call("cuCtxSetCurrent")?;
    let v = f
        .occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)
        .call("cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
    lock(&OCCUPANCY).insert(key, v);
    Ok(v)
}

/// Blocks in one full wave: `sm_count * blocks_per_sm`, each at least 1 (a zero occupancy
/// report still gives a launchable grid). Pure.
pub(crate) fn wave_blocks(sm_count: u32, blocks_per_sm: u32) -> u64 {
    u64::from(sm_count.max(1)) * u64::from(blocks_per_sm.max(1))
}

/// One wave of `f`'s blocks on the Context's device (see [`wave_blocks`]).
pub(crate) fn one_wave(
    ctx: &Context,
    f: &CudaFunction,
    name: &'static str,
    threads: u32,
    smem: u32,
) -> Result<u64> {
    let per_sm = blocks_per_sm(ctx, f, name, threads, smem)?;
    Ok(wave_blocks(sm_count(ctx), per_sm))
}

/// A grid-stride launch over `n` items: `threads` threads a block, at most 32 blocks per SM.
pub(crate) fn grid_stride_config(ctx: &Context, n: usize, threads: u32) -> LaunchConfig {
    let blocks_needed = n.div_ceil(threads as usize).max(1);
    let cap = (sm_count(ctx) as usize) * 32;
    LaunchConfig {
        grid_dim: (blocks_needed.min(cap) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Lets `f` launch with up to `bytes` of dynamic shared memory (`cuFuncSetAttribute`; beyond
/// 48 KiB a kernel must opt in). The attribute stays with the function.
pub(crate) fn allow_dynamic_smem(f: &CudaFunction, bytes: usize) -> Result<()> {
    let bytes = i32::try_from(bytes).map_err(|_| {
        crate::error::Error::invalid("shared memory", format!("{bytes} bytes do not fit in i32"))
    })?;
    f.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes,
    )
    .call("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
}

/// `v` as a kernel's `u32` argument, or an error naming `what` when it does not fit.
pub(crate) fn u32_arg(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v)
        .map_err(|_| crate::error::Error::invalid(what, format!("{v} does not fit in u32")))
}

/// A kernel argument's address, as the parameter array of [`launch_kernel`] holds it (the
/// value must outlive the launch call; the driver copies it when the launch is queued).
#[inline(always)]
pub(crate) fn arg<T: DeviceRepr>(v: &T) -> *mut c_void {
    std::ptr::from_ref(v).cast_mut().cast()
}

/// Queues `f` on the Context's stream with `cfg`'s grid, block and dynamic shared memory and the
/// kernel parameters `params` (one [`arg`] per parameter, in order): what cudarc's launch builder
/// does (its context's sticky error checked and the context made current, then
/// `cuLaunchKernel`), without its per-launch allocation. Either status is an error naming `call`.
///
/// # Safety
/// `params` has one entry per kernel parameter, each the address of a value of that
/// parameter's type; every device address among them is valid for what the kernel does with
/// it until the queued work completes.
pub(crate) unsafe fn launch_kernel(
    ctx: &Context,
    f: &CudaFunction,
    cfg: LaunchConfig,
    params: &mut [*mut c_void],
    call: &'static str,
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { launch_on_stream(ctx, f, cfg, params, drv::launch_kernel) }.call(call)
}

/// [`launch_kernel`] as a cooperative launch (`cuLaunchCooperativeKernel`), returning the
/// driver's error itself so that the caller can tell a grid refused as too large.
///
/// # Safety
/// As [`launch_kernel`]; every block of the grid can be resident at once.
pub(crate) unsafe fn launch_cooperative(
    ctx: &Context,
    f: &CudaFunction,
    cfg: LaunchConfig,
    params: &mut [*mut c_void],
) -> std::result::Result<(), DriverError> {
    // SAFETY: the caller's contract.
    unsafe { launch_on_stream(ctx, f, cfg, params, drv::launch_cooperative_kernel) }
}

/// The driver's launch entry points (`cuLaunchKernel`, `cuLaunchCooperativeKernel`) share
/// this signature.
type DriverLaunch = unsafe fn(
    sys::CUfunction,
    (u32, u32, u32),
    (u32, u32, u32),
    u32,
    sys::CUstream,
    &mut [*mut c_void],
) -> std::result::Result<(), DriverError>;

/// What both launches do: the Context made current, then `launch` on its stream.
///
/// # Safety
/// As [`launch_kernel`] (and, for a cooperative `launch`, [`launch_cooperative`]).
unsafe fn launch_on_stream(
    ctx: &Context,
    f: &CudaFunction,
    cfg: LaunchConfig,
    params: &mut [*mut c_void],
    launch: DriverLaunch,
) -> std::result::Result<(), DriverError> {
    ctx.cuda().bind_to_thread()?;
    // SAFETY: the caller's contract; the stream is the Context's, live.
    unsafe {
        launch(
            f.cu_function(),
            cfg.grid_dim,
            cfg.block_dim,
            cfg.shared_mem_bytes,
            ctx.stream().cu_stream(),
            params,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_argument_is_its_value_address() {
        let v = 7u64;
        assert_eq!(arg(&v) as usize, std::ptr::from_ref(&v) as usize);
    }

    #[test]
    fn a_wave_is_never_empty() {
        assert_eq!(wave_blocks(132, 8), 1056);
        assert_eq!(wave_blocks(0, 0), 1);
        assert_eq!(wave_blocks(132, 0), 132);
    }
}
