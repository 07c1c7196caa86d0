//! `nnfuse demo --profile-host`: where nnfuse's host time per step goes, by the library's stages
//! (`nnfuse::internals::profile`) and by operation — the structure the GPU pass fills, and its
//! text table and JSON. Pure: no GPU.

use nnfuse::internals::profile::{Stage, Totals, STAGES};
use nnfuse::internals::timing::Timing;
use serde_json::{json, Map, Value};

use super::block::STEP;
use super::report::table;

/// One operation of the step over the profiled steps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OpProfile {
    /// Wall time of the operation's host call, one sample per profiled step (ms).
    pub wall_ms: Vec<f64>,
    /// The library's stage totals of the call, summed over the profiled steps.
    pub stages: Totals,
}

/// nnfuse's step queued `steps` times with the stage profiler on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HostProfile {
    /// Per operation of [`STEP`], in order.
    pub ops: Vec<OpProfile>,
    /// Profiled steps whose queueing outlasted the head start (the GPU went idle before the
    /// step was queued): their calls may have waited for the GPU.
    pub gpu_went_idle: usize,
}

/// `a += b`, stage by stage.
pub fn add_totals(a: &mut Totals, b: &Totals) {
    for i in 0..STAGES {
        a.ns[i] += b.ns[i];
        a.entries[i] += b.entries[i];
    }
}

impl HostProfile {
    /// An empty profile of the step's operations.
    pub fn new() -> Self {
        HostProfile {
            ops: vec![OpProfile::default(); STEP.len()],
            gpu_went_idle: 0,
        }
    }

    /// Profiled steps (the fewest samples of any operation).
    pub fn steps(&self) -> usize {
        self.ops.iter().map(|o| o.wall_ms.len()).min().unwrap_or(0)
    }

    /// Host time of each profiled step (ms): its operations' wall times summed.
    pub fn step_ms(&self) -> Vec<f64> {
        (0..self.steps())
            .map(|s| self.ops.iter().map(|o| o.wall_ms[s]).sum())
            .collect()
    }

    /// Every operation's stage totals summed (over the step's operations and the steps).
    pub fn totals(&self) -> Totals {
        let mut t = Totals::default();
        for o in &self.ops {
            add_totals(&mut t, &o.stages);
        }
        t
    }

    /// µs per step: `ns` summed over the steps, divided by the steps.
    fn per_step_us(&self, ns: u64) -> f64 {
        ns as f64 * 1e-3 / self.steps().max(1) as f64
    }

    /// Mean host time (µs per step) of operation `k`'s call.
    fn op_mean_us(&self, k: usize) -> f64 {
        let w = &self.ops[k].wall_ms;
        1e3 * w.iter().sum::<f64>() / w.len().max(1) as f64
    }

    /// µs per step of the step's calls outside every stage of operation `k` (the demo's call,
    /// library code no stage covers, part of the profiler's own clock reads): its wall time
    /// less its stages. Can be slightly negative: the wall and the stages are separate clocks.
    fn op_other_us(&self, k: usize) -> f64 {
        self.op_mean_us(k) - self.per_step_us(self.ops[k].stages.total_ns())
    }

    /// The table and the lines around it; empty when nothing was profiled.
    pub fn to_text(&self, unprofiled_busy_ms: Option<f64>) -> String {
        let steps = self.steps();
        if steps == 0 {
            return String::new();
        }
        let mut s = format!(
            "\nhost profile (--profile-host): nnfuse's step queued {steps} more times while the \
             GPU is busy (behind a head start), the library's stage profiler on; µs per step, \
             mean over the steps (each operation's call timed around it; other = its time \
             outside every stage: the demo's call, library code no stage covers):\n"
        );
        let mut header = vec!["op", "host us"];
        header.extend(Stage::ALL.iter().map(|s| s.name()));
        header.push("other");
        let row = |name: String, wall: f64, t: &Totals, other: f64| {
            let mut r = vec![name, format!("{wall:.1}")];
            r.extend(
                Stage::ALL
                    .iter()
                    .map(|&st| format!("{:.1}", self.per_step_us(t.ns_of(st)))),
            );
            r.push(format!("{other:.1}"));
            r
        };
        let mut rows: Vec<Vec<String>> = STEP
            .iter()
            .enumerate()
            .map(|(k, op)| {
                row(
                    op.name(),
                    self.op_mean_us(k),
                    &self.ops[k].stages,
                    self.op_other_us(k),
                )
            })
            .collect();
        let total = self.totals();
        let wall: f64 = (0..STEP.len()).map(|k| self.op_mean_us(k)).sum();
        let other: f64 = (0..STEP.len()).map(|k| self.op_other_us(k)).sum();
        rows.push(row("step".into(), wall, &total, other));
        let mut right = vec![true; header.len()];
        right[0] = false;
        s.push_str(&table(&header, &rows, &right));
        let entries: Vec<String> = Stage::ALL
            .iter()
            .map(|&st| {
                format!(
                    "{} {}",
                    st.name(),
                    fmt_count(total.entries_of(st) as f64 / steps as f64)
                )
            })
            .collect();
        s.push_str(&format!("stage entries per step: {}\n", entries.join(", ")));
        if let Some(t) = Timing::from_samples(self.step_ms()) {
            s.push_str(&format!(
                "profiled step: {:.1} µs median (p10 {:.1}, p90 {:.1}; the profiler's own clock \
                 reads included){}\n",
                t.median_ms * 1e3,
                t.p10_ms * 1e3,
                t.p90_ms * 1e3,
                unprofiled_busy_ms.map_or(String::new(), |u| format!(
                    "; unprofiled, while the GPU is busy: {:.1} µs",
                    u * 1e3
                ))
            ));
        }
        if self.gpu_went_idle > 0 {
            s.push_str(&format!(
                "note: in {} of {steps} profiled steps the GPU finished the head start before \
                 the step was queued (a call may have waited for the GPU)\n",
                self.gpu_went_idle
            ));
        }
        s
    }

    /// The JSON field `host_profile`.
    pub fn to_json(&self) -> Value {
        let steps = self.steps();
        let stages = |t: &Totals| -> Value {
            let m: Map<String, Value> = Stage::ALL
                .iter()
                .map(|&st| {
                    (
                        st.name().to_string(),
                        json!({
                            "us_per_step": self.per_step_us(t.ns_of(st)),
                            "entries_per_step": t.entries_of(st) as f64 / steps.max(1) as f64,
                        }),
                    )
                })
                .collect();
            Value::Object(m)
        };
        let ops: Vec<Value> = STEP
            .iter()
            .enumerate()
            .map(|(k, op)| {
                let t = Timing::from_samples(self.ops[k].wall_ms.clone());
                json!({
                    "op": op.name(),
                    "host_us": self.op_mean_us(k),
                    "host_median_us": t.map(|t| t.median_ms * 1e3),
                    "stages": stages(&self.ops[k].stages),
                    "stages_us": self.per_step_us(self.ops[k].stages.total_ns()),
                    "other_us": self.op_other_us(k),
                })
            })
            .collect();
        let total = self.totals();
        let step = Timing::from_samples(self.step_ms());
        json!({
            "steps": steps,
            "gpu_went_idle": self.gpu_went_idle,
            "step_mean_us": (0..STEP.len()).map(|k| self.op_mean_us(k)).sum::<f64>(),
            "step_median_us": step.map(|t| t.median_ms * 1e3),
            "step_p10_us": step.map(|t| t.p10_ms * 1e3),
            "step_p90_us": step.map(|t| t.p90_ms * 1e3),
            "stages_us": self.per_step_us(total.total_ns()),
            "other_us": (0..STEP.len()).map(|k| self.op_other_us(k)).sum::<f64>(),
            "stages": stages(&total),
            "ops": ops,
        })
    }
}

/// A count per step: whole numbers without decimals.
fn fmt_count(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two steps; operation `k` takes `10 + k` µs of wall time, of which 4 µs vendor and 2 µs
    /// validate (one entry each per step).
    fn profile() -> HostProfile {
        let mut p = HostProfile::new();
        for (k, o) in p.ops.iter_mut().enumerate() {
            for _ in 0..2 {
                o.wall_ms.push((10.0 + k as f64) * 1e-3);
                let mut t = Totals::default();
                t.ns[Stage::ALL.iter().position(|&s| s == Stage::Vendor).unwrap()] = 4_000;
                t.entries[Stage::ALL.iter().position(|&s| s == Stage::Vendor).unwrap()] = 1;
                t.ns[Stage::ALL
                    .iter()
                    .position(|&s| s == Stage::Validate)
                    .unwrap()] = 2_000;
                t.entries[Stage::ALL
                    .iter()
                    .position(|&s| s == Stage::Validate)
                    .unwrap()] = 1;
                add_totals(&mut o.stages, &t);
            }
        }
        p
    }

    #[test]
    fn stages_and_operations_add_up_per_step() {
        let p = profile();
        let n = STEP.len() as f64;
        assert_eq!(p.steps(), 2);
        let wall = 10.0 * n + n * (n - 1.0) / 2.0;
        for s in p.step_ms() {
            assert!((s * 1e3 - wall).abs() < 1e-9, "{s}");
        }
        let j = p.to_json();
        assert_eq!(j["steps"], 2);
        assert!((j["step_mean_us"].as_f64().unwrap() - wall).abs() < 1e-9);
        assert!((j["stages_us"].as_f64().unwrap() - 6.0 * n).abs() < 1e-9);
        assert!((j["other_us"].as_f64().unwrap() - (wall - 6.0 * n)).abs() < 1e-9);
        assert!((j["stages"]["vendor"]["us_per_step"].as_f64().unwrap() - 4.0 * n).abs() < 1e-9);
        assert!((j["stages"]["vendor"]["entries_per_step"].as_f64().unwrap() - n).abs() < 1e-9);
        assert_eq!(j["stages"]["launch"]["us_per_step"].as_f64().unwrap(), 0.0);
        let ops = j["ops"].as_array().unwrap();
        assert_eq!(ops.len(), STEP.len());
        assert_eq!(ops[0]["op"], "conv1.fwd");
        assert!((ops[3]["host_us"].as_f64().unwrap() - 13.0).abs() < 1e-9);
        assert!((ops[3]["host_median_us"].as_f64().unwrap() - 13.0).abs() < 1e-9);
        assert!((ops[3]["other_us"].as_f64().unwrap() - 7.0).abs() < 1e-9);
        assert!(
            (ops[3]["stages"]["validate"]["us_per_step"]
                .as_f64()
                .unwrap()
                - 2.0)
                .abs()
                < 1e-9
        );
    }

    #[test]
    fn the_table_has_a_row_per_operation_and_the_step() {
        let mut p = profile();
        let text = p.to_text(Some(0.2));
        assert!(text.contains("host profile (--profile-host)"), "{text}");
        let header = text.lines().nth(2).unwrap();
        for st in Stage::ALL {
            assert!(header.contains(st.name()), "{header}");
        }
        assert!(header.trim_start().starts_with("op"), "{header}");
        assert!(header.trim_end().ends_with("other"), "{header}");
        let step = text
            .lines()
            .find(|l| l.trim_start().starts_with("step "))
            .unwrap();
        // conv1.fwd .. dx.add: 19 rows of 10..28 µs, 4 vendor and 2 validate each.
        assert!(step.contains("361.0"), "{step}");
        assert!(step.contains("76.0"), "{step}");
        assert!(step.contains("38.0"), "{step}");
        assert!(
            text.contains("stage entries per step: call 0, validate 19,"),
            "{text}"
        );
        assert!(
            text.contains("unprofiled, while the GPU is busy: 200.0 µs"),
            "{text}"
        );
        assert!(!text.contains("note:"), "{text}");
        p.gpu_went_idle = 1;
        assert!(p.to_text(None).contains("note: in 1 of 2 profiled steps"));
        assert!(HostProfile::new().to_text(None).is_empty());
    }
}
