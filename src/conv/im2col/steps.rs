//! The im2col + GEMM path as a list of steps: which kernel or GEMM runs on which buffer at which
//! offset, for every chunk of the batch. Pure: the GPU executor in [`super`] follows a plan
//! step by step, and the tests here run the same plan on the CPU (the kernels emulated, the
//! GEMMs by [`crate::reference::gemm`]) against [`crate::reference::conv`].
//!
//! # Formulations (column-major GEMMs as cuBLAS; `P = oh*ow`, `K = c_in*kh*kw`, `c = chunk`)
//! | | NCHW | NHWC |
//! |---|---|---|
//! | forward | per image: `y[P x c_out] = cols[P x K] * wᵀ` (batched, filter broadcast) | `y[c_out x cP] = wᵀ[c_out x K] * cols[K x cP]` (one GEMM) |
//! | data gradient | per image: `cols[P x K] = dy[P x c_out] * w[c_out x K]`, then col2im | `cols[K x cP] = w[K x c_out] * dy[c_out x cP]`, then col2im |
//! | filter gradient | `dw[K x c_out] = colsᵀ * dyᵀ` over `k = cP`, with the columns written `[K][c][P]` and dy permuted to `[c_out][c][P]` (an image-interleaved copy made by the same im2col kernel) | `dw[K x c_out] = cols[K x cP] * dyᵀ` over `k = cP` |
//!
//! The filter is the `[c_out][K]` row-major matrix it is stored as (KCRS or KRSC), i.e. the
//! column-major `K x c_out` matrix. Pointwise (1x1, stride 1, no padding) convolutions use x
//! itself as the columns; their NCHW filter gradient still permutes x and dy when a chunk holds
//! several images (one image needs no copy) — except in f32, where each image's
//! `dw_i = x_iᵀ dy_i` reads x and dy in place, cut along P into pieces (one batched GEMM over
//! pointer arrays, `Step::PieceGemm`) whose f32 partials one kernel sums in order
//! (`Step::SumParts`), wherever the partials stay small against x and dy and fit the cap.
//!
//! # Filter-gradient accumulation
//! A chunk's GEMM sums its images in f32 inside cuBLAS and rounds the chunk's partial to the
//! data type once. f32 data, or a single chunk, accumulate through the GEMM's beta straight into
//! `dw` (beta 1 for `accumulate`). Otherwise each chunk's partial goes to scratch and a kernel
//! adds it to an f32 accumulator; the last one writes `dw = acc + partial` (or `dw += ...`),
//! rounded once.
//!
//! # Scratch
//! The workspace cap bounds the per-chunk intermediates: the column matrices and, for NCHW's
//! filter gradient, the permuted dy. A problem whose one image's column matrix exceeds the cap is
//! [`Error::NotSupported`] (exactly when [`crate::conv::sizes::im2col_chunk`] is `None`). The
//! filter-sized partial and f32 accumulator of a chunked f16/bf16 filter gradient come on top.

use crate::conv::sizes::{balanced_chunks, im2col_chunk, im2col_dims, is_pointwise};
use crate::conv::ConvShape;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gemm::{Compute, Problem};
use crate::layout::TensorFormat;

use super::launch::ColLayout;

/// A buffer a step reads or writes: the caller's operands, or a region of the scratch arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Buf {
    /// Input.
    X,
    /// Filter.
    W,
    /// Output.
    Y,
    /// Output gradient.
    Dy,
    /// Input gradient.
    Dx,
    /// Filter gradient.
    Dw,
    /// Scratch: column matrices.
    Cols,
    /// Scratch: dy permuted to `[c_out][chunk][P]` (NCHW filter gradient).
    DyT,
    /// Scratch: one chunk's filter-gradient partial, in the data type.
    Partial,
    /// Scratch: the filter-gradient accumulator, f32.
    Acc,
    /// Scratch: the pointer arrays of a [`Step::PieceGemm`] (8-byte device addresses).
    Ptrs,
}

impl Buf {
    /// Bytes of one element of the buffer for data of `elem` bytes.
    pub(crate) fn elem_bytes(self, elem: usize) -> usize {
        match self {
            Buf::Acc => 4,
            Buf::Ptrs => 8,
            _ => elem,
        }
    }
}

/// An element of a buffer (offset in elements of the buffer's type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct At {
    /// The buffer.
    pub buf: Buf,
    /// Elements from its start.
    pub offset: usize,
}

fn at(buf: Buf, offset: usize) -> At {
    At { buf, offset }
}

/// What the accumulation kernel does with a chunk's partial (`mode` of `conv_accumulate_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AccMode {
    /// `acc = part` (first chunk).
    Start,
    /// `acc += part`.
    Add,
    /// `out = acc + part`, or `out += acc + part` with `accumulate` (last chunk).
    Finish {
        /// Add to the old `out`.
        accumulate: bool,
    },
}

impl AccMode {
    /// The kernel's mode bits: 1 reads the accumulator, 2 writes `out`, 4 adds the old `out`.
    pub(crate) fn bits(self) -> u32 {
        match self {
            AccMode::Start => 0,
            AccMode::Add => 1,
            AccMode::Finish { accumulate: false } => 3,
            AccMode::Finish { accumulate: true } => 7,
        }
    }
}

/// One step of a plan.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Step {
    /// `images` images of `shape`'s input at `src` into columns at `dst` in `layout`.
    Im2col {
        src: At,
        dst: At,
        shape: ConvShape,
        layout: ColLayout,
        images: usize,
    },
    /// A strided batched GEMM: A at `a`, B at `b`, C at `c`.
    Gemm {
        problem: Problem,
        a: At,
        b: At,
        c: At,
    },
    /// col2im (gather) of `images` images' reference-layout columns at `src` into x-shaped `dst`,
    /// overwriting it or (`add`) adding to it.
    Col2im {
        src: At,
        dst: At,
        shape: ConvShape,
        images: usize,
        add: bool,
    },
    /// The accumulation kernel over `len` elements.
    Accumulate {
        part: At,
        acc: At,
        out: At,
        len: usize,
        mode: AccMode,
    },
    /// A batched GEMM over `problem.batch` pieces, `split` per image: piece `q = i * split + j`
    /// reads A at `a + i * a_img + j * problem.stride_a`, B at `b + i * b_img + j *
    /// problem.stride_b`, and writes C at `c + q * problem.stride_c` (elements). The two-level
    /// offsets are not one stride, so cuBLAS takes pointer arrays (`cublasGemmBatchedEx`),
    /// written into `ptrs` first by a kernel.
    PieceGemm {
        problem: Problem,
        a: At,
        b: At,
        c: At,
        ptrs: At,
        a_img: usize,
        b_img: usize,
        split: usize,
    },
    /// `out = part[0] + ... + part[count - 1]` (f32, in that order), each part `len` elements
    /// after the previous one; with `add`, `out`'s old value comes first.
    SumParts {
        part: At,
        out: At,
        len: usize,
        count: usize,
        add: bool,
    },
}

/// Where each scratch region lies in the arena (bytes) and how many elements it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct ScratchLayout {
    /// `(byte offset, elements)` of [`Buf::Cols`].
    pub cols: (usize, usize),
    /// Of [`Buf::DyT`].
    pub dyt: (usize, usize),
    /// Of [`Buf::Partial`].
    pub partial: (usize, usize),
    /// Of [`Buf::Acc`] (f32 elements).
    pub acc: (usize, usize),
    /// Of [`Buf::Ptrs`] (8-byte elements).
    pub ptrs: (usize, usize),
    /// Bytes of the arena the plan uses.
    pub bytes: usize,
}

/// Regions start on this many bytes (cuBLASLt's and the vector kernels' alignment needs).
const REGION_ALIGN: usize = 256;

impl ScratchLayout {
    fn new(
        elem: usize,
        cols: usize,
        dyt: usize,
        partial: usize,
        acc: usize,
        ptrs: usize,
    ) -> Result<Self> {
        let mut next = 0usize;
        let mut region = |elems: usize, size: usize| -> Result<(usize, usize)> {
            if elems == 0 {
                return Ok((0, 0));
            }
            let start = next;
            let bytes = elems
                .checked_mul(size)
                .and_then(|b| b.checked_next_multiple_of(REGION_ALIGN))
                .ok_or_else(|| Error::invalid("shape", "the scratch size overflows usize"))?;
            next = start
                .checked_add(bytes)
                .ok_or_else(|| Error::invalid("shape", "the scratch size overflows usize"))?;
            Ok((start, elems))
        };
        let cols = region(cols, elem)?;
        let dyt = region(dyt, elem)?;
        let partial = region(partial, elem)?;
        let acc = region(acc, 4)?;
        let ptrs = region(ptrs, 8)?;
        Ok(ScratchLayout {
            cols,
            dyt,
            partial,
            acc,
            ptrs,
            bytes: next,
        })
    }

    /// `(byte offset, elements)` of a scratch buffer; `None` for the caller's operands.
    pub(crate) fn region(&self, buf: Buf) -> Option<(usize, usize)> {
        match buf {
            Buf::Cols => Some(self.cols),
            Buf::DyT => Some(self.dyt),
            Buf::Partial => Some(self.partial),
            Buf::Acc => Some(self.acc),
            Buf::Ptrs => Some(self.ptrs),
            _ => None,
        }
    }
}

/// A whole call: its steps in order, the scratch they use, the chunks of the batch.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Plan {
    /// The steps, in stream order.
    pub steps: Vec<Step>,
    /// The scratch regions.
    pub scratch: ScratchLayout,
    /// Images per chunk.
    pub chunks: Vec<usize>,
    /// im2col skipped (1x1, stride 1, no padding).
    pub pointwise: bool,
}

/// Element counts of one problem.
struct Dims {
    pixels: usize,
    taps: usize,
    x_img: usize,
    y_img: usize,
    w_len: usize,
}

fn dims(s: &ConvShape) -> Result<Dims> {
    let d = im2col_dims(s)?;
    s.y_len()?;
    let big = || Error::invalid("shape", "an element count overflows usize");
    Ok(Dims {
        pixels: d.pixels,
        taps: d.taps,
        x_img: s
            .c_in
            .checked_mul(s.h)
            .and_then(|v| v.checked_mul(s.w))
            .ok_or_else(big)?,
        y_img: d.pixels.checked_mul(s.c_out).ok_or_else(big)?,
        w_len: d.taps.checked_mul(s.c_out).ok_or_else(big)?,
    })
}

const INT_MAX: usize = i32::MAX as usize;

fn cap_error(per_image: usize, cap: usize) -> Error {
    Error::NotSupported(format!(
        "im2col + GEMM: one image's column matrix takes {per_image} bytes, more than the \
         convolution workspace cap of {cap} bytes ({} MiB); raise NNFUSE_CONV_WORKSPACE_MB \
         (Config::conv_workspace_mb) or use another path",
        cap >> 20
    ))
}

/// Images per chunk for the forward and the data gradient (columns of the chunk under the cap;
/// GEMM `int` limits).
fn column_chunk(s: &ConvShape, d: &Dims, elem: usize, cap: usize) -> Result<usize> {
    let chunk = match im2col_chunk(s, elem, cap)? {
        Some(c) => c,
        None => {
            return Err(cap_error(
                d.pixels.saturating_mul(d.taps).saturating_mul(elem),
                cap,
            ))
        }
    };
    Ok(gemm_limit(s, d, chunk))
}

/// The largest chunk whose GEMM fits cuBLAS's `int` arguments: NCHW batches images (batch),
/// NHWC folds them into one dimension (`chunk * P`).
fn gemm_limit(s: &ConvShape, d: &Dims, chunk: usize) -> usize {
    let limit = match s.format {
        TensorFormat::Nchw => INT_MAX,
        TensorFormat::Nhwc => INT_MAX / d.pixels.max(1),
    };
    chunk.min(limit).max(1)
}

fn gemm(
    (trans_a, trans_b): (bool, bool),
    (m, n, k): (usize, usize, usize),
    (lda, ldb, ldc): (usize, usize, usize),
    (stride_a, stride_b, stride_c): (usize, usize, usize),
    batch: usize,
    beta: f32,
) -> Problem {
    Problem {
        trans_a,
        trans_b,
        m,
        n,
        k,
        lda,
        ldb,
        ldc,
        stride_a,
        stride_b,
        stride_c,
        batch,
        alpha: 1.0,
        beta,
        compute: Compute::F32,
    }
}

/// `(first image, images)` of each chunk.
fn starts(chunks: &[usize]) -> impl Iterator<Item = (usize, usize)> + '_ {
    chunks.iter().scan(0usize, |b0, &nb| {
        let s = *b0;
        *b0 += nb;
        Some((s, nb))
    })
}

/// The forward convolution.
pub(crate) fn forward(s: &ConvShape, dtype: DType, cap: usize) -> Result<Plan> {
    let d = dims(s)?;
    let elem = dtype.size();
    let pointwise = is_pointwise(s);
    let chunk = if pointwise {
        gemm_limit(s, &d, s.n)
    } else {
        column_chunk(s, &d, elem, cap)?
    };
    let chunks = balanced_chunks(s.n, chunk);
    let cols_len = if pointwise {
        0
    } else {
        chunks[0] * d.pixels * d.taps
    };
    let scratch = ScratchLayout::new(elem, cols_len, 0, 0, 0, 0)?;
    let (p, k, c_out) = (d.pixels, d.taps, s.c_out);
    let mut steps = Vec::new();
    for (b0, nb) in starts(&chunks) {
        let cols = if pointwise {
            at(Buf::X, b0 * d.x_img)
        } else {
            steps.push(Step::Im2col {
                src: at(Buf::X, b0 * d.x_img),
                dst: at(Buf::Cols, 0),
                shape: *s,
                layout: ColLayout::standard(p, k),
                images: nb,
            });
            at(Buf::Cols, 0)
        };
        let y = at(Buf::Y, b0 * d.y_img);
        steps.push(match s.format {
            // y_b[P x c_out] = cols_b[P x K] * w^T: B is the K x c_out column-major filter.
            TensorFormat::Nchw => Step::Gemm {
                problem: gemm(
                    (false, false),
                    (p, c_out, k),
                    (p, k, p),
                    (p * k, 0, p * c_out),
                    nb,
                    0.0,
                ),
                a: cols,
                b: at(Buf::W, 0),
                c: y,
            },
            // y[c_out x nb*P] = (K x c_out filter)^T * cols[K x nb*P].
            TensorFormat::Nhwc => Step::Gemm {
                problem: gemm(
                    (true, false),
                    (c_out, nb * p, k),
                    (k, k, c_out),
                    (0, 0, nb * p * c_out),
                    1,
                    0.0,
                ),
                a: at(Buf::W, 0),
                b: cols,
                c: y,
            },
        });
    }
    Ok(Plan {
        steps,
        scratch,
        chunks,
        pointwise,
    })
}

/// The data gradient: columns from the filter and dy, then col2im; written to `dx` or (with
/// `accumulate`) added to it: by col2im, or for a pointwise problem (the GEMM writes dx) by the
/// GEMM's beta. Every chunk writes its own images of dx, so each element is added to once.
pub(crate) fn backward_data(
    s: &ConvShape,
    dtype: DType,
    cap: usize,
    accumulate: bool,
) -> Result<Plan> {
    let d = dims(s)?;
    let elem = dtype.size();
    let pointwise = is_pointwise(s);
    let chunk = if pointwise {
        gemm_limit(s, &d, s.n)
    } else {
        column_chunk(s, &d, elem, cap)?
    };
    let chunks = balanced_chunks(s.n, chunk);
    let cols_len = if pointwise {
        0
    } else {
        chunks[0] * d.pixels * d.taps
    };
    let scratch = ScratchLayout::new(elem, cols_len, 0, 0, 0, 0)?;
    let (p, k, c_out) = (d.pixels, d.taps, s.c_out);
    let mut steps = Vec::new();
    for (b0, nb) in starts(&chunks) {
        let dy = at(Buf::Dy, b0 * d.y_img);
        let dx = at(Buf::Dx, b0 * d.x_img);
        let cols = if pointwise { dx } else { at(Buf::Cols, 0) };
        // A pointwise GEMM writes dx itself: it adds through beta.
        let beta = if pointwise && accumulate { 1.0 } else { 0.0 };
        steps.push(match s.format {
            // cols_b[P x K] = dy_b[P x c_out] * op(w), op(w) = the stored K x c_out filter
            // transposed.
            TensorFormat::Nchw => Step::Gemm {
                problem: gemm(
                    (false, true),
                    (p, k, c_out),
                    (p, k, p),
                    (p * c_out, 0, p * k),
                    nb,
                    beta,
                ),
                a: dy,
                b: at(Buf::W, 0),
                c: cols,
            },
            // cols[K x nb*P] = w[K x c_out] * dy[c_out x nb*P].
            TensorFormat::Nhwc => Step::Gemm {
                problem: gemm(
                    (false, false),
                    (k, nb * p, c_out),
                    (k, c_out, k),
                    (0, 0, nb * p * k),
                    1,
                    beta,
                ),
                a: at(Buf::W, 0),
                b: dy,
                c: cols,
            },
        });
        if !pointwise {
            steps.push(Step::Col2im {
                src: cols,
                dst: dx,
                shape: *s,
                images: nb,
                add: accumulate,
            });
        }
    }
    Ok(Plan {
        steps,
        scratch,
        chunks,
        pointwise,
    })
}

/// The filter gradient, written to `dw` or (with `accumulate`) added to it.
pub(crate) fn backward_filter(
    s: &ConvShape,
    dtype: DType,
    cap: usize,
    accumulate: bool,
) -> Result<Plan> {
    let d = dims(s)?;
    if let Some(plan) = piece_filter(s, &d, dtype, cap, accumulate)? {
        return Ok(plan);
    }
    let elem = dtype.size();
    let pointwise = is_pointwise(s);
    let (p, k, c_out) = (d.pixels, d.taps, s.c_out);
    let nchw = s.format == TensorFormat::Nchw;
    let cols_bytes = p.saturating_mul(k).saturating_mul(elem);
    // Scratch per image of a multi-image chunk: the columns (NHWC pointwise: none) and, for NCHW,
    // the permuted dy.
    let per_image = match (s.format, pointwise) {
        (TensorFormat::Nhwc, true) => 0,
        (TensorFormat::Nhwc, false) => cols_bytes,
        (TensorFormat::Nchw, _) => {
            cols_bytes.saturating_add(c_out.saturating_mul(p).saturating_mul(elem))
        }
    };
    if !pointwise && cols_bytes > cap {
        return Err(cap_error(cols_bytes, cap));
    }
    let chunk = cap.checked_div(per_image).map_or(s.n, |c| c.clamp(1, s.n));
    // Both formats fold a chunk's images into the GEMM's k = chunk * P.
    let chunk = chunk.min(INT_MAX / p.max(1)).max(1);
    let chunks = balanced_chunks(s.n, chunk);
    let max = chunks[0];
    let cols_len = match (s.format, pointwise) {
        (TensorFormat::Nhwc, true) => 0,
        (TensorFormat::Nchw, true) if max == 1 => 0,
        _ => max * p * k,
    };
    let dyt_len = if nchw && max > 1 { max * c_out * p } else { 0 };
    let direct_out = dtype == DType::F32 || chunks.len() == 1;
    let fixed = if direct_out { 0 } else { d.w_len };
    let scratch = ScratchLayout::new(elem, cols_len, dyt_len, fixed, fixed, 0)?;
    let last = chunks.len() - 1;
    let mut steps = Vec::new();
    for (i, (b0, nb)) in starts(&chunks).enumerate() {
        let x = at(Buf::X, b0 * d.x_img);
        let dy = at(Buf::Dy, b0 * d.y_img);
        let (target, beta) = if direct_out {
            let beta = if i == 0 && !accumulate { 0.0 } else { 1.0 };
            (at(Buf::Dw, 0), beta)
        } else {
            (at(Buf::Partial, 0), 0.0)
        };
        let chunk = FilterChunk {
            x,
            dy,
            target,
            beta,
            images: nb,
        };
        let step = if nchw {
            nchw_filter_chunk(s, &d, pointwise, chunk, &mut steps)?
        } else {
            nhwc_filter_chunk(s, &d, pointwise, chunk, &mut steps)
        };
        steps.push(step);
        if !direct_out {
            let mode = match i {
                0 => AccMode::Start,
                _ if i == last => AccMode::Finish { accumulate },
                _ => AccMode::Add,
            };
            steps.push(Step::Accumulate {
                part: at(Buf::Partial, 0),
                acc: at(Buf::Acc, 0),
                out: at(Buf::Dw, 0),
                len: d.w_len,
                mode,
            });
        }
    }
    Ok(Plan {
        steps,
        scratch,
        chunks,
        pointwise,
    })
}

/// Each piece's GEMM takes at least this many pixels (its k): on the H100, f32 256x64 filter
/// gradients at 56x56 ran best cut into pieces of 784 (docs/PERFORMANCE.md).
const MIN_PIECE_K: usize = 768;
/// Most pieces per image.
const MAX_SPLIT: usize = 64;
/// The pieces' partials (written once, read once) stay under this share of the operands' size;
/// beyond it (wide filters, few pixels) the permuted single GEMM moves fewer bytes.
const PART_SHARE: usize = 8;

/// Pieces per image of `pixels` pixels: the most that divide them evenly (one k for every piece
/// of the one GEMM call) and leave each at least [`MIN_PIECE_K`] (1 below `2 * MIN_PIECE_K`).
fn piece_split(pixels: usize) -> usize {
    (1..=MAX_SPLIT)
        .rev()
        .find(|&s| pixels % s == 0 && pixels / s >= MIN_PIECE_K)
        .unwrap_or(1)
}

/// Whether the filter gradient of `s` in `dtype` under `cap` bytes of workspace is the
/// in-place one in pieces ([`piece_filter`]; pure, for the plan's candidate order).
pub(crate) fn filter_takes_pieces(s: &ConvShape, dtype: DType, cap: usize) -> bool {
    dims(s).is_ok_and(|d| matches!(piece_filter(s, &d, dtype, cap, false), Ok(Some(_))))
}

/// The NCHW pointwise f32 filter gradient without copies: each image's `dw_i = x_i^T dy_i`
/// straight from x and dy (no permuted copies of both, which moved twice their bytes), its
/// pixels cut into [`piece_split`] pieces so that the batched GEMM has enough blocks, then one
/// kernel sums the pieces in a fixed order. `None` where it does not apply: other formats,
/// kernels or dtypes (16-bit partials would round per piece), partials large against the
/// operands, or scratch over the cap.
fn piece_filter(
    s: &ConvShape,
    d: &Dims,
    dtype: DType,
    cap: usize,
    accumulate: bool,
) -> Result<Option<Plan>> {
    if s.format != TensorFormat::Nchw || !is_pointwise(s) || dtype != DType::F32 {
        return Ok(None);
    }
    let (p, k, c_out) = (d.pixels, d.taps, s.c_out);
    let split = piece_split(p);
    let count = s.n.saturating_mul(split);
    let part_len = count.saturating_mul(d.w_len);
    let operands = s.n.saturating_mul(d.x_img.saturating_add(d.y_img));
    if count > INT_MAX || part_len > operands / PART_SHARE {
        return Ok(None);
    }
    let scratch = ScratchLayout::new(dtype.size(), 0, 0, part_len, 0, 3 * count)?;
    if scratch.bytes > cap {
        return Ok(None);
    }
    let l = p / split;
    let steps = vec![
        Step::PieceGemm {
            // dw_q[K x c_out] = x_q^T * dy_q, each operand a column-major P x _ matrix.
            problem: gemm(
                (true, false),
                (k, c_out, l),
                (p, p, k),
                (l, l, d.w_len),
                count,
                0.0,
            ),
            a: at(Buf::X, 0),
            b: at(Buf::Dy, 0),
            c: at(Buf::Partial, 0),
            ptrs: at(Buf::Ptrs, 0),
            a_img: d.x_img,
            b_img: d.y_img,
            split,
        },
        Step::SumParts {
            part: at(Buf::Partial, 0),
            out: at(Buf::Dw, 0),
            len: d.w_len,
            count,
            add: accumulate,
        },
    ];
    Ok(Some(Plan {
        steps,
        scratch,
        chunks: vec![s.n],
        pointwise: true,
    }))
}

/// One chunk's operands in the filter gradient's plan.
struct FilterChunk {
    x: At,
    dy: At,
    /// Where the chunk's GEMM writes (dw, or the f32 partial).
    target: At,
    beta: f32,
    images: usize,
}

/// An NCHW chunk of the filter gradient: im2col of x (and the permutation of dy for several
/// images) pushed to `steps`; returns the chunk's GEMM.
fn nchw_filter_chunk(
    s: &ConvShape,
    d: &Dims,
    pointwise: bool,
    c: FilterChunk,
    steps: &mut Vec<Step>,
) -> Result<Step> {
    let FilterChunk {
        x,
        dy,
        target,
        beta,
        images: nb,
    } = c;
    let (p, k, c_out) = (d.pixels, d.taps, s.c_out);
    let kk = nb * p; // the GEMM's inner dimension: the chunk's pixels
                     // dw[K x c_out] = colsT^T * dyT with colsT = [K][nb][P] (column-major nb*P x K) and
                     // dyT = [c_out][nb][P] (column-major nb*P x c_out). One image needs no permutation.
    let a = if pointwise && nb == 1 {
        x
    } else {
        steps.push(Step::Im2col {
            src: x,
            dst: at(Buf::Cols, 0),
            shape: *s,
            layout: ColLayout { img: p, row: kk },
            images: nb,
        });
        at(Buf::Cols, 0)
    };
    let b = if nb == 1 {
        dy
    } else {
        let (oh, ow) = s.out_hw()?;
        steps.push(Step::Im2col {
            src: dy,
            dst: at(Buf::DyT, 0),
            shape: ConvShape {
                n: nb,
                c_in: c_out,
                h: oh,
                w: ow,
                c_out: 1,
                kh: 1,
                kw: 1,
                stride: (1, 1),
                pad: (0, 0),
                dilation: (1, 1),
                format: TensorFormat::Nchw,
            },
            layout: ColLayout { img: p, row: kk },
            images: nb,
        });
        at(Buf::DyT, 0)
    };
    Ok(Step::Gemm {
        problem: gemm(
            (true, false),
            (k, c_out, kk),
            (kk, kk, k),
            (0, 0, d.w_len),
            1,
            beta,
        ),
        a,
        b,
        c: target,
    })
}

/// An NHWC chunk of the filter gradient: im2col of x (unless pointwise) pushed to `steps`;
/// returns the chunk's GEMM.
fn nhwc_filter_chunk(
    s: &ConvShape,
    d: &Dims,
    pointwise: bool,
    c: FilterChunk,
    steps: &mut Vec<Step>,
) -> Step {
    let FilterChunk {
        x,
        dy,
        target,
        beta,
        images: nb,
    } = c;
    let (p, k, c_out) = (d.pixels, d.taps, s.c_out);
    let kk = nb * p; // the GEMM's inner dimension: the chunk's pixels
                     // dw[K x c_out] = cols[K x nb*P] * (dy[c_out x nb*P])^T.
    let a = if pointwise {
        x
    } else {
        steps.push(Step::Im2col {
            src: x,
            dst: at(Buf::Cols, 0),
            shape: *s,
            layout: ColLayout::standard(p, k),
            images: nb,
        });
        at(Buf::Cols, 0)
    };
    Step::Gemm {
        problem: gemm(
            (false, true),
            (k, c_out, kk),
            (k, c_out, k),
            (0, 0, d.w_len),
            1,
            beta,
        ),
        a,
        b: dy,
        c: target,
    }
}

#[cfg(test)]
mod tests {
    use super::super::launch::{self, emulate};
    use super::*;
    use crate::reference::conv as r;
    use crate::reference::gemm::gemm_strided_batched;
    use std::collections::HashMap;
    use TensorFormat::{Nchw, Nhwc};

    use crate::testutil::xorshift_values as values;

    /// Runs a plan on the CPU: scratch regions poisoned with NaN, the kernels emulated (x's
    /// address `x_addr` decides the copy unit as on the GPU), every GEMM checked against its
    /// buffers' lengths (as cuBLAS would need) and computed in f64.
    fn run(
        plan: &Plan,
        dtype: DType,
        mut bufs: HashMap<Buf, Vec<f64>>,
        x_addr: u64,
    ) -> HashMap<Buf, Vec<f64>> {
        let elem = dtype.size();
        for (buf, (_, len)) in [
            (Buf::Cols, plan.scratch.cols),
            (Buf::DyT, plan.scratch.dyt),
            (Buf::Partial, plan.scratch.partial),
            (Buf::Acc, plan.scratch.acc),
            (Buf::Ptrs, plan.scratch.ptrs),
        ] {
            bufs.insert(buf, vec![f64::NAN; len]);
        }
        let addr = |a: At| -> u64 {
            let base = match a.buf {
                Buf::X | Buf::Dy => x_addr,
                _ => 0,
            };
            base + (a.offset * elem) as u64
        };
        for step in &plan.steps {
            match step {
                Step::Im2col {
                    src,
                    dst,
                    shape,
                    layout,
                    images,
                } => {
                    let l = launch::im2col(shape, *layout, elem, *images, addr(*src), addr(*dst))
                        .unwrap();
                    let x = bufs[&src.buf][src.offset..].to_vec();
                    let out = bufs.get_mut(&dst.buf).unwrap();
                    emulate::im2col(&l, &x, &mut out[dst.offset..]);
                }
                Step::Col2im {
                    src,
                    dst,
                    shape,
                    images,
                    add,
                } => {
                    let l = launch::col2im(shape, dtype, *images, addr(*src), addr(*dst), *add)
                        .unwrap();
                    let cols = bufs[&src.buf][src.offset..].to_vec();
                    let out = bufs.get_mut(&dst.buf).unwrap();
                    emulate::col2im(&l, &cols, &mut out[dst.offset..]);
                }
                Step::Gemm { problem, a, b, c } => {
                    assert!(
                        a.buf != c.buf && b.buf != c.buf,
                        "C overlaps an input: {step:?}"
                    );
                    let av = bufs[&a.buf][a.offset..].to_vec();
                    let bv = bufs[&b.buf][b.offset..].to_vec();
                    let cv = &mut bufs.get_mut(&c.buf).unwrap()[c.offset..];
                    problem
                        .check_buffers(dtype, av.len(), bv.len(), cv.len())
                        .unwrap_or_else(|e| panic!("{step:?}: {e}"));
                    gemm_strided_batched(&problem.to_reference(), &av, &bv, cv).unwrap();
                }
                Step::Accumulate {
                    part,
                    acc,
                    out,
                    len,
                    mode,
                } => {
                    // conv_accumulate_* in kernels/im2col.cu.
                    let bits = mode.bits();
                    let pv = bufs[&part.buf][part.offset..part.offset + len].to_vec();
                    for i in 0..*len {
                        let mut s = pv[i];
                        if bits & 1 != 0 {
                            s += bufs[&acc.buf][acc.offset + i];
                        }
                        if bits & 2 != 0 {
                            if bits & 4 != 0 {
                                s += bufs[&out.buf][out.offset + i];
                            }
                            bufs.get_mut(&out.buf).unwrap()[out.offset + i] = s;
                        } else {
                            bufs.get_mut(&acc.buf).unwrap()[acc.offset + i] = s;
                        }
                    }
                }
                Step::PieceGemm {
                    problem,
                    a,
                    b,
                    c,
                    ptrs,
                    a_img,
                    b_img,
                    split,
                } => {
                    assert!(a.buf != c.buf && b.buf != c.buf && ptrs.buf == Buf::Ptrs);
                    assert!(bufs[&Buf::Ptrs].len() >= 3 * problem.batch, "{step:?}");
                    let one = Problem {
                        batch: 1,
                        stride_a: 0,
                        stride_b: 0,
                        stride_c: 0,
                        ..*problem
                    };
                    for q in 0..problem.batch {
                        let (i, j) = (q / split, q % split);
                        let ao = a.offset + i * a_img + j * problem.stride_a;
                        let bo = b.offset + i * b_img + j * problem.stride_b;
                        let co = c.offset + q * problem.stride_c;
                        let av = bufs[&a.buf][ao..].to_vec();
                        let bv = bufs[&b.buf][bo..].to_vec();
                        let cv = &mut bufs.get_mut(&c.buf).unwrap()[co..];
                        one.check_buffers(dtype, av.len(), bv.len(), cv.len())
                            .unwrap_or_else(|e| panic!("{step:?} piece {q}: {e}"));
                        gemm_strided_batched(&one.to_reference(), &av, &bv, cv).unwrap();
                    }
                }
                Step::SumParts {
                    part,
                    out,
                    len,
                    count,
                    add,
                } => {
                    // conv_sum_parts_f32 in kernels/im2col.cu.
                    let pv = bufs[&part.buf][part.offset..part.offset + count * len].to_vec();
                    let o = &mut bufs.get_mut(&out.buf).unwrap()[out.offset..out.offset + len];
                    for (i, v) in o.iter_mut().enumerate() {
                        let mut s = if *add { *v } else { 0.0 };
                        for q in 0..*count {
                            s += pv[q * len + i];
                        }
                        *v = s;
                    }
                }
            }
        }
        bufs
    }

    fn close(got: &[f64], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-10, "{what}: element {i}: {g} vs {w}");
        }
    }

    /// Problems for the plan tests: both formats, pointwise and not, batch 5 (so that caps give
    /// uneven chunks).
    fn problems() -> Vec<ConvShape> {
        let mut v = Vec::new();
        for format in [Nchw, Nhwc] {
            // (4, 2, 40, 40): 1600 pixels, cut in two pieces by the f32 NCHW pointwise filter
            // gradient.
            for (c_in, c_out, h, w) in [(3, 4, 5, 6), (8, 3, 4, 4), (16, 8, 3, 5), (4, 2, 40, 40)] {
                for (kh, kw, stride, pad, dilation) in [
                    (3, 3, (1, 1), (1, 1), (1, 1)),
                    (1, 1, (1, 1), (0, 0), (1, 1)),
                    (1, 1, (2, 2), (0, 0), (1, 1)),
                    (3, 2, (2, 1), (0, 2), (1, 2)),
                ] {
                    v.push(ConvShape {
                        n: 5,
                        c_in,
                        h,
                        w,
                        c_out,
                        kh,
                        kw,
                        stride,
                        pad,
                        dilation,
                        format,
                    });
                }
            }
        }
        v
    }

    /// Caps that give one chunk per image, two or three chunks, and one chunk.
    fn caps(s: &ConvShape, elem: usize) -> Vec<usize> {
        let d = dims(s).unwrap();
        let per = d.pixels * d.taps * elem;
        vec![
            per,
            2 * per + 1,
            3 * per + s.c_out * d.pixels * elem * 3,
            usize::MAX / 4,
        ]
    }

    #[test]
    fn emulated_forward_equals_the_reference() {
        let mut seen_chunks = std::collections::BTreeSet::new();
        for (i, s) in problems().into_iter().enumerate() {
            let x = values(i as u64 + 1, s.x_len().unwrap());
            let w = values(i as u64 + 100, s.w_len().unwrap());
            let want = r::conv2d(&s, &x, &w).unwrap();
            for dtype in [DType::F32, DType::F16] {
                for cap in caps(&s, dtype.size()) {
                    for x_addr in [0u64, dtype.size() as u64] {
                        let plan = forward(&s, dtype, cap).unwrap();
                        seen_chunks.insert(plan.chunks.len());
                        let bufs = HashMap::from([
                            (Buf::X, x.clone()),
                            (Buf::W, w.clone()),
                            (Buf::Y, vec![f64::NAN; want.len()]),
                        ]);
                        let out = run(&plan, dtype, bufs, x_addr);
                        close(&out[&Buf::Y], &want, &format!("{s:?} {dtype} cap {cap}: y"));
                    }
                }
            }
        }
        assert!(seen_chunks.len() >= 3, "{seen_chunks:?}");
    }

    #[test]
    fn emulated_data_gradient_equals_the_reference() {
        for (i, s) in problems().into_iter().enumerate() {
            let dy = values(i as u64 + 1, s.y_len().unwrap());
            let w = values(i as u64 + 100, s.w_len().unwrap());
            let want = r::conv2d_backward_data(&s, &dy, &w).unwrap();
            let dx0 = values(i as u64 + 200, want.len());
            let added: Vec<f64> = dx0.iter().zip(&want).map(|(a, b)| a + b).collect();
            for dtype in [DType::F32, DType::BF16] {
                for cap in caps(&s, dtype.size()) {
                    for accumulate in [false, true] {
                        let plan = backward_data(&s, dtype, cap, accumulate).unwrap();
                        let init = if accumulate {
                            dx0.clone()
                        } else {
                            vec![f64::NAN; want.len()]
                        };
                        let bufs = HashMap::from([
                            (Buf::Dy, dy.clone()),
                            (Buf::W, w.clone()),
                            (Buf::Dx, init),
                        ]);
                        let out = run(&plan, dtype, bufs, 0);
                        close(
                            &out[&Buf::Dx],
                            if accumulate { &added } else { &want },
                            &format!("{s:?} {dtype} cap {cap} accumulate {accumulate}: dx"),
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn emulated_filter_gradient_equals_the_reference() {
        let mut modes = std::collections::BTreeSet::new();
        let mut pieces = Vec::new();
        for (i, s) in problems().into_iter().enumerate() {
            let x = values(i as u64 + 1, s.x_len().unwrap());
            let dy = values(i as u64 + 50, s.y_len().unwrap());
            let want = r::conv2d_backward_filter(&s, &x, &dy).unwrap();
            let old = values(i as u64 + 99, want.len());
            for dtype in [DType::F32, DType::F16] {
                for cap in caps(&s, dtype.size()) {
                    for accumulate in [false, true] {
                        let plan = backward_filter(&s, dtype, cap, accumulate).unwrap();
                        for st in &plan.steps {
                            match st {
                                Step::Accumulate { mode, .. } => {
                                    modes.insert(mode.bits());
                                }
                                Step::PieceGemm { split, .. } => pieces.push(*split),
                                _ => {}
                            }
                        }
                        let init = if accumulate {
                            old.clone()
                        } else {
                            vec![f64::NAN; want.len()]
                        };
                        let bufs = HashMap::from([
                            (Buf::X, x.clone()),
                            (Buf::Dy, dy.clone()),
                            (Buf::Dw, init),
                        ]);
                        let out = run(&plan, dtype, bufs, 0);
                        let expect: Vec<f64> = if accumulate {
                            want.iter().zip(&old).map(|(a, b)| a + b).collect()
                        } else {
                            want.clone()
                        };
                        close(
                            &out[&Buf::Dw],
                            &expect,
                            &format!(
                                "{s:?} {dtype} cap {cap} accumulate {accumulate}: dw ({} chunks)",
                                plan.chunks.len()
                            ),
                        );
                    }
                }
            }
        }
        // Every accumulation mode ran somewhere, and the pieces (one image per piece and two).
        assert_eq!(modes.into_iter().collect::<Vec<_>>(), vec![0, 1, 3, 7]);
        assert!(pieces.contains(&1) && pieces.contains(&2), "{pieces:?}");
    }

    #[test]
    fn pointwise_nchw_f32_filter_gradient_takes_pieces_where_they_pay() {
        assert_eq!(piece_split(3136), 4);
        assert_eq!(piece_split(1600), 2);
        assert_eq!(piece_split(12544), 16);
        assert_eq!(piece_split(196), 1);
        assert_eq!(piece_split(1543), 1); // prime: no even cut
        assert_eq!(piece_split(1), 1);
        let gb = 1usize << 30;
        // The demo's 1x1 convolutions at 56x56, batch 32: 128 pieces of 784 pixels.
        for (c_in, c_out) in [(256, 64), (64, 256)] {
            let s = crate::testutil::square_conv(32, c_in, 56, c_out, 1, Nchw);
            let plan = backward_filter(&s, DType::F32, gb, false).unwrap();
            let [Step::PieceGemm { problem, split, .. }, Step::SumParts { count, add, .. }] =
                &plan.steps[..]
            else {
                panic!("{:?}", plan.steps);
            };
            assert_eq!(
                (problem.batch, problem.k, *split, *count),
                (128, 784, 4, 128)
            );
            assert!(!add);
            assert!(plan.scratch.bytes <= 128 * c_in * c_out * 4 + 2 * REGION_ALIGN + 128 * 24);
            // Not where it does not apply: 16-bit data, NHWC, a cap below its scratch.
            for (dtype, format, cap) in [
                (DType::F16, Nchw, gb),
                (DType::F32, Nhwc, gb),
                (DType::F32, Nchw, plan.scratch.bytes - 1),
            ] {
                let q = ConvShape { format, ..s };
                let other = backward_filter(&q, dtype, cap, false).unwrap();
                assert!(
                    !other
                        .steps
                        .iter()
                        .any(|st| matches!(st, Step::PieceGemm { .. })),
                    "{dtype} {format:?} cap {cap}: {:?}",
                    other.steps
                );
            }
        }
        // Wide filters over few pixels: the partials would outweigh x and dy.
        let s = crate::testutil::square_conv(32, 2048, 7, 512, 1, Nchw);
        let plan = backward_filter(&s, DType::F32, gb, false).unwrap();
        assert!(!plan
            .steps
            .iter()
            .any(|st| matches!(st, Step::PieceGemm { .. })));
    }

    #[test]
    fn single_chunk_nchw_forward_is_the_reference_formulation() {
        let s = ConvShape {
            n: 3,
            c_in: 5,
            h: 8,
            w: 6,
            c_out: 7,
            kh: 3,
            kw: 3,
            stride: (1, 1),
            pad: (1, 1),
            dilation: (1, 1),
            format: Nchw,
        };
        let plan = forward(&s, DType::F32, usize::MAX).unwrap();
        let Step::Gemm { problem, .. } = &plan.steps[1] else {
            panic!("{:?}", plan.steps);
        };
        assert_eq!(problem.to_reference(), r::im2col_gemm_problem(&s).unwrap());
        // NHWC folds the batch into n: the same product as the reference's batched one.
        let q = ConvShape { format: Nhwc, ..s };
        let plan = forward(&q, DType::F32, usize::MAX).unwrap();
        let Step::Gemm { problem, .. } = &plan.steps[1] else {
            panic!("{:?}", plan.steps);
        };
        let g = r::im2col_gemm_problem(&q).unwrap();
        assert_eq!((problem.m, problem.n, problem.k), (g.m, g.n * g.batch, g.k));
        assert_eq!(
            (problem.trans_a, problem.lda, problem.ldb, problem.ldc),
            (g.trans_a, g.lda, g.ldb, g.ldc)
        );
    }

    #[test]
    fn chunks_respect_the_cap_and_errors_name_it() {
        let s = crate::testutil::square_conv(32, 64, 56, 64, 3, Nhwc);
        let per = 3136 * 576 * 2;
        let plan = forward(&s, DType::F16, 256 << 20).unwrap();
        assert!(plan.scratch.bytes <= 256 << 20);
        assert_eq!(plan.chunks.iter().sum::<usize>(), 32);
        assert_eq!(plan.chunks[0], ((256usize << 20) / per).min(32));
        let plan = forward(&s, DType::F16, 1 << 20).err().unwrap();
        let msg = plan.to_string();
        assert!(
            msg.contains("NNFUSE_CONV_WORKSPACE_MB") && msg.contains(&per.to_string()),
            "{msg}"
        );
        for f in [
            backward_data(&s, DType::F16, 1 << 20, false),
            backward_filter(&s, DType::F16, 1 << 20, false),
        ] {
            assert!(matches!(f, Err(Error::NotSupported(_))));
        }
        // Eligibility agrees with sizes::im2col_chunk for all three directions.
        for nchw in [false, true] {
            let q = ConvShape {
                format: if nchw { Nchw } else { Nhwc },
                ..s
            };
            for cap in [per - 1, per, per + 1, 3 * per] {
                let ok = im2col_chunk(&q, 2, cap).unwrap().is_some();
                assert_eq!(forward(&q, DType::F16, cap).is_ok(), ok);
                assert_eq!(backward_data(&q, DType::F16, cap, false).is_ok(), ok);
                assert_eq!(backward_filter(&q, DType::F16, cap, true).is_ok(), ok);
                if let Ok(p) = backward_filter(&q, DType::F16, cap, true) {
                    let over = p.scratch.cols.1 * 2 + p.scratch.dyt.1 * 2;
                    assert!(over <= cap, "{q:?} cap {cap}: {over}");
                }
            }
        }
        // Pointwise needs no scratch for the forward and the data gradient.
        let p1 = ConvShape {
            kh: 1,
            kw: 1,
            pad: (0, 0),
            ..s
        };
        assert_eq!(forward(&p1, DType::F16, 1).unwrap().scratch.bytes, 0);
        assert_eq!(
            backward_data(&p1, DType::F16, 1, false)
                .unwrap()
                .scratch
                .bytes,
            0
        );
        assert_eq!(
            backward_filter(&p1, DType::F16, 1, false)
                .unwrap()
                .scratch
                .bytes,
            0
        );
        assert_eq!(forward(&p1, DType::F16, 1).unwrap().steps.len(), 1);
    }

    #[test]
    fn scratch_regions_are_aligned_and_disjoint() {
        let l = ScratchLayout::new(2, 1001, 17, 33, 33, 9).unwrap();
        let regions = [l.cols, l.dyt, l.partial, l.acc, l.ptrs];
        let sizes = [2, 2, 2, 4, 8];
        for (i, (&(off, n), &sz)) in regions.iter().zip(&sizes).enumerate() {
            assert_eq!(off % REGION_ALIGN, 0);
            if i + 1 < regions.len() {
                assert!(off + n * sz <= regions[i + 1].0);
            } else {
                assert!(off + n * sz <= l.bytes);
            }
        }
        assert_eq!(ScratchLayout::new(2, 0, 0, 0, 0, 0).unwrap().bytes, 0);
    }
}
