//! Pure launch arithmetic of the Winograd kernels (`kernels/winograd.cu`,
//! `kernels/winograd_gemm.cu`): which vector width and kernel a transform takes, its grid, the
//! scratch layout of a chunk, and the argument limits the kernels assume. No GPU; tested on the
//! CPU.

use crate::conv::problem::{winograd_dims, WinogradDims, WinogradGeometry, WinogradTile};
use crate::conv::ConvShape;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::KernelFile;

/// Threads per block of every transform kernel (`WG_THREADS`).
pub(crate) const THREADS: u32 = 256;

/// Block tile of the Direct batched multiply (`DG_BM` x `DG_BN`).
pub(crate) const DIRECT_TILE: (usize, usize) = (64, 64);
/// Threads per block of the Direct batched multiply (`DG_THREADS`).
pub(crate) const DIRECT_THREADS: u32 = 256;
/// Most batch blocks of one Direct launch (`gridDim.y`); the kernel strides over the rest.
pub(crate) const DIRECT_MAX_GRID_Y: usize = 65_535;

/// Alignment (bytes) of every region of the scratch layout: what cuBLASLt assumes of fresh
/// allocations, so the batched GEMM on scratch gets the same kernels as on user buffers.
pub(crate) const REGION_ALIGN: usize = 256;

/// The two per-tile transforms (the filter transform has one kernel per type and tile).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// `U = Bᵀ d B` (reads x, writes U).
    Input,
    /// `y = Aᵀ M A` (reads M, writes y).
    Output,
}

/// Channels per thread the kernels of `dtype` are instantiated for, widest first: 16-byte,
/// 4-byte (16-bit types) and single-element accesses. Mirrors the instantiation list at the end
/// of `kernels/winograd.cu`.
pub(crate) fn vec_widths(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::F32 => &[4, 1],
        DType::F16 | DType::BF16 => &[8, 2, 1],
    }
}

/// Rows of the transformed tile one thread computes (`RG` of the kernel): the kernel runs
/// `rows / RG` threads per (tile, channel vector), where rows is `alpha` for the input transform
/// and `m` for the output transform. Chosen so that the f32 intermediate `RG x alpha x V` stays
/// at most 72 registers. Mirrors `kernels/winograd.cu`.
pub(crate) fn row_groups(stage: Stage, tile: WinogradTile, vec: usize) -> usize {
    match (stage, tile, vec) {
        (Stage::Input, WinogradTile::F2x3, 8) => 2,
        (Stage::Input, WinogradTile::F2x3, 4) => 2,
        (Stage::Input, WinogradTile::F2x3, _) => 4,
        (Stage::Input, WinogradTile::F4x3, 8) => 1,
        (Stage::Input, WinogradTile::F4x3, 4) => 2,
        (Stage::Input, WinogradTile::F4x3, _) => 6,
        (Stage::Output, _, 8) => 1,
        (Stage::Output, WinogradTile::F2x3, 4) => 2,
        (Stage::Output, WinogradTile::F2x3, _) => 2,
        (Stage::Output, WinogradTile::F4x3, 4) => 2,
        (Stage::Output, WinogradTile::F4x3, _) => 4,
    }
}

/// Thread groups per (tile, channel vector): `rows / RG`.
pub(crate) fn groups(stage: Stage, tile: WinogradTile, vec: usize) -> usize {
    let rows = match stage {
        Stage::Input => tile.alpha(),
        Stage::Output => tile.m(),
    };
    rows / row_groups(stage, tile, vec)
}

/// The channel widths a transform takes by default, in order of preference: the first that
/// divides the channel count and whose byte size every pointer is aligned to runs. Measured on
/// the H100 (`benches/winograd.rs`, "Transform variants"; f16 NHWC, ResNet-50's 3x3 layers,
/// batch 32; µs at 56² / 28² / 14² / 7²), not assumed:
///
/// - input F(2x2): 8 channels (16-byte accesses) fastest on every layer: 32.7 / 18.9 / 12.6 /
///   9.0 against 35.2 / 20.5 / 13.9 / 9.8 (v2) and 37.4 / 21.3 / 13.3 / 9.7 (v1);
/// - input F(4x4): 1 channel fastest on every layer: 27.3 / 16.8 / 12.0 / 8.7 against 39.0 /
///   25.4 / 15.8 / 9.0 (v2) and 47.7 / 28.4 / 18.3 / 8.8 (v8). With 8 channels a thread computes
///   one of the six rows and reads the four input rows it needs, so each input row is read ~3.7
///   times (through the L2); with 2 channels the six-row intermediate takes 104 registers;
/// - output F(4x4): 2 channels: 20.2 / 12.3 / 9.4 / 8.3 against 20.8 / 13.4 / 9.9 / 8.4 (v1) and
///   22.0 / 14.3 / 10.1 / 8.5 (v8);
/// - output F(2x2): all widths within 2 %; 2 channels fastest on three of the four layers.
///
/// bf16 moves the same bytes through the same kernels and takes f16's table; f32 is not
/// measured and keeps the widest width first.
pub(crate) fn preferred_widths(stage: Stage, tile: WinogradTile, dtype: DType) -> &'static [usize] {
    match (dtype, stage, tile) {
        (DType::F32, _, _) => &[4, 1],
        (_, Stage::Input, WinogradTile::F2x3) => &[8, 2, 1],
        (_, Stage::Input, WinogradTile::F4x3) => &[1],
        (_, Stage::Output, _) => &[2, 1],
    }
}

/// The first width of [`preferred_widths`] that divides `channels` and to whose byte size every
/// pointer in `ptrs` is aligned (the scalar width always qualifies).
pub(crate) fn choose_vec(
    stage: Stage,
    tile: WinogradTile,
    dtype: DType,
    channels: usize,
    ptrs: &[u64],
) -> usize {
    preferred_widths(stage, tile, dtype)
        .iter()
        .copied()
        .find(|&v| {
            let bytes = (v * dtype.size()) as u64;
            channels % v == 0 && ptrs.iter().all(|p| p % bytes == 0)
        })
        .unwrap_or(1)
}

/// The kernel name of a transform, `None` for a width `dtype` has no kernel for.
pub(crate) fn transform_kernel(
    stage: Stage,
    dtype: DType,
    tile: WinogradTile,
    vec: usize,
) -> Option<&'static str> {
    use DType::*;
    use Stage::*;
    use WinogradTile::*;
    Some(match (stage, tile, dtype, vec) {
        (Input, F2x3, F32, 4) => "winograd_input_f2x3_f32_v4",
        (Input, F2x3, F32, 1) => "winograd_input_f2x3_f32_v1",
        (Input, F4x3, F32, 4) => "winograd_input_f4x3_f32_v4",
        (Input, F4x3, F32, 1) => "winograd_input_f4x3_f32_v1",
        (Input, F2x3, F16, 8) => "winograd_input_f2x3_f16_v8",
        (Input, F2x3, F16, 2) => "winograd_input_f2x3_f16_v2",
        (Input, F2x3, F16, 1) => "winograd_input_f2x3_f16_v1",
        (Input, F4x3, F16, 8) => "winograd_input_f4x3_f16_v8",
        (Input, F4x3, F16, 2) => "winograd_input_f4x3_f16_v2",
        (Input, F4x3, F16, 1) => "winograd_input_f4x3_f16_v1",
        (Input, F2x3, BF16, 8) => "winograd_input_f2x3_bf16_v8",
        (Input, F2x3, BF16, 2) => "winograd_input_f2x3_bf16_v2",
        (Input, F2x3, BF16, 1) => "winograd_input_f2x3_bf16_v1",
        (Input, F4x3, BF16, 8) => "winograd_input_f4x3_bf16_v8",
        (Input, F4x3, BF16, 2) => "winograd_input_f4x3_bf16_v2",
        (Input, F4x3, BF16, 1) => "winograd_input_f4x3_bf16_v1",
        (Output, F2x3, F32, 4) => "winograd_output_f2x3_f32_v4",
        (Output, F2x3, F32, 1) => "winograd_output_f2x3_f32_v1",
        (Output, F4x3, F32, 4) => "winograd_output_f4x3_f32_v4",
        (Output, F4x3, F32, 1) => "winograd_output_f4x3_f32_v1",
        (Output, F2x3, F16, 8) => "winograd_output_f2x3_f16_v8",
        (Output, F2x3, F16, 2) => "winograd_output_f2x3_f16_v2",
        (Output, F2x3, F16, 1) => "winograd_output_f2x3_f16_v1",
        (Output, F4x3, F16, 8) => "winograd_output_f4x3_f16_v8",
        (Output, F4x3, F16, 2) => "winograd_output_f4x3_f16_v2",
        (Output, F4x3, F16, 1) => "winograd_output_f4x3_f16_v1",
        (Output, F2x3, BF16, 8) => "winograd_output_f2x3_bf16_v8",
        (Output, F2x3, BF16, 2) => "winograd_output_f2x3_bf16_v2",
        (Output, F2x3, BF16, 1) => "winograd_output_f2x3_bf16_v1",
        (Output, F4x3, BF16, 8) => "winograd_output_f4x3_bf16_v8",
        (Output, F4x3, BF16, 2) => "winograd_output_f4x3_bf16_v2",
        (Output, F4x3, BF16, 1) => "winograd_output_f4x3_bf16_v1",
        _ => return None,
    })
}

/// The filter transform's kernel (`rotated`: the data gradient's, `V'[pos][c_out][c_in]`).
pub(crate) fn filter_kernel(dtype: DType, tile: WinogradTile, rotated: bool) -> &'static str {
    use DType::*;
    use WinogradTile::*;
    match (tile, dtype, rotated) {
        (F2x3, F32, false) => "winograd_filter_f2x3_f32",
        (F2x3, F16, false) => "winograd_filter_f2x3_f16",
        (F2x3, BF16, false) => "winograd_filter_f2x3_bf16",
        (F4x3, F32, false) => "winograd_filter_f4x3_f32",
        (F4x3, F16, false) => "winograd_filter_f4x3_f16",
        (F4x3, BF16, false) => "winograd_filter_f4x3_bf16",
        (F2x3, F32, true) => "winograd_filter_rot_f2x3_f32",
        (F2x3, F16, true) => "winograd_filter_rot_f2x3_f16",
        (F2x3, BF16, true) => "winograd_filter_rot_f2x3_bf16",
        (F4x3, F32, true) => "winograd_filter_rot_f4x3_f32",
        (F4x3, F16, true) => "winograd_filter_rot_f4x3_f16",
        (F4x3, BF16, true) => "winograd_filter_rot_f4x3_bf16",
    }
}

/// The Direct batched multiply's kernel for the transposes.
pub(crate) fn direct_kernel(dtype: DType, trans_a: bool, trans_b: bool) -> &'static str {
    use DType::*;
    match (dtype, trans_a, trans_b) {
        (F32, false, false) => "winograd_gemm_direct_nn_f32",
        (F32, false, true) => "winograd_gemm_direct_nt_f32",
        (F32, true, false) => "winograd_gemm_direct_tn_f32",
        (F32, true, true) => "winograd_gemm_direct_tt_f32",
        (F16, false, false) => "winograd_gemm_direct_nn_f16",
        (F16, false, true) => "winograd_gemm_direct_nt_f16",
        (F16, true, false) => "winograd_gemm_direct_tn_f16",
        (F16, true, true) => "winograd_gemm_direct_tt_f16",
        (BF16, false, false) => "winograd_gemm_direct_nn_bf16",
        (BF16, false, true) => "winograd_gemm_direct_nt_bf16",
        (BF16, true, false) => "winograd_gemm_direct_tn_bf16",
        (BF16, true, true) => "winograd_gemm_direct_tt_bf16",
    }
}

/// One compilation unit of `kernels/winograd.cu` (or `kernels/winograd_gemm.cu`): the file with
/// the selection macros defined, so that NVRTC compiles only the kernels of one stage, type, tile
/// and width (the whole file takes NVRTC tens of seconds; one unit a second or two). The
/// Context compiles and caches each unit on first use, by its name.
macro_rules! wg_unit {
    ($label:literal, $stage:literal, $dt:literal, $tile:literal, $vec:literal) => {
        KernelFile {
            name: concat!("winograd.cu[", $label, "]"),
            source: concat!(
                include_str!("../../../kernels/prelude.cuh"),
                "\n#define NNF_WG_STAGE ",
                $stage,
                "\n#define NNF_WG_DT ",
                $dt,
                "\n#define NNF_WG_TILE ",
                $tile,
                "\n#define NNF_WG_VEC ",
                $vec,
                "\n#line 1 \"winograd.cu\"\n",
                include_str!("../../../kernels/winograd.cu")
            ),
        }
    };
}

macro_rules! dg_unit {
    ($label:literal, $dt:literal) => {
        KernelFile {
            name: concat!("winograd_gemm.cu[", $label, "]"),
            source: concat!(
                include_str!("../../../kernels/prelude.cuh"),
                "\n#define NNF_DG_DT ",
                $dt,
                "\n#line 1 \"winograd_gemm.cu\"\n",
                include_str!("../../../kernels/winograd_gemm.cu")
            ),
        }
    };
}

/// The compilation units of the transforms, `(stage, dtype, tile, vec)` → unit.
static TRANSFORM_UNITS: [(Stage, DType, WinogradTile, usize, KernelFile); 32] = [
    (
        Stage::Input,
        DType::F32,
        WinogradTile::F2x3,
        4,
        wg_unit!("input,f32,f2x3,v4", 1, 1, 2, 4),
    ),
    (
        Stage::Input,
        DType::F32,
        WinogradTile::F2x3,
        1,
        wg_unit!("input,f32,f2x3,v1", 1, 1, 2, 1),
    ),
    (
        Stage::Output,
        DType::F32,
        WinogradTile::F2x3,
        4,
        wg_unit!("output,f32,f2x3,v4", 2, 1, 2, 4),
    ),
    (
        Stage::Output,
        DType::F32,
        WinogradTile::F2x3,
        1,
        wg_unit!("output,f32,f2x3,v1", 2, 1, 2, 1),
    ),
    (
        Stage::Input,
        DType::F32,
        WinogradTile::F4x3,
        4,
        wg_unit!("input,f32,f4x3,v4", 1, 1, 4, 4),
    ),
    (
        Stage::Input,
        DType::F32,
        WinogradTile::F4x3,
        1,
        wg_unit!("input,f32,f4x3,v1", 1, 1, 4, 1),
    ),
    (
        Stage::Output,
        DType::F32,
        WinogradTile::F4x3,
        4,
        wg_unit!("output,f32,f4x3,v4", 2, 1, 4, 4),
    ),
    (
        Stage::Output,
        DType::F32,
        WinogradTile::F4x3,
        1,
        wg_unit!("output,f32,f4x3,v1", 2, 1, 4, 1),
    ),
    (
        Stage::Input,
        DType::F16,
        WinogradTile::F2x3,
        8,
        wg_unit!("input,f16,f2x3,v8", 1, 2, 2, 8),
    ),
    (
        Stage::Input,
        DType::F16,
        WinogradTile::F2x3,
        2,
        wg_unit!("input,f16,f2x3,v2", 1, 2, 2, 2),
    ),
    (
        Stage::Input,
        DType::F16,
        WinogradTile::F2x3,
        1,
        wg_unit!("input,f16,f2x3,v1", 1, 2, 2, 1),
    ),
    (
        Stage::Output,
        DType::F16,
        WinogradTile::F2x3,
        8,
        wg_unit!("output,f16,f2x3,v8", 2, 2, 2, 8),
    ),
    (
        Stage::Output,
        DType::F16,
        WinogradTile::F2x3,
        2,
        wg_unit!("output,f16,f2x3,v2", 2, 2, 2, 2),
    ),
    (
        Stage::Output,
        DType::F16,
        WinogradTile::F2x3,
        1,
        wg_unit!("output,f16,f2x3,v1", 2, 2, 2, 1),
    ),
    (
        Stage::Input,
        DType::F16,
        WinogradTile::F4x3,
        8,
        wg_unit!("input,f16,f4x3,v8", 1, 2, 4, 8),
    ),
    (
        Stage::Input,
        DType::F16,
        WinogradTile::F4x3,
        2,
        wg_unit!("input,f16,f4x3,v2", 1, 2, 4, 2),
    ),
    (
        Stage::Input,
        DType::F16,
        WinogradTile::F4x3,
        1,
        wg_unit!("input,f16,f4x3,v1", 1, 2, 4, 1),
    ),
    (
        Stage::Output,
        DType::F16,
        WinogradTile::F4x3,
        8,
        wg_unit!("output,f16,f4x3,v8", 2, 2, 4, 8),
    ),
    (
        Stage::Output,
        DType::F16,
        WinogradTile::F4x3,
        2,
        wg_unit!("output,f16,f4x3,v2", 2, 2, 4, 2),
    ),
    (
        Stage::Output,
        DType::F16,
        WinogradTile::F4x3,
        1,
        wg_unit!("output,f16,f4x3,v1", 2, 2, 4, 1),
    ),
    (
        Stage::Input,
        DType::BF16,
        WinogradTile::F2x3,
        8,
        wg_unit!("input,bf16,f2x3,v8", 1, 3, 2, 8),
    ),
    (
        Stage::Input,
        DType::BF16,
        WinogradTile::F2x3,
        2,
        wg_unit!("input,bf16,f2x3,v2", 1, 3, 2, 2),
    ),
    (
        Stage::Input,
        DType::BF16,
        WinogradTile::F2x3,
        1,
        wg_unit!("input,bf16,f2x3,v1", 1, 3, 2, 1),
    ),
    (
        Stage::Output,
        DType::BF16,
        WinogradTile::F2x3,
        8,
        wg_unit!("output,bf16,f2x3,v8", 2, 3, 2, 8),
    ),
    (
        Stage::Output,
        DType::BF16,
        WinogradTile::F2x3,
        2,
        wg_unit!("output,bf16,f2x3,v2", 2, 3, 2, 2),
    ),
    (
        Stage::Output,
        DType::BF16,
        WinogradTile::F2x3,
        1,
        wg_unit!("output,bf16,f2x3,v1", 2, 3, 2, 1),
    ),
    (
        Stage::Input,
        DType::BF16,
        WinogradTile::F4x3,
        8,
        wg_unit!("input,bf16,f4x3,v8", 1, 3, 4, 8),
    ),
    (
        Stage::Input,
        DType::BF16,
        WinogradTile::F4x3,
        2,
        wg_unit!("input,bf16,f4x3,v2", 1, 3, 4, 2),
    ),
    (
        Stage::Input,
        DType::BF16,
        WinogradTile::F4x3,
        1,
        wg_unit!("input,bf16,f4x3,v1", 1, 3, 4, 1),
    ),
    (
        Stage::Output,
        DType::BF16,
        WinogradTile::F4x3,
        8,
        wg_unit!("output,bf16,f4x3,v8", 2, 3, 4, 8),
    ),
    (
        Stage::Output,
        DType::BF16,
        WinogradTile::F4x3,
        2,
        wg_unit!("output,bf16,f4x3,v2", 2, 3, 4, 2),
    ),
    (
        Stage::Output,
        DType::BF16,
        WinogradTile::F4x3,
        1,
        wg_unit!("output,bf16,f4x3,v1", 2, 3, 4, 1),
    ),
];

/// The compilation units of the filter transforms (both variants), `(dtype, tile)` → unit.
static FILTER_UNITS: [(DType, WinogradTile, KernelFile); 6] = [
    (
        DType::F32,
        WinogradTile::F2x3,
        wg_unit!("filter,f32,f2x3", 3, 1, 2, 0),
    ),
    (
        DType::F32,
        WinogradTile::F4x3,
        wg_unit!("filter,f32,f4x3", 3, 1, 4, 0),
    ),
    (
        DType::F16,
        WinogradTile::F2x3,
        wg_unit!("filter,f16,f2x3", 3, 2, 2, 0),
    ),
    (
        DType::F16,
        WinogradTile::F4x3,
        wg_unit!("filter,f16,f4x3", 3, 2, 4, 0),
    ),
    (
        DType::BF16,
        WinogradTile::F2x3,
        wg_unit!("filter,bf16,f2x3", 3, 3, 2, 0),
    ),
    (
        DType::BF16,
        WinogradTile::F4x3,
        wg_unit!("filter,bf16,f4x3", 3, 3, 4, 0),
    ),
];

/// The compilation units of the Direct batched multiply, one per type.
static DIRECT_UNITS: [(DType, KernelFile); 3] = [
    (DType::F32, dg_unit!("f32", 1)),
    (DType::F16, dg_unit!("f16", 2)),
    (DType::BF16, dg_unit!("bf16", 3)),
];

/// The compilation unit holding [`transform_kernel`]'s kernel.
pub(crate) fn transform_unit(
    stage: Stage,
    dtype: DType,
    tile: WinogradTile,
    vec: usize,
) -> Option<&'static KernelFile> {
    TRANSFORM_UNITS
        .iter()
        .find(|u| u.0 == stage && u.1 == dtype && u.2 == tile && u.3 == vec)
        .map(|u| &u.4)
}

/// The compilation unit holding [`filter_kernel`]'s kernels.
pub(crate) fn filter_unit(dtype: DType, tile: WinogradTile) -> &'static KernelFile {
    // Every (dtype, tile) has an entry (tested); the first is a harmless fallback.
    FILTER_UNITS
        .iter()
        .find(|u| u.0 == dtype && u.1 == tile)
        .map_or(&FILTER_UNITS[0].2, |u| &u.2)
}

/// The compilation unit holding [`direct_kernel`]'s kernels.
pub(crate) fn direct_unit(dtype: DType) -> &'static KernelFile {
    DIRECT_UNITS
        .iter()
        .find(|u| u.0 == dtype)
        .map_or(&DIRECT_UNITS[0].1, |u| &u.1)
}

fn too_big(what: &str) -> Error {
    Error::invalid(
        "shape",
        format!("{what} exceeds what one kernel launch can cover"),
    )
}

/// `v` as a kernel's `u32` argument, or an error naming `what`.
pub(crate) fn arg_u32(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        Error::invalid(
            "shape",
            format!("{what} = {v} exceeds the kernels' 32-bit limit"),
        )
    })
}

/// Blocks of a transform launch over `tiles` tiles of `channels` channels with `vec` channels
/// per thread: `groups * ceil(tiles * channels / vec / THREADS)`, within `gridDim.x`'s limit.
pub(crate) fn transform_blocks(
    stage: Stage,
    tile: WinogradTile,
    vec: usize,
    tiles: usize,
    channels: usize,
) -> Result<u32> {
    let items = tiles
        .checked_mul(channels / vec.max(1))
        .ok_or_else(|| too_big("tiles x channels"))?;
    let blocks = items
        .div_ceil(THREADS as usize)
        .checked_mul(groups(stage, tile, vec))
        .ok_or_else(|| too_big("the grid"))?;
    u32::try_from(blocks)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| too_big("the grid"))
}

/// Blocks a filter transform aims for before it splits the transformed rows over
/// `blockIdx.z`: four per SM of an H100 (132 SMs), enough to hide the loads' latency.
pub(crate) const FILTER_TARGET_BLOCKS: usize = 528;

/// Grid of the filter transform (`filter_transform` in `kernels/winograd.cu`): 32 lanes along
/// the channel the output is contiguous in (`c_out`, or `c_in` for the rotated layout), 8 warps
/// along the other, and as many groups of the `alpha` rows as it takes to reach
/// [`FILTER_TARGET_BLOCKS`] (each group `ceil(alpha / groups)` rows; no group empty).
/// `gridDim.y` is limited to 65535.
pub(crate) fn filter_grid(
    c_in: usize,
    c_out: usize,
    tile: WinogradTile,
    rotated: bool,
) -> Result<(u32, u32, u32)> {
    let (fast, slow) = if rotated {
        (c_in, c_out)
    } else {
        (c_out, c_in)
    };
    let x = fast.div_ceil(32);
    let y = slow.div_ceil(8);
    if y > 65_535 || x > i32::MAX as usize {
        return Err(too_big("the filter's channel count"));
    }
    let a = tile.alpha();
    let want = FILTER_TARGET_BLOCKS.div_ceil((x * y).max(1)).clamp(1, a);
    let rows = a.div_ceil(want);
    Ok((x as u32, y as u32, a.div_ceil(rows) as u32))
}

/// Grid of the Direct batched multiply: `(mblocks * nblocks, min(batch, 65535))` and `mblocks`.
pub(crate) fn direct_grid(m: usize, n: usize, batch: usize) -> Result<((u32, u32), u32)> {
    let mb = m.div_ceil(DIRECT_TILE.0);
    let nb = n.div_ceil(DIRECT_TILE.1);
    let x = mb
        .checked_mul(nb)
        .filter(|&x| x <= i32::MAX as usize)
        .ok_or_else(|| too_big("the Direct multiply's grid"))?;
    Ok((
        (x as u32, batch.clamp(1, DIRECT_MAX_GRID_Y) as u32),
        mb as u32,
    ))
}

/// Byte offsets of the regions of a Winograd scratch: the transformed filter (absent when the
/// caller's is used), the transformed input and the product of one chunk, each starting at a
/// multiple of [`REGION_ALIGN`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ScratchLayout {
    /// Offset of V (0 when V is not in the scratch).
    pub v: usize,
    /// Offset of U.
    pub u: usize,
    /// Offset of M.
    pub m: usize,
    /// Bytes of the whole layout.
    pub bytes: usize,
}

fn align_up(v: usize) -> Option<usize> {
    v.checked_add(REGION_ALIGN - 1)
        .map(|x| x / REGION_ALIGN * REGION_ALIGN)
}

/// The layout for chunks of `chunk` images; `with_v`: the transformed filter is made in the
/// scratch too.
pub(crate) fn scratch_layout(
    d: &WinogradDims,
    elem: usize,
    chunk: usize,
    with_v: bool,
) -> Result<ScratchLayout> {
    let big = || Error::invalid("n", "Winograd's scratch bytes overflow usize");
    let bytes = |e: usize| e.checked_mul(elem).ok_or_else(big);
    let v_bytes = if with_v { bytes(d.v)? } else { 0 };
    let u_bytes = bytes(d.u_per_image.checked_mul(chunk).ok_or_else(big)?)?;
    let m_bytes = bytes(d.m_per_image.checked_mul(chunk).ok_or_else(big)?)?;
    let u = align_up(v_bytes).ok_or_else(big)?;
    let m = align_up(u.checked_add(u_bytes).ok_or_else(big)?).ok_or_else(big)?;
    let end = m.checked_add(m_bytes).ok_or_else(big)?;
    Ok(ScratchLayout {
        v: 0,
        u,
        m,
        bytes: end,
    })
}

/// How a Winograd run splits its batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Chunking {
    /// Chunks as large as the convolution workspace cap allows (usually one): the default of
    /// the path (see `default_chunking` in `src/conv/winograd.rs` for the measurement).
    WorkspaceCap,
    /// Chunks whose transformed input and product together take at most [`L2_SHARE`] of the
    /// L2 (of this many bytes), but at least [`MIN_CHUNK_TILES`] tiles, and never more than the
    /// workspace cap allows: the product stage then reads U, and the output stage M, from the L2,
    /// and the next chunk overwrites the same scratch lines there, so U and M mostly never reach
    /// DRAM. Measured slower than one chunk on the H100 (1.15-1.22x at 56² and 28²), so not the
    /// default; kept for comparison and for devices where the L2 matters more.
    L2Resident {
        /// The device's L2 in bytes.
        l2_bytes: usize,
    },
}

/// Share of the L2 one chunk's U and M may take under [`Chunking::L2Resident`] (the rest holds
/// the chunk's x, y and the filter).
pub const L2_SHARE: f64 = 0.5;

/// Fewest tiles per chunk [`Chunking::L2Resident`] goes down to: the batched GEMM of a narrower
/// chunk loses more to its shape than the L2 saves.
pub const MIN_CHUNK_TILES: usize = 1024;

/// Everything a chunked Winograd run needs: sizes, the images per chunk and the chunk sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChunkPlan {
    /// Per-image sizes.
    pub dims: WinogradDims,
    /// Images per chunk (the largest chunk).
    pub chunk: usize,
    /// Sizes of the chunks in order (differing by at most one, the largest first).
    pub chunks: Vec<usize>,
    /// The scratch layout for the largest chunk.
    pub layout: ScratchLayout,
    /// Whether the L2 rule (not the workspace cap) set the chunk size.
    pub l2_limited: bool,
}

/// Splits the batch of `g`'s problem into chunks whose transformed filter (`with_v`),
/// transformed input and product fit in `cap_bytes` (the region alignment may add up to
/// `2 * REGION_ALIGN` bytes), and, with [`Chunking::L2Resident`], whose U and M fit the L2
/// share; an error when one image does not fit the cap.
pub(crate) fn chunk_plan(
    g: &WinogradGeometry,
    elem: usize,
    cap_bytes: usize,
    with_v: bool,
    chunking: Chunking,
) -> Result<ChunkPlan> {
    let (s, tile, dims) = (&g.problem, g.tile, g.dims);
    // The prepared path keeps V out of the scratch: count it only when it is in there.
    let cap = if with_v {
        cap_bytes
    } else {
        cap_bytes.saturating_add(dims.v.saturating_mul(elem))
    };
    let Some(cap_chunk) = crate::conv::sizes::winograd_chunk(&dims, s.n, elem, cap)? else {
        return Err(Error::NotSupported(format!(
            "Winograd {}: the transformed tensors of one image ({} + {} elements, plus the \
             {}-element transformed filter) exceed the convolution workspace cap of {} bytes \
             (NNFUSE_CONV_WORKSPACE_MB)",
            tile.name(),
            dims.u_per_image,
            dims.m_per_image,
            dims.v,
            cap_bytes
        )));
    };
    let mut max_chunk = cap_chunk;
    if let Chunking::L2Resident { l2_bytes } = chunking {
        let per_image = dims
            .u_per_image
            .saturating_add(dims.m_per_image)
            .saturating_mul(elem)
            .max(1);
        let fit = ((l2_bytes as f64 * L2_SHARE) as usize) / per_image;
        let least = MIN_CHUNK_TILES.div_ceil(dims.tiles_per_image.max(1));
        max_chunk = max_chunk.min(fit.max(least).max(1));
    }
    let chunks = crate::conv::sizes::balanced_chunks(s.n, max_chunk);
    let chunk = chunks.iter().copied().max().unwrap_or(1);
    let layout = scratch_layout(&dims, elem, chunk, with_v)?;
    Ok(ChunkPlan {
        dims,
        chunk,
        chunks,
        layout,
        l2_limited: max_chunk < cap_chunk.min(s.n),
    })
}

/// Bytes each stage of a Winograd forward moves at the minimum (every input read once, every
/// output written once): the floor of a memory-bound stage at the copy bandwidth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageBytes {
    /// Input transform: x read + U written.
    pub input: usize,
    /// Filter transform: w read + V written.
    pub filter: usize,
    /// Batched multiply: U and V read + M written.
    pub multiply: usize,
    /// Output transform: M read + y written.
    pub output: usize,
}

/// [`StageBytes`] of `s` with `tile` for `elem`-byte data (whole batch, saturating).
pub fn stage_bytes(s: &ConvShape, tile: WinogradTile, elem: usize) -> Result<StageBytes> {
    let d = winograd_dims(s, tile)?;
    let y = s.y_len()?;
    let mul = |a: usize, b: usize| a.saturating_mul(b);
    let u = mul(d.u_per_image, s.n);
    let m = mul(d.m_per_image, s.n);
    Ok(StageBytes {
        input: mul(s.x_len()?.saturating_add(u), elem),
        filter: mul(s.w_len()?.saturating_add(d.v), elem),
        multiply: mul(u.saturating_add(d.v).saturating_add(m), elem),
        output: mul(m.saturating_add(y), elem),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::TensorFormat;

    fn shape(n: usize, c: usize, h: usize, k: usize) -> ConvShape {
        crate::testutil::square_conv(n, c, h, k, 3, TensorFormat::Nhwc)
    }

    #[test]
    fn every_width_has_a_kernel_and_groups_divide_the_rows() {
        for dtype in DType::ALL {
            for tile in WinogradTile::ALL {
                for &v in vec_widths(dtype) {
                    for stage in [Stage::Input, Stage::Output] {
                        let name = transform_kernel(stage, dtype, tile, v).unwrap();
                        assert!(name.ends_with(&format!("_{}_v{v}", dtype.name())), "{name}");
                        assert!(name.contains(tile.name()));
                        let rows = if stage == Stage::Input {
                            tile.alpha()
                        } else {
                            tile.m()
                        };
                        let rg = row_groups(stage, tile, v);
                        assert_eq!(rows % rg, 0);
                        // The f32 intermediate stays in registers.
                        assert!(rg * tile.alpha() * v <= 72, "{name}: {rg} x {v}");
                    }
                }
                assert!(transform_kernel(Stage::Input, dtype, tile, 3).is_none());
                assert!(filter_kernel(dtype, tile, true).contains("_rot_"));
            }
        }
    }

    /// The kernels' instantiation list says the same as [`row_groups`]: every
    /// `NNF_WG_INPUT(tile, M, T, S, V, RG)` / `NNF_WG_OUTPUT(...)` line of the source.
    #[test]
    fn row_groups_match_the_kernel_source() {
        let src = include_str!("../../../kernels/winograd.cu");
        let mut seen = 0;
        for line in src.lines() {
            let line = line.trim();
            let stage = if line.starts_with("NNF_WG_INPUT(") {
                Stage::Input
            } else if line.starts_with("NNF_WG_OUTPUT(") {
                Stage::Output
            } else {
                continue;
            };
            let inner = &line[line.find('(').unwrap() + 1..line.find(')').unwrap()];
            let args: Vec<&str> = inner.split(',').map(str::trim).collect();
            if args.len() != 6 || args[0] == "TILE" {
                continue; // the macro definitions themselves
            }
            let tile = if args[0] == "f2x3" {
                WinogradTile::F2x3
            } else {
                WinogradTile::F4x3
            };
            let (v, rg): (usize, usize) = (args[4].parse().unwrap(), args[5].parse().unwrap());
            assert_eq!(row_groups(stage, tile, v), rg, "{line}");
            seen += 1;
        }
        // f32: 2 widths, f16 and bf16: 3 widths each; 2 tiles, 2 stages.
        assert_eq!(seen, 2 * 2 * 2 + 2 * 3 * 2 * 2);
    }

    #[test]
    fn every_kernel_has_its_compilation_unit() {
        for dtype in DType::ALL {
            for tile in WinogradTile::ALL {
                for &v in vec_widths(dtype) {
                    for stage in [Stage::Input, Stage::Output] {
                        let unit = transform_unit(stage, dtype, tile, v).unwrap();
                        assert!(
                            unit.name.contains(dtype.name()) && unit.name.contains(tile.name())
                        );
                        assert!(unit.source.contains("#define NNF_WG_VEC"));
                    }
                }
                let f = filter_unit(dtype, tile);
                assert!(
                    f.name.contains(dtype.name()) && f.name.contains(tile.name()),
                    "{}",
                    f.name
                );
            }
            assert!(direct_unit(dtype).name.contains(dtype.name()));
        }
        let mut names: Vec<&str> = TRANSFORM_UNITS.iter().map(|u| u.4.name).collect();
        names.extend(FILTER_UNITS.iter().map(|u| u.2.name));
        names.extend(DIRECT_UNITS.iter().map(|u| u.1.name));
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(
            names.len(),
            n,
            "unit names must be unique (the module cache keys on them)"
        );
    }

    /// A unit compiles exactly its own kernels (needs NVRTC; skipped without it).
    #[test]
    fn a_unit_compiles_only_its_kernels() {
        if !crate::kernels::nvrtc_present() {
            eprintln!("skipping: NVRTC not found");
            return;
        }
        let unit = transform_unit(Stage::Output, DType::BF16, WinogradTile::F2x3, 2).unwrap();
        let ptx = crate::testutil::ptx_of(unit);
        let entries = crate::testutil::ptx_entries(&ptx);
        assert_eq!(entries.len(), 1, "{entries:?}");
        assert!(
            entries[0].starts_with("winograd_output_f2x3_bf16_v2("),
            "{entries:?}"
        );
        let unit = direct_unit(DType::F16);
        let ptx = crate::testutil::ptx_of(unit);
        assert_eq!(ptx.matches(".visible .entry").count(), 4);
        assert!(ptx.contains("winograd_gemm_direct_tn_f16"));
    }

    #[test]
    fn vector_width_follows_the_table_channels_and_alignment() {
        use Stage::{Input, Output};
        use WinogradTile::{F2x3, F4x3};
        assert_eq!(
            choose_vec(Input, F2x3, DType::F16, 64, &[0x1000, 0x2000]),
            8
        );
        assert_eq!(
            choose_vec(Input, F2x3, DType::F16, 64, &[0x1008, 0x2000]),
            2
        );
        assert_eq!(choose_vec(Input, F2x3, DType::F16, 30, &[0x1000]), 2);
        assert_eq!(choose_vec(Input, F2x3, DType::F16, 129, &[0x1000]), 1);
        assert_eq!(choose_vec(Input, F2x3, DType::BF16, 8, &[0x1002]), 1);
        // Measured: F(4x4)'s input transform is fastest one channel a thread, its output
        // transform two.
        assert_eq!(
            choose_vec(Input, F4x3, DType::F16, 64, &[0x1000, 0x2000]),
            1
        );
        assert_eq!(
            choose_vec(Output, F4x3, DType::BF16, 64, &[0x1000, 0x2000]),
            2
        );
        assert_eq!(
            choose_vec(Output, F2x3, DType::F16, 64, &[0x1000, 0x2000]),
            2
        );
        assert_eq!(choose_vec(Output, F4x3, DType::F16, 63, &[0x1000]), 1);
        assert_eq!(choose_vec(Output, F4x3, DType::F16, 64, &[0x1002]), 1);
        for stage in [Input, Output] {
            for tile in WinogradTile::ALL {
                assert_eq!(choose_vec(stage, tile, DType::F32, 12, &[0x1000]), 4);
                assert_eq!(choose_vec(stage, tile, DType::F32, 6, &[0x1000]), 1);
                assert_eq!(choose_vec(stage, tile, DType::F32, 8, &[0x1004]), 1);
                // Every preferred width has a kernel, and the scalar width is always last.
                for dtype in DType::ALL {
                    let pref = preferred_widths(stage, tile, dtype);
                    assert_eq!(pref.last(), Some(&1));
                    for &v in pref {
                        assert!(vec_widths(dtype).contains(&v), "{dtype} {tile:?} v{v}");
                    }
                }
            }
        }
    }

    #[test]
    fn grids() {
        // 6272 tiles x 64 channels / 8 per thread = 50176 items = 196 blocks, 6 groups (F4 v8).
        assert_eq!(
            transform_blocks(Stage::Input, WinogradTile::F4x3, 8, 6272, 64).unwrap(),
            196 * 6
        );
        assert_eq!(
            transform_blocks(Stage::Output, WinogradTile::F4x3, 2, 10, 3).unwrap(),
            1
        );
        assert!(transform_blocks(Stage::Input, WinogradTile::F4x3, 1, usize::MAX, 2).is_err());
        // 64x64, F(4x4): 2 x 8 blocks of pairs, the six rows one per group.
        assert_eq!(
            filter_grid(64, 64, WinogradTile::F4x3, false).unwrap(),
            (2, 8, 6)
        );
        assert_eq!(
            filter_grid(64, 65, WinogradTile::F2x3, true).unwrap(),
            (2, 9, 4)
        );
        // 512x512: 1024 blocks, no split. 256x256: 256 blocks, 3 groups of 2 rows (F(4x4)).
        assert_eq!(
            filter_grid(512, 512, WinogradTile::F4x3, false).unwrap(),
            (16, 64, 1)
        );
        assert_eq!(
            filter_grid(256, 256, WinogradTile::F4x3, false).unwrap(),
            (8, 32, 3)
        );
        // No empty group: 5 groups wanted of 6 rows would leave one empty; 3 of 2 rows run.
        for c in 1..200 {
            for tile in WinogradTile::ALL {
                let (x, y, z) = filter_grid(c, 3 * c, tile, false).unwrap();
                let rows = tile.alpha().div_ceil(z as usize);
                assert!((z as usize - 1) * rows < tile.alpha(), "{c} {tile:?}");
                assert!(z as usize * rows >= tile.alpha());
                assert_eq!((x, y), ((3 * c).div_ceil(32) as u32, c.div_ceil(8) as u32));
            }
        }
        assert!(filter_grid(1, 8 * 65_536, WinogradTile::F2x3, true).is_err());
        assert_eq!(direct_grid(64, 65, 36).unwrap(), ((2, 36), 1));
        assert_eq!(direct_grid(130, 1, 100_000).unwrap(), ((3, 65_535), 3));
        assert_eq!(arg_u32(5, "h").unwrap(), 5);
        assert_eq!(arg_u32(1 << 40, "h").unwrap_err().argument(), Some("shape"));
    }

    #[test]
    fn scratch_regions_are_aligned_and_disjoint() {
        let s = shape(10, 30, 7, 5);
        let d = winograd_dims(&s, WinogradTile::F4x3).unwrap();
        let l = scratch_layout(&d, 2, 3, true).unwrap();
        assert_eq!(l.v, 0);
        assert_eq!(l.u % REGION_ALIGN, 0);
        assert_eq!(l.m % REGION_ALIGN, 0);
        assert!(l.u >= d.v * 2);
        assert!(l.m >= l.u + 3 * d.u_per_image * 2);
        assert_eq!(l.bytes, l.m + 3 * d.m_per_image * 2);
        let l = scratch_layout(&d, 2, 3, false).unwrap();
        assert_eq!(l.u, 0);
    }

    fn geo(s: &ConvShape, tile: WinogradTile) -> WinogradGeometry {
        WinogradGeometry::forward(s, tile).unwrap()
    }

    #[test]
    fn chunk_plans_respect_the_cap() {
        let s = shape(32, 64, 56, 64);
        let d = winograd_dims(&s, WinogradTile::F4x3).unwrap();
        // One image: 2 x 36 x 196 x 64 x 2 bytes = 1.8 MB of U and M.
        let cap = 8 << 20;
        let p = chunk_plan(
            &geo(&s, WinogradTile::F4x3),
            2,
            cap,
            true,
            Chunking::WorkspaceCap,
        )
        .unwrap();
        assert!(p.layout.bytes <= cap + 2 * REGION_ALIGN);
        assert_eq!(p.chunks.iter().sum::<usize>(), 32);
        assert!(p.chunks.len() > 1);
        // Without V in the scratch, as many or more images per chunk.
        let q = chunk_plan(
            &geo(&s, WinogradTile::F4x3),
            2,
            cap,
            false,
            Chunking::WorkspaceCap,
        )
        .unwrap();
        assert!(q.chunk >= p.chunk);
        assert!(q.layout.bytes <= cap + 2 * REGION_ALIGN);
        // One image too big: NotSupported, saying why.
        let e = chunk_plan(
            &geo(&s, WinogradTile::F4x3),
            2,
            1000,
            true,
            Chunking::WorkspaceCap,
        )
        .unwrap_err();
        assert!(e.to_string().contains("workspace cap"), "{e}");
        assert!(d.u_per_image > 0);
        // Large cap: one chunk.
        let p = chunk_plan(
            &geo(&s, WinogradTile::F2x3),
            2,
            1 << 32,
            true,
            Chunking::WorkspaceCap,
        )
        .unwrap();
        assert_eq!(p.chunks, vec![32]);
    }

    #[test]
    fn l2_resident_chunks_fit_half_the_l2() {
        let l2 = Chunking::L2Resident { l2_bytes: 50 << 20 };
        // 64@56², N=32, F(4x4) f16: 1.8 MB of U + M per image, 25 MiB -> 14 images a chunk.
        let s = shape(32, 64, 56, 64);
        let p = chunk_plan(&geo(&s, WinogradTile::F4x3), 2, 256 << 20, true, l2).unwrap();
        assert!(p.l2_limited);
        let d = p.dims;
        assert!(
            p.chunk * (d.u_per_image + d.m_per_image) * 2 <= 25 << 20,
            "{:?}",
            p.chunks
        );
        assert_eq!(p.chunks, vec![11, 11, 10]);
        // Small layers stay one chunk: 512@7², N=32.
        let s = shape(32, 512, 7, 512);
        let p = chunk_plan(&geo(&s, WinogradTile::F4x3), 2, 256 << 20, true, l2).unwrap();
        assert_eq!((p.chunks.clone(), p.l2_limited), (vec![32], false));
        // Never below MIN_CHUNK_TILES tiles: 64@112², F(2x2) has 3136 tiles an image.
        let s = shape(8, 256, 112, 256);
        let p = chunk_plan(&geo(&s, WinogradTile::F2x3), 2, 1 << 40, true, l2).unwrap();
        assert_eq!(p.chunk, 1);
        let s = shape(64, 64, 14, 64);
        let p = chunk_plan(&geo(&s, WinogradTile::F4x3), 4, 1 << 40, true, l2).unwrap();
        assert!(p.chunk * p.dims.tiles_per_image >= MIN_CHUNK_TILES);
        // The workspace cap still wins when smaller.
        let s = shape(32, 64, 56, 64);
        let p = chunk_plan(&geo(&s, WinogradTile::F4x3), 2, 4 << 20, true, l2).unwrap();
        assert!(!p.l2_limited);
        assert!(p.layout.bytes <= (4 << 20) + 2 * REGION_ALIGN);
    }

    #[test]
    fn stage_bytes_count_each_tensor_once() {
        let s = shape(32, 64, 56, 64);
        let b = stage_bytes(&s, WinogradTile::F4x3, 2).unwrap();
        let x = 32 * 56 * 56 * 64;
        let u = 36 * 32 * 196 * 64;
        assert_eq!(b.input, 2 * (x + u));
        assert_eq!(b.output, 2 * (u + x)); // c_out = c_in, same output size
        assert_eq!(b.multiply, 2 * (2 * u + 36 * 64 * 64));
        assert_eq!(b.filter, 2 * (64 * 9 * 64 + 36 * 64 * 64));
    }
}
