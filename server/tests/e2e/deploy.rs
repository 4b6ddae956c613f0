//! deploy/: the offline checks (scripts/check-deploy.sh), the CPU container image built from
//! deploy/Dockerfile and run (scripts/container-test.sh), and every metric the Grafana
//! dashboard, the alert rules and the autoscalers query exists on a live server's /metrics.

use crate::harness::{shared, Server};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn deploy_files_pass_offline_checks() {
    let out = Command::new(root().join("scripts/check-deploy.sh")).stdin(Stdio::null()).output().expect("running scripts/check-deploy.sh");
    assert!(
        out.status.success(),
        "scripts/check-deploy.sh failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// deploy/Dockerfile's runtime stage, built by buildah around the binary these tests run (the
/// base image debootstrapped from Debian's mirror, no registry), serves a completion as the
/// image's non-root user and stops on SIGTERM; its greedy answer is the one the same binary
/// gives outside the image.
#[tokio::test]
async fn the_container_image_serves_a_completion() {
    let out = Command::new(root().join("scripts/container-test.sh"))
        .arg(env!("CARGO_BIN_EXE_tessera"))
        .stdin(Stdio::null())
        .output()
        .expect("running scripts/container-test.sh");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "scripts/container-test.sh failed:\n{stdout}{stderr}");
    let r: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(r["user"], "10001:10001", "{r}");
    assert_eq!((r["uid"].as_u64(), r["gid"].as_u64()), (Some(10001), Some(10001)), "the server runs as the image's user: {r}");
    assert_eq!(r["exit"], 0, "{r}");
    let completion = &r["completion"];
    assert_eq!(completion["model"], "SmolLM2-135M-Instruct.Q4_1", "the image serves its model: {r}");
    assert_eq!(completion["usage"]["completion_tokens"], 8, "{r}");
    let outside = Server::start(&[]).complete(r["request"].clone()).await;
    assert_eq!(completion["choices"][0]["text"], outside["choices"][0]["text"], "{r}\n{outside}");
}

/// PromQL's aggregation operators and keywords (never metric names).
const KEYWORDS: &[&str] = &[
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group", "by", "without",
    "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
];

/// The metric names a PromQL expression selects: identifiers that are not functions (followed
/// by `(`), keywords, label lists (after `by`, `on`, ...), label matchers (`{...}`), ranges
/// (`[...]`), strings or Grafana variables.
fn metric_names(expr: &str) -> Vec<String> {
    let mut cleaned = String::new();
    let mut depth_brace = 0;
    let mut depth_bracket = 0;
    let mut in_string = false;
    for c in expr.chars() {
        match c {
            '"' if depth_brace == 0 => in_string = !in_string,
            _ if in_string => {}
            '{' => depth_brace += 1,
            '}' => depth_brace -= 1,
            '[' => depth_bracket += 1,
            ']' => depth_bracket -= 1,
            _ if depth_brace > 0 || depth_bracket > 0 => {}
            _ => cleaned.push(c),
        }
        if matches!(c, '}' | ']') {
            cleaned.push(' ');
        }
    }
    // Tokens: identifiers (with `$` for Grafana variables), and single punctuation.
    let mut tokens: Vec<String> = Vec::new();
    let mut cur = String::new();
    for c in cleaned.chars() {
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' || c == '$' || c == '.' {
            cur.push(c);
        } else {
            if !cur.is_empty() {
                tokens.push(std::mem::take(&mut cur));
            }
            if !c.is_whitespace() {
                tokens.push(c.to_string());
            }
        }
    }
    if !cur.is_empty() {
        tokens.push(cur);
    }
    let mut names = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let t = &tokens[i];
        let next = tokens.get(i + 1).map(String::as_str);
        if ["by", "without", "on", "ignoring", "group_left", "group_right"].contains(&t.as_str()) && next == Some("(") {
            // Skip the label list.
            while i < tokens.len() && tokens[i] != ")" {
                i += 1;
            }
        } else if (t.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_' || c == ':'))
            && next != Some("(")
            && !KEYWORDS.contains(&t.as_str())
        {
            names.push(t.clone());
        }
        i += 1;
    }
    names
}

#[test]
fn promql_metric_names_are_extracted() {
    assert_eq!(
        metric_names(r#"histogram_quantile(0.9, sum by (le, instance) (rate(a_bucket{x=~"$i", y="}"}[$__rate_interval]))) > 2"#),
        ["a_bucket"]
    );
    assert_eq!(
        metric_names("max by (k) (b{i=~\"$i\"} * on (instance) group_left (k) c_info) / sum(rate(vllm:d_total[5m]))"),
        ["b", "c_info", "vllm:d_total"]
    );
    assert_eq!(metric_names("absent(up) or sum without (job) (e) > bool 1"), ["up", "e"]);
}

/// Every `expr:` in the alert rules (plain or a folded `>-` block).
fn rule_exprs(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(at) = line.find("expr: ") else { continue };
        let value = line[at + 6..].trim();
        if value.starts_with('>') || value.starts_with('|') {
            let indent = at;
            let block: Vec<&str> = lines[i + 1..].iter().take_while(|l| l.len() - l.trim_start().len() > indent).map(|l| l.trim()).collect();
            out.push(block.join(" "));
        } else {
            out.push(value.to_owned());
        }
    }
    out
}

#[tokio::test]
async fn dashboard_and_alert_metrics_exist_on_a_live_server() {
    let deploy = root().join("deploy");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(deploy.join("grafana/tessera-dashboard.json")).unwrap()).unwrap();
    let mut exprs: Vec<String> = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().to_owned());
        }
    }
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = var["definition"].as_str() {
            // label_values(METRIC, label)
            exprs.push(q.trim_start_matches("label_values(").split(',').next().unwrap().to_owned());
        }
    }
    let panels = exprs.len();
    assert!(panels >= 14, "{exprs:?}");
    exprs.extend(rule_exprs(&std::fs::read_to_string(deploy.join("prometheus/tessera-rules.yaml")).unwrap()));
    assert!(exprs.len() >= panels + 7, "{exprs:?}");
    // The autoscalers' queue metric.
    let hpa = std::fs::read_to_string(deploy.join("kubernetes/base/hpa.yaml")).unwrap();
    exprs.extend(hpa.lines().filter_map(|l| l.trim().strip_prefix("name: tessera_")).map(|n| format!("tessera_{n}")));
    let keda = std::fs::read_to_string(deploy.join("kubernetes/keda/scaledobject.yaml")).unwrap();
    exprs.extend(keda.lines().filter_map(|l| l.trim().strip_prefix("query: ")).map(str::to_owned));

    let s = shared();
    // Every labelled family appears once a request has finished.
    s.complete(json!({"prompt": "Hello", "max_tokens": 2})).await;
    let text = s.metrics().await;
    let exported: BTreeSet<&str> =
        text.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
    let mut checked = BTreeSet::new();
    for e in &exprs {
        let names = metric_names(e);
        assert!(!names.is_empty(), "no metric in {e:?}");
        for n in names {
            assert!(exported.contains(n.as_str()), "{n} (in {e:?}) is not on /metrics");
            checked.insert(n);
        }
    }
    assert!(checked.len() >= 15, "{checked:?}");
    assert!(checked.contains("vllm:num_requests_waiting") && checked.contains("tessera_kv_cache_bytes_per_token"), "{checked:?}");
}
