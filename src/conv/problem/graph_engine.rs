//! [`GraphEngine`]: one engine configuration of cuDNN's graph API — the engine's global index
//! and its knob choices — as a plain value that a route carries, a plan cache keys on and the
//! tuning file stores (never a heuristics rank, which changes between cuDNN versions).

use std::fmt;

/// Most knob choices a [`GraphEngine`] holds (one per knob type an engine has; cuDNN 9 knows
/// 37 to 44 types, an engine uses a few); a config with more is not a candidate, said where it
/// is listed.
pub const MAX_GRAPH_KNOBS: usize = 16;

/// One cuDNN graph engine configuration: `CUDNN_ATTR_ENGINE_GLOBAL_INDEX` and its knob choices
/// `(cudnnBackendKnobType_t value, value)`, sorted by knob type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphEngine {
    index: i64,
    count: u8,
    /// Unused slots are `(0, 0)`, so that equality and hashing see only the used ones.
    knobs: [(u32, i64); MAX_GRAPH_KNOBS],
}

impl GraphEngine {
    /// Engine `index` with knob choices `knobs` (any order; sorted here). `None` when there are
    /// more than 8 or a knob type repeats.
    pub fn new(index: i64, knobs: &[(u32, i64)]) -> Option<GraphEngine> {
        if knobs.len() > MAX_GRAPH_KNOBS {
            return None;
        }
        let mut k = [(0u32, 0i64); MAX_GRAPH_KNOBS];
        k[..knobs.len()].copy_from_slice(knobs);
        k[..knobs.len()].sort_unstable();
        if k[..knobs.len()].windows(2).any(|w| w[0].0 == w[1].0) {
            return None;
        }
        Some(GraphEngine {
            index,
            count: knobs.len() as u8,
            knobs: k,
        })
    }

    /// `CUDNN_ATTR_ENGINE_GLOBAL_INDEX`.
    pub const fn index(&self) -> i64 {
        self.index
    }

    /// The knob choices, sorted by knob type.
    pub fn knobs(&self) -> &[(u32, i64)] {
        &self.knobs[..usize::from(self.count)]
    }

    /// `eng45{}`, `eng12{k2=1,k5=0}`: the label of [`GraphEngine::parse`] and the tuning file.
    pub fn label(&self) -> String {
        let knobs: Vec<String> = self
            .knobs()
            .iter()
            .map(|(t, v)| format!("k{t}={v}"))
            .collect();
        format!("eng{}{{{}}}", self.index, knobs.join(","))
    }

    /// Parses [`GraphEngine::label`]; `None` when it is not one.
    pub fn parse(s: &str) -> Option<GraphEngine> {
        let rest = s.trim().strip_prefix("eng")?;
        let (index, rest) = rest.split_once('{')?;
        let inner = rest.strip_suffix('}')?;
        let index: i64 = index.parse().ok()?;
        let mut knobs = Vec::new();
        for part in inner.split(',').filter(|p| !p.is_empty()) {
            let (t, v) = part.strip_prefix('k')?.split_once('=')?;
            knobs.push((t.parse().ok()?, v.parse().ok()?));
        }
        GraphEngine::new(index, &knobs)
    }
}

impl fmt::Display for GraphEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_round_trip_and_knobs_are_sorted() {
        let e = GraphEngine::new(12, &[(5, 0), (2, -1)]).unwrap();
        assert_eq!(e.knobs(), &[(2, -1), (5, 0)]);
        assert_eq!(e.label(), "eng12{k2=-1,k5=0}");
        assert_eq!(GraphEngine::parse(&e.label()), Some(e));
        let plain = GraphEngine::new(45, &[]).unwrap();
        assert_eq!(plain.label(), "eng45{}");
        assert_eq!(GraphEngine::parse("eng45{}"), Some(plain));
        assert_ne!(plain, GraphEngine::new(45, &[(0, 0)]).unwrap());
        for bad in [
            "",
            "eng",
            "eng{}",
            "engx{}",
            "eng1{k2}",
            "eng1{k2=1",
            "45{}",
            "eng1{k1=1,k1=2}",
        ] {
            assert_eq!(GraphEngine::parse(bad), None, "{bad}");
        }
        assert!(GraphEngine::new(1, &[(0, 0); MAX_GRAPH_KNOBS + 1]).is_none());
    }
}
