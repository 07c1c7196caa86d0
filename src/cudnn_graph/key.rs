//! The plain-data key of the graph plan cache: everything a plan depends on (problem, layout,
//! element type, direction, engine policy, pointer alignment). Pure; tested on the CPU.

use crate::conv::problem::GraphEngine;
use crate::conv::Direction;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reference::conv::Conv2d as ConvShape;

use super::layout::MAX_ALIGNMENT;
use super::notes::GraphPolicy;

/// One cached execution plan's identity (per Context: the device is implied).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphConvKey {
    /// The problem; its `format` gives every tensor's strides (packed NCHW/KCRS or NHWC/KRSC).
    pub shape: ConvShape,
    /// Element type of x, w and y.
    pub dtype: DType,
    /// Forward, data gradient or filter gradient.
    pub direction: Direction,
    /// Which engines may run (math, determinism, run-time compilation).
    pub policy: GraphPolicy,
    /// Byte alignment every data pointer is guaranteed to have (a power of two up to 16).
    pub alignment: u8,
    /// The engine config to run: `None` takes the first listed config the policy admits that
    /// finalizes; `Some` exactly that one (rebuilt from its index and knobs).
    pub engine: Option<GraphEngine>,
    /// Add to the output instead of overwriting it (`beta = 1`: the filter gradient of a
    /// weight shared by several layers, the data gradient of a tensor that also feeds a
    /// shortcut).
    pub accumulate: bool,
}

impl GraphConvKey {
    /// The key of `shape` for `dtype` and `direction` with the strict policy and 16-byte
    /// pointers (what every cudarc allocation gives).
    pub fn new(shape: ConvShape, dtype: DType, direction: Direction) -> GraphConvKey {
        GraphConvKey {
            shape,
            dtype,
            direction,
            policy: GraphPolicy::default(),
            alignment: MAX_ALIGNMENT,
            engine: None,
            accumulate: false,
        }
    }

    /// The same key for engine config `engine` (`None`: the first admitted one).
    pub fn with_engine(self, engine: Option<GraphEngine>) -> GraphConvKey {
        GraphConvKey { engine, ..self }
    }

    /// The same key adding to the output (`beta = 1`) or not.
    pub fn with_accumulate(self, accumulate: bool) -> GraphConvKey {
        GraphConvKey { accumulate, ..self }
    }

    /// The same key for pointers of alignment class `alignment` (see
    /// [`super::layout::alignment_of`]).
    pub fn with_alignment(self, alignment: u8) -> GraphConvKey {
        GraphConvKey { alignment, ..self }
    }

    /// The same key under `policy`.
    pub fn with_policy(self, policy: GraphPolicy) -> GraphConvKey {
        GraphConvKey { policy, ..self }
    }

    /// Checks the key before anything is built: a valid shape, and an alignment that is a
    /// power of two up to 16 and at least the element size.
    pub fn validate(&self) -> Result<()> {
        self.shape.y_len()?;
        let a = self.alignment;
        if !a.is_power_of_two() || a > MAX_ALIGNMENT || usize::from(a) < self.dtype.size() {
            return Err(Error::invalid(
                "alignment",
                format!(
                    "{a} bytes: must be a power of two from the element size ({}) to {MAX_ALIGNMENT}",
                    self.dtype.size()
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::TensorFormat;
    use std::collections::HashSet;

    fn shape() -> ConvShape {
        crate::testutil::square_nhwc(1, 8, 8, 8, 3)
    }

    #[test]
    fn every_field_separates_keys() {
        let base = GraphConvKey::new(shape(), DType::F16, Direction::Forward);
        let variants = [
            base,
            GraphConvKey {
                shape: ConvShape {
                    format: TensorFormat::Nchw,
                    ..shape()
                },
                ..base
            },
            GraphConvKey {
                dtype: DType::BF16,
                ..base
            },
            GraphConvKey {
                direction: Direction::BackwardData,
                ..base
            },
            base.with_policy(GraphPolicy {
                deterministic: true,
                ..GraphPolicy::default()
            }),
            base.with_policy(GraphPolicy {
                allow_tf32: true,
                ..GraphPolicy::default()
            }),
            base.with_alignment(8),
            base.with_engine(GraphEngine::new(45, &[])),
            base.with_engine(GraphEngine::new(45, &[(2, 1)])),
            base.with_accumulate(true),
        ];
        let set: HashSet<GraphConvKey> = variants.iter().copied().collect();
        assert_eq!(set.len(), variants.len());
        assert!(set.contains(&GraphConvKey::new(shape(), DType::F16, Direction::Forward)));
    }

    #[test]
    fn validation_names_the_field() {
        let k = GraphConvKey::new(shape(), DType::F32, Direction::Forward);
        assert!(k.validate().is_ok());
        assert_eq!(
            k.with_alignment(2).validate().unwrap_err().argument(),
            Some("alignment")
        );
        assert_eq!(
            k.with_alignment(32).validate().unwrap_err().argument(),
            Some("alignment")
        );
        let h = GraphConvKey::new(shape(), DType::F16, Direction::Forward);
        assert!(h.with_alignment(2).validate().is_ok());
        let mut bad = k;
        bad.shape.kh = 0;
        assert_eq!(bad.validate().unwrap_err().argument(), Some("kh"));
    }
}
