//! A minimal blocking HTTP/1.1 client over loopback TCP (one request per connection), for
//! `arbor bench serve` and the end-to-end tests: JSON requests and SSE streams.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

pub struct HttpResponse {
    pub status: u16,
    pub body: String,
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Sends one request; returns the status and a reader of the (de-chunked) body.
fn send(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> io::Result<(u16, Box<dyn BufRead>)> {
    let body = body.map(|b| (b.as_bytes(), "application/json"));
    send_bytes(addr, method, path, body, headers)
}

/// `send` with a body of any content type.
fn send_bytes(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<(&[u8], &str)>,
    headers: &[(&str, &str)],
) -> io::Result<(u16, Box<dyn BufRead>)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(300)))?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some((b, ctype)) = body {
        req.push_str(&format!(
            "Content-Type: {ctype}\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    if let Some((b, _)) = body {
        // A server that refuses a body (413) answers and closes before reading it all:
        // its answer is still there to read.
        if let Err(e) = s.write_all(b) {
            if !matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ) {
                return Err(e);
            }
        }
    }
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad(format!("bad status line {line:?}")))?;
    let mut chunked = false;
    let mut length = None;
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            length = v.trim().parse::<u64>().ok();
        }
        if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            chunked = true;
        }
    }
    let body: Box<dyn BufRead> = match (chunked, length) {
        (true, _) => Box::new(BufReader::new(Chunked {
            inner: r,
            left: 0,
            done: false,
        })),
        (false, Some(n)) => Box::new(BufReader::new(r.take(n))),
        (false, None) => Box::new(r),
    };
    Ok((status, body))
}

/// De-chunks a `Transfer-Encoding: chunked` body as it arrives.
struct Chunked<R: BufRead> {
    inner: R,
    left: usize,
    done: bool,
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            self.inner.read_line(&mut line)?;
            if line == "\r\n" {
                line.clear();
                self.inner.read_line(&mut line)?;
            }
            let size = line.trim().split(';').next().unwrap_or("");
            self.left = usize::from_str_radix(size, 16)
                .map_err(|_| bad(format!("bad chunk size {line:?}")))?;
            if self.left == 0 {
                self.done = true;
                return Ok(0);
            }
        }
        let n = buf.len().min(self.left);
        let got = self.inner.read(&mut buf[..n])?;
        if got == 0 {
            return Err(bad("connection closed inside a chunk"));
        }
        self.left -= got;
        Ok(got)
    }
}

pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> io::Result<HttpResponse> {
    let (status, mut r) = send(addr, method, path, body, headers)?;
    let mut text = String::new();
    r.read_to_string(&mut text)?;
    Ok(HttpResponse { status, body: text })
}

/// A request whose body is `body` bytes of `content_type` (a safetensors push; the
/// end-to-end tests use it).
#[allow(dead_code)]
pub fn request_bytes(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
    content_type: &str,
    headers: &[(&str, &str)],
) -> io::Result<HttpResponse> {
    let (status, mut r) = send_bytes(addr, method, path, Some((body, content_type)), headers)?;
    let mut text = String::new();
    r.read_to_string(&mut text)?;
    Ok(HttpResponse { status, body: text })
}

pub fn get(addr: &str, path: &str) -> io::Result<HttpResponse> {
    request(addr, "GET", path, None, &[])
}

/// POSTs and reads a server-sent-event stream: `on_data` gets each event's `data` as it
/// arrives and returns false to hang up early. Returns the status (and the body, if it
/// was not an event stream).
pub fn post_sse(
    addr: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
    mut on_data: impl FnMut(&str) -> bool,
) -> io::Result<HttpResponse> {
    let (status, mut r) = send(addr, "POST", path, Some(body), headers)?;
    if status != 200 {
        let mut text = String::new();
        r.read_to_string(&mut text)?;
        return Ok(HttpResponse { status, body: text });
    }
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        if let Some(data) = line.trim_end().strip_prefix("data: ") {
            if !on_data(data) {
                break;
            }
        }
    }
    Ok(HttpResponse {
        status,
        body: String::new(),
    })
}
