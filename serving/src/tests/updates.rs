//! Weight updates arriving while requests run: each policy of docs/rl.md, a failed update,
//! one that waits too long, and a push in parts.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::fake::{disk_weights, pushed_weights, tokens, Gate, FAKE_MODEL_TENSORS, START};
use super::*;

#[test]
fn an_update_with_policy_wait_lets_started_requests_finish_on_the_old_weights() {
    let s = Server::start(config(), Gate::closed());
    let (old, new) = (disk_weights(START), disk_weights("/fake/b"));
    let mut a = s.submit(request("a", 0, 2, 4, 6));
    s.step_and_hold();
    // Taken after step 2: `a` has started, so the update waits for it, and what arrives
    // meanwhile waits too, to run on the new weights.
    let update = s
        .handle
        .control(from_disk("/fake/b", Policy::Wait, Some("step-1")));
    let mut b = s.submit(request("b", 7, 1, 4, 3));
    let second = s.handle.control(from_disk("/fake/c", Policy::Wait, None));
    s.gate.open_all();
    let (kind, msg) = refused(second.wait());
    assert_eq!(kind, RefusalKind::Conflict, "{msg}");
    assert_eq!(
        collect(&mut a),
        vec![
            finished("0", tokens(old, 0, 4, 6)),
            finished("0", tokens(old, 1, 4, 6))
        ]
    );
    let body = ok(update.wait());
    assert_eq!(body["weight_version"], "step-1");
    assert_eq!(body["previous_weight_version"], "0");
    assert_eq!(
        (body["aborted"].as_u64(), body["retracted"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(body["waited_seconds"].as_f64().unwrap() > 0.0, "{body}");
    assert_eq!(
        collect(&mut b),
        vec![finished("step-1", tokens(new, 7, 4, 3))]
    );
    assert_eq!(s.stats.weight_version(), "step-1");
    assert_eq!(s.stats.weight_updates.load(Ordering::Relaxed), 1);
    s.stop().unwrap();
}

#[test]
fn an_update_with_policy_retract_reruns_started_requests_on_the_new_weights() {
    let s = Server::start(config(), Gate::closed());
    let new = disk_weights("/fake/b");
    let mut a = s.submit(request("a", 0, 2, 4, 6));
    s.step_and_hold();
    let update = s
        .handle
        .control(from_disk("/fake/b", Policy::Retract, None));
    s.gate.open_all();
    let body = ok(update.wait());
    // No version given: the number of updates so far.
    assert_eq!(body["weight_version"], "1");
    assert_eq!(body["retracted"], 1);
    let out = collect(&mut a);
    for (key, c) in out.iter().enumerate() {
        assert_eq!(c.restarts, 1, "{out:?}");
        assert_eq!(
            c,
            &Choice {
                restarts: 1,
                ..finished("1", tokens(new, key as u64, 4, 6))
            }
        );
    }
    s.stop().unwrap();
}

#[test]
fn an_update_with_policy_abort_ends_every_request_with_the_tokens_it_had() {
    let cfg = ServeConfig {
        scheduler: SchedulerConfig {
            max_running: 1,
            ..config().scheduler
        },
        ..config()
    };
    let s = Server::start(cfg, Gate::closed());
    let old = disk_weights(START);
    let mut a = s.submit(request("a", 0, 1, 4, 6));
    // Queued behind `a` (one running sequence at most): not started.
    let mut c = s.submit(request("c", 3, 1, 4, 6));
    s.step_and_hold();
    let update = s
        .handle
        .control(from_disk("/fake/b", Policy::Abort, Some("v2")));
    s.gate.allow(1);
    let body = ok(update.wait());
    assert_eq!(
        (body["aborted"].as_u64(), body["weight_version"].as_str()),
        (Some(2), Some("v2"))
    );
    let a = collect(&mut a);
    assert_eq!(
        a[0],
        Choice {
            version: Some("0".into()),
            tokens: tokens(old, 0, 4, 2),
            end: Some(End::Aborted("0".into())),
            restarts: 0,
        }
    );
    let c = collect(&mut c);
    assert_eq!(c[0].end, Some(End::Aborted("0".into())));
    assert!(c[0].tokens.is_empty());
    s.stop().unwrap();
}

#[test]
fn an_update_that_waits_too_long_is_refused_and_changes_nothing() {
    let cfg = ServeConfig {
        update_wait: Duration::from_millis(30),
        ..config()
    };
    let s = Server::start(cfg, Gate::closed());
    let old = disk_weights(START);
    let mut a = s.submit(request("a", 0, 1, 4, 8));
    s.step_and_hold();
    let update = s.handle.control(from_disk("/fake/b", Policy::Wait, None));
    let mut b = s.submit(request("b", 1, 1, 4, 2));
    // Step 2 ends, the update starts waiting; step 3 ends after its limit.
    s.step_and_hold();
    std::thread::sleep(Duration::from_millis(60));
    s.gate.open_all();
    let (kind, msg) = refused(update.wait());
    assert_eq!(kind, RefusalKind::Unavailable, "{msg}");
    assert!(
        msg.contains("timed out") && msg.contains("nothing changed"),
        "{msg}"
    );
    // The held request runs after all, on the weights that still serve.
    assert_eq!(collect(&mut a), vec![finished("0", tokens(old, 0, 4, 8))]);
    assert_eq!(collect(&mut b), vec![finished("0", tokens(old, 1, 4, 2))]);
    assert_eq!(s.stats.weight_version(), "0");
    s.stop().unwrap();
}

#[test]
fn a_failed_update_changes_nothing() {
    let s = Server::start(config(), Gate::open());
    s.faults.fail_prepare("no config.json here");
    let (kind, msg) = refused(s.control(from_disk("/fake/missing", Policy::Wait, None)));
    assert_eq!(kind, RefusalKind::Input);
    assert!(
        msg.contains("no config.json here")
            && msg.contains("nothing changed: version 0 keeps serving"),
        "{msg}"
    );
    *s.faults.prepare.lock().unwrap() = None;
    let mut a = s.submit(request("a", 0, 1, 4, 3));
    assert_eq!(
        collect(&mut a),
        vec![finished("0", tokens(disk_weights(START), 0, 4, 3))]
    );
    assert_eq!(s.stats.weight_updates.load(Ordering::Relaxed), 0);
    s.stop().unwrap();
}

#[test]
fn a_push_in_parts_applies_at_its_commit() {
    let s = Server::start(config(), Gate::open());
    let (p1, p2) = (b"first part".to_vec(), b"second".to_vec());
    let body = ok(s.control(ControlOp::Stage {
        bytes: p1.clone(),
        commit: Commit::No,
    }));
    assert_eq!(body["staged_tensors"], 1);
    // A disk update would mix with the staged part.
    let (kind, msg) = refused(s.control(from_disk("/fake/b", Policy::Wait, None)));
    assert_eq!(kind, RefusalKind::Conflict, "{msg}");
    let body = ok(s.control(ControlOp::Stage {
        bytes: p2.clone(),
        commit: Commit::Now(UpdateReq {
            version: Some("pushed".into()),
            policy: Policy::Wait,
        }),
    }));
    assert_eq!(body["weight_version"], "pushed");
    let mut a = s.submit(request("a", 0, 1, 4, 3));
    let w = pushed_weights(&[&p1, &p2]);
    assert_eq!(
        collect(&mut a),
        vec![finished("pushed", tokens(w, 0, 4, 3))]
    );
    // The commit used what was staged.
    let (kind, msg) = refused(s.control(ControlOp::Commit(UpdateReq {
        version: None,
        policy: Policy::Wait,
    })));
    assert_eq!(kind, RefusalKind::Input, "{msg}");
    // Staged, then dropped.
    ok(s.control(ControlOp::Stage {
        bytes: p1,
        commit: Commit::No,
    }));
    ok(s.control(ControlOp::Discard));
    ok(s.control(from_disk("/fake/b", Policy::Wait, None)));
    s.stop().unwrap();
}

#[test]
fn buckets_without_a_commit_apply_once_every_tensor_is_staged() {
    let s = Server::start(config(), Gate::open());
    let parts: Vec<Vec<u8>> = (0..FAKE_MODEL_TENSORS)
        .map(|i| format!("bucket {i}").into_bytes())
        .collect();
    let when_complete = || {
        Commit::WhenComplete(UpdateReq {
            version: Some("buckets".into()),
            policy: Policy::Wait,
        })
    };
    for (i, p) in parts[..FAKE_MODEL_TENSORS - 1].iter().enumerate() {
        let body = ok(s.control(ControlOp::Stage {
            bytes: p.clone(),
            commit: when_complete(),
        }));
        assert_eq!(body["staged_tensors"], i + 1, "{body}");
        assert_eq!(body["model_tensors"], FAKE_MODEL_TENSORS, "{body}");
        assert_eq!(s.stats.weight_updates.load(Ordering::Relaxed), 0);
    }
    // Generation continued meanwhile says what is staged and not applied.
    let body = ok(s.control(ControlOp::Continue));
    assert_eq!(body["staged_tensors"], FAKE_MODEL_TENSORS - 1, "{body}");
    let mut a = s.submit(request("a", 0, 1, 4, 3));
    assert_eq!(
        collect(&mut a),
        vec![finished("0", tokens(disk_weights(START), 0, 4, 3))]
    );
    let body = ok(s.control(ControlOp::Stage {
        bytes: parts[FAKE_MODEL_TENSORS - 1].clone(),
        commit: when_complete(),
    }));
    assert_eq!(body["weight_version"], "buckets", "{body}");
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let mut b = s.submit(request("b", 0, 1, 4, 3));
    assert_eq!(
        collect(&mut b),
        vec![finished("buckets", tokens(pushed_weights(&refs), 0, 4, 3))]
    );
    s.stop().unwrap();
}

#[test]
fn staged_tensors_nobody_commits_are_dropped() {
    let cfg = ServeConfig {
        upload_idle: Duration::from_millis(20),
        ..config()
    };
    let s = Server::start(cfg, Gate::open());
    ok(s.control(ControlOp::Stage {
        bytes: b"part".to_vec(),
        commit: Commit::No,
    }));
    // The idle loop looks at the clock every tick (20 ms here).
    std::thread::sleep(Duration::from_millis(300));
    let (kind, msg) = refused(s.control(ControlOp::Commit(UpdateReq {
        version: None,
        policy: Policy::Wait,
    })));
    assert_eq!(kind, RefusalKind::Input);
    assert!(msg.contains("nothing is staged"), "{msg}");
    s.stop().unwrap();
}
