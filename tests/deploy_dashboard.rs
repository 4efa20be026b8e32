//! Every metric the Grafana dashboard queries is one a running `serve` really exports.

mod common;
use common::*;

#[test]
fn dashboard_queries_only_exported_metrics() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/decode-node.json");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    exprs.push(
        dash["templating"]["list"][1]["query"]
            .as_str()
            .unwrap()
            .to_string(),
    );
    let s = Served::start(&[]);
    let text = s.metrics_text();
    let exported: std::collections::HashSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let mut checked = 0;
    for e in &exprs {
        for (i, _) in e.match_indices("decode_node_") {
            let name: String = e[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            assert!(
                exported.contains(name.as_str()),
                "dashboard queries {name}, which /metrics does not export"
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 15,
        "the dashboard queries the metrics ({checked} references)"
    );
}
