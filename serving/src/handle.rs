//! The front end's side of the serving loop: a [`ServingHandle`] submits requests and
//! control operations; each request's events come back on its [`RequestStream`], each
//! operation's reply as a [`PendingReply`].

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use arbor_model::batching::SeqSpec;
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot};

use crate::msg::{ControlOp, ControlReply, Refusal, RefusalKind, SeqEvent};

/// The loop has stopped (drained, failed, or dropped): it takes nothing more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the engine has stopped")]
pub struct Stopped;

/// A request: its choices run as sequences, all on one weight version.
#[derive(Debug, Clone)]
pub struct Submission {
    /// The request's id (`rid`): what [`ControlOp::Abort`] names.
    pub rid: String,
    /// One per choice; a choice's index is its tag in the events.
    pub choices: Vec<SeqSpec>,
    /// Events the stream holds unread before the loop gives up on it: a consumer that
    /// falls that far behind (a streaming client that does not read) has its sequences
    /// cancelled and their KV freed, never waited for. At least 1.
    pub backlog: usize,
}

/// A cheap, cloneable handle on a serving loop ([`crate::Leader`]).
#[derive(Clone)]
pub struct ServingHandle {
    tx: std::sync::mpsc::Sender<Cmd>,
}

impl ServingHandle {
    pub(crate) fn new(tx: std::sync::mpsc::Sender<Cmd>) -> Self {
        ServingHandle { tx }
    }

    /// Queues every choice of `sub`; its events (all choices, tagged by index) come on
    /// the returned stream. Dropping the stream cancels the request at the next step.
    pub fn submit(&self, sub: Submission) -> Result<RequestStream, Stopped> {
        let (events, rx) = mpsc::channel(sub.backlog.max(1));
        let cancels: Vec<Arc<AtomicBool>> = (0..sub.choices.len())
            .map(|_| Arc::new(AtomicBool::new(false)))
            .collect();
        let choices = sub
            .choices
            .into_iter()
            .zip(&cancels)
            .map(|(spec, cancel)| SubmitChoice {
                spec,
                cancel: cancel.clone(),
            })
            .collect();
        let req = Request {
            rid: sub.rid,
            choices,
            events,
        };
        self.tx.send(Cmd::Submit(req)).map_err(|_| Stopped)?;
        Ok(RequestStream { rx, cancels })
    }

    /// Sends `op` to the loop; it runs between two steps. Await the reply, or `wait` for it
    /// on a thread outside an async runtime.
    pub fn control(&self, op: ControlOp) -> PendingReply {
        let (reply, rx) = oneshot::channel();
        match self.tx.send(Cmd::Control { op, reply }) {
            Ok(()) => PendingReply(Some(rx)),
            Err(_) => PendingReply(None),
        }
    }

    /// Stops taking work: new requests and operations are refused, what runs finishes
    /// (up to [`crate::ServeConfig::drain_timeout`]), then the loop ends.
    pub fn drain(&self) -> Result<(), Stopped> {
        self.tx.send(Cmd::Drain).map_err(|_| Stopped)
    }
}

/// The reply to a control operation, once the loop has run it (an update with policy
/// `wait` answers when it applies).
pub struct PendingReply(Option<oneshot::Receiver<ControlReply>>);

fn stopped() -> Refusal {
    Refusal::new(RefusalKind::Unavailable, Stopped.to_string())
}

fn gone(_: oneshot::error::RecvError) -> ControlReply {
    Err(Refusal::new(
        RefusalKind::Unavailable,
        "the engine stopped before answering",
    ))
}

impl PendingReply {
    /// Blocks this thread until the reply comes (not for use inside an async runtime).
    pub fn wait(self) -> ControlReply {
        match self.0 {
            None => Err(stopped()),
            Some(rx) => rx.blocking_recv().unwrap_or_else(gone),
        }
    }
}

impl Future for PendingReply {
    type Output = ControlReply;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<ControlReply> {
        match self.0.as_mut() {
            None => Poll::Ready(Err(stopped())),
            Some(rx) => Pin::new(rx).poll(cx).map(|r| r.unwrap_or_else(gone)),
        }
    }
}

/// The events of one request's choices, in the order the loop sent them, and a cancel
/// flag per choice.
pub struct RequestStream {
    rx: mpsc::Receiver<(usize, Delivery)>,
    cancels: Vec<Arc<AtomicBool>>,
}

impl RequestStream {
    /// The next event and the choice it is for; `None` once the loop holds none of the
    /// request's sequences any more (every choice ended, was cancelled, or the loop
    /// stopped).
    pub async fn next(&mut self) -> Option<(usize, SeqEvent)> {
        let d = self.rx.recv().await?;
        Some(self.open(d))
    }

    /// `next` for a thread outside an async runtime.
    pub fn blocking_next(&mut self) -> Option<(usize, SeqEvent)> {
        let d = self.rx.blocking_recv()?;
        Some(self.open(d))
    }

    /// An event that has arrived, if any; `Err(Disconnected)` as `next` gives `None`.
    pub fn try_next(&mut self) -> Result<(usize, SeqEvent), TryRecvError> {
        let d = self.rx.try_recv()?;
        Ok(self.open(d))
    }

    /// Stops choice `choice` at the loop's next step (a stop string matched). Out of
    /// range: nothing.
    pub fn cancel(&self, choice: usize) {
        if let Some(c) = self.cancels.get(choice) {
            c.store(true, Ordering::SeqCst);
        }
    }

    /// Whether choice `choice` is cancelled: by `cancel`, or by the loop because this
    /// stream fell more than its backlog behind.
    pub fn is_cancelled(&self, choice: usize) -> bool {
        self.cancels
            .get(choice)
            .is_some_and(|c| c.load(Ordering::SeqCst))
    }

    /// How many choices the request has.
    pub fn choices(&self) -> usize {
        self.cancels.len()
    }

    fn open(&mut self, (tag, d): (usize, Delivery)) -> (usize, SeqEvent) {
        match d {
            Delivery::Event(ev) => (tag, ev),
            Delivery::Restart(cancel) => {
                if let Some(c) = self.cancels.get_mut(tag) {
                    *c = cancel;
                }
                (tag, SeqEvent::Restart)
            }
        }
    }
}

/// From a handle to the loop.
pub(crate) enum Cmd {
    Submit(Request),
    /// Finish what runs (up to the drain timeout), then stop.
    Drain,
    Control {
        op: ControlOp,
        reply: oneshot::Sender<ControlReply>,
    },
}

/// What travels on a request's event channel.
pub(crate) enum Delivery {
    Event(SeqEvent),
    /// The choice runs again from its prompt, with this cancel flag.
    Restart(Arc<AtomicBool>),
}

pub(crate) type EventTx = mpsc::Sender<(usize, Delivery)>;

/// A request as the loop holds it.
pub(crate) struct Request {
    pub(crate) rid: String,
    pub(crate) choices: Vec<SubmitChoice>,
    pub(crate) events: EventTx,
}

pub(crate) struct SubmitChoice {
    pub(crate) spec: SeqSpec,
    /// Set by the consumer to stop the sequence; set by the loop when it cancelled the
    /// sequence because an event could not be delivered.
    pub(crate) cancel: Arc<AtomicBool>,
}

impl Request {
    /// Tells every choice it will not run (`shutting_down`: the loop is draining or has
    /// stopped).
    pub(crate) fn refuse(&self, shutting_down: bool, msg: &str) {
        refuse_choices(&self.events, self.choices.len(), shutting_down, msg);
    }

    /// Tells every choice it was aborted before it ran.
    pub(crate) fn abort(&self, weight_version: &Arc<str>) {
        for tag in 0..self.choices.len() {
            let _ = self.events.try_send((
                tag,
                Delivery::Event(SeqEvent::Aborted {
                    weight_version: weight_version.clone(),
                }),
            ));
        }
    }
}

/// Tells choices `0..n` of a request they will not run.
pub(crate) fn refuse_choices(events: &EventTx, n: usize, shutting_down: bool, msg: &str) {
    for tag in 0..n {
        let _ = events.try_send((
            tag,
            Delivery::Event(SeqEvent::Refused {
                shutting_down,
                msg: msg.to_string(),
            }),
        ));
    }
}
