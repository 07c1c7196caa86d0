//! The block `nnfuse demo` runs, as plain data: its layers and their shapes, the operations of
//! one training step in the order they are queued, and what each one must at least cost
//! (FLOPs, bytes, the floor on an H100). Pure: no GPU.
//!
//! The block is ResNet-50's first bottleneck with an identity shortcut (stage conv2_x, blocks 2
//! and 3): `x` (256 channels, 56x56) → 1x1 conv 256→64 → BN+ReLU → 3x3 conv 64→64 (pad 1) →
//! BN+ReLU → 1x1 conv 64→256 → BN, + `x`, ReLU. The step also runs ResNet-50's classifier
//! GEMM (fc 2048→1000 at the same batch: forward and both gradients) on its own random
//! features: the pooling and stages between the block and the classifier are not part of the
//! demo, so that GEMM is not connected to the block.

use nnfuse::batchnorm::Fuse;
use nnfuse::conv::{ConvShape, Direction};
use nnfuse::gemm::Problem;
use nnfuse::{DType, TensorFormat};

/// H100 SXM datasheet peaks (dense): f16/bf16 tensor cores, f32 FMA (no TF32); as
/// `benches/conv.rs`.
pub const PEAK_HALF_TFLOPS: f64 = 989.4;
/// See [`PEAK_HALF_TFLOPS`].
pub const PEAK_F32_TFLOPS: f64 = 66.9;
/// Device-to-device copy bandwidth measured on the H100 (docs/CUDNN-FACTS.md).
pub const COPY_TBPS: f64 = 3.0;

/// BatchNorm's momentum and epsilon in the demo (PyTorch's defaults).
pub const MOMENTUM: f64 = 0.1;
/// See [`MOMENTUM`].
pub const EPS: f64 = 1e-5;

/// The block's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockDef {
    /// Batch.
    pub n: usize,
    /// Channels of the block's input and output.
    pub c: usize,
    /// Channels inside the bottleneck.
    pub mid: usize,
    /// Height and width.
    pub hw: usize,
    /// Memory format of every activation (filters KCRS with NCHW, KRSC with NHWC).
    pub format: TensorFormat,
    /// Element type of activations, filters and the GEMM.
    pub dtype: DType,
    /// Classifier inputs (features).
    pub fc_in: usize,
    /// Classifier outputs (classes).
    pub fc_out: usize,
}

impl BlockDef {
    /// ResNet-50's bottleneck (256→64→256 at 56x56) and classifier (2048→1000).
    pub fn resnet50(n: usize, dtype: DType, format: TensorFormat) -> BlockDef {
        BlockDef {
            n,
            c: 256,
            mid: 64,
            hw: 56,
            format,
            dtype,
            fc_in: 2048,
            fc_out: 1000,
        }
    }

    /// The same block at another batch.
    pub fn with_batch(&self, n: usize) -> BlockDef {
        BlockDef { n, ..*self }
    }

    /// Convolution `i` (0: 1x1 c→mid, 1: 3x3 mid→mid pad 1, 2: 1x1 mid→c).
    pub fn conv(&self, i: usize) -> ConvShape {
        let (c_in, c_out, k, pad) = match i {
            0 => (self.c, self.mid, 1, 0),
            1 => (self.mid, self.mid, 3, 1),
            _ => (self.mid, self.c, 1, 0),
        };
        ConvShape {
            n: self.n,
            c_in,
            h: self.hw,
            w: self.hw,
            c_out,
            kh: k,
            kw: k,
            stride: (1, 1),
            pad: (pad, pad),
            dilation: (1, 1),
            format: self.format,
        }
    }

    /// Channels BatchNorm `i` normalises (the output channels of convolution `i`).
    pub fn bn_channels(&self, i: usize) -> usize {
        if i == 2 {
            self.c
        } else {
            self.mid
        }
    }

    /// The activation BatchNorm `i` is fused with: ReLU, ReLU, and Add+ReLU with the block's
    /// input as the addend.
    pub fn bn_fuse(i: usize) -> Fuse {
        if i == 2 {
            Fuse::AddRelu
        } else {
            Fuse::Relu
        }
    }

    /// The tensor shape BatchNorm `i` sees and its channel axis: `[n, hw, hw, C]` axis 3
    /// (NHWC) or `[n, C, hw, hw]` axis 1 (NCHW).
    pub fn bn_shape(&self, i: usize) -> (Vec<usize>, usize) {
        let c = self.bn_channels(i);
        match self.format {
            TensorFormat::Nhwc => (vec![self.n, self.hw, self.hw, c], 3),
            TensorFormat::Nchw => (vec![self.n, c, self.hw, self.hw], 1),
        }
    }

    /// Elements of an activation with `channels` channels.
    pub fn act_len(&self, channels: usize) -> usize {
        self.n * channels * self.hw * self.hw
    }

    /// The classifier's three GEMMs, column-major as cuBLAS (row-major buffers: features
    /// `[n][fc_in]`, weight `[fc_out][fc_in]`, logits `[n][fc_out]`):
    /// - forward: `logits = features · weightᵀ` — `m = fc_out`, `n = batch`, `k = fc_in`,
    ///   A = weight (transposed), B = features;
    /// - weight gradient: `dweight = dlogitsᵀ · features` — `m = fc_in`, `n = fc_out`,
    ///   `k = batch`, A = features, B = dlogits (transposed);
    /// - feature gradient: `dfeatures = dlogits · weight` — `m = fc_in`, `n = batch`,
    ///   `k = fc_out`, A = weight, B = dlogits.
    pub fn fc_problem(&self, op: Op) -> Problem {
        match op {
            Op::FcWgrad => Problem::packed_trans(1, self.fc_in, self.fc_out, self.n, false, true),
            Op::FcDgrad => Problem::packed_trans(1, self.fc_in, self.n, self.fc_out, false, false),
            _ => Problem::packed_trans(1, self.fc_out, self.n, self.fc_in, true, false),
        }
    }
}

/// One operation of the training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Convolution `i`, forward.
    ConvFwd(usize),
    /// BatchNorm `i` (with its activation), training forward.
    BnFwd(usize),
    /// Classifier forward GEMM.
    FcFwd,
    /// Classifier weight gradient GEMM.
    FcWgrad,
    /// Classifier feature gradient GEMM.
    FcDgrad,
    /// BatchNorm `i` (with its activation), backward.
    BnBwd(usize),
    /// Convolution `i`, data gradient.
    ConvDgrad(usize),
    /// Convolution `i`, filter gradient.
    ConvWgrad(usize),
    /// The block input's gradient: the shortcut's (BN 3's addend gradient) plus convolution
    /// 1's data gradient.
    AddDx,
}

/// One training step, in the order it is queued: the block's forward, the classifier's
/// forward and gradients, the block's backward.
pub const STEP: [Op; 19] = [
    Op::ConvFwd(0),
    Op::BnFwd(0),
    Op::ConvFwd(1),
    Op::BnFwd(1),
    Op::ConvFwd(2),
    Op::BnFwd(2),
    Op::FcFwd,
    Op::FcWgrad,
    Op::FcDgrad,
    Op::BnBwd(2),
    Op::ConvDgrad(2),
    Op::ConvWgrad(2),
    Op::BnBwd(1),
    // Filter gradients before data gradients: bnN.bwd's output (dz, 12.8 MB at batch 32) is
    // still in L2 when the filter gradient reads it (H100: conv1.wgrad 37.8 -> 33.3 us, the
    // step 520 -> 508 us; docs/PERFORMANCE.md, 2026-11-27 12:00).
    Op::ConvWgrad(1),
    Op::ConvDgrad(1),
    Op::BnBwd(0),
    Op::ConvWgrad(0),
    Op::ConvDgrad(0),
    Op::AddDx,
];

impl Op {
    /// `conv2.fwd`, `bn3.bwd`, `conv1.dgrad`, `fc.wgrad`, `dx.add` (layers count from 1).
    pub fn name(self) -> String {
        match self {
            Op::ConvFwd(i) => format!("conv{}.fwd", i + 1),
            Op::BnFwd(i) => format!("bn{}.fwd", i + 1),
            Op::FcFwd => "fc.fwd".into(),
            Op::FcWgrad => "fc.wgrad".into(),
            Op::FcDgrad => "fc.dgrad".into(),
            Op::BnBwd(i) => format!("bn{}.bwd", i + 1),
            Op::ConvDgrad(i) => format!("conv{}.dgrad", i + 1),
            Op::ConvWgrad(i) => format!("conv{}.wgrad", i + 1),
            Op::AddDx => "dx.add".into(),
        }
    }

    /// The convolution and direction of a convolution op.
    pub fn conv(self) -> Option<(usize, Direction)> {
        match self {
            Op::ConvFwd(i) => Some((i, Direction::Forward)),
            Op::ConvDgrad(i) => Some((i, Direction::BackwardData)),
            Op::ConvWgrad(i) => Some((i, Direction::BackwardFilter)),
            _ => None,
        }
    }

    /// The BatchNorm of a BatchNorm op.
    pub fn bn(self) -> Option<usize> {
        match self {
            Op::BnFwd(i) | Op::BnBwd(i) => Some(i),
            _ => None,
        }
    }

    /// Whether this is one of the classifier's GEMMs.
    pub fn is_fc(self) -> bool {
        matches!(self, Op::FcFwd | Op::FcWgrad | Op::FcDgrad)
    }

    /// What it computes, in a few words (`1x1 256->64`, `BN+Add+ReLU 256ch`, `GEMM 1000x32x2048`).
    pub fn describe(self, def: &BlockDef) -> String {
        match self {
            Op::ConvFwd(i) | Op::ConvDgrad(i) | Op::ConvWgrad(i) => {
                let s = def.conv(i);
                format!("{}x{} {}->{}", s.kh, s.kw, s.c_in, s.c_out)
            }
            Op::BnFwd(i) | Op::BnBwd(i) => {
                format!(
                    "{} {}ch",
                    BlockDef::bn_fuse(i).describe(),
                    def.bn_channels(i)
                )
            }
            Op::FcFwd | Op::FcWgrad | Op::FcDgrad => {
                let p = def.fc_problem(self);
                format!("GEMM {}x{}x{}", p.m, p.n, p.k)
            }
            Op::AddDx => format!("add {}ch", def.c),
        }
    }

    /// Floating-point operations: `2·N·K·C·R·S·OH·OW` for every direction of a convolution,
    /// `2·m·n·k` for a GEMM, 0 for the memory-bound operations.
    pub fn flops(self, def: &BlockDef) -> f64 {
        match self.conv() {
            Some((i, _)) => {
                let s = def.conv(i);
                2.0 * (s.n * s.c_out * s.c_in * s.kh * s.kw * s.h * s.w) as f64
            }
            None if self.is_fc() => {
                let p = def.fc_problem(self);
                2.0 * (p.m * p.n * p.k) as f64
            }
            None => 0.0,
        }
    }

    /// Bytes the operation must at least move: every input read once, every output written
    /// once; a ReLU's backward state counted as its 1-bit mask (as `benches/batchnorm.rs`).
    pub fn bytes(self, def: &BlockDef) -> f64 {
        let es = def.dtype.size() as f64;
        match self {
            Op::ConvFwd(i) | Op::ConvDgrad(i) | Op::ConvWgrad(i) => {
                let s = def.conv(i);
                let y = s.n * s.c_out * s.h * s.w; // stride 1, "same" padding
                (s.x_len().unwrap_or(usize::MAX) + s.w_len().unwrap_or(usize::MAX) + y) as f64 * es
            }
            Op::BnFwd(i) => {
                let n = def.act_len(def.bn_channels(i)) as f64;
                let add = BlockDef::bn_fuse(i) == Fuse::AddRelu;
                (if add { 3.0 } else { 2.0 }) * n * es
            }
            Op::BnBwd(i) => {
                let n = def.act_len(def.bn_channels(i)) as f64;
                let add = BlockDef::bn_fuse(i) == Fuse::AddRelu;
                (if add { 4.0 } else { 3.0 }) * n * es + n / 8.0
            }
            Op::FcFwd | Op::FcWgrad | Op::FcDgrad => {
                let p = def.fc_problem(self);
                (p.m * p.k + p.k * p.n + p.m * p.n) as f64 * es
            }
            Op::AddDx => 3.0 * def.act_len(def.c) as f64 * es,
        }
    }

    /// The physical floor on an H100 in µs: FLOPs over the datasheet peak or bytes over the
    /// copy bandwidth, whichever is larger.
    pub fn floor_us(self, def: &BlockDef) -> f64 {
        let peak = if def.dtype == DType::F32 {
            PEAK_F32_TFLOPS
        } else {
            PEAK_HALF_TFLOPS
        };
        let compute = self.flops(def) / (peak * 1e12);
        let memory = self.bytes(def) / (COPY_TBPS * 1e12);
        compute.max(memory) * 1e6
    }
}

/// The index of a convolution direction in a `[forward, data, filter]` triple.
pub const fn direction_index(d: Direction) -> usize {
    match d {
        Direction::Forward => 0,
        Direction::BackwardData => 1,
        Direction::BackwardFilter => 2,
    }
}

/// FLOPs of one whole step.
pub fn step_flops(def: &BlockDef) -> f64 {
    STEP.iter().map(|op| op.flops(def)).sum()
}

/// The floor of one whole step (sum of the operations' floors), µs.
pub fn step_floor_us(def: &BlockDef) -> f64 {
    STEP.iter().map(|op| op.floor_us(def)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use nnfuse::reference::gemm::{gemm_strided_batched, GemmProblem};

    fn def() -> BlockDef {
        BlockDef::resnet50(32, DType::F16, TensorFormat::Nhwc)
    }

    #[test]
    fn the_block_is_resnet50s_bottleneck() {
        let d = def();
        let c: Vec<_> = (0..3).map(|i| d.conv(i)).collect();
        assert_eq!(
            (c[0].c_in, c[0].c_out, c[0].kh, c[0].pad),
            (256, 64, 1, (0, 0))
        );
        assert_eq!(
            (c[1].c_in, c[1].c_out, c[1].kh, c[1].pad),
            (64, 64, 3, (1, 1))
        );
        assert_eq!(
            (c[2].c_in, c[2].c_out, c[2].kh, c[2].pad),
            (64, 256, 1, (0, 0))
        );
        for s in &c {
            // Every convolution keeps 56x56: the activations chain.
            assert_eq!(s.out_hw().unwrap(), (56, 56));
        }
        assert_eq!(d.bn_shape(2), (vec![32, 56, 56, 256], 3));
        let nchw = BlockDef::resnet50(8, DType::F32, TensorFormat::Nchw);
        assert_eq!(nchw.bn_shape(0), (vec![8, 64, 56, 56], 1));
        assert_eq!(BlockDef::bn_fuse(2), Fuse::AddRelu);
        assert_eq!(BlockDef::bn_fuse(0), Fuse::Relu);
        assert_eq!(d.with_batch(2).conv(1).n, 2);
    }

    #[test]
    fn the_step_runs_every_op_once_forward_before_backward() {
        let names: Vec<String> = STEP.iter().map(|o| o.name()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), STEP.len(), "{names:?}");
        assert_eq!(names[0], "conv1.fwd");
        assert_eq!(names.last().unwrap(), "dx.add");
        let pos = |n: &str| names.iter().position(|x| x == n).unwrap();
        for i in 1..=3 {
            assert!(pos(&format!("conv{i}.fwd")) < pos(&format!("bn{i}.fwd")));
            assert!(pos(&format!("bn{i}.bwd")) < pos(&format!("conv{i}.dgrad")));
            assert!(pos(&format!("bn{i}.bwd")) < pos(&format!("conv{i}.wgrad")));
        }
        assert!(pos("bn3.fwd") < pos("bn3.bwd"));
        assert!(pos("conv1.dgrad") < pos("dx.add") && pos("bn3.bwd") < pos("dx.add"));
    }

    #[test]
    fn flops_and_floors() {
        let d = def();
        // 3x3 64->64 at 32x56x56: 2 * 32*56*56 * 64*64*9 FLOPs.
        assert_eq!(Op::ConvFwd(1).flops(&d), 2.0 * 100352.0 * 36864.0);
        assert_eq!(Op::ConvWgrad(1).flops(&d), Op::ConvFwd(1).flops(&d));
        assert_eq!(Op::FcFwd.flops(&d), 2.0 * 1000.0 * 32.0 * 2048.0);
        assert_eq!(Op::BnFwd(0).flops(&d), 0.0);
        // BN+Add+ReLU forward moves x, z and y: 3 * 32*56*56*256 halves.
        assert_eq!(Op::BnFwd(2).bytes(&d), 3.0 * 25_690_112.0 * 2.0);
        // Memory-bound floor: bytes / 3 TB/s.
        let f = Op::AddDx.floor_us(&d);
        assert!(
            (f - 3.0 * 25_690_112.0 * 2.0 / 3e12 * 1e6).abs() < 1e-9,
            "{f}"
        );
        // At batch 32 in f16 even the 3x3 convolution moves its bytes (8.6 us) more slowly than
        // the tensor cores do its FLOPs (7.5 us); in f32 it is compute-bound.
        let compute: f64 = 2.0 * 100352.0 * 36864.0 / 989.4e12 * 1e6;
        let memory = (2.0 * 100352.0 * 64.0 + 36864.0) * 2.0 / 3e12 * 1e6;
        let f = Op::ConvFwd(1).floor_us(&d);
        assert!(
            (f - compute.max(memory)).abs() < 1e-9,
            "{f} {compute} {memory}"
        );
        let d32 = BlockDef::resnet50(32, DType::F32, TensorFormat::Nchw);
        let f = Op::ConvFwd(1).floor_us(&d32);
        assert!(
            (f - 2.0 * 100352.0 * 36864.0 / 66.9e12 * 1e6).abs() < 1e-9,
            "{f}"
        );
        // Three directions of the three convolutions, three GEMMs of the classifier.
        let conv = 2.0 * 100352.0 * (256.0 * 64.0 + 64.0 * 64.0 * 9.0 + 64.0 * 256.0);
        assert_eq!(
            step_flops(&d),
            3.0 * conv + 3.0 * 2.0 * 1000.0 * 32.0 * 2048.0
        );
        assert!(step_floor_us(&d) > 0.0);
    }

    fn reference_problem(p: &Problem) -> GemmProblem {
        GemmProblem {
            trans_a: p.trans_a,
            trans_b: p.trans_b,
            m: p.m,
            n: p.n,
            k: p.k,
            lda: p.lda,
            ldb: p.ldb,
            ldc: p.ldc,
            stride_a: p.stride_a,
            stride_b: p.stride_b,
            stride_c: p.stride_c,
            batch: p.batch,
            alpha: p.alpha as f64,
            beta: p.beta as f64,
        }
    }

    /// The column-major problems compute the row-major classifier formulas.
    #[test]
    fn classifier_gemms_compute_the_row_major_formulas() {
        let mut d = def().with_batch(3);
        d.fc_in = 5;
        d.fc_out = 4;
        let v = |n: usize, seed: usize| -> Vec<f64> {
            (0..n)
                .map(|i| ((i * 7 + seed * 13) % 11) as f64 - 5.0)
                .collect()
        };
        let feat = v(d.n * d.fc_in, 1); // [n][fc_in]
        let w = v(d.fc_out * d.fc_in, 2); // [fc_out][fc_in]
        let dlog = v(d.n * d.fc_out, 3); // [n][fc_out]
        let mut logits = vec![0.0; d.n * d.fc_out];
        gemm_strided_batched(
            &reference_problem(&d.fc_problem(Op::FcFwd)),
            &w,
            &feat,
            &mut logits,
        )
        .unwrap();
        let mut dw = vec![0.0; d.fc_out * d.fc_in];
        gemm_strided_batched(
            &reference_problem(&d.fc_problem(Op::FcWgrad)),
            &feat,
            &dlog,
            &mut dw,
        )
        .unwrap();
        let mut dfeat = vec![0.0; d.n * d.fc_in];
        gemm_strided_batched(
            &reference_problem(&d.fc_problem(Op::FcDgrad)),
            &w,
            &dlog,
            &mut dfeat,
        )
        .unwrap();
        for b in 0..d.n {
            for o in 0..d.fc_out {
                let want: f64 = (0..d.fc_in)
                    .map(|i| feat[b * d.fc_in + i] * w[o * d.fc_in + i])
                    .sum();
                assert_eq!(logits[b * d.fc_out + o], want, "logits[{b}][{o}]");
            }
            for i in 0..d.fc_in {
                let want: f64 = (0..d.fc_out)
                    .map(|o| dlog[b * d.fc_out + o] * w[o * d.fc_in + i])
                    .sum();
                assert_eq!(dfeat[b * d.fc_in + i], want, "dfeat[{b}][{i}]");
            }
        }
        for o in 0..d.fc_out {
            for i in 0..d.fc_in {
                let want: f64 = (0..d.n)
                    .map(|b| dlog[b * d.fc_out + o] * feat[b * d.fc_in + i])
                    .sum();
                assert_eq!(dw[o * d.fc_in + i], want, "dw[{o}][{i}]");
            }
        }
    }
}
