//! The launch rules of the bitmask kernels (the pure half of the launchers): argument validation (lengths, mask size, aliasing) on
//! plain lengths and pointer ranges, the vector/scalar path rule and the grid arithmetic. No GPU
//! is needed to run or test any of it; the launchers in `activation/mod.rs` only gather pointers, call
//! these functions and launch.

use cudarc::driver::LaunchConfig;

use crate::error::{Error, Result};
use crate::validate::{check_lengths, check_overlaps, Aliasing, Need, Operand};

/// Threads per block of every bitmask launch (`THREADS` in `kernels/bitmask.cu`).
pub const THREADS: u32 = 256;
/// 32-vector chunks a warp handles per iteration in the vector paths (`VEC_UNROLL`).
pub const VEC_UNROLL: u64 = 4;
/// Mask words (32 elements each) a warp handles per iteration in the scalar paths
/// (`SCALAR_WORDS`).
pub const SCALAR_WORDS: u64 = 8;
/// Bytes per vector access; the vector path needs every data pointer aligned to it.
pub const VECTOR_BYTES: u64 = 16;
/// Largest element count accepted (keeps every 64-bit index computation in the kernels far from
/// overflow; 2^56 elements is far beyond any device memory).
pub const MAX_ELEMENTS: usize = 1 << 56;

/// Which code path a launch takes inside the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// 16-byte loads and stores; every data pointer is 16-byte aligned.
    Vector,
    /// Element-sized accesses, any alignment.
    Scalar,
}

impl Path {
    /// Lower-case name for logs and benchmark output.
    pub const fn name(self) -> &'static str {
        match self {
            Path::Vector => "vector",
            Path::Scalar => "scalar",
        }
    }
}

/// The path rule the kernels apply (and the launchers mirror for their grid size and log):
/// vector when every data pointer is 16-byte aligned, else scalar. A null pointer (an absent
/// optional output) counts as aligned; mask pointers are not passed (masks are read and written
/// as single `u32` words, so their alignment never matters).
pub fn choose_path(data_ptrs: &[u64]) -> Path {
    if data_ptrs.iter().all(|p| p % VECTOR_BYTES == 0) {
        Path::Vector
    } else {
        Path::Scalar
    }
}

/// How a kernel divides its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// The warp-tiled kernels (both forwards, the mask backward, the y-based backward): a warp
    /// takes `VEC_UNROLL` chunks of 32 vectors (vector path) or a tile of `SCALAR_WORDS`
    /// words (scalar path) per iteration.
    Warp,
    /// The naive baseline: one thread per byte of mask (eight elements).
    Naive8,
}

/// Elements per 16-byte vector.
pub const fn lanes_per_vector(elem_bytes: u64) -> u64 {
    VECTOR_BYTES / elem_bytes
}

/// Elements in one warp chunk of the vector path (32 vectors; a whole number of mask words).
pub const fn chunk_elements(elem_bytes: u64) -> u64 {
    32 * lanes_per_vector(elem_bytes)
}

/// Warps that have work: beyond this many, extra warps would only idle.
pub fn warps_needed(scheme: Scheme, path: Path, n: u64, elem_bytes: u64) -> u64 {
    match (scheme, path) {
        // Whole chunks, VEC_UNROLL per warp; the leftover (< one chunk) goes to the last warp of
        // the grid, so there is always at least one.
        (Scheme::Warp, Path::Vector) => {
            (n / chunk_elements(elem_bytes)).div_ceil(VEC_UNROLL).max(1)
        }
        (Scheme::Warp, Path::Scalar) => n.div_ceil(32 * SCALAR_WORDS).max(1),
        (Scheme::Naive8, _) => (4 * n.div_ceil(32)).div_ceil(32).max(1),
    }
}

/// Grid and block of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LaunchGrid {
    /// The path the kernel will take.
    pub path: Path,
    /// Blocks in the grid.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
}

impl LaunchGrid {
    /// As cudarc's launch configuration.
    pub fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.blocks, 1, 1),
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// The grid for `n` elements of `elem_bytes` bytes: as many blocks as have work, capped at one
/// full wave (`sm_count * blocks_per_sm`, the occupancy the driver reports for the kernel) —
/// the kernels loop grid-stride over the rest, and a second, partial wave would only add a
/// tail in which a few SMs work alone.
pub fn launch_grid(
    scheme: Scheme,
    path: Path,
    n: u64,
    elem_bytes: u64,
    sm_count: u32,
    blocks_per_sm: u32,
) -> LaunchGrid {
    let warps_per_block = u64::from(THREADS / 32);
    let needed = warps_needed(scheme, path, n, elem_bytes).div_ceil(warps_per_block);
    let wave = crate::launch::wave_blocks(sm_count, blocks_per_sm);
    let blocks = needed.min(wave).clamp(1, i32::MAX as u64);
    LaunchGrid {
        path,
        // In range: clamped to i32::MAX above.
        blocks: blocks as u32,
        threads: THREADS,
    }
}

/// Validates one call before anything reaches the GPU and returns the element count `n`: the
/// shared rules of [`crate::validate`] with the elementwise length rule and in-place aliasing.
///
/// * The first data operand defines `n`; every other data operand must have length `n`
///   (the error names the other operand).
/// * Every mask needs at least [`crate::activation::mask_words`]`(n)` words (longer is fine: only the first
///   `mask_words(n)` are touched).
/// * `n` ≤ [`MAX_ELEMENTS`].
/// * Aliasing, on the byte ranges the call touches (for `n > 0`): two operands that overlap are
///   an error naming the later one in `ops`, except (a) two data operands that are both only
///   read, which may overlap in any way, and (b) a pair listed in `exact_ok` (either order) that
///   covers exactly the same bytes (in-place operation). A mask never overlaps anything.
pub(crate) fn validate(ops: &[Operand], exact_ok: &[(&str, &str)]) -> Result<usize> {
    let Some(first) = ops.iter().find(|o| o.need == Need::Same) else {
        return Err(Error::invalid("(none)", "a call needs a data operand"));
    };
    let n = check_lengths(ops)?;
    if n > MAX_ELEMENTS {
        return Err(Error::invalid(
            first.name,
            format!("{n} elements, more than the kernels handle ({MAX_ELEMENTS})"),
        ));
    }
    if n == 0 {
        return Ok(0);
    }
    check_overlaps(ops, n, Aliasing::InPlace(exact_ok))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernel_source() {
        let src = crate::kernels::BITMASK.source;
        assert!(src.contains(&format!("constexpr int THREADS = {THREADS};")));
        assert!(src.contains(&format!("constexpr int VEC_UNROLL = {VEC_UNROLL};")));
        assert!(src.contains(&format!("constexpr int SCALAR_WORDS = {SCALAR_WORDS};")));
    }

    #[test]
    fn path_follows_alignment_of_every_pointer() {
        assert_eq!(choose_path(&[0x1000, 0x2000]), Path::Vector);
        assert_eq!(choose_path(&[0x1000, 0x2000, 0]), Path::Vector); // null dz
        assert_eq!(choose_path(&[0x1004, 0x2000]), Path::Scalar); // f32 view at offset 1
        assert_eq!(choose_path(&[0x1000, 0x2002]), Path::Scalar); // f16 view at offset 1
        assert_eq!(choose_path(&[0x1010, 0x2020]), Path::Vector); // offset 4 f32 / 8 f16
        assert_eq!(choose_path(&[0x1008, 0x1008]), Path::Scalar); // same misalignment
        assert_eq!(choose_path(&[]), Path::Vector);
    }

    #[test]
    fn vector_geometry() {
        assert_eq!(lanes_per_vector(4), 4);
        assert_eq!(lanes_per_vector(2), 8);
        assert_eq!(chunk_elements(4), 128); // 4 mask words
        assert_eq!(chunk_elements(2), 256); // 8 mask words
        for b in [2, 4] {
            assert_eq!(
                chunk_elements(b) % 32,
                0,
                "chunks must end on word boundaries"
            );
        }
    }

    #[test]
    fn warps_needed_counts() {
        use Path::*;
        use Scheme::*;
        // Vector f32: 128-element chunks, VEC_UNROLL per warp; the leftover rides on the last
        // warp. f16: 256-element chunks.
        let per_warp = |chunk: u64| chunk * VEC_UNROLL;
        assert_eq!(warps_needed(Warp, Vector, 0, 4), 1);
        assert_eq!(warps_needed(Warp, Vector, 1, 4), 1);
        assert_eq!(warps_needed(Warp, Vector, 127, 4), 1);
        assert_eq!(warps_needed(Warp, Vector, per_warp(128), 4), 1);
        assert_eq!(warps_needed(Warp, Vector, per_warp(128) + 1, 4), 1);
        assert_eq!(warps_needed(Warp, Vector, per_warp(128) + 128, 4), 2);
        assert_eq!(warps_needed(Warp, Vector, per_warp(256), 2), 1);
        assert_eq!(warps_needed(Warp, Vector, per_warp(256) + 256, 2), 2);
        assert_eq!(warps_needed(Warp, Vector, 3 * per_warp(256), 2), 3);
        // Scalar: 256-element tiles.
        assert_eq!(warps_needed(Warp, Scalar, 1, 2), 1);
        assert_eq!(warps_needed(Warp, Scalar, 256, 4), 1);
        assert_eq!(warps_needed(Warp, Scalar, 257, 4), 2);
        // Naive8: one thread per mask byte, 4 bytes per word.
        assert_eq!(warps_needed(Naive8, Scalar, 1, 4), 1);
        assert_eq!(warps_needed(Naive8, Scalar, 32 * 8, 4), 1); // 32 bytes
        assert_eq!(warps_needed(Naive8, Scalar, 32 * 8 + 1, 4), 2); // 36 bytes
    }

    #[test]
    fn grid_is_capped_at_one_wave() {
        // 64x64x112x112 f16: 51.4 M elements, 200,704 chunks, 100,352 warps, 12,544 blocks.
        let n = 64 * 64 * 112 * 112;
        let p = launch_grid(Scheme::Warp, Path::Vector, n, 2, 132, 8);
        assert_eq!(p.blocks, 132 * 8);
        assert_eq!(p.threads, THREADS);
        assert_eq!(p.path, Path::Vector);
        // Small: only the blocks that have work (8 warps a block).
        let warp_elems = 128 * VEC_UNROLL; // f32
        let p = launch_grid(Scheme::Warp, Path::Vector, 8 * warp_elems + 1, 4, 132, 8);
        assert_eq!(p.blocks, 1); // 8 warps' chunks, the leftover element on the last warp
        let p = launch_grid(Scheme::Warp, Path::Vector, 8 * warp_elems * 3, 4, 132, 8);
        assert_eq!(p.blocks, 3);
        let p = launch_grid(Scheme::Warp, Path::Scalar, 1, 4, 132, 8);
        assert_eq!(p.blocks, 1);
        // A zero occupancy report still gives a launchable grid.
        let p = launch_grid(Scheme::Warp, Path::Scalar, 1 << 30, 4, 0, 0);
        assert_eq!(p.blocks, 1);
        let c = p.config();
        assert_eq!(c.block_dim, (THREADS, 1, 1));
    }

    fn d(name: &'static str, ptr: u64, len: usize, writes: bool) -> Operand {
        Operand::data(name, ptr, len, 4, writes)
    }

    #[test]
    fn lengths_name_the_argument() {
        let e = validate(&[d("x", 0x1000, 12, false), d("y", 0x9000, 10, true)], &[]).unwrap_err();
        assert_eq!(e.argument(), Some("y"));
        assert!(e.to_string().contains("length 10, expected 12"), "{e}");
        let e = validate(
            &[
                d("x", 0x1000, 12, false),
                d("z", 0x5000, 10, false),
                d("y", 0x9000, 12, true),
            ],
            &[],
        )
        .unwrap_err();
        assert_eq!(e.argument(), Some("z"));
        assert_eq!(
            e.to_string(),
            "invalid argument `z`: length 10, expected 12 (the length of `x`)"
        );
    }

    #[test]
    fn mask_length() {
        let ops = |n, words| {
            [
                d("x", 0x1000, n, false),
                d("y", 0x100000, n, true),
                Operand::mask("mask", 0x200000, words, true),
            ]
        };
        assert_eq!(validate(&ops(33, 2), &[]).unwrap(), 33);
        assert_eq!(validate(&ops(33, 5), &[]).unwrap(), 33); // longer is fine
        assert_eq!(validate(&ops(32, 1), &[]).unwrap(), 32);
        let e = validate(&ops(33, 1), &[]).unwrap_err();
        assert_eq!(e.argument(), Some("mask"));
        assert!(e.to_string().contains("at least 2"), "{e}");
        assert_eq!(validate(&ops(0, 0), &[]).unwrap(), 0);
    }

    #[test]
    fn too_many_elements() {
        let e = validate(
            &[
                d("x", 0x1000, MAX_ELEMENTS + 1, false),
                d("y", 0x1000, MAX_ELEMENTS + 1, true),
            ],
            &[],
        )
        .unwrap_err();
        assert_eq!(e.argument(), Some("x"));
    }

    #[test]
    fn aliasing_rules() {
        let ok = &[("x", "y")];
        // Disjoint, adjacent ranges are fine (x: 0x1000..0x1040).
        assert!(validate(&[d("x", 0x1000, 16, false), d("y", 0x1040, 16, true)], ok).is_ok());
        // Exact alias where documented.
        assert!(validate(&[d("x", 0x1000, 16, false), d("y", 0x1000, 16, true)], ok).is_ok());
        // Exact alias where not documented.
        let e = validate(&[d("x", 0x1000, 16, false), d("y", 0x1000, 16, true)], &[]).unwrap_err();
        assert_eq!(e.argument(), Some("y"));
        assert!(e.to_string().contains("same memory as `x`"), "{e}");
        // Partial overlap, never.
        let e = validate(&[d("x", 0x1000, 16, false), d("y", 0x1004, 16, true)], ok).unwrap_err();
        assert_eq!(e.argument(), Some("y"));
        assert!(e.to_string().contains("overlaps `x`"), "{e}");
        let e = validate(&[d("x", 0x1004, 16, false), d("y", 0x1000, 16, true)], ok).unwrap_err();
        assert_eq!(e.argument(), Some("y"));
        // Two inputs may overlap any way they like (x + x, shifted views ...).
        let ops = [
            d("x", 0x1000, 16, false),
            d("z", 0x1008, 16, false),
            d("y", 0x8000, 16, true),
        ];
        assert!(validate(&ops, &[]).is_ok());
        // The mask never overlaps data, read or written.
        let ops = [
            d("x", 0x1000, 64, false),
            d("y", 0x8000, 64, true),
            Operand::mask("mask", 0x1000 + 60, 2, true),
        ];
        let e = validate(&ops, ok).unwrap_err();
        assert_eq!(e.argument(), Some("mask"));
        assert!(e.to_string().contains("mask must not overlap"), "{e}");
        let ops = [
            d("dy", 0x1000, 64, false),
            d("dx", 0x8000, 64, true),
            Operand::mask("mask", 0x1000, 2, false),
        ];
        assert_eq!(validate(&ops, &[]).unwrap_err().argument(), Some("mask"));
        // Only the bytes touched count: a mask right after the data is fine, and so is a mask
        // buffer longer than needed whose unused tail would overlap (it is never touched).
        let ops = [
            d("x", 0x1000, 64, false),
            d("y", 0x8000, 64, true),
            Operand::mask("mask", 0x1000 + 256, 2, true),
        ];
        assert!(validate(&ops, ok).is_ok());
        let ops = [
            d("x", 0x1000, 64, false),
            d("y", 0x8000, 64, true),
            Operand::mask("mask", 0x1000 - 8, 1000, true), // touches 0xff8..0x1000 only
        ];
        assert!(validate(&ops, ok).is_ok());
        // Two outputs may not overlap even exactly unless listed.
        let ops = [
            d("dy", 0x1000, 16, false),
            d("dx", 0x8000, 16, true),
            d("dz", 0x8000, 16, true),
        ];
        let e = validate(&ops, &[("dy", "dx"), ("dy", "dz")]).unwrap_err();
        assert_eq!(e.argument(), Some("dz"));
        // n == 0 touches nothing: no aliasing question.
        assert!(validate(&[d("x", 0x1000, 0, false), d("y", 0x1000, 0, true)], &[]).is_ok());
    }

    #[test]
    fn element_size_counts_in_ranges() {
        // f16: 16 elements = 32 bytes; y starting 32 bytes later does not overlap.
        let h = |name, ptr, writes| Operand::data(name, ptr, 16, 2, writes);
        assert!(validate(&[h("x", 0x1000, false), h("y", 0x1020, true)], &[]).is_ok());
        assert!(validate(&[h("x", 0x1000, false), h("y", 0x101e, true)], &[]).is_err());
    }
}
