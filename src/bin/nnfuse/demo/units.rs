//! nnfuse's training units: conv `i` and BatchNorm `i` as one `nnfuse::block::ConvBnTrain`
//! (fused: the convolution writes its output's per-channel sums, then the BatchNorm finalizes
//! its statistics from them and normalises in one pass, on nnfuse's own kernels; or unfused:
//! the layer's conv then its BatchNorm). The unit decides its route on its first forward
//! (timing forward plus the BatchNorm's backward of both routes, after checking the fused one);
//! this file builds the units and says in words how each was decided.

use nnfuse::block::{ConvBnTrain, TrainChoice, TrainRoute};
use nnfuse::{Context, Element};

use super::block::BlockDef;
use super::variants::Variant;

/// A unit as a Layers holds it: built, or why not.
pub type Unit<T> = std::result::Result<ConvBnTrain<T>, String>;

/// The three units of `variant`'s layers: built for nnfuse, refused for the plain
/// compositions (which run no fusion at all).
pub fn build<T: Element>(ctx: &Context, def: &BlockDef, variant: Variant) -> [Unit<T>; 3] {
    if variant != Variant::Nnfuse {
        return [0, 1, 2].map(|_| Err("a plain composition: no fused units".to_string()));
    }
    [0, 1, 2].map(|i| {
        ConvBnTrain::<T>::new(ctx, &def.conv(i), BlockDef::bn_fuse(i))
            .map_err(|e| format!("ConvBnTrain: {e}"))
    })
}

/// One sentence for the report's "why" of unit `i`: which composition runs and the times.
pub fn describe(c: &TrainChoice, i: usize) -> String {
    let n = i + 1;
    let verdict = match c.route {
        TrainRoute::Fused => {
            format!("fused unit taken (conv{n}+stats, then bn{n} from the sums)")
        }
        TrainRoute::Unfused => format!("fused unit not taken (conv{n} then bn{n} as decided)"),
    };
    format!("{verdict}: {}", c.describe())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_names_the_unit_and_the_route() {
        let c = TrainChoice {
            route: TrainRoute::Fused,
            times_us: vec![(TrainRoute::Unfused, 263.0), (TrainRoute::Fused, 229.5)],
            stats: None,
            notes: Vec::new(),
            provisional: false,
        };
        let t = describe(&c, 2);
        assert!(t.starts_with("fused unit taken (conv3+stats"), "{t}");
        assert!(t.contains("unfused 263.0 us, fused 229.5 us"), "{t}");
        let n = TrainChoice {
            route: TrainRoute::Unfused,
            times_us: Vec::new(),
            stats: None,
            notes: vec!["fused: refused by the plan: NCHW".into()],
            provisional: true,
        };
        let t = describe(&n, 0);
        assert!(t.starts_with("fused unit not taken (conv1 then bn1"), "{t}");
        assert!(t.contains("refused by the plan: NCHW"), "{t}");
        assert!(t.ends_with("(provisional)"), "{t}");
    }
}
