//! The graph check of `nnfuse demo --graph`: the raw bits of every output of a replayed CUDA
//! graph against an eager step on the same inputs (and of a second eager step against the
//! first, which tells an output that no run reproduces bit for bit from a graph that differs).
//! Pure: no GPU.

use half::{bf16, f16};
use nnfuse::DType;

use super::block::Op;
use super::reference::{compare, Compared};

/// Every output of one training step, in the order [`super::gpu::Buffers::for_each_output`]
/// visits them: (operation, quantity, element type is f32 rather than the step's). The labels
/// are the check's (`conv2.fwd y`, `bn3.bwd dgamma`, `dx.add dx (block input)`).
pub const OUTPUTS: [(Op, &str, bool); 31] = [
    (Op::ConvFwd(0), "y", false),
    (Op::ConvFwd(1), "y", false),
    (Op::ConvFwd(2), "y", false),
    (Op::BnFwd(0), "y", false),
    (Op::BnFwd(1), "y", false),
    (Op::BnFwd(2), "y", false),
    (Op::BnFwd(0), "running_mean", true),
    (Op::BnFwd(1), "running_mean", true),
    (Op::BnFwd(2), "running_mean", true),
    (Op::BnFwd(0), "running_var", true),
    (Op::BnFwd(1), "running_var", true),
    (Op::BnFwd(2), "running_var", true),
    (Op::BnBwd(0), "dx", false),
    (Op::BnBwd(1), "dx", false),
    (Op::BnBwd(2), "dx", false),
    (Op::BnBwd(0), "dgamma", true),
    (Op::BnBwd(1), "dgamma", true),
    (Op::BnBwd(2), "dgamma", true),
    (Op::BnBwd(0), "dbeta", true),
    (Op::BnBwd(1), "dbeta", true),
    (Op::BnBwd(2), "dbeta", true),
    (Op::ConvDgrad(1), "dx", false),
    (Op::ConvDgrad(2), "dx", false),
    (Op::ConvDgrad(0), "dx", false),
    (Op::AddDx, "dx (block input)", false),
    (Op::ConvWgrad(0), "dw", false),
    (Op::ConvWgrad(1), "dw", false),
    (Op::ConvWgrad(2), "dw", false),
    (Op::FcFwd, "logits", false),
    (Op::FcWgrad, "dw", false),
    (Op::FcDgrad, "dx", false),
];

/// Elements of `dtype` whose bytes differ between `a` and `b`, and the first of them.
/// Lengths that differ count every element of the longer one past the shorter as differing.
pub fn differing(a: &[u8], b: &[u8], dtype: DType) -> (usize, Option<usize>) {
    let size = dtype.size();
    let (mut n, mut first) = (0, None);
    let elems = a.len().max(b.len()).div_ceil(size);
    for e in 0..elems {
        let r = e * size..(e + 1) * size;
        if a.get(r.clone()) != b.get(r) {
            n += 1;
            first.get_or_insert(e);
        }
    }
    (n, first)
}

/// The values of raw little-endian `bytes` of `dtype`, widened to f64.
pub fn widen(bytes: &[u8], dtype: DType) -> Vec<f64> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
            .collect(),
    }
}

/// One output of the step: the replay against the first eager step.
#[derive(Debug, Clone)]
pub struct BitRow {
    /// The operation that wrote it.
    pub op: Op,
    /// Which of its outputs.
    pub quantity: &'static str,
    /// Its element type.
    pub dtype: DType,
    /// Elements.
    pub elements: usize,
    /// Elements whose bits differ between two eager steps on the same inputs (non-zero: the
    /// route this output comes from does not reproduce its bits, e.g. atomics in a reduction).
    pub eager_differs: usize,
    /// Elements whose bits differ between the replay and the first eager step.
    pub graph_differs: usize,
    /// The first of those.
    pub first_differing: Option<usize>,
    /// Where eager steps differ among themselves: the replay against the first eager step by
    /// relative L2 error (held to `tol`).
    pub compared: Option<Compared>,
    /// The tolerance of that comparison (the check's, for this output's type).
    pub tol: f64,
}

impl BitRow {
    /// Compares the raw bytes of one output: `eager` (first eager step), `again` (a second
    /// eager step on the same inputs), `graph` (the replay).
    pub fn of(
        (op, quantity, dtype): (Op, &'static str, DType),
        eager: &[u8],
        again: &[u8],
        graph: &[u8],
        tol: f64,
    ) -> BitRow {
        let (eager_differs, _) = differing(eager, again, dtype);
        let (graph_differs, first_differing) = differing(eager, graph, dtype);
        let compared = (eager_differs > 0 && graph_differs > 0)
            .then(|| compare(&widen(graph, dtype), &widen(eager, dtype)));
        BitRow {
            op,
            quantity,
            dtype,
            elements: eager.len() / dtype.size(),
            eager_differs,
            graph_differs,
            first_differing,
            compared,
            tol,
        }
    }

    /// Whether the replay matches: bit for bit, or — only where two eager steps differ among
    /// themselves — within the tolerance.
    pub fn ok(&self) -> bool {
        match &self.compared {
            _ if self.graph_differs == 0 => true,
            Some(c) if self.eager_differs > 0 => c.within(self.tol),
            _ => false,
        }
    }

    /// `identical`, `differs`, or `eager_not_reproducible` (compared within the tolerance).
    pub fn verdict(&self) -> &'static str {
        if self.graph_differs == 0 {
            "identical"
        } else if self.eager_differs > 0 {
            "eager_not_reproducible"
        } else {
            "differs"
        }
    }

    /// `bn2.bwd dgamma`.
    pub fn label(&self) -> String {
        format!("{} {}", self.op.name(), self.quantity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes16(v: &[f32]) -> Vec<u8> {
        v.iter()
            .flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes())
            .collect()
    }

    #[test]
    fn outputs_are_the_checks_31_distinct_ones() {
        let mut labels: Vec<String> = OUTPUTS
            .iter()
            .map(|(op, q, _)| format!("{} {q}", op.name()))
            .collect();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), 31);
    }

    #[test]
    fn bits_count_elements_not_bytes() {
        let a = bytes16(&[1.0, 2.0, 3.0]);
        let mut b = a.clone();
        b[3] ^= 1; // the second element's high byte
        assert_eq!(differing(&a, &b, DType::F16), (1, Some(1)));
        assert_eq!(differing(&a, &a, DType::F16), (0, None));
        // -0 and +0 are equal values but not equal bits.
        let z = bytes16(&[0.0]);
        let nz = bytes16(&[-0.0]);
        assert_eq!(differing(&z, &nz, DType::F16).0, 1);
        // A shorter buffer: every missing element differs.
        assert_eq!(differing(&a, &a[..2], DType::F16), (2, Some(1)));
    }

    #[test]
    fn widening_reads_each_type() {
        assert_eq!(widen(&bytes16(&[1.5, -2.0]), DType::F16), [1.5, -2.0]);
        assert_eq!(widen(&2.5f32.to_le_bytes(), DType::F32), [2.5]);
        let b = bf16::from_f32(3.0).to_bits().to_le_bytes();
        assert_eq!(widen(&b, DType::BF16), [3.0]);
    }

    #[test]
    fn a_replay_passes_only_bit_identical_unless_eager_itself_differs() {
        let id = (Op::ConvWgrad(1), "dw", DType::F16);
        let e = bytes16(&[1.0, 2.0, 3.0, 4.0]);
        let near = bytes16(&[1.0, 2.0, 3.0, 4.01]);
        let nan = bytes16(&[1.0, 2.0, f32::NAN, 4.0]);
        let same = BitRow::of(id, &e, &e, &e, 1e-2);
        assert!(same.ok() && same.verdict() == "identical");
        // Eager reproducible, the replay two ulps away in one element: fails.
        let off = BitRow::of(id, &e, &e, &near, 1e-2);
        assert!(!off.ok());
        assert_eq!(off.verdict(), "differs");
        assert_eq!((off.graph_differs, off.first_differing), (1, Some(3)));
        // Eager not reproducible: the replay is held to the tolerance instead.
        let loose = BitRow::of(id, &e, &near, &near, 1e-2);
        assert!(loose.ok(), "{loose:?}");
        assert_eq!(loose.verdict(), "eager_not_reproducible");
        // ... which a poisoned (NaN) element never meets.
        assert!(!BitRow::of(id, &e, &near, &nan, 1e-2).ok());
        assert_eq!(same.elements, 4);
        assert_eq!(same.label(), "conv2.wgrad dw");
    }
}
