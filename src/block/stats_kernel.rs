//! Launcher of `kernels/block_stats.cu`'s per-channel sum and sum of squares (ConvStats'
//! unfused route; the BatchNorm finalize from such sums is launched by
//! `batchnorm/from_sums.rs`). The grid arithmetic is pure and CPU-tested; the launchers take
//! device addresses their callers validated.

use cudarc::driver::{DeviceRepr, LaunchConfig};

use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels;
use crate::launch;

/// Rows a block reduces at least (so that its 8 row lanes each read several rows).
const MIN_ROWS_PER_PART: u64 = 64;
/// Blocks per SM the grid aims at.
const BLOCKS_PER_SM: u64 = 4;
/// Rows each thread of the vector kernel reduces at least.
const MIN_ROWS_PER_THREAD_VEC: u64 = 8;
/// Threads of a block (`blockDim` 32 x 8).
const SUMS_THREADS: u64 = 256;
/// Bytes of the vector kernel's loads.
const SUMS_VECTOR_BYTES: u64 = 16;
/// Values of a channel a channels-first block reduces at least.
const MIN_VALUES_PER_PART: u64 = 2048;
/// Most parts per channel slab (the finish kernel adds them one by one).
const MAX_PARTS: u64 = 1024;

/// The grid of `channel_sums_<t>` over `rows` rows of `channels` channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SumsGeom {
    /// Slabs of 32 channels (grid x).
    pub slabs: u32,
    /// Parts of the rows (grid y).
    pub parts: u32,
    /// Rows per part.
    pub rows_per_part: u64,
}

/// The grid for `rows` x `channels` on `sms` SMs: about [`BLOCKS_PER_SM`] blocks per SM, each
/// part at least [`MIN_ROWS_PER_PART`] rows (pure).
pub(crate) fn sums_geom(rows: u64, channels: u64, sms: u64) -> SumsGeom {
    let slabs = channels.div_ceil(32).max(1);
    let want = (sms.max(1) * BLOCKS_PER_SM).div_ceil(slabs).max(1);
    let most = rows.div_ceil(MIN_ROWS_PER_PART).max(1);
    let parts = want.min(most).min(MAX_PARTS);
    let rows_per_part = rows.div_ceil(parts).max(1);
    SumsGeom {
        slabs: slabs as u32,
        parts: rows.div_ceil(rows_per_part).max(1) as u32,
        rows_per_part,
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct SumsArgs {
    y: u64,
    part: u64,
    rows: u64,
    rpp: u64,
    hw: u64,
    channels: u32,
    parts: u32,
}

// SAFETY: plain old data laid out as the kernels' structs (checked by the tests below).
unsafe impl DeviceRepr for SumsArgs {}

/// The grid of `channel_sums_vec_<t>` over `rows` rows of `channels` channels in vectors of
/// `v` elements (`channels` a multiple of `v`): slabs of up to 256 vectors side by side (grid
/// x), `wave` blocks in all (the resident blocks of the whole device: one full wave, no tail
/// of a second), each thread at least [`MIN_ROWS_PER_THREAD_VEC`] rows (pure; the kernel
/// computes the same `cvs` and `rb`).
pub(crate) fn sums_geom_vec(rows: u64, channels: u64, v: u64, wave: u64) -> SumsGeom {
    let cv = (channels / v.max(1)).max(1);
    let cvs = cv.min(SUMS_THREADS);
    let rb = SUMS_THREADS / cvs;
    let slabs = cv.div_ceil(cvs);
    let want = (wave.max(1) / slabs).max(1);
    let most = rows.div_ceil(rb * MIN_ROWS_PER_THREAD_VEC).max(1);
    let parts = want.min(most).min(MAX_PARTS);
    let rows_per_part = rows.div_ceil(parts).max(1);
    SumsGeom {
        slabs: slabs as u32,
        parts: rows.div_ceil(rows_per_part).max(1) as u32,
        rows_per_part,
    }
}

/// Whether channels-last data of `dtype` at `y` with `channels` channels takes the vector
/// kernel (whole 16-byte vectors per row, `y` aligned to them).
fn vector_sums(dtype: DType, y: u64, channels: u64) -> bool {
    let v = SUMS_VECTOR_BYTES / dtype.size() as u64;
    y % SUMS_VECTOR_BYTES == 0 && channels % v == 0
}

fn sums_vec_kernel(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "channel_sums_vec_f32",
        DType::F16 => "channel_sums_vec_f16",
        DType::BF16 => "channel_sums_vec_bf16",
    }
}

fn sums_kernel(dtype: DType, channels_first: bool) -> &'static str {
    match (dtype, channels_first) {
        (DType::F32, false) => "channel_sums_f32",
        (DType::F16, false) => "channel_sums_f16",
        (DType::BF16, false) => "channel_sums_bf16",
        (DType::F32, true) => "channel_sums_cf_f32",
        (DType::F16, true) => "channel_sums_cf_f16",
        (DType::BF16, true) => "channel_sums_cf_bf16",
    }
}

/// The grid of `channel_sums_cf_<t>` over `channels` channels of `count` values each: one
/// slab per channel (grid x), parts of at least [`MIN_VALUES_PER_PART`] values (pure).
pub(crate) fn sums_geom_cf(count: u64, channels: u64, sms: u64) -> SumsGeom {
    let want = (sms.max(1) * BLOCKS_PER_SM)
        .div_ceil(channels.max(1))
        .max(1);
    let most = count.div_ceil(MIN_VALUES_PER_PART).max(1);
    let parts = want.min(most).min(MAX_PARTS);
    let per = count.div_ceil(parts).max(1);
    SumsGeom {
        slabs: channels.max(1) as u32,
        parts: count.div_ceil(per).max(1) as u32,
        rows_per_part: per,
    }
}

/// Where a reduction's per-channel results go: device addresses of `channels` f32s each; the
/// low words (what the f32 rounding of the f64 sums dropped) only where non-zero.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SumsOut {
    pub(crate) sum: u64,
    pub(crate) sqsum: u64,
    pub(crate) sum_lo: u64,
    pub(crate) sqsum_lo: u64,
}

impl SumsOut {
    /// The rounded sums only.
    pub(crate) fn rounded(sum: u64, sqsum: u64) -> SumsOut {
        SumsOut {
            sum,
            sqsum,
            sum_lo: 0,
            sqsum_lo: 0,
        }
    }
}

/// `sum[c]`, `sqsum[c]` (f32) of `y` of `dtype`, in f64 per thread and per part, rounded once
/// (and the low words where `out` has them): channels-last (`hw = 0`: `rows` rows of `channels`
/// elements) or channels-first (`rows / hw` runs of `hw` elements per channel).
///
/// # Safety
/// `y` holds `rows * channels` elements of `dtype` (`hw` divides `rows`), every non-zero
/// address of `out` `channels` f32s, all on the Context's device, the outputs overlapping
/// nothing else, valid until the queued work completes.
pub(crate) unsafe fn channel_sums(
    ctx: &Context,
    dtype: DType,
    y: u64,
    rows: u64,
    hw: u64,
    channels: u64,
    out: SumsOut,
) -> Result<()> {
    let ch = u32::try_from(channels)
        .map_err(|_| Error::invalid("channels", format!("{channels} exceeds u32")))?;
    let sms = launch::sm_count(ctx).into();
    let cf = hw > 0;
    let vec = !cf && vector_sums(dtype, y, channels);
    let name = if vec {
        sums_vec_kernel(dtype)
    } else {
        sums_kernel(dtype, cf)
    };
    let f = ctx.function(&kernels::BLOCK_STATS, name)?;
    let g = if cf {
        sums_geom_cf(rows, channels, sms)
    } else if vec {
        // One full wave at the occupancy the driver reports (32 KB of f64 staging and ~76
        // registers a thread hold it to 3 blocks of 256 per SM on the H100, not 4).
        let per_sm = launch::blocks_per_sm(ctx, &f, name, SUMS_THREADS as u32, 0)?;
        sums_geom_vec(
            rows,
            channels,
            SUMS_VECTOR_BYTES / dtype.size() as u64,
            sms * u64::from(per_sm.max(1)),
        )
    } else {
        sums_geom(rows, channels, sms)
    };
    let scratch = ctx.scratch(2 * channels as usize * g.parts as usize * 8)?;
    let args = SumsArgs {
        y,
        part: scratch.ptr(),
        rows,
        rpp: g.rows_per_part,
        hw,
        channels: ch,
        parts: g.parts,
    };
    tracing::debug!(
        slabs = g.slabs,
        parts = g.parts,
        rows_per_part = g.rows_per_part,
        kernel = name,
        "per-channel sums"
    );
    let cfg = LaunchConfig {
        grid_dim: (g.slabs, g.parts, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: SumsArgs is the kernel's struct; y and the scratch partials (2*C*P f64) are sized
    // as the caller's contract and the line above say.
    unsafe {
        launch::launch_kernel(
            ctx,
            &f,
            cfg,
            &mut [launch::arg(&args)],
            "cuLaunchKernel(channel_sums)",
        )
    }?;
    // SAFETY: the partials were written above ([2][C][parts]), `out` as the caller's contract
    // says; the scratch guard is held until the launch is queued.
    unsafe { finish_sums(ctx, scratch.ptr(), channels, u64::from(g.parts), out) }
}

/// `channel_sums_finish`: adds `[2][channels][parts]` f64 partial sums at `part` into `out`'s
/// sum and sqsum (f32, `channels` each; and their low words where `out` has them), a warp per
/// channel in a fixed order.
///
/// # Safety
/// `part` holds the partials (written before, in stream order), every non-zero address of
/// `out` `channels` f32s, on the Context's device.
pub(crate) unsafe fn finish_sums(
    ctx: &Context,
    part: u64,
    channels: u64,
    parts: u64,
    out: SumsOut,
) -> Result<()> {
    let fin = ctx.function(&kernels::BLOCK_STATS, "channel_sums_finish")?;
    let (c32, p32) = (channels as u32, parts as u32);
    // The kernel writes the low words only where both addresses are given.
    let lo = if out.sum_lo != 0 && out.sqsum_lo != 0 {
        (out.sum_lo, out.sqsum_lo)
    } else {
        (0, 0)
    };
    // SAFETY: channel_sums_finish(const double*, u32, u32, float* x4) matches; the rest is the
    // caller's contract.
    unsafe {
        launch::launch_kernel(
            ctx,
            &fin,
            launch_1d(channels * 32), // a warp per channel
            &mut [
                launch::arg(&part),
                launch::arg(&c32),
                launch::arg(&p32),
                launch::arg(&out.sum),
                launch::arg(&out.sqsum),
                launch::arg(&lo.0),
                launch::arg(&lo.1),
            ],
            "cuLaunchKernel(channel_sums_finish)",
        )
    }
}

/// One thread per item, 128 per block.
pub(crate) fn launch_1d(n: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(128).max(1) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_covers_every_row_once_and_fills_the_device() {
        for (rows, c, sms) in [
            (100_352u64, 64u64, 132u64),
            (100_352, 256, 132),
            (392, 64, 132),
            (128, 3, 132),
            (1, 1, 1),
            (7, 33, 2),
        ] {
            let g = sums_geom(rows, c, sms);
            assert_eq!(u64::from(g.slabs), c.div_ceil(32));
            assert!(g.parts >= 1 && u64::from(g.parts) <= MAX_PARTS);
            // Parts tile the rows: the last one starts before the end, none is empty.
            assert!(u64::from(g.parts) * g.rows_per_part >= rows, "{g:?}");
            assert!(u64::from(g.parts - 1) * g.rows_per_part < rows, "{g:?}");
            if rows >= MIN_ROWS_PER_PART * 2 {
                assert!(g.rows_per_part >= MIN_ROWS_PER_PART / 2, "{g:?}");
            }
        }
        for (count, c) in [(392u64, 64u64), (100_352, 3), (1, 1), (5000, 1)] {
            let g = sums_geom_cf(count, c, 132);
            assert_eq!(u64::from(g.slabs), c);
            assert!(u64::from(g.parts) * g.rows_per_part >= count, "{g:?}");
            assert!(u64::from(g.parts - 1) * g.rows_per_part < count, "{g:?}");
        }
        for (rows, c, v) in [
            (100_352u64, 256u64, 8u64),
            (100_352, 64, 8),
            (100_352, 64, 4),
            (392, 2048, 8),
            (7, 8, 8),
            (1, 4, 4),
            (300, 200, 8),
        ] {
            let g = sums_geom_vec(rows, c, v, 3 * 132);
            let cv = c / v;
            let cvs = cv.min(SUMS_THREADS);
            // Slabs of cvs vectors cover every vector once; parts tile the rows.
            assert_eq!(u64::from(g.slabs), cv.div_ceil(cvs), "{g:?}");
            assert!(u64::from(g.slabs) * cvs >= cv);
            assert!(u64::from(g.parts) * g.rows_per_part >= rows, "{g:?}");
            assert!(u64::from(g.parts - 1) * g.rows_per_part < rows, "{g:?}");
            assert!(u64::from(g.parts) <= MAX_PARTS);
            // At most one wave (a grid of several slabs may leave a few blocks of it idle).
            assert!(u64::from(g.parts) * u64::from(g.slabs) <= (3 * 132).max(u64::from(g.slabs)));
        }
        // The demo's conv3 output (256 channels, f16): one slab of 32 vectors, 8 rows at a
        // time, exactly one wave of 3 blocks per SM, every thread at least 8 rows.
        let g = sums_geom_vec(100_352, 256, 8, 3 * 132);
        assert!(g.slabs == 1 && g.parts == 396, "{g:?}");
        assert!(g.rows_per_part >= 8 * MIN_ROWS_PER_THREAD_VEC);
        assert!(vector_sums(DType::F16, 0x1000, 256));
        assert!(!vector_sums(DType::F16, 0x1002, 256));
        assert!(!vector_sums(DType::F32, 0x1000, 6));
        let src = kernels::BLOCK_STATS.source;
        for d in [DType::F32, DType::F16, DType::BF16] {
            assert!(src.contains(&format!(
                "void __launch_bounds__(256) {}(",
                sums_vec_kernel(d)
            )));
        }
        // The demo's conv1 output: 2 slabs, enough blocks for 4 per SM.
        let g = sums_geom(32 * 56 * 56, 64, 132);
        assert!(
            u64::from(g.slabs) * u64::from(g.parts) >= 4 * 132 - 2,
            "{g:?}"
        );
    }

    /// The field names, in order, of `struct name { ... };` in the CUDA source.
    fn cuda_fields(src: &str, name: &str) -> Vec<String> {
        let start = src
            .find(&format!("struct {name} {{"))
            .expect("struct in source");
        let body = &src[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
        body.lines()
            .map(|l| l.split("//").next().unwrap().trim())
            .filter(|l| !l.is_empty())
            .map(|l| {
                l.trim_end_matches(';')
                    .rsplit([' ', '*'])
                    .next()
                    .unwrap()
                    .to_string()
            })
            .collect()
    }

    #[test]
    fn argument_structs_match_the_kernels() {
        let src = kernels::BLOCK_STATS.source;
        assert_eq!(
            cuda_fields(src, "SumsArgs"),
            ["y", "part", "rows", "rpp", "hw", "channels", "parts"]
        );
        assert_eq!(std::mem::size_of::<SumsArgs>(), 48);
    }
}
