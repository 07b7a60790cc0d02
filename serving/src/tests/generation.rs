//! Requests through the handle; pause, continue and abort; memory released and resumed.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::fake::{disk_weights, tokens, Gate, START};
use super::*;

#[test]
fn requests_stream_their_tokens_and_free_their_kv() {
    let s = Server::start(config(), Gate::open());
    let w = disk_weights(START);
    let mut a = s.submit(request("a", 0, 2, 5, 7));
    let mut b = s.submit(request("b", 10, 1, 70, 3));
    assert_eq!(
        collect(&mut a),
        vec![
            finished("0", tokens(w, 0, 5, 7)),
            finished("0", tokens(w, 1, 5, 7))
        ]
    );
    assert_eq!(collect(&mut b), vec![finished("0", tokens(w, 10, 70, 3))]);
    // Every choice ended: the loop let go of the streams.
    assert!(a.blocking_next().is_none() && b.blocking_next().is_none());
    wait_until("the KV to come back", || {
        s.stats.kv_blocks_used.load(Ordering::Relaxed) == 0
    });
    assert_eq!(s.stats.running.load(Ordering::Relaxed), 0);
    assert_eq!(s.stats.generated_tokens.load(Ordering::Relaxed), 17);
    s.stop().unwrap();
}

#[test]
fn a_request_the_scheduler_refuses_is_refused_whole() {
    let s = Server::start(config(), Gate::open());
    // Past the context (1024 positions): every choice is refused, none runs.
    let mut r = s.submit(request("long", 0, 2, 1000, 100));
    let out = collect(&mut r);
    for c in &out {
        assert!(
            matches!(&c.end, Some(End::Refused { shutting_down: false, msg }) if msg.contains("context")),
            "{out:?}"
        );
    }
    s.stop().unwrap();
}

#[test]
fn pause_in_place_holds_requests_where_they_are_until_continue() {
    let s = Server::start(config(), Gate::closed());
    let w = disk_weights(START);
    let mut a = s.submit(request("a", 0, 1, 4, 6));
    s.step_and_hold();
    let pause = s
        .handle
        .control(ControlOp::Pause(crate::PauseMode::InPlace));
    s.gate.allow(1);
    let body = ok(pause.wait());
    assert_eq!(
        (body["aborted"].as_u64(), body["retracted"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(s.stats.paused.load(Ordering::Relaxed));
    // Paused: no step runs, though the gate is open.
    s.gate.open_all();
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(s.gate.passed(), 2);
    // An update that would wait for the held request could never apply; releasing memory
    // under it neither.
    let (kind, msg) = refused(s.control(from_disk("/fake/b", Policy::Wait, None)));
    assert_eq!(kind, RefusalKind::Conflict, "{msg}");
    assert!(msg.contains("held in place"), "{msg}");
    let (kind, _) = refused(s.control(ControlOp::Release {
        weights: true,
        kv: true,
    }));
    assert_eq!(kind, RefusalKind::Conflict);
    ok(s.control(ControlOp::Continue));
    assert!(!s.stats.paused.load(Ordering::Relaxed));
    // It goes on where it was, on the weights it started on.
    assert_eq!(collect(&mut a), vec![finished("0", tokens(w, 0, 4, 6))]);
    s.stop().unwrap();
}

#[test]
fn pause_abort_ends_requests_and_pause_retract_reruns_them_after_continue() {
    let s = Server::start(config(), Gate::closed());
    let w = disk_weights(START);
    let mut a = s.submit(request("a", 0, 2, 4, 6));
    s.step_and_hold();
    let pause = s.handle.control(ControlOp::Pause(crate::PauseMode::Abort));
    s.gate.allow(1);
    assert_eq!(ok(pause.wait())["aborted"], 1);
    // Aborted after two steps: the tokens they had, and the version they ran on.
    let aborted = Choice {
        version: Some("0".into()),
        tokens: tokens(w, 0, 4, 2),
        end: Some(End::Aborted("0".into())),
        restarts: 0,
    };
    let out = collect(&mut a);
    assert_eq!(out[0], aborted);
    assert_eq!(out[1].tokens, tokens(w, 1, 4, 2));
    ok(s.control(ControlOp::Continue));

    let mut b = s.submit(request("b", 5, 1, 4, 6));
    s.step_and_hold();
    let pause = s
        .handle
        .control(ControlOp::Pause(crate::PauseMode::Retract));
    s.gate.allow(1);
    assert_eq!(ok(pause.wait())["retracted"], 1);
    // Retracted: queued again from its prompt, and nothing runs while paused.
    assert!(matches!(
        b.blocking_next(),
        Some((0, SeqEvent::Started { .. }))
    ));
    assert!(matches!(b.blocking_next(), Some((0, SeqEvent::Token(_)))));
    assert!(matches!(b.blocking_next(), Some((0, SeqEvent::Token(_)))));
    assert_eq!(b.blocking_next(), Some((0, SeqEvent::Restart)));
    assert!(
        !b.is_cancelled(0),
        "a restarted choice has a fresh cancel flag"
    );
    s.gate.open_all();
    std::thread::sleep(Duration::from_millis(40));
    assert_eq!(s.gate.passed(), 4);
    ok(s.control(ControlOp::Continue));
    assert_eq!(collect(&mut b), vec![finished("0", tokens(w, 5, 4, 6))]);
    s.stop().unwrap();
}

#[test]
fn abort_by_rid_ends_only_that_request() {
    let s = Server::start(config(), Gate::closed());
    let w = disk_weights(START);
    let mut a = s.submit(request("a", 0, 1, 4, 5));
    let mut b = s.submit(request("b", 1, 1, 4, 5));
    s.step_and_hold();
    let abort = s.handle.control(ControlOp::Abort {
        rid: Some("b".into()),
    });
    let nobody = s.handle.control(ControlOp::Abort {
        rid: Some("nobody".into()),
    });
    s.gate.open_all();
    assert_eq!(ok(abort.wait())["aborted"], 1);
    assert_eq!(ok(nobody.wait())["aborted"], 0);
    assert_eq!(collect(&mut a), vec![finished("0", tokens(w, 0, 4, 5))]);
    let b = collect(&mut b);
    assert_eq!(b[0].end, Some(End::Aborted("0".into())));
    assert_eq!(b[0].tokens, tokens(w, 1, 4, 2));
    wait_until("the aborted sequence to be counted", || {
        s.stats.cancelled.load(Ordering::Relaxed) == 1
    });
    s.stop().unwrap();
}

#[test]
fn released_memory_holds_requests_until_it_is_resumed() {
    let s = Server::start(config(), Gate::open());
    let start = disk_weights(START);
    let body = ok(s.control(ControlOp::Release {
        weights: true,
        kv: true,
    }));
    assert_eq!(body["message"], "released: weights kv_cache");
    assert!(s.stats.released.load(Ordering::Relaxed));
    // Queued, not run, while the memory is released.
    let mut a = s.submit(request("a", 0, 1, 4, 3));
    wait_until("the request to be queued", || {
        s.stats.waiting.load(Ordering::Relaxed) == 1
    });
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(s.gate.passed(), 0);
    // Read again from where the weights came from: the same version.
    let body = ok(s.control(ControlOp::Resume {
        weights: true,
        kv: true,
        from: None,
        version: None,
    }));
    assert_eq!(body["weight_version"], "0");
    assert!(!s.stats.released.load(Ordering::Relaxed));
    assert_eq!(collect(&mut a), vec![finished("0", tokens(start, 0, 4, 3))]);

    // A model_path only reloads released weights.
    let (kind, _) = refused(s.control(ControlOp::Resume {
        weights: true,
        kv: true,
        from: Some(PathBuf::from("/fake/other")),
        version: None,
    }));
    assert_eq!(kind, RefusalKind::Conflict);
    // Weights resumed from another checkpoint are a new version.
    ok(s.control(ControlOp::Release {
        weights: true,
        kv: false,
    }));
    let body = ok(s.control(ControlOp::Resume {
        weights: true,
        kv: false,
        from: Some(PathBuf::from("/fake/other")),
        version: Some("other".into()),
    }));
    assert_eq!(body["weight_version"], "other");
    assert_eq!(s.stats.weight_version(), "other");
    let mut b = s.submit(request("b", 0, 1, 4, 3));
    assert_eq!(
        collect(&mut b),
        vec![finished(
            "other",
            tokens(disk_weights("/fake/other"), 0, 4, 3)
        )]
    );
    s.stop().unwrap();
}

#[test]
fn release_and_flush_are_refused_while_requests_run() {
    let s = Server::start(config(), Gate::closed());
    let mut a = s.submit(request("a", 0, 1, 4, 4));
    s.step_and_hold();
    let release = s.handle.control(ControlOp::Release {
        weights: false,
        kv: true,
    });
    let flush = s.handle.control(ControlOp::FlushCache);
    s.gate.open_all();
    let (kind, msg) = refused(release.wait());
    assert_eq!(kind, RefusalKind::Conflict);
    assert!(msg.contains("1 requests are running"), "{msg}");
    assert_eq!(refused(flush.wait()).0, RefusalKind::Conflict);
    assert!(!s.stats.released.load(Ordering::Relaxed));
    collect(&mut a);
    // Nothing runs now: both apply.
    ok(s.control(ControlOp::FlushCache));
    ok(s.control(ControlOp::Release {
        weights: false,
        kv: true,
    }));
    assert!(s.stats.released.load(Ordering::Relaxed));
    s.stop().unwrap();
}

#[test]
fn a_version_is_renamed_only_when_no_request_runs() {
    let s = Server::start(config(), Gate::closed());
    let w = disk_weights(START);
    let mut a = s.submit(request("a", 0, 1, 4, 6));
    s.step_and_hold();
    // A started request reports one version: renaming under it is refused.
    let rename = s.handle.control(ControlOp::SetVersion {
        version: "step-1".into(),
        abort_all: false,
    });
    s.gate.allow(1);
    let (kind, msg) = refused(rename.wait());
    assert_eq!(kind, RefusalKind::Conflict, "{msg}");
    s.gate.open_all();
    assert_eq!(collect(&mut a), vec![finished("0", tokens(w, 0, 4, 6))]);
    let body = ok(s.control(ControlOp::SetVersion {
        version: "step-1".into(),
        abort_all: false,
    }));
    assert_eq!(
        (
            body["weight_version"].as_str(),
            body["previous_weight_version"].as_str()
        ),
        (Some("step-1"), Some("0"))
    );
    assert_eq!(s.stats.weight_version(), "step-1");
    // The same weights under the new name.
    let mut b = s.submit(request("b", 0, 1, 4, 6));
    assert_eq!(
        collect(&mut b),
        vec![finished("step-1", tokens(w, 0, 4, 6))]
    );
    s.stop().unwrap();
}
