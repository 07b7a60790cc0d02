//! What goes wrong around the loop: a rank that fails a command or dies, a consumer that
//! does not read or leaves, a drain, every handle dropped.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::fake::{disk_weights, tokens, Gate, START};
use super::*;

#[test]
fn at_tp2_both_ranks_run_every_step_and_command() {
    let s = Server::start_tp2(config(), Gate::open());
    let mut a = s.submit(request("a", 0, 2, 9, 5));
    let w = disk_weights(START);
    assert_eq!(
        collect(&mut a),
        vec![
            finished("0", tokens(w, 0, 9, 5)),
            finished("0", tokens(w, 1, 9, 5))
        ]
    );
    let body = ok(s.control(from_disk("/fake/b", Policy::Wait, None)));
    assert_eq!(body["weight_version"], "1");
    let mut b = s.submit(request("b", 0, 1, 9, 5));
    assert_eq!(
        collect(&mut b),
        vec![finished("1", tokens(disk_weights("/fake/b"), 0, 9, 5))]
    );
    // Draining ends both ranks cleanly (the follower gets Shutdown).
    s.stop().unwrap();
}

#[test]
fn a_command_that_fails_on_one_rank_is_refused_on_every_rank() {
    let s = Server::start_tp2(config(), Gate::open());
    let (_, follower_faults) = s.follower.as_ref().unwrap();
    follower_faults.fail_prepare("truncated safetensors");
    let (kind, msg) = refused(s.control(from_disk("/fake/b", Policy::Wait, None)));
    assert_eq!(kind, RefusalKind::Input);
    assert!(
        msg.starts_with("rank 1: config <fake>: truncated safetensors; nothing changed"),
        "{msg}"
    );
    // Nothing changed: the old weights serve on.
    *follower_faults.prepare.lock().unwrap() = None;
    let mut a = s.submit(request("a", 0, 1, 4, 3));
    assert_eq!(
        collect(&mut a),
        vec![finished("0", tokens(disk_weights(START), 0, 4, 3))]
    );
    s.stop().unwrap();
}

#[test]
fn a_rank_that_dies_ends_every_request_with_the_reason() {
    let s = Server::start_tp2(config(), Gate::open());
    let (_, follower_faults) = s.follower.as_ref().unwrap();
    // Rank 1 fails in its third step and is gone; rank 0 finds out in that step's
    // collective or at its next broadcast.
    follower_faults.fail_step(2);
    let mut a = s.submit(request("a", 0, 2, 4, 50));
    let mut b = s.submit(request("b", 5, 1, 4, 50));
    for out in [collect(&mut a), collect(&mut b)] {
        for c in &out {
            match &c.end {
                Some(End::Refused {
                    shutting_down: true,
                    msg,
                }) => assert!(
                    msg.starts_with("the server stopped: ") && msg.contains("peer rank 1"),
                    "{msg}"
                ),
                other => panic!("{other:?}"),
            }
        }
    }
    let Server {
        handle,
        thread,
        follower,
        ..
    } = s;
    let (follower, _) = follower.unwrap();
    let e = join(follower).unwrap_err();
    assert!(e.to_string().contains("rank 1: executing step 2"), "{e}");
    let e = join(thread).unwrap_err();
    assert!(
        matches!(e, ServeError::Collective { .. } | ServeError::Model { .. }),
        "{e:?}"
    );
    // The loop is gone: the handle says so instead of waiting.
    assert!(handle.submit(request("c", 0, 1, 4, 1)).is_err());
    let (kind, _) = refused(handle.control(ControlOp::FlushCache).wait());
    assert_eq!(kind, RefusalKind::Unavailable);
}

#[test]
fn a_failed_step_on_rank_0_answers_what_waits() {
    let s = Server::start(config(), Gate::closed());
    s.faults.fail_step(1);
    let mut a = s.submit(request("a", 0, 1, 4, 9));
    s.step_and_hold();
    // Queued behind the failing step: answered too, never left waiting.
    let flush = s.handle.control(ControlOp::FlushCache);
    s.gate.open_all();
    let out = collect(&mut a);
    assert!(
        matches!(&out[0].end, Some(End::Refused { shutting_down: true, msg }) if msg.contains("rank 0: executing step 1: rank 0 died at step 1")),
        "{out:?}"
    );
    let (kind, msg) = refused(flush.wait());
    assert_eq!(kind, RefusalKind::Unavailable);
    assert!(msg.starts_with("the server stopped: "), "{msg}");
    assert!(matches!(s.stop(), Err(ServeError::Model { .. })));
}

#[test]
fn a_stream_nobody_reads_is_cancelled_and_its_kv_freed() {
    let s = Server::start(config(), Gate::open());
    let w = disk_weights(START);
    let mut sub = request("slow", 0, 1, 4, 200);
    sub.backlog = 4;
    let mut slow = s.submit(sub);
    wait_until("the unread stream to be cancelled", || {
        s.stats.cancelled.load(Ordering::Relaxed) == 1
    });
    wait_until("its KV to come back", || {
        s.stats.running.load(Ordering::Relaxed) == 0
            && s.stats.kv_blocks_used.load(Ordering::Relaxed) == 0
    });
    assert!(slow.is_cancelled(0));
    // What fit in the backlog arrives in order, then the stream ends unfinished.
    assert!(matches!(
        slow.blocking_next(),
        Some((0, SeqEvent::Started { .. }))
    ));
    for t in tokens(w, 0, 4, 3) {
        assert!(matches!(slow.blocking_next(), Some((0, SeqEvent::Token(r))) if r.token == t));
    }
    assert!(slow.blocking_next().is_none());
    // The loop goes on serving others.
    let mut a = s.submit(request("a", 1, 1, 4, 3));
    assert_eq!(collect(&mut a), vec![finished("0", tokens(w, 1, 4, 3))]);
    s.stop().unwrap();
}

#[test]
fn a_dropped_stream_or_a_cancel_stops_its_sequence() {
    let s = Server::start(config(), Gate::closed());
    let gone = s.submit(request("gone", 0, 1, 4, 100));
    let mut stop = s.submit(request("stop", 1, 2, 4, 100));
    s.step_and_hold();
    drop(gone);
    stop.cancel(1);
    s.gate.open_all();
    wait_until("both to be freed", || {
        s.stats.cancelled.load(Ordering::Relaxed) == 2
    });
    // Choice 0 of "stop" runs on.
    let out = collect(&mut stop);
    assert_eq!(
        out[0],
        finished("0", tokens(disk_weights(START), 1, 4, 100))
    );
    assert!(out[1].end.is_none() && stop.is_cancelled(1));
    s.stop().unwrap();
}

#[test]
fn a_drain_lets_running_requests_finish_and_refuses_new_work() {
    let s = Server::start(config(), Gate::closed());
    let mut a = s.submit(request("a", 0, 1, 4, 6));
    s.step_and_hold();
    s.handle.drain().unwrap();
    let mut late = s.submit(request("late", 1, 1, 4, 6));
    let flush = s.handle.control(ControlOp::FlushCache);
    s.gate.open_all();
    assert_eq!(
        collect(&mut late)[0].end,
        Some(End::Refused {
            shutting_down: true,
            msg: "the server is shutting down".into()
        })
    );
    assert_eq!(refused(flush.wait()).0, RefusalKind::Unavailable);
    assert_eq!(
        collect(&mut a),
        vec![finished("0", tokens(disk_weights(START), 0, 4, 6))]
    );
    // Drained: the loop ends by itself, with every handle still alive.
    join(s.thread).unwrap();
    assert!(s.handle.submit(request("after", 0, 1, 4, 1)).is_err());
}

#[test]
fn a_drain_timeout_cancels_what_still_runs() {
    let cfg = ServeConfig {
        drain_timeout: Duration::ZERO,
        ..config()
    };
    let s = Server::start(cfg, Gate::closed());
    let mut a = s.submit(request("a", 0, 1, 4, 50));
    s.step_and_hold();
    s.handle.drain().unwrap();
    s.gate.open_all();
    let out = collect(&mut a);
    assert_eq!(
        out[0].end,
        Some(End::Refused {
            shutting_down: true,
            msg: "cancelled: the server is shutting down".into()
        })
    );
    assert_eq!(out[0].tokens.len(), 2);
    join(s.thread).unwrap();
}

#[test]
fn dropping_every_handle_stops_the_loop() {
    let s = Server::start(config(), Gate::open());
    let h2 = s.handle.clone();
    drop(s.handle);
    std::thread::sleep(Duration::from_millis(30));
    assert!(!s.thread.is_finished(), "a clone still drives it");
    drop(h2);
    join(s.thread).unwrap();
}
