//! The plan of every layer of the block under one variant's configuration, without a GPU: the
//! convolution plans of all three directions (`nnfuse::conv::plan`), the BatchNorm training
//! plans (`nnfuse::batchnorm::plan`), as `nnfuse plan` would print them one by one, and for
//! nnfuse the training units' plans (`nnfuse::block::plan_train`).

use nnfuse::batchnorm::{self, BnPlan, Phase, PlanRequest};
use nnfuse::block::{plan_train, TrainPlan, TrainPlanRequest, TrainRoute};
use nnfuse::conv::{self, ConvPlan, ConvPlanRequest, Direction};
use nnfuse::Config;
use serde_json::{json, Value};

use super::block::BlockDef;
use super::variants::Variant;

/// Every layer's plan for one variant.
#[derive(Debug, Clone)]
pub struct BlockPlans {
    /// The variant.
    pub variant: Variant,
    /// The configuration it plans with.
    pub config: Config,
    /// Per convolution: forward, data gradient, filter gradient.
    pub convs: Vec<[ConvPlan; 3]>,
    /// Per BatchNorm: the training plan.
    pub bns: Vec<BnPlan>,
    /// Per conv → BN unit (nnfuse only; empty for the plain compositions): its routes.
    pub units: Vec<TrainPlan>,
}

/// Plans the block. `cudnn_present` and `cudnn_version` are what the machine has (or what is
/// assumed without cuDNN, as `nnfuse plan` does).
pub fn plan_block(
    def: &BlockDef,
    variant: Variant,
    base: &Config,
    cudnn_present: bool,
    cudnn_version: usize,
) -> nnfuse::Result<BlockPlans> {
    let config = variant.config(base);
    let mut convs = Vec::new();
    for i in 0..3 {
        let one = |direction| {
            conv::plan(&ConvPlanRequest {
                shape: def.conv(i),
                dtype: def.dtype,
                direction,
                config: &config,
                cudnn_present,
                cudnn_graph: cudnn_present && cudnn_version >= 90000,
            })
        };
        convs.push([
            one(Direction::Forward)?,
            one(Direction::BackwardData)?,
            one(Direction::BackwardFilter)?,
        ]);
    }
    let mut bns = Vec::new();
    for i in 0..3 {
        let (shape, axis) = def.bn_shape(i);
        bns.push(batchnorm::plan(&PlanRequest {
            shape: &shape,
            axis,
            dtype: def.dtype,
            fuse: variant.fuse(i),
            phase: Phase::Training,
            config: &config,
            cudnn_version,
            cudnn_available: cudnn_present,
            own_variant: batchnorm::OwnVariantChoice::Auto,
        })?);
    }
    let mut units = Vec::new();
    if variant == Variant::Nnfuse {
        for i in 0..3 {
            units.push(plan_train(&TrainPlanRequest {
                shape: &def.conv(i),
                dtype: def.dtype,
                fuse: BlockDef::bn_fuse(i),
                config: &config,
                cudnn: cudnn_present.then_some(cudnn_version),
            })?);
        }
    }
    Ok(BlockPlans {
        variant,
        config,
        convs,
        bns,
        units,
    })
}

/// One line for a unit's plan: the fused route's eligibility and why.
pub fn unit_line(p: &TrainPlan) -> String {
    let r = TrainRoute::Fused;
    if p.eligible(r) {
        "fused route eligible: measured against conv then BN (forward + BN backward) at the \
         first step"
            .to_string()
    } else {
        format!("fused route refused: {}; conv then BN", p.reason(r))
    }
}

/// One line for a convolution plan: the path, or what `auto` measures at the first call.
pub fn conv_line(p: &ConvPlan) -> String {
    let mut s = if !p.runnable {
        format!("NOT RUNNABLE here: {}", p.reasons.join("; "))
    } else if p.measured {
        format!(
            "measured at the first call among {} (incumbent {})",
            p.candidates
                .iter()
                .map(|r| r.label())
                .collect::<Vec<_>>()
                .join(", "),
            p.route()
        )
    } else {
        match p.engine {
            Some(e) => format!("{} ({} engine)", p.path, e.name()),
            None => p.path.to_string(),
        }
    };
    if let Some(f) = &p.fallback {
        s.push_str(&format!("; fell back: {f}"));
    }
    s
}

/// One line for a BatchNorm plan: layout, mode, API, path and the refusals of the fused path.
pub fn bn_line(p: &BnPlan) -> String {
    let mut s = format!(
        "{} {} via the {} API, path {}",
        p.layout.format.name().to_ascii_uppercase(),
        p.mode.cudnn_name(),
        p.api,
        p.path
    );
    let refused: Vec<&str> = p
        .refusals
        .iter()
        .map(|r| r.code())
        .filter(|c| *c != "no_activation")
        .collect();
    if !refused.is_empty() {
        s.push_str(&format!(" (fusion refused: {})", refused.join(", ")));
    }
    s
}

impl BlockPlans {
    /// Every plan as JSON (`conv1: {forward, backward_data, backward_filter}`, `bn1`, ...).
    pub fn to_json(&self) -> Value {
        let mut layers = serde_json::Map::new();
        for (i, c) in self.convs.iter().enumerate() {
            layers.insert(
                format!("conv{}", i + 1),
                json!({
                    "forward": c[0].to_json(),
                    "backward_data": c[1].to_json(),
                    "backward_filter": c[2].to_json(),
                }),
            );
        }
        for (i, b) in self.bns.iter().enumerate() {
            layers.insert(format!("bn{}", i + 1), b.to_json());
        }
        for (i, u) in self.units.iter().enumerate() {
            let routes: serde_json::Map<String, Value> = TrainRoute::ALL
                .iter()
                .map(|&r| {
                    let v = json!({"eligible": u.eligible(r), "reason": u.reason(r)});
                    (r.name().to_string(), v)
                })
                .collect();
            layers.insert(format!("unit{}", i + 1), Value::Object(routes));
        }
        json!({
            "variant": self.variant.name(),
            "describe": self.variant.describe(),
            "conv_policy": self.config.conv_algo.name(),
            "winograd_gemm": self.config.winograd_gemm.name(),
            "bn_mode_policy": self.config.bn_mode_policy.name(),
            "enable_nhwc": self.config.enable_nhwc,
            "cudnn_fusion": !self.config.disable_cudnn_fusion,
            "gemm_search": self.config.gemm_search,
            "layers": Value::Object(layers),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nnfuse::batchnorm::ASSUMED_CUDNN_VERSION;
    use nnfuse::{DType, TensorFormat};

    #[test]
    fn every_layer_is_planned_without_a_gpu() {
        let def = BlockDef::resnet50(32, DType::F16, TensorFormat::Nhwc);
        for present in [true, false] {
            for v in Variant::ALL {
                let p = plan_block(&def, v, &Config::default(), present, ASSUMED_CUDNN_VERSION)
                    .unwrap();
                assert_eq!(p.convs.len(), 3);
                assert_eq!(p.bns.len(), 3);
                // Units only where they run (nnfuse), each with both routes in the JSON.
                assert_eq!(p.units.len(), if v == Variant::Nnfuse { 3 } else { 0 });
                for (i, u) in p.units.iter().enumerate() {
                    assert!(u.eligible(TrainRoute::Unfused));
                    assert!(!unit_line(u).is_empty());
                    let j = p.to_json();
                    let unit = &j["layers"][format!("unit{}", i + 1)];
                    assert!(unit["fused"]["eligible"].is_boolean(), "{unit}");
                    assert!(unit["unfused"]["reason"].is_string(), "{unit}");
                }
                for c in &p.convs {
                    for (d, plan) in Direction::ALL.iter().zip(c) {
                        assert_eq!(plan.direction, *d);
                        assert!(plan.runnable, "{v:?} {present}: {plan}");
                        assert!(!conv_line(plan).is_empty());
                    }
                }
                let j = p.to_json();
                assert_eq!(j["variant"], v.name());
                assert!(j["layers"]["conv2"]["backward_filter"]["path"].is_string());
                assert!(j["layers"]["bn3"]["mode"].is_string());
            }
        }
        let p = plan_block(
            &def,
            Variant::Nnfuse,
            &Config::default(),
            true,
            ASSUMED_CUDNN_VERSION,
        )
        .unwrap();
        assert!(
            bn_line(&p.bns[2]).contains("cudnn_fused"),
            "{}",
            bn_line(&p.bns[2])
        );
        let s = plan_block(
            &def,
            Variant::CudnnSpatial,
            &Config::default(),
            true,
            ASSUMED_CUDNN_VERSION,
        )
        .unwrap();
        assert!(bn_line(&s.bns[0]).contains("CUDNN_BATCHNORM_SPATIAL via the legacy API"));
        // Under the cudnn policy with cuDNN present, the plan is cuDNN's.
        assert_eq!(conv_line(&s.convs[1][0]), "cudnn");
    }
}
