//! Copies a rank's stdout/stderr to ours, one whole line at a time, prefixed with the
//! rank, so that lines of different ranks never interleave mid-line.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

/// A line longer than this is passed on in pieces (progress bars without newlines).
const MAX_LINE: usize = 64 << 10;
/// Lines of a hidden rank's stderr kept to show when it fails.
pub const TAIL_LINES: usize = 20;

/// The last lines of a stream whose output is not shown.
pub type Tail = Arc<Mutex<VecDeque<Vec<u8>>>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Where one child stream goes.
pub struct Pump {
    pub stream: Stream,
    /// Written before every line (e.g. "[rank 2] "); empty for none.
    pub prefix: Vec<u8>,
    /// Hidden streams are drained (so the child never blocks) and only tailed.
    pub show: bool,
    pub tail: Option<Tail>,
}

impl Pump {
    /// Copies `from` until end of stream on a new thread; sends `()` on `done` at the end.
    pub fn spawn(self, from: impl Read + Send + 'static, done: Sender<()>) -> std::io::Result<()> {
        std::thread::Builder::new()
            .name("arbor-launch-output".into())
            .spawn(move || {
                self.run(from);
                let _ = done.send(());
            })
            .map(|_| ())
    }

    fn run(&self, from: impl Read) {
        let mut r = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            let (found, used) = match r.fill_buf() {
                Ok([]) => break,
                Ok(buf) => {
                    let room = MAX_LINE - line.len();
                    match buf.iter().take(room).position(|&b| b == b'\n') {
                        Some(i) => {
                            line.extend_from_slice(&buf[..=i]);
                            (true, i + 1)
                        }
                        None => {
                            let n = buf.len().min(room);
                            line.extend_from_slice(&buf[..n]);
                            (line.len() >= MAX_LINE, n)
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            r.consume(used);
            if found {
                self.emit(&line);
                line.clear();
            }
        }
        if !line.is_empty() {
            self.emit(&line);
        }
    }

    fn emit(&self, line: &[u8]) {
        if let Some(tail) = &self.tail {
            let mut t = match tail.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            if t.len() == TAIL_LINES {
                t.pop_front();
            }
            t.push_back(line.to_vec());
        }
        if !self.show {
            return;
        }
        let mut buf = Vec::with_capacity(self.prefix.len() + line.len() + 1);
        buf.extend_from_slice(&self.prefix);
        buf.extend_from_slice(line);
        if !line.ends_with(b"\n") {
            buf.push(b'\n');
        }
        // A closed stdout (e.g. `| head`) must not stop the draining, so errors are ignored.
        let _ = match self.stream {
            Stream::Stdout => {
                let mut o = std::io::stdout().lock();
                o.write_all(&buf).and_then(|_| o.flush())
            }
            Stream::Stderr => {
                let mut o = std::io::stderr().lock();
                o.write_all(&buf).and_then(|_| o.flush())
            }
        };
    }
}
