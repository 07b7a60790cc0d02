//! Generation control, memory, limits and the API key (TP 2): every route needs the key,
//! upload limits, malformed bodies, pause (retract, in place), abort by rid, release and
//! resume.

use std::time::Duration;

use serde_json::{json, Value};

use crate::bits::*;
use crate::checkpoint::models;
use crate::client;
use crate::server::Server;

#[test]
fn pause_abort_release_and_limits() {
    let m = models();
    let key = "rl-secret";
    let s = Server::start(
        2,
        &m.a,
        &[
            "--api-key",
            key,
            "--max-weight-upload-bytes",
            "200000",
            "--max-body-bytes",
            "65536",
        ],
        "ctl",
    );
    // Every route needs the key.
    for (method, path) in [
        ("POST", "/update_weights_from_disk"),
        ("POST", "/update_weights_from_tensor"),
        ("POST", "/init_weights_update_group"),
        ("POST", "/update_weights_from_distributed"),
        ("POST", "/destroy_weights_update_group"),
        ("GET", "/get_weight_version"),
        ("POST", "/pause_generation"),
        ("POST", "/continue_generation"),
        ("POST", "/abort_request"),
        ("POST", "/release_memory_occupation"),
        ("POST", "/resume_memory_occupation"),
        ("POST", "/flush_cache"),
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/reset_prefix_cache"),
    ] {
        let r = client::request(&s.addr, method, path, Some("{}"), &[]).expect("request");
        assert_eq!(r.status, 401, "{method} {path} without the key: {}", r.body);
    }
    assert_serves(&s, "0");

    // Uploads above --max-weight-upload-bytes: 413, nothing staged.
    let big: Vec<&String> = m
        .c_tensors
        .names()
        .into_iter()
        .filter(|n| m.c_tensors.0[*n].2.len() > 80_000)
        .take(3)
        .collect();
    let over = m.c_tensors.image(&big);
    assert!(over.len() > 200_000 && over.len() < 400_000);
    let (st, v) = s.push("commit=true", &over);
    assert_eq!(st, 413, "{v}");
    // Parts below it work (a 1.6 MB checkpoint in parts of < 200 KB), larger than the
    // JSON routes' --max-body-bytes.
    let parts = m.c_tensors.parts_below(200_000);
    assert!(parts.len() > 8 && parts.iter().all(|p| p.len() <= 200_000));
    assert!(parts.iter().any(|p| p.len() > 65536));
    for p in &parts {
        let (st, v) = s.push("commit=false", p);
        assert_eq!(st, 200, "{v}");
    }
    let (st, v) = s.push("discard=true", &[]);
    assert_eq!(st, 200, "{v}");
    let (st, v) = s.push("commit=true", &[]);
    assert_eq!(st, 400, "discarded, so nothing to commit: {v}");
    // Malformed bodies.
    let (st, v) = s.post(
        "/update_weights_from_disk",
        &json!({"model_path": m.b, "policy": "later"}),
    );
    assert_eq!(st, 400, "{v}");
    let (st, v) = s.post("/update_weights_from_disk", &json!({"path": m.b}));
    assert_eq!(st, 422, "{v}");
    let (st, v) = s.post("/pause_generation", &json!({"mode": "sometimes"}));
    assert_eq!(st, 400, "{v}");
    // The trainer's store by address: nobody listens there, refused after timeout_s.
    let nobody = crate::cli_support::free_port();
    let (st, v) = s.post(
        "/init_weights_update_group",
        &json!({"master_address": "127.0.0.1", "master_port": nobody, "rank_offset": 1, "world_size": 3, "group_name": "g", "timeout_s": 1}),
    );
    assert_eq!(st, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .expect("message")
            .contains(&format!("cannot reach the TCPStore at 127.0.0.1:{nobody}")),
        "{v}"
    );
    // On CPU ranks a NCCL group cannot form: refused by every rank, nothing changes.
    let (st, v) = s.post(
        "/init_weights_update_group",
        &json!({"unique_id": "00".repeat(128), "rank_offset": 1, "world_size": 3, "group_name": "g", "backend": "nccl"}),
    );
    assert_eq!(st, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .expect("message")
            .contains("--device cuda"),
        "{v}"
    );
    let (st, v) = s.post(
        "/update_weights_from_distributed",
        &json!({"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[64]], "group_name": "g"}),
    );
    assert_eq!(st, 409, "{v}");

    // Pause (retract) holds new requests; an update applies; continue runs them on B.
    let v = s.ok("/pause_generation", &json!({"mode": "retract"}));
    assert_eq!(v["success"], true);
    let (resps, _) = std::thread::scope(|scope| {
        let hs: Vec<_> = probes()
            .into_iter()
            .map(|b| {
                let addr = s.addr.clone();
                scope.spawn(move || {
                    let r = client::request(
                        &addr,
                        "POST",
                        "/v1/completions",
                        Some(&b.to_string()),
                        &[("Authorization", "Bearer rl-secret")],
                    )
                    .expect("completion");
                    assert_eq!(r.status, 200, "{}", r.body);
                    serde_json::from_str::<Value>(&r.body).expect("JSON")
                })
            })
            .collect();
        let (st, h) = s.call("GET", "/health", None);
        assert_eq!((st, &h["paused"]), (200, &json!(true)), "{h}");
        std::thread::sleep(Duration::from_millis(300));
        let u = s.ok(
            "/update_weights_from_disk",
            &json!({"model_path": m.b, "weight_version": "B"}),
        );
        assert_eq!(u["weight_version"], "B");
        s.ok("/continue_generation", &json!({}));
        (
            hs.into_iter()
                .map(|h| h.join().expect("client"))
                .collect::<Vec<_>>(),
            u,
        )
    });
    for (i, r) in resps.iter().enumerate() {
        let (v, _) = check(r, i, |v| probe_refs(v, i));
        assert_eq!(v, "B", "queued during the pause, run after the update");
    }

    // Pause in place holds a started request: an update that would wait is refused;
    // continue finishes it on the weights it started on.
    let long = load("long").swap_remove(0);
    let tokens0 = s.metric("arbor_generation_tokens_total");
    std::thread::scope(|scope| {
        let addr = s.addr.clone();
        let body = long.to_string();
        let h = scope.spawn(move || {
            let r = client::request(
                &addr,
                "POST",
                "/v1/completions",
                Some(&body),
                &[("Authorization", "Bearer rl-secret")],
            )
            .expect("completion");
            serde_json::from_str::<Value>(&r.body).expect("JSON")
        });
        while s.metric("arbor_generation_tokens_total") < tokens0 + 2.0 {
            std::thread::sleep(Duration::from_millis(2));
        }
        s.ok("/pause_generation", &json!({"mode": "in_place"}));
        let (st, v) = s.post("/update_weights_from_disk", &json!({"model_path": m.a}));
        assert_eq!(st, 409, "{v}");
        assert!(
            v["message"]
                .as_str()
                .expect("message")
                .contains("held in place"),
            "{v}"
        );
        let (st, v) = s.post("/release_memory_occupation", &json!({}));
        assert_eq!(st, 409, "release while a request holds the KV: {v}");
        s.ok("/continue_generation", &json!({}));
        let r = h.join().expect("client");
        let (v, aborted) = check(&r, 0, |v| load_refs(v, 0));
        assert_eq!((v.as_str(), aborted), ("B", false));
    });

    // Abort one request by its rid: it ends with what it had, a prefix of B's bits.
    let tokens0 = s.metric("arbor_generation_tokens_total");
    std::thread::scope(|scope| {
        let addr = s.addr.clone();
        let body = long.to_string();
        let h = scope.spawn(move || {
            let r = client::request(
                &addr,
                "POST",
                "/v1/completions",
                Some(&body),
                &[("Authorization", "Bearer rl-secret")],
            )
            .expect("completion");
            serde_json::from_str::<Value>(&r.body).expect("JSON")
        });
        while s.metric("arbor_generation_tokens_total") < tokens0 + 2.0 {
            std::thread::sleep(Duration::from_millis(2));
        }
        let v = s.ok("/abort_request", &json!({"rid": "long-0"}));
        assert_eq!(v["aborted"], 1, "{v}");
        let r = h.join().expect("client");
        assert_eq!(r["id"], "long-0");
        let (v, aborted) = check(&r, 0, |v| load_refs(v, 0));
        assert_eq!((v.as_str(), aborted), ("B", true));
    });

    // Release: generation gets 503 until resume; resume reads the weights again.
    s.ok("/release_memory_occupation", &json!({}));
    let (st, v) = s.post("/v1/completions", &probes()[0]);
    assert_eq!(st, 503, "{v}");
    assert_eq!(v["error"]["code"], "memory_released", "{v}");
    let (_, v) = s.call("GET", "/is_sleeping", None);
    assert_eq!(v["is_sleeping"], true);
    s.ok("/resume_memory_occupation", &json!({}));
    assert_serves(&s, "B");
    // vLLM's names, and a resume from another checkpoint (new weights: a new version).
    s.ok("/sleep", &json!({}));
    let (_, v) = s.call("GET", "/is_sleeping", None);
    assert_eq!(v["is_sleeping"], true);
    let v = s.ok(
        "/resume_memory_occupation",
        &json!({"model_path": m.a, "weight_version": "A"}),
    );
    assert_eq!(v["weight_version"], "A");
    assert_serves(&s, "A");
    s.ok("/flush_cache", &json!({}));
    s.ok("/reset_prefix_cache", &json!({}));
    // The version in /health and /metrics.
    let (_, h) = s.call("GET", "/health", None);
    assert_eq!(h["weight_version"], "A");
    let r = client::get(&s.addr, "/metrics").expect("metrics");
    assert!(
        r.body
            .contains("arbor_weight_version_info{version=\"A\"} 1"),
        "{}",
        r.body
    );
}
