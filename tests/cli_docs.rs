//! The user-facing documentation against the code: every configuration variable listed once
//! with every value it takes, and text that stands on its own (no references to work items or
//! work sessions). Needs no GPU.

mod common;

use common::nnfuse_binary as binary;
use std::process::Command;

use nnfuse::config::ALL_VARS;
use nnfuse::{BnImpl, ConvAlgoPolicy, WinogradGemmPolicy};

fn read(rel: &str) -> String {
    let path = format!("{}/{rel}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The rows of CONFIG.md's variable table whose first cell names `var`.
fn config_rows<'a>(doc: &'a str, var: &str) -> Vec<&'a str> {
    let needle = format!("`{var}`");
    doc.lines()
        .filter(|l| l.starts_with("| ") && l.split('|').nth(1).is_some_and(|c| c.contains(&needle)))
        .collect()
}

/// The backticked values of a row's second cell.
fn values(row: &str) -> Vec<&str> {
    let cell = row.split('|').nth(2).unwrap_or_default();
    cell.split('`').skip(1).step_by(2).collect()
}

#[test]
fn config_lists_every_variable_once_with_every_value() {
    let doc = read("docs/CONFIG.md");
    for var in ALL_VARS {
        let rows = config_rows(&doc, var);
        assert_eq!(rows.len(), 1, "{var} in docs/CONFIG.md: {rows:#?}");
    }
    let row = config_rows(&doc, "NNFUSE_WINOGRAD_GEMM")[0];
    let listed = values(row);
    for p in [
        WinogradGemmPolicy::Auto,
        WinogradGemmPolicy::Seed,
        WinogradGemmPolicy::TensorCore,
        WinogradGemmPolicy::Direct,
        WinogradGemmPolicy::Fused,
    ] {
        assert!(listed.contains(&p.name()), "{} missing: {row}", p.name());
    }
    for v in &listed {
        assert!(v.parse::<WinogradGemmPolicy>().is_ok(), "{v}");
    }
    for v in values(config_rows(&doc, "NNFUSE_BN_IMPL")[0]) {
        assert!(v.parse::<BnImpl>().is_ok(), "NNFUSE_BN_IMPL {v}");
    }
    for v in values(config_rows(&doc, "NNFUSE_CONV_ALGO")[0]) {
        assert!(v.parse::<ConvAlgoPolicy>().is_ok(), "NNFUSE_CONV_ALGO {v}");
    }
}

/// Words that point at the history of the work rather than say the thing: "the issue",
/// "issue 9", "session 2", "(run 3)". Identifiers in backticks (test names) and file names
/// (`...-session3-...log`) are not prose and do not match.
fn history_words(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let lower = prose.to_lowercase();
        let words: Vec<&str> = lower
            .split(|c: char| !(c.is_alphanumeric() || c == '\'' || c == '_' || c == '-'))
            .filter(|w| !w.is_empty())
            .collect();
        for (i, w) in words.iter().enumerate() {
            let next = words.get(i + 1).copied().unwrap_or_default();
            let numbered = next.chars().all(|c| c.is_ascii_digit()) && !next.is_empty();
            let hit = matches!(*w, "issue" | "issue's" | "issues" | "session" | "session's")
                || (*w == "run" && numbered && lower.contains(&format!("(run {next})")));
            if hit {
                found.push(format!("line {}: {line}", n + 1));
            }
        }
    }
    found
}

#[test]
fn user_facing_text_stands_on_its_own() {
    for doc in [
        "README.md",
        "docs/CONFIG.md",
        "docs/DEMO.md",
        "docs/PERFORMANCE.md",
        "docs/RELIABILITY.md",
    ] {
        let hits = history_words(&read(doc));
        assert!(hits.is_empty(), "{doc}:\n{}", hits.join("\n"));
    }
    for args in [
        &["--help"][..],
        &["info", "--help"],
        &["plan", "--help"],
        &["tune", "--help"],
        &["demo", "--help"],
        &["demo"],
    ] {
        let out = Command::new(binary())
            .args(args)
            .env("CUDA_VISIBLE_DEVICES", "")
            .output()
            .expect("the nnfuse binary runs");
        let text = String::from_utf8_lossy(&out.stdout);
        let hits = history_words(&text);
        assert!(hits.is_empty(), "nnfuse {args:?}:\n{}", hits.join("\n"));
    }
}

#[test]
fn the_history_check_sees_what_it_should() {
    assert_eq!(history_words("the issue's table").len(), 1);
    assert_eq!(history_words("## 2026-11-23 (session 3)").len(), 1);
    assert_eq!(history_words("kernels (run 3)").len(), 1);
    assert!(history_words("`perf/2026-11-23-h100-session3-demo.log`").is_empty());
    assert!(history_words("`default_configuration_on_the_issue_shapes`").is_empty());
    assert!(history_words("loads issued before their adds; run 3 times").is_empty());
}
