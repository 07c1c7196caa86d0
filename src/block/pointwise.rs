//! Launcher of `kernels/conv_pointwise.cu`: ConvStats' `own_pointwise` route, a 1x1 stride-1
//! unpadded channels-last convolution on tensor cores whose epilogue also sums each output
//! channel and its squares (then `channel_sums_finish` adds the blocks' partials). What it can
//! run and its grid are pure and CPU-tested; the launcher takes addresses its caller validated.

use cudarc::driver::{DeviceRepr, LaunchConfig};

use once_cell::sync::Lazy;

use super::stats_kernel::{finish_sums, SumsOut};
use crate::context::Context;
use crate::conv::ConvShape;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::{self, KernelFile};
use crate::launch;
use crate::layout::TensorFormat;

/// Rows of a tile (`PW_BM`).
const BM: u64 = 64;
/// k of a staged chunk (`PW_BK`).
const BK: u64 = 64;
/// Threads of a block (`PW_THREADS`).
const THREADS: u32 = 256;
/// Shared memory the route may use: what every sm_80+ GPU lets one block opt in to (sm_86 and
/// sm_89 allow 99 KB), so that the plan, which makes no GPU call, holds on any of them.
pub(crate) const MAX_SMEM: u64 = 99 * 1024;
/// The output channel counts a kernel exists for (32 · NT, NT = 1, 2, 4, 8).
pub(crate) const C_OUT: [usize; 4] = [32, 64, 128, 256];
/// Most stages of x in flight (`PW_MAX_STAGES`); fewer than 2 do not pipeline.
const MAX_STAGES: u64 = 6;
/// Bytes of one stage of x: 64 rows of 64 + 8 halves.
const STAGE_BYTES: u64 = BM * (BK + 8) * 2;
/// Bytes of the end's f64 partials (`red`: 2 x 256 threads x 8 channels), which reuse the stages
/// and the output tile.
const RED_BYTES: u64 = 2 * 2048 * 8;

/// The kernel's stages of x and dynamic shared memory for `c_in` → `c_out`: the whole filter at
/// a row stride of 64·⌈c_in/64⌉ + 8 halves, as many stages as fit in [`MAX_SMEM`] (2 to
/// [`MAX_STAGES`]), the output tile at c_out + 8 halves a row; None when 2 stages do not fit
/// (pure).
pub(crate) fn layout(c_in: usize, c_out: usize) -> Option<(u64, u64)> {
    let ldw = BK * (c_in as u64).div_ceil(BK) + 8;
    let co = c_out as u64;
    let fixed = 2 * co * ldw + BM * (co + 8) * 2;
    let stages = (MAX_SMEM.checked_sub(fixed)? / STAGE_BYTES).min(MAX_STAGES);
    if stages < 2 {
        return None;
    }
    let smem = 2 * co * ldw + (stages * STAGE_BYTES + BM * (co + 8) * 2).max(RED_BYTES);
    (smem <= MAX_SMEM).then_some((stages, smem))
}

/// Why the route cannot run `shape` in `dtype` on a GPU of compute capability `cc` (`None`: not
/// known yet, as in a plan made without a GPU), or None (pure).
pub(crate) fn refusal(shape: &ConvShape, dtype: DType, cc: Option<(i32, i32)>) -> Option<String> {
    let s = shape;
    if dtype == DType::F32 {
        return Some("f32 data (the kernel multiplies f16 or bf16 on tensor cores)".into());
    }
    if let Some(cc) = cc.filter(|cc| cc.0 < 8) {
        return Some(format!(
            "compute capability {}.{} (mma.sync with f16/bf16 inputs needs 8.0)",
            cc.0, cc.1
        ));
    }
    if s.format != TensorFormat::Nhwc {
        return Some("NCHW (the kernel reads channels-last rows)".into());
    }
    if (s.kh, s.kw, s.stride, s.pad) != (1, 1, (1, 1), (0, 0)) {
        return Some(format!(
            "not a 1x1 stride-1 unpadded convolution ({}x{}, stride {:?}, pad {:?})",
            s.kh, s.kw, s.stride, s.pad
        ));
    }
    if s.c_in % 8 != 0 {
        return Some(format!("c_in {} is not a multiple of 8", s.c_in));
    }
    if !C_OUT.contains(&s.c_out) {
        return Some(format!("c_out {} is not one of {C_OUT:?}", s.c_out));
    }
    // The kernel counts tiles and a block's items (tiles x k chunks) in 32 bits.
    let tiles = (s.n as u64)
        .saturating_mul(s.h as u64)
        .saturating_mul(s.w as u64)
        .div_ceil(BM);
    if tiles.saturating_mul((s.c_in as u64).div_ceil(BK)) > u64::from(u32::MAX / 2) {
        return Some(format!(
            "{tiles} row tiles of {BM}: beyond the kernel's 32-bit tile and item counts"
        ));
    }
    if layout(s.c_in, s.c_out).is_none() {
        return Some(format!(
            "the filter ({} B) and two stages of the input do not fit in {MAX_SMEM} B of shared \
             memory",
            2 * s.c_out * (64 * s.c_in.div_ceil(64) + 8)
        ));
    }
    None
}

/// The kernel's name for `dtype` and `c_out` (one of [`C_OUT`]).
fn kernel(dtype: DType, c_out: usize) -> Result<&'static str> {
    Ok(match (dtype, c_out) {
        (DType::F16, 32) => "conv_pointwise_f16_n1",
        (DType::F16, 64) => "conv_pointwise_f16_n2",
        (DType::F16, 128) => "conv_pointwise_f16_n4",
        (DType::F16, 256) => "conv_pointwise_f16_n8",
        (DType::BF16, 32) => "conv_pointwise_bf16_n1",
        (DType::BF16, 64) => "conv_pointwise_bf16_n2",
        (DType::BF16, 128) => "conv_pointwise_bf16_n4",
        (DType::BF16, 256) => "conv_pointwise_bf16_n8",
        _ => {
            return Err(Error::NotSupported(format!(
                "own_pointwise: no kernel for {dtype} with c_out {c_out}"
            )))
        }
    })
}

/// Blocks of the persistent grid: one per tile of [`BM`] rows, at most `wave` (pure).
pub(crate) fn grid(rows: u64, wave: u64) -> u64 {
    rows.div_ceil(BM).min(wave.max(1)).max(1)
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct PwArgs {
    x: u64,
    w: u64,
    y: u64,
    part: u64,
    rows: u64,
    k: u32,
    kchunks: u32,
    tiles: u32,
    ldw: u32,
    stages: u32,
}

// SAFETY: plain old data laid out as the kernel's `PwArgs` (checked by the test below).
unsafe impl DeviceRepr for PwArgs {}

/// Whether the addresses suit the kernel: x and w are read in 16-byte pieces (cp.async), y is
/// written in 16-byte pieces (each output tile's rows, staged in shared memory).
pub(crate) fn aligned(x: u64, w: u64, y: u64) -> bool {
    x % 16 == 0 && w % 16 == 0 && y % 16 == 0
}

/// `y = conv(x, w)` and its per-channel `sum`, `sqsum` (f32) for `shape` (eligible by
/// [`refusal`]).
///
/// # Safety
/// x, w and y hold the shape's element counts of `dtype` on the Context's device, sum and sqsum
/// `c_out` f32s, y disjoint from the others, the addresses [`aligned`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn run(
    ctx: &Context,
    shape: &ConvShape,
    dtype: DType,
    x: u64,
    w: u64,
    y: u64,
    sum: u64,
    sqsum: u64,
) -> Result<()> {
    if let Some(why) = refusal(shape, dtype, Some(ctx.info().compute_capability)) {
        return Err(Error::NotSupported(format!("own_pointwise: {why}")));
    }
    if !aligned(x, w, y) {
        return Err(Error::NotSupported(
            "own_pointwise: x, w or y is not 16-byte aligned".into(),
        ));
    }
    let name = kernel(dtype, shape.c_out)?;
    let file = unit(dtype).ok_or_else(|| Error::NotSupported("own_pointwise: f32".into()))?;
    let f = ctx.function(file, name)?;
    let (stages, smem) = layout(shape.c_in, shape.c_out)
        .ok_or_else(|| Error::NotSupported("own_pointwise: shared memory".into()))?;
    launch::allow_dynamic_smem(&f, smem as usize)?;
    let rows = (shape.n * shape.h * shape.w) as u64;
    let wave = launch::one_wave(ctx, &f, name, THREADS, smem as u32)?;
    let blocks = grid(rows, wave);
    let tiles = u32::try_from(rows.div_ceil(BM))
        .map_err(|_| Error::invalid("x", format!("{rows} rows exceed the kernel's tile count")))?;
    let kchunks = (shape.c_in as u64).div_ceil(BK);
    let c_out = shape.c_out as u64;
    let scratch = ctx.scratch(2 * shape.c_out * blocks as usize * 8)?;
    let args = PwArgs {
        x,
        w,
        y,
        part: scratch.ptr(),
        rows,
        k: shape.c_in as u32,
        kchunks: kchunks as u32,
        tiles,
        ldw: (BK * kchunks + 8) as u32,
        stages: stages as u32,
    };
    tracing::debug!(
        kernel = name,
        blocks,
        wave,
        smem,
        "own pointwise conv+stats"
    );
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: PwArgs is the kernel's struct; x, w, y sized and aligned as the caller's contract
    // says, the partials (2·c_out·blocks f64) in the scratch; the shared memory opted in above.
    unsafe {
        launch::launch_kernel(
            ctx,
            &f,
            cfg,
            &mut [launch::arg(&args)],
            "cuLaunchKernel(conv_pointwise)",
        )
    }?;
    // SAFETY: the partials were written above ([2][c_out][blocks]), sum and sqsum hold c_out
    // floats (the caller's contract); the scratch guard is held until the launch is queued.
    unsafe {
        finish_sums(
            ctx,
            scratch.ptr(),
            c_out,
            blocks,
            SumsOut::rounded(sum, sqsum),
        )
    }
}

/// The compilation unit of `dtype`'s kernels (`NNF_PW_DT`): a first call compiles four kernels,
/// not eight. None for f32 (no kernel).
pub(crate) fn unit(dtype: DType) -> Option<&'static KernelFile> {
    static UNITS: Lazy<[KernelFile; 2]> = Lazy::new(|| {
        let u = |dt: u32, label: &str| {
            kernels::unit(&kernels::CONV_POINTWISE, label, &[("NNF_PW_DT", dt)])
        };
        [u(2, "f16"), u(3, "bf16")]
    });
    match dtype {
        DType::F16 => Some(&UNITS[0]),
        DType::BF16 => Some(&UNITS[1]),
        DType::F32 => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(c_in: usize, c_out: usize) -> ConvShape {
        ConvShape::square(32, c_in, 56, c_out, 1, TensorFormat::Nhwc)
    }

    #[test]
    fn the_demo_shapes_fit_and_the_rest_say_why() {
        let h100 = Some((9, 0));
        for (ci, co) in [(256, 64), (64, 256), (64, 64), (8, 32)] {
            assert_eq!(
                refusal(&shape(ci, co), DType::F16, h100),
                None,
                "{ci}->{co}"
            );
            assert_eq!(
                refusal(&shape(ci, co), DType::BF16, h100),
                None,
                "{ci}->{co}"
            );
        }
        // The demo's: 3 stages beside the 256-channel filter and output tile (twice in an H100
        // SM's 228 KB), 6 beside the 256-wide filter of 64 channels.
        assert_eq!(layout(64, 256), Some((3, 96 * 1024)));
        assert_eq!(layout(256, 64), Some((6, 96 * 1024)));
        // A small filter still leaves room for the end's partials.
        assert_eq!(layout(8, 32).map(|l| l.0), Some(6));
        assert!(layout(8, 32).unwrap().1 >= 2 * 32 * 72 + RED_BYTES);
        assert_eq!(layout(72, 128).map(|l| l.0), Some(5));
        let why = |s: &ConvShape, dt, cc| refusal(s, dt, cc).unwrap_or_default();
        assert!(why(&shape(64, 256), DType::F32, h100).contains("f32"));
        assert!(why(&shape(64, 256), DType::F16, Some((7, 5))).contains("7.5"));
        assert_eq!(refusal(&shape(64, 256), DType::F16, None), None);
        assert!(why(&shape(60, 256), DType::F16, h100).contains("c_in 60"));
        assert!(why(&shape(64, 96), DType::F16, h100).contains("c_out 96"));
        assert!(why(&shape(512, 256), DType::F16, h100).contains("shared memory"));
        let mut s = shape(64, 64);
        s.format = TensorFormat::Nchw;
        assert!(why(&s, DType::F16, h100).contains("NCHW"));
        let mut s = shape(64, 64);
        s.stride = (2, 2);
        assert!(why(&s, DType::F16, h100).contains("1x1 stride-1"));
        let s = ConvShape::square(32, 64, 56, 64, 3, TensorFormat::Nhwc);
        assert!(why(&s, DType::F16, h100).contains("3x3"));
        // 2^36 rows of 256 channels (2^30 tiles, 4 k chunks each): past the 32-bit item count.
        let s = ConvShape::square(1 << 20, 256, 256, 64, 1, TensorFormat::Nhwc);
        assert!(why(&s, DType::F16, h100).contains("32-bit"), "{s:?}");
    }

    #[test]
    fn each_unit_selects_its_dtype() {
        assert!(unit(DType::F16)
            .unwrap()
            .source
            .starts_with("#define NNF_PW_DT 2"));
        assert!(unit(DType::BF16)
            .unwrap()
            .source
            .starts_with("#define NNF_PW_DT 3"));
        assert!(unit(DType::F32).is_none());
        assert!(kernels::CONV_POINTWISE
            .source
            .contains("#if NNF_PW_DT == 0 || NNF_PW_DT == 3"));
    }

    #[test]
    fn the_stage_limit_is_the_kernels() {
        let src = kernels::CONV_POINTWISE.source;
        assert!(src.contains(&format!("#define PW_MAX_STAGES {MAX_STAGES}")));
    }

    #[test]
    fn every_operand_must_be_16_byte_aligned() {
        assert!(aligned(256, 512, 4096));
        // y is written in 16-byte pieces: 4- or 8-byte alignment is not enough.
        assert!(!aligned(256, 512, 4100));
        assert!(!aligned(256, 512, 4104));
        assert!(!aligned(8, 512, 4096));
        assert!(!aligned(256, 2, 4096));
    }

    #[test]
    fn the_grid_is_one_wave_or_every_tile() {
        assert_eq!(grid(32 * 56 * 56, 132), 132);
        assert_eq!(grid(100, 132), 2);
        assert_eq!(grid(1, 132), 1);
        assert_eq!(grid(1 << 20, 0), 1);
    }

    #[test]
    fn the_args_struct_matches_the_kernel() {
        let src = kernels::CONV_POINTWISE.source;
        let body = &src[src.find("struct PwArgs {").expect("PwArgs")..];
        let body = &body[..body.find("};").expect("end")];
        let fields: Vec<&str> = body
            .lines()
            .skip(1)
            .filter_map(|l| l.split("//").next())
            .flat_map(|l| l.split(';'))
            .filter_map(|d| d.split_whitespace().last())
            .map(|f| f.trim_start_matches('*'))
            .flat_map(|f| f.split(','))
            .filter(|f| !f.is_empty())
            .collect();
        assert_eq!(
            fields,
            ["x", "w", "y", "part", "rows", "k", "kchunks", "tiles", "ldw", "stages"]
        );
        assert_eq!(std::mem::size_of::<PwArgs>(), 5 * 8 + 5 * 4 + 4);
    }
}
